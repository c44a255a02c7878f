"""`pdsim plan`: the pre-filter against full simulation, the recommendation against every
simulated candidate, the launch commands against SGLang's flags, the emitted experiment, the
CLI."""

from __future__ import annotations

import argparse
import json
import math
import shlex
import subprocess
import sys

import pandas as pd
import pytest
import yaml

from pdsim.config import ConfigError, load_experiment, parse_experiment
from pdsim.metrics import price_columns
from pdsim.planning import load_plan, meets, parse_plan, plan
from pdsim.planning.candidates import Candidate, RoleShape, enumerate_deployments
from pdsim.planning.launch import sglang_commands
from pdsim.planning.prefilter import Prefilter
from pdsim.planning.search import rank_feasible, pareto_frontier, tpot_percentiles
from pdsim.runner import run_experiment
from pdsim.specs.hardware import load_hardware_spec
from pdsim.specs.models import load_model_spec
from pdsim.workload import generate

# Whole plans: each module fixture simulates dozens of candidates (~20 s).
pytestmark = pytest.mark.slow

# Llama-3.1-8B on up to 4 H100s at 90 req/s: one prefill TP1 instance cannot keep up, a TP1
# decode step misses the 5.5 ms ITL target, and only a few 4-GPU deployments meet the SLO.
SMALL = {
    "name": "small_plan",
    "model": "llama-3.1-8b",
    "hardware": "h100",
    "workload": {"num_requests": 120, "seed": 0, "arrival": {"process": "poisson", "rate_rps": 90},
                 "input_len": {"dist": "lognormal", "mean": 1024, "cv": 0.5, "min": 64, "max": 4096},
                 "output_len": {"dist": "lognormal", "mean": 64, "cv": 0.5, "min": 8, "max": 256}},
    "slo": {"ttft_p90_s": 0.4, "itl_p90_s": 0.0055},
    "max_gpus": 4,
    "search": {"tp": [1, 2], "cost_slack": 0},
}


@pytest.fixture(scope="module")
def full():
    """Every candidate of the small grid simulated to the end (pre-filter and early stop off)."""
    cfg = parse_plan({**SMALL, "search": {**SMALL["search"], "early_stop": False}})
    return plan(cfg, prefilter=False, write=False, jobs=2)


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """The plan as written: its pre-filter and early stop on (the defaults)."""
    out = tmp_path_factory.mktemp("plan")
    return plan(parse_plan(SMALL), out_dir=out, jobs=2)


@pytest.mark.slow
def test_prefilter_never_discards_a_deployment_simulation_finds_feasible(full):
    cfg = parse_plan(SMALL)
    model, hw = load_model_spec(cfg.model), load_hardware_spec(cfg.hardware)
    deployments = enumerate_deployments(cfg, model, cfg.max_gpus)
    filt = Prefilter(cfg, model, hw, generate(cfg.workload_data()))
    verdicts = {d.label: filt.check(d) for d in deployments}
    table = full.candidates.set_index("label")
    assert table["simulated"].all() and len(table) == len(deployments) == 17
    discarded = [label for label, v in verdicts.items() if not v.keep]
    assert len(discarded) >= 8  # the filter does prune this grid ...
    assert table["feasible"].any()
    for label in discarded:  # ... and never a deployment that meets the SLO in simulation
        assert not table.loc[label, "feasible"], (label, verdicts[label].reason)
    reasons = {verdicts[label].reason.split(":")[0] for label in discarded}
    assert {"ITL floor", "prefill capacity"} <= reasons


@pytest.mark.slow
def test_recommendation_meets_the_slo_and_is_the_cheapest_that_does(full, planned):
    rec = planned.recommended
    assert rec is not None
    s = rec.summary
    assert s["ttft_p90_s"] <= 0.4 and s["itl_p90_s"] <= 0.0055 and s["failed"] == 0
    assert meets(planned.plan, s)
    feasible = full.feasible
    assert rec.summary["usd_per_hour"] <= feasible["usd_per_hour"].min()
    assert rec.deployment.label in set(feasible["label"])
    # The pre-filtered plan simulated fewer candidates and found the same answer.
    assert planned.candidates["simulated"].sum() < len(full.candidates)
    cheapest = feasible.sort_values(["usd_per_hour", "usd_per_mtok"]).iloc[0]
    assert rec.deployment.label == cheapest["label"]
    # $/Mtok: the hour's price over the output tokens served in it.
    assert rec.summary["usd_per_mtok"] == pytest.approx(
        s["num_gpus"] * 2.95 / 3600 / s["output_tok_s"] * 1e6)


