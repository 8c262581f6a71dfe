"""Routed experts: the arithmetic of a mixture-of-experts block's `experts` module, in its place
inside transformers' own MoE block (router, shared expert and the block's sum stay transformers').

A step's rows are grouped by the experts the router picked (a stable sort of the (row, slot)
pairs by expert), each picked expert runs once over its rows as one product (gate and up stacked,
then down), and an expert nobody picked is never read: a one-token decode reads its top-k experts'
bytes only, a 512-token prefill runs each expert once over its hundreds of rows.

An expert's matrices are float views of transformers' 3D parameters ([E, 2I, H] and [E, H, I], no
copy), or quantized linears (`hpipe.quant`'s Int4Linear / Int8Linear) over one expert's slice of
tensors packed for all experts of the block at once (`pack_experts`): the cache maps one file per
unit, and each expert's module holds views into it.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["RoutedExperts", "is_experts", "pack_experts", "quantized_experts", "float_experts"]


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
    top_k_weights [T, k]) -> [T, H], the weighted sum of each row's picked experts."""

    def __init__(self, experts: list[nn.Module], act_fn, keep: tuple = ()):
        super().__init__()
        self.experts = nn.ModuleList(experts)
        self.num_experts = len(experts)
        self.act_fn = act_fn
        self._keep = keep               # the tensors the experts' views point into
        self.fused: Fused | None = None

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        if hidden_states.shape[0] == 1:
            return self._one_row(hidden_states, top_k_index, top_k_weights)
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
        """A one-token decode step: its k experts in the router's order, no sorting or gathering
        (they cost ~0.3 ms a block here, a quarter of the experts' own time); where the experts run
        hpipe's CPU kernels on the block's stacked tensors, all k in one call per matrix (`Fused`)."""
        weights = top_k_weights.to(x.dtype)
        if self.fused is not None:
            gate, up = self.fused.project_in(x, top_k_index[0]).to(x.dtype).chunk(2, dim=-1)
            ys = self.fused.project_out(self.act_fn(gate) * up, top_k_index[0]).to(x.dtype)
            rows = [ys[slot:slot + 1] * weights[:, slot:slot + 1] for slot in range(ys.shape[0])]
        else:
            rows = []
            for slot, e in enumerate(top_k_index[0].tolist()):
                expert = self.experts[e]
                gate, up = expert.project_in(x).to(x.dtype).chunk(2, dim=-1)
                rows.append(expert.project_out(self.act_fn(gate) * up).to(x.dtype) * weights[:, slot:slot + 1])
        out = rows[0]
        for y in rows[1:]:          # the slots in order, as the loop above sums them: the same bits
            out = out.add_(y)
        return out


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
    """The routed experts over `pack_experts`' tensors (moved to `device` once, then viewed per expert)."""
    from hpipe import quant

    parts = {}
    for key, t in tensors.items():
        name, _, field = key.partition(".")
        parts.setdefault(name, {})[field] = t.to(device)
    n = next(iter(parts["down"].values())).shape[0]

    def linear(name: str, e: int):
        return quant.linear_module({f: t[e] for f, t in parts[name].items()}, device)

    experts = [QuantizedExpert([linear(p, e) for p in ("gate_up", "gate", "up") if p in parts], linear("down", e))
               for e in range(n)]
    routed = RoutedExperts(experts, act_fn, keep=tuple(t for p in parts.values() for t in p.values()))
    routed.fused = Fused.of(parts, experts)
    return routed


class Fused:
    """A block's experts through hpipe's CPU kernels, all of a step's picks in one call per matrix
    (`cpu_kernels.int4_mm_experts` / `int8_mm_experts`): one parallel region where a call per expert
    made k. Only where every expert's module runs those kernels on its slice of the stacked tensors
    in place (`of`)."""

    def __init__(self, calls: dict):
        self.calls = calls              # part -> function(x, ids, shared) -> float32 [len(ids), N]

    @classmethod
    def of(cls, parts: dict, experts: list[QuantizedExpert]) -> "Fused | None":
        from hpipe import cpu_kernels, quant

        Int4Linear, Int8Linear = quant.classes()[:2]
        if cpu_kernels.kernels()[0] is None:
            return None
        modules = {"down": [e.down for e in experts]}
        for i, name in enumerate(p for p in ("gate_up", "gate", "up") if p in parts):
            modules[name] = [e.gate_up[i] for e in experts]
        calls = {}
        for name, mods in modules.items():
            m = mods[0]
            if getattr(m, "mm", None) != getattr(m, "_vnni_mm", None) or m.bias is not None:
                return None
            tensors = (m.packed, m.scales_zeros) if isinstance(m, Int4Linear) else (m.weight, m.scales)
            stacked = [t.as_strided((len(mods), *t.shape), (t.numel(), *t.stride())) for t in tensors]
            fields = ("packed", "scales_zeros") if isinstance(m, Int4Linear) else ("weight", "scales")
            in_place = all(getattr(mod, f).data_ptr() == s[e].data_ptr() and getattr(mod, f).is_contiguous()
                           for e, mod in enumerate(mods) for f, s in zip(fields, stacked))
            if not in_place:
                return None
            if isinstance(m, Int4Linear):
                calls[name] = (lambda x, ids, shared, t=stacked, g=m.group:
                               cpu_kernels.int4_mm_experts(x, t[0], t[1], g, ids, shared))
            elif isinstance(m, Int8Linear):
                calls[name] = (lambda x, ids, shared, t=stacked:
                               cpu_kernels.int8_mm_experts(x, t[0], t[1], ids, shared))
            else:
                return None
        return cls(calls)

    def project_in(self, x, ids):
        if "gate_up" in self.calls:
            return self.calls["gate_up"](x, ids, True)
        return torch.cat([self.calls["gate"](x, ids, True), self.calls["up"](x, ids, True)], -1)

    def project_out(self, h, ids):
        return self.calls["down"](h, ids, False)
