"""Runs on a remote host for the preflight:
`python -c <this file's text> [--cuda] [--model SPEC] [--sha256 FILE...]`.

Prints one JSON line: interpreter, versions of hpipe/torch/transformers (None when missing; torch
and transformers from their package metadata, without importing them), cores, available memory,
with --cuda the CUDA devices with free memory (this imports torch), a free TCP port (for the rendezvous),
whether the model is there (without converting anything) and, with --sha256, the checksums of the
given files (for `--push-model`). Standard library only at the top level, so that it reports a
missing package instead of failing.
"""

import hashlib
import importlib
from importlib import metadata
import json
import os
import socket
import sys


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def main(argv):
    out = {"python": sys.version.split()[0], "executable": sys.executable, "cores": os.cpu_count(),
           "hostname": socket.gethostname(), "home": os.path.expanduser("~")}
    for name in ("hpipe", "torch", "transformers"):
        try:
            if name == "hpipe":  # may run from a checkout on PYTHONPATH, without package metadata
                out[name] = getattr(importlib.import_module(name), "__version__", "unknown")
            else:  # the installed version, without the seconds an import of torch costs
                out[name] = metadata.version(name)
        except Exception as e:  # noqa: BLE001 - any failure is a finding, not a crash
            out[name] = None
            out[name + "_error"] = "%s: %s" % (type(e).__name__, str(e)[:200])
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        out["mem_available_bytes"] = int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        out["mem_available_bytes"] = None
    out["cuda"] = []
    if out["torch"] is not None and "--cuda" in argv:
        import torch

        if torch.cuda.is_available():
            for i in range(torch.cuda.device_count()):
                free, total = torch.cuda.mem_get_info(i)
                out["cuda"].append({"index": i, "name": torch.cuda.get_device_name(i), "free_bytes": free,
                                    "total_bytes": total})
    if out["hpipe"] is not None and "--kernels" in argv:   # which weight-only kernels each device runs
        try:
            from hpipe import quant

            devices = ["cpu"] + ["cuda:%d" % d["index"] for d in out["cuda"]]
            out["kernels"] = {d: quant.kernels_on(d)[1] for d in devices}
        except Exception as e:  # noqa: BLE001 - a finding, not a crash
            out["kernels"] = {"error": "%s: %s" % (type(e).__name__, str(e)[:200])}
    try:                                  # the rendezvous port, picked as every launch picks one
        from hpipe.net import free_port

        out["free_port"] = free_port()
    except ImportError:                   # no hpipe here (the preflight says so): the kernel's pick
        with socket.socket() as s:
            s.bind(("", 0))
            out["free_port"] = s.getsockname()[1]
    if "--model" in argv:
        spec = argv[argv.index("--model") + 1]
        if out["hpipe"] is None:
            out["model"] = {"ok": False, "note": "hpipe is not installed"}
        else:
            from hpipe import models

            ok, note = models.check_model_available(spec)
            out["model"] = {"ok": ok, "note": note}
    if "--sha256" in argv:
        out["sha256"] = {}
        for path in argv[argv.index("--sha256") + 1:]:
            out["sha256"][path] = sha256(path) if os.path.isfile(path) else None
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])
