"""What users of `pdsim plan` ran into: GB200 launch commands treating the NVL72 rack as one
host, a bottleneck blamed on KV memory where DeepEP's dispatch cap binds, `pdsim check` passing
a plan `pdsim plan` refuses for want of a price, a progress line promising more simulations than
ran, and a bar that stood still through a long candidate."""

from __future__ import annotations

import io
import shlex

import pandas as pd
import pytest
import yaml
from rich.console import Console
from rich.progress import Progress
from typer.testing import CliRunner

from pdsim import progress
from pdsim.cli import app
from pdsim.config import ConfigError
from pdsim.planning import load_plan, parse_plan, plan
from pdsim.planning.bottleneck import find_bottleneck
from pdsim.planning.candidates import Candidate, RoleShape
from pdsim.planning.launch import sglang_commands
from pdsim.planning.search import _simulated_note, request_cap_words
from pdsim.pools import open_pool
from pdsim.specs.hardware import load_hardware_spec

# Llama-3.1-8B, 40 short requests: each candidate simulates in well under a second.
TINY = {
    "name": "tiny",
    "model": "llama-3.1-8b",
    "hardware": "h100",
    "workload": {"num_requests": 40, "seed": 0, "arrival": {"process": "poisson", "rate_rps": 4},
                 "input_len": {"dist": "fixed", "value": 256},
                 "output_len": {"dist": "fixed", "value": 16}},
    "slo": {"ttft_p90_s": 5.0, "itl_p90_s": 0.5},
    "max_gpus": 2,
    "search": {"modes": ["colocated"], "tp": [1, 2], "cost_slack": 0},
}


def _argv(line: str) -> dict[str, str]:
    """A server command's flags and their values (a bare flag: "")."""
    words, flags = shlex.split(line), {}
    for i, word in enumerate(words):
        if word.startswith("--"):
            following = words[i + 1] if i + 1 < len(words) else "--"
            flags[word] = "" if following.startswith("--") else following
    return flags


# --------------------------------------------------------------------------------------------
# Hosts, not the NVLink domain


def test_a_gb200_host_is_a_four_gpu_compute_tray_of_the_72_gpu_domain():
    gb200, h100 = load_hardware_spec("gb200"), load_hardware_spec("h100")
    assert (gb200.gpus_per_node, gb200.host_gpus) == (72, 4)
    assert load_hardware_spec("gb300").host_gpus == 4
    assert (h100.gpus_per_node, h100.host_gpus) == (8, 8)  # an HGX board: both
    assert load_hardware_spec({"base": "h100", "gpus_per_node": 4}).host_gpus == 4
    with pytest.raises(ValueError, match="gpus_per_host 4 does not divide"):
        load_hardware_spec({"base": "gb200", "gpus_per_node": 6})


def test_an_eight_gpu_instance_on_gb200_spans_two_trays():
    cfg = parse_plan({**TINY, "hardware": "gb200"})
    dep = Candidate("disaggregated", (("prefill", 2, RoleShape(8)), ("decode", 1, RoleShape(2))))
    servers = sglang_commands(dep, cfg, load_hardware_spec("gb200").host_gpus).servers
    prefill = [_argv(line) for what, line in servers if what.startswith("prefill")]
    assert len(prefill) == 4  # two instances, two hosts each
    assert all(a["--nnodes"] == "2" and "--base-gpu-id" not in a for a in prefill)
    assert sorted(a["--node-rank"] for a in prefill) == ["0", "0", "1", "1"]
    assert len({a["--host"] for a in prefill}) == 4
    (decode,) = [_argv(line) for what, line in servers if what.startswith("decode")]
    assert "--nnodes" not in decode


def test_the_plan_launches_gb200_instances_over_trays():
    result = plan(parse_plan({**TINY, "hardware": "gb200", "max_gpus": 8,
                              "search": {"modes": ["colocated"], "tp": [8]}}),
                  write=False, jobs=1)
    servers = [_argv(line) for _, line in result.recommended.launch.servers]
    assert [(a["--nnodes"], a["--node-rank"]) for a in servers] == [("2", "0"), ("2", "1")]


# --------------------------------------------------------------------------------------------
# The decode batch's cap named as such


