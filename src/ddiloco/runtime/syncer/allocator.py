"""Freed tensors go back to the operating system.

glibc's malloc serves an allocation below its mmap threshold from a heap, and a freed chunk
in the middle of a heap stays resident. The threshold is dynamic: each freed mmapped chunk
raises it to that chunk's size (up to 32 MiB), so once the syncer has freed a large tensor,
every tensor below that size comes from a heap. A syncer allocates and frees fragment-sized
tensors at every merge, from many threads: with the dynamic threshold its resident memory
climbs to several models' worth of freed chunks. Fixing the threshold at ``MMAP_THRESHOLD``
keeps every tensor of that size or more in its own mapping, returned when freed
(``bench/syncer_memory.py`` measures the effect).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

__all__ = ["MMAP_THRESHOLD", "return_freed_memory"]

log = logging.getLogger("ddiloco.syncer")

MMAP_THRESHOLD = 1 << 20
"""Bytes: allocations of this size or more are mapped on their own (1 MiB: a fp32 tensor of
256k elements; the syncer's smaller tensors stay in the heap)."""
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def return_freed_memory(threshold: int = MMAP_THRESHOLD) -> bool:
    """Fix glibc's mmap threshold (and trim threshold) for this process; False where the C
    library is not glibc (nothing is changed)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = bool(mallopt(_M_MMAP_THRESHOLD, threshold)) and bool(
        mallopt(_M_TRIM_THRESHOLD, 2 * threshold)
    )
    if not ok:
        log.debug("mallopt refused the mmap threshold %d", threshold)
    return ok
