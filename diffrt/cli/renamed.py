"""Flags of earlier releases: given, they exit 2 naming what replaced them.

Two kinds. A renamed flag (``--threads`` -> ``--torch-threads``) is an
option of its own that refuses itself (``add_renamed``); it is spelled out in
full, so argparse's prefix matching never reads it as the new flag (``--url-ttl``
would otherwise be a prefix of ``--url-ttl-s``). A flag that took a value and
now takes none (``--async-output on``, ``--compile BACKEND``, ``bench --warmup
N``) keeps its name: the value after it would be a stray argument, so
``CommandParser`` looks for the old form before parsing and names the new one.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from typing import Any

#: engine flags of earlier releases -> what replaced them (every command that has them)
RENAMED_FLAGS = {
    "--mode": "--step-execution / --no-step-execution",
    "--threads": "--torch-threads",
    "--policy": "--scheduling-policy",
    "--batch-wait-ms": "--request-batch-max-wait-ms or --step-batch-max-wait-ms",
    "--steps-per-tick": "--max-steps-per-tick",
    "--executor": "--executor-backend",
    "--request-timeout": "--request-timeout-s",
    "--unread-output-timeout": "--unread-output-timeout-s",
    "--startup-timeout": "--startup-timeout-s",
    "--no-restart": "--no-restart-workers",
    "--max-request-cost": "--max-request-seconds (an estimated run time, not megapixel-steps)",
    "--reject-unmeetable": "--refuse-unmeetable",
    "--no-reject-unmeetable": "--no-refuse-unmeetable",
}
#: engine flags that took a value and take none now -> how to say it today
RENAMED_VALUES = {
    "--async-output": "--async-output / --no-async-output (neither: where the platform "
                      "supports it)",
    "--compile": "--compile --compile-backend BACKEND",
}


class _Renamed(argparse.Action):
    """A flag of an earlier release: exits 2 naming its replacement."""

    def __init__(self, option_strings: list[str], dest: str, *, new: str, **kw: Any) -> None:
        super().__init__(option_strings, dest, nargs="?", default=argparse.SUPPRESS,
                         help=argparse.SUPPRESS)
        self.new = new

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kw: Any) -> None:
        parser.error(f"{self.option_strings[0]} was renamed: use {self.new}")


class CommandParser(argparse.ArgumentParser):
    """An ArgumentParser that knows which of its flags took a value in an
    earlier release (``renamed_values``: flag -> the spelling that replaced
    ``FLAG VALUE``); its subcommands' parsers are of this class too."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.renamed_values: dict[str, str] = {}

    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: Any = None) -> tuple[Any, list[str]]:
        given = list(sys.argv[1:] if args is None else args)
        for token, after in zip(given, [*given[1:], ""], strict=False):
            flag, eq, value = token.partition("=")
            new = self.renamed_values.get(flag)
            if new is None:
                continue
            if not eq:  # the value as the next argument ("--warmup 3", not "--warmup -p x")
                value = after if after and not after.startswith("-") else ""
            if value:
                self.error(f"{flag} {value} was renamed: use {new}")
        return super().parse_known_args(args, namespace)


def add_renamed(p: argparse.ArgumentParser, flags: Mapping[str, str],
                values: Mapping[str, str] = {}) -> None:
    """Refuse ``flags`` (old -> new) and, on a ``CommandParser``, the old
    value-taking forms of ``values`` (flag -> new spelling)."""
    for old, new in flags.items():
        p.add_argument(old, action=_Renamed, new=new)
    if isinstance(p, CommandParser):
        p.renamed_values.update(values)


__all__ = ["RENAMED_FLAGS", "RENAMED_VALUES", "CommandParser", "add_renamed"]
