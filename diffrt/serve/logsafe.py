"""Client-supplied text made safe for a log line.

A decoded path such as ``/health%0AINFO ...`` would otherwise write a forged
line into the log, and ``%00`` NUL bytes; a long value would fill the disk.
Everything a client chose (path, method, header values) goes through
``escape`` before it is logged.
"""

from __future__ import annotations

#: the most characters of one client value a log line keeps
MAX_LOGGED_CHARS = 200


def escape(value: object, limit: int = MAX_LOGGED_CHARS) -> str:
    """``value`` with every non-printable character (line breaks, NUL,
    escape sequences, Unicode separators) as a backslash escape, cut to
    ``limit`` characters with the count of those left out."""
    text = value if isinstance(value, str) else str(value)
    cut = len(text) - limit
    if cut > 0:
        text = text[:limit]
    safe = "".join(ch if ch.isprintable() and ch != "\\" else _escaped(ch) for ch in text)
    return f"{safe}...(+{cut} chars)" if cut > 0 else safe


def _escaped(ch: str) -> str:
    if ch == "\\":
        return "\\\\"
    return ch.encode("unicode_escape").decode("ascii")
