"""Bad input never gets a 500, and every listener bounds what one client can hold (Reliability
II), on a real deployment (`pdsim serve`: router, prefill and decode workers, bootstrap server on
loopback) and real sockets."""

from __future__ import annotations

import json
import logging
import re
import select
import socket
import threading
import time
import urllib.parse

import pytest
import torch
import zmq
from configs import tiny_pd_yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from pdsim.deployment import HttpLimits
from runtime.http_app import RateLimit
from runtime.sampler import make_generator, sample
from runtime.sampling import (
    GREEDY_BELOW, MAX_TEMPERATURE, MIN_TOP_P, SEED_MAX, SEED_MIN, TOP_K_MAX, SamplingError,
    parse_sampling,
)
from runtime.security import AUTH_HEADER, SECRET_ENV, ClusterKey, new_secret
from runtime.protocol import transfer as m
from runtime.transfer.bootstrap_server import BootstrapServer
from runtime.transfer.channel import MAX_FRAME_BYTES, ZmqChannel

pytestmark = [pytest.mark.real, pytest.mark.slow]

SECRET = new_secret()
KEY = ClusterKey.from_secret(SECRET)
API_KEY = "reliability-key"
KEEPALIVE_S = 1.0
MAX_CONNECTIONS = 16
DEPLOYMENT = tiny_pd_yaml(extra=(
    f"security:\n  api_key: {API_KEY}\n"
    f"  limits: {{keepalive_timeout_s: {KEEPALIVE_S}, max_connections: {MAX_CONNECTIONS}}}\n"))


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    from pd_harness import Proc

    cfg = tmp_path_factory.mktemp("rel") / "pd.yaml"
    cfg.write_text(DEPLOYMENT)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(SECRET_ENV, SECRET)
        launcher = Proc(str(cfg))
    try:
        prefill = launcher.wait_for(r"prefill worker 0 .* at (http://\S+), bootstrap "
                                    r"127\.0\.0\.1:(\d+)")
        decode = launcher.wait_for(r"decode worker 0 .* at (http://\S+)").group(1)
        router = launcher.wait_for(r"\(disaggregated: .*\) at (http://\S+)/v1").group(1)
        yield {"router": router, "prefill": prefill.group(1).rstrip(","), "decode": decode,
               "bootstrap": f"http://127.0.0.1:{prefill.group(2)}"}
        assert launcher.stop() == 0
    finally:
        if launcher.proc.poll() is None:
            launcher.proc.kill()


def raw_http(url: str, method: str, path: str, headers: list[tuple[bytes, bytes]] = (),
             body: bytes = b"", timeout_s: float = 30.0) -> tuple[int, bytes]:
    """One request with exactly these header bytes; (status, body) of the answer."""
    u = urllib.parse.urlsplit(url)
    head = [f"{method} {path} HTTP/1.1".encode(), f"Host: {u.hostname}".encode(),
            b"Connection: close", f"Content-Length: {len(body)}".encode()]
    head += [k + b": " + v for k, v in headers]
    with socket.create_connection((u.hostname, u.port), timeout=timeout_s) as s:
        s.sendall(b"\r\n".join(head) + b"\r\n\r\n" + body)
        return parse_answer(read_all(s))


def read_all(s: socket.socket) -> bytes:
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    return data


def parse_answer(data: bytes) -> tuple[int, bytes]:
    head, _, rest = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    if b"transfer-encoding: chunked" in head.lower():
        out = b""
        while rest:
            size, _, rest = rest.partition(b"\r\n")
            n = int(size, 16)
            if n == 0:
                break
            out, rest = out + rest[:n], rest[n + 2:]
        rest = out
    return status, rest


def error_of(body: bytes) -> dict:
    return json.loads(body)["error"]


BEARER = [(b"Authorization", f"Bearer {API_KEY}".encode())]


# ---- no 500 from bad input ------------------------------------------------------------------


