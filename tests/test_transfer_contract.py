"""One contract for every transfer backend: the states a sender/receiver pair goes through, the
metadata it delivers, and how an abort on one side reaches the other.

To run the contract against another backend, add a factory to `BACKENDS` that returns a `Pair`
(the sim backend: its managers, and a `step` that advances the SimPy clock).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest

from pdsim.core.fake_transfer import FakeKVManager, FakeWire
from pdsim.core.kvpoll import KVPoll
from pdsim.core.request import Request
from pdsim.core.transfer import FirstTokenMetadata, KVManager


@dataclass
class Pair:
    """A prefill and a decode manager that can reach each other."""

    prefill: KVManager
    decode: KVManager
    request: Callable[[int], Request]  # a fresh request (one per side) for a bootstrap room
    step: Callable[[], None]  # let a little time pass (sleep, or advance a simulated clock)
    close: Callable[[], None] = lambda: None


def _request(room: int, host: str = "", port: int = 0) -> Request:
    return Request(rid=f"req-{room}", input_len=16, max_new_tokens=8, bootstrap_host=host,
                   bootstrap_port=port, bootstrap_room=room)


def fake_pair() -> Pair:
    wire = FakeWire()
    return Pair(FakeKVManager(wire), FakeKVManager(wire), _request, step=lambda: None)


def mooncake_pair() -> Pair:
    from runtime.transfer.bootstrap_server import BootstrapServer
    from runtime.transfer.layout import KVArgs
    from runtime.transfer.metadata import MetadataBuffer
    from runtime.transfer.mooncake import MooncakeKVManager

    server = BootstrapServer().start()

    def manager() -> MooncakeKVManager:
        buffers = [np.zeros((32, 4, 2, 8), dtype=np.float16) for _ in range(4)]
        md = MetadataBuffer.allocate(8)
        state = np.zeros((8, 1, 2, 16), dtype=np.float32)  # slots x layers x heads x floats
        return MooncakeKVManager(KVArgs(
            state_ptr=state.ctypes.data, state_len=state.nbytes, state_slot_len=state[0].nbytes,
            state_layers=1, total_state_heads=2,
            kv_data_ptrs=[b.ctypes.data for b in buffers],
            kv_data_lens=[b.nbytes for b in buffers], kv_item_lens=[b[0].nbytes for b in buffers],
            metadata_ptr=md.ptr, metadata_len=md.nbytes, metadata_item_len=md.item_len,
            page_size=4, kv_dtype="float16", total_kv_heads=2, kv_heads_per_rank=2,
            owners=(buffers, md, state)))  # registered memory must live as long as the manager

    prefill, decode = manager(), manager()
    prefill.register_with_bootstrap("127.0.0.1", server.port)

    def close() -> None:
        prefill.close()
        decode.close()
        server.stop()

    return Pair(prefill, decode, lambda room: _request(room, "127.0.0.1", server.port),
                step=lambda: time.sleep(0.001), close=close)


def sim_pair() -> Pair:
    import simpy

    from pdsim.sim.network import Link, NetworkModel, SimFabric, SimKVManager

    env = simpy.Environment()
    fabric = SimFabric(env, NetworkModel())

    def manager(key: int) -> SimKVManager:
        return SimKVManager(fabric, key, Link(50e9), bytes_per_page=4096.0, notify=lambda: None)

    return Pair(manager(0), manager(1), _request, step=lambda: env.run(until=env.now + 1e-3))


BACKENDS: dict[str, Callable[[], Pair]] = {
    "fake": fake_pair, "sim": sim_pair, "mooncake": mooncake_pair,
}
REAL_BACKENDS = {"mooncake"}  # they start real components (marked `real`)

_rooms = itertools.count(1000)


@pytest.fixture(scope="module", params=[
    pytest.param(name, marks=pytest.mark.real) if name in REAL_BACKENDS else name
    for name in BACKENDS])
def pair(request):
    p = BACKENDS[request.param]()
    yield p
    p.close()


class Watch:
    """Polls endpoints while waiting, and checks on every poll that states only move forward and
    that a state never changes while its manager's `poll_epoch` stays the same."""

    def __init__(self, pair: Pair, **endpoints) -> None:
        self.pair = pair
        self.endpoints = endpoints
        self.seen: dict[str, list[KVPoll]] = {name: [] for name in endpoints}
        self.last: dict[str, tuple[int, KVPoll]] = {}  # name → (epoch read before, state)

    def poll(self, name: str) -> KVPoll:
        manager = self.pair.prefill if name == "sender" else self.pair.decode
        epoch = manager.poll_epoch()
        state = self.endpoints[name].poll()
        if name in self.last and self.last[name][0] == epoch:
            assert state is self.last[name][1], \
                f"{name} went {self.last[name][1].name} -> {state.name} with poll_epoch {epoch}"
        self.last[name] = (epoch, state)
        history = self.seen[name]
        if history:
            assert history[-1] is not KVPoll.Failed or state is KVPoll.Failed, \
                f"{name} left Failed for {state.name}"
            assert state is KVPoll.Failed or state >= history[-1], \
                f"{name} went back from {history[-1].name} to {state.name}"
        if not history or history[-1] is not state:
            history.append(state)
        return state

    def until(self, name: str, predicate, timeout_s: float = 10.0) -> KVPoll:
        deadline = time.monotonic() + timeout_s
        while not predicate(state := self.poll(name)):
            if time.monotonic() > deadline:
                raise AssertionError(f"{name} stuck in {state.name}; saw {self.seen[name]}")
            self.pair.step()
        return state


