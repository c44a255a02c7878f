"""SGLang's dynamic chunking for pipeline stages (`cluster.prefill.dynamic_chunking`,
--enable-dynamic-chunking): SGLang's chunk rule against an independent solve, the scheduler
cutting a request's later chunks by it (and only those), the simulator's fit to one stage's
step making the chunks' stage times even, the config's limits, import-sglang and the planner."""

from __future__ import annotations

from dataclasses import replace

import pytest
from configs import scheduler_config

from pdsim.config import ConfigError, parse_experiment
from pdsim.core.batch import BatchResult, extend_shape
from pdsim.core.chunking import DynamicChunking, prompt_chunks
from pdsim.core.request import Request
from pdsim.core.scheduler import ColocatedScheduler
from pdsim.explain import explain_step
from pdsim.planning import parse_plan
from pdsim.planning.candidates import Candidate, RoleShape, enumerate_deployments
from pdsim.planning.import_sglang import import_sglang
from pdsim.planning.launch import sglang_commands
from pdsim.sim.build import build_cluster
from pdsim.sim.cluster import Simulation
from pdsim.sim.pipeline import pipelined_s, profile_lengths
from pdsim.specs.models import load_model_spec
from pdsim.workload import generate

A, B = 6e-11, 1e-5  # a forward of l tokens: a·l² + b·l seconds (plus a constant)
BASE = 24576
PROMPT = 130_048  # 127k: with its output, inside Llama-3.1's 131,072-token context


def solve_by_bisection(history: int, base: int) -> tuple[float, float]:
    """Bounds, a millionth of a token apart, on the x with f(history + x) - f(history) =
    f(base) - f(0), found without the closed form."""
    def f(l: float) -> float:
        return A * l * l + B * l

    target = f(base) - f(0)
    lo, hi = 0.0, float(base) + 1
    while hi - lo > 1e-6:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if f(history + mid) - f(history) < target else (lo, mid)
    return lo, hi


