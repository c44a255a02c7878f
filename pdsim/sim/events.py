"""Events the simulator puts on SimPy's queue itself, the one place that relies on SimPy 4's
internals: the environment pops `(time, priority, eid, event)` off `env._queue`, runs
`event.callbacks` and reads `event._ok`; `env._eid` numbers entries in the order they were
made, which breaks ties at equal times."""

from __future__ import annotations

from collections.abc import Callable
from heapq import heappush

import simpy
from simpy.events import NORMAL


def push(env: simpy.Environment, at: float, event) -> None:
    """Queue `event` at time `at` (normal priority), as `Environment.schedule` does."""
    heappush(env._queue, (at, NORMAL, next(env._eid), event))


class At(simpy.Timeout):
    """A timeout that fires at the absolute time `at`. SimPy schedules `now + delay`, which
    cannot always land on a given float (rounding), and a run of decode steps must end exactly
    where step-by-step timeouts would."""

    def __init__(self, env: simpy.Environment, at: float):
        if at < env.now:
            raise ValueError(f"cannot schedule at {at!r}, before now ({env.now!r})")
        self.env = env
        self.callbacks = []
        self._value = None
        self._delay = at - env.now
        self._ok = True
        push(env, at, self)


class Call:
    """An event that SimPy processes by calling `callback(event)`: the queue entry of
    `env.timeout(delay)` with that callback, without building the Timeout and its callback list
    (~5 of these per PD request)."""

    __slots__ = ("callbacks", "fn")
    _ok = True

    def __init__(self, callback: Callable[["Call"], None], fn: Callable[[], None] | None = None):
        self.callbacks = (callback,)
        self.fn = fn


def call_fn(event: Call) -> None:
    event.fn()


def push_after(env: simpy.Environment, delay: float, event: Call) -> None:
    """Queue `event` `delay` seconds from now, ordered as a timeout made now."""
    if delay < 0:
        raise ValueError(f"negative delay {delay!r}")
    push(env, env._now + delay, event)
