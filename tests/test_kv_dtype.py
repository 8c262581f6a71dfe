"""The KV cache's element type (`--kv-dtype`, float16 by default): every count halves, the stored
keys are the float32 run's rounded once, hpipe's float16 decode attention against a float64
reference, every attention path within the cache's rounding of transformers' float forward (eager,
compiled), and bad values refused in one line."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import VOCAB, assert_run_matches
from hpipe import cpu_kernels, formats, models
from hpipe.cli import main
from hpipe.config import Speculation
from hpipe.formats import Slicing
from hpipe.launcher.cluster import device_needs
from hpipe.request import Request
from hpipe.runtime import stage as stage_module
from hpipe.runtime.graphs import compiled as compiled_graphs
from hpipe.runtime.inprocess import run_inprocess
from hpipe.runtime.pages import Segment
from hpipe.runtime.stage import StageRunner

# A float16 cache rounds each key and value once (2^-11 relative): the tiny models' logits (up to
# ~2.5) move by at most ~1e-3 (measured 8e-4); bfloat16's 2^-8 moves them ~2e-2.
F16_TOL = 3e-3
POOL = 64
EXAMPLE_INVENTORY = Path(__file__).resolve().parent.parent / "profiles" / "examples" / "hpipe-paper.toml"


def test_the_default_cache_is_float16_and_every_count_halves(tiny_models, tmp_path):
    path = tiny_models["llama"]
    config = models.load_config(path)
    plans = {}
    for kv in (None, "float32"):
        out = tmp_path / f"plan-{kv}.json"
        assert main(["plan", "--model", str(path), "--stages", "2", "-o", str(out)] +
                    (["--kv-dtype", kv] if kv else [])) == 0
        plans[kv] = formats.load_plan(out)
    assert plans[None].kv_dtype == formats.KV_DTYPE == "float16"
    assert json.loads((tmp_path / "plan-None.json").read_text())["kv_dtype"] == "float16"
    # a token's cache by the config's own numbers: keys and values, each KV head's head_dim elements
    head_dim = config.hidden_size // config.num_attention_heads
    per_layer = 2 * config.num_key_value_heads * head_dim
    table = models.unit_bytes(config, "float32", kv_dtype="float16")
    assert sum(table.kv_per_token_per_unit) == config.num_hidden_layers * per_layer * 2
    assert sum(models.unit_bytes(config, "float32").kv_per_token_per_unit) == config.num_hidden_layers * per_layer * 4
    # the launch preflight counts the plan's: 1,000 tokens take half the bytes
    need = {kv: device_needs(p, config, "local", 1000, 16)["cpu"] for kv, p in plans.items()}
    assert need["float32"] - need[None] == config.num_hidden_layers * per_layer * 2 * 1000
    # and the stage's pool holds float16 pages: half the bytes for the same pages
    pools = {}
    for kv in ("float16", "float32"):
        runner = StageRunner(path, config, range(models.num_units(config)), kv_dtype=kv)
        runner.kv.allocate(8)
        runner.forward(runner.prepare_inputs([Segment(0, 0, 0, 5, True)]), torch.tensor([5, 6, 7, 8, 9]))
        assert all(t.dtype == getattr(torch, kv) for t in runner.kv.keys.values())
        pools[kv] = runner.kv.bytes()
    assert pools["float32"] == 2 * pools["float16"] > 0


def test_a_float16_cache_holds_the_float32_runs_keys_rounded_once(tiny_models):
    """Layer 0's keys depend only on the prompt: the float16 pool holds exactly the float32 pool's
    values rounded to float16."""
    path = tiny_models["qwen2"]
    config = models.load_config(path)
    ids = torch.tensor([random.Random(1).randrange(3, VOCAB) for _ in range(20)])
    pools = {}
    for kv in ("float16", "float32"):
        runner = StageRunner(path, config, range(3), kv_dtype=kv)
        runner.kv.allocate(8)
        runner.forward(runner.prepare_inputs([Segment(0, 0, 0, 20, True)]), ids)
        pools[kv] = (runner.kv.keys[0], runner.kv.values[0])
    for half, full in zip(pools["float16"], pools["float32"]):
        assert torch.equal(half, full.to(torch.float16))
        assert full.abs().sum() > 0


@pytest.mark.parametrize("b,kv_heads,group,d,n", [(1, 3, 3, 64, 1000), (2, 8, 4, 64, 300), (3, 2, 1, 128, 9),
                                                  (2, 1, 16, 32, 600), (1, 2, 5, 72, 300), (2, 2, 37, 64, 500),
                                                  (1, 2, 24, 64, 700)])
def test_the_float16_decode_attention_is_a_float64_softmax_of_its_pages(b, kv_heads, group, d, n):
    """`hpipe::attend_f16` (both routes: the C++ op and its Python twin) against float64 SDPA over
    the same float16 keys and values, with and without a mask (a row with nothing to attend gives
    zeros, as torch's flash kernel), one mask row for the group, one a query, and one per several
    queries (a sequence's rows as one group, each row's heads under its row; 16 queries a tile: 37 is
    three, 24 in rows of 6 cross a tile), its pages read at a pool's strides (a view, not a
    copy)."""
    if cpu_kernels.kernels()[0] is None:
        pytest.skip(cpu_kernels.kernels()[1])
    cpu_kernels.ops()
    gen = torch.Generator().manual_seed(n)
    q = torch.randn(b, kv_heads, group, d, generator=gen) * 3
    pool = torch.randn(2, kv_heads, b, n + 7, d, generator=gen).half()     # [k/v, heads, rows, positions, d]
    k, v = pool[0].transpose(0, 1)[:, :, 3:3 + n], pool[1].transpose(0, 1)[:, :, 3:3 + n]
    mask = torch.rand(b, 1, 1, n, generator=gen) > 0.3
    mask[0, ..., : min(n, 700)] = False
    each = torch.rand(b, 1, group, n, generator=gen) > 0.5                   # a row a query
    each[-1, :, -1] = False
    masks = [None, mask, each]
    rows = next((r for r in (5, 4, 2) if group % r == 0 and r < group), None)  # a row per group // rows queries
    if rows:
        shared = torch.rand(b, 1, rows, n, generator=gen) > 0.4
        shared[0, :, -1, n // 2:] = False
        masks.append(shared)
    for m in masks:
        wide = None if m is None else m.repeat_interleave(group // m.shape[2], dim=2)
        ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(),
                                                               attn_mask=wide, scale=d ** -0.5).nan_to_num(0.0)
        for got in (torch.ops.hpipe.attend_f16(q, k, v, m, d ** -0.5), cpu_kernels.attend_f16(q, k, v, m, d ** -0.5)):
            assert got.dtype == torch.float32 and got.shape == q.shape
            assert float((got - ref).abs().max()) < 1e-5
    for attend in (torch.ops.hpipe.attend_f16, cpu_kernels.attend_f16):      # shapes that do not match: refused
        other = torch.zeros(b, kv_heads + 1, n, d, dtype=torch.float16)      # another number of KV heads
        for bad_k, bad_v in ((other, other), (k, v[..., : d // 2]), (k.float(), v.float())):
            with pytest.raises((RuntimeError, ValueError), match="attention kernel"):
                attend(q, bad_k, bad_v, None, d ** -0.5)


@pytest.mark.parametrize("length,kv_heads,group,d,n", [(5, 3, 3, 64, 1700), (2, 2, 4, 128, 40), (8, 1, 16, 72, 300)])
def test_a_sequences_few_rows_attend_through_the_float16_kernel_as_float64_sdpa(length, kv_heads, group, d, n,
                                                                              monkeypatch):
    """A speculative step's k+1 rows of one sequence over float16 pages (`decode_sdpa`: the decode
    kernel, the rows' heads one group of queries each under its row of the causal mask) against
    float64 SDPA over the same keys and values, in transformers' output layout."""
    if cpu_kernels.kernels()[0] is None:
        pytest.skip(cpu_kernels.kernels()[1])
    stage_module.register_decode_sdpa(torch.device("cpu"), "float16")
    gen = torch.Generator().manual_seed(n)
    heads = kv_heads * group
    q = torch.randn(1, heads, length, d, generator=gen) * 3
    pool = torch.randn(2, kv_heads, 1, n + 9, d, generator=gen).half()       # [k/v, heads, rows, positions, d]
    k, v = pool[0].transpose(0, 1)[:, :, 2:2 + n], pool[1].transpose(0, 1)[:, :, 2:2 + n]
    # row r sees the context and the rows up to itself; the mask is wider than the pages, as a pool's
    mask = torch.ones(1, 1, length, n + 4, dtype=torch.bool).tril(n - length)
    through = []
    rows = stage_module._attend_f16_rows
    monkeypatch.setattr(stage_module, "_attend_f16_rows", lambda *a: through.append(1) or rows(*a))
    out, _ = stage_module.decode_sdpa(None, q, k, v, mask, scaling=d ** -0.5)
    assert through, "the rows went to the float32 copy"
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1),
        attn_mask=mask[..., :n], scale=d ** -0.5)
    assert out.shape == (1, length, heads, d) and out.dtype == torch.float32
    assert float((out - ref.transpose(1, 2)).abs().max()) < 1e-5


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_every_attention_path_over_a_float16_cache_is_within_its_rounding(attn, tiny_models, reference_models):
    """2 stages of a grouped-query model, batches of 1-3 rows through prefill slices and decode
    steps (the float16 decode kernel, the float32 copy of multi-row steps; eager attention's copy),
    against transformers' float32 forward: within the cache's rounding, greedy tokens equal."""
    path = tiny_models["llama"]
    config = models.load_config(path)
    rng = random.Random(f"f16-{attn}")
    requests = [Request(i, f"p{i}", tuple(rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 40))),
                        max_new_tokens=10, eos_ids=frozenset()) for i in range(3)]
    n = models.num_units(config)
    runners = [StageRunner(path, config, range(a, b), attn_implementation=attn, kv_dtype="float16")
               for a, b in ((0, 4), (4, n))]
    results = run_inprocess(runners, requests, Slicing(lengths=(16,)).slices_for, max_batch=3, keep_logits=True,
                            pages=POOL)
    assert_run_matches(reference_models["llama"], requests, results, F16_TOL)


