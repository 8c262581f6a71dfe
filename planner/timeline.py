"""The simulated pipeline as a Gantt chart, one row per stage, one block per slice (like HPipe's
Fig. 6): `hpipe plan ... --timeline FILE.html` (a self-contained page with an SVG) or `.png`
(needs matplotlib).

The drawing is shared with the launcher's measured chart (`hpipe.launcher.run_chart`): a chart is
a list of bars `(row, start, end, colour, hover text)` with row labels, drawn by `svg_gantt` (an
inline SVG) or `plot_gantt` (a matplotlib axes); `timeline_bars` turns a simulated `Timeline` into
bars and `pyplot` imports matplotlib or fails with one line."""

from __future__ import annotations

import html
from pathlib import Path

import numpy as np

from hpipe.errors import HpipeError
from hpipe.planner.simulate import Timeline

PALETTE = ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7", "#9c755f"]


def timeline_bars(tl: Timeline, n_slices: int) -> list[tuple[int, float, float, str, str]]:
    """One bar per slice per stage; a sequence's i-th slice has the same colour on every stage."""
    m, d = tl.start.shape
    out = []
    for j in range(d):
        for i in range(m):
            start, end = float(tl.start[i, j]), float(tl.end[i, j])
            out.append((j, start, end, PALETTE[(i % n_slices) % len(PALETTE)], f"slice {i}: {start:.4f}-{end:.4f} s"))
    return out


def write_timeline(tl: Timeline, stage_names: list[str], n_slices: int, path: str, title: str) -> None:
    suffix = Path(path).suffix.lower()
    if suffix == ".html":
        Path(path).write_text(_html(tl, stage_names, n_slices, title))
    elif suffix == ".png":
        _png(tl, stage_names, n_slices, path, title)
    else:
        raise HpipeError(f"--timeline {path}: give a .html or .png file name")


def svg_gantt(bars, labels: list[str], span: float, title: str, width: int = 1000, row: int = 34,
              band: int = 0) -> str:
    """An <svg> of `bars` on rows named by `labels`, time 0..span seconds (so that two charts drawn
    with the same span share their scale). `band` > 0 shades every other group of that many rows,
    to tell apart the lanes of neighbouring stages."""
    left, top = 190, 40
    scale = (width - left - 20) / max(span, 1e-12)
    n = len(labels)
    height = top + n * row + 40
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
             f'font-size="12">', f'<text x="{left}" y="20" font-size="14">{html.escape(title)}</text>']
    groups = -(-n // band) if band else 0
    for g in range(1, groups, 2):
        parts.append(f'<rect x="0" y="{top + g * band * row}" width="{width}" height="{band * row}" fill="#f3f3f3"/>')
    for j, name in enumerate(labels):
        y = top + j * row
        parts.append(f'<text x="{left - 8}" y="{y + row / 2 + 4}" text-anchor="end">{html.escape(name)}</text>')
    pad = max(1, row // 8)
    for j, start, end, color, hover in bars:
        x, w, y = left + start * scale, max((end - start) * scale, 0.5), top + j * row + pad
        parts.append(f'<rect x="{x:.2f}" y="{y}" width="{w:.2f}" height="{row - 2 * pad}" fill="{color}" '
                     f'stroke="white" stroke-width="0.5"><title>{html.escape(hover)}</title></rect>')
    for k in range(6):
        t = span * k / 5
        x = left + t * scale
        parts.append(f'<line x1="{x:.1f}" y1="{top - 4}" x2="{x:.1f}" y2="{top + n * row}" stroke="#ccc"/>')
        parts.append(f'<text x="{x:.1f}" y="{top + n * row + 16}" text-anchor="middle">{t:.3f} s</text>')
    parts.append("</svg>")
    return "".join(parts)


def _html(tl: Timeline, names: list[str], n_slices: int, title: str) -> str:
    svg = svg_gantt(timeline_bars(tl, n_slices), names, tl.makespan, title)
    busy = tl.busy() / max(tl.makespan, 1e-12)
    rows = "".join(f"<tr><td>{html.escape(n)}</td><td>{b:.0%}</td></tr>" for n, b in zip(names, busy))
    return (f"<!doctype html><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<body style='font-family:sans-serif'>{svg}"
            f"<p>makespan {tl.makespan:.4f} s</p><table><tr><th>stage</th><th>busy</th></tr>{rows}</table></body>")


def pyplot(flag: str, others: tuple[str, ...] = (".html",)):
    """matplotlib.pyplot on the file-only Agg backend; without matplotlib one line naming the flag
    and the formats that need nothing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        need = "needs" if len(others) == 1 else "need"
        raise HpipeError(f"{flag} .png needs matplotlib (pip install matplotlib); {' and '.join(others)} "
                         f"{need} nothing") from None
    return plt


def plot_gantt(ax, bars, labels: list[str]) -> None:
    """The bars of `svg_gantt` on a matplotlib axes, first row on top."""
    for j, start, end, color, _ in bars:
        ax.barh(j, end - start, left=start, color=color, edgecolor="white", linewidth=0.4)
    ax.set_yticks(np.arange(len(labels)), labels=labels)
    ax.invert_yaxis()
    ax.set_xlabel("seconds")


def _png(tl: Timeline, names: list[str], n_slices: int, path: str, title: str) -> None:
    plt = pyplot("--timeline")
    fig, ax = plt.subplots(figsize=(10, 0.5 * len(names) + 1.2))
    plot_gantt(ax, timeline_bars(tl, n_slices), names)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
