"""How good `hpipe launch`'s time left is: a batch job of 64 prompts on 3 emulated hosts
(tests/netns_hosts.py), its plain progress lines read as they come, each line's ETA against the
time that was actually left from then to the job's end.

    python bench/launch_progress.py [--prompts 64] [--max-new-tokens 64] [-o bench/results/launch_progress.json]

The plan is made from the one-thread profile put on the three hosts (`netns_hosts.elastic_profile`),
so the ETA starts from the plan's prediction; the prompts are varied questions whose answers may
end early (EOS), as a user's would. Reported: every line (elapsed, done, ETA, actual left) and the
relative error of the first line after a quarter of the prompts are done.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
import on_path  # noqa: E402,F401  (bench/on_path.py: the repository and tests/ on sys.path)

from bench.common import cpu_flags, cpu_name, plan_on_hosts, three_hosts  # noqa: E402

QUESTIONS = ["What is the capital of France?", "Name three colours.", "Count from one to ten.", "What is 2 + 2?",
             "Tell me about the sea.", "Why is the sky blue?", "Name a large animal.", "Write a haiku about rain."]
LINE = re.compile(r"hpipe: (\d+)/(\d+) prompts, .* ETA (\S+);")


def seconds(text: str) -> float | None:
    """'1h02m', '3m05s', '42s' -> seconds; '–' -> None."""
    m = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?", text)
    if not m or not any(m.groups()):
        return None
    h, mi, s = (int(g or 0) for g in m.groups())
    return 3600 * h + 60 * mi + s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("-o", "--out", default=str(ROOT / "bench" / "results" / "launch_progress.json"))
    args = ap.parse_args()
    from netns_hosts import stop_cluster

    cluster, work = three_hosts("progress")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    try:
        plan = plan_on_hosts(cluster, work, env)
        prompts = work / "prompts.jsonl"
        prompts.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"{QUESTIONS[i % len(QUESTIONS)]} ({i})"}) + "\n"
                                   for i in range(args.prompts)))
        proc = subprocess.Popen([sys.executable, "-m", "hpipe", "launch", str(plan), "--cluster",
                                 str(cluster.inventory_path), "--prompts", str(prompts), "--out", str(work / "out.jsonl"),
                                 "--max-new-tokens", str(args.max_new_tokens), "--compile", "off", "--quiet"],
                                stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
        lines = []
        for line in proc.stderr:
            m = LINE.search(line)
            if m:
                lines.append({"t": time.time(), "done": int(m.group(1)), "total": int(m.group(2)),
                              "eta_s": seconds(m.group(3)), "line": line.strip()})
                print(line.strip(), flush=True)
        if proc.wait() != 0:
            raise SystemExit("the launch failed")
    finally:
        stop_cluster(cluster)
    t_end = lines[-1]["t"]
    for x in lines:
        x["left_s"] = round(t_end - x["t"], 2)
        x["error"] = None if x["eta_s"] is None or x["left_s"] <= 0 else round((x["eta_s"] - x["left_s"]) / x["left_s"], 3)
    quarter = next(x for x in lines if x["done"] >= args.prompts / 4)
    result = {"date": time.strftime("%Y-%m-%d"), "cpu": cpu_name(), "cpu_flags": cpu_flags(), "prompts": args.prompts,
              "max_new_tokens": args.max_new_tokens, "lines": lines, "after_a_quarter": quarter}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"after a quarter ({quarter['done']}/{args.prompts}): ETA {quarter['eta_s']} s, actually "
          f"{quarter['left_s']} s left ({quarter['error']:+.1%})")


if __name__ == "__main__":
    main()
