"""The distributed runtime (one process per stage, torch.distributed gloo point-to-point),
started by `hpipe launch --local`, against one single-process transformers forward."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import FAMILIES, VOCAB, assert_greedy_equal, cold_host_cache, reference_greedy, reference_logits
from hpipe import models
from hpipe.cli import main
from hpipe.launcher.local import threads_per_stage

pytestmark = pytest.mark.slow

NEW_TOKENS = 16


def write_prompts(path, prompts):
    path.write_text("".join(json.dumps({"id": f"p{i}", "input_ids": p}) + "\n" for i, p in enumerate(prompts)))


def read_results(path):
    return {r["id"]: r for r in map(json.loads, path.read_text().splitlines())}


@pytest.mark.parametrize("family", FAMILIES)
def test_random_plan_multiprocess_matches_transformers(family, tiny_models, reference_models, tmp_path, capfd):
    rng = random.Random(f"launch-{family}")
    path = tiny_models[family]
    n_units = models.num_units(models.load_config(path))
    n_stages = rng.choice([2, 3, 4])
    cuts = sorted(rng.sample(range(1, n_units), n_stages - 1))
    slices = [rng.randint(3, 30) for _ in range(rng.randint(1, 4))]
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 70))] for _ in range(rng.randint(2, 5))]
    plan, prompts_file, out, logits = (tmp_path / n for n in ("plan.json", "prompts.jsonl", "out.jsonl", "l.npz"))
    write_prompts(prompts_file, prompts)
    assert main(["plan", "--kv-dtype", "float32", "--model", str(path), "--stages", str(n_stages), "--cuts", ",".join(map(str, cuts)),
                 "--slices", ",".join(map(str, slices)), "-o", str(plan)]) == 0
    assert main(["launch", str(plan), "--local", "--prompts", str(prompts_file), "--out", str(out),
                 "--max-new-tokens", str(NEW_TOKENS), "--logits-out", str(logits), "--max-batch", "3",
                 "--quiet"]) == 0
    # not a terminal: the progress (launcher/progress.py) in plain lines, the last at the end
    last = [x for x in capfd.readouterr().err.splitlines() if re.match(r"hpipe: \d+/\d+ prompts", x)][-1]
    assert re.match(rf"hpipe: {len(prompts)}/{len(prompts)} prompts, .* ETA 0s; stages busy "
                    rf"\d+%(, \d+%){{{n_stages - 1}}}$", last), last      # every stage's last pulse came
    results = read_results(out)
    saved = np.load(logits)
    ref_model = reference_models[family]
    for i, p in enumerate(prompts):
        r = results[f"p{i}"]
        assert r["ttft_s"] > 0 and r["tpot_s"] >= 0 and r["prompt_tokens"] == len(p)
        ref = reference_logits(ref_model, p, r["output_ids"])
        got = torch.from_numpy(saved[f"p{i}"])
        assert got.shape == ref.shape
        assert float((got - ref).abs().max()) < 1e-4, f"plan cuts {cuts}, slices {slices}"
        assert_greedy_equal(ref_model, p, r["output_ids"], reference_greedy(ref_model, p, NEW_TOKENS, 2))


def test_temperature_sampling_is_seeded(tiny_models, tmp_path):
    path = tiny_models["llama"]
    prompts_file = tmp_path / "p.jsonl"
    write_prompts(prompts_file, [[5, 6, 7, 8], [9, 10, 11]])
    runs = []
    for name, stages, seed in (("a", 2, 7), ("b", 3, 7), ("c", 2, 8)):
        plan, out = tmp_path / f"{name}.json", tmp_path / f"{name}.jsonl"
        assert main(["plan", "--kv-dtype", "float32", "--model", str(path), "--stages", str(stages), "-o", str(plan)]) == 0
        assert main(["launch", str(plan), "--local", "--prompts", str(prompts_file), "--out", str(out),
                     "--max-new-tokens", "12", "--temperature", "1.5", "--seed", str(seed), "--quiet"]) == 0
        runs.append({k: v["output_ids"] for k, v in read_results(out).items()})
    assert runs[0] == runs[1], "same seed, different plan: the same tokens"
    assert runs[0] != runs[2], "another seed: other tokens"


@pytest.mark.parametrize("sampling_args,procs", [
    (["--temperature", "0"], "1"),
    (["--temperature", "0.9", "--top-k", "20", "--top-p", "0.9", "--min-p", "0.02", "--repetition-penalty", "1.3",
      "--frequency-penalty", "0.5", "--presence-penalty", "0.3", "--seed", "11"], "2"),
])
def test_sampler_pool_gives_the_tokens_of_inline_sampling(sampling_args, procs, tiny_models, tmp_path):
    """--sampling cpu (a pool of sampler processes fed through the shared-memory ring) against the
    last stage sampling inline: the same tokens, greedy and seeded with every penalty."""
    path = tiny_models["llama"]
    rng = random.Random(5)
    prompts_file = tmp_path / "p.jsonl"
    write_prompts(prompts_file, [[rng.randrange(3, VOCAB) for _ in range(rng.randint(2, 30))] for _ in range(6)])
    plan = tmp_path / "plan.json"
    assert main(["plan", "--kv-dtype", "float32", "--model", str(path), "--stages", "2", "--slices", "8", "-o", str(plan)]) == 0
    runs = {}
    for name, extra in (("inline", ["--sampling", "inline"]), ("pool", ["--sampling", "cpu", "--sampler-procs", procs])):
        out = tmp_path / f"{name}.jsonl"
        assert main(["launch", str(plan), "--local", "--prompts", str(prompts_file), "--out", str(out),
                     "--max-new-tokens", "14", "--max-batch", "4", "--quiet", *sampling_args, *extra]) == 0
        runs[name] = {k: v["output_ids"] for k, v in read_results(out).items()}
    assert len(runs["inline"]) == 6
    assert runs["pool"] == runs["inline"]


def test_per_prompt_sampling_overrides(tiny_models, reference_models, tmp_path):
    """A prompt's own "sampling" object wins over the launch's options: a greedy prompt in a hot
    launch gives transformers' greedy tokens, and a prompt with its own seed gives the same tokens
    whatever the launch's --seed."""
    path = tiny_models["llama"]
    plan = tmp_path / "plan.json"
    assert main(["plan", "--kv-dtype", "float32", "--model", str(path), "--stages", "2", "-o", str(plan)]) == 0
    greedy_prompt, seeded_prompt = [5, 17, 33, 8], [9, 10, 11, 40, 2 + 1]
    lines = [{"id": "greedy", "input_ids": greedy_prompt, "sampling": {"temperature": 0}},
             {"id": "seeded", "input_ids": seeded_prompt, "sampling": {"seed": 1234, "top_k": 30}},
             {"id": "plain", "input_ids": seeded_prompt}]
    prompts_file = tmp_path / "p.jsonl"
    prompts_file.write_text("".join(json.dumps(x) + "\n" for x in lines))
    runs = []
    for launch_seed in (1, 2):
        out = tmp_path / f"o{launch_seed}.jsonl"
        assert main(["launch", str(plan), "--local", "--prompts", str(prompts_file), "--out", str(out),
                     "--max-new-tokens", str(NEW_TOKENS), "--temperature", "1.5", "--seed", str(launch_seed),
                     "--quiet"]) == 0
        runs.append({k: v["output_ids"] for k, v in read_results(out).items()})
    ref_model = reference_models["llama"]
    for r in runs:
        assert_greedy_equal(ref_model, greedy_prompt, r["greedy"], reference_greedy(ref_model, greedy_prompt,
                                                                                    NEW_TOKENS, 2))
    assert runs[0]["seeded"] == runs[1]["seeded"]
    assert runs[0]["plain"] != runs[1]["plain"], "without its own seed a prompt follows --seed"


