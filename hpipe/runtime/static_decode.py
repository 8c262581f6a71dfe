"""Decode steps with static shapes: the path CUDA graphs replay (SiPipe's TSEM, §5.2).

A decode micro-batch of n sequences (one new token each) is padded to the next batch size in
`BATCH_SIZES` and run through the stage's units with every shape fixed:
- the inputs live in persistent buffers, one set per *version* (two): token ids or hidden states,
  positions, the KV write and read indices and the attention masks. The CPU executor fills version
  1-v while version v computes;
- attention reads each row's KV pages over the whole capacity (a fixed number of pages per row, its
  page table padded with the scratch page) with a mask (key position <= the row's position, within
  its sliding window), through transformers' own attention modules, so the result is the dynamic
  path's up to float summation order;
- padded rows point at the scratch page (page 0) at position 0.

On CUDA, `capture()` records one graph per (version, padded batch size) bound to that version's
buffers, before the clock starts; `run()` replays it. The buffers are filled from pinned host
memory on a copy stream that waits for the last replay of the same version (its `done` event), and
a replay waits for its version's copy (`ready`): the write-after-read hazard of SiPipe §3.2 is
excluded by these two events, not by synchronising the host. On a CPU the same code runs eagerly.

With `--compile on` the stage's halves run compiled inside the step as in any decode step
(`hpipe.runtime.stage.CompiledHalves`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hpipe import models
from hpipe.runtime.kv import KVStore, LayerKV, flat_positions, read_as
from hpipe.runtime.pages import SCRATCH_PAGE, Segment, pages_needed
from hpipe.runtime.stage import StageInputs

__all__ = ["BATCH_SIZES", "StaticDecode", "StaticKV", "unsupported"]

BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
VERSIONS = 2


class StaticKV:
    """`past_key_values` of a static decode step: writes each row's new key at its position's page,
    reads each row's whole page table [capacity] (the mask hides what is not its own)."""

    def __init__(self, store: KVStore, tables: torch.Tensor, write_pos: torch.Tensor):
        self.store = store
        rows = flat_positions(tables, store.page_size)                     # [B, capacity], on the device
        self.read = rows.flatten()
        self.write = rows.gather(1, write_pos[:, None]).flatten()
        self.rows, self.capacity = rows.shape

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """key_states: [rows, kv_heads, 1, head_dim]. Returns [rows, kv_heads, capacity, head_dim]."""
        return self.write_read(*self.store._layer(layer_idx, key_states), key_states, value_states)

    def layer(self, layer_idx: int) -> LayerKV:
        return LayerKV(self, self.store.keys[layer_idx], self.store.values[layer_idx])

    def write_read(self, keys, values, key_states, value_states):
        heads, d = keys.shape[0], keys.shape[3]
        keys, values = keys.view(heads, -1, d), values.view(heads, -1, d)
        keys.index_copy_(1, self.write, key_states[:, :, 0].transpose(0, 1).to(keys.dtype))
        values.index_copy_(1, self.write, value_states[:, :, 0].transpose(0, 1).to(values.dtype))
        k, v = read_as(self.store, keys.index_select(1, self.read), values.index_select(1, self.read))
        return (k.view(heads, self.rows, self.capacity, d).transpose(0, 1),
                v.view(heads, self.rows, self.capacity, d).transpose(0, 1))

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.capacity


@dataclass
class Buffers:
    """One version's inputs, sized for the largest padded batch."""

    x: torch.Tensor                 # token ids [B] (first stage) or hidden states [B, H]
    positions: torch.Tensor         # [B, 1]
    tables: torch.Tensor            # [B, pages per row] each row's KV pages (scratch-padded)
    masks: dict                     # sliding window (None = full) -> [B, 1, 1, capacity] attention mask
    host: dict                      # pinned host copies of positions, tables and masks (CUDA)


def padded_size(n: int) -> int:
    return next(b for b in BATCH_SIZES if b >= n)