@pytest.mark.parametrize("history", [0, 24576, 65536, 100000])
@pytest.mark.parametrize("smooth", [1.0, 0.75, 0.0])
def test_the_chunk_after_a_prefix_is_sglangs_smoothed_aligned_solution(history, smooth):
    dyn = DynamicChunking(A, B, BASE, smooth, page_size=16, max_tokens=65536)
    aligned = {max(int(BASE + smooth * (x - BASE)), BASE // 4) // 64 * 64  # max(page, 64)
               for x in solve_by_bisection(history, BASE)}
    assert dyn.chunk_after(history) in aligned
    if history == 0 or smooth == 0:
        assert dyn.chunk_after(history) == BASE


def test_a_chunk_is_never_below_a_quarter_of_the_base_and_at_most_the_token_budget():
    dyn = DynamicChunking(A, B, BASE, 1.0, page_size=16, max_tokens=65536)
    assert dyn.chunk_after(10_000_000) == BASE // 4
    assert DynamicChunking(A, B, BASE, 1.0, page_size=256, max_tokens=65536).chunk_after(
        10_000_000) == BASE // 4 // 256 * 256
    assert DynamicChunking(A, B, BASE, 1.0, page_size=16, max_tokens=10000).chunk_after(0) \
        == 10000 // 64 * 64
    with pytest.raises(ValueError, match="positive quadratic term"):
        DynamicChunking(0.0, B, BASE, 1.0, page_size=16, max_tokens=65536)


def test_the_scheduler_sizes_only_a_continuing_requests_chunks_dynamically():
    dyn = DynamicChunking(1e-4, 0.0, 1024, 1.0, page_size=4, max_tokens=4096)
    cfg = scheduler_config(num_pages=2048, page_size=4, max_prefill_tokens=4096,
                           chunked_prefill_size=1024)
    sched = ColocatedScheduler(replace(cfg, dynamic_chunking=dyn))
    long_one = Request("r0", 3000, 2)
    sched.add_request(long_one, 0.0)
    sizes, now = [], 0.0
    while long_one.prefill_end_s != long_one.prefill_end_s:
        batch = sched.step(now)
        sizes.append(batch.shape.prefill_tokens)
        now += 1.0
        sched.on_batch_done(batch, BatchResult(1.0), now)
    # a pure quadratic: after 1024 tokens, 1024 (sqrt 2 - 1) = 424, aligned down to 64s
    assert sizes[:2] == [1024, 384] and sizes == sorted(sizes, reverse=True)
    assert sizes == [n for _, n in prompt_chunks(3000, 1024, dyn)]
    # a new request (no earlier chunk) always starts at the base
    sched.add_request(Request("r1", 2000, 2), now)
    batch = sched.step(now)
    assert batch.kind == "extend" and batch.shape.prefill_tokens == 1024


def pipelined(smooth: float | None, chunk: int = BASE) -> dict:
    """One 128k-token prompt of Llama-3.1-70B on H100s through a TP 8 x PP 4 prefill."""
    prefill = {"instances": 1, "tp": 8, "pp": 4,
               "scheduler": {"chunked_prefill_size": chunk, "max_prefill_tokens": 32768}}
    if smooth is not None:
        prefill["dynamic_chunking"] = {"smooth_factor": smooth}
    return {"name": "dyn", "seed": 0, "model": "llama-3.1-70b", "hardware": "h100",
            "cluster": {"prefill": prefill, "decode": {"instances": 1, "tp": 8}},
            "workload": {"num_requests": 1, "seed": 0,
                         "arrival": {"process": "constant", "rate_rps": 1},
                         "input_len": {"dist": "fixed", "value": PROMPT},
                         "output_len": {"dist": "fixed", "value": 2}}}


def stage_times(data: dict) -> tuple[list[int], list[float], object]:
    spec = build_cluster(parse_experiment(data)).prefill
    sched, cost = spec.scheduler, spec.cost()
    chunks = prompt_chunks(PROMPT, sched.chunked_prefill_size, sched.dynamic_chunking)
    return [n for _, n in chunks], [cost.step_time_s([extend_shape(n, c)]) for c, n in chunks], \
        sched


def test_sglangs_profile_spans_a_chunk_and_a_quarter_in_127_prompts():
    lengths = profile_lengths(8192)
    assert len(lengths) == 127 and lengths[0] == 10160 and lengths[-1] == 80
    assert lengths == sorted(lengths, reverse=True)


def test_dynamic_chunks_even_out_the_stage_times_that_fixed_chunks_let_grow():
    fixed_sizes, fixed, _ = stage_times(pipelined(None))
    sizes, even, sched = stage_times(pipelined(1.0))
    assert set(fixed_sizes[:-1]) == {BASE} and fixed[-2] > 1.8 * fixed[0]
    # every chunk but the remainder costs what the first does, within 3 %
    assert sizes[0] == BASE and sizes == sorted(sizes, reverse=True)[:-1] + sizes[-1:]
    assert max(even[:-1]) < 1.03 * even[0] and min(even[:-1]) == pytest.approx(even[0])
    assert sched.dynamic_chunking.smooth == 1.0
    # SGLang's default smoothing moves chunks three quarters of the way
    sizes_75, _, _ = stage_times(pipelined(0.75))
    assert all(s75 >= s for s75, s in zip(sizes_75[1:-1], sizes[1:-1]))


def test_the_simulated_prefill_runs_the_dynamic_chunks_through_the_pipeline():
    data = pipelined(0.65, chunk=12288)  # SGLang's published setting: 12k at a 0.65 smooth
    sizes, times, _ = stage_times(data)
    cfg = parse_experiment(data)
    wl = generate(cfg.workload)
    result = Simulation(build_cluster(cfg), cfg.seed).run(wl.arrival_s, wl.input_tokens,
                                                            wl.output_tokens)
    (rec,) = result.records
    assert len(sizes) > PROMPT // 12288 + 1  # later chunks are smaller than 12k
    assert rec.prefill_end_s - rec.prefill_start_s == pytest.approx(pipelined_s(times, 4),
                                                                      rel=1e-9)


def test_explain_prices_and_names_the_dynamic_chunks():
    got = explain_step(parse_experiment(pipelined(0.75)), role="prefill", prompt=PROMPT)
    sizes, times, _ = stage_times(pipelined(0.75))
    assert [shapes[0].prefill_tokens for shapes in got.steps] == sizes
    assert f"dynamic chunking: {' → '.join(map(str, sizes))}" in got.step
    assert got.step_s == pytest.approx(sum(times), rel=1e-9)


@pytest.mark.parametrize("change, message", [
    ({"pp": 1}, "dynamic_chunking sizes chunks for pipeline stages .* needs pp > 1, got pp=1"),
    ({"scheduler": {"chunked_prefill_size": 0}}, "chunked_prefill_size, which is 0"),
    ({"dynamic_chunking": {"smooth_factor": 1.5}}, "smooth_factor"),
])
def test_dynamic_chunking_outside_its_scope_is_refused_naming_why(change, message):
    data = pipelined(0.75)
    data["cluster"]["prefill"].update(change)
    with pytest.raises(ConfigError, match=message):
        parse_experiment(data)


def test_true_takes_sglangs_default_smooth_factor():
    data = pipelined(None)
    data["cluster"]["prefill"]["dynamic_chunking"] = True
    assert parse_experiment(data).cluster.prefill.dynamic_chunking.smooth_factor == 0.75
    data["cluster"]["prefill"]["dynamic_chunking"] = False
    assert parse_experiment(data).cluster.prefill.dynamic_chunking is None


def test_import_sglang_reads_the_flag_and_the_smooth_factor():
    base = {k: v for k, v in pipelined(None).items() if k != "cluster"}
    server = ("python -m sglang.launch_server --model-path llama-3.1-70b --tp-size 8 "
              "--pp-size 4 --chunked-prefill-size 12288 --enable-dynamic-chunking "
              "--disaggregation-mode prefill --port 30000")
    decode = ("python -m sglang.launch_server --model-path llama-3.1-70b --tp-size 8 "
              "--disaggregation-mode decode --port 30001")
    router = ("python -m sglang_router.launch_router --pd-disaggregation --prefill "
              "http://127.0.0.1:30000 --decode http://127.0.0.1:30001")
    script = "\n".join([f"SGLANG_DYNAMIC_CHUNKING_SMOOTH_FACTOR=0.65 {server}", decode, router])
    imported, _ = import_sglang(script, base)
    assert imported["cluster"]["prefill"]["dynamic_chunking"] == {"smooth_factor": 0.65}
    assert parse_experiment(imported).cluster.prefill.dynamic_chunking.smooth_factor == 0.65
    flat = "\n".join([server.replace("--pp-size 4 ", ""), decode, router])
    imported, notes = import_sglang(flat, base)
    assert "dynamic_chunking" not in imported["cluster"]["prefill"]
    assert any("--enable-dynamic-chunking" in note for note in notes)


def test_the_planner_tries_dynamic_chunking_on_pipelined_prefills_and_launches_it():
    plan = parse_plan({
        "name": "long", "model": "llama-3.1-70b", "hardware": "h100",
        "workload": {"num_requests": 20, "seed": 0,
                     "arrival": {"process": "poisson", "rate_rps": 0.05},
                     "input_len": {"dist": "fixed", "value": 100_000},
                     "output_len": {"dist": "fixed", "value": 32}},
        "slo": {"ttft_p90_s": 20.0}, "max_gpus": 24,
        "search": {"tp": [8], "modes": ["disaggregated"], "pp": [1, 2],
                   "dynamic_chunking": [False, True]}})
    model = load_model_spec("llama-3.1-70b")
    prefills = {shape for dep in enumerate_deployments(plan, model, 24, (1, 2))
                for role, _, shape in dep.roles if role == "prefill"}
    assert prefills == {RoleShape(8), RoleShape(8, pp=2), RoleShape(8, pp=2, dynamic_chunking=True)}
    dep = Candidate("disaggregated", (("prefill", 1, RoleShape(8, pp=2, dynamic_chunking=True)),
                                      ("decode", 1, RoleShape(8))))
    assert dep.label == "1P TP8 PP2 DCK + 1D TP8"
    servers = sglang_commands(dep, plan, gpus_per_node=8).servers
    assert all(("--enable-dynamic-chunking" in command) == what.startswith("prefill")
               for what, command in servers)
    exp = parse_experiment(dep.experiment_data(plan))
    assert exp.cluster.prefill.dynamic_chunking.smooth_factor == 0.75
