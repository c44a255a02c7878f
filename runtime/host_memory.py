"""Keep a CPU serving process's freed memory for its next forward, as a GPU engine's caching
allocator keeps the device memory its last forward freed.

glibc hands memory that a forward frees back to the kernel: the top of a heap once it grows
past the trim threshold, and every block above the mmap threshold (glibc moves both as blocks
come and go). The next forward's activations then fault their pages in again. On the 2-vCPU
KVM machine docs/validation.md's matrix runs on, a page first touched costs 4-7 us: a served
256-token tiny-llama extend that faulted 1,238 pages took 16.6 ms against 7.7 ms for the same
extend without faults, and a later 384-token one, after the heap had been trimmed, 688 faults
and 14.6 ms against 12 ms. The simulator prices forwards as the calibration profiled them,
back to back, without those faults; a GPU engine pays none either. The price: the process's
resident memory stays at its high-water mark, as a GPU engine's reserved memory does.
"""

from __future__ import annotations

import ctypes

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)
TRIM_THRESHOLD_MAX = 2**31 - 1  # mallopt takes a C int
MMAP_THRESHOLD_MAX = 32 << 20  # glibc's largest mmap threshold on a 64-bit host


def retain_freed_memory() -> bool:
    """Keep freed memory in this process's heaps: never trim them, and serve blocks of up to
    32 MiB from them (larger ones still map and unmap their pages). Fixed thresholds also stop
    glibc's adjusting them. Returns whether the C library took both (False off glibc)."""
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        return False
    return bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_MAX)) and bool(
        mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX))
