"""Timeline tracing in Chrome/Perfetto trace-event format, across processes.

Tracing is off unless ``DIFFRT_TRACE_DIR`` names a folder (spawned workers
inherit it). Each process appends complete ("X") events, one JSON object per
line, to its own file there; ``merge_traces`` joins them into one trace file.
Timestamps come from CLOCK_MONOTONIC, which every process on a machine shares,
so spans of the engine, the workers and their output threads line up.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

TRACE_DIR_ENV = "DIFFRT_TRACE_DIR"

_lock = threading.Lock()
_file = None
_file_pid: int | None = None
_tracks: dict[str, int] = {}


def enabled() -> bool:
    return bool(os.environ.get(TRACE_DIR_ENV))


def enable(trace_dir: str | os.PathLike) -> None:
    """Turn tracing on for this process and every worker it spawns later."""
    Path(trace_dir).mkdir(parents=True, exist_ok=True)
    os.environ[TRACE_DIR_ENV] = str(trace_dir)


def disable() -> None:
    global _file, _file_pid
    os.environ.pop(TRACE_DIR_ENV, None)
    with _lock:
        if _file is not None:
            _file.close()
        _file, _file_pid = None, None
        _tracks.clear()


def _now_us() -> float:
    return time.monotonic_ns() / 1000.0


def _write(event: dict[str, Any]) -> None:
    global _file, _file_pid
    pid = os.getpid()
    with _lock:
        if _file is None or _file_pid != pid:
            path = Path(os.environ[TRACE_DIR_ENV]) / f"trace-{pid}.jsonl"
            _file = open(path, "a", buffering=1)  # noqa: SIM115 - lives for the process
            _file_pid = pid
            _tracks.clear()
        track = event.pop("track")
        if track not in _tracks:
            _tracks[track] = len(_tracks) + 1
            meta = {"ph": "M", "name": "thread_name", "pid": pid, "tid": _tracks[track],
                    "args": {"name": track}}
            _file.write(json.dumps(meta) + "\n")
        event.update(pid=pid, tid=_tracks[track])
        _file.write(json.dumps(event) + "\n")


def record(track: str, name: str, start_us: float, end_us: float, **args: Any) -> None:
    """Record a finished span on ``track`` (e.g. "worker0 main", "worker0 output")."""
    if not enabled():
        return
    _write({"ph": "X", "name": name, "ts": start_us, "dur": max(end_us - start_us, 0.0),
            "track": track, "args": args})


@contextlib.contextmanager
def span(track: str, name: str, **args: Any) -> Iterator[None]:
    """Context manager form of ``record``; costs one env lookup when tracing is off."""
    if not enabled():
        yield
        return
    start = _now_us()
    try:
        yield
    finally:
        record(track, name, start, _now_us(), **args)


def process_name(name: str) -> None:
    """Label this process in the trace viewer."""
    if enabled():
        _write({"ph": "M", "name": "process_name", "track": "main", "args": {"name": name}})


def merge_traces(trace_dir: str | os.PathLike, out_path: str | os.PathLike) -> dict[str, Any]:
    """Join every per-process file in ``trace_dir`` into one trace-event JSON file."""
    events: list[dict[str, Any]] = []
    for path in sorted(Path(trace_dir).glob("trace-*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                events.append(json.loads(line))
    trace = {"traceEvents": events, "displayTimeUnit": "ms"}
    Path(out_path).write_text(json.dumps(trace))
    return trace
