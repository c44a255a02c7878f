"""Pipeline-parallel prefill (`cluster.prefill.pp`, SGLang's --pp-size) in the simulator: one
stage's step priced by both cost models, a long prompt's chunks overlapping across stages
((C + pp - 1) stage times), each stage's KV on its own NICs, the config's limits, the planner's
--pp-size."""

from __future__ import annotations

import math
import shlex
from types import SimpleNamespace

import numpy as np
import pytest

from pdsim.config import ConfigError, parse_experiment
from pdsim.core.batch import BatchShape, extend_attn_pairs
from pdsim.planning import parse_plan
from pdsim.planning.candidates import (
    Candidate,
    RoleShape,
    enumerate_deployments,
    prefill_pp_sizes,
)
from pdsim.planning.launch import sglang_commands
from pdsim.planning.prefilter import Prefilter
from pdsim.sim.build import build_cluster
from pdsim.sim.cluster import Simulation
from pdsim.sim.cost import Parallelism, kv_capacity_tokens, make_cost_model
from pdsim.sim.network import stage_kv_page_bytes
from pdsim.sim.pipeline import PipelineExecutor, make_executor, pipelined_s
from pdsim.specs.hardware import load_hardware_spec
from pdsim.specs.models import load_model_spec
from pdsim.specs.pipeline import stage_layer_ranges, stage_model
from pdsim.workload import generate

CHUNK_TOKENS = 8192  # SGLang's default chunked_prefill_size on H100
PROMPT_TOKENS = 15 * CHUNK_TOKENS  # 120k: with its output, inside Llama-3.1's 128k context


def long_prefill(tp: int, pp: int, **prefill) -> dict:
    """One 128k-token prompt of Llama-3.1-70B on H100s, prefilled by one instance of tp x pp."""
    return {
        "name": "pp", "seed": 0, "model": "llama-3.1-70b", "hardware": "h100",
        "cluster": {"prefill": {"instances": 1, "tp": tp, "pp": pp, **prefill},
                    "decode": {"instances": 1, "tp": 8}},
        "workload": {"num_requests": 1, "seed": 0,
                     "arrival": {"process": "constant", "rate_rps": 1},
                     "input_len": {"dist": "fixed", "value": PROMPT_TOKENS},
                     "output_len": {"dist": "fixed", "value": 2}},
    }


def simulate(data: dict):
    cfg = parse_experiment(data)
    wl = generate(cfg.workload)
    result = Simulation(build_cluster(cfg), cfg.seed).run(wl.arrival_s, wl.input_tokens,
                                                            wl.output_tokens)
    (record,) = result.records
    assert record.status == "ok"
    return record, result


@pytest.fixture(scope="module")
def llama70b():
    return load_model_spec("llama-3.1-70b"), load_hardware_spec("h100")


@pytest.fixture(scope="module")
def runs():
    return {shape: simulate(long_prefill(*shape)) for shape in ((8, 1), (8, 2), (8, 4), (16, 1))}


def chunk_stage_times_s(tp: int, pp: int) -> list[float]:
    """One stage's time of each chunk of the prompt, as the simulated instance prices it."""
    cost = build_cluster(parse_experiment(long_prefill(tp, pp))).prefill.cost()
    return [cost.step_time_s([BatchShape(prefill_tokens=CHUNK_TOKENS,
                                         prefill_attn_pairs=extend_attn_pairs(CHUNK_TOKENS, c))])
            for c in range(0, PROMPT_TOKENS, CHUNK_TOKENS)]


# ---- time to first token ------------------------------------------------------------------


@pytest.mark.slow
def test_ttft_of_a_long_chunked_prompt_falls_with_pipeline_stages(runs):
    ttft = {shape: rec.first_token_s - rec.arrival_s for shape, (rec, _) in runs.items()}
    assert ttft[(8, 4)] < ttft[(8, 2)] < ttft[(8, 1)]
    # Chunks overlap across the stages: two stages do better than 0.6 of one...
    assert ttft[(8, 2)] < 0.6 * ttft[(8, 1)]
    # ...and a second node as pipeline stages beats it as TP-16, whose all-reduces cross the
    # RDMA NICs every layer.
    assert ttft[(8, 2)] < ttft[(16, 1)]


