"""The syncer's settings of glibc's allocator (``tune_malloc``).

A syncer allocates and frees fragment-sized tensors at every merge and push-sized buffers at
every push, from many threads. Two defaults of glibc's malloc make that resident memory grow
far beyond what the syncer holds:

- each thread that allocates gets its own heap (arena), and a heap keeps its peak: with M
  learners pushing at once through M connection threads, resident memory grew like
  M x model (``bench/perf_memory.py``);
- an allocation below the mmap threshold comes from a heap, whose freed chunks stay resident
  unless they are at its top. The threshold is dynamic: each freed mapped chunk raises it to
  that chunk's size, up to 32 MiB, so once a large tensor has been freed every smaller
  tensor comes from a heap and the heap keeps the syncer's peak, fragmented.

``tune_malloc`` sets one heap for all threads and a fixed 1 MiB threshold: every tensor of
1 MiB or more is its own mapping, returned when freed. At N = 2e7, M = 8 (tensors of 2.5 MB)
a default syncer held 8.9 x 4N with a 32 MiB threshold and 2.9 x 4N steady with 1 MiB
(``bench/syncer_memory.py --params 2e7``); a fresh mapping's pages are faulted in when a
merge writes them (a cold 2.4 MB merge took 5.2 ms that way against 0.86 ms from reused
heap memory, ``bench/perf_syncer.py``), which is the price of memory that follows the state.
"""

from __future__ import annotations

import ctypes
import ctypes.util

__all__ = ["MMAP_THRESHOLD", "tune_malloc"]

MMAP_THRESHOLD = 1 << 20
"""Bytes: allocations of this size or more are mapped on their own (1 MiB: an fp32 tensor of
256k elements; smaller ones stay in the heap)."""
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8


def tune_malloc(threshold: int = MMAP_THRESHOLD) -> bool:
    """One heap for all threads, allocations of ``threshold`` bytes or more mapped on their
    own, free heap above twice that returned (see the module docstring). Process-wide; a
    no-op off glibc. Returns whether every setting applied."""
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return all(
        [
            bool(mallopt(_M_ARENA_MAX, 1)),
            bool(mallopt(_M_MMAP_THRESHOLD, threshold)),
            bool(mallopt(_M_TRIM_THRESHOLD, 2 * threshold)),
        ]
    )
