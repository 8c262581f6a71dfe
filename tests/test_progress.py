"""`hpipe launch`'s progress (launcher/progress.py): its time left against the model its docstring
states, worked by hand here; the lines a launch prints: tests/test_launch_local.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hpipe import protocol
from hpipe.launcher.progress import DRAIN, PRIOR_S, JobProgress, duration
from hpipe.launcher.pulses import Pulses
from hpipe.prediction import DecodePrediction, DecodeTerms, Prediction
from hpipe.request import Request


def requests(n: int, prompt: int, max_new: int) -> list[Request]:
    return [Request(i, f"q{i}", tuple(range(1, prompt + 1)), max_new_tokens=max_new) for i in range(n)]


def take(pulses: Pulses, rank: int, t: float, busy_s: float, decoded: int = 4) -> None:
    """A pulse of the window (t - 1, t], come at t (one clock), with `decoded` decode tokens."""
    pulses.take(protocol.Pulse(rank, t, 1.0, busy_s, {"decode": [busy_s, decoded, 1]}, 0, 0, 0, []), received=t)


class Shown:
    def __init__(self):
        self.shown = []

    def show(self, p):
        self.shown.append(p)

    close = show

    def due(self):
        return True


def plan(stages: int, predicted=None):
    return SimpleNamespace(stages=[None] * stages, pipeline_prediction=predicted)


def test_time_left_is_the_prompts_left_at_the_rate_they_finish():
    progress = JobProgress(requests(8, 100, 50), plan(2), Shown())
    pulses = Pulses()
    assert progress.eta_s(pulses, 10.0) is None                # nothing finished, nothing predicted
    take(pulses, 0, 11.0, 0.5)                                 # the stages first computed at 10.0
    take(pulses, 1, 11.0, 0.8)
    # stage 0 decoded 4 tokens: 4 / 50 of an answer under way, in 2 s; a step of 4 rows: 4 in flight
    assert progress.eta_s(pulses, 12.0) == pytest.approx((8 - 0.08 + DRAIN * 4) / (0.08 / 2.0))
    progress.finished("q0", 25)
    progress.finished("q1", 50)
    # stage 0 decoded 4 tokens so far, fewer than the answers' 24 + 49 (a first token comes with the prefill)
    assert progress.eta_s(pulses, 14.0) == pytest.approx((6 + DRAIN * 4) / (2 / 4.0))
    take(pulses, 0, 14.0, 0.5, decoded=73 + 75 - 4)           # 75 under way: 1.5 answers of the longest, 50
    # steps of 74 rows on average now: no more in flight than the 6 left
    assert progress.eta_s(pulses, 14.0) == pytest.approx((6 - 1.5 + DRAIN * 6) / ((2 + 1.5) / 4.0))
    snap = progress.snapshot(pulses, ("h1",), now=14.0)
    assert (snap.done, snap.total, snap.lost) == (2, 8, ("h1",))
    assert "2/8 prompts" in snap.line() and "hosts lost: h1" in snap.line()
    for i in range(2, 8):
        progress.finished(f"q{i}", 50)
    assert progress.eta_s(pulses, 15.0) == 0.0


def test_the_plans_prediction_starts_the_rate():
    decode = DecodePrediction(new_tokens=40, rows_per_group=4, groups=1, context=120.0, stage_step_s=(0.08,),
                              round_s=0.08, tokens_per_s=50.0, terms=DecodeTerms((0.08,), (), 0.0, "measured"))
    predicted = Prediction(profile="profile.json", seq_len=100, batch=4, slices=(100,), makespan_s=0.2,
                           throughput_tokens_per_s=2000.0, decode=decode)
    progress = JobProgress(requests(4, 100, 40), plan(1, predicted), Shown())
    pulses = Pulses()
    rate = 4 / (4 * (100 / 2000.0 + 40 / 50.0))                 # prompts a second, as the plan predicts them
    assert progress.eta_s(pulses, 0.0) == pytest.approx(4 / rate)
    take(pulses, 0, 2.0, 0.9)
    progress.finished("q0", 40)
    assert progress.eta_s(pulses, 3.0) == pytest.approx((3 + DRAIN * 3) / ((1 + PRIOR_S * rate) / (2.0 + PRIOR_S)))


def test_after_a_lost_host_the_prompts_left_count_from_where_the_new_pipeline_starts():
    reqs = requests(4, 10, 20)
    progress = JobProgress(reqs, plan(3), Shown())
    pulses = Pulses()
    take(pulses, 0, 1.0, 0.5)
    progress.finished("q0", 20)
    pulses.clear()                                             # the new pipeline: 2 stages, q1..q3 from their start
    progress.restart(pulses, reqs[1:], plan(2))
    assert progress.eta_s(pulses, 5.0) is None                 # none of them finished on it yet
    take(pulses, 0, 6.0, 0.5)                                  # it first computed at 5.0
    progress.finished("q1", 20)
    assert progress.eta_s(pulses, 9.0) == pytest.approx((2 + DRAIN * 2) / (1 / 4.0))
    assert len(progress.snapshot(pulses, now=9.0).busy) == 2


def test_durations_read_as_people_write_them():
    assert [duration(s) for s in (0.4, 59, 61, 3600 + 125)] == ["0s", "59s", "1m01s", "1h02m"]
