"""Trace files: per-process spans merged into one trace, the overlap finder, the plot."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import struct

import pytest

from diffrt import tracing
from diffrt.cli.timeline import plot_timeline
from diffrt.cli.trace_analysis import (
    TraceError,
    find_async_overlaps,
    load_trace,
    summarize,
    tracks,
)
from diffrt.tracing import (
    BENCH_TRACK,
    COPY_SPAN,
    ENGINE_LOOP_TRACK,
    ENGINE_POST_TRACK,
    FORWARD_SPAN,
    worker_main_track,
    worker_output_track,
)

MAIN0, OUT0 = worker_main_track(0), worker_output_track(0)


@pytest.fixture
def trace_dir(tmp_path):
    d = tmp_path / "spans"
    tracing.enable(d)
    yield d
    tracing.disable()


def _child_spans(trace_dir: str) -> None:
    # a spawned worker inherits DIFFRT_TRACE_DIR through the environment
    from diffrt import tracing as t

    assert t.enabled()
    t.record(MAIN0, FORWARD_SPAN, 10.0, 20.0, method="execute", keys=["a"])
    t.record(OUT0, COPY_SPAN, 19.0, 30.0, keys=["a"])


def test_spans_of_several_processes_merge_into_one_trace(trace_dir, tmp_path):
    tracing.process_name(tracing.ENGINE_PROCESS)
    with tracing.span(ENGINE_LOOP_TRACK, "schedule", n=1):
        pass
    tracing.instant(ENGINE_LOOP_TRACK, "arrival")
    proc = mp.get_context("spawn").Process(target=_child_spans, args=(str(trace_dir),))
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0

    out = tmp_path / "trace.json"
    merged = tracing.merge_traces(trace_dir, out)
    assert json.loads(out.read_text()) == merged
    events = merged["traceEvents"]
    assert {e["pid"] for e in events} == {proc.pid, os.getpid()}
    for e in events:  # the fields the trace-event format requires
        assert {"ph", "name", "pid", "tid"} <= e.keys()
        if e["ph"] == "X":
            assert e["dur"] >= 0 and isinstance(e["ts"], float)
    names = {t.label: [s.name for s in t.spans] for t in tracks(merged)}
    assert names[ENGINE_LOOP_TRACK] == ["schedule"]
    # the child never named its process: the merge names it after its tracks
    assert names[MAIN0] == [FORWARD_SPAN] and names[OUT0] == [COPY_SPAN]


def test_merge_skips_a_line_cut_by_a_killed_process(trace_dir, tmp_path):
    tracing.record(MAIN0, FORWARD_SPAN, 1.0, 2.0)
    tracing.disable()
    (trace_dir / "trace-999999.jsonl").write_text(
        json.dumps({"ph": "X", "name": FORWARD_SPAN, "pid": 999999, "tid": 1, "ts": 1.0, "dur": 1.0})
        + '\n{"ph": "X", "na')
    merged = tracing.merge_traces(trace_dir, tmp_path / "t.json")
    assert sum(e["ph"] == "X" for e in merged["traceEvents"]) == 2


def test_tracing_off_writes_nothing(tmp_path):
    tracing.disable()
    with tracing.span(ENGINE_LOOP_TRACK, "x"):
        pass
    tracing.record(ENGINE_LOOP_TRACK, "y", 0.0, 1.0)
    assert not tracing.enabled()
    assert list(tmp_path.iterdir()) == []


def _synthetic(forwards, copies):
    events = [{"ph": "M", "name": "thread_name", "pid": 7, "tid": 1, "args": {"name": MAIN0}},
              {"ph": "M", "name": "thread_name", "pid": 7, "tid": 2, "args": {"name": OUT0}}]
    for tid, name, spans in ((1, FORWARD_SPAN, forwards), (2, COPY_SPAN, copies)):
        for start, end, key in spans:
            events.append({"ph": "X", "name": name, "pid": 7, "tid": tid, "ts": start,
                           "dur": end - start, "args": {"keys": [key]}})
    return {"traceEvents": events}


def test_overlap_found_when_next_forward_runs_during_previous_copy():
    trace = _synthetic(forwards=[(0, 100, "r1"), (105, 200, "r2")], copies=[(100, 150, "r1")])
    pairs = find_async_overlaps(trace)
    assert [(f.keys, c.keys) for f, c in pairs] == [(("r2",), ("r1",))]
    text = summarize(trace)
    assert "1 of 2" in text and "measured: 0.2 ms" in text
    assert f"{MAIN0}: 2 spans, 0.2 ms busy (98%)" in text  # 195 of 200 us


def test_overlap_found_when_the_copy_thread_starts_after_the_next_forward():
    # a loaded machine: r1's copy starts 2 us into r2's forward, and runs beside it
    trace = _synthetic(forwards=[(0, 100, "r1"), (101, 200, "r2")], copies=[(103, 150, "r1")])
    assert [(f.keys, c.keys) for f, c in find_async_overlaps(trace)] == [(("r2",), ("r1",))]
    # a later request's copy running beside an earlier forward is not it
    trace = _synthetic(forwards=[(0, 100, "r1"), (101, 200, "r2")], copies=[(50, 120, "r2")])
    assert find_async_overlaps(trace) == []


def test_no_overlap_when_copies_run_between_forwards():
    # the synchronous path: copy of r1 ends before forward r2 starts
    trace = _synthetic(forwards=[(0, 100, "r1"), (160, 200, "r2")], copies=[(100, 150, "r1")])
    assert find_async_overlaps(trace) == []
    # a copy overlapping its own forward is not the async overlap either
    trace = _synthetic(forwards=[(0, 100, "r1")], copies=[(50, 150, "r1")])
    assert find_async_overlaps(trace) == []


def test_a_trace_without_copies_says_why_there_is_no_overlap():
    text = summarize(_synthetic(forwards=[(0, 100, "r1"), (105, 200, "r2")], copies=[]))
    assert "0 of 2" in text and "synchronously" in text


def _renamed(trace, old, new):
    for e in trace["traceEvents"]:
        if e["ph"] == "X" and e["name"] == old:
            e["name"] = new
    return trace


@pytest.mark.parametrize("renamed", [FORWARD_SPAN, COPY_SPAN])
def test_analysis_fails_loudly_when_a_worker_span_is_renamed(renamed, tmp_path, capsys):
    # A renamed span would otherwise read as "no overlap": the analysis refuses it.
    trace = _renamed(_synthetic(forwards=[(0, 100, "r1"), (105, 200, "r2")],
                                copies=[(100, 150, "r1")]), renamed, "renamed")
    with pytest.raises(TraceError, match=renamed.replace("+", r"\+")):
        find_async_overlaps(trace)
    with pytest.raises(TraceError):
        summarize(trace)
    path = tmp_path / "renamed.json"
    path.write_text(json.dumps(trace))
    from diffrt.cli import main

    assert main(["trace", str(path)]) == 2
    assert "renamed" in capsys.readouterr().err


def test_analysis_fails_loudly_without_worker_tracks_but_accepts_an_empty_trace():
    engine_only = {"traceEvents": [
        {"ph": "M", "name": "thread_name", "pid": 7, "tid": 1, "args": {"name": ENGINE_LOOP_TRACK}},
        {"ph": "X", "name": "execute_batch", "pid": 7, "tid": 1, "ts": 0.0, "dur": 5.0}]}
    with pytest.raises(TraceError, match=ENGINE_LOOP_TRACK):
        find_async_overlaps(engine_only)
    assert find_async_overlaps({"traceEvents": []}) == []


def test_worker_track_names_parse_back():
    assert tracing.parse_worker_track(worker_main_track(3)) == (3, tracing.WORKER_MAIN)
    assert tracing.parse_worker_track(worker_output_track(12)) == (12, tracing.WORKER_OUTPUT)
    assert tracing.parse_worker_track(ENGINE_LOOP_TRACK) is None
    # a track's row label drops the process name when the track name starts with it
    assert MAIN0.startswith(tracing.worker_process(0))


def test_load_trace_refuses_other_json(tmp_path):
    path = tmp_path / "x.json"
    path.write_text('{"foo": 1}')
    with pytest.raises(ValueError, match="traceEvents"):
        load_trace(path)
    path.write_text("[]")
    assert load_trace(path) == {"traceEvents": []}


def test_timeline_plot_is_a_png_with_every_span(tmp_path):
    trace = _synthetic(forwards=[(0, 100, "r1"), (105, 200, "r2")], copies=[(100, 150, "r1")])
    out = tmp_path / "timeline.png"
    assert plot_timeline(trace, out) == 3
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert width >= 800 and height >= 100


def test_merge_keeps_only_spans_touching_the_windows(trace_dir, tmp_path):
    tracing.record(MAIN0, "warmup forward", 0.0, 50.0)
    tracing.record(MAIN0, FORWARD_SPAN, 100.0, 150.0)
    tracing.record(OUT0, COPY_SPAN, 190.0, 260.0)  # straddles the end: kept
    tracing.record(MAIN0, FORWARD_SPAN, 300.0, 350.0)
    merged = tracing.merge_traces(trace_dir, tmp_path / "t.json", windows=[(90.0, 200.0)])
    kept = [(e["name"], e["ts"]) for e in merged["traceEvents"] if e["ph"] == "X"]
    assert kept == [(FORWARD_SPAN, 100.0), (COPY_SPAN, 190.0)]
    assert any(e["ph"] == "M" and e["args"].get("name") == MAIN0
               for e in merged["traceEvents"])


def test_viewer_rows_are_engine_then_each_worker_main_above_output():
    order = [ENGINE_LOOP_TRACK, ENGINE_POST_TRACK, MAIN0, OUT0,
             worker_main_track(1), worker_output_track(1), BENCH_TRACK]
    assert sorted(order, key=tracing.track_sort_index) == order


def test_bench_trace_gets_one_panel_per_configuration(tmp_path):
    trace = _synthetic(forwards=[(10, 20, "a"), (150, 160, "between"), (210, 220, "b")],
                       copies=[(20, 40, "a")])
    trace["traceEvents"] += [
        {"ph": "M", "name": "thread_name", "pid": 7, "tid": 3, "args": {"name": BENCH_TRACK}},
        {"ph": "X", "name": "sync", "pid": 7, "tid": 3, "ts": 0.0, "dur": 100.0},
        {"ph": "X", "name": "async", "pid": 7, "tid": 3, "ts": 200.0, "dur": 100.0}]
    one_panel = plot_timeline(_synthetic([(10, 20, "a")], []), tmp_path / "one.png")
    # spans between the configurations (warm-up, engine start) are not drawn
    assert plot_timeline(trace, tmp_path / "two.png") == 3
    heights = [struct.unpack(">II", (tmp_path / n).read_bytes()[16:24])[1] for n in ("one.png", "two.png")]
    assert one_panel == 1 and heights[1] > heights[0]


def test_trace_command_merges_a_folder_and_plots(trace_dir, tmp_path, capsys):
    from diffrt.cli import main

    tracing.record(MAIN0, FORWARD_SPAN, 0.0, 100.0, keys=["a"])
    tracing.record(MAIN0, FORWARD_SPAN, 105.0, 200.0, keys=["b"])
    tracing.record(OUT0, COPY_SPAN, 100.0, 150.0, keys=["a"])
    tracing.disable()
    out, png = tmp_path / "merged.json", tmp_path / "tl.png"
    assert main(["trace", str(trace_dir), "--out", str(out), "--plot", str(png)]) == 0
    text = capsys.readouterr().out
    assert "1 of 2" in text and str(png) in text
    assert len(load_trace(out)["traceEvents"]) > 3 and png.read_bytes()[:4] == b"\x89PNG"
    assert main(["trace", str(out)]) == 0  # a merged file is read back
    assert main(["trace", str(tmp_path / "missing")]) == 2
    (tmp_path / "bad.json").write_text("{}")
    assert main(["trace", str(tmp_path / "bad.json")]) == 2
    assert "traceEvents" in capsys.readouterr().err


def test_flow_arrows_link_each_forward_to_its_own_output_copy():
    from diffrt.cli.trace_analysis import add_output_flows

    trace = _synthetic(forwards=[(0, 100, "r1"), (105, 200, "r2")],
                       copies=[(100, 150, "r1"), (200, 230, "r2")])
    assert add_output_flows(trace) == 2
    flows = [e for e in trace["traceEvents"] if e["ph"] in ("s", "f")]
    starts = {e["id"]: e for e in flows if e["ph"] == "s"}
    ends = {e["id"]: e for e in flows if e["ph"] == "f"}
    assert starts.keys() == ends.keys() == {1, 2}
    # r1's arrow leaves forward r1 (before 100 us), lands on copy r1 at 100 us
    assert 0 <= starts[1]["ts"] < 100 and ends[1]["ts"] == 100 and starts[1]["tid"] == 1
    assert 105 <= starts[2]["ts"] < 200 and ends[2]["ts"] == 200 and ends[2]["tid"] == 2
    assert all(e["pid"] == 7 for e in flows)
