"""A server's stage on a host that `hpipe warmup` has not warmed (`--compile auto`, cold) compiles
its decode graphs in the background while it serves eagerly, then runs them.

A chat server is started once and serves for hours: the minute its graphs take to compile is paid
once, beside the first requests, instead of every decode step taking ~2.5x its compiled time until
someone runs `hpipe warmup` (SmolLM2 on 2 AVX2 cores: 27.7 ms a token eager, 10.9 compiled,
llama.cpp 10.9). Two parts:

1. a child process compiles the stage's layout into inductor's cache and marks it warm, exactly
   as `hpipe warmup` does (`warm_layout`), at the lowest CPU priority (nice 19: the stage's own
   threads keep the cores while they have work) and tied to the stage (`hpipe.lifeline`: it dies
   with it, so nothing of hpipe outlives a job on a host); a compile in another process holds
   none of the serving process's GIL for its minute;
2. a thread of the stage then builds the graphs from that cache (`compiled_beside`: dynamo traces
   again, a few seconds, on a KV pool of its own) and hands them to the stage in one assignment;
   the steps after it run them. A compile that fails leaves the stage eager, said in one line.

Later starts on the host find the graphs warm and run them from their first step.

    python -m hpipe.runtime.background_compile MODEL FIRST_UNIT END_UNIT WEIGHTS DTYPE THREADS PAGE_SIZE ATTN
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from hpipe import protocol

__all__ = ["BackgroundCompile"]


class BackgroundCompile:
    """Compiles a running stage's decode graphs beside it (see the module's docstring)."""

    def __init__(self, runner, model: str, weights: str, dtype: str, page_size: int, attn: str,
                 name: str, log: Callable[[str], None] | None = None):
        self.runner, self.name = runner, name
        self.log = log or (lambda text: protocol.send(protocol.Notice(text)))     # shown by a quiet launch too
        import torch

        units = runner.units
        self.argv = [sys.executable, "-m", __name__, model, str(units.start), str(units.stop), weights, dtype,
                     str(torch.get_num_threads()), str(page_size), attn]
        self.thread = threading.Thread(target=self._run, name="hpipe-background-compile", daemon=True)

    def start(self) -> None:
        self.log(f"{self.name}: decode runs eagerly while its graphs compile in the background (no `hpipe "
                 f"warmup` on this host yet; about a minute at the lowest CPU priority); steps then run them")
        self.thread.start()

    def _run(self) -> None:
        from hpipe.lifeline import PARENT_ENV
        from hpipe.runtime.stage import compiled_beside, use_inductor_cache

        t = time.time()
        use_inductor_cache()          # the child's cache is this process's
        # started from this thread, which waits for it: the parent-death signal follows the thread
        child = subprocess.run(self.argv, env={**os.environ, PARENT_ENV: str(os.getpid())},
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, check=False)
        if child.returncode != 0:
            lines = [line for line in child.stderr.strip().splitlines() if line.strip()] or [f"exit {child.returncode}"]
            self.log(f"{self.name}: decode stays eager, its background compile failed: {lines[-1][:300]}")
            return
        compiled = time.time()
        try:
            halves = compiled_beside(self.runner)
        except Exception as e:  # noqa: BLE001 - an inductor bug: the stage serves on eagerly
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
            self.log(f"{self.name}: decode stays eager, loading its compiled graphs failed: {type(e).__name__}: {first}")
            return
        self.runner.decode_halves = halves          # the next decode step runs the graphs
        gc.freeze()         # what the compile made, out of the collector's sight (as the worker's build does)
        self.log(f"{self.name}: decode compiled in the background ({compiled - t:.0f} s at low priority, "
                 f"{time.time() - compiled:.1f} s to load); decode steps run the graphs from now")


def main(argv: list[str]) -> None:
    """The child: one stage layout's graphs into inductor's cache, marked warm (`warm_layout`)."""
    from hpipe.lifeline import exit_now, tie_to_parent

    tie_to_parent("background compile")
    os.setpriority(os.PRIO_PROCESS, 0, 19)
    model, start, stop, weights, dtype, threads, page_size, attn = argv
    import torch

    from hpipe import models, quant
    from hpipe.runtime.stage import warm_layout

    torch.set_num_threads(int(threads))
    source = models.resolve_model(model)
    config = models.load_config(source.path)
    warm_layout(source, config, quant.stage_weights(quant.WeightFormat.parse(weights), "cpu"), dtype,
                lambda line: sys.stderr.write(line + "\n"), range(int(start), int(stop)), int(page_size), attn)
    exit_now(0)


if __name__ == "__main__":
    main(sys.argv[1:])
