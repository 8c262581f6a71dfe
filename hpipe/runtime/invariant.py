"""`--deterministic on`: one answer per request. A row's arithmetic is fixed by the row itself (its
position, its request's prompt), never by the micro-batch around it: which other requests share
the step, how the prompt was sliced, whether its prefix came from the cache, after a preemption,
on which stage a unit runs.

What varies otherwise, measured on this kind of CPU (tests/test_determinism.py keeps it so):
- attention: torch's SDPA gives a query row other bits when the call holds other rows, other
  sequences (its batch dimension) or padded keys; so a deterministic stage (an attention
  implementation registered with transformers, its modules unchanged) calls it once per
  *piece*: each generated token alone with exactly its keys, and a prompt in pieces of one KV page
  ([kP, (k+1)P), keys [0, (k+1)P), the last piece ending at the prompt's end), the same pieces
  however the scheduler sliced it (its cuts and prefix hits fall on page boundaries);
- float32 linears: MKL's GEMM rounds a row differently for other numbers of rows; padded to a
  multiple of `TILE` rows, a row gets the same bits for any count (`RowTiledLinear`);
- quantized linears: the weight-only kernel, and the dense GEMM on rows tiled as its
  `quant.DenseGemm` says (bf16: calls of exactly 128 rows; float32: one call, a multiple of 16),
  each give a row the same bits for any number of rows, but
  round apart; the path is chosen by the row's request, not by the call's rows (`hpipe.quant.ROW_PATHS`: prompt rows of prompts of `DENSE_PROMPT` tokens or more
  take the dense GEMM, every other row the kernel);
- RMSNorm, rotary embeddings and the MLP's elementwise products are row by row already.
Decode steps run eagerly (no static path, no compiled halves: their kernels read padded keys).
Not measured on CUDA yet (cuBLAS and its SDPA kernels split by shape too)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hpipe import quant
from hpipe.runtime.pages import Segment

__all__ = ["ATTENTION", "Pieces", "RowTiledLinear", "pieces_for", "refused", "resolve",
           "row_paths", "scheduling", "tile_linears"]

TILE = 16             # rows: float32 linears run on a multiple of this many rows
ATTENTION = "hpipe_rows"      # the attention implementation registered with transformers


def scheduling(page_size: int, deterministic: bool) -> dict:
    """The scheduler's part (`Scheduler(grid=, long_prompt=)`): prompts cut on page boundaries, and the
    prefixes of prompts whose rows take the dense path cached apart."""
    return {"grid": page_size, "long_prompt": quant.DENSE_PROMPT} if deterministic else {}


def resolve(setting: str, config, page_size: int, max_tokens: int) -> bool:
    """--deterministic for a whole plan (every stage decides the same); one line when it cannot be."""
    if setting == "off":
        return False
    why_not = refused(config) or (f"prompts are cut on whole pages of {page_size} tokens, more than a micro-batch "
                                   f"holds ({max_tokens}): lower --page-size or raise --budget / --max-prefill"
                                   if page_size > max_tokens else None)
    if why_not:
        from hpipe.errors import HpipeError
        raise HpipeError(f"--deterministic on: {why_not}")
    return True


def refused(config) -> str | None:
    """Why a model cannot run deterministically, or None."""
    from hpipe import models

    if config.model_type not in models.LLAMA_LIKE:
        return f"it runs llama-like models (their attention goes through transformers' interface), not " \
               f"{config.model_type}: leave it off for this model"
    if models.is_moe(config):
        return f"a mixture of experts ({config.model_type}) runs each expert over the rows routed to it, " \
               f"so a row's bits depend on the others: leave it off for this model"
    return None


# ------------------------------------------------------------------------------ attention
@dataclass(frozen=True)
class Piece:
    """Queries [q0, q1) of batch row b attend to keys [k0, k1) of that row, under `mask` (None:
    every key, the one-query case)."""

    b: int
    q0: int
    q1: int
    k0: int
    k1: int
    mask: torch.Tensor | None


class Pieces(list):
    """A micro-batch's attention pieces for one window: what a deterministic stage passes as the
    attention mask (transformers hands it to the attention function as it is)."""


def _prompt_rows(seg: Segment) -> int:
    """How many of the segment's rows are prompt tokens."""
    if not seg.prefill:
        return 0
    return max(0, min(seg.end, seg.prompt or seg.end) - seg.start)


