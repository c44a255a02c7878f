"""`pdsim validate` serves and simulates a hybrid model's deployment,
experiments/real_pd_hybrid.yaml (tiny-hybrid, prefill tp 1 -> decode tp 1, its recurrent state
moved by Mooncake over TCP on loopback), with the committed calibration of this deployment. Both
sides complete every request, the real workers' pools (recurrent-state slots too) all come back,
and the simulated transfer of a request's last chunk carries its hybrid state: a sliding
window's KV and the recurrent state of both linear-attention layers, as many bytes as each
worker holds per request (validate's state line). A worker's `/pools` check counts its
recurrent-state slots: one held outside any request keeps it from full.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pandas as pd
import pytest
import yaml

from pdsim.specs.models import load_model_spec
from pdsim.validation.validate import load_experiment_for

pytestmark = [pytest.mark.real, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]
EXPERIMENT = REPO / "experiments" / "real_pd_hybrid.yaml"
CALIBRATION = REPO / "experiments" / "validation" / "calibration" / "pd_hybrid.yaml"
REQUESTS = 8


def test_the_simulated_transfer_carries_the_hybrid_state():
    exp = load_experiment_for(EXPERIMENT, CALIBRATION)
    model = load_model_spec("tiny-hybrid")
    kv_dtype_bytes = exp.sim_cfg.kv_dtype_bytes
    recurrent_bytes = model.recurrent_state_bytes_per_request_per_rank(1)
    window_bytes = model.swa_window_bytes_per_request_per_rank(1, kv_dtype_bytes)
    assert recurrent_bytes > 0 and window_bytes > 0
    for role in (exp.cluster.prefill, exp.cluster.decode):
        assert role.state_bytes_per_request == recurrent_bytes + window_bytes


def test_validate_a_hybrid_deployment(tmp_path):
    raw = yaml.safe_load(EXPERIMENT.read_text())
    raw["workload"]["num_requests"] = REQUESTS
    (tmp_path / "hybrid.yaml").write_text(yaml.safe_dump(raw))
    proc = subprocess.run(
        [sys.executable, "-m", "pdsim.cli", "validate", "hybrid.yaml", "--calibration",
         str(CALIBRATION), "--tolerance", "10", "--out", "out"], cwd=tmp_path,
        env={**os.environ, "GLOG_minloglevel": "2"}, capture_output=True, text=True, timeout=600)
    # 0: within the tolerance, 1: outside it; anything else is an error.
    assert proc.returncode in (0, 1), proc.stdout[-3000:] + proc.stderr[-3000:]
    # Every page, request, metadata and recurrent-state slot is back on both workers.
    assert "real: every worker's pages and slots came back" in proc.stdout, proc.stdout[-3000:]
    # The simulator prices the recurrent state each worker holds per request.
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("recurrent state per")]
    assert "(equal)" in line and "prefill 0: real" in line and "decode 0: real" in line, line
    table = pd.read_csv(tmp_path / "out" / "validation.csv").set_index("metric")
    assert table.loc["completed", "real"] == table.loc["completed", "sim"] == REQUESTS
    for side in ("real", "sim"):
        done = pd.read_csv(tmp_path / "out" / f"{side}_requests.csv")
        assert len(done) == REQUESTS and (done["status"] == "ok").all(), side
        assert (done["output_tokens"] > 0).all(), side


def _pools_around_a_taken_state_slot(group) -> dict:
    """A tp-1 tiny-hybrid decode worker's `/pools` answer before, while and after one of its
    recurrent-state slots is held outside any request."""
    from pd_harness import pd_config
    from runtime.pd.worker import RankSpec, build_rank

    rank = build_rank(pd_config("tiny-hybrid"), RankSpec("decode", 0, 0, 1), group)
    engine = rank.engine.start()
    try:
        slots = engine.scheds[0].state_slots
        before = engine.pools(30)
        slot = engine.call(slots.alloc)
        held = engine.pools(30)
        engine.call(lambda: slots.free_many([slot]))
        return {"before": before, "held": held, "after": engine.pools(30)}
    finally:
        engine.stop()
        rank.manager.close()
        # Mooncake's destructor holds an exiting process up for seconds: leave once answered.
        threading.Timer(3.0, os._exit, (0,)).start()


def test_a_held_state_slot_keeps_the_pools_from_full():
    from runtime.distributed import run_ranks

    (got,) = run_ranks(_pools_around_a_taken_state_slot, 1, timeout_s=120)
    full = {"full": True, "detail": ""}
    assert got["before"] == got["after"] == full
    assert got["held"]["full"] is False
    assert got["held"]["detail"].startswith("1 of ")
    assert got["held"]["detail"].endswith("state slots in use")
