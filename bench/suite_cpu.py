"""Where a command's CPU time goes, by kind of process: every process that ends while it runs
(the kernel's own accounting, acct(2), so a g++ of a tenth of a second counts), named by its
command line (sampled from /proc while it lives) or, for one too short to be seen, its name.

    python bench/suite_cpu.py -o bench/results/suite-cpu.json -- make test

Made for the test suite (issue 69: it is CPU-bound on two cores, so it gets faster by doing less,
not by packing better): which of pytest's own processes, stage workers, `hpipe` commands,
inductor's compiles, sshd, the browser, ... take the suite's CPU. Needs root (acct(2)); the
machine's other processes are counted too, so run nothing else beside it.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import json
import os
import re
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cpu_flags, cpu_name  # noqa: E402

RECORD = 64                         # struct acct_v3
AHZ = 100                           # its times' ticks a second

# what a command line says the process is, tried in order (the first match names it)
KINDS = [
    ("remote wrapper", re.compile(r"Runs on a remote host, around one worker")),
    ("stage worker", re.compile(r"-m hpipe\.runtime\.worker ")),
    ("inductor compile worker", re.compile(r"torch/_inductor|compile_worker")),
    ("hpipe {}", re.compile(r"(?:-m hpipe|bin/hpipe) ([a-z]+)")),                 # hpipe launch, plan, ...
    ("{}", re.compile(r"-m (hpipe\.[\w.]+)")),                                  # hpipe.launcher.forkserver, ...
    ("pytest worker (the tests' own work)", re.compile(r"exec\(eval\(sys\.stdin\.readline\(\)\)\)")),
    ("pytest", re.compile(r"-m pytest|bin/pytest")),
]
BY_NAME = {"cc1plus": "C++ compile", "g++": "C++ compile", "c++": "C++ compile", "as": "C++ compile",
           "ld": "C++ compile", "collect2": "C++ compile", "cc1": "C++ compile", "gcc": "C++ compile",
           "sshd": "sshd", "ssh": "ssh client", "chrome": "browser", "chromium": "browser", "headless_shell": "browser"}


def comp_t(c: int) -> int:
    """acct's 16-bit float: a 13-bit mantissa and a 3-bit base-8 exponent."""
    return (c & 0x1FFF) << (3 * (c >> 13))


def records(data: bytes):
    for i in range(0, len(data) - RECORD + 1, RECORD):
        rec = data[i:i + RECORD]
        _, version, _, _, _, _, pid, ppid, _, _ = struct.unpack("<bBHIIIIIIf", rec[:32])
        if version != 3:
            continue
        utime, stime = struct.unpack("<HH", rec[32:36])
        yield pid, ppid, rec[48:64].split(b"\0")[0].decode(errors="replace"), (comp_t(utime) + comp_t(stime)) / AHZ


def sample(cmdlines: dict[int, str], stop: threading.Event, every: float) -> None:
    while not stop.wait(every):
        for d in os.listdir("/proc"):
            if d.isdigit() and int(d) not in cmdlines:
                try:
                    raw = Path(f"/proc/{d}/cmdline").read_bytes()
                except OSError:
                    continue
                if raw:
                    cmdlines[int(d)] = raw.replace(b"\0", b" ").decode(errors="replace").strip()


def kind_of(pid: int, comm: str, cmdlines: dict[int, str], parents: dict[int, int]) -> str:
    cmd = cmdlines.get(pid)
    if cmd is not None:
        for kind, pattern in KINDS:
            m = pattern.search(cmd)
            if m:
                return kind.format(*m.groups())
    for name, kind in BY_NAME.items():
        if comm.startswith(name):
            return kind
    if comm.startswith("python"):       # a short python: its parent's kind, said so
        parent = parents.get(pid)
        if parent in cmdlines:
            return kind_of(parent, "", cmdlines, parents) + " (child)"
    return f"other ({comm})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-o", "--out", default="bench/results/suite-cpu.json")
    ap.add_argument("--every", type=float, default=0.25, help="seconds between /proc samples")
    ap.add_argument("command", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        ap.error("give the command to measure after --")
    libc = ctypes.CDLL(None, use_errno=True)
    log = Path(tempfile.mkstemp(prefix="hpipe-acct-")[1])
    if libc.acct(str(log).encode()) != 0:
        sys.exit(f"suite_cpu: acct({log}) failed (errno {ctypes.get_errno()}): run as root")
    cmdlines: dict[int, str] = {}
    stop = threading.Event()
    sampler = threading.Thread(target=sample, args=(cmdlines, stop, args.every), daemon=True)
    sampler.start()
    t0 = time.time()
    try:
        code = subprocess.call(command)
    finally:
        libc.acct(None)
        stop.set()
        sampler.join()
    wall = time.time() - t0
    rows = list(records(log.read_bytes()))
    log.unlink()
    parents = {pid: ppid for pid, ppid, _, _ in rows}
    by_kind: dict[str, list] = collections.defaultdict(lambda: [0.0, 0])
    every = []
    for pid, ppid, comm, cpu in rows:
        k = kind_of(pid, comm, cmdlines, parents)
        by_kind[k][0] += cpu
        by_kind[k][1] += 1
        every.append({"pid": pid, "ppid": ppid, "cpu_s": cpu, "kind": k, "command": cmdlines.get(pid, comm)[:300]})
    total = sum(v[0] for v in by_kind.values())
    result = {"cpu": cpu_name(), "cpu_flags": cpu_flags(), "cores": os.cpu_count(), "command": command, "exit_code": code, "wall_s": round(wall, 1),
              "cpu_s": round(total, 1),
              "by_kind": {k: {"cpu_s": round(v[0], 1), "share": round(v[0] / total, 3), "processes": v[1]}
                          for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1][0])},
              "processes": sorted(every, key=lambda r: -r["cpu_s"])}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"{wall:.0f} s wall, {total:.0f} s CPU in processes that ended:")
    for k, v in result["by_kind"].items():
        print(f"  {v['cpu_s']:8.1f} s  {100 * v['share']:5.1f} %  {v['processes']:6d}  {k}")
    sys.exit(code)


if __name__ == "__main__":
    main()
