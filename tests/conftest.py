"""Test-wide settings, the public traces fixture, the one real `pdsim validate` run two files
check, and a -m that skips whole files unimported."""

import ast
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from markers import module_marks, rules_out_every_test

# Mooncake's transfer engine logs every segment it opens and closes through glog; keep warnings.
os.environ.setdefault("GLOG_minloglevel", "1")

# The public traces are part of the test environment, not of the repository: they sit in
# shared/traces beside the checkout (CI has them there). A missing one is an error, not a skip.
TRACES_DIR = Path(__file__).resolve().parents[2] / "shared" / "traces"
PUBLIC_TRACES = ("conversation_trace.jsonl", "synthetic_trace.jsonl",
                 "AzureLLMInferenceTrace_conv.csv", "AzureLLMInferenceTrace_code.csv")


@pytest.fixture(scope="session")
def traces() -> Path:
    """The folder of the public traces; fails, naming each missing file's path, unless all of
    `PUBLIC_TRACES` are there."""
    missing = [str(TRACES_DIR / name) for name in PUBLIC_TRACES
               if not (TRACES_DIR / name).is_file()]
    if missing:
        pytest.fail("public traces missing (the tests read them from shared/traces beside the "
                    "checkout): " + ", ".join(missing), pytrace=False)
    return TRACES_DIR


REPO = Path(__file__).resolve().parents[1]
PD_1P1D = REPO / "experiments" / "validation" / "pd_1p1d_low.yaml"
# How far apart two real runs of one workload have been measured on this machine: mean TTFT
# 2.8x, back to back (docs/validation.md, "In CI"). Simulated latencies further than this from
# the real ones are an error of the simulator or its calibration, not noise.
NOISE_RATIO = 3.0


@dataclass(frozen=True)
class Validation:
    proc: subprocess.CompletedProcess
    out: Path  # the folder `--out` named
    num_requests: int
    calibration: Path  # what `pdsim calibrate` wrote just before


@pytest.fixture(scope="session")
def pd_validation(tmp_path_factory) -> Validation:
    """`pdsim calibrate` of this machine now (two runs per shape), then `pdsim validate` of
    experiments/validation/pd_1p1d_low.yaml cut to 12 requests with that calibration (the
    goals' tolerances): a 1 prefill : 1 decode tiny-llama deployment served for real, once a
    session.
    tests/test_validate.py checks its comparison table, tests/test_phases.py its phase table."""
    import yaml

    work = tmp_path_factory.mktemp("pd_validation")
    raw = yaml.safe_load(PD_1P1D.read_text())
    raw["workload"]["num_requests"] = 12
    raw["cost_model"]["params"]["timings"] = str(
        REPO / "experiments" / "calibration" / "tiny_llama_cpu_timings.csv")
    (work / "tiny.yaml").write_text(yaml.safe_dump(raw))
    env = {**os.environ, "GLOG_minloglevel": "2"}
    calib = subprocess.run(
        [sys.executable, "-m", "pdsim.cli", "calibrate", "tiny.yaml", "-o", "calib/pd.yaml",
         "--repeats", "2"], cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert calib.returncode == 0, calib.stdout[-3000:] + calib.stderr[-3000:]
    proc = subprocess.run(
        [sys.executable, "-m", "pdsim.cli", "validate", "tiny.yaml", "--calibration",
         "calib/pd.yaml", "--out", "out"],
        cwd=work, env=env, capture_output=True, text=True, timeout=300)
    return Validation(proc, work / "out", 12, work / "calib" / "pd.yaml")


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """With `-m`, a test file whose module marks rule out every test in it (a file marked `slow`
    under `-m "not slow"`) is not imported at all: importing torch and the rest for tests that
    are then deselected would cost the fast loop more than its tests take."""
    markexpr = config.option.markexpr
    if not markexpr or not (collection_path.name.startswith("test_")
                            and collection_path.suffix == ".py"):
        return None
    marks = module_marks(ast.parse(collection_path.read_text()))
    return True if marks and rules_out_every_test(markexpr, marks) else None
