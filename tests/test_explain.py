"""`pdsim explain` (one step op by op) and the per-role share columns of summary.csv."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import yaml
from typer.testing import CliRunner

from pdsim.cli import app
from pdsim.config import parse_experiment
from pdsim.core.batch import BatchResult, BatchShape, extend_shape
from pdsim.core.request import Request
from pdsim.core.scheduler import ColocatedScheduler
from pdsim.runner import run_experiment
from pdsim.sim.build import build_cluster
from pdsim.sim.cluster import Simulation
from pdsim.sim.cost import SHARE_GROUPS
from pdsim.sim.silicon import tables
from pdsim.workload import generate

needs_tables = pytest.mark.skipif(tables.systems_dir() is None,
                                  reason="aiconfigurator's silicon tables are not installed")

WORKLOAD = {"num_requests": 80, "seed": 0, "arrival": {"process": "poisson", "rate_rps": 8},
            "input_len": {"dist": "uniform", "low": 100, "high": 3000},
            "output_len": {"dist": "uniform", "low": 10, "high": 200}}


def config(model: str = "llama-3.1-8b", hardware: str = "h100", cost: str = "silicon",
           role: dict | None = None, **over) -> dict:
    role = role or {}
    return {"name": "explain", "model": model, "hardware": hardware,
            "cost_model": {"name": cost},
            "cluster": {"prefill": dict(role), "decode": dict(role)}, "workload": WORKLOAD,
            **over}


DEEPEP = {"tp": 8, "dp_attention": 8, "ep": 8, "moe_a2a": "deepep"}
KIMI_DEEPEP = {"tp": 16, "dp_attention": 16, "ep": 16, "moe_a2a": "deepep"}


def explain(tmp_path, cfg: dict, *args: str, columns: int = 80) -> tuple[int, str]:
    """Exit code and output of `pdsim explain` on a `columns`-wide terminal."""
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    result = CliRunner().invoke(app, ["explain", str(path), *args],
                                env={"COLUMNS": str(columns)})
    return result.exit_code, result.output


def explain_json(tmp_path, cfg: dict, *args: str) -> dict:
    code, out = explain(tmp_path, cfg, "--json", *args)
    assert code == 0, out
    return json.loads(out)


def step_time_s(cfg: dict, role: str, steps: list[BatchShape]) -> float:
    """The role's cost model, built as a run builds it, summed over `steps` (one shape each,
    on every attention-DP rank)."""
    spec = getattr(build_cluster(parse_experiment(cfg)), role)
    cost = spec.cost()
    return sum(cost.step_time_s([shape] * spec.dp_attention) for shape in steps)


def check_sums(got: dict, want_s: float) -> None:
    ops = got["ops"]
    assert sum(op["total_s"] for op in ops) == pytest.approx(want_s, rel=1e-9)
    assert got["step_s"] == pytest.approx(want_s, rel=1e-12)
    assert sum(op["share"] for op in ops) == pytest.approx(1.0, rel=1e-9)
    assert sum(got["group_shares"].values()) == pytest.approx(1.0, rel=1e-9)
    for op in ops:
        assert op["total_s"] == pytest.approx(op["count"] * op["each_s"], rel=1e-12)


def decode(batch: int, context: int) -> BatchShape:
    return BatchShape(decode_reqs=batch, decode_context_tokens=batch * context)


@needs_tables
def test_dense_silicon_decode_lists_its_kernels_and_adds_up_to_the_step(tmp_path):
    cfg = config()
    got = explain_json(tmp_path, cfg, "--batch", "32", "--context", "1000")
    names = [op["name"] for op in got["ops"]]
    assert names == ["qkv_proj", "o_proj", "decode attention", "elementwise", "gate_up_proj",
                     "down_proj", "lm_head", "host overhead"]
    by_name = {op["name"]: op for op in got["ops"]}
    assert by_name["qkv_proj"]["count"] == 32  # llama-3.1-8b's layers
    assert by_name["qkv_proj"]["table"] == "gemm"
    assert by_name["decode attention"]["table"] == "generation_attention"
    assert by_name["elementwise"]["how"] == "roofline"
    assert by_name["gate_up_proj"]["group"] == "gemm"
    check_sums(got, step_time_s(cfg, "decode", [decode(32, 1000)]))


def test_dense_roofline_prefill_chunks_the_prompt_as_the_scheduler_does(tmp_path):
    cfg = config(cost="roofline")
    cfg["cluster"]["prefill"]["scheduler"] = {"chunked_prefill_size": 4096}
    got = explain_json(tmp_path, cfg, "--role", "prefill", "--prompt", "10000")
    assert [op["name"] for op in got["ops"]] == ["attention block", "dense MLP", "LM head",
                                                "host overhead"]
    assert {op["how"] for op in got["ops"]} == {"roofline"}
    assert [s["prefill_tokens"] for s in got["shapes"]] == [4096, 4096, 1808]
    assert got["ops"][0]["count"] == 3 * 32  # every chunk's 32 layers
    chunks = [extend_shape(n, done) for n, done in ((4096, 0), (4096, 4096), (1808, 8192))]
    check_sums(got, step_time_s(cfg, "prefill", chunks))
    assert explain_json(tmp_path, cfg, "--prompt", "10000") == got  # a prompt: prefill's step


@pytest.mark.slow
@needs_tables
def test_deepseek_deepep_decode_and_prefill_name_the_moe_ops(tmp_path):
    cfg = config("deepseek-v3", "h200", role=DEEPEP)
    got = explain_json(tmp_path, cfg)  # defaults: decode, 64 requests at 2048 tokens
    by_name = {op["name"]: op for op in got["ops"]}
    assert {"q_a_proj", "q_b_proj", "kv_a_proj", "o_proj", "mla_bmm_pre", "mla_bmm_post",
            "decode attention", "gate_up_proj", "routed experts", "router", "shared gate_up",
            "dispatch+combine", "lm_head"} <= set(by_name)
    assert by_name["routed experts"]["count"] == 58  # 61 layers, the first 3 dense
    assert by_name["gate_up_proj"]["count"] == 3
    assert by_name["dispatch+combine"]["table"] == "wideep_deepep_ll"
    assert by_name["dispatch+combine"]["group"] == "communication"
    assert by_name["routed experts"]["group"] == "moe"
    assert got["ranks"] == 8
    check_sums(got, step_time_s(cfg, "decode", [decode(64, 2048)]))

    # SGLang's default chunk, 8192 tokens an instance, is 1024 a rank over 8 DP ranks
    got = explain_json(tmp_path, cfg, "--role", "prefill", "--prompt", "3000")
    assert [s["prefill_tokens"] for s in got["shapes"]] == [1024, 1024, 952]
    names = {op["name"] for op in got["ops"]}
    # the first chunk in the MHA form, the two after it over fewer than 8,192 cached tokens
    # in the absorbed one, as SGLang's fa3 backend dispatches them
    assert {"kv_b_proj", "prefill attention", "prefill attention (absorbed)",
            "routed experts"} <= names
    assert "decode attention" not in names and "kv_b_proj (prefix)" not in names
    assert {op["table"] for op in got["ops"] if op["name"] == "dispatch+combine"} == {
        "wideep_deepep_normal"}
    chunks = [extend_shape(n, done) for n, done in ((1024, 0), (1024, 1024), (952, 2048))]
    check_sums(got, step_time_s(cfg, "prefill", chunks))


@pytest.mark.parametrize("cost", ["roofline", "silicon"])
def test_two_batch_overlap_leaves_the_exposed_communication_in_its_group(tmp_path, cost):
    """DeepEP's dispatch/combine is communication, and what two-batch overlap hides of it
    counts there too: the group is the communication left exposed, never below zero. Where
    the split costs more than it hides (silicon: the SMs DeepEP's normal mode holds slow the
    compute beside it), its change is compute, in moe."""
    if cost == "silicon" and tables.systems_dir() is None:
        pytest.skip("aiconfigurator's silicon tables are not installed")
    cfg = config("deepseek-v3", "h200", cost=cost, role={**DEEPEP, "two_batch_overlap": True})
    got = explain_json(tmp_path, cfg, "--role", "prefill", "--prompt", "8192")
    (tbo,) = [op for op in got["ops"] if op["name"] == "two-batch overlap"]
    assert tbo["group"] == ("communication" if tbo["total_s"] < 0 else "moe")
    comm = [op for op in got["ops"] if op["group"] == "communication"]
    exposed = sum(op["total_s"] for op in comm)
    assert exposed > 0.05 * got["step_s"]
    assert got["group_shares"]["communication"] == pytest.approx(exposed / got["step_s"])
    assert got["group_shares"]["moe"] > 0


@pytest.mark.parametrize("cost", ["roofline", "silicon"])
def test_two_batch_overlap_that_costs_more_than_it_hides_counts_as_expert_compute(tmp_path,
                                                                                 cost):
    """At 4 requests a rank each micro-batch reads the experts' weights again and hides little
    DeepEP time: the split's net cost is compute (moe), not communication."""
    if cost == "silicon" and tables.systems_dir() is None:
        pytest.skip("aiconfigurator's silicon tables are not installed")
    cfg = config("deepseek-v3", "h200", cost=cost, role={**DEEPEP, "two_batch_overlap": True})
    got = explain_json(tmp_path, cfg, "--role", "decode", "--batch", "4", "--context", "2048")
    (tbo,) = [op for op in got["ops"] if op["name"] == "two-batch overlap"]
    assert tbo["total_s"] > 0 and tbo["group"] == "moe"
    moe = sum(op["total_s"] for op in got["ops"] if op["group"] == "moe")
    assert got["group_shares"]["moe"] == pytest.approx(moe / got["step_s"])
    assert min(got["group_shares"].values()) >= 0


