"""The simulator's network: max-min fair sharing of the NICs at both ends of every transfer,
FIFO as the alternative, and the per-descriptor cost of head slices across a TP mismatch."""

from __future__ import annotations

import pytest
import simpy

from pdsim.sim.network import (
    Link,
    NetworkModel,
    SimFabric,
    descriptor_counts,
    page_runs,
)

GB = 1e9
FLOOR_S = 1e-3


def landed_at(flows: list[tuple[float, str, str, float]], sharing: str = "fair",
              per_descriptor_s: float = 0.0, gpus: int = 1) -> list[float]:
    """Each (start_s, sender, receiver, bytes) transfer between 10 GB/s links: when it lands."""
    env = simpy.Environment()
    fabric = SimFabric(env, NetworkModel(transfer_floor_s=FLOOR_S, sharing=sharing,
                                         per_descriptor_s=per_descriptor_s))
    links: dict[str, Link] = {}
    ends = [0.0] * len(flows)

    def start(i: int, src: str, dst: str, nbytes: float) -> None:
        a = links.setdefault(src, Link(10 * GB, gpus))
        b = links.setdefault(dst, Link(10 * GB, gpus))
        fabric.transfer(a, b, nbytes, 1000.0, lambda: ends.__setitem__(i, env.now))

    for i, (at, src, dst, nbytes) in enumerate(flows):
        fabric.later(at, lambda i=i, s=src, d=dst, n=nbytes: start(i, s, d, n))
    env.run()
    return ends


def test_a_flow_alone_gets_the_whole_link():
    assert landed_at([(0.0, "p0", "d0", 1 * GB)]) == [pytest.approx(0.1 + FLOOR_S)]


def test_two_equal_flows_on_one_nic_each_take_twice_the_single_flow_time():
    # Same sender, two receivers: the sender's NIC is the bottleneck, shared half and half.
    ends = landed_at([(0.0, "p0", "d0", 1 * GB), (0.0, "p0", "d1", 1 * GB)])
    assert ends == [pytest.approx(0.2 + FLOOR_S)] * 2
    # Two senders into one receiver: the same at the receiving end.
    ends = landed_at([(0.0, "p0", "d0", 1 * GB), (0.0, "p1", "d0", 1 * GB)])
    assert ends == [pytest.approx(0.2 + FLOOR_S)] * 2


def test_flows_at_different_ends_do_not_interfere():
    ends = landed_at([(0.0, "p0", "d0", 1 * GB), (0.0, "p1", "d1", 1 * GB)])
    assert ends == [pytest.approx(0.1 + FLOOR_S)] * 2


def test_shares_are_recomputed_when_a_flow_starts_and_ends():
    # A: 1 GB alone for 50 ms (0.5 GB sent), then shares with B (0.25 GB) at 5 GB/s each:
    # B ends at 0.05 + 0.25/5 = 0.1 s; A's last 0.25 GB runs alone again: 0.125 s.
    ends = landed_at([(0.0, "p0", "d0", 1 * GB), (0.05, "p0", "d1", 0.25 * GB)])
    assert ends == [pytest.approx(0.125 + FLOOR_S), pytest.approx(0.1 + FLOOR_S)]


def test_max_min_fair_gives_an_unbottlenecked_flow_the_leftover():
    # d0 receives from p0 and p1; p1 also sends to d1. d0 is shared by two flows (5 GB/s
    # each), so p1 -> d1 gets the other 5 GB/s of p1, not a third of anything.
    ends = landed_at([(0.0, "p0", "d0", 0.5 * GB), (0.0, "p1", "d0", 0.5 * GB),
                      (0.0, "p1", "d1", 0.5 * GB)])
    assert ends == [pytest.approx(0.1 + FLOOR_S)] * 3


def test_fifo_serialises_where_fair_shares():
    flows = [(0.0, "p0", "d0", 1 * GB), (0.0, "p0", "d1", 1 * GB)]
    assert landed_at(flows, "fifo") == [pytest.approx(0.1 + FLOOR_S), pytest.approx(0.2 + FLOOR_S)]


def test_descriptors_cost_nic_time_on_the_senders_gpus():
    # 1000 descriptors of 10 us on one GPU: 10 ms of the link; over 4 GPUs in parallel: 2.5 ms.
    one = landed_at([(0.0, "p0", "d0", 1 * GB)], per_descriptor_s=10e-6)
    four = landed_at([(0.0, "p0", "d0", 1 * GB)], per_descriptor_s=10e-6, gpus=4)
    assert one == [pytest.approx(0.11 + FLOOR_S)]
    assert four == [pytest.approx(0.1025 + FLOOR_S)]


def test_descriptor_counts_for_a_tp_mismatch():
    # Llama-3.1-70B: 80 layers, K and V, 8 KV heads, pages of 16 tokens.
    assert descriptor_counts(80, 2, 16, 8, 8, 8, mla=False) == (80 * 2 * 8, 0.0)  # rank to rank
    # TP 8 -> 4: every token slot of every page gets a head slice per overlapping rank pair
    # (8 pairs: each prefill rank's one head lands in one decode rank).
    assert descriptor_counts(80, 2, 16, 8, 8, 4, mla=False) == (0.0, 80 * 2 * 16 * 8)
    assert descriptor_counts(80, 2, 16, 8, 2, 8, mla=False) == (0.0, 80 * 2 * 16 * 8)
    # More ranks than KV heads: heads are replicated, pairs count distinct heads.
    assert descriptor_counts(80, 2, 16, 8, 16, 4, mla=False) == (0.0, 80 * 2 * 16 * 8)
    # MLA (one latent buffer a layer, replicated): whole pages to each decode rank.
    assert descriptor_counts(61, 1, 64, 1, 8, 4, mla=True) == (61 * 4, 0.0)


