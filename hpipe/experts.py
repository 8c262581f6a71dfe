"""Routed experts: the arithmetic of a mixture-of-experts block's `experts` module, in its place
inside transformers' own MoE block (router, shared expert and the block's sum stay transformers').

A step's rows are grouped by the experts the router picked (a stable sort of the (row, slot)
pairs by expert), each picked expert runs once over its rows as one product (gate and up stacked,
then down), and an expert nobody picked is never read: a one-token decode reads its top-k experts'
bytes only, a 512-token prefill runs each expert once over its hundreds of rows.

An expert's matrices are float views of transformers' 3D parameters ([E, 2I, H] and [E, H, I], no
copy), or quantized linears (`hpipe.quantized`'s Int4Linear / Int8Linear) over one expert's slice of
tensors packed for all experts of the block at once (`pack_experts`): the cache maps one file per
unit, and each expert's module holds views into it.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["HostExperts", "RoutedExperts", "StackedInt4", "StackedInt8", "stacked", "in_graphs", "is_experts", "pack_experts",
           "quantized_experts", "float_experts"]


def is_experts(module: nn.Module) -> bool:
    """transformers' 3D-tensor experts module (gate and up merged, `use_experts_implementation`)."""
    p = getattr(module, "gate_up_proj", None)
    return isinstance(p, torch.Tensor) and p.dim() == 3 and getattr(module, "down_proj", None) is not None


class FloatExpert(nn.Module):
    """One expert of a float block: views of the block's merged parameters."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor):
        super().__init__()
        self.gate_up, self.down = gate_up, down      # plain attributes: views, owned by the block's tensors

    def project_in(self, x):
        return F.linear(x, self.gate_up)

    def project_out(self, h):
        return F.linear(h, self.down)


class QuantizedExpert(nn.Module):
    """One expert of a quantized block: gate and up as one linear (or two, where the file keeps them
    in different types), down as another."""

    def __init__(self, gate_up: list[nn.Module], down: nn.Module):
        super().__init__()
        self.gate_up = nn.ModuleList(gate_up)
        self.down = down

    def project_in(self, x):
        return self.gate_up[0](x) if len(self.gate_up) == 1 else torch.cat([m(x) for m in self.gate_up], -1)

    def project_out(self, h):
        return self.down(h)


class RoutedExperts(nn.Module):
    """Takes the place of transformers' experts module: forward(hidden [T, H], top_k_index [T, k],
    top_k_weights [T, k]) -> [T, H], the weighted sum of each row's picked experts.

    Where the block's experts are stacked for hpipe's routed kernels (`stacked`), a step of fewer
    rows than the experts' dense path starts at (`stacked_rows`: no expert then gets enough rows for
    it) is one kernel call per matrix for all of its (row, slot) pairs, grouped by expert inside
    the kernel: no read-back of the router's picks, so a compiled decode step holds the whole MoE
    half in its graph. Other steps group the pairs here and call each picked expert's modules."""

    def __init__(self, experts: list[nn.Module], act_fn, keep: tuple = (), stacked: dict | None = None,
                 stacked_rows: float = 0):
        super().__init__()
        self.experts = nn.ModuleList(experts)
        self.num_experts = len(experts)
        self.act_fn = act_fn
        self._keep = keep               # the tensors the experts' views point into
        self.stacked = nn.ModuleDict(stacked) if stacked else None
        self.stacked_rows = stacked_rows

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        rows = hidden_states.shape[0]
        if self.stacked is not None and rows < self.stacked_rows:
            return self._stacked(hidden_states, top_k_index, top_k_weights)
        if rows == 1:
            return self._one_row(hidden_states, top_k_index, top_k_weights)
        return self._grouped(hidden_states, top_k_index, top_k_weights)

    def _stacked(self, x, top_k_index, top_k_weights):
        ids = top_k_index.reshape(-1)
        if "gate_up" in self.stacked:
            gate_up = self.stacked["gate_up"](x, ids)
        else:
            gate_up = torch.cat([self.stacked["gate"](x, ids), self.stacked["up"](x, ids)], -1)
        gate, up = gate_up.to(x.dtype).chunk(2, dim=-1)
        y = self.stacked["down"](self.act_fn(gate) * up, ids).to(x.dtype)          # [T k, H]
        return (y.view(*top_k_index.shape, -1) * top_k_weights.to(x.dtype).unsqueeze(-1)).sum(1)

    def _grouped(self, hidden_states, top_k_index, top_k_weights):
        k = top_k_index.shape[-1]
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)               # (row, slot) pairs grouped by expert
        rows = order // k
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()      # one read-back a block
        x = hidden_states.index_select(0, rows)
        out = torch.empty_like(x)
        start = 0
        for e, n in enumerate(counts):
            if n:
                expert = self.experts[e]
                gate, up = expert.project_in(x[start:start + n]).to(x.dtype).chunk(2, dim=-1)
                out[start:start + n] = expert.project_out(self.act_fn(gate) * up).to(x.dtype)
                start += n
        out.mul_(top_k_weights.reshape(-1).index_select(0, order).to(out.dtype)[:, None])
        return torch.zeros_like(hidden_states).index_add_(0, rows, out)

    def _one_row(self, x, top_k_index, top_k_weights):
        """A one-token decode step of experts not stacked for the routed kernels: its k experts in
        the router's order, no sorting or gathering (they cost ~0.3 ms a block here, a quarter of
        the experts' own time)."""
        weights = top_k_weights.to(x.dtype)
        out = None
        for slot, e in enumerate(top_k_index[0].tolist()):
            expert = self.experts[e]
            gate, up = expert.project_in(x).to(x.dtype).chunk(2, dim=-1)
            y = expert.project_out(self.act_fn(gate) * up).to(x.dtype) * weights[:, slot:slot + 1]
            out = y if out is None else out.add_(y)
        return out


