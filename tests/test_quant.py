"""Weights kept quantized (hpipe.quant): what is read from a GGUF file is the gguf package's own
dequantization, bit for bit; packing and the kernels stay within bounds that follow from bf16;
a quantized pipeline gives the logits and tokens of one process running the same modules, and
every runtime switch, preemption and the batch path agree with the same weights."""

from __future__ import annotations

import json
import random
import shutil
import types

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from conftest import VOCAB, assert_greedy_equal, assert_run_matches, reference_greedy, reference_logits
from hpipe import cpu_kernels, heap, models, quant, quantized
from hpipe.cli import main
from hpipe.formats import Slicing
from hpipe.request import Request
from hpipe.runtime.graphs import compiled as compiled_graphs
from hpipe.runtime.inprocess import run_inprocess
from hpipe.runtime import stage as stage_module
from hpipe.runtime.stage import StageRunner

U = 2.0 ** -8          # bf16's unit roundoff (8 significant bits, round to nearest)
ROWS, COLS = 32, 512   # a weight [N, K]: two K-quant super-blocks per row, N a multiple of 16
TYPES = [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q4_K, T.Q6_K]


def random_blocks(qtype, rng: np.random.Generator, rows: int = ROWS, cols: int = COLS,
                  d: tuple[float, float] = (1e-3, 2e-2)) -> np.ndarray:
    """Raw bytes of [rows, cols] weights of a K-quant type (gguf cannot quantize to these): random
    codes and scales, with sane f16 super-block scales (d, dmin, drawn from `d`) so that no value is
    inf or nan."""
    elems, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // elems, nbytes), dtype=np.uint8)
    f16 = lambda n: rng.uniform(*d, (rows, cols // elems, n)).astype(np.float16).view(np.uint8)
    if qtype == T.Q4_K:
        raw[..., 0:4] = f16(2)                     # d, dmin
    else:                                          # Q6_K: d is the last field
        raw[..., 208:210] = f16(1)
    return raw.reshape(rows, -1)


def file_blocks(values: np.ndarray, qtype, rng: np.random.Generator, d: tuple[float, float] = (1e-3, 2e-2)) -> np.ndarray:
    """Raw bytes of `values` [N, K] in a GGUF block type: the gguf package's own quantizer, or random
    blocks of that shape for the K-quants it cannot write (super-block scales from `d`)."""
    return random_blocks(qtype, rng, *values.shape, d=d) if qtype in (T.Q4_K, T.Q6_K) else \
        gguf.quants.quantize(values, qtype)


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    """One small GGUF file written with the gguf package's own writer: a tensor of every type."""
    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("gguf") / "types.gguf"
    w = gguf.GGUFWriter(str(path), arch="llama")
    for qtype in TYPES:
        values = rng.normal(0, 0.05, (ROWS, COLS)).astype(np.float32)
        values[:, :32] += 0.3                      # groups with a shifted range (Q4_1's minimum)
        if qtype in (T.Q4_K, T.Q6_K):
            w.add_tensor(qtype.name, random_blocks(qtype, rng), raw_dtype=qtype)
        elif qtype == T.F32:
            w.add_tensor(qtype.name, values)
        else:
            w.add_tensor(qtype.name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {t.name: t for t in gguf.GGUFReader(str(path)).tensors}


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_codes_and_scales_are_the_gguf_packages_own_values(gguf_file, qtype):
    tensor = gguf_file[qtype.name]
    theirs = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
    ours = quant.read_gguf_tensor(tensor)
    if qtype in (T.F32, T.F16, T.BF16):
        assert isinstance(ours, np.ndarray)
    else:
        assert isinstance(ours, quant.Affine) and ours.codes.shape == (ROWS, COLS)
        assert ours.bits == {T.Q8_0: 8, T.Q6_K: 6}.get(qtype, 4)
        ours = ours.dequantize()
    assert theirs.shape == ours.shape == (ROWS, COLS)
    assert np.array_equal(ours, theirs), f"{qtype.name}: largest difference {np.abs(ours - theirs).max()}"


def int4_codes(a: quant.Affine) -> np.ndarray:
    """The kernel's unsigned codes u, w = (u - 8) s + z."""
    return a.codes.astype(np.int64) + (8 if a.codes.dtype == np.int8 else 0)


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q4_K], ids=lambda t: t.name)
def test_int4_packing_is_within_bf16_rounding_of_its_scales(gguf_file, qtype):
    """|w_packed - w| <= 2^-8 (|u - 8| |s| + |z|) + 2^-23 |z|: s and z = offset + 8 s rounded to bf16
    (z's own float32 sum adds the last term)."""
    a = quant.read_gguf_tensor(gguf_file[qtype.name])
    packed = quant.pack(a, quant.WeightFormat("gguf"))
    assert set(packed) == {"int4", "scales_zeros"}
    s, z = (np.repeat(t, 32, axis=1) for t in quant.int4_scales(packed))
    u = int4_codes(a)
    w = a.dequantize().astype(np.float64)
    w_packed = (u - 8) * s + z
    bound = U * (np.abs(u - 8) * np.abs(s) + np.abs(z)) * (1 + U) + 2.0 ** -23 * np.abs(z)
    assert (np.abs(w_packed - w) <= bound).all()


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q6_K, T.F16], ids=lambda t: t.name)
def test_int8_repacking_is_within_half_a_row_step(gguf_file, qtype):
    """Types without a kernel of their own go to int8 per output row: |w_packed - w| <= s_row / 2,
    s_row = max |w_row| / 127, plus s_row's bf16 rounding times the code (<= 127 2^-8 s_row)."""
    w = quant.read_gguf_tensor(gguf_file[qtype.name])
    w = w.dequantize() if isinstance(w, quant.Affine) else w
    packed = quant.pack(w if isinstance(w, np.ndarray) else w, quant.WeightFormat("gguf"))
    assert set(packed) == {"int8", "scales"}
    s = packed["scales"].double().numpy()[:, None]
    w_packed = packed["int8"].numpy().astype(np.float64) * s
    step = np.abs(w).max(axis=1, keepdims=True) / 127
    assert (np.abs(w_packed - w) <= step / 2 + 127 * U * step * (1 + U)).all()


