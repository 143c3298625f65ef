"""Reading a merged trace back: tracks, spans, and the async-output overlap.

The overlap is the point of the two-phase output: while a worker's output
thread copies request N off the device (COPY_SPAN on ``worker_output_track``),
its main stream already runs the forward of request N+1 (FORWARD_SPAN on
``worker_main_track``). Track and span names come from ``diffrt.tracing``, where
the code that records them gets them too; a trace with spans but none of the
worker spans read here raises TraceError rather than reporting no overlap.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diffrt.tracing import (
    BENCH_TRACK,
    COPY_SPAN,
    FORWARD_SPAN,
    WORKER_MAIN,
    WORKER_OUTPUT,
    parse_worker_track,
    track_sort_index,
    worker_main_track,
    worker_output_track,
)


class TraceError(ValueError):
    """The trace lacks the tracks or spans the analysis reads (e.g. a renamed span)."""


@dataclass
class Span:
    name: str
    start_us: float
    end_us: float
    args: dict[str, Any] = field(default_factory=dict)

    @property
    def keys(self) -> tuple[str, ...]:
        keys = self.args.get("keys") or ()
        return tuple(str(k) for k in keys) if isinstance(keys, (list, tuple)) else (str(keys),)

    def overlaps(self, other: Span) -> bool:
        return self.start_us < other.end_us and other.start_us < self.end_us


@dataclass
class Track:
    process: str
    name: str
    pid: int
    tid: int
    spans: list[Span] = field(default_factory=list)

    @property
    def label(self) -> str:
        return self.name if self.name.startswith(self.process) else f"{self.process}: {self.name}"


def load_trace(path: str | os.PathLike) -> dict[str, Any]:
    """Parse a trace-event JSON file (object form or bare array form)."""
    data = json.loads(Path(path).read_text())
    if isinstance(data, list):
        data = {"traceEvents": data}
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise ValueError(f"{path}: not a trace-event file (no traceEvents list)")
    return data


def _track_order(track: Track) -> tuple:
    """The viewer's row order, with the bench windows on top."""
    return (track.name != BENCH_TRACK, track_sort_index(track.name), track.name)


def tracks(trace: dict[str, Any]) -> list[Track]:
    """Every track holding spans, ordered bench, engine, worker0 main/output, worker1 ..."""
    procs: dict[int, str] = {}
    names: dict[tuple[int, int], str] = {}
    found: dict[tuple[int, int], Track] = {}
    events = trace["traceEvents"]
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            procs[e["pid"]] = e["args"]["name"]
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            names[(e["pid"], e["tid"])] = e["args"]["name"]
    for e in events:
        if e.get("ph") != "X":
            continue
        key = (e["pid"], e["tid"])
        if key not in found:
            found[key] = Track(procs.get(e["pid"], f"pid {e['pid']}"),
                               names.get(key, f"thread {e['tid']}"), *key)
        found[key].spans.append(Span(e["name"], float(e["ts"]), float(e["ts"]) + float(e["dur"]),
                                     e.get("args") or {}))
    result = sorted(found.values(), key=_track_order)
    for t in result:
        t.spans.sort(key=lambda s: s.start_us)
    return result


def _worker_streams(rows: list[Track]) -> dict[tuple[int, int], dict[str, Track]]:
    """{(pid, rank): {WORKER_MAIN: track, WORKER_OUTPUT: track}} of every worker in ``rows``."""
    workers: dict[tuple[int, int], dict[str, Track]] = {}
    for t in rows:
        parsed = parse_worker_track(t.name)
        if parsed is not None:
            rank, stream = parsed
            workers.setdefault((t.pid, rank), {})[stream] = t
    return workers


def _spans(streams: dict[str, Track], stream: str, name: str) -> list[Span]:
    track = streams.get(stream)
    return [s for s in track.spans if s.name == name] if track else []


def _check_worker_spans(rows: list[Track]) -> None:
    """Raise TraceError when spans were traced but not the worker spans the
    overlap analysis reads: FORWARD_SPAN on a worker main track, and only
    COPY_SPAN on a worker output track that holds spans."""
    if not rows:
        return
    workers = _worker_streams(rows)
    found = ", ".join(sorted({f"{t.name!r}: {s.name!r}" for t in rows for s in t.spans}))
    if not any(_spans(streams, WORKER_MAIN, FORWARD_SPAN) for streams in workers.values()):
        raise TraceError(f"no {FORWARD_SPAN!r} span on a worker main track "
                         f"({worker_main_track(0)!r}, ...); the trace holds {found}")
    for streams in workers.values():
        out = streams.get(WORKER_OUTPUT)
        if out is not None and out.spans and not _spans(streams, WORKER_OUTPUT, COPY_SPAN):
            raise TraceError(f"no {COPY_SPAN!r} span on {out.name!r} (expected on "
                             f"{worker_output_track(0)!r}, ...); the trace holds {found}")


