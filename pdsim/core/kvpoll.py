"""Transfer progress of one request, as every transfer backend reports it."""

from __future__ import annotations

from collections.abc import Iterable
from enum import IntEnum


class KVPoll(IntEnum):
    """Ordered states: a request only ever moves right, except into the sticky `Failed`."""

    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


def advance(current: KVPoll, new: KVPoll) -> KVPoll:
    """The state after reporting `new`: forward-only (`max`), and `Failed` is never left."""
    if current is KVPoll.Failed or new is KVPoll.Failed:
        return KVPoll.Failed
    return current if current >= new else new


def reduce_polls(polls: Iterable[KVPoll]) -> KVPoll:
    """What the ranks of one instance agree on: the MIN of their polls, so one failure fails all."""
    result = None
    for poll in polls:
        result = poll if result is None or poll < result else result
    if result is None:
        raise ValueError("reduce_polls needs at least one poll")
    return KVPoll(result)
