"""The decisions of a cluster that loses a host (launcher/elastic.py), without hosts: the plans made
over the hosts still up, the refusal when they cannot hold the model (against the memory it
needs, summed here), and how long a lost host must answer before it is taken back. The runs
through a killed worker, a downed link and a host's return are in test_ssh.py (emulated hosts)."""

from __future__ import annotations

import json

import pytest

from hpipe import formats, models, planner
from hpipe.errors import HpipeError
from hpipe.launcher.elastic import MAX_REJOIN_AFTER_S, REJOIN_AFTER_S, HostWatch, Replanner
from hpipe.planner import MARGIN
from netns_hosts import FREE, elastic_profile

HOSTS = ["h0", "h1", "h2"]


@pytest.fixture(scope="module")
def model():
    source = models.resolve_model("smollm2")
    return source, models.load_config(source.path)


@pytest.fixture(scope="module")
def profiled(model, tmp_path_factory):
    """A plan over three hosts from a profile in which each holds FREE bytes."""
    _, config = model
    path = elastic_profile(HOSTS, tmp_path_factory.mktemp("elastic") / "profile.json")
    profile = formats.load_profile(path)
    result = planner.plan_from_profile(profile, str(path), "smollm2", config, [(h, "cpu") for h in HOSTS], 64)
    return result.plan, profile


def covers_every_unit(plan: formats.Plan, n_units: int) -> bool:
    bounds = [s.units for s in plan.stages]
    return bounds[0][0] == 0 and bounds[-1][1] == n_units and all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))


def test_a_profiled_plan_is_made_again_over_the_hosts_up(model, profiled):
    _, config = model
    plan, profile = profiled
    assert [s.host for s in plan.stages] == HOSTS
    replanner = Replanner(plan, config, "smollm2")
    for up in ({"h0", "h2"}, {"h0", "h1"}, {"h1", "h2"}):
        again = replanner.plan_for(up)
        assert {s.host for s in again.stages} <= up and covers_every_unit(again, models.num_units(config))
        assert again.weights == plan.weights and again.dtype == plan.dtype
        assert again.predicted.seq_len == plan.predicted.seq_len
        # the planner's memory model on each stage, within the profile's free memory less the margin
        assert all(m <= FREE * (1 - MARGIN) for m in again.predicted.memory_bytes_per_stage)
    assert replanner.predicted_s(replanner.plan_for(set(HOSTS))) <= replanner.predicted_s(replanner.plan_for({"h0", "h1"}))


def test_one_host_left_that_cannot_hold_the_model_is_refused_with_the_cause(model, profiled):
    _, config = model
    plan, profile = profiled
    weights = sum(profile.bytes.weights_per_unit)
    assert weights > FREE * (1 - MARGIN)                 # the weights alone overflow one host
    with pytest.raises(HpipeError, match=r"the hosts still up \(h1\) cannot hold the model"):
        Replanner(plan, config, "smollm2").plan_for({"h1"})
    with pytest.raises(HpipeError, match="no host of the plan is up"):
        Replanner(plan, config, "smollm2").plan_for(set())


def test_a_plan_without_a_profile_gets_equal_cuts_and_keeps_its_slicing(model):
    _, config = model
    plan = planner.make_plan("smollm2", config, [(h, "cpu") for h in HOSTS], None, None, 5, 8, "float32", "gguf")
    again = Replanner(plan, config, "smollm2").plan_for({"h0", "h2"})
    n = models.num_units(config)
    expected = planner.make_plan("smollm2", config, [("h0", "cpu"), ("h2", "cpu")], None, None, 5, 8, "float32",
                                 "gguf")
    assert [s.units for s in again.stages] == [s.units for s in expected.stages] and covers_every_unit(again, n)
    assert again.slicing == plan.slicing and again.weights == "gguf"
    assert json.dumps(again.to_json())     # a plan file the workers read


def test_a_host_lost_again_waits_longer_before_it_is_taken_back():
    inventory = formats.Inventory(formats.SSHSettings(), (formats.Host("h0", "10.0.0.1", "python3", ("cpu",)),))
    watch = HostWatch(inventory)
    try:
        watch.lose("h0")
        assert watch.hold_s("h0") == REJOIN_AFTER_S
        with watch.lock:
            watch.lost["h0"] = 100.0                     # answering since t = 100
        assert watch.back(now=100 + REJOIN_AFTER_S - 0.1) == set() and watch.back(now=100 + REJOIN_AFTER_S) == {"h0"}
        watch.regain("h0")
        watch.lose("h0")
        watch.lose("h0")
        assert watch.hold_s("h0") == 4 * REJOIN_AFTER_S
        for _ in range(20):
            watch.lose("h0")
        assert watch.hold_s("h0") == MAX_REJOIN_AFTER_S
    finally:
        watch.close()
