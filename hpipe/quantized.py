"""The torch modules that run weights kept quantized (`hpipe.quant` reads and packs them): linears
through a weight-only kernel (`Int4Linear`, `Int8Linear`), the parts of linears stacked into one
(`LinearPart`), and embedding tables looked up in the same packings (`Int4Embedding`,
`Int8Embedding`). See `hpipe.quant`'s docstring for the kernels, the dense path and the bounds."""

from __future__ import annotations

import torch
from torch import nn

from hpipe import cpu_kernels, quant

__all__ = ["WeightOnly", "Int4Linear", "Int8Linear", "LinearPart", "Int4Embedding", "Int8Embedding", "QUANTIZED",
           "linear_module", "linear_parts", "embedding_module"]


class _Product:
    """What the parts of one stacked linear share: the input last multiplied and its slices."""
    x = None
    parts = None


class WeightOnly(nn.Module):
    """y = x W^T (+ b) through a weight-only kernel, chosen once for the device: x goes in as the
    kernel's activation dtype (bf16 for torch's; the VNNI kernels quantize float32 themselves)
    and y comes back in x's."""

    def __init__(self, in_features: int, out_features: int, bias):
        super().__init__()
        self.in_features, self.out_features, self.bias = in_features, out_features, bias

    def forward(self, x):
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        # a compiled decode step keeps the kernel: one graph serves every number of rows, with
        # no guard on the row count that a large batch would break mid-run to recompile
        # (a compiled step never runs deterministically; dynamo would bake the context in)
        paths = None if torch.compiler.is_compiling() else quant.ROW_PATHS.get()
        if paths is not None and self.dense_from != float("inf"):
            y = self._by_row(x2, paths).to(x.dtype)
        else:
            dense = not torch.compiler.is_compiling() and x2.shape[0] >= self.dense_from
            y = (self.dense(x2) if dense else self.mm(x2)).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)

    def _by_row(self, x2, paths: quant.RowPaths):
        if paths.kernel is None:
            return self._dense_tiled(x2)
        if paths.dense is None:
            return self.mm(x2)
        y = x2.new_empty(x2.shape[0], self.out_features)
        y[paths.dense] = self._dense_tiled(x2[paths.dense]).to(y.dtype)
        y[paths.kernel] = self.mm(x2[paths.kernel]).to(y.dtype)
        return y

    def _dense_tiled(self, x2):
        """`dense` on x2's rows padded once to a multiple of the GEMM's tile, in calls of exactly
        that many rows where its `tile_calls` says so (`quant.DenseGemm`)."""
        n, tile = x2.shape[0], self.gemm.tile
        if n % tile:
            x2 = torch.cat([x2, x2.new_zeros(-n % tile, x2.shape[1])])
        return self.dense(x2, tile if self.gemm.tile_calls else None)[:n]


