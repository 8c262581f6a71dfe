"""The one memory model of a stage: what the planner fits into a device, what `hpipe plan
--compare` reports, and what the launch preflight checks against a host's free memory.

    stage memory = weights of its units
                 + KV cache of its attention units for `kv_tokens` tokens (sequence length x sequences)
                 + activation buffers: ACTIVATION_BUFFERS hidden-state buffers of the longest
                   micro-batch (`microbatch_tokens` tokens) at the widest cut

The byte counts per unit (`formats.UnitBytes`) come from `hpipe.models.unit_bytes` (a profile
carries the same table under "bytes"). A stage's routed experts kept in the host's RAM (a plan's `host_experts`) count
there, not on its device. Four buffers: the received hidden states, the stage's output, one send still in
flight, and room for the forward's own intermediates of the same size.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hpipe.formats import UnitBytes

__all__ = ["ACTIVATION_BUFFERS", "StageMemory", "activation_bytes", "microbatch_tokens", "stage_memory",
           "unit_memory"]

ACTIVATION_BUFFERS = 4


@dataclass(frozen=True)
class StageMemory:
    weights: int
    kv: int
    activations: int
    host: int = 0        # routed experts kept in the host's RAM (a plan's `host_experts`), not on the device

    @property
    def total(self) -> int:
        """What the stage's device holds."""
        return self.weights + self.kv + self.activations


def unit_memory(unit_bytes: UnitBytes, kv_tokens: int) -> np.ndarray:
    """[U] bytes per unit: its weights and its KV cache for kv_tokens tokens (the planner's DP
    adds these up per stage)."""
    return (np.asarray(unit_bytes.weights_per_unit, dtype=float)
            + np.asarray(unit_bytes.kv_per_token_per_unit, dtype=float) * kv_tokens)


def activation_bytes(activation_per_token_at_cut: tuple[int, ...], microbatch_tokens: int) -> int:
    """The activation buffers of any stage (`UnitBytes.activation_per_token_at_cut`, or
    `models.token_bytes`'s): the same bound wherever its cuts fall."""
    return int(ACTIVATION_BUFFERS * microbatch_tokens * max(activation_per_token_at_cut))


def stage_memory(unit_bytes: UnitBytes, units: range, kv_tokens: int, microbatch_tokens: int,
                 host_units: frozenset[int] = frozenset()) -> StageMemory:
    """host_units: the units whose routed experts stay in the host's RAM (`models.host_expert_units`)."""
    host = int(sum(unit_bytes.experts_per_unit[u] for u in host_units)) if host_units else 0
    return StageMemory(
        weights=int(sum(unit_bytes.weights_per_unit[u] for u in units)) - host,
        kv=int(sum(unit_bytes.kv_per_token_per_unit[u] for u in units) * kv_tokens),
        activations=activation_bytes(unit_bytes.activation_per_token_at_cut, microbatch_tokens), host=host)


def microbatch_tokens(slices: list[int], decode_batch: int = 1) -> int:
    """The longest micro-batch a stage receives: a prompt slice, or one decode token per sequence
    of a decode group."""
    return max([*slices, decode_batch, 1])
