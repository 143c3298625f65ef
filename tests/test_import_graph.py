"""The import graph of diffrt, read from source: no cycles, and layers import only downwards.

Every ``.py`` under diffrt/ is parsed with ``ast``, never imported, so imports
that run late count as much as those at the top: imports inside functions and
under ``if TYPE_CHECKING:``, ``importlib.import_module("diffrt....")`` with a
literal name, and string literals that name a diffrt module ("diffrt.a.b", as in
a lazy-import table, or "diffrt.a.b:Name", as in a class path). Relative imports
are resolved, and ``from pkg import name`` points at the submodule ``pkg.name``
when there is one. Importing ``a.b.c`` also runs the ``__init__`` of ``a`` and
``a.b``; those implicit edges are left out, or every package would sit on a
cycle with its own modules.

Layers (platforms -> runtime -> engine -> cli/serve) import only downwards, and
so do the engine's rooms (models -> weights -> pipelines; the compute rooms and
the schedulers below the core);
``diffrt.tracing`` is a leaf every layer may use; ``diffrt/__init__.py`` is the root.
"""

from __future__ import annotations

import ast
import re
from collections import deque
from collections.abc import Collection, Iterable, Mapping
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "diffrt"

#: each layer, and the layers it must not import
FORBIDDEN = {
    "diffrt.platforms": ("diffrt.runtime", "diffrt.engine", "diffrt.cli", "diffrt.serve"),
    "diffrt.runtime": ("diffrt.engine", "diffrt.cli", "diffrt.serve"),
    "diffrt.engine": ("diffrt.cli", "diffrt.serve"),
    "diffrt.serve": ("diffrt.cli",),
}
#: the engine's rooms, in the same form: model folders below weights below the
#: pipelines, the worker-side compute rooms below the engine process's core,
#: and the schedulers' bookkeeping apart from both
_ENGINE_TOP = ("diffrt.engine.engine", "diffrt.engine.core", "diffrt.engine.pipeline_runner",
               "diffrt.engine.output_processor")
_COMPUTE = ("diffrt.engine.pipelines", "diffrt.engine.cache", "diffrt.engine.lora",
            "diffrt.engine.parallel", "diffrt.engine.weights")
FORBIDDEN.update({
    "diffrt.engine.models": (*_COMPUTE, "diffrt.engine.sched", *_ENGINE_TOP),
    "diffrt.engine.weights": ("diffrt.engine.pipelines", "diffrt.engine.sched", *_ENGINE_TOP),
    "diffrt.engine.pipelines": ("diffrt.engine.sched", "diffrt.engine.record", *_ENGINE_TOP),
    "diffrt.engine.cache": ("diffrt.engine.pipelines", "diffrt.engine.sched", *_ENGINE_TOP),
    "diffrt.engine.parallel": ("diffrt.engine.pipelines", "diffrt.engine.sched", *_ENGINE_TOP),
    # adapters: the rows' math for the workers, the registry and the pinning of a
    # tick's adapters (which reads the schedulers' output) for the engine process
    "diffrt.engine.lora": ("diffrt.engine.pipelines", *_ENGINE_TOP),
    "diffrt.engine.sched": (*_COMPUTE, "diffrt.engine.models", *_ENGINE_TOP, "diffrt.runtime"),
})
#: shared by every layer (tracing, log_filters, the field errors' base, vendor metadata) or by the demo model's training,
#: tests and docs (demo), so they import no other diffrt module
LEAVES = ("diffrt.tracing", "diffrt.demo", "diffrt.log_filters", "diffrt.vendor_metadata",
          "diffrt.field_error")

_MODULE_STRING = re.compile(r"^(diffrt(?:\.\w+)+)(?::[\w.]+)?$")


