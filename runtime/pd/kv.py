"""What the ranks of one instance agree on about their transfers: one poll snapshot per loop
iteration.

Every rank of a tensor-parallel instance runs the same core scheduler, and each rank has its own
transfer manager whose senders and receivers progress on their own threads. If each rank's
scheduler polled its own endpoints, the ranks would see different states at different times and
their schedulers would drift apart. So the scheduler never polls the real endpoints: it gets
`SnapshotKV`, a `KVManager` whose endpoints answer `poll()` from the last snapshot, and once per
loop iteration every rank calls `refresh()`, which

1. polls every live endpoint of this rank in creation order (the same order on every rank, since
   every rank creates them at the same scheduler steps), and
2. reduces those values with one `all_reduce_min_int` (SGLang's `poll_and_all_reduce`): a request
   is `Success` only once it is on every rank, and one rank's `Failed` fails it everywhere.

`poll_epoch()` changes exactly when a snapshot value changes, so the schedulers' skip-the-rescan
logic sees the same epochs on every rank. An endpoint whose snapshot reaches `Success` or
`Failed` is final and is not polled again.

The decode side also reads first-token metadata, and a scheduler decision depends on it (its room
must be the request's, else the buffer was crossed). So a receiver contributes a second value to
the snapshot: 1 when this rank's metadata slot holds the request's room (or the KV has not
arrived), 0 when it does not. If any rank saw a wrong room, every rank's `metadata.read` of that
slot reports a mismatch (the wrong metadata where this rank has it, else None), so all ranks fail
the request alike.

With a single rank the collective is skipped; the snapshot is then just this rank's polls.

Attention DP: every process holds the schedulers of every DP rank of its instance (the same
inputs, so the same states), but only its own rank's transfers. The other ranks' schedulers get
`mirror()` ports, whose endpoints move nothing and contribute the MIN's identity (`Success`, and
no metadata); the snapshot is reduced over the whole instance, so a mirrored request takes the
states its own rank's processes report. A receiver also contributes its metadata slot's content
(room, first token, its logprob's bits, cached tokens) once `Success`, so a mirror port's
metadata store holds the first token the owning rank read, and every process's decode scheduler
decides alike.

`release(req)` closes a finished request's endpoint (the Mooncake endpoints' `close()` forgets the
room), explicitly: the core may hold a finished request for a while (the running batch forgets
lazily), so waiting for garbage collection would leave its room registered. An endpoint the real
manager refuses to create (a room already in use on this rank, say) is created failed instead,
so the request fails through the scheduler like any other transfer failure.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

from pdsim.core.kvpoll import KVPoll, advance
from pdsim.core.transfer import DictMetadataStore, FirstTokenMetadata
from runtime.distributed import TPGroup

FINAL = (KVPoll.Success, KVPoll.Failed)
OTHER_RANK = "failed on another tensor-parallel rank of this instance"
NO_VALUE = 2**63 - 1  # the MIN's identity: what a rank that knows nothing contributes


def _float_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", x))[0]


def _bits_float(n: int) -> float:
    return struct.unpack("<d", struct.pack("<q", n))[0]


class SnapshotMetadata:
    """The scheduler's view of this rank's metadata slots (see the module docstring)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.disputed: dict[int, int] = {}  # slot some rank read a wrong room from -> right room

    def write(self, slot: int, meta: FirstTokenMetadata) -> None:
        self.inner.write(slot, meta)

    def read(self, slot: int) -> FirstTokenMetadata | None:
        meta = self.inner.read(slot)
        expected = self.disputed.pop(slot, None)
        if expected is not None and meta is not None and meta.bootstrap_room == expected:
            return None  # right here but wrong on another rank: a mismatch all the same
        return meta


class _Endpoint:
    """A sender or receiver whose `poll()` answers from the snapshot."""

    width = 1  # values this endpoint adds to the snapshot

    def __init__(self, kv: SnapshotKV, inner, room: int) -> None:
        self._kv = kv
        self.inner = inner
        self.room = room
        self.state = KVPoll.Bootstrapping

    @property
    def final(self) -> bool:
        return self.state in FINAL

    def poll(self) -> KVPoll:
        return self.state

    def abort(self, reason: str) -> None:
        self.inner.abort(reason)

    def failure_reason(self) -> str:
        return self.inner.failure_reason() or OTHER_RANK

    def local_values(self) -> list[int]:
        return [int(self.inner.poll())]

    def take(self, values: Sequence[int]) -> bool:
        """Adopt the reduced values; True if the snapshot state changed."""
        new = advance(self.state, KVPoll(values[0]))
        changed = new is not self.state
        self.state = new
        return changed


class _Inert:
    """An endpoint that moves nothing: every call but `poll` and `failure_reason` does nothing."""

    def init(self, num_pages: int, metadata_slot: int) -> None:
        pass

    def send(self, page_indices: Sequence[int], last: bool,
             state_indices: Sequence[int] = ()) -> None:
        pass

    def send_metadata(self, page_indices: Sequence[int], metadata_slot: int,
                      state_indices: Sequence[int] = ()) -> None:
        pass

    def abort(self, reason: str) -> None:
        pass

    def close(self) -> None:
        pass


class _Refused(_Inert):
    """The stand-in for an endpoint the real manager refused to create: failed from the start."""

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def poll(self) -> KVPoll:
        return KVPoll.Failed

    def failure_reason(self) -> str:
        return self.reason


class SnapshotSender(_Endpoint):
    def init(self, num_pages: int, metadata_slot: int) -> None:
        self.inner.init(num_pages, metadata_slot)

    def send(self, page_indices: Sequence[int], last: bool,
             state_indices: Sequence[int] = ()) -> None:
        self.inner.send(page_indices, last, state_indices)


