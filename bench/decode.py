"""The asynchronous runtime's ablation (SiPipe Fig. 16): decode tokens/s, TPOT and the bottleneck
stage's busy fraction in steady decode for all off, +SAT, +TSEM, +sampling pool and all on.

    python bench/decode.py [--setups local,hosts,floor,objective] [--repeats 2] [--device cuda:0 --vocab 151643]

- local: the default model (SmolLM2-135M) on 2 local CPU stages;
- hosts: the same on the 3 emulated hosts (tests/netns_hosts.py: network namespaces with sshd, tbf
  shaped links; needs root and openssh-server);
- gpu: (with --device cuda:N) a random-init large-vocabulary Llama on 2 stages of that GPU, with
  and without CUDA graphs;
- floor: single-stream TPOT on one CPU stage against its memory-bandwidth floor (the stage's weight
  bytes / the matrix-vector bandwidth measured in the same run);
- objective: all on, on a 2-stage plan balanced for prefill against one balanced for decode
  (`hpipe plan --objective`).

Variants of one setup run interleaved (`--repeats` rounds of every variant), the median kept, and
compared as ratios to "all off" within the run (this machine is shared and noisy). Writes
bench/results/decode[-NAME].json.
"""

from __future__ import annotations

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

VARIANTS = {
    "all off": ["--no-tsem", "--no-sat", "--sampling", "inline", "--no-cuda-graphs"],
    "+SAT": ["--no-tsem", "--sampling", "inline", "--no-cuda-graphs"],
    "+TSEM": ["--no-sat", "--sampling", "inline", "--no-cuda-graphs"],
    "+sampling pool": ["--no-tsem", "--no-sat", "--sampling", "cpu", "--no-cuda-graphs"],
    "all on": ["--sampling", "cpu"],
    "all on, inline sampling": ["--sampling", "inline"],
}


def hpipe(*args, cwd) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    r = subprocess.run([sys.executable, "-m", "hpipe", *map(str, args)], capture_output=True, text=True, cwd=cwd,
                       env=env, stdin=subprocess.DEVNULL)
    if r.returncode != 0:
        raise SystemExit(f"hpipe {' '.join(map(str, args[:2]))} failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")


def steady_decode(timeline: dict) -> dict:
    """Per stage, compute seconds inside the steady-decode window (from the first decode micro-batch
    that starts after every prompt's prefill to the last decode micro-batch), over its length."""
    stages = timeline["stages"]
    computes = [[i for i in st["intervals"] if i["what"] == "compute"] for st in stages]
    last_prefill = max((i["end"] for c in computes for i in c if i.get("kind") != "decode"), default=0.0)
    decode = [i for c in computes for i in c if i.get("kind") == "decode" and i["start"] >= last_prefill]
    if not decode:
        return {}
    a, b = min(i["start"] for i in decode), max(i["end"] for i in decode)
    busy = [sum(max(0.0, min(i["end"], b) - max(i["start"], a)) for i in c) / (b - a) for c in computes]
    bottleneck = max(range(len(busy)), key=lambda j: busy[j])
    return {"window_s": round(b - a, 4), "busy_fraction": [round(x, 4) for x in busy],
            "bottleneck_stage": bottleneck, "bottleneck_busy": round(busy[bottleneck], 4)}


def measure(results_path: Path, timeline_path: Path) -> dict:
    results = [json.loads(x) for x in results_path.read_text().splitlines()]
    timeline = json.loads(timeline_path.read_text())
    decoded = sum(len(r["output_ids"]) - 1 for r in results)
    window = max(r["e2e_s"] for r in results) - min(r["ttft_s"] for r in results)
    links = {}
    for st in timeline["stages"]:
        for link, c in st.get("links", {}).items():
            links[link] = c
    return {"decode_tokens_per_s": round(decoded / window, 3) if window > 0 else None,
            "tpot_ms": round(1000 * statistics.mean(r["tpot_s"] for r in results), 3),
            **steady_decode(timeline), "links": links}


