"""The SiDP planner's predictions in the paper's own setting, beside the paper's numbers.

Fig. 5 (KV capacity): 8 x H20 (96 GB each, and 144 GB as the paper's Table 1 lists its H20 node;
vLLM's memory budget of 0.9), bf16 weights, TP = 1, 2
and 4 (a TP group counts as one replica with TP x the memory, compute and bandwidth, the weights
and KV heads split over it), DP = 8 / TP; the group's KV tokens for plain DP (every replica holds
every weight) and for SiDP (each replica its share of the FFNs plus d - 1 slots of one FFN; the
paper says its slots cost <= 1 GB: both are shown). An activation reserve of 2 GiB per GPU stands
for vLLM's profiled peak.
Fig. 9 (prefetch vs T(B)): Llama-3.1-70B, TP = 2, S = 1K, the roofline T(B) for B = 64..512 on
H20 / H200 / B200 against the time to read all FFN weights of one TP rank over NVLink 4 and 5.

    python bench/sidp_paper.py          # writes bench/results/sidp_paper.json
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
import on_path  # noqa: E402,F401  (bench/on_path.py: the repository and tests/ on sys.path, bench/ off it)

GIB = 2 ** 30
BUDGET, RESERVE = 0.9, 2 * GIB
PAPER = {  # what the paper's text states about Fig. 5 and Fig. 9
    "fig5": "~1.7x KV tokens with TP=2, DP=4; TP=1, DP=8: vLLM cannot run Llama-3.1-70B or Qwen2.5-72B, "
            "SiDP ~1.0M tokens; ~5% for Qwen3-32B at TP=4, DP=2",
    "fig9": "H20: T(B) exceeds the full fetch at B=128, 3-5x it at B=256 and 512; H200: slightly above at "
            "B=256, ~1.8x at B=512; B200: approaches or exceeds it near B=256",
}


def step_s(config, spec, tp: int, rows: int, context: float) -> float:
    from hpipe import models
    from hpipe.profiler import catalog

    group = replace(spec, fp32_tflops=spec.fp32_tflops * tp, fp16_tflops=spec.fp16_tflops * tp,
                    bandwidth_gbs=spec.bandwidth_gbs * tp)
    t = {k: float(catalog.decode_unit_time(config, k, rows, context, group, "bfloat16")) for k in ("attn", "mlp", "head")}
    return models.num_blocks(config) * (t["attn"] + t["mlp"]) + t["head"]


def kv_capacity(name: str, tp: int, memory_gib: float) -> dict:
    from hpipe import models
    from hpipe.planner import sidp
    from hpipe.profiler import catalog

    config = models.config_for(name)
    spec = replace(catalog.spec("H20"), memory_gib=memory_gib)
    d = 8 // tp
    unit_bytes = models.unit_bytes(config, "bfloat16")
    free = tp * (spec.memory_gib * GIB * BUDGET - RESERVE)
    nvlink = catalog.link_gbs("nvlink4") * 1e9 * tp
    members = [sidp.Member(f"tp-group-{i}", free, lambda b, c: step_s(config, spec, tp, b, c),
                           lambda b: 0.0, nvlink, 5e-6, nvlink) for i in range(d)]
    out = {"model": name, "memory_gib": memory_gib, "tp": tp, "dp": d}
    for label, slots in (("sidp", None), ("sidp_1gb_slots", 0)):
        group = sidp.plan_group(config, members, unit_bytes, "peer", 1024, 0, max_batch=512, slots=slots)
        if slots == 0:   # the paper's <= 1 GB of slots per GPU, instead of d - 1 whole FFNs
            group.kv_tokens = [t - tp * GIB / sum(unit_bytes.kv_per_token_per_unit) for t in group.kv_tokens]
        out[label] = round(sum(max(t, 0) for t in group.kv_tokens))
        out["plain_dp"] = round(sum(max(t, 0) for t in group.dp_kv_tokens)) if min(group.dp_kv_tokens) > 0 else 0
    out["ratio"] = round(out["sidp"] / out["plain_dp"], 2) if out["plain_dp"] else None
    return out


def prefetch_vs_step() -> dict:
    from hpipe import models
    from hpipe.profiler import catalog

    config = models.config_for("llama3.1-70b")
    ffn = sum(models.unit_bytes(config, "bfloat16").weights_per_unit[2::2][:models.num_blocks(config)]) / 2
    fetch = {link: ffn / (catalog.link_gbs(link) * 1e9) for link in ("nvlink4", "nvlink5")}
    rows = {}
    for gpu in ("H20", "H200", "B200"):
        spec = catalog.spec(gpu)
        rows[gpu] = {b: round(step_s(config, spec, 2, b, 512), 4) for b in (64, 128, 256, 512)}
    return {"ffn_bytes_per_tp_rank": ffn, "fetch_s": fetch, "T_s": rows}


def main() -> None:
    report = {"setting": "8 x H20 96 GB, budget 0.9, 2 GiB reserve per GPU, bf16, S = 1K",
              "paper": PAPER,
              "fig5": [kv_capacity(m, tp, mem) for mem in (96, 144)
                       for m in ("llama3.1-70b", "qwen2.5-72b", "qwen3-32b") for tp in (1, 2, 4)],
              "fig9": prefetch_vs_step()}
    out = ROOT / "bench" / "results" / "sidp_paper.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
