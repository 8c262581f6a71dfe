"""Where one decode token's time goes through a pipeline of stages, and llama.cpp's RPC split beside it.

hpipe: `hpipe launch --local` of the plan `hpipe plan --stages N` makes (its own slicing of a long
prompt: 2 x stages slices, pipelined through the stages; default flags, after `hpipe warmup
--plan`; the local launcher gives each stage one thread on this 2-core machine, as emulated hosts
get), one stream, a 256-token
prompt and 128 greedy tokens, `--timeline-out`. From the timeline, per decode token (the median over
the steady tokens): each stage's compute, each hop (a stage's compute end to the next stage's
compute start: the send, the receive, the next stage's wait and preparation), and the way back
(the last stage's compute end to stage 0's next compute start: sampling, the ids' trip to stage 0,
the scheduler's commit). Their sum is the token; nothing else is on the path. Then a 2,048-token
prefill (time to first token).

llama.cpp: `llama-bench` (decode after a 256-token context, and 2,048-token prefill) on the same
file, one thread, its blocks split evenly over this process and --stages - 1 `ggml-rpc-server`
processes of one thread each on 127.0.0.1 (`-ngl` the servers' share of the blocks, `-ts 1/1`; see
../shared/notes/peers.md; $LLAMA_CPP_BIN).

The two go in --rounds rounds (3), alternated (each round the other goes first: this machine is
shared and its speed drifts by a third within minutes); the report gives each one's median and the
median of the rounds' ratios, every round beside them, and the timeline of hpipe's median round.

Both run on one machine without shaped links; the per-token figures are the runtime's own costs.
`--hosts`: the same on 3 emulated hosts instead (tests/netns_hosts.py: network namespaces with real
sshd, 1 Gbit/s `tc tbf` links, one thread each): hpipe plans, warms (`hpipe warmup --cluster
--plan`) and launches over SSH (`--cluster`), llama.cpp's rpc servers run in hosts 1 and 2's
namespaces and `llama-bench` in host 0's, its blocks split as on one machine. Needs root and
openssh-server.

    python bench/trip.py [--stages 3] [--model smollm2] [--extra "--compile on"] [--rounds 3] [--hosts]

Writes bench/results/trip.json (or --out).
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import on_path  # noqa: E402,F401  (bench/on_path.py: the repository and tests/ on sys.path, bench/ off it)

from bench.common import bench_arguments, cpu_name, hpipe, kernels_line, prompt_ids, results_path, three_hosts  # noqa: E402
from hpipe.net import free_port  # noqa: E402

PROMPT, NEW, PREFILL = 256, 128, 2048




def per_token(timeline: dict) -> dict:
    """Medians over the steady decode tokens (ms): compute per stage, hops, the way back (sampling,
    the ids to stage 0, the commit), the token: the run summary's own reading of a timeline."""
    from hpipe.launcher import decode_terms

    return {k: round(1000 * v, 3) for k, v in decode_terms(timeline["stages"]).items()}


def prepare_hpipe(model: str, stages: int, extra: list[str], work: Path, cluster=None) -> tuple[Path, dict]:
    """The plan as `hpipe plan` makes it (a 2,048-token prompt in 2 x stages slices: one slice
    left each stage idle while the others computed, 15.9-16.2 s against 9.0-9.2 for the 1B shape's
    prefill over 2 stages), and with default flags `hpipe warmup --plan` (the plan's stages at the
    threads the launch gives them; on emulated hosts, every host's at once over SSH)."""
    plan = work / "plan.json"
    hosts = ["--cluster", cluster.inventory_path] if cluster else []
    hpipe("plan", "--model", model, *(hosts or ["--stages", stages]), "-o", plan, cwd=work)
    out = {}
    if "--compile" not in extra:
        t = time.time()
        hpipe("warmup", *hosts, "--plan", plan, cwd=work)
        out["warmup_s"] = round(time.time() - t, 1)
    return plan, out


def hpipe_run(plan: Path, name: str, extra: list[str], work: Path) -> dict:
    """One `hpipe launch` (`extra`: --local or --cluster FILE, and the flags asked): "decode" (a
    256-token prompt, 128 tokens: TPOT and the per-token timeline) or "prefill" (2,048 tokens: time
    to first token)."""
    n, new = (PROMPT, NEW) if name == "decode" else (PREFILL, 1)
    prompts, results, tl = work / f"{name}.jsonl", work / f"{name}-out.jsonl", work / f"{name}-timeline.json"
    prompts.write_text(json.dumps({"id": name, "input_ids": prompt_ids(n)}) + "\n")
    results.unlink(missing_ok=True)
    t = time.time()
    hpipe("launch", plan, "--prompts", prompts, "--out", results, "--max-new-tokens", new, "--quiet",
          "--timeline-out", tl, *extra, cwd=work)
    r = json.loads(results.read_text().splitlines()[0])
    if name == "decode":
        return {"decode_ms": round(1000 * r["tpot_s"], 3), "start_to_end_s": round(time.time() - t, 2),
                "per_token_ms": per_token(json.loads(tl.read_text()))}
    return {"prefill_s": round(r["ttft_s"], 3)}


def block_count(path: Path) -> int:
    import gguf

    fields = gguf.GGUFReader(str(path)).fields
    key = next(k for k in fields if k.endswith(".block_count"))
    return int(fields[key].parts[-1][0])


