"""A heterogeneous pipeline end to end (HPipe's mixed-device case): profile a GPU and the CPU, plan
from the profile (the DP gives each device its share), launch one prompt, and compare the plan's
prediction with the run: prefill as the time to first token against the predicted makespan, decode
as the run summary's check reads it off the timeline (`plan_check`: every stage's compute, every hop
and the way back, predicted and measured, per steady token). A random-init Llama (~1B parameters)
built here, no download. Writes bench/results/hetero_<devices>[_<name>].json.

    python bench/hetero.py --devices cuda:0,cpu [--tokens 1024] [--slices 8] [--new-tokens 64]
                           [--dtype bfloat16] [--repeats 2] [--name NVIDIA-H200]
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
import on_path  # noqa: E402,F401  (bench/on_path.py: the repository and tests/ on sys.path, bench/ off it)

from bench.common import bench_arguments, hpipe, launch_checked, prompt_ids, random_llama  # noqa: E402


def main() -> None:
    from hpipe import formats
    from hpipe.launcher.local import threads_per_stage

    args = bench_arguments(devices="cuda:0,cpu", tokens=1024, slices=8, new_tokens=64, dtype="bfloat16", hidden=2048,
                           layers=16, repeats=(2, "launches of the plan; the faster is kept"),
                           name=("", "suffix of the results file (the device)"))
    devices = args.devices.split(",")
    report = {"devices": devices, "dtype": args.dtype, "tokens": args.tokens, "new_tokens": args.new_tokens}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = random_llama(work / "model", 32000, hidden=args.hidden, layers=args.layers,
                             mlp=int(args.hidden * 2.75), heads=(args.hidden // 64, max(1, args.hidden // 256)),
                             dtype=args.dtype)
        # the CPU is profiled with the threads a CPU stage gets beside the GPU stages (launcher.local)
        cpu_threads = max(threads_per_stage(devices))
        hpipe("profile", "--model", model, "--local", "--devices", args.devices, "--quick", "--max-seq-len",
              args.tokens + args.new_tokens, "--dtype", args.dtype, "--threads", cpu_threads,
              "-o", work / "profile.json", cwd=work)
        report["cpu_threads"] = cpu_threads
        prof = formats.load_profile(work / "profile.json")
        report["fit_error"] = {d.id: d.fit_error for d in prof.devices}
        report["links"] = [{"src": x.src, "dst": x.dst, "backend": x.extra.get("backend"), "alpha_s": x.alpha_s,
                            "beta_bytes_per_s": x.beta_bytes_per_s} for x in prof.links]
        inv = work / "cluster.toml"
        inv.write_text(f'[[hosts]]\nname = "local"\naddress = "127.0.0.1"\npython = "{sys.executable}"\n'
                       f'devices = {json.dumps(devices)}\n')
        plan = work / "plan.json"
        hpipe("plan", "--model", model, "--cluster", inv, "--profile", work / "profile.json", "--seq-len",
              args.tokens, "--num-slices", args.slices, "--new-tokens", args.new_tokens, "-o", plan, cwd=work)
        predicted = json.loads(plan.read_text())["predicted"]
        prompts = work / "p.jsonl"
        prompts.write_text(json.dumps({"id": "one", "input_ids": prompt_ids(args.tokens)}) + "\n")
        runs = []
        for k in range(args.repeats):
            result, check, _ = launch_checked(plan, prompts, work, str(k), args.new_tokens, ["--local"])
            runs.append({"ttft_s": result["ttft_s"], "tpot_s": result["tpot_s"], "check": check})
        best = min(runs, key=lambda r: r["ttft_s"])
        dec = min((r["check"].get("decode") for r in runs if r["check"].get("decode")),
                  key=lambda d: d["measured_ms_per_token"], default=None)
        stages = formats.load_plan(plan).stages
        report["plan"] = {"stages": [[s.device, list(s.units)] for s in stages],
                          "slices": predicted.get("slices"),
                          "predicted_makespan_s": predicted["makespan_s"],
                          "uniform_cuts_predicted_makespan_s": predicted.get("uniform_makespan_s"),
                          "measured_ttft_s": [round(r["ttft_s"], 4) for r in runs],
                          "prefill_error": (predicted["makespan_s"] - best["ttft_s"]) / best["ttft_s"],
                          "predicted_with_measured_compute_s": best["check"].get("predicted_with_measured_compute_s"),
                          "measured_stage_busy_s": best["check"].get("measured_stage_busy_s"),
                          "predicted_stage_busy_s": predicted.get("stage_busy_s")}
        if dec:
            report["decode"] = {"predicted_ms_per_token": dec["predicted_ms_per_token"],
                                "measured_ms_per_token": dec["measured_ms_per_token"],
                                "error": (dec["predicted_ms_per_token"] - dec["measured_ms_per_token"])
                                / dec["measured_ms_per_token"],
                                "predicted_with_measured_compute_ms": dec.get("predicted_with_measured_compute_ms"),
                                "terms_ms": {k: [v, dec["measured_terms_ms"].get(k, 0.0)]
                                             for k, v in dec.get("predicted_terms_ms", {}).items()},
                                "tpot_ms": [round(1000 * r["tpot_s"], 3) for r in runs]}
    name = "_".join(d.replace(":", "") for d in devices) + (f"_{args.name}" if args.name else "")
    path = ROOT / "bench" / "results" / f"hetero_{name}.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
