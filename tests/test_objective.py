"""`hpipe plan --objective decode|mixed`: cuts that balance the decode steps the runtime will run
(from the profile's decode tables), checked against every possible cut."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpipe import formats, models
from hpipe.planner import decode_prediction, objective_seconds, plan_from_profile

PROFILE = Path(__file__).resolve().parent.parent / "profiles" / "smollm2-cpu-1thread-quick.json"


@pytest.fixture(scope="module")
def setup():
    profile = formats.load_profile(str(PROFILE))
    config = models.load_config(models.resolve_model("smollm2").path)
    devices = [(d.host, d.device) for d in profile.devices] * 2
    return profile, config, devices


def plan(setup, objective: str, seq_len: int = 256, batch: int = 8, new_tokens: int = 64):
    profile, config, devices = setup
    return plan_from_profile(profile, str(PROFILE), "smollm2", config, devices, seq_len, batch,
                             objective=objective, new_tokens=new_tokens)


def test_decode_objective_is_the_best_cut_for_decode(setup):
    profile, config, devices = setup
    result = plan(setup, "decode")
    n_units = models.num_units(config)
    # a round of decode: 2 groups' steps on the slowest stage, or one trip through both stages and
    # back, whichever binds (decode_prediction); the plan's cut is the best over every cut
    rounds = {c: decode_prediction(result.cost, [0, c, n_units], 8, 256, 64).round_s for c in range(1, n_units)}
    assert result.plan.predicted.decode.round_s <= min(rounds.values()) * (1 + 1e-9)
    # the LM head weighs more in a decode step than in a prompt slice: the decode cut leaves the
    # last stage fewer units than the prefill cut does
    prefill = plan(setup, "prefill")
    assert result.cuts[1] > prefill.cuts[1]
    assert result.plan.predicted.decode.tokens_per_s > prefill.plan.predicted.decode.tokens_per_s


def test_mixed_objective_balances_the_sum_of_both(setup):
    """mixed: prefill slices and decode steps share the stages (as under continuous batching), so
    the cuts minimise the largest per-stage sum of both, checked against every cut."""
    from hpipe.planner import decode_workload, workload
    from hpipe.planner.partition import stage_time

    profile, config, devices = setup
    result = plan(setup, "mixed")
    pre_t, pre_c = workload(result.cost, result.slices, 8)
    dec_t, dec_c = decode_workload(result.cost, 8, 256, 64)
    unit_time, out_comm = pre_t + dec_t, pre_c + dec_c
    n_units = models.num_units(config)

    def bottleneck(c):
        return max(stage_time(unit_time, out_comm, 0, 0, c), stage_time(unit_time, out_comm, 1, c, n_units))

    best = min(bottleneck(c) for c in range(1, n_units))
    assert bottleneck(result.cuts[1]) <= best * (1 + 1e-9)
    assert result.plan.predicted.objective == "mixed"
    cuts = {o: plan(setup, o).cuts[1] for o in ("prefill", "decode")}
    assert cuts["prefill"] <= result.cuts[1] <= cuts["decode"]
    assert objective_seconds(result) > 0


def test_objective_needs_a_profile_and_a_known_name(setup, tmp_path):
    from hpipe.cli import main

    assert main(["plan", "--model", "smollm2", "--stages", "2", "--objective", "decode", "-o",
                 str(tmp_path / "p.json")]) == 2
    with pytest.raises(formats.HpipeError, match="--objective 'speed'"):
        plan(setup, "speed")


def test_the_plan_carries_algorithm_2_for_every_prompt_length(setup):
    """Serving: a prompt of any length gets HPipe's latency-optimal slicing. The plan's table holds,
    for every length up to --seq-len in steps of the granularity, exactly what Algorithm 2 gives
    when run for that length alone, and the runtime's lookup cuts a shorter prompt from the next
    entry."""
    from hpipe.planner.profiled import slice_time_table, slices_in_tokens
    from hpipe.planner.slicing import slice_sequence
    result = plan(setup, "prefill", seq_len=320, batch=1)
    table = result.plan.slicing.by_seq_len
    assert sorted(table) == list(range(16, 321, 16))
    for length in (16, 48, 160, 304):
        alone = slice_sequence(slice_time_table(result.cost, result.cuts, length, 16), 2).lengths
        assert list(table[length]) == slices_in_tokens(alone, 16, length), length
    got = result.plan.slicing.slices_for(150)
    assert sum(got) == 150 and got[:-1] == list(table[160][:len(got) - 1])
