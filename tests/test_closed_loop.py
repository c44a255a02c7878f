"""Closed-loop clients, the measurement window, fixed per-request costs and DP-rank assignment
in the simulator, end to end."""

from __future__ import annotations

import numpy as np
import pytest
from configs import scheduler_config
from core_harness import StubKV

from pdsim.config import ConfigError, parse_experiment
from pdsim.core.decode import DecodeScheduler
from pdsim.core.instance import Instance
from pdsim.core.prefill import PrefillScheduler
from pdsim.core.router import Router, pick_dp_rank
from pdsim.core.scheduler import ColocatedScheduler
from pdsim.metrics import MeasurementWindow, summarize
from pdsim.runner import run_point
from pdsim.sim.build import build_cluster
from pdsim.sim.cluster import Simulation
from pdsim.workload import generate


def experiment(concurrency=8, think_time_s=0.0, num_requests=160, **over) -> dict:
    data = {
        "name": "closed",
        "seed": 2,
        "model": "llama-3.1-8b",
        "hardware": "h100",
        "cluster": {"prefill": {"instances": 1}, "decode": {"instances": 1}},
        "workload": {
            "num_requests": num_requests,
            "seed": 5,
            "arrival": {"process": "closed", "concurrency": concurrency, "think_time_s": think_time_s},
            "input_len": {"dist": "uniform", "low": 64, "high": 1500},
            "output_len": {"dist": "uniform", "low": 4, "high": 60},
        },
    }
    data.update(over)
    return data


def simulate(data: dict):
    cfg = parse_experiment(data)
    wl = generate(cfg.workload)
    sim = Simulation(build_cluster(cfg), cfg.seed, cfg.max_duration_s)
    result = sim.run(wl.arrival_s, wl.input_tokens, wl.output_tokens, wl.closed_loop)
    assert all(r.ok for r in result.records)
    arrivals = np.array([r.arrival_s for r in result.records])
    finishes = np.array([r.finish_s for r in result.records])
    return arrivals, finishes, result


@pytest.mark.parametrize("concurrency", [1, 8])
def test_closed_loop_keeps_exactly_n_requests_in_flight(concurrency):
    arrivals, finishes, _ = simulate(experiment(concurrency))
    assert np.count_nonzero(arrivals == 0.0) == concurrency  # every client starts at once
    last_sent = arrivals.max()
    for t in np.union1d(arrivals, finishes):
        in_flight = np.count_nonzero(arrivals <= t) - np.count_nonzero(finishes <= t)
        if t < last_sent:
            assert in_flight == concurrency, t
        else:  # the drain: no new request, the clients finish one by one
            assert in_flight <= concurrency


def test_without_think_time_a_request_is_sent_when_another_ends():
    n = 8
    arrivals, finishes, _ = simulate(experiment(n))
    # The requests after the first wave are sent exactly at the first len - n finishes.
    np.testing.assert_array_equal(np.sort(arrivals)[n:], np.sort(finishes)[: len(finishes) - n])


def test_think_time_delays_each_next_request():
    n, think = 4, 0.25
    arrivals, finishes, _ = simulate(experiment(n, think_time_s=think))
    np.testing.assert_allclose(np.sort(arrivals)[n:], np.sort(finishes)[: len(finishes) - n] + think,
                               rtol=0, atol=1e-9)


def test_closed_loop_replays_a_trace_with_its_lengths(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(
        f'{{"timestamp": {i * 1000}, "input_length": {100 + i}, "output_length": {5 + i % 3}}}\n'
        for i in range(12)))
    data = experiment()
    data["workload"] = {"trace": str(trace), "closed_loop": {"concurrency": 3}}
    arrivals, finishes, result = simulate(data)
    assert [r.input_tokens for r in result.records] == [100 + i for i in range(12)]
    np.testing.assert_array_equal(np.sort(arrivals)[3:], np.sort(finishes)[:9])
    with pytest.raises(ConfigError, match="closed_loop"):
        parse_experiment({**data, "workload": {**data["workload"], "target_rate_rps": 2.0}})


