"""One memory model for the planner and the launch preflight, and the planner's lower bound held
against independent references (a grid search of the fractions, every plan the planner and its
baselines produce)."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hpipe import formats, memory, models
from hpipe.launcher.cluster import device_needs
from hpipe.planner import compare, plan_from_profile, predict
from hpipe.planner.bound import balanced_compute

ROOT = Path(__file__).resolve().parent.parent
PAPER_PROFILE = ROOT / "profiles" / "hpipe-paper-llama7b.json"


@pytest.fixture(scope="module")
def paper_plan():
    profile = formats.load_profile(PAPER_PROFILE)
    config = models.config_for("llama-7b")
    devices = [(d.host, d.device) for d in profile.devices]
    return plan_from_profile(profile, str(PAPER_PROFILE), "llama-7b", config, devices, seq_len=1024, batch=3), config


def test_planner_and_preflight_count_the_same_bytes(paper_plan):
    result, config = paper_plan
    plan, pr = result.plan, result.plan.predicted
    kv_tokens, mb_tokens = pr.seq_len * pr.batch, max(pr.slices)
    # the preflight's figure comes from the model itself (models.unit_bytes), the planner's from the profile
    preflight = {}
    for host in {stage.host for stage in plan.stages}:
        for dev, need in device_needs(plan, config, host, kv_tokens, mb_tokens).items():
            preflight[(host, dev)] = need
    planner = {(st.host, st.device): need for st, need in zip(plan.stages, pr.memory_bytes_per_stage)}
    assert preflight == planner
    # and the model is what it says: weights + KV + four activation buffers of the longest slice
    table = models.unit_bytes(config, plan.dtype)
    st0 = plan.stages[0]
    weights = sum(table.weights_per_unit[st0.units[0]:st0.units[1]])
    kv = sum(table.kv_per_token_per_unit[st0.units[0]:st0.units[1]]) * kv_tokens
    acts = 4 * mb_tokens * config.hidden_size * 2   # float16
    assert pr.memory_bytes_per_stage[0] == weights + kv + acts


def _grid_optimum(work: np.ndarray, steps: int = 200) -> float:
    """Brute force for 2 kinds x 2 devices: try every pair of fractions on a grid."""
    best = np.inf
    for a, b in itertools.product(np.linspace(0, 1, steps + 1), repeat=2):
        m = max(a * work[0, 0] + b * work[1, 0], (1 - a) * work[0, 1] + (1 - b) * work[1, 1])
        best = min(best, m)
    return best


@settings(max_examples=25, deadline=None)
@given(st.lists(st.floats(0.1, 10.0), min_size=4, max_size=4))
def test_balance_lp_matches_a_grid_search(values):
    work = np.array(values).reshape(2, 2)
    lp = balanced_compute(work)
    grid = _grid_optimum(work)
    assert lp <= grid + 1e-9                      # the LP is the exact optimum
    assert grid - lp <= 0.01 * max(values)        # and the grid gets within its resolution


def test_balance_lp_is_the_even_split_when_devices_differ_by_a_factor():
    speeds = np.array([1.0, 2.5, 4.0])
    work = np.outer([3.0, 1.0, 0.5], 1 / speeds)   # kinds x devices, every device the same mix
    assert balanced_compute(work) == pytest.approx(1 / np.sum(1 / work.sum(axis=0)), rel=1e-9)


def test_no_plan_beats_the_bound(paper_plan):
    result, _ = paper_plan
    bound = result.bound
    assert bound.makespan_s == max(bound.compute_s, bound.link_s)
    assert bound.compute_s <= bound.even_split_s * (1 + 1e-9)
    assert result.plan.predicted.ratio_to_lower_bound == pytest.approx(result.timeline.makespan / bound.makespan_s)
    assert result.timeline.makespan >= bound.makespan_s
    # any other cuts for the same work (the plan's slices), memory ignored, do no better
    rng = np.random.default_rng(0)
    n_units, d = len(result.cost.kinds), len(result.cost.entries)
    for _ in range(40):
        cuts = [0, *sorted(rng.choice(np.arange(1, n_units), d - 1, replace=False).tolist()), n_units]
        assert predict(result.cost, cuts, result.slices, 3).makespan >= bound.makespan_s
    # the baselines of --compare are all above it as well (other slicings cost at least as much here)
    assert all(row["makespan_s"] >= bound.makespan_s for row in compare(result, 16))
    assert memory.ACTIVATION_BUFFERS == 4
