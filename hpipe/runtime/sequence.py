"""One request on its way through stage 0's scheduler: its status, its pages, its tokens, its clock.

A sequence moves through the statuses in one direction, except for preemption:

    WAITING ──admit──> PREFILLING ──last prompt slice committed──> DECODING ──end──> FINISHED
                            ^                                         │
                            └──── pages back, recomputed ─── PREEMPTED <┘ (no free page)

- WAITING: queued, no slot, no pages;
- PREFILLING: its prompt (+ its output, after a preemption) is being sent in slices;
- DECODING: every token it has was sent; each step feeds its last token;
- PREEMPTED: it takes no new steps; once its steps in flight are back its pages return to the pool
  and it is PREFILLING again, from its first token (vLLM's recompute preemption);
- FINISHED: it ended (EOS, a stop id, its length, an abort); its steps still in flight run as
  leftovers whose ids are dropped.

Tokens are counted, and TTFT / TPOT measured, here and nowhere else (`timing`).

Pure Python (no torch).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from hpipe.request import Request

__all__ = ["Sequence", "Status"]


class Status(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request: Request
    t_arrival: float                           # when it was added (the scheduler's clock)
    status: Status = Status.WAITING
    slot: int = -1                             # its row in every stage's page table, while it has one
    order: int = -1                            # admission order (preemption takes the latest)
    tokens: list[int] = field(default_factory=list)   # what its prefill feeds: the prompt (+ output, after a preemption)
    cuts: list[int] = field(default_factory=list)     # the plan's slice ends for `tokens`, when it runs alone
    pos: int = 0                               # tokens of this sequence already sent into the pipeline
    pages: list[int] = field(default_factory=list)
    cached: int = 0                            # tokens at the head of `tokens` found in the prefix cache
    fresh: bool = False                        # its next segment carries its whole page list (a cached head)
    fed: int = 0                               # positions whose input ids are decided (their KV is the tokens')
    keys: list = field(default_factory=list)   # its full pages' prefix-cache keys so far (`pages.page_keys`)
    output: list[int] = field(default_factory=list)
    in_flight: int = 0                         # committed sampling steps whose token has not come back
    committed: int = 0                         # tokens it will have once every committed step is back
    last_mb: int = -1                          # the micro-batch of its latest step (round-robin order)
    preemptions: int = 0
    spec_k: int = 0                            # speculating: its next step's most proposed tokens (adapts)
    drafting: bool = False                     # a step carrying proposals is in flight (none goes after it)
    proposed: int = 0                          # tokens proposed for it, and of them accepted
    accepted: int = 0
    finish_reason: str | None = None
    t_first: float | None = None
    t_last: float | None = None

    @property
    def index(self) -> int:
        """The request's key, from the server's handler to the sampler."""
        return self.request.index

    @property
    def prefilling(self) -> bool:
        return self.status is Status.PREFILLING

    @property
    def decoding(self) -> bool:
        return self.status is Status.DECODING

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def started(self) -> bool:
        """Some of its own tokens were sent (past its cached head)."""
        return self.pos > self.cached

    @property
    def known_tokens(self) -> list[int]:
        """The token at every position it has: its prompt, then its output."""
        return list(self.request.input_ids) + self.output

    @property
    def scoring(self) -> bool:
        """Its next segment needs every row's logits: it asked for its prompt's
        log-probabilities and the segment holds positions that predict prompt tokens (the last
        stage reports each position once, a preemption's recompute included)."""
        return self.request.params.prompt_logprobs is not None and self.pos < len(self.request.input_ids) - 1

    @property
    def prefilled(self) -> bool:
        """Every token it has was sent (it decodes, or would, were it not preempted)."""
        return self.pos >= len(self.tokens) and self.status is not Status.WAITING

    def take_token(self, token: int, now: float) -> None:
        """A token sampled for it: the one place tokens are counted and its clock read (a step's
        return, `in_flight`, is the scheduler's to count: one step may bring several tokens)."""
        self.output.append(token)
        self.t_first = now if self.t_first is None else self.t_first
        self.t_last = now
        self.finish_reason = self.request.finish_reason(token, len(self.output))
        if self.finish_reason:
            self.status = Status.FINISHED

    def finish(self, reason: str) -> None:
        self.finish_reason, self.status = reason, Status.FINISHED

    def timing(self, t0: float | None = None) -> dict:
        """TTFT, TPOT, end-to-end time and tokens/s, from its arrival (or from `t0`, a batch job's start)."""
        n = len(self.output)
        start = self.t_arrival if t0 is None else t0
        if self.t_first is None:
            return {"ttft_s": None, "tpot_s": 0.0, "e2e_s": None, "tokens_per_s": None}
        ttft, e2e = self.t_first - start, self.t_last - start
        return {"ttft_s": round(ttft, 6),
                "tpot_s": round((self.t_last - self.t_first) / (n - 1), 6) if n > 1 else 0.0,
                "e2e_s": round(e2e, 6), "tokens_per_s": round(n / e2e, 3) if e2e > 0 else None}
