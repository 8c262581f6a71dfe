"""Decode with speculative decoding, predicted from a measured acceptance rate.

The runtime proposes up to K tokens per step and adapts each sequence's k after every step
(`hpipe.runtime.speculative.next_k`: one more after a step whose proposals were all accepted, else
one past what was accepted). With every proposed token accepted with probability alpha, given the
ones before it were (Leviathan et al.'s i.i.d. model), k is a Markov chain on 1..K: a step of k
proposals accepts j < k of them with probability alpha^j (1 - alpha) and all k with alpha^k. Its
stationary distribution gives the proposals per step E[k] and the tokens per step 1 + E[a]; the
rate a run reports (accepted / proposed, printed by `hpipe launch` and counted in /metrics) is
E[a] / E[k], which fixes alpha (the rate grows with alpha: bisection).

A step of a sequence then computes 1 + E[k] rows instead of one (the profile's decode table at that
many rows, as a batch of that size), and its tokens come back one round trip later, as a plain
decode step's do: decode tokens/s = (1 + E[a]) x the plain prediction at 1 + E[k] rows per sequence.
Where the runtime's cap on a round's rows (SPEC_ROWS over every decoding sequence) leaves less
room, the proposals and what they accept shrink in proportion.
"""

from __future__ import annotations

import numpy as np

from hpipe.planner.simulate import decode_round

from hpipe.errors import HpipeError
from hpipe.runtime.speculative import SPEC_ROWS, next_k

__all__ = ["adaptive_proposals", "speculative_decode"]


def _chain(k_max: int, alpha: float) -> tuple[float, float]:
    """(E[k], E[a]) of the stationary chain of the runtime's adaptive k at per-token acceptance alpha."""
    trans = np.zeros((k_max, k_max))
    accepted = np.zeros(k_max)
    for k in range(1, k_max + 1):
        probs = [alpha ** j * (1 - alpha) for j in range(k)] + [alpha ** k]
        for a, p in enumerate(probs):
            trans[k - 1, next_k(k, k, a, k_max) - 1] += p
        accepted[k - 1] = sum(a * p for a, p in enumerate(probs))
    pi = np.full(k_max, 1.0 / k_max)
    for _ in range(2000):                       # power iteration: the chain mixes in a few dozen steps
        nxt = pi @ trans
        if np.abs(nxt - pi).max() < 1e-13:
            break
        pi = nxt
    ks = np.arange(1, k_max + 1)
    return float(pi @ ks), float(pi @ accepted)


def adaptive_proposals(k_max: int, acceptance: float) -> dict:
    """The per-token acceptance alpha whose stationary chain accepts `acceptance` of its proposals,
    and that chain's proposals and tokens per step."""
    if not 0.0 <= acceptance <= 1.0:
        raise HpipeError(f"--acceptance {acceptance}: the share of proposed tokens accepted, between 0 and 1 "
                         f"(`hpipe launch --speculative ...` prints it)")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        k, a = _chain(k_max, mid)
        lo, hi = (mid, hi) if a / k < acceptance else (lo, mid)
    alpha = (lo + hi) / 2
    k, a = _chain(k_max, alpha)
    return {"k_max": k_max, "acceptance": acceptance, "alpha": alpha, "proposed_per_step": k,
            "tokens_per_step": 1.0 + a}


def speculative_decode(batch: int, rows: int, groups: int, step_s, k_max: int, acceptance: float,
                       back_s: float = 0.0) -> dict:
    """Decode of `batch` sequences in `groups` groups of `rows` with speculation: step_s(r) gives
    every stage's step (compute and send) for r rows per group; back_s the way back to stage 0."""
    chain = adaptive_proposals(k_max, acceptance)
    proposed = min(chain["proposed_per_step"], max(0.0, SPEC_ROWS / batch - 1.0))
    extra = (chain["tokens_per_step"] - 1.0) * proposed / chain["proposed_per_step"]
    step = step_s(rows * (1.0 + proposed))
    round_s = float(decode_round(step, back_s, groups))
    return {**chain, "proposed_per_step": proposed, "tokens_per_step": 1.0 + extra, "stage_step_s": step,
            "round_s": round_s, "tokens_per_s": batch * (1.0 + extra) / round_s}
