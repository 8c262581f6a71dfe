"""The CPU's int4 and int8 matrix products with 16-bit activations, built at first use: `kernels/vnni.c`
on AVX512-VNNI, `kernels/avx2.c` (the same arithmetic, `vpmaddwd` and an add) on AVX2 (`VARIANTS`).

Decode at one or two threads is bound by the arithmetic per weight, not by reading the weights:
torch's `_weight_int4pack_mm_for_cpu` converts every code to float (a 1B model's step reads its
weights at ~35 GB/s of this machine's 65). llama.cpp multiplies 4-bit codes by 8-bit activations
in integer dot products (AVX-512 VNNI); this kernel multiplies them by 16-bit activations (VNNI's
`vpdpwssd`: an activation's rounding 2^-16 of its block's largest, 256 times finer than llama.cpp's),
on the codes in blocks of 64 outputs as torch's AVX512 build packs them (`hpipe.quant.pack_blocked`;
their scales in the same blocks), 1.5-3x faster than that op at one row (AVX2: 2.7-4x)
(with 8-bit activations 2.5-4x, but SmolLM2's KL against float32 doubled: 0.0024 -> 0.0046, where
16-bit gives 0.0018; llama.cpp 0.0028); and int8 weights with a scale per
row, the layout `_weight_int8pack_mm` reads (GGUF's 8-bit types and embeddings, the heads tied to
them). torchao's `da8w4_linear_cpu` does the
same (8-bit activations) only where oneDNN's brgemm packs int8 (AMX: recent Intel Xeons); elsewhere it falls to scalar
loops, and its PyPI wheel ships no CPU build of it at all.

Built once per source and compiler flags into the cache (`~/.cache/hpipe/kernels/`, a second of
gcc), loaded with ctypes into torch's process, where its OpenMP calls share torch's own runtime
(the same libgomp soname). Where the CPU lacks the instructions, or no C compiler is found, or the
build fails, `kernels()` says so and the modules keep torch's ops: nothing else changes.
`HPIPE_CPU_KERNELS=torch` keeps torch's ops on purpose (benchmarks compare the two).

The modules call them as torch ops (`ops()`), whose CPU kernels are C++ (`kernels/ops.cpp`, built
once per torch version against its headers, ~6 s of g++), so that a compiled graph calls them
without Python; where that build fails they are the Python functions here, as `ops_route()` says.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from hpipe.config import cache_dir

__all__ = ["Variant", "VARIANTS", "variant_here", "cpu_flags", "kernels", "int4_form", "int4_mm", "int8_mm",
           "int4_mm_experts", "int8_mm_experts", "int4_dequant", "int8_dequant", "int4_rows", "attend_f16", "ops",
           "ops_route", "OPS_SOURCE"]


@dataclass(frozen=True)
class Variant:
    """One build of the kernels: its source, the CPU flags it needs (/proc/cpuinfo names) and the
    compiler's."""
    name: str
    source: Path
    cpu_flags: tuple[str, ...]
    cflags: tuple[str, ...]


