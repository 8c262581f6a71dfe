"""This checkout against another commit, in one run: decode throughput of `hpipe launch` on 2 local
CPU stages and the maximum output throughput of `hpipe serve --local`, the two commits interleaved
round by round (this machine is shared and noisy: compare ratios within a run, not runs).

    python bench/commits.py [--base REF] [--rounds 3] [--prompts 8] [--new-tokens 48]
                            [--num-prompts 24] [--rate 8] [--max-output-len 64] [--name NAME]

The base commit is checked out into a temporary git worktree and laid out as it installs; each side
runs its own code (its folder on PYTHONPATH) on the same plan, prompts, requests and arrival times. Decode: bench/decode.py's
workload and measure (tokens/s over the decode window) for "all on" (the defaults) and "all off";
serving: bench/serve.py's ShareGPT requests at one high Poisson rate (its maximum output
throughput), throttle policy. Writes bench/results/commits[-NAME].json.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
import on_path  # noqa: E402,F401  (bench/on_path.py: the repository and tests/ on sys.path, bench/ off it)

from bench.common import bench_arguments  # noqa: E402


def _bench_module(name: str):
    import importlib.util
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


decode_bench = _bench_module("decode")
serve_bench = _bench_module("serve")


def run_hpipe(root: Path, args: list, cwd: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(root))
    r = subprocess.run([sys.executable, "-m", "hpipe", *map(str, args)], capture_output=True, text=True, cwd=cwd,
                       env=env, stdin=subprocess.DEVNULL)
    if r.returncode != 0:
        raise SystemExit(f"[{root}] hpipe {' '.join(map(str, args[:2]))} failed:\n{r.stderr[-3000:]}")


def main() -> None:
    args = bench_arguments(base=("HEAD~1", "the commit to compare against (a git ref)"), rounds=3, prompts=8,
                           new_tokens=48, num_prompts=24, rate=8.0, max_model_len=1024, max_output_len=64,
                           max_batch=16, kv_pages=0, seed=0, skip=("", "decode or serve: leave that part out"),
                           name="")
    base_rev = subprocess.run(["git", "rev-parse", "--short", args.base], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    head_rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                                capture_output=True, text=True).stdout.strip())
    report = {"machine_cores": os.cpu_count(), "date": time.strftime("%Y-%m-%d"),
              "base": base_rev, "head": head_rev + ("+working tree" if dirty else ""), "rounds": args.rounds}
    out = ROOT / "bench" / "results" / f"commits{'-' + args.name if args.name else ''}.json"
    with tempfile.TemporaryDirectory(prefix="hpipe-bench-commits-") as tmp:
        tmp = Path(tmp)
        base_root = tmp / "base"
        subprocess.run(["git", "worktree", "add", "--detach", str(base_root), args.base], cwd=ROOT, check=True,
                       capture_output=True)
        sides = {"base": installed_layout(base_root, tmp / "base-pkg"), "head": ROOT}
        try:
            if "decode" not in args.skip:
                report["decode"] = decode_part(sides, tmp, args)
                out.write_text(json.dumps(report, indent=2) + "\n")
            if "serve" not in args.skip:
                report["serve"] = serve_part(sides, tmp, args)
                out.write_text(json.dumps(report, indent=2) + "\n")
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base_root)], cwd=ROOT, capture_output=True)
    print(json.dumps(report, indent=2))


def installed_layout(checkout: Path, dest: Path) -> Path:
    """The checkout as it installs (planner/, profiler/, launcher/ inside hpipe/), so that its folder
    on PYTHONPATH is the whole of `hpipe`, not mixed with this checkout's editable install."""
    import shutil
    shutil.copytree(checkout / "hpipe", dest / "hpipe")
    for sub in ("planner", "profiler", "launcher"):
        shutil.copytree(checkout / sub, dest / "hpipe" / sub)
    return dest


def decode_part(sides: dict, tmp: Path, args) -> dict:
    work = tmp / "decode"
    work.mkdir()
    plan = work / "plan.json"
    prompts = decode_bench.prompts_file(work / "p.jsonl", args.prompts)
    run_hpipe(ROOT, ["plan", "--model", "smollm2", "--stages", "2", "-o", plan], work)
    variants = {"all on": [], "all off": decode_bench.VARIANTS["all off"]}
    runs: dict = {v: {s: [] for s in sides} for v in variants}
    for k in range(args.rounds):
        for variant, extra in variants.items():
            for side, root in sides.items():
                o, tl = work / f"o-{k}-{side}-{len(extra)}.jsonl", work / f"t-{k}-{side}-{len(extra)}.json"
                run_hpipe(root, ["launch", plan, "--local", "--prompts", prompts, "--out", o, "--timeline-out", tl,
                                 "--max-new-tokens", args.new_tokens, "--max-batch", args.prompts, "--temperature",
                                 "0.8", "--top-k", "50", "--quiet", *extra], work)
                runs[variant][side].append(decode_bench.measure(o, tl)["decode_tokens_per_s"])
                print(f"  decode {variant} {side}: {runs[variant][side][-1]} tok/s", flush=True)
    result = {"setup": f"SmolLM2-135M, 2 local CPU stages, {args.prompts} prompts x {args.new_tokens} new tokens, "
                       f"temperature 0.8, top-k 50"}
    for variant, by_side in runs.items():
        med = {s: statistics.median(v) for s, v in by_side.items()}
        ratios = [h / b for h, b in zip(by_side["head"], by_side["base"])]
        result[variant] = {"tokens_per_s_runs": by_side, "median_tokens_per_s": med,
                           "head_over_base_median": round(med["head"] / med["base"], 4),
                           "head_over_base_per_round": [round(r, 4) for r in ratios]}
    return result


def serve_part(sides: dict, tmp: Path, args) -> dict:
    from hpipe import models
    work = tmp / "serve"
    work.mkdir()
    plan = work / "plan.json"
    run_hpipe(ROOT, ["plan", "--model", "smollm2", "--stages", "2", "-o", plan], work)
    tokenizer = models.load_tokenizer(models.resolve_model("smollm2").path)
    requests, _ = serve_bench.sample_requests(tokenizer, args.num_prompts, args.max_model_len, args.max_output_len,
                                              args.seed)
    runs: dict = {s: [] for s in sides}
    for k in range(args.rounds):
        for side, root in sides.items():
            proc, base = serve_bench.start_server(plan, "throttle", args, work, None, root=root)
            try:
                asyncio.run(serve_bench.run_rate(base, requests[:2], float("inf"), args.seed))     # warm-up
                run = asyncio.run(serve_bench.run_rate(base, requests, args.rate, args.seed))
                s = serve_bench.summarize(run, [])
            finally:
                serve_bench.stop_serve(proc)
            runs[side].append({k: s[k] for k in ("output_throughput", "request_throughput", "median_ttft_ms",
                                                 "median_tpot_ms")})
            print(f"  serve {side}: {s['output_throughput']} tok/s out, TPOT median {s['median_tpot_ms']} ms",
                  flush=True)
    med = {s: statistics.median(r["output_throughput"] for r in v) for s, v in runs.items()}
    return {"setup": f"hpipe serve --local, 2 CPU stages, throttle, {len(requests)} ShareGPT requests at "
                     f"{args.rate} req/s (Poisson), replies capped at {args.max_output_len} tokens",
            "runs": runs, "median_output_throughput": med,
            "head_over_base_median": round(med["head"] / med["base"], 4),
            "head_over_base_per_round": [round(h["output_throughput"] / b["output_throughput"], 4)
                                         for h, b in zip(runs["head"], runs["base"])]}


if __name__ == "__main__":
    main()