@pytest.mark.slow
def test_a_pipelined_prefill_takes_c_plus_pp_minus_one_stage_times(runs):
    """15 chunks through 2 stages: every chunk one stage time, plus the fill of the last stage
    (the bubble), not 15 x 2 stage times. A later chunk attends over more keys, so stage times
    grow and the chunk that fills the pipeline last is the last one."""
    for pp in (2, 4):
        stage_s = chunk_stage_times_s(8, pp)
        assert len(stage_s) == 15 and stage_s == sorted(stage_s)
        rec, _ = runs[(8, pp)]
        expected = sum(stage_s) + (pp - 1) * stage_s[-1]
        assert rec.prefill_end_s - rec.prefill_start_s == pytest.approx(expected, rel=1e-9)
        assert expected < 0.6 * pp * sum(stage_s)  # far from the chunks' stages one after another


def test_pipelined_time_of_equal_chunks_is_c_plus_pp_minus_one():
    assert pipelined_s([0.5] * 16, 2) == 0.5 * 17
    assert pipelined_s([0.5] * 16, 4) == 0.5 * 19
    assert pipelined_s([0.5] * 16, 1) == 0.5 * 16
    assert pipelined_s([0.5], 3) == 0.5 * 3  # a lone chunk crosses every stage


class _PerToken:
    """A cost model of 1 ms per prefill token."""

    def step_time_s(self, shapes):
        return sum(s.prefill_tokens for s in shapes) * 1e-3


def test_chunks_back_to_back_keep_the_pipeline_full_and_an_idle_one_refills_it():
    clock = [0.0]
    executor = PipelineExecutor(_PerToken(), 3, lambda: clock[0])

    def step(tokens: int) -> float:
        duration = executor.execute([SimpleNamespace(shape=BatchShape(prefill_tokens=tokens), kv_moves=[])])
        clock[0] += duration.duration_s
        return duration.duration_s

    assert step(1000) == pytest.approx(3.0)  # through all 3 stages: the bubble
    assert step(1000) == pytest.approx(1.0)  # entered stage 0 as the first left it
    assert step(1000) == pytest.approx(1.0)
    clock[0] = 20.0  # idle: the pipeline drained
    assert step(2000) == pytest.approx(6.0)
    # a shorter chunk after a longer one leaves the last stage after it, not before
    assert step(500) == pytest.approx(0.5)
    assert make_executor(_PerToken(), 1, lambda: 0.0).execute(
        [SimpleNamespace(shape=BatchShape(prefill_tokens=1000), kv_moves=[])]).duration_s == 1.0


# ---- one stage's price ---------------------------------------------------------------------


@pytest.mark.parametrize("name", ["roofline", "silicon"])
def test_a_stage_prices_its_share_of_the_layers_and_the_send(name, llama70b):
    model, hw = llama70b
    shape = [BatchShape(prefill_tokens=CHUNK_TOKENS, prefill_attn_pairs=CHUNK_TOKENS ** 2 / 2)]
    whole = make_cost_model(name, model, hw, Parallelism(tp=8), role="prefill")
    stage = make_cost_model(name, model, hw, Parallelism(tp=8, pp=2), role="prefill")
    w, s = whole.step_breakdown_s(shape), stage.step_breakdown_s(shape)
    assert s["attention"] == pytest.approx(w["attention"] / 2)  # 40 of 80 layers
    assert s["dense_mlp"] == pytest.approx(w["dense_mlp"] / 2)
    assert s["lm_head"] == w["lm_head"]  # the last stage runs it
    # The activations go to the next stage: 2 x 8192 tokens x 8192 x 2 B / 8 GPUs, over RDMA
    # (16 GPUs span two H100 nodes).
    # What differs from the stage's layers priced alone is the send of the activations to the
    # next stage: 2 x 8192 tokens x 8192 x 2 B / 8 GPUs, over RDMA (16 GPUs span two nodes).
    alone = make_cost_model(name, stage_model(model, 2), hw, Parallelism(tp=8),
                            role="prefill").step_breakdown_s(shape)
    assert {k: v for k, v in s.items() if k != "overhead"} == \
        {k: v for k, v in alone.items() if k != "overhead"}
    assert s["overhead"] - alone["overhead"] == pytest.approx(
        2 * CHUNK_TOKENS * 8192 * 2 / 8 / (hw.rdma_gb_per_s * 1e9 * 0.7) + 10e-6)
    assert stage.step_time_s(shape) == pytest.approx(sum(s.values()))