def test_non_utf8_auth_headers_are_refused_never_a_500(deployment):
    d = deployment
    targets = [(d["router"], "/health", 200), (d["router"], "/v1/models", 401),
               (d["decode"], "/health", 200), (d["decode"], "/records", 401),
               (d["prefill"], "/health", 200),
               (d["bootstrap"], "/health", 200),
               (d["bootstrap"], "/route?prefill_dp_rank=-1&target_tp_rank=-1&target_pp_rank=-1",
                401)]
    bad_values = (b"\xff\xfe\x80", b"Bearer \xc3\x28" + API_KEY.encode(),
                  "Bearer é".encode("latin-1"))
    for bad in bad_values:
        for name in (b"Authorization", AUTH_HEADER.encode()):
            for url, path, want in targets:
                status, body = raw_http(url, "GET", path, [(name, bad)])
                assert status == want, (url, path, name, bad, status, body)
                if status == 401:
                    assert error_of(body)["type"] == "authentication_error"
    status, _ = raw_http(d["router"], "GET", "/v1/models", BEARER)
    assert status == 200  # the right key still works
    status, _ = raw_http(d["decode"], "GET", "/records",
                         [(AUTH_HEADER.encode(), KEY.http_token.encode())])
    assert status == 200


def complete(url: str, **fields) -> tuple[int, bytes]:
    body = json.dumps({"prompt": "hello", "max_tokens": 2, **fields}).encode()
    return raw_http(url, "POST", "/v1/completions",
                    [*BEARER, (b"Content-Type", b"application/json")], body)


def test_sampling_fields_that_pass_validation_can_be_sampled(deployment):
    url = deployment["router"]
    for fields in ({"top_p": 1e-300}, {"top_p": 5e-324}, {"top_p": 0}, {"temperature": 2.0001},
                   {"top_k": 2**31}, {"seed": 2**63}, {"temperature": float("inf")}):
        status, body = complete(url, **{"temperature": 1.0, **fields})
        assert status == 400, (fields, body)
        assert error_of(body)["param"] == next(iter(fields)), body
    for fields in ({"top_p": MIN_TOP_P}, {"temperature": 1e-5}, {"temperature": MAX_TEMPERATURE},
                   {"top_k": TOP_K_MAX}, {"top_k": 1}, {"seed": SEED_MIN}, {"seed": SEED_MAX}):
        status, body = complete(url, **{"temperature": 1.0, **fields})
        assert status == 200, (fields, body)
        assert json.loads(body)["usage"]["completion_tokens"] == 2


edges = st.sampled_from([0, -1, 1, 5e-324, 1e-300, 1e-46, 1e-45, 1e-8, MIN_TOP_P, 1e-5,
                         MAX_TEMPERATURE, TOP_K_MAX, SEED_MIN, SEED_MAX])  # float32's and ours
junk = st.one_of(st.none(), edges, st.floats(), st.integers(-2**70, 2**70), st.booleans(),
                 st.text(max_size=3))


@settings(max_examples=400, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(temperature=st.one_of(junk, st.floats(0, 2.5)),
       top_p=st.one_of(junk, st.floats(0, 1e-40), st.floats(0, 1e-5), st.floats(0, 1.5)),
       top_k=st.one_of(junk, st.integers(-1, 300)),
       seed=st.one_of(junk, st.integers(SEED_MIN - 10, SEED_MAX + 10)),
       logits_seed=st.integers(0, 2**32 - 1), scale=st.sampled_from([1e-3, 1.0, 30.0, 1e4]),
       masked=st.floats(0, 0.99), vocab=st.integers(1, 257))
@example(temperature=1.0, top_p=1e-300, top_k=0, seed=None, logits_seed=0, scale=1.0,
         masked=0.0, vocab=50)  # passed validation and failed to sample (a 500)
@example(temperature=GREEDY_BELOW, top_p=MIN_TOP_P, top_k=TOP_K_MAX, seed=SEED_MIN,
         logits_seed=1, scale=1e4, masked=0.9, vocab=257)
def test_whatever_parse_sampling_accepts_the_sampler_samples(temperature, top_p, top_k, seed,
                                                            logits_seed, scale, masked, vocab):
    """The whole sampling space against the real sampler: a value either is refused naming its
    field, or samples a token the logits allow, never a failed row."""
    raw = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "seed": seed}
    try:
        params = parse_sampling(raw, default_temperature=1.0)
    except SamplingError as exc:
        assert exc.field in raw and exc.field in str(exc)
        return
    g = torch.Generator().manual_seed(logits_seed)
    logits = torch.randn(2, vocab, generator=g) * scale
    mask = torch.rand(2, vocab, generator=g) < masked
    mask[:, 0] = False  # a row keeps at least one allowed token, as the vocabulary limit does
    logits = logits.masked_fill(mask, float("-inf"))
    gens = [make_generator(params.seed if params.seed is not None else 0)] * 2
    result = sample(logits, [params, params], gens)
    assert result.failed == {}
    chosen = logits.gather(1, result.token_ids[:, None])[:, 0]
    assert torch.isfinite(chosen).all() and torch.isfinite(result.logprobs).all()