_KERNELS = Path(__file__).with_name("kernels")
_COMMON = ("-O3", "-fopenmp", "-fPIC", "-shared")
# the first whose flags the CPU has: AVX-512 (VNNI's fused dot products), else AVX2 (the same
# arithmetic in two instructions, vpmaddwd and an add)
VARIANTS = (
    Variant("AVX512-VNNI", _KERNELS / "vnni.c", ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512vbmi", "f16c"),
            ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mavx512vbmi", "-mfma", "-mf16c", *_COMMON)),
    Variant("AVX2", _KERNELS / "avx2.c", ("avx2", "fma", "f16c"), ("-mavx2", "-mfma", "-mf16c", *_COMMON)),
)
OPS_SOURCE = _KERNELS / "ops.cpp"
ENV = "HPIPE_CPU_KERNELS"
OPS_ENV = "HPIPE_CPU_OPS"        # "python": the ops' Python kernels (tests compare the two routes)


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo names them (empty where it cannot be read)."""
    try:
        return frozenset(Path("/proc/cpuinfo").read_text().split("flags", 2)[1].split("\n", 1)[0].split())
    except (OSError, IndexError):
        return frozenset()


def _build(compiler: str, source: Path, flags: tuple[str, ...], stem: str, inputs: tuple[str, ...] = (),
           timeout: int = 120) -> Path:
    """The shared library for this source, these flags and inputs, compiled once (atomically:
    processes that start together each build their own temporary file and the last rename wins)."""
    headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))     # what the sources include
    key = hashlib.sha256(source.read_bytes() + headers + " ".join((compiler, *flags, *inputs)).encode()).hexdigest()[:16]
    out = cache_dir() / "kernels" / f"{stem}-{key}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(f".tmp-{os.getpid()}.so")
        subprocess.run([compiler, *flags, "-o", str(tmp), str(source), *inputs], check=True, capture_output=True,
                       timeout=timeout)
        os.replace(tmp, out)
    return out


def _failure(e: Exception, compiler: str) -> str:
    """The first line a failed build printed (or its exit status)."""
    detail = (getattr(e, "stderr", b"") or b"").decode(errors="replace").strip().splitlines()
    return (detail[0] if detail else f"{compiler} exited with {getattr(e, 'returncode', e)}")[:160]


@functools.cache
def kernels() -> tuple[object | None, str]:
    """(the loaded library, or None; a line saying which kernels the CPU's quantized linears run,
    or why not these)."""
    torch_ops = "torch's int4/int8 kernels, bf16 activations"
    if os.environ.get(ENV, "").lower() == "torch":
        return None, f"{torch_ops} ({ENV}=torch)"
    variant = variant_here()
    if variant is None:
        return None, f"{torch_ops} (this CPU has neither {' nor '.join('/'.join(v.cpu_flags) for v in VARIANTS)})"
    compiler = next((c for c in (os.environ.get("CC"), "gcc", "cc", "clang") if c and shutil.which(c)), None)
    if compiler is None:
        return None, f"{torch_ops} (no C compiler found for the {variant.name} kernels: install gcc)"
    import torch          # its libgomp first: the library's OpenMP binds to the same runtime

    try:
        lib = ctypes.CDLL(str(_build(compiler, variant.source, variant.cflags, variant.source.stem)))
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"{torch_ops} (building the {variant.name} kernels with {compiler} failed: {_failure(e, compiler)})"
    del torch
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.hpipe_int4_mm.argtypes = [p, i32, i64, i64, p, p, i32, i64, i64, p, i32]
    lib.hpipe_int8_mm.argtypes = [p, i32, i64, i64, p, p, i32, i64, p, i32]
    lib.hpipe_int4_mm.restype = lib.hpipe_int8_mm.restype = i32
    lib.hpipe_int4_mm_routed.argtypes = [p, i32, i64, i64, p, i64, p, i64, i32, i64, i64, p, i64, i64, p, i32]
    lib.hpipe_int8_mm_routed.argtypes = [p, i32, i64, i64, p, i64, p, i64, i32, i64, p, i64, i64, p, i32]
    lib.hpipe_int4_mm_routed.restype = lib.hpipe_int8_mm_routed.restype = i32
    lib.hpipe_int4_dequant.argtypes = [p, p, i32, i64, i64, i64, i64, p, i32]
    lib.hpipe_int4_rows.argtypes = [p, p, i32, i64, i64, i64, p, i64, p]
    lib.hpipe_int4_rows.restype = i32
    lib.hpipe_int8_dequant.argtypes = [p, p, i32, i64, i64, i64, p, i32]
    lib.hpipe_attend_f16.argtypes = [p, i64, i64, i64, i64, p, p, i64, i64, i64, i64, p, i64, ctypes.c_float, p, i32]
    lib.hpipe_attend_f16.restype = i32
    return lib, f"int4/int8 codes x 16-bit activations per block of 32 ({variant.name})"


def variant_here() -> Variant | None:
    """The kernels' build this CPU runs (None: neither)."""
    return next((v for v in VARIANTS if all(f in cpu_flags() for f in v.cpu_flags)), None)


def _rows(x):
    import torch

    if x.dtype not in (torch.float32, torch.bfloat16):
        x = x.float()
    return x.contiguous()


def int4_form(scales_zeros) -> int:
    """How `scales_zeros` holds an int4 weight's scales (vnni.c's forms), by its dtype and shape:
    bf16 [N / 64, K / G, 64, 2] (s, z) pairs 1; float16 [..., 1] s alone (symmetric) 0; uint8
    [N / 64, K / 256, 1280] Q4_K's super-blocks 2."""
    import torch

    if scales_zeros.dtype == torch.uint8:
        return 2
    return 1 if scales_zeros.shape[-1] == 2 else 0


def int4_mm(x, packed, scales_zeros, group: int):
    """x [M, K] (float32 or bf16) @ W^T -> float32 [M, N], W in torch's CPU int4 packing
    (`packed` [N / 64, K, 32] bytes) with its scales in blocks of 64 outputs, in one of the forms
    of `int4_form`."""
    import torch

    x = _rows(x)
    m, k = x.shape
    n = scales_zeros.shape[0] * 64
    y = torch.empty(m, n, dtype=torch.float32)
    if m and kernels()[0].hpipe_int4_mm(x.data_ptr(), x.dtype == torch.bfloat16, m, k, packed.data_ptr(),
                                        scales_zeros.data_ptr(), int4_form(scales_zeros), n, group, y.data_ptr(),
                                        torch.get_num_threads()):
        raise MemoryError(f"int4 kernel: no memory for {m} x {k} activations")
    return y


def int8_mm(x, weight, scales):
    """x [M, K] (float32 or bf16) @ W^T -> float32 [M, N], W int8 [N, K] times bf16 `scales` [N] (one
    per row), or float16 `scales` [N, K / 32] (one per block of 32 inputs: GGUF's Q8_0)."""
    import torch

    x = _rows(x)
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    if m and kernels()[0].hpipe_int8_mm(x.data_ptr(), x.dtype == torch.bfloat16, m, k, weight.data_ptr(),
                                        scales.data_ptr(), scales.dim() == 2, n, y.data_ptr(), torch.get_num_threads()):
        raise MemoryError(f"int8 kernel: no memory for {m} x {k} activations")
    return y


def _pairs(x, ids):
    """`ids` as the routed kernels read them (int64, contiguous), checked against x's rows."""
    import torch

    ids = ids.reshape(-1).to(torch.int64).contiguous()
    if x.shape[0] and ids.numel() % x.shape[0]:
        raise ValueError(f"{ids.numel()} routed pairs over {x.shape[0]} rows: each row must have as many")
    return ids


def _routed_failed(rc: int, k: int, n_experts: int):
    if rc == -2:
        raise IndexError(f"an expert id outside [0, {n_experts})")
    raise MemoryError(f"routed experts kernel: no memory for {k} activations")


def int4_mm_experts(x, packed, scales_zeros, group: int, ids):
    """A step's routed experts in one call (kernels/experts.h): row i of the result [len(ids), N]
    float32 is x's row i // (len(ids) / len(x)) @ W[ids[i]]^T, W the block's stacked int4 weights
    (`packed` [E, N / 64, K, 32], `scales_zeros` [E, ...] in one of `int4_form`'s forms); each
    picked expert read once for all of its pairs."""
    import torch

    x, ids = _rows(x), _pairs(x, ids)
    m, k = x.shape
    n, e = scales_zeros.shape[1] * 64, packed.shape[0]
    y = torch.empty(ids.numel(), n, dtype=torch.float32)
    if m and ids.numel():
        rc = kernels()[0].hpipe_int4_mm_routed(x.data_ptr(), x.dtype == torch.bfloat16, m, k, packed.data_ptr(),
                                               packed.stride(0) * packed.element_size(), scales_zeros.data_ptr(),
                                               scales_zeros.stride(0) * scales_zeros.element_size(),
                                               int4_form(scales_zeros[0]), n, group, ids.data_ptr(), ids.numel(), e,
                                               y.data_ptr(), torch.get_num_threads())
        if rc:
            _routed_failed(rc, k, e)
    return y


def int8_mm_experts(x, weight, scales, ids):
    """`int4_mm_experts` for int8 weights `weight` [E, N, K] with `scales` [E, N] (bf16, per row) or
    [E, N, K / 32] (float16, per block: Q8_0)."""
    import torch

    x, ids = _rows(x), _pairs(x, ids)
    m, k = x.shape
    n, e = weight.shape[1], weight.shape[0]
    y = torch.empty(ids.numel(), n, dtype=torch.float32)
    if m and ids.numel():
        rc = kernels()[0].hpipe_int8_mm_routed(x.data_ptr(), x.dtype == torch.bfloat16, m, k, weight.data_ptr(),
                                               weight.stride(0), scales.data_ptr(), scales.stride(0),
                                               scales.dim() == 3, n, ids.data_ptr(), ids.numel(), e, y.data_ptr(),
                                               torch.get_num_threads())
        if rc:
            _routed_failed(rc, k, e)
    return y


def int4_dequant(packed, scales_zeros, group: int, first: int, out) -> None:
    """Blocks [first, first + len(out)) of 64 outputs of an int4 weight (as `int4_mm` reads it) into
    `out` [blocks, K, 64] bf16: W^T of each block, rounded once to bf16 (the dense path's chunks)."""
    import torch

    blocks, k, _ = out.shape
    kernels()[0].hpipe_int4_dequant(packed.data_ptr(), scales_zeros.data_ptr(), int4_form(scales_zeros), k,
                                    group, first, blocks, out.data_ptr(), torch.get_num_threads())


def int4_rows(packed, scales_zeros, group: int, rows):
    """Rows `rows` [T] (int64) of an int4 weight as `int4_mm` reads it (`packed` [N, K / 2] bytes), in float32 ->
    [T, K]: an embedding's lookups, the values torch's ops give from the same tensors."""
    import torch

    rows = rows.to(torch.int64).contiguous()
    n, k = scales_zeros.shape[0] * 64, packed.shape[1] * 2         # packed [N, K / 2] bytes
    out = torch.empty(rows.shape[0], k, dtype=torch.float32)
    if kernels()[0].hpipe_int4_rows(packed.data_ptr(), scales_zeros.data_ptr(), int4_form(scales_zeros), n, k, group,
                                    rows.data_ptr(), rows.shape[0], out.data_ptr()):
        raise IndexError(f"a row outside [0, {n}) of a {n}-row table")
    return out


def int8_dequant(weight, scales, first: int, out) -> None:
    """Rows [first, first + len(out)) of an int8 weight times their scales (per row or per block, as
    `int8_mm` reads them) into `out` [rows, K] bf16, rounded once."""
    import torch

    rows, k = out.shape
    kernels()[0].hpipe_int8_dequant(weight.data_ptr(), scales.data_ptr(), scales.dim() == 2, k, first, rows,
                                    out.data_ptr(), torch.get_num_threads())


def attend_f16(q, k, v, mask, scale: float):
    """One query row per sequence against a float16 KV cache where it lies (kernels/attention.h):
    q [b, kv heads, g, d] float32, k and v [b, kv heads, n, d] float16 (the same strides, the last
    1), mask [b, 1, R, n] bool (True: attend; query j takes row j // (g // R): R = 1 one row for the
    group, R = g one a query, R = L a sequence's L rows as one group of L x heads-per-KV-head queries)
    or None -> [b, kv heads, g, d] float32, softmax(q k^T scale) v per query head."""
    import torch

    b, h, g, d = q.shape
    n = k.shape[2]
    q = q.float().contiguous()
    _check_attend(k, v, b, h, n, d)
    rows = mask.shape[2] if mask is not None and mask.dim() == 4 else 1
    if g % rows:
        raise ValueError(f"attention kernel: a mask of {rows} rows for {g} queries a KV head: its rows must divide them")
    m = None if mask is None else mask.expand(b, 1, rows, n).reshape(b, rows * n).to(torch.uint8).contiguous()
    out = torch.empty(b, h, g, d, dtype=torch.float32)
    rc = kernels()[0].hpipe_attend_f16(q.data_ptr(), b, h, g, d, k.data_ptr(), v.data_ptr(), k.stride(0),
                                       k.stride(1), k.stride(2), n, None if m is None else m.data_ptr(), rows, scale,
                                       out.data_ptr(), torch.get_num_threads())
    if rc:
        raise MemoryError(f"attention kernel: no memory for {b} x {h} x {n} positions") if rc == -1 else \
            ValueError(f"attention kernel: heads of size {d}: sizes a multiple of 8 up to 256")
    return out


def _check_attend(k, v, b: int, h: int, n: int, d: int) -> None:
    import torch

    if k.dtype != torch.float16 or v.dtype != torch.float16 or k.stride() != v.stride() or k.stride(3) != 1:
        raise ValueError("attention kernel: k and v must be float16 at the same strides, the last 1")
    if k.dim() != 4 or tuple(k.shape) != (b, h, n, d) or tuple(v.shape) != (b, h, n, d):
        raise ValueError(f"attention kernel: k {tuple(k.shape)} and v {tuple(v.shape)} do not match the query")


def _cpp_ops() -> str | None:
    """Loads `kernels/ops.cpp`'s CPU kernels of the hpipe ops into torch's dispatcher (built once per
    source, torch version and ABI, linked to the VNNI library); None, or why not."""
    import torch

    compiler = next((c for c in (os.environ.get("CXX"), "g++", "c++", "clang++") if c and shutil.which(c)), None)
    if compiler is None:
        return "no C++ compiler found: install g++"
    root = Path(torch.__file__).parent
    # -DHPIPE_TORCH: torch's version in the build's cache key (the source does not read it)
    flags = ("-O2", "-std=c++17", "-fPIC", "-shared", "-w",
             f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}", f"-DHPIPE_TORCH={torch.__version__}",
             f"-I{root / 'include'}", f"-I{root / 'include' / 'torch' / 'csrc' / 'api' / 'include'}")
    libraries = (kernels()[0]._name, f"-L{root / 'lib'}", f"-Wl,-rpath,{root / 'lib'}", "-ltorch_cpu", "-lc10")
    try:     # the libraries after the source (a linker that drops those not needed yet would drop them)
        torch.ops.load_library(str(_build(compiler, OPS_SOURCE, flags, "ops", libraries, timeout=300)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        return f"building {OPS_SOURCE.name} with {compiler} failed: {_failure(e, compiler)}"
    return None


@functools.cache
def ops():
    """`int4_mm` and `int8_mm` as the torch ops `torch.ops.hpipe.int4_mm` / `int8_mm`, what the
    modules call: a compiled graph keeps each as one opaque call (dynamo does not trace into
    ctypes). Their CPU kernels are `kernels/ops.cpp`'s (`_cpp_ops`: 2.2 us a call from Python at
    one row of 64 x 64 here, 5.4 through Python's, and none of Python from a compiled graph's C++
    wrapper); where it cannot be built, or `HPIPE_CPU_OPS=python`, the Python functions above.
    Returns (the library, None or why the Python kernels)."""
    import torch

    lib = torch.library.Library("hpipe", "DEF")
    lib.define("int4_mm(Tensor x, Tensor packed, Tensor scales_zeros, int group) -> Tensor")
    lib.define("int8_mm(Tensor x, Tensor weight, Tensor scales) -> Tensor")
    lib.define("int4_mm_experts(Tensor x, Tensor packed, Tensor scales_zeros, int group, Tensor ids) -> Tensor")
    lib.define("int8_mm_experts(Tensor x, Tensor weight, Tensor scales, Tensor ids) -> Tensor")
    lib.define("attend_f16(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale) -> Tensor")
    why = f"{OPS_ENV}=python" if os.environ.get(OPS_ENV, "").lower() == "python" else _cpp_ops()
    if why is not None:
        lib.impl("int4_mm", int4_mm, "CPU")
        lib.impl("int8_mm", int8_mm, "CPU")
        lib.impl("int4_mm_experts", int4_mm_experts, "CPU")
        lib.impl("int8_mm_experts", int8_mm_experts, "CPU")
        lib.impl("attend_f16", attend_f16, "CPU")

    @torch.library.register_fake("hpipe::int4_mm", lib=lib)
    def _(x, packed, scales_zeros, group):
        return x.new_empty(x.shape[0], scales_zeros.shape[0] * 64, dtype=torch.float32)

    @torch.library.register_fake("hpipe::int8_mm", lib=lib)
    def _(x, weight, scales):
        return x.new_empty(x.shape[0], weight.shape[0], dtype=torch.float32)

    @torch.library.register_fake("hpipe::int4_mm_experts", lib=lib)
    def _(x, packed, scales_zeros, group, ids):
        return x.new_empty(ids.numel(), scales_zeros.shape[1] * 64, dtype=torch.float32)

    @torch.library.register_fake("hpipe::int8_mm_experts", lib=lib)
    def _(x, weight, scales, ids):
        return x.new_empty(ids.numel(), weight.shape[1], dtype=torch.float32)

    @torch.library.register_fake("hpipe::attend_f16", lib=lib)
    def _(q, k, v, mask, scale):
        return q.new_empty(q.shape, dtype=torch.float32)

    return lib, why


def ops_route() -> str:
    """How the hpipe ops reach the kernels: "C++", or "Python (why)"."""
    why = ops()[1]
    return "C++" if why is None else f"Python ({why})"
