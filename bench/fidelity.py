"""How close the planner's predictions come to the runs: predicted against measured prefill (time to
first token) and single-stream decode (ms/token) on the default model, for local pipelines of 1, 2
and 3 stages and for 2 and 3 emulated hosts (tests/netns_hosts.py: network namespaces with real
sshd, one link shaped to 100 Mbit/s, one thread per host), at several prompt lengths.

Each setting: `hpipe profile` (--quick, the threads the stages will get), `hpipe plan --profile
--seq-len N` for every length, `hpipe launch` of one prompt of N token ids with --max-new-tokens,
(--repeats times: this machine is shared, and one launch can meet a slow spell; the median launch
is compared), then the plan's prediction against the run: prefill as the time to first token, decode as the
run summary's check reads it off the timeline (`plan_check`: every stage's compute, every hop and
the way back, predicted and measured, per steady token).

    python bench/fidelity.py [--settings local-1,local-2,local-3,hosts-2,hosts-3] [--lengths 512,2048] [--model M]
                             [--new-tokens 64] [--repeats 3] [--out bench/results/fidelity.json]
                             [--keep-profile hosts-3=tests/data/profile-3hosts.json]

Needs root and openssh-server for the hosts-* settings (others run anywhere).
"""

from __future__ import annotations

import collections
import datetime
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
import on_path  # noqa: E402,F401  (bench/on_path.py: the repository and tests/ on sys.path, bench/ off it)

from bench.common import bench_parser, hpipe as run_hpipe, launch_checked, prompt_ids, results_path  # noqa: E402

SETTINGS = {   # name: (local stages or None, hosts as (name, link Mbit/s or None), profile threads)
    "local-1": (1, None, 0),
    "local-2": (2, None, 1),
    "local-3": (3, None, 1),
    "hosts-2": (None, (("h0", None), ("h1", 100)), 1),
    "hosts-3": (None, (("h0", None), ("h1", None), ("h2", 100)), 1),
}


def hpipe(*args, cwd: Path) -> str:
    return run_hpipe(*args, cwd=cwd, env=dict(os.environ, PYTHONPATH=str(ROOT)))


