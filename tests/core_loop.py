"""The core loop run by hand, for tests of the real executor under a scheduler: a clock that
advances by each forward's measured time, no threads, no sockets."""

from __future__ import annotations


def drive(sched, executor, reqs, *, gap_s: float = 0.0) -> list:
    """Add `reqs` to `sched` and run its batches on `executor` until it is idle (`gap_s`: host
    time between steps); the batches, in order."""
    now = 0.0
    for r in reqs:
        sched.add_request(r, now)
    batches = []
    while not sched.is_idle:
        batch = sched.step(now)
        assert batch is not None, "the scheduler stalled"
        result = executor.forward(batch)
        now += result.duration_s + gap_s
        sched.on_batch_done(batch, result, now)
        batches.append(batch)
    return batches