def test_a_long_token_id_prompt_is_refused_before_its_ids_are_checked(deployment):
    status, body = complete(deployment["router"], prompt=[10**9] * 200_000)
    assert status == 400
    err = error_of(body)
    assert err["param"] == "prompt" and "the prompt has 200000 tokens" in err["message"], err


def test_router_errors_name_workers_by_role_and_index_never_an_address(caplog):
    import openai

    from test_router import Cluster, ScriptedWorker

    c = Cluster([ScriptedWorker("prefill")], [ScriptedWorker("decode")])
    try:
        url = c.decode[0].url
        c.run(c.decode[0].runner.cleanup())  # the decode worker goes away
        with caplog.at_level(logging.WARNING, "runtime.router"):
            with pytest.raises(openai.APIStatusError) as e:
                c.client().completions.create(model="tiny", prompt="hi", max_tokens=2)
        message = e.value.body["message"]
        assert e.value.status_code == 503 and message == "decode worker 0 is unreachable"
        assert any(url in r.getMessage() for r in caplog.records)  # the operator's log has it
        time.sleep(c.router.client.health_ttl_s)
        status, body = raw_http(c.router.url, "GET", "/health")
        text = body.decode()
        assert status == 503 and "decode worker 0" in text
        assert not re.search(r"127\.0\.0\.1|localhost|:\d{4,5}\b|http://", text), text
    finally:
        c.run(c.router.close())
        c.run(c.prefill[0].runner.cleanup())
        c.loop.call_soon_threadsafe(c.loop.stop)


def test_protocol_errors_are_json_on_every_listener(deployment):
    d = deployment
    token = [(AUTH_HEADER.encode(), KEY.http_token.encode())]
    for url, auth in ((d["router"], BEARER), (d["decode"], token), (d["bootstrap"], token)):
        cases = [("GET", "/nowhere", auth, b"", 404), ("DELETE", "/health", auth, b"", 405),
                 ("GET", "/health", [(b"X-Long", b"x" * 9000)], b"", 400),
                 ("GET", "/health", [(b"X-Bad\x01", b"1")], b"", 400),
                 ("POST", "/v1/completions" if url == d["router"] else "/generate", auth,
                  b"{not json", 400)]
        if url == d["bootstrap"]:
            cases[-1] = ("PUT", "/route", auth, b"{not json", 400)
        for method, path, headers, body, want in cases:
            status, answer = raw_http(url, method, path, headers, body)
            assert status == want, (url, method, path, status, answer)
            assert isinstance(json.loads(answer)["error"], (dict, str)), answer
        # a body over the limit: refused from its Content-Length, before it is sent
        with socket.create_connection(urllib.parse.urlsplit(url)[1].split(":")) as s:
            s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 60000000\r\n" +
                      b"\r\n".join(k + b": " + v for k, v in auth) + b"\r\n\r\n")
            s.settimeout(10)
            status, answer = parse_answer(s.recv(65536))
        assert status == 413 and "max_body_bytes" in error_of(answer)["message"], answer


def test_bootstrap_route_refuses_deeply_nested_json_with_400(deployment):
    token = [(AUTH_HEADER.encode(), KEY.http_token.encode())]
    for body in (b"[" * 100_000 + b"]" * 100_000, b"\xff\xfe", b'{"ip": 1e999999}'):
        status, answer = raw_http(deployment["bootstrap"], "PUT", "/route", token, body)
        assert status == 400, (status, answer[:200])
        assert "error" in json.loads(answer)


# ---- ZMQ -----------------------------------------------------------------------------------


