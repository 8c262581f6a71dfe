"""`hpipe launch --timeline-out FILE`: the measured run, by the file's suffix, as JSON (every
stage's intervals as the workers reported them), a self-contained HTML page (inline SVG Gantt
charts and a per-stage table) or a PNG (matplotlib).

Each stage is drawn as a few lanes, not one bar, because its intervals overlap in time (a prepare
thread runs beside the compute): compute (coloured by micro-batch kind), prepare, send / wait, and
an "other" lane for sampling and any interval kind this version does not know. With a plan that
carries a prediction, the planner's simulated prefill (HPipe Fig. 6) is drawn above on the same
time scale. The drawing itself is the planner's (`hpipe.planner.svg_gantt` / `plot_gantt`).
"""

from __future__ import annotations

import html
import json
import math
from pathlib import Path

from hpipe import formats
from hpipe.errors import HpipeError
from hpipe.planner import (PALETTE, CostModel, Timeline, check_profile_matches, plot_gantt, predict, pyplot,
                           svg_gantt, timeline_bars)

SUFFIXES = (".json", ".html", ".png")
KIND_COLOURS = {"prefill": PALETTE[0], "decode": PALETTE[1], "mixed": PALETTE[6]}
WHAT_COLOURS = {"prepare": PALETTE[3], "send": PALETTE[4], "wait": PALETTE[7], "sample": PALETTE[5]}
GREY = "#9e9e9e"   # an interval (or compute kind) this version does not know: drawn, but neutral
LANES = (("compute", ("compute",)), ("prepare", ("prepare",)), ("send · wait", ("send", "wait")))
KNOWN = ("compute", "prepare", "wait", "send")   # the table's fixed columns, in this order


def check_timeline_out(path: str) -> None:
    """Fails now, not after the run, on a suffix that cannot be written (or .png without matplotlib)."""
    suffix = Path(path).suffix.lower()
    if suffix not in SUFFIXES:
        raise HpipeError(f"--timeline-out {path}: give a file name ending in {', '.join(SUFFIXES)}")
    if suffix == ".png":
        pyplot("--timeline-out", (".html", ".json"))


def write_run_timeline(path: str, timelines: dict[int, dict], predicted: Timeline | None = None, title: str = "",
                       slices_per_sequence: int | None = None) -> None:
    """`timelines`: rank -> the worker's "timeline" report. `predicted`: the plan's simulated prefill
    (`predicted_timeline`), `slices_per_sequence` its slices per prompt (colours repeat per prompt)."""
    check_timeline_out(path)
    suffix = Path(path).suffix.lower()
    if suffix == ".json":
        with open(path, "w") as f:
            json.dump(_json_data(timelines, predicted), f)
    elif suffix == ".html":
        Path(path).write_text(_html(timelines, predicted, title, slices_per_sequence))
    else:
        _png(path, timelines, predicted, title, slices_per_sequence)


def _json_data(timelines: dict[int, dict], predicted: Timeline | None) -> dict:
    data = {"version": 1, "stages": [timelines[r] for r in sorted(timelines)]}
    if predicted is not None:
        data["predicted"] = {"makespan_s": predicted.makespan, "start": predicted.start.tolist(),
                             "end": predicted.end.tolist(), "send_end": predicted.send_end.tolist()}
    return data


def run_span(timelines: dict[int, dict]) -> tuple[float, float]:
    """The run: first start to last end of any stage (wall-clock seconds)."""
    return min(t["start"] for t in timelines.values()), max(t["end"] for t in timelines.values())


def stage_table(timelines: dict[int, dict]) -> dict[int, dict]:
    """Per stage: seconds per interval kind ("what"), compute micro-batches per kind, and the busy
    fraction (compute seconds / the run's span, the same span for every stage)."""
    if not timelines:
        return {}
    start, end = run_span(timelines)
    span = max(end - start, 1e-9)
    out = {}
    for r, t in sorted(timelines.items()):
        seconds: dict[str, float] = {w: 0.0 for w in KNOWN}
        mbs = {k: 0 for k in KIND_COLOURS}
        for i in t["intervals"]:
            seconds[i["what"]] = seconds.get(i["what"], 0.0) + i["end"] - i["start"]
            if i["what"] == "compute":
                mbs[i.get("kind")] = mbs.get(i.get("kind"), 0) + 1
        out[r] = {"busy": seconds["compute"] / span, "seconds": seconds, "microbatches": mbs}
    return out


