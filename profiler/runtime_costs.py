"""What the runtime itself costs per decode token beyond its stages' compute, measured by running it.

A token's trip is each stage's compute, each hop between stages, and the way back (the last stage
samples, the ids go to stage 0, its scheduler commits the step and the next one is prepared). The
compute is in the profile's tables; the link's own latency and bandwidth are in its link figures;
what is left is the runtime's machinery (thread hand-offs, the scheduler, the sampler), which no
unit measurement sees. `runtime_costs` measures it the only faithful way: a short greedy decode of
a small random-init Llama (2 blocks whose MLPs stream ~50 MB a step through the caches, as a real
stage's do) with the profiled model's vocabulary (so the sampler's work is the real one) through
1 and then 2 local stages of the real runtime, read off the stages' timelines
(`hpipe.launcher.overheads.decode_terms`):

- `step_s`: one stage, a token's time beyond its compute (sampling, commit, the next step's start);
- `hop_s`: a hop's time on this machine's loopback (send, receive, the next stage's start);
- `back_s`: with 2 or more stages, the way back from the last stage's compute to stage 0's next.

`hpipe profile` stores them in the profile's "runtime" object; the planner adds them to its
decode and prefill predictions (planner/profiled.py).
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

from hpipe import formats

__all__ = ["runtime_costs"]

PROMPT, NEW = 32, 48
ROUNDS = 2
QUICK_ROUNDS = 1         # `hpipe profile --quick`: one run each of 1 and 2 stages, ~6 s instead of ~12
# Big enough MLPs that a step streams ~50 MB of weights through the caches, as a real stage's does:
# with a toy model the runtime's own Python finds its data in cache and looks ~2x cheaper.
HIDDEN, MLP = 512, 8192


def _small_model(directory: Path, vocab: int) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig
    from transformers.utils import logging

    logging.disable_progress_bar()
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=HIDDEN, intermediate_size=MLP, num_hidden_layers=2, num_attention_heads=8,
                         num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=512, bos_token_id=0,
                         eos_token_id=None, tie_word_embeddings=True)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return directory


def _run(model: Path, stages: int, work: Path, round_: int) -> dict[str, float]:
    from hpipe import models
    from hpipe.config import RuntimeConfig
    from hpipe.launcher.jobs import LaunchSettings, prepare
    from hpipe.launcher.local import launch_local
    from hpipe.launcher.overheads import decode_terms
    from hpipe.planner.uniform import make_plan

    config = models.load_config(model)
    plan_path, prompts, out = work / f"plan-{stages}.json", work / f"p-{stages}.jsonl", work / f"o-{stages}-{round_}.jsonl"
    formats.write_plan(make_plan(str(model), config, [("local", "cpu")] * stages), plan_path)
    prompts.write_text(json.dumps({"id": "calibrate", "input_ids": [1 + (7 * j) % 1000 for j in range(PROMPT)]}) + "\n")
    settings = LaunchSettings(runtime=RuntimeConfig(), max_new_tokens=NEW)
    job = prepare(str(plan_path), str(prompts), str(out), settings)
    report = launch_local(job, str(plan_path), str(out), settings, log=lambda *_: None, quiet=True)
    return decode_terms([report.output.timelines[r] for r in sorted(report.output.timelines)])


def runtime_costs(vocab: int, quick: bool = False) -> formats.RuntimeCosts:
    """The profile's runtime costs: step_s, hop_s, back_s (seconds) and how they were had (quick:
    `QUICK_ROUNDS` runs of each, open to a run that met a busy machine)."""
    rounds = QUICK_ROUNDS if quick else ROUNDS
    with tempfile.TemporaryDirectory(prefix="hpipe-runtime-costs-") as tmp:
        work = Path(tmp)
        model = _small_model(work / "model", vocab)
        t = time.time()
        # 1, 2, 1, 2 stages: per term the lesser of two runs' medians. A hand-off's time on a shared
        # machine only grows with what else runs (a worker's thread preempted, the other tenants):
        # one run's median had a hop at 2.4 ms where every other run measured 0.2-0.6, and the
        # predicted way back was 1.3x every run's in bench/fidelity.py with a single run
        runs = [_run(model, stages, work, r) for r in range(rounds) for stages in (1, 2)]
    one, two = runs[0::2], runs[1::2]
    if not all(one) or not all(two):
        raise RuntimeError("the calibration decode produced too few tokens to measure")
    return formats.RuntimeCosts(
        step_s=min(r["back"] for r in one), hop_s=min(r["hop 0->1"] for r in two), back_s=min(r["back"] for r in two),
        measured=f"{NEW} greedy tokens of a 2-block random Llama (hidden {HIDDEN}, MLP {MLP}, vocabulary {vocab}) "
                        f"through 1 and 2 local stages of this runtime, the lesser of {rounds} runs' medians, "
                        f"{time.time() - t:.0f} s")
