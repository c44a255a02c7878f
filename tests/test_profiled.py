"""The profiled cost model: fitted to measured forwards, it reproduces their law; fitted to the
real executor's timings it predicts held-out forwards; an experiment can use it by name."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from pdsim.config import ConfigError, parse_experiment
from pdsim.core.batch import BatchShape
from pdsim.sim.build import build_cluster
from pdsim.sim.cost import Parallelism, make_cost_model
from pdsim.sim.profiled import fit_linear_costs
from pdsim.specs import load_hardware_spec, load_model_spec

LAW = dict(extend=2e-3, decode=1e-3, a=5e-6, b=1e-9, c=2e-5, d=3e-8)


def synthetic_timings(n: int = 400, noise: float = 0.0, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        if rng.random() < 0.3:
            p = int(rng.integers(1, 2048))
            pairs = p * (p + 1) / 2 + p * int(rng.integers(0, 1024))
            d, ctx = 0, 0
            t = LAW["extend"] + LAW["a"] * p + LAW["b"] * pairs
        else:
            p, pairs = 0, 0.0
            d = int(rng.integers(1, 64))
            ctx = d * int(rng.integers(16, 2048))
            t = LAW["decode"] + LAW["c"] * d + LAW["d"] * ctx
        rows.append(dict(kind="extend" if p else "decode", prefill_tokens=p,
                         prefill_attn_pairs=pairs, decode_reqs=d, decode_context_tokens=ctx,
                         duration_s=t * (1 + noise * rng.standard_normal())))
    return pd.DataFrame(rows)


def model_for(timings):
    return make_cost_model("profiled", load_model_spec("tiny-llama"), load_hardware_spec("h100"),
                           Parallelism(), timings=timings)


def test_fit_recovers_a_known_law():
    e, d, slopes = fit_linear_costs(synthetic_timings())
    assert e == pytest.approx(LAW["extend"], rel=1e-6) and d == pytest.approx(LAW["decode"], rel=1e-6)
    assert slopes == pytest.approx([LAW["a"], LAW["b"], LAW["c"], LAW["d"]], rel=1e-5)


def test_predictions_are_close_under_noise_and_never_negative():
    cost = model_for(synthetic_timings(noise=0.05))
    shape = BatchShape(decode_reqs=32, decode_context_tokens=32 * 1000)
    truth = LAW["decode"] + 32 * LAW["c"] + 32000 * LAW["d"]
    assert cost.step_time_s([shape]) == pytest.approx(truth, rel=0.05)
    assert cost.step_time_s([BatchShape()]) == 0.0
    two = cost.step_time_s([shape, BatchShape(decode_reqs=1, decode_context_tokens=10)])
    assert two == cost.step_time_s([shape])  # DP ranks: the slowest one sets the step


@pytest.mark.real
@pytest.mark.slow
def test_fit_to_real_executor_timings_predicts_held_out_forwards():
    import torch
    from configs import scheduler_config
    from pdsim.core.request import Request
    from pdsim.core.scheduler import ColocatedScheduler
    from runtime.executor import ModelExecutor
    from runtime.model import ModelConfig, build_model

    torch.set_num_threads(1)
    cfg = scheduler_config(512, page_size=16, max_prefill_tokens=512,
                           chunked_prefill_size=256)
    executor = ModelExecutor(build_model(ModelConfig.preset("tiny-llama"), seed=0),
                             num_pages=512, page_size=16)
    executor.warmup()
    sched = ColocatedScheduler(cfg)
    rng = np.random.default_rng(1)
    for i in range(24):
        n = int(rng.integers(16, 400))
        sched.add_request(Request(str(i), n, int(rng.integers(4, 40)),
                                  prompt_ids=[int(t) for t in rng.integers(0, 256, n)]), 0.0)
    while not sched.is_idle:
        batch = sched.step(0.0)
        sched.on_batch_done(batch, executor.forward(batch), 0.0)
    timings = executor.timings_frame()
    train, test = timings.iloc[::2], timings.iloc[1::2]
    cost = model_for(train)
    predicted = np.array([cost.step_time_s([BatchShape(r.prefill_tokens, r.prefill_attn_pairs,
                                                       r.decode_reqs, r.decode_context_tokens)])
                          for r in test.itertuples()])
    # CPU timings are noisy; the fit must still carry the bulk of the time.
    ratio = predicted.sum() / test["duration_s"].sum()
    print(f"predicted / measured = {ratio:.3f} over {len(test)} forwards")
    assert abs(ratio - 1) < 0.35


def test_an_experiment_names_its_timings_file_relative_to_itself(tmp_path):
    synthetic_timings().to_csv(tmp_path / "timings.csv", index=False)
    data = {"name": "p", "model": "tiny-llama", "cost_model": {"name": "profiled",
                                                                "params": {"timings": "timings.csv"}},
            "workload": {"num_requests": 5, "seed": 0, "arrival": {"process": "poisson", "rate_rps": 1},
                         "input_len": {"dist": "fixed", "value": 10},
                         "output_len": {"dist": "fixed", "value": 4}}}
    cfg = parse_experiment(data)
    cluster = build_cluster(cfg, str(tmp_path))
    assert cluster.prefill.cost().step_time_s([BatchShape(100, 5050.0)]) > LAW["extend"]
    with pytest.raises(ConfigError, match="cluster.prefill: no timings file"):
        build_cluster(parse_experiment({**data, "cost_model": {
            "name": "profiled", "params": {"timings": "missing.csv"}}}), str(tmp_path))


def test_overheads_per_step_and_per_token_streamed_and_per_role(tmp_path):
    """`step_overhead_s` adds to every step, `token_overhead_s` to every decode request in it;
    `roles` gives one role its own timings and overheads (a PD prefill worker streams nothing)."""
    timings = synthetic_timings()
    plain = model_for(timings)
    over = make_cost_model("profiled", load_model_spec("tiny-llama"), load_hardware_spec("h100"),
                           Parallelism(), timings=timings, step_overhead_s=1e-3,
                           token_overhead_s=2e-4, role="decode")
    for n in (1, 8, 32):
        shape = BatchShape(decode_reqs=n, decode_context_tokens=n * 100)
        assert over.step_time_s([shape]) == pytest.approx(
            plain.step_time_s([shape]) + 1e-3 + n * 2e-4, rel=1e-9)
    extend = BatchShape(prefill_tokens=64, prefill_attn_pairs=64 * 65 / 2)
    assert over.step_time_s([extend]) == pytest.approx(plain.step_time_s([extend]) + 1e-3)

    slower = timings.assign(duration_s=timings["duration_s"] * 3)
    slower.to_csv(tmp_path / "prefill.csv", index=False)
    timings.to_csv(tmp_path / "decode.csv", index=False)
    data = {"name": "p", "model": "tiny-llama", "cluster": {"mode": "disaggregated"},
            "cost_model": {"name": "profiled", "params": {
                "timings": "decode.csv", "step_overhead_s": 1e-3, "token_overhead_s": 2e-4,
                "roles": {"prefill": {"timings": "prefill.csv", "step_overhead_s": 5e-4,
                                      "token_overhead_s": 0}}}},
            "workload": {"num_requests": 5, "seed": 0,
                         "arrival": {"process": "poisson", "rate_rps": 1},
                         "input_len": {"dist": "fixed", "value": 10},
                         "output_len": {"dist": "fixed", "value": 4}}}
    cluster = build_cluster(parse_experiment(data), str(tmp_path))
    prefill, decode = cluster.prefill.cost(), cluster.decode.cost()
    assert prefill.step_time_s([extend]) == pytest.approx(3 * plain.step_time_s([extend]) + 5e-4,
                                                          rel=1e-6)
    assert decode.step_time_s([extend]) == pytest.approx(plain.step_time_s([extend]) + 1e-3,
                                                         rel=1e-6)
    bad = {**data["cost_model"]["params"], "roles": {"prefil": {"step_overhead_s": 0}}}
    with pytest.raises(ConfigError, match=r"unknown role\(s\) \['prefil'\]; allowed: prefill"):
        build_cluster(parse_experiment({**data, "cost_model": {"name": "profiled",
                                                               "params": bad}}), str(tmp_path))
    bad = {**data["cost_model"]["params"], "roles": {"decode": {"token_overhead": 0}}}
    with pytest.raises(ConfigError, match=r"roles.decode: unknown parameter\(s\)"):
        build_cluster(parse_experiment({**data, "cost_model": {"name": "profiled",
                                                               "params": bad}}), str(tmp_path))
