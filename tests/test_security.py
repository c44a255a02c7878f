"""Nothing reachable from outside, a cluster secret, bounded peer state (issue 8), on real
sockets: ZMQ channels, Mooncake managers over TCP, the bootstrap server, a TP group, and a whole
deployment started by the launcher."""

from __future__ import annotations

import json
import logging
import os
import re
import urllib.error
import urllib.request
from dataclasses import asdict

import msgpack
import pytest
import zmq

from pdsim.core.kvpoll import KVPoll
from runtime.transfer.bootstrap_server import BootstrapClient, BootstrapError, BootstrapServer, RankRegistration
from runtime.distributed import run_ranks
from runtime.security import (
    AUTH_HEADER, SECRET_ENV, ClusterKey, SecurityError, deployment_secret, listeners,
    new_secret, resolve_secret,
)
from runtime.transfer import bindshim
from runtime.protocol import transfer as m
from runtime.transfer.channel import ChannelError, ZmqChannel
from runtime.transfer.prefill import MAX_UNCLAIMED_ROOMS
from configs import tiny_pd_yaml
from test_mooncake_transfer import CONFIG, Cluster, request, wait_for

pytestmark = [pytest.mark.real]

SECRET = new_secret()
KEY = ClusterKey.from_secret(SECRET)
OTHER = ClusterKey.from_secret(new_secret())


def open_fds(pid: int | str = "self") -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


# ---- the secret ----------------------------------------------------------------------------


def test_sealed_frames_open_only_with_the_same_secret():
    frame = KEY.seal(b"body")
    assert KEY.open(frame) == b"body"
    assert OTHER.open(frame) is None
    assert KEY.open(frame[:-1] + b"x") is None  # body changed
    assert KEY.open(bytes([frame[0] ^ 1]) + frame[1:]) is None  # tag changed
    assert KEY.open(b"short") is None
    assert KEY.accepts(KEY.http_token) and not KEY.accepts(OTHER.http_token)
    assert not KEY.accepts(None) and SECRET not in KEY.http_token


def test_the_secret_comes_from_the_environment_or_the_config(monkeypatch, caplog):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    with pytest.raises(SecurityError, match=f"decode worker 0 needs .* set {SECRET_ENV}"):
        resolve_secret(None, what="decode worker 0")
    with caplog.at_level(logging.WARNING, logger="runtime.security"):
        assert resolve_secret(None, insecure=True) is None
    assert "INSECURE" in caplog.text
    assert resolve_secret("c" * 16) == "c" * 16
    with pytest.raises(SecurityError, match="at least 16"):
        resolve_secret("too short")
    monkeypatch.setenv(SECRET_ENV, SECRET)
    assert resolve_secret("c" * 16) == SECRET == deployment_secret(None)
    monkeypatch.delenv(SECRET_ENV)
    fresh = {deployment_secret(None) for _ in range(3)}
    assert len(fresh) == 3 and all(len(s) == 64 for s in fresh)


def test_secrets_never_leave_in_a_dumped_config():
    from runtime.serve_config import PDServeConfig

    pool = {"scheduler": {"num_pages": 8}}
    cfg = PDServeConfig.model_validate({"model": "tiny-llama",
                                        "cluster": {"prefill": pool, "decode": pool},
                                        "security": {"cluster_secret": SECRET,
                                                     "api_key": "public-key"}})
    assert cfg.security.cluster_secret == SECRET and cfg.security.api_key == "public-key"
    dumped = json.dumps(cfg.model_dump(mode="json"))
    assert SECRET not in dumped and "public-key" not in dumped and SECRET not in repr(cfg)


# ---- ZMQ -----------------------------------------------------------------------------------

BEAT = m.Heartbeat(session_id="127.0.0.1:1", endpoint="tcp://127.0.0.1:2", reply=False)


def recv_all(channel: ZmqChannel, wait_ms: int = 200) -> list:
    got = []
    while (msg := channel.recv(timeout_ms=wait_ms)) is not None or channel._pull.poll(0):
        if msg is not None:
            got.append(msg)
    return got