class HostExperts(nn.Module):
    """A block's routed experts kept in the host's RAM and run on its CPU for a stage on another
    device (a plan's `host_experts`; llama.cpp's --n-cpu-moe): the step's rows and the router's
    picks cross to the host, the weighted sum comes back; the router, the shared expert and the KV
    cache stay on the stage's device. On a CPU stage the crossings are no-ops."""

    def __init__(self, routed: RoutedExperts):
        super().__init__()
        self.routed = routed

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        host = self.routed(hidden_states.to("cpu"), top_k_index.to("cpu"), top_k_weights.to("cpu"))
        return host.to(hidden_states.device)


def in_graphs(mlp: nn.Module) -> bool:
    """Whether a block's MLP module runs inside a compiled decode graph: any but a MoE block whose
    experts are not stacked for the routed kernels (those read the router's picks back to choose
    modules, which a graph cannot follow)."""
    routed = getattr(mlp, "experts", None)
    routed = routed.routed if isinstance(routed, HostExperts) else routed
    return not isinstance(routed, RoutedExperts) or routed.stacked is not None


def float_experts(module: nn.Module) -> RoutedExperts:
    """transformers' float experts module -> the routed form over views of its own parameters."""
    gate_up, down = module.gate_up_proj, module.down_proj
    experts = [FloatExpert(gate_up[e], down[e]) for e in range(gate_up.shape[0])]
    return RoutedExperts(experts, module.act_fn, keep=(gate_up, down))


def pack_experts(gate: list, up: list, down: list, fmt, device_type: str) -> dict[str, torch.Tensor]:
    """Each expert's matrices (`quant.Affine` codes as the file keeps them, or float arrays) -> the
    packed tensors of all experts stacked on a leading dimension, under `<part>.<tensor>`:
    {'gate_up.int4': [E, ...], ...}, `gate_up` where gate and up pack alike, else `gate` and `up`."""
    from hpipe import quant

    stacked = [quant.stack_rows([g, u]) for g, u in zip(gate, up)]
    parts = {"gate_up": stacked} if all(s is not None for s in stacked) else {"gate": gate, "up": up}
    parts["down"] = down
    out = {}
    for name, mats in parts.items():
        packed = [quant.pack(m, fmt, device_type) for m in mats]
        for key in packed[0]:
            out[f"{name}.{key}"] = torch.stack([p[key] for p in packed])
    return out