def test_a_batch_above_what_a_run_holds_says_so(tmp_path):
    """Explain prices any batch, and says when a run could not hold it: DeepEP's low-latency
    dispatch caps a decode rank at 128 tokens (one each without speculation)."""
    cfg = config("deepseek-v3", "h200", cost="roofline", role=DEEPEP)
    code, out = explain(tmp_path, cfg, "--batch", "256")
    assert code == 0 and ("a run holds at most 128 a rank: DeepEP's low-latency dispatch "
                          "takes 128 tokens a rank") in " ".join(out.split())
    code, out = explain(tmp_path, cfg, "--batch", "128")
    assert code == 0 and "a run holds" not in out


@pytest.mark.slow
@needs_tables
def test_a_speculating_batch_above_sglangs_default_says_where_48_comes_from(tmp_path):
    """A speculating role without max_running_requests runs SGLang's 48 requests: explain
    names that default and the knob, pdsim check notes it; a given limit is just the knob."""
    from pdsim.runner import check_points

    spec = {"method": "mtp", "num_draft_tokens": 3, "acceptance": {"mean_accept_len": 2.5}}
    cfg = config("deepseek-v3", "h200", cost="roofline", role={"tp": 8}, speculative=spec)
    code, out = explain(tmp_path, cfg, "--batch", "64")
    assert code == 0 and ("a run holds at most 48 a rank: SGLang's default of 48 running "
                          "requests an instance under speculation; set "
                          "scheduler.max_running_requests for more") in " ".join(out.split())
    (note,) = check_points([({}, parse_experiment(cfg))], str(tmp_path), "cfg.yaml")
    assert note.startswith("cluster.decode: speculative decoding (mtp) without "
                           "scheduler.max_running_requests runs at most 48 requests an instance")
    given = {"tp": 8, "scheduler": {"max_running_requests": 32}}
    cfg = config("deepseek-v3", "h200", cost="roofline", role=given, speculative=spec)
    code, out = explain(tmp_path, cfg, "--batch", "64")
    assert code == 0 and "a run holds at most 32 a rank: its max_running_requests" in " ".join(
        out.split())
    assert check_points([({}, parse_experiment(cfg))], str(tmp_path), "cfg.yaml") == []


