"""One decode step's attention at long contexts, by formulation: the default model's shape (30
layers, 9 query heads over 3 KV heads, head size 64), one new token, each layer's keys and values
contiguous [kv heads, positions, 64] as the KV pool holds a stream whose pages lie in order. 30
layers of their own (92 MB of K/V at 2,048 positions): the step reads them from memory, not from
cache, as a real step does. Milliseconds per step (all 30 layers), the median of --repeats, every
variant in one run, and each one's ratio to the runtime's (SDPA, float32, the query heads grouped
per KV head: `hpipe.runtime.stage.decode_sdpa`):
- `sdpa_bf16`: the same kernel on bfloat16 K/V (half the bytes; rounds Q, K and V to 8 bits);
- `split_kv_N`: flash-decoding, the context cut in N pieces, each piece's attention by torch's
  flash kernel (`_scaled_dot_product_flash_attention_for_cpu`, which returns the log-sum-exp) and
  the pieces merged by their log-sum-exp: N times the parallel work for the same bytes;
- `three_ops`: q.K^T, softmax and .V as bmm, softmax, bmm;
- `inductor`: the same three ops as multiply-and-sum reductions, compiled by inductor;
- `read_floor`: a sum over the same K/V, what reading them costs at this machine's bandwidth.
Stop 64 ran it on an AVX2 EPYC (no formulation beat SDPA there); the question it keeps open is
whether an Intel CPU, where MKL's small GEMMs take their AVX2/AVX-512 paths, shows the same.

    python bench/decode_attention.py [--contexts 256,1024,2048] [--threads 2] [--repeats 9]

Writes bench/results/decode_attention.json (--out).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import on_path  # noqa: E402,F401  (bench/on_path.py: the repository and tests/ on sys.path, bench/ off it)

from bench.common import bench_arguments, results_path  # noqa: E402

LAYERS, KV_HEADS, GROUP, HEAD = 30, 3, 3, 64        # SmolLM2-135M
SCALE = HEAD ** -0.5


def variants(torch):
    F = torch.nn.functional
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, scale=SCALE)

    def sdpa_bf16(q, k, v):     # k, v already bfloat16
        return F.scaled_dot_product_attention(q.to(torch.bfloat16), k, v, scale=SCALE).float()

    def split_kv(pieces):
        def run(q, k, v):
            b, h, n, d = k.shape
            s = n // pieces
            kc = k[:, :, :s * pieces].reshape(b, h * pieces, s, d)
            vc = v[:, :, :s * pieces].reshape(b, h * pieces, s, d)
            g = q.shape[2]
            qc = q[:, :, None].expand(b, h, pieces, g, d).reshape(b, h * pieces, g, d)
            out, lse = flash(qc, kc, vc, 0.0, False, scale=SCALE)
            weights = torch.softmax(lse.view(b, h, pieces, g), dim=2)
            return (out.view(b, h, pieces, g, d) * weights[..., None]).sum(2)
        return run

    def three_ops(q, k, v):
        p = torch.softmax(torch.matmul(q, k.transpose(-1, -2)) * SCALE, -1)
        return torch.matmul(p, v)

    def reductions(q, k, v):
        s = (q[..., None, :] * k[:, :, None]).sum(-1) * SCALE
        return (torch.softmax(s, -1)[..., None] * v[:, :, None]).sum(-2)

    return {"sdpa": (sdpa, False), "sdpa_bf16": (sdpa_bf16, True), "split_kv_2": (split_kv(2), False),
            "split_kv_4": (split_kv(4), False), "three_ops": (three_ops, False),
            "inductor": (torch.compile(reductions, dynamic=False), False),
            "read_floor": (lambda q, k, v: k.sum() + v.sum(), False)}


def main() -> None:
    import torch

    from bench.common import cpu_name

    args = bench_arguments(contexts="256,1024,2048", threads=2, repeats=9, out=results_path("decode_attention"))
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    report = {"date": time.strftime("%Y-%m-%d"), "cpu": cpu_name(), "threads": args.threads,
              "shape": {"layers": LAYERS, "kv_heads": KV_HEADS, "queries_per_kv_head": GROUP, "head_size": HEAD},
              "ms_per_step": {}, "vs_sdpa": {}, "max_abs_diff_vs_sdpa": {}}
    q = torch.randn(1, KV_HEADS, GROUP, HEAD)
    fns = variants(torch)
    with torch.inference_mode():
        for n in map(int, args.contexts.split(",")):
            kv = [(torch.randn(1, KV_HEADS, n, HEAD), torch.randn(1, KV_HEADS, n, HEAD)) for _ in range(LAYERS)]
            kv16 = [(k.bfloat16(), v.bfloat16()) for k, v in kv]
            reference = fns["sdpa"][0](q, *kv[0])
            times: dict[str, list[float]] = {name: [] for name in fns}
            for name, (fn, half) in fns.items():       # once each: inductor compiles, kernels warm
                out = fn(q, *(kv16 if half else kv)[0])
                if name != "read_floor":
                    report["max_abs_diff_vs_sdpa"].setdefault(name, {})[n] = float((out - reference).abs().max())
            for _ in range(args.repeats):              # interleaved: the machine's noise hits all alike
                for name, (fn, half) in fns.items():
                    layers = kv16 if half else kv
                    t = time.perf_counter()
                    for k, v in layers:
                        fn(q, k, v)
                    times[name].append(time.perf_counter() - t)
            ms = {name: round(1000 * statistics.median(t), 3) for name, t in times.items()}
            report["ms_per_step"][n] = ms
            report["vs_sdpa"][n] = {name: round(m / ms["sdpa"], 3) for name, m in ms.items()}
            print(n, ms, flush=True)
            del kv, kv16
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
