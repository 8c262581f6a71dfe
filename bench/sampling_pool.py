"""Decode throughput with the sampler pool on and off: the default model, 2 local stages,
`hpipe launch --sampling inline` vs `--sampling cpu`, same prompts and seeded sampling with
penalties (the tokens must be equal; checked here). Writes bench/results/sampling_pool_<device>.json.

    python bench/sampling_pool.py [--device cpu|cuda:0] [--prompts 8] [--new-tokens 64] [--repeats 2]
    python bench/sampling_pool.py --device cuda:0 --random-vocab 151643 --dtype bfloat16   # no download:
        a random-init Llama (hidden 1024, 8 blocks) with Qwen2's vocabulary, built here
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
import on_path  # noqa: E402,F401  (bench/on_path.py: the repository and tests/ on sys.path, bench/ off it)

from bench.common import bench_arguments  # noqa: E402


def main() -> None:
    from hpipe import formats
    from hpipe.cli import main as hpipe

    args = bench_arguments(device="cpu", prompts=8, new_tokens=64, repeats=2, random_vocab=0, dtype="float32",
                           sampler_procs=1)
    topics = ["rivers", "compilers", "tea", "volcanoes", "chess", "bridges", "owls", "glass", "maps", "bees",
              "clocks", "salt", "kites", "moss", "ink", "wind"]
    report = {"device": args.device, "stages": 2, "prompts": args.prompts, "new_tokens": args.new_tokens,
              "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        prompts = tmp / "p.jsonl"
        model = "smollm2"
        if args.random_vocab:
            from bench.common import random_llama, token_prompts

            model = str(random_llama(tmp / "model", args.random_vocab))
            report["model"] = f"random-init Llama, hidden 1024, 8 blocks, vocab {args.random_vocab}"
            token_prompts(prompts, args.prompts, vocab=args.random_vocab)
        else:
            report["model"] = "smollm2"
            prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"Write a paragraph about {topics[i % 16]}."})
                                       + "\n" for i in range(args.prompts)))
        plan = tmp / "plan.json"
        assert hpipe(["plan", "--model", model, "--stages", "2", "--device", args.device, "--dtype", args.dtype,
                      "-o", str(plan)]) == 0
        tokens = {}
        for mode in ("inline", "cpu"):
            rates = []
            for r in range(args.repeats):
                out = tmp / f"{mode}{r}.jsonl"
                assert hpipe(["launch", str(plan), "--local", "--prompts", str(prompts), "--out", str(out),
                              "--max-new-tokens", str(args.new_tokens), "--sampling", mode, "--model", model,
                              "--sampler-procs", str(args.sampler_procs), "--temperature", "0.8",
                              "--top-k", "50", "--top-p", "0.9", "--repetition-penalty", "1.1", "--seed", "1",
                              "--max-batch", str(args.prompts), "--quiet"]) == 0
                summary = json.loads(Path(f"{out}.summary.json").read_text())["run"]
                rates.append(summary["tokens_per_s"])
                tokens[mode] = {x["id"]: x["output_ids"] for x in formats.load_results(str(out))}
            report["runs"][mode] = {"tokens_per_s": rates, "median": statistics.median(rates)}
        report["same_tokens"] = tokens["inline"] == tokens["cpu"]
    report["pool_vs_inline"] = report["runs"]["cpu"]["median"] / report["runs"]["inline"]["median"]
    out = ROOT / "bench" / "results" / f"sampling_pool_{args.device.replace(':', '')}.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
