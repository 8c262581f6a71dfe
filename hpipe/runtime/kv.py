"""The KV cache of one stage.

Storage, per attention layer: one tensor [slots, kv_heads, capacity, head_dim] for keys and one
for values, grown by doubling. A sequence owns a slot while it runs; a new sequence in a reused
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

    @property
    def end(self) -> int:
        return self.start + self.length


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

    def reserve(self, slots: int, capacity: int) -> None:
        """Makes room for slot indices < slots and positions < capacity in every layer."""
        new_slots, new_cap = self.slots, self.capacity
        while new_slots < slots:
            new_slots *= 2
        while new_cap < capacity:
            new_cap *= 2
        if (new_slots, new_cap) == (self.slots, self.capacity):
            return
        for store in (self.keys, self.values):
            for layer, old in store.items():
                grown = old.new_zeros((new_slots, old.shape[1], new_cap, old.shape[3]))
                grown[: old.shape[0], :, : old.shape[2]] = old
                store[layer] = grown
        self.slots, self.capacity = new_slots, new_cap

    def _layer(self, layer: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if layer not in self.keys:
            shape = (self.slots, like.shape[1], self.capacity, like.shape[3])
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
        self._slots = torch.tensor([s.slot for s in segments], device=store.device)
        self._max_end = max(s.end for s in segments)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        keys, values = self.store._layer(layer_idx, key_states)
        segs = self.segments
        if self.layout == "rows":
            for i, s in enumerate(segs):
                keys[s.slot, :, s.start:s.end] = key_states[i]
                values[s.slot, :, s.start:s.end] = value_states[i]
            if len(segs) == 1:
                s = segs[0]
                return keys[s.slot:s.slot + 1, :, : s.end], values[s.slot:s.slot + 1, :, : s.end]
            return (keys.index_select(0, self._slots)[:, :, : self._max_end],
                    values.index_select(0, self._slots)[:, :, : self._max_end])
        offset = 0
        for s in segs:
            keys[s.slot, :, s.start:s.end] = key_states[0, :, offset:offset + s.length]
            values[s.slot, :, s.start:s.end] = value_states[0, :, offset:offset + s.length]
            offset += s.length
        return (torch.cat([keys[s.slot, :, : s.end] for s in segs], dim=1).unsqueeze(0),
                torch.cat([values[s.slot, :, : s.end] for s in segs], dim=1).unsqueeze(0))

    # transformers' attention code may ask these of a cache object
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._max_end
