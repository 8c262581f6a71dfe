"""`hpipe plan` without a profile: uniform and hand-made plans, from --stages or a cluster file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hpipe import formats, models
from hpipe.cli import main
from hpipe.planner import uniform_cuts

EXAMPLE = Path(__file__).resolve().parent.parent / "profiles" / "examples" / "office.toml"


@given(n_units=st.integers(3, 400), data=st.data())
def test_uniform_cuts_are_balanced(n_units, data):
    n_stages = data.draw(st.integers(1, n_units))
    bounds = [0, *uniform_cuts(n_units, n_stages), n_units]
    sizes = [b - a for a, b in zip(bounds, bounds[1:])]
    assert len(sizes) == n_stages and min(sizes) >= 1 and max(sizes) - min(sizes) <= 1


def test_plan_from_cluster_file(tiny_models, tmp_path):
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", str(tiny_models["gpt2"]), "--cluster", str(EXAMPLE), "-o", str(out)]) == 0
    plan = formats.load_plan(out)
    assert [(s.host, s.device) for s in plan.stages] == [("workstation", "cuda:0"), ("workstation", "cuda:1"),
                                                         ("nas", "cpu")]
    assert [s.units for s in plan.stages] == [(0, 3), (3, 7), (7, 10)]
    assert plan.model.family == "gpt2" and plan.model.units == 10 and plan.model.blocks == 4


def test_hand_made_plan_and_unit_names(tiny_models, tmp_path):
    out = tmp_path / "plan.json"
    path = tiny_models["llama"]
    assert main(["plan", "--model", str(path), "--stages", "3", "--cuts", "2,7", "--slices", "64,32",
                 "--granularity", "8", "-o", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [s["units"] for s in data["stages"]] == [[0, 2], [2, 7], [7, 10]]
    assert data["slicing"]["lengths"] == [64, 32] and data["slicing"]["granularity"] == 8
    assert data["model"]["name"] == str(path.resolve())
    config = models.load_config(path)
    names = [models.unit_name(config, u) for u in range(models.num_units(config))]
    assert names[:4] == ["embed", "block0.attn", "block0.mlp", "block1.attn"] and names[-1] == "head"
    # unit 2 (block 0's MLP half) starts stage 1: the cut falls inside block 0
    assert names[data["stages"][1]["units"][0]] == "block0.mlp"


PROFILE = Path(__file__).resolve().parent.parent / "profiles" / "smollm2-cpu-1thread-quick.json"


@pytest.mark.parametrize("argv,needle", [
    (["--stages", "2", "--cluster", str(EXAMPLE)], "give one of --stages N"),
    (["--stages", "0"], "--stages must be at least 1, got 0"),
    (["--stages", "2", "--device", "tpu"], "--device"),
    (["--stages", "2", "--num-slices", "0"], "--num-slices must be at least 1"),
    (["--stages", "2", "--granularity", "0"], "--granularity must be at least 1"),
    (["--stages", "2", "--dtype", "int4"], "--dtype 'int4': use one of float32"),
    (["--stages", "2", "--mode", "both"], "--mode 'both': use 'pipeline' or 'sidp'"),
    (["--stages", "2", "--speculative", "ngram:4"], "--speculative and --acceptance go together"),
    (["--stages", "2", "--speculative", "guess"], "--speculative 'guess'"),
    (["--stages", "2", "--seq-len", "256"], "plan from measured times: add --profile FILE"),
    (["--stages", "2", "--order", "search"], "plan from measured times: add --profile FILE"),
    (["--stages", "2", "--cuts", "9", "--profile", str(PROFILE), "--seq-len", "256"], "--cuts and --profile exclude"),
    (["--stages", "2", "--profile", str(PROFILE)], "--profile needs --seq-len N"),
    (["--stages", "2", "--profile", str(PROFILE), "--seq-len", "256", "--order", "best"], "--order 'best'"),
    (["--stages", "2", "--profile", str(PROFILE), "--seq-len", "256", "--objective", "speed"], "--objective 'speed'"),
    (["--stages", "2", "--cuts", "2,x"], "--cuts '2,x': expected comma-separated integers"),
    (["--mode", "sidp", "--profile", str(PROFILE), "--seq-len", "256", "--sidp-source", "disk"], "--sidp-source 'disk'"),
    (["--mode", "sidp", "--profile", str(PROFILE), "--seq-len", "256", "--max-batch", "0"], "--max-batch must be at least 1"),
])
def test_a_plans_options_that_do_not_hold_are_one_line_and_no_file(argv, needle, tmp_path, capsys):
    """PlanRequest's checks (and the planner's where the option needs the profile), each as the user
    sees it: exit 2, one line naming the option, nothing written."""
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "smollm2", *argv, "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err
    assert not out.exists()