def unsupported(runner) -> str | None:
    """Why a stage cannot take the static path, or None. RoPE variants that rescale with the
    sequence length ("dynamic", "longrope") read positions back to the host, which a graph cannot."""
    if runner.deterministic:
        return "--deterministic on: a row attends to its own keys alone, not to padded slots under a mask"
    rope = getattr(runner.rotary, "rope_type", "default") if runner.rotary is not None else "default"
    if rope in ("dynamic", "longrope"):
        return f"its {rope} RoPE reads positions back to the host"
    if runner.device.type == "cuda" and models.is_moe(runner.config):
        return "a mixture of experts' work depends on the router's picks, which a replayed CUDA graph cannot follow"
    if runner.attn_implementation != "sdpa":
        return f"attention {runner.attn_implementation!r} (the static path uses sdpa's boolean masks)"
    return None


class StaticDecode:
    def __init__(self, runner, max_batch: int, graphs: bool, max_len: int):
        """runner: the stage's StageRunner, its KV pool already sized (not grown after this);
        max_len: the longest sequence (prompt and output) a row may hold."""
        self.runner = runner
        self.width = pages_needed(max_len, runner.kv.page_size)      # pages per row
        self.capacity = self.width * runner.kv.page_size
        self.max_rows = padded_size(min(max_batch, BATCH_SIZES[-1]))
        self.cuda = runner.device.type == "cuda"
        self.graphs = graphs and self.cuda
        self.buffers = [self._allocate() for _ in range(VERSIONS)]
        self.graph: dict[tuple[int, int], tuple] = {}      # (version, rows) -> (graph, output)
        self.row_ids = torch.arange(self.max_rows, device=runner.device)
        if self.cuda:
            self.copy_stream = torch.cuda.Stream(runner.device)
            self.ready = [torch.cuda.Event() for _ in range(VERSIONS)]
            self.done = [torch.cuda.Event() for _ in range(VERSIONS)]

    def _allocate(self) -> Buffers:
        r, b, dev = self.runner, self.max_rows, self.runner.device
        x = torch.zeros(b, dtype=torch.long, device=dev) if r.first else \
            torch.zeros(b, r.hidden_size, dtype=r.dtype, device=dev)
        masks = {w: torch.zeros(b, 1, 1, self.capacity, dtype=torch.bool, device=dev) for w in r.windows}
        buf = Buffers(x, torch.zeros(b, 1, dtype=torch.long, device=dev),
                      torch.full((b, self.width), SCRATCH_PAGE, dtype=torch.long, device=dev), masks, {})
        if self.cuda:
            buf.host = {"positions": torch.zeros(b, 1, dtype=torch.long).pin_memory(),
                        "tables": torch.zeros(b, self.width, dtype=torch.long).pin_memory(),
                        "masks": {w: torch.zeros(b, 1, 1, self.capacity, dtype=torch.bool).pin_memory()
                                  for w in r.windows}}
        return buf

    def accepts(self, segments: list[Segment]) -> bool:
        """A decode micro-batch that fits the buffers."""
        return (0 < len(segments) <= self.max_rows
                and all(s.length == 1 and not s.prefill and s.end <= self.capacity for s in segments))

    # ------------------------------------------------------------------ the CPU executor's side
    def prepare(self, segments: list[Segment], version: int) -> tuple[int, int, int]:
        """Writes the micro-batch's positions, page tables and masks into `version`'s buffers;
        returns the handle (version, rows, padded rows) for `run`."""
        n, rows = len(segments), padded_size(len(segments))
        pos = torch.zeros(rows, dtype=torch.long)
        pos[:n] = torch.tensor([s.start for s in segments])
        tables = torch.full((rows, self.width), SCRATCH_PAGE, dtype=torch.long)
        for i, s in enumerate(segments):
            pages = list(self.runner.kv.pages_of(s))[: self.width]
            tables[i, : len(pages)] = torch.tensor(pages, dtype=torch.long)
        keys = torch.arange(self.capacity)
        masks = {}
        for w in self.runner.windows:
            allowed = keys[None, :] <= pos[:, None]
            if w is not None:
                allowed &= keys[None, :] > pos[:, None] - w
            masks[w] = allowed
        buf = self.buffers[version]
        if not self.cuda:
            buf.positions[:rows, 0] = pos
            buf.tables[:rows] = tables
            for w, m in masks.items():
                buf.masks[w][:rows, 0, 0] = m
            return version, n, rows
        host = buf.host
        self.ready[version].synchronize()          # the previous copy out of these pinned buffers is done
        host["positions"][:rows, 0] = pos
        host["tables"][:rows] = tables
        for w, m in masks.items():
            host["masks"][w][:rows, 0, 0] = m
        with torch.cuda.stream(self.copy_stream):
            self.copy_stream.wait_event(self.done[version])     # the last replay that read this version is over
            buf.positions[:rows].copy_(host["positions"][:rows], non_blocking=True)
            buf.tables[:rows].copy_(host["tables"][:rows], non_blocking=True)
            for w in masks:
                buf.masks[w][:rows].copy_(host["masks"][w][:rows], non_blocking=True)
            self.ready[version].record(self.copy_stream)
        return version, n, rows

    # ------------------------------------------------------------------ the device executor's side
    def _rows(self, version: int, rows: int) -> tuple:
        """The step's inputs: `version`'s buffers cut to `rows`."""
        buf = self.buffers[version]
        return (buf.x[:rows], buf.positions[:rows], buf.tables[:rows], {w: m[:rows] for w, m in buf.masks.items()},
                self.row_ids[:rows])

    def _decode(self, x, positions, tables, masks, sample_rows) -> torch.Tensor:
        inputs = StageInputs(segments=[], layout="rows", shape=(x.shape[0], 1), positions=positions, masks=masks,
                             rotary=None, cache=StaticKV(self.runner.kv, tables, positions[:, 0]),
                             sample_rows=sample_rows)
        return self.runner.compute(inputs, x)

    def _step(self, version: int, rows: int) -> torch.Tensor:
        with torch.inference_mode():
            return self._decode(*self._rows(version, rows))

    def run(self, handle: tuple[int, int, int], x: torch.Tensor) -> torch.Tensor:
        """x: the n real rows' token ids or hidden states. Returns the n rows' output (a copy)."""
        version, n, rows = handle
        buf = self.buffers[version]
        if self.cuda:
            torch.cuda.current_stream(self.runner.device).wait_event(self.ready[version])
        buf.x[:n].copy_(x.to(buf.x.device, buf.x.dtype).reshape(buf.x[:n].shape), non_blocking=True)
        if rows > n:
            buf.x[n:rows].zero_()
        key = (version, rows)
        if self.graphs and key in self.graph:
            graph, out = self.graph[key]
            graph.replay()
        else:
            out = self._step(version, rows)
        result = out[:n].clone()
        if self.cuda:
            self.done[version].record(torch.cuda.current_stream(self.runner.device))
        return result

    def _point_at_scratch(self) -> None:
        """Every row of every version reads and writes the scratch page only (warm-up steps)."""
        for buf in self.buffers:
            buf.tables.fill_(SCRATCH_PAGE)
            buf.positions.zero_()
            for m in buf.masks.values():
                m.zero_()
                m[..., 0] = True

    def capture(self) -> int:
        """On CUDA records one graph per (version, padded batch size) up to the largest, on a side
        stream after warm-up replays (the scratch page takes every write). Returns the CUDA graphs made."""
        if not self.graphs:
            return 0
        self._point_at_scratch()
        dev = self.runner.device
        torch.cuda.synchronize(dev)
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        pool = None
        with torch.cuda.stream(side):
            for version in range(VERSIONS):
                for rows in (b for b in BATCH_SIZES if b <= self.max_rows):
                    for _ in range(2):
                        self._step(version, rows)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool, stream=side):
                        out = self._step(version, rows)
                    pool = graph.pool()
                    self.graph[(version, rows)] = (graph, out)
        torch.cuda.current_stream(dev).wait_stream(side)
        torch.cuda.synchronize(dev)
        return len(self.graph)