def run_variants(launch, work: Path, repeats: int, variants: dict) -> dict:
    """launch(out, timeline, extra_args) runs one launch. Rounds of every variant, interleaved."""
    runs: dict[str, list] = {name: [] for name in variants}
    for k in range(repeats):
        for name, extra in variants.items():
            out, tl = work / f"o-{k}-{len(runs[name])}-{abs(hash(name))}.jsonl", work / f"t-{k}-{abs(hash(name))}.json"
            launch(out, tl, extra)
            runs[name].append(measure(out, tl))
            print(f"  {name}: {runs[name][-1]['decode_tokens_per_s']} tok/s, "
                  f"bottleneck busy {runs[name][-1].get('bottleneck_busy')}", flush=True)
    report = {}
    for name, rs in runs.items():
        med = sorted(rs, key=lambda r: r["decode_tokens_per_s"])[len(rs) // 2]
        report[name] = {**med, "decode_tokens_per_s_runs": [r["decode_tokens_per_s"] for r in rs]}
    base = report["all off"]["decode_tokens_per_s"]
    for name in report:
        report[name]["speedup_vs_all_off"] = round(report[name]["decode_tokens_per_s"] / base, 3)
    return report


def prompts_file(path: Path, n: int, words: int = 40) -> Path:
    path.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"Story {i}: " + " ".join(
        ["the pipeline carries tokens from one stage to the next"] * (words // 10))}) + "\n" for i in range(n)))
    return path


def local_setup(work: Path, args) -> dict:
    plan, prompts = work / "plan.json", prompts_file(work / "p.jsonl", args.prompts)
    hpipe("plan", "--model", "smollm2", "--stages", "2", "-o", plan, cwd=work)

    def launch(out, tl, extra):
        hpipe("launch", plan, "--local", "--prompts", prompts, "--out", out, "--timeline-out", tl, "--max-new-tokens",
              args.new_tokens, "--max-batch", args.prompts, "--temperature", "0.8", "--top-k", "50", "--quiet", *extra,
              cwd=work)
    return {"setup": f"SmolLM2-135M, 2 local CPU stages, {args.prompts} prompts x {args.new_tokens} new tokens",
            "variants": run_variants(launch, work, args.repeats, VARIANTS)}


def hosts_setup(work: Path, args) -> dict:
    from netns_hosts import HostSpec, start_cluster, stop_cluster, unavailable_reason

    reason = unavailable_reason()
    if reason:
        return {"skipped": f"emulated hosts unavailable: {reason}"}
    cluster = start_cluster(work / "hosts", [HostSpec("h0", 1000), HostSpec("h1", 1000), HostSpec("h2", 100)])
    try:
        plan, prompts = work / "plan-hosts.json", prompts_file(work / "p-hosts.jsonl", args.prompts)
        hpipe("plan", "--model", "smollm2", "--cluster", cluster.inventory_path, "-o", plan, cwd=work)

        def launch(out, tl, extra):
            hpipe("launch", plan, "--cluster", cluster.inventory_path, "--prompts", prompts, "--out", out,
                  "--timeline-out", tl, "--max-new-tokens", args.new_tokens, "--max-batch", args.prompts,
                  "--temperature", "0.8", "--top-k", "50", "--quiet", *extra, cwd=work)
        return {"setup": f"SmolLM2-135M, 3 emulated hosts (1 Gbit/s, 1 Gbit/s, 100 Mbit/s; one stage each, sharing "
                         f"{os.cpu_count()} cores), {args.prompts} prompts x {args.new_tokens} new tokens",
                "variants": run_variants(launch, work, args.repeats, VARIANTS)}
    finally:
        stop_cluster(cluster)


def gpu_setup(work: Path, args) -> dict:
    from bench.common import random_llama, token_prompts

    random_llama(work / "m", args.vocab, layers=16)
    prompts = token_prompts(work / "pg.jsonl", args.prompts, vocab=args.vocab)
    plan = work / "plan-gpu.json"
    hpipe("plan", "--model", work / "m", "--stages", args.gpu_stages, "--device", args.device, "--dtype", "bfloat16",
          "-o", plan, cwd=work)

    def launch(out, tl, extra):
        hpipe("launch", plan, "--local", "--prompts", prompts, "--out", out, "--timeline-out", tl, "--max-new-tokens",
              args.new_tokens, "--max-batch", args.prompts, "--temperature", "0.8", "--top-k", "50", "--quiet", *extra,
              cwd=work)
    variants = dict(VARIANTS)
    variants["all on, no CUDA graphs"] = ["--sampling", "cpu", "--no-cuda-graphs"]
    return {"setup": f"random-init Llama (hidden 1024, 16 blocks, V={args.vocab}, bf16), {args.gpu_stages} stage(s) on "
                     f"{args.device}, "
                     f"{args.prompts} prompts x {args.new_tokens} new tokens",
            "variants": run_variants(launch, work, args.repeats, variants)}


def device_read_gbs(device: str, nbytes: int = 4 << 30, repeats: int = 10) -> float:
    """The device's read bandwidth: a sum over `nbytes` of bf16 (read once, nothing written back),
    the best of `repeats`, timed with the device's events."""
    import torch

    x = torch.randn(nbytes // 2, dtype=torch.bfloat16, device=device)
    x.sum()
    best = float("inf")
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        x.sum()
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b) / 1000)
    return nbytes / best / 1e9


def gpu_floor_setup(work: Path, args) -> dict:
    """One GPU stage, one stream, the 8B shape's decode (four blocks of Llama-3.1-8B: hidden 4096,
    32/8 heads, MLP 14336, its 128,256-token vocabulary and untied head; random bf16 weights): TPOT
    in bf16 and in int4 groups of 32 (tinygemm) against the weight-reading bound, the bytes a step
    reads over the device's measured read bandwidth."""
    from bench.common import random_llama
    from hpipe import models

    model = random_llama(work / "m8", 128256, hidden=4096, layers=4, mlp=14336, heads=(32, 8), dtype="bfloat16")
    config = models.load_config(model)
    prompt = work / "p1.jsonl"
    prompt.write_text(json.dumps({"id": "one", "input_ids": [3 + (j * 31) % 30000 for j in range(256)]}) + "\n")
    bw = device_read_gbs(args.device)
    rows = []
    for weights in ("none", "int4"):
        plan = work / f"plan-{weights}.json"
        hpipe("plan", "--model", model, "--stages", "1", "--device", args.device, "--dtype", "bfloat16",
              "--quantize", weights, "-o", plan, cwd=work)
        packed = json.loads(plan.read_text())["weights"]
        # a step reads every matrix once but the embedding (one row)
        weight_bytes = sum(models.unit_bytes(config, "bfloat16", packed).weights_per_unit[1:])
        for variant in ("all on", "all on, no CUDA graphs"):
            extra = VARIANTS.get(variant, ["--sampling", "cpu", "--no-cuda-graphs"])
            best = None
            try:
                for k in range(args.repeats):
                    out = work / f"g-{weights}-{k}-{len(rows)}.jsonl"
                    hpipe("launch", plan, "--local", "--prompts", prompt, "--out", out, "--max-new-tokens",
                          args.new_tokens * 2, "--quiet", *extra, cwd=work)
                    tpot = json.loads(out.read_text().splitlines()[0])["tpot_s"]
                    best = tpot if best is None else min(best, tpot)
            except SystemExit as failed:      # a variant that fails is reported, the others still run
                rows.append({"weights": packed, "variant": variant, "error": str(failed)[-600:]})
                print(f"  gpu floor {rows[-1]}", flush=True)
                continue
            floor_s = weight_bytes / (bw * 1e9)
            rows.append({"weights": packed, "variant": variant, "tpot_ms": round(1000 * best, 3),
                         "weight_bytes": weight_bytes, "read_gb_s": round(bw, 1), "floor_ms": round(1000 * floor_s, 3),
                         "of_floor": round(floor_s / best, 3)})
            print(f"  gpu floor {rows[-1]}", flush=True)
    return {"setup": f"four blocks of Llama-3.1-8B's shape (random bf16 weights, vocab 128,256, untied head) on one "
                     f"stage of {args.device}, one sequence after a 256-token prompt, {args.new_tokens * 2} new tokens, "
                     f"greedy; the best of {args.repeats}", "runs": rows}


def objective_setup(work: Path, args) -> dict:
    """The same decode run on a plan balanced for prefill and on one balanced for decode (`hpipe
    plan --objective`), both from the repository's profile of this kind of machine."""
    profile = ROOT / "profiles" / "smollm2-cpu-1thread-quick.json"
    prompts = prompts_file(work / "p.jsonl", args.prompts)
    plans = {}
    for objective in ("prefill", "decode"):
        plans[objective] = work / f"plan-{objective}.json"
        hpipe("plan", "--model", "smollm2", "--stages", "2", "--profile", profile, "--seq-len", 64, "--batch",
              args.prompts, "--objective", objective, "--new-tokens", args.new_tokens, "-o", plans[objective],
              cwd=work)
    variants = {f"{objective} objective": [] for objective in plans}
    runs: dict[str, list] = {name: [] for name in variants}
    for k in range(args.repeats):
        for objective, plan in plans.items():
            out, tl = work / f"o-{objective}-{k}.jsonl", work / f"t-{objective}-{k}.json"
            hpipe("launch", plan, "--local", "--prompts", prompts, "--out", out, "--timeline-out", tl,
                  "--max-new-tokens", args.new_tokens, "--max-batch", args.prompts, "--temperature", "0.8",
                  "--top-k", "50", "--quiet", cwd=work)
            runs[f"{objective} objective"].append(measure(out, tl))
            print(f"  {objective}: {runs[f'{objective} objective'][-1]['decode_tokens_per_s']} tok/s", flush=True)
    report = {}
    for name, rs in runs.items():
        med = sorted(rs, key=lambda r: r["decode_tokens_per_s"])[len(rs) // 2]
        p = json.loads(plans[name.split()[0]].read_text())
        report[name] = {**med, "cuts": [st["units"] for st in p["stages"]],
                        "predicted_decode": p["predicted"]["decode"],
                        "decode_tokens_per_s_runs": [r["decode_tokens_per_s"] for r in rs]}
    return {"setup": f"SmolLM2-135M, 2 local CPU stages, all on, {args.prompts} prompts x {args.new_tokens} new "
                     f"tokens; plans from {profile.name}", "variants": report}


def bandwidth_gbs(nbytes: int = 256 << 20, repeats: int = 7) -> float:
    """Matrix-vector bandwidth with torch's threads: bytes of a float32 matrix read per second."""
    import torch

    rows = nbytes // 4 // 4096
    m, v = torch.randn(rows, 4096), torch.randn(4096)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        m.mv(v)
        best = min(best, time.perf_counter() - t)
    return rows * 4096 * 4 / best / 1e9


def floor_setup(work: Path, args) -> dict:
    """One CPU stage, one sequence: TPOT against weight bytes / measured bandwidth."""
    import torch

    from hpipe import models

    source = models.resolve_model("smollm2")
    config = models.load_config(source.path)
    # a decode step reads every weight once, except the embedding table (one row); the LM head's
    # matrix (tied to the embedding here) is read whole
    weight_bytes = sum(models.unit_bytes(config, "float32").weights_per_unit[1:])
    plan = work / "plan-1.json"
    hpipe("plan", "--model", "smollm2", "--stages", "1", "-o", plan, cwd=work)
    prompt = work / "p1.jsonl"
    prompt.write_text(json.dumps({"id": "one", "input_ids": [3 + (j * 31) % 30000 for j in range(256)]}) + "\n")
    torch.set_num_threads(os.cpu_count() or 1)
    rows = []
    for k in range(args.repeats):
        for name in ("all off", "all on, inline sampling"):
            bw = bandwidth_gbs()
            out, tl = work / f"f-{k}-{len(rows)}.jsonl", work / f"f-{k}-{len(rows)}.json"
            hpipe("launch", plan, "--local", "--prompts", prompt, "--out", out, "--timeline-out", tl,
                  "--max-new-tokens", args.new_tokens, "--quiet", *VARIANTS[name], cwd=work)
            r = json.loads(out.read_text().splitlines()[0])
            floor_ms = weight_bytes / (bw * 1e9) * 1000
            rows.append({"variant": name, "tpot_ms": round(1000 * r["tpot_s"], 2), "bandwidth_gb_s": round(bw, 2),
                         "floor_ms": round(floor_ms, 2), "of_floor": round(floor_ms / (1000 * r["tpot_s"]), 3)})
            print(f"  floor {rows[-1]}", flush=True)
    return {"setup": f"SmolLM2-135M on 1 CPU stage ({torch.get_num_threads()} threads), one sequence after a 256-token "
                     f"prompt, {args.new_tokens} new tokens; weights {weight_bytes / 1e6:.0f} MB fp32",
            "runs": rows}


def main() -> None:
    args = bench_arguments(setups="local,hosts,floor", repeats=2, prompts=8, new_tokens=48, device="cuda:0",
                           vocab=151643, gpu_stages=(2, "the gpu setup's stages on --device"),
                           name=("", "suffix of the results file"))
    report = {"machine_cores": os.cpu_count(), "date": time.strftime("%Y-%m-%d")}
    setups = {"local": local_setup, "hosts": hosts_setup, "gpu": gpu_setup, "floor": floor_setup,
              "gpu-floor": gpu_floor_setup, "objective": objective_setup}
    out = ROOT / "bench" / "results" / f"decode{'-' + args.name if args.name else ''}.json"
    if out.exists():          # re-measuring some setups keeps the others
        report = {**json.loads(out.read_text()), **report}
    with tempfile.TemporaryDirectory(prefix="hpipe-bench-decode-") as tmp:
        for name in args.setups.split(","):
            print(f"{name}:", flush=True)
            work = Path(tmp) / name
            work.mkdir()
            report[name] = setups[name](work, args)
            out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