def test_the_channel_drops_and_counts_unauthenticated_frames():
    receiver, sender = ZmqChannel(key=KEY), ZmqChannel(key=KEY)
    stranger, impostor = ZmqChannel(), ZmqChannel(key=OTHER)
    ctx = zmq.Context()
    raw = ctx.socket(zmq.PUSH)
    raw.connect(receiver.endpoint)
    try:
        stranger.send(receiver.endpoint, BEAT)
        impostor.send(receiver.endpoint, BEAT)
        raw.send(b"\x00" * 40)
        raw.send(m.encode(BEAT))  # a valid message, no tag
        tampered = bytearray(KEY.seal(m.encode(BEAT)))
        tampered[-2] ^= 1
        raw.send(bytes(tampered))
        sender.send(receiver.endpoint, BEAT)
        wait_for(lambda: receiver._pull.poll(0), what="frames")
        got = []
        wait_for(lambda: got.extend(recv_all(receiver, 20)) or (
            receiver.rejected_frames == 5 and got), what="five rejections and one message")
        assert got == [BEAT] and receiver.rejected_frames == 5 and receiver.bad_frames == 0
    finally:
        raw.close(linger=0)
        ctx.term()
        for c in (receiver, sender, stranger, impostor):
            c.close()


def test_the_channel_keeps_at_most_max_peers_sockets():
    channel = ZmqChannel(key=KEY, max_peers=4, connect_timeout_s=0.01)
    try:
        before = open_fds()
        for port in range(20000, 20050):  # nothing listens there: ZMQ keeps reconnecting
            with pytest.raises(ChannelError, match="no connection within 0.01 s"):
                channel.send(f"tcp://127.0.0.1:{port}", BEAT)
        assert channel.num_peers == 4
        # closed sockets go once their linger (0.1 s) is over
        wait_for(lambda: open_fds() - before < 15, timeout_s=5, what="the sockets to close")
        channel.forget("tcp://127.0.0.1:20049")
        assert channel.num_peers == 3
    finally:
        channel.close()


# ---- the transfer backend's peer state -----------------------------------------------------


# Floods queue a decode rank's heartbeats behind thousands of frames: a timeout of seconds, not
# CONFIG's 0.5 s, keeps a busy 2-core machine from declaring it dead meanwhile.
SECURED = CONFIG.model_copy(update={"heartbeat_timeout_s": 10.0})


@pytest.fixture(scope="module")
def secured():
    cluster = Cluster.start(1, 1, config=SECURED, key=KEY)
    yield cluster
    cluster.close()


def sealed_push(endpoint: str, frames, key: ClusterKey | None = KEY) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.connect(endpoint)
    for body in frames:
        sock.send(body if key is None else key.seal(body))
    sock.close(linger=5000)
    ctx.term()


def test_a_secured_cluster_transfers(secured):
    src, dst = [0, 1, 2], [5, 6, 7]
    senders, receivers = secured.transfer(201, src, dst, chunks=2)
    assert [e.poll() for e in senders + receivers] == [KVPoll.Success] * 2
    secured.assert_arrived(src, dst, only_there=False)


def test_heartbeats_from_unregistered_endpoints_open_no_sockets(secured):
    (_, p), (_, d) = secured.prefill[0], secured.decode[0]
    side, channel = p.prefill, p.channel
    dropped, rejected, peers, fds = (side.dropped_messages, channel.rejected_frames,
                                     channel.num_peers, open_fds())
    n = 2000
    beats = [m.encode(m.Heartbeat(session_id=f"10.0.0.1:{i}", endpoint=f"tcp://127.0.0.1:{i}",
                                  reply=False)) for i in range(1, n + 1)]
    sealed_push(channel.endpoint, beats)  # authenticated, but no such decode rank registered
    sealed_push(channel.endpoint, beats[:300], key=None)  # not even authenticated
    wait_for(lambda: side.dropped_messages - dropped == n
             and channel.rejected_frames - rejected == 300, timeout_s=30, what="the flood")
    assert channel.num_peers == peers and open_fds() - fds < 10
    # A beat naming a registered session is echoed to where that session registered, not to
    # the endpoint the message names.
    sealed_push(channel.endpoint, [m.encode(m.Heartbeat(
        session_id=d.session_id, endpoint="tcp://127.0.0.1:9", reply=False))])
    wait_for(lambda: side._last_seen.get(d.session_id, 0) > 0, what="the registered beat")
    assert "tcp://127.0.0.1:9" not in channel._push
    senders, receivers = secured.transfer(202, [3], [9], chunks=1)
    assert all(e.poll() is KVPoll.Success for e in senders + receivers)