def test_early_stop_ends_only_runs_that_miss_the_slo(full, planned):
    table = planned.candidates.set_index("label")
    whole = full.candidates.set_index("label")
    stopped = table[table["simulated"] & (table["stopped"].fillna("") != "")]
    assert len(stopped) >= 1  # this grid has candidates far over their targets
    for label, row in stopped.iterrows():
        assert not whole.loc[label, "feasible"], label  # simulated to the end: infeasible too
        assert not row["feasible"] and row["completed"] < whole.loc[label, "completed"]
        assert "over the" in row["stopped"] or "failed" in row["stopped"]
    ran = table[table["simulated"] & (table["stopped"].fillna("") == "")]
    for label, row in ran.iterrows():  # the runs that went to the end are unchanged
        assert row["ttft_p90_s"] == whole.loc[label, "ttft_p90_s"], label
    assert not set(planned.frontier["label"]) & set(stopped.index)


def test_goodput_objective_ranks_by_goodput_per_gpu(full):
    cfg = parse_plan({**SMALL, "objective": "goodput_per_gpu"})
    best = rank_feasible(cfg, full.candidates)[0]
    feasible = full.feasible
    top = feasible.loc[feasible["goodput_req_s_per_gpu"].idxmax(), "candidate"]
    assert best == top


def test_bottlenecks_name_the_limiting_resource(full):
    table = full.candidates.set_index("label")
    # One TP1 prefill instance at 90 req/s: TTFT p90 several times its target.
    assert table.loc["1P TP1 + 1D TP1", "ttft_p90_s"] > 2 * 0.4
    assert table.loc["1P TP1 + 1D TP1", "bottleneck"] == "prefill compute"
    # Two prefill instances keep up; the TP1 decode step is what misses the ITL target.
    assert table.loc["2P TP1 + 1D TP1", "ttft_p90_s"] < 0.4
    assert table.loc["2P TP1 + 1D TP1", "bottleneck"] == "decode compute"


def test_writes_report_frontier_plots_and_launch(planned):
    out = planned.out_dir
    for name in ("report.md", "frontier.csv", "candidates.csv", "frontier.png", "recommended.yaml",
                 "launch.sh"):
        assert (out / name).is_file(), name
    report = (out / "report.md").read_text()
    assert f"## Recommended: {planned.recommended.deployment.label}" in report
    assert "bottleneck:" in report and "sglang.launch_server" in report
    frontier = pd.read_csv(out / "frontier.csv")
    assert len(frontier) == len(planned.frontier) >= 1
    assert {"usd_per_mtok", "goodput_req_per_usd", "output_tok_s_per_gpu"} <= set(frontier.columns)
    assert load_plan(out / "plan.yaml") == planned.plan  # the plan as run, to run again


@pytest.mark.slow
def test_emitted_experiment_validates_and_reproduces_the_plan(planned, tmp_path):
    path = planned.out_dir / "recommended.yaml"
    cfg, _ = load_experiment(path)
    assert cfg.cluster.num_gpus == planned.recommended.deployment.num_gpus
    summary, _ = run_experiment(path, out_dir=tmp_path, jobs=1, progress=False)
    s = planned.recommended.summary
    for col in ("ttft_p90_s", "itl_p90_s", "output_tok_s", "completed", "usd_per_mtok",
                "goodput_req_per_usd"):  # pdsim run prices at the preset's $2.95, as the plan
        assert summary.loc[0, col] == pytest.approx(s[col], rel=1e-12), col


def test_written_plan_and_experiment_name_the_plans_files_from_anywhere(tmp_path, monkeypatch):
    """A model file named relative to the plan is written into results/ by its absolute path:
    plan.yaml and recommended.yaml load from another folder and name the same file."""
    plans = tmp_path / "plans"
    plans.mkdir()
    (plans / "my_llama.yaml").write_text("base: llama-3.1-8b\nname: my-llama\n")
    small = {**SMALL, "model": "my_llama.yaml", "max_gpus": 2,
             "workload": {**SMALL["workload"], "num_requests": 40},
             "slo": {"ttft_p90_s": 5.0, "itl_p90_s": 0.1}, "search": {"tp": [1]}}
    (plans / "plan.yaml").write_text(yaml.safe_dump(small))
    result = plan(plans / "plan.yaml", out_dir=tmp_path / "out", jobs=1)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    model_file = str((plans / "my_llama.yaml").resolve())
    written = load_plan(result.out_dir / "plan.yaml")
    assert written.model == model_file
    cfg, _ = load_experiment(result.out_dir / "recommended.yaml")
    assert cfg.model == model_file
    assert load_model_spec(cfg.model).name == "my-llama"