def handshake(pair: Pair, room: int, dst_pages: list[int], slot: int) -> Watch:
    sender = pair.prefill.create_sender(pair.request(room))
    receiver = pair.decode.create_receiver(pair.request(room))
    w = Watch(pair, sender=sender, receiver=receiver)
    assert w.until("receiver", lambda s: s >= KVPoll.WaitingForInput) is KVPoll.WaitingForInput
    assert w.poll("sender") is KVPoll.Bootstrapping  # decode has not said where to write yet
    receiver.send_metadata(dst_pages, slot)
    assert w.until("sender", lambda s: s >= KVPoll.WaitingForInput) is KVPoll.WaitingForInput
    return w


def test_a_transfer_goes_through_every_state_and_delivers_metadata(pair):
    room = next(_rooms)
    w = handshake(pair, room, dst_pages=[7, 8, 3], slot=4)
    sender = w.endpoints["sender"]
    sender.init(num_pages=3, metadata_slot=1)
    meta = FirstTokenMetadata(bootstrap_room=room, first_token_id=17, first_logprob=-0.5,
                              cached_tokens=2)
    pair.prefill.metadata.write(1, meta)
    sender.send([0, 1], last=False)
    assert w.poll("sender") in (KVPoll.Transferring, KVPoll.Success)
    sender.send([2], last=True)
    w.until("sender", lambda s: s in (KVPoll.Success, KVPoll.Failed))
    w.until("receiver", lambda s: s in (KVPoll.Success, KVPoll.Failed))
    assert w.poll("sender") is KVPoll.Success and w.poll("receiver") is KVPoll.Success
    assert pair.decode.metadata.read(4) == meta
    assert w.seen["sender"][:2] == [KVPoll.Bootstrapping, KVPoll.WaitingForInput]


@pytest.mark.parametrize("who", ["sender", "receiver"])
def test_an_abort_on_one_side_fails_the_other_with_the_reason(pair, who):
    w = handshake(pair, next(_rooms), dst_pages=[1], slot=0)
    w.endpoints[who].abort(f"{who} gave up: client went away")
    other = "receiver" if who == "sender" else "sender"
    assert w.poll(who) is KVPoll.Failed
    w.until(other, lambda s: s is KVPoll.Failed)
    for name in (who, other):
        assert "client went away" in w.endpoints[name].failure_reason()


def test_a_receiver_abort_before_metadata_fails_the_sender(pair):
    room = next(_rooms)
    sender = pair.prefill.create_sender(pair.request(room))
    receiver = pair.decode.create_receiver(pair.request(room))
    w = Watch(pair, sender=sender, receiver=receiver)
    w.until("receiver", lambda s: s >= KVPoll.WaitingForInput)
    receiver.abort("decode out of memory")
    w.until("sender", lambda s: s is KVPoll.Failed)
    assert "decode out of memory" in sender.failure_reason()
