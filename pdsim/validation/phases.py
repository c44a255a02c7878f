"""Where TTFT goes: the mean of each phase of a PD request, simulated and measured, side by side.

A disaggregated request passes these stamps in order (`RequestRecord`): arrival, bootstrap done
(prefill side; the request enters the prefill waiting queue at that step), prefill forward start
and end, KV landed (decode side), decode joined, first token. The phases between consecutive
stamps sum to TTFT, so the phase whose sim and real means differ most is the one that carries
most of the TTFT error.

The real backend's stamps live in three processes, each on its own clock: the client (the
replay), the prefill worker and the decode worker (their `/records`). `merge_worker_records`
moves the workers' stamps onto the client's clock.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import replace

import pandas as pd

from pdsim.core.records import RequestRecord

# (label, from stamp, to stamp): consecutive, so the means of those a request has sum to its TTFT.
PHASES = (
    ("arrival -> bootstrap done", "arrival_s", "bootstrap_done_s"),
    ("bootstrap -> prefill start", "bootstrap_done_s", "prefill_start_s"),
    ("prefill forward", "prefill_start_s", "prefill_end_s"),
    ("prefill end -> KV landed", "prefill_end_s", "transfer_done_s"),
    ("KV landed -> decode joined", "transfer_done_s", "decode_join_s"),
    ("decode joined -> first token", "decode_join_s", "first_token_s"),
)
PREFILL_STAMPS = ("bootstrap_done_s", "prefill_start_s", "prefill_end_s", "transfer_start_s")
DECODE_STAMPS = ("transfer_done_s", "decode_join_s")


def _mean(values: Iterable[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return sum(finite) / len(finite) if finite else math.nan


def phase_means(records: Sequence[RequestRecord]) -> dict[str, float]:
    """Per phase, its mean over the completed requests that have both its stamps (NaN when
    none has); also "TTFT" and "decode ITL" (every gap of every completed request pooled, as
    `summarize` counts it)."""
    done = [r for r in records if r.ok]
    out = {label: _mean(getattr(r, b) - getattr(r, a) for r in done) for label, a, b in PHASES}
    out["TTFT"] = _mean(r.ttft_s for r in done)
    out["decode ITL"] = _mean(b - a for r in done for a, b in zip(r.token_times_s,
                                                                  r.token_times_s[1:]))
    return out


def phase_table(real: Sequence[RequestRecord], sim: Sequence[RequestRecord]) -> pd.DataFrame:
    """One row per phase (then TTFT and decode ITL): real and sim means in seconds, their
    difference (sim − real) and `largest`: True on the phase with the largest absolute
    difference, the one that carries most of the TTFT error."""
    r, s = phase_means(real), phase_means(sim)
    table = pd.DataFrame({"phase": list(r), "real_s": list(r.values()),
                          "sim_s": [s[k] for k in r]})
    table["diff_s"] = table["sim_s"] - table["real_s"]
    is_phase = table["phase"].isin([label for label, _, _ in PHASES])
    gaps = table["diff_s"].abs().where(is_phase)
    table["largest"] = False
    if gaps.notna().any():
        table.loc[gaps.idxmax(), "largest"] = True
    return table


def largest_phase(table: pd.DataFrame) -> str | None:
    hit = table[table["largest"]]
    return None if hit.empty else str(hit["phase"].iloc[0])


def markdown(table: pd.DataFrame, title: str) -> str:
    lines = [f"### {title}", "", "| phase | real | sim | sim − real | |",
             "| --- | ---: | ---: | ---: | --- |"]

    def ms(v: float) -> str:
        return "–" if math.isnan(v) else f"{v * 1e3:.1f} ms"

    for row in table.itertuples():
        diff = "–" if math.isnan(row.diff_s) else f"{row.diff_s * 1e3:+.1f} ms"
        mark = "**largest**" if row.largest else ""
        lines.append(f"| {row.phase} | {ms(row.real_s)} | {ms(row.sim_s)} | {diff} | {mark} |")
    name = largest_phase(table)
    if name is not None:
        lines += ["", f"Sim and real part most in **{name}**."]
    return "\n".join(lines) + "\n"


def _clock_offset_s(client: dict[str, RequestRecord], rows: Sequence[dict]) -> float:
    """What to add to a worker's times to put them on the client's clock.

    A request reaches the worker some delay after the client sent it, never before, so
    `client arrival − worker arrival` is at most the offset for every request, and equal to it
    up to the smallest delivery delay (a few ms on loopback) for the fastest one: the maximum
    over the requests. One offset per worker, so queueing on the way stays in the phases.
    """
    return max(client[row["rid"]].arrival_s - row["arrival_s"] for row in rows)


def merge_worker_records(client: Sequence[RequestRecord], prefill: Sequence[Sequence[dict]],
                         decode: Sequence[Sequence[dict]]) -> list[RequestRecord]:
    """The client's records with the prefill side's stamps (bootstrap done, forward start and
    end, KV send start) and the decode side's (KV landed, joined) on the client's clock.
    `prefill` and `decode` hold one list per worker: its `/records` rows (NaN as None), each
    worker on its own clock. A request no worker reported keeps NaN there."""
    merged = {r.rid: r for r in client}
    for workers, stamps, instance in ((prefill, PREFILL_STAMPS, "prefill_instance"),
                                      (decode, DECODE_STAMPS, "decode_instance")):
        for rows in workers:
            rows = [row for row in rows if row["rid"] in merged]
            if not rows:
                continue
            offset = _clock_offset_s(merged, rows)
            for row in rows:
                fields = {k: math.nan if row.get(k) is None else row[k] + offset for k in stamps}
                merged[row["rid"]] = replace(merged[row["rid"]], **fields,
                                             **{instance: row[instance]})
    return [merged[r.rid] for r in client]