def test_single_batch_overlap_shows_what_it_hides(tmp_path):
    """The overlap's change is a row of each part it touches, so the rows still add up."""
    cfg = config("deepseek-v3", "h200", role={**DEEPEP, "single_batch_overlap": True})
    got = explain_json(tmp_path, cfg)
    by_name = {op["name"]: op for op in got["ops"]}
    assert {"dispatch", "combine", "routed experts"} <= set(by_name)
    hidden = by_name["single-batch overlap: hidden"]
    assert hidden["total_s"] < 0 and hidden["how"] == "derived"
    assert by_name["single-batch overlap: SMs the combine holds"]["total_s"] > 0
    check_sums(got, step_time_s(cfg, "decode", [decode(64, 2048)]))


@pytest.mark.slow
@needs_tables
def test_kimi_experts_are_transferred_from_the_measured_deepseek_shape(tmp_path):
    cfg = config("kimi-k2", "h200", role=KIMI_DEEPEP)
    got = explain_json(tmp_path, cfg)
    by_name = {op["name"]: op for op in got["ops"]}
    assert by_name["routed experts"]["how"] == "transferred"
    assert by_name["o_proj"]["how"] == "interpolated"
    check_sums(got, step_time_s(cfg, "decode", [decode(64, 2048)]))
    code, out = explain(tmp_path, cfg)
    assert code == 0, out
    experts = [line for line in out.splitlines() if line.startswith("routed experts")]
    assert len(experts) == 1 and "transferred" in experts[0]
    assert max(len(line) for line in out.splitlines()) <= 80


