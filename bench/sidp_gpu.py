"""SiDP replicas on one GPU standing in for two cards (SiDP §5 on one device): a random-init
Llama (bf16, no download) profiled on the device, `hpipe plan --mode sidp` of 2 replicas sharing
it (the planner's B_th and its WaS fetch time from the profile's pinned-host and peer reads), and
one job of random-token prompts through:
- `one stage`: one replica with the whole model (the plain-DP replica's speed; its tokens are
  what every variant must give);
- `sidp was host-pool` / `sidp was peer`: WaS filling its slots on a copy stream from one pinned
  host copy, or from the owner's device memory through CUDA IPC;
- `sidp cas`: every MLP half it does not own run by the owner (the rows staged through the host);
- `sidp auto`: the planner's plan, WaS in the bulk and CaS below its B_th.
Per variant: output tokens/s (the run's own clock), the tokens against `one stage`'s, and per
replica the copy stream's device time per fetch and per WaS step against the step's time, beside
the planner's fetch time and T(B) (SiDP Fig. 9's question: does the fetch hide?), and the batch
and mode per step (Fig. 15).

    python bench/sidp_gpu.py [--device cuda:0] [--requests 24] [--max-new-tokens 64] [--name NVIDIA-H200]

Writes bench/results/sidp_gpu[_NAME].json.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
import on_path  # noqa: E402,F401  (bench/on_path.py: the repository and tests/ on sys.path, bench/ off it)

from bench.common import bench_arguments, fetch_figures, hpipe, random_llama, token_prompts  # noqa: E402


def runs_of(modes: list[str]) -> list[list]:
    """[mode, steps] for each run of one mode, in order (the trace of Fig. 15, compressed)."""
    out: list[list] = []
    for m in modes:
        if out and out[-1][0] == m:
            out[-1][1] += 1
        else:
            out.append([m, 1])
    return out


def main() -> None:
    args = bench_arguments(device="cuda:0", requests=24, prompt_len=256, max_new_tokens=64, max_batch=8, hidden=2048,
                           layers=16, name="")
    gpu = args.device.startswith("cuda")
    dtype = "bfloat16" if gpu else "float32"
    report = {"date": time.strftime("%Y-%m-%d"), "device": args.device, "requests": args.requests,
              "prompt_len": args.prompt_len, "max_new_tokens": args.max_new_tokens, "max_batch": args.max_batch,
              "model": f"random Llama, hidden {args.hidden}, {args.layers} blocks, MLP {int(args.hidden * 2.75)}, "
                       f"{dtype}", "variants": {}}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = random_llama(work / "m", 32000, hidden=args.hidden, layers=args.layers, mlp=int(args.hidden * 2.75),
                             heads=(args.hidden // 64, max(1, args.hidden // 256)), dtype=dtype)
        prompts = token_prompts(work / "p.jsonl", args.requests, length=args.prompt_len, vocab=32000)
        t = time.time()
        hpipe("profile", "--model", model, "--local", "--devices", args.device, "--quick", "--dtype", dtype,
              "--max-seq-len", args.prompt_len + args.max_new_tokens, "-o", work / "profile.json", cwd=work)
        report["profile_s"] = round(time.time() - t, 1)
        prof = json.loads((work / "profile.json").read_text())
        report["profile_fetch"] = prof["devices"][0].get("fetch")
        plan_args = ["--model", model, "--mode", "sidp", "--stages", 2, "--device", args.device, "--profile", work / "profile.json",
                     "--seq-len", args.prompt_len, "--new-tokens", args.max_new_tokens, "--max-batch",
                     args.max_batch, "--dtype", dtype]
        sources = ["host-pool", "peer"] if gpu else ["host-pool"]
        for source in sources:
            hpipe("plan", *plan_args, "--sidp-source", source, "-o", work / f"sidp-{source}.json", cwd=work)
        planned = json.loads((work / "sidp-host-pool.json").read_text())
        report["predicted"] = planned["predicted"]["groups"][0]
        report["planner_threshold"] = planned["sidp"][0]["threshold"]
        hpipe("plan", "--model", model, "--stages", 1, "--device", args.device, "--dtype", dtype, "-o", work / "one.json",
              cwd=work)
        variants = {"one stage": ("one.json", [])}
        variants.update({f"sidp was {s}": (f"sidp-{s}.json", ["--sidp-mode", "was"]) for s in sources})
        variants["sidp cas"] = ("sidp-host-pool.json", ["--sidp-mode", "cas"])
        variants["sidp auto"] = ("sidp-host-pool.json", ["--sidp-mode", "auto"])
        reference = None
        for name, (plan, extra) in variants.items():
            out = work / f"{name.replace(' ', '-')}.jsonl"
            hpipe("launch", work / plan, "--local", "--prompts", prompts, "--out", out, "--max-new-tokens",
                  args.max_new_tokens, "--max-batch", args.max_batch, "--quiet", *extra, cwd=work)
            summary = json.loads(out.with_name(out.name + ".summary.json").read_text())
            sidp = name.startswith("sidp")
            run = summary if sidp else summary["run"]
            tokens = run["output_tokens"] if sidp else run["generated_tokens"]
            outputs = {r["id"]: r["output_ids"] for r in map(json.loads, out.read_text().splitlines())}
            reference = reference or outputs
            row = {"tokens_per_s": round(tokens / run["wall_s"], 2), "wall_s": round(run["wall_s"], 3),
                   "output_tokens": tokens,
                   "same_tokens_as_one_stage": sum(outputs[k] == v for k, v in reference.items()),
                   "of": len(reference)}
            if sidp:
                row.update(fetch_figures(summary, run["wall_s"]))
                row["replicas"] = [{k: v for k, v in r.items() if k != "sidp"} | {
                    "was": r["sidp"]["was"], "device_bytes_released": r["sidp"].get("device_bytes_released")}
                    for r in summary["replicas"]]
                row["modes_per_step"] = [runs_of([m for *_, m in t["trace"]]) for t in summary.get("traces", [])]
                for rep in row["replicas"]:
                    w = rep["was"]
                    if w.get("fetches"):
                        w["fetch_ms_each"] = round(1e3 * w["fetch_s"] / w["fetches"], 3)
                        w["fetch_gb_s"] = round(w["bytes_per_fetch"] * w["fetches"] / max(w["fetch_s"], 1e-9) / 1e9, 1)
            report["variants"][name] = row
            print(f"  {name}: {row['tokens_per_s']} tokens/s, same tokens {row['same_tokens_as_one_stage']}/"
                  f"{row['of']}", flush=True)
    base = report["variants"]["one stage"]["tokens_per_s"]
    for row in report["variants"].values():
        row["vs_one_stage"] = round(row["tokens_per_s"] / base, 3)
    path = ROOT / "bench" / "results" / f"sidp_gpu{'_' + args.name if args.name else ''}.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "predicted"}, indent=2)[:6000])


if __name__ == "__main__":
    main()
