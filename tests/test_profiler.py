"""The profiler: byte counts against transformers' own tensors, the fitted model's monotonicity,
the profile schema, estimated profiles, and the planner's use (and refusal) of profiles."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import FAMILIES
from hpipe import formats, models
from hpipe.cli import main
from hpipe.grid import GridModel

EXAMPLES = Path(__file__).resolve().parent.parent / "profiles" / "examples"


@pytest.mark.parametrize("family", FAMILIES)
def test_byte_counts_equal_transformers_tensors(family, tiny_models, reference_models):
    from transformers import DynamicCache

    config = models.load_config(tiny_models[family])
    b = models.unit_bytes(config)
    model = reference_models[family]
    gpt2 = family == "gpt2"
    base = model.transformer if gpt2 else model.model
    layers = base.h if gpt2 else base.layers
    nbytes = lambda mod: sum(p.nbytes for p in mod.parameters())  # noqa: E731
    embed = nbytes(base.wte) + nbytes(base.wpe) if gpt2 else nbytes(base.embed_tokens)
    assert b.weights_per_unit[0] == embed
    for i, layer in enumerate(layers):
        attn = nbytes(layer.ln_1) + nbytes(layer.attn) if gpt2 else nbytes(layer.input_layernorm) + nbytes(layer.self_attn)
        assert b.weights_per_unit[1 + 2 * i] == attn
        assert b.weights_per_unit[1 + 2 * i] + b.weights_per_unit[2 + 2 * i] == nbytes(layer)
    head = (nbytes(base.ln_f) if gpt2 else nbytes(base.norm)) + model.lm_head.weight.nbytes
    assert b.weights_per_unit[-1] == head
    # KV cache and activations: what a real forward of T tokens keeps and passes between blocks
    tokens = 11
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        out = model(torch.arange(3, 3 + tokens)[None], **{models.cache_argument(model): cache}, use_cache=True, output_hidden_states=True)
    for i in range(len(layers)):
        kv = cache.layers[i].keys.nbytes + cache.layers[i].values.nbytes
        assert b.kv_per_token_per_unit[1 + 2 * i] * tokens == kv
        assert b.kv_per_token_per_unit[2 + 2 * i] == 0
    for h in out.hidden_states[1:-1]:
        assert b.activation_per_token_at_cut[3] * tokens == h[0].nbytes


@settings(max_examples=150, deadline=None)
@given(data=st.data(), n_s=st.integers(1, 6), n_c=st.integers(1, 4))
def test_fitted_model_is_monotone(data, n_s, n_c):
    s = sorted(data.draw(st.sets(st.integers(1, 4096), min_size=n_s, max_size=n_s)))
    c = sorted(data.draw(st.sets(st.integers(0, 4096), min_size=n_c, max_size=n_c)))
    t = [[data.draw(st.one_of(st.none(), st.floats(1e-6, 1.0))) for _ in c] for _ in s]
    if all(v is None for row in t for v in row):
        t[0][0] = 1e-3
    model = GridModel(s, c, t)
    qs = np.linspace(1, 5000, 60)
    qc = np.linspace(0, 5000, 40)
    grid = model(qs[:, None] * np.ones((1, len(qc))), np.ones((len(qs), 1)) * qc[None, :])
    # up to rounding: values reach 1e6 beyond the last row, where one ulp is ~1e-10
    assert np.all(np.diff(grid, axis=0) >= -1e-12 * np.abs(grid[1:])), "not monotone in s"
    assert np.all(np.diff(grid, axis=1) >= -1e-12 * np.abs(grid[:, 1:])), "not monotone in c"


def test_fit_reproduces_monotone_grid_points():
    s, c = [1, 16, 64, 256], [0, 128]
    t = [[1.0, 2.0], [2.0, 3.0], [4.0, 6.0], [9.0, None]]
    model = GridModel(s, c, t)
    for i, si in enumerate(s):
        for j, cj in enumerate(c):
            if t[i][j] is not None:
                assert model(np.array([si]), np.array([cj]))[0] == pytest.approx(t[i][j])


@pytest.mark.slow
def test_local_profile_validates_and_reports_a_failing_device(tiny_models, tmp_path, capsys):
    out = tmp_path / "prof.json"
    code = main(["profile", "--model", str(tiny_models["llama"]), "--local", "--devices", "cpu,cuda:7",
                 "--quick", "--max-seq-len", "96", "-o", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and "failed" in err
    # stderr is no terminal here: each step is a line of its own as it comes (a log shows where it is)
    assert "local/cpu: measuring its units" in err and "local/cuda:7: failed" in err
    assert "link local/cpu -> local/cpu: measuring" in err
    profile = formats.load_profile(out)  # what was measured is written, and validates
    assert [d.id for d in profile.devices] == ["local/cpu"]
    assert profile.errors and profile.errors[0]["device"] == "cuda:7"
    dev = profile.devices[0]
    assert dev.source == "measured" and dev.identity["threads"] >= 1
    assert set(dev.compute) == set(formats.UNIT_KINDS) and set(dev.fit_error) == {*formats.UNIT_KINDS, "all"}
    assert dev.decode.t["attn"][0][0] > 0
    # SiDP's WaS read on a CPU: a file's shared mapping into private memory, at memory speed
    assert dev.extra["fetch"]["source"] == "host-pool" and dev.extra["fetch"]["bytes_per_s"] > 1e8
    (link,) = profile.links
    assert link.src == link.dst == "local/cpu" and link.beta_bytes_per_s > 1e7
    assert [p[0] for p in link.extra["points"]][-1] >= 16 * 2 ** 20
    # the machine (stages sharing its cores) and the runtime's own per-token costs, measured by a run
    assert dev.identity["machine"] and dev.identity["cores"] >= 1
    rt = profile.runtime
    assert 0 < rt.hop_s < 0.05 and 0 < rt.step_s < 0.05 and 0 < rt.back_s < 0.05
    assert formats.parse_profile(json.loads(out.read_text())).to_json() == json.loads(out.read_text())   # read as written

    # a plan from this profile, run: the summary checks the prediction term by term
    plan, prompts, results = tmp_path / "plan.json", tmp_path / "p.jsonl", tmp_path / "o.jsonl"
    assert main(["plan", "--model", str(tiny_models["llama"]), "--stages", "2", "--profile", str(out),
                 "--seq-len", "64", "-o", str(plan)]) == 0
    prompts.write_text(json.dumps({"id": "a", "input_ids": [5 + j for j in range(64)]}) + "\n")
    assert main(["launch", str(plan), "--local", "--prompts", str(prompts), "--out", str(results),
                 "--max-new-tokens", "24"]) == 0
    assert len(json.loads(results.read_text())["output_ids"]) == 24
    check = json.loads(Path(f"{results}.summary.json").read_text())["plan_check"]
    terms = check["decode"]["predicted_terms_ms"]
    assert set(terms) == {"compute 0", "compute 1", "hop 0->1", "back"}
    assert set(check["decode"]["measured_terms_ms"]) == set(terms) and check["decode"]["measured_ms_per_token"] > 0
    assert abs(check["decode"]["relative_difference"]) <= check["tolerance"] or check["off"]
    assert all(isinstance(x, str) and x for x in check["off"])


def test_estimated_profile_of_the_paper_testbed(tmp_path):
    out = tmp_path / "paper.json"
    assert main(["profile", "--estimate", "--cluster", str(EXAMPLES / "hpipe-paper.toml"), "--model", "llama-7b",
                 "--dtype", "float16", "-o", str(out)]) == 0
    profile = formats.load_profile(out)
    assert [d.type for d in profile.devices] == ["P100"] * 4 + ["RTX3090"] * 2
    assert all(d.source == "estimated" for d in profile.devices)
    links = {(x.src, x.dst): x.beta_bytes_per_s for x in profile.links}
    assert links[("p100-box/cuda:3", "rtx3090-box/cuda:0")] == pytest.approx(1e9 / 8)
    assert links[("p100-box/cuda:0", "p100-box/cuda:1")] == pytest.approx(96e9 / 8)
    p100 = GridModel(**{k: getattr(profile.devices[0].compute["attn"], k) for k in "sct"})
    rtx = GridModel(**{k: getattr(profile.devices[4].compute["attn"], k) for k in "sct"})
    assert p100(np.array([1024]), np.array([512]))[0] > rtx(np.array([1024]), np.array([512]))[0]
    # a plan for that hardware: the faster RTX 3090s get more units than any P100
    plan = tmp_path / "plan.json"
    assert main(["plan", "--model", "llama-7b", "--cluster", str(EXAMPLES / "hpipe-paper.toml"), "--profile",
                 str(out), "--seq-len", "2048", "-o", str(plan)]) == 0
    stages = json.loads(plan.read_text())["stages"]
    sizes = [b - a for a, b in (s["units"] for s in stages)]
    assert min(sizes[4:]) > max(sizes[:4]), sizes


def test_planner_refuses_a_profile_for_another_model(tmp_path, capsys):
    prof = tmp_path / "paper.json"
    assert main(["profile", "--estimate", "--cluster", str(EXAMPLES / "hpipe-paper.toml"), "--model", "llama-7b",
                 "-o", str(prof)]) == 0
    capsys.readouterr()
    code = main(["plan", "--model", "llama2-13b", "--cluster", str(EXAMPLES / "hpipe-paper.toml"), "--profile",
                 str(prof), "--seq-len", "512", "-o", str(tmp_path / "plan.json")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "profile was made for model 'llama-7b'" in err[0], err


@pytest.fixture(scope="module")
def paper_profile(tmp_path_factory):
    out = tmp_path_factory.mktemp("paper") / "paper.json"
    assert main(["profile", "--estimate", "--cluster", str(EXAMPLES / "hpipe-paper.toml"), "--model", "llama-7b",
                 "--dtype", "float16", "-o", str(out)]) == 0
    return out


def test_plan_compare_search_drop_and_timeline(paper_profile, tmp_path, capsys):
    plan, page = tmp_path / "plan.json", tmp_path / "timeline.html"
    assert main(["plan", "--model", "llama-7b", "--cluster", str(EXAMPLES / "hpipe-paper.toml"), "--profile",
                 str(paper_profile), "--seq-len", "512", "--batch", "2", "--compare", "--order", "search",
                 "--allow-drop", "--timeline", str(page), "-o", str(plan)]) == 0
    predicted = json.loads(plan.read_text())["predicted"]
    rows = {r["method"].split(" (")[0]: r for r in predicted["compare"]}
    assert set(rows) >= {"Base", "GPipe", "GP-B", "TeraPipe", "HPipe-paper", "HPipe"}
    ours = rows["HPipe"]["makespan_s"]
    assert ours == pytest.approx(predicted["makespan_s"])
    # the plan is the best of what it searched, and no baseline the simulator scores is better
    assert all(r["makespan_s"] >= ours * (1 - 1e-9) for r in rows.values())
    assert ours <= min(c["makespan_s"] for c in predicted["candidates"] if "makespan_s" in c) * (1 + 1e-9)
    assert len(predicted["candidates"]) > 2
    first = json.loads(plan.read_text())["stages"][0]
    assert "<svg" in page.read_text() and f"{first['host']}/{first['device']}" in page.read_text()
    assert "HPipe-paper" in capsys.readouterr().out


@pytest.mark.parametrize("argv,needles", [
    (["--seq-len", "4096"], ("--seq-len 4096", "context (2048")),
    (["--seq-len", "2048", "--batch", "4000"], ("short by", "GiB")),
    (["--seq-len", "512", "--timeline", "x.svg"], ("--timeline", ".html or .png")),
])
def test_plan_bad_input_is_one_line(paper_profile, tmp_path, capsys, argv, needles):
    code = main(["plan", "--model", "llama-7b", "--cluster", str(EXAMPLES / "hpipe-paper.toml"), "--profile",
                 str(paper_profile), *argv, "-o", str(tmp_path / "plan.json")])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("hpipe: error:")]
    assert code == 2 and len(err) == 1, err
    for n in needles:
        assert n in err[0], err[0]


def test_the_rest_after_a_cached_prefix_is_sliced_for_its_context(paper_profile, tmp_path):
    """A plan from a profile carries, for every cached context c, Algorithm 2's slices of the
    planned prompt's rest after it: the brute-force optimum of the objective with the slice costs
    at their true contexts, never worse than slicing the rest as a prompt of its own."""
    import itertools

    from hpipe.planner.profiled import CostModel, slice_time_table

    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "llama-7b", "--cluster", str(EXAMPLES / "hpipe-paper.toml"), "--profile",
                 str(paper_profile), "--seq-len", "160", "-o", str(out)]) == 0
    plan = formats.load_plan(out)
    devices = [(s.host, s.device) for s in plan.stages]
    cuts = [s.units[0] for s in plan.stages] + [plan.stages[-1].units[1]]
    cost = CostModel(formats.load_profile(paper_profile), models.config_for("llama-7b"), devices, str(paper_profile))
    tau = slice_time_table(cost, cuts, 160, 16)
    d = len(devices)

    def objective(units, c):
        starts = c + np.cumsum([0] + units[:-1])
        costs = tau[units, starts]
        return costs.sum() + (d - 1) * costs.max()

    assert sorted(plan.slicing.by_context) == list(range(16, 160, 16))
    for c_tok, slices in plan.slicing.by_context.items():
        c, n = c_tok // 16, 10 - c_tok // 16
        assert sum(slices) == 160 - c_tok and plan.slicing.slices_for(160 - c_tok, c_tok + 3) == list(slices)
        ours = objective([s // 16 for s in slices], c)
        best = min(objective([b - a for a, b in zip((0, *cut), (*cut, n))], c)
                   for k in range(n) for cut in itertools.combinations(range(1, n), k))
        assert ours == pytest.approx(best, rel=1e-9)
        as_own = [s // 16 for s in plan.slicing.slices_for(160 - c_tok)]
        assert ours <= objective(as_own, c) * (1 + 1e-9)


def test_link_latency_is_the_fastest_small_message():
    """A slow 8-byte round trip (a host answering late) does not become the link's latency: the
    fastest message up to 4 KB does; the bandwidth comes from the large messages alone."""
    from hpipe.profiler.links import fit_alpha_beta

    beta = 12.5e6                                   # a 100 Mbit/s link
    points = [(n, 2e-4 + n / beta) for n in (1024, 4096, 1 << 20, 4 << 20, 16 << 20)]
    alpha, fitted = fit_alpha_beta([(8, 4e-3), *points])
    assert alpha == pytest.approx(2e-4 + 1024 / beta)
    assert fitted == pytest.approx(beta, rel=1e-6)
    alpha, _ = fit_alpha_beta([(8, 1e-4), *points])
    assert alpha == pytest.approx(1e-4)
    assert fit_alpha_beta([(1 << 20, 0.1), (2 << 20, 0.2)])[0] == pytest.approx(0.1)   # no small messages