def colocated(scheduler: dict | None = None) -> dict:
    cfg = config(cost="roofline")
    cfg["cluster"] = {"mode": "colocated", "colocated": {"scheduler": scheduler or {}}}
    return cfg


def test_a_colocated_prompt_explains_the_colocated_extend_step(tmp_path):
    """A colocated instance runs extend steps too: --prompt asks for one, and --role prefill
    and decode name the colocated instance's steps."""
    cfg = colocated({"chunked_prefill_size": 4096})
    chunks = [extend_shape(n, done) for n, done in ((4096, 0), (4096, 4096), (1808, 8192))]
    for args in (("--role", "colocated", "--prompt", "10000"), ("--prompt", "10000"),
                 ("--role", "prefill", "--prompt", "10000")):
        got = explain_json(tmp_path, cfg, *args)
        assert got["role"] == "colocated", args
        assert got["step"] == "prefill of a 10000-token prompt in 3 chunk(s) of <= 4096"
        check_sums(got, step_time_s(cfg, "colocated", chunks))
    got = explain_json(tmp_path, cfg, "--role", "prefill")  # the default prompt
    assert got["role"] == "colocated" and got["shapes"][0]["prefill_tokens"] == 4096
    for args in ((), ("--role", "decode"), ("--role", "colocated", "--batch", "64")):
        got = explain_json(tmp_path, cfg, *args)
        assert got["step"] == "decode of 64 requests at 2048 tokens of context", args
        check_sums(got, step_time_s(cfg, "colocated", [decode(64, 2048)]))


