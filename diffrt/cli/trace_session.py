"""`--trace` / `--plot`: collect spans from every process while a command runs.

Tracing writes one file per process into a temporary folder (workers inherit
the setting at spawn), and once the engine has closed the files are merged
into one Chrome/Perfetto trace-event file and, if asked, drawn as a picture.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from diffrt import tracing
from diffrt.cli.paths import check_writable_file


def add_trace_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", metavar="TRACE.json",
                   help="write a Chrome/Perfetto trace-event file: one track per worker main "
                        "stream, output thread and engine thread (open in ui.perfetto.dev)")
    p.add_argument("--plot", metavar="TIMELINE.png",
                   help="draw the same timeline as an image (needs matplotlib)")


def check_trace_args(args: argparse.Namespace) -> None:
    """Fail before the run, not after it, when the trace or plot cannot be written."""
    if args.trace:
        check_writable_file(args.trace, "the trace")
    if args.plot:
        check_writable_file(args.plot, "the timeline plot")
        try:
            import matplotlib  # noqa: F401
        except ImportError as exc:
            from diffrt.cli.errors import CliError

            raise CliError("--plot needs matplotlib: pip install 'diffrt[plot]'") from exc


class TraceWindows:
    """The stretches of the run worth showing (engine start-up and warm-up are
    left out); every span when none is marked."""

    def __init__(self) -> None:
        self.windows: list[tuple[float, float]] = []

    @contextlib.contextmanager
    def window(self, label: str | None = None) -> Iterator[None]:
        """Keep the spans of the body; with ``label`` also draw it on the bench track."""
        start = tracing.now_us()
        try:
            yield
        finally:
            end = tracing.now_us()
            self.windows.append((start, end))
            if label:
                tracing.record(tracing.BENCH_TRACK, label, start, end)


@contextlib.contextmanager
def trace_session(args: argparse.Namespace, title: str) -> Iterator[TraceWindows]:
    """Trace the body when ``--trace`` or ``--plot`` was given; the body must
    close its engine so that every worker's spans are on disk when it ends."""
    windows = TraceWindows()
    if not (args.trace or args.plot):
        yield windows
        return
    tmp = Path(tempfile.mkdtemp(prefix="diffrt-trace-"))
    tracing.enable(tmp)  # the engine names its own process in the trace
    ok = False
    try:
        yield windows
        ok = True
    finally:
        tracing.disable()
        try:
            if ok:
                _finish(args, tmp, title, windows.windows or None)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def _finish(args: argparse.Namespace, tmp: Path, title: str,
            windows: list[tuple[float, float]] | None) -> None:
    from diffrt.cli.trace_analysis import add_output_flows, summarize

    out = Path(args.trace) if args.trace else tmp / "trace.json"
    trace = tracing.merge_traces(tmp, out, windows=windows)
    if add_output_flows(trace):  # arrows forward -> its output copy in the viewer
        out.write_text(json.dumps(trace))
    if args.trace:
        print(f"trace: {out} ({len(trace['traceEvents'])} events; open in https://ui.perfetto.dev "
              "or chrome://tracing)")
        print(summarize(trace))
    if args.plot:
        from diffrt.cli.timeline import plot_timeline

        plot_timeline(trace, args.plot, title=title)
        print(f"timeline: {args.plot}")
