"""A mixture of experts against llama.cpp on the same GGUF file, the same threads, in one run.

The model (`--shape`, `SHAPES`): Qwen3-30B-A3B's architecture scaled down (64 small experts a block,
8 active, norm_topk_prob), or Mixtral's shape (8 large experts, 2 active) in that architecture; SmolLM2's
tokenizer and vocabulary, random weights N(0, 0.02) from torch's seed 0,
saved by transformers as bf16 safetensors, written to an F16 GGUF by llama.cpp's own
`convert_hf_to_gguf.py` and quantized by its `llama-quantize` to Q4_K_M (Q4_K experts, Q6_K for some
blocks' down and the head, as users' files are). Made once under ~/.cache/hpipe/bench-models/.

Measured in --repeats rounds, each round the three variants one after another (this machine is
shared: a round's neighbours see the same load), reported as the best of each and as the median over
rounds of the round's own ratio to llama.cpp:
- llama.cpp (`llama-bench -t THREADS`): decode (tg64) and prefill of 512 and 2,048 tokens (pp512, pp2048);
- hpipe in one process (one stage holding every unit, the file's own blocks, `--compile off` and
  `on`): decode ms/token after a 16-token prompt (64 greedy tokens through the runtime's scheduler,
  the one-token step less), and the 512- and 2,048-token prefills (slices of 512);
- KL (transformers' float32 forward of the gguf package's dequantization of the same file || hpipe)
  per token over 256 tokens, and top-1 agreement;
- resident bytes: the tensors a stage holds against the file's size.

    python bench/moe.py [--shape qwen3moe-0.5b | mixtral-shape-0.5b] [--threads 2] [--repeats 5] [--out F]

The same file through 3 stages against llama.cpp's RPC split: `bench/trip.py --model FILE` (local
stages on this machine's loopback) and `bench/trip.py --hosts --model FILE` (3 emulated hosts over SSH).

llama.cpp's binaries and source: $LLAMA_CPP_BIN (default /opt/llama.cpp/build/bin) and
$LLAMA_CPP_SRC (default /opt/llama.cpp); ../shared/notes/peers.md says how to build them here.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
import on_path  # noqa: E402,F401  (bench/on_path.py: the repository and tests/ on sys.path, bench/ off it)

from bench.common import cpu_flags, cpu_name, kernels_line  # noqa: E402
from bench.shapes import llama_cpp_bin, models_dir  # noqa: E402

SEED = 0
# Qwen3-30B-A3B: hidden 2048, 48 blocks, 32/4 heads of 128, 128 experts of 768, 8 active.
# Mixtral-8x7B: hidden 4096, 32 blocks, 32/8 heads of 128, 8 experts of 14,336, 2 active; here in
# Qwen3-MoE's architecture (its routing with norm_topk_prob is Mixtral's: softmax, top 2, renormalized;
# it adds q/k norms), as hpipe reads Mixtral from Hugging Face directories, not from GGUF files.
SHAPES = {"qwen3moe-0.5b": dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
                                head_dim=64, num_experts=64, num_experts_per_tok=8, moe_intermediate_size=256,
                                intermediate_size=3072),
          "mixtral-shape-0.5b": dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16,
                                     num_key_value_heads=4, head_dim=64, num_experts=8, num_experts_per_tok=2,
                                     moe_intermediate_size=1792, intermediate_size=3584)}
PREFILLS = (512, 2048)


def model_file(name: str) -> Path:
    """The shape's Q4_K_M file, made once (HF directory -> llama.cpp's converter -> its quantizer)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from hpipe import models

    out = models_dir() / f"{name}-Q4_K_M.gguf"
    if out.exists():
        return out
    hf = models_dir() / f"{name}-hf"
    if not (hf / "config.json").exists():
        tokenizer = models.resolve_model("smollm2").path
        config = AutoConfig.for_model("qwen3_moe", vocab_size=49152, max_position_embeddings=4096, norm_topk_prob=True,
                                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, **SHAPES[name])
        torch.manual_seed(SEED)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() > 1:
                    p.normal_(0, 0.02)
        model.save_pretrained(hf)
        for f in Path(tokenizer).iterdir():
            if f.name.startswith("tokenizer") or f.suffix == ".jinja":
                shutil.copy(f, hf / f.name)
    src = Path(os.environ.get("LLAMA_CPP_SRC", "/opt/llama.cpp"))
    f16 = models_dir() / f"{name}-F16.gguf"
    env = dict(os.environ, PYTHONPATH=str(src / "gguf-py"))
    subprocess.run([sys.executable, str(src / "convert_hf_to_gguf.py"), str(hf), "--outtype", "f16", "--outfile", str(f16)],
                   check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    subprocess.run([str(llama_cpp_bin("llama-quantize")), str(f16), str(out) + ".part", "Q4_K_M"], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    os.replace(str(out) + ".part", out)
    return out


def llama_cpp(path: Path, threads: int) -> dict:
    """llama-bench's decode (tg64) and prefills (`PREFILLS`), ms/token and s."""
    done = subprocess.run([str(llama_cpp_bin("llama-bench")), "-m", str(path), "-t", str(threads), "-p",
                           ",".join(map(str, PREFILLS)), "-n", "64", "-r", "2", "-o", "json"], check=True,
                          capture_output=True, text=True)
    rows = json.loads(done.stdout)
    tg = next(r for r in rows if r["n_gen"] > 0)
    out = {"decode_ms": 1000 / tg["avg_ts"]}
    for n in PREFILLS:
        out[f"prefill_{n}_s"] = n / next(r for r in rows if r["n_prompt"] == n)["avg_ts"]
    return out


def hpipe_numbers(path: Path, threads: int, compile_mode: str) -> dict:
    """One stage holding every unit of the file (its own blocks): decode and the prefills."""
    import torch

    from hpipe import models, quant
    from hpipe.formats import Slicing
    from hpipe.request import Request
    from hpipe.runtime.inprocess import run_inprocess
    from hpipe.runtime.stage import StageRunner, warm_up

    torch.set_num_threads(threads)
    source = models.resolve_model(str(path))
    config = models.load_config(source.path)
    runner = StageRunner(source, config, range(models.num_units(config)), weights=quant.WeightFormat("gguf"),
                         compile=compile_mode)
    pages = -(-(max(PREFILLS) + 64) // runner.kv.page_size) + 4
    runner.kv.allocate(pages)
    warm_up(runner, 16, lambda *_: None)

    def run(new: int, length: int) -> float:
        request = Request(0, "p", tuple(range(100, 100 + length)), max_new_tokens=new, eos_ids=frozenset())
        t = time.perf_counter()
        run_inprocess([runner], [request], Slicing(lengths=(512,)).slices_for, max_batch=1, pages=pages)
        return time.perf_counter() - t

    run(4, 16)
    decode = min((run(65, 16) - run(1, 16)) / 64 for _ in range(2))
    prefills = {f"prefill_{n}_s": min(run(1, n) for _ in range(2)) for n in PREFILLS}
    tensors = [t for m in runner.model.modules() for t in [*m.parameters(False), *m.buffers(False),
                                                           *getattr(m, "_keep", ())] if not t.is_meta]
    # each storage once: an expert's modules hold views of its block's stacked tensors
    held = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())
    return {"decode_ms": 1000 * decode, **prefills, "held_bytes": held,
            "compile": compile_mode, "compile_refused": runner.compile_refused}


def llama_cpp_logits(path: Path, ids: list[int], threads: int):
    """llama.cpp's own logits at every position of `ids` on the file (libllama through ctypes: one
    token a decode, the last position's logits each time), [len(ids), vocab] float32."""
    import ctypes

    import numpy as np

    lib = ctypes.CDLL(str(llama_cpp_bin("libllama.so")))

    class Params(ctypes.Structure):      # the params structs, opaque and larger than llama.h's: a struct
        _fields_ = [("raw", ctypes.c_uint8 * 1024)]     # over 16 bytes goes by memory, the callee reads its own size

    class Batch(ctypes.Structure):       # llama.h's llama_batch
        _fields_ = [("n_tokens", ctypes.c_int32)] + [(f, ctypes.c_void_p) for f in
                                                      ("token", "embd", "pos", "n_seq_id", "seq_id", "logits")]

    lib.llama_model_default_params.restype = lib.llama_context_default_params.restype = Params
    lib.llama_model_load_from_file.argtypes, lib.llama_model_load_from_file.restype = [ctypes.c_char_p, Params], \
        ctypes.c_void_p
    lib.llama_init_from_model.argtypes, lib.llama_init_from_model.restype = [ctypes.c_void_p, Params], ctypes.c_void_p
    lib.llama_batch_get_one.argtypes, lib.llama_batch_get_one.restype = [ctypes.c_void_p, ctypes.c_int32], Batch
    lib.llama_decode.argtypes, lib.llama_decode.restype = [ctypes.c_void_p, Batch], ctypes.c_int32
    lib.llama_get_logits_ith.argtypes, lib.llama_get_logits_ith.restype = [ctypes.c_void_p, ctypes.c_int32], \
        ctypes.POINTER(ctypes.c_float)
    lib.llama_model_get_vocab.argtypes, lib.llama_model_get_vocab.restype = [ctypes.c_void_p], ctypes.c_void_p
    lib.llama_vocab_n_tokens.argtypes, lib.llama_vocab_n_tokens.restype = [ctypes.c_void_p], ctypes.c_int32
    lib.llama_free.argtypes = lib.llama_model_free.argtypes = [ctypes.c_void_p]
    lib.llama_backend_init()
    model = lib.llama_model_load_from_file(str(path).encode(), lib.llama_model_default_params())
    params = lib.llama_context_default_params()
    fields = np.frombuffer(params.raw, dtype=np.uint32, count=9)   # n_ctx ... n_threads, n_threads_batch
    fields.setflags(write=True)
    fields[0], fields[7], fields[8] = len(ids) + 16, threads, threads
    ctx = lib.llama_init_from_model(model, params)
    vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(model))
    out = np.empty((len(ids), vocab), dtype=np.float32)
    token = (ctypes.c_int32 * 1)()
    try:
        for i, t in enumerate(ids):
            token[0] = t
            if lib.llama_decode(ctx, lib.llama_batch_get_one(token, 1)) != 0:
                raise SystemExit(f"llama_decode failed at position {i}")
            out[i] = np.ctypeslib.as_array(lib.llama_get_logits_ith(ctx, -1), shape=(vocab,))
    finally:
        lib.llama_free(ctx)
        lib.llama_model_free(model)
    return out


def quality(path: Path, tokens: int, threads: int) -> dict:
    """hpipe's and llama.cpp's logits on the same tokens against transformers' float32 forward of the
    gguf package's dequantization of the file: KL (reference || theirs) per token, top-1 agreement."""
    import torch
    from transformers import AutoModelForCausalLM

    from hpipe import models, quant

    source = models.resolve_model(str(path))
    config = models.load_config(source.path)
    reference = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, config=config,
                                                     dtype=torch.float32).eval()
    ours = models.build_full_model(source, config, weights=quant.WeightFormat("gguf"))
    ids = [(i * 7919) % 49000 + 100 for i in range(tokens)]
    with torch.no_grad():
        a, b = ours(torch.tensor([ids])).logits[0].float(), reference(torch.tensor([ids])).logits[0]
    c = torch.from_numpy(llama_cpp_logits(path, ids, threads))[:, :b.shape[-1]]

    def against_reference(x):
        kl = torch.nn.functional.kl_div(x.log_softmax(-1), b.log_softmax(-1), log_target=True,
                                        reduction="none").sum(-1)
        return {"kl_mean": float(kl.mean()), "kl_max": float(kl.max()),
                "top1": float((x.argmax(-1) == b.argmax(-1)).float().mean())}

    return {"tokens": tokens, **against_reference(a), "llama.cpp": against_reference(c)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen3moe-0.5b", choices=list(SHAPES))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quality-tokens", type=int, default=256)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help="default bench/results/moe.json (moe-SHAPE.json for another shape)")
    args = ap.parse_args()
    path = model_file(args.shape)
    args.out = args.out or str(ROOT / "bench" / "results" / ("moe.json" if args.shape == "qwen3moe-0.5b" else
                                                              f"moe-{args.shape}.json"))
    if args.child:          # one hpipe variant in a process of its own (its threads, its memory)
        print(json.dumps(hpipe_numbers(path, args.threads, args.child)))
        return

    def child(mode: str) -> dict:
        done = subprocess.run([sys.executable, __file__, "--shape", args.shape, "--threads", str(args.threads),
                               "--child", mode], check=True, capture_output=True, text=True)
        return json.loads(done.stdout.strip().splitlines()[-1])

    runs = {"llama.cpp": [], "hpipe compile off": [], "hpipe compile on": []}
    for _ in range(args.repeats):
        runs["llama.cpp"].append(llama_cpp(path, args.threads))
        runs["hpipe compile off"].append(child("off"))
        runs["hpipe compile on"].append(child("on"))
    metrics = ("decode_ms", *(f"prefill_{n}_s" for n in PREFILLS))
    best = {k: {m: min(r[m] for r in v) for m in metrics} for k, v in runs.items()}
    ref = best["llama.cpp"]
    report = {
        "date": time.strftime("%Y-%m-%d"), "cpu": cpu_name(), "threads": args.threads, "kernels": kernels_line(),
        "cpu_flags": cpu_flags(),
        "model": {"shape": args.shape, **SHAPES[args.shape], "file": path.name, "file_bytes": path.stat().st_size,
                  "seed": SEED, "made_by": "transformers (random N(0, 0.02)) -> convert_hf_to_gguf.py -> llama-quantize Q4_K_M"},
        "runs": runs, "best": best,
        "ratio_to_llama_cpp": {k: {m: v[m] / ref[m] for m in v} for k, v in best.items() if k != "llama.cpp"},
        "median_round_ratio": {k: {m: statistics.median(r[m] / l[m] for r, l in zip(v, runs["llama.cpp"])) for m in metrics}
                               for k, v in runs.items() if k != "llama.cpp"},
        "held_over_file": runs["hpipe compile off"][0]["held_bytes"] / path.stat().st_size,
        "quality": quality(path, args.quality_tokens, args.threads),
    }
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({"best": best, "ratio": report["ratio_to_llama_cpp"], "median_round_ratio": report["median_round_ratio"],
                      "quality": report["quality"],
                      "held_over_file": report["held_over_file"]}, indent=1))


if __name__ == "__main__":
    main()
