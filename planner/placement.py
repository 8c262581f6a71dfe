"""Experts where the memory is: a stage on a GPU whose memory cannot hold its share of a
mixture-of-experts model keeps the routed experts of its first MoE blocks in its host's RAM, run by
the host's CPU (llama.cpp's `--n-cpu-moe`, KTransformers), while attention, router, shared expert
and KV cache stay on the GPU. A plan says so per stage (`host_experts`).

The planner weighs it against cutting elsewhere: the cuts its search finds with memory unlimited,
each stage that cannot hold its units given as few host-RAM blocks as make it fit (each one's MoE
half then costs the CPU's measured time plus the rows' crossing both ways), against the cuts
memory allowed. A host CPU serves only where the profile measured it and it runs no stage itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hpipe import memory, models

__all__ = ["ExpertPlacement", "host_experts"]


@dataclass(frozen=True)
class ExpertPlacement:
    """Per stage, the units whose routed experts its host's CPU runs from the host's RAM."""

    units: dict[int, frozenset[int]]
    host_bytes: dict[int, int]            # per stage: the experts' bytes in the host's RAM

    def counts(self, n_stages: int) -> list[int]:
        return [len(self.units.get(j, ())) for j in range(n_stages)]


def host_experts(cost, config, cuts: list[int], capacity: np.ndarray, kv_tokens: int,
                 margin: float) -> ExpertPlacement | None:
    """The fewest MoE blocks per stage whose experts, kept in the host's RAM, let every stage of
    `cuts` fit its device (`capacity`: what the planner lets a device hold of weights and KV), or
    None where some stage cannot be made to fit that way."""
    if not models.is_moe(config):
        return None
    stage_ids = {e.id for e in cost.entries}
    ram: dict[str, float] = {}
    units, host_bytes = {}, {}
    for j in range(len(cuts) - 1):
        span = range(cuts[j], cuts[j + 1])
        if _device_bytes(cost, span, kv_tokens, frozenset()) <= capacity[j]:
            continue
        cpu = cost.host_cpu(j)
        if cost.entries[j].device == "cpu" or cpu is None or cpu.id in stage_ids:
            return None
        moved = _fewest(cost, config, span, kv_tokens, capacity[j])
        if moved is None:
            return None
        need = memory.stage_memory(cost.bytes, span, kv_tokens, 1, moved).host
        left = ram.setdefault(cpu.id, cpu.free_bytes * (1 - margin))
        if need > left:
            return None
        ram[cpu.id] = left - need
        units[j], host_bytes[j] = moved, need
    return ExpertPlacement(units, host_bytes) if units else None


def _device_bytes(cost, span: range, kv_tokens: int, moved: frozenset[int]) -> int:
    m = memory.stage_memory(cost.bytes, span, kv_tokens, 1, moved)
    return m.weights + m.kv


def _fewest(cost, config, span: range, kv_tokens: int, capacity: float) -> frozenset[int] | None:
    for count in range(1, len(models.moe_halves(config, span)) + 1):
        moved = models.host_expert_units(config, span, count)
        if _device_bytes(cost, span, kv_tokens, moved) <= capacity:
            return moved
    return None