def find_async_overlaps(trace: dict[str, Any]) -> list[tuple[Span, Span]]:
    """(forward, copy) pairs of one worker where a forward ran while the
    output of an EARLIER forward (other keys) was copied.

    The copy is of an earlier forward when the forward its keys name started
    before this one; without keys, when the copy started first. (On a loaded
    machine the copy thread may start a moment after the next forward did:
    the copy still ran beside it.)

    Raises TraceError for a trace whose spans do not include the worker spans
    this reads (see ``_check_worker_spans``).
    """
    rows = tracks(trace)
    _check_worker_spans(rows)
    pairs = []
    for streams in _worker_streams(rows).values():
        forwards = _spans(streams, WORKER_MAIN, FORWARD_SPAN)
        copies = _spans(streams, WORKER_OUTPUT, COPY_SPAN)
        for fwd in forwards:
            for copy in copies:
                if copy.keys and fwd.keys:
                    if set(copy.keys) & set(fwd.keys):
                        continue  # its own forward's output
                    own = [f for f in forwards if set(f.keys) & set(copy.keys)]
                    earlier = (min(f.start_us for f in own) < fwd.start_us if own
                               else copy.start_us < fwd.start_us)
                else:
                    earlier = copy.start_us < fwd.start_us
                if earlier and fwd.overlaps(copy):
                    pairs.append((fwd, copy))
    return pairs


def measured_ms(rows: list[Track]) -> float:
    """The time the trace is about: the bench windows, else first to last span."""
    bench = [t for t in rows if t.name == BENCH_TRACK]
    if bench:
        return sum(s.end_us - s.start_us for s in bench[0].spans) / 1000
    spans = [s for t in rows for s in t.spans]
    if not spans:
        return 0.0
    return (max(s.end_us for s in spans) - min(s.start_us for s in spans)) / 1000


def summarize(trace: dict[str, Any]) -> str:
    """One line per track (spans, busy time and its share of the measured
    time: an idle worker main stream is the device bubble) plus the overlap count.

    Raises TraceError as ``find_async_overlaps`` does.
    """
    rows = tracks(trace)
    overlapped = {id(f) for f, _ in find_async_overlaps(trace)}
    total = measured_ms(rows)
    lines = [f"  measured: {total:.1f} ms"]
    for t in rows:
        if t.name == BENCH_TRACK:
            continue
        busy_ms = sum(s.end_us - s.start_us for s in t.spans) / 1000
        share = f" ({100 * busy_ms / total:.0f}%)" if total > 0 else ""
        noun = "span" if len(t.spans) == 1 else "spans"
        lines.append(f"  {t.label}: {len(t.spans)} {noun}, {busy_ms:.1f} ms busy{share}")
    workers = _worker_streams(rows).values()
    forwards = sum(len(_spans(w, WORKER_MAIN, FORWARD_SPAN)) for w in workers)
    copies = sum(len(_spans(w, WORKER_OUTPUT, COPY_SPAN)) for w in workers)
    if forwards:
        note = "" if copies else f" (no {COPY_SPAN!r} spans: output was copied synchronously)"
        lines.append(f"  forwards overlapping the previous output copy: "
                     f"{len(overlapped)} of {forwards}{note}")
    return "\n".join(lines)


def add_output_flows(trace: dict[str, Any]) -> int:
    """Add flow arrows (Perfetto/Chrome "s"/"f" events) from each forward to the
    output copy of the same requests, so the viewer links request N's forward
    to its copy even while request N+1's forward runs. Returns the count."""
    flows: list[dict[str, Any]] = []
    for streams in _worker_streams(tracks(trace)).values():
        main, out_track = streams.get(WORKER_MAIN), streams.get(WORKER_OUTPUT)
        if main is None or out_track is None:
            continue
        forwards = _spans(streams, WORKER_MAIN, FORWARD_SPAN)
        for copy in _spans(streams, WORKER_OUTPUT, COPY_SPAN):
            sources = [f for f in forwards
                       if f.start_us <= copy.start_us and set(f.keys) & set(copy.keys)]
            if not sources:
                continue
            fwd = max(sources, key=lambda f: f.start_us)
            flow_id = len(flows) // 2 + 1
            common = {"name": "output", "cat": "diffrt", "id": flow_id, "pid": main.pid}
            flows.append({**common, "ph": "s", "tid": main.tid,
                          "ts": max(fwd.start_us, fwd.end_us - 1.0)})
            flows.append({**common, "ph": "f", "bp": "e", "tid": out_track.tid,
                          "ts": copy.start_us})
    trace["traceEvents"].extend(flows)
    return len(flows) // 2
