"""SiPipe's CPU sampler (hpipe.sampling.CPUSampler) against a naive sampler that rebuilds the
penalties from the token history with row-wise torch ops, in the same run: B = 256 sequences,
V = 151,643 (Qwen2's vocabulary), every penalty + top-k 50 + top-p 0.9 + min-p 0.05, after 64 warm
steps. Both of hpipe's layouts (column-wise [V, B] as in SiPipe, row-wise [B, V]) are timed;
bytes allocated per step come from torch.profiler's CPU memory events. Writes
bench/results/sampler.json.

    python bench/sampler.py [--batch 256] [--vocab 151643] [--steps 10] [--threads 2]
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
import on_path  # noqa: E402,F401  (bench/on_path.py: the repository and tests/ on sys.path, bench/ off it)

from bench.common import bench_arguments  # noqa: E402

from hpipe.sampling import CPUSampler, SamplingParams  # noqa: E402


def naive_step(logits, prompts, histories, params: SamplingParams, generators):
    """What a sampler without SiPipe's buffers does: everything dense, row-wise, rebuilt each step."""
    b, v = logits.shape
    x = logits.clone()
    counts = torch.zeros(b, v)
    for i, h in enumerate(histories):
        if h:
            counts[i].scatter_add_(0, torch.tensor(h), torch.ones(len(h)))
    in_prompt = torch.zeros(b, v, dtype=torch.bool)
    for i, p in enumerate(prompts):
        in_prompt[i, torch.tensor(p)] = True
    seen = in_prompt | (counts > 0)
    rep = params.repetition_penalty
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    x = x - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).float()
    x = x / params.temperature
    probs = torch.softmax(x, dim=-1)
    x = x.masked_fill(probs < params.min_p * probs.max(dim=-1, keepdim=True).values, -float("inf"))
    kth = torch.topk(x, params.top_k, dim=-1).values[:, -1:]
    x = x.masked_fill(x < kth, -float("inf"))
    sorted_x, order = torch.sort(x, dim=-1, descending=False)
    sorted_p = torch.softmax(sorted_x, dim=-1)
    drop = torch.cumsum(sorted_p, dim=-1) <= 1 - params.top_p
    drop[:, -1] = False
    x = x.scatter(-1, order, sorted_x.masked_fill(drop, -float("inf")))
    probs = torch.softmax(x, dim=-1)
    q = torch.empty_like(probs)
    for i in range(b):
        q[i].exponential_(generator=generators[i])
    return (probs / q).argmax(dim=-1)


def allocated_bytes(fn) -> int:
    """Sum of the CPU allocations torch's profiler records while fn runs."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return int(sum(max(0, e.cpu_memory_usage) for e in prof.events() if e.cpu_memory_usage > 0
                   and not any(c for c in getattr(e, "cpu_children", []))))


def main() -> None:
    args = bench_arguments(batch=256, vocab=151643, warm=64, steps=10, naive_steps=3, prompt=128, threads=0)
    if args.threads:
        torch.set_num_threads(args.threads)
    b, v = args.batch, args.vocab
    params = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.1,
                            frequency_penalty=0.3, presence_penalty=0.2, seed=0)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, v, (args.prompt,), generator=g).tolist() for _ in range(b)]
    logits_steps = [torch.randn(b, v, generator=g) * 4 for _ in range(4)]
    report = {"batch": b, "vocab": v, "warm_steps": args.warm, "threads": torch.get_num_threads(),
              "params": params.__dict__, "layouts": {}}
    histories = None
    for layout in ("column", "row"):
        s = CPUSampler(v, max_batch=b, max_len=args.warm + args.steps + 8, layout=layout)
        seqs = list(range(b))
        for i in seqs:
            s.add(i, SamplingParams(**{**params.__dict__, "seed": i}), prompts[i])
        hist = [[] for _ in seqs]
        for step in range(args.warm):
            ids = s.step(logits_steps[step % 4], seqs)
            for i, t in enumerate(ids.tolist()):
                hist[i].append(t)
        times = []
        for step in range(args.steps):
            t = time.perf_counter()
            ids = s.step(logits_steps[step % 4], seqs)
            times.append(time.perf_counter() - t)
            for i, t_ in enumerate(ids.tolist()):
                hist[i].append(t_)
        alloc = allocated_bytes(lambda: s.step(logits_steps[0], seqs))
        report["layouts"][layout] = {"step_ms_median": statistics.median(times) * 1e3,
                                     "step_ms_all": [round(x * 1e3, 2) for x in times],
                                     "allocated_bytes_per_step": alloc}
        print(layout, report["layouts"][layout], flush=True)
        histories = histories or [h[:args.warm] for h in hist]
    gens = [torch.Generator().manual_seed(i) for i in range(b)]
    times = []
    for step in range(args.naive_steps):
        t = time.perf_counter()
        naive_step(logits_steps[step % 4], prompts, histories, params, gens)
        times.append(time.perf_counter() - t)
    alloc = allocated_bytes(lambda: naive_step(logits_steps[0], prompts, histories, params, gens))
    report["naive"] = {"step_ms_median": statistics.median(times) * 1e3, "step_ms_all": [round(x * 1e3, 2) for x in times],
                       "allocated_bytes_per_step": alloc}
    print("naive", report["naive"], flush=True)
    best = min(report["layouts"], key=lambda k: report["layouts"][k]["step_ms_median"])
    report["faster_layout"] = best
    report["speedup_vs_naive"] = {k: report["naive"]["step_ms_median"] / x["step_ms_median"]
                                  for k, x in report["layouts"].items()}
    report["bv_bytes_float32"] = b * v * 4
    out = ROOT / "bench" / "results" / "sampler.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: report[k] for k in ("faster_layout", "speedup_vs_naive")}, indent=2))


if __name__ == "__main__":
    main()
