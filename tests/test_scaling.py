"""The launcher's scaling (runtime/scaling.py) over a real router and scripted workers on
loopback (tests/test_router.py's), processes stood in for: `POST /scale` moves a role to a
count, the autoscaling loop applies the shared policy's targets, and its observation of a
window is what the router saw. tests/test_scale_real.py scales real worker processes."""

from __future__ import annotations

import asyncio
import math

import aiohttp
import pytest

from pdsim.core.autoscale import Bounds, FixedSchedule, RoleState
from pdsim.core.records import RequestRecord
from runtime.launcher import WorkerProcess
from runtime.scaling import Autoscaler, Scaler, ScaleError, window_observation
from test_router import ScriptedWorker
from test_router_workers import TOKEN, call, cleanup, complete, make_router, started

pytestmark = [pytest.mark.real]


class Pool:
    """Scripted workers started ahead, handed out as the Scaler "spawns" instances."""

    def __init__(self, spares: list[ScriptedWorker]) -> None:
        self.spares = spares
        self.spawned: list[WorkerProcess] = []
        self.stopped: list[str] = []

    def spawn(self, role: str, instance: int) -> WorkerProcess:
        spare = next(w for w in self.spares if w.role == role)
        self.spares.remove(spare)
        worker = WorkerProcess(role, instance, spare.url, None)
        self.spawned.append(worker)
        return worker

    async def healthy(self, worker: WorkerProcess) -> dict:
        return {"role": worker.role, "bootstrap_host": "127.0.0.1", "bootstrap_port": 9999}

    def stop(self, worker: WorkerProcess) -> None:
        self.stopped.append(worker.name)


async def deployment(n_spares: int = 2, wait_healthy=None):
    workers = await started(ScriptedWorker("prefill"), ScriptedWorker("decode"),
                            *(ScriptedWorker(role) for role in ("prefill", "decode")
                              for _ in range(n_spares)))
    p0, d0, spares = workers[0], workers[1], list(workers[2:])
    router = await make_router([p0], [d0])
    pool = Pool(spares)
    scaler = Scaler(router, [WorkerProcess("prefill", 0, p0.url, None),
                             WorkerProcess("decode", 0, d0.url, None)],
                    spawn=pool.spawn, wait_healthy=wait_healthy or pool.healthy, stop=pool.stop,
                    pools_timeout_s=0.0)  # scripted workers have no /pools
    return router, scaler, pool, workers


def test_post_scale_moves_a_role_to_a_count_and_refuses_bad_input():
    async def main():
        router, scaler, pool, workers = await deployment()
        try:
            async with aiohttp.ClientSession() as s:
                assert await scaler.scale("decode", 3) == []
                assert scaler.counts() == {"prefill": 1, "decode": 3}
                names = [m.name for m in router.client.decode]
                assert names == ["decode worker 0", "decode worker 1", "decode worker 2"]
                texts = await asyncio.gather(*(complete(s, router, f"r{i}") for i in range(6)))
                assert texts == [(200, f"r{i}") for i in range(6)]
                assert all(len(w.generated) == 2 for w in workers if w.role == "decode"
                           and w.url in {m.address.url for m in router.client.decode})
                drained = await scaler.scale("decode", 1)
                assert [d["name"] for d in drained] == ["decode worker 2", "decode worker 1"]
                assert pool.stopped == ["decode worker 2", "decode worker 1"]
                assert [w.name for w in scaler.workers] == ["prefill worker 0",
                                                            "decode worker 0"]
                for role, n, message in (("decode", 0, "instances: 0; allowed: 1 or more"),
                                         ("router", 1, "role: 'router'; allowed: prefill")):
                    with pytest.raises(ScaleError) as e:
                        await scaler.scale(role, n)
                    assert e.value.status == 400 and message in e.value.message
                scaler.bounds = Bounds(max_decode=2)  # an autoscaling section's
                with pytest.raises(ScaleError) as e:
                    await scaler.scale("decode", 3)
                assert "instances: 3; allowed: 1 to 2 (autoscaling.decode)" in e.value.message
                assert scaler.counts() == {"prefill": 1, "decode": 1}
        finally:
            await cleanup(router, *workers)

    asyncio.run(main())


