"""The C heap of a process that computes: freed activations stay in it for the next step.

glibc serves an allocation above its mmap threshold (128 KiB at first, raised only after such a
block is freed) with a fresh mapping, and gives freed memory at the heap's top back to the system
beyond its trim threshold (128 KiB). A prefill slice's activations are megabytes: every unit of
every step would map new pages, fault them in zeroed and unmap them again. Measured on 2 cores
with SmolLM2's GGUF blocks (`hpipe.profiler.measure`, 500-token slices): an MLP half 9.6 ms with
glibc's defaults against 5.1 ms with the thresholds below; a 2,048-token prompt's prefill through
`hpipe launch` 2.6-3.1 s against 2.1-2.3 s. A profile is only as good as its likeness to the run,
so `StageRunner` calls `keep_freed_memory()` as it starts: the stage workers, the profiler's
workers and every in-process runner see the same heap.

The heap then holds up to a step's largest transient working set (what the step had mapped at its
peak anyway); weights, KV pages and packed caches are allocated once and are not affected.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

__all__ = ["DEFAULTS_ENV", "MMAP_THRESHOLD", "TRIM_THRESHOLD", "keep_freed_memory"]

# mallopt's parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20       # glibc's ceiling on 64-bit (half its 64 MiB heap): blocks below come from the heap
TRIM_THRESHOLD = 512 << 20      # free memory kept at the heap's top before any is given back
DEFAULTS_ENV = "HPIPE_GLIBC_HEAP"   # =default leaves glibc's thresholds as they are (bench/heap.py compares)


@functools.cache
def keep_freed_memory() -> bool:
    """Raises glibc's mmap and trim thresholds for this process (once; later calls are free).
    False where the C library is not glibc (musl, macOS): nothing to change there, or where
    HPIPE_GLIBC_HEAP=default asks for glibc's own thresholds."""
    if os.environ.get(DEFAULTS_ENV) == "default":
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
