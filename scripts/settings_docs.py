"""Writes the docs' tables of settings from their declarations, between
``<!-- NAME:begin -->`` and ``<!-- NAME:end -->`` markers: in docs/engine.md
the engine settings and request fields (``engine/settings.py``,
``engine/sampling.py``); in docs/serving.md the flags of ``diffrt serve``
(``serve/settings.py``, ``cli/serve_opts.py``) and serve's profile, in
docs/cli.md generate's profile (``cli/profiles.py``). A default quoted in
prose is written ``<!-- default:NAME -->...<!-- /default -->`` (a serve
option's name) and filled in the same way, in every file of ``DOCS``.
``--check`` exits 1 when a file is out of date (the tests run it)."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import msgspec

from diffrt.cli.engine_opts import flag_of
from diffrt.cli.profiles import GENERATE, SERVE, Profile
from diffrt.cli.serve_opts import DECLARATIONS
from diffrt.engine.declarations import Declared, declared_fields
from diffrt.engine.sampling import SamplingParams
from diffrt.engine.settings import GROUPS

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "engine.md"
SERVING = ROOT / "docs" / "serving.md"
#: every file whose tables or quoted defaults come from declarations
DOCS = (DOC, SERVING, ROOT / "docs" / "cli.md", ROOT / "docs" / "limits.md",
        ROOT / "docs" / "scale-out.md", ROOT / "docs" / "videos.md", ROOT / "README.md")
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


_SERVE_FIELDS = {d.name: d for struct, _ in DECLARATIONS for d in declared_fields(struct)}
_GROUP_NAMES = {"server": "server", "edge": "HTTP edge", "ray": "Ray Serve"}


def human(d: Declared) -> str:
    """A default as prose quotes it: 16 KiB, 30 s, 64."""
    value = d.default
    if value is None or value is msgspec.NODEFAULT:
        return "None" if value is None else "(computed)"
    if d.extra.get("unit") == "bytes":
        for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
            if value >= size and value % size == 0:
                return f"{value // size} {unit}"
        return f"{value} bytes"
    if d.name.endswith("_s"):
        return f"{value:g} s"
    return f"{value}"


def serve_flags_table() -> str:
    rows = ["| flag | group | default | allowed | meaning |", "|---|---|---|---|---|"]
    for group, name in _GROUP_NAMES.items():  # as --help lists them
        for struct, home in DECLARATIONS:
            for d in declared_fields(struct):
                if d.extra.get("group", home) == group:
                    rows.append(f"| `{flag_of(d)}` | {name} | {human(d)} | {_limits(d)} | "
                                f"{d.description} |")
    return "\n".join(rows)


def profile_table(profile: Profile) -> str:
    rows = ["| setting | the command's default | why |", "|---|---|---|"]
    for name, d in profile.defaults.items():
        rows.append(f"| `{name}` | {d.shown} | {d.why} |")
    return "\n".join(rows)


#: file -> its tables (marker -> how it is written)
TABLES = {
    DOC: {"settings": settings_table, "sampling": sampling_table},
    SERVING: {"serve-flags": serve_flags_table, "serve-profile": lambda: profile_table(SERVE)},
    ROOT / "docs" / "cli.md": {"generate-profile": lambda: profile_table(GENERATE)},
}
_QUOTED = re.compile(r"(<!-- default:(\w+) -->).*?(<!-- /default -->)", re.S)


def render(text: str, path: Path = DOC) -> str:
    """``text`` of the file ``path`` with its tables and quoted defaults
    written from the declarations."""
    for marker, write in TABLES.get(path, {}).items():
        table = write()
        pattern = re.compile(rf"(<!-- {marker}:begin -->\n).*?(<!-- {marker}:end -->)", re.S)
        if not pattern.search(text):
            raise SystemExit(f"{path}: no <!-- {marker}:begin/end --> markers")
        text = pattern.sub(lambda m, t=table: m.group(1) + t + "\n" + m.group(2), text)

    def quoted(m: re.Match) -> str:
        field = _SERVE_FIELDS.get(m.group(2))
        if field is None:
            raise SystemExit(f"{path}: <!-- default:{m.group(2)} -->: not a serve option")
        return m.group(1) + human(field) + m.group(3)

    return _QUOTED.sub(quoted, text)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--check", action="store_true", help="exit 1 if a file is stale")
    args = ap.parse_args()
    stale = []
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        new = render(text, path)
        if new != text:
            stale.append(path)
            if not args.check:
                path.write_text(new, encoding="utf-8")
    if args.check and stale:
        for path in stale:
            print(f"{path} is out of date: run python scripts/settings_docs.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
