"""scripts/measures.py on a synthetic tree: it finds what is over each limit."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "measures.py"


def _tree(root: Path) -> None:
    engine = root / "diffrt" / "engine"
    (engine / "pipelines").mkdir(parents=True)
    (root / "diffrt" / "long.py").write_text("x = 1\n" * 501, encoding="utf-8")
    methods = "".join(f"    def m{i}(self) -> None:\n        pass\n" for i in range(36))
    (root / "diffrt" / "wide.py").write_text(
        "class Wide:\n" + methods + "    class Inner:\n        def only(self) -> None: ...\n",
        encoding="utf-8")
    (engine / "engine.py").write_text(
        "from typing import Any  # Any here, AnyIO and many_Any not\n"
        "x: Any = 1  # type: ignore[misc]\n", encoding="utf-8")
    (engine / "pipelines" / "p.py").write_text("from typing import Any\n", encoding="utf-8")


def test_reports_a_long_module_and_a_wide_class(tmp_path: Path) -> None:
    _tree(tmp_path)
    done = subprocess.run([sys.executable, str(SCRIPT), "--root", str(tmp_path)],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "modules in diffrt/ over 500 lines: 1 (goal 0: NOT met)" in lines
    assert "  diffrt/long.py: 501 lines" in lines
    assert "classes over 35 methods: 1 (goal 0: NOT met)" in lines
    assert "  diffrt/wide.py:Wide: 36 methods" in lines
    assert "  diffrt/wide.py:Wide.Inner: 1 methods" in lines
    assert "engine facade (diffrt/engine/engine.py): 2 lines (goal <= 450: met)" in lines
    assert "type: ignore in diffrt/: 1 (goal <= 20: met)" in lines
    assert "Any in diffrt/engine/: 4 (goal <= 165: met)" in lines
    assert "Any in diffrt/engine/ outside pipelines/: 3 (goal <= 80: met)" in lines


def test_a_tree_without_the_package_is_refused(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--root", str(tmp_path)],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 2
    assert "has no diffrt/ package" in done.stderr
