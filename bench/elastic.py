"""A host lost and taken back while serving: output tokens/s over time on 3 emulated hosts
(tests/netns_hosts.py: network namespaces with real sshd, one thread each), through a SIGKILL of one
host's stage worker and its return, with the time of each phase of both events (notice, re-plan,
start, re-prefill) as the server measured them (`GET /hpipe/events`).

    python bench/elastic.py [--clients 6] [--kill-at 20] [--after 25] [--llama-cpp /opt/llama.cpp/build/bin]
                            [-o bench/results/elastic.json]

Writes the JSON (per-second output tokens, the events, every stream's errors: none expected) and a
PNG beside it. With --llama-cpp (a build with `ggml-rpc-server` and `llama-bench`:
../shared/notes/peers.md), the peer users would pick goes through the same event on the same
hosts: its RPC split of the same GGUF file over h1 and h2, decoding, one rpc-server killed; what
its client does is recorded beside ours (`peer`). The model is the default one with dense float32 weights, planned from the measured
one-thread profile put on the three hosts (`netns_hosts.elastic_profile`)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
import on_path  # noqa: E402,F401  (bench/on_path.py: the repository and tests/ on sys.path, bench/ off it)

from bench.common import plan_on_hosts, three_hosts  # noqa: E402

QUESTIONS = ["What is the capital of France?", "Name three colours.", "Count from one to ten.",
             "Tell me about the sea.", "What is 2 + 2?", "Why is the sky blue?"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=6, help="streams kept open at once, each asking again when done")
    ap.add_argument("--kill-at", type=float, default=20.0, help="seconds into the load when h1's worker is killed")
    ap.add_argument("--after", type=float, default=25.0, help="seconds of load after h1 is back in the pipeline")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--llama-cpp", default=None, help="a llama.cpp build's bin/ (ggml-rpc-server, llama-bench)")
    ap.add_argument("-o", "--out", default=str(ROOT / "bench" / "results" / "elastic.json"))
    args = ap.parse_args()

    import openai

    from hpipe.net import free_port
    from netns_hosts import namespace_pids, process_cmdline, stop_cluster

    cluster, work = three_hosts("elastic")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = None
    try:
        plan_on_hosts(cluster, work, env)
        port = free_port()
        log = open(work / "serve.log", "w")
        proc = subprocess.Popen([sys.executable, "-m", "hpipe", "serve", str(work / "plan.json"), "--cluster",
                                 str(cluster.inventory_path), "--port", str(port), "--max-model-len", "512",
                                 "--kv-pages", "128", "--max-batch", "12", "--heartbeat-timeout", "3"],
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True)
        base = f"http://127.0.0.1:{port}"
        deadline = time.time() + 300
        while True:
            if _get(base + "/health")[0] == 200:
                break
            if proc.poll() is not None or time.time() > deadline:
                raise SystemExit("the server did not start: " + (work / "serve.log").read_text()[-2000:])
            time.sleep(0.5)
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=600)
        arrivals: list[float] = []
        errors: list[str] = []
        stop = threading.Event()
        lock = threading.Lock()

        def stream(i: int) -> None:
            n = 0
            while not stop.is_set():
                try:
                    for ev in client.chat.completions.create(
                            model="smollm2", messages=[{"role": "user", "content": QUESTIONS[(i + n) % len(QUESTIONS)]}],
                            max_tokens=args.max_tokens, temperature=0, stream=True, extra_body={"ignore_eos": True}):
                        if ev.choices and ev.choices[0].delta.content:
                            with lock:
                                arrivals.append(time.time())
                except Exception as e:  # noqa: BLE001 - what a client saw
                    errors.append(repr(e)[:300])
                n += 1

        t0 = time.time()
        threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(args.clients)]
        for t in threads:
            t.start()
        time.sleep(args.kill_at)
        ns = cluster.host("h1").namespace
        victim = next(pid for pid in namespace_pids(ns)
                      if process_cmdline(pid).split(" ")[1:3] == ["-m", "hpipe.runtime.worker"])
        t_kill = time.time()
        os.kill(victim, signal.SIGKILL)

        def events() -> dict:
            return json.loads(_get(base + "/hpipe/events")[1])

        deadline = time.time() + 300
        while sum(e["kind"] == "rejoined" for e in events()["events"]) < 1:
            if time.time() > deadline:
                raise SystemExit("h1 was not taken back: " + (work / "serve.log").read_text()[-3000:])
            time.sleep(0.5)
        t_back = time.time()
        time.sleep(args.after)
        stop.set()
        for t in threads:
            t.join(timeout=120)
        t_end = time.time()
        seen = events()
        peer = _llama_cpp_kill(cluster, Path(args.llama_cpp), args.kill_at) if args.llama_cpp else None
    finally:
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        stop_cluster(cluster)

    seconds = int(t_end - t0) + 1
    per_s = [0] * seconds
    for t in arrivals:
        per_s[min(seconds - 1, int(t - t0))] += 1
    out = {"version": 1, "device": "this machine: 2 CPU cores shared by 3 emulated hosts, one thread each",
           "clients": args.clients, "max_tokens": args.max_tokens, "kill_at_s": round(t_kill - t0, 3),
           "rejoined_at_s": round(t_back - t0, 3), "tokens_per_s": per_s, "events": seen["events"],
           "stages_at_end": seen["stages"], "client_errors": errors, "peer": peer,
           "steady_tokens_per_s": {"before": _mean(per_s[3:int(t_kill - t0)]),
                                   "after_rejoin": _mean(per_s[int(t_back - t0) + 3:-2])},
           "seconds_without_tokens": sum(1 for x in per_s[int(t_kill - t0):int(t_back - t0) + 3] if x == 0)}
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    _chart(out, Path(args.out).with_suffix(".png"))
    print(json.dumps({k: v for k, v in out.items() if k != "tokens_per_s"}, indent=2))


def _llama_cpp_kill(cluster, bin_dir: Path, kill_at: float) -> dict:
    """llama.cpp's RPC split through the same event: rpc-servers on h1 and h2, its client (llama-bench,
    decoding 4,096 tokens of the default model's GGUF file) on h0, the rpc-server on h1 killed after
    `kill_at` s. Returns what the client did: its exit, when, and its last lines."""
    from hpipe import models
    gguf = models.resolve_model("smollm2").location         # the GGUF file hpipe's own weights come from
    servers = {}
    for name in ("h1", "h2"):
        h = cluster.host(name)
        servers[name] = subprocess.Popen(["ip", "netns", "exec", h.namespace, str(bin_dir / "ggml-rpc-server"), "-H",
                                          h.address, "-p", "50052", "-t", "1"], stdout=subprocess.DEVNULL,
                                         stderr=subprocess.DEVNULL, start_new_session=True)
    time.sleep(2)
    rpc = ",".join(f"{cluster.host(n).address}:50052" for n in ("h1", "h2"))
    client = subprocess.Popen(["ip", "netns", "exec", cluster.host("h0").namespace, str(bin_dir / "llama-bench"), "-m",
                               str(gguf), "--rpc", rpc, "-ngl", "99", "-ts", "1/1", "-t", "1", "-p", "0", "-n", "4096",
                               "-r", "1"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True)
    try:
        time.sleep(kill_at)
        running = client.poll() is None
        t_kill = time.time()
        servers["h1"].kill()
        try:
            out, _ = client.communicate(timeout=120)
            code, after = client.returncode, round(time.time() - t_kill, 2)
        except subprocess.TimeoutExpired:
            os.killpg(client.pid, signal.SIGKILL)
            out, _ = client.communicate()
            code, after = None, None
    finally:
        for p in servers.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    return {"what": "llama.cpp RPC split (llama-bench decoding on h0; rpc-servers on h1 and h2, one thread each), "
                    "the rpc-server on h1 SIGKILLed", "decoding_when_killed": running,
            "client_exit_code": code, "client_ended_s_after_kill": after,
            "client_hung_120_s": code is None,
            "error_lines": [line for line in out.splitlines()
                            if any(k in line.lower() for k in ("error", "assert", "failed", "abort", "crash"))][:6]}


def _get(url: str) -> tuple[int, str]:
    import urllib.error
    import urllib.request
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError:
        return 0, "{}"


def _mean(xs: list[int]) -> float | None:
    return round(sum(xs) / len(xs), 2) if xs else None


def _chart(out: dict, path: Path) -> None:
    from hpipe.planner import pyplot

    plt = pyplot("bench/elastic.py", (".json",))
    fig, ax = plt.subplots(figsize=(9, 3.6))
    ax.plot(range(len(out["tokens_per_s"])), out["tokens_per_s"], lw=1.2, color="#333333")
    ax.axvline(out["kill_at_s"], color="#c0392b", ls="--", lw=1)
    ax.text(out["kill_at_s"], ax.get_ylim()[1] * 0.95, " h1's worker killed", color="#c0392b", fontsize=8, va="top")
    t_kill = out["kill_at_s"]
    for e in out["events"]:
        ph = e["phases"]
        start = t_kill if e["kind"] == "lost" else out["rejoined_at_s"] - ph.get("start", 0) - ph.get("reprefill", 0)
        x = start
        for name, colour in (("notice", "#e67e22"), ("replan", "#8e44ad"), ("start", "#2980b9"),
                             ("reprefill", "#27ae60")):
            if name in ph:
                ax.axvspan(x, x + ph[name], color=colour, alpha=0.25, lw=0,
                           label=name if e is out["events"][0] else None)
                x += ph[name]
    ax.axvline(out["rejoined_at_s"], color="#27ae60", ls="--", lw=1)
    ax.text(out["rejoined_at_s"], ax.get_ylim()[1] * 0.85, " h1 back in", color="#27ae60", fontsize=8, va="top")
    ax.set_xlabel("seconds")
    ax.set_ylabel("output tokens/s (all streams)")
    ax.set_title(f"hpipe serve on 3 emulated hosts, {out['clients']} streams: a lost host and its return")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