def find_modules(package_dir: Path = PACKAGE_DIR) -> dict[str, Path]:
    """{dotted module name: source file} of every module of the package."""
    modules = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = path.relative_to(package_dir.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _resolve(name: str, modules: Collection[str]) -> str | None:
    """``name`` if it is a module, else its longest prefix that is one."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _from_base(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute module of ``from <base> import ...`` written in ``module``."""
    if node.level == 0:
        return node.module or ""
    parts = module.split(".") if is_package else module.split(".")[:-1]
    parts = parts[: len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def _is_import_module(func: ast.expr) -> bool:
    return ((isinstance(func, ast.Attribute) and func.attr == "import_module")
            or (isinstance(func, ast.Name) and func.id == "import_module"))


def imports_of(source: str, module: str, is_package: bool, modules: Collection[str]) -> set[str]:
    """The modules of ``modules`` that ``module`` (whose source is ``source``) imports."""
    found: set[str | None] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(_resolve(alias.name, modules) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _from_base(node, module, is_package)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in modules else _resolve(base, modules))
        elif (isinstance(node, ast.Call) and _is_import_module(node.func) and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            found.add(_resolve(node.args[0].value, modules))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            m = _MODULE_STRING.match(node.value)
            if m and m.group(1) in modules:
                found.add(m.group(1))
    found.discard(module)
    return {name for name in found if name is not None}


def import_graph(package_dir: Path = PACKAGE_DIR) -> dict[str, set[str]]:
    """{module: the modules it imports} for every module of the package."""
    modules = find_modules(package_dir)
    return {name: imports_of(path.read_text(), name, path.name == "__init__.py", modules)
            for name, path in modules.items()}


def _cycle_through(graph: Mapping[str, Iterable[str]], start: str, members: set[str]) -> list[str]:
    """A shortest cycle [start, ..., start] inside ``members`` (breadth first)."""
    parent: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for nxt in sorted(graph.get(node, ())):
            if nxt == start:
                path = [node]
                while path[-1] != start:
                    path.append(parent[path[-1]])
                return path[::-1] + [start]
            if nxt in members and nxt not in parent:
                parent[nxt] = node
                queue.append(nxt)
    raise AssertionError(f"{start} is on no cycle inside {sorted(members)}")


def cyclic_components(graph: Mapping[str, Iterable[str]]) -> list[set[str]]:
    """The strongly connected components (Tarjan) that hold a cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            components.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [c for c in components if len(c) > 1 or min(c) in graph.get(min(c), ())]


def find_cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """One cycle per strongly connected component that holds one, each as a
    path [a, b, ..., a] from the component's first module; [] when acyclic."""
    return sorted(_cycle_through(graph, min(c), c) for c in cyclic_components(graph))


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def layer_violations(graph: Mapping[str, Iterable[str]]) -> list[str]:
    """"importer -> imported" for every import against the layering."""
    bad = []
    for src, targets in graph.items():
        for layer, banned in FORBIDDEN.items():
            if _within(src, layer):
                bad += [f"{src} -> {dst}" for dst in targets
                        if any(_within(dst, b) for b in banned)]
        for leaf in LEAVES:
            if _within(src, leaf):
                bad += [f"{src} -> {dst} (a leaf imports no other diffrt module)"
                        for dst in targets if not _within(dst, leaf)]
    return sorted(bad)


# -- the package --------------------------------------------------------------------

def test_the_package_has_no_import_cycle():
    graph = import_graph()
    lines = [f"  {' -> '.join(_cycle_through(graph, min(c), c))}  (modules on cycles with it: "
             f"{', '.join(sorted(c))})" for c in cyclic_components(graph)]
    assert not lines, "import cycles:\n" + "\n".join(sorted(lines))


def test_layers_import_only_downwards():
    bad = layer_violations(import_graph())
    assert not bad, "imports against the layering:\n" + "\n".join("  " + b for b in bad)


def test_the_graph_sees_the_package():
    graph = import_graph()
    assert {"diffrt", "diffrt.tracing", "diffrt.platforms", "diffrt.runtime", "diffrt.engine",
            "diffrt.cli"} <= graph.keys()
    assert any(graph.values())


# -- the checker itself ---------------------------------------------------------------

def test_cycle_finder_reports_each_cycle_by_name():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}, "f": {"a"}}
    assert find_cycles(graph) == [["a", "b", "c", "a"], ["e", "e"]]
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": set(), "d": {"a", "c"}}) == []


def test_edges_include_late_imports_and_module_strings():
    modules = {"diffrt", "diffrt.pkg", "diffrt.pkg.mod", "diffrt.pkg.sub", "diffrt.pkg.typed",
               "diffrt.pkg.lazy", "diffrt.pkg.dyn", "diffrt.pkg.cls", "diffrt.other",
               "diffrt.other.deep"}
    source = '''
import logging
from typing import TYPE_CHECKING
from . import sub
from ..other import name_in_init
if TYPE_CHECKING:
    from diffrt.pkg.typed import T
_LAZY = {"Thing": "diffrt.pkg.lazy", "NotAModule": "diffrt.nowhere"}
RUNNER = "diffrt.pkg.cls:Runner"
logger = logging.getLogger("diffrt.pkg.mod")

def later():
    import importlib
    import diffrt.other.deep
    return importlib.import_module("diffrt.pkg.dyn")
'''
    assert imports_of(source, "diffrt.pkg.mod", False, modules) == {
        "diffrt.pkg.sub", "diffrt.other", "diffrt.pkg.typed", "diffrt.pkg.lazy", "diffrt.pkg.cls",
        "diffrt.other.deep", "diffrt.pkg.dyn"}  # not diffrt.pkg nor diffrt: parents of imports
    # in a package's __init__, "." is the package itself
    assert imports_of("from .mod import x\n", "diffrt.pkg", True, modules) == {"diffrt.pkg.mod"}


def test_layering_allows_downward_imports_and_tracing_only():
    graph = {"diffrt.runtime.x": {"diffrt.platforms.y", "diffrt.tracing", "diffrt.engine.z"},
             "diffrt.engine.z": {"diffrt.runtime.x", "diffrt.cli.bench"},
             "diffrt.tracing": {"diffrt.platforms.y"},
             "diffrt.cli.bench": {"diffrt.engine.z"},
             # a leaf package may import its own modules, nothing else
             "diffrt.demo": {"diffrt.demo.shapes"}, "diffrt.demo.shapes": {"diffrt.engine.z"}}
    assert layer_violations(graph) == [
        "diffrt.demo.shapes -> diffrt.engine.z (a leaf imports no other diffrt module)",
        "diffrt.engine.z -> diffrt.cli.bench",
        "diffrt.runtime.x -> diffrt.engine.z",
        "diffrt.tracing -> diffrt.platforms.y (a leaf imports no other diffrt module)"]


def test_the_engines_rooms_are_layered_too():
    """Model folders sit below the pipelines, the schedulers apart from compute."""
    graph = {"diffrt.engine.models.registry": {"diffrt.engine.pipelines.flux"},
             "diffrt.engine.sched.policy": {"diffrt.engine.record", "diffrt.engine.cache.state"},
             "diffrt.engine.pipelines.load": {"diffrt.engine.models.registry"}}
    assert layer_violations(graph) == [
        "diffrt.engine.models.registry -> diffrt.engine.pipelines.flux",
        "diffrt.engine.sched.policy -> diffrt.engine.cache.state"]
