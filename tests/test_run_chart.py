"""`hpipe launch --timeline-out`: the measured run as JSON, HTML (inline SVG) or PNG, with the plan's
predicted prefill beside it. Synthetic timelines only: no model, no processes."""

from __future__ import annotations

import importlib.util
import json
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from hpipe import formats, models
from hpipe.errors import HpipeError
from hpipe.launcher import predicted_timeline, write_run_summary, write_run_timeline
from hpipe.launcher.jobs import JobOutput, PreparedJob
from hpipe.launcher.run_chart import GREY, KIND_COLOURS, WHAT_COLOURS
from hpipe.planner import plan_from_profile, simulate
from hpipe.profiler import profile_estimate

EXAMPLES = Path(__file__).resolve().parent.parent / "profiles" / "examples"
T0 = 1_700_000_000.0   # wall-clock seconds, as the workers report them


def compute(mb, kind, tokens, start, end):
    return {"what": "compute", "start": T0 + start, "end": T0 + end, "mb": mb, "kind": kind, "tokens": tokens}


def other(what, start, end):
    return {"what": what, "start": T0 + start, "end": T0 + end}


def stage(rank, start, end, intervals):
    return {"rank": rank, "host": "localhost", "device": "cpu", "units": [10 * rank, 10 * rank + 10],
            "start": T0 + start, "end": T0 + end, "load_s": 0.5, "peak_rss_bytes": 1 << 28, "kv_bytes": 1 << 20,
            "intervals": intervals}


def synthetic() -> dict[int, dict]:
    """Three stages: two prefill slices, a mixed and two decode micro-batches each, prepares that
    overlap the compute, sends and waits; the last stage samples."""
    out = {}
    for r in range(3):
        d = 0.1 * r
        ivs = [other("prepare", d + 0.00, d + 0.05), compute(0, "prefill", 256, d + 0.05, d + 0.35),
               other("prepare", d + 0.30, d + 0.36),   # overlaps slice 0's compute
               compute(1, "prefill", 128, d + 0.36, d + 0.50), compute(2, "mixed", 130, d + 0.50, d + 0.60),
               compute(3, "decode", 2, d + 0.70, d + 0.72), compute(4, "decode", 2, d + 0.80, d + 0.82)]
        ivs += [other("send", d + 0.35, d + 0.37), other("wait", d + 0.60, d + 0.70)] if r < 2 else \
               [other("sample", d + 0.72, d + 0.73)]
        out[r] = stage(r, 0.0 + 0.01 * r, 1.0 + 0.01 * r, ivs)
    return out


def svgs(page: str) -> list[str]:
    return re.findall(r"<svg.*?</svg>", page, re.S)


def titled_rects(svg: str) -> list[tuple[float, str, str]]:
    """(y, fill, hover) of every block: the rects with a <title> (lane shading has none)."""
    return [(float(y), fill, title) for y, fill, title in
            re.findall(r'<rect x="[^"]*" y="([^"]*)" [^>]*fill="([^"]*)"[^>]*><title>([^<]*)</title></rect>', svg)]


def table_rows(page: str) -> list[list[str]]:
    table = re.search(r"<table.*?</table>", page, re.S).group(0)
    return [re.findall(r"<t[dh]>([^<]*)</t[dh]>", row) for row in re.findall(r"<tr>.*?</tr>", table)]