def test_an_oversized_zmq_frame_is_dropped_and_the_socket_keeps_serving():
    rx, tx = ZmqChannel(key=KEY), ZmqChannel(key=KEY)
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    try:
        push.connect(rx.endpoint)
        push.send(b"\0" * (MAX_FRAME_BYTES + 1))  # never buffered whole: the peer is cut off
        beat = m.Heartbeat(session_id="s", endpoint=tx.endpoint, reply=False)
        tx.send(rx.endpoint, beat)
        received = [rx.recv(100) for _ in range(30)]  # 3 s: time for the big frame to arrive
        assert [x for x in received if x is not None] == [beat]
        assert rx.rejected_frames == rx.bad_frames == 0  # the big frame never reached recv
        # the same peer reconnects and is served again with a frame of a legitimate size
        pages = m.pack_pages(range(1 << 16))
        info = m.TransferInfo(room=1, session_id="s", decode_tp_rank=0, dst_pages=pages[0],
                              page_dtype=pages[1], metadata_slot=0, is_dummy=False)
        push.send(KEY.seal(m.encode(info)))
        for _ in range(50):
            if (got := rx.recv(100)) is not None:
                break
        assert got == info
    finally:
        push.close()
        ctx.term()
        rx.close()
        tx.close()


# ---- connection limits ---------------------------------------------------------------------


def test_an_idle_connection_is_closed_after_the_keepalive_timeout(deployment):
    for url in deployment.values():
        u = urllib.parse.urlsplit(url)
        with socket.create_connection((u.hostname, u.port)) as fresh, \
                socket.create_connection((u.hostname, u.port)) as used, \
                socket.create_connection((u.hostname, u.port)) as slow:
            used.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            used.settimeout(10)
            assert used.recv(65536).startswith(b"HTTP/1.1 200")
            slow.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")  # headers never end
            start = time.monotonic()
            for s in (fresh, used, slow):
                s.settimeout(KEEPALIVE_S + 5)
                assert s.recv(1) == b""  # closed by the server
            assert KEEPALIVE_S * 0.5 < time.monotonic() - start < KEEPALIVE_S + 3


def test_a_60_mb_body_is_refused_while_another_clients_stream_flows(deployment):
    url = deployment["router"]
    u = urllib.parse.urlsplit(url)
    body = json.dumps({"prompt": "stream", "max_tokens": 120, "stream": True,
                       "ignore_eos": True, "temperature": 0}).encode()
    times: list[float] = []

    def stream() -> None:
        with socket.create_connection((u.hostname, u.port), timeout=60) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                      b"Content-Type: application/json\r\nAuthorization: Bearer " +
                      API_KEY.encode() + f"\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                      + body)
            while chunk := s.recv(65536):
                times.extend([time.monotonic()] * chunk.count(b"data: {"))
                if b"data: [DONE]" in chunk:
                    times.append(-1.0)

    reader = threading.Thread(target=stream)
    reader.start()
    deadline = time.monotonic() + 60
    while len(times) < 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(times) >= 5, "the stream did not start"
    answers = [upload_60_mb(u, chunked=False), upload_60_mb(u, chunked=True)]
    reader.join(60)
    assert times and times[-1] == -1.0, "the stream did not end with [DONE]"
    gaps = [b - a for a, b in zip(times, times[1:-1])]
    assert len(gaps) >= 20 and max(gaps) < 2.0, (len(gaps), max(gaps))
    for sent, status, answer in answers:
        assert status == 413 and error_of(answer)["type"] == "invalid_request_error", answer
        assert sent <= HttpLimits().max_body_bytes + (16 << 20)  # refused long before 60 MB


def upload_60_mb(u: urllib.parse.SplitResult, chunked: bool) -> tuple[int, int, bytes]:
    """Start sending a 60 MB completion body; read the answer as soon as one comes (declared
    in Content-Length: before any byte of it; chunked: once the limit has been read).
    (bytes sent, status, body)."""
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + API_KEY.encode() + b"\r\n")
    head += (b"Transfer-Encoding: chunked" if chunked else b"Content-Length: 60000000") + \
        b"\r\n\r\n"
    piece = b"[" + b"1," * (1 << 16)
    with socket.create_connection((u.hostname, u.port), timeout=30) as s:
        s.sendall(head)
        s.settimeout(30)
        sent, answer = 0, b""
        while chunked and sent < 60_000_000 and not select.select([s], [], [], 0)[0]:
            try:
                s.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
            except (BrokenPipeError, ConnectionResetError):
                break
            sent += len(piece)
        try:
            while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
                chunk = s.recv(65536)
                if not chunk:
                    break
                answer += chunk
        except ConnectionResetError:
            pass
    return (sent, *parse_answer(answer))


