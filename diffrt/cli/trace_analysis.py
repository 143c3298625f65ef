"""Reading a merged trace back: tracks, spans, and the async-output overlap.

The overlap is the point of the two-phase output: while a worker's output
thread copies request N off the device ("d2h+pack" on "worker<r> output"), its
main stream already runs the forward of request N+1 ("forward" on
"worker<r> main").
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FORWARD = "forward"
OUTPUT_COPY = "d2h+pack"
BENCH_TRACK = "bench"
_WORKER_TRACK = re.compile(r"^worker(\d+) (main|output)$")


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
    m = _WORKER_TRACK.match(track.name)
    if track.name.startswith("engine"):
        return (1, 0, track.name)
    if m:
        return (2, int(m.group(1)), m.group(2) != "main", track.name)
    return (0 if track.name == BENCH_TRACK else 3, 0, track.name)


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


def find_async_overlaps(trace: dict[str, Any]) -> list[tuple[Span, Span]]:
    """(forward, d2h+pack) pairs of one worker where a forward ran while the
    output of an EARLIER forward (other keys, copy started first) was copied."""
    by_worker: dict[tuple[int, str], dict[str, list[Span]]] = {}
    for t in tracks(trace):
        m = _WORKER_TRACK.match(t.name)
        if m:
            by_worker.setdefault((t.pid, m.group(1)), {})[m.group(2)] = t.spans
    pairs = []
    for streams in by_worker.values():
        forwards = [s for s in streams.get("main", []) if s.name == FORWARD]
        copies = [s for s in streams.get("output", []) if s.name == OUTPUT_COPY]
        for fwd in forwards:
            for copy in copies:
                earlier = copy.start_us < fwd.start_us
                other_request = not (set(copy.keys) & set(fwd.keys)) if copy.keys and fwd.keys else True
                if earlier and other_request and fwd.overlaps(copy):
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
    time: an idle worker main stream is the device bubble) plus the overlap count."""
    rows = tracks(trace)
    total = measured_ms(rows)
    lines = [f"  measured: {total:.1f} ms"]
    for t in rows:
        if t.name == BENCH_TRACK:
            continue
        busy_ms = sum(s.end_us - s.start_us for s in t.spans) / 1000
        share = f" ({100 * busy_ms / total:.0f}%)" if total > 0 else ""
        noun = "span" if len(t.spans) == 1 else "spans"
        lines.append(f"  {t.label}: {len(t.spans)} {noun}, {busy_ms:.1f} ms busy{share}")
    forwards = sum(1 for t in rows for s in t.spans if s.name == FORWARD)
    overlapped = {id(f) for f, _ in find_async_overlaps(trace)}
    if forwards:
        lines.append(f"  forwards overlapping the previous output copy: {len(overlapped)} of {forwards}")
    return "\n".join(lines)


def add_output_flows(trace: dict[str, Any]) -> int:
    """Add flow arrows (Perfetto/Chrome "s"/"f" events) from each forward to the
    output copy of the same requests, so the viewer links request N's forward
    to its d2h+pack even while request N+1's forward runs. Returns the count."""
    flows: list[dict[str, Any]] = []
    by_pid: dict[int, dict[str, Track]] = {}
    for t in tracks(trace):
        by_pid.setdefault(t.pid, {})[t.name] = t
    for named in by_pid.values():
        for name, out_track in named.items():
            m = _WORKER_TRACK.match(name)
            main = named.get(f"worker{m.group(1)} main") if m and m.group(2) == "output" else None
            if main is None:
                continue
            for copy in (s for s in out_track.spans if s.name == OUTPUT_COPY and s.keys):
                sources = [f for f in main.spans if f.name == FORWARD and f.start_us <= copy.start_us
                           and set(f.keys) & set(copy.keys)]
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
