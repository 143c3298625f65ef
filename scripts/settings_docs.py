"""Writes the tables of engine settings and request fields into
docs/engine.md from their declarations (``engine/settings.py``,
``engine/sampling.py``), between the ``<!-- settings:begin/end -->`` and
``<!-- sampling:begin/end -->`` markers. ``--check`` exits 1 when the file
is out of date (the tests run it)."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import msgspec

from diffrt.engine.declarations import Declared, declared_fields
from diffrt.engine.sampling import SamplingParams
from diffrt.engine.settings import GROUPS

DOC = Path(__file__).resolve().parents[1] / "docs" / "engine.md"
GROUP_NAMES = {"model_config": "model", "scheduling": "scheduling", "parallel": "parallel",
               "limits": "limits", "executor": "executor"}


def _default(d: Declared) -> str:
    if d.default is msgspec.NODEFAULT:
        return "(computed)"
    return f"`{d.default!r}`"


def _limits(d: Declared) -> str:
    signs = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<", "min_length": "length >=",
             "max_length": "length <="}
    parts = [f"{signs[k]} {v:g}" if isinstance(v, (int, float)) else f"{signs[k]} {v}"
             for k, v in d.bounds.items()]
    if d.choices:
        parts.append(" / ".join(f"`{c!r}`" for c in d.choices))
    if d.optional:
        parts.append("or None")
    return ", ".join(parts)


def settings_table() -> str:
    rows = ["| setting | group | default | allowed | meaning |", "|---|---|---|---|---|"]
    for attr, cls in GROUPS.items():
        for d in declared_fields(cls):
            rows.append(f"| `{d.name}` | {GROUP_NAMES[attr]} | {_default(d)} | {_limits(d)} | "
                        f"{d.description} |")
    return "\n".join(rows)


def sampling_table() -> str:
    rows = ["| field | default | allowed | HTTP body | CLI | meaning |",
            "|---|---|---|---|---|---|"]
    for d in declared_fields(SamplingParams):
        http = d.extra.get("http")
        http_text = "—" if http is None else f"`{http or d.name}`"
        if http is not None and d.extra.get("needs_image"):
            http_text += " (edits)"
        cli = d.extra.get("cli")
        cli_text = "—" if cli is None else ", ".join(
            [f"`--{d.name.replace('_', '-')}`", *(f"`{a}`" for a in cli)])
        rows.append(f"| `{d.name}` | {_default(d)} | {_limits(d)} | {http_text} | {cli_text} | "
                    f"{d.description} |")
    return "\n".join(rows)


def render(text: str) -> str:
    for marker, table in (("settings", settings_table()), ("sampling", sampling_table())):
        pattern = re.compile(rf"(<!-- {marker}:begin -->\n).*?(<!-- {marker}:end -->)", re.S)
        if not pattern.search(text):
            raise SystemExit(f"{DOC}: no <!-- {marker}:begin/end --> markers")
        text = pattern.sub(lambda m, t=table: m.group(1) + t + "\n" + m.group(2), text)
    return text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--check", action="store_true", help="exit 1 if docs/engine.md is stale")
    args = ap.parse_args()
    text = DOC.read_text(encoding="utf-8")
    new = render(text)
    if args.check:
        if new != text:
            print(f"{DOC} is out of date: run python scripts/settings_docs.py", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(new, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