def test_pareto_frontier_drops_dominated_rows():
    table = pd.DataFrame({
        "simulated": [True] * 4,
        "output_tok_s_per_gpu": [100.0, 90.0, 120.0, 80.0],
        "ttft_p90_s": [1.0, 2.0, 3.0, 1.0],
        "itl_p90_s": [0.01, 0.02, 0.01, 0.005],
    })
    cfg = parse_plan(SMALL)
    front = pareto_frontier(table, cfg)
    # Row 1 is worse than row 0 on all three; the others each win somewhere.
    assert sorted(front.index) == [0, 2, 3]


# SGLang's flags as `python -m sglang.launch_server --help` and its PD-disaggregation guide
# (docs/advanced_features/pd_disaggregation.md) spell them, and sglang_router.launch_router's
# (`--prefill URL [BOOTSTRAP_PORT]`, repeated).
def _server_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sglang.launch_server", exit_on_error=False)
    p.add_argument("--model-path", required=True)
    p.add_argument("--host")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--tp-size", type=int, required=True)
    p.add_argument("--dp-size", type=int, default=1)
    p.add_argument("--enable-dp-attention", action="store_true")
    p.add_argument("--enable-dp-lm-head", action="store_true")
    p.add_argument("--ep-size", type=int, default=1)
    p.add_argument("--moe-a2a-backend", choices=["none", "deepep", "mooncake"])
    p.add_argument("--mem-fraction-static", type=float)
    p.add_argument("--max-running-requests", type=int)
    p.add_argument("--chunked-prefill-size", type=int)
    p.add_argument("--max-prefill-tokens", type=int)
    p.add_argument("--page-size", type=int)
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8_e5m2", "fp8_e4m3"])
    p.add_argument("--disaggregation-mode", choices=["null", "prefill", "decode"])
    p.add_argument("--disaggregation-transfer-backend", choices=["mooncake", "nixl", "ascend"])
    p.add_argument("--disaggregation-bootstrap-port", type=int)
    p.add_argument("--disaggregation-ib-device")
    p.add_argument("--num-reserved-decode-tokens", type=int)
    p.add_argument("--base-gpu-id", type=int, default=0)
    p.add_argument("--dist-init-addr")
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    return p


def _router_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sglang_router.launch_router", exit_on_error=False)
    p.add_argument("--pd-disaggregation", action="store_true")
    p.add_argument("--prefill", nargs="+", action="append", default=[])
    p.add_argument("--decode", action="append", default=[])
    p.add_argument("--worker-urls", nargs="+", default=[])
    p.add_argument("--policy", choices=["random", "round_robin", "cache_aware", "power_of_two"])
    p.add_argument("--cache-threshold", type=float)
    p.add_argument("--balance-abs-threshold", type=int)
    p.add_argument("--balance-rel-threshold", type=float)
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    return p


def _parse(parser, line: str, module: str):
    argv = shlex.split(line)
    assert argv[:3] == ["python", "-m", module]
    return parser.parse_args(argv[3:])


def test_generated_sglang_commands_parse_and_match_the_deployment():
    cfg = parse_plan({**SMALL, "model": "deepseek-v3", "hardware": "h200", "kv_dtype_bytes": 1,
                      "max_gpus": 64, "launch": {"model_path": "deepseek-ai/DeepSeek-V3"}})
    prefill = RoleShape(16, 8, 16, "deepep")  # two nodes per instance
    decode = RoleShape(8, 8, 8, "deepep")
    dep = Candidate("disaggregated", (("prefill", 2, prefill), ("decode", 3, decode)))
    cmds = sglang_commands(dep, cfg, gpus_per_node=8)
    servers = [_parse(_server_parser(), line, "sglang.launch_server") for _, line in cmds.servers]
    assert len(servers) == 2 * 2 + 3
    pre = [a for a in servers if a.disaggregation_mode == "prefill"]
    dec = [a for a in servers if a.disaggregation_mode == "decode"]
    assert all(a.tp_size == 16 and a.dp_size == 8 and a.enable_dp_attention and a.ep_size == 16
               and a.moe_a2a_backend == "deepep" and a.nnodes == 2 for a in pre)
    # DP attention with each rank's LM head on its own rows, as the simulated deployment has it
    assert all(a.enable_dp_lm_head for a in pre + dec)
    assert dep.experiment_data(cfg)["cluster"]["decode"]["dp_lm_head"] is True
    assert sorted(a.node_rank for a in pre) == [0, 0, 1, 1]
    assert all(a.tp_size == 8 and a.nnodes == 1 and a.kv_cache_dtype == "fp8_e4m3" for a in dec)
    assert {a.model_path for a in servers} == {"deepseek-ai/DeepSeek-V3"}
    router = _parse(_router_parser(), cmds.router, "sglang_router.launch_router")
    assert router.pd_disaggregation and len(router.prefill) == 2 and len(router.decode) == 3
    for url, port in router.prefill:  # each prefill URL with its instance's bootstrap port
        node0 = [a for a in pre if a.node_rank == 0 and url == f"http://{a.host}:{a.port}"]
        assert len(node0) == 1 and int(port) == node0[0].disaggregation_bootstrap_port
    assert sorted(router.decode) == sorted(f"http://{a.host}:{a.port}" for a in dec)


