"""Speculative decoding's proposers (stage 0): prompt lookup here, a draft model in
`hpipe.runtime.draft`.

A decode step of a speculating sequence carries its last token and up to k proposed tokens
(`Segment.draft`); every stage computes them as one short slice, and the last stage's sampler
verifies them (`hpipe.sampling.RequestSampler.sample`): it samples each position in turn, with the
request's own parameters and state as of that position, and goes on to the next position only while
the sampled token equals the proposed one. Every token it samples is emitted, so the output is the
one decoding without speculation gives (greedy: the same argmax; sampling: the same draws from the
request's generator, one per emitted token), and at most the tokens after the first mismatch are
lost. Stage 0 rolls the sequence back to the positions whose tokens were emitted (`Scheduler`).

Prompt lookup (vLLM's n-gram proposer, llama.cpp's lookup decoding): the longest suffix of the
sequence's tokens (prompt and output, NGRAM_MAX down to NGRAM_MIN of them) that occurred before
proposes what followed its latest earlier occurrence: at most k tokens, and fewer than the suffix
matched (a bet no longer than its evidence). An index of every n-gram's latest position makes a
proposal a few dictionary lookups, however long the prompt.

A proposer is chosen once, at start (`hpipe.runtime.draft.proposer_for`), and the scheduler asks it
for every speculating sequence of a micro-batch at once (`propose`): a draft model runs them as one
batch. It keeps what it needs per sequence until `forget`.

Pure Python (no torch).
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["NGRAM_MAX", "NGRAM_MIN", "SPEC_ROWS", "SPEC_SEQUENCES", "NgramIndex", "NgramProposer", "Proposer", "next_k", "through_end"]

# The shortest suffix looked up is 2 tokens and a suffix of n proposes at most n - 1: one token
# matched anywhere is weak evidence, and on a CPU every proposed token costs its step ~0.24 of a
# one-token step (the compiled int4 default, 2 threads). On SmolLM2's greedy answers to 8 document
# questions and 8 ShareGPT turns (bench/spec_policy.py replays them; bench/results/spec-policy.json),
# against 1-to-4-token suffixes proposing k: 0.74 tokens proposed a step where 1.34 were (chat 0.41,
# 0.89), 13-14 % fewer accepted, and a predicted 1.18x where 1.11x (chat 1.17x, 1.10x).
NGRAM_MAX, NGRAM_MIN = 8, 2
# The most decode rows (fed tokens and proposals) of a round, every decoding sequence's step once
# (one micro-batch on one stage, a few on a pipeline): beyond it a step stops being bound by reading
# the weights, and proposals that fail cost more than they save (a full batch decodes without them).
# Counted per micro-batch, 8 sequences on 3 stages proposed 13 tokens beside 3 rows and lost 7 % of
# their throughput. bench/speculative.py measures both sides.
SPEC_ROWS = 16
# The most sequences a micro-batch whose steps carry proposals holds. A lone sequence's verification
# step runs through the compiled decode graphs (`StageRunner.takes_graphs`); several sequences'
# rows of unequal lengths are packed and ran eagerly, beside compiled one-token steps, each query
# row scoring every sequence's context: 8 requests at once on one stage (AVX-512, 2 threads, after
# `hpipe warmup --speculative`) made 0.46-0.56x the tokens a second of no speculation
# (bench/speculative.py), where a lone stream made 1.03-1.17x. On a pipeline a round's sequences
# go a micro-batch each while there are no more of them than stages.
SPEC_SEQUENCES = 1


class NgramIndex:
    """One sequence's tokens and the latest position of every n-gram of them that a token follows."""

    def __init__(self):
        self.tokens: list[int] = []
        self.latest: dict[tuple[int, ...], int] = {}   # n-gram -> the position of its last token

    def extend(self, tokens) -> None:
        old = len(self.tokens)
        self.tokens.extend(tokens)
        toks = self.tokens
        for end in range(max(0, old - 1), len(toks) - 1):     # positions that now have a next token
            for n in range(NGRAM_MIN, min(NGRAM_MAX, end + 1) + 1):
                self.latest[tuple(toks[end - n + 1:end + 1])] = end

    def propose(self, k: int) -> list[int]:
        """What followed the latest earlier occurrence of the longest suffix that has one: up to k
        tokens and fewer than the suffix's n."""
        toks = self.tokens
        for n in range(min(NGRAM_MAX, len(toks)), NGRAM_MIN - 1, -1):
            end = self.latest.get(tuple(toks[len(toks) - n:]))
            if end is not None:
                return toks[end + 1:end + 1 + min(k, n - 1)]
        return []


class Proposer(Protocol):
    k: int              # the most tokens proposed per step

    def propose(self, wants: list[tuple]) -> list[list[int]]:
        """wants: (sequence, n) pairs, every sequence with its last token back (its prompt and output
        are all its tokens): at most n proposed tokens for each, in order."""

    def forget(self, index: int) -> None:
        """The sequence left: what was kept for it goes."""


class NgramProposer:
    """Prompt lookup: an n-gram index per sequence, extended by the tokens it gained since."""

    def __init__(self, k: int):
        self.k = k
        self.indexes: dict[int, NgramIndex] = {}

    def propose(self, wants: list[tuple]) -> list[list[int]]:
        out = []
        for seq, n in wants:
            index = self.indexes.setdefault(seq.index, NgramIndex())
            have, prompt = len(index.tokens), seq.request.input_ids
            index.extend(prompt[have:] if have < len(prompt) else ())
            index.extend(seq.output[max(0, have - len(prompt)):])
            out.append(index.propose(n))
        return out

    def forget(self, index: int) -> None:
        self.indexes.pop(index, None)


def through_end(tokens: list[int], ends: frozenset[int]) -> list[int]:
    """A proposal up to and with its first token that ends the request (an EOS or stop id): no token
    after it would be used. A draft of the model itself proposed past its EOS: 3 of 12 proposals
    verified for nothing on a short answer."""
    for i, t in enumerate(tokens):
        if t in ends:
            return tokens[:i + 1]
    return tokens


def next_k(k: int, proposed: int, accepted: int, k_max: int) -> int:
    """A sequence's next proposal size: one more after a step whose proposals were all accepted,
    else one past what was accepted (fewer proposals while acceptance is low)."""
    if proposed == 0:
        return k
    return min(k_max, k + 1) if accepted == proposed else max(1, accepted + 1)
