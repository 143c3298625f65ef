"""Print issue 46's size and typing measures for a tree, each beside its goal.

    python scripts/measures.py [--root TREE]

TREE (default: the checkout this script sits in) is a diffrt checkout; what
is measured is its ``diffrt/`` package:

- modules over 500 lines, and the five largest;
- classes over 35 methods (functions defined in the class body, read with
  ``ast``), and the five largest;
- the engine facade's lines (``diffrt/engine/engine.py``);
- ``type: ignore`` lines over ``diffrt/`` (as ``grep -rn "type: ignore"``);
- ``Any`` in ``diffrt/engine/``, whole-word as ``grep -row Any`` counts it
  (comments and docstrings included), in all and outside ``pipelines/``.

It reports and does not gate: the exit status is 0 whatever the figures (a
missing ``diffrt/`` is the one error, exit 2).
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

MAX_MODULE_LINES = 500
MAX_CLASS_METHODS = 35
MAX_FACADE_LINES = 450
MAX_TYPE_IGNORES = 20
#: half of the 330 counted when issue 46 was filed
MAX_ENGINE_ANY = 165
MAX_ENGINE_ANY_OUTSIDE_PIPELINES = 80
LARGEST = 5

#: grep -w's word: not preceded or followed by a letter, digit or underscore
_ANY = re.compile(r"(?<![A-Za-z0-9_])Any(?![A-Za-z0-9_])")


@dataclass(frozen=True)
class Measures:
    modules: list[tuple[str, int]]  # (path, lines), largest first
    classes: list[tuple[str, int]]  # (path:Class, methods), largest first
    facade_lines: int | None  # None: the tree has no diffrt/engine/engine.py
    type_ignores: int
    engine_any: int
    engine_any_outside_pipelines: int


def _python_files(package: Path) -> Iterator[Path]:
    yield from sorted(p for p in package.rglob("*.py") if p.is_file())


def _classes(tree: ast.AST, prefix: str = "") -> Iterator[tuple[str, int]]:
    """(qualified name, methods in its own body) for every class, nested ones too."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.ClassDef):
            name = prefix + node.name
            methods = sum(isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
                          for n in node.body)
            yield name, methods
            yield from _classes(node, name + ".")
        else:
            yield from _classes(node, prefix)


def measure(root: Path) -> Measures:
    package = root / "diffrt"
    modules: list[tuple[str, int]] = []
    classes: list[tuple[str, int]] = []
    type_ignores = engine_any = outside = 0
    for path in _python_files(package):
        rel = path.relative_to(root).as_posix()
        text = path.read_text(encoding="utf-8", errors="replace")
        lines = text.splitlines()
        modules.append((rel, len(lines)))
        type_ignores += sum("type: ignore" in line for line in lines)
        if rel.startswith("diffrt/engine/"):
            found = sum(len(_ANY.findall(line)) for line in lines)
            engine_any += found
            if "/pipelines/" not in rel:
                outside += found
        try:
            tree = ast.parse(text, filename=rel)
        except SyntaxError:
            continue
        classes += [(f"{rel}:{name}", n) for name, n in _classes(tree)]
    facade = package / "engine" / "engine.py"
    facade_lines = (len(facade.read_text(encoding="utf-8", errors="replace").splitlines())
                    if facade.is_file() else None)

    def largest_first(rows: list[tuple[str, int]]) -> list[tuple[str, int]]:
        return sorted(rows, key=lambda row: (-row[1], row[0]))

    return Measures(largest_first(modules), largest_first(classes), facade_lines,
                    type_ignores, engine_any, outside)


def _verdict(value: int, goal: int) -> str:
    return "met" if value <= goal else "NOT met"


def report(m: Measures) -> list[str]:
    """The measures as plain lines, each figure beside its goal."""
    big_modules = [row for row in m.modules if row[1] > MAX_MODULE_LINES]
    big_classes = [row for row in m.classes if row[1] > MAX_CLASS_METHODS]
    out = [f"modules in diffrt/ over {MAX_MODULE_LINES} lines: {len(big_modules)} "
           f"(goal 0: {_verdict(len(big_modules), 0)})"]
    out += [f"  {path}: {n} lines" for path, n in m.modules[:LARGEST]]
    out.append(f"classes over {MAX_CLASS_METHODS} methods: {len(big_classes)} "
               f"(goal 0: {_verdict(len(big_classes), 0)})")
    out += [f"  {name}: {n} methods" for name, n in m.classes[:LARGEST]]
    if m.facade_lines is None:
        out.append("engine facade (diffrt/engine/engine.py): missing")
    else:
        out.append(f"engine facade (diffrt/engine/engine.py): {m.facade_lines} lines "
                   f"(goal <= {MAX_FACADE_LINES}: {_verdict(m.facade_lines, MAX_FACADE_LINES)})")
    out.append(f"type: ignore in diffrt/: {m.type_ignores} "
               f"(goal <= {MAX_TYPE_IGNORES}: {_verdict(m.type_ignores, MAX_TYPE_IGNORES)})")
    out.append(f"Any in diffrt/engine/: {m.engine_any} "
               f"(goal <= {MAX_ENGINE_ANY}: {_verdict(m.engine_any, MAX_ENGINE_ANY)})")
    out.append(f"Any in diffrt/engine/ outside pipelines/: {m.engine_any_outside_pipelines} "
               f"(goal <= {MAX_ENGINE_ANY_OUTSIDE_PIPELINES}: "
               f"{_verdict(m.engine_any_outside_pipelines, MAX_ENGINE_ANY_OUTSIDE_PIPELINES)})")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1],
                        help="the checkout to measure (default: this script's)")
    args = parser.parse_args(argv)
    root = args.root.resolve()
    if not (root / "diffrt").is_dir():
        print(f"measures: {root} has no diffrt/ package", file=sys.stderr)
        return 2
    print(f"issue 46 measures for {root}")
    for line in report(measure(root)):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