def pieces_for(segments: list[Segment], layout: str, window: int | None, grid: int, device) -> Pieces:
    out = Pieces()
    q_at = k_at = 0
    for i, seg in enumerate(segments):
        b, qb, kb = (i, 0, 0) if layout == "rows" else (0, q_at, k_at)
        prompt_end = seg.start + _prompt_rows(seg)
        a = seg.start
        spans = []
        while a < prompt_end:                       # prompt rows: pieces of one page (the grid)
            e = min(prompt_end, (a // grid + 1) * grid)
            spans.append((a, e))
            a = e
        spans += [(p, p + 1) for p in range(a, seg.end)]    # generated tokens: one each
        for a, e in spans:
            k0 = 0 if window is None else max(0, a - window + 1)
            mask = None
            if e - a > 1:
                q = torch.arange(a, e, device=device)[:, None]
                k = torch.arange(k0, e, device=device)[None, :]
                allowed = k <= q
                if window is not None:
                    allowed = allowed & (k > q - window)
                mask = allowed[None, None]
            out.append(Piece(b, qb + a - seg.start, qb + e - seg.start, kb + k0, kb + e, mask))
        q_at += seg.length
        k_at += seg.end
    return out


def attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """transformers' attention interface (its modules call it with their projections), piece by
    piece through torch's SDPA. query [b, heads, L, d]; key, value [b, kv heads, K, d]; returns
    [b, L, heads, d]. (transformers' own SDPA function around each call costs 4 of its 28 us.)"""
    gqa = query.shape[1] != key.shape[1]
    out = query.new_empty(query.shape[0], query.shape[2], query.shape[1], query.shape[3])
    for p in attention_mask:
        o = torch.nn.functional.scaled_dot_product_attention(
            query[p.b:p.b + 1, :, p.q0:p.q1], key[p.b:p.b + 1, :, p.k0:p.k1], value[p.b:p.b + 1, :, p.k0:p.k1],
            attn_mask=p.mask, scale=scaling, enable_gqa=gqa)
        out[p.b, p.q0:p.q1] = o[0].transpose(0, 1)
    return out, None


def register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, attention)


# ------------------------------------------------------------------------------ linears
def row_paths(segments: list[Segment], rows: list[int] | None, device) -> quant.RowPaths:
    """The quantized linears' path of every row of the micro-batch (`rows`: of these flattened rows
    only, the head's), by the row's own request: dense for the prompt rows of long prompts."""
    dense = []
    for seg in segments:
        n = _prompt_rows(seg)
        long = (seg.prompt or seg.end) >= quant.DENSE_PROMPT
        dense += [long and j < n for j in range(seg.length)]
    if rows is not None:
        dense = [dense[r] for r in rows]
    return quant.RowPaths.of(dense, device)


class RowTiledLinear(torch.nn.Module):
    """An `nn.Linear` whose rows go through the GEMM padded to a multiple of TILE rows: the bits of a
    row then do not depend on how many rows share the call (see the module's docstring)."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.linear = linear

    @property
    def weight(self):
        return self.linear.weight

    def forward(self, x):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        n = x2.shape[0]
        pad = -n % TILE
        if pad:
            x2 = torch.cat([x2, x2.new_zeros(pad, x2.shape[1])])
        y = torch.matmul(x2.view(-1, TILE, x2.shape[1]), self.linear.weight.t()).reshape(-1, self.linear.out_features)
        y = y[:n]
        if self.linear.bias is not None:
            y = y + self.linear.bias
        return y.reshape(*shape[:-1], self.linear.out_features)


def tile_linears(model: torch.nn.Module) -> int:
    """Puts every plain `nn.Linear` of `model` inside a `RowTiledLinear`; returns how many."""
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if type(child) is torch.nn.Linear]
    for parent, name, child in swaps:
        setattr(parent, name, RowTiledLinear(child))
    return len(swaps)
