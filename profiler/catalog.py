"""Estimated profiles: a catalog of devices with their published peak throughput and memory
bandwidth, and roofline estimates of the same per-unit tables the profiler measures.

A unit's time is max(flops / (peak x compute efficiency), bytes / (bandwidth x memory efficiency))
plus a fixed per-unit overhead (kernel launches, Python). The efficiencies are typical achieved
fractions, not measurements: an estimated profile is marked `"source": "estimated"` and is meant
for planning hardware not at hand; measure (`hpipe profile --local`) when you have it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hpipe import models
from hpipe.errors import HpipeError


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    fp32_tflops: float
    fp16_tflops: float          # dense tensor-core (or FP16 ALU) peak with FP32 accumulation
    bandwidth_gbs: float        # memory bandwidth, GB/s
    memory_gib: float
    overhead_us: float = 40.0   # per unit: kernel launches and framework work


# Vendors' published figures (data sheets); CPU is a generic 8-core AVX2 desktop.
CATALOG = {
    "P100": DeviceSpec("NVIDIA Tesla P100 PCIe 16GB", 9.3, 18.7, 732, 16),
    "V100": DeviceSpec("NVIDIA Tesla V100 PCIe 32GB", 14.0, 112.0, 900, 32),
    "T4": DeviceSpec("NVIDIA T4", 8.1, 65.0, 320, 16),
    "RTX3090": DeviceSpec("NVIDIA GeForce RTX 3090", 35.6, 71.0, 936, 24),
    "RTX4090": DeviceSpec("NVIDIA GeForce RTX 4090", 82.6, 165.2, 1008, 24),
    "A10": DeviceSpec("NVIDIA A10", 31.2, 125.0, 600, 24),
    "L4": DeviceSpec("NVIDIA L4", 30.3, 121.0, 300, 24),
    "A100": DeviceSpec("NVIDIA A100 SXM4 80GB", 19.5, 312.0, 2039, 80),
    "H100": DeviceSpec("NVIDIA H100 SXM5 80GB", 67.0, 989.0, 3350, 80),
    "H20": DeviceSpec("NVIDIA H20 96GB", 44.0, 148.0, 4000, 96),
    "H200": DeviceSpec("NVIDIA H200 SXM 141GB", 67.0, 989.0, 4800, 141),
    "B200": DeviceSpec("NVIDIA B200 180GB", 80.0, 2250.0, 8000, 180),
    "CPU": DeviceSpec("generic 8-core x86-64 CPU (AVX2)", 0.6, 0.3, 50, 32, overhead_us=20.0),
}
# Links between devices of one host, one direction, GB/s (published; achieved is LINK_EFFICIENCY of it).
# PCIe is what a GPU reads a pinned host buffer at; NVLink what it reads a peer's memory at.
LINKS_GBS = {"pcie3": 16.0, "pcie4": 32.0, "pcie5": 64.0, "nvlink3": 300.0, "nvlink4": 450.0, "nvlink5": 900.0}
LINK_EFFICIENCY = 0.8
COMPUTE_EFFICIENCY = 0.55
MEMORY_EFFICIENCY = 0.75


def spec(name: str) -> DeviceSpec:
    key = name.upper().replace(" ", "").replace("-", "")
    if key not in CATALOG:
        raise HpipeError(f"unknown device type {name!r}; the catalog has {', '.join(CATALOG)}")
    return CATALOG[key]


def _dims(config):
    hidden = int(config.hidden_size)
    heads = int(config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    if config.model_type == "gpt2":
        inter = int(getattr(config, "n_inner", None) or 4 * hidden)
        mlp_mats = 2
    else:
        inter = int(config.intermediate_size)
        mlp_mats = 3
    return hidden, heads, head_dim, kv_heads, inter, mlp_mats, int(config.vocab_size)


def _expert_width(config) -> int:
    return int(getattr(config, "moe_intermediate_size", None) or config.intermediate_size)


def unit_cost(config, kind: str, s, c, elem: int, welem: float | None = None, kv_elem: int | None = None):
    """(flops, bytes moved) of one unit of `kind` for s tokens after c tokens of context (numpy-friendly);
    `welem`: bytes per weight when they differ from the activations' (quantized); `kv_elem`: bytes
    per KV-cache element (the plan's `kv_dtype`) when they differ."""
    welem = elem if welem is None else welem
    kv_elem = elem if kv_elem is None else kv_elem
    hidden, heads, head_dim, kv_heads, inter, mlp_mats, vocab = _dims(config)
    act = 4 * s * hidden * elem
    if kind == "embed":
        return 0.0 * s, 2 * s * hidden * elem
    if kind == "attn":
        qkv = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden
        flops = 2 * s * qkv + 4 * s * heads * head_dim * (c + (s + 1) / 2)
        return flops, qkv * welem + (c + s) * 2 * kv_heads * head_dim * kv_elem + act
    if kind == "mlp" and models.is_moe(config):
        # the router on every row, each row through its k experts (and a shared expert where the family
        # has one), and the weights of every distinct expert the s rows touch read once
        e, k, width = models.num_experts(config), models.experts_per_token(config), _expert_width(config)
        shared = int(getattr(config, "shared_expert_intermediate_size", 0) or 0)
        flops = 2 * s * hidden * (e + 3 * k * width + 3 * shared)
        weights = (models.expected_experts(config, s) * 3 * width + 3 * shared) * hidden * welem + e * hidden * elem
        return flops, weights + act
    if kind == "mlp":
        return 2 * s * mlp_mats * hidden * inter, mlp_mats * hidden * inter * welem + act
    if kind == "head":  # the final norm on all rows, the LM head on the sampled row
        return 2 * hidden * vocab + 0.0 * s, hidden * vocab * welem + s * hidden * elem
    raise ValueError(kind)


def link_gbs(name: str) -> float:
    """A catalog link's achievable one-direction bandwidth in GB/s."""
    key = name.lower().replace(" ", "").replace("-", "")
    if key not in LINKS_GBS:
        raise HpipeError(f"unknown link type {name!r}; the catalog has {', '.join(LINKS_GBS)}")
    return LINKS_GBS[key] * LINK_EFFICIENCY


def decode_unit_time(config, kind: str, rows, context, device: DeviceSpec, dtype: str, weights: str = "none",
                     kv_dtype: str | None = None):
    """Roofline estimate of one unit of `kind` in a decode step of `rows` sequences, each one new
    token after `context` tokens: the weights are read once for all rows, each row reads its own KV."""
    kv_elem = _elem(kv_dtype or dtype)
    flops, nbytes = unit_cost(config, kind, rows, 0, _elem(dtype), _welem(weights), kv_elem)
    if kind == "attn":
        hidden, heads, head_dim, kv_heads, *_ = _dims(config)
        flops = flops + 4 * rows * heads * head_dim * context
        nbytes = nbytes + rows * context * 2 * kv_heads * head_dim * kv_elem
    return _roofline(flops, nbytes, device, dtype)


DECODE_BATCHES = (1, 4, 16, 64, 256, 1024)


def estimated_decode_table(config, device: DeviceSpec, dtype: str, max_seq_len: int, weights: str = "none",
                           kv_dtype: str | None = None) -> dict:
    """The profile's decode table (seconds per unit kind at [batch][context]) from the roofline."""
    contexts = sorted({128, max_seq_len // 2, max_seq_len})
    return {"batch": list(DECODE_BATCHES), "context": contexts,
            "t": {kind: [[float(decode_unit_time(config, kind, b, c, device, dtype, weights, kv_dtype)) for c in contexts]
                         for b in DECODE_BATCHES] for kind in ("attn", "mlp", "head")}}


def _elem(dtype: str) -> int:
    return 4 if dtype == "float32" else 2


def _welem(weights: str) -> float | None:
    from hpipe import quant

    fmt = quant.WeightFormat.parse(weights, where="weights")
    return quant.packed_bytes(4096, 4096, fmt) / 4096 ** 2 if fmt.quantized else None


def _roofline(flops, nbytes, device: DeviceSpec, dtype: str):
    peak = (device.fp32_tflops if dtype == "float32" else device.fp16_tflops) * 1e12 * COMPUTE_EFFICIENCY
    bandwidth = device.bandwidth_gbs * 1e9 * MEMORY_EFFICIENCY
    return np.maximum(flops / peak, nbytes / bandwidth) + device.overhead_us * 1e-6


def unit_time(config, kind: str, s, c, device: DeviceSpec, dtype: str, weights: str = "none",
              kv_dtype: str | None = None):
    """Roofline estimate in seconds (s, c may be numpy arrays); quantized weights move fewer bytes
    (their packed size, `hpipe.quant.packed_bytes`) and compute at the activations' rate; the KV
    cache's reads are in `kv_dtype`'s elements (else `dtype`'s)."""
    return _roofline(*unit_cost(config, kind, s, c, _elem(dtype), _welem(weights), _elem(kv_dtype or dtype)),
                     device, dtype)
