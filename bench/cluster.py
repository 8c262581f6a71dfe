"""The whole SSH path on emulated hosts (tests/netns_hosts.py: network namespaces with real sshd,
tbf-shaped links, a CPU quota): `hpipe cluster check` -> `hpipe profile --cluster` -> `hpipe plan`
-> `hpipe launch --cluster` on the default model with the demo document as the prompt, then
predicted vs measured prefill, and the time each fault takes to tear everything down.
Needs root and openssh-server. Writes bench/results/cluster.json.

    python bench/cluster.py [--max-seq-len 2048] [--h2-cpus 0.5]

The three "hosts" share this machine's cores (2 here): h0 and h1 get one torch thread each, h2 one
thread under a CPU quota. Profiling measures one host at a time; at launch the three stages run at
once on those shared cores, which the prediction does not know.
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

ROOT = Path(__file__).resolve().parent.parent
import on_path  # noqa: E402,F401  (bench/on_path.py: the repository and tests/ on sys.path, bench/ off it)

from bench.common import bench_arguments  # noqa: E402


def hpipe(*args, cwd, check=True):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    t = time.time()
    r = subprocess.run([sys.executable, "-m", "hpipe", *map(str, args)], capture_output=True, text=True, cwd=cwd,
                       env=env, stdin=subprocess.DEVNULL)
    if check and r.returncode != 0:
        raise SystemExit(f"hpipe {' '.join(map(str, args[:2]))} failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    return r, time.time() - t


def fault_run(cluster, plan, prompts, work: Path, fault: str) -> dict:
    from netns_hosts import hpipe_processes, namespace_pids, process_cmdline, set_link

    out = work / f"fault-{fault}.jsonl"
    out.unlink(missing_ok=True)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-m", "hpipe", "launch", str(plan), "--cluster",
                             str(cluster.inventory_path), "--prompts", str(prompts), "--out", str(out),
                             "--max-new-tokens", "64", "--max-batch", "1", "--quiet", "--host-timeout", "5"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=work)
    while not (out.exists() and out.read_text().strip()):
        if proc.poll() is not None:
            raise SystemExit(proc.communicate())
        time.sleep(0.1)
    t = time.time()
    if fault == "kill -9 worker on h1":
        ns = cluster.host("h1").namespace
        pid = next(p for p in namespace_pids(ns) if process_cmdline(p).split(" ")[1:3] == ["-m", "hpipe.runtime.worker"])
        os.kill(pid, signal.SIGKILL)
    elif fault == "link of h2 down":
        set_link(cluster, "h2", up=False)
    else:
        proc.send_signal(signal.SIGINT)
    _, err = proc.communicate()
    exit_s = time.time() - t
    while any(hpipe_processes(h.namespace) for h in cluster.hosts) and time.time() - t < 60:
        time.sleep(0.1)
    clean_s = time.time() - t
    if fault == "link of h2 down":
        set_link(cluster, "h2", up=True)
    return {"fault": fault, "exit_code": proc.returncode, "launcher_exit_s": round(exit_s, 2),
            "all_hpipe_processes_gone_s": round(clean_s, 2),
            "message": next((x for x in err.splitlines() if x.startswith("hpipe: error:")), err[-300:])}


def main() -> None:
    from netns_hosts import HostSpec, start_cluster, stop_cluster, unavailable_reason

    args = bench_arguments(max_seq_len=2048, h2_cpus=0.5, skip_faults=False,
                           faults_only=(False, "re-measure the faults, keep the rest of the JSON"))
    reason = unavailable_reason()
    if reason:
        raise SystemExit(f"emulated hosts unavailable: {reason}")
    report: dict = {"hosts": {"h0": "1 Gbit/s, 1 thread", "h1": "1 Gbit/s, 1 thread",
                              "h2": f"100 Mbit/s, 1 thread, {args.h2_cpus} CPU quota"},
                    "machine_cores": os.cpu_count()}
    out_path = ROOT / "bench" / "results" / "cluster.json"
    if args.faults_only:
        report = json.loads(out_path.read_text())
    with tempfile.TemporaryDirectory(prefix="hpipe-bench-cluster-") as tmp:
        work = Path(tmp)
        cluster = start_cluster(work / "hosts", [HostSpec("h0", 1000), HostSpec("h1", 1000),
                                                 HostSpec("h2", 100, cpus=args.h2_cpus)])
        try:
            inv = cluster.inventory_path
            if not args.faults_only:
                _, report["cluster_check_s"] = hpipe("cluster", "check", inv, "--model", "smollm2", cwd=work)
                r, report["profile_s"] = hpipe("profile", "--cluster", inv, "--quick", "--max-seq-len", args.max_seq_len,
                                               "-o", work / "profile.json", cwd=work)
                prof = json.loads((work / "profile.json").read_text())
                report["links_mbit_s"] = {f"{x['src']}->{x['dst']}": round(x["beta_bytes_per_s"] * 8 / 1e6, 1)
                                          for x in prof["links"]}
                report["fit_error"] = {d["id"]: d["fit_error"] for d in prof["devices"]}
                # the prompt: the demo's document and question, as `hpipe demo` asks it
                data = ROOT / "hpipe" / "data"
                prompt = (f"Read this report and answer the question.\n\n{(data / 'demo_document.md').read_text()}"
                          f"\n\nQuestion: {(data / 'demo_question.txt').read_text().strip()}")
                prompts = work / "prompts.jsonl"
                prompts.write_text(json.dumps({"id": "doc", "prompt": prompt}) + "\n")
                from hpipe import models
                from hpipe.launcher.jobs import encode_prompt
                from hpipe.formats import load_prompts

                tok = models.load_tokenizer(models.resolve_model("smollm2").path)
                n = len(encode_prompt(tok, load_prompts(str(prompts))[0]))
                report["prompt_tokens"] = n
                plan = work / "plan.json"
                r, report["plan_s"] = hpipe("plan", "--model", "smollm2", "--cluster", inv, "--profile",
                                            work / "profile.json", "--seq-len", n, "-o", plan, cwd=work)
                p = json.loads(plan.read_text())
                report["plan"] = {"stages": [{"host": s["host"], "units": s["units"]} for s in p["stages"]],
                                  "slices": p["slicing"], "predicted": p.get("predicted")}
                out = work / "out.jsonl"
                r, report["launch_s"] = hpipe("launch", plan, "--cluster", inv, "--prompts", prompts, "--out", out,
                                              "--max-new-tokens", "16", "--quiet", cwd=work)
                summary = json.loads(Path(f"{out}.summary.json").read_text())
                report["plan_check"] = summary["plan_check"]
                report["answer"] = json.loads(out.read_text().splitlines()[0])["text"]
                report["launch_stdout"] = r.stdout.strip().splitlines()
            if not args.skip_faults:
                inv = cluster.inventory_path
                fault_prompts = work / "fault-prompts.jsonl"
                fault_prompts.write_text("".join(json.dumps({"id": f"f{i}", "prompt": f"Tell me fact number {i} about "
                                                             "pipelines."}) + "\n" for i in range(4)))
                uniform = work / "uniform.json"
                hpipe("plan", "--model", "smollm2", "--cluster", inv, "-o", uniform, cwd=work)
                report["faults"] = [fault_run(cluster, uniform, fault_prompts, work, f)
                                    for f in ("kill -9 worker on h1", "link of h2 down", "SIGINT to the launcher")]
        finally:
            stop_cluster(cluster)
    out_path.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
