"""The Mooncake backend's parts on loopback: wire format, layout arithmetic, the engine itself and
whole prefill → decode transfers (1:1, GQA and MLA TP mismatch, failures). No mocks."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, replace

import msgpack
import numpy as np
import pytest

from pdsim.core.kvpoll import KVPoll
from pdsim.core.request import Request
from pdsim.core.transfer import FirstTokenMetadata
from pdsim.deployment import TransferConfig
from runtime.transfer.bootstrap_server import BootstrapServer
from runtime.protocol import transfer as m
from runtime.transfer.mooncake_engine import MooncakeEngine, TransferEngineError, check_version
from runtime.transfer.layout import (
    KVArgs, Target, head_range, page_descriptors, plan_targets,
)
from runtime.transfer.metadata import MetadataBuffer
from runtime.transfer.mooncake import MooncakeKVManager

pytestmark = [pytest.mark.real]

# ---- messages ------------------------------------------------------------------------------

INFO = m.TransferInfo(room=2**62 + 5, session_id="127.0.0.1:1234", decode_tp_rank=1,
                      dst_pages=m.pack_pages([3, 4, 9])[0], page_dtype="int32", metadata_slot=7,
                      is_dummy=False)
REGISTER = m.RegisterDecode(
    session_id="127.0.0.1:1", endpoint="tcp://127.0.0.1:2", tp_rank=0, tp_size=2,
    kv_data_ptrs=[2**40, 2**40 + 4096], kv_data_lens=[4096, 4096], kv_item_lens=[512, 512],
    metadata_ptr=2**41, metadata_len=256, metadata_item_len=32, page_size=16,
    kv_dtype="bfloat16", is_mla=False, total_kv_heads=8, kv_heads_per_rank=4)


@pytest.mark.parametrize("msg", [
    INFO, REGISTER,
    m.Status(room=1, poll=int(KVPoll.Failed), reason="boom", prefill_tp_rank=3),
    m.Abort(room=1, reason="client left", session_id="h:1"),
    m.Heartbeat(session_id="h:1", endpoint="tcp://h:2", reply=True),
])
def test_messages_round_trip(msg):
    assert m.decode(m.encode(msg)) == msg


def _raw(**changes):
    body = msgpack.unpackb(m.encode(INFO))
    body.update(changes)
    return msgpack.packb({k: v for k, v in body.items() if v is not _DROP}, use_bin_type=True)


_DROP = object()


@pytest.mark.parametrize("frame, needle", [
    (_raw(type="pickle"), "unknown message type 'pickle'"),
    (_raw(version=1), "protocol version 1 is not supported"),
    (_raw(version=_DROP), "protocol version None"),
    (_raw(colour="red"), "unexpected fields ['colour']"),
    (_raw(type="step"), "unknown message type 'step'"),
    (_raw(room=_DROP), "missing fields ['room']"),
    (_raw(room="5"), "transfer_info.room must be"),
    (_raw(is_dummy=0), "transfer_info.is_dummy must be"),
    (_raw(metadata_slot=True), "transfer_info.metadata_slot must be"),
    (m.encode(INFO)[:-3], "not one msgpack map"),
    (m.encode(INFO) + b"\x00", "not one msgpack map"),
    (msgpack.packb([1, 2]), "expected a map"),
])
def test_strict_decoding_names_the_problem(frame, needle):
    with pytest.raises(m.ProtocolError) as err:
        m.decode(frame)
    assert needle in str(err.value)


def test_page_indices_pack_small_and_large():
    data, dtype = m.pack_pages([0, 7, 2**31 - 1])
    assert dtype == "int32" and len(data) == 12
    data, dtype = m.pack_pages([1, 2**40])
    assert dtype == "int64" and m.unpack_pages(data, dtype).tolist() == [1, 2**40]
    with pytest.raises(m.ProtocolError, match="not a whole number"):
        m.unpack_pages(b"\x00" * 5, "int32")
    with pytest.raises(m.ProtocolError, match="page dtype"):
        m.unpack_pages(b"", "float32")


# ---- layout --------------------------------------------------------------------------------


def test_head_ranges_split_and_replicate():
    assert [head_range(r, 4, 8) for r in range(4)] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    assert [head_range(r, 4, 2) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    with pytest.raises(ValueError, match="cannot be split"):
        head_range(0, 3, 8)


@pytest.mark.parametrize("decode_rank, decode_tp, prefill_tp, mla, heads, want", [
    (1, 2, 2, False, 8, [Target(1, False)]),
    (3, 4, 2, False, 8, [Target(1, False)]),  # n < m: one prefill rank serves two
    (1, 2, 4, False, 8, [Target(2, False), Target(3, False)]),  # n > m: both halves of the heads
    (1, 2, 4, True, 1, [Target(2, False), Target(3, True)]),  # MLA n > m: one real, one dummy
    (0, 1, 4, False, 2, [Target(0, False), Target(1, True), Target(2, False), Target(3, True)]),
])
def test_plan_targets(decode_rank, decode_tp, prefill_tp, mla, heads, want):
    assert plan_targets(decode_rank, decode_tp, prefill_tp, is_mla=mla, total_heads=heads) == want


def test_page_descriptors_merge_runs_on_both_sides():
    srcs, dsts, lens = page_descriptors([1000, 5000], [9000, 20000], [10, 20],
                                        [0, 1, 2, 10, 11, 20], [5, 6, 7, 15, 16, 25])
    assert srcs == [1000, 1100, 1200, 5000, 5200, 5400]
    assert dsts == [9050, 9150, 9250, 20100, 20300, 20500]
    assert lens == [30, 20, 10, 60, 40, 20]


def test_kv_args_reject_inconsistent_layouts():
    good = Rank.make(total_heads=4, tp_size=2).args
    with pytest.raises(ValueError, match=r"kv_heads_per_rank must be max\(1, 4 // 2\) = 2"):
        replace(good, kv_heads_per_rank=4)
    with pytest.raises(ValueError, match="do not divide evenly"):
        replace(good, kv_data_lens=(100,) * len(good.kv_data_ptrs))
    with pytest.raises(ValueError, match="cannot be split over TP 3"):
        replace(good, tp_size=3, tp_rank=0)


# ---- the engine ----------------------------------------------------------------------------


def test_version_check():
    assert check_version()  # the installed one is new enough
    assert check_version("0.3.12") == "0.3.12"
    with pytest.raises(TransferEngineError, match="0.3.11 is too old.*half-written page"):
        check_version("0.3.11")


@pytest.fixture(scope="module")
def engines():
    return MooncakeEngine(), MooncakeEngine()


def test_two_engines_in_one_process_write_pages(engines):
    src_engine, dst_engine = engines
    assert src_engine.session_id != dst_engine.session_id
    item = 4096
    src = np.random.default_rng(0).integers(0, 255, 64 * item, dtype=np.uint8)
    dst = np.zeros(64 * item, dtype=np.uint8)
    src_engine.register(src.ctypes.data, src.nbytes)
    dst_engine.register(dst.ctypes.data, dst.nbytes)
    src_pages, dst_pages = [0, 1, 2, 7, 30, 31], [10, 11, 40, 41, 5, 6]
    try:
        src_engine.write(dst_engine.session_id,
                         *page_descriptors([src.ctypes.data], [dst.ctypes.data], [item],
                                           src_pages, dst_pages))
    finally:
        src_engine.unregister(src.ctypes.data)
        dst_engine.unregister(dst.ctypes.data)
    pages = lambda a, idx: a.reshape(64, item)[idx]  # noqa: E731
    assert (pages(dst, dst_pages) == pages(src, src_pages)).all()
    untouched = sorted(set(range(64)) - set(dst_pages))
    assert not pages(dst, untouched).any()


def test_registration_is_once_per_region(engines):
    engine = engines[0]
    buf = np.zeros(8192, dtype=np.uint8)
    engine.register(buf.ctypes.data, buf.nbytes)
    try:
        engine.register(buf.ctypes.data, buf.nbytes)  # the same region again: a no-op
        with pytest.raises(TransferEngineError, match="overlaps"):
            engine.register(buf.ctypes.data + 4096, 100)
    finally:
        engine.unregister(buf.ctypes.data)


@pytest.mark.slow
def test_registered_memory_stays_alive_until_unregistered(engines):
    import gc
    import weakref

    buf = np.zeros(4096, dtype=np.uint8)
    addr, alive = buf.ctypes.data, weakref.ref(buf)
    engines[1].register(addr, buf.nbytes, owner=buf)
    del buf
    gc.collect()
    assert alive() is not None  # a peer may still write there
    engines[1].unregister(addr)
    gc.collect()
    assert alive() is None


def test_write_to_an_unreachable_peer_raises(engines):
    buf = np.zeros(64, dtype=np.uint8)
    engines[0].register(buf.ctypes.data, buf.nbytes)
    try:
        with pytest.raises(TransferEngineError, match="batch_transfer_sync_write to 127.0.0.1:1"):
            engines[0].write("127.0.0.1:1", [buf.ctypes.data], [buf.ctypes.data], [64])
    finally:
        engines[0].unregister(buf.ctypes.data)


# ---- whole transfers -----------------------------------------------------------------------

# Heartbeats every 50 ms find a closed peer at once; the silence timeout is long enough that a
# CPU-starved run (two cores, a busy suite) does not read a live peer as lost.
CONFIG = TransferConfig(heartbeat_interval_s=0.05, heartbeat_timeout_s=10.0)


@dataclass
class Rank:
    """One rank's numpy KV buffers (`layers` K then `layers` V, or `layers` latents) + metadata."""

    buffers: list[np.ndarray]
    metadata: MetadataBuffer
    args: KVArgs

    @classmethod
    def make(cls, *, tp_rank=0, tp_size=1, total_heads=4, mla=False, pages=24, page_size=4,
             layers=2, head_dim=8, dtype="float32", fill=None):
        heads = 1 if mla else max(1, total_heads // tp_size)
        shape = (pages, page_size, heads, head_dim)
        buffers = [np.zeros(shape, dtype=np.float32) for _ in range(layers if mla else 2 * layers)]
        if fill is not None:
            start, _ = (0, 1) if mla else head_range(tp_rank, tp_size, total_heads)
            for buf, full in zip(buffers, fill):
                buf[:] = full[:, :, start:start + heads]
        md = MetadataBuffer.allocate(8)
        args = KVArgs(
            kv_data_ptrs=[b.ctypes.data for b in buffers], kv_data_lens=[b.nbytes for b in buffers],
            kv_item_lens=[b[0].nbytes for b in buffers], metadata_ptr=md.ptr,
            metadata_len=md.nbytes, metadata_item_len=md.item_len, page_size=page_size,
            kv_dtype=dtype, tp_rank=tp_rank, tp_size=tp_size,
            total_kv_heads=1 if mla else total_heads, kv_heads_per_rank=heads, is_mla=mla,
            owners=(buffers, md))
        return cls(buffers, md, args)


def request(server_port, room):
    return Request(rid=f"r{room}", input_len=8, max_new_tokens=4, bootstrap_host="127.0.0.1",
                   bootstrap_port=server_port, bootstrap_room=room)


def wait_for(predicate, timeout_s=10.0, what="condition"):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.002)