def test_window_throughput_is_in_window_tokens_over_its_length():
    n = 16
    window = {"warmup_requests": n, "cooldown_requests": n}
    data = experiment(n, num_requests=240, metrics=window)
    point = run_point(0, parse_experiment(data), {}, None)
    frame, s = point.requests, point.summary
    start, end = s["window_start_s"], s["window_end_s"]
    # Warm-up ends when the first request of the second wave is sent, cool-down starts when
    # the last n requests are still to finish.
    assert start == np.sort(frame["arrival_s"])[n] > 0
    assert end == np.sort(frame["finish_s"])[-n - 1] < frame["finish_s"].max()
    # The window's requests arrived in it: none of the first wave, though some of it ended
    # inside; its latencies are theirs.
    inside = frame["in_window"].to_numpy()
    arrival, finish = frame["arrival_s"], frame["finish_s"]
    np.testing.assert_array_equal(inside, (arrival >= start) & (arrival < end))
    first_wave = arrival == 0
    assert first_wave.sum() == n and not (inside & first_wave).any()
    assert (first_wave & (finish >= start)).sum() > 0
    assert s["num_requests"] == inside.sum() < s["run_requests"] == 240
    ttft = (frame["first_token_s"] - arrival)[inside]
    assert s["ttft_p99_s"] == pytest.approx(np.percentile(ttft, 99), rel=1e-12)
    # Its request throughput is the requests that ended in it (its token throughput, the
    # tokens emitted in it: tests/test_metrics_window.py).
    ended = (finish >= start) & (finish < end)
    assert s["request_throughput_req_s"] == pytest.approx(ended.sum() / (end - start), rel=1e-12)
    assert s["duration_s"] == pytest.approx(end - start)
    whole = run_point(0, parse_experiment(experiment(n, num_requests=240)), {}, None).summary
    assert not whole["output_tok_s"] == pytest.approx(s["output_tok_s"], rel=0.01)
    assert whole["run_requests"] == whole["num_requests"] == 240
    assert whole["duration_s"] == pytest.approx(frame["finish_s"].max())  # first arrival at 0


def test_window_by_time_on_hand_made_times():
    arrivals = np.array([0.0, 0.0, 1.0, 2.0, 3.0, np.nan])
    finishes = np.array([1.0, 2.0, 3.0, 4.0, np.nan, np.nan])
    w = MeasurementWindow(warmup_s=0.5, cooldown_s=1.5)
    assert w.bounds(arrivals, finishes) == (0.5, 2.5)
    # Arrived inside [0.5, 2.5]: the third and fourth (the one that never ended came at 3.0);
    # ended inside it: the first two.
    np.testing.assert_array_equal(w.mask(arrivals, finishes), [False, False, True, True, False, False])
    np.testing.assert_array_equal(w.ended_mask(arrivals, finishes),
                                  [True, True, False, False, False, False])
    assert MeasurementWindow().mask(arrivals, finishes).all()
    assert MeasurementWindow().ended_mask(arrivals, finishes).all()
    assert MeasurementWindow(warmup_requests=2).bounds(arrivals, finishes) == (1.0, 4.0)
    empty = MeasurementWindow(warmup_requests=99).bounds(arrivals, finishes)
    assert empty[0] == np.inf
    assert np.isnan(summarize([], num_gpus=1, slo=parse_experiment(experiment()).slo,
                              window=w)["output_tok_s"])


def one_request_ttft(**network_and_router) -> float:
    data = experiment(1, num_requests=1, **network_and_router)
    data["workload"]["input_len"] = {"dist": "fixed", "value": 1000}
    _, _, result = simulate(data)
    return result.records[0].ttft_s


def test_ttft_at_concurrency_one_includes_the_fixed_costs():
    free = {"frontend_latency_s": 0.0}
    zero_net = {"first_contact_s": 0.0, "handshake_s": 0.0, "transfer_floor_s": 0.0,
                "message_latency_s": 0.0}
    bare = one_request_ttft(router=free, network=zero_net)
    costs = {"frontend_latency_s": 0.004}
    net = {**zero_net, "first_contact_s": 0.003, "transfer_floor_s": 0.002}
    assert one_request_ttft(router=costs, network=net) == pytest.approx(bare + 0.009, abs=1e-9)
    # The defaults carry a floor of several ms over the bare compute and bytes: the front end
    # (4.4 ms), the first contact, the handshake and the transfer's floor.
    assert one_request_ttft() > bare + 0.007
    # An idle scheduler's wake-up is paid at each of the request's idle-to-busy steps.
    wake = {"prefill": {"scheduler": {"wakeup_s": 0.001}}, "decode": {"scheduler": {"wakeup_s": 0.001}}}
    slower = one_request_ttft(router=free, network=zero_net, cluster=wake)
    assert slower >= bare + 0.002


