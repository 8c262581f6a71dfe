"""Speculative decoding with a draft model: a small model with the target's tokenizer runs beside
stage 0 and proposes each speculating sequence's next k tokens, greedily.

The draft is a whole model in one `StageRunner` (transformers' own modules, GGUF weights kept in
their blocks as a stage keeps them) with its own paged KV: a `PagePool` of its own, pages taken per
sequence as it grows and given back when the sequence leaves. Per sequence it remembers the
tokens whose KV its pages hold; a call to `propose` first feeds what the sequence gained since
(the whole prompt on the first call, then the tokens accepted and the one sampled after them; the
KV of its own rejected proposals is overwritten, as the target's is), then decodes k tokens. Every
speculating sequence of a micro-batch runs in the same forward calls: one for the catch-up of all
of them (packed), then one per proposed token.

The proposals are the draft's argmax, a point mass, so verification by sampling the target at each
position and accepting while it equals the proposal (`hpipe.sampling.RequestSampler.sample`) is
Leviathan et al.'s accept rule for a deterministic draft (accept with probability p(x)), as
llama.cpp's speculative server verifies: the output is exactly the target's, greedy or sampled.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hpipe import models, quant
from hpipe.config import Speculation
from hpipe.errors import HpipeError
from hpipe.runtime.pages import PagePool, Segment, pages_needed
from hpipe.runtime.speculative import NgramProposer, Proposer
from hpipe.runtime.stage import StageRunner

__all__ = ["DraftProposer", "proposer_for"]


def proposer_for(speculation: Speculation, vocab: int, device: str, dtype: str, pages: int,
                 page_size: int, kv_dtype: str) -> Proposer | None:
    """The proposer --speculative asks for, built once at start (None: off). pages, page_size,
    kv_dtype: the model's KV pool; a draft's own pool holds as many tokens, of the same type."""
    if speculation.proposer == "ngram":
        return NgramProposer(speculation.k)
    if speculation.proposer == "draft":
        return DraftProposer(speculation, vocab, device, dtype, pages, page_size, kv_dtype)
    return None


@dataclass
class _Held:
    """What the draft holds for one sequence: its pages and the tokens whose KV they hold."""

    pages: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)


class DraftProposer:
    def __init__(self, speculation: Speculation, vocab: int, device: str, dtype: str, pages: int, page_size: int,
                 kv_dtype: str):
        source = models.resolve_model(speculation.model)
        config = models.load_config(source.path)
        if int(config.vocab_size) != vocab:
            raise HpipeError(f"--speculative {speculation.proposer}:{speculation.model}: the draft's vocabulary has "
                             f"{config.vocab_size} tokens, the model's {vocab}; a draft model must share the model's "
                             f"tokenizer (e.g. a smaller model of its family)")
        weights = quant.stage_weights(quant.default_format(source.gguf is not None), device)
        self.k = speculation.k
        self.runner = StageRunner(source, config, range(models.num_units(config)), device, dtype,
                                  page_size=page_size, weights=weights, kv_dtype=kv_dtype)
        # as many tokens as the model's pool holds (page 0 is scratch); a sequence that finds it full
        # gets no proposals until pages come back
        self.pool = PagePool(pages, page_size)
        self.runner.kv.allocate(self.pool.pages)
        self.held: dict[int, _Held] = {}

    def forget(self, index: int) -> None:
        held = self.held.pop(index, None)
        if held is not None:
            self.pool.give_back(held.pages)

    def propose(self, wants: list[tuple]) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in wants]
        segments, ids = [], []
        for i, (seq, n) in enumerate(wants):
            tokens = seq.known_tokens
            held = self.held.setdefault(seq.index, _Held())
            same = _common_prefix(held.tokens, tokens, len(tokens) - 1)   # its last token is fed again at least
            more = pages_needed(len(tokens) + n - 1, self.pool.page_size) - len(held.pages)
            got = self.pool.take(more) if more > 0 else []
            if got is None:                    # the draft's pool is full: no proposals for it this step
                self.forget(seq.index)
                continue
            held.pages += got
            segments.append(Segment(i, i, same, len(tokens) - same, sample=True, pages=tuple(held.pages)))
            ids += tokens[same:]
            held.tokens = list(tokens)
        with torch.inference_mode():
            while segments:
                logits = self.runner.forward(self.runner.prepare_inputs(segments), torch.tensor(ids, dtype=torch.long))
                going, ids = [], []
                for seg, token in zip(segments, logits.argmax(-1).tolist()):
                    out[seg.seq].append(token)
                    seq, n = wants[seg.seq]
                    if len(out[seg.seq]) < n and token not in seq.request.ends:     # nothing after an end is used
                        going.append(Segment(seg.seq, seg.slot, seg.end, 1, sample=True, pages=seg.pages))
                        ids.append(token)
                        self.held[seq.index].tokens.append(token)
                segments = going
        return out


def _common_prefix(a: list[int], b: list[int], most: int) -> int:
    """The length of a and b's common prefix, at most `most` (a bisection of list comparisons,
    which run in C: a few of them over a long prompt, instead of a Python loop over its tokens)."""
    lo, hi = 0, min(len(a), len(b), most)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
