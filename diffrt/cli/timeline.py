"""Render a merged trace as a timeline picture (one row per track), with matplotlib.

Uses the Agg canvas directly, never pyplot, so no display or global figure
state is involved.
"""

from __future__ import annotations

import os
from typing import Any

from diffrt.cli.trace_analysis import FORWARD, OUTPUT_COPY, tracks

_COLORS = {FORWARD: "#1f77b4", OUTPUT_COPY: "#ff7f0e", "postprocess": "#2ca02c"}
_OTHER_COLORS = ["#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf", "#d62728"]


def _color(name: str, assigned: dict[str, str]) -> str:
    if name not in assigned:
        assigned[name] = _COLORS.get(name) or _OTHER_COLORS[len(assigned) % len(_OTHER_COLORS)]
    return assigned[name]


def plot_timeline(trace: dict[str, Any], out_path: str | os.PathLike, title: str | None = None) -> int:
    """Write the timeline of ``trace`` to ``out_path``; return the number of spans drawn.

    Forward and output-copy spans are labelled with the request they carry
    (#1, #2, ... in order of first appearance), so "forward #2 overlaps
    d2h+pack #1" can be read straight off the picture.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    rows = tracks(trace)
    starts = [s.start_us for t in rows for s in t.spans]
    t0 = min(starts) if starts else 0.0
    t1 = max((s.end_us for t in rows for s in t.spans), default=t0 + 1.0)
    span_ms = max((t1 - t0) / 1000.0, 1e-3)

    fig = Figure(figsize=(14, 1.2 + 0.6 * max(len(rows), 1)), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    colors: dict[str, str] = {}
    ordinals: dict[str, int] = {}
    drawn = 0
    for y, track in enumerate(rows):
        for s in track.spans:
            x, w = (s.start_us - t0) / 1000.0, (s.end_us - s.start_us) / 1000.0
            ax.broken_barh([(x, max(w, span_ms / 2000))], (y - 0.38, 0.76),
                           facecolors=_color(s.name, colors), edgecolor="black", linewidth=0.3)
            drawn += 1
            if s.name in (FORWARD, OUTPUT_COPY) and s.keys and w > span_ms / 60:
                label = ",".join(f"#{ordinals.setdefault(k, len(ordinals) + 1)}" for k in s.keys[:3])
                ax.text(x + w / 2, y, label, ha="center", va="center", fontsize=7, clip_on=True)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([t.label for t in rows])
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    ax.set_xlim(0, span_ms * 1.01)
    ax.grid(axis="x", linestyle=":", linewidth=0.5)
    ax.set_title(title or "diffrt timeline")
    if colors:
        ax.legend(handles=[Patch(facecolor=c, label=n) for n, c in colors.items()],
                  loc="upper right", fontsize=8, ncol=min(len(colors), 4))
    fig.tight_layout()
    fig.savefig(os.fspath(out_path))
    return drawn
