"""`diffrt trace`: merge the per-process files a program wrote with
DIFFRT_TRACE_DIR set, and/or draw a trace file as a timeline picture."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from diffrt.cli.errors import CliError
from diffrt.cli.paths import check_writable_file


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "trace", help="merge a DIFFRT_TRACE_DIR folder and/or plot a trace file",
        description="Merge the per-process span files that any program using diffrt writes "
                    "when DIFFRT_TRACE_DIR is set, and/or draw a trace as a timeline picture.")
    p.add_argument("source", type=Path, help="a DIFFRT_TRACE_DIR folder or a trace .json file")
    p.add_argument("--out", "-o", metavar="TRACE.json",
                   help="write the merged trace here (folder sources)")
    p.add_argument("--plot", metavar="TIMELINE.png", help="draw the timeline")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from diffrt import tracing
    from diffrt.cli.trace_analysis import add_output_flows, load_trace, summarize

    if args.out:
        check_writable_file(args.out, "the trace")
    if args.plot:
        check_writable_file(args.plot, "the timeline plot")
    if args.source.is_dir():
        if not any(args.source.glob("trace-*.jsonl")):
            raise CliError(f"{str(args.source)!r} holds no trace-*.jsonl files")
        if not (args.out or args.plot):
            raise CliError("give --out and/or --plot for a folder source")
        out = args.out or args.source / "merged-trace.json"
        trace = tracing.merge_traces(args.source, out)
        if add_output_flows(trace):
            Path(out).write_text(json.dumps(trace))
        if args.out:
            print(f"trace: {args.out} ({len(trace['traceEvents'])} events)")
    elif args.source.is_file():
        if args.out:
            raise CliError("--out merges a folder; the source is already one trace file")
        try:
            trace = load_trace(args.source)
        except ValueError as exc:
            raise CliError(str(exc)) from None
    else:
        raise CliError(f"{str(args.source)!r} does not exist")
    print(summarize(trace))
    if args.plot:
        from diffrt.cli.timeline import plot_timeline

        plot_timeline(trace, args.plot, title=f"diffrt trace {args.source.name}")
        print(f"timeline: {args.plot}")
    return 0
