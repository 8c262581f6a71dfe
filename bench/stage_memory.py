"""Peak memory (RSS) of a stage that loads only its own units, against the whole model.

Each measurement runs in a fresh process: import torch/transformers, build the stage from the
cached safetensors of the default model, run one 128-token slice, report ru_maxrss. Writes
bench/results/stage_memory.json.

    python bench/stage_memory.py
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
import on_path  # noqa: E402,F401  (bench/on_path.py: the repository and tests/ on sys.path, bench/ off it)
CHILD = r"""
import json, sys, time, torch
from hpipe import models
from hpipe.runtime.stage import StageRunner
from hpipe.runtime.pages import Segment
start, end = int(sys.argv[1]), int(sys.argv[2])
src = models.resolve_model("smollm2"); cfg = models.load_config(src.path)
base = models.peak_rss_bytes()
t = time.time()
if start < 0:
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(str(src.path)).eval()
    with torch.no_grad(): m(torch.arange(128)[None])
    params = sum(p.numel() * p.element_size() for p in m.parameters())
else:
    r = StageRunner(src.path, cfg, range(start, end))
    x = torch.arange(128) if start == 0 else torch.zeros(128, cfg.hidden_size)
    r.forward(r.prepare_inputs([Segment(0, 0, 0, 128, end == models.num_units(cfg))]), x)
    params = sum(p.numel() * p.element_size() for p in r.model.parameters() if not p.is_meta)
print(json.dumps({"peak_rss_bytes": models.peak_rss_bytes(), "rss_after_imports_bytes": base,
                  "weight_bytes": params, "build_s": round(time.time() - t, 3)}))
"""


def measure(start: int, end: int) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, str(start), str(end)], capture_output=True, text=True,
                         cwd=ROOT, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    from hpipe import models

    config = models.load_config(models.resolve_model("smollm2").path)
    blocks = models.num_blocks(config)
    quarter = blocks // 4
    cases = {
        "transformers_from_pretrained_whole_model": (-1, -1),
        "stage_whole_model": (0, models.num_units(config)),
        f"stage_quarter_blocks_{quarter}_blocks": (1 + 2 * quarter, 1 + 4 * quarter),  # middle blocks only
    }
    results = {name: measure(*rng) | {"units": list(rng)} for name, rng in cases.items()}
    whole = results["stage_whole_model"]
    part = results[f"stage_quarter_blocks_{quarter}_blocks"]
    report = {"model": "smollm2 (SmolLM2-135M-Instruct, float32)", "blocks": blocks, "cases": results,
              "quarter_over_whole_peak_rss": round(part["peak_rss_bytes"] / whole["peak_rss_bytes"], 3),
              "quarter_over_whole_above_imports": round(
                  (part["peak_rss_bytes"] - part["rss_after_imports_bytes"])
                  / (whole["peak_rss_bytes"] - whole["rss_after_imports_bytes"]), 3)}
    (ROOT / "bench" / "results").mkdir(exist_ok=True)
    (ROOT / "bench" / "results" / "stage_memory.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
