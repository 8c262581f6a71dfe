"""One pipeline stage: the units it holds and the three steps of running a micro-batch.

1. `prepare_inputs(segments)`: positions, the attention mask(s) and rotary embeddings, all derived
   from the schedule alone (every stage computes the same from the same segments);
2. `forward(inputs, x)`: the stage's units, through transformers' own modules;
3. the transfer of the hidden states is the worker's business (`hpipe.runtime.comm`).

Keeping the steps apart is what lets SiPipe's token-safe execution prepare the next micro-batch's
inputs while this one computes.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import os
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from hpipe import experts, heap, models, quant, quantized
from hpipe.runtime import compile_choice, graphs
from hpipe.config import DEFAULTS
from hpipe.formats import KV_DTYPE
from hpipe.runtime.kv import BatchCache, KVStore
from hpipe.runtime.pages import SCRATCH_PAGE, Segment, layout_of, pages_needed


# whether this process's CPU runs hpipe's float16 decode attention (kernels/attention.h): set once,
# by `register_decode_sdpa`, read as a constant by the graphs that trace `decode_sdpa`
F16_DECODE_KERNEL = False


def f16_kernel(runner) -> bool:
    """Whether the stage's decode steps attend through `hpipe::attend_f16` (its graphs hold the op)."""
    return F16_DECODE_KERNEL and runner.device.type == "cpu" and runner.kv.dtype == torch.float16


