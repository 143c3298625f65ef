"""Plain aligned text tables.

Plain text rather than `rich`: one dependency fewer, and the output stays
readable when piped into a file, `grep` or a CI log.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def format_cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    if isinstance(value, (list, tuple)):
        return ", ".join(format_cell(v) for v in value) or "-"
    return str(value)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], title: str | None = None) -> str:
    """Left-align the first column, right-align the others (they are mostly numbers)."""
    cells = [[format_cell(v) for v in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        for i, text in enumerate(row):
            widths[i] = max(widths[i], len(text))

    def line(row: Sequence[str]) -> str:
        parts = [row[0].ljust(widths[0])] + [t.rjust(w) for t, w in zip(row[1:], widths[1:], strict=True)]
        return "  ".join(parts).rstrip()

    out = [title] if title else []
    out += [line(list(headers)), "  ".join("-" * w for w in widths)]
    out += [line(row) for row in cells]
    return "\n".join(out)


def format_pairs(pairs: Sequence[tuple[str, Any]], title: str | None = None) -> str:
    """A two-column key/value table, left-aligned (values are mostly words)."""
    width = max((len(k) for k, _ in pairs), default=0)
    out = [title] if title else []
    out += [f"  {k.ljust(width)}  {format_cell(v)}" for k, v in pairs]
    return "\n".join(out)