def test_html_draws_every_interval_in_its_lane_and_colour(tmp_path):
    timelines = synthetic()
    page_path = tmp_path / "run.html"
    write_run_timeline(str(page_path), timelines, title="three stages")
    page = page_path.read_text()
    assert "<script" not in page and "http" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")
    (svg,) = svgs(page)
    rects = titled_rects(svg)
    intervals = [i for r in sorted(timelines) for i in timelines[r]["intervals"]]
    assert len(rects) == len(intervals)
    lane_y = {}
    for (y, fill, hover), i in zip(rects, intervals):
        if i["what"] == "compute":
            assert fill == KIND_COLOURS[i["kind"]]
            assert f"mb {i['mb']} {i['kind']}, {i['tokens']} tokens" in hover
        else:
            assert fill == WHAT_COLOURS[i["what"]] and hover.startswith(i["what"])
        assert f"{i['start'] - T0:.4f}-{i['end'] - T0:.4f} s" in hover   # seconds from the run's start
        lane_y.setdefault(i["what"], set()).add(y)
    assert len({KIND_COLOURS["prefill"], KIND_COLOURS["decode"], KIND_COLOURS["mixed"]}) == 3
    # overlapping intervals of one stage sit on different lanes: compute, prepare, send/wait, other
    assert lane_y["compute"].isdisjoint(lane_y["prepare"]) and lane_y["prepare"].isdisjoint(lane_y["send"])
    assert lane_y["send"] == lane_y["wait"] and lane_y["sample"].isdisjoint(lane_y["send"] | lane_y["compute"])
    for name in ("prefill", "decode", "mixed", "prepare", "send", "wait"):
        assert f"</span> {name}" in page   # the legend


def test_busy_table_matches_an_independent_sum(tmp_path):
    timelines = synthetic()
    page_path = tmp_path / "run.html"
    write_run_timeline(str(page_path), timelines)
    header, *rows = table_rows(page_path.read_text())
    col = {h: k for k, h in enumerate(header)}
    span = max(t["end"] for t in timelines.values()) - min(t["start"] for t in timelines.values())
    assert len(rows) == 3
    for r, row in zip(sorted(timelines), rows):
        ivs = timelines[r]["intervals"]
        secs = {w: sum(i["end"] - i["start"] for i in ivs if i["what"] == w) for w in ("compute", "prepare", "wait",
                                                                                   "send")}
        assert float(row[col["busy"]].rstrip("%")) / 100 == pytest.approx(secs["compute"] / span, abs=5e-4)
        for w, s in secs.items():
            assert float(row[col[f"{w} s"]]) == pytest.approx(s, abs=5e-4)
        for kind in ("prefill", "decode", "mixed"):
            assert int(row[col[f"{kind} mbs"]]) == sum(i.get("kind") == kind for i in ivs)
    assert [row[col["sample s"]] for row in rows] == ["0.000", "0.000", "0.010"]


def test_unknown_intervals_are_grey(tmp_path):
    timelines = synthetic()
    timelines[1]["intervals"].append(other("defrag", 0.9, 0.95))
    page_path = tmp_path / "run.html"
    write_run_timeline(str(page_path), timelines)
    rects = titled_rects(svgs(page_path.read_text())[0])
    assert [fill for _, fill, hover in rects if hover.startswith("defrag")] == [GREY]


def test_json_is_todays_data_and_carries_the_prediction(tmp_path):
    timelines = synthetic()
    path = tmp_path / "t.json"
    write_run_timeline(str(path), {r: timelines[r] for r in (2, 0, 1)})
    assert json.loads(path.read_text()) == {"version": 1, "stages": [timelines[r] for r in (0, 1, 2)]}
    tl = simulate(np.full((4, 3), 0.1), np.full((4, 3), 0.01))
    write_run_timeline(str(path), timelines, tl)
    data = json.loads(path.read_text())
    assert data["stages"] == [timelines[r] for r in (0, 1, 2)]
    assert data["predicted"]["makespan_s"] == pytest.approx(tl.makespan)
    assert np.allclose(data["predicted"]["start"], tl.start) and np.allclose(data["predicted"]["end"], tl.end)


