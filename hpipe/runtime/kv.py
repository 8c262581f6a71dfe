"""The KV cache of one stage.

Storage, per attention layer: one tensor [slots, capacity, kv_heads, head_dim] for keys and one
for values, grown by doubling (position-major, so that writing a micro-batch's new keys is one
indexed copy per layer whatever its size). A sequence owns a slot while it runs; a new sequence in a reused
slot simply overwrites from position 0, since a micro-batch only ever reads a sequence's keys up
to its own end.

`BatchCache` is what transformers' attention modules see as `past_key_values` for one micro-batch:
its `update(keys, values, layer_idx)` writes the new keys of every segment into their slots and
returns the keys and values attention must read, in the micro-batch's layout:
- "rows": every segment has the same length L (a decode step, or one prefill slice); hidden states
  are [n, L, H] and keys come back as [n, kv_heads, K, d] (K = longest context in the batch);
- "packed": segments of different lengths (mixed prefill and decode); hidden states are
  [1, T, H] and keys come back as every segment's context laid end to end, [1, kv_heads, sum K, d].
The attention mask built by `hpipe.runtime.stage.prepare_inputs` matches that layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Segment:
    """Tokens [start, start + length) of one sequence, processed in one micro-batch."""

    seq: int      # request index (stable over the run)
    slot: int     # KV-cache slot the sequence owns
    start: int    # tokens of this sequence already in the cache = position of the first token
    length: int
    sample: bool  # the segment ends at a position whose next token is sampled
    prefill: bool = False  # its tokens are the prompt's (else: tokens the pipeline generated)

    @property
    def end(self) -> int:
        return self.start + self.length


def microbatch_kind(segments: list[Segment]) -> str:
    """The one definition of a micro-batch's kind, the same on every stage (timelines, plan
    checks): "prefill" (prompt tokens only), "decode" (generated tokens only) or "mixed"."""
    kinds = {s.prefill for s in segments}
    if len(kinds) > 1:
        return "mixed"
    return "prefill" if True in kinds else "decode"


def layout_of(segments: list[Segment]) -> str:
    return "rows" if len({s.length for s in segments}) == 1 else "packed"


class KVStore:
    def __init__(self, device: str | torch.device, dtype: torch.dtype, slots: int = 4, capacity: int = 256):
        self.device = torch.device(device)
        self.dtype = dtype
        self.slots = slots
        self.capacity = capacity
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.frozen = False      # set once the run's clock starts: never grown (nor moved) after that

    def reserve(self, slots: int, capacity: int) -> None:
        """Makes room for slot indices < slots and positions < capacity in every layer."""
        new_slots, new_cap = self.slots, self.capacity
        while new_slots < slots:
            new_slots *= 2
        while new_cap < capacity:
            new_cap *= 2
        if (new_slots, new_cap) == (self.slots, self.capacity):
            return
        if self.frozen:
            raise RuntimeError(f"the KV cache was sized for {self.slots} slots x {self.capacity} positions before the "
                               f"run; a micro-batch needs {slots} x {capacity}")
        for store in (self.keys, self.values):
            for layer, old in store.items():
                grown = old.new_zeros((new_slots, new_cap, old.shape[2], old.shape[3]))
                grown[: old.shape[0], : old.shape[1]] = old
                store[layer] = grown
        self.slots, self.capacity = new_slots, new_cap

    def _layer(self, layer: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if layer not in self.keys:
            shape = (self.slots, self.capacity, like.shape[1], like.shape[3])
            self.keys[layer] = torch.zeros(shape, dtype=self.dtype, device=self.device)
            self.values[layer] = torch.zeros(shape, dtype=self.dtype, device=self.device)
        return self.keys[layer], self.values[layer]

    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for s in (self.keys, self.values) for t in s.values())


class BatchCache:
    """The `past_key_values` object for one micro-batch (duck-types transformers' Cache.update)."""

    def __init__(self, store: KVStore, segments: list[Segment]):
        self.store = store
        self.segments = segments
        self.layout = layout_of(segments)
        store.reserve(max(s.slot for s in segments) + 1, max(s.end for s in segments))
        dev = store.device
        self._max_end = max(s.end for s in segments)
        slots = [s.slot for s in segments]
        # rows whose slots are consecutive are read as a view, without a gather
        self._slot_range = (slots[0], slots[0] + len(slots)) if slots == list(range(slots[0], slots[0] + len(slots))) \
            else None
        self._slots = torch.tensor(slots, device=dev)
        if self.layout == "rows":
            length = segments[0].length
            self._write_slots = self._slots[:, None].expand(len(segments), length)
            self._write_pos = torch.tensor([s.start for s in segments], device=dev)[:, None] + \
                torch.arange(length, device=dev)[None, :]
        else:
            self._write_slots = torch.cat([torch.full((s.length,), s.slot, device=dev) for s in segments])[None]
            self._write_pos = torch.cat([torch.arange(s.start, s.end, device=dev) for s in segments])[None]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """key_states, value_states: [rows, kv_heads, tokens, head_dim] of the new tokens."""
        keys, values = self.store._layer(layer_idx, key_states)
        keys[self._write_slots, self._write_pos] = key_states.transpose(1, 2)
        values[self._write_slots, self._write_pos] = value_states.transpose(1, 2)
        segs = self.segments
        if self.layout == "rows":
            if self._slot_range is not None:
                a, b = self._slot_range
                k, v = keys[a:b, : self._max_end], values[a:b, : self._max_end]
            else:
                k, v = keys[self._slots, : self._max_end], values[self._slots, : self._max_end]
            return k.transpose(1, 2), v.transpose(1, 2)
        k = torch.cat([keys[s.slot, : s.end] for s in segs], dim=0)
        v = torch.cat([values[s.slot, : s.end] for s in segs], dim=0)
        return k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)

    # transformers' attention code may ask these of a cache object
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._max_end
