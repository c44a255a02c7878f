"""Seeded workloads: synthetic processes and distributions, trace replay, config errors."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Literal

import numpy as np
import pytest
import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from pdsim.workload import (
    ARRIVAL_PROCESSES,
    LENGTH_DISTRIBUTIONS,
    ArrivalProcess,
    PoissonArrival,
    Registry,
    SyntheticWorkload,
    TraceNotFoundError,
    TraceWorkload,
    Workload,
    WorkloadConfig,
    WorkloadError,
    generate,
    parse_workload_config,
    read_azure,
    read_mooncake,
    read_mooncake_hash_ids,
    read_trace,
)

REPO = Path(__file__).resolve().parents[1]

MOONCAKE_CONV = "conversation_trace.jsonl"
AZURE_CONV = "AzureLLMInferenceTrace_conv.csv"
AZURE_CODE = "AzureLLMInferenceTrace_code.csv"


def synthetic(**overrides) -> dict:
    config = {
        "num_requests": 1000,
        "seed": 7,
        "arrival": {"process": "poisson", "rate_rps": 5.0},
        "input_len": {"dist": "uniform", "low": 10, "high": 100},
        "output_len": {"dist": "fixed", "value": 32},
    }
    config.update(overrides)
    return config


def gaps(workload: Workload) -> np.ndarray:
    return np.diff(workload.arrival_s)


def cv(values: np.ndarray) -> float:
    return float(values.std() / values.mean())


# --- determinism -------------------------------------------------------------------------------


def test_same_seed_gives_identical_arrays_and_different_seed_differs():
    config = synthetic(input_len={"dist": "lognormal", "mean": 500, "cv": 1.5, "max": 8000})
    a, b = generate(config), generate(config)
    assert a == b
    np.testing.assert_array_equal(a.arrival_s, b.arrival_s)
    np.testing.assert_array_equal(a.input_tokens, b.input_tokens)

    c = generate({**config, "seed": 8})
    assert not np.array_equal(a.arrival_s, c.arrival_s)
    assert not np.array_equal(a.input_tokens, c.input_tokens)


def test_a_workload_without_a_seed_draws_from_seed_zero():
    config = synthetic()
    del config["seed"]
    assert generate(config) == generate({**config, "seed": 0})
    assert generate(config) != generate(synthetic())  # seed 7


def test_each_component_has_its_own_stream():
    """Changing the output distribution leaves arrivals and inputs exactly as they were."""
    a = generate(synthetic())
    b = generate(synthetic(output_len={"dist": "uniform", "low": 1, "high": 900}))
    np.testing.assert_array_equal(a.arrival_s, b.arrival_s)
    np.testing.assert_array_equal(a.input_tokens, b.input_tokens)
    assert not np.array_equal(a.output_tokens, b.output_tokens)


def test_generate_accepts_a_parsed_config():
    config = parse_workload_config(synthetic())
    assert isinstance(config, SyntheticWorkload)
    assert generate(config) == generate(synthetic())


# --- arrival processes -------------------------------------------------------------------------


def test_poisson_rate_and_unit_cv():
    w = generate(synthetic(num_requests=20_000, arrival={"process": "poisson", "rate_rps": 8.0}))
    assert w.arrival_s[0] == 0.0
    assert np.all(gaps(w) >= 0)
    assert w.mean_rate_rps == pytest.approx(8.0, rel=0.03)
    assert cv(gaps(w)) == pytest.approx(1.0, rel=0.05)


def test_gamma_cv_matches_request():
    w = generate(synthetic(num_requests=20_000, arrival={"process": "gamma", "rate_rps": 3.0, "cv": 2.0}))
    assert cv(gaps(w)) == pytest.approx(2.0, rel=0.10)
    assert w.mean_rate_rps == pytest.approx(3.0, rel=0.05)


def test_gamma_with_cv_one_behaves_like_poisson():
    w = generate(synthetic(num_requests=20_000, arrival={"process": "gamma", "rate_rps": 2.0, "cv": 1.0}))
    assert cv(gaps(w)) == pytest.approx(1.0, rel=0.05)


def test_constant_arrivals_have_zero_variance():
    w = generate(synthetic(num_requests=101, arrival={"process": "constant", "rate_rps": 4.0}))
    np.testing.assert_allclose(gaps(w), 0.25)
    assert gaps(w).var() == pytest.approx(0.0, abs=1e-20)
    assert w.duration_s == pytest.approx(25.0)
    assert w.mean_rate_rps == pytest.approx(4.0)


# --- length distributions ----------------------------------------------------------------------


def test_fixed_lengths():
    w = generate(synthetic(input_len={"dist": "fixed", "value": 123}))
    assert set(w.input_tokens.tolist()) == {123}
    assert w.input_tokens.dtype == np.int64


def test_uniform_bounds_hold_and_include_both_ends():
    w = generate(synthetic(num_requests=20_000, input_len={"dist": "uniform", "low": 3, "high": 9}))
    assert w.input_tokens.min() == 3
    assert w.input_tokens.max() == 9
    assert w.input_tokens.mean() == pytest.approx(6.0, rel=0.02)


@pytest.mark.parametrize(("ratio", "low"), [(None, 1), (0.0, 1), (0.5, 512), (0.25, 256), (1.0, 1024)])
def test_sglang_random_lengths_are_bench_servings(ratio, low):
    """bench_serving --dataset-name random: uniform integers in [max(int(len * ratio), 1), len];
    its default ratio, 0, gives 1..len (mean ~len/2), not len."""
    spec = {"dist": "sglang_random", "len": 1024} | ({} if ratio is None else {"range_ratio": ratio})
    w = generate(synthetic(num_requests=20_000, input_len=spec, output_len=spec))
    for lengths in (w.input_tokens, w.output_tokens):
        assert lengths.min() == low and lengths.max() == 1024
        assert lengths.mean() == pytest.approx((low + 1024) / 2, rel=0.02)
    # the same numbers as `uniform` over the bounds bench_serving derives
    same = generate(synthetic(num_requests=20_000, input_len={"dist": "uniform", "low": low, "high": 1024}))
    assert np.array_equal(same.input_tokens, w.input_tokens)


@pytest.mark.parametrize("bad", [{"range_ratio": 1.5}, {"range_ratio": -0.1}, {"len": 0}])
def test_sglang_random_refuses_what_bench_serving_cannot_draw(bad):
    with pytest.raises(ValidationError):
        generate(synthetic(input_len={"dist": "sglang_random", "len": 1024} | bad))


@pytest.mark.parametrize("spread", [{"cv": 1.0}, {"cv": 0.5}, {"sigma": 0.8}])
def test_lognormal_mean_is_the_distribution_mean(spread):
    dist = {"dist": "lognormal", "mean": 2000, **spread}
    w = generate(synthetic(num_requests=50_000, input_len=dist))
    assert w.input_tokens.mean() == pytest.approx(2000, rel=0.03)
    if "cv" in spread:
        assert cv(w.input_tokens.astype(float)) == pytest.approx(spread["cv"], rel=0.10)
    else:
        assert np.log(w.input_tokens).std() == pytest.approx(spread["sigma"], rel=0.03)


def test_lognormal_clips_to_min_and_max():
    dist = {"dist": "lognormal", "mean": 1000, "cv": 3.0, "min": 50, "max": 4000}
    w = generate(synthetic(num_requests=20_000, input_len=dist))
    assert w.input_tokens.min() == 50
    assert w.input_tokens.max() == 4000


def test_empirical_draws_only_trace_values(traces):
    trace = read_mooncake(traces / MOONCAKE_CONV)
    config = synthetic(
        num_requests=5000,
        input_len={"dist": "empirical", "path": MOONCAKE_CONV, "column": "input"},
        output_len={"dist": "empirical", "path": str(traces / AZURE_CONV), "column": "output"},
    )
    w = generate(config, base_dir=traces)
    assert np.isin(w.input_tokens, trace.input_tokens).all()
    assert np.isin(w.output_tokens, read_azure(traces / AZURE_CONV).output_tokens).all()
    assert len(np.unique(w.input_tokens)) > 1000  # resampled, not one value repeated
    assert w.input_tokens.mean() == pytest.approx(trace.input_tokens.mean(), rel=0.05)


# --- traces ------------------------------------------------------------------------------------


def test_mooncake_conversation_trace(traces):
    w = generate({"trace": MOONCAKE_CONV}, base_dir=traces)
    assert len(w) == 12_031
    assert w.arrival_s[0] == 0.0
    assert w.duration_s == pytest.approx(3536.999)
    assert w.input_tokens.mean() == pytest.approx(12_035.1, abs=0.1)
    assert w.output_tokens.mean() == pytest.approx(342.6, abs=0.1)
    assert (w.input_tokens.min(), w.input_tokens.max()) == (891, 126_195)
    assert w.mean_rate_rps == pytest.approx(3.40, abs=0.01)


def test_mooncake_hash_ids_line_up_with_rows(traces):
    w = read_mooncake(traces / MOONCAKE_CONV)
    hash_ids = read_mooncake_hash_ids(traces / MOONCAKE_CONV)
    assert len(hash_ids) == len(w)
    blocks = np.array([len(h) for h in hash_ids])
    np.testing.assert_array_equal(blocks, -(-w.input_tokens // 512))


def test_azure_conversation_trace(traces):
    w = generate({"trace": AZURE_CONV}, base_dir=traces)
    assert len(w) == 19_366
    assert w.duration_s == pytest.approx(3501.721937, abs=1e-6)
    assert w.input_tokens.mean() == pytest.approx(1154.7, abs=0.1)
    assert w.output_tokens.mean() == pytest.approx(211.1, abs=0.1)


def test_azure_code_trace(traces):
    w = read_trace(traces / AZURE_CODE)
    assert len(w) == 8819
    assert w.duration_s == pytest.approx(3435.9, abs=0.1)


def test_azure_keeps_all_seven_fraction_digits(tmp_path):
    path = tmp_path / "tiny.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,374,44\n"
        "2023-11-16 18:15:47.6805901,10,2\n"
        "2023-11-16 18:16:00.0000000,5,1\n"
    )
    w = read_azure(path)
    np.testing.assert_allclose(w.arrival_s, [0.0, 1.0000001, 13.31941], rtol=0, atol=1e-9)
    np.testing.assert_array_equal(w.input_tokens, [374, 10, 5])


def test_format_auto_sniffs_the_first_line(tmp_path):
    mooncake = tmp_path / "trace.log"
    mooncake.write_text(
        '{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [0, 1]}\n'
        '{"timestamp": 1500, "input_length": 7, "output_length": 9, "hash_ids": [2]}\n'
    )
    azure = tmp_path / "trace.dat"
    azure.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.0000000,3,4\n")
    w = generate({"trace": str(mooncake)})
    np.testing.assert_array_equal(w.arrival_s, [0.0, 1.5])
    np.testing.assert_array_equal(w.output_tokens, [5, 9])
    assert len(generate({"trace": str(azure)})) == 1

    other = tmp_path / "trace.txt"
    other.write_text("a,b,c\n1,2,3\n")
    with pytest.raises(WorkloadError, match="format"):
        generate({"trace": str(other)})


def test_doubling_the_rate_halves_the_duration(traces):
    native = generate({"trace": MOONCAKE_CONV}, base_dir=traces)
    doubled = generate({"trace": MOONCAKE_CONV, "rate_scale": 2.0}, base_dir=traces)
    assert doubled.duration_s == pytest.approx(native.duration_s / 2)
    assert doubled.mean_rate_rps == pytest.approx(2 * native.mean_rate_rps)
    np.testing.assert_array_equal(doubled.input_tokens, native.input_tokens)
    assert native.scaled(2.0) == doubled

    targeted = generate({"trace": AZURE_CONV, "target_rate_rps": 11.0}, base_dir=traces)
    assert targeted.mean_rate_rps == pytest.approx(11.0)


def test_trace_window_drop_and_head(traces):
    full = read_trace(traces / MOONCAKE_CONV)
    config = {"trace": MOONCAKE_CONV, "start_s": 600, "max_input_tokens": 32_768, "num_requests": 1000}
    w = generate(config, base_dir=traces)
    assert len(w) == 1000
    assert w.input_tokens.max() <= 32_768
    assert w.arrival_s[0] >= 0.0

    in_window = full.arrival_s >= 600
    rows = np.flatnonzero(in_window & (full.input_tokens <= 32_768))[:1000]
    np.testing.assert_allclose(w.arrival_s, full.arrival_s[rows] - 600)
    np.testing.assert_array_equal(w.input_tokens, full.input_tokens[rows])
    dropped = np.count_nonzero(in_window[: rows[-1] + 1] & (full.input_tokens[: rows[-1] + 1] > 32_768))
    assert w.num_dropped == dropped > 0

    assert generate({"trace": MOONCAKE_CONV, "num_requests": 50}, base_dir=traces) == full.head(50)


def test_asking_for_more_requests_than_the_trace_holds_fails(traces):
    with pytest.raises(WorkloadError, match=r"num_requests.*12031"):
        generate({"trace": MOONCAKE_CONV, "num_requests": 20_000}, base_dir=traces)
    with pytest.raises(WorkloadError, match="start_s"):
        generate({"trace": MOONCAKE_CONV, "start_s": 1e6}, base_dir=traces)


def test_relative_paths_resolve_against_base_dir_then_cwd(traces, tmp_path, monkeypatch):
    via_base = generate({"trace": f"traces/{AZURE_CONV}"}, base_dir=traces.parent)
    monkeypatch.chdir(traces.parent)
    via_cwd = generate({"trace": f"traces/{AZURE_CONV}"}, base_dir=tmp_path)
    assert via_base == via_cwd


# --- configs and errors ------------------------------------------------------------------------


def test_yaml_shapes_parse_and_round_trip(traces):
    document = yaml.safe_load(
        f"""
        workload:
          num_requests: 500
          seed: 3
          arrival: {{process: gamma, rate_rps: 4.0, cv: 2.0}}
          input_len: {{dist: lognormal, mean: 2048, cv: 1.0, min: 16, max: 32768}}
          output_len: {{dist: empirical, path: {MOONCAKE_CONV}, column: output}}
        """
    )
    config = parse_workload_config(document["workload"])
    assert isinstance(config, SyntheticWorkload)
    assert config.arrival.process == "gamma" and config.arrival.cv == 2.0
    assert parse_workload_config(config.model_dump()) == config
    assert len(generate(config, base_dir=traces)) == 500

    replay = parse_workload_config(yaml.safe_load(f"trace: {AZURE_CONV}\nformat: azure\nrate_scale: 1.5"))
    assert isinstance(replay, TraceWorkload)
    assert parse_workload_config(replay.model_dump()) == replay


def test_config_is_frozen():
    config = parse_workload_config(synthetic())
    with pytest.raises(ValidationError):
        config.seed = 3
    with pytest.raises(ValidationError):
        config.arrival.rate_rps = 1.0


@pytest.mark.parametrize(
    ("change", "field", "text"),
    [
        ({"burst": 2}, "burst", "Extra inputs"),
        ({"arrival": {"process": "poisson", "rate_rps": 1, "cv": 2}}, "arrival.cv", "Extra inputs"),
        ({"arrival": {"process": "weibull", "rate_rps": 1}}, "arrival.process", "allowed: closed, constant, diurnal, gamma"),
        ({"arrival": {"rate_rps": 1}}, "arrival.process", "Field required"),
        ({"arrival": {"process": "poisson", "rate_rps": -2}}, "arrival.rate_rps", "greater than 0"),
        ({"arrival": {"process": "gamma", "rate_rps": 1, "cv": 0}}, "arrival.cv", "greater than 0"),
        ({"arrival": {"process": "gamma", "rate_rps": 1, "cv": -1.5}}, "arrival.cv", "greater than 0"),
        ({"input_len": {"dist": "pareto", "alpha": 2}}, "input_len.dist", "allowed: empirical, fixed"),
        ({"input_len": {"dist": "uniform", "low": 50, "high": 10}}, "input_len", r"low \(50\) must be <= high"),
        ({"input_len": {"dist": "fixed", "value": 0}}, "input_len.value", "greater than or equal to 1"),
        ({"output_len": {"dist": "lognormal", "mean": 100}}, "output_len", "exactly one of sigma or cv"),
        ({"output_len": {"dist": "lognormal", "mean": 9, "cv": 1, "sigma": 1}}, "output_len", "exactly one"),
        ({"output_len": {"dist": "empirical", "path": "x", "column": "both"}}, "output_len.column", "'input'"),
        ({"num_requests": 0}, "num_requests", "greater than or equal to 1"),
    ],
)
def test_bad_synthetic_configs_name_the_field(change, field, text):
    with pytest.raises(ValidationError) as info:
        parse_workload_config(synthetic(**change))
    message = str(info.value)
    assert f"\n{field}\n" in message, message
    assert re.search(text, message), message


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ({"trace": "a.jsonl", "rate_scale": -1}, "rate_scale"),
        ({"trace": "a.jsonl", "target_rate_rps": 0}, "target_rate_rps"),
        ({"trace": "a.jsonl", "format": "parquet"}, "format"),
        ({"trace": "a.jsonl", "num_requests": 10, "seed": 1, "shuffle": True}, "shuffle"),
    ],
)
def test_bad_trace_configs_name_the_field(config, field):
    with pytest.raises(ValidationError, match=f"\n{field}\n"):
        parse_workload_config(config)
    with pytest.raises(ValidationError, match="at most one of rate_scale or target_rate_rps"):
        parse_workload_config({"trace": "a.jsonl", "rate_scale": 2, "target_rate_rps": 3})


def test_errors_carry_the_path_inside_an_experiment_config():
    class Experiment(BaseModel):
        model_config = ConfigDict(extra="forbid", frozen=True)
        workload: WorkloadConfig

    with pytest.raises(ValidationError, match=r"workload\.arrival\.rate_rps"):
        Experiment.model_validate({"workload": synthetic(arrival={"process": "constant", "rate_rps": -1})})
    experiment = Experiment.model_validate({"workload": {"trace": "t.csv"}})
    assert isinstance(experiment.workload, TraceWorkload)


def test_missing_trace_file_names_field_and_path(tmp_path):
    with pytest.raises(TraceNotFoundError, match=r"workload\.trace: .*'nope\.jsonl'.*" + str(tmp_path)):
        generate({"trace": "nope.jsonl"}, base_dir=tmp_path)
    bad_empirical = synthetic(input_len={"dist": "empirical", "path": "gone.csv", "column": "input"})
    with pytest.raises(FileNotFoundError, match=r"workload\.input_len\.path: .*'gone\.csv'"):
        generate(bad_empirical, base_dir=tmp_path)


# --- registries --------------------------------------------------------------------------------


def test_registering_a_name_twice_raises():
    class AnotherPoisson(ArrivalProcess):
        process: Literal["poisson"] = "poisson"

    with pytest.raises(ValueError, match="'poisson' is already registered"):
        ARRIVAL_PROCESSES.register(AnotherPoisson)
    assert ARRIVAL_PROCESSES["poisson"] is PoissonArrival
    assert LENGTH_DISTRIBUTIONS.names() == ("empirical", "fixed", "lognormal", "sglang_random",
                                            "uniform")


def test_a_registry_parses_what_was_registered_in_it():
    registry: Registry[ArrivalProcess] = Registry("arrival process", "process")

    @registry.register
    class Burst(ArrivalProcess):
        process: Literal["burst"] = "burst"
        size: int

    assert registry.parse({"process": "burst", "rate_rps": 2, "size": 4}) == Burst(rate_rps=2, size=4)
    with pytest.raises(KeyError, match="allowed: burst"):
        registry["poisson"]
    with pytest.raises(TypeError, match="Literal"):

        @registry.register
        class Untagged(ArrivalProcess):
            pass


# --- the Workload value ------------------------------------------------------------------------


def test_workload_checks_its_arrays():
    with pytest.raises(WorkloadError, match="non-decreasing"):
        Workload([0.0, 2.0, 1.0], [1, 1, 1], [1, 1, 1])
    with pytest.raises(WorkloadError, match="output_tokens must be >= 1; request 1"):
        Workload([0.0, 1.0], [5, 5], [3, 0])
    with pytest.raises(WorkloadError, match="differ in length"):
        Workload([0.0], [1, 2], [1, 2])
    with pytest.raises(WorkloadError, match="whole numbers"):
        Workload([0.0], [1.5], [1])


def test_workload_is_read_only_and_helpers_work():
    source = np.array([0.0, 1.0, 3.0])
    w = Workload(source, [4, 5, 6], [1, 2, 3])
    source[0] = 9.0
    assert w.arrival_s[0] == 0.0  # copied
    with pytest.raises(ValueError):
        w.input_tokens[0] = 7
    assert len(w.head(2)) == 2 and w.head(2).duration_s == 1.0
    assert w.mean_rate_rps == pytest.approx(2 / 3)
    assert w.scaled(3.0).duration_s == pytest.approx(1.0)
    assert list(w.to_frame().columns) == ["arrival_s", "input_tokens", "output_tokens"]
    assert np.isnan(Workload([], [], []).mean_rate_rps)


def test_the_package_stays_backend_free():
    code = "import sys, pdsim.workload; print(sorted({'simpy', 'torch', 'zmq'} & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert result.stdout.strip() == "[]"