@pytest.mark.slow
def test_unknown_room_aborts_stay_bounded(secured):
    (_, p), (_, d) = secured.prefill[0], secured.decode[0]
    side = p.prefill
    secured.transfer(204, [5], [11], chunks=1)  # the decode rank registers (run alone too)
    rooms = side.num_rooms
    for room in range(10**6, 10**6 + 100_000):
        side.on_abort(m.Abort(room=room, reason="flood", session_id=d.session_id))
    assert side.num_rooms <= rooms + MAX_UNCLAIMED_ROOMS
    for room in range(2 * 10**6, 2 * 10**6 + 1000):  # from no registered rank: nothing kept
        side.on_abort(m.Abort(room=room, reason="flood", session_id="10.0.0.1:1"))
    assert side.num_rooms <= rooms + MAX_UNCLAIMED_ROOMS
    # through ZMQ too, and the transfers go on
    frames = [m.encode(m.Abort(room=3 * 10**6 + i, reason="x", session_id=d.session_id))
              for i in range(500)]
    sealed_push(p.channel.endpoint, frames)
    wait_for(lambda: 3 * 10**6 + 499 in side._rooms, what="the aborts")
    assert side.num_rooms <= rooms + MAX_UNCLAIMED_ROOMS
    # an abort that overtakes its request still fails the request's sender
    room = 4 * 10**6
    side.on_abort(m.Abort(room=room, reason="client left", session_id=d.session_id))
    sender = p.create_sender(request(secured.server.port, room))
    assert sender.poll() is KVPoll.Failed and "client left" in sender.failure_reason()
    sender.close()
    # unclaimed rooms expire
    ttl, side.unclaimed_ttl_s = side.unclaimed_ttl_s, 0.0
    try:
        side.check_liveness(SECURED.heartbeat_timeout_s)
        assert side.num_rooms == rooms
    finally:
        side.unclaimed_ttl_s = ttl
    senders, receivers = secured.transfer(203, [4], [10], chunks=1)
    assert all(e.poll() is KVPoll.Success for e in senders + receivers)


def test_a_silent_decode_rank_is_forgotten_and_its_socket_closed():
    cluster = Cluster.start(1, 1, key=KEY)
    try:
        (_, p), (_, d) = cluster.prefill[0], cluster.decode[0]
        cluster.transfer(301, [0], [1], chunks=1)
        assert p.prefill.num_peers == 1 and p.channel.num_peers == 1
        d.close()  # no more heartbeats
        wait_for(lambda: p.prefill.num_peers == 0 and p.channel.num_peers == 0,
                 timeout_s=5 * CONFIG.heartbeat_timeout_s, what="the peer to be forgotten")
    finally:
        cluster.close()


# ---- the bootstrap server ------------------------------------------------------------------


def registration(**changes) -> RankRegistration:
    base = dict(ip="127.0.0.1", zmq_port=5000, tp_rank=0, tp_size=1, dp_rank=0, dp_size=1,
                pp_rank=0, pp_size=1, page_size=16, kv_dtype="bfloat16", session_id="a:1")
    return RankRegistration(**{**base, **changes})


