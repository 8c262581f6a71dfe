"""`hpipe launch`'s progress (launcher/progress.py): its time left against the model its docstring
states, worked by hand here from stage 0's pulses; the lines a launch prints: tests/test_launch_local.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hpipe import protocol
from hpipe.launcher.progress import PRIOR_S, JobProgress, duration
from hpipe.launcher.pulses import Pulses
from hpipe.request import Request


def requests(n: int, prompt: int, max_new: int) -> list[Request]:
    return [Request(i, f"q{i}", tuple(range(1, prompt + 1)), max_new_tokens=max_new) for i in range(n)]


def take(pulses: Pulses, rank: int, t: float, kinds: dict) -> None:
    """A pulse of the window ending at t, come at t (one clock); kinds: kind -> [seconds, tokens]."""
    kinds = {k: [s, n, 1] for k, (s, n) in kinds.items()}
    pulses.take(protocol.Pulse(rank, t, 1.0, sum(s for s, _, _ in kinds.values()), kinds, 0, 0, 0, []), received=t)


class Shown:
    def __init__(self):
        self.shown = []

    def show(self, p):
        self.shown.append(p)

    close = show


def test_time_left_weighs_prompt_tokens_by_the_measured_cost_and_outputs_by_what_finished_ones_used():
    plan = SimpleNamespace(stages=[None, None], predicted=None)
    progress = JobProgress(requests(4, 100, 50), plan, Shown())
    pulses = Pulses()
    assert progress.eta_s(pulses, 10.0) is None                   # nothing measured, nothing predicted
    take(pulses, 0, 11.0, {"prefill": [0.5, 400]})           # stage 0: every prompt prefilled
    take(pulses, 1, 11.0, {"prefill": [0.8, 400]})           # stage 1 is the busier one
    take(pulses, 0, 12.0, {"decode": [0.6, 60]})
    take(pulses, 1, 12.0, {"decode": [0.9, 60]})
    progress.finished("q0", 25)                                    # it used half its max_new_tokens
    # a prompt token costs (0.8 / 400) / (0.9 / 60) decode tokens on the busiest stage
    ratio = (0.8 / 400) / (0.9 / 60)
    work = ratio * 400 + (25 - 1) + 3 * (50 * 0.5 - 1)               # a first token comes with the prefill
    done = ratio * 400 + 60
    elapsed = 14.0 - 10.0                                          # since the first pulse's window began
    assert progress.eta_s(pulses, 14.0) == pytest.approx((work - done) / (done / elapsed))
    snap = progress.snapshot(pulses, ("h1",), now=14.0)
    assert (snap.done, snap.total, snap.lost) == (1, 4, ("h1",))
    assert "1/4 prompts" in snap.line() and "hosts lost: h1" in snap.line()
    for r in ("q1", "q2", "q3"):
        progress.finished(r, 50)
    assert progress.eta_s(pulses, 15.0) == 0.0


def test_the_plans_prediction_starts_the_rate_and_sets_the_cost_of_a_prompt_token():
    plan = SimpleNamespace(stages=[None], predicted={"throughput_tokens_per_s": 2000.0,
                                                      "decode": {"tokens_per_s": 50.0}})
    progress = JobProgress(requests(2, 100, 40), plan, Shown())
    pulses = Pulses()
    ratio = 50.0 / 2000.0
    work = ratio * 200 + 2 * (40 - 1)
    assert progress.eta_s(pulses, 0.0) == pytest.approx(work / 50.0)                   # the plan's alone
    take(pulses, 0, 2.0, {"prefill": [0.1, 200], "decode": [0.5, 10]})
    done = ratio * 200 + 10
    rate = (done + PRIOR_S * 50.0) / (1.0 + PRIOR_S)
    assert progress.eta_s(pulses, 2.0) == pytest.approx((work - done) / rate)


def test_after_a_lost_host_the_prompts_left_count_from_where_the_new_pipeline_starts():
    plan = SimpleNamespace(stages=[None, None], predicted=None)
    reqs = requests(3, 10, 20)
    progress = JobProgress(reqs, plan, Shown())
    pulses = Pulses()
    take(pulses, 0, 1.0, {"prefill": [0.1, 30], "decode": [0.4, 20]})
    take(pulses, 1, 1.0, {"prefill": [0.1, 30], "decode": [0.4, 20]})
    progress.finished("q0", 20)
    pulses.clear()                                     # the new pipeline: 2 stages, q1 and q2 from their start
    progress.restart(pulses, reqs[1:], SimpleNamespace(stages=[None, None], predicted=None))
    assert progress.eta_s(pulses, 5.0) is None        # no stage of it computed yet
    take(pulses, 0, 6.0, {"prefill": [0.1, 20], "decode": [0.4, 10]})
    take(pulses, 1, 6.0, {"prefill": [0.1, 20], "decode": [0.4, 10]})
    ratio = (0.2 / 50) / (0.8 / 30)                    # the busiest stage's, over the whole job
    work = 2 * (ratio * 10 + (20 - 1))
    done = ratio * 20 + 10
    assert progress.eta_s(pulses, 7.0) == pytest.approx((work - done) / (done / 2.0))


def test_durations_read_as_people_write_them():
    assert [duration(s) for s in (0.4, 59, 61, 3600 + 125)] == ["0s", "59s", "1m01s", "1h02m"]
