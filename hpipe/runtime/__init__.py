"""hpipe's runtime: one worker process per pipeline stage (`python -m hpipe.runtime.worker`).

- `stage`: a stage's units and the steps of a micro-batch (prepare inputs, forward), its
  compiled decode graphs and `warm_compile` (`hpipe warmup`);
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

from hpipe.runtime.inprocess import run_inprocess
from hpipe.runtime.kv import KVStore
from hpipe.runtime.pages import Segment, microbatch_kind
from hpipe.runtime.schedule import Schedule
from hpipe.runtime.scheduler import Policy, Scheduler
from hpipe.runtime.sequence import Sequence, Status
from hpipe.runtime.stage import StageRunner, warm_compile

__all__ = ["KVStore", "Policy", "Schedule", "Scheduler", "Segment", "Sequence", "StageRunner", "Status",
           "microbatch_kind", "run_inprocess", "warm_compile"]
