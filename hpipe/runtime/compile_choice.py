"""Whether a batch job on a cold host compiles a stage's decode graphs before it starts (`--compile
auto`, the default): when the decode time the graphs save this job exceeds what compiling them
costs on this host. Every stage decides for itself, at the same moment (the job's start), from:

- the job's decode steps: each request's `max_new_tokens`, `--max-batch` sequences at a time;
- an eager decode step's time, measured at the stage's warm-up (one row);
- a compiled step's share of an eager one and the compile's seconds: what this host recorded for
  each of the stage's graphs the last time it compiled one like it (the same modules, threads and
  settings; `hpipe warmup` or a job that chose to compile; `compile-costs.json` beside the graphs'
  warm marks), else `COMPILED_SHARE` and `COMPILE_S_PER_GRAPH` (SmolLM2's stages, 2 threads, an
  AVX2 EPYC: 0.6-0.75x, 10-20 s a graph).

A server never waits: it compiles beside itself (`hpipe.runtime.background_compile`).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from hpipe.config import inductor_cache_dir

__all__ = ["COMPILED_SHARE", "COMPILE_S_PER_GRAPH", "CompileChoice", "choose", "record", "recorded"]

COMPILED_SHARE = 0.7
COMPILE_S_PER_GRAPH = 15.0


@dataclass(frozen=True)
class CompileChoice:
    compile: bool
    decode_s: float         # the job's decode on this stage, eager, predicted
    saved_s: float          # what compiled graphs would save of it
    cost_s: float           # what compiling them costs here
    measured: bool          # cost and share as this host recorded them (else the defaults)
    eager_step_s: float     # the eager decode step it was measured from

    def line(self, stage: str) -> str:
        cost = f"{self.cost_s:.0f} s{'' if self.measured else ' (estimated)'}"
        if self.compile:
            return (f"{stage}: compiling its decode graphs first ({cost}, once on this host): predicted to save "
                    f"{self.saved_s:.0f} s of this job's {self.decode_s:.0f} s of decode")
        return (f"{stage}: decode runs eagerly: compiling ({cost}) would save {self.saved_s:.0f} s of this job's "
                f"{self.decode_s:.0f} s; `hpipe warmup` compiles once for every later job")


def _records() -> Path:
    """Beside the graphs' warm marks, in inductor's cache (hpipe's, unless the user set their own)."""
    return inductor_cache_dir() / "hpipe-warm" / "compile-costs.json"


def _read() -> dict:
    """The host's records, graph -> {"compile_s", "share"}; nothing where the file is missing or not
    the records' form (a cost is an estimate's input, never a job's failure)."""
    try:
        data = json.loads(_records().read_text())
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in data.items() if isinstance(v, dict) and
            all(isinstance(v.get(f), (int, float)) for f in ("compile_s", "share"))} if isinstance(data, dict) else {}


def record(graphs: list[str], compile_s: float, eager_step_s: float, compiled_step_s: float) -> None:
    """Keeps what one compile of a stage's `graphs` cost here, shared equally among them (they compile
    in one warm-up), and its compiled step's share of an eager one. Stages of one host that compile
    at once each rewrite the file under a lock; a failure to write loses the record, not the job."""
    import fcntl

    try:
        _records().parent.mkdir(parents=True, exist_ok=True)
        with open(_records().with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            data = _read()
            share = round(compiled_step_s / max(eager_step_s, 1e-9), 3)
            for g in graphs:
                data[g] = {"compile_s": round(compile_s / max(1, len(graphs)), 2), "share": share,
                           "when": time.strftime("%Y-%m-%dT%H:%M:%S")}
            tmp = _records().with_suffix(f".tmp-{os.getpid()}")
            tmp.write_text(json.dumps(data, indent=1))
            os.replace(tmp, _records())
    except OSError:
        pass


def choose(graphs: list[str], steps: float, eager_step_s: float) -> CompileChoice:
    """Compile when the job's `steps` eager decode steps of `eager_step_s` would save more than
    compiling `graphs` costs: each graph's recorded cost on this host (a graph of the same modules,
    threads and settings, compiled by `hpipe warmup` or an earlier job, in whatever stage layout),
    else `COMPILE_S_PER_GRAPH`; the recorded share, else `COMPILED_SHARE`."""
    known = _read()
    seen = [known[g] for g in graphs if g in known]
    cost = sum(known[g]["compile_s"] if g in known else COMPILE_S_PER_GRAPH for g in graphs)
    share = sum(r["share"] for r in seen) / len(seen) if seen else COMPILED_SHARE
    decode = steps * eager_step_s
    saved = decode * (1 - share)
    return CompileChoice(saved > cost, decode, saved, cost, bool(graphs) and len(seen) == len(graphs), eager_step_s)


def recorded(graph: str) -> dict | None:
    """One graph's record on this host, or None."""
    return _read().get(graph)
