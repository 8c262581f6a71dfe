"""A host that never ran `hpipe warmup`: a batch job with default flags against the same job after
`hpipe warmup` (the warmup's time included), and a short job against an eager run.

Each variant gets an inductor cache of its own, new and empty (`TORCHINDUCTOR_CACHE_DIR`: a host that
never compiled anything), so a cold job meets what a fresh host meets: `--compile auto` compiles the
plan's decode graphs first where the plan's own prediction says the job's decode time saved exceeds
the compile's cost, else runs eagerly and says what a warmup would save.

- long job, cold: `hpipe launch` of --prompts prompts (64 token ids each, --new-tokens each), default flags;
- long job, warmed: `hpipe warmup --plan` then the same launch; its wall is the two together;
- short job (--short prompts), cold, default flags, against the same with `--compile off`.

The plan: `hpipe plan --model MODEL --stages N` (default flags). Variants in --rounds rounds, the
order turned each round (this machine is shared). Writes bench/results/cold_host.json.

    python bench/cold_host.py [--model smollm2] [--stages 2] [--prompts 64] [--short 4] [--new-tokens 64] [--rounds 1]
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import on_path  # noqa: E402,F401  (bench/on_path.py: the repository and tests/ on sys.path, bench/ off it)

from bench.common import bench_arguments, cpu_flags, cpu_name, hpipe, results_path, token_prompts  # noqa: E402


def fresh_cache(work: Path, tag: str) -> dict:
    """This process's environment with an inductor cache of its own, new and empty (no space in its
    path: inductor's compiler command line broke on one, "CppCompileError")."""
    path = tempfile.mkdtemp(prefix=f"inductor-{tag.replace(' ', '-')}-", dir=work)
    return dict(os.environ, TORCHINDUCTOR_CACHE_DIR=path)


def launch(plan: Path, prompts: Path, work: Path, tag: str, env: dict, new_tokens: int, *extra: str) -> dict:
    """One `hpipe launch --local`: its wall, whether it ran compiled graphs, what it said about compiling."""
    out = work / f"{tag.replace(' ', '-')}.jsonl"
    out.unlink(missing_ok=True)           # the same variant's file from an earlier round
    t = time.time()
    said = hpipe("launch", plan, "--local", "--prompts", prompts, "--out", out, "--max-new-tokens", new_tokens,
                 *extra, cwd=work, env=env)
    wall = time.time() - t
    options = json.loads(Path(f"{out}.summary.json").read_text())["run"]["options"]
    return {"wall_s": round(wall, 2), "compiled": options["compiled"], "compile_cold": options["compile_cold"],
            "said": [line for line in said.splitlines() if "compil" in line or "warmup" in line or "eager" in line]}


def one_round(plan: Path, long: Path, short: Path, work: Path, new_tokens: int, order: list[str]) -> dict:
    row = {}
    for variant in order:
        env = fresh_cache(work, variant)
        if variant == "long cold":
            row[variant] = launch(plan, long, work, variant, env, new_tokens)
        elif variant == "long warmed":
            t = time.time()
            hpipe("warmup", "--plan", plan, cwd=work, env=env)
            warmup_s = time.time() - t
            got = launch(plan, long, work, variant, env, new_tokens)
            row[variant] = {**got, "warmup_s": round(warmup_s, 2), "job_s": got["wall_s"],
                            "wall_s": round(warmup_s + got["wall_s"], 2)}
        elif variant == "short cold":
            row[variant] = launch(plan, short, work, variant, env, new_tokens)
        else:
            row[variant] = launch(plan, short, work, variant, env, new_tokens, "--compile", "off")
        print(variant, json.dumps(row[variant]), flush=True)
    return row


def main() -> None:
    args = bench_arguments(model="smollm2", stages=2, prompts=64, short=4, new_tokens=64,
                           rounds=(1, "rounds of the four variants, the order turned each round"),
                           out=results_path("cold_host"))
    variants = ["long cold", "long warmed", "short cold", "short eager"]
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        plan = work / "plan.json"
        hpipe("plan", "--model", args.model, "--stages", args.stages, "-o", plan, cwd=work)
        long = token_prompts(work / "long.jsonl", args.prompts)
        short = token_prompts(work / "short.jsonl", args.short)
        for r in range(args.rounds):
            rounds.append(one_round(plan, long, short, work, args.new_tokens, variants if r % 2 == 0 else variants[::-1]))

    def median(variant: str) -> float:
        return statistics.median(row[variant]["wall_s"] for row in rounds)

    report = {"date": time.strftime("%Y-%m-%d"), "cpu": cpu_name(), "cpu_flags": cpu_flags(),
              "machine_cores": os.cpu_count(), "model": args.model, "stages": args.stages,
              "long_job": f"{args.prompts} prompts of 64 token ids, {args.new_tokens} new tokens each",
              "short_job": f"{args.short} prompts, the same",
              "long_cold_vs_warmup_and_job": round(median("long cold") / median("long warmed"), 3),
              "short_cold_vs_eager": round(median("short cold") / median("short eager"), 3),
              "wall_s": {v: median(v) for v in variants}, "rounds": rounds}
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "rounds"}, indent=2))


if __name__ == "__main__":
    main()