@pytest.mark.parametrize("cluster, args, message", [
    ("pd", ("--role", "prefill", "--batch", "8", "--context", "100"),
     "--batch and --context cannot be honoured: the prefill role explains an extend step, "
     "which takes --prompt and --prompts"),
    ("pd", ("--role", "decode", "--prompt", "100"), "--prompt cannot be honoured: the decode "
     "role explains a decode step, which takes --batch and --context"),
    ("pd", ("--prompts", "4", "--batch", "8"), "--batch cannot be honoured: the prefill role"),
    ("colocated", ("--prompt", "100", "--batch", "8"), "--batch cannot be honoured with "
     "--prompt: a colocated instance runs its extend and decode steps apart"),
    ("colocated", ("--role", "decode", "--prompts", "2"), "--prompts cannot be honoured: the "
     "decode role explains a decode step"),
])
def test_an_option_the_step_does_not_take_is_refused_by_name(tmp_path, cluster, args, message):
    cfg = colocated() if cluster == "colocated" else config(cost="roofline")
    code, out = explain(tmp_path, cfg, *args)
    assert code == 2 and message in " ".join(out.split())


def scheduled_extends(cfg: dict, prompts: int, prompt: int) -> list[BatchShape]:
    """The extend batches the colocated scheduler of `cfg` plans for `prompts` prompts of
    `prompt` tokens that arrive together."""
    sched = ColocatedScheduler(build_cluster(parse_experiment(cfg)).colocated.scheduler)
    for i in range(prompts):
        sched.add_request(Request(f"r{i}", prompt, 4), 0.0)
    shapes = []
    while (batch := sched.step(0.0)).kind == "extend":
        shapes.append(batch.shape)
        sched.on_batch_done(batch, BatchResult(1.0), 0.0)
    return shapes


@pytest.mark.parametrize("chunk, prompts, prompt, sizes", [
    (4096, 16, 1024, [4096] * 4),  # whole prompts, four to a chunk
    (4096, 3, 3000, [4096, 4096, 808]),  # the prompt crossing a chunk is cut there
    (4096, 5, 100, [500]),
    (0, 5, 3000, [6000, 6000, 3000]),  # unchunked: whole prompts within max_prefill_tokens
])
def test_prompts_share_extend_steps_as_the_scheduler_plans_them(tmp_path, chunk, prompts,
                                                                 prompt, sizes):
    cfg = colocated({"chunked_prefill_size": chunk, "max_prefill_tokens": 8192})
    got = explain_json(tmp_path, cfg, "--prompts", str(prompts), "--prompt", str(prompt))
    planned = scheduled_extends(cfg, prompts, prompt)
    assert [BatchShape(**shape) for shape in got["shapes"]] == planned
    assert [shape.prefill_tokens for shape in planned] == sizes
    assert got["step"] == (f"prefill of {prompts} prompts of {prompt} tokens in {len(sizes)} "
                           f"step(s) of <= {max(sizes)} tokens")
    check_sums(got, step_time_s(cfg, "colocated", planned))


@needs_tables
def test_the_op_table_keeps_each_op_on_one_line_at_80_columns(tmp_path):
    """At 80 columns the table drops its least needed columns, and says which, rather than
    fold a row; a wide terminal (or --wide) shows them all."""
    cfg = config("deepseek-v3", "h200", role={**DEEPEP, "single_batch_overlap": True},
                 speculative={"method": "mtp", "num_draft_tokens": 3,
                              "acceptance": {"mean_accept_len": 2.5}})
    names = [op["name"] for op in explain_json(tmp_path, cfg)["ops"]]
    assert "draft step: MoE experts" in names
    code, out = explain(tmp_path, cfg)
    assert code == 0, out
    lines = out.splitlines()
    assert max(len(line) for line in lines) <= 80
    head = next(i for i, line in enumerate(lines) if line.startswith("op "))
    assert lines[head].split() == ["op", "n", "total", "ms", "share", "how"]
    rows = lines[head + 1:head + 1 + len(names)]
    assert [row[:len(name) + 1] for row, name in zip(rows, names)] == [f"{name} "
                                                                       for name in names]
    assert lines[head + 1 + len(names)] == ("not shown at 80 columns: each µs, table (--wide "
                                            "shows them)")
    for args, columns in (((), 200), (("--wide",), 80)):
        code, out = explain(tmp_path, cfg, *args, columns=columns)
        assert code == 0 and "not shown" not in out
        assert ["op", "n", "each", "µs", "total", "ms", "share", "table", "how"] in [
            line.split() for line in out.splitlines()]