class SnapshotReceiver(_Endpoint):
    # the poll; whether this rank's metadata slot holds our room; whether this rank read the
    # slot (0: it did); the slot's content (attention DP: for the other DP ranks' mirrors)
    width = 7

    metadata_slot = -1

    def __init__(self, kv: SnapshotKV, inner, room: int, mirror: MirrorKV | None = None) -> None:
        super().__init__(kv, inner, room)
        self.mirror = mirror  # the port of another DP rank whose metadata this one fills

    def send_metadata(self, page_indices: Sequence[int], metadata_slot: int,
                      state_indices: Sequence[int] = ()) -> None:
        self.metadata_slot = metadata_slot
        self.inner.send_metadata(page_indices, metadata_slot, state_indices)

    def local_values(self) -> list[int]:
        poll = self.inner.poll()
        room_ok, content = 1, [1, *[NO_VALUE] * 4]
        if poll is KVPoll.Success and self.mirror is None:
            meta = self._kv.metadata.inner.read(self.metadata_slot)
            room_ok = int(meta is not None and meta.bootstrap_room == self.room)
            if meta is not None:
                content = [0, meta.bootstrap_room, meta.first_token_id,
                           _float_bits(meta.first_logprob), meta.cached_tokens]
        return [int(poll), room_ok, *content]

    def take(self, values: Sequence[int]) -> bool:
        changed = super().take(values)
        if self.state is KVPoll.Success and changed:
            if self.mirror is not None:
                if values[1] and values[2] == 0:
                    room, token, bits, cached = values[3:7]
                    self.mirror.metadata.write(self.metadata_slot, FirstTokenMetadata(
                        room, token, _bits_float(bits), cached))
            elif not values[1]:
                self._kv.metadata.disputed[self.metadata_slot] = self.room
        return changed


class _Mirror(_Inert):
    """The inner endpoint of a request another DP rank's processes transfer: it moves nothing
    and reports the MIN's identity."""

    def poll(self) -> KVPoll:
        return KVPoll.Success

    def failure_reason(self) -> str:
        return ""


class MirrorKV:
    """The `KVManager` port of another DP rank's scheduler on this process (module docstring)."""

    def __init__(self, kv: SnapshotKV) -> None:
        self.kv = kv
        self.metadata = DictMetadataStore()

    def poll_epoch(self) -> int:
        return self.kv.poll_epoch()

    def create_sender(self, req) -> SnapshotSender:
        return self.kv._track(req, SnapshotSender(self.kv, _Mirror(), req.bootstrap_room))

    def create_receiver(self, req) -> SnapshotReceiver:
        return self.kv._track(req, SnapshotReceiver(self.kv, _Mirror(), req.bootstrap_room,
                                                    mirror=self))


class SnapshotKV:
    """The core's `KVManager` port over this rank's real manager `inner` (see the module
    docstring). `group` is the instance's TP group (`TPGroup.single()` for one rank)."""

    def __init__(self, inner, group: TPGroup) -> None:
        self.inner = inner
        self.group = group
        self.metadata = SnapshotMetadata(inner.metadata)
        self._live: dict[int, _Endpoint] = {}  # creation number -> endpoint, not yet released
        self._owner: dict[int, int] = {}  # id(request) -> creation number
        self._next = 0
        self._epoch = 0
        self.inner_epoch_seen = -1  # `inner.poll_epoch()` read just before the last snapshot

    # ---- the port ------------------------------------------------------------------------

    def poll_epoch(self) -> int:
        return self._epoch

    def create_sender(self, req) -> SnapshotSender:
        return self._track(req, SnapshotSender(self, self._create(self.inner.create_sender, req),
                                               req.bootstrap_room))

    def create_receiver(self, req) -> SnapshotReceiver:
        return self._track(req, SnapshotReceiver(
            self, self._create(self.inner.create_receiver, req), req.bootstrap_room))

    @staticmethod
    def _create(make, req):
        try:
            return make(req)
        except Exception as exc:  # noqa: BLE001 - the request fails, the loop goes on
            return _Refused(f"could not start the transfer: {exc}")

    def mirror(self) -> MirrorKV:
        """The port of another DP rank's scheduler (attention DP, module docstring)."""
        return MirrorKV(self)

    # ---- the driver's side ---------------------------------------------------------------

    def refresh(self) -> bool:
        """Take the snapshot (every rank, same point of the loop). True if anything changed."""
        self.inner_epoch_seen = self.inner.poll_epoch()  # before polling: later news is news
        pending = [ep for ep in self._live.values() if not ep.final]
        if not pending:  # the same on every rank, so every rank skips the collective
            return False
        local: list[int] = []
        for ep in pending:
            local.extend(ep.local_values())
        reduced = self.group.all_reduce_min_int(local)
        changed, i = False, 0
        for ep in pending:
            changed |= ep.take(reduced[i:i + ep.width])
            i += ep.width
        if changed:
            self._epoch += 1
        return changed

    def release(self, req) -> None:
        """Close a finished request's endpoint (its room is forgotten) and stop tracking it."""
        number = self._owner.pop(id(req), None)
        if number is not None:
            self._live.pop(number).inner.close()

    @property
    def num_live(self) -> int:
        """Endpoints of requests not yet released."""
        return len(self._live)

    @property
    def num_pending(self) -> int:
        """Endpoints whose transfer has not reached a final state on every rank."""
        return sum(not ep.final for ep in self._live.values())

    def _track(self, req, endpoint: _Endpoint) -> _Endpoint:
        number = self._next
        self._next += 1
        self._live[number] = endpoint
        self._owner[id(req)] = number
        return endpoint