def test_instances_sharing_a_node_get_their_own_gpus_and_ports():
    cfg = parse_plan(SMALL)
    dep = Candidate("colocated", (("colocated", 6, RoleShape(2)),))
    cmds = sglang_commands(dep, cfg, gpus_per_node=8)
    servers = [_parse(_server_parser(), line, "sglang.launch_server") for _, line in cmds.servers]
    placed = {(a.host, a.base_gpu_id) for a in servers}
    assert placed == {("colocated-0", g) for g in (0, 2, 4, 6)} | {("colocated-1", g) for g in (0, 2)}
    assert len({(a.host, a.port) for a in servers}) == 6
    router = _parse(_router_parser(), cmds.router, "sglang_router.launch_router")
    assert not router.pd_disaggregation and len(router.worker_urls) == 6


def test_a_checkpoints_config_json_launches_from_its_directory(tmp_path):
    """SGLang's --model-path takes a checkpoint's directory (or an HF id), not its config.json;
    launch.model_path overrides it."""
    import json

    from pdsim.specs.servable import SERVABLE_HF_CONFIGS

    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps(SERVABLE_HF_CONFIGS["tiny-llama"]))
    dep = Candidate("colocated", (("colocated", 1, RoleShape(1)),))
    for launch, want in (({}, str(checkpoint)), ({"model_path": "org/Model"}, "org/Model")):
        cfg = parse_plan({**SMALL, "model": str(checkpoint / "config.json"), "launch": launch})
        (_, line), = sglang_commands(dep, cfg, gpus_per_node=8).servers
        assert _parse(_server_parser(), line, "sglang.launch_server").model_path == want


def test_a_preset_launches_from_its_hugging_face_repository():
    from pdsim.specs.models import PRESET_REPOS, model_preset_names
    from pdsim.specs.servable import SERVABLE_HF_CONFIGS

    assert set(PRESET_REPOS) == set(model_preset_names()) - set(SERVABLE_HF_CONFIGS)
    dep = Candidate("colocated", (("colocated", 1, RoleShape(1)),))
    cfg = parse_plan({**SMALL, "model": "llama-3.1-8b"})
    (_, line), = sglang_commands(dep, cfg, gpus_per_node=8).servers
    model_path = _parse(_server_parser(), line, "sglang.launch_server").model_path
    assert model_path == "meta-llama/Llama-3.1-8B-Instruct"


def test_the_router_line_carries_cache_aware_settings():
    cfg = parse_plan({**SMALL, "router": {"policy": "cache_aware", "policy_options": {
        "cache_threshold": 0.5, "balance_abs_threshold": 32, "max_tree_size": 4096}}})
    dep = Candidate("disaggregated", (("prefill", 1, RoleShape(1)), ("decode", 1, RoleShape(2))))
    router = _parse(_router_parser(), sglang_commands(dep, cfg, gpus_per_node=8).router,
                    "sglang_router.launch_router")
    assert (router.policy, router.cache_threshold, router.balance_abs_threshold) == ("cache_aware", 0.5, 32)
    assert router.balance_rel_threshold is None  # unset: sglang_router's own default


def test_plan_config_errors_name_the_field(tmp_path):
    with pytest.raises(ConfigError, match=r"search\.tpp: unknown key \(allowed: .*allow_tp_mismatch"):
        parse_plan({**SMALL, "search": {"tpp": [1]}})
    no_budget = {k: v for k, v in SMALL.items() if k != "max_gpus"}
    with pytest.raises(ConfigError, match="max_gpus.*target_rate_rps"):
        parse_plan(no_budget)
    with pytest.raises(ConfigError, match="slo: .*at least one target"):
        parse_plan({**SMALL, "slo": {}})
    closed = {**SMALL["workload"], "arrival": {"process": "closed", "concurrency": 8}}
    with pytest.raises(ConfigError, match="closed-loop"):
        parse_plan({**SMALL, "workload": closed, "target_rate_rps": 5})
    unpriced = tmp_path / "unpriced.yaml"
    unpriced.write_text(yaml.safe_dump({**SMALL, "hardware": "h20"}))
    with pytest.raises(ConfigError, match="usd_per_gpu_hour: hardware 'h20' has no list price"):
        plan(unpriced, write=False)