SWITCHES = [(tsem, sat, sampling) for tsem in (False, True) for sat in (False, True) for sampling in ("inline", "cpu")]
# each combination's number of stages: 1-4 eagerly; the three combinations `switch_args` compiles take
# 4 stages of one whole block each, a thread each, and share one block's graphs (2 and 3 stages held
# runs of two blocks too, a second set of graphs, ~20 s; a 2-thread single stage compiled a set of
# its own)
SWITCH_STAGES = (1, 2, 3, 4, 4, 4, 1, 4)
# the compiled combinations' cuts, at block boundaries (a stage's own calls are compiled for its
# layout: random mid-block cuts compiled 18 graphs, ~160 s; cut halves under compile are tested in
# test_quant.py); the eager ones cut anywhere
COMPILED_CUTS = {4: [3, 5, 7]}


def switch_args(tsem: bool, sat: bool, sampling: str) -> list[str]:
    """With TSEM the CPU executor runs as a thread (as on CUDA stages); all on also takes the static
    decode path (the CUDA-graph path, eager on a CPU), and with the sampler pool its steps' halves
    through torch.compile (`--compile on`); TSEM alone takes the compiled halves on the dynamic path."""
    static = ["--static-decode", "on"] if tsem and sat else []
    if tsem and (sampling == "cpu" or not sat):
        static += ["--compile", "on"]
    return (["--sampling", sampling] + (["--prepare-thread", "on"] if tsem else ["--no-tsem"])
            + ([] if sat else ["--no-sat"]) + ["--no-cuda-graphs"] + static)


