"""A server's CPU stage gets its compiled decode graphs beside it (`--compile auto`): it answers
from its start, eagerly, and runs the graphs once they are there.

A chat server is started once and serves for hours. Before this, a host that `hpipe warmup` had
not warmed served every token eagerly, ~2.5x the compiled time (SmolLM2 on 2 AVX2 cores: 27.7 ms
a token eager, 10.9 compiled, llama.cpp 10.9), and a warmed one waited ~10 s a stage at its start
while dynamo traced the graphs again. Now, in two steps:

1. on a cold host, a child process compiles the stage's layout into inductor's cache and marks it
   warm, exactly as `hpipe warmup` does (`warm_layout`), at the lowest CPU priority (nice 19: the
   stage's own threads keep the cores while they have work) and tied to the stage
   (`hpipe.lifeline`: it dies with it, so nothing of hpipe outlives a job on a host). A compile in
   another process holds none of the serving process's GIL for its minute;
2. a thread of the stage loads the graphs the child saved (`compiled_beside`, on a KV pool of its
   own: ~2 s a stage, where dynamo traced them again for ~10 before they were saved as code,
   `hpipe.runtime.graphs`) and hands them to the stage; the steps after it run them. It does so with the stage's steps held (`StageRunner.stepping`), at a moment the stage
   is idle (`IDLE_S` without a step; after `IDLE_WAIT_S` without one, at the next): traced beside
   running steps, it took the GIL from them, and a reply streamed at 216 ms a token instead of ~30
   for the 14.6 s the trace took (SmolLM2, 2 AVX2 cores). A request that comes in meanwhile waits
   for it, once in the server's life.

A compile that fails leaves the stage eager, said in one line (a `protocol.Notice`, which a quiet
server shows too). A server busy without a pause compiles slowly (nice 19 gets next to no CPU)
and then loads at its next step after `IDLE_WAIT_S`. The child's OOM score is the highest (its
copy of the weights and the compiler's memory come after the KV pool was sized): if memory runs
short, the kernel ends it, not the stage. `--compile on` still compiles before the first step; a
batch job (`hpipe launch`) keeps its clock free of it: warm graphs load before the job starts,
cold ones are left to `hpipe warmup`, which its report names.

    python -m hpipe.runtime.background_compile MODEL FIRST_UNIT END_UNIT WEIGHTS DTYPE THREADS PAGE_SIZE ATTN
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from hpipe import protocol

__all__ = ["BackgroundCompile"]

IDLE_S = 1.0            # a stage this long without a step is idle: the graphs load then
IDLE_WAIT_S = 60.0      # and after this long without such a moment, they load at the next step


class BackgroundCompile:
    """Compiles (`cold`) and loads a running stage's decode graphs beside it."""

    def __init__(self, runner, argv: list[str], cold: bool, name: str, log: Callable[[str], None] | None = None):
        self.runner, self.argv, self.cold, self.name = runner, argv, cold, name
        self.log = log or (lambda text: protocol.send(protocol.Notice(text)))     # shown by a quiet server too
        self.thread = threading.Thread(target=self._run, name="hpipe-background-compile", daemon=True)

    @classmethod
    def for_server(cls, runner, model: str, weights: str, dtype: str, config, name: str,
                   kv_dtype: str) -> BackgroundCompile | None:
        """What a server's stage does about its graphs under `config.compile`, decided before its
        warm-up: None where the warm-up compiles them (`--compile on`) or nothing will (off,
        refused); else a BackgroundCompile, and the stage decodes eagerly until it has run."""
        if config.compile != "auto" or not (runner.compile_refused is None or runner.compile_cold):
            return None
        import torch

        runner.decode_halves = runner.eager       # the warm-up traces nothing: this does, beside the server
        argv = [sys.executable, "-m", __name__, model, str(runner.units.start), str(runner.units.stop), weights,
                dtype, str(torch.get_num_threads()), str(config.page_size), config.attn, kv_dtype, str(runner.step_tokens)]
        return cls(runner, argv, runner.compile_cold, name)

    def start(self) -> None:
        if self.cold:
            self.log(f"{self.name}: decode runs eagerly while its graphs compile in the background (no `hpipe "
                     f"warmup` on this host yet: 1-3 minutes on 2 cores, at the lowest CPU priority); steps then run them")
        self.thread.start()

    def _run(self) -> None:
        t = time.time()
        if self.cold and not self._compile():
            return
        compiled = time.time()
        from hpipe.runtime.stage import compiled_beside

        runner = self.runner
        while time.monotonic() - runner.last_step < IDLE_S and time.time() - compiled < IDLE_WAIT_S:
            time.sleep(0.1)
        with runner.stepping:         # the stage's next step waits for the graphs
            loading = time.time()
            try:
                halves = compiled_beside(runner)
            except Exception as e:  # noqa: BLE001 - an inductor bug: the stage serves on eagerly
                first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
                self.log(f"{self.name}: decode stays eager, loading its compiled graphs failed: "
                         f"{type(e).__name__}: {first}")
                return
            runner.decode_halves = halves          # the next decode step runs the graphs
            gc.collect()        # what the compile made, out of the collector's sight (as the worker's build does)
            gc.freeze()
        what = f"compiled in the background ({compiled - t:.0f} s at low priority) and loaded" if self.cold else "loaded"
        self.log(f"{self.name}: decode graphs {what} in {time.time() - loading:.1f} s beside the server (steps "
                 f"held meanwhile); decode steps run them from now")

    def _compile(self) -> bool:
        """The child's compile; False (said) if it failed."""
        from hpipe.lifeline import PARENT_ENV
        from hpipe.runtime.stage import use_inductor_cache

        use_inductor_cache()          # the child's cache is this process's
        # started from this thread, which waits for it: the parent-death signal follows the thread
        child = subprocess.run(self.argv, env={**os.environ, PARENT_ENV: str(os.getpid())}, stdin=subprocess.DEVNULL,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, check=False)
        if child.returncode == 0:
            return True
        if child.returncode < 0:
            why = f"killed by {signal.Signals(-child.returncode).name}" + \
                  (" (out of memory?)" if child.returncode == -signal.SIGKILL else "")
        else:
            lines = [line for line in child.stderr.strip().splitlines() if line.strip()]
            why = lines[-1][:300] if lines else f"exit {child.returncode}"
        self.log(f"{self.name}: decode stays eager, its background compile failed: {why}")
        return False


def main(argv: list[str]) -> None:
    """The child: one stage layout's graphs into inductor's cache, marked warm (`warm_layout`)."""
    from hpipe.lifeline import exit_now, tie_to_parent

    tie_to_parent("background compile")
    os.setpriority(os.PRIO_PROCESS, 0, 19)
    try:
        Path("/proc/self/oom_score_adj").write_text("1000")      # the first the kernel ends, not the stage
    except OSError:
        pass
    model, start, stop, weights, dtype, threads, page_size, attn, kv_dtype, step_tokens = argv
    import torch

    from hpipe import models, quant
    from hpipe.runtime.stage import warm_layout

    torch.set_num_threads(int(threads))
    source = models.resolve_model(model)
    config = models.load_config(source.path)
    warm_layout(source, config, quant.stage_weights(quant.WeightFormat.parse(weights), "cpu"), dtype,
                lambda line: sys.stderr.write(line + "\n"), range(int(start), int(stop)), int(page_size), attn,
                kv_dtype, int(step_tokens))
    exit_now(0)


if __name__ == "__main__":
    main(sys.argv[1:])
