"""What hpipe's stage executor costs against transformers' own forward, on one device: prefill of
a long prompt (whole, and in 8 slices through the KV cache) and decode steps (batch 1 and 8), for a
random-init Llama of ~1B parameters on CUDA (or a ~110M one on CPU). Writes
bench/results/stage_overhead_<device>.json.

    python bench/stage_overhead.py [--device cuda] [--tokens 2048]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
import on_path  # noqa: E402,F401  (bench/on_path.py: the repository and tests/ on sys.path, bench/ off it)


def timed(fn, sync, repeats=5):
    from hpipe.profiler.measure import median_time

    return median_time(fn, sync, repeats)


def main() -> None:
    from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig

    from hpipe import models
    from hpipe.runtime.pages import Segment
    from hpipe.runtime.stage import StageRunner

    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tokens", type=int, default=2048)
    args = ap.parse_args()
    dev = args.device
    cuda = dev.startswith("cuda")
    dtype = "bfloat16" if cuda else "float32"
    size = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8) if cuda else \
        dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=12,
             num_key_value_heads=4)
    config = LlamaConfig(vocab_size=32000, max_position_embeddings=8192, **size)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    n = args.tokens
    ids = torch.randint(0, 32000, (n,))
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(tmp)
        cfg = models.load_config(Path(tmp))
        runner = StageRunner(Path(tmp), cfg, range(models.num_units(cfg)), device=dev, dtype=dtype, compile="off")
        ref = AutoModelForCausalLM.from_pretrained(tmp, dtype=models.torch_dtype(dtype)).eval().to(dev)
    params = sum(p.numel() for p in ref.parameters())

    def ours_prefill(slices):
        def run():
            start = 0
            for s in slices:
                seg = Segment(0, 0, start, s, start + s == n)
                runner.forward(runner.prepare_inputs([seg]), ids[start:start + s])
                start += s
        return run

    kv = models.cache_argument(ref)        # transformers' keyword for the cache (renamed in 5.x)

    @torch.inference_mode()
    def ref_prefill():
        ref(ids[None].to(dev), logits_to_keep=1)

    @torch.inference_mode()
    def ref_prefill_sliced(slices):
        def run():
            cache, start = DynamicCache(config=ref.config), 0
            for s in slices:
                ref(ids[None, start:start + s].to(dev), **{kv: cache}, use_cache=True, logits_to_keep=1)
                start += s
        return run

    eight = [n // 8] * 8
    report = {"device": torch.cuda.get_device_name() if cuda else "cpu", "dtype": dtype, "params": params,
              "prompt_tokens": n, "torch": torch.__version__, "threads": torch.get_num_threads()}
    report["prefill_s"] = {"hpipe_whole": timed(ours_prefill([n]), sync), "transformers_whole": timed(ref_prefill, sync),
                           "hpipe_8_slices": timed(ours_prefill(eight), sync),
                           "transformers_8_slices": timed(ref_prefill_sliced(eight), sync)}
    for batch in (1, 8):
        # contexts of n tokens per sequence, then decode steps
        for b in range(batch):
            runner.forward(runner.prepare_inputs([Segment(b, b, 0, n, False)]), ids)
        step = {"pos": n}

        def ours_decode():
            segs = [Segment(b, b, step["pos"], 1, True) for b in range(batch)]
            runner.forward(runner.prepare_inputs(segs), torch.full((batch,), 7))

        cache = DynamicCache(config=ref.config)
        with torch.inference_mode():
            ref(ids[None].expand(batch, n).to(dev), **{kv: cache}, use_cache=True, logits_to_keep=1)

        @torch.inference_mode()
        def ref_decode():
            ref(torch.full((batch, 1), 7, device=dev), **{kv: cache}, use_cache=True)
            cache.crop(-1)

        report[f"decode_step_s_batch{batch}"] = {"hpipe": timed(ours_decode, sync, 20),
                                                 "transformers": timed(ref_decode, sync, 20)}
    out = ROOT / "bench" / "results" / f"stage_overhead_{'cuda' if cuda else 'cpu'}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