def test_a_gpu_holds_only_its_stage_s_weights_and_kv(llama70b):
    model, hw = llama70b
    one, two = (kv_capacity_tokens(model, hw, Parallelism(tp=8, pp=pp)) for pp in (1, 2))
    assert two > 2 * one  # half the KV per token, and room freed by half the weights


def test_sglang_layer_split_puts_the_remainder_on_the_last_stages():
    assert [len(r) for r in stage_layer_ranges(61, 4)] == [15, 15, 15, 16]
    assert [len(r) for r in stage_layer_ranges(62, 4)] == [15, 15, 16, 16]
    assert [(r.start, r.stop) for r in stage_layer_ranges(80, 2)] == [(0, 40), (40, 80)]
    dsv3 = stage_model(load_model_spec("deepseek-v3"), 2)  # 3 dense layers, all on stage 0
    assert (dsv3.num_layers, dsv3.num_dense_layers) == (31, 0)
    with pytest.raises(ValueError, match="pp=81 stages need at least one layer"):
        stage_layer_ranges(80, 81)


# ---- KV per stage ------------------------------------------------------------------------


def test_each_stage_sends_its_layers_kv_and_the_stages_add_up_to_the_page():
    page = 16 * 327680.0
    assert stage_kv_page_bytes(page, 80, 2) == [page / 2, page / 2]
    shares = stage_kv_page_bytes(page, 61, 4)
    assert math.fsum(shares) == pytest.approx(page)
    assert shares == [page * n / 61 for n in (15, 15, 15, 16)]


@pytest.mark.slow
def test_the_stages_nics_carry_the_kv_together(runs):
    cfg = parse_experiment(long_prefill(8, 2))
    one = build_cluster(parse_experiment(long_prefill(8, 1))).prefill
    two = build_cluster(cfg).prefill
    assert two.gpus_per_instance == 16 and two.pp == 2
    assert two.kv_bytes_per_page == one.kv_bytes_per_page  # the whole page still moves...
    assert two.nic_bytes_per_s == pytest.approx(2 * one.nic_bytes_per_s)  # ...from both stages
    # the same KV reaches decode (a TP-8 instance without stages) either way
    assert runs[(8, 2)][1].kv_transfer_gb == pytest.approx(runs[(8, 1)][1].kv_transfer_gb)
    assert cfg.cluster.num_gpus == 16 + 8


# ---- the config's limits -----------------------------------------------------------------


@pytest.mark.parametrize("role", ["decode", "colocated"])
def test_pp_outside_prefill_is_refused_naming_the_field(role):
    data = long_prefill(8, 1)
    if role == "colocated":
        data["cluster"] = {"mode": "colocated", "colocated": {"instances": 1, "tp": 8, "pp": 2}}
    else:
        data["cluster"]["decode"]["pp"] = 2
    with pytest.raises(ConfigError, match=rf"cluster\.{role}\.pp=2: pipeline parallelism is "
                                          "modelled for the prefill role"):
        parse_experiment(data)


def test_more_stages_than_layers_is_refused():
    with pytest.raises(ConfigError, match="cluster.prefill: pp=81 stages need at least one "
                                          "layer each; the model has 80 layers"):
        build_cluster(parse_experiment(long_prefill(1, 81)))


