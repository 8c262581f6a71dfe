"""Pieces several benchmarks share: a random-init Llama built on the spot (no download),
synthetic prompts as token ids, and `hpipe` run as a child process."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path


def cpu_name() -> str:
    """The CPU's model name, and whether it has AVX-512 (the kernels' build differs)."""
    text = Path("/proc/cpuinfo").read_text()
    name = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), "?")
    return f"{name}, {'AVX-512' if ' avx512f' in text else 'AVX2, no AVX-512' if ' avx2' in text else 'no AVX2'}"


def cpu_flags() -> list[str]:
    """The CPU's vector flags the numbers depend on (AVX, AVX-512, AMX, F16C, FMA)."""
    import re

    line = Path("/proc/cpuinfo").read_text().split("flags", 2)[1].split("\n", 1)[0]
    return sorted(f for f in line.split() if re.match(r"avx|amx|f16c|fma", f))


def kernels_line() -> str:
    from hpipe import cpu_kernels

    return cpu_kernels.kernels()[1]


def prompt_ids(n: int) -> list[int]:
    """A fixed, non-repeating prompt of n token ids (no tokenizer needed)."""
    return [3 + (j * 31) % 30000 for j in range(n)]


def hpipe(*args, cwd: Path, env: dict | None = None) -> str:
    """Run one `hpipe` command in a child process (`env`: its whole environment, else this one's)
    and return what it printed on stdout; its stderr (progress, errors) goes to the benchmark's as
    it comes, so a log shows where a long run was when it was stopped. Its failure ends the benchmark."""
    done = subprocess.run([sys.executable, "-m", "hpipe", *map(str, args)], cwd=cwd, env=env,
                          stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
    if done.returncode:
        raise SystemExit(f"hpipe {' '.join(map(str, args[:2]))} failed (exit {done.returncode}; its stderr is above)")
    return done.stdout


def three_hosts(tag: str) -> tuple[object, Path]:
    """3 emulated hosts (tests/netns_hosts.py: network namespaces with real sshd, 1 Gbit/s links)
    and a new work folder, $TMPDIR/hpipe-TAG-PID, their files in it; the benchmark ends with the
    reason where they cannot run."""
    from netns_hosts import HostSpec, start_cluster, unavailable_reason

    reason = unavailable_reason()
    if reason:
        raise SystemExit(f"emulated hosts: {reason}")
    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"hpipe-{tag}-{os.getpid()}"
    work.mkdir(parents=True)
    return start_cluster(work / "hosts", [HostSpec(f"h{i}", rate_mbit=1000) for i in range(3)]), work


def plan_on_hosts(cluster, work: Path, env: dict, name: str = "plan.json") -> Path:
    """The default model planned over the emulated hosts (tests/netns_hosts.py) from the measured
    one-thread profile put on each (`elastic_profile`), for 64-token prompts: a plan with predictions."""
    from netns_hosts import elastic_profile

    profile = elastic_profile([h.spec.name for h in cluster.hosts], work / "profile.json")
    hpipe("plan", "--model", "smollm2", "--cluster", cluster.inventory_path, "--profile", profile, "--seq-len", "64",
          "-o", work / name, cwd=work, env=env)
    return work / name


def launch_checked(plan: Path, prompts: Path, work: Path, tag: str, new_tokens: int, where: list,
                   env: dict | None = None) -> tuple[dict, dict, str]:
    """One `hpipe launch` of a plan on a one-prompt file with a timeline: the prompt's result, the
    run summary's check against the plan (`plan_check`), and what the launch printed."""
    out, timeline = work / f"r-{tag}.jsonl", work / f"t-{tag}.json"
    out.unlink(missing_ok=True)
    stdout = hpipe("launch", plan, *where, "--prompts", prompts, "--out", out, "--max-new-tokens", new_tokens,
                   "--timeline-out", timeline, cwd=work, env=env)
    summary = json.loads(Path(f"{out}.summary.json").read_text())
    return json.loads(out.read_text().splitlines()[0]), summary.get("plan_check") or {}, stdout


def random_llama(directory: Path, vocab: int, hidden: int = 1024, layers: int = 8, mlp: int | None = None,
                 heads: tuple[int, int] = (16, 4), dtype: str = "float32") -> Path:
    """A random-init Llama (GQA heads: query, key/value) saved as a Hugging Face directory."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=hidden, intermediate_size=mlp or int(hidden * 2.75), num_hidden_layers=layers,
                         num_attention_heads=heads[0], num_key_value_heads=heads[1], vocab_size=vocab,
                         max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype)).save_pretrained(directory)
    return directory


def token_prompts(path: Path, n: int, length: int = 64, vocab: int = 30003) -> Path:
    """n prompts of `length` deterministic token ids each (3 <= id < min(vocab, 30,003))."""
    span = min(vocab, 30003) - 3
    path.write_text("".join(json.dumps({"id": f"p{i}", "input_ids": [3 + (i * 7919 + j * 31) % span
                                                                     for j in range(length)]}) + "\n"
                            for i in range(n)))
    return path


def fetch_figures(summary: dict, wall_s: float) -> dict:
    """Per replica of a grouped run: steps per mode, the housekeeper's fetch time per WaS step
    against the mean step (the wall over the steps with work), the forward's waits for a slot."""
    out = []
    for r in summary["replicas"]:
        s = r.get("sidp")
        if not s:
            continue
        steps = sum(s["steps"].values())
        was = s["steps"]["was"]
        out.append({"steps": s["steps"], "step_ms": round(1e3 * wall_s / max(steps, 1), 2),
                    "fetch_ms_per_was_step": round(1e3 * s["was"]["fetch_s"] / max(was, 1), 2),
                    "slot_wait_ms_per_was_step": round(1e3 * s["was"]["wait_s"] / max(was, 1), 2),
                    "cas_rows_sent": s["cas"]["rows_sent"], "cas_rows_served": s["cas"]["rows_served"]})
    return {"group": out} if out else {}


def bench_parser(description: str | None = None, **options) -> argparse.ArgumentParser:
    """A bench's command line from its options' defaults, one way for every bench: `name=default` is
    `--name` (underscores as dashes) of the default's type (`None`: a string), `False` a switch;
    `name=(default, "help")` the same with its help. The caller adds what this does not cover."""
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, value in options.items():
        default, help_text = value if isinstance(value, tuple) else (value, None)
        flag = "--" + name.replace("_", "-")
        if default is False:
            ap.add_argument(flag, action="store_true", help=help_text)
        else:
            ap.add_argument(flag, type=str if default is None else type(default), default=default, help=help_text)
    return ap


def bench_arguments(description: str | None = None, **options) -> argparse.Namespace:
    """`bench_parser(...)`'s arguments, parsed."""
    return bench_parser(description, **options).parse_args()


def results_path(name: str) -> str:
    """Where a bench writes its JSON unless told otherwise: bench/results/NAME.json."""
    return str(Path(__file__).resolve().parent / "results" / f"{name}.json")