def test_traffic_target_sets_the_workload_rate():
    cfg = parse_plan({**SMALL, "target_rate_rps": 12.5})
    assert cfg.workload_data()["arrival"]["rate_rps"] == 12.5
    assert cfg.gpu_limit(8) == 4
    cfg = parse_plan({**{k: v for k, v in SMALL.items() if k != "max_gpus"}, "target_rate_rps": 3})
    assert cfg.gpu_limit(8) == 32  # no budget: up to four NVLink domains


def test_candidates_cover_modes_counts_and_tp_mismatch():
    cfg = parse_plan(SMALL)
    deps = enumerate_deployments(cfg, load_model_spec("llama-3.1-8b"), 4)
    labels = {d.label for d in deps}
    assert {"4x colocated TP1", "2x colocated TP2", "3P TP1 + 1D TP1", "2P TP1 + 1D TP2",
            "1P TP2 + 2D TP1"} <= labels
    assert all(d.num_gpus <= 4 for d in deps)
    same_tp = enumerate_deployments(parse_plan({**SMALL, "search": {"tp": [1, 2],
                                                                  "allow_tp_mismatch": False}}),
                                    load_model_spec("llama-3.1-8b"), 4)
    assert all(len({s.tp for _, _, s in d.roles}) == 1 for d in same_tp)
    # No attention split SGLang refuses: 32 query and 8 KV heads over 3 GPUs.
    odd = parse_plan({**SMALL, "search": {"tp": [1, 3]}})
    assert {s.tp for d in enumerate_deployments(odd, load_model_spec("llama-3.1-8b"), 4)
            for _, _, s in d.roles} == {1}
    # A dense model gets no EP or DeepEP shapes even when the search lists them.
    dense = parse_plan({**SMALL, "search": {"tp": [2], "ep": [1, 2], "moe_a2a": ["none", "deepep"]}})
    assert {s for d in enumerate_deployments(dense, load_model_spec("llama-3.1-8b"), 4)
            for _, _, s in d.roles} == {RoleShape(2)}


def test_two_batch_overlap_is_searched_on_deepep_shapes_only():
    moe = parse_plan({**SMALL, "model": "deepseek-v3", "hardware": "h200", "max_gpus": 16,
                      "search": {"tp": [8], "dp_attention": [8], "ep": [1, 8],
                                 "moe_a2a": ["none", "deepep"],
                                 "two_batch_overlap": [False, True]}})
    shapes = {s for d in enumerate_deployments(moe, load_model_spec("deepseek-v3"), 16)
              for _, _, s in d.roles}
    assert shapes == {RoleShape(8, 8), RoleShape(8, 8, 8), RoleShape(8, 8, 8, "deepep"),
                      RoleShape(8, 8, 8, "deepep", two_batch_overlap=True)}
    tbo = RoleShape(8, 8, 8, "deepep", two_batch_overlap=True)
    assert tbo.label == "TP8 DP8 EP8 deepep TBO"
    assert tbo.role_data(2, moe)["two_batch_overlap"] is True


def test_single_batch_overlap_is_searched_on_decode_deepep_shapes_without_tbo():
    moe = parse_plan({**SMALL, "model": "deepseek-v3", "hardware": "h200", "max_gpus": 16,
                      "search": {"modes": ["disaggregated"], "tp": [8], "dp_attention": [8],
                                 "ep": [8], "moe_a2a": ["deepep"],
                                 "two_batch_overlap": [False, True],
                                 "single_batch_overlap": [False, True]}})
    deps = enumerate_deployments(moe, load_model_spec("deepseek-v3"), 16)
    prefill = {s for d in deps for role, _, s in d.roles if role == "prefill"}
    decode = {s for d in deps for role, _, s in d.roles if role == "decode"}
    plain = RoleShape(8, 8, 8, "deepep")
    tbo = RoleShape(8, 8, 8, "deepep", two_batch_overlap=True)
    sbo = RoleShape(8, 8, 8, "deepep", single_batch_overlap=True)
    assert prefill == {plain, tbo} and decode == {plain, tbo, sbo}
    assert sbo.label == "TP8 DP8 EP8 deepep SBO"
    assert sbo.role_data(1, moe)["single_batch_overlap"] is True
    dep = Candidate("disaggregated", (("prefill", 1, plain), ("decode", 1, sbo)))
    parse_experiment(dep.experiment_data(moe))
    lines = [line for _, line in sglang_commands(dep, moe, gpus_per_node=8).servers]
    assert ["--enable-single-batch-overlap" in line for line in lines] == [False, True]


