"""Timeline tracing in Chrome/Perfetto trace-event format, across processes.

Tracing is off unless ``DIFFRT_TRACE_DIR`` names a folder (spawned workers
inherit it). Each process appends complete ("X") events, one JSON object per
line, to its own file there; ``merge_traces`` joins them into one trace file.
Timestamps come from CLOCK_MONOTONIC, which every process on a machine shares,
so spans of the engine, the workers and their output threads line up.

Each named track ("worker0 main", "worker0 output", "engine loop", ...) becomes
one thread row in the viewer, whatever OS thread wrote to it. The track, span
and process names that code emits and that trace analysis reads back are
declared below, once: a renamed span then changes both sides together.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

TRACE_DIR_ENV = "DIFFRT_TRACE_DIR"

logger = logging.getLogger(__name__)

# -- names shared by the code that records spans and the code that reads them ----
#: Process label of the engine (the process that runs the busy loop).
ENGINE_PROCESS = "engine"
#: The engine's busy loop: one span per executor call, named after what it asks
#: the runner to do (``execute_batch`` or ``execute_step``).
ENGINE_LOOP_TRACK = "engine loop"
#: The engine's post-processing of finished requests: POSTPROCESS_SPAN spans.
ENGINE_POST_TRACK = "engine postprocess"
#: ``diffrt bench``: one span per measured configuration, named after it.
BENCH_TRACK = "bench"
#: One execute RPC on a worker's main stream (``worker_main_track``).
FORWARD_SPAN = "forward"
#: Copying one execute's outputs off the device into shared memory, on the
#: output thread (``worker_output_track``); overlaps the next FORWARD_SPAN when
#: output is asynchronous.
COPY_SPAN = "d2h+pack"
#: Turning one finished request's tensors into images, on ENGINE_POST_TRACK.
POSTPROCESS_SPAN = "postprocess"

WORKER_MAIN = "main"
WORKER_OUTPUT = "output"
_WORKER_TRACK = re.compile(rf"^worker(\d+) ({WORKER_MAIN}|{WORKER_OUTPUT})$")


def worker_process(rank: int) -> str:
    """Process label of the worker of ``rank``; a prefix of its track names."""
    return f"worker{rank}"


def worker_main_track(rank: int) -> str:
    """The track of the worker's main stream (its FORWARD_SPAN spans)."""
    return f"{worker_process(rank)} {WORKER_MAIN}"


def worker_output_track(rank: int) -> str:
    """The track of the worker's output thread (its COPY_SPAN spans)."""
    return f"{worker_process(rank)} {WORKER_OUTPUT}"


def parse_worker_track(track: str) -> tuple[int, str] | None:
    """(rank, WORKER_MAIN or WORKER_OUTPUT) of a worker track name; None for any other track."""
    m = _WORKER_TRACK.match(track)
    return (int(m.group(1)), m.group(2)) if m else None


_lock = threading.Lock()
_file: TextIO | None = None
_file_pid: int | None = None
_tracks: dict[str, int] = {}


def enabled() -> bool:
    return bool(os.environ.get(TRACE_DIR_ENV))


def enable(trace_dir: str | os.PathLike) -> None:
    """Turn tracing on for this process and every worker it spawns later."""
    Path(trace_dir).mkdir(parents=True, exist_ok=True)
    _close()
    os.environ[TRACE_DIR_ENV] = str(trace_dir)


def disable() -> None:
    """Turn tracing off and close this process's trace file (flushes it)."""
    os.environ.pop(TRACE_DIR_ENV, None)
    _close()


def _close() -> None:
    global _file, _file_pid
    with _lock:
        if _file is not None:
            _file.close()
        _file, _file_pid = None, None
        _tracks.clear()


def now_us() -> float:
    """The trace clock (CLOCK_MONOTONIC) in microseconds."""
    return time.monotonic_ns() / 1000.0


def _open_locked(pid: int) -> TextIO | None:
    """This process's trace file, opened; None when tracing was turned off."""
    global _file, _file_pid
    trace_dir = os.environ.get(TRACE_DIR_ENV)
    if not trace_dir:  # disabled by another thread since the caller checked
        return None
    path = Path(trace_dir) / f"trace-{pid}.jsonl"
    _file = open(path, "a", buffering=1)  # noqa: SIM115 - lives for the process
    _file_pid = pid
    _tracks.clear()
    return _file