def test_the_scale_route_needs_the_cluster_token_and_names_bad_input():
    async def main():
        workers = await started(ScriptedWorker("prefill"), ScriptedWorker("decode"),
                                ScriptedWorker("decode"))
        router = make_router([workers[0]], [workers[1]], start=False)
        pool = Pool([workers[2]])
        scaler = Scaler(router, [WorkerProcess("prefill", 0, workers[0].url, None),
                                 WorkerProcess("decode", 0, workers[1].url, None)],
                        spawn=pool.spawn, wait_healthy=pool.healthy, stop=pool.stop,
                        pools_timeout_s=0.0)
        router.add_internal(("POST", "/scale", scaler.handle))
        router.protect(api_key="public-key")
        await router.start()
        try:
            async with aiohttp.ClientSession() as s:
                status, answer = await call(s, router, "POST", "/scale",
                                            {"role": "decode", "instances": 2},
                                            {"Authorization": "Bearer public-key"})
                assert status == 401, answer
                for body, message in (({"role": "decode"}, "instances: missing"),
                                      ({"role": "decode", "instances": "2"},
                                       "instances: '2'; allowed: a int"),
                                      ({"role": "decode", "instances": True},
                                       "instances: True; allowed: a int"),
                                      ({"role": "decode", "instances": 0},
                                       "instances: 0; allowed: 1 or more")):
                    status, answer = await call(s, router, "POST", "/scale", body)
                    assert status == 400 and message in answer["error"]["message"], answer
                status, answer = await call(s, router, "POST", "/scale",
                                            {"role": "decode", "instances": 2})
                assert status == 200, answer
                assert answer["instances"] == {"prefill": 1, "decode": 2}
                assert [w["name"] for w in answer["workers"]] == [
                    "prefill worker 0", "decode worker 0", "decode worker 1"]
                status, answer = await call(s, router, "POST", "/scale",
                                            {"role": "decode", "instances": 1})
                assert status == 200 and [d["name"] for d in answer["drained"]] == [
                    "decode worker 1"], answer
        finally:
            await cleanup(router, *workers)

    asyncio.run(main())


def test_the_autoscaler_applies_the_policys_targets_while_requests_flow():
    async def main():
        router, scaler, pool, workers = await deployment()
        policy = FixedSchedule([(0.0, 1, 1), (0.4, 1, 2), (1.0, 2, 1)], interval_s=0.1)
        auto = Autoscaler(policy, scaler, headers=TOKEN)
        loop = asyncio.create_task(auto.run())
        try:
            async with aiohttp.ClientSession() as s:
                results = []
                while router.client.now() < 1.6:
                    results.append(await complete(s, router, "flow"))
            assert all(r == (200, "flow") for r in results), results
            assert scaler.counts() == {"prefill": 2, "decode": 1}
            assert [m.name for m in router.client.members()] == [
                "prefill worker 0", "prefill worker 1", "decode worker 0"]
            assert pool.stopped == ["decode worker 1"]
            wants = [want for _, want in auto.decisions]
            assert {"prefill": 1, "decode": 2} in wants and wants[-1] == {"prefill": 2,
                                                                          "decode": 1}
            first_up = wants.index({"prefill": 1, "decode": 2})
            assert all(w == {"prefill": 1, "decode": 1} for w in wants[:first_up])
            obs, _ = auto.decisions[first_up + 1]  # the decision after decode worker 1 joined
            assert (obs.decode.running, obs.prefill.running) == (2, 1)
            assert obs.arrivals > 0 and obs.mean_input_tokens is not None
        finally:
            loop.cancel()
            await asyncio.gather(loop, return_exceptions=True)
            await cleanup(router, *workers)

    asyncio.run(main())