def test_page_runs_merge_pages_contiguous_on_both_sides():
    assert page_runs([0, 1, 2, 3], [10, 11, 12, 13]) == 1
    assert page_runs([0, 1, 2, 3], [10, 11, 20, 21]) == 2
    assert page_runs([0, 2, 3], [5, 6, 7]) == 2
    assert page_runs([7], [3]) == 1


def _experiment(**network) -> dict:
    return {"name": "t", "seed": 1, "model": "llama-3.1-70b", "hardware": "h200",
            "cluster": {"prefill": {"instances": 1, "tp": 8}, "decode": {"instances": 1, "tp": 4}},
            "network": {"bandwidth_gb_per_s": 2.0, **network},
            "workload": {"num_requests": 40, "seed": 3,
                         "arrival": {"process": "poisson", "rate_rps": 10},
                         "input_len": {"dist": "lognormal", "mean": 1500, "cv": 0.8, "min": 16,
                                       "max": 8000},
                         "output_len": {"dist": "uniform", "low": 16, "high": 300}}}


def _ttft_p50(data: dict) -> float:
    from pdsim.config import parse_experiment
    from pdsim.runner import run_point

    return run_point(0, parse_experiment(data), {}, None).summary["ttft_p50_s"]


@pytest.mark.slow
def test_gqa_tp_mismatch_pays_for_its_descriptors_and_mla_does_not():
    slow, free = {"per_descriptor_s": 0.1e-6}, {"per_descriptor_s": 0.0}
    # TP 4 -> 8 over RDMA: the 4 sending ranks post every head slice (8 -> 4 spreads them over
    # 8 senders, where the receiver's bytes take longer anyway)
    fewer_senders = {"cluster": {"prefill": {"instances": 1, "tp": 4},
                                 "decode": {"instances": 1, "tp": 8}}}
    assert _ttft_p50(_experiment(**slow) | fewer_senders) > \
        1.5 * _ttft_p50(_experiment(**free) | fewer_senders)
    assert _ttft_p50(_experiment(**slow)) < 1.1 * _ttft_p50(_experiment(**free))
    same_tp = {"decode": {"instances": 1, "tp": 8}}
    matched = _experiment(**slow) | {"cluster": {"prefill": {"instances": 1, "tp": 8}, **same_tp}}
    matched_free = _experiment(**free) | {"cluster": {"prefill": {"instances": 1, "tp": 8},
                                                      **same_tp}}
    # Rank to rank whole pages: 1,280 descriptors a run of pages (head slices: 20,480 a page).
    assert _ttft_p50(matched) < 1.1 * _ttft_p50(matched_free)
    mla = {"model": "deepseek-v3", "cluster": {"prefill": {"instances": 1, "tp": 8},
                                               "decode": {"instances": 1, "tp": 8,
                                                          "dp_attention": 2}}}
    assert _ttft_p50(_experiment(**slow) | mla) < 1.1 * _ttft_p50(_experiment(**free) | mla)


def test_the_flat_head_slice_efficiency_is_gone_with_a_clear_error():
    from pdsim.config import ConfigError, parse_experiment

    with pytest.raises(ConfigError, match="head_slice_efficiency.*per_descriptor_s"):
        parse_experiment(_experiment(head_slice_efficiency=0.5))


@pytest.mark.slow
def test_each_dp_rank_sends_through_its_own_gpus_nics():
    from pdsim.config import parse_experiment
    from pdsim.sim.build import build_cluster
    from pdsim.sim.cluster import Simulation

    data = _experiment()
    data["model"] = "deepseek-v3"
    data["cluster"] = {"prefill": {"instances": 1, "tp": 8, "dp_attention": 2},
                       "decode": {"instances": 1, "tp": 8}}
    spec = build_cluster(parse_experiment(data))
    sim = Simulation(spec, 0)
    a, b = (s.kv.link for s in sim.prefills[0].schedulers)
    assert a is not b and a.gpus == b.gpus == 4
    assert a.bytes_per_s == pytest.approx(spec.prefill.nic_bytes_per_s / 2)
    assert sim.serving[0].schedulers[0].kv.link.gpus == 8


def test_runs_of_decode_steps_match_step_by_step_over_contended_fair_nics(monkeypatch):
    """The fast path stays exact when transfers share the NICs (only transfers change)."""
    from test_fast_path import assert_same_records, both_ways, experiment

    data = experiment("disaggregated", network={"bandwidth_gb_per_s": 2.0, "sharing": "fair"})
    slow, fast, settled = both_ways(data, monkeypatch)
    assert_same_records(slow, fast)
    assert sum(settled) > 0


def test_mla_tp_mismatch_moves_the_receivers_replicas_through_the_ranks_that_send():
    from pdsim.config import parse_experiment
    from pdsim.sim.build import build_cluster

    def spec(decode_dp: int):
        data = _experiment()
        data["model"] = "deepseek-v3"
        data["cluster"] = {"prefill": {"instances": 1, "tp": 8},
                           "decode": {"instances": 1, "tp": 8, "dp_attention": decode_dp}}
        return build_cluster(parse_experiment(data))

    same, half = spec(1), spec(2)
    # Attention TP 8 -> 4 (DP 2): four prefill ranks send (the other four are dummies), four
    # replicas land.
    assert half.prefill.nic_bytes_per_s == pytest.approx(same.prefill.nic_bytes_per_s / 2)
    assert half.decode.kv_bytes_per_page == pytest.approx(same.decode.kv_bytes_per_page / 2)
