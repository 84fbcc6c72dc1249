"""Keep the memory a turn frees inside the process instead of handing it back to the OS at once (glibc).

Why: a turn allocates and frees tensors of a few megabytes (a recall's spliced KV, an eviction's spans, a
forward's activations). By default glibc returns a freed block above its mmap threshold, and the free top
of its heap past its trim threshold, to the OS, so the next turn's tensors of the same sizes land on fresh
pages, each faulted in and zeroed on first touch: a recall's two 5 MB gathers cost 3 ms each instead of
0.4. Raising both thresholds keeps that memory: the process holds what it used at its peak, plus at most
TRIM_THRESHOLD of free heap, and stops paying the faults every turn. Only glibc has `mallopt`; elsewhere
this does nothing. A process-wide setting, so the command line sets it (every `palace` command and each
eval worker); a program embedding the Agent may call `keep_freed_memory()` itself."""

from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
MMAP_THRESHOLD = 32 << 20  # bytes: blocks below this come from the heap (glibc's largest on 64-bit)
TRIM_THRESHOLD = 256 << 20  # bytes of free heap top kept before any is given back


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process; True where both took effect."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return False
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    mmap_set = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    return bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)) and mmap_set