def colour_of(interval: dict) -> str:
    if interval["what"] == "compute":
        return KIND_COLOURS.get(interval.get("kind"), GREY)
    return WHAT_COLOURS.get(interval["what"], GREY)


def hover_of(interval: dict, t0: float) -> str:
    when = f"{interval['start'] - t0:.4f}-{interval['end'] - t0:.4f} s"
    if interval["what"] == "compute":
        return f"mb {interval.get('mb')} {interval.get('kind')}, {interval.get('tokens')} tokens: {when}"
    return f"{interval['what']}: {when}"


def lanes(timelines: dict[int, dict]) -> list[tuple[str, tuple[str, ...] | None]]:
    """The lanes of every stage; the "other" lane (None: every what not in another lane) only when
    some stage has such an interval, so that all stages keep the same lanes."""
    placed = {w for _, whats in LANES for w in whats}
    other = any(i["what"] not in placed for t in timelines.values() for i in t["intervals"])
    return [*LANES, ("other", None)] if other else list(LANES)


def stage_name(t: dict) -> str:
    units = t.get("units") or [0, 0]
    return f"{t['rank']}: {t['host']}/{t['device']} [{units[0]}-{units[1] - 1}]"


def measured_bars(timelines: dict[int, dict], t0: float):
    """(bars, row labels): every interval on its stage's lane, times from t0."""
    ls = lanes(timelines)
    placed = {w for _, whats in LANES for w in whats}
    bars, labels = [], []
    for r, t in sorted(timelines.items()):
        base = len(labels)
        labels += [f"{stage_name(t)} {ls[0][0]}", *(name for name, _ in ls[1:])]
        for i in t["intervals"]:
            lane = next(k for k, (_, whats) in enumerate(ls)
                        if (i["what"] in whats if whats is not None else i["what"] not in placed))
            bars.append((base + lane, i["start"] - t0, i["end"] - t0, colour_of(i), hover_of(i, t0)))
    return bars, labels


def predicted_parts(timelines: dict[int, dict], predicted: Timeline, slices_per_sequence: int | None):
    """(bars, row labels, title) of the plan's simulated prefill, rows named like the measured stages."""
    m, d = predicted.start.shape
    n = slices_per_sequence or m
    ranks = sorted(timelines)
    names = [stage_name(timelines[ranks[j]]) if j < len(ranks) else f"stage {j}" for j in range(d)]
    title = (f"predicted by the plan: prefill of {max(m // n, 1)} x {n} slices, makespan "
             f"{predicted.makespan:.3f} s")
    return timeline_bars(predicted, n), names, title


def chart_span(timelines: dict[int, dict], predicted: Timeline | None) -> tuple[float, float]:
    """(t0, span): both charts share one scale, long enough for the run and the prediction."""
    t0, t1 = run_span(timelines) if timelines else (0.0, 0.0)
    ends = [i["end"] for t in timelines.values() for i in t["intervals"]]
    span = max([t1, *ends]) - t0 if timelines else 0.0
    return t0, max(span, predicted.makespan if predicted is not None else 0.0, 1e-9)


def legend_items(timelines: dict[int, dict]) -> list[tuple[str, str]]:
    items = [(k, c) for k, c in KIND_COLOURS.items()] + [(w, c) for w, c in WHAT_COLOURS.items()]
    unknown = any(colour_of(i) == GREY for t in timelines.values() for i in t["intervals"])
    return items + ([("other", GREY)] if unknown else [])


