"""What the live page of `hpipe serve` costs the server, and what it looks like.

    python bench/dashboard.py [--rounds 4] [--chats 8] [--max-tokens 64] [--hosts]
                              [-o bench/results/dashboard.json]

On 2 local stages of the default model: rounds of 8 streaming chats at once, alternately with the
page open in a headless Chromium (Playwright, polling /hpipe/state every second) and without it;
the server's output tokens/s of each round, and their ratio (page open / closed) in one run. The
browser runs on this machine too (a user's would run on theirs): its rendering shares the cores
with the stages, so the ratio is an upper bound of the cost. Screenshots: idle and under load.
With --hosts: 3 emulated hosts (tests/netns_hosts.py), one host's stage worker SIGKILLed under
load, and a screenshot after the event row. The screenshots land beside the JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
import on_path  # noqa: E402,F401  (bench/on_path.py: the repository and tests/ on sys.path)

from browser import browser, open_page, wait_until  # noqa: E402  (tests/browser.py)
from bench.common import cpu_flags, cpu_name, plan_on_hosts, three_hosts  # noqa: E402

QUESTIONS = ["What is the capital of France?", "Name three colours.", "Count from one to ten.", "What is 2 + 2?",
             "Tell me about the sea.", "Why is the sky blue?", "Name a large animal.", "What is a pipeline?"]


def serve(plan: Path, log: Path, env: dict, *where: str) -> tuple[subprocess.Popen, str]:
    from hpipe.net import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "hpipe", "serve", str(plan), *where, "--port", str(port),
                             "--max-model-len", "512", "--kv-pages", "128", "--max-batch", "12", "--compile", "off"],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                            start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while not healthy(base):
        if proc.poll() is not None or time.time() > deadline:
            raise SystemExit("the server did not start: " + log.read_text()[-2000:])
        time.sleep(0.5)
    return proc, base


def healthy(base: str) -> bool:
    import urllib.request
    try:
        with urllib.request.urlopen(base + "/health", timeout=5) as r:
            return r.status == 200
    except OSError:
        return False


def chats(base: str, n: int, max_tokens: int, during=None) -> dict:
    """n streaming greedy chats at once; the output tokens and the seconds from the first request
    to the last token."""
    import openai

    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=600)
    counts, errors = [0] * n, []

    def one(i: int) -> None:
        try:
            for ev in client.chat.completions.create(
                    model="smollm2", messages=[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
                    max_tokens=max_tokens, temperature=0, stream=True, stream_options={"include_usage": True},
                    extra_body={"ignore_eos": True}):
                if ev.usage is not None:
                    counts[i] = ev.usage.completion_tokens
        except Exception as e:  # noqa: BLE001 - what a client saw
            errors.append(repr(e)[:300])

    t0 = time.time()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    if during is not None:
        during()
    for t in threads:
        t.join()
    wall = time.time() - t0
    return {"tokens": sum(counts), "wall_s": round(wall, 3), "tokens_per_s": round(sum(counts) / wall, 2),
            "errors": errors}


def overhead(args, work: Path, env: dict, out_dir: Path) -> dict:
    plan = work / "plan.json"
    subprocess.run([sys.executable, "-m", "hpipe", "plan", "--model", "smollm2", "--stages", "2", "-o", str(plan)],
                   check=True, env=env, capture_output=True)
    proc, base = serve(plan, work / "serve.log", env, "--local")
    rounds = []
    try:
        with browser() as b:
            chats(base, args.chats, 8)                                   # the first requests' costs go here
            page = open_page(b, base, None)
            page.screenshot(path=str(out_dir / "dashboard-idle.png"), full_page=True)
            page.close()
            for r in range(2 * args.rounds):
                opened = r % 2 == 1
                page = open_page(b, base, None) if opened else None
                shot = (lambda: (time.sleep(6), page.screenshot(path=str(out_dir / "dashboard-load.png"),
                                                                full_page=True))) if opened and r == 1 else None
                result = chats(base, args.chats, args.max_tokens, during=shot)
                rounds.append({"page_open": opened, **result})
                print(f"round {r}: page {'open' if opened else 'closed'}: {result['tokens_per_s']} tokens/s",
                      flush=True)
                if page is not None:
                    page.close()
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    closed = [x["tokens_per_s"] for x in rounds if not x["page_open"]]
    opened = [x["tokens_per_s"] for x in rounds if x["page_open"]]
    pairs = [o / c for c, o in zip(closed, opened)]           # each open round over the closed one before it
    return {"rounds": rounds, "closed_tokens_per_s": sum(closed) / len(closed),
            "open_tokens_per_s": sum(opened) / len(opened),
            "ratio_open_to_closed": round(sum(opened) / len(opened) / (sum(closed) / len(closed)), 4),
            "pair_ratios": [round(r, 4) for r in pairs], "median_pair_ratio": round(statistics.median(pairs), 4)}


def lost_host(args, work: Path, env: dict, out_dir: Path) -> dict:
    from netns_hosts import namespace_pids, process_cmdline, stop_cluster

    cluster, hosts_work = three_hosts("dashboard")
    proc = None
    try:
        plan = plan_on_hosts(cluster, hosts_work, env, "hosts-plan.json")
        proc, base = serve(plan, work / "hosts-serve.log", env, "--cluster",
                           str(cluster.inventory_path), "--heartbeat-timeout", "3")
        with browser() as b:
            page = open_page(b, base, None)

            def kill() -> None:
                time.sleep(4)
                ns = cluster.host("h1").namespace
                os.kill(next(pid for pid in namespace_pids(ns)
                             if process_cmdline(pid).split(" ")[1:3] == ["-m", "hpipe.runtime.worker"]), signal.SIGKILL)

            result = chats(base, args.chats, args.max_tokens, during=kill)
            wait_until(page, "document.querySelector(\"#events tr[data-kind='lost']\") !== null", 120)
            time.sleep(2)
            page.screenshot(path=str(out_dir / "dashboard-lost-host.png"), full_page=True)
            events = page.inner_text("#events")
        return {"chats": result, "events_shown": events}
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=60)
        stop_cluster(cluster)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=4, help="rounds with the page open (and as many without)")
    ap.add_argument("--chats", type=int, default=8, help="streaming chats at once")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--hosts", action="store_true", help="also: a lost host on 3 emulated hosts, its screenshot")
    ap.add_argument("-o", "--out", default=str(ROOT / "bench" / "results" / "dashboard.json"))
    args = ap.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"hpipe-dashboard-{os.getpid()}"
    work.mkdir(parents=True)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    result = {"date": time.strftime("%Y-%m-%d"), "cpu": cpu_name(), "cpu_flags": cpu_flags(), "chats": args.chats, "max_tokens": args.max_tokens,
              "overhead": overhead(args, work, env, out.parent)}
    print(f"output tokens/s with the page open / closed: {result['overhead']['ratio_open_to_closed']:.3f} "
          f"(median of the pairs {result['overhead']['median_pair_ratio']:.3f})")
    if args.hosts:
        result["lost_host"] = lost_host(args, work, env, out.parent)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