@dataclass
class Cluster:
    """A prefill instance of TP n and a decode instance of TP m, each rank its own manager."""

    server: BootstrapServer
    prefill: list[tuple[Rank, MooncakeKVManager]]
    decode: list[tuple[Rank, MooncakeKVManager]]
    full: list[np.ndarray]  # the prefill instance's KV with all heads

    @classmethod
    def start(cls, n, m, *, mla=False, total_heads=4, config=CONFIG, key=None):
        """`key` also guards the bootstrap server."""
        rng = np.random.default_rng(n * 10 + m)
        layers, pages, page_size, head_dim = 2, 24, 4, 8
        heads = 1 if mla else total_heads
        full = [rng.standard_normal((pages, page_size, heads, head_dim)).astype(np.float32)
                for _ in range(layers if mla else 2 * layers)]
        server = BootstrapServer(key=key).start()
        prefill, decode = [], []
        for r in range(n):
            rank = Rank.make(tp_rank=r, tp_size=n, total_heads=total_heads, mla=mla, fill=full)
            mgr = MooncakeKVManager(rank.args, config, key=key)
            mgr.register_with_bootstrap("127.0.0.1", server.port)
            prefill.append((rank, mgr))
        for r in range(m):
            rank = Rank.make(tp_rank=r, tp_size=m, total_heads=total_heads, mla=mla)
            decode.append((rank, MooncakeKVManager(rank.args, config, key=key)))
        return cls(server, prefill, decode, full)

    def close(self):
        for _, mgr in self.prefill + self.decode:
            mgr.close()
        self.server.stop()

    def transfer(self, room, src_pages, dst_pages, chunks=2):
        """Run one request through every rank; returns (senders, receivers)."""
        meta = FirstTokenMetadata(bootstrap_room=room, first_token_id=99, first_logprob=-1.5,
                                  cached_tokens=4)
        senders = [mgr.create_sender(request(self.server.port, room)) for _, mgr in self.prefill]
        receivers = [mgr.create_receiver(request(self.server.port, room)) for _, mgr in self.decode]
        for rcv in receivers:
            wait_for(lambda: rcv.poll() >= KVPoll.WaitingForInput, what="decode handshake")
            assert rcv.poll() is KVPoll.WaitingForInput, rcv.failure_reason()
            rcv.send_metadata(dst_pages, metadata_slot=5)
        for (_, mgr), snd in zip(self.prefill, senders):
            wait_for(lambda: snd.poll() >= KVPoll.WaitingForInput, what="transfer info")
            snd.init(len(src_pages), metadata_slot=2)
            mgr.metadata.write(2, meta)
            for i, part in enumerate(np.array_split(np.asarray(src_pages), chunks)):
                snd.send(part.tolist(), last=i == chunks - 1)
        for end in senders + receivers:
            wait_for(lambda: end.poll() in (KVPoll.Success, KVPoll.Failed), what="the end")
        for rank, mgr in self.decode:
            assert mgr.metadata.read(5) == meta
        return senders, receivers

    def assert_arrived(self, src_pages, dst_pages, *, only_there=True):
        for rank, _ in self.decode:
            a = rank.args
            start, count = (0, 1) if a.is_mla else head_range(a.tp_rank, a.tp_size,
                                                              a.total_kv_heads)
            for buf, full in zip(rank.buffers, self.full):
                want = full[src_pages][:, :, start:start + count]
                np.testing.assert_array_equal(buf[dst_pages], want)
                others = sorted(set(range(len(buf))) - set(dst_pages))
                if only_there:
                    assert not buf[others].any(), "bytes landed outside the destination pages"


