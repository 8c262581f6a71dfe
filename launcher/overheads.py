"""What a run's timelines say of a decode token's trip beyond its stages' compute: each hop and the
way back (the last stage samples, the ids go to stage 0, its scheduler commits the step and the
next one is prepared). The run summary's predicted-against-measured check reads them with
`decode_terms`; `hpipe profile` measures the same terms on this machine before any plan
(`hpipe.profiler.runtime_costs`).
"""

from __future__ import annotations

import collections
import statistics

__all__ = ["decode_terms"]


def decode_terms(stages: list[dict]) -> dict[str, float]:
    """Medians over the steady decode tokens of one stream (seconds): each stage's compute
    ("compute R"), each hop ("hop R->R+1", a stage's compute end to the next one's start), the way
    back ("back", the last stage's compute end to stage 0's next compute start) and the token.
    `stages`: every stage's timeline report (rank, intervals). Empty with fewer than 4 tokens."""
    compute = {}
    for st in stages:
        for i in st["intervals"]:
            if i["what"] == "compute" and i.get("kind") == "decode":
                compute[(st["rank"], i["mb"])] = (i["start"], i["end"])
    n = len(stages)
    ids = sorted(m for r, m in compute if r == 0 and all((s, m) in compute for s in range(n)))
    steady = ids[2:]                            # the first steps warm caches and the allocator
    parts = collections.defaultdict(list)
    for a, b in zip(steady, steady[1:]):
        if compute[(0, b)][0] < compute[(n - 1, a)][1]:   # another stream's step in between: not one trip
            continue
        for r in range(n):
            parts[f"compute {r}"].append(compute[(r, a)][1] - compute[(r, a)][0])
            if r + 1 < n:
                parts[f"hop {r}->{r + 1}"].append(compute[(r + 1, a)][0] - compute[(r, a)][1])
        parts["back"].append(compute[(0, b)][0] - compute[(n - 1, a)][1])
        parts["token"].append(compute[(0, b)][0] - compute[(0, a)][0])
    if len(parts["token"]) < 3:
        return {}
    return {k: statistics.median(v) for k, v in parts.items()}