def test_a_flood_of_idle_connections_at_the_cap_leaves_room_for_a_real_request(deployment):
    for url in (deployment["router"], deployment["decode"], deployment["bootstrap"]):
        u = urllib.parse.urlsplit(url)
        flood = [socket.create_connection((u.hostname, u.port))
                 for _ in range(MAX_CONNECTIONS * 2)]
        try:
            time.sleep(0.2)
            start = time.monotonic()
            status, _ = raw_http(url, "GET", "/health", timeout_s=5)
            assert status == 200 and time.monotonic() - start < 1.0
            closed = 0
            for s in flood:
                s.settimeout(0.5)
                try:
                    closed += s.recv(1) == b""
                except ConnectionResetError:
                    closed += 1
                except TimeoutError:
                    pass
            assert closed >= MAX_CONNECTIONS, closed  # the cap held: the oldest idle went
        finally:
            for s in flood:
                s.close()


# ---- logs ----------------------------------------------------------------------------------


def test_repeated_identical_log_lines_are_limited_to_one_a_second_with_a_count():
    now = [0.0]
    limit = RateLimit(interval_s=1.0, clock=lambda: now[0])
    logger = logging.getLogger("test_reliability.flood")
    out: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            out.append(record.getMessage())

    logger.addFilter(limit)
    logger.addHandler(Keep())
    logger.propagate = False
    for i in range(100):
        logger.error("accept failed: %s", "Too many open files")
        logger.error("another message %d", i)  # its own key: one line too
        now[0] += 0.005
    assert out == ["accept failed: Too many open files", "another message 0"]
    now[0] += 1.0
    logger.error("accept failed: %s", "Too many open files")
    assert re.fullmatch(r"accept failed: Too many open files \[99 more like this in the last "
                        r"[\d.]+ s not logged\]", out[-1]), out[-1]


def test_a_flood_of_malformed_requests_logs_a_line_a_second(caplog):
    with BootstrapServer() as server, caplog.at_level(logging.INFO, "runtime.http_app"):
        time.sleep(1.1)  # lines of earlier tests are a second old
        for _ in range(200):
            status, _ = raw_http(server.url, "GET", "/health", [(b"X-Long", b"x" * 9000)])
            assert status == 400
        lines = [r.getMessage() for r in caplog.records if "malformed" in r.getMessage()]
        assert 1 <= len(lines) <= 3, lines
        time.sleep(1.1)
        raw_http(server.url, "GET", "/health", [(b"X-Long", b"x" * 9000)])
        lines = [r.getMessage() for r in caplog.records if "malformed" in r.getMessage()]
        assert re.search(r"\[\d+ more like this", lines[-1]), lines[-1]


def test_the_colocated_server_refuses_bad_headers_and_closes_idle_connections():
    from configs import colocated_config
    from runtime.colocated import BackgroundServer, build_server

    server = build_server(colocated_config(num_pages=32, page_size=8, device="cpu"))
    server.protect(api_key=API_KEY, limits=HttpLimits(keepalive_timeout_s=0.5))
    with BackgroundServer(server) as srv:
        assert raw_http(srv.url, "GET", "/health", [(b"Authorization", b"\xff")])[0] == 200
        status, body = raw_http(srv.url, "GET", "/v1/models", [(b"Authorization", b"\xff")])
        assert status == 401 and error_of(body)["type"] == "authentication_error"
        status, body = complete(srv.url, top_p=1e-300)
        assert status == 400 and error_of(body)["param"] == "top_p"
        u = urllib.parse.urlsplit(srv.url)
        with socket.create_connection((u.hostname, u.port)) as idle:
            idle.settimeout(5)
            start = time.monotonic()
            assert idle.recv(1) == b"" and time.monotonic() - start < 3