def test_dense_layers_per_gpu_are_searched_on_dp_attention_shapes_of_moe_models_with_them():
    def shapes(model: str) -> set[RoleShape]:
        plan = parse_plan({**SMALL, "model": model, "hardware": "h200", "max_gpus": 16,
                           "search": {"modes": ["colocated"], "tp": [8], "dp_attention": [1, 8],
                                      "ep": [8], "moe_dense_tp": [None, 1]}})
        return {s for d in enumerate_deployments(plan, load_model_spec(model), 16)
                for _, _, s in d.roles}

    dense = RoleShape(8, 8, 8, dense_dp=True)
    assert shapes("deepseek-v3") == {RoleShape(8, 1, 8), RoleShape(8, 8, 8), dense}
    assert shapes("qwen3-235b-a22b") == {RoleShape(8, 1, 8), RoleShape(8, 8, 8)}  # no dense layer
    moe = parse_plan({**SMALL, "model": "deepseek-v3", "hardware": "h200"})
    assert dense.label == "TP8 DP8 EP8 dense-TP1"
    assert parse_experiment(Candidate("colocated", (("colocated", 1, dense),)).experiment_data(
        moe)).cluster.colocated.moe_dense_tp == 1
    (_, line), = sglang_commands(Candidate("colocated", (("colocated", 1, dense),)), moe,
                                 gpus_per_node=8).servers
    assert "--moe-dense-tp-size 1" in line


def test_eplb_is_searched_where_the_experts_and_copies_split_evenly():
    def shapes(tp: int, eps: list[int], dp: int = 8) -> set[RoleShape]:
        moe = parse_plan({**SMALL, "model": "deepseek-v3", "hardware": "h200", "max_gpus": 24,
                          "search": {"tp": [tp], "dp_attention": [dp], "ep": eps,
                                     "eplb_redundant_experts": [None, 0, 32]}})
        return {s for d in enumerate_deployments(moe, load_model_spec("deepseek-v3"), 24)
                for _, _, s in d.roles}

    # 256 experts: EP 8 takes 0 or 32 copies; EP 24 takes 32 (288 = 12 x 24), but neither 0
    # nor no EPLB at all (SGLang asserts that the physical experts divide by the EP size)
    assert shapes(8, [1, 8]) == {RoleShape(8, 8), RoleShape(8, 8, 8),
                                 RoleShape(8, 8, 8, eplb=True),
                                 RoleShape(8, 8, 8, eplb=True, redundant_experts=32)}
    assert shapes(24, [24], dp=24) == {RoleShape(24, 24, 24, eplb=True, redundant_experts=32)}
    assert RoleShape(24, 24, 24, eplb=True, redundant_experts=32).label == "TP24 DP24 EP24 EPLB+32"
    # nor a shape whose attention GPUs (tp / dp_attention = 3) split 128 heads unevenly
    assert shapes(24, [24]) == set()
    with pytest.raises(ConfigError, match="eplb_redundant_experts: null or integers >= 0"):
        parse_plan({**SMALL, "search": {"eplb_redundant_experts": [-1]}})


def test_price_columns():
    summary = {"num_gpus": 4, "output_tok_s": 2000.0, "goodput_req_s": 10.0}
    cols = price_columns(summary, 3.0)
    assert cols["usd_per_hour"] == 12.0
    assert cols["usd_per_mtok"] == pytest.approx(12.0 / 3600 / 2000 * 1e6)
    assert cols["goodput_req_per_usd"] == pytest.approx(10 * 3600 / 12)
    assert all(math.isnan(v) for v in price_columns(summary, None).values())