@pytest.fixture(scope="module")
def one_to_one():
    cluster = Cluster.start(1, 1)
    yield cluster
    cluster.close()


def test_one_to_one_writes_pages_and_metadata(one_to_one):
    src, dst = [0, 1, 2, 5, 9, 10, 11], [3, 4, 20, 21, 22, 7, 8]
    senders, receivers = one_to_one.transfer(101, src, dst, chunks=3)
    assert [e.poll() for e in senders + receivers] == [KVPoll.Success] * 2
    one_to_one.assert_arrived(src, dst, only_there=False)  # other tests share these buffers


def test_states_move_forward_through_the_protocol(one_to_one):
    c, room = one_to_one, 102
    (_, p), (_, d) = c.prefill[0], c.decode[0]
    snd = p.create_sender(request(c.server.port, room))
    assert snd.poll() is KVPoll.Bootstrapping
    rcv = d.create_receiver(request(c.server.port, room))
    wait_for(lambda: rcv.poll() is KVPoll.WaitingForInput)
    assert snd.poll() is KVPoll.Bootstrapping  # nothing said yet where to write
    rcv.send_metadata([1, 2], metadata_slot=0)
    assert rcv.poll() is KVPoll.Transferring
    wait_for(lambda: snd.poll() is KVPoll.WaitingForInput)
    snd.init(2, metadata_slot=0)
    snd.send([3], last=False)
    assert snd.poll() in (KVPoll.Transferring, KVPoll.Success)
    snd.send([4], last=True)
    wait_for(lambda: rcv.poll() is KVPoll.Success and snd.poll() is KVPoll.Success)


