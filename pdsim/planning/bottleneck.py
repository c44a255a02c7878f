"""Name what limits a simulated deployment, in words.

Each resource gets a *pressure*: 1 means it uses up its share of the SLO or of its capacity.
The bottleneck is the resource under the most pressure; the runner-up resource is named too:

- prefill compute: the prefill instances' busy fraction, or the 90th percentile of the time
  from a request's arrival to the end of its prefill over the TTFT target, whichever is larger
  (a disaggregated request waits in the bootstrap queue while its prefill instance runs a
  step, so that wait is prefill's);
- KV transfer: the 90th percentile of the time from the end of prefill to the KV arriving at
  decode, over the TTFT target;
- network: the KV bytes per second each decode instance receives over its NIC line rate;
- decode memory: the decode side's mean running batch over the batch its KV pools hold at the
  mean context;
- decode request cap: the same batch over the running requests the decode side admits at most
  (`--max-running-requests`, or under DeepEP the low-latency dispatch's tokens per rank), when
  that cap is below what the KV pools hold: the batch then stops there with the pools part full;
- decode compute: the ITL (or TPOT) percentile over its target, the larger.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

RESOURCES = ("prefill compute", "KV transfer", "network", "decode memory", "decode request cap",
             "decode compute")


@dataclass(frozen=True)
class Bottleneck:
    name: str  # one of RESOURCES
    pressure: float
    words: str  # the figures behind it, for the report


def _p90(values: pd.Series) -> float:
    values = values.to_numpy(float)
    values = values[np.isfinite(values)]
    return float(np.percentile(values, 90)) if len(values) else 0.0


def find_bottleneck(row: dict, requests: pd.DataFrame, *, ttft_target_s: float | None,
                    latency_targets: list[tuple[str, int, float]], decode_kv_batch: float,
                    decode_request_cap: float, request_cap_why: str,
                    decode_nic_bytes_s: float) -> Bottleneck:
    """`row`: the candidate's summary; `requests`: its per-request frame; `latency_targets`:
    the plan's (metric, percentile, bound) on ITL and TPOT; `decode_kv_batch`:
    requests the decode (or colocated) side's KV pools hold at the mean context, all instances;
    `decode_request_cap`: the running requests it admits at most, all instances, and
    `request_cap_why` what sets that cap; `decode_nic_bytes_s`: the NIC line rate of all decode
    instances together."""
    ok = requests[requests["status"] == "ok"]
    ttft = ttft_target_s or _p90(ok["ttft_s"]) or 1.0
    colocated = row["mode"] == "colocated"
    prefill_wait = _p90(ok["prefill_end_s"] - ok["arrival_s"])
    transfer = 0.0 if colocated else _p90(ok["transfer_done_s"] - ok["prefill_end_s"])
    busy = row.get("prefill_busy_frac", math.nan)
    busy = 0.0 if busy != busy else busy
    batch = row.get("decode_mean_batch", math.nan) * row["decode_instances"]
    kv_use = batch / decode_kv_batch if decode_kv_batch > 0 and batch == batch else 0.0
    cap_use = batch / decode_request_cap if decode_request_cap > 0 and batch == batch else 0.0
    duration = row.get("duration_s", math.nan)
    nic_use = (row.get("kv_transfer_gb", 0.0) * 1e9 / duration / decode_nic_bytes_s
               if not colocated and duration and duration == duration and decode_nic_bytes_s else 0.0)
    decode_use, decode_words = 0.0, f"ITL p90 {row.get('itl_p90_s', math.nan) * 1e3:,.1f} ms"
    for metric, q, bound in latency_targets:
        value = row.get(f"{metric}_p{q}_s", math.nan)
        if value == value and value / bound >= decode_use:
            decode_use = value / bound
            decode_words = (f"{metric.upper()} p{q} {value * 1e3:,.1f} ms of the "
                            f"{bound * 1e3:,.1f} ms target")
    ms = 1e3
    options = {
        "prefill compute": (max(busy, prefill_wait / ttft),
                            ("" if colocated else f"prefill busy {busy:.0%}; ")
                            + f"arrival to end of prefill p90 {prefill_wait * ms:,.0f} ms of "
                            f"the {ttft * ms:,.0f} ms TTFT target"),
        "KV transfer": (transfer / ttft, f"KV transfer p90 {transfer * ms:,.1f} ms of the "
                        f"{ttft * ms:,.0f} ms TTFT target"),
        "network": (nic_use, f"decode NICs {nic_use:.0%} used by KV traffic"),
        "decode memory": (kv_use, f"decode KV pools {kv_use:.0%} full on average (mean batch "
                          f"{batch:,.1f} of the ~{decode_kv_batch:,.0f} they hold at the mean "
                          "context)"),
        # Only where the cap, not memory, stops the batch: else it is the KV pools' figure.
        "decode request cap": (cap_use if decode_request_cap < decode_kv_batch else 0.0,
                               f"decode running requests {cap_use:.0%} of their cap on average "
                               f"(mean batch {batch:,.1f} of {decode_request_cap:,.0f}: "
                               f"{request_cap_why}); KV pools {kv_use:.0%} full"),
        "decode compute": (decode_use, decode_words),
    }
    first, second = sorted(options, key=lambda k: options[k][0], reverse=True)[:2]
    pressure, words = options[first]
    return Bottleneck(first, pressure, f"{words}; next: {second}, {options[second][1]}")
