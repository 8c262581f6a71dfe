"""Where a decode-heavy launch spends its time, per stage: compute / wait / send totals and the
number of micro-batches, from `hpipe launch --timeline-out`. A random-init Llama (hidden 1024,
8 blocks, vocabulary of --vocab) built here, 2 stages on --device. Prints JSON.

    python bench/decode_timeline.py --device cuda:0 [--vocab 151643] [--prompts 16] [--new-tokens 64]
"""

from __future__ import annotations

import collections
import json
import sys
import tempfile
from pathlib import Path

import on_path  # noqa: E402,F401  (bench/on_path.py: the repository and tests/ on sys.path, bench/ off it)

from bench.common import bench_arguments  # noqa: E402


def main() -> None:
    from bench.common import random_llama, token_prompts
    from hpipe.cli import main as hpipe

    args = bench_arguments(device="cpu", vocab=151643, prompts=16, new_tokens=64, sampling="inline", dtype="bfloat16")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        random_llama(tmp / "m", args.vocab)
        token_prompts(tmp / "p.jsonl", args.prompts, vocab=args.vocab)
        assert hpipe(["plan", "--model", str(tmp / "m"), "--stages", "2", "--device", args.device, "--dtype",
                      args.dtype, "-o", str(tmp / "plan.json")]) == 0
        rc = hpipe(["launch", str(tmp / "plan.json"), "--local", "--prompts", str(tmp / "p.jsonl"), "--out",
                    str(tmp / "o.jsonl"), "--max-new-tokens", str(args.new_tokens), "--max-batch", str(args.prompts),
                    "--sampling", args.sampling, "--temperature", "0.8", "--top-k", "50",
                    "--timeline-out", str(tmp / "t.json"), "--quiet"])
        assert rc == 0
        t = json.loads((tmp / "t.json").read_text())
        report = {"run": json.loads(Path(f"{tmp / 'o.jsonl'}.summary.json").read_text())["run"], "stages": []}
        for st in t["stages"]:
            tot = collections.Counter()
            n = collections.Counter()
            for i in st["intervals"]:
                key = i["what"] + ("/" + i["kind"] if i.get("kind") else "")
                tot[key] += i["end"] - i["start"]
                n[key] += 1
            report["stages"].append({"rank": st["rank"], "load_s": st["load_s"],
                                     "totals_s": {k: round(v, 3) for k, v in tot.items()}, "counts": dict(n)})
        print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
