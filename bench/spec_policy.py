"""Prompt lookup's rule, replayed: which n-gram matches should propose, and how many tokens.

Greedy decoding gives the same tokens with and without speculation, so one launch without it (the
default model, one local stage, bench/speculative.py's 8 document questions and 8 ShareGPT turns, 64
new tokens) gives every answer, and each rule's steps can be replayed on them without the model: at
each step the rule proposes from the tokens so far, the answer's next tokens say how many are
accepted, and the step emits those and one more. A step of 1 + p rows costs about 1 + alpha p
one-token steps (alpha: what a proposed token adds to a step; 0.24 for the compiled int4 default on
2 threads of an AMX Xeon, from bench/results/speculative-amx.json), so a rule's speed-up over no
speculation is (tokens - answers) / (steps + alpha proposed), and its bound (tokens - answers) / steps.

    python bench/spec_policy.py [--out bench/results/spec-policy.json]

Rules: `min`, `max` the shortest and longest suffix looked up; `cap` "k" proposes up to k tokens
from any match, "n-1" at most one fewer than the suffix matched. `hpipe.runtime.speculative`'s own
index is replayed too and must propose what its rule's row does.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import on_path  # noqa: E402,F401  (bench/on_path.py: the repository and tests/ on sys.path, bench/ off it)

from bench.common import bench_arguments, cpu_flags, cpu_name, hpipe, results_path  # noqa: E402

NEW_TOKENS, K = 64, 4
RULES = [dict(min=1, max=4, cap="k"), dict(min=2, max=4, cap="k"), dict(min=3, max=4, cap="k"),
         dict(min=2, max=8, cap="n-1")]
ALPHAS = (0.15, 0.24, 0.35)


def answers(work: Path) -> dict[str, list[tuple[list[int], list[int]]]]:
    """Each workload's (prompt ids, greedy answer ids), from one launch without speculation."""
    from transformers import AutoTokenizer

    from bench.speculative import workloads
    from hpipe import formats, models
    from hpipe.launcher.jobs import encode_prompt

    tokenizer = AutoTokenizer.from_pretrained(models.resolve_model("smollm2").path)
    plan = work / "plan.json"
    hpipe("plan", "--model", "smollm2", "--stages", "1", "-o", plan, cwd=work)
    out = {}
    for name, prompts in workloads().items():
        path, done = work / f"{name}.jsonl", work / f"{name}-out.jsonl"
        path.write_text("".join(json.dumps(p) + "\n" for p in prompts))
        hpipe("launch", plan, "--local", "--prompts", path, "--out", done, "--max-new-tokens", NEW_TOKENS,
              "--max-batch", 8, "--quiet", cwd=work)
        records = {r.id: r for r in formats.load_prompts(path)}
        results = [json.loads(x) for x in done.read_text().splitlines()]
        out[name] = [(encode_prompt(tokenizer, records[r["id"]]), r["output_ids"]) for r in results]
    return out


def proposer(rule: dict):
    """The rule as a function of the tokens so far and k (an index of every n-gram's latest end)."""
    latest: dict[tuple, int] = {}
    seen = [0]

    def propose(tokens: list[int], k: int) -> list[int]:
        for end in range(max(0, seen[0] - 1), len(tokens) - 1):
            for n in range(rule["min"], min(rule["max"], end + 1) + 1):
                latest[tuple(tokens[end - n + 1:end + 1])] = end
        seen[0] = len(tokens)
        for n in range(min(rule["max"], len(tokens)), rule["min"] - 1, -1):
            end = latest.get(tuple(tokens[len(tokens) - n:]))
            if end is not None:
                return tokens[end + 1:end + 1 + (k if rule["cap"] == "k" else min(k, n - 1))]
        return []
    return propose


def runtime_proposer():
    from hpipe.runtime.speculative import NgramIndex

    index = NgramIndex()

    def propose(tokens: list[int], k: int) -> list[int]:
        index.extend(tokens[len(index.tokens):])
        return index.propose(k)
    return propose


def replay(items, make) -> dict:
    """Each answer decoded step by step under a fresh proposer from `make` (the runtime's adaptive k:
    `next_k`)."""
    from hpipe.runtime.speculative import next_k

    steps = proposed = accepted = tokens = 0
    for prompt, answer in items:
        propose, k, have = make(), K, 1            # the first token comes from the prefill
        while have < len(answer):
            draft = propose(prompt + answer[:have], min(k, NEW_TOKENS - have - 1))
            a = 0
            while a < len(draft) and have + a < len(answer) and draft[a] == answer[have + a]:
                a += 1
            steps, proposed, accepted = steps + 1, proposed + len(draft), accepted + a
            have += a + 1
            k = next_k(k, len(draft), a, K)
        tokens += len(answer)
    decoded = tokens - len(items)
    out = {"steps": steps, "proposed": proposed, "accepted": accepted, "proposed_per_step": round(proposed / steps, 3),
           "acceptance": round(accepted / max(1, proposed), 3), "bound": round(decoded / steps, 3)}
    for alpha in ALPHAS:
        speedup = decoded / (steps + alpha * proposed)
        out[f"alpha_{alpha}"] = {"speedup": round(speedup, 3), "of_bound": round(speedup * steps / decoded, 3)}
    return out


def main() -> None:
    args = bench_arguments(out=results_path("spec-policy"))
    with tempfile.TemporaryDirectory(prefix="hpipe-bench-policy-") as tmp:
        data = answers(Path(tmp))
    report = {"date": time.strftime("%Y-%m-%d"), "cpu": cpu_name(), "cpu_flags": cpu_flags(), "model": "smollm2",
              "new_tokens": NEW_TOKENS, "k": K, "workloads": {}}
    for name, items in data.items():
        rows = {f"min {r['min']}, max {r['max']}, cap {r['cap']}": replay(items, lambda r=r: proposer(r)) for r in RULES}
        runtime = replay(items, runtime_proposer)
        assert runtime == rows["min 2, max 8, cap n-1"], "the runtime's index proposes other tokens than its rule"
        report["workloads"][name] = rows
        for rule, row in rows.items():
            print(f"{name:9s} {rule:26s} {json.dumps(row)}")
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