def test_hpipe_warmup_makes_default_launches_run_compiled_graphs_with_the_eager_tokens(tiny_models, reference_models,
                                                                                    tmp_path):
    """`--compile auto`, the default: before `hpipe warmup` a launch runs eagerly and its report says
    in one line what would compile it; `hpipe warmup` compiles the model's graphs once (a run of
    whole blocks, one whole block, and the halves of a block cut between stages) into inductor's
    cache, for the thread count the launch gives each stage; the same launch
    then runs them (its summary says so) from the cache, compiling nothing new (a warm-up whose pool
    differed from the run's once missed every graph: the KV pool's shape), and gives the eager
    launch's tokens."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cold_host_cache(tmp_path / "inductor"))}
    path = str(tiny_models["llama"])
    plan, prompts = tmp_path / "plan.json", tmp_path / "p.jsonl"
    assert main(["plan", "--kv-dtype", "float32", "--model", path, "--stages", "2", "--cuts", "4", "-o", str(plan)]) == 0   # block 1 cut
    prompt_ids = [list(range(3, 40)), list(range(50, 61))]
    write_prompts(prompts, prompt_ids)

    def hpipe(*args):
        done = subprocess.run([sys.executable, "-m", "hpipe", *args], env=env, capture_output=True, text=True,
                              check=False, timeout=900)   # a hang guard (compiles on 2 busy cores: 300+ s)
        assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
        return done

    def launch(tag: str, prompts=prompts):
        out = tmp_path / f"{tag}.jsonl"
        done = hpipe("launch", str(plan), "--local", "--prompts", str(prompts), "--out", str(out),
                     "--max-new-tokens", "10", "--max-batch", "2")
        options = json.loads(out.with_name(out.name + ".summary.json").read_text())["run"]["options"]
        tokens = {k: v["output_ids"] for k, v in read_results(out).items()}
        hint = [line for line in done.stdout.splitlines() if "hpipe warmup" in line]
        return hint, (options["compiled"], options["compile_cold"]), tokens

    hint, compiled, eager_tokens = launch("cold")
    assert compiled == (False, True) and len(hint) == 1 and hint[0].startswith("decode ran eagerly"), hint
    threads = str(threads_per_stage(["cpu", "cpu"])[0])          # what the launch gives each of its 2 stages
    warmed = hpipe("warmup", "--model", path, "--threads", threads, "--kv-dtype", "float32").stdout
    assert "4 decode graphs compiled" in warmed and f"{threads} threads" in warmed     # 4 blocks, 1 block, 2 halves
    graphs = lambda: {p for d in ("fxgraph", "hpipe-graphs") for p in (tmp_path / "inductor" / d).rglob("*")}  # noqa: E731 - the compiled graphs
    before = graphs()
    hint, compiled, tokens = launch("warm")
    assert compiled == (True, False) and not hint
    assert graphs() == before, "the warm launch compiled graphs the warmup had not"
    # a short prompt alone: over 2 stages its slices are single tokens, the first attending to itself
    # alone, a context no warm-up traces (a warm host's first short job compiled a graph a function)
    short = tmp_path / "p-short.jsonl"
    write_prompts(short, [list(range(70, 74))])
    _, compiled, short_tokens = launch("short", short)
    assert compiled == (True, False) and graphs() == before, "a 4-token prompt compiled graphs the warmup had not"
    assert_greedy_equal(reference_models["llama"], list(range(70, 74)), short_tokens["p0"],
                        reference_greedy(reference_models["llama"], list(range(70, 74)), 10, 2))
    for i, prompt in enumerate(prompt_ids):       # inductor's sums are not eager's bit for bit: near-ties aside
        assert_greedy_equal(reference_models["llama"], prompt, tokens[f"p{i}"], eager_tokens[f"p{i}"])


def test_every_switch_combination_gives_the_tokens_of_the_baseline(tiny_models, reference_models, tmp_path):
    """--no-tsem/--no-sat/--sampling inline|cpu, all eight combinations, each on its own random plan
    (1-4 stages as `SWITCH_STAGES` says, mid-block cuts where eager, random slicing) with early EOS: greedy
    prompts give transformers' tokens, seeded prompts with every penalty give the tokens of the
    baseline (all off, which is the first runtime)."""
    family = "qwen2"
    path = tiny_models[family]
    ref_model = reference_models[family]
    n_units = models.num_units(models.load_config(path))
    rng = random.Random("switches")
    hot = {"temperature": 0.9, "top_k": 40, "top_p": 0.95, "repetition_penalty": 1.2, "frequency_penalty": 0.4,
           "presence_penalty": 0.2}
    lines, greedy = [], {}
    for i in range(7):
        prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 60))]
        if i % 2:
            lines.append({"id": f"p{i}", "input_ids": prompt, "sampling": {**hot, "seed": 100 + i},
                          "stop_token_ids": list(range(3, 40))})    # stops early, mid-pipeline
        else:
            lines.append({"id": f"p{i}", "input_ids": prompt, "sampling": {"temperature": 0}})
            greedy[f"p{i}"] = prompt
    prompts_file = tmp_path / "p.jsonl"
    prompts_file.write_text("".join(json.dumps(x) + "\n" for x in lines))
    runs = {}
    for k, (tsem, sat, sampling) in enumerate(SWITCHES):
        n_stages, compiled = SWITCH_STAGES[k], "--compile" in switch_args(tsem, sat, sampling)
        cuts = COMPILED_CUTS[n_stages] if compiled else sorted(rng.sample(range(1, n_units), n_stages - 1))
        slices = [rng.randint(2, 25) for _ in range(rng.randint(1, 3))]
        plan, out = tmp_path / f"plan{k}.json", tmp_path / f"out{k}.jsonl"
        assert main(["plan", "--kv-dtype", "float32", "--model", str(path), "--stages", str(n_stages), "--slices", ",".join(map(str, slices)),
                     "-o", str(plan)] + (["--cuts", ",".join(map(str, cuts))] if cuts else [])) == 0
        assert main(["launch", str(plan), "--local", "--prompts", str(prompts_file), "--out", str(out),
                     "--max-new-tokens", "12", "--max-batch", "3", "--quiet",
                     *switch_args(tsem, sat, sampling)]) == 0
        runs[(tsem, sat, sampling)] = {k2: v["output_ids"] for k2, v in read_results(out).items()}
        options = json.loads(out.with_name(out.name + ".summary.json").read_text())["run"]["options"]
        assert options["compiled"] == compiled
    baseline = runs[(False, False, "inline")]
    assert len(baseline) == len(lines)
    stopped = [pid for pid, out in baseline.items() if int(pid[1:]) % 2 and len(out) < 12]
    assert stopped, "some seeded prompt should stop early (its stop ids)"
    for switches, tokens in runs.items():
        assert tokens == baseline, f"tsem, sat, sampling = {switches}"
    for pid, prompt in greedy.items():
        assert_greedy_equal(ref_model, prompt, baseline[pid], reference_greedy(ref_model, prompt, 12, 2))


def test_no_metadata_crosses_a_hop_with_sat(tiny_models, tmp_path):
    """From the comm counters: with SAT a hop carries one message per micro-batch (its hidden
    states) and the back link one per sampling micro-batch (its ids), no header or segments;
    without SAT every hop carries header + segments + hidden states."""
    path = tiny_models["llama"]
    prompts_file = tmp_path / "p.jsonl"
    write_prompts(prompts_file, [[5 + i, 6, 7, 8, 9, 10 + i] for i in range(4)])
    plan = tmp_path / "plan.json"
    assert main(["plan", "--kv-dtype", "float32", "--model", str(path), "--stages", "3", "--slices", "4", "-o", str(plan)]) == 0
    for sat in (True, False):
        out, tl = tmp_path / f"o{sat}.jsonl", tmp_path / f"t{sat}.json"
        assert main(["launch", str(plan), "--local", "--prompts", str(prompts_file), "--out", str(out),
                     "--max-new-tokens", "10", "--max-batch", "4", "--timeline-out", str(tl), "--quiet"]
                    + ([] if sat else ["--no-sat"])) == 0
        stages = json.loads(tl.read_text())["stages"]
        sent = {link: c for st in stages for link, c in st["links"].items()}
        for j in range(3):
            mbs = [i for i in stages[j]["intervals"] if i["what"] == "compute"]
            decode = [i for i in mbs if i["kind"] == "decode"]
            assert len(decode) >= 9, "the run should be mostly decode"
            if j < 2:
                hop = sent[f"{j}->{j + 1}"]
                assert hop["data_msgs"] == len(mbs)
                assert hop.get("meta_msgs", 0) == (0 if sat else 2 * len(mbs) + 1), (sat, hop)   # + the stop
        back = sent["2->0"]
        sampling = sum(1 for i in stages[2]["intervals"] if i["what"] == "compute" and i["kind"] == "decode")
        assert back["data_msgs"] >= sampling
        if sat:
            assert "meta_msgs" not in back and "meta_msgs" not in sent["0->1"] and "meta_msgs" not in sent["1->2"]
            n_mbs = sum(1 for i in stages[0]["intervals"] if i["what"] == "compute")
            assert sent["0->1"]["schedule_msgs"] == sent["0->2"]["schedule_msgs"] == n_mbs + 1   # + the stop


@pytest.mark.parametrize("policy", ["throttle", "sarathi"])
def test_policies_and_preemption_give_transformers_tokens(policy, tiny_models, reference_models, tmp_path):
    """Continuous batching on 3 processes under either policy: with a KV pool of every sequence's
    pages, and with one so small (one longest sequence and a page) that sequences are preempted and
    recomputed; the greedy tokens are transformers' every time."""
    path = tiny_models["llama"]
    rng = random.Random(f"policy-{policy}")
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(5, 40))] for _ in range(5)]
    plan, prompts_file = tmp_path / "plan.json", tmp_path / "prompts.jsonl"
    write_prompts(prompts_file, prompts)
    assert main(["plan", "--kv-dtype", "float32", "--model", str(path), "--stages", "3", "--slices", "12,8", "-o", str(plan)]) == 0
    page_size = 4
    small = -(-(max(map(len, prompts)) + NEW_TOKENS) // page_size) + 2
    ref_model = reference_models["llama"]
    for kv_pages in (0, small):
        out = tmp_path / f"out-{kv_pages}.jsonl"
        assert main(["launch", str(plan), "--local", "--prompts", str(prompts_file), "--out", str(out),
                     "--max-new-tokens", str(NEW_TOKENS), "--max-batch", "4", "--policy", policy, "--budget", "24",
                     "--max-prefill", "24", "--kv-pages", str(kv_pages), "--page-size", str(page_size),
                     "--quiet"]) == 0
        results = read_results(out)
        for i, p in enumerate(prompts):
            assert_greedy_equal(ref_model, p, results[f"p{i}"]["output_ids"],
                                reference_greedy(ref_model, p, NEW_TOKENS, 2))
        run = json.loads((tmp_path / f"out-{kv_pages}.jsonl.summary.json").read_text())["run"]
        assert run["policy"]["name"] == policy
        if kv_pages:
            assert run["kv_pages"] == small - 1 and run["preemptions"] > 0, run
        else:
            assert run["preemptions"] == 0


@pytest.mark.parametrize("kv_pages", [0, 14])
def test_prompts_sharing_a_document_reuse_its_cached_pages_exactly(kv_pages, tiny_models, reference_models, tmp_path):
    """Ten questions on one 70-token document through 3 stages, 2 at a time (and with a pool so
    small that sequences are preempted and recomputed): the later ones start after the document's
    cached pages, every logit equals a transformers forward of the whole prompt (1e-4), and the
    tokens equal those of the same job with the cache off."""
    rng = random.Random("prefix")
    path = tiny_models["llama"]
    doc = [rng.randrange(3, VOCAB) for _ in range(70)]
    prompts = [doc + [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 12))] for _ in range(10)]
    plan, prompts_file = tmp_path / "plan.json", tmp_path / "prompts.jsonl"
    write_prompts(prompts_file, prompts)
    assert main(["plan", "--kv-dtype", "float32", "--model", str(path), "--stages", "3", "--slices", "16,8", "-o", str(plan)]) == 0
    runs = {}
    for caching in ("on", "off"):
        out, logits = tmp_path / f"{caching}.jsonl", tmp_path / f"{caching}.npz"
        assert main(["launch", str(plan), "--local", "--prompts", str(prompts_file), "--out", str(out),
                     "--max-new-tokens", str(NEW_TOKENS), "--logits-out", str(logits), "--max-batch", "2",
                     "--page-size", "8", "--kv-pages", str(kv_pages), "--prefix-caching", caching, "--quiet"]) == 0
        runs[caching] = (read_results(out), np.load(logits), json.loads((tmp_path / f"{caching}.jsonl.summary.json")
                                                                         .read_text())["run"])
    (on, on_logits, on_run), (off, _, off_run) = runs["on"], runs["off"]
    assert on_run["prefix_hit_tokens"] >= 8 * 64 and off_run["prefix_hit_tokens"] == 0
    assert (on_run["preemptions"] > 0) == (kv_pages > 0)
    ref_model = reference_models["llama"]
    for i, p in enumerate(prompts):
        ref = reference_logits(ref_model, p, on[f"p{i}"]["output_ids"])
        assert float((torch.from_numpy(on_logits[f"p{i}"]) - ref).abs().max()) < 1e-4
        assert on[f"p{i}"]["output_ids"] == off[f"p{i}"]["output_ids"]
