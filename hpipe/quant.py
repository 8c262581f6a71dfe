"""Weights kept quantized: GGUF files in their own 4/8-bit form, Hugging Face models quantized at
load, run by PyTorch's weight-only kernels, or on a CPU with AVX512-VNNI or AVX2 by hpipe's own 16-bit-activation
kernels on the same layouts (`hpipe.cpu_kernels`).

Three steps, each a small function:

1. **Read** (`read_gguf_tensor`): a GGUF tensor's blocks -> `Affine` codes and per-group scales and
   offsets, `w = scale * code + offset`, exactly the values the `gguf` package's own dequantization
   gives (same float32 arithmetic), without passing through a float weight matrix. Or, for a float
   checkpoint, `quantize_int4` / `quantize_int8` make the same form from the floats.
2. **Pack** (`pack`): codes -> the kernel's layout. A 4-bit code with a group the kernel takes
   (Q4_0, Q4_1, Q4_K, int4:G) goes to the int4 kernel, `w = (u - 8) * s + z` with s, z in bf16;
   every other code (Q8_0, Q6_K, 5-bit types, int8) is re-quantized to int8 per output channel, the
   nearest layout a kernel serves (`torch._weight_int8pack_mm` has one scale per row).
3. **Run** (`hpipe.quantized`: `Int4Linear`, `Int8Linear`, `Int4Embedding`, `Int8Embedding`): modules that take the place of
   transformers' `nn.Linear` / `nn.Embedding` inside its own attention and MLP modules, as torchao
   swaps them; activations go to torch's kernels in bf16 (they take no other dtype), to the VNNI
   kernels as they are (float32 by default), quantized there to int16 per block of 32.
   Linears that read one input (attention's q, k, v; a gated MLP's gate and up) are packed
   stacked into one matrix and run as one (`STACKED`, `LinearPart`).
   Many rows at once (prefill slices, scored prompts) on a CPU: the weights are dequantized to bf16
   a chunk of output rows at a time and multiplied by a GEMM (the modules' `dense`, as `dense_gemm`
   chooses per device: `DENSE`). The weight-only kernels do the arithmetic of a matrix-vector
   product for every row, so from some number of rows on, dequantizing costs less than it saves.
   With bf16 matrix units (AMX or AVX512-BF16), oneDNN's bf16 GEMM: 180 GFLOP/s for the kernels on
   2 cores there against 2,500 for the GEMM; 8192x2048 int4 at 256 rows 47 -> 25 ms, at 512 rows
   94 -> 31 ms; int8 at 256 rows 47 -> 11 ms. Without them (AVX2; oneDNN emulates bf16 there, a
   512 x 2048 x 8192 product took 84 s), the chunks are widened to float32 for MKL's GEMM:
   ~120 GFLOP/s on 2 Zen 3 cores against the AVX2 kernels' ~90 (16384x2048 int4 at 512 rows
   381 -> 293 ms, 2048x8192 189 -> 138 ms; int8 2048x8192 at 256 rows 93 -> 69 ms).

Why the torch ops and not torchao: the codes and scales must be the file's own (torchao's
weight-only configs re-derive them from floats), and the two CPU ops are all we need; torchao is
the field's home for the CUDA variants, whose torch ops we call the same way.

Bounds (tests/test_quant.py checks them):
- packing int4: s and z rounded to bf16 (relative error <= 2^-8 each), so per weight
  |w_packed - w| <= 2^-8 * (8 |s| + |z|) + rounding of z's own value, <= 2^-8 * (8|s| + |z|) * (1 + 2^-8);
- re-quantizing to int8 per channel: |w_packed - w| <= s_row / 2 with s_row = max|w_row| / 127 (plus
  the bf16 rounding of s_row, 2^-8 relative, times 127);
- a quantized linear against a float64 matmul of the packed weights: activations rounded to bf16
  (2^-8 relative each), float32 sums (K 2^-24 relative) and the output rounded to bf16:
  |y - y64| <= (2^-8 (1 + 2^-8) + K 2^-23) (|x| @ |w|.T) + 2^-8 |y64|; through `dense` each
  weight is rounded to bf16 too (another 2^-8 of |w|): twice the first term.
"""

from __future__ import annotations

import contextlib
import contextvars
import fcntl
import functools
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hpipe import cpu_kernels
from hpipe.errors import HpipeError

__all__ = ["WeightFormat", "one_gguf_name_map", "Affine", "read_gguf_tensor", "quantize_int4", "quantize_int8", "quantize_int8_blocks", "pack", "RowPaths",
           "ROW_PATHS", "row_paths", "DenseGemm", "DENSE", "dense_gemm", "DENSE_PROMPT", "gemm_rows", "path_switches", "BLOCKED", "cpu_int4_layout", "pack_blocked", "unpack_blocked",
           "torch_packs_blocked", "vnni_kernel", "kernels_on", "stage_weights", "scales_shape", "blocked_scales", "flat_scales",
           "super_pairs", "row_scaled",
           "packed_bytes", "STACKED", "stacked_groups", "stack_rows", "int4_scales", "int8_weight"]

PACK_VERSION = 9        # the packed cache's layout: a new one never reads an old one (3: stacked linears,
                        # 4: int4 scales in blocks of 64 outputs for the VNNI kernel, 5: and no zeros
                        # for a symmetric weight there, 6: and Q8_0's own block scales, 7: and Q4_K's
                        # super-blocks, 8: a symmetric weight's float16 scales, 9: 5- and 6-bit blocks
                        # as int8 blocks of 32 there)
INT4_GROUPS = (32, 64, 128, 256)        # what torch's int4 weight-only kernels accept
INT4_N_MULTIPLE = 16                    # the CPU packing wants output rows in multiples of 16


