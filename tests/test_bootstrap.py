"""The HTTP bootstrap server on loopback: registration, lookup, readiness and errors."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict, replace

import pytest

from runtime.transfer.bootstrap_server import (
    BootstrapClient, BootstrapError, BootstrapMismatchError, BootstrapServer, ParallelInfo,
    RankRegistration, check_compatible,
)

pytestmark = [pytest.mark.real]


def reg(tp_rank=0, dp_rank=0, *, tp_size=2, dp_size=1, port=5000) -> RankRegistration:
    return RankRegistration(ip="127.0.0.1", zmq_port=port + tp_rank, tp_rank=tp_rank,
                            tp_size=tp_size, dp_rank=dp_rank, dp_size=dp_size, pp_rank=0,
                            pp_size=1, page_size=16, kv_dtype="bfloat16", total_kv_heads=8)


def http(method, url, body=None):
    data = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.fixture
def server():
    with BootstrapServer("127.0.0.1", 0) as s:
        yield s


def route(server, dp, tp, pp=0):
    return http("GET", f"{server.url}/route?prefill_dp_rank={dp}&target_tp_rank={tp}"
                       f"&target_pp_rank={pp}")


def test_port_zero_picks_a_free_port_and_health_answers(server):
    assert server.port > 0
    status, body = http("GET", f"{server.url}/health")
    assert status == 200 and body["status"] == "ok"
    assert BootstrapClient("127.0.0.1", server.port).health()


def test_503_until_every_rank_registered_then_lookup_and_info(server):
    status, body = route(server, -1, -1, -1)
    assert status == 503 and "0 of ? ranks" in body["error"]

    assert http("PUT", f"{server.url}/route", asdict(reg(0)))[0] == 200
    status, body = route(server, 0, 0)
    assert status == 503 and "1 of 2 ranks" in body["error"]

    assert http("PUT", f"{server.url}/route", asdict(reg(1)))[0] == 200
    status, body = route(server, 0, 1)
    assert status == 200 and RankRegistration.from_json(body) == reg(1)
    status, body = route(server, -1, -1, -1)
    assert status == 200
    assert ParallelInfo(**body) == ParallelInfo(tp_size=2, dp_size=1, pp_size=1, page_size=16,
                                                kv_dtype="bfloat16", total_kv_heads=8)


def test_unknown_rank_is_404(server):
    for r in (reg(0), reg(1)):
        http("PUT", f"{server.url}/route", asdict(r))
    status, body = route(server, 0, 2)
    assert status == 404 and "tp=2" in body["error"]
    assert route(server, 1, 0)[0] == 404


@pytest.mark.parametrize("query, needle", [
    ("prefill_dp_rank=0&target_tp_rank=0", "target_pp_rank"),
    ("prefill_dp_rank=x&target_tp_rank=0&target_pp_rank=0", "must be an integer"),
    ("prefill_dp_rank=-1&target_tp_rank=0&target_pp_rank=0", "all -1"),
])
def test_bad_queries_are_400_with_the_reason(server, query, needle):
    status, body = http("GET", f"{server.url}/route?{query}")
    assert status == 400 and needle in body["error"]


@pytest.mark.parametrize("body, needle", [
    (b"{not json", "not valid JSON"),
    ([1, 2], "JSON object"),
    ({k: v for k, v in asdict(reg(0)).items() if k != "zmq_port"}, "missing field 'zmq_port'"),
    ({**asdict(reg(0)), "colour": "red"}, "unknown registration fields ['colour']"),
    ({**asdict(reg(0)), "tp_rank": "0"}, "'tp_rank' must be int"),
    ({**asdict(reg(0)), "tp_rank": True}, "'tp_rank' must be int"),
    ({**asdict(reg(0)), "tp_rank": 2}, "tp_rank must be in 0..tp_size-1"),
])
def test_malformed_registration_is_400_with_the_reason(server, body, needle):
    status, answer = http("PUT", f"{server.url}/route", body)
    assert status == 400 and needle in answer["error"], answer


def test_a_rank_that_disagrees_with_the_instance_is_rejected(server):
    http("PUT", f"{server.url}/route", asdict(reg(0)))
    status, body = http("PUT", f"{server.url}/route", asdict(replace(reg(1), page_size=32)))
    assert status == 400 and "already has" in body["error"]


def test_client_waits_for_late_registration():
    with BootstrapServer() as server:
        client = BootstrapClient("127.0.0.1", server.port, timeout_s=5)

        def register_later():
            time.sleep(0.3)
            for r in (reg(0, tp_size=1, dp_size=2), reg(0, dp_rank=1, tp_size=1, dp_size=2)):
                BootstrapClient("127.0.0.1", server.port).register(r)

        t = threading.Thread(target=register_later)
        t.start()
        assert client.parallel_info().dp_size == 2
        assert client.rank(1, 0).dp_rank == 1
        t.join()


def test_client_gives_up_after_its_timeout_and_says_why():
    with BootstrapServer() as server:
        client = BootstrapClient("127.0.0.1", server.port, timeout_s=0.3)
        with pytest.raises(BootstrapError, match="503: prefill instance not ready"):
            client.parallel_info()
    with pytest.raises(BootstrapError, match="unreachable"):
        BootstrapClient("127.0.0.1", server.port, timeout_s=0.2).parallel_info()


def test_client_raises_at_once_on_404():
    with BootstrapServer() as server:
        BootstrapClient("127.0.0.1", server.port).register(reg(0, tp_size=1))
        with pytest.raises(BootstrapError, match="404"):
            BootstrapClient("127.0.0.1", server.port, timeout_s=5).rank(0, 3)


def test_check_compatible_names_each_mismatch():
    info = reg(0).info()
    check_compatible(info, page_size=16, kv_dtype="bfloat16")
    with pytest.raises(BootstrapMismatchError, match=r"page_size: prefill 16, decode 32.*kv_dtype"):
        check_compatible(info, page_size=32, kv_dtype="float16")
