"""hpipe's runtime: one worker process per pipeline stage (`python -m hpipe.runtime.worker`).

- `stage`: a stage's units and the steps of a micro-batch (prepare inputs, forward);
- `kv`: the KV cache, the schedule's segments and the micro-batch kind;
- `scheduler`: what every micro-batch holds (stage 0);
- `comm`: the schedule (control plane), hidden states and sampled ids over torch.distributed;
- `pipeline`: a stage's executors (source, prepare, compute, sample) and how they hand on;
- `static_decode`: decode steps with static shapes, replayed from CUDA graphs on CUDA stages;
- `sampler_pool`: sampling off the last stage's critical path;
- `inprocess`: all stages in one process (tests, benchmarks);
- `worker`: the process a launcher starts (not imported here: it runs as `-m`).
"""

from hpipe.runtime.inprocess import run_inprocess
from hpipe.runtime.kv import KVStore, Segment, microbatch_kind
from hpipe.runtime.scheduler import MicroBatch, Scheduler
from hpipe.runtime.stage import StageRunner

__all__ = ["KVStore", "MicroBatch", "Scheduler", "Segment", "StageRunner", "microbatch_kind", "run_inprocess"]