@pytest.mark.slow
def test_compiled_decode_steps_read_the_float16_pages_as_eager_ones_do(tiny_models, reference_models, monkeypatch):
    """`--compile on`: the graphs hold `hpipe::attend_f16` (one opaque call); their steps are within
    the cache's rounding of transformers' forward, and warm-up compiled every graph the run calls.
    The stages run speculation too (`step_tokens`: a lone sequence's fed token and up to 4 ngram
    proposals through the same graphs, `_attend_f16_rows` inside them): the warm-up compiled those
    steps' graphs as well, and a lone stream's verification steps run compiled, within the same
    rounding of the forward. The graphs are saved as code (`hpipe.runtime.graphs`): stages built
    again load them, compiling none (a file that is not a graph beside them is passed over), and
    give the first stages' logits bit for bit. The stages are a 3-host plan's of the tiny model
    (1, 2 and 1 whole blocks: the first and last share a graph), whose graphs for one row
    tests/test_ssh.py's `hpipe warmup --cluster` then finds compiled (cut halves under compile:
    test_quant.py)."""

    path = tiny_models["llama"]
    config = models.load_config(path)
    rng = random.Random("f16-compiled")
    requests = [Request(i, f"p{i}", tuple(rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 30))),
                        max_new_tokens=8 + 4 * i, eos_ids=frozenset()) for i in range(3)]
    n = models.num_units(config)
    speculation = Speculation("ngram", 4)

    def built() -> list[StageRunner]:
        runners = [StageRunner(path, config, range(a, b), compile="on", kv_dtype="float16",
                               step_tokens=speculation.step_tokens) for a, b in ((0, 3), (3, 7), (7, n))]
        for runner in runners:      # warmed up in a pool of 4 pages, as `hpipe warmup` warms (`warm_layout`):
            runner.kv.allocate(4)   # its graphs serve the run's larger pool (one traced in 40 pages refused 4)
            stage_module.warm_up(runner, 16, print)
        return runners

    def run(runners: list[StageRunner]) -> dict:
        return run_inprocess(runners, requests, Slicing(lengths=(16,)).slices_for, max_batch=3, keep_logits=True,
                             pages=POOL)

    runners = built()
    graphs = compiled_graphs()
    first = run(runners)
    assert compiled_graphs() == graphs, "a decode step compiled a graph warm-up had not"
    assert_run_matches(reference_models["llama"], requests, first, F16_TOL)
    graph_dirs = {g.dir for r in runners for g in r.decode_halves.fns.values()}
    junk = [d / "cut-short.graph" for d in graph_dirs]
    for file in junk:
        file.write_bytes(b"not a graph")
    again = run(built())
    for file in junk:
        file.unlink()
    assert compiled_graphs() == graphs, "stages built again compiled graphs they could have loaded"
    assert {i: r["output_ids"] for i, r in again.items()} == {i: r["output_ids"] for i, r in first.items()}
    assert all(torch.equal(a, b) for i in first for a, b in zip(first[i]["logits"], again[i]["logits"]))
    # a lone stream whose prompt repeats itself: the proposer finds its n-grams
    phrase = [rng.randrange(3, VOCAB) for _ in range(6)]
    stream = [Request(0, "s", tuple(phrase * 4), max_new_tokens=20, eos_ids=frozenset())]
    compiled_steps = []
    takes_graphs = StageRunner.takes_graphs

    def spy(runner, inputs):
        taken = takes_graphs(runner, inputs)
        if taken and inputs.shape[1] > 1:
            compiled_steps.append(inputs.shape)
        return taken
    monkeypatch.setattr(StageRunner, "takes_graphs", spy)
    results = run_inprocess(runners, stream, Slicing(lengths=(16,)).slices_for, max_batch=1, keep_logits=True,
                            pages=POOL, speculation=speculation)
    assert compiled_steps and all(rows == 1 and 2 <= tokens <= 5 for rows, tokens in compiled_steps), compiled_steps
    assert compiled_graphs() == graphs, "a verification step compiled a graph warm-up had not"
    assert_run_matches(reference_models["llama"], stream, results, F16_TOL)