def test_a_known_prefill_instance_needs_no_lookup():
    """The first receiver for a prefill instance looks it up on a thread; once every rank it
    reads from is cached and registered with, the next receiver is ready as it is created
    (SGLang's receiver ends its __init__ in WaitingForInput), so the scheduler can send its
    pages in the same iteration."""
    c = Cluster.start(2, 1)  # the decode rank reads from both prefill ranks
    try:
        (_, d), = c.decode
        first = d.create_receiver(request(c.server.port, 201))
        assert first.poll() is KVPoll.Bootstrapping
        wait_for(lambda: first.poll() is KVPoll.WaitingForInput)
        second = d.create_receiver(request(c.server.port, 202))
        assert second.poll() is KVPoll.WaitingForInput
        senders = [p.create_sender(request(c.server.port, 202)) for _, p in c.prefill]
        second.send_metadata([1, 2], metadata_slot=0)
        for snd in senders:
            wait_for(lambda: snd.poll() is KVPoll.WaitingForInput, what="transfer info")
            snd.init(2, metadata_slot=0)
            snd.send([3, 4], last=True)
        wait_for(lambda: second.poll() is KVPoll.Success, what="the transfer")
    finally:
        c.close()


def test_page_count_mismatch_fails_both_sides(one_to_one):
    c, room = one_to_one, 103
    (_, p), (_, d) = c.prefill[0], c.decode[0]
    snd, rcv = p.create_sender(request(c.server.port, room)), d.create_receiver(
        request(c.server.port, room))
    wait_for(lambda: rcv.poll() is KVPoll.WaitingForInput)
    rcv.send_metadata([1, 2, 3], metadata_slot=0)
    wait_for(lambda: snd.poll() is KVPoll.WaitingForInput)
    snd.init(2, metadata_slot=0)
    assert snd.poll() is KVPoll.Failed
    assert "allocated 3 pages, prefill sends 2" in snd.failure_reason()
    wait_for(lambda: rcv.poll() is KVPoll.Failed)
    assert "allocated 3 pages" in rcv.failure_reason()