def _row(batch: float) -> dict:
    return {"mode": "disaggregated", "decode_instances": 1, "decode_mean_batch": batch,
            "prefill_busy_frac": 0.3, "itl_p90_s": 0.02, "duration_s": 10.0,
            "kv_transfer_gb": 1.0}


_REQUESTS = pd.DataFrame({"status": ["ok"] * 3, "arrival_s": [0.0, 1.0, 2.0],
                          "prefill_end_s": [0.1, 1.1, 2.1], "transfer_done_s": [0.11, 1.11, 2.11],
                          "ttft_s": [0.12, 0.12, 0.12]})


def _bottleneck(batch: float, kv_batch: float, cap: float):
    return find_bottleneck(_row(batch), _REQUESTS, ttft_target_s=3.0,
                           latency_targets=[("itl", 90, 0.05)], decode_kv_batch=kv_batch,
                           decode_request_cap=cap, request_cap_why="the cap's source",
                           decode_nic_bytes_s=400e9)


def test_a_batch_held_by_the_request_cap_is_not_blamed_on_kv_memory():
    b = _bottleneck(batch=590.2, kv_batch=9_800, cap=1_024)
    assert b.name == "decode request cap"
    assert b.words.startswith("decode running requests 58% of their cap on average (mean batch "
                              "590.2 of 1,024: the cap's source); KV pools 6% full")
    b = _bottleneck(batch=590.2, kv_batch=800, cap=1_024)  # the pools fill first
    assert b.name == "decode memory"
    assert b.words.startswith("decode KV pools 74% full on average (mean batch 590.2 of the ~800")


def test_the_cap_names_deepeps_dispatch_limit_or_max_running_requests():
    deepep = RoleShape(8, 8, 8, "deepep")
    words = request_cap_words(deepep, 128, 8)
    assert words == ("128 per rank x 8 ranks, DeepEP low-latency dispatch's 128 tokens per rank, "
                     "SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK")
    tbo = RoleShape(8, 1, 8, "deepep", two_batch_overlap=True)
    assert "128 tokens per rank and micro-batch" in request_cap_words(tbo, 256, 1)
    assert request_cap_words(RoleShape(8), 48, 1) == "--max-running-requests"


def test_a_deepep_decode_in_a_plan_is_capped_at_its_dispatch_tokens():
    """The plan's bottleneck reads the cap off the decode role as built (128 a rank under
    DeepEP) and the KV pools apart."""
    from pdsim.planning.prefilter import Prefilter
    from pdsim.planning.search import _bottleneck as plan_bottleneck
    from pdsim.runner import PointResult
    from pdsim.specs.models import load_model_spec
    from pdsim.workload import generate

    cfg = parse_plan({**TINY, "model": "qwen3-30b-a3b", "max_gpus": 16,
                      "search": {"modes": ["disaggregated"], "tp": [8], "ep": [8],
                                 "moe_a2a": ["deepep"]}})
    hw = load_hardware_spec("h100")
    filt = Prefilter(cfg, load_model_spec(cfg.model), hw, generate(cfg.workload_data()))
    shape = RoleShape(8, 1, 8, "deepep")
    dep = Candidate("disaggregated", (("prefill", 1, shape), ("decode", 1, shape)))
    b = plan_bottleneck(cfg, dep, PointResult(0, _row(100.0), _REQUESTS), filt, hw)
    assert b.name == "decode request cap"
    assert "mean batch 100.0 of 128: DeepEP low-latency dispatch's 128 tokens" in b.words


# --------------------------------------------------------------------------------------------
# A plan without a price fails `pdsim check` as `pdsim plan` does


def test_check_refuses_a_plan_whose_hardware_has_no_price(tmp_path):
    path = tmp_path / "h20.yaml"
    path.write_text(yaml.safe_dump({**TINY, "hardware": "h20"}))
    with pytest.raises(ConfigError, match=r"hardware 'h20' has no list price; set "
                       r"usd_per_gpu_hour beside it in the plan .*presets with a list price: "
                       r"a10, a100, b200, gb200, h100, h200, l40s"):
        load_plan(path)
    result = CliRunner().invoke(app, ["check", str(path)])
    said = " ".join(result.output.split())  # unwrapped
    assert result.exit_code != 0 and "set usd_per_gpu_hour beside it" in said, said
    path.write_text(yaml.safe_dump({**TINY, "hardware": "h20", "usd_per_gpu_hour": 1.5}))
    result = CliRunner().invoke(app, ["check", str(path)])
    said = " ".join(result.output.split())
    assert result.exit_code == 0 and "valid plan, llama-3.1-8b on h20" in said, said