def test_pp_with_speculative_decoding_is_refused():
    data = long_prefill(8, 2)
    data["speculative"] = {"method": "eagle", "num_draft_tokens": 2,
                           "acceptance": {"mean_accept_len": 2.0}}
    with pytest.raises(ConfigError, match="cluster.prefill.pp=2: pipeline stages are not "
                                          "modelled with speculative decoding"):
        build_cluster(parse_experiment(data))


def test_the_real_backend_refuses_pp():
    from runtime.serve_config import parse_serve_config

    data = {"model": "tiny-llama", "cluster": {
        "mode": "disaggregated",
        "prefill": {"pp": 2, "scheduler": {"num_pages": 64}},
        "decode": {"scheduler": {"num_pages": 64}}}}
    with pytest.raises(ConfigError, match=r"cluster\.prefill\.pp: 2; the real backend serves 1 "
                                          "only"):
        parse_serve_config(data)


# ---- the planner ---------------------------------------------------------------------------


def long_plan(mean_tokens: int) -> dict:
    return {
        "name": "long_pp", "model": "llama-3.1-70b", "hardware": "h100",
        "workload": {"num_requests": 20, "seed": 0,
                     "arrival": {"process": "poisson", "rate_rps": 0.2},
                     "input_len": {"dist": "lognormal", "mean": mean_tokens, "cv": 0.2,
                                   "min": 1024, "max": 131072},
                     "output_len": {"dist": "fixed", "value": 64}},
        "slo": {"ttft_p90_s": 20.0, "itl_p90_s": 0.05},
        "max_gpus": 24,
        "search": {"tp": [8], "modes": ["disaggregated"]},
    }


def test_the_planner_searches_prefill_pp_for_long_prompts_only():
    model = load_model_spec("llama-3.1-70b")
    long, short = parse_plan(long_plan(100_000)), parse_plan(long_plan(4096))
    assert prefill_pp_sizes(long, generate(long.workload_data()).input_tokens) == (1, 2, 4)
    assert prefill_pp_sizes(short, generate(short.workload_data()).input_tokens) == (1,)
    deps = enumerate_deployments(long, model, 24, (1, 2, 4))
    prefill_pp = {shape.pp for dep in deps for role, _, shape in dep.roles if role == "prefill"}
    decode_pp = {shape.pp for dep in deps for role, _, shape in dep.roles if role == "decode"}
    assert prefill_pp == {1, 2} and decode_pp == {1}  # PP4 x TP8 + a decode TP8 exceeds 24
    assert all(dep.num_gpus <= 24 for dep in deps)
    assert Candidate("disaggregated", (("prefill", 1, RoleShape(8, pp=2)),
                                       ("decode", 1, RoleShape(8)))) in deps


def test_the_launch_command_of_a_pipelined_prefill_carries_pp_size():
    cfg = parse_plan(long_plan(100_000))
    dep = Candidate("disaggregated", (("prefill", 1, RoleShape(8, pp=2)),
                                      ("decode", 1, RoleShape(8))))
    assert dep.num_gpus == 24 and dep.label == "1P TP8 PP2 + 1D TP8"
    cmds = sglang_commands(dep, cfg, gpus_per_node=8)
    prefill = [shlex.split(c) for what, c in cmds.servers if what.startswith("prefill")]
    assert len(prefill) == 2  # 16 GPUs: two nodes
    for argv in prefill:
        assert argv[argv.index("--pp-size") + 1] == "2"
        assert argv[argv.index("--tp-size") + 1] == "8"
        assert argv[argv.index("--nnodes") + 1] == "2"
    decode = [shlex.split(c) for what, c in cmds.servers if what.startswith("decode")]
    assert all("--pp-size" not in argv for argv in decode)
    exp = parse_experiment(dep.experiment_data(cfg))
    assert exp.cluster.prefill.pp == 2 and exp.cluster.num_gpus == 24