def test_receiver_abort_reaches_the_sender(one_to_one):
    c, room = one_to_one, 104
    (_, p), (_, d) = c.prefill[0], c.decode[0]
    snd, rcv = p.create_sender(request(c.server.port, room)), d.create_receiver(
        request(c.server.port, room))
    wait_for(lambda: rcv.poll() is KVPoll.WaitingForInput)
    rcv.send_metadata([1], metadata_slot=0)
    wait_for(lambda: snd.poll() is KVPoll.WaitingForInput)
    rcv.abort("client disconnected")
    wait_for(lambda: snd.poll() is KVPoll.Failed)
    assert snd.failure_reason() == "decode side aborted: client disconnected"
    snd.init(1, 0)
    snd.send([0], last=True)  # a failed room ignores late calls
    assert snd.poll() is KVPoll.Failed and rcv.poll() is KVPoll.Failed


def test_unreachable_bootstrap_server_fails_the_receiver_after_the_handshake_timeout():
    """The deployment's `transfer` section reaches the manager as it is: its
    handshake_timeout_s bounds the decode side's bootstrap lookup (retried until then)."""
    from runtime.serve_config import parse_serve_config

    pool = {"scheduler": {"num_pages": 8}}
    transfer = parse_serve_config({"model": "tiny-llama", "cluster": {"prefill": pool, "decode": pool},
                                   "transfer": {"handshake_timeout_s": 1.0,
                                                "heartbeat_interval_s": 0}}).transfer
    rank = Rank.make()
    with MooncakeKVManager(rank.args, transfer) as d:
        t0 = time.monotonic()
        rcv = d.create_receiver(request(1, 105))
        wait_for(lambda: rcv.poll() is KVPoll.Failed)
        elapsed = time.monotonic() - t0
        assert "bootstrap with 127.0.0.1:1 failed" in rcv.failure_reason()
    # Retried with backoff (0.05 s doubling) while the next try fits in the 1 s: ~0.75 s. The
    # default, 30 s, would outlast wait_for's 10 s.
    assert 0.5 <= elapsed < 8.0


def test_layout_mismatch_fails_the_receiver_with_the_reason(one_to_one):
    rank = Rank.make(page_size=8, pages=12)
    with MooncakeKVManager(rank.args, CONFIG) as d:
        rcv = d.create_receiver(request(one_to_one.server.port, 106))
        wait_for(lambda: rcv.poll() is KVPoll.Failed)
        assert "page_size: prefill 4, decode 8" in rcv.failure_reason()


def test_dead_prefill_rank_fails_waiting_rooms_by_heartbeat():
    cluster = Cluster.start(1, 1)
    try:
        (_, p), (_, d) = cluster.prefill[0], cluster.decode[0]
        rcv = d.create_receiver(request(cluster.server.port, 107))
        wait_for(lambda: rcv.poll() is KVPoll.WaitingForInput)
        rcv.send_metadata([0], metadata_slot=0)
        p.close()  # its socket closes: the next heartbeat finds it unconnected
        wait_for(lambda: rcv.poll() is KVPoll.Failed, timeout_s=5)
        assert "not connected" in rcv.failure_reason()
        assert "peer restarted or gone" in rcv.failure_reason()  # an HTTP 503
    finally:
        cluster.close()