def test_a_request_that_finds_the_deployment_idle_pays_the_wake_on_its_way_in():
    """router.idle_wakeup_s lengthens the TTFT of a request that found nothing in flight for
    idle_after_s or longer (the run's first: the deployment idled before it) by all of it,
    even behind a longer handshake it could overlap; requests sent back to back do not pay
    it."""
    def ttfts(think_time_s: float, wake_s: float) -> np.ndarray:
        data = experiment(1, think_time_s, num_requests=6, network={"handshake_s": 0.005},
                          router={"idle_wakeup_s": wake_s, "idle_after_s": 0.025})
        data["workload"]["input_len"] = {"dist": "fixed", "value": 500}
        return np.array([r.ttft_s for r in simulate(data)[2].records])

    assert ttfts(0.1, 0.003) - ttfts(0.1, 0.0) == pytest.approx([0.003] * 6, abs=1e-9)
    back_to_back = ttfts(0.0, 0.003) - ttfts(0.0, 0.0)
    assert back_to_back == pytest.approx([0.003] + [0.0] * 5, abs=1e-9)


def test_each_request_draws_its_way_in_delay_from_the_jitter_lists():
    """router.jitter_s: each request takes one of the listed delays longer on its way in, drawn
    by the run's seed; one that finds the deployment idle draws from idle_jitter_s instead (on
    top of idle_wakeup_s)."""
    def ttfts(think_time_s: float, seed: int = 0, **router) -> np.ndarray:
        data = experiment(1, think_time_s, num_requests=12, network={"handshake_s": 0.005},
                          router={"idle_after_s": 0.025, **router})
        data["seed"] = seed
        data["workload"]["input_len"] = {"dist": "fixed", "value": 500}
        return np.array([r.ttft_s for r in simulate(data)[2].records])

    plain = ttfts(0.0)
    drawn = ttfts(0.0, jitter_s=[0.001, 0.004]) - plain
    # the first request found the deployment idle, but with no idle list it draws from jitter_s
    assert set(np.round(drawn, 9)) == {0.001, 0.004}
    assert ttfts(0.0, jitter_s=[0.001, 0.004]) - plain == pytest.approx(drawn, abs=1e-12)
    other_seed = ttfts(0.0, seed=1, jitter_s=[0.001, 0.004]) - ttfts(0.0, seed=1)
    assert not np.allclose(other_seed, drawn)
    lists = {"jitter_s": [0.001], "idle_jitter_s": [0.02], "idle_wakeup_s": 0.003}
    assert ttfts(0.0, **lists) - plain == pytest.approx([0.023] + [0.001] * 11, abs=1e-9)
    assert ttfts(0.1, **lists) - ttfts(0.1) == pytest.approx([0.023] * 12, abs=1e-9)


def test_a_step_after_a_long_enough_idle_runs_cold():
    """cold_step_s + cold_step_factor x the priced time for an instance's first step after it
    idled cold_after_s or more (both roles), the priced time otherwise."""
    def lone(cold: dict | None = None):
        sched = {"scheduler": cold or {}}
        data = experiment(1, num_requests=1, cluster={"prefill": sched, "decode": sched})
        data["workload"]["input_len"] = {"dist": "fixed", "value": 1000}
        data["workload"]["output_len"] = {"dist": "fixed", "value": 8}
        return simulate(data)[2].records[0]

    plain = lone()
    cold = lone({"cold_step_s": 0.002, "cold_step_factor": 1.5, "cold_after_s": 0.001})
    span = plain.prefill_end_s - plain.prefill_start_s
    assert cold.prefill_end_s - cold.prefill_start_s == pytest.approx(0.002 + 1.5 * span)
    assert cold.ttft_s == pytest.approx(plain.ttft_s + 0.002 + 0.5 * span)
    # the decode instance's first step after idle is cold too, the ones after it are not
    gaps, cold_gaps = np.diff(plain.token_times_s), np.diff(cold.token_times_s)
    assert cold_gaps[0] > gaps[0] + 0.002 and cold_gaps[1:] == pytest.approx(gaps[1:])
    # an idle shorter than cold_after_s leaves the steps as priced
    warm = lone({"cold_step_s": 0.002, "cold_step_factor": 1.5, "cold_after_s": 10.0})
    assert warm.ttft_s == pytest.approx(plain.ttft_s)
    assert np.diff(warm.token_times_s) == pytest.approx(gaps)