GRAPH_PROBE = """
import sys, time
from contextlib import nullcontext
from pathlib import Path

import torch

from hpipe.runtime import graphs


def twice_plus_one(x):
    return x * 2 + 1


def main(directory, go):
    graph = graphs.Graph(twice_plus_one, Path(directory), {}, lambda args: nullcontext())
    print("ready", flush=True)
    while not Path(go).exists():
        time.sleep(0.01)
    with torch.inference_mode():
        assert graph(torch.arange(4.0)).tolist() == [1.0, 3.0, 5.0, 7.0]
    print(graphs.compiled(), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
"""


@pytest.mark.slow
def test_processes_wanting_the_same_graph_at_once_compile_it_once(tmp_path):
    """Two processes (two stages of one layout starting together) call a graph function that has no
    graph yet at the same moment: one compiles and saves it while the other waits on the
    directory's lock, then loads it. One graph file, one compile between them."""
    (tmp_path / "graph_probe.py").write_text(GRAPH_PROBE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(Path(__file__).resolve().parents[1])])}
    directory, go = tmp_path / "graphs", tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-m", "graph_probe", str(directory), str(go)], env=env,
                              stdout=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        assert [p.stdout.readline().strip() for p in procs] == ["ready", "ready"]
        go.touch()
        compiles = [int(p.stdout.readline()) for p in procs]
        assert [p.wait(timeout=120) for p in procs] == [0, 0]
    finally:
        for p in procs:
            p.kill()
    assert sorted(compiles) == [0, 1] and len(list(directory.glob("*.graph"))) == 1