def http(method: str, url: str, body: dict | None = None, headers: dict | None = None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={
        "Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


def test_bootstrap_routes_need_the_token_and_a_rank_cannot_be_replaced():
    with BootstrapServer(key=KEY) as server:
        reg = registration()
        status, body = http("PUT", server.url + "/route", asdict(reg))
        assert status == 401 and AUTH_HEADER in body["error"]["message"]
        status, _ = http("PUT", server.url + "/route", {"ip": "x"}, {AUTH_HEADER: OTHER.http_token})
        assert status == 401
        assert http("GET", server.url + "/route?prefill_dp_rank=-1&target_tp_rank=-1"
                    "&target_pp_rank=-1")[0] == 401
        assert http("GET", server.url + "/health")[0] == 200
        client = BootstrapClient("127.0.0.1", server.port, timeout_s=2, key=KEY)
        client.register(reg)
        client.register(reg)  # the same again: fine
        with pytest.raises(BootstrapError, match="409.*is registered at 127.0.0.1:5000"):
            client.register(registration(zmq_port=6000, session_id="b:2"))
        with pytest.raises(BootstrapError, match="401"):
            BootstrapClient("127.0.0.1", server.port, timeout_s=2, key=OTHER).parallel_info()
        assert client.rank(0, 0) == reg  # still the first one


# ---- what listens where --------------------------------------------------------------------


def own_listeners(group) -> list[str]:
    group.barrier()  # every rank has joined: the store and gloo listen now
    found = [f"{x.address}:{x.port}" for x in listeners()]
    group.barrier()
    return found


@pytest.mark.slow
def test_a_tp_group_listens_on_loopback_only():
    ranks = run_ranks(own_listeners, 2, timeout_s=60)
    assert ranks[0], "rank 0 hosts the rendezvous store"
    for found in ranks:
        assert all(re.match(r"127\.0\.0\.1:\d+$", a) for a in found), ranks


def test_the_mooncake_engine_says_truthfully_where_it_listens(caplog):
    from runtime.transfer.mooncake import MooncakeKVManager
    from test_mooncake_transfer import Rank

    rank = Rank.make()
    before = {(x.address, x.port) for x in listeners()}
    with caplog.at_level(logging.WARNING, logger="runtime.transfer.mooncake"):
        manager = MooncakeKVManager(rank.args, CONFIG, key=KEY)
    try:
        opened = {(x.address, x.port) for x in listeners()} - before
        exposed = {(x.address, x.port) for x in manager.engine.exposed}
        assert exposed == {a for a in opened if a[0] not in ("127.0.0.1", "::1")}
        rpc = int(manager.session_id.rsplit(":", 1)[1])
        assert ("0.0.0.0", rpc) in exposed  # Mooncake binds INADDR_ANY; nothing configures it
        assert len(exposed) == 2  # the handshake port and the TCP data port
        for address, port in exposed:
            assert f"{address}:{port}" in caplog.text
        assert ("127.0.0.1", manager.channel.port) in opened  # ZMQ: the configured host
    finally:
        manager.close()


SHIM_PROBE = """
import json, socket, sys
from runtime.security import listeners
from runtime.transfer.mooncake_engine import MooncakeEngine
engine = MooncakeEngine("127.0.0.1")
mine = socket.socket()
mine.bind(("0.0.0.0", 0))
mine.listen()
print(json.dumps({"rpc": int(engine.session_id.rsplit(":", 1)[1]), "mine": mine.getsockname()[1],
                  "listeners": [[x.address, x.port, x.loopback] for x in listeners()]}))
sys.stdout.flush()
"""


@pytest.mark.slow
def test_the_bind_wrapper_keeps_mooncake_on_the_host_and_nothing_else():
    import subprocess
    import sys

    env = bindshim.preload_env("127.0.0.1")
    if not env:
        pytest.skip("no C compiler to build the bind() wrapper")
    assert bindshim.preload_env("node-a.example") == {} == bindshim.preload_env("::1")
    out = subprocess.run([sys.executable, "-c", SHIM_PROBE], env={**os.environ, **env},
                         capture_output=True, text=True, timeout=60, cwd=bindshim.SOURCE.parents[2])
    report = json.loads(out.stdout.strip().splitlines()[-1])
    found = {(port, address): loopback for address, port, loopback in report["listeners"]}
    assert found[(report["mine"], "0.0.0.0")] is False  # not Mooncake's: left as asked
    mooncake = {k: v for k, v in found.items() if k[0] != report["mine"]}
    assert len(mooncake) == 2 and all(mooncake.values()), found  # handshake + data port
    assert (report["rpc"], "127.0.0.1") in mooncake


# ---- a whole deployment --------------------------------------------------------------------

DEPLOYMENT = tiny_pd_yaml(prefill_tp=2, extra="security: {api_key: test-api-key}\n")
MOONCAKE_WARNING = re.compile(r"the Mooncake transfer engine listens on (.+?) \(every interface\)")


def pid_listening_on(port: int, pids) -> int:
    return next(p for p in pids if any(x.port == port for x in listeners(p)))


@pytest.mark.slow
def test_a_deployment_listens_on_loopback_and_refuses_strangers(tmp_path, monkeypatch):
    from openai import AuthenticationError, OpenAI

    from pd_harness import Proc
    from test_pd_launcher import complete, descendants

    monkeypatch.setenv(SECRET_ENV, SECRET)
    cfg = tmp_path / "pd.yaml"
    cfg.write_text(DEPLOYMENT)
    launcher = Proc(str(cfg))
    try:
        prefill = launcher.wait_for(r"prefill worker 0 .* at (http://\S+), bootstrap "
                                    r"127\.0\.0\.1:(\d+)")
        decode = launcher.wait_for(r"decode worker 0 .* at (http://\S+)").group(1)
        url = launcher.wait_for(r"\(disaggregated: .*\) at (http://\S+/v1)").group(1)
        prefill_url, bootstrap = prefill.group(1), f"http://127.0.0.1:{prefill.group(2)}"

        # Every listener of every process is on loopback: Mooncake's too, with the bind()
        # wrapper; without it (no C compiler) all but Mooncake's two per rank, which each rank
        # names in its warning.
        pids = descendants(launcher.proc.pid) | {launcher.proc.pid}
        assert len(pids) == 4
        warned = {a for line in launcher.seen for match in [MOONCAKE_WARNING.search(line)]
                  if match for a in match.group(1).split(", ")}
        off_loopback = {}
        for pid in pids:
            found = [x for x in listeners(pid) if not x.loopback]
            if found:
                off_loopback[pid] = {f"{x.address}:{x.port}" for x in found}
        if bindshim.build() is not None:
            assert off_loopback == {} and warned == set(), (off_loopback, warned)
            assert sum(len(listeners(pid)) for pid in pids) >= 3 * 3 + 2  # they do listen
        else:
            assert len(off_loopback) == 3, off_loopback  # the three ranks; not the launcher
            assert all(len(a) == 2 for a in off_loopback.values()), off_loopback
            assert set().union(*off_loopback.values()) == warned

        # The secret went to every worker in its environment, never on a command line.
        for pid in pids - {launcher.proc.pid}:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                assert SECRET.encode() not in f.read()
            with open(f"/proc/{pid}/environ", "rb") as f:
                assert f"{SECRET_ENV}={SECRET}".encode() in f.read().split(b"\0")

        # Internal endpoints refuse calls without the token; /health stays open.
        rid_body = {"rid": "someone-elses", "reason": "mine now"}
        for method, target, body in (
                ("POST", prefill_url + "/generate", {"rid": "x"}),
                ("POST", decode + "/abort", rid_body), ("GET", decode + "/records", None),
                ("GET", bootstrap + "/route?prefill_dp_rank=0&target_tp_rank=0"
                                    "&target_pp_rank=0", None),
                ("PUT", bootstrap + "/route", {"ip": "10.0.0.66"})):
            status, reply = http(method, target, body)
            assert status == 401 and reply["error"]["type"] == "authentication_error", target
        assert http("GET", decode + "/health")[0] == 200
        token = {AUTH_HEADER: KEY.http_token}
        status, rank0 = http("GET", bootstrap + "/route?prefill_dp_rank=0&target_tp_rank=0"
                                                "&target_pp_rank=0", headers=token)
        assert status == 200
        status, _ = http("PUT", bootstrap + "/route", {**rank0, "zmq_port": 1}, token)
        assert status == 409  # rank 0 cannot be replaced

        # Strangers' ZMQ frames (junk, unsigned, and signed beats from unregistered ranks)
        # neither stop the prefill rank nor open sockets in it.
        pid = pid_listening_on(rank0["zmq_port"], pids)
        fds = open_fds(pid)
        endpoint = f"tcp://127.0.0.1:{rank0['zmq_port']}"
        beats = [m.encode(m.Heartbeat(session_id=f"10.0.0.1:{i}", endpoint=f"tcp://10.0.0.1:{i}",
                                      reply=False)) for i in range(1, 1501)]
        sealed_push(endpoint, [b"junk", msgpack.packb({"type": "abort"})] + beats[:500],
                    key=None)
        sealed_push(endpoint, beats)

        # The public API wants the key; with it, requests are served as before.
        with pytest.raises(AuthenticationError):
            OpenAI(base_url=url, api_key="wrong", max_retries=0).models.list()
        status, reply = http("GET", url.removesuffix("/v1") + "/health")
        assert status == 200
        tokens = complete(url, api_key="test-api-key")
        assert len(tokens) == 10
        assert open_fds(pid) - fds < 10
        assert launcher.stop() == 0
    finally:
        if launcher.proc.poll() is None:
            launcher.proc.kill()


def test_the_api_key_guards_the_colocated_server():
    from configs import colocated_config
    from runtime.colocated import BackgroundServer, build_server

    server = build_server(colocated_config(num_pages=32, page_size=8, device="cpu"))
    server.protect(api_key="colocated-key")
    with BackgroundServer(server) as srv:
        body = {"model": "tiny-llama", "prompt": "hi", "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "colocated-key"}):
            status, reply = http("POST", srv.url + "/v1/completions", body, headers)
            assert status == 401 and reply["error"]["type"] == "authentication_error"
        assert http("GET", srv.url + "/v1/models")[0] == 401
        assert http("GET", srv.url + "/health")[0] == 200
        status, reply = http("POST", srv.url + "/v1/completions", body,
                             {"Authorization": "Bearer colocated-key"})
        assert status == 200 and reply["usage"]["completion_tokens"] == 2
