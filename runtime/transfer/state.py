"""Per-room progress shared by both halves of the backend, and the manager's poll epoch."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from pdsim.core.kvpoll import KVPoll, advance


class Epoch:
    """`KVManager.poll_epoch`: bumped (after the change) whenever any room's state changes.

    Listeners are called after every bump, on the bumping thread (often with a side's lock
    held): they must be quick and must not call back into the transfer backend.
    """

    def __init__(self) -> None:
        self.value = 0
        self._lock = threading.Lock()  # two racing bumps must both count
        self._listeners: list[Callable[[], None]] = []

    def listen(self, callback: Callable[[], None]) -> None:
        self._listeners.append(callback)

    def bump(self) -> None:
        with self._lock:
            self.value += 1
        for callback in self._listeners:
            callback()


@dataclass
class RoomState:
    state: KVPoll = KVPoll.Bootstrapping
    reason: str = ""

    @property
    def done(self) -> bool:
        return self.state in (KVPoll.Success, KVPoll.Failed)

    def update(self, new: KVPoll, reason: str = "") -> bool:
        """Move to `new` (forward only, `Failed` sticky); True if the state changed."""
        nxt = advance(self.state, new)
        if nxt is self.state:
            return False
        if nxt is KVPoll.Failed:
            self.reason = reason
        self.state = nxt
        return True