def test_predicted_chart_sits_above_on_the_same_scale(tmp_path):
    tl = simulate(np.full((4, 3), 0.3), np.full((4, 3), 0.02))   # longer than the measured run
    assert tl.makespan > 1.02
    page_path = tmp_path / "run.html"
    write_run_timeline(str(page_path), synthetic(), tl, "with prediction", slices_per_sequence=4)
    page = page_path.read_text()
    predicted, measured = svgs(page)
    assert "predicted by the plan" in predicted and len(titled_rects(predicted)) == 12
    assert all(hover.startswith("slice ") for _, _, hover in titled_rects(predicted))
    ticks = re.compile(r">([0-9.]+) s</text>")
    assert ticks.findall(predicted) == ticks.findall(measured)
    assert float(ticks.findall(measured)[-1]) == pytest.approx(tl.makespan, abs=1e-3)


def test_a_bad_suffix_names_the_flag(tmp_path):
    path = tmp_path / "t.svg"
    with pytest.raises(HpipeError, match="--timeline-out") as err:
        write_run_timeline(str(path), synthetic())
    assert str(path) in str(err.value) and ".html" in str(err.value) and "\n" not in str(err.value)
    assert not path.exists()


def test_png_is_written_or_refused_in_one_line(tmp_path):
    path = tmp_path / "t.png"
    tl = simulate(np.full((4, 3), 0.1))
    if importlib.util.find_spec("matplotlib") is None:
        with pytest.raises(HpipeError, match="matplotlib") as err:
            write_run_timeline(str(path), synthetic(), tl)
        assert "--timeline-out" in str(err.value) and ".html" in str(err.value) and "\n" not in str(err.value)
    else:
        write_run_timeline(str(path), synthetic(), tl, "png")
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def paper_plan(tmp_path_factory):
    """A plan with a prediction, from an estimated profile of the paper's testbed (no weights)."""
    d = tmp_path_factory.mktemp("paper")
    config = models.config_for("llama-7b")
    profile_estimate("llama-7b", formats.load_inventory(EXAMPLES / "hpipe-paper.toml"), str(d / "p.json"),
                     "float16", None)
    profile = formats.load_profile(d / "p.json")
    devices = [(x.host, x.device) for x in profile.devices]
    result = plan_from_profile(profile, str(d / "p.json"), "llama-7b", config, devices, seq_len=512)
    formats.write_plan(result.plan, d / "plan.json")
    return formats.load_plan(d / "plan.json"), config, result.timeline, d


def test_predicted_timeline_re_simulates_the_plan(paper_plan):
    plan, config, expected, d = paper_plan
    tl = predicted_timeline(plan, config)
    assert np.allclose(tl.start, expected.start) and np.allclose(tl.end, expected.end)
    assert predicted_timeline(plan) is None   # a bare plan without the model's config
    assert predicted_timeline(replace(plan, predicted=None), config) is None
    gone = replace(plan, predicted=replace(plan.predicted, profile=str(d / "missing.json")))
    assert predicted_timeline(gone, config) is None
    # the profile was measured again since: its simulation is no longer the plan's prediction
    remeasured = replace(plan, predicted=replace(plan.predicted, makespan_s=plan.predicted.makespan_s * 1.5))
    assert predicted_timeline(remeasured, config) is None


def test_write_run_summary_draws_the_plans_prediction(paper_plan, tmp_path):
    plan, config, expected, _ = paper_plan
    job = PreparedJob(plan, source=None, config=config, tokenizer=None, requests=[], skipped=[])
    out = tmp_path / "results.jsonl"
    timelines = {r: stage(r, 0.0, 1.0, [compute(0, "prefill", 512, 0.1 * r, 0.1 * r + 0.1)])
                 for r in range(len(plan.stages))}
    output = JobOutput(str(out), tokenizer=None, timelines=timelines)
    summary = write_run_summary(job, output, str(out), str(tmp_path / "run.html"))
    assert summary["busy_fraction"] == pytest.approx({r: 0.1 for r in timelines}, abs=1e-6)
    predicted, measured = svgs((tmp_path / "run.html").read_text())
    assert len(titled_rects(predicted)) == expected.start.size and len(titled_rects(measured)) == len(timelines)
    assert (Path(f"{out}.summary.json")).exists()