# --------------------------------------------------------------------------------------------
# Progress


def test_the_log_says_at_most_and_then_how_many_ran(monkeypatch):
    out = io.StringIO()
    monkeypatch.setattr(progress, "_stderr", lambda: Console(file=out, width=200))
    result = plan(parse_plan(TINY), write=False, jobs=1, progress=True)
    # 1x TP1 meets the SLO; with no cost slack the two 2-GPU candidates never run
    assert int(result.candidates["simulated"].sum()) == 1
    lines = out.getvalue().splitlines()
    assert "simulating tiny (at most 3, cheapest first)..." in lines
    assert ("simulated 1 of the 3 candidates past the pre-filter; not simulated: 2 cost over "
            "$2.95/h, (1 + search.cost_slack) x the cheapest that meets the SLO") in lines


def test_the_note_names_the_simulation_cap():
    assert _simulated_note(40, 75, 40, float("inf")) == (
        "simulated 40 of the 75 candidates past the pre-filter; not simulated: 35 past "
        "search.max_simulations (40)")


def _live_bar() -> tuple[progress.Bar, Progress]:
    bars = Progress(console=Console(file=io.StringIO(), force_terminal=True), auto_refresh=False)
    return progress.Bar(bars, bars.add_task("x", total=2)), bars


def test_a_bar_moves_within_the_items_in_flight_and_never_back():
    bar, bars = _live_bar()
    bar.within(0.4)
    assert bars.tasks[0].completed == 0.4
    bar.advance()  # the item done: its share leaves the sum, the bar stays put
    assert bars.tasks[0].completed == 1.0
    bar.within(0.0)
    bar.within(0.5)
    assert bars.tasks[0].completed == 1.5


def test_request_share_reports_finished_requests_and_defers_stopping():
    reports, seen = [], []

    class Check:
        def __call__(self, req):
            return "over" if req == 3 else ""

        def sent(self, req):
            seen.append(req)
            return ""

    share = progress.RequestShare(reports.append, 4, Check())
    share.sent(1)
    assert [share(r) for r in (1, 2, 3)] == ["", "", "over"] and seen == [1]
    assert reports == [0.25]  # then no more than one report per REPORT_S
    assert progress.RequestShare(reports.append, 4).sent(1) == ""  # no check: never stops


def _report_half(report) -> None:
    report(0.5)


def test_points_in_a_process_pool_report_their_share_to_the_bar():
    bar, bars = _live_bar()
    with open_pool("local", jobs=2, tasks=2) as pool, progress.point_shares(bar, pool) as shares:
        pool.submit(_report_half, shares.reporter(7)).result()
        shares.refresh([7])
        assert bars.tasks[0].completed == 0.5
        shares.refresh([])  # done: no longer in flight
        assert bars.tasks[0].completed == 0.5
    with open_pool("local", jobs=1) as pool, progress.point_shares(bar, pool) as shares:
        pool.submit(_report_half, shares.reporter(8)).result()  # run here: straight to the bar
        assert bars.tasks[0].completed == 0.5
    with open_pool("local", jobs=1) as pool, \
            progress.point_shares(progress.Bar(None, None), pool) as shares:
        assert shares is None  # no bar drawn: nothing to report to


def test_a_plans_candidate_moves_the_bar_as_its_requests_finish(monkeypatch):
    shares = []
    monkeypatch.setattr(progress, "_stderr", lambda: Console(file=io.StringIO(),
                                                             force_terminal=True))
    monkeypatch.setattr(progress.Bar, "within", lambda self, share: shares.append(share))
    plan(parse_plan({**TINY, "max_gpus": 1}), write=False, jobs=1, progress=True)
    assert any(0 < s < 1 for s in shares), shares
