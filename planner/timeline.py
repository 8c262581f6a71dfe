"""The simulated pipeline as a Gantt chart, one row per stage, one block per slice (like HPipe's
Fig. 6): `hpipe plan ... --timeline FILE.html` (a self-contained page with an SVG) or `.png`
(needs matplotlib)."""

from __future__ import annotations

import html
from pathlib import Path

import numpy as np

from hpipe.errors import HpipeError
from hpipe.planner.simulate import Timeline

PALETTE = ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7", "#9c755f"]


def _blocks(tl: Timeline, n_slices: int):
    m, d = tl.start.shape
    for j in range(d):
        for i in range(m):
            yield j, i, float(tl.start[i, j]), float(tl.end[i, j]), PALETTE[(i % n_slices) % len(PALETTE)]


def write_timeline(tl: Timeline, stage_names: list[str], n_slices: int, path: str, title: str) -> None:
    suffix = Path(path).suffix.lower()
    if suffix == ".html":
        Path(path).write_text(_html(tl, stage_names, n_slices, title))
    elif suffix == ".png":
        _png(tl, stage_names, n_slices, path, title)
    else:
        raise HpipeError(f"--timeline {path}: give a .html or .png file name")


def _html(tl: Timeline, names: list[str], n_slices: int, title: str) -> str:
    width, row, left, top = 1000, 34, 190, 40
    scale = (width - left - 20) / max(tl.makespan, 1e-12)
    d = len(names)
    height = top + d * row + 40
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
             f'font-size="12">', f'<text x="{left}" y="20" font-size="14">{html.escape(title)}</text>']
    for j, name in enumerate(names):
        y = top + j * row
        parts.append(f'<text x="{left - 8}" y="{y + row / 2 + 4}" text-anchor="end">{html.escape(name)}</text>')
    for j, i, start, end, color in _blocks(tl, n_slices):
        x, w, y = left + start * scale, max((end - start) * scale, 0.5), top + j * row + 4
        parts.append(f'<rect x="{x:.2f}" y="{y}" width="{w:.2f}" height="{row - 8}" fill="{color}" stroke="white" '
                     f'stroke-width="0.5"><title>slice {i}: {start:.4f}-{end:.4f} s</title></rect>')
    for k in range(6):
        t = tl.makespan * k / 5
        x = left + t * scale
        parts.append(f'<line x1="{x:.1f}" y1="{top - 4}" x2="{x:.1f}" y2="{top + d * row}" stroke="#ccc"/>')
        parts.append(f'<text x="{x:.1f}" y="{top + d * row + 16}" text-anchor="middle">{t:.3f} s</text>')
    parts.append("</svg>")
    busy = tl.busy() / max(tl.makespan, 1e-12)
    rows = "".join(f"<tr><td>{html.escape(n)}</td><td>{b:.0%}</td></tr>" for n, b in zip(names, busy))
    return (f"<!doctype html><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<body style='font-family:sans-serif'>{''.join(parts)}"
            f"<p>makespan {tl.makespan:.4f} s</p><table><tr><th>stage</th><th>busy</th></tr>{rows}</table></body>")


def _png(tl: Timeline, names: list[str], n_slices: int, path: str, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise HpipeError("--timeline .png needs matplotlib (pip install matplotlib); .html needs nothing") from None
    fig, ax = plt.subplots(figsize=(10, 0.5 * len(names) + 1.2))
    for j, i, start, end, color in _blocks(tl, n_slices):
        ax.barh(j, end - start, left=start, color=color, edgecolor="white", linewidth=0.4)
    ax.set_yticks(np.arange(len(names)), labels=names)
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
