"""hpipe's runtime: one worker process per pipeline stage (`python -m hpipe.runtime.worker`).

- `stage`: a stage's units and the steps of a micro-batch (prepare inputs, forward), its
  compiled decode graphs and `warm_compile` (`hpipe warmup`);
- `background_compile`: a server's stage getting its compiled graphs beside it (compiled on a
  cold host, loaded on a warm one);
- `pages`: a sequence's KV pages and a micro-batch's segments (no torch);
- `kv`: the KV cache itself (torch);
- `sequence`: one request's state on stage 0, its status enum (no torch);
- `scheduler`: what every micro-batch holds (stage 0; no torch);
- `schedule`: the one message per micro-batch every stage reads, and its encoding (no torch);
- `comm`: schedules (control plane), hidden states and sampled ids over torch.distributed;
- `pipeline`: a stage's executors (source, prepare, compute, sample) and how they hand on;
- `static_decode`: decode steps with static shapes, replayed from CUDA graphs on CUDA stages;
- `sampler_pool`: sampling off the last stage's critical path;
- `inprocess`: all stages in one process (tests, benchmarks);
- `worker`: the process a launcher starts, `StageWorker` (not imported here: it runs as `-m`).
"""

import importlib

# name -> its module, imported on first use: the torch-free modules (`pages`, `schedule`,
# `scheduler`, `sequence`, `speculative`) serve the planner and the launcher without importing
# torch (about 1 s of every `hpipe` command's start here)
_HOMES = {"run_inprocess": "inprocess", "KVStore": "kv", "Segment": "pages", "microbatch_kind": "pages",
          "Schedule": "schedule", "Policy": "scheduler", "Scheduler": "scheduler", "Sequence": "sequence",
          "Status": "sequence", "StageRunner": "stage", "warm_compile": "stage"}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'hpipe.runtime' has no attribute {name!r}")
    return getattr(importlib.import_module(f"hpipe.runtime.{_HOMES[name]}"), name)
