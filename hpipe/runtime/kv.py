"""The KV cache of one stage: fixed-size pages from one pool (gLLM §3.3, vLLM's paged attention).

Storage, per attention layer: one tensor [kv_heads, pages, page_size, head_dim] for keys and one
for values, head-major, so that each head's context is contiguous where attention reads it: torch's
CPU flash kernel packs every block of keys it multiplies, and a position-major pool ([pages,
page_size, kv_heads, head_dim]) made that a strided gather (a decode step's attention, one thread,
SmolLM2's 9/3 heads: 50 -> 40 us a layer at 320 positions, 197 -> 147 at 1,000; the 1B shape's
32/8 at 2 threads: 74 -> 61, 266 -> 207). Which page holds which position is
`hpipe.runtime.pages`' bookkeeping; here a flat index `page * page_size + row` addresses a
position in the layer's [kv_heads, pages * page_size, head_dim] view: writing a micro-batch's
new keys is one `index_copy_` per layer, reading a sequence's context one `index_select`. A
segment without pages (profiling, benchmarks, unit tests) uses the store's own table per slot,
grown on demand, which gives the old one-slot-per-sequence behaviour.

`BatchCache` is what transformers' attention modules see as `past_key_values` for one micro-batch:
its `update(keys, values, layer_idx)` writes the new keys of every segment into their pages and
returns the keys and values attention must read, in the micro-batch's layout:
- "rows": every segment has the same length L (a decode step, or one prefill slice); hidden states
  are [n, L, H] and keys come back as [n, kv_heads, K, d] (K = longest context in the batch);
- "packed": segments of different lengths (mixed prefill and decode); hidden states are
  [1, T, H] and keys come back as every segment's context laid end to end, [1, kv_heads, sum K, d].
The attention mask built by `hpipe.runtime.stage.prepare_inputs` matches that layout.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from hpipe.runtime.pages import SCRATCH_PAGE, Segment, layout_of, pages_needed

__all__ = ["BatchCache", "KVStore", "LayerKV", "flat_positions", "read_as"]


class KVStore:
    def __init__(self, device: str | torch.device, dtype: torch.dtype, page_size: int, pages: int = 64,
                 read_dtype: torch.dtype | None = None):
        """dtype: the pages' elements (the plan's `kv_dtype`); new keys are rounded to it as they are
        written. read_dtype: what attention reads, where its implementation cannot take the pages'
        dtype under the activations' (eager, --deterministic): a copy of the context per layer,
        where SDPA (`hpipe.runtime.stage.decode_sdpa`) reads 16-bit pages as they are."""
        self.device = torch.device(device)
        self.dtype = dtype
        self.read_dtype = read_dtype if read_dtype != dtype else None
        self.page_size = page_size
        self.pages = pages
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.own: dict[int, list[int]] = {}      # slot -> pages, for segments that carry none
        self.own_next = 1                        # the next page the own tables take (page 0 is scratch)
        self.frozen = False      # set once the run's clock starts: never grown (nor moved) after that
        self.static_page_shape = False

    def allocate(self, pages: int) -> None:
        """Sizes the pool to `pages` pages in every layer (before the run: layers that exist are moved)."""
        if pages == self.pages:
            return
        if self.frozen:
            raise RuntimeError(f"the KV pool was sized to {self.pages} pages before the run; asked for {pages}")
        with torch.inference_mode(False):
            for store in (self.keys, self.values):
                for layer, old in store.items():
                    new = old.new_zeros((old.shape[0], pages, *old.shape[2:]))
                    n = min(pages, self.pages)
                    new[:, :n] = old[:, :n]
                    store[layer] = new
        self.pages = pages

    def pages_of(self, seg: Segment) -> list[int] | tuple[int, ...]:
        if seg.pages:
            return seg.pages
        row = self.own.setdefault(seg.slot, [])
        need = pages_needed(seg.end, self.page_size)
        if len(row) < need:
            extra = need - len(row)
            if self.own_next + extra > self.pages:
                size = self.pages
                while self.own_next + extra > size:
                    size *= 2
                self.allocate(size)
            row.extend(range(self.own_next, self.own_next + extra))
            self.own_next += extra
        return row

    def _layer(self, layer: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if layer not in self.keys:
            shape = (like.shape[1], self.pages, self.page_size, like.shape[3])
            with torch.inference_mode(False):    # plain tensors, which a compiled decode step may write
                self.keys[layer] = torch.zeros(shape, dtype=self.dtype, device=self.device)
                self.values[layer] = torch.zeros(shape, dtype=self.dtype, device=self.device)
        return self.keys[layer], self.values[layer]

    def keep_page_shape_static(self) -> None:
        """Tells torch.compile, while it traces a graph (`static_while_traced`), that the KV heads, a
        page's tokens and the head size (dims 0, 2 and 3 of every layer's tensors) never change; the
        number of pages may (warm-up's pool is smaller than a run's: with the pool's length one
        dynamic dim, pages times tokens, the graphs `hpipe warmup` compiled missed a run's pool and
        compiled again, 17 s at its start). Compiled decode steps read the pool. With those dims
        dynamic, dynamo's duck shaping gave a batch's row count the symbol of an equal one (3 rows
        and SmolLM2's 3 KV heads) and baked it in with that one: a graph traced at 3 rows guarded
        rows == 3, and every other batch size compiled again mid-run (5-10 s a graph here)."""
        self.static_page_shape = True

    @contextmanager
    def static_while_traced(self):
        """The marks `keep_page_shape_static` promises, on every layer's tensors while a graph is
        traced, and gone after: a graph saved to disk keeps no marks in its guards, and a guard made
        without them refuses a tensor that has them (`hpipe.runtime.graphs`)."""
        tensors = [*self.keys.values(), *self.values.values()] if self.static_page_shape else []
        for t in tensors:
            for dim in (0, 2, 3):
                torch._dynamo.mark_static(t, dim)
        try:
            yield
        finally:
            for t in tensors:
                for attr in ("_dynamo_static_indices", "_has_dynamo_dim_marking", "_dynamo_marked_static"):
                    if hasattr(t, attr):
                        delattr(t, attr)

    def bytes(self) -> int:
        """(Read by the stage's pulse thread too, while the first forward may add layers: a copy.)"""
        return sum(t.numel() * t.element_size() for s in (self.keys, self.values) for t in list(s.values()))


def flat_positions(pages: torch.Tensor, page_size: int) -> torch.Tensor:
    """[..., n_pages] page numbers -> [..., n_pages * page_size] flat row indices, in position order."""
    rows = pages[..., None] * page_size + torch.arange(page_size, device=pages.device)
    return rows.flatten(-2)


def read_as(store: KVStore, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's context as its attention reads it (`KVStore.read_dtype`)."""
    if store.read_dtype is None:
        return keys, values
    return keys.to(store.read_dtype), values.to(store.read_dtype)


class BatchCache:
    """The `past_key_values` object for one micro-batch (duck-types transformers' Cache.update)."""

    def __init__(self, store: KVStore, segments: list[Segment]):
        self.store = store
        self.segments = segments
        self.rows = len(segments)
        self.layout = layout_of(segments)
        P, dev = store.page_size, store.device
        tables = [store.pages_of(s) for s in segments]
        self._max_end = max(s.end for s in segments)
        width = pages_needed(self._max_end, P)
        # one sequence whose pages lie in order (a lone stream: the pool hands pages out in order):
        # attention reads its context where it lies, a view, instead of a gathered copy per layer
        first = tables[0][0] if len(segments) == 1 and tables[0] else 0
        self._span = first * P if first and list(tables[0][:width]) == list(range(first, first + width)) else None
        # the new rows' places from host ints (a decode step writes one row a sequence: one small
        # tensor, where tensor arithmetic over the page tables took most of a step's preparation)
        self._write = torch.tensor([t[p // P] * P + p % P for t, s in zip(tables, segments)
                                    for p in range(s.start, s.end)], dtype=torch.long, device=dev)
        self._read = None
        if self._span is None:
            padded = torch.tensor([list(t[:width]) + [SCRATCH_PAGE] * (width - len(t[:width])) for t in tables],
                                  dtype=torch.long, device=dev)
            flat = flat_positions(padded, P)                                   # [n, width * P]
            self._read = flat[:, : self._max_end].flatten() if self.layout == "rows" else \
                torch.cat([flat[i, : s.end] for i, s in enumerate(segments)])

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """key_states, value_states: [rows, kv_heads, tokens, head_dim] of the new tokens."""
        return self.write_read(*self.store._layer(layer_idx, key_states), key_states, value_states)

    def layer(self, layer_idx: int) -> "LayerKV":
        return LayerKV(self, self.store.keys[layer_idx], self.store.values[layer_idx])

    def write_read(self, keys: torch.Tensor, values: torch.Tensor, key_states: torch.Tensor,
                   value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Writes the new keys and values into one layer's pages; returns what its attention reads."""
        heads, d = keys.shape[0], keys.shape[3]
        keys, values = keys.view(heads, -1, d), values.view(heads, -1, d)
        keys.index_copy_(1, self._write, key_states.transpose(0, 1).reshape(heads, -1, d).to(keys.dtype))
        values.index_copy_(1, self._write, value_states.transpose(0, 1).reshape(heads, -1, d).to(values.dtype))
        if self._span is not None:            # one sequence: [1, heads, K, d] in place
            return read_as(self.store, keys[None, :, self._span:self._span + self._max_end],
                           values[None, :, self._span:self._span + self._max_end])
        k, v = read_as(self.store, keys.index_select(1, self._read), values.index_select(1, self._read))
        if self.layout == "rows":
            return (k.view(heads, self.rows, self._max_end, d).transpose(0, 1),
                    v.view(heads, self.rows, self._max_end, d).transpose(0, 1))
        return k.unsqueeze(0), v.unsqueeze(0)

    # transformers' attention code may ask these of a cache object
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._max_end


class LayerKV:
    """One attention layer's part of a micro-batch's cache (a `BatchCache` or a static step's
    `StaticKV`), that layer's K/V tensors bound: the `past_key_values` of a compiled attention half.
    transformers passes the layer's index to `update`; a graph that every block shares must not read
    it (it would be baked in as a constant), so this object ignores it."""

    def __init__(self, cache, keys: torch.Tensor, values: torch.Tensor):
        self.cache, self.keys, self.values = cache, keys, values

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        return self.cache.write_read(self.keys, self.values, key_states, value_states)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.cache.get_seq_length()