def test_explain_rejects_a_role_the_cluster_lacks(tmp_path):
    code, out = explain(tmp_path, config(cost="roofline"), "--role", "colocated")
    assert code == 2
    assert "role 'colocated'" in out and "prefill, decode" in out
    code, out = explain(tmp_path, config(cost="roofline"), "--batch", "0")
    assert code == 2 and "--batch must be at least 1" in out


@pytest.mark.parametrize("cost", ["roofline", pytest.param("silicon", marks=needs_tables)])
def test_explain_speculative_step_adds_the_drafts_forwards(tmp_path, cost):
    """A speculating decode step is the target's verify forward (k + 1 query tokens a
    request), the draft's extend and its k - 1 one-token steps: the rows add up to the
    speculative cost model's step, the target's at the verify shape."""
    cfg = config("deepseek-v3", "h200", cost=cost, role={"tp": 8}, speculative={
        "method": "mtp", "num_draft_tokens": 3, "acceptance": {"mean_accept_len": 2.5}})
    got = explain_json(tmp_path, cfg, "--batch", "32", "--context", "2048")
    verify = BatchShape(decode_reqs=32, decode_context_tokens=32 * 2048, decode_query_len=4)
    check_sums(got, step_time_s(cfg, "decode", [verify]))  # as the core plans the step
    assert got["shapes"][0]["decode_query_len"] == 4
    ops = got["ops"]
    drafts = [op for op in ops if op["name"].startswith("draft")]
    assert {op["name"] for op in drafts} >= {"draft: MoE experts", "draft step: MoE experts"}
    step = {op["name"]: op for op in drafts}["draft step: MoE experts"]
    assert step["count"] == 2  # k - 1 one-token forwards of the one-layer MTP module
    target = sum(op["total_s"] for op in ops if not op["name"].startswith("draft"))
    spec = build_cluster(parse_experiment(cfg)).decode.cost()
    assert target == pytest.approx(spec.target.step_time_s([verify]), rel=1e-9)
    code, out = explain(tmp_path, cfg)
    assert code == 0 and "mtp verifies 3 draft tokens" in out


def share_sums(row: pd.Series, role: str) -> float:
    return sum(row[f"{role}_share_{group}"] for group in SHARE_GROUPS)


def test_summary_shares_sum_to_one_per_role(tmp_path):
    cfg = config(cost="roofline")
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    run_experiment(path, tmp_path / "out", jobs=1, progress=False)
    row = pd.read_csv(tmp_path / "out" / "summary.csv").iloc[0]
    for role in ("prefill", "decode"):
        assert share_sums(row, role) == pytest.approx(1.0, rel=1e-9)
        assert row[f"{role}_share_attention"] > 0.05 and row[f"{role}_share_gemm"] > 0.05
        assert row[f"{role}_share_moe"] == 0.0  # a dense model
    assert "colocated_share_attention" not in row


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_counted_breakdown_adds_up_to_each_instances_busy_time(mode):
    """The executor counts every step it ran (decode runs included): priced by part, they add
    up to the instance's simulated forward time."""
    cfg = config(cost="roofline", role=DEEPEP, model="deepseek-v3", hardware="h200")
    if mode == "colocated":
        cfg["cluster"] = {"mode": "colocated", "colocated": dict(DEEPEP)}
    cfg = parse_experiment(cfg)
    wl = generate(cfg.workload)
    sim = Simulation(build_cluster(cfg), cfg.seed)
    sim.run(wl.arrival_s, wl.input_tokens, wl.output_tokens)
    for inst in sim.instances:
        parts = inst.executor.breakdown_s()
        assert parts["moe_experts"] > 0 and parts["moe_comm"] > 0
        # decode steps are priced at their bucket's mean context: not to the bit
        assert sum(parts.values()) == pytest.approx(inst.busy_s, rel=1e-4)