@dataclass(frozen=True)
class DenseGemm:
    """How a CPU runs many-row linears: weights dequantized to bf16 `chunk_bytes` at a time, widened
    to `dtype` and multiplied by its GEMM, from `from_rows[kind]` rows on (int4, int8). Under
    --deterministic, rows padded to a multiple of `tile`, and with `tile_calls` each GEMM call
    taking exactly `tile` of them (`WeightOnly._dense_tiled`): what gives a row the same bits for
    any row count."""
    dtype: str
    chunk_bytes: int
    from_rows: dict
    tile: int
    tile_calls: bool


# Measured on 2 cores (the module's docstring). bf16 units: int4 breaks even at 128 rows (dequantizing
# one code costs what ~120 rows of the kernel's arithmetic on it cost), int8 at ~32; its chunk stays in
# L2 while multiplied. float32 (AVX2): both break even between 128 and 256 rows, and the GEMM wants
# wider chunks (16384x2048 at 512 rows: 338 ms with chunks of 1 MB, 293 with 4 MB, 434 with 16 MB).
# The tiles (--deterministic): oneDNN's bf16 GEMM picks its kernel and blocking by the row count: on
# an AMX Xeon (2026-12-01) a row got other bits among 33-63 rows than alone, and among 256+ rows than
# among 64, padded or not; in calls of a fixed count (64, 128 or 256) every row got the same bits at
# any place among 1 to 1,024 rows. 128: a deterministic stage's 512-token prefill there took 1.45x
# the time of the GEMM's own calls in calls of 64, 1.17x in 128, 1.05x in 256, but a 272-token one
# 1.49x in 256 (its padding). MKL's float32 GEMM gives a row the same bits in one call of any multiple
# of 16 rows (as `invariant.RowTiledLinear`'s; SmolLM2's shapes, 16-1,024 rows, 1 and 2 threads, an
# AVX2 EPYC, 2026-12-02): the default model's deterministic launch of 8 prompts took 0.73x the time
# of calls of exactly 128 rows.
DENSE = {"bf16": DenseGemm("bfloat16", 1 << 20, {"int4": 192, "int8": 64}, tile=128, tile_calls=True),
         "float32": DenseGemm("float32", 4 << 20, {"int4": 192, "int8": 192}, tile=16, tile_calls=False)}
# --deterministic: a row's path is fixed by its own request, never by how many rows share the call
# (each path alone gives a row the same bits for any number of rows, the GEMM tiled as its
# `DenseGemm` says; the two paths round apart).
# Prompt rows of prompts this long take the dense GEMM, every other row the weight-only kernel.
DENSE_PROMPT = max(r for d in DENSE.values() for r in d.from_rows.values())


@dataclass(frozen=True)
class RowPaths:
    """Which rows of the current linear calls take the dense GEMM (`dense`) and which the weight-only
    kernel (`kernel`): index tensors, None for none. Set for a micro-batch by a deterministic stage."""

    dense: "torch.Tensor | None"
    kernel: "torch.Tensor | None"

    @classmethod
    def of(cls, dense_rows: list[bool], device) -> "RowPaths":
        import torch

        rows = torch.tensor(dense_rows, dtype=torch.bool)
        pick = lambda m: m.nonzero().flatten().to(device) if bool(m.any()) else None   # noqa: E731
        return cls(pick(rows), pick(~rows))


ROW_PATHS: contextvars.ContextVar[RowPaths | None] = contextvars.ContextVar("hpipe_row_paths", default=None)


@contextlib.contextmanager
def row_paths(paths: RowPaths | None):
    """The rows' paths for the linear calls made inside (None: chosen by the call's row count)."""
    token = ROW_PATHS.set(paths)
    try:
        yield
    finally:
        ROW_PATHS.reset(token)


def gemm_rows(x2, b, tile: int | None):
    """x2 @ b, or with `tile`, in calls of exactly `tile` rows of x2 (`WeightOnly._dense_tiled`: x2's
    rows a multiple of it)."""
    import torch

    if tile is None:
        return x2 @ b
    out = x2.new_empty(x2.shape[0], b.shape[1])
    for a in range(0, x2.shape[0], tile):
        torch.matmul(x2[a:a + tile], b, out=out[a:a + tile])
    return out


# --------------------------------------------------------------------------------------------
# What the user asks for


@dataclass(frozen=True)
class WeightFormat:
    """`none` (the plan's dtype, dense), `gguf` (a GGUF file's own blocks), `int8` (per channel) or
    `int4:G` (groups of G along the input dimension, asymmetric)."""
    kind: str = "none"
    group: int = 0

    @classmethod
    def parse(cls, text: str, where: str = "--quantize") -> "WeightFormat":
        kind, _, group = text.strip().lower().partition(":")
        if kind in ("none", "gguf", "int8") and not group:
            return cls(kind)
        if kind == "int4":
            g = int(group) if group.isdigit() else (32 if not group else -1)
            if g in INT4_GROUPS:
                return cls("int4", g)
            raise HpipeError(f"{where} {text!r}: int4 groups are {', '.join(map(str, INT4_GROUPS))} "
                             f"(e.g. int4:32)")
        raise HpipeError(f"{where} {text!r}: use none, gguf (a .gguf file's own blocks), int8 or int4[:group]")

    def __str__(self) -> str:
        return f"int4:{self.group}" if self.kind == "int4" else self.kind

    @property
    def quantized(self) -> bool:
        return self.kind != "none"


NONE = WeightFormat()


def default_format(model_is_gguf: bool) -> WeightFormat:
    """A GGUF file runs in its own blocks; a float checkpoint as it is unless asked."""
    return WeightFormat("gguf") if model_is_gguf else NONE