@pytest.mark.slow
def test_cli_plan_end_to_end(tmp_path):
    tiny = {**SMALL, "name": "tiny_plan", "max_gpus": 2,
            "search": {"tp": [1], "modes": ["colocated", "disaggregated"]},
            "workload": {**SMALL["workload"], "num_requests": 40,
                         "arrival": {"process": "poisson", "rate_rps": 10}},
            "slo": {"ttft_p90_s": 1.0, "itl_p90_s": 0.05}}
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(tiny))
    run = subprocess.run([sys.executable, "-m", "pdsim.cli", "plan", "tiny.yaml", "--jobs", "1"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr + run.stdout
    assert "recommended: 1x colocated TP1" in run.stdout
    assert "python -m sglang.launch_server" in run.stdout
    out = tmp_path / "results" / "tiny_plan"
    candidates = pd.read_csv(out / "candidates.csv")
    assert len(candidates) == 3 and candidates["simulated"].any()
    assert load_plan(tmp_path / "tiny.yaml").name == "tiny_plan"
    bad = subprocess.run([sys.executable, "-m", "pdsim.cli", "plan", "missing.yaml"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "no such plan file" in bad.stderr


def test_a_plan_whose_every_run_stops_early_says_where_and_why(tmp_path):
    """Nothing can meet a 1 ms TTFT: every simulated run stops early, and the CLI and
    report.md list them with the reason instead of an empty frontier."""
    hopeless = {**SMALL, "name": "hopeless", "max_gpus": 2, "search": {"tp": [1],
                "modes": ["colocated"]}, "slo": {"ttft_p90_s": 0.001}}
    (tmp_path / "hopeless.yaml").write_text(yaml.safe_dump(hopeless))
    run = subprocess.run([sys.executable, "-m", "pdsim.cli", "plan", "hopeless.yaml", "--jobs",
                          "1", "--no-prefilter", "--wide"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 1, run.stderr + run.stdout
    assert "stopped early" in run.stdout and "over the TTFT p90 target of 1 ms" in run.stdout
    assert "no simulated deployment meets the SLO" in run.stdout
    report = (tmp_path / "results" / "hopeless" / "report.md").read_text()
    section = report.split("## Stopped early")[1]
    assert "| 2x colocated TP1 | 2 | " in section and "| 1x colocated TP1 | 1 | " in section


def test_tpot_percentiles_are_over_requests_mean_itl():
    frame = pd.DataFrame({"status": ["ok", "ok", "ok", "failed"], "in_window": [True] * 4,
                          "itl_mean_s": [0.01, 0.02, 0.03, 9.0]})
    got = tpot_percentiles(frame)
    assert got["tpot_p50_s"] == pytest.approx(0.02)
    assert got["tpot_p90_s"] == pytest.approx(0.028)  # linear interpolation, failed one left out


def test_tpot_floor_discards_when_one_request_steps_are_too_slow():
    cfg = parse_plan({**SMALL, "slo": {"tpot_p90_s": 0.001}})
    model, hw = load_model_spec(cfg.model), load_hardware_spec(cfg.hardware)
    filt = Prefilter(cfg, model, hw, generate(cfg.workload_data()))
    dep = Candidate("colocated", (("colocated", 1, RoleShape(2)),))
    verdict = filt.check(dep)
    assert not verdict.keep and verdict.reason.startswith("TPOT floor")
    assert cfg.slo.request_slo().itl_s == 0.001  # goodput's per-request mean-ITL bound


def test_a_pool_that_cannot_hold_the_longest_request_is_discarded_before_simulating():
    """The core refuses a request its instance's pool cannot hold whole (a prefill instance its
    prompt, a decode one its prompt and output): such a candidate never runs a request."""
    long = {**SMALL["workload"], "input_len": {"dist": "fixed", "value": 8_192},
            "output_len": {"dist": "fixed", "value": 1_000}}
    cfg = parse_plan({**SMALL, "model": "llama-3.1-70b", "max_gpus": 16, "workload": long})
    model, hw = load_model_spec(cfg.model), load_hardware_spec(cfg.hardware)
    filt = Prefilter(cfg, model, hw, generate(cfg.workload_data()))
    tp2, tp4 = RoleShape(2), RoleShape(4)
    pool = {s: filt.capacity("decode", s).kv_tokens_per_rank for s in (tp2, tp4)}
    assert pool[tp2] < 8_192 < 9_192 < pool[tp4]  # 70B's weights leave TP2 little
    decode = filt.check(Candidate("disaggregated", (("prefill", 1, tp4), ("decode", 1, tp2))))
    assert not decode.keep and decode.reason == (
        f"decode memory: the longest request needs 9,192 KV tokens, a rank's pool holds "
        f"{pool[tp2]:,}")
    prefill = filt.check(Candidate("disaggregated", (("prefill", 1, tp2), ("decode", 1, tp4))))
    assert prefill.reason.startswith("prefill memory: the longest request needs 8,192 KV tokens")
    both = filt.check(Candidate("disaggregated", (("prefill", 1, tp4), ("decode", 1, tp4))))
    assert "memory" not in (both.reason or "")


@pytest.mark.slow
def test_without_the_prefilter_a_deployment_that_cannot_be_built_is_reported_not_fatal():
    cfg = parse_plan({**SMALL, "model": "llama-3.1-70b", "max_gpus": 2,
                      "search": {"tp": [1, 2], "modes": ["colocated"]},
                      "workload": {**SMALL["workload"], "num_requests": 10}})
    result = plan(cfg, prefilter=False, write=False, jobs=1)
    table = result.candidates.set_index("label")
    # 70B in BF16 does not fit one 80 GB H100: the simulator refuses it, with the reason.
    assert not table.loc["1x colocated TP1", "simulated"]
    assert "does not fit" in table.loc["1x colocated TP1", "sim_error"]
    assert table.loc["1x colocated TP2", "simulated"]


def test_closed_loop_plan_runs_without_the_capacity_tests():
    closed = {**SMALL["workload"], "num_requests": 40,
              "arrival": {"process": "closed", "concurrency": 4}}
    cfg = parse_plan({**SMALL, "workload": closed, "max_gpus": 2,
                      "search": {"tp": [1], "modes": ["colocated"]},
                      "slo": {"ttft_p90_s": 1.0, "itl_p90_s": 0.05}})
    result = plan(cfg, write=False, jobs=1)
    # The load is the clients': no offered rate, so no utilisation bound and no capacity test.
    assert result.candidates["prefill_util_bound"].isna().all()
    assert result.candidates["prefilter_keep"].all()
    assert result.recommended is not None and result.recommended.deployment.num_gpus == 1


def test_traffic_target_rescales_a_trace_replay(tmp_path):
    rows = [{"timestamp": 1000 * i, "input_length": 500, "output_length": 20} for i in range(21)]
    (tmp_path / "trace.jsonl").write_text("\n".join(map(json.dumps, rows)) + "\n")
    plan_file = tmp_path / "plan.yaml"
    plan_file.write_text(yaml.safe_dump({**SMALL, "workload": {"trace": "trace.jsonl"},
                                         "target_rate_rps": 4.0}))
    cfg = load_plan(plan_file)
    assert cfg.workload_data()["target_rate_rps"] == 4.0
    workload = generate(cfg.workload_data(), tmp_path)
    assert workload.arrival_s[-1] == pytest.approx(20 / 4.0)  # 1 req/s in the file, 4 asked


def test_the_cheapest_first_cutoff_keeps_the_same_results_whatever_order_they_came_back_in():
    """Workers return out of order, so a dearer candidate may be simulated before a cheaper one
    meets the SLO; the plan keeps what the rule applied in cost order keeps (so a Ray cluster,
    a process pool and one process agree)."""
    from pdsim.planning.search import _kept_in_cost_order
    from pdsim.runner import PointResult

    cfg = parse_plan({**SMALL, "search": {"tp": [1, 2], "cost_slack": 0.5}})
    deps = [Candidate("colocated", (("colocated", n, RoleShape(tp=1)),)) for n in (1, 2, 3, 4)]
    good = {"failed": 0, "completed": 10, "ttft_p90_s": 0.1, "itl_p90_s": 0.001}
    bad = {**good, "ttft_p90_s": 9.0}

    def result(c, summary):
        return PointResult(c, dict(summary), pd.DataFrame())

    # 1 GPU misses the SLO, 2 GPUs meet it: with slack 0.5 the rule stops after 3 GPUs.
    results = {0: result(0, bad), 1: result(1, good), 2: result(2, good), 3: result(3, good)}
    for arrival in ([0, 1, 2, 3], [3, 2, 1, 0], [2, 0, 3, 1]):
        kept = _kept_in_cost_order(cfg, deps, [0, 1, 2, 3], {c: results[c] for c in arrival}, 1.0)
        assert sorted(kept) == [0, 1, 2]
    # A candidate that could not be built (its reason) neither meets nor bounds anything.
    some = {0: "no fit", 1: results[1], 3: results[3]}
    assert sorted(_kept_in_cost_order(cfg, deps, [0, 1, 2, 3], some, 1.0)) == [0, 1]


def test_sglang_moves_a_sliding_window_models_state_only_between_equal_tp():
    """SGLang's PD transfer refuses different attention TP sizes for a non-MLA model with
    sliding-window layers (gpt-oss); the planner leaves such pairs out."""
    from pdsim.config import ConfigError, parse_experiment
    from pdsim.planning.candidates import enumerate_deployments
    from pdsim.sim.build import build_cluster
    from pdsim.specs import model_preset

    oss = model_preset("gpt-oss-120b")
    assert oss.pd_tp_error(4, 4) is None and model_preset("llama-3.1-8b").pd_tp_error(4, 2) is None
    workload = {"num_requests": 1, "arrival": {"process": "poisson", "rate_rps": 1},
                "input_len": {"dist": "fixed", "value": 16},
                "output_len": {"dist": "fixed", "value": 4}}
    cfg = parse_experiment({"name": "x", "model": "gpt-oss-120b", "hardware": "h100",
                            "cluster": {"prefill": {"tp": 4}, "decode": {"tp": 2}},
                            "workload": workload})
    with pytest.raises(ConfigError, match="prefill 4, decode 2"):
        build_cluster(cfg)
    plan = parse_plan({"name": "p", "model": "gpt-oss-120b", "hardware": "h100", "max_gpus": 8,
                       "workload": workload, "slo": {"ttft_p90_s": 1.0},
                       "search": {"modes": ["disaggregated"], "tp": [1, 2, 4]}})
    pairs = {(c.roles[0][2].tp, c.roles[1][2].tp) for c in enumerate_deployments(plan, oss, 8)}
    assert pairs and all(p == d for p, d in pairs)