def decode_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' SDPA attention over the KV pool's pages as they are, one query per row against
    grouped KV heads (a decode step) on a CPU with the query heads packed per KV head, [b, kv heads,
    group, d], so that each KV head's context is read once for the whole group (with `enable_gqa`
    torch's flash kernel reads it once per query head: the 1B shape, 32/8 heads, 2 threads: 55 ->
    47 us at 330 positions, 228 -> 136 at 1,000; transformers packs so itself only outside compiled
    graphs and without a mask). The mask is SDPA's boolean one. Pages of another dtype than the
    activations (`kv_dtype`):
    - float16 on a CPU: a decode step goes to `hpipe::attend_f16`, which reads them where they lie
      (torch's flash kernel takes float16 at 2-5x float32's time on CPUs without AVX-512 FP16, and a
      float32 copy costs more than the attention: bench/kv_dtype.py), as do one sequence's few rows
      (`F16_KERNEL_ROWS`: a speculative step), a row at a time; other steps (prefill slices, mixed
      batches) and CPUs without the kernel attend over a copy in the activations' dtype;
    - otherwise (bfloat16; CUDA) the query goes to the pages' dtype and the output comes back."""
    b, heads, length, d = query.shape
    kv_heads = key.shape[1]
    plain = not dropout and kwargs.get("position_bias") is None and kwargs.get("softcap") is None
    if key.dtype != query.dtype:
        if query.device.type == "cpu" and key.dtype == torch.float16:
            kernel = F16_DECODE_KERNEL and plain and d % 8 == 0 and d <= 256
            scale = scaling if scaling is not None else d ** -0.5
            if kernel and length == 1 and (attention_mask is None or attention_mask.shape[-2] == 1):
                mask = None if attention_mask is None else attention_mask[..., : key.shape[2]]
                out = torch.ops.hpipe.attend_f16(query.reshape(b, kv_heads, heads // kv_heads, d), key, value, mask,
                                                 scale)
                return out.to(query.dtype).reshape(b, heads, 1, d).transpose(1, 2).contiguous(), None
            if kernel and b == 1 and 1 < length <= F16_KERNEL_ROWS and attention_mask is not None and \
                    attention_mask.dtype == torch.bool and attention_mask.shape[1] == 1:
                return _attend_f16_rows(query, key, value, attention_mask, scale), None
            return decode_sdpa(module, query, key.to(query.dtype), value.to(query.dtype), attention_mask, dropout,
                               scaling, is_causal, **kwargs)
        out, weights = decode_sdpa(module, query.to(key.dtype), key, value, attention_mask, dropout, scaling,
                                   is_causal, **kwargs)
        return out.to(query.dtype), weights
    if length == 1 and heads != kv_heads and query.device.type == "cpu" and plain and \
            (attention_mask is None or attention_mask.shape[-2] == 1):
        out = torch.nn.functional.scaled_dot_product_attention(
            query.reshape(b, kv_heads, heads // kv_heads, d), key, value, attn_mask=attention_mask, scale=scaling)
        return out.reshape(b, heads, 1, d).transpose(1, 2).contiguous(), None
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kwargs)


# A sequence's few query rows over float16 pages (a speculative step's k+1) go through the decode
# kernel as one group, the context read once for all of them; longer slices (prefill) attend over a
# float32 copy. Where the rows went to the copy, speculation on the AVX-512 machine, whose one-row
# kernel is fast, made the document questions 1.9x slower a token (bench/speculative.py: 9.8 ->
# 18.5 ms): each step copied ~1,700 positions of every layer's pages.
F16_KERNEL_ROWS = 8


def _attend_f16_rows(query, key, value, mask, scale: float):
    """The query rows [1, heads, L, d] of one sequence through `hpipe::attend_f16` as one sequence
    whose KV heads each have L x group queries (row-major), each query under its row's mask
    [1, 1, L, >= n], which the kernel reads as it is -> [1, L, heads, d] (transformers' attention
    output). Row by row, the kernel read the context L times (SmolLM2, 5 rows at 1,700 positions:
    3.1x one row's attention); the mask repeated per head was a copy in every layer (3 rows at 1,700
    positions: 1.7 ms of a 17.8 ms step)."""
    _, heads, length, d = query.shape
    kv_heads, n = key.shape[1], key.shape[2]
    group = heads // kv_heads
    q = query[0].reshape(kv_heads, group, length, d).transpose(1, 2).reshape(1, kv_heads, length * group, d)
    out = torch.ops.hpipe.attend_f16(q, key, value, mask[:, :, :, :n], scale)    # [1, kv heads, L group, d]
    return out.to(query.dtype).reshape(kv_heads, length, group, d).transpose(0, 1).reshape(1, length, heads, d)


def register_decode_sdpa(device: torch.device, kv_dtype: str) -> None:
    """`decode_sdpa` as this process's "sdpa" attention on every device (it hands every other call
    to transformers'), with hpipe's float16 decode attention where a CPU stage's pages are float16
    and this CPU runs the kernels (built at their first use)."""
    global F16_DECODE_KERNEL
    from transformers import AttentionInterface

    from hpipe import cpu_kernels

    AttentionInterface.register("sdpa", decode_sdpa)
    if device.type == "cpu":
        # transformers' SDPA expands grouped KV heads to every query head (a copy of the whole
        # context per layer) whenever a mask is given, i.e. for every step of more than one token
        # after a context (prefill slices, speculative steps): 3 tokens after 1,700 took 4-5x one
        # token's time. Torch's CPU kernels take masked GQA as it is (CUDA's fall back to math).
        os.environ["TRANSFORMERS_SDPA_FORCE_GQA"] = "1"
        if kv_dtype == "float16" and not F16_DECODE_KERNEL and cpu_kernels.kernels()[0] is not None:
            cpu_kernels.ops()
            F16_DECODE_KERNEL = True


@dataclass
class StageInputs:
    segments: list[Segment]
    layout: str                       # "rows" or "packed" (see hpipe.runtime.kv)
    shape: tuple[int, int]            # (rows, tokens per row) of the hidden states
    positions: torch.Tensor           # [rows, tokens]
    masks: dict                       # sliding window (None = full) -> attention mask
    rotary: tuple | None              # (cos, sin) for RoPE models
    cache: BatchCache | None
    sample_rows: torch.Tensor         # flat token indices whose logits are taken: sampled, then scored
    paths: object = None              # --deterministic: the quantized linears' path of every row (quant.RowPaths)
    head_paths: object = None         # and of the head's rows


def _deterministic_attention(config) -> str:
    """`--deterministic on`: the batch-invariant ops registered, and the attention they run (or
    the one line saying why this model cannot have them)."""
    from hpipe.errors import HpipeError
    from hpipe.runtime import invariant

    why_not = invariant.refused(config)
    if why_not:
        raise HpipeError(f"--deterministic on: {why_not}")
    invariant.register()
    return invariant.ATTENTION


class StageRunner:
    def __init__(self, model: models.ModelSource | Path, config, units: range, device: str = "cpu",
                 dtype: str = "float32", attn_implementation: str = DEFAULTS.attn,
                 page_size: int = DEFAULTS.page_size, weights=None, compile: str = DEFAULTS.compile,
                 deterministic: bool = DEFAULTS.deterministic == "on", host_experts: int = 0,
                 kv_dtype: str = KV_DTYPE, step_tokens: int = 1, join_halves: bool | None = None,
                 shared_weights: bool = False):
        """compile (`--compile`): "on", decode steps run their blocks through torch.compile where
        `compiled_halves_refused` allows; "auto", the same where `hpipe warmup` has compiled this
        stage's graphs on this host (`warm_graphs`); "off", eagerly. Everything else runs eagerly.
        deterministic: every row's arithmetic fixed by the row itself (`hpipe.runtime.invariant`).
        host_experts: the first this many MoE blocks of `units` keep their routed experts in the host's
        RAM, run by its CPU (`models.host_expert_units`).
        kv_dtype: the KV pool's elements (the plan's; `KVStore.read_dtype`).
        step_tokens: the most tokens a lone sequence's step runs through the compiled halves beside
        one-token decode steps (`Speculation.step_tokens`: a speculative step's fed token and its
        proposals); their graphs are compiled and marked warm with the others.
        join_halves: the stage's decode calls are its own runs of halves (`stage_runs`) or runs of
        whole blocks and halves alone (`stage_calls`), whose graphs serve any stage layout; None: its
        own under `--compile on` or where they are warm, else the others. shared_weights: SiDP's
        replicas share the packed cache's file mapping (`models.build_model_units`)."""
        self.config = config = copy.deepcopy(config)     # transformers writes the attention implementation into it
        self.deterministic = deterministic
        if deterministic:
            attn_implementation = _deterministic_attention(config)
        self.units = units
        self.step_tokens = step_tokens
        heap.keep_freed_memory()     # activations reuse freed memory, in the profiler's runs as in the job's
        self.device = torch.device(device)
        register_decode_sdpa(self.device, kv_dtype)
        self.dtype = models.torch_dtype(dtype)
        self.attn_implementation = attn_implementation
        self.model = models.build_model_units(model, config, units, device, dtype, attn_implementation, weights,
                                              models.host_expert_units(config, units, host_experts), shared_weights)
        self.weights_quantized = any(isinstance(m, quantized.QUANTIZED) for m in self.model.modules())
        if deterministic:
            from hpipe.runtime import invariant
            invariant.tile_linears(self.model)      # float linears (quantized ones choose their path per row)
        self.rotary = models.rotary_embedding(self.model, config, device)
        self.rotary_table = None if self.rotary is None else RotaryTable(self.rotary, self.dtype)
        self.n_units = models.num_units(config)
        self.gpt2 = config.model_type in models.GPT2_LIKE
        self.hidden_size = int(config.hidden_size)
        self.blocks = sorted({(u - 1) // 2 for u in units if 0 < u < self.n_units - 1})
        self.windows = sorted({models.sliding_window_of_block(config, b) for b in self.blocks},
                              key=lambda w: -1 if w is None else w)
        self.kv = KVStore(device, models.torch_dtype(kv_dtype), page_size,
                          read_dtype=None if attn_implementation == "sdpa" else self.dtype)
        self._mods = {u: [self.model.get_submodule(p) for p in models.unit_modules(config, u)] for u in units}
        attention = next((self._mods[u][1] for u in units if 0 < u < self.n_units - 1 and u % 2 == 1), None)
        self.cache_argument = models.cache_argument(attention)
        # a MoE block whose experts run the routed kernels is a block like any other (its graph
        # holds the router and the kernels' calls); other MoE blocks go a half a call, the MoE half
        # eager (which of its experts' modules run is known only from the router's output)
        self.eager = Halves(self.cache_argument)
        self._choose_calls(compile, join_halves)
        self.decode_halves = CompiledHalves(self) if self.compile_refused is None else self.eager
        # held for each forward: what changes the stage between steps (graphs loaded beside a
        # server, hpipe.runtime.background_compile) holds it instead, and the next step waits
        self.stepping = threading.RLock()
        self.last_step = time.monotonic()       # when the last forward ended

    def _choose_calls(self, compile: str, join_halves: bool | None) -> None:
        """The stage's calls (`join_halves`, None: its own where they are not cold, else those a
        plain warmup compiled) and whether, and why not, they run compiled graphs."""
        for join in ((True, False) if join_halves is None else (join_halves,)):
            self.calls = stage_calls(self.units, self.n_units, not self.gpt2 and self.moe_in_graphs, join)
            self._blocks = self._gather_blocks()
            self.compile_refused = compiled_halves_refused(self, compile)
            if not self.compile_cold:
                break

    @property
    def moe_in_graphs(self) -> bool:
        """Every MoE block the stage holds can run inside a compiled graph (`experts.in_graphs`)."""
        return all(experts.in_graphs(m) for m in self.mlp_modules().values())

    @property
    def compile_cold(self) -> bool:
        """`--compile auto` found no graphs that `hpipe warmup` compiled for this stage here."""
        return (self.compile_refused or "").startswith(COLD)

    @property
    def first(self) -> bool:
        return self.units.start == 0

    @property
    def last(self) -> bool:
        return self.units.stop == self.n_units

    def mlp_modules(self) -> dict[int, torch.nn.Module]:
        """Block -> its MLP module (the MLP half's second module, after its norm), for the blocks held."""
        return {b: self._mods[2 + 2 * b][1] for b in self.blocks if 2 + 2 * b in self._mods}

    def replace_mlps(self, modules: dict[int, torch.nn.Module]) -> None:
        """Runs `modules[b]` in place of block b's MLP module (SiDP's owned and remote MLP halves)."""
        for b, module in modules.items():
            self._mods[2 + 2 * b][1] = module
        self._blocks = self._gather_blocks()
        self.decode_halves = self.eager      # their fetches and sends are Python a graph does not hold

    # ---------------------------------------------------------------- step 1: input preparation
    def prepare_inputs(self, segments: list[Segment], kv: KVStore | None = None) -> StageInputs:
        """kv: the pool the micro-batch's cache reads and writes (default the stage's own)."""
        layout = layout_of(segments)
        dev = self.device
        end = max(s.end for s in segments)
        # positions from host ints: one small tensor (a decode step's preparation runs with the
        # caches cold after a forward, where every tensor op costs ~20 us)
        positions = torch.tensor([list(range(s.start, s.end)) for s in segments] if layout == "rows" else
                                 [[p for s in segments for p in range(s.start, s.end)]], device=dev)
        masks = {}
        if self.blocks and self.deterministic:
            from hpipe.runtime import invariant

            masks = {w: invariant.pieces_for(segments, layout, w, self.kv.page_size, dev) for w in self.windows}
        elif self.blocks:
            q = None
            for w in self.windows:
                if self.attn_implementation == "sdpa" and _plain_causal(segments, layout, w):
                    masks[w] = None  # SDPA's own causal kernels (flash on CUDA) need no mask
                    continue
                if q is None:
                    q, k, same_seq = _mask_inputs(segments, layout, positions, end)
                allowed = k <= q
                if w is not None:
                    allowed = allowed & (k > q - w)
                if same_seq is not None:
                    allowed = allowed & same_seq
                masks[w] = self._mask_for_attention(allowed)
        rotary = None
        if self.rotary is not None and self.blocks:
            rotary = self.rotary_table.lookup(positions, end)
        ends = list(itertools.accumulate(s.length for s in segments))    # host ints: no device read-back
        # the sampled rows first, then every other row of the scored segments (prompt log-probabilities)
        rows = [e - s.sampled_rows + i for e, s in zip(ends, segments) for i in range(s.sampled_rows)]
        rows += [e - s.length + i for e, s in zip(ends, segments) if s.scored for i in range(s.length - s.sample)]
        sample_rows = torch.tensor(rows, dtype=torch.long, device=dev)
        shape = (len(segments), segments[0].length) if layout == "rows" else (1, ends[-1])
        cache = BatchCache(kv or self.kv, segments) if self.blocks else None
        inputs = StageInputs(segments, layout, shape, positions, masks, rotary, cache, sample_rows)
        if self.deterministic and self.weights_quantized:
            from hpipe.runtime import invariant

            inputs.paths = invariant.row_paths(segments, None, dev)
            inputs.head_paths = invariant.row_paths(segments, rows, dev) if self.last else None
        return inputs

    def _mask_for_attention(self, allowed: torch.Tensor) -> torch.Tensor:
        """SDPA takes the boolean mask; eager attention adds a float mask (0 or the dtype's min)."""
        if self.attn_implementation == "sdpa":
            return allowed
        zero = torch.zeros((), dtype=self.dtype, device=self.device)
        return torch.where(allowed, zero, torch.finfo(self.dtype).min)

    # ---------------------------------------------------------------- step 2: the forward
    @torch.inference_mode()
    def forward(self, inputs: StageInputs, x: torch.Tensor, decode_halves: Halves | None = None) -> torch.Tensor:
        """x: token ids [T] on the first stage, hidden states [T, H] elsewhere. Returns hidden
        states [T, H], or on the last stage the logits [rows sampled + scored rows, V] (float32).
        decode_halves: how a decode step runs its blocks, if not the stage's `decode_halves`."""
        with self.stepping:
            out = self.compute(inputs, x, decode_halves)
        self.last_step = time.monotonic()
        return out

    def compute(self, inputs: StageInputs, x: torch.Tensor, decode_halves: Halves | None = None) -> torch.Tensor:
        """`forward` without its inference mode: what torch.compile traces (it cannot trace
        inference tensors' version counters), called under `torch.no_grad`."""
        rows, per_row = inputs.shape
        if inputs.rotary is None and self.rotary is not None and self.blocks:   # static decode: inside the graph
            inputs = replace(inputs, rotary=self.rotary(torch.empty(0, dtype=self.dtype, device=self.device),
                                                        inputs.positions))
        h = x.to(self.device).view(rows, per_row) if self.first else \
            x.to(self.device, self.dtype).view(rows, per_row, self.hidden_size)
        halves = (decode_halves or self.decode_halves) if self.takes_graphs(inputs) else self.eager
        if halves is not self.eager and torch.is_inference_mode_enabled() and not h.is_inference():
            h = h.clone()       # received hidden states: a graph made for inference tensors serves them too
        with quant.row_paths(inputs.paths):
            for units in self.calls:
                h = self._run_blocks(units[0], h, inputs, halves) if len(units) >= 2 else \
                    self._run_unit(units[0], h, inputs, halves)
        if self.last:
            return h.float()
        return h.reshape(rows * per_row, self.hidden_size)

    def takes_graphs(self, inputs: StageInputs) -> bool:
        """Whether a step runs through the decode halves: one new token a row (a decode step), or a
        lone sequence's few (a speculative step's fed token and proposals, up to `step_tokens`). A
        verification step run eagerly beside compiled one-token steps cost 2.9x one (SmolLM2, 5 tokens
        at a 300-token context, AVX-512, 2 threads); compiled, 1.7x. Not a step whose rows are all
        first tokens at position 0 (a short prompt's one-token slices: 4 tokens over 2 stages): the
        graphs' traces specialized their contexts to be longer than 1, so a warm host's first short
        job compiled one more graph per function for it (~25 s a stage on 2 cores); it runs eagerly
        (inputs without segments take the graphs as before)."""
        rows, per_row = inputs.shape
        return inputs.layout == "rows" and (per_row == 1 or (rows == 1 and per_row <= self.step_tokens)) and \
            (not inputs.segments or any(s.end > 1 for s in inputs.segments))

    def _gather_blocks(self) -> dict[int, tuple[list[tuple], list[int]]]:
        """Each call of several units (by its first unit): its halves' modules, each (norm, module,
        attends), and the numbers of the blocks whose attention it runs, gathered once per set of
        modules rather than every step."""
        return {c[0]: ([(*self._mods[v], v % 2 == 1) for v in c], [(v - 1) // 2 for v in c if v % 2 == 1])
                for c in self.calls if len(c) >= 2}

    def _run_blocks(self, u: int, h: torch.Tensor, inputs: StageInputs, halves: "Halves") -> torch.Tensor:
        mods, blocks = self._blocks[u]
        return halves.blocks(u, mods, h, inputs.rotary, [self._mask(inputs, b) for b in blocks], inputs.cache, blocks)

    def _mask(self, inputs: StageInputs, block: int) -> torch.Tensor | None:
        """The micro-batch's attention mask for this block's window."""
        return inputs.masks[models.sliding_window_of_block(self.config, block)]

    def _run_unit(self, u: int, h: torch.Tensor, inputs: StageInputs, halves: "Halves") -> torch.Tensor:
        mods = self._mods[u]
        if u == 0:
            if self.gpt2:
                wte, wpe = mods
                return wte(h) + wpe(inputs.positions)
            return mods[0](h)
        if u == self.n_units - 1:
            norm, head = mods
            flat = h.reshape(-1, h.shape[-1]).index_select(0, inputs.sample_rows)
            with quant.row_paths(inputs.head_paths):
                return head(norm(flat))
        block = (u - 1) // 2
        norm, module = mods
        if u % 2 == 1:  # attention half
            mask = self._mask(inputs, block)
            if self.gpt2:
                out, _ = module(norm(h), attention_mask=mask, **{self.cache_argument: inputs.cache})
                return h + out
            return halves.attention(u, norm, module, h, inputs.rotary, mask, inputs.cache, block)
        return halves.mlp(u, norm, module, h)


def attention_half(norm, attention, h, rotary, mask, cache_kw: dict):
    out, _ = attention(hidden_states=norm(h), position_embeddings=rotary, attention_mask=mask, **cache_kw)
    return h + out


def mlp_half(norm, mlp, h):
    return h + mlp(norm(h))


def run_of_halves(halves: list[tuple], h, rotary, masks: list, caches: list[dict]):
    """Consecutive halves of blocks, each (norm, module, attends): an attention half takes the next of
    `masks` and `caches` (one per attention half), an MLP half neither."""
    i = 0
    for norm, module, attends in halves:
        if attends:
            h = attention_half(norm, module, h, rotary, masks[i], caches[i])
            i += 1
        else:
            h = mlp_half(norm, module, h)
    return h


# Whole blocks per call (one compiled graph) where a stage holds that many in a row; the rest of a run
# go one block a call. Each graph call costs dynamo's guards, its argument gathering and its wrapper,
# about 60 us here: SmolLM2's decode step at 1 thread took 11.0 ms with 30 calls, 10.3 with pairs,
# 9.1-9.5 with 3, 4, 5, 10 or 15 blocks a call (2 threads: 9.1 -> 7.8 ms with 4); a graph of 4
# compiles in ~15 s cold, one of 10 in 29, of 15 in 46 (the step of bench/decode_compile.py in a loop).
# A model takes the size of these that calls its blocks in the fewest calls (`blocks_per_call`).
CALL_SIZES = (4, 5)


def blocks_per_call(n_units: int) -> int:
    """Whole blocks a call for a model of `n_units` units: of `CALL_SIZES`, the one that runs all of
    its blocks in the fewest calls, the smaller on a tie (it compiles faster). SmolLM2's 30 blocks go
    5 a call, 6 calls and no block left over to a graph of its own (4 a call made 9 calls: 7.5 and
    7.1 ms a step at 2 threads, 4 against 5, in three alternated runs here, 6.7 against 6.6 and 7.6
    against 5.6); Llama-3.2-1B's 16 go 4."""
    blocks = (n_units - 2) // 2
    return min(CALL_SIZES, key=lambda b: (blocks // b + blocks % b, b))


def stage_calls(units: range, n_units: int, joined: bool, join_halves: bool = False) -> list[tuple[int, ...]]:
    """The stage's units as its forward calls them: whole blocks (both halves held) go
    `blocks_per_call` consecutive ones a call, those left over one a call (each call one compiled
    graph); everything else is a unit alone (the embedding, the head, the halves of blocks cut in the
    middle, and every unit where `joined` is False). join_halves: the stage's own calls instead
    (`stage_runs`)."""
    per_call = 2 * blocks_per_call(n_units)      # units
    if joined and join_halves:
        return stage_runs(units, n_units, per_call)
    calls: list[tuple[int, ...]] = []
    for u in units:
        mlp = 0 < u < n_units - 1 and u % 2 == 0
        if joined and mlp and calls and calls[-1] == (u - 1,):
            calls[-1] = (u - 1, u)
        else:
            calls.append((u,))
    grouped: list[tuple[int, ...]] = []
    for call in calls:
        run = grouped[-1] if grouped and len(call) == 2 and len(grouped[-1]) >= 2 else None
        if run is not None and len(run) < per_call and run[-1] + 1 == call[0]:
            grouped[-1] = run + call
        else:
            grouped.append(call)
    # a run's tail shorter than a full call goes one block a call (one more graph, not one per length)
    out: list[tuple[int, ...]] = []
    for call in grouped:
        if 2 < len(call) < per_call:
            out.extend(call[i:i + 2] for i in range(0, len(call), 2))
        else:
            out.append(call)
    return out


def stage_runs(units: range, n_units: int, per_call: int) -> list[tuple[int, ...]]:
    """The stage's halves of blocks in as few calls as `per_call` units a call allow, a cut block's
    MLP half going with the first whole blocks and a cut block's attention half with the last, the
    blocks left over one call (the embedding and the head alone). Graphs of these calls serve this
    stage layout alone (`hpipe warmup --units`, `--compile on`), where `stage_calls`'s serve any: the
    MoE shape's 3 stages of 2-3 blocks called 10 graphs a token, 2 in one process, and each call
    costs ~0.1 ms beside its kernels at one thread (one process, the 3 stages' runners in a row: 8.1
    against 7.2 ms)."""
    inner = [u for u in units if 0 < u < n_units - 1]
    lead = inner[:1] if inner and inner[0] % 2 == 0 else []
    trail = inner[-1:] if len(inner) > len(lead) and inner[-1] % 2 == 1 else []
    body = inner[len(lead):len(inner) - len(trail)]          # whole blocks
    chunks = [body[i:i + per_call] for i in range(0, len(body), per_call)] or [[]]
    chunks[0] = lead + chunks[0]
    chunks[-1] = chunks[-1] + trail
    return [(u,) for u in units if u == 0] + [tuple(c) for c in chunks if c] + \
        [(u,) for u in units if u == n_units - 1]


class Halves:
    """How a stage runs its blocks and halves: transformers' modules called as they are, the
    micro-batch's cache object told the layer by transformers. Chosen once per stage and kind of
    micro-batch (decode steps may take `CompiledHalves`)."""

    def __init__(self, cache_argument: str):
        self.cache_argument = cache_argument

    def blocks(self, u, mods, h, rotary, masks, cache, blocks):
        return run_of_halves(mods, h, rotary, masks, [{self.cache_argument: cache}] * len(blocks))

    def attention(self, u, norm, module, h, rotary, mask, cache, block):
        return attention_half(norm, module, h, rotary, mask, {self.cache_argument: cache})

    def mlp(self, u, norm, module, h):
        return mlp_half(norm, module, h)


COLD = "no graph of its blocks is compiled on this host yet"


def compiled_halves_refused(runner, mode: str) -> str | None:
    """Why a stage's decode steps do not run compiled graphs of its blocks under `--compile mode`, or
    None. Under "auto" a stage whose graphs `hpipe warmup` has not compiled here gives `COLD`, with
    what to do about it."""
    if mode == "off":
        return "--compile off"
    if runner.deterministic:
        return "--deterministic on: decode steps run piece by piece (inductor's kernels round rows by the batch)"
    if runner.device.type != "cpu":
        return f"{runner.device.type} stages replay CUDA graphs of the static step instead"
    if runner.config.model_type not in models.LLAMA_LIKE:
        return f"{runner.config.model_type} blocks are not compiled (llama-like models are)"
    if not runner.blocks:
        return "the stage holds no block"
    if mode == "auto" and not warm_graphs(runner):
        speculative = " with the run's --speculative" if runner.step_tokens > 1 else ""
        return (f"{COLD} for {torch.get_num_threads()} threads: `hpipe warmup --plan PLAN`{speculative} compiles "
                f"them once (1-3 minutes on 2 cores; later starts load them in ~2 s a stage) and decode steps then take "
                f"about 0.7x the time")
    return None


def graph_plan(runner) -> dict[int, tuple]:
    """Unit -> (function, key) of every graph the stage's decode steps call: a whole block's, or a
    half's of a block cut between stages (keyed by the function and `_signature` of its modules)."""
    return {call[0]: graph for call in runner.calls if (graph := _call_graph(runner, call)) is not None}


def _call_graph(runner, call: tuple[int, ...]) -> tuple | None:
    """(function, key) of the graph that serves one call of units held by `runner`, or None where no
    graph does (the embedding, the head, a MoE half whose experts run eagerly)."""
    u = call[0]
    if not 0 < u < runner.n_units - 1:
        return None
    if len(call) == 1 and u % 2 == 0 and not experts.in_graphs(runner._mods[u][1]):
        return None        # such a MoE half runs eagerly (`StageRunner.calls`)
    fn = run_of_halves if len(call) >= 2 else attention_half if u % 2 == 1 else mlp_half
    return fn, (fn.__name__, len(call), _signature(*(m for v in call for m in runner._mods[v])))


def any_layout_units(runner) -> list[range]:
    """For a runner of the whole model: one stage layout per distinct graph that a stage of any
    layout calls (`stage_calls` without the stages' own joined calls: runs of whole blocks, single
    ones, the halves of cut ones), each layout that graph's call alone. Blocks whose modules differ
    call graphs of their own: a Q4_K_M file keeps some blocks' attn_v and ffn_down in Q6_K, and
    warming block 0's halves alone left a cut at block 5 of the MoE bench shape eager."""
    n, joined = runner.n_units, not runner.gpt2 and runner.moe_in_graphs
    calls = {c for a in range(1, n - 1) for b in range(a + 1, n) for c in stage_calls(range(a, b), n, joined)}
    first: dict[tuple, tuple[int, ...]] = {}
    for call in sorted(calls):
        graph = _call_graph(runner, call)
        if graph is not None:
            first.setdefault(graph[1], call)
    return [range(c[0], c[-1] + 1) for c in first.values()]


def _graph_text(runner, fn, key) -> str:
    """What one of the stage's graphs bakes in (`graphs.graph_dir` adds the code it is traced from,
    hpipe's sources among it): the function, its modules' signature, the attention implementation,
    the KV dtype and kernel, the page size, the thread count (inductor builds its C++ kernels for
    one: a stage of 1 thread missed a 2-thread warmup's artifacts and compiled for 40 s at its
    start) and `DYNAMO_SETTINGS`."""
    return repr((fn.__name__, key, runner.attn_implementation, str(runner.kv.dtype), f16_kernel(runner),
                 runner.kv.page_size, torch.get_num_threads(), DYNAMO_SETTINGS))


def _warm_marks(runner, step_tokens: int | None = None) -> list[Path]:
    """One file per graph of the stage beside inductor's artifacts, named by the graph's directory
    (`graphs.graph_dir`: what it bakes in, the code it is traced from) and the decode steps warm-up
    runs: a mark made by a warm-up of fewer shapes does not count (a speculative stage's,
    `step_tokens`, default the runner's)."""
    import hashlib

    use_inductor_cache()
    root = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]) / "hpipe-warm"
    shapes = decode_shapes(WARM_TOKENS, runner.kv.page_size, step_tokens or runner.step_tokens)
    names = [graphs.graph_dir(_graph_text(runner, fn, key)).name for fn, key in graph_plan(runner).values()]
    return [root / hashlib.sha256(repr((name, shapes)).encode()).hexdigest()[:32] for name in names]


def warm_graphs(runner) -> bool:
    """Whether `hpipe warmup` compiled every graph this stage's decode steps call, on this host."""
    marks = _warm_marks(runner)
    return bool(marks) and all(m.exists() for m in marks)


# Warm-up's slice, in tokens: a length no dimension of a model has. Tracing a graph, dynamo gives
# sizes of equal value one symbol, and a context of 16 tokens traced beside a head size of 16 made
# a graph that served contexts of 16 alone.
WARM_TOKENS = 13


def decode_shapes(n: int, page_size: int, step_tokens: int = 1) -> list[list[Segment]]:
    """One decode step of each kind that calls a graph of its own, inside the pages of slot 0's
    n-token slice: dynamo bakes in a size of 1, whether a mask is passed, and whether a lone row's
    context is read in place (`BatchCache._span`), so every function a stage compiles has at most
    three graphs. Warming two left the third, and every new number of rows, to compile mid-run: a
    launch of 16 prompts at --max-batch 8 after `hpipe warmup` compiled 4 graphs in its first
    steps, ~17 s of its 21. The steps:
    - one row whose pages lie in order (its context read in place);
    - one row read through its page table (the scratch page stands for pages out of order, as a
      stream's are once others have come and gone);
    - three rows, under a mask (`_plain_causal`): the graph serves every number of rows above one
      (`KVStore.keep_page_shape_static`);
    - with `step_tokens` above 1 (speculation), a lone row of several tokens (its causal mask) in
      place and through its page table: the graphs serve every count from 2 to `step_tokens`."""
    gathered = (SCRATCH_PAGE,) * pages_needed(n, page_size)
    steps = [[Segment(0, 0, n - 1, 1, True)],
             [Segment(0, 0, n - 1, 1, True, pages=gathered)],
             [Segment(i, 0, n - 1 - i, 1, True) for i in range(3)]]
    if step_tokens > 1:
        length = min(3, step_tokens)           # 3 (or 2): not a size of the context's 13 tokens
        steps += [[Segment(0, 0, n - length, length, True)], [Segment(0, 0, n - length, length, True, pages=gathered)]]
    return steps


def warm_up(runner, max_len: int, log) -> float | None:
    """Before the clock starts (the KV pool is allocated): one small slice through the stage's units
    (kernel selection, thread pools, first-touch allocations); with compiled halves, the decode
    steps that compile every graph a run calls (`decode_shapes`). A compile that fails (no C++
    compiler, an inductor bug) leaves the stage eager, said in one line. Returns the compile's
    seconds (None: nothing compiled)."""
    n = warm_tokens(max_len)
    took = None
    warm_step(runner, [Segment(0, 0, 0, n, True)])
    if runner.decode_halves is not runner.eager and n > 3:
        t = time.time()
        try:
            check_inductor_cache()
            for segments in decode_shapes(n, runner.kv.page_size, runner.step_tokens):
                warm_step(runner, segments)
        except Exception as e:  # noqa: BLE001 - no C++ compiler, an inductor bug: the run goes on eagerly
            runner.decode_halves = runner.eager
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
            log(f"stage {runner.units.start}-{runner.units.stop - 1}: decode runs eagerly, its compile failed "
                f"(--compile off skips it): {type(e).__name__}: {first}")
        else:
            took = time.time() - t
            log(f"stage {runner.units.start}-{runner.units.stop - 1}: decode compiled in {took:.1f} s "
                f"({runner.decode_halves.graphs} graphs: runs of whole blocks, single ones, halves of cut ones)")
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    return took


def warm_tokens(max_len: int) -> int:
    """The warm-up's slice: WARM_TOKENS, or the longest request where that is shorter."""
    return max(1, min(WARM_TOKENS, max_len))


def decode_step_s(runner, halves: Halves, n: int) -> float:
    """One row's decode step after n - 1 tokens through `halves`: the least of 3 (the warm-up's
    context: a cost the compile choice compares, eager against compiled)."""
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        warm_step(runner, decode_shapes(n, runner.kv.page_size)[0], halves)
        best = min(best, time.perf_counter() - t)
    return best


def compile_if_it_pays(runner, steps: float, max_len: int, log) -> compile_choice.CompileChoice:
    """A cold CPU stage of a batch job (`--compile auto`, no `hpipe warmup` here): its eager decode
    step measured, the choice made (`hpipe.runtime.compile_choice`) and said in one line; where
    compiling pays, the stage's graphs are compiled by the warm-up that follows, as under
    `--compile on` (`record_compile` then marks them warm and keeps the cost)."""
    n = warm_tokens(max_len)
    warm_step(runner, [Segment(0, 0, 0, n, True)])
    choice = compile_choice.choose(graph_keys(runner), steps, decode_step_s(runner, runner.eager, n))
    log(choice.line(f"stage {runner.units.start}-{runner.units.stop - 1}"))
    if choice.compile:
        runner.compile_refused = None
        runner.decode_halves = CompiledHalves(runner)
    return choice


def record_compile(runner, compile_s: float | None, max_len: int, eager_step_s: float | None = None) -> None:
    """After a warm-up compiled the stage's graphs: marked warm for later `--compile auto` runs on
    this host, and the compile's cost and the compiled step's share kept for later choices (the
    eager step measured here unless the choice to compile already did)."""
    if compile_s is None or runner.decode_halves is runner.eager:
        return
    mark_warm(runner)
    n = warm_tokens(max_len)
    eager = eager_step_s if eager_step_s is not None else decode_step_s(runner, runner.eager, n)
    compile_choice.record(graph_keys(runner), compile_s, eager, decode_step_s(runner, runner.decode_halves, n))


def graph_keys(runner) -> list[str]:
    """The stage's distinct graphs as this host's compile records name them: what each graph bakes in
    but the versions (`_warm_marks` less torch's and hpipe's and the code's), so that a record
    outlives the marks an upgrade makes cold, and serves any stage layout holding the same graph."""
    import hashlib

    keys = {repr((key, runner.attn_implementation, str(runner.kv.dtype), f16_kernel(runner), runner.kv.page_size,
                  torch.get_num_threads())) for _, key in graph_plan(runner).values()}
    return sorted(hashlib.sha256(k.encode()).hexdigest()[:24] for k in keys)


def mark_warm(runner) -> list[Path]:
    """The stage's graphs marked warm: for stages of its steps, and (speculative) of one-token ones."""
    marks = _warm_marks(runner) + (_warm_marks(runner, 1) if runner.step_tokens > 1 else [])
    for m in marks:
        m.parent.mkdir(parents=True, exist_ok=True)
        m.touch()
    return marks


@torch.inference_mode()      # as the run prepares and computes (a compiled graph tells the two apart)
def warm_step(runner, segments: list[Segment], halves: Halves | None = None, kv: KVStore | None = None) -> None:
    """One step of zeros through the stage (its decode steps through `halves`, its cache in `kv`)."""
    rows = sum(s.length for s in segments)
    x = torch.zeros(rows, dtype=torch.long, device=runner.device) if runner.first else \
        torch.zeros(rows, runner.hidden_size, dtype=runner.dtype, device=runner.device)
    runner.forward(runner.prepare_inputs(segments, kv), x, halves)


def compiled_beside(runner) -> CompiledHalves:
    """A running stage's compiled halves, made without touching its KV pool or its `decode_halves`
    (hpipe.runtime.background_compile, with the stage's steps held): the steps `warm_up` compiles,
    through a pool of their own (`keep_page_shape_static`: the graphs then serve the run's pool as
    they are)."""
    halves = CompiledHalves(runner)
    kv = KVStore(runner.device, runner.kv.dtype, runner.kv.page_size, pages=4, read_dtype=runner.kv.read_dtype)
    kv.keep_page_shape_static()
    warm_step(runner, [Segment(0, 0, 0, WARM_TOKENS, True)], kv=kv)        # the pool's layers (eager)
    for segments in decode_shapes(WARM_TOKENS, kv.page_size, runner.step_tokens):
        warm_step(runner, segments, halves, kv)
    return halves


def warm_compile(model: models.ModelSource, config, weights, dtype: str, log, threads: list[int],
                 kv_dtype: str = KV_DTYPE, step_tokens: int = 1, unit_ranges: list[range] | None = None) -> int:
    """`hpipe warmup`: compiles, on this host, every graph a CPU stage of `model` running on each of
    `threads` threads can call (a run of whole blocks, a whole block, the attention half and the MLP
    half of a block cut between stages, for every kind of block the model has: `any_layout_units`)
    into inductor's cache, and marks them warm for `--compile auto`; with `step_tokens` above 1 a
    speculative step's graphs too. `unit_ranges`: only the graphs of stages holding these units (a
    plan's stages on this host), each stage's own calls (`stage_runs`). Returns how many graphs are
    warm."""
    marks: set[Path] = set()
    before, t0 = torch.get_num_threads(), time.time()
    if unit_ranges is None:          # each graph any stage calls, compiled through a layout of its call alone
        each = any_layout_units(StageRunner(model, config, range(models.num_units(config)), "cpu", dtype,
                                            weights=weights, compile="off", kv_dtype=kv_dtype, step_tokens=step_tokens,
                                            shared_weights=True))     # read for its modules' signatures: no copy
    # each layout at each thread count; the time left from the layouts done
    layouts = [(count, units) for count in threads for units in (unit_ranges or each)]
    try:
        for i, (count, units) in enumerate(layouts):
            left = f", about {(time.time() - t0) / i * (len(layouts) - i):.0f} s left" if i else ""
            log(f"warmup {i + 1}/{len(layouts)}: units {units.start}-{units.stop - 1}, {count} thread(s){left}")
            torch.set_num_threads(count)
            marks.update(warm_layout(model, config, weights, dtype, log, units, kv_dtype=kv_dtype,
                                     step_tokens=step_tokens, join_halves=unit_ranges is not None))
    finally:
        torch.set_num_threads(before)
    return len(marks)


def warm_layout(model: models.ModelSource, config, weights, dtype: str, log, units: range,
                page_size: int = DEFAULTS.page_size, attn: str = DEFAULTS.attn, kv_dtype: str = KV_DTYPE,
                step_tokens: int = 1, join_halves: bool = False) -> list[Path]:
    """Compiles the graphs of one stage layout not yet warm, and marks them. join_halves: the
    layout's own calls (`stage_runs`), else those any layout can call (`stage_calls`)."""
    from hpipe.errors import HpipeError

    runner = StageRunner(model, config, units, "cpu", dtype, attn, page_size, weights=weights, compile="on",
                         kv_dtype=kv_dtype, step_tokens=step_tokens, join_halves=join_halves)
    if runner.compile_refused is not None:
        raise HpipeError(f"{model.name}: decode steps are not compiled ({runner.compile_refused}); its runs "
                         f"need no warmup")
    own = _warm_marks(runner)
    if not all(m.exists() for m in own):
        runner.kv.allocate(4)
        took = warm_up(runner, 16, log)
        if runner.decode_halves is runner.eager:
            raise HpipeError(f"{model.name}: the compile failed (the line above says why); runs stay eager")
        record_compile(runner, took, 16)
    return own


class CompiledHalves(Halves):
    """Decode steps through inductor's graphs, regionally: one graph function per call of
    `blocks_per_call` whole blocks, per single whole block, and per half of a block cut between
    stages, each shared by every call of its kind (30 blocks compile two functions, not 30; a
    whole-stage graph took 40-126 s to compile here, one of 4 blocks about 15); or, the stage's own
    calls (`stage_runs`), its cut halves in the calls of its first and last blocks. Blocks go several to
    a graph, and a block is one graph rather than two halves, because each graph call costs its
    guards, its argument gathering and its wrapper; the graph's wrapper is C++ (`cpp_wrapper`), which
    calls its kernels without Python in between. Guards skip the modules (checking every parameter of
    a block on every call cost more than its norms); so that a graph never runs on modules it was not
    made for, blocks share one only where their modules' classes, plain attributes and tensor shapes
    agree (`_signature`). The layer index is the one attribute left out: transformers hands it to the
    cache, and a `LayerKV` binds that layer's tensors instead. Dynamic shapes: one graph serves every
    context length and number of rows of its kind of step. The graphs are compiled ahead of time and
    kept on this host (`hpipe.runtime.graphs`): a warm start loads them without tracing."""

    def __init__(self, runner):
        super().__init__(runner.cache_argument)
        use_inductor_cache()
        runner.kv.keep_page_shape_static()
        self.fns: dict[int, graphs.Graph] = {}
        shared: dict[tuple, graphs.Graph] = {}
        for u, (fn, key) in graph_plan(runner).items():
            if key not in shared:
                shared[key] = graphs.Graph(fn, graphs.graph_dir(_graph_text(runner, fn, key)), DYNAMO_SETTINGS,
                                           _pages_static_while_traced)
            self.fns[u] = shared[key]
        self.graphs = len(shared)

    def blocks(self, u, mods, h, rotary, masks, cache, blocks):
        if any(b not in cache.store.keys for b in blocks):      # a layer's pages are made by its first write (eager)
            return super().blocks(u, mods, h, rotary, masks, cache, blocks)
        return self.fns[u](mods, h, rotary, masks, [{self.cache_argument: cache.layer(b)} for b in blocks])

    def attention(self, u, norm, module, h, rotary, mask, cache, block):
        if block not in cache.store.keys:
            return super().attention(u, norm, module, h, rotary, mask, cache, block)
        return self.fns[u](norm, module, h, rotary, mask, {self.cache_argument: cache.layer(block)})

    def mlp(self, u, norm, module, h):
        fn = self.fns.get(u)
        return super().mlp(u, norm, module, h) if fn is None else fn(norm, module, h)


def _pages_static_while_traced(args):
    """The KV pool a graph's arguments read (the last one: a block's cache keywords, or a list of
    them; an MLP half reads none), its page shape static while the graph is traced."""
    last = args[-1]
    keywords = last[0] if isinstance(last, list) else last
    if isinstance(keywords, dict):
        return next(iter(keywords.values())).cache.store.static_while_traced()
    return contextlib.nullcontext()


# Dynamo's settings for hpipe's graphs (process-wide: a stage compiles no other graphs). A module's
# float attributes (RMSNorm's epsilon, attention's scaling) are constants of the graph: with dynamic
# shapes dynamo otherwise makes each one an input, wrapped in a new 0-d tensor and guarded on every
# call (SmolLM2, 10 blocks in 2 graph calls at 1 thread: dynamo's part of a decode step went from
# 0.40-0.70 ms to 0.15-0.23, torch's profiler, two alternated runs). Every block has the same values,
# so the graphs are still shared. Part of the graphs' directory names (they change the graphs).
DYNAMO_SETTINGS = {"specialize_float": True}


def _signature(*modules) -> tuple:
    """What a graph shared by several blocks bakes in from their modules: classes, plain attributes
    (but the layer index, see `CompiledHalves`), tensor names, shapes and dtypes."""
    out = []
    for top in modules:
        for name, m in top.named_modules():
            attrs = tuple(sorted((k, v) for k, v in vars(m).items()
                                 if isinstance(v, (int, float, str, bool, type(None))) and k != "layer_idx"))
            tensors = tuple((k, tuple(t.shape), t.dtype) for k, t in itertools.chain(m._parameters.items(),
                                                                                  m._buffers.items()) if t is not None)
            out.append((name, type(m), attrs, tensors))
    return tuple(out)


def check_inductor_cache() -> None:
    """Refuses, before a compile spends its minute, an inductor cache whose path has a space: inductor's
    compiler command line splits there (torch 2.13's g++: "input file '/x/my' is the same as output
    file", a CppCompileError)."""
    from hpipe.errors import HpipeError

    path = os.environ.get("TORCHINDUCTOR_CACHE_DIR", "")
    if any(c.isspace() for c in path):
        raise HpipeError(f"inductor's cache {path!r} has a space in its path, which inductor's compiler command "
                         f"line breaks on; set HPIPE_CACHE (or TORCHINDUCTOR_CACHE_DIR) to a path without one")


def use_inductor_cache() -> None:
    """Inductor's artifacts under hpipe's cache directory (torch's default is a temporary one), so a
    second start loads what the first compiled; a user's own TORCHINDUCTOR_CACHE_DIR stays."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR", default_cache_dir()) == default_cache_dir():
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(models.cache_dir() / "inductor")


class RotaryTable:
    """The rotary embedding's cos and sin by position: transformers' own module computes them for
    positions [0, n) once (n doubles when a longer sequence comes) and a step looks its positions
    up, two indexing ops instead of the module's dozen (a decode step prepares with its caches cold
    after a forward: 79 -> 30 us). Rope types whose frequencies follow the sequence length (dynamic
    NTK, longrope) run the module every step."""

    STATIC = ("default", "linear", "llama3", "yarn")

    def __init__(self, module, dtype: torch.dtype):
        self.module, self.dtype = module, dtype
        self.static = getattr(module, "rope_type", None) in self.STATIC
        self.cos = self.sin = None

    def lookup(self, positions: torch.Tensor, end: int):
        """(cos, sin) [rows, L, head_dim] of `positions` [rows, L], every one below `end`."""
        if not self.static:
            return self.module(torch.empty(0, dtype=self.dtype, device=positions.device), positions)
        if self.cos is None or self.cos.shape[0] < end:
            n = max(256, 1 << (end - 1).bit_length())
            probe = torch.empty(0, dtype=self.dtype, device=positions.device)
            cos, sin = self.module(probe, torch.arange(n, device=positions.device)[None])
            self.cos, self.sin = cos[0], sin[0]
        return self.cos[positions], self.sin[positions]


def _mask_inputs(segments: list[Segment], layout: str, positions: torch.Tensor, end: int):
    """What an attention mask compares: each query row's position [.., L, 1], each key's [.., 1, K],
    and (packed) whether the two rows belong to one sequence. `end`: the longest segment's end."""
    dev = positions.device
    if layout == "rows":
        key_pos = torch.arange(end, device=dev)
        return positions[:, None, :, None], key_pos[None, None, None, :], None          # [n, 1, L, 1], [1, 1, 1, K]
    q_seq = torch.cat([torch.full((s.length,), i, device=dev) for i, s in enumerate(segments)])
    key_pos = torch.cat([torch.arange(s.end, device=dev) for s in segments])
    k_seq = torch.cat([torch.full((s.end,), i, device=dev) for i, s in enumerate(segments)])
    return positions[0][None, None, :, None], key_pos[None, None, None, :], \
        (q_seq[:, None] == k_seq[None, :])[None, None]


def _plain_causal(segments: list[Segment], layout: str, window: int | None) -> bool:
    """True when no mask is needed: every row attends exactly to its own tokens causally (all
    segments start at 0 with the same length), or one new token on a lone row. Several decode rows
    take a mask even after equal contexts: their compiled graph is then the one of unequal contexts
    (a graph without a mask would be one more to trace at every start)."""
    if layout != "rows":
        return False
    end = segments[0].end
    if any(s.end != end for s in segments) or (window is not None and end > window):
        return False
    return (len(segments) == 1 and segments[0].length == 1) or all(s.start == 0 for s in segments)