def kernels_on(device: str) -> tuple[bool, str]:
    """Whether `device` runs the weight-only kernels, and a line that says which (or why not)."""
    import torch

    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            return False, "no CUDA here"
        major, minor = torch.cuda.get_device_capability(torch.device(device))
        if major >= 8:
            return True, f"int4/int8 weight-only (tinygemm), bf16 activations, sm{major}{minor}"
        return False, f"sm{major}{minor} has no int4 kernel (needs sm80+): dense float16"
    cap = torch.backends.cpu.get_cpu_capability()
    if cap in ("AVX2", "AVX512"):
        return True, f"{cpu_kernels.kernels()[1]} ({cap}{_bf16_note()})"
    return False, f"CPU capability {cap}: no vectorized int4/int8 kernel, dense float32"


def _bf16_note() -> str:
    flags = cpu_kernels.cpu_flags()
    units = [name for flag, name in (("amx_bf16", "AMX-BF16"), ("avx512_bf16", "AVX512-BF16")) if flag in flags]
    if not units:
        return ", bf16 emulated"
    gemm = dense_gemm("cpu")
    if gemm is None:
        return f", {'/'.join(units)}"
    return f", {'/'.join(units)}; from {gemm.from_rows['int8']}/{gemm.from_rows['int4']} rows (int8/int4) " \
           f"{gemm.dtype} GEMMs on weights dequantized in chunks"


@functools.cache
def dense_gemm(device_type: str) -> DenseGemm | None:
    """How many-row linears on `device_type` run (None: through the weight-only kernels at any
    count): on a CPU whose int4 packing is the blocked layout `Int4Linear.dense` reads, bf16 GEMMs
    with bf16 matrix units, float32 GEMMs without them where hpipe's kernels run (torch's bf16 GEMM
    is emulated there, ~700x slower)."""
    if device_type != "cpu" or cpu_int4_layout() != BLOCKED:
        return None
    if {"amx_bf16", "avx512_bf16"} & cpu_kernels.cpu_flags():
        return DENSE["bf16"]
    return DENSE["float32"] if cpu_kernels.kernels()[0] is not None else None


BLOCKED = "blocked64"


@functools.cache
def cpu_int4_layout() -> str:
    """How this process packs int4 codes on the CPU: `BLOCKED` ([N/64, K, 32] bytes, the low nibble
    row j and the high nibble row j + 32 of each block of 64 rows), what the kernels of
    `hpipe.cpu_kernels` read and `pack_blocked` writes, and torch's own packing on an AVX512 build;
    or, where neither kernels nor that packing are here, torch's other packing (its AVX2 build
    packs blocks of 32 rows), named by torch's CPU capability. The packed cache keeps them apart."""
    if cpu_kernels.kernels()[0] is not None or torch_packs_blocked():
        return BLOCKED
    import torch

    return f"torch-{torch.backends.cpu.get_cpu_capability().lower()}"