def median_by(items: list, key):
    """The middle item by `key` (the lower middle of an even count)."""
    return sorted(items, key=key)[(len(items) - 1) // 2]


def run_setting(name: str, lengths: list[int], new_tokens: int, work: Path, keep: Path | None,
                repeats: int = 3, model: str = "smollm2") -> dict:
    stages, hosts, threads = SETTINGS[name]
    cluster = None
    if hosts:
        from netns_hosts import HostSpec, start_cluster, unavailable_reason

        reason = unavailable_reason()
        if reason:
            return {"skipped": f"emulated hosts unavailable: {reason}"}
        cluster = start_cluster(work / "hosts", [HostSpec(h, rate, threads=1) for h, rate in hosts])
    try:
        where = ["--cluster", cluster.inventory_path] if cluster else ["--local"]
        profile = work / "profile.json"
        t = time.time()
        hpipe("profile", "--model", model, *where, "--quick", "--threads", threads,
              "--max-seq-len", max(lengths), "-o", profile, cwd=work)
        out = {"profile_s": round(time.time() - t, 1), "runs": []}
        if keep:
            shutil.copy(profile, keep)
        devices = ["--stages", stages] if stages else ["--cluster", cluster.inventory_path]
        for n in lengths:
            plan = work / f"plan-{n}.json"
            hpipe("plan", "--model", model, *devices, "--profile", profile, "--seq-len", n,
                  "--new-tokens", new_tokens, "-o", plan, cwd=work)
            pr = json.loads(plan.read_text())["predicted"]
            prompts = work / f"p-{n}.jsonl"
            prompts.write_text(json.dumps({"id": f"n{n}", "input_ids": prompt_ids(n)}) + "\n")
            launches = [launch_checked(plan, prompts, work, f"{n}-{k}", new_tokens, where,
                                       env=dict(os.environ, PYTHONPATH=str(ROOT))) for k in range(repeats)]
            # the median launch: prefill by its time to first token, decode by its steady ms/token
            r, check, stdout = median_by(launches, lambda x: x[0]["ttft_s"])
            dec = median_by(launches, lambda x: (x[1].get("decode") or {}).get("measured_ms_per_token", 0.0))[1] \
                .get("decode") or {}
            row = {"seq_len": n, "stages": len(pr["stage_busy_s"]), "slices": pr["slices"],
                   "prefill_predicted_s": round(pr["makespan_s"], 4), "prefill_measured_s": round(r["ttft_s"], 4),
                   "prefill_error": round((pr["makespan_s"] - r["ttft_s"]) / r["ttft_s"], 4),
                   "prefill_measured_runs_s": [round(x[0]["ttft_s"], 4) for x in launches],
                   "decode_predicted_ms": round(dec["predicted_ms_per_token"], 3) if dec else None,
                   "decode_measured_ms": round(dec["measured_ms_per_token"], 3) if dec else None,
                   "decode_measured_runs_ms": [round((x[1].get("decode") or {}).get("measured_ms_per_token", 0.0), 3)
                                               for x in launches],
                   "tpot_ms": round(1000 * r["tpot_s"], 3),
                   "decode_error": round((dec["predicted_ms_per_token"] - dec["measured_ms_per_token"])
                                         / dec["measured_ms_per_token"], 4) if dec else None,
                   # the model's own error: the plan's pipeline with the stages' compute as this run measured it
                   "prefill_model_error": round((check["predicted_with_measured_compute_s"] - r["ttft_s"]) / r["ttft_s"], 4)
                   if check.get("predicted_with_measured_compute_s") else None,
                   "decode_model_error": round((dec["predicted_with_measured_compute_ms"] - dec["measured_ms_per_token"])
                                               / dec["measured_ms_per_token"], 4) if dec else None,
                   "decode_terms_ms": {k: [round(v, 3), round(dec["measured_terms_ms"].get(k, 0.0), 3)]
                                       for k, v in dec.get("predicted_terms_ms", {}).items()},
                   "prefill_stage_busy_s": {"predicted": [round(x, 4) for x in pr["stage_busy_s"]],
                                            "measured": [round(x, 4) for x in check.get("measured_stage_busy_s", [])]},
                   "assumptions": pr.get("assumptions", []), "off": check.get("off", []),
                   "launch_said": stdout.splitlines()[:3]}
            out["runs"].append(row)
            print(f"{name} {n}: (model error prefill {row['prefill_model_error']}, decode {row['decode_model_error']}) "
                  f"prefill {row['prefill_predicted_s']:.3f} vs {row['prefill_measured_s']:.3f} s "
                  f"({row['prefill_error']:+.1%}), decode {row['decode_predicted_ms']} vs {row['decode_measured_ms']} ms "
                  f"({row['decode_error'] if row['decode_error'] is None else format(row['decode_error'], '+.1%')})",
                  flush=True)
        return out
    finally:
        if cluster:
            from netns_hosts import stop_cluster

            stop_cluster(cluster)


def main() -> None:
    ap = bench_parser(settings=",".join(SETTINGS),
                      model=("smollm2", "what `hpipe plan --model` takes (a MoE GGUF file: bench/moe.py's)"),
                      lengths="512,2048", new_tokens=64, repeats=(3, "launches per length; the median is compared"),
                      out=results_path("fidelity"))
    ap.add_argument("--keep-profile", action="append", default=[], help="SETTING=PATH: keep that setting's profile")
    args = ap.parse_args()
    keep = dict(x.split("=", 1) for x in args.keep_profile)
    lengths = [int(x) for x in args.lengths.split(",")]
    report = {"date": datetime.date.today().isoformat(), "machine_cores": os.cpu_count(), "model": "smollm2 (Q4_1 GGUF)" if args.model == "smollm2" else Path(args.model).name,
              "new_tokens": args.new_tokens, "settings": {}}
    for name in args.settings.split(","):
        with tempfile.TemporaryDirectory(prefix=f"hpipe-fidelity-{name}-") as tmp:
            report["settings"][name] = run_setting(name, lengths, args.new_tokens, Path(tmp),
                                                   Path(keep[name]).resolve() if name in keep else None, args.repeats,
                                                   str(Path(args.model).resolve()) if args.model != "smollm2" else "smollm2")
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    worst = collections.defaultdict(float)
    model = collections.defaultdict(float)
    for name, s in report["settings"].items():
        for r in s.get("runs", []):
            worst[name] = max(worst[name], abs(r["prefill_error"]), abs(r["decode_error"] or 0))
            model[name] = max(model[name], abs(r["prefill_model_error"] or 0), abs(r["decode_model_error"] or 0))
    report["worst_abs_error"] = dict(worst)
    report["worst_abs_model_error"] = dict(model)   # with the stages' measured compute put in
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({"raw": report["worst_abs_error"], "with measured compute": report["worst_abs_model_error"]}))


if __name__ == "__main__":
    main()
