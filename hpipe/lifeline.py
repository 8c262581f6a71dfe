"""A process hpipe starts never outlives the process that started it.

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

import ctypes
import os
import signal
import sys
import threading
import time

__all__ = ["PARENT_ENV", "arm_parent_death_signal", "tie_to_parent"]

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