def test_a_window_observation_counts_what_the_router_saw_in_it():
    def record(arrival: float, first: float, finish: float, n_out: int, ok=True):
        times = [first + k * (finish - first) / max(n_out - 1, 1) for k in range(n_out)]
        return RequestRecord(rid="r", input_tokens=0, output_tokens=n_out,
                             status="ok" if ok else "failed", arrival_s=arrival,
                             first_token_s=first, finish_s=finish, token_times_s=times)

    records = [record(0.5, 0.9, 1.9, 11),  # finished before the window
               record(1.5, 2.5, 3.5, 5),  # finished in the window: TTFT 1.0, gaps 0.25
               record(1.0, 1.5, 3.0, 3),  # finished in the window: TTFT 0.5, gaps 0.75
               record(2.5, 2.9, 6.0, 4),  # finished after
               record(3.0, 3.2, 3.8, 3, ok=False)]  # failed: no latencies, no length
    arrivals = [(0.5, 10), (1.5, 20), (2.5, 40), (3.0, 30), (4.5, 99)]
    pre, dec = RoleState(running=1), RoleState(running=2, draining=1)
    obs = window_observation(arrivals, records, 2.0, 4.0, pre, dec)
    assert (obs.now_s, obs.window_s, obs.prefill, obs.decode) == (4.0, 2.0, pre, dec)
    assert obs.arrivals == 2 and obs.mean_input_tokens == 35.0  # at 2.5 and 3.0
    assert obs.mean_output_tokens == 4.0  # of the two that finished ok in the window
    assert math.isclose(obs.ttft_p90_s, 0.95)  # of 0.5 and 1.0, interpolated
    assert math.isclose(obs.itl_p90_s, 0.7)  # of 0.25 and 0.75
    empty = window_observation([], [], 5.0, 6.0, pre, dec)
    assert empty.arrivals == 0 and empty.mean_input_tokens is None and empty.ttft_p90_s is None


def test_a_serve_config_autoscales_only_behind_pdsims_router():
    from pdsim.config import ConfigError
    from runtime.serve_config import parse_serve_config

    base = {"model": "tiny-llama", "cluster": {
        "mode": "disaggregated", "prefill": {"scheduler": {"num_pages": 64}},
        "decode": {"scheduler": {"num_pages": 64}}},
        "autoscaling": {"policy": "threshold", "interval_s": 5}}
    assert parse_serve_config(base).autoscaling.interval_s == 5
    with pytest.raises(ConfigError) as e:
        parse_serve_config({**base, "router": {"impl": "sglang"}})
    assert "autoscaling: needs router.impl pdsim" in str(e.value)
    with pytest.raises(ConfigError) as e:
        parse_serve_config({**base, "autoscaling": {"policy": "sla", "sla": {
            "prefill_tokens_per_s": 100.0}}})
    assert "autoscaling.sla.decode_tokens_per_s" in str(e.value)
    assert "serving has no cost model" in str(e.value)


def test_an_instance_that_does_not_come_up_is_stopped_and_named():
    async def exits(worker: WorkerProcess) -> dict:
        raise RuntimeError(f"{worker.name} exited with status 1 while starting")

    async def main():
        router, scaler, pool, workers = await deployment(wait_healthy=exits)
        try:
            with pytest.raises(ScaleError) as e:
                await scaler.scale("decode", 2)
            assert e.value.status == 503
            assert e.value.message == ("decode worker 1 did not come up: decode worker 1 exited "
                                       "with status 1 while starting")
            assert pool.stopped == ["decode worker 1"] and scaler.starting["decode"] == 0
            assert scaler.counts() == {"prefill": 1, "decode": 1}
            assert [m.name for m in router.client.members()] == ["prefill worker 0",
                                                                 "decode worker 0"]
        finally:
            await cleanup(router, *workers)

    asyncio.run(main())
