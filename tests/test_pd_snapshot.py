"""`SnapshotKV` on two real gloo ranks: what the schedulers of one instance see of their transfers.
Each rank's endpoints are scripted (one rank lags, one fails, one reads a crossed metadata slot);
both ranks must see the same states, epochs and metadata verdicts."""

from __future__ import annotations

import pytest

from pdsim.core.kvpoll import KVPoll
from pdsim.core.request import Request
from pdsim.core.transfer import DictMetadataStore, FirstTokenMetadata
from runtime.distributed import TPGroup, run_ranks
from runtime.pd.kv import OTHER_RANK, SnapshotKV

pytestmark = [pytest.mark.real, pytest.mark.slow]

B, W, T, S, F = (KVPoll.Bootstrapping, KVPoll.WaitingForInput, KVPoll.Transferring,
                 KVPoll.Success, KVPoll.Failed)


class Scripted:
    """A sender or receiver whose local state the script sets; counts its polls."""

    def __init__(self) -> None:
        self.state, self.reason, self.polls, self.closed = B, "", 0, False

    def poll(self) -> KVPoll:
        self.polls += 1
        return self.state

    def failure_reason(self) -> str:
        return self.reason

    def send_metadata(self, pages, slot, state_indices=()) -> None:
        pass

    def close(self) -> None:
        self.closed = True


class ScriptedManager:
    def __init__(self) -> None:
        self.metadata = DictMetadataStore()
        self.made: dict[str, Scripted] = {}

    def poll_epoch(self) -> int:
        return 0

    def create_sender(self, req) -> Scripted:
        return self.made.setdefault(req.rid, Scripted())

    create_receiver = create_sender


def scenario(group: TPGroup) -> dict:
    rank = group.rank
    inner = ScriptedManager()
    kv = SnapshotKV(inner, group)
    reqs = {rid: Request(rid, 4, 2, bootstrap_room=room)
            for rid, room in (("s", 1), ("r1", 2), ("r2", 3))}
    sender = kv.create_sender(reqs["s"])
    r1, r2 = kv.create_receiver(reqs["r1"]), kv.create_receiver(reqs["r2"])
    r1.send_metadata([0], 5)
    seen = []

    def step(**states) -> None:
        for rid, state in states.items():
            inner.made[rid].state = state
        changed = kv.refresh()
        seen.append([changed, kv.poll_epoch(), int(sender.poll()), int(r1.poll()), int(r2.poll())])

    step(s=W if rank == 0 else B, r1=T, r2=T)  # rank 1 lags on s: it is still Bootstrapping
    step(s=W)  # now both have it
    step()  # nothing new
    inner.made["r2"].reason = "boom" if rank == 1 else ""
    inner.metadata.write(5, FirstTokenMetadata(2 if rank == 0 else 99, 7, -0.5, 0))
    step(r1=S, r2=F if rank == 1 else T)  # rank 1 read someone else's room; its r2 failed
    polls_before = inner.made["r1"].polls
    step(s=S)
    meta = kv.metadata.read(5)
    kv.release(reqs["r1"])
    return {"seen": seen, "r2_reason": r2.failure_reason(),
            "meta_room": None if meta is None else meta.bootstrap_room,
            "r1_polled_after_final": inner.made["r1"].polls - polls_before,
            "closed": inner.made["r1"].closed, "live": kv.num_live, "pending": kv.num_pending}


def test_ranks_agree_on_one_snapshot():
    rank0, rank1 = run_ranks(scenario, 2)
    assert rank0["seen"] == rank1["seen"] == [
        [True, 1, B, T, T],  # the MIN: s waits for the lagging rank
        [True, 2, W, T, T],
        [False, 2, W, T, T],  # no change, no new epoch: the schedulers skip their rescans
        [True, 3, W, S, F],  # one rank's Failed fails the request everywhere
        [True, 4, S, S, F],
    ]
    assert rank1["r2_reason"] == "boom" and rank0["r2_reason"] == OTHER_RANK
    # Both ranks report the crossed slot: rank 1 its wrong room, rank 0 (right locally) none.
    assert (rank0["meta_room"], rank1["meta_room"]) == (None, 99)
    for r in (rank0, rank1):
        assert r["r1_polled_after_final"] == 0  # a final state is not polled again
        assert r["closed"] and r["live"] == 2 and r["pending"] == 0
