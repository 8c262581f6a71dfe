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

__all__ = ["DEFAULTS_ENV", "HUGE_PAGE", "MMAP_THRESHOLD", "TRIM_THRESHOLD", "huge_pages_advised", "in_huge_pages",
           "keep_freed_memory"]

# mallopt's parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20       # glibc's ceiling on 64-bit (half its 64 MiB heap): blocks below come from the heap
TRIM_THRESHOLD = 512 << 20      # free memory kept at the heap's top before any is given back
DEFAULTS_ENV = "HPIPE_GLIBC_HEAP"   # =default leaves glibc's thresholds as they are (bench/heap.py compares)
HUGE_PAGE = 2 << 20             # x86-64's and arm64's (4 KB base pages) transparent huge page
_THP = "/sys/kernel/mm/transparent_hugepage/enabled"


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


@functools.cache
def huge_pages_advised() -> bool:
    """Whether anonymous memory advised with MADV_HUGEPAGE gets transparent huge pages here (Linux,
    THP "always" or "madvise"; not "never", nor a system without them)."""
    import mmap

    try:
        mode = open(_THP).read()
    except OSError:
        return False
    return hasattr(mmap, "MADV_HUGEPAGE") and "[never]" not in mode


def in_huge_pages(tensors: dict) -> dict:
    """Copies of CPU `tensors` (name -> tensor) in one anonymous mapping advised for transparent huge
    pages, each at a 64-byte boundary, or `tensors` as they are where `huge_pages_advised()` is False.

    A decode step reads every weight once, in streams of a few hundred KB (a MoE block's picked
    experts, a block's projections). On 4 KB pages each page costs a TLB miss, and under a
    hypervisor's nested paging a miss walks two sets of page tables; the packed cache's file mapping
    (`quant.cached_unit`) gives 4 KB pages. Measured on a 2-core AVX-512 EPYC VM (the MoE bench shape
    of bench/moe.py, whole model in one process, real decode): 8.10 -> 6.68 ms a token at one thread,
    6.04 -> 5.03 at two; its routed experts' kernel alone over all 8 blocks 2.6-2.8 -> 1.5-2.2 ms.
    The cost: one copy at load, and up to one huge page of the mapping's tail beyond the tensors (a
    caller copies a stage's tensors in one call: one a unit left units under 2 MB on 4 KB pages)."""
    import mmap

    import torch

    if not huge_pages_advised() or not tensors:
        return tensors
    offsets, end = {}, 0
    for name, t in tensors.items():
        offsets[name] = end
        end += -(-t.numel() * t.element_size() // 64) * 64
    area = mmap.mmap(-1, end + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    area.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(area, dtype=torch.uint8)         # keeps `area` alive while any view lives
    start = -raw.data_ptr() % HUGE_PAGE                     # huge pages cover aligned 2 MB ranges
    out = {}
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        out[name] = raw[start + offsets[name]:start + offsets[name] + n].view(t.dtype).view(t.shape)
        out[name].copy_(t)
    return out