def _table_html(timelines: dict[int, dict]) -> str:
    table = stage_table(timelines)
    extra = sorted({w for row in table.values() for w in row["seconds"]} - set(KNOWN))
    head = ["stage", "busy", *(f"{w} s" for w in (*KNOWN, *extra)), *(f"{k} mbs" for k in KIND_COLOURS)]
    rows = []
    for r, row in table.items():
        cells = [stage_name(timelines[r]), f"{row['busy']:.1%}",
                 *(f"{row['seconds'].get(w, 0.0):.3f}" for w in (*KNOWN, *extra)),
                 *(str(row["microbatches"].get(k, 0)) for k in KIND_COLOURS)]
        rows.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    header = "<tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in head) + "</tr>"
    return f"<table border='1' cellpadding='3' style='border-collapse:collapse'>{header}{''.join(rows)}</table>"


def _html(timelines: dict[int, dict], predicted: Timeline | None, title: str, slices_per_sequence: int | None) -> str:
    t0, span = chart_span(timelines, predicted)
    charts = []
    if predicted is not None:
        bars, names, ptitle = predicted_parts(timelines, predicted, slices_per_sequence)
        charts.append(svg_gantt(bars, names, span, ptitle))
    bars, labels = measured_bars(timelines, t0)
    charts.append(svg_gantt(bars, labels, span, "measured (seconds from the run's start)", row=20,
                            band=len(lanes(timelines))))
    legend = " ".join(f"<span style='display:inline-block;width:12px;height:12px;background:{c}'></span> "
                      f"{html.escape(name)}&nbsp;&nbsp;" for name, c in legend_items(timelines))
    return (f"<!doctype html><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<body style='font-family:sans-serif'><h3>{html.escape(title)}</h3>{'<br>'.join(charts)}"
            f"<p>{legend}</p><p>run span {span:.4f} s; busy = compute seconds / run span</p>"
            f"{_table_html(timelines)}</body>")


def _png(path: str, timelines: dict[int, dict], predicted: Timeline | None, title: str,
         slices_per_sequence: int | None) -> None:
    plt = pyplot("--timeline-out", (".html", ".json"))
    from matplotlib.patches import Patch

    t0, span = chart_span(timelines, predicted)
    bars, labels = measured_bars(timelines, t0)
    charts = [(bars, labels, "measured")]
    if predicted is not None:
        charts.insert(0, predicted_parts(timelines, predicted, slices_per_sequence))
    heights = [0.3 * len(c[1]) + 0.6 for c in charts]
    fig, axes = plt.subplots(len(charts), 1, figsize=(11, sum(heights) + 1.0), sharex=True, squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    for ax, (b, names, sub) in zip(axes[:, 0], charts):
        plot_gantt(ax, b, names)
        ax.set_title(sub, fontsize=9)
        ax.set_xlim(0, span)
        ax.set_xlabel("")   # one axis label, under the last chart
    axes[-1, 0].set_xlabel("seconds from the run's start")
    axes[-1, 0].legend(handles=[Patch(color=c, label=n) for n, c in legend_items(timelines)], fontsize=7,
                       loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def predicted_timeline(job_or_plan, config=None) -> Timeline | None:
    """The plan's predicted prefill as the planner's Timeline, or None when it cannot be had.

    The plan file keeps only the prediction's summary (slices, batch, makespan, per-stage busy
    seconds), not per-slice times, so the pipeline is re-simulated from the profile it names
    (`predicted.profile`) with the model's config (a PreparedJob carries it; a bare Plan needs
    `config`). None when the plan carries no prediction, the profile is gone or no longer matches
    the model or devices, or the re-simulation does not give the plan's makespan (the profile was
    measured again since): a chart is never worth failing the launch for."""
    plan = getattr(job_or_plan, "plan", job_or_plan)
    config = config if config is not None else getattr(job_or_plan, "config", None)
    pr = plan.pipeline_prediction
    if config is None or pr is None:
        return None
    try:
        profile = formats.load_profile(pr.profile)
        check_profile_matches(profile, config, plan.model.name, pr.profile)
        cost = CostModel(profile, config, [(st.host, st.device) for st in plan.stages], pr.profile)
        cuts = [st.units[0] for st in plan.stages] + [plan.stages[-1].units[1]]
        tl = predict(cost, cuts, list(pr.slices), pr.batch)
    except (HpipeError, OSError, KeyError, ValueError, TypeError):
        return None
    return tl if math.isclose(tl.makespan, pr.makespan_s, rel_tol=1e-6) else None