def quantized_experts(tensors: dict[str, torch.Tensor], act_fn, device) -> RoutedExperts:
    """The routed experts over `pack_experts`' tensors (moved to `device` once, then viewed per expert,
    and stacked for the routed kernels where the experts run hpipe's CPU kernels: `stacked`)."""
    from hpipe import quantized

    parts = {}
    for key, t in tensors.items():
        name, _, field = key.partition(".")
        parts.setdefault(name, {})[field] = t.to(device)
    n = next(iter(parts["down"].values())).shape[0]

    def linear(name: str, e: int):
        return quantized.linear_module({f: t[e] for f, t in parts[name].items()}, device)

    experts = [QuantizedExpert([linear(p, e) for p in ("gate_up", "gate", "up") if p in parts], linear("down", e))
               for e in range(n)]
    modules = {"down": [e.down for e in experts]}
    for i, name in enumerate(p for p in ("gate_up", "gate", "up") if p in parts):
        modules[name] = [e.gate_up[i] for e in experts]
    together = {name: stacked(mods) for name, mods in modules.items()}
    if any(m is None for m in together.values()):
        together = {}
    rows = min((m.dense_from for mods in modules.values() for m in mods[:1]), default=0)
    return RoutedExperts(experts, act_fn, keep=tuple(t for p in parts.values() for t in p.values()),
                         stacked=together, stacked_rows=rows if together else 0)


class StackedInt4(nn.Module):
    """One matrix of all of a block's experts in int4 (`Int4Linear`'s tensors of each, stacked on a
    leading dimension), multiplied by the routed kernel for a step's (row, slot) pairs at once."""

    def __init__(self, packed: torch.Tensor, scales_zeros: torch.Tensor, group: int):
        super().__init__()
        self.register_buffer("packed", packed, persistent=False)
        self.register_buffer("scales_zeros", scales_zeros, persistent=False)
        self.group = group

    def forward(self, x, ids):
        return torch.ops.hpipe.int4_mm_experts(x, self.packed, self.scales_zeros, self.group, ids)


class StackedInt8(nn.Module):
    """`StackedInt4` for int8 experts (`Int8Linear`'s weight and scales, per row or per block)."""

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor):
        super().__init__()
        self.register_buffer("weight", weight, persistent=False)
        self.register_buffer("scales", scales, persistent=False)

    def forward(self, x, ids):
        return torch.ops.hpipe.int8_mm_experts(x, self.weight, self.scales, ids)


def stacked(modules: list[nn.Module]) -> nn.Module | None:
    """The experts' modules of one matrix as one stacked module for the routed kernels, or None where
    they do not all run hpipe's CPU kernels, without a bias, on their slices of one stacked tensor
    in place (each expert's module a view of expert e of it: the stacking is no copy)."""
    from hpipe.quantized import Int4Linear, Int8Linear

    m = modules[0]
    if getattr(m, "mm", None) != getattr(m, "_vnni_mm", None) or m.bias is not None:
        return None
    if isinstance(m, Int4Linear):
        cls, fields = StackedInt4, ("packed", "scales_zeros")
    elif isinstance(m, Int8Linear):
        cls, fields = StackedInt8, ("weight", "scales")
    else:
        return None
    tensors = [getattr(m, f) for f in fields]
    together = [t.as_strided((len(modules), *t.shape), (t.numel(), *t.stride())) for t in tensors]
    if not all(type(mod) is type(m) and getattr(mod, f).data_ptr() == s[e].data_ptr()
               and getattr(mod, f).is_contiguous() and getattr(mod, f).shape == t.shape
               for e, mod in enumerate(modules) for f, s, t in zip(fields, together, tensors)):
        return None
    return StackedInt4(*together, m.group) if cls is StackedInt4 else StackedInt8(*together)
