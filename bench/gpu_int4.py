"""int4 weights on a GPU at Llama-3.1-8B's shapes, in two parts (the 8B int4 launch failed on an H200
on 2026-11-26 and an H100 on 2026-11-27, the head's tinygemm call with no rows, since returned
empty: it ran on the H100 that day):
1. tinygemm's linear (`hpipe.quantized.Int4Linear`) on each of the 8B matrices (q/o, k/v, gate/up,
   down, the 128,256-row head) at 1, 8, 255, 256 and 1,024 rows, each against a bf16 GEMM of the
   unquantized weights (the relative error is int4's rounding, about 0.08 on Gaussian weights);
2. `hpipe launch` of four 8B blocks in int4, eager and with CUDA graphs, each stage's whole log kept
   under --log-dir (a launch that fails runs again with CUDA_LAUNCH_BLOCKING=1, so that the log
   names the failing op).

    python bench/gpu_int4.py [--device cuda:0] [--log-dir DIR] [--skip-linears] [--skip-launch]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
import on_path  # noqa: E402,F401  (bench/on_path.py: the repository and tests/ on sys.path, bench/ off it)

from bench.common import bench_arguments  # noqa: E402

SHAPES = [(4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336), (128256, 4096)]   # [out, in]


def check_linears(device: str) -> list[dict]:
    import numpy as np
    import torch

    from hpipe import quant, quantized

    rows_out = []
    rng = np.random.default_rng(0)
    for n, k in SHAPES:
        w = rng.standard_normal((n, k), dtype=np.float32) * 0.02
        module = quantized.linear_module(quant.pack(w, quant.WeightFormat.parse("int4:32"), "cuda"), device)
        dense = torch.from_numpy(w).to(device, torch.bfloat16)
        for rows in (1, 8, 255, 256, 1024):
            x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
            try:
                y = module(x).float()
                ref = torch.nn.functional.linear(x, dense).float()
                row = {"shape": [n, k], "rows": rows, "rel_err": round(float((y - ref).norm() / ref.norm()), 4)}
            except Exception as e:          # reported, and the next shape still runs
                row = {"shape": [n, k], "rows": rows, "error": f"{type(e).__name__}: {e}"[:400]}
            rows_out.append(row)
            print(row, flush=True)
    return rows_out


def launch(device: str, log_dir: Path) -> list[dict]:
    from bench.common import random_llama

    out = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = random_llama(work / "m8", 128256, hidden=4096, layers=4, mlp=14336, heads=(32, 8), dtype="bfloat16")
        (work / "p.jsonl").write_text(json.dumps({"id": "one", "input_ids": [3 + (j * 31) % 30000
                                                                            for j in range(256)]}) + "\n")
        run = [sys.executable, "-m", "hpipe"]
        subprocess.run([*run, "plan", "--model", model, "--stages", "1", "--device", device, "--dtype", "bfloat16",
                        "--quantize", "int4", "-o", work / "plan.json"], check=True, cwd=work)
        for name, extra in (("eager", ["--no-cuda-graphs"]), ("graphs", [])):
            logs = log_dir / name
            t = time.time()
            cmd = [*run, "launch", work / "plan.json", "--local", "--prompts", work / "p.jsonl",
                   "--out", work / f"{name}.jsonl", "--max-new-tokens", "32", "--log-dir", logs, *extra]
            done = subprocess.run(cmd, cwd=work, capture_output=True, text=True)
            blocking = done.returncode != 0     # again with each launch synchronous: the stage log names the op
            if blocking:
                done = subprocess.run(cmd, cwd=work, capture_output=True, text=True,
                                      env=dict(os.environ, CUDA_LAUNCH_BLOCKING="1"))
            row = {"variant": name, "rc": done.returncode, "s": round(time.time() - t, 1),
                   "cuda_launch_blocking": blocking, "stderr_tail": done.stderr[-1500:]}
            if done.returncode == 0:
                row["tpot_ms"] = 1000 * json.loads((work / f"{name}.jsonl").read_text().splitlines()[0])["tpot_s"]
            out.append(row)
            print(json.dumps(row, indent=1), flush=True)
    return out


def main() -> None:
    args = bench_arguments(device="cuda:0", log_dir=str(Path(os.environ.get("OUT", "/tmp")) / "int4-logs"),
                           skip_linears=False, skip_launch=False)
    report = {"date": time.strftime("%Y-%m-%d")}
    try:
        if not args.skip_linears:
            report["linears"] = check_linears(args.device)
        if not args.skip_launch:
            report["launch"] = launch(args.device, Path(args.log_dir))
    except Exception:
        report["error"] = traceback.format_exc()[-2000:]
        print(report["error"], flush=True)
    import torch

    name = torch.cuda.get_device_name().replace(" ", "-")
    (ROOT / "bench" / "results" / f"gpu_int4-{name}.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