class LlamaRpc:
    """llama.cpp's RPC split: --stages - 1 `ggml-rpc-server` processes of one thread, started once,
    on this machine's loopback or (`cluster`) in the emulated hosts 1.. with `llama-bench` in host
    0's namespace; `run(name)` is one `llama-bench` of decode or prefill through them."""

    def __init__(self, path: Path, stages: int, cluster=None):
        from bench.shapes import llama_cpp_bin

        if cluster is None:
            servers = [([], "127.0.0.1", free_port()) for _ in range(stages - 1)]
            here = []
        else:
            inside = lambda host: ["ip", "netns", "exec", host.namespace]   # noqa: E731
            servers = [(inside(h), h.address, 50052) for h in cluster.hosts[1:stages]]
            here = inside(cluster.hosts[0])
        self.servers = [subprocess.Popen([*ns, str(llama_cpp_bin("ggml-rpc-server")), "-H", addr, "-p", str(port),
                                          "-t", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                        for ns, addr, port in servers]
        time.sleep(1.0)
        blocks = block_count(path)
        offloaded = round(blocks * (stages - 1) / stages)      # the rest stay in this process
        split = "/".join(["1"] * (stages - 1))
        # the model, the thread and the split, as every llama.cpp tool takes them (bench/batch.py too)
        self.split_args = ["-m", str(path), "-t", "1", "-ngl", str(offloaded), "-ts", split,
                           "--rpc", ",".join(f"{addr}:{port}" for _, addr, port in servers)]
        self.cmd = [*here, str(llama_cpp_bin("llama-bench")), *self.split_args, "-o", "json", "-r", "1"]
        self.split = (f"-ngl {offloaded} -ts {split}: {blocks - offloaded} blocks in "
                      f"{'host 0' if cluster else 'this process'}, {offloaded} on {stages - 1} rpc servers"
                      f"{' (hosts 1..)' if cluster else ''}, one thread each")

    def run(self, name: str) -> dict:
        size = ["-p", "0", "-n", str(NEW), "-d", str(PROMPT)] if name == "decode" else ["-p", str(PREFILL), "-n", "0"]
        ts = json.loads(subprocess.run(self.cmd + size, check=True, capture_output=True, text=True).stdout)[0]["avg_ts"]
        return {"decode_ms": round(1000 / ts, 3)} if name == "decode" else {"prefill_s": round(PREFILL / ts, 3)}

    def close(self) -> None:
        for s in self.servers:
            s.terminate()
            s.wait()


def main() -> None:
    from hpipe import models

    args = bench_arguments(stages=3, model="smollm2", extra=("", "more `hpipe launch` flags, e.g. \"--compile on\""),
                           rounds=(3, "rounds of the two, alternated (this machine is shared)"),
                           hosts=(False, "on 3 emulated hosts over SSH (network namespaces, 1 Gbit/s links)"),
                           out=results_path("trip"))
    path = models.smollm2_gguf_path() if args.model == "smollm2" else Path(args.model)
    rounds = []
    with contextlib.ExitStack() as stack:
        cluster = None
        if args.hosts:
            from netns_hosts import stop_cluster

            cluster, tmp = three_hosts("trip")            # its files in a folder of its own, kept
            stack.callback(stop_cluster, cluster)
            args.stages = len(cluster.hosts)
        else:
            tmp = stack.enter_context(tempfile.TemporaryDirectory())
        where = ["--cluster", str(cluster.inventory_path)] if cluster else ["--local"]
        extra = [*where, *shlex.split(args.extra)]
        plan, ours = prepare_hpipe(args.model, args.stages, extra, Path(tmp), cluster)
        theirs = LlamaRpc(path, args.stages, cluster)
        try:
            for r in range(args.rounds):
                row = {}
                order = ("hpipe", "llama.cpp") if r % 2 == 0 else ("llama.cpp", "hpipe")
                for name in ("decode", "prefill"):
                    for who in order:
                        got = hpipe_run(plan, name, extra, Path(tmp)) if who == "hpipe" else theirs.run(name)
                        row.setdefault(who, {}).update(got)
                rounds.append(row)
                print(json.dumps(row), flush=True)
        finally:
            theirs.close()

    def median_of(who: str, key: str) -> float:
        return statistics.median(row[who][key] for row in rounds)

    def ratio(key: str) -> float:
        return round(statistics.median(row["hpipe"][key] / row["llama.cpp"][key] for row in rounds), 3)

    typical = sorted(rounds, key=lambda row: row["hpipe"]["decode_ms"])[len(rounds) // 2]["hpipe"]
    ours.update(decode_ms=median_of("hpipe", "decode_ms"), prefill_s=median_of("hpipe", "prefill_s"),
                per_token_ms=typical["per_token_ms"], start_to_end_s=typical["start_to_end_s"])
    report = {"date": time.strftime("%Y-%m-%d"), "machine_cores": os.cpu_count(), "cpu": cpu_name(),
              "kernels": kernels_line(), "file": path.name,
              "stages": args.stages, "where": "3 emulated hosts over SSH, 1 Gbit/s links" if args.hosts
              else "one machine's loopback", "prompt": PROMPT, "new_tokens": NEW, "prefill_tokens": PREFILL,
              "hpipe_flags": args.extra or "(defaults)", "hpipe": ours,
              "llama.cpp rpc": {"decode_ms": median_of("llama.cpp", "decode_ms"),
                                "prefill_s": median_of("llama.cpp", "prefill_s"), "split": theirs.split},
              "decode_vs_llama_cpp": ratio("decode_ms"), "prefill_vs_llama_cpp": ratio("prefill_s"),
              "rounds": rounds}
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