def track_sort_index(track: str) -> int:
    """Rows in reading order: engine threads, then each worker's main stream
    above its output thread, then anything else."""
    if track == ENGINE_LOOP_TRACK:
        return 0
    if track.startswith(ENGINE_PROCESS + " "):
        return 1
    worker = parse_worker_track(track)
    if worker is not None:
        rank, stream = worker
        return 10 + 2 * rank + (stream != WORKER_MAIN)
    return 1000


def _write(event: dict[str, Any]) -> None:
    pid = os.getpid()
    with _lock:
        # First event, or we are a forked child: open this process's own file.
        file = _file if _file is not None and _file_pid == pid else _open_locked(pid)
        if file is None:
            return
        track = event.pop("track", None)
        if track is None:
            event.update(pid=pid, tid=0)
        else:
            if track not in _tracks:
                _tracks[track] = tid = len(_tracks) + 1
                for meta in ({"name": "thread_name", "args": {"name": track}},
                             {"name": "thread_sort_index",
                              "args": {"sort_index": track_sort_index(track)}}):
                    file.write(json.dumps({"ph": "M", "pid": pid, "tid": tid, **meta}) + "\n")
            event.update(pid=pid, tid=_tracks[track])
        file.write(json.dumps(event, default=str) + "\n")


def record(track: str, name: str, start_us: float, end_us: float, **args: Any) -> None:
    """Record a finished span on ``track`` (e.g. ``worker_main_track(0)``)."""
    if not enabled():
        return
    _write({"ph": "X", "name": name, "ts": start_us, "dur": max(end_us - start_us, 0.0),
            "track": track, "args": args})


def instant(track: str, name: str, **args: Any) -> None:
    """Record a point in time on ``track`` (e.g. a request's arrival)."""
    if not enabled():
        return
    _write({"ph": "i", "s": "t", "name": name, "ts": now_us(), "track": track, "args": args})


@contextlib.contextmanager
def span(track: str, name: str, **args: Any) -> Iterator[None]:
    """Context manager form of ``record``; costs one env lookup when tracing is off."""
    if not enabled():
        yield
        return
    start = now_us()
    try:
        yield
    finally:
        record(track, name, start, now_us(), **args)


def process_name(name: str) -> None:
    """Label this process in the trace viewer."""
    if enabled():
        _write({"ph": "M", "name": "process_name", "args": {"name": name}})


def _read_events(path: Path) -> list[dict[str, Any]]:
    events = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:  # a process killed mid-write leaves a partial line
            logger.warning("skipping a truncated trace line in %s", path)
    return events


def _guess_process_name(events: list[dict[str, Any]]) -> str | None:
    """Name a process that never called ``process_name`` after its tracks."""
    tracks = [e["args"]["name"] for e in events
              if e.get("ph") == "M" and e.get("name") == "thread_name"]
    prefixes = sorted({t.split(" ")[0] for t in tracks})
    return "/".join(prefixes) or None


def _in_windows(event: dict[str, Any], windows: list[tuple[float, float]] | None) -> bool:
    if windows is None or event.get("ph") == "M":
        return True
    start = float(event.get("ts", 0.0))
    end = start + float(event.get("dur", 0.0))
    return any(start <= w_end and end >= w_start for w_start, w_end in windows)


def merge_traces(trace_dir: str | os.PathLike, out_path: str | os.PathLike,
                 windows: list[tuple[float, float]] | None = None) -> dict[str, Any]:
    """Join every per-process file in ``trace_dir`` into one trace-event JSON file.

    Call it after the processes that wrote the files have stopped tracing (the
    engine closed), so every span is on disk. ``windows`` ((start_us, end_us)
    pairs on the ``now_us`` clock) keeps only the spans touching one of them,
    e.g. to leave engine start-up and warm-up out of a benchmark's trace.
    """
    _close()  # flush this process's file
    events: list[dict[str, Any]] = []
    for path in sorted(Path(trace_dir).glob("trace-*.jsonl")):
        proc_events = _read_events(path)
        named = any(e.get("ph") == "M" and e.get("name") == "process_name" for e in proc_events)
        if not named and proc_events:
            guess = _guess_process_name(proc_events)
            if guess:
                proc_events.insert(0, {"ph": "M", "name": "process_name",
                                       "pid": proc_events[0]["pid"], "tid": 0,
                                       "args": {"name": guess}})
        events.extend(e for e in proc_events if _in_windows(e, windows))
    # Metadata first, then spans in time order: easier to read and to diff.
    events.sort(key=lambda e: (e.get("ph") != "M", e.get("ts", 0.0)))
    trace = {"traceEvents": events, "displayTimeUnit": "ms"}
    Path(out_path).write_text(json.dumps(trace))
    return trace