def pack_blocked(u: "torch.Tensor") -> "torch.Tensor":
    """int4 codes [N, K] (N whole blocks of 64) -> the `BLOCKED` layout's bytes, [N / 64, K, 32] held
    as [N, K / 2] uint8 (the shape of torch's packing)."""
    import torch

    n, k = u.shape
    halves = u.to(torch.uint8).view(n // 64, 2, 32, k)
    return (halves[:, 0] | halves[:, 1] << 4).transpose(1, 2).contiguous().view(n, k // 2)


def unpack_blocked(packed: "torch.Tensor") -> "torch.Tensor":
    """`pack_blocked`'s inverse: [N, K / 2] uint8 -> int32 codes [N, K]."""
    import torch

    n, k = packed.shape[0], packed.shape[1] * 2
    blocks = packed.view(n // 64, k, 32)
    return torch.stack([blocks & 15, blocks >> 4], 1).transpose(2, 3).reshape(n, k).to(torch.int32)


@functools.cache
def torch_packs_blocked() -> bool:
    """Whether torch's own CPU int4 packing is `BLOCKED` (its AVX512 build). Checked, not assumed."""
    import torch

    codes = torch.randint(0, 16, (128, 64), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    return torch.equal(unpack_blocked(torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)), codes)


def vnni_kernel(device_type: str, kind: str, shape: tuple[int, int]) -> bool:
    """Whether a `kind` ('int4' or 'int8') linear of `shape` [N, K] on `device_type` runs the VNNI
    kernels of `hpipe.cpu_kernels` (16-bit activations per block of 32, integer dot products) on the
    codes as `pack` packs them for it (int4: the `BLOCKED` layout, whole blocks of 64 outputs, whose
    scales and zeros `pack` keeps in the same blocks); their ops registered on the way."""
    n, k = shape
    if device_type != "cpu" or k % 32 or cpu_kernels.kernels()[0] is None or \
            (kind == "int4" and n % 64):
        return False
    cpu_kernels.ops()
    return True


def blocked_scales(sz: "torch.Tensor") -> "torch.Tensor":
    """[K / G, N, w] -> [N / 64, K / G, 64, w] (w: 2, (s, z), or 1, s alone)."""
    groups, n, w = sz.shape
    return sz.view(groups, n // 64, 64, w).permute(1, 0, 2, 3).contiguous()


def flat_scales(sz: "torch.Tensor") -> "torch.Tensor":
    """[N / 64, K / G, 64, w] (or Q4_K's super-blocks) -> bf16 [K / G, N, 2] (torch's ops' order and
    dtype; they always take zeros)."""
    import torch

    return flat_pairs(sz).to(torch.bfloat16).contiguous()


def flat_pairs(sz: "torch.Tensor") -> "torch.Tensor":
    """The VNNI kernel's scales (any form) -> [K / G, N, 2] (s, z), in their own precision."""
    import torch

    sz = super_pairs(sz) if sz.dtype == torch.uint8 else sz
    blocks, groups, _, w = sz.shape
    sz = sz.permute(1, 0, 2, 3).reshape(groups, blocks * 64, w)
    return sz if w == 2 else with_zeros(sz)


def super_blocks(f: SuperBlocks) -> "torch.Tensor":
    """Q4_K's factors -> uint8 [N / 64, K / 256, 1280] in blocks of 64 outputs: float16 d [64] and
    dmin [64], then for each group of 32 inputs uint8 sc [64] and mn [64] (vnni.c's SUPER form, in
    the order the kernel reads it; 4.625 bits a weight)."""
    import torch

    n, supers = f.d.shape
    nb = n // 64

    def by_block(a, dtype, per):                                   # [N, S * per] -> [NB, S, per * 64 bytes]
        a = a.astype(dtype).reshape(nb, 64, supers, per).transpose(0, 2, 3, 1)
        return np.ascontiguousarray(a).view(np.uint8).reshape(nb, supers, -1)

    sc_mn = np.stack([by_block(f.sc, np.uint8, 8), by_block(f.mn, np.uint8, 8)], axis=-2)  # [NB, S, 2, 512]
    sc_mn = sc_mn.reshape(nb, supers, 2, 8, 64).transpose(0, 1, 3, 2, 4).reshape(nb, supers, -1)
    return torch.from_numpy(np.concatenate([by_block(f.d, np.float16, 1), by_block(f.dmin, np.float16, 1), sc_mn],
                                           axis=-1))


def super_pairs(sz: "torch.Tensor", rows: "torch.Tensor | None" = None) -> "torch.Tensor":
    """Q4_K's super-blocks (`super_blocks`) -> float32 (s, z) [N / 64, K / 32, 64, 2], s = d sc and
    z = 8 s - dmin mn as the kernel computes them; or, for output `rows` [T], [T, K / 32, 2] (only
    their blocks converted: an embedding's lookups)."""
    import torch

    if rows is not None:
        t, j = torch.arange(rows.shape[0], device=rows.device), rows % 64
        blocks = sz[rows // 64]                                                   # [T, S, 1280] bytes
        d_dmin = blocks[..., :256].contiguous().view(torch.float16)[t, :, torch.stack([j, 64 + j])]   # [2, T, S]
        d, dmin = d_dmin.float().unsqueeze(-1).unbind(0)                                          # [T, S, 1]
        sc, mn = blocks[..., 256:].unflatten(-1, (8, 2, 64))[t, :, :, :, j].float().unbind(-1)     # [T, S, 8]
        s = (d * sc).flatten(-2)
        return torch.stack([s, 8 * s - (dmin * mn).flatten(-2)], -1)
    nb, supers, _ = sz.shape
    d, dmin = (sz[..., a:a + 128].contiguous().view(torch.float16).float() for a in (0, 128))   # [NB, S, 64]
    sc, mn = sz[..., 256:].reshape(nb, supers, 8, 2, 64).float().unbind(-2)                     # [NB, S, 8, 64]
    s = (d[:, :, None] * sc).reshape(nb, supers * 8, 64)
    z = 8 * s - (dmin[:, :, None] * mn).reshape(nb, supers * 8, 64)
    return torch.stack([s, z], -1)


def scales_shape(sz: "torch.Tensor") -> tuple[bool, int, int]:
    """(in the VNNI kernel's blocks of 64 outputs, outputs N, input groups K / G) of int4 scales in
    any of their forms: torch's [K / G, N, 2], the kernel's [N / 64, K / G, 64, 2 or 1], or Q4_K's
    super-blocks [N / 64, K / 256, 1280] (groups of 32)."""
    import torch

    if sz.dtype == torch.uint8:
        return True, sz.shape[0] * 64, sz.shape[1] * 8
    if sz.dim() == 4:
        return True, sz.shape[0] * 64, sz.shape[1]
    return False, sz.shape[1], sz.shape[0]


def with_zeros(s: "torch.Tensor") -> "torch.Tensor":
    """[..., 1] scales of a symmetric weight -> [..., 2] (s, 0)."""
    import torch

    return torch.cat([s, torch.zeros_like(s)], -1)


def int8_weight(tensors: dict) -> np.ndarray:
    """The float64 [N, K] weight packed int8 tensors stand for: codes times their row or block scales."""
    codes, scales = tensors["int8"].double().cpu().numpy(), tensors["scales"].double().cpu().numpy()
    return codes * (np.repeat(scales, 32, axis=1) if scales.ndim == 2 else scales[:, None])


def row_scaled(weight: "torch.Tensor", scales: "torch.Tensor") -> tuple["torch.Tensor", "torch.Tensor"]:
    """int8 codes with float16 block scales [N, K / 32] -> quantized again per row (int8, bf16 [N]),
    what torch's ops take (a copy: a cache packed for the VNNI kernel read by a process without it)."""
    import torch

    q, scale = quantize_int8(int8_weight({"int8": weight, "scales": scales}).astype(np.float32))
    return torch.from_numpy(q).to(weight.device), torch.from_numpy(scale).to(torch.bfloat16).to(weight.device)


def int4_scales(tensors: dict) -> tuple[np.ndarray, np.ndarray]:
    """(s, z) float64 [N, K / G] of packed int4 tensors, in whichever order they are kept (z = 0 where
    a symmetric weight keeps none)."""
    import torch

    sz = tensors["scales_zeros"].cpu()
    if sz.dim() == 4 or sz.dtype == torch.uint8:    # the VNNI kernel's forms, exactly as it reads them
        sz = flat_pairs(sz)
    sz = sz.double().numpy()
    return sz[..., 0].T, sz[..., 1].T


def stage_weights(fmt: WeightFormat, device: str) -> WeightFormat:
    """The format a stage on `device` runs: the asked one where the device has kernels, else dense."""
    return fmt if fmt.quantized and kernels_on(device)[0] else NONE


def path_switches(fmt: WeightFormat, device: str) -> tuple[int, ...]:
    """The row counts from which a stage's quantized linears on `device` take the dense GEMM
    instead of the kernel: its time per row steps there, so a profile measures both sides."""
    gemm = dense_gemm(device.split(":")[0])
    if not stage_weights(fmt, device).quantized or gemm is None:
        return ()
    kinds = ("int4", "int8") if fmt.kind == "gguf" else (fmt.kind,)
    return tuple(sorted({gemm.from_rows[k] for k in kinds}))


def planned(fmt: "WeightFormat | str", host: str, device: str) -> str:
    """The format a plan records for a stage: resolved by capability for this machine's devices
    (host 'local'), as asked elsewhere (that stage resolves it when it starts and reports it)."""
    fmt = WeightFormat.parse(fmt, where="weights") if isinstance(fmt, str) else fmt
    return str(stage_weights(fmt, device)) if host in ("local", "localhost") else str(fmt)


# --------------------------------------------------------------------------------------------
# Step 1: read. Codes and per-group scale/offset, w = scale * code + offset.


@dataclass
class SuperBlocks:
    """Q4_K's factoring of its scales, per super-block of 256 inputs (8 groups of 32): scale = d sc,
    offset = -dmin mn, every product exact in float32."""
    d: np.ndarray            # float32 (float16 values) [N, K // 256]
    dmin: np.ndarray         # float32 (float16 values) [N, K // 256]
    sc: np.ndarray           # uint8 (6-bit) [N, K // 32]
    mn: np.ndarray           # uint8 (6-bit) [N, K // 32]

    def rows(self, index: np.ndarray) -> "SuperBlocks":
        return SuperBlocks(self.d[index], self.dmin[index], self.sc[index], self.mn[index])

    @staticmethod
    def stacked(parts: list["SuperBlocks"]) -> "SuperBlocks":
        return SuperBlocks(*(np.concatenate([getattr(p, f) for p in parts]) for f in ("d", "dmin", "sc", "mn")))


@dataclass
class Affine:
    codes: np.ndarray        # int8 or uint8 [N, K]
    scale: np.ndarray        # float32 [N, K // group]
    offset: np.ndarray | None  # float32 [N, K // group], or None (symmetric)
    group: int
    bits: int                # 4, 5, 6 or 8: which kernel fits
    superblocks: SuperBlocks | None = None   # Q4_K's factors of scale and offset

    def dequantize(self) -> np.ndarray:
        """float32 [N, K], the same arithmetic as the gguf package (scale * code, then + offset)."""
        n, k = self.codes.shape
        c = self.codes.astype(np.float32).reshape(n, k // self.group, self.group)
        w = self.scale[:, :, None] * c
        if self.offset is not None:
            w = w + self.offset[:, :, None]
        return w.reshape(n, k)

    def rows(self, index: np.ndarray) -> "Affine":
        """Reordered output rows (GGUF stores Llama's q/k rows permuted for its RoPE layout)."""
        return Affine(self.codes[index], self.scale[index], None if self.offset is None else self.offset[index],
                      self.group, self.bits, None if self.superblocks is None else self.superblocks.rows(index))


# Linears of one module that read the same input, stacked by rows into one matrix: one kernel call
# instead of three (attention's q, k, v) or two (a gated MLP's gate and up). The weight-only kernels
# read a larger matrix faster (SmolLM2's 30 blocks at 2 threads: 2.88 -> 2.59 ms a decode step, the
# 1B shape's 16: 16.6 -> 14.8), and a compiled block gathers fewer tensors.
STACKED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def stacked_groups(module) -> list[tuple[str, tuple[str, ...]]]:
    """(path of the owning module within `module`, its linears' names) for every `STACKED` group
    found among `module`'s submodules, all of them plain `nn.Linear`s."""
    import torch

    return [(path, names) for path, m in module.named_modules() for names in STACKED
            if all(isinstance(getattr(m, n, None), torch.nn.Linear) for n in names)]


def stack_rows(parts: list) -> Affine | np.ndarray | None:
    """Weights stacked by output rows when they pack alike (float matrices, or codes of the same
    kind: bits, group, signedness, offsets or none), which `pack` then treats as one: every
    packing here is row by row, so the stack packs to the parts' own packings. None otherwise
    (a GGUF file that keeps v in 6 bits and q, k in 4 packs them apart)."""
    if all(isinstance(p, np.ndarray) for p in parts):
        return np.concatenate(parts) if len({p.shape[1] for p in parts}) == 1 else None
    if not all(isinstance(p, Affine) for p in parts):
        return None
    kinds = {(p.codes.shape[1], p.codes.dtype, p.group, p.bits, p.offset is None, p.superblocks is None)
             for p in parts}
    if len(kinds) != 1:
        return None
    a = parts[0]
    return Affine(np.concatenate([p.codes for p in parts]), np.concatenate([p.scale for p in parts]),
                  None if a.offset is None else np.concatenate([p.offset for p in parts]), a.group, a.bits,
                  None if a.superblocks is None else SuperBlocks.stacked([p.superblocks for p in parts]))


def _f16(b: np.ndarray) -> np.ndarray:
    return b.copy().view(np.float16).astype(np.float32)[..., 0]


def _nibbles_32(qs: np.ndarray) -> np.ndarray:
    """16 bytes -> 32 codes: element j < 16 is byte j's low nibble, element j + 16 its high one."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _q4_0(blocks):             # d f16, 16 bytes of nibbles: w = d (q - 8)
    d = _f16(blocks[:, :, 0:2])
    q = _nibbles_32(blocks[:, :, 2:18]).astype(np.int8) - 8
    return q, d, None, 32, 4


def _q4_1(blocks):             # d f16, m f16, 16 bytes of nibbles: w = d q + m
    d, m = _f16(blocks[:, :, 0:2]), _f16(blocks[:, :, 2:4])
    return _nibbles_32(blocks[:, :, 4:20]), d, m, 32, 4


def _q8_0(blocks):             # d f16, 32 int8: w = d q
    return blocks[:, :, 2:34].copy().view(np.int8), _f16(blocks[:, :, 0:2]), None, 32, 8


def _k_scales(packed: np.ndarray):
    """Q4_K's 12 bytes -> 8 six-bit scales and 8 six-bit minimums (llama.cpp get_scale_min_k4)."""
    a, b, c = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 2) & 0x30)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _q4_k(blocks):             # super-block of 256 = 8 groups of 32: w = (d sc) q - (dmin m)
    d, dmin = _f16(blocks[:, :, 0:2]), _f16(blocks[:, :, 2:4])
    sc, mn = _k_scales(blocks[:, :, 4:16])
    qs = blocks[:, :, 16:144].reshape(*blocks.shape[:2], 4, 32)    # 4 chunks of 32 bytes: 64 codes each
    q = np.stack([qs & 0x0F, qs >> 4], axis=3).reshape(*blocks.shape[:2], 256)
    n = blocks.shape[0]
    scale = (d[..., None] * sc).reshape(n, -1)
    offset = -(dmin[..., None] * mn).reshape(n, -1)
    return q, scale, offset, 32, 4, SuperBlocks(d, dmin, sc.reshape(n, -1).astype(np.uint8),
                                                mn.reshape(n, -1).astype(np.uint8))


def _q6_k(blocks):             # super-block of 256 = 16 groups of 16: w = (d sc) (q - 32), 6-bit q
    ql, qh = blocks[:, :, 0:128], blocks[:, :, 128:192]
    sc = blocks[:, :, 192:208].copy().view(np.int8).astype(np.float32)
    d = _f16(blocks[:, :, 208:210])
    n, nb = blocks.shape[:2]
    low = np.stack([ql.reshape(n, nb, 2, 64) & 0x0F, ql.reshape(n, nb, 2, 64) >> 4], axis=3)     # [.,.,2,2,64]
    high = np.stack([(qh.reshape(n, nb, 2, 32) >> s) & 0x03 for s in (0, 2, 4, 6)], axis=3)       # [.,.,2,4,32]
    q = (low.reshape(n, nb, 2, 4, 32) | (high << 4)).astype(np.int8) - 32
    return q.reshape(n, nb, 256), (d[..., None] * sc).reshape(n, -1), None, 16, 6


# ggml type id -> (name, block elements, block bytes, decoder); floats are dense
_BLOCKS = {2: ("Q4_0", 32, 18, _q4_0), 3: ("Q4_1", 32, 20, _q4_1), 8: ("Q8_0", 32, 34, _q8_0),
           12: ("Q4_K", 256, 144, _q4_k), 14: ("Q6_K", 256, 210, _q6_k)}
_FLOATS = {0: "F32", 1: "F16", 30: "BF16"}


def read_gguf_tensor(tensor) -> Affine | np.ndarray:
    """A `gguf.GGUFReader` tensor -> `Affine` (block types), or float32 [N, K] (float types and block
    types without a reader here, through the gguf package's own dequantization, re-quantized later)."""
    ttype = int(tensor.tensor_type)
    data = np.asarray(tensor.data)
    data = data.reshape(-1, data.shape[-1])        # a 3D tensor (a block's experts): their rows one after another
    if ttype in _FLOATS:
        if ttype == 30:
            bits = np.ascontiguousarray(data).view(np.uint16)          # stored as bytes or as uint16
            return (bits.astype(np.uint32) << 16).view(np.float32).reshape(data.shape[0], -1)
        return data.astype(np.float32)
    if ttype not in _BLOCKS:
        from gguf.quants import dequantize

        return dequantize(data, tensor.tensor_type).astype(np.float32)
    _, _, nbytes, decode = _BLOCKS[ttype]
    n = data.shape[0]
    blocks = data.reshape(n, -1, nbytes)
    codes, scale, offset, group, bits, *superblocks = decode(blocks)
    return Affine(codes.reshape(n, -1), scale.reshape(n, -1).astype(np.float32),
                  None if offset is None else offset.reshape(n, -1).astype(np.float32), group, bits,
                  *superblocks)


def quantize_int4(w: np.ndarray, group: int) -> Affine:
    """Asymmetric min/max per group of `group` inputs (as gpt-fast and torchao's int4 weight-only):
    code in [0, 15], w ~ scale * code + min."""
    n, k = w.shape
    g = w.reshape(n, k // group, group).astype(np.float32)
    lo, hi = g.min(-1), g.max(-1)
    scale = np.maximum(hi - lo, 1e-12) / 15
    codes = np.clip(np.rint((g - lo[..., None]) / scale[..., None]), 0, 15).astype(np.uint8)
    return Affine(codes.reshape(n, k), scale.astype(np.float32), lo.astype(np.float32), group, 4)


def quantize_int8_blocks(w: np.ndarray, block: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric per block of `block` inputs, as Q8_0 is: (int8 [N, K], float32 scales [N, K // block])."""
    n, k = w.shape
    b = w.reshape(n, k // block, block)
    amax = np.abs(b).max(axis=2)
    scale = np.where(amax > 0, amax / 127, 1.0).astype(np.float32)
    return np.clip(np.rint(b / scale[:, :, None]), -127, 127).astype(np.int8).reshape(n, k), scale


def quantize_int8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric per output channel: (int8 [N, K], float32 scales [N]), one block a row."""
    q, scale = quantize_int8_blocks(w, w.shape[1])
    return q, scale[:, 0]


# --------------------------------------------------------------------------------------------
# Step 2: pack into a kernel's layout (plain tensors: cached on disk, mapped back read-only)


def int4_fits(shape: tuple[int, int], group: int) -> bool:
    n, k = shape
    return group in INT4_GROUPS and k % group == 0 and n % INT4_N_MULTIPLE == 0


def int4_rows_gatherable(n: int, device_type: str) -> bool:
    """Whether an embedding can look its rows up in the int4 packing of an [n, K] table (and so
    share it with a tied head): CUDA's two codes per byte always, the CPU's blocked layout when
    the table is whole blocks of 64 rows."""
    return device_type == "cuda" or (n % 64 == 0 and cpu_int4_layout() == BLOCKED)


def pack(weight: Affine | np.ndarray, fmt: WeightFormat, device_type: str = "cpu",
         as_embedding: bool = False) -> dict[str, "torch.Tensor"]:
    """One weight -> the plain tensors its module holds (what the disk cache stores):
    int4: {'int4': packed, 'scales_zeros': bf16 [K / group, N, 2], or [N / 64, K / group, 64, 2] where
    the VNNI kernel runs it (`vnni_kernel`): a block's stream one contiguous run, and there [..., 1],
    s alone in float16, for a symmetric weight (Q4_0: the file's 4.5 bits a weight, its own d), or Q4_K's super-blocks as the
    file factors them (`super_blocks`, uint8, 4.625 bits)}, packed in the CPU kernel's own
    layout (mapped straight back next time), or for CUDA two codes per byte (the GPU packs them);
    int8: {'int8': int8 [N, K], 'scales': bf16 [N]}, or where the VNNI kernel runs a GGUF file's
    8-bit blocks (Q8_0) their own codes and float16 scales, 'scales' [N, K / 32]: the file's weights
    exactly, not rounded again to a step per row.
    An embedding table (`as_embedding`) stays in the file's 4-bit groups where its rows can be
    gathered from the packing (`int4_rows_gatherable`), so that a head tied to it runs the int4
    kernel on the file's own codes (a 1B model's 49152 x 2048 head: 1.5 ms a step against int8's
    3.4 here, and half the bytes); a float table, or one of another type, goes to int8 rows."""
    import torch

    if fmt.kind == "int8" and isinstance(weight, Affine):
        weight = weight.dequantize()                  # every matrix int8 per row, asked for
    if fmt.kind == "int4" and isinstance(weight, Affine) and not (weight.bits == 4 and weight.group == fmt.group):
        weight = weight.dequantize()                  # other blocks: quantized again to groups of G
    if isinstance(weight, np.ndarray) and fmt.kind == "int4" and not as_embedding and \
            int4_fits(weight.shape, fmt.group):
        weight = quantize_int4(weight, fmt.group)
    if isinstance(weight, Affine) and weight.bits == 4 and int4_fits(weight.codes.shape, weight.group) and \
            (not as_embedding or int4_rows_gatherable(weight.codes.shape[0], device_type)):
        signed = weight.codes.dtype == np.int8                      # Q4_0: codes in [-8, 7]
        u = torch.from_numpy(weight.codes.astype(np.int32) + (8 if signed else 0))
        s = weight.scale
        z = (weight.offset if weight.offset is not None else np.zeros_like(s)) + (0 if signed else 8 * s)
        vnni = vnni_kernel(device_type, "int4", tuple(u.shape))
        if vnni and weight.superblocks is not None and u.shape[1] % 256 == 0:    # Q4_K as the file factors it
            sz = super_blocks(weight.superblocks)
        elif vnni and signed and weight.offset is None:   # symmetric (Q4_0): z = 0 not kept, s its float16 d
            sz = blocked_scales(torch.from_numpy(np.ascontiguousarray(s.T[..., None])).to(torch.float16))
        else:                                             # (s, z) pairs; in the kernel's blocks of 64 there
            sz = torch.from_numpy(np.ascontiguousarray(np.stack([s.T, z.T], axis=-1))).to(torch.bfloat16)
            sz = blocked_scales(sz) if vnni else sz
        if device_type == "cuda":
            packed = (u[:, ::2] << 4 | u[:, 1::2]).to(torch.uint8)
        elif cpu_int4_layout() == BLOCKED and u.shape[0] % 64 == 0:
            packed = pack_blocked(u)
        else:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(u, 1)
        return {"int4": packed, "scales_zeros": sz}
    if isinstance(weight, Affine) and weight.bits == 8 and weight.group == 32 and weight.offset is None and \
            vnni_kernel(device_type, "int8", tuple(weight.codes.shape)):
        return {"int8": torch.from_numpy(weight.codes), "scales": torch.from_numpy(weight.scale.astype(np.float16))}
    if isinstance(weight, Affine) and weight.bits in (5, 6) and \
            vnni_kernel(device_type, "int8", tuple(weight.codes.shape)):
        # a file's 5- and 6-bit blocks (Q5_*, Q6_K) as Q8_0 runs, int8 blocks of 32 with float16 scales:
        # a step of max|w| / 127 a block, where one a row cost the MoE shape's Q6_K head and down
        # projections KL 7.8e-5 against llama.cpp's 6.6e-5 on the same tokens (0.5 bits a weight more)
        q, scale = quantize_int8_blocks(weight.dequantize())
        return {"int8": torch.from_numpy(q), "scales": torch.from_numpy(scale.astype(np.float16))}
    dense = weight.dequantize() if isinstance(weight, Affine) else weight
    q, scale = quantize_int8(dense)
    return {"int8": torch.from_numpy(q), "scales": torch.from_numpy(scale).to(torch.bfloat16)}


def packed_bytes(n: int, k: int, fmt: WeightFormat, int8_rows: bool = False) -> int:
    """Resident bytes of one [N, K] weight once packed (the memory model's unit bytes). A GGUF
    file's block matrices are counted as 4-bit groups of 32 (its 6- and 8-bit ones pack as int8);
    `int8_rows`: an embedding table (and a head tied to it), counted as int8 rows, the most it
    takes (a 4-bit table of whole 64-row blocks keeps its 4 bits, see `pack`; a Q8_0 one its float16
    scale per block of 32)."""
    group = fmt.group if fmt.kind == "int4" else 32
    if fmt.kind in ("int4", "gguf") and not int8_rows and int4_fits((n, k), group):
        return n * k // 2 + 4 * n * (k // group)
    return n * k + 2 * n * (max(1, k // 32) if fmt.kind == "gguf" else 1)


# --------------------------------------------------------------------------------------------
# Where the weights come from: a GGUF file's tensors by transformers' parameter names


def gguf_architecture(reader) -> str:
    """A `gguf.GGUFReader`'s `general.architecture` (llama.cpp's name: `llama`, `qwen3moe`, ...)."""
    return str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")


@contextlib.contextmanager
def one_gguf_name_map():
    """transformers' `get_gguf_hf_weights_map` builds llama.cpp's name map of every block again for
    each module it recurses into (397 maps for SmolLM2's 30 blocks, 5.4 s of CPU on a 2-core EPYC,
    in each stage packing its weights the first time, and in a conversion to float32); within this
    context one map per (architecture, blocks) serves them all (the map is only read)."""
    import gguf

    build = gguf.get_tensor_name_map
    gguf.get_tensor_name_map = functools.cache(build)
    try:
        yield
    finally:
        gguf.get_tensor_name_map = build


class GGUFTensors:
    """A GGUF file's tensors under transformers' parameter names (the mapping is transformers' own,
    `get_gguf_hf_weights_map`, and so is the reordering of Llama's q/k rows)."""

    def __init__(self, path: Path, model):
        import gguf
        from transformers.modeling_gguf_pytorch_utils import (TENSOR_PROCESSORS, TensorProcessor,
                                                              get_gguf_hf_weights_map)

        self.path = path
        self.reader = gguf.GGUFReader(str(path))
        self.tensors = {t.name: t for t in self.reader.tensors}
        arch = gguf_architecture(self.reader)
        self.processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=model.config.to_dict())
        with one_gguf_name_map():
            self.to_gguf = {hf: g for g, hf in get_gguf_hf_weights_map(model, self.processor).items()}

    def name(self, hf_name: str) -> str | None:
        g = self.to_gguf.get(hf_name)
        return g if g in self.tensors else None

    def read_experts(self, block: int) -> tuple[list, list, list]:
        """Block `block`'s routed experts as the file keeps them (`ffn_{gate,up,down}_exps`: one tensor
        of all experts each): per expert, its gate, up and down matrices."""
        out = []
        for part in ("gate", "up", "down"):
            tensor = self.tensors.get(f"blk.{block}.ffn_{part}_exps.weight")
            if tensor is None:
                raise HpipeError(f"{self.path}: no tensor blk.{block}.ffn_{part}_exps.weight for block {block}'s experts")
            whole = read_gguf_tensor(tensor)
            n_experts = int(tensor.shape[-1])
            rows = (whole.codes if isinstance(whole, Affine) else whole).shape[0] // n_experts
            out.append([whole.rows(np.arange(e * rows, (e + 1) * rows)) if isinstance(whole, Affine)
                        else whole[e * rows:(e + 1) * rows] for e in range(n_experts)])
        return tuple(out)

    def read(self, hf_name: str):
        g = self.name(hf_name)
        tensor = self.tensors[g]
        out = read_gguf_tensor(tensor)
        rows = out.codes.shape[0] if isinstance(out, Affine) else out.shape[0]
        # transformers' processor reorders rows (Llama's q/k): apply its order, found on the indices
        order = self.processor.process(weights=np.arange(rows)[:, None], name=g).weights[:, 0]
        if not np.array_equal(order, np.arange(rows)):
            out = out.rows(order) if isinstance(out, Affine) else out[order]
        return out


# --------------------------------------------------------------------------------------------
# Cached packed units: built once per (model, format), mapped read-only after


def cached_unit(directory: Path, unit: int, build) -> dict:
    """The packed tensors of one unit from `directory/unit-<u>.pt`, built once by `build()` (a dict
    name -> tensor) under a lock. Later loads map the file read-only (`torch.load(mmap=True)`: a
    private mapping, so the page cache serves every process on the host); torch's format aligns
    each tensor to 64 bytes, as the kernels' vector loads want (safetensors' 8 are not enough)."""
    import torch

    path = directory / f"unit-{unit:04d}.pt"
    if not path.exists():
        directory.mkdir(parents=True, exist_ok=True)
        with open(directory / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not path.exists():
                tmp = path.with_suffix(f".tmp-{os.getpid()}")
                torch.save({k: v.contiguous() for k, v in build().items()}, tmp)
                os.replace(tmp, path)
    return torch.load(path, mmap=True, weights_only=True)