class Int4Linear(WeightOnly):
    """W in int4 groups: on a CPU with AVX512-VNNI or AVX2 the 16-bit-activation kernel of
    `hpipe.cpu_kernels` (codes in the `BLOCKED` layout), else `_weight_int4pack_mm_for_cpu`;
    tinygemm's `_weight_int4pack_mm` on CUDA."""

    def __init__(self, packed, scales_zeros, bias=None):
        in_blocks, n, groups = quant.scales_shape(scales_zeros)
        super().__init__(packed.shape[1] * 2, n, bias)
        self.group = self.in_features // groups
        # the order the kernel reads (a cache packed for another kernel is put in it once, a copy)
        vnni = quant.vnni_kernel(packed.device.type, "int4", (self.out_features, self.in_features))
        if vnni != in_blocks:
            scales_zeros = quant.blocked_scales(scales_zeros) if vnni else quant.flat_scales(scales_zeros)
            if in_blocks and not packed.is_cuda and not quant.torch_packs_blocked():    # torch's own packing
                packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(quant.unpack_blocked(packed), 1)
        if packed.is_cuda:   # tinygemm's tiles: the widest inner-k tiling the input dimension allows
            tiles = next(t for t in (8, 4, 2) if self.in_features % (t * 16) == 0)
            packed = torch.ops.aten._convert_weight_to_int4pack(packed, tiles)
        self._kernel = torch.ops.aten._weight_int4pack_mm if packed.is_cuda else \
            torch.ops.aten._weight_int4pack_mm_for_cpu
        self.register_buffer("packed", packed, persistent=False)
        self.register_buffer("scales_zeros", scales_zeros, persistent=False)
        self.gemm = quant.dense_gemm(packed.device.type) if self.out_features % 64 == 0 else None
        self.dense_from = self.gemm.from_rows["int4"] if self.gemm else float("inf")
        self._dequantize = self._vnni_dequantize if vnni else self._torch_dequantize
        if vnni:
            self.mm = self._vnni_mm

    def _vnni_mm(self, x2):
        return torch.ops.hpipe.int4_mm(x2, self.packed, self.scales_zeros, self.group)

    def mm(self, x2):
        if x2.shape[0] == 0:    # tinygemm launches a grid of no blocks: CUDA's "invalid argument"
            return x2.new_empty(0, self.out_features)
        return self._kernel(x2.to(torch.bfloat16), self.packed, self.group, self.scales_zeros)

    def dense(self, x2, tile: int | None = None):
        """x2 @ W.T through GEMMs of `self.gemm`'s dtype, W dequantized (w = (u - 8) s + z,
        rounded to bf16) one chunk of 64-row blocks at a time, in the packing's own order: a
        block's codes come out as W.T [K, 64] without a transposing copy of the whole matrix.
        tile: the GEMMs take this many rows of x2 a call (`quant.gemm_rows`; x2's rows a multiple of it)."""
        k, nb = self.in_features, self.out_features // 64
        x2 = x2.to(getattr(torch, self.gemm.dtype))
        step = max(1, min(nb, self.gemm.chunk_bytes // (2 * 64 * k)))
        blocks = self.packed.view(nb, k, 32)
        work = torch.empty(step, k, 64, dtype=torch.bfloat16, device=x2.device)
        outs = []
        for a in range(0, nb, step):
            m = min(step, nb - a)
            w = work[:m]
            self._dequantize(blocks, a, w)
            outs.append(quant.gemm_rows(x2, w.transpose(0, 1).reshape(k, m * 64).to(x2.dtype), tile))
        return outs[0] if len(outs) == 1 else torch.cat(outs, 1)

    def _torch_dequantize(self, blocks, a: int, w) -> None:
        """Blocks [a, a + len(w)) into w [m, K, 64] through torch's ops (five passes)."""
        m, k, g = w.shape[0], self.in_features, self.group
        w[..., :32].copy_(blocks[a:a + m] & 15)
        w[..., 32:].copy_(blocks[a:a + m] >> 4)
        w4 = w.view(m, k // g, g, 64).sub_(8)
        # [m, K/G, 1, 64], contiguous: addcmul's broadcast then runs on vectors (2.5x faster)
        sz = self.scales_zeros.view(k // g, -1, 64, 2)     # torch's order: zeros always kept
        s, z = (sz[:, a:a + m, :, i].permute(1, 0, 2).unsqueeze(2).contiguous() for i in (0, 1))
        torch.addcmul(z, w4, s, out=w4)

    def _vnni_dequantize(self, blocks, a: int, w) -> None:
        """The same in one pass of the C library (its scales in blocks of 64 outputs)."""
        cpu_kernels.int4_dequant(self.packed, self.scales_zeros, self.group, a, w)


class Int8Linear(WeightOnly):
    """W int8 with one scale per output row: on a CPU with AVX512-VNNI or AVX2 the 16-bit-activation
    kernel of `hpipe.cpu_kernels` (activations per block of 32, as llama.cpp's Q8_0 dot
    products), else `_weight_int8pack_mm` (its arithmetic as a float32 GEMM where that op fails).
    That op's results come rounded to bf16: logits on a grid of 2^-8 of their size. (Exact int32 sums
    through torch._int_mm with int8 activations, one scale per row, are faster for SmolLM2's
    head, 1.6 against 2.1 ms, but per-row activation steps are coarse: logits moved by up to 1.6
    where bf16 moves them by 0.25. llama.cpp scales activations per block of 32.)"""

    def __init__(self, weight, scales, bias=None):
        super().__init__(weight.shape[1], weight.shape[0], bias)
        vnni = quant.vnni_kernel(weight.device.type, "int8", tuple(weight.shape))
        if scales.dim() == 2 and not vnni:      # block scales (Q8_0) only the VNNI kernel reads
            weight, scales = quant.row_scaled(weight, scales)
        self.register_buffer("weight", weight, persistent=False)
        self.register_buffer("scales", scales, persistent=False)
        self.gemm = quant.dense_gemm(weight.device.type)
        self.dense_from = self.gemm.from_rows["int8"] if self.gemm else float("inf")
        self._dequantize = self._vnni_dequantize if vnni else self._torch_dequantize
        if vnni:
            self.mm = self._vnni_mm
        elif weight.is_cuda or weight.shape[1] % 16:
            # torch's CUDA `_weight_int8pack_mm` is a plain loop per output that failed with
            # "invalid argument" on an H200 (2026-11-26), and on an AVX-512 CPU torch 2.13's
            # crashes (SIGSEGV) for more than one row when K is not a multiple of 16 (40, 72
            # here; a tiny model's shared expert): its arithmetic then, not its speed
            self.mm = self._float_mm

    def mm(self, x2):
        return torch.ops.aten._weight_int8pack_mm(x2.to(torch.bfloat16), self.weight, self.scales)

    def _vnni_mm(self, x2):
        return torch.ops.hpipe.int8_mm(x2, self.weight, self.scales)

    def _float_mm(self, x2):
        """`_weight_int8pack_mm`'s arithmetic: bf16 activations against the codes in a float32 GEMM
        (both exact in float32), the row scales on its sums, one rounding to bf16 at the end."""
        y = torch.nn.functional.linear(x2.to(torch.bfloat16).float(), self.weight.float(), None)
        return (y * self.scales.float()).to(torch.bfloat16)

    def dense(self, x2, tile: int | None = None):
        """x2 @ W.T through GEMMs of `self.gemm`'s dtype, W = code * row scale rounded to bf16
        (the codes are exact in bf16), a chunk of rows at a time; tile as `Int4Linear.dense`'s."""
        n, k = self.weight.shape
        x2 = x2.to(getattr(torch, self.gemm.dtype))
        step = max(64, self.gemm.chunk_bytes // (2 * k))
        work = torch.empty(min(step, n), k, dtype=torch.bfloat16, device=x2.device)
        outs = []
        for a in range(0, n, step):
            w = work[: min(step, n - a)]
            self._dequantize(a, w)
            outs.append(quant.gemm_rows(x2, w.t().to(x2.dtype), tile))
        return outs[0] if len(outs) == 1 else torch.cat(outs, 1)

    def _torch_dequantize(self, a: int, w) -> None:
        w.copy_(self.weight[a:a + len(w)]).mul_(self.scales[a:a + len(w), None])

    def _vnni_dequantize(self, a: int, w) -> None:
        cpu_kernels.int8_dequant(self.weight, self.scales, a, w)


class LinearPart(nn.Module):
    """One of several linears stacked into one (`STACKED`), in its place inside transformers'
    module: the first part called with an input runs the stacked linear and keeps the others'
    slices of the product until they ask for them with the same input (as transformers' modules
    do, q then k then v); a part asked with another input computes the product itself. The
    last part lets go of what was kept: nothing stays held between calls of the module."""

    def __init__(self, stacked: nn.Module, sizes: list[int], index: int, shared: _Product):
        super().__init__()
        if index == 0:
            self.stacked = stacked          # registered once, under the first part
        self._linear = (stacked,)           # every part reaches it (a tuple: not a submodule)
        self.sizes, self.index, self.shared = sizes, index, shared
        self.in_features, self.out_features = stacked.in_features, sizes[index]

    def forward(self, x):
        s = self.shared
        if self.index == 0 or s.x is not x:
            s.x, s.parts = x, self._linear[0](x).split(self.sizes, -1)
        y = s.parts[self.index]
        if self.index == len(self.sizes) - 1:
            s.x = s.parts = None
        return y


class Int4Embedding(nn.Module):
    """Rows of a 4-bit table, w = (u - 8) s + z as the int4 kernel reads them (float32 arithmetic
    on the bf16 s and z), gathered from the packing it shares with a tied Int4Linear head: the
    CPU's blocks of 64 rows (low nibbles rows 0-31, high nibbles rows 32-63, see
    `BLOCKED`) or CUDA's two codes per byte."""

    def __init__(self, packed, scales_zeros, dtype):
        super().__init__()
        self.register_buffer("packed", packed, persistent=False)
        self.register_buffer("scales_zeros", scales_zeros, persistent=False)
        self.dtype = dtype
        super_ = scales_zeros.dtype == torch.uint8   # Q4_K's super-blocks (`super_blocks`)
        blocked, self.rows, groups = quant.scales_shape(scales_zeros)
        self.cols = packed.shape[1] * 2
        self.group = self.cols // groups
        self._row_scales = self._super_rows if super_ else self._blocked_rows if blocked else self._flat_rows
        if blocked and not packed.is_cuda and cpu_kernels.kernels()[0] is not None:
            self.forward = self._kernel_rows     # one C call a lookup (cpu_kernels.int4_rows)

    def _kernel_rows(self, ids):
        flat = ids.reshape(-1)
        rows = cpu_kernels.int4_rows(self.packed, self.scales_zeros, self.group, flat)
        return rows.reshape(*ids.shape, self.cols).to(self.dtype)

    def forward(self, ids):
        flat = ids.reshape(-1)
        if self.packed.is_cuda:
            pairs = self.packed[flat]                                         # [T, K / 2]
            u = torch.stack([pairs >> 4, pairs & 15], -1)
        else:
            j = flat % 64
            bytes_ = self.packed.view(self.rows // 64, self.cols, 32)[flat // 64, :, j % 32]   # [T, K]
            u = (bytes_ >> (4 * (j >= 32)).to(torch.uint8)[:, None]) & 15
        sz = self._row_scales(flat).float()                                # [T, K / G, 2 or 1]
        w = (u.reshape(flat.shape[0], -1, self.group).float() - 8) * sz[..., :1]
        if sz.shape[-1] == 2:                                              # else symmetric
            w = w + sz[..., 1:]
        return w.reshape(*ids.shape, self.cols).to(self.dtype)

    def _flat_rows(self, flat):
        return self.scales_zeros[:, flat].transpose(0, 1)

    def _blocked_rows(self, flat):
        return self.scales_zeros[flat // 64, :, flat % 64]

    def _super_rows(self, flat):
        return quant.super_pairs(self.scales_zeros, flat)


class Int8Embedding(nn.Module):
    """Rows of an int8 table times their scale (per row, or per block of 32 columns: Q8_0's,
    float32 arithmetic then); shares its tensors with a tied Int8Linear head."""

    def __init__(self, weight, scales, dtype):
        super().__init__()
        self.register_buffer("weight", weight, persistent=False)
        self.register_buffer("scales", scales, persistent=False)
        self.dtype = dtype

    def forward(self, ids):
        if self.scales.dim() == 2:
            rows = self.weight[ids].float().unflatten(-1, (-1, 32)) * self.scales[ids, :, None].float()
            return rows.flatten(-2).to(self.dtype)
        return (self.weight[ids].to(self.dtype) * self.scales[ids, None].to(self.dtype))


# the modules that hold packed weights (the stages count them: a stage is quantized when it has one)
QUANTIZED = (Int4Linear, Int8Linear)


def linear_module(tensors: dict, device, bias=None):
    if "int4" in tensors:
        return Int4Linear(tensors["int4"].to(device), tensors["scales_zeros"].to(device), bias)
    return Int8Linear(tensors["int8"].to(device), tensors["scales"].to(device), bias)


def linear_parts(stacked, sizes: list[int]) -> list:
    """The modules that take the places of the linears stacked into `stacked`, in `sizes`' order."""
    shared = _Product()
    return [LinearPart(stacked, sizes, i, shared) for i in range(len(sizes))]


def embedding_module(tensors: dict, device, dtype):
    if "int4" in tensors:
        return Int4Embedding(tensors["int4"].to(device), tensors["scales_zeros"].to(device), dtype)
    return Int8Embedding(tensors["int8"].to(device), tensors["scales"].to(device), dtype)
