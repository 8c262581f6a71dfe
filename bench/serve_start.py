"""A server's first minutes: how soon `hpipe serve` answers, and its decode speed over time, as its
CPU stages get their compiled graphs beside it (hpipe.runtime.background_compile).

Cases, each its own server on the same one-stage plan (the whole model in one CPU stage, every core):
- `cold`: a host that never compiled (a fresh inductor cache): it answers eagerly, its stage
  compiles its graphs in a child at nice 19, then loads them;
- `warm`: the same host after that (the graphs marked warm): it answers eagerly while its stage
  loads them (dynamo traces them again);
- `on`: the same warm host with `--compile on`: the stage loads them before it answers (what
  every start of a warmed host did before).

Per case: the seconds from the command to the first answer of GET /health, when the log said the
graphs run, and a chat client's streamed greedy completions (a 256-token prompt, --new-tokens
tokens each) with --gap seconds between a reply's end and the next request (a user reading and
typing; a server busy without a pause gives a nice-19 compile next to no CPU) for --seconds: each
reply's start, time to first token and TPOT. Beside them, `hpipe launch`'s TPOT on the same plan with
default flags once the graphs are warm.

    python bench/serve_start.py [--model smollm2] [--quantize gguf] [--seconds 150] [--new-tokens 64] [--gap 5]
                                [--cases cold,warm,on]

Writes bench/results/serve_start.json (--out), with the CPU's name.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import on_path  # noqa: E402,F401  (bench/on_path.py: the repository and tests/ on sys.path, bench/ off it)

from bench.common import bench_arguments, cpu_name, hpipe, kernels_line, prompt_ids, results_path  # noqa: E402

RAN = "steps run them from now"


def serve_case(plan: Path, work: Path, env: dict, compile: str, seconds: float, new_tokens: int, gap: float) -> dict:
    import openai

    from hpipe.net import free_port

    port = free_port()
    log = work / f"serve-{compile}-{port}.log"
    t0 = time.time()
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "hpipe", "serve", str(plan), "--local", "--port", str(port),
                                 "--max-model-len", "1024", "--compile", compile], stdout=f, stderr=subprocess.STDOUT,
                                text=True, env=env, start_new_session=True)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=300)
    try:
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                client.models.list()
                break
            except openai.APIConnectionError:
                time.sleep(0.2)
        ready = time.time() - t0
        model = client.models.list().data[0].id
        replies, ran = [], None
        while time.time() - t0 < seconds:
            start, first, n = time.time(), None, 0
            for chunk in client.completions.create(model=model, prompt=prompt_ids(256), max_tokens=new_tokens,
                                                   temperature=0, stream=True,
                                                   extra_body={"ignore_eos": True}):
                if chunk.choices and chunk.choices[0].text is not None:
                    first = first or time.time()
                    n += 1
            end = time.time()
            replies.append({"start_s": round(start - t0, 2), "ttft_s": round(first - start, 3),
                            "tpot_ms": round(1000 * (end - first) / max(1, n - 1), 2)})
            if ran is None and RAN in log.read_text():
                ran = round(time.time() - t0, 1)     # seen after this reply (its line, read between replies)
            time.sleep(gap)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    lines = [line for line in log.read_text().splitlines() if "decode" in line]
    return {"ready_s": round(ready, 2), "graphs_run_seen_s": ran, "log": lines, "replies": replies}


def main() -> None:
    args = bench_arguments(model="smollm2", quantize="gguf", seconds=150.0, new_tokens=64, gap=5.0,
                           cases=("cold,warm,on", "of cold, warm, on; in that order"), out=results_path("serve_start"))
    report = {"date": time.strftime("%Y-%m-%d"), "cpu": cpu_name(), "machine_cores": os.cpu_count(),
              "kernels": kernels_line(), "model": args.model, "quantize": args.quantize, "prompt": 256,
              "new_tokens": args.new_tokens, "gap_s": args.gap,
              "cases": {}}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(work / "inductor")}    # a host that never compiled
        plan = work / "plan.json"
        hpipe("plan", "--model", args.model, "--stages", "1", "--quantize", args.quantize, "-o", plan, cwd=work,
              env=env)
        for case, compile in (("cold", "auto"), ("warm", "auto"), ("on", "on")):
            if case not in args.cases.split(","):
                continue
            report["cases"][case] = serve_case(plan, work, env, compile, args.seconds, args.new_tokens, args.gap)
            print(case, json.dumps(report["cases"][case]), flush=True)
        prompts, out = work / "p.jsonl", work / "out.jsonl"
        prompts.write_text(json.dumps({"id": "p", "input_ids": prompt_ids(256)}) + "\n")
        hpipe("launch", plan, "--local", "--prompts", prompts, "--out", out, "--max-new-tokens", 128, "--quiet",
              cwd=work, env=env)
        report["launch_tpot_ms"] = round(1000 * json.loads(out.read_text().splitlines()[0])["tpot_s"], 2)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "cases"}, indent=2))


if __name__ == "__main__":
    main()
