"""Render a merged trace as a timeline picture (one row per track), with matplotlib.

A bench trace gets one panel per configuration (the spans of its
``BENCH_TRACK``), each on its own time axis, so a slow configuration does not squash a
fast one. Uses the Agg canvas directly, never pyplot: no display and no global
figure state.
"""

from __future__ import annotations

import os
from typing import Any

from diffrt.cli.trace_analysis import Span, Track, tracks
from diffrt.tracing import BENCH_TRACK, COPY_SPAN, FORWARD_SPAN, POSTPROCESS_SPAN

_COLORS = {FORWARD_SPAN: "#1f77b4", COPY_SPAN: "#ff7f0e", POSTPROCESS_SPAN: "#2ca02c"}
_OTHER_COLORS = ["#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf", "#d62728"]


def _color(name: str, assigned: dict[str, str]) -> str:
    if name not in assigned:
        assigned[name] = _COLORS.get(name) or _OTHER_COLORS[len(assigned) % len(_OTHER_COLORS)]
    return assigned[name]


def _panels(rows: list[Track]) -> tuple[list[Track], list[Span]]:
    """(rows to draw, one window per panel): the bench windows, or everything."""
    bench = [t for t in rows if t.name == BENCH_TRACK]
    others = [t for t in rows if t.name != BENCH_TRACK]
    if bench and bench[0].spans:
        return others, bench[0].spans
    starts = [s.start_us for t in rows for s in t.spans]
    t0 = min(starts, default=0.0)
    t1 = max((s.end_us for t in rows for s in t.spans), default=t0 + 1.0)
    return rows, [Span("", t0, t1)]


def _draw_panel(ax: Any, rows: list[Track], window: Span, colors: dict[str, str],
                ordinals: dict[str, int]) -> int:
    t0 = window.start_us
    width_ms = max((window.end_us - t0) / 1000.0, 1e-3)
    drawn = 0
    for y, track in enumerate(rows):
        for s in track.spans:
            if s.end_us < window.start_us or s.start_us > window.end_us:
                continue
            x, w = (s.start_us - t0) / 1000.0, (s.end_us - s.start_us) / 1000.0
            ax.broken_barh([(x, max(w, width_ms / 2000))], (y - 0.38, 0.76),
                           facecolors=_color(s.name, colors), edgecolor="black", linewidth=0.3)
            drawn += 1
            if s.name in (FORWARD_SPAN, COPY_SPAN) and s.keys and w > width_ms / 60:
                label = ",".join(f"#{ordinals.setdefault(k, len(ordinals) + 1)}" for k in s.keys[:3])
                ax.text(x + w / 2, y, label, ha="center", va="center", fontsize=7, clip_on=True)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([t.label for t in rows])
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlim(0, width_ms * 1.01)
    ax.grid(axis="x", linestyle=":", linewidth=0.5)
    return drawn


def plot_timeline(trace: dict[str, Any], out_path: str | os.PathLike, title: str | None = None) -> int:
    """Write the timeline of ``trace`` to ``out_path``; return the number of spans drawn.

    Forward and output-copy spans are labelled with the request they carry
    (#1, #2, ... in order of first appearance in each panel), so "forward #2 overlaps
    d2h+pack #1" can be read straight off the picture.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    rows, windows = _panels(tracks(trace))
    panel_h = 0.8 + 0.5 * max(len(rows), 1)
    fig = Figure(figsize=(14, 0.9 + panel_h * len(windows)), dpi=100)
    FigureCanvasAgg(fig)
    colors: dict[str, str] = {}
    drawn = 0
    axes = fig.subplots(len(windows), 1, squeeze=False)[:, 0]
    for ax, window in zip(axes, windows, strict=True):
        drawn += _draw_panel(ax, rows, window, colors, ordinals={})  # #1.. per panel
        if window.name:
            ax.set_title(window.name, fontsize=10, loc="left")
    axes[-1].set_xlabel("time (ms)")
    fig.suptitle(title or "diffrt timeline")
    if colors:
        fig.legend(handles=[Patch(facecolor=c, label=n) for n, c in colors.items()],
                   loc="lower center", ncol=min(len(colors), 6), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.05 if colors else 0, 1, 1))
    fig.savefig(os.fspath(out_path))
    return drawn
