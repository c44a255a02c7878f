"""Fault injection (`faults:`): the config, the pure choices both backends share, the simulator's
faults, and the same faults in the real PD deployment compared with the simulator's answer."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pdsim.config import ConfigError, parse_experiment
from pdsim.faults import TRANSFER_FAULT, FaultsConfig, fault_summary, transfer_fails
from pdsim.runner import run_point
from pdsim.sim.build import build_cluster
from pdsim.sim.cluster import Simulation
from pdsim.workload import generate


def experiment(faults: dict, prefill: int = 1, decode: int = 1, n: int = 120,
               rate_rps: float = 10.0) -> dict:
    return {
        "name": "faults", "seed": 1, "model": "llama-3.1-8b", "hardware": "h100",
        "cluster": {"prefill": {"instances": prefill}, "decode": {"instances": decode}},
        "workload": {
            "num_requests": n, "seed": 3,
            "arrival": {"process": "poisson", "rate_rps": rate_rps},
            "input_len": {"dist": "uniform", "low": 200, "high": 2000},
            "output_len": {"dist": "uniform", "low": 20, "high": 200},
        },
        "faults": faults,
    }


def simulate(data: dict):
    cfg = parse_experiment(data)
    wl = generate(cfg.workload)
    result = Simulation(build_cluster(cfg), cfg.seed).run(wl.arrival_s, wl.input_tokens,
                                                          wl.output_tokens)
    return wl, result


# ---- config and the shared choices ---------------------------------------------------------


@pytest.mark.parametrize("faults, field, words", [
    ({"kill": [{"role": "router", "at_s": 1}]}, "faults.kill.0.role", ["'router'", "prefill"]),
    ({"kill": [{"role": "decode", "instance": 2, "at_s": 1}]}, "faults.kill.0.instance",
     ["2", "0..0"]),
    ({"slow_nic": [{"role": "prefill", "factor": 0}]}, "faults.slow_nic.0.factor", ["0"]),
    ({"fail_transfers": 1.5}, "faults.fail_transfers", ["1.5", "less than or equal to 1"]),
    ({"bootstrap_delay_s": -1}, "faults.bootstrap_delay_s", ["-1"]),
    ({"kill": [{"role": "decode", "at_s": 1}, {"role": "decode", "at_s": 2}]}, "faults.kill",
     ["one kill per instance"]),
    ({"kil": []}, "faults.kil", ["unknown key", "kill"]),
])
def test_bad_faults_name_the_field_the_value_and_what_is_allowed(faults, field, words):
    with pytest.raises(ConfigError) as err:
        parse_experiment(experiment(faults))
    text = str(err.value)
    assert field in text
    for w in words:
        assert w in text


def test_transfer_faults_need_transfers():
    data = experiment({"fail_transfers": 0.2})
    data["cluster"]["mode"] = "colocated"
    with pytest.raises(ConfigError, match="faults.fail_transfers: 0.2; allowed: 0 when serving "
                                          "colocated"):
        parse_experiment(data)


def test_the_failing_transfers_are_a_seeded_pure_choice():
    rids = [str(i) for i in range(4000)]
    picked = [r for r in rids if transfer_fails(7, 0.3, r)]
    assert picked == [r for r in rids if transfer_fails(7, 0.3, r)]  # no hidden state
    assert abs(len(picked) / len(rids) - 0.3) < 0.03
    assert picked != [r for r in rids if transfer_fails(8, 0.3, r)]
    assert not any(transfer_fails(7, 0.0, r) for r in rids)
    assert all(transfer_fails(7, 1.0, r) for r in rids)
    assert FaultsConfig(seed=7, fail_transfers=0.3).fails_transfer("12") == transfer_fails(7, 0.3, "12")


def test_fault_summary_columns():
    from pdsim.core.records import RequestRecord

    recs = [RequestRecord("0", 1, 1, "ok", arrival_s=0.0, finish_s=1.0),
            RequestRecord("1", 1, 0, "failed", arrival_s=1.0, finish_s=3.0),
            RequestRecord("2", 1, 0, "failed", arrival_s=2.5, finish_s=2.5),
            RequestRecord("3", 1, 1, "ok", arrival_s=4.0, finish_s=6.0),
            RequestRecord("4", 1, 1, "ok", arrival_s=5.0, finish_s=5.5)]
    s = fault_summary(recs, fault_s=2.0)
    assert s["error_latency_p50_s"] == 1.0 and s["error_latency_max_s"] == 2.0
    assert s["recovery_s"] == 3.5  # request 4 arrived after the fault and ended first, at 5.5
    assert math.isnan(fault_summary(recs, None)["recovery_s"])


# ---- the simulator -------------------------------------------------------------------------


def test_sim_failed_transfers_fail_exactly_the_chosen_requests_and_free_everything():
    wl, result = simulate(experiment({"seed": 5, "fail_transfers": 0.3}))
    failed = {r.rid for r in result.records if not r.ok}
    assert failed == {str(i) for i in range(len(wl)) if transfer_fails(5, 0.3, str(i))}
    assert 20 < len(failed) < 60
    for rec, n_out in zip(result.records, wl.output_tokens):
        if rec.ok:
            assert rec.output_tokens == n_out
        else:
            assert TRANSFER_FAULT in rec.error and rec.output_tokens == 0
    result.check_pools_full()


def test_sim_kill_decode_fails_its_requests_at_once_and_restart_serves_again():
    kill_s, back_s = 4.0, 3.0
    data = experiment({"kill": [{"role": "decode", "instance": 0, "at_s": kill_s,
                                 "restart_after_s": back_s}]}, decode=2, n=150)
    wl, result = simulate(data)
    recs = result.records
    died = [r for r in recs if r.error == "decode worker 0 died"]
    refused = [r for r in recs if "decode worker 0 unreachable" in r.error]
    assert died and refused and len(died) + len(refused) == sum(not r.ok for r in recs)
    for r in died:  # in flight at the kill: the stream breaks then
        assert r.decode_instance == 0 and r.arrival_s <= kill_s and r.finish_s == kill_s
    for r in refused:  # sent to the dead worker: refused as it reaches the router
        assert kill_s <= r.arrival_s < kill_s + back_s
        assert 0 <= r.finish_s - r.arrival_s < 0.05  # the front end's latency only
    later = [r for r in recs if r.arrival_s >= kill_s + back_s]
    assert later and all(r.ok for r in later)
    assert any(r.ok and r.decode_instance == 0 for r in later)  # the restarted one serves
    assert all(r.ok for r in recs if r.decode_instance == 1)
    result.check_pools_full()
    row = run_point(0, parse_experiment(data), {}, None).summary
    assert row["failed"] == len(died) + len(refused)
    assert row["error_latency_p50_s"] >= 0 and row["error_latency_max_s"] <= kill_s
    assert 0 < row["recovery_s"] < 2.0  # decode 1 still serves: the next request succeeds


def test_sim_kill_prefill_fails_only_what_it_still_held():
    kill_s = 1.0
    data = experiment({"kill": [{"role": "prefill", "instance": 0, "at_s": kill_s}]},
                      n=80, rate_rps=40)
    wl, result = simulate(data)
    held = [r for r in result.records if r.error == "prefill worker 0 died"]
    assert held, "the kill should catch requests in prefill"
    for r in held:  # the router aborts their decode side, which stops them after its forward
        assert r.arrival_s <= kill_s <= r.finish_s < kill_s + 0.2 and r.output_tokens == 0
    before = [r for r in result.records if r.finish_s < kill_s]
    assert before and all(r.ok for r in before)
    assert all("unreachable" in r.error for r in result.records if r.arrival_s > kill_s)
    ok_after_kill = [r for r in result.records if r.ok and r.finish_s > kill_s]
    assert ok_after_kill  # their KV had arrived: decode finishes them
    result.check_pools_full()  # the decode instance got everything back


def _transfer_s(result) -> np.ndarray:
    return np.array([r.transfer_done_s - r.prefill_end_s for r in result.records])


def test_sim_slow_nic_divides_the_bandwidth():
    base = experiment({}, n=20, rate_rps=0.5)
    _, fast = simulate(base)
    for role in ("prefill", "decode"):
        _, slow = simulate({**base, "faults": {"slow_nic": [{"role": role, "factor": 8}]}})
        ratio = np.median(_transfer_s(slow) / _transfer_s(fast))
        assert 4 < ratio <= 8  # the bytes take 8x; latencies and set-up do not


def test_sim_bootstrap_delay_slows_the_first_handshake_only():
    base = experiment({}, n=20, rate_rps=0.5)
    _, fast = simulate(base)
    _, slow = simulate({**base, "faults": {"bootstrap_delay_s": 0.25}})
    diff = [b.first_token_s - a.first_token_s for a, b in zip(fast.records, slow.records)]
    assert 0.5 <= diff[0] < 0.55  # two bootstrap answers, each 0.25 s late
    wait = [[r.bootstrap_done_s - r.arrival_s for r in res.records] for res in (fast, slow)]
    assert wait[1][0] - wait[0][0] == pytest.approx(0.5, abs=0.01)
    assert wait[1][1:] == pytest.approx(wait[0][1:], abs=0.01)  # later handshakes: cached