def test_tcp_is_slower_than_rdma_for_the_same_line_rate():
    rdma = one_request_ttft(network={"protocol": "rdma"})
    tcp = one_request_ttft(network={"protocol": "tcp"})
    assert tcp > rdma
    half = one_request_ttft(network={"protocol": "rdma", "line_rate_efficiency": 0.1})
    assert half > rdma


def test_instance_knobs_split_over_dp_ranks_as_sglang_does():
    data = experiment()
    data["model"] = "deepseek-v3"
    data["hardware"] = "h200"
    sched = {"max_running_requests": 256, "chunked_prefill_size": 8192, "max_prefill_tokens": 16384}
    data["cluster"] = {"prefill": {"tp": 8, "dp_attention": 8, "ep": 8, "scheduler": sched},
                       "decode": {"tp": 8, "dp_attention": 8, "ep": 8, "scheduler": sched}}
    rank = build_cluster(parse_experiment(data)).decode.scheduler
    assert (rank.max_running_requests, rank.chunked_prefill_size, rank.max_prefill_tokens) == (32, 1024, 16384)
    data["cluster"]["decode"]["scheduler"] = {"max_running_requests": 4}
    with pytest.raises(ConfigError, match=r"decode\.scheduler\.max_running_requests: 4 .* at least 8"):
        build_cluster(parse_experiment(data))


def test_batches_follow_sglangs_overlap_loop_unless_it_is_off():
    """SGLang runs its overlap event loops by default: a TP prefill, a PD decode and a
    colocated instance plan each batch a forward ahead; DeepEP prefill (whose dispatch holds
    the host), pipeline stages, speculation and --disable-overlap-schedule do not."""
    data = experiment()
    cluster = build_cluster(parse_experiment(data))
    assert cluster.prefill.scheduler.overlap_schedule == "plans_ahead"
    assert cluster.decode.scheduler.overlap_schedule == "plans_ahead"
    data["cluster"]["prefill"]["scheduler"] = {"disable_overlap_schedule": True}
    data["cluster"]["decode"]["scheduler"] = {"disable_overlap_schedule": True}
    off = build_cluster(parse_experiment(data))
    assert off.prefill.scheduler.overlap_schedule == off.decode.scheduler.overlap_schedule == "off"
    coloc = experiment()
    coloc["cluster"]["mode"] = "colocated"
    assert build_cluster(parse_experiment(coloc)).colocated.scheduler.overlap_schedule == "plans_ahead"
    data["model"], data["hardware"] = "deepseek-v3", "h200"
    data["cluster"] = {"prefill": {"tp": 8, "dp_attention": 8, "ep": 8, "moe_a2a": "deepep"},
                       "decode": {"tp": 8, "dp_attention": 8, "ep": 8}}
    assert build_cluster(parse_experiment(data)).prefill.scheduler.overlap_schedule == "late_results"


def test_pick_dp_rank_follows_the_room_the_turn_or_the_shortest_queue():
    queues = [3, 1, 1, 4]
    assert pick_dp_rank("room", 10, 4, queues.__getitem__) == 2
    assert [pick_dp_rank("round_robin", 10, 4, queues.__getitem__, turn)
            for turn in range(6)] == [0, 1, 2, 3, 0, 1]
    assert pick_dp_rank("shortest_queue", 10, 4, queues.__getitem__) == 1  # ties: lowest rank
    assert pick_dp_rank("shortest_queue", 10, 1, queues.__getitem__) == 0
    with pytest.raises(ValueError, match="allowed: room, round_robin, shortest_queue"):
        pick_dp_rank("random", 1, 2, queues.__getitem__)


def test_auto_dp_assignment_is_sglangs_per_role_default():
    """SGLang >= 0.5.10 (`_handle_load_balance_method`): a PD prefill instance follows the
    bootstrap room, a decode or colocated one takes turns."""
    config = scheduler_config(64)
    decode = Instance([DecodeScheduler(config, StubKV()) for _ in range(2)], lambda req: None)
    prefill = Instance([PrefillScheduler(config, StubKV()) for _ in range(2)], lambda req: None)
    colocated = Instance([ColocatedScheduler(config) for _ in range(2)], lambda req: None)
    assert (decode.dp_assignment, prefill.dp_assignment, colocated.dp_assignment) == (
        "round_robin", "room", "round_robin")
    assert Instance([DecodeScheduler(config, StubKV())], lambda req: None,
                    "shortest_queue").dp_assignment == "shortest_queue"


