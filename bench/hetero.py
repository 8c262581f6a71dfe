"""A heterogeneous pipeline end to end: profile a GPU and the CPU, plan from the profile (the DP
gives each device its share), launch, and compare the measured prefill makespan with the
prediction. Uses a random-init Llama (~1B parameters on CUDA) built here, no download.
Writes bench/results/hetero_<devices>.json.

    python bench/hetero.py --devices cuda:0,cpu [--tokens 2048] [--slices 8] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# bench/profile.py would shadow the standard library's `profile` module: keep bench/ off the path
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(ROOT))


def main() -> None:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from hpipe import formats
    from hpipe.config import RuntimeConfig
    from hpipe.launcher.jobs import LaunchSettings, busy_fractions, prepare
    from hpipe.launcher.local import launch_local

    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", default="cuda:0,cpu")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--slices", type=int, default=8)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=16)
    args = ap.parse_args()
    devices = args.devices.split(",")
    report = {"devices": devices, "dtype": args.dtype, "tokens": args.tokens}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=32000, hidden_size=args.hidden, intermediate_size=int(args.hidden * 2.75),
                             num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                             num_key_value_heads=max(1, args.hidden // 256), max_position_embeddings=8192)
        AutoModelForCausalLM.from_config(config).save_pretrained(tmp / "model")
        run = lambda *a: subprocess.run([sys.executable, "-m", "hpipe", *a], check=True, cwd=ROOT)  # noqa: E731
        # the CPU is profiled with the threads a CPU stage gets beside the GPU stages (see launcher.local)
        from hpipe.launcher.local import threads_per_stage

        cpu_threads = max(threads_per_stage(devices))
        run("profile", "--model", str(tmp / "model"), "--local", "--devices", args.devices, "--quick",
            "--max-seq-len", str(args.tokens), "--dtype", args.dtype, "--threads", str(cpu_threads),
            "-o", str(tmp / "profile.json"))
        report["cpu_threads"] = cpu_threads
        prof = formats.load_profile(tmp / "profile.json")
        report["fit_error"] = {d["id"]: d["fit_error"] for d in prof["devices"]}
        report["links"] = [{k: x[k] for k in ("src", "dst", "backend", "alpha_s", "beta_bytes_per_s")}
                           for x in prof["links"]]
        inv = tmp / "cluster.toml"
        inv.write_text(f'[[hosts]]\nname = "local"\naddress = "127.0.0.1"\npython = "{sys.executable}"\n'
                       f'devices = {json.dumps(devices)}\n')
        run("plan", "--model", str(tmp / "model"), "--cluster", str(inv), "--profile", str(tmp / "profile.json"),
            "--seq-len", str(args.tokens), "--num-slices", str(args.slices), "-o", str(tmp / "plan.json"))
        plan = formats.load_plan(tmp / "plan.json")
        ids = torch.randint(0, 32000, (args.tokens,)).tolist()
        (tmp / "p.jsonl").write_text("".join(json.dumps({"id": f"r{i}", "input_ids": ids}) + "\n" for i in range(4)))
        settings = LaunchSettings(runtime=RuntimeConfig(max_batch=1), max_new_tokens=1)
        job = prepare(str(tmp / "plan.json"), str(tmp / "p.jsonl"), str(tmp / "o.jsonl"), settings)
        out = launch_local(job, str(tmp / "plan.json"), str(tmp / "o.jsonl"), settings, quiet=True)
        done = sorted(r["ttft_s"] for r in out.output.results)
        measured = statistics.median([b - a for a, b in zip(done, done[1:])])
        report["plan"] = {"stages": [[s.device, list(s.units)] for s in plan.stages],
                          "predicted_makespan_s": plan.predicted["makespan_s"],
                          "uniform_cuts_predicted_makespan_s": plan.predicted["uniform_makespan_s"],
                          "measured_makespan_s": measured,
                          "relative_difference": (measured - plan.predicted["makespan_s"]) / plan.predicted["makespan_s"],
                          "predicted_utilization": plan.predicted["utilization"],
                          "measured_busy_fraction": list(busy_fractions(out.output.timelines).values())}
    name = "_".join(d.replace(":", "") for d in devices)
    path = ROOT / "bench" / "results" / f"hetero_{name}.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