ISA_PROBE = """
import sys
from contextlib import nullcontext
from pathlib import Path

import torch
from torch._inductor import cpu_vec_isa

from hpipe.runtime import graphs

probes = []
real = cpu_vec_isa.VecISA._probe_load
cpu_vec_isa.VecISA._probe_load = lambda self, path: probes.append(path) or real(self, path)
graph = graphs.Graph(lambda x: x * 2 + 1, Path(sys.argv[1]), {}, lambda args: nullcontext())
with torch.inference_mode():
    assert graph(torch.arange(4.0)).tolist() == [1.0, 3.0, 5.0, 7.0]
print(len(probes), graphs.compiled(), cpu_vec_isa.pick_vec_isa(), sep="|")
"""


@pytest.mark.slow
def test_a_hosts_second_process_takes_the_vector_check_of_its_first(tmp_path):
    """Inductor's check that the compiler builds and loads vector code for this CPU (a Python process
    that loads a probe library) is made by a host's first process alone: the second, with the same
    inductor cache, loads the first one's graph (their cache keys agree), runs no probe, and picks the
    same vector set."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    env.pop("TORCHINDUCTOR_VEC_ISA_OK", None)

    def run() -> list[str]:
        done = subprocess.run([sys.executable, "-c", ISA_PROBE, str(tmp_path / "graphs")], env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout.strip().split("|")

    first, second = run(), run()
    assert int(first[0]) >= 1 and first[1] == "1", first        # the check's probe ran; the graph compiled
    assert second == ["0", "0", first[2]], (first, second)


def test_a_kv_dtype_hpipe_cannot_keep_is_refused_in_one_line(tiny_models, tmp_path, capsys):
    path = str(tiny_models["llama"])
    assert main(["plan", "--model", path, "--stages", "2", "--kv-dtype", "int8", "-o", str(tmp_path / "p.json")]) != 0
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("hpipe: error:")]
    assert len(err) == 1 and "--kv-dtype 'int8'" in err[0] and "float16" in err[0]
    assert not (tmp_path / "p.json").exists()
    plan = tmp_path / "plan.json"
    assert main(["plan", "--model", path, "--stages", "2", "-o", str(plan)]) == 0
    data = json.loads(plan.read_text())
    data["kv_dtype"] = "fp8"
    with pytest.raises(formats.HpipeError, match=r"kv_dtype.*'fp8' is not one of"):
        formats.parse_plan(data, "plan.json")
    del data["kv_dtype"]          # a plan made before 16-bit caches runs the float32 cache it was planned with
    assert formats.parse_plan(data, "plan.json").kv_dtype == "float32"
    # a plan from a profile keeps the profile's cache type: another is refused, saying what to do
    profile = tmp_path / "profile.json"
    assert main(["profile", "--estimate", "--cluster", str(EXAMPLE_INVENTORY), "--model", "llama-7b",
                 "-o", str(profile)]) == 0
    assert json.loads(profile.read_text())["kv_dtype"] == "float16"
    capsys.readouterr()
    assert main(["plan", "--profile", str(profile), "--seq-len", "128", "--model", "llama-7b", "--kv-dtype",
                 "float32", "-o", str(tmp_path / "q.json")]) != 0
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("hpipe: error:")]
    assert len(err) == 1 and "measured with --kv-dtype float16, not float32" in err[0]