def test_the_prefilter_prices_a_pipelined_prefill_alone(llama70b):
    cfg = parse_plan(long_plan(100_000))
    wl = generate(cfg.workload_data())
    filt = Prefilter(cfg, *llama70b, wl)
    one, two = filt.capacity("prefill", RoleShape(8)), filt.capacity("prefill", RoleShape(8, pp=2))
    n = int(np.max(wl.input_tokens))
    assert two.prefill_alone_s[n] < 0.6 * one.prefill_alone_s[n]
    assert two.prefill_tok_s > 1.8 * one.prefill_tok_s


@pytest.mark.slow
def test_a_plan_for_long_prompts_recommends_and_launches_a_pipelined_prefill():
    """Twenty ~100k-token prompts on up to 24 H100s: two prefill stages of TP 8 meet the
    20 s TTFT p90 target at the cost of two TP-8 instances and with the lower TTFT; the
    recommendation launches them with --pp-size 2 over two nodes."""
    from pdsim.planning import plan

    result = plan(parse_plan(long_plan(100_000)), write=False, jobs=1)
    labels = set(result.candidates["label"])
    assert "1P TP8 PP2 + 1D TP8" in labels and "1P TP8 + 1D TP8" in labels
    best = result.recommended
    assert best.deployment.label == "1P TP8 PP2 + 1D TP8"
    prefill = [shlex.split(c) for what, c in best.launch.servers if what.startswith("prefill")]
    assert [argv[argv.index("--pp-size") + 1] for argv in prefill] == ["2", "2"]
    assert "pp: 2" in best.experiment_yaml


def test_a_chunk_never_enters_stage_0_before_its_request_is_ready():
    """A step planned back to back enters stage 0 when the previous chunk left it, but not
    before its new request finished its bootstrap (its sender's ready_s)."""
    clock = [0.0]
    executor = PipelineExecutor(_PerToken(), 3, lambda: clock[0])

    def step(tokens: int, ready_s: float | None = None) -> float:
        segments = [] if ready_s is None else [
            SimpleNamespace(req=SimpleNamespace(sender=SimpleNamespace(ready_s=ready_s)))]
        batch = SimpleNamespace(shape=BatchShape(prefill_tokens=tokens), kv_moves=[],
                                segments=segments)
        duration = executor.execute([batch]).duration_s
        clock[0] += duration
        return duration

    assert step(1000) == pytest.approx(3.0)  # left stage 0 at 1 s, the last stage at 3 s
    # ready at 0.5 s, before stage 0 freed: it entered at 1 s and leaves one stage time later
    assert step(1000, ready_s=0.5) == pytest.approx(1.0)
    # ready at 3.9 s, after stage 0 freed at 2 s: it enters then and crosses all 3 stages
    assert step(1000, ready_s=3.9) == pytest.approx(3.9 + 3.0 - 4.0)


def test_a_prompt_arriving_behind_a_long_one_takes_its_own_pipeline_fill():
    """Llama-3.1-70B, TP 8 x PP 4: a one-chunk prompt that arrives as a 64k prompt's last chunk
    is about to leave the last stage enters stage 0 on arrival and takes its pp stage times from
    there; it cannot come out one stage time behind the long prompt, faster than it would
    alone."""
    cfg = parse_experiment(long_prefill(8, 4))

    def run(arrivals, lens):
        result = Simulation(build_cluster(cfg), cfg.seed).run(
            np.array(arrivals), np.array(lens), np.array([2] * len(lens)))
        assert all(r.status == "ok" for r in result.records)
        return sorted(result.records, key=lambda r: int(r.rid))

    (alone,) = run([0.0], [CHUNK_TOKENS])
    lone_s = alone.prefill_end_s - alone.prefill_start_s  # pp stage times
    (long,) = run([0.0], [8 * CHUNK_TOKENS])
    _, short = run([0.0, long.prefill_end_s - 0.05], [8 * CHUNK_TOKENS, CHUNK_TOKENS])
    assert short.prefill_end_s - short.arrival_s >= lone_s
    assert short.prefill_end_s - short.arrival_s == pytest.approx(lone_s, rel=0.02)
