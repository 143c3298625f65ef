"""The `diffrt` command: `env`, `generate`, `bench`, `serve`, `trace`.

Each subcommand lives in its own module and imports torch and the engine only
when it runs, so `diffrt --help` and input errors answer at once. Input the
user can fix is reported as one line on stderr with exit status 2; a failed
run exits with 1. `--debug` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from diffrt.cli.errors import EXIT_FAILURE, EXIT_USAGE, CliError, is_user_error
from diffrt.cli.renamed import CommandParser
from diffrt.cli.torch_import import import_torch
from diffrt.vendor_metadata import AutoloadFailure

__all__ = ["CliError", "build_parser", "main"]


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("diffrt")
    except PackageNotFoundError:  # running from a source tree that is not installed
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    # the subcommands import torch (through the engine's declarations): only
    # once main() made sure `import torch` works
    from diffrt.cli import bench, env, generate, serve, trace_cmd

    parser = CommandParser(
        prog="diffrt", description="Serve diffusion models on any accelerator, or on CPU.")
    parser.add_argument("--version", action="version", version=f"diffrt {_version()}")
    parser.add_argument("--log-level", default="WARNING",
                        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
                        help="library log level (default: %(default)s)")
    parser.add_argument("--debug", action="store_true",
                        help="show tracebacks instead of one-line errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    env.add_parser(sub)
    generate.add_parser(sub)
    bench.add_parser(sub)
    serve.add_parser(sub)
    trace_cmd.add_parser(sub)
    return parser


#: Shown at INFO whatever --log-level says: loading a large checkpoint takes
#: minutes, and its progress is what a user watches meanwhile (workers show it
#: too: see ``diffrt.runtime.worker.DEFAULT_LOG_SPEC``).
PROGRESS_LOGGERS = ("diffrt.load",)


def configure_logging(level: str) -> None:
    """The terminal's logging: ``level`` for libraries, progress loggers at INFO,
    no prompt text (``diffrt.log_filters``)."""
    from diffrt import log_filters

    log_filters.install()
    logging.basicConfig(level=getattr(logging, level),
                        format="%(levelname)s %(name)s: %(message)s")
    for name in PROGRESS_LOGGERS:
        logging.getLogger(name).setLevel(min(logging.INFO, getattr(logging, level)))


def autoload_failed(failure: AutoloadFailure, argv: list[str]) -> int:
    """The one line on stderr (and ``diffrt env``'s report, from package
    metadata) when ``import torch`` failed in a vendor backend; exit 2. The
    command line is read by hand: the parser needs the subcommands, which
    need torch."""
    command = next((a for a in argv if not a.startswith("-")), "")
    print(f"diffrt{' ' + command if command else ''}: error: {failure.line()}", file=sys.stderr)
    if command == "env":
        from diffrt.cli.env import print_autoload_report

        print_autoload_report(failure, as_json="--json" in argv)
    return EXIT_USAGE


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script; returns the exit status."""
    failure = import_torch()
    if failure is not None:  # a vendor backend broke `import torch`: nothing else can run
        return autoload_failed(failure, list(sys.argv[1:] if argv is None else argv))
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(args.log_level)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("diffrt: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if args.debug:
            raise
        if is_user_error(exc):
            print(f"diffrt {args.command}: error: {exc}", file=sys.stderr)
            return EXIT_USAGE
        print(f"diffrt {args.command}: error: {type(exc).__name__}: {exc} "
              "(run with --debug for the traceback)", file=sys.stderr)
        return EXIT_FAILURE


if __name__ == "__main__":
    sys.exit(main())