@pytest.mark.parametrize("assignment", ["auto", "room", "round_robin", "shortest_queue"])
def test_dp_assignment_in_the_simulator(assignment):
    data = experiment(concurrency=16, num_requests=16, router={"dp_assignment": assignment})
    data["cluster"]["decode"] = {"tp": 4, "dp_attention": 4}
    cfg = parse_experiment(data)
    wl = generate(cfg.workload)
    sim = Simulation(build_cluster(cfg), cfg.seed)
    taken = [0] * 4
    for rank, sched in enumerate(sim.serving[0].schedulers):
        def counting(req, now, add=sched.add_request, rank=rank):
            taken[rank] += 1
            add(req, now)
        sched.add_request = counting
    result = sim.run(wl.arrival_s, wl.input_tokens, wl.output_tokens, wl.closed_loop)
    assert all(r.ok for r in result.records) and sum(taken) == 16
    if assignment != "room":  # auto: decode takes turns
        assert taken == [4, 4, 4, 4]  # 16 arrive at once: each rank takes the next in turn
    else:  # the same seed draws the same rooms, in the same order
        router = Router(cfg.router.policy, 1, 1, cfg.seed)
        rooms = [router.route(lambda i: 0, lambda i: 0)[2] for _ in range(16)]
        assert taken == [sum(room % 4 == r for room in rooms) for r in range(4)]


def test_a_failed_request_frees_its_client_for_the_next():
    data = experiment(4, num_requests=40)
    data["workload"]["input_len"] = {"dist": "uniform", "low": 100, "high": 4000}
    data["cluster"]["decode"]["scheduler"] = {"num_pages": 200, "page_size": 16}  # 3,200 tokens
    cfg = parse_experiment(data)
    wl = generate(cfg.workload)
    sim = Simulation(build_cluster(cfg), cfg.seed, cfg.max_duration_s)
    records = sim.run(wl.arrival_s, wl.input_tokens, wl.output_tokens, wl.closed_loop).records
    failed = [r for r in records if not r.ok]
    assert failed and len(failed) < len(records)
    assert all("pool holds 3200" in r.error for r in failed)
    arrivals = np.sort([r.arrival_s for r in records])
    finishes = np.sort([r.finish_s for r in records])
    np.testing.assert_array_equal(arrivals[4:], finishes[:-4])  # failures hand on at once too


def test_a_window_starting_inside_the_first_wave_is_noted(tmp_path):
    """A closed loop's first wave is sent at 0 s: warmup_requests below the client count
    starts the window inside it, which `pdsim check` and `pdsim run` say."""
    import yaml
    from typer.testing import CliRunner

    from pdsim.cli import app
    from pdsim.runner import first_wave_note

    short = experiment(concurrency=16, metrics={"warmup_requests": 8})
    note = first_wave_note(parse_experiment(short))
    assert note is not None and "below the closed loop's 16 clients" in note
    for metrics in ({"warmup_requests": 16}, {}, {"warmup_requests": 8, "warmup_s": 1.0}):
        assert first_wave_note(parse_experiment(experiment(concurrency=16, metrics=metrics))) \
            is None, metrics
    config = tmp_path / "closed.yaml"
    config.write_text(yaml.safe_dump(short))
    result = CliRunner().invoke(app, ["check", str(config)])
    assert result.exit_code == 0 and "give at least 16" in " ".join(result.output.split())


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_a_request_beyond_the_models_context_fails_as_sglang_refuses_it(mode):
    """Llama-3.1-8B serves 131,072 tokens (max_position_embeddings): a prompt + output that
    reach it fail at once with the reason; the shorter ones are served."""
    data = experiment(concurrency=2, num_requests=8)
    data["workload"]["input_len"] = {"dist": "uniform", "low": 125_000, "high": 136_000}
    data["workload"]["output_len"] = {"dist": "fixed", "value": 1000}
    if mode == "colocated":
        data["cluster"] = {"mode": "colocated", "colocated": {"instances": 1}}
    cfg = parse_experiment(data)
    wl = generate(cfg.workload)
    result = Simulation(build_cluster(cfg), cfg.seed).run(
        wl.arrival_s, wl.input_tokens, wl.output_tokens, wl.closed_loop)
    too_long = {r.rid for r in result.records if r.input_tokens + 1000 >= 131_072}
    assert too_long and len(too_long) < len(result.records)
    for r in result.records:
        assert r.ok == (r.rid not in too_long)
        if not r.ok:
            assert "beyond the model's context length of 131072 tokens" in r.error
