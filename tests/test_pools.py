"""Where simulations run (pdsim.pools): a sweep and a plan give the same tables on a local
Ray instance as in the local process pool, `pdsim run --executor ray` joins a running cluster,
and bad choices fail with a clear error."""

from __future__ import annotations

import subprocess
import sys

import pandas as pd
import pytest
import ray
import yaml

from pdsim.config import ConfigError
from pdsim.pools import InlinePool, open_pool
from pdsim.planning import parse_plan, plan
from pdsim.runner import run_experiment

pytestmark = [pytest.mark.slow]

SWEEP = {
    "name": "exec_sweep",
    "model": "llama-3.1-8b",
    "hardware": "h100",
    "cluster": {"prefill": {"instances": 1}, "decode": {"instances": 1}},
    "workload": {"num_requests": 60, "seed": 3, "arrival": {"process": "poisson", "rate_rps": 8},
                 "input_len": {"dist": "lognormal", "mean": 1500, "cv": 0.6, "min": 64, "max": 6000},
                 "output_len": {"dist": "uniform", "low": 10, "high": 120}},
    "sweep": {"cluster.prefill.instances,cluster.decode.instances": [[1, 2], [2, 1]],
              "workload.arrival.rate_rps": [8, 16]},
}

PLAN = {
    "name": "exec_plan",
    "model": "llama-3.1-8b",
    "hardware": "h100",
    "workload": {"num_requests": 80, "seed": 1, "arrival": {"process": "poisson", "rate_rps": 40},
                 "input_len": {"dist": "lognormal", "mean": 1024, "cv": 0.5, "min": 64, "max": 4096},
                 "output_len": {"dist": "lognormal", "mean": 64, "cv": 0.5, "min": 8, "max": 256}},
    "slo": {"ttft_p90_s": 0.5, "itl_p90_s": 0.02},
    "max_gpus": 3,
    "search": {"tp": [1, 2], "cost_slack": 2.0},  # the cheapest meets the SLO: simulate more
}


@pytest.fixture(scope="module")
def ray_address():
    """One local Ray instance for the module (pdsim's pools reuse an initialised Ray)."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


def test_sweep_on_ray_equals_the_process_pool(tmp_path, ray_address):
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(SWEEP))
    local, _ = run_experiment(path, tmp_path / "local", jobs=2, progress=False)
    remote, out = run_experiment(path, tmp_path / "ray", progress=False, executor="ray")
    assert len(local) == 4 and local["completed"].gt(0).all()
    pd.testing.assert_frame_equal(local, remote)  # no wall-clock column: all simulated time
    pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "local" / "requests.parquet"),
                                  pd.read_parquet(out / "requests.parquet"))


def test_plan_on_ray_equals_the_process_pool(ray_address):
    local = plan(parse_plan(PLAN), write=False, jobs=2)
    remote = plan(parse_plan(PLAN), write=False, executor="ray")
    assert local.candidates["simulated"].sum() >= 2
    pd.testing.assert_frame_equal(local.candidates, remote.candidates)
    pd.testing.assert_frame_equal(local.frontier, remote.frontier)
    assert (local.recommended is None) == (remote.recommended is None)
    if local.recommended is not None:
        assert local.recommended.deployment == remote.recommended.deployment


def test_cli_run_joins_a_running_ray_cluster(tmp_path, ray_address):
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump({**SWEEP, "sweep": {
        "workload.arrival.rate_rps": [8, 16]}}))
    proc = subprocess.run([sys.executable, "-m", "pdsim.cli", "run", "sweep.yaml", "--quiet",
                           "--executor", "ray", "--ray-address", ray_address],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    summary = pd.read_csv(tmp_path / "results" / "exec_sweep" / "summary.csv")
    assert list(summary["request_rate"]) == [8, 16] and summary["completed"].gt(0).all()


def test_bad_executor_choices_name_the_value(tmp_path):
    with pytest.raises(ConfigError, match="executor: 'dask'; allowed: local, ray"):
        with open_pool("dask"):
            pass
    with pytest.raises(ConfigError, match="ray_address 'auto' given with executor 'local'"):
        with open_pool("local", ray_address="auto"):
            pass
    with pytest.raises(ConfigError, match="jobs: 0"):
        with open_pool("local", jobs=0):
            pass
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump(SWEEP))
    proc = subprocess.run([sys.executable, "-m", "pdsim.cli", "run", "sweep.yaml", "--executor",
                           "dask"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "allowed: local, ray" in proc.stderr


def test_without_ray_installed_the_error_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(ConfigError, match=r"pip install 'pdsim\[ray\]'"):
        with open_pool("ray"):
            pass


def test_one_local_worker_runs_tasks_inline_in_order():
    with open_pool("local", jobs=4, tasks=1) as pool:
        assert isinstance(pool, InlinePool)
        assert list(pool.imap_unordered(divmod, [(7, 2), (9, 4)])) == [(3, 1), (2, 1)]
        failed = pool.submit(divmod, 1, 0)
        assert isinstance(failed.exception(), ZeroDivisionError)
