"""Helpers to run the real `diffrt` console script.

A test that uses the ``cli`` fixture starts the console script (seconds of
imports, worker processes for most commands), so it is marked ``e2e``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from waiting import HANG_GUARD_S

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # A conftest hook sees the items of the whole session: mark only this folder's.
    for item in items:
        if HERE in item.path.resolve().parents and "cli" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.e2e)


def diffrt_script() -> str:
    """The installed console script next to this interpreter (the venv's bin)."""
    candidate = Path(sys.executable).parent / "diffrt"
    found = str(candidate) if candidate.exists() else shutil.which("diffrt")
    if not found:
        pytest.fail("the diffrt console script is not installed (pip install -e .)")
    return found


def run_cli(*args: str, cwd: Path, env: dict[str, str] | None = None,
            timeout: float = HANG_GUARD_S) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    full_env.pop("DIFFRT_TRACE_DIR", None)
    return subprocess.run([diffrt_script(), *args], cwd=cwd, env=full_env, capture_output=True,
                          text=True, timeout=timeout)


def assert_clean_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    """A user error: non-zero exit, one explanatory line, never a traceback."""
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    for needle in needles:
        assert needle in proc.stderr, proc.stderr


@pytest.fixture
def cli():
    """Run the real console script: ``cli("generate", ..., cwd=tmp_path)``."""
    return run_cli


@pytest.fixture
def clean_error():
    return assert_clean_error
