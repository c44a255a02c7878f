"""A CPU serving process keeps the memory its forwards free (runtime/host_memory.py), and its
engine thread's heap is grown to the largest step before the first request
(`ModelExecutor.bind_thread`). Each check runs in a fresh interpreter: glibc's thresholds are
process-wide, and only a fresh process shows what its defaults do. Page faults are counted with
getrusage, so nothing here is timed."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.real

MIB = 1 << 20
PAGE = 4096


def run(script: str, *args: str) -> dict:
    """The JSON that `script` prints last, run in a fresh interpreter with `args`."""
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(script), *args],
                         capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.splitlines()[-1])


REALLOCATE = """
    import ctypes, json, resource, sys
    from runtime.host_memory import retain_freed_memory
    retained = retain_freed_memory() if sys.argv[-1] == "retain" else None
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]

    def faults_of_one(nbytes):  # allocate, touch every page, free
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        p = libc.malloc(nbytes)
        ctypes.memset(p, 1, nbytes)
        libc.free(p)
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    first = faults_of_one(SIZE)
    print(json.dumps({"retained": retained, "first": first, "again": faults_of_one(SIZE)}))
"""


@pytest.mark.parametrize("retain", [False, True])
def test_a_freed_block_is_reused_without_faulting_only_when_retained(retain):
    """A 24 MiB block, freed and asked for again: glibc's defaults map it afresh (its pages fault
    again, as a CPU forward's activations did between requests); retained, the heap keeps it."""
    size = 24 * MIB
    out = run(REALLOCATE.replace("SIZE", str(size)), "retain" if retain else "default")
    pages = size // PAGE
    assert out["first"] > pages // 2  # the first touch always faults
    if retain:
        assert out["retained"] is True
        assert out["again"] < pages // 100
    else:
        assert out["again"] > pages // 2


WARM_THREAD = """
    import json, resource, threading
    import torch
    from runtime.executor import ModelExecutor
    from runtime.model import ModelConfig, build_model

    model = build_model(ModelConfig.preset("tiny-llama"), seed=0)
    torch.set_num_threads(1)
    executors = {"step": ModelExecutor(model, num_pages=64, page_size=16, warmup=(768, 256)),
                 "default": ModelExecutor(model, num_pages=64, page_size=16)}
    faults, both_bound = {}, threading.Barrier(2)

    def step_faults(name):
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        executors[name].warmup(768, 256)  # the largest step: 3 chunks of 256 tokens
        return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before

    def engine_thread(name):
        executors[name].bind_thread()
        both_bound.wait()  # both alive: each thread keeps a heap of its own
        # The unwarmed thread's first step grows its heap, so it is timed once; the warmed
        # one's every step is alike: the median of three sets its stray faults aside.
        runs = [step_faults(name) for _ in range(1 if name == "default" else 3)]
        faults[name] = sorted(runs)[len(runs) // 2]
        both_bound.wait()

    threads = [threading.Thread(target=engine_thread, args=(n,)) for n in executors]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps(faults))
"""


def test_bind_thread_grows_the_engine_threads_heap_to_the_largest_step():
    """The thread that binds an executor warmed at the scheduler's largest step runs that step
    without faulting its activations in; one warmed at the old 32-token default faults them in
    then (1,592-2,565 pages in 55 runs). Some allocation outside the activations still faults
    now and then on the warmed thread, in multiples of 32 pages (0-2 pages in 26 of those
    runs, 33-385 in 29, and in one fast-suite run more than a quarter of the unwarmed
    thread's): the test takes the median of three of its steps."""
    faults = run(WARM_THREAD)
    assert faults["default"] > 1000
    assert faults["step"] < faults["default"] / 4


def test_warmup_shape_is_the_largest_step_capped():
    from configs import scheduler_config
    from runtime.executor import WARMUP_MAX_CHUNK, WARMUP_MAX_TOKENS, warmup_shape

    def shape(**knobs):
        return warmup_shape(scheduler_config(64, **knobs))

    # with chunking a step holds at most one chunk, however many requests it takes, and a lone
    # request takes a whole one even beyond max_prefill_tokens
    assert shape(max_prefill_tokens=1024, chunked_prefill_size=256) == (256, 256)
    assert shape(max_prefill_tokens=128, chunked_prefill_size=256) == (256, 256)
    assert shape(max_prefill_tokens=16384, chunked_prefill_size=8192) == (WARMUP_MAX_TOKENS,
                                                                          WARMUP_MAX_CHUNK)
    assert shape(max_prefill_tokens=300, chunked_prefill_size=0) == (300, 300)
    assert shape(max_prefill_tokens=16384, chunked_prefill_size=0) == (WARMUP_MAX_TOKENS,
                                                                      WARMUP_MAX_CHUNK)


def test_engine_start_returns_after_the_engine_thread_warmed_up(monkeypatch):
    """The warm-up runs on the engine thread before `Engine.start` returns (so no request waits
    for it), and a warm-up that fails fails the start."""
    import threading

    from configs import scheduler_config
    from runtime.driver import Engine
    from runtime.executor import ModelExecutor
    from runtime.model import ModelConfig, build_model

    model = build_model(ModelConfig.preset("tiny-llama"), seed=0)
    cfg = scheduler_config(64, max_prefill_tokens=256, chunked_prefill_size=128)
    warmed = []

    def warmup(self, tokens, chunk):
        warmed.append((threading.current_thread().name, tokens, chunk))
        if tokens == 13:
            raise RuntimeError("no memory for the warm-up")

    monkeypatch.setattr(ModelExecutor, "warmup", warmup)
    executor = ModelExecutor(model, num_pages=64, page_size=16, warmup=(256, 128))
    engine = Engine(executor, cfg).start()
    try:
        assert warmed == [("pdsim-engine", 256, 128)]
    finally:
        engine.stop()
    failing = ModelExecutor(model, num_pages=64, page_size=16, warmup=(13, 0))
    with pytest.raises(RuntimeError, match="no memory for the warm-up"):
        Engine(failing, cfg).start()
