"""A process hpipe starts never outlives the process that started it, and ends without the
interpreter's teardown (`exit_now`).

Workers, profiler workers and sampler processes call `tie_to_parent()` first thing. Two mechanisms,
because either alone has a hole:
- Linux's parent-death signal (prctl PR_SET_PDEATHSIG = SIGKILL): the kernel kills us the moment
  the parent dies, whatever we are doing (loading weights, blocked in a rendezvous, inside a
  collective). A process that starts after its parent already died would never get it, so we
  compare our parent with the one that started us (HPIPE_PARENT_PID) right after arming it.
- a daemon thread that polls our parent pid every `poll_s` seconds (other systems, or a
  parent-death signal lost to a thread exit): when the parent changes, exit at once.

The launcher (local), the remote wrapper (SSH) and the worker (for its sampler processes) set
HPIPE_PARENT_PID in the child's environment.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import signal
import sys
import threading
import time

__all__ = ["PARENT_ENV", "arm_parent_death_signal", "exit_now", "tie_to_parent"]

PARENT_ENV = "HPIPE_PARENT_PID"
_PR_SET_PDEATHSIG = 1


def _find_prctl():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


# resolved here, not in the child: between fork and exec (Popen's preexec_fn, with threads running
# in the parent) a dlopen could deadlock; the call itself is safe
_PRCTL = _find_prctl()


def arm_parent_death_signal() -> bool:
    """Also usable as Popen's preexec_fn: armed before exec, it covers the child's imports too. The
    signal follows the *thread* that forked: start children from a thread that outlives them."""
    return _PRCTL is not None and _PRCTL(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0


def _parent_gone(what: str, parent: int) -> None:
    sys.stderr.write(f"hpipe: {what} (pid {os.getpid()}): its parent (pid {parent}) is gone; exiting\n")
    sys.stderr.flush()
    os._exit(3)


def tie_to_parent(what: str = "worker", parent: int | None = None, poll_s: float = 0.25) -> None:
    """Exits (or is killed) within `poll_s` of the parent's death. parent: the pid that started us
    (default: HPIPE_PARENT_PID, else our parent now)."""
    # read once and dropped: our own children must not compare themselves with our parent
    parent = parent or int(os.environ.pop(PARENT_ENV, "0") or 0) or os.getppid()
    arm_parent_death_signal()
    if os.getppid() != parent:
        _parent_gone(what, parent)

    def watch() -> None:
        while True:
            time.sleep(poll_s)
            if os.getppid() != parent:
                _parent_gone(what, parent)

    threading.Thread(target=watch, name="hpipe-lifeline", daemon=True).start()


def exit_now(code: int, wait_for_threads: bool = True) -> None:
    """Ends the process without the interpreter's teardown: finalizing torch's and transformers'
    modules took 0.5-0.9 s after a process's last line (an import of both and a tokenizer: 0.91 s; a
    2-stage local launch: 1.0-1.1 s; a stage worker on a host at half a core: up to 2.8 s), which the
    command, and every job's end waiting on its workers, paid. What an ordinary exit does for the
    program runs first, in its order: the other non-daemon threads are waited for (not when
    `wait_for_threads` is False: a failing stage's threads may be blocked in a dead transport),
    atexit's handlers run (logging, temporary directories, multiprocessing's: sampler processes
    stopped, their semaphores given back), the output is flushed. Files hpipe writes are closed by
    then (`with` blocks; stage logs flush each line)."""
    if wait_for_threads:
        threading._shutdown()          # what Py_Finalize does first
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