@pytest.mark.skipif(not quant.vnni_kernel("cpu", "int8", (64, 64)), reason="no int4/int8 kernels (AVX512-VNNI or AVX2) on this CPU")
def test_q6_k_goes_to_int8_blocks_of_32_where_the_vnni_kernel_reads_them(gguf_file):
    """Q6_K where the VNNI kernel runs: int8 blocks of 32 with float16 scales, as Q8_0 runs, within half
    a block's step of the gguf package's dequantization (s_block = max |w_block| / 127, plus its
    float16 rounding times the code): a step a row cost the MoE shape KL above llama.cpp's."""
    w = quant.read_gguf_tensor(gguf_file["Q6_K"])
    dense = w.dequantize()
    packed = quant.pack(w, quant.WeightFormat("gguf"))
    n, k = dense.shape
    assert packed["int8"].dtype == torch.int8 and packed["scales"].dtype == torch.float16
    assert packed["scales"].shape == (n, k // 32)
    s = packed["scales"].double().numpy().repeat(32, axis=1)
    step = np.abs(dense.reshape(n, k // 32, 32)).max(axis=2).repeat(32, axis=1) / 127
    err = np.abs(packed["int8"].numpy().astype(np.float64) * s - dense)
    assert (err <= step / 2 + 127 * 2.0 ** -11 * step * (1 + 2.0 ** -11)).all()


@pytest.mark.skipif(not quant.vnni_kernel("cpu", "int8", (64, 64)), reason="no int4/int8 kernels (AVX512-VNNI or AVX2) on this CPU")
def test_q8_0_keeps_the_files_own_weights_where_the_vnni_kernel_reads_them(gguf_file, monkeypatch):
    """Q8_0's codes and float16 block scales are packed as they are: the weights, and the rows an
    embedding looks up, are the gguf package's own dequantization exactly. A process on torch's ops
    (HPIPE_CPU_KERNELS=torch) quantizes them again per row at load, within half a row step."""
    tensor = gguf_file["Q8_0"]
    theirs = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
    packed = quant.pack(quant.read_gguf_tensor(tensor), quant.WeightFormat("gguf"))
    assert packed["scales"].dtype == torch.float16 and packed["scales"].shape == (ROWS, COLS // 32)
    assert np.array_equal(quant.int8_weight(packed).astype(np.float32), theirs)
    ids = torch.tensor([[0, 5], [ROWS - 1, 3]])
    rows = quantized.embedding_module(packed, "cpu", torch.float32)(ids).numpy()
    assert np.array_equal(rows, theirs[ids.numpy()])
    monkeypatch.setattr(quant, "vnni_kernel", lambda *args: False)
    module = quantized.linear_module(packed, "cpu")
    assert module.scales.shape == (ROWS,) and module.mm != getattr(module, "_vnni_mm", None)
    w = module.weight.double().numpy() * module.scales.double().numpy()[:, None]
    step = np.abs(theirs).max(axis=1, keepdims=True) / 127
    assert (np.abs(w - theirs) <= step / 2 + 127 * U * step * (1 + U)).all()


def kernel_bound(x: torch.Tensor, w: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """The kernels round x to bf16 (2^-8 |x|), sum in float32 (K 2^-24 of |x| |w|) and round y to
    bf16 (2^-8 |y|)."""
    a = np.abs(x.double().numpy()) @ np.abs(w).T
    k = w.shape[1]
    return (U * (1 + U) + k * 2.0 ** -23) * a + U * np.abs(ref)


def vnni_bound(x: torch.Tensor, w: np.ndarray, magnitude: np.ndarray) -> np.ndarray:
    """The VNNI kernels (`hpipe.cpu_kernels`): half an activation step per block of 32 (amax / 65534
    of the block) times the weights, and float32's roundings of the per-block sums, whose terms
    are at most `magnitude` [N, K] times the quantized activations (int4: 23 |s| + |z|, the codes'
    range and the zero terms; int8: |w|)."""
    xf = x.double().numpy()
    q, d = activation_blocks(xf)
    step = np.repeat(d[..., 0], 32, axis=1) / 2 * (1 + 2.0 ** -10)
    return step @ np.abs(w).T + (w.shape[1] / 32 + 8) * 2.0 ** -23 * (np.abs(q * d).reshape(xf.shape) @ magnitude.T)


def bound_of(module, x: torch.Tensor, w: np.ndarray, ref: np.ndarray, magnitude: np.ndarray) -> np.ndarray:
    """The bound of the kernel `module` runs: the VNNI kernels' or torch's (bf16 activations)."""
    vnni = module.mm == getattr(module, "_vnni_mm", None)
    return vnni_bound(x, w, magnitude) if vnni else kernel_bound(x, w, ref)


@pytest.mark.parametrize("fmt", ["gguf", "int8"])
@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q4_K, T.Q8_0], ids=lambda t: t.name)
def test_quantized_linear_against_a_float64_matmul(gguf_file, qtype, fmt, device):
    torch.manual_seed(0)
    a = quant.read_gguf_tensor(gguf_file[qtype.name])
    packed = quant.pack(a if fmt == "gguf" else a.dequantize(), quant.WeightFormat(fmt), torch.device(device).type)
    module = quantized.linear_module(packed, device)
    if "int4" in packed:
        s, z = (np.repeat(t, 32, axis=1) for t in quant.int4_scales(packed))
        w, magnitude = (int4_codes(a) - 8) * s + z, 23 * np.abs(s) + np.abs(z)
    else:
        w = quant.int8_weight(packed)
        magnitude = np.abs(w)
    for rows in (0, 1, 7):      # 0: a prompt's slice before its last samples no row through the head
        x = torch.randn(rows, COLS)
        y = module(x.to(device)).double().cpu().numpy()
        ref = x.double().numpy() @ w.T
        assert y.shape == (rows, ROWS)
        assert (np.abs(y - ref) <= bound_of(module, x, w, ref, magnitude)).all(), np.abs(y - ref).max()


def activation_blocks(x: np.ndarray):
    """x [M, K] -> (q, d): the VNNI kernels' 16-bit activations restated, float32 as they compute them:
    per block of 32 inputs d = amax / 32767, q = x * (32767 / amax) rounded to the nearest (ties to even)."""
    m, k = x.shape
    xb = x.astype(np.float32).reshape(m, k // 32, 32)
    amax = np.abs(xb).max(-1, keepdims=True)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(32767) / amax, np.float32(0)).astype(np.float32)
    q = np.rint(xb * inv).astype(np.float64)
    return q, (amax / np.float32(32767)).astype(np.float64)


@pytest.mark.skipif(not quant.vnni_kernel("cpu", "int4", (64, 64)), reason="no int4/int8 kernels (AVX512-VNNI or AVX2) on this CPU")
@pytest.mark.parametrize("qtype,fmt,n,k", [(T.Q4_0, "gguf", 128, 2048), (T.Q4_1, "gguf", 192, 512),
                                           (T.Q4_K, "gguf", 128, 768),
                                           (None, "int4:64", 64, 256), (None, "int4:128", 320, 1024),
                                           (T.Q8_0, "gguf", 100, 576), (None, "int8", 48, 2048), (None, "int8", 7, 32)],
                         ids=["Q4_0", "Q4_1", "Q4_K", "int4:64", "int4:128", "Q8_0", "int8", "int8-one-block"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_the_vnni_kernels_are_their_block_arithmetic_and_within_their_activations_rounding(qtype, fmt, n, k, dtype):
    """The 16-bit-activation kernels (`hpipe.cpu_kernels`) on the layouts torch's ops read, called as
    the modules call them (the ops' C++ kernels, where g++ built them; the Python twin beside):
    1. against their arithmetic restated in float64 (activations to int16 per block of 32, integer
       dot products with the codes, the block's scales after): within float32's roundings only;
    2. against a float64 matmul of the packed weights: within half an activation step per block
       (amax / 65534 of each block) times the weights, plus those roundings;
    3. every row the bits it gets alone (rows never share a quantization step)."""
    rng = np.random.default_rng(11)
    values = rng.normal(0, 0.05, (n, k)).astype(np.float32)
    values[:, :32] += 0.3
    if qtype is None:
        a = values
    else:
        raw = file_blocks(values, qtype, rng)
        a = quant.read_gguf_tensor(types.SimpleNamespace(data=raw, tensor_type=qtype, shape=(k, n)))
    packed = quant.pack(a, quant.WeightFormat.parse(fmt))
    module = quantized.linear_module(packed, "cpu")
    assert module.mm == module._vnni_mm
    if qtype == T.Q4_K:      # the file's own factors: float16 d, dmin per 256 inputs, 6-bit sc, mn per 32
        assert packed["scales_zeros"].shape == (n // 64, k // 256, 1280)
    elif "int4" in packed:   # Q4_0's zeros are all 0: the kernel reads its scales alone (4.5 bits a weight)
        assert packed["scales_zeros"].shape[-1] == (1 if qtype == T.Q4_0 else 2)
        assert packed["scales_zeros"].dtype == (torch.float16 if qtype == T.Q4_0 else torch.bfloat16)
    else:                    # Q8_0 keeps the file's codes and float16 scales per block of 32
        assert packed["scales"].shape == ((n, k // 32) if qtype == T.Q8_0 else (n,))
    if "int4" in packed:
        s, z = quant.int4_scales(packed)
        group = k // s.shape[1]
        s, z = (np.repeat(t, group, axis=1) for t in (s, z))
        codes = (quant.quantize_int4(values, group) if qtype is None else a).codes
        u = codes.astype(np.float64) + (8 if codes.dtype == np.int8 else 0)
        # per block: s sum(u q) + (z - 8 s) sum(q), the kernel's two terms
        terms, weights = [(u, s), (np.ones_like(u), z - 8 * s)], np.abs(16 * s) + np.abs(z)
        call = lambda x: torch.ops.hpipe.int4_mm(x, module.packed, module.scales_zeros, group)   # noqa: E731
        twin = lambda x: cpu_kernels.int4_mm(x, module.packed, module.scales_zeros, group)      # noqa: E731
    else:
        scales = packed["scales"].double().numpy()        # per block of 32 (Q8_0's own) or per row
        scale = np.repeat(scales, 32, axis=1) if scales.ndim == 2 else np.repeat(scales[:, None], k, axis=1)
        terms, weights = [(packed["int8"].numpy().astype(np.float64), scale)], None
        call = lambda x: torch.ops.hpipe.int8_mm(x, module.weight, module.scales)               # noqa: E731
        twin = lambda x: cpu_kernels.int8_mm(x, module.weight, module.scales)                   # noqa: E731
    w = sum(c * f for c, f in terms)
    weights = np.abs(w) if weights is None else weights
    for rows in (0, 1, 2, 3, 5, 7):
        x = torch.from_numpy(rng.normal(0, 1, (rows, k)).astype(np.float32)).to(dtype)
        x[:, :32] = 0                                             # a block of zeros: amax 0
        y = call(x)
        assert y.dtype == torch.float32 and y.shape == (rows, n)
        assert torch.equal(twin(x), y)         # the op's C++ kernel and its Python twin: the same call
        y = y.double().numpy()
        xf = x.double().numpy()
        q, d = activation_blocks(xf)
        exact = sum(np.einsum("mb,mbk,nbk->mn", d[..., 0], q, (c * f).reshape(n, k // 32, 32)) for c, f in terms)
        magnitude = np.abs(q * d).reshape(rows, k) @ weights.T
        rounding = (k / 32 + 8) * 2.0 ** -23 * magnitude
        assert (np.abs(y - exact) <= rounding).all(), np.abs(y - exact).max()
        step = np.repeat(d[..., 0], 32, axis=1) / 2 * (1 + 2.0 ** -10)
        ref = xf @ w.T
        assert (np.abs(y - ref) <= step @ np.abs(w).T + rounding).all(), np.abs(y - ref).max()
        if rows:
            alone = np.concatenate([call(x[i:i + 1]).numpy() for i in range(rows)])
            assert np.array_equal(alone, y.astype(np.float32))


@pytest.mark.skipif(not quant.vnni_kernel("cpu", "int4", (64, 64)) or not shutil.which("g++"),
                    reason="no int4/int8 kernels (AVX512-VNNI or AVX2) on this CPU, or no g++")
def test_the_ops_reach_the_kernels_from_cpp_where_a_compiler_is_found():
    """A compiled graph calls the ops without Python: their kernels are C++ wherever g++ is found."""
    assert cpu_kernels.ops_route() == "C++"


def _mapping_of(address: int) -> tuple[str, set[str]]:
    """(the file, or "" for anonymous memory; VmFlags) of this process's mapping holding `address`."""
    found = None
    for line in open("/proc/self/smaps"):
        head = line.split()
        if "-" in head[0] and ":" not in head[0]:
            lo, hi = (int(x, 16) for x in head[0].split("-"))
            found = ((head[5] if len(head) > 5 else ""), None) if lo <= address < hi else None
        elif found is not None and head[0] == "VmFlags:":
            return found[0], set(head[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not heap.huge_pages_advised(), reason="no transparent huge pages here")
def test_a_cpu_stages_packed_weights_are_copied_into_huge_pages_unless_shared():
    """A CPU stage's packed weights leave the packed cache's file mapping (4 KB pages) for anonymous
    memory advised for transparent huge pages (VmFlags `hg`), the same bytes; with `shared_weights`
    (SiDP's replicas) they stay the file's mapping, one copy in the page cache for the host."""
    source = models.resolve_model("smollm2")
    config = models.load_config(source.path)

    def block_q(shared: bool) -> torch.Tensor:
        runner = StageRunner(source, config, range(0, 3), weights=quant.WeightFormat("gguf"), compile="off",
                             shared_weights=shared)
        return next(m for m in runner.model.modules() if isinstance(m, quantized.Int4Linear)).packed

    own, shared = block_q(False), block_q(True)
    assert torch.equal(own, shared)
    path, flags = _mapping_of(own.data_ptr())
    assert path == "" and "hg" in flags, (path, flags)
    path, flags = _mapping_of(shared.data_ptr())
    assert path.endswith(".pt") and "hg" not in flags, (path, flags)


def test_int4_codes_are_packed_in_the_kernels_blocked_layout_and_back():
    """`pack_blocked` against the layout read byte by byte (block b, input k, byte j: output 64 b + j
    in the low nibble, 64 b + j + 32 in the high one), the inverse, and torch's own packing where
    torch packs the same blocks (its AVX512 build)."""
    n, k = 192, 96
    u = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=torch.Generator().manual_seed(3))
    packed = quant.pack_blocked(u)
    assert packed.shape == (n, k // 2) and packed.dtype == torch.uint8
    blocks = packed.view(n // 64, k, 32).numpy().astype(np.int32)
    codes = u.numpy()
    b, kk, j = np.meshgrid(np.arange(n // 64), np.arange(k), np.arange(32), indexing="ij")
    assert (blocks & 15 == codes[64 * b + j, kk]).all() and (blocks >> 4 == codes[64 * b + j + 32, kk]).all()
    assert torch.equal(quant.unpack_blocked(packed), u)
    if quant.torch_packs_blocked():
        assert torch.equal(torch.ops.aten._convert_weight_to_int4pack_for_cpu(u, 1), packed)


@pytest.mark.skipif(not quant.vnni_kernel("cpu", "int4", (64, 64)), reason="no int4/int8 kernels (AVX512-VNNI or AVX2) on this CPU")
def test_a_symmetric_int4_packing_runs_on_torchs_kernel_too(monkeypatch):
    """Q4_0 packed for the VNNI kernel keeps no zeros; a process that runs torch's op on that cache
    (HPIPE_CPU_KERNELS=torch) gets them back as 0 and the float64 matmul's outputs within bf16's."""
    rng = np.random.default_rng(12)
    n, k = 128, 256
    raw = gguf.quants.quantize(rng.normal(0, 0.05, (n, k)).astype(np.float32), T.Q4_0)
    a = quant.read_gguf_tensor(types.SimpleNamespace(data=raw, tensor_type=T.Q4_0, shape=(k, n)))
    packed = quant.pack(a, quant.WeightFormat("gguf"))
    assert packed["scales_zeros"].shape == (n // 64, k // 32, 64, 1)
    monkeypatch.setattr(quant, "vnni_kernel", lambda *args: False)
    module = quantized.linear_module(packed, "cpu")
    assert module.mm != getattr(module, "_vnni_mm", None) and module.scales_zeros.shape == (k // 32, n, 2)
    x = torch.randn(3, k)
    s = np.repeat(quant.int4_scales(packed)[0], 32, axis=1)
    w = (int4_codes(a) - 8) * s
    ref = x.double().numpy() @ w.T
    assert (np.abs(module(x).double().numpy() - ref) <= kernel_bound(x, w, ref)).all()


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q4_K], ids=lambda t: t.name)
def test_a_4bit_embedding_table_keeps_its_codes_and_its_tied_head_shares_them(qtype, device):
    """A GGUF embedding table in 4-bit blocks (128 rows: two of the CPU packing's 64-row blocks)
    stays int4: every row looked up is the gguf package's own dequantization within the bf16
    rounding of its scales, and the head tied to it runs the int4 kernel on the same codes (the
    same tensors on a CPU; on CUDA tinygemm's tiles of them), against a float64 matmul of the rows
    the embedding gives."""
    kind = torch.device(device).type
    if not quant.int4_rows_gatherable(128, kind):
        pytest.skip("this torch build packs int4 for the CPU in another layout (the table goes to int8)")
    rng = np.random.default_rng(6)
    n, k = 128, 256
    values = rng.normal(0, 0.05, (n, k)).astype(np.float32)
    raw = file_blocks(values, qtype, rng)
    theirs = gguf.quants.dequantize(raw, qtype).astype(np.float64)
    a = quant.read_gguf_tensor(types.SimpleNamespace(data=raw, tensor_type=qtype, shape=(k, n)))
    packed = quant.pack(a, quant.WeightFormat("gguf"), kind, as_embedding=True)
    assert set(packed) == {"int4", "scales_zeros"}
    embedding = quantized.embedding_module(packed, device, torch.float32)
    head = quantized.linear_module(packed, device)
    if kind == "cpu":
        assert embedding.packed.data_ptr() == head.packed.data_ptr()
    ids = torch.tensor([[0, 31, 32, 63], [64, 100, 127, 5]])
    rows = embedding(ids.to(device)).double().cpu().numpy()
    assert rows.shape == (2, 4, k)
    u = int4_codes(a)[ids.numpy()]
    s, z = (np.repeat(t[ids.numpy()], 32, axis=-1) for t in quant.int4_scales(packed))    # [2, 4, K]
    bound = U * (np.abs(u - 8) * np.abs(s) + np.abs(z)) * (1 + U) + 2.0 ** -23 * np.abs(z)
    assert (np.abs(rows - theirs[ids.numpy()]) <= bound).all()
    if "_kernel_rows" in vars(embedding).get("forward", lambda: None).__qualname__:
        # hpipe's C lookup (cpu_kernels.int4_rows): the bits torch's ops give from the same tensors,
        # and an id outside the table refused, not read
        assert torch.equal(embedding(ids), type(embedding).forward(embedding, ids))
        with pytest.raises(IndexError):
            embedding(torch.tensor([[3, n]]))
    table = embedding(torch.arange(n, device=device)).double().cpu().numpy()
    x = torch.randn(3, k)
    ref = x.double().numpy() @ table.T
    s, z = (np.repeat(t, 32, axis=-1) for t in quant.int4_scales(packed))
    bound = bound_of(head, x, table, ref, 23 * np.abs(s) + np.abs(z))
    assert (np.abs(head(x.to(device)).double().cpu().numpy() - ref) <= bound).all()


def dense_bound(x: torch.Tensor, w: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """bf16 GEMMs on dequantized weights: x and each weight rounded to bf16 (2^-8 each), float32
    sums, y rounded to bf16."""
    a = np.abs(x.double().numpy()) @ np.abs(w).T
    return (2 * U * (1 + U) + w.shape[1] * 2.0 ** -23) * a + U * np.abs(ref)


@pytest.mark.skipif(not quant.dense_gemm("cpu"), reason="no dense path on this CPU (neither hpipe's kernels "
                    "nor torch's blocked int4 packing with bf16 units)")
@pytest.mark.parametrize("fmt", ["int4:32", "int4:128", "Q4_0", "Q4_K", "int8"])
def test_many_rows_go_through_dense_chunks_within_bf16_bounds(fmt):
    """A prefill slice's rows take the dequantized GEMM path (bf16, or float32 without bf16 units):
    every output against a float64 matmul of the packed weights (several chunks: 2,048 inputs by
    1,024 outputs; the bf16 GEMM's bound holds for the float32 one), and the same rows
    one at a time through the weight-only kernel within the two bounds of each other. (Q4_0: a
    GGUF file's symmetric blocks, kept without zeros by the VNNI kernels; Q4_K: its super-blocks.)"""
    rng = np.random.default_rng(3)
    n, k = 1024, 2048
    w = rng.normal(0, 0.05, (n, k)).astype(np.float32)
    a, from_file = w, fmt.startswith("Q")
    if from_file:
        raw = file_blocks(w, T[fmt], rng)
        a = quant.read_gguf_tensor(types.SimpleNamespace(data=raw, tensor_type=T[fmt], shape=(k, n)))
    packed = quant.pack(a, quant.WeightFormat.parse("gguf" if from_file else fmt))
    module = quantized.linear_module(packed, "cpu")
    if "int4" in packed:
        group = 32 if from_file else int(fmt.split(":")[1])
        codes = (int4_codes(a) if from_file else quant.quantize_int4(w, group).codes).astype(np.float64)
        s, z = (np.repeat(t, group, axis=1) for t in quant.int4_scales(packed))
        w, magnitude = (codes - 8) * s + z, 23 * np.abs(s) + np.abs(z)
    else:
        w = quant.int8_weight(packed)
        magnitude = np.abs(w)
    rows = quant.dense_gemm("cpu").from_rows["int8" if fmt == "int8" else "int4"] + 5
    assert module.dense_from < rows
    x = torch.randn(rows, k)
    y = module(x).double().numpy()
    ref = x.double().numpy() @ w.T
    assert (np.abs(y - ref) <= dense_bound(x, w, ref)).all(), np.abs(y - ref).max()
    one = torch.cat([module(x[i:i + 1]) for i in range(rows)]).double().numpy()
    assert (np.abs(one - ref) <= bound_of(module, x, w, ref, magnitude)).all()
    assert not np.array_equal(one, y)        # the two paths differ in their roundings: both ran


@pytest.mark.skipif(not quant.dense_gemm("cpu"), reason="no dense path on this CPU (neither hpipe's kernels "
                    "nor torch's blocked int4 packing with bf16 units)")
@pytest.mark.parametrize("fmt", ["int4:32", "int8"])
def test_a_deterministic_dense_row_has_its_own_bits_among_any_rows(fmt):
    """--deterministic's rows on the dense GEMM (`quant.RowPaths`): each row's output is the bits it
    gets alone, among 2 to 300 rows at any place (oneDNN's bf16 GEMM on an AMX Xeon rounds a row
    by how many share the call: it took 33 rows there)."""
    w = np.random.default_rng(6).normal(0, 0.05, (896, 576)).astype(np.float32)
    module = quantized.linear_module(quant.pack(w, quant.WeightFormat.parse(fmt)), "cpu")
    x = torch.randn(300, 576)
    with quant.row_paths(quant.RowPaths(dense=torch.arange(300), kernel=None)):
        alone = torch.cat([module(x[i:i + 1]) for i in range(300)])
        for n in (2, 33, 46, 64, 65, 100, 255, 256, 300):
            assert torch.equal(module(x[:n]), alone[:n]), f"{n} rows"
            assert torch.equal(module(x[:n].flip(0)), alone[:n].flip(0)), f"{n} rows, reversed"


@pytest.mark.skipif(not quant.dense_gemm("cpu"), reason="no dense path on this CPU (neither hpipe's kernels "
                    "nor torch's blocked int4 packing with bf16 units)")
def test_the_profile_measures_both_sides_of_every_path_switch():
    """`quant.path_switches` names the row counts where a real linear leaves the kernel for the
    dense GEMM (seen by which of the two it calls), and the profiler's grid holds each of them and
    the row count below it, quick or not."""
    from hpipe.profiler.measure import grid

    rng = np.random.default_rng(5)
    w = rng.normal(0, 0.05, (256, 512)).astype(np.float32)
    switches = quant.path_switches(quant.WeightFormat.parse("gguf"), "cpu")
    assert quant.path_switches(quant.NONE, "cpu") == ()
    for fmt in ("int4:32", "int8"):
        module = quantized.linear_module(quant.pack(w, quant.WeightFormat.parse(fmt)), "cpu")
        (switch,) = quant.path_switches(quant.WeightFormat.parse(fmt), "cpu")
        assert switch in switches
        taken = []
        module.mm = lambda x2, f=module.mm: taken.append("kernel") or f(x2)
        module.dense = lambda x2, f=module.dense: taken.append("dense") or f(x2)
        for rows in (switch - 1, switch):
            module(torch.randn(rows, 512))
        assert taken == ["kernel", "dense"], (fmt, switch, taken)
    for quick in (True, False):
        s, _ = grid(2048, quick, switches)
        assert all(k - 1 in s and k in s for k in switches), s


def test_a_compiled_step_keeps_the_kernel_for_any_number_of_rows():
    """Inside torch.compile (the `--compile on` decode step) a linear always takes the weight-only
    kernel: a batch past the dense path's rows reuses the graph of any other number of rows (no guard on the
    count, no recompile mid-run) and gives the kernel's result."""

    w = np.random.default_rng(4).normal(0, 0.05, (256, 512)).astype(np.float32)
    module = quantized.linear_module(quant.pack(w, quant.WeightFormat("int8")), "cpu")
    compiled = torch.compile(module)
    with torch.no_grad():
        for rows in (2, 3):
            compiled(torch.randn(rows, 512))
        graphs = compiled_graphs()
        x = torch.randn(quant.DENSE_PROMPT + 6, 512)        # past every CPU's dense-path row count
        y = compiled(x)
    assert compiled_graphs() == graphs
    assert torch.allclose(y, module.mm(x).float(), rtol=2 ** -7, atol=1e-3)


def test_int4_group_and_shape_rules():
    assert str(quant.WeightFormat.parse("int4")) == "int4:32"
    assert str(quant.WeightFormat.parse("INT4:128")) == "int4:128"
    for bad in ("int4:16", "int3", "q4_1", "int8:32"):
        with pytest.raises(Exception, match="--quantize"):
            quant.WeightFormat.parse(bad)
    w = np.random.default_rng(1).normal(size=(24, 64)).astype(np.float32)   # 24 rows: no int4 packing
    assert set(quant.pack(w, quant.WeightFormat("int4", 32))) == {"int8", "scales"}


@pytest.mark.parametrize("fmt", ["int4:32", "int8"])
def test_stacked_linears_give_each_part_what_it_gives_packed_alone(fmt):
    """q, k, v stacked into one matrix: each part's output equals the output of that weight packed
    and run on its own, in transformers' order (q, k, v on one input) and when a part comes
    first with another input; codes of different kinds are not stacked."""
    rng = np.random.default_rng(3)
    ws = [rng.normal(size=(n, 64)).astype(np.float32) for n in (128, 64, 64)]
    weights = quant.WeightFormat.parse(fmt)
    alone = [quantized.linear_module(quant.pack(w, weights), "cpu") for w in ws]
    parts = quantized.linear_parts(quantized.linear_module(quant.pack(quant.stack_rows(ws), weights), "cpu"), [128, 64, 64])
    x, other = torch.randn(3, 64), torch.randn(2, 64)
    with torch.inference_mode():
        for part, single in zip(parts, alone):
            assert torch.equal(part(x), single(x))
        assert torch.equal(parts[2](other), alone[2](other)) and torch.equal(parts[0](x), alone[0](x))
        assert parts[0].shared.x is x and parts[2](x).shape == (3, 64) and parts[0].shared.x is None
    q4_0, q4_1 = (quant.quantize_int4(w, 32) for w in ws[:2])
    q4_0 = quant.Affine(q4_0.codes.astype(np.int8) - 8, q4_0.scale, None, 32, 4)        # symmetric codes
    assert quant.stack_rows([q4_0, q4_1]) is None and quant.stack_rows([ws[0], q4_1]) is None


# ------------------------------------------------------------------------------- whole models

QUANT_TOL = 0.5     # logits: bf16 results come in steps of 2^-8 of their size (see test_default_model)


@pytest.mark.parametrize("fmt", ["int4:32", "int8"])
def test_quantized_pipelines_match_one_process_of_the_same_modules(fmt, tiny_models, device):
    """1-4 stages with cuts anywhere (mid-block included), random slicing and batches, against one
    process running the same quantized modules over the whole sequence."""
    path = tiny_models["llama"]
    config = models.load_config(path)
    weights = quant.WeightFormat.parse(fmt)
    reference = models.build_full_model(path, config, weights=weights)
    mlp, kind = reference.model.layers[0].mlp, (quantized.Int4Linear if fmt.startswith("int4") else quantized.Int8Linear)
    assert isinstance(mlp.up_proj, quantized.LinearPart) and isinstance(mlp.gate_proj.stacked, kind)    # stacked
    assert isinstance(mlp.down_proj, kind)
    rng = random.Random(fmt)
    n_units = models.num_units(config)
    for trial in range(4):
        n_stages = 1 + trial
        bounds = [0, *sorted(rng.sample(range(1, n_units), n_stages - 1)), n_units]
        runners = [StageRunner(path, config, range(a, b), weights=weights, device=device, kv_dtype="float32")
                   for a, b in zip(bounds, bounds[1:])]
        prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 50))] for _ in range(3)]
        requests = [Request(i, f"p{i}", tuple(p), max_new_tokens=10, eos_ids=frozenset([2]))
                    for i, p in enumerate(prompts)]
        slicing = Slicing(lengths=tuple(rng.randint(3, 20) for _ in range(2)))
        results = run_inprocess(runners, requests, slicing.slices_for, max_batch=2, keep_logits=True)
        for r in requests:
            out = results[r.id]["output_ids"]
            ref = reference_logits(reference, list(r.input_ids), out)
            diff = (results[r.id]["logits"] - ref).abs()
            assert float(diff.max()) < QUANT_TOL and float(diff.mean()) < QUANT_TOL / 10, (bounds, float(diff.max()))
            assert_greedy_equal(reference, list(r.input_ids), out,
                                reference_greedy(reference, list(r.input_ids), 10, 2), tie=QUANT_TOL)


@pytest.mark.slow
def test_every_switch_and_preemption_give_the_batch_paths_tokens_with_quantized_weights(tiny_models, tmp_path):
    """`hpipe plan --quantize int4` on a float checkpoint; the baseline (all switches off, inline
    sampling), all switches on with the sampler pool, and a KV pool small enough to preempt, on 3
    processes: the same tokens, greedy and seeded."""
    path = tiny_models["llama"]
    rng = random.Random("quant-switches")
    lines = []
    for i in range(5):
        prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randint(5, 40))]
        sampling = {"temperature": 0} if i % 2 == 0 else {"temperature": 0.8, "top_p": 0.9, "seed": 7 + i}
        lines.append({"id": f"p{i}", "input_ids": prompt, "sampling": sampling})
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(x) + "\n" for x in lines))
    plan = tmp_path / "plan.json"
    assert main(["plan", "--kv-dtype", "float32", "--model", str(path), "--stages", "3", "--quantize", "int4", "--cuts", "3,6",
                 "--slices", "12,8", "-o", str(plan)]) == 0
    assert json.loads(plan.read_text())["weights"] == "int4:32"
    small = -(-(40 + 12) // 4) + 2
    variants = {"baseline": ["--no-tsem", "--no-sat", "--sampling", "inline"],
                "all on": ["--sampling", "cpu", "--sampler-procs", "2"],
                "preempted": ["--kv-pages", str(small), "--page-size", "4"]}
    runs = {}
    for name, args in variants.items():
        out = tmp_path / f"{name.replace(' ', '-')}.jsonl"
        assert main(["launch", str(plan), "--local", "--prompts", str(prompts), "--out", str(out),
                     "--max-new-tokens", "12", "--max-batch", "4", "--quiet", *args]) == 0
        runs[name] = {r["id"]: r["output_ids"] for r in map(json.loads, out.read_text().splitlines())}
        summary = json.loads(out.with_name(out.name + ".summary.json").read_text())["run"]
        assert summary["options"]["weights"] == "int4:32"
        if name == "preempted":
            assert summary["preemptions"] > 0
    assert runs["all on"] == runs["baseline"] and runs["preempted"] == runs["baseline"]


def test_whole_blocks_go_several_to_a_call_and_the_rest_one_by_one():
    """A stage's forward calls: runs of whole blocks, as many a call as run the model's blocks in the
    fewest calls (5 for SmolLM2's 30, 4 for Llama-3.2-1B's 16), the whole blocks left over one a
    call, a cut block's halves and the embedding and head alone; every unit once, in order."""
    calls = stage_module.stage_calls(range(62), 62, joined=True)          # SmolLM2: 30 blocks
    assert calls[0] == (0,) and calls[-1] == (61,)
    assert [len(c) for c in calls[1:-1]] == [10] * 6
    assert [u for c in calls for u in c] == list(range(62))
    assert stage_module.stage_calls(range(20, 41), 62, joined=True) == [
        (20,), tuple(range(21, 31)), tuple(range(31, 41))]
    assert stage_module.stage_calls(range(20, 37), 62, joined=True) == [
        (20,), tuple(range(21, 31)), (31, 32), (33, 34), (35, 36)]
    assert [len(c) for c in stage_module.stage_calls(range(34), 34, joined=True)] == [1] + [8] * 4 + [1]
    assert stage_module.stage_calls(range(3, 9), 62, joined=False) == [(u,) for u in range(3, 9)]


def test_a_stages_own_calls_join_its_cut_halves_to_its_blocks():
    """`stage_runs` (`join_halves`): a cut block's MLP half goes with the stage's first whole blocks and
    a cut block's attention half with its last, blocks `blocks_per_call` a call, the leftover ones one
    call; every unit once, in order. The whole model's calls are the same either way."""
    assert stage_module.stage_calls(range(0, 20), 62, True, join_halves=True) == [
        (0,), tuple(range(1, 11)), tuple(range(11, 20))]
    assert stage_module.stage_calls(range(20, 41), 62, True, join_halves=True) == [
        tuple(range(20, 31)), tuple(range(31, 41))]
    assert stage_module.stage_calls(range(41, 62), 62, True, join_halves=True) == [
        tuple(range(41, 51)), tuple(range(51, 61)), (61,)]
    assert stage_module.stage_calls(range(6, 12), 18, True, join_halves=True) == [tuple(range(6, 12))]
    assert stage_module.stage_calls(range(2, 4), 62, True, join_halves=True) == [(2, 3)]
    assert stage_module.stage_calls(range(1, 2), 62, True, join_halves=True) == [(1,)]
    assert stage_module.stage_calls(range(62), 62, True, join_halves=True) == stage_module.stage_calls(range(62), 62, True)
    assert stage_module.stage_calls(range(3, 9), 62, False, join_halves=True) == [(u,) for u in range(3, 9)]
    for a, b in ((0, 7), (3, 30), (8, 61), (13, 62)):
        assert [u for c in stage_module.stage_calls(range(a, b), 62, True, join_halves=True) for u in c] == list(range(a, b))


POOL = 40      # KV pages, a size no dim of the tiny model has (duck shaping would tie the two)


@pytest.mark.parametrize("fmt", ["none", "int4:32"])
def test_compiled_decode_steps_match_one_process_of_the_same_modules(fmt, tiny_models, device, monkeypatch):
    """`--compile on`: decode steps through graphs compiled once for every call of their kind
    (inductor), on 2 stages with a mid-block cut: the first (calls any layout can use) runs its one
    whole block through the single block's graph and the cut block's attention half through that
    half's graph, the second (its own calls, `join_halves`) the cut block's MLP half and its two
    whole blocks as one call (2 blocks a call here, for the tiny model's 4 blocks), with batches of
    1-3 rows (every form of each graph: one row in place or through its pages, and any other number
    under a mask), against one process running the same modules eagerly. Float32 weights within
    float32 summation noise; quantized within the bf16 grid of the kernels' results. A stage's
    warm-up compiles every graph its steps call: the run compiles none (dynamo's own count of
    graphs). On a GPU the same steps take the static path too (its CUDA graphs' path, here eager);
    a CPU's static path under `--compile on` calls the same graph functions on steps of its own (2
    more graphs of each, ~30 s here), which test_launch_local.py's all-on switch combination runs."""
    monkeypatch.setattr(stage_module, "CALL_SIZES", (2,))
    path = tiny_models["llama"]
    config = models.load_config(path)
    weights = quant.WeightFormat.parse(fmt)
    reference = models.build_full_model(path, config, weights=weights)
    tol = QUANT_TOL if weights.quantized else 1e-4
    rng = random.Random(f"compile-{fmt}")
    n_units = models.num_units(config)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 30))] for _ in range(3)]
    requests = [Request(i, f"p{i}", tuple(p), max_new_tokens=8 + 4 * i, eos_ids=frozenset())
                for i, p in enumerate(prompts)]
    for static in (False,) if device == "cpu" else (False, True):
        runners = [StageRunner(path, config, range(a, b), weights=weights, compile="on", device=device,
                               kv_dtype="float32", join_halves=join) for a, b, join in ((0, 4, False), (4, n_units, True))]
        if device == "cpu":   # a block's graph and the cut block's half's; the MLP half with the blocks
            assert [r.decode_halves.graphs for r in runners] == [2, 1]
            assert [r.calls for r in runners] == [[(0,), (1, 2), (3,)], [(4, 5, 6, 7, 8), (9,)]]
        else:                 # a GPU stage replays CUDA graphs of its static step instead, and says so
            assert all("CUDA graphs" in r.compile_refused for r in runners)
        if device == "cpu":      # as a stage worker: its pool sized, then warmed up
            for runner in runners:
                runner.kv.allocate(POOL)
                stage_module.warm_up(runner, 16, print)
        graphs = compiled_graphs()
        results = run_inprocess(runners, requests, Slicing(lengths=(16,)).slices_for, max_batch=3,
                                keep_logits=True, static=static, pages=POOL)
        if device == "cpu":
            assert compiled_graphs() == graphs, "a decode step compiled a graph warm-up had not"
        assert_run_matches(reference, requests, results, tol)