@pytest.mark.parametrize("n, m", [(1, 2), (2, 1), (4, 2)])
@pytest.mark.slow
def test_gqa_tp_mismatch_writes_head_slices(n, m):
    cluster = Cluster.start(n, m, total_heads=4)
    try:
        src, dst = [3, 4, 5, 10], [0, 1, 9, 2]
        senders, receivers = cluster.transfer(200 + n * 10 + m, src, dst)
        for end in senders + receivers:
            assert end.poll() is KVPoll.Success, end.failure_reason()
        cluster.assert_arrived(src, dst)
    finally:
        cluster.close()


@pytest.mark.slow
def test_gqa_with_replicated_heads():
    cluster = Cluster.start(4, 1, total_heads=2)  # prefill ranks 0,1 and 2,3 hold the same head
    try:
        src, dst = [1, 2], [6, 7]
        senders, receivers = cluster.transfer(301, src, dst)
        assert all(e.poll() is KVPoll.Success for e in senders + receivers)
        cluster.assert_arrived(src, dst)
    finally:
        cluster.close()


@pytest.mark.parametrize("n, m", [(2, 1), (1, 2)])
@pytest.mark.slow
def test_mla_tp_mismatch_sends_whole_pages(n, m):
    cluster = Cluster.start(n, m, mla=True)
    try:
        src, dst = [0, 1, 2, 3, 8], [10, 11, 12, 13, 1]
        senders, receivers = cluster.transfer(400 + n * 10 + m, src, dst)
        assert all(e.poll() is KVPoll.Success for e in senders + receivers)
        cluster.assert_arrived(src, dst)
    finally:
        cluster.close()


def test_bad_frames_are_dropped_and_the_manager_keeps_working(one_to_one):
    import pickle

    import zmq

    (_, d) = one_to_one.decode[0]
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.connect(d.channel.endpoint)
    for frame in (b"garbage", pickle.dumps({"type": "status"}), msgpack.packb({"type": "status"})):
        sock.send(frame)
    sock.close(linger=1000)
    ctx.term()
    src, dst = [6, 7], [14, 15]
    senders, receivers = one_to_one.transfer(108, src, dst, chunks=1)
    assert all(e.poll() is KVPoll.Success for e in senders + receivers)


def test_many_requests_at_once(one_to_one):
    """Concurrent rooms on the shared managers, each landing on its own pages."""
    c = one_to_one
    (_, p), (_, d) = c.prefill[0], c.decode[0]
    rooms = random.Random(0).sample(range(2**62), 8)
    pairs = []
    for i, room in enumerate(rooms):
        snd, rcv = p.create_sender(request(c.server.port, room)), d.create_receiver(
            request(c.server.port, room))
        pairs.append((room, snd, rcv, [i], [i + 12]))
    for room, snd, rcv, src, dst in pairs:
        wait_for(lambda: rcv.poll() is KVPoll.WaitingForInput)
        rcv.send_metadata(dst, metadata_slot=0)
    for room, snd, rcv, src, dst in pairs:
        wait_for(lambda: snd.poll() is KVPoll.WaitingForInput)
        snd.init(1, metadata_slot=0)
        snd.send(src, last=True)
    for room, snd, rcv, src, dst in pairs:
        wait_for(lambda: rcv.poll() is KVPoll.Success)
    for (rank, _), full in [(c.decode[0], c.full)]:
        for buf, f in zip(rank.buffers, full):
            np.testing.assert_array_equal(buf[12:20], f[0:8])


def test_rooms_are_forgotten_when_their_endpoints_go(one_to_one):
    c, room = one_to_one, 109
    (_, p), (_, d) = c.prefill[0], c.decode[0]
    senders, receivers = c.transfer(room, [0], [23], chunks=1)
    assert room in p.prefill._rooms and room in d.decode._rooms
    senders[0].close()
    del receivers  # dropping a receiver forgets its room too
    assert room not in p.prefill._rooms and room not in d.decode._rooms


def test_pages_outside_the_decode_buffers_are_refused(one_to_one):
    c, room = one_to_one, 110
    (_, p), (_, d) = c.prefill[0], c.decode[0]
    snd, rcv = p.create_sender(request(c.server.port, room)), d.create_receiver(
        request(c.server.port, room))
    wait_for(lambda: rcv.poll() is KVPoll.WaitingForInput)
    rcv.send_metadata([3, 24], metadata_slot=0)  # the decode buffers hold pages 0..23
    wait_for(lambda: snd.poll() is KVPoll.Failed and rcv.poll() is KVPoll.Failed)
    assert "pages 3..24 outside 0..23" in rcv.failure_reason()
