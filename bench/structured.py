"""The cost of structured output per token, where it is paid: the last stage's sampler
(hpipe.sampling.RequestSampler), which runs off the pipeline's critical path (a thread or the
sampler pool). In one run, interleaved: B sequences of the default model's vocabulary sampled
step by step with no grammar, then every one with a JSON schema (nested objects, enums, arrays),
a regex and a choice; a step's time includes applying each row's mask and computing its next one
(llguidance). The logits are the model's shape, drawn at random and biased to close strings, so
that the grammars end and restart (a matcher per request, as the server has). Writes
bench/results/structured.json.

    python bench/structured.py [--batch 8] [--steps 200] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
import on_path  # noqa: E402,F401  (bench/on_path.py: the repository and tests/ on sys.path, bench/ off it)

from hpipe import grammar, models  # noqa: E402
from hpipe.request import Request, SamplingParams  # noqa: E402
from hpipe.sampling import RequestSampler  # noqa: E402

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "color", "tags", "address"],
          "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0,
                                                                              "maximum": 120},
                         "color": {"enum": ["red", "green", "blue"]},
                         "tags": {"type": "array", "maxItems": 3, "items": {"enum": ["a", "b", "c"]}},
                         "address": {"type": "object", "additionalProperties": False, "required": ["city", "zip"],
                                     "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}}


def grammars() -> dict[str, str | None]:
    return {"none": None, "json_schema": grammar.json_schema_grammar(SCHEMA),
            "regex": grammar.regex_grammar(r"[0-9]{4}-[0-9]{2}-[0-9]{2}"),
            "choice": grammar.choice_grammar(["positive", "negative", "neutral"])}


def run(kind: str, g: str | None, vocab: grammar.GrammarVocabulary, eos: list[int], batch: int, steps: int,
        seed: int) -> dict:
    """Seconds per step of B rows; a sequence that ends (EOS) is replaced by a new request."""
    sampler = RequestSampler(vocab.vocab_size, batch, steps + 1, grammars=vocab)
    params = SamplingParams(temperature=0.0, grammar=g)
    gen = torch.Generator().manual_seed(seed)
    live, next_index, times, ended = [], 0, [], 0
    for _ in range(batch):
        sampler.admit(Request(next_index, str(next_index), (1, 2, 3), params, steps + 1, frozenset(eos)))
        live.append(next_index)
        next_index += 1
    for _ in range(steps):
        logits = torch.randn(len(live), vocab.vocab_size, generator=gen)
        logits[:, eos] += 2.0          # ends come (a free-text row would otherwise never end)
        t = time.perf_counter()
        ids = sampler.sample(logits, live)
        times.append(time.perf_counter() - t)
        for i, (s, token) in enumerate(zip(list(live), ids)):
            if token in eos:
                ended += 1
                sampler.release(s)
                sampler.admit(Request(next_index, str(next_index), (1, 2, 3), params, steps + 1, frozenset(eos)))
                live[i] = next_index
                next_index += 1
    return {"grammar": kind, "step_ms_median": statistics.median(times) * 1e3,
            "per_token_us": statistics.median(times) / batch * 1e6, "sequences_ended": ended}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    source = models.resolve_model("smollm2").path
    config = models.load_config(source)
    vocab = grammar.GrammarVocabulary(source, int(config.vocab_size))
    eos = models.eos_token_ids(source, config)
    kinds = grammars()
    rows: dict[str, list[dict]] = {k: [] for k in kinds}
    for r in range(args.rounds):                 # interleaved: the machine's noise falls on every variant
        for kind, g in kinds.items():
            rows[kind].append(run(kind, g, vocab, eos, args.batch, args.steps, seed=r))
    best = {k: min(v, key=lambda x: x["step_ms_median"]) for k, v in rows.items()}
    base = best["none"]["step_ms_median"]
    for k, v in best.items():
        v["vs_none"] = v["step_ms_median"] / base
        v["added_per_token_us"] = (v["step_ms_median"] - base) / args.batch * 1e3
    out = {"device": "cpu (this machine: 2 cores, AVX-512)", "threads": args.threads, "batch": args.batch,
           "steps": args.steps, "vocab": vocab.vocab_size, "results": best}
    path = ROOT / "bench" / "results" / "structured.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    for k, v in best.items():
        print(f"{k:12s} step {v['step_ms_median']:.2f} ms  ({v['vs_none']:.2f}x none, "
              f"+{v['added_per_token_us']:.0f} us/token)  ended {v['sequences_ended']}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
