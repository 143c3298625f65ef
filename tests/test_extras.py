"""Every extra of pyproject.toml resolves with pip against the pinned torch,
and none of them replaces that torch (issue 52, item 8).

One ``pip install --dry-run`` resolves all the extras together (a few
seconds: what is installed already satisfies most of them; torch-npu's
metadata comes from the index). Where that fails because no package index
answers, the test is skipped with the reason.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import urllib.error
import urllib.request
from importlib.metadata import version
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
PYPI = "https://pypi.org/simple/"
#: vendor extras that installed nothing, or something diffrt refuses (ipex:
#: intel-extension-for-pytorch 2.8.0, a CPU build, refused on torch 2.13)
REMOVED = ("cuda", "rocm", "xpu", "musa", "ipex")


def extras() -> dict[str, list[str]]:
    """``[project.optional-dependencies]`` of pyproject.toml (read by hand:
    tomllib is Python 3.11+, diffrt supports 3.10)."""
    text = (ROOT / "pyproject.toml").read_text()
    section = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    return {name: ast.literal_eval(value) for name, value in
            re.findall(r'^(\w[\w-]*) = (\[(?:"[^"]*"|[\s,])*\])', section, flags=re.M)}


def index_unreachable() -> str | None:
    """Why no package index answers here, or None."""
    url = os.environ.get("PIP_INDEX_URL", PYPI).rstrip("/") + "/torch-npu/"
    try:
        with urllib.request.urlopen(url, timeout=5):
            return None
    except (urllib.error.URLError, OSError) as exc:
        return f"no package index reachable ({url}: {exc})"


def test_no_extra_installs_nothing_or_a_refused_package():
    found = extras()
    assert not set(found) & set(REMOVED)
    for name, requirements in found.items():
        assert requirements, f"extra {name!r} installs nothing"
        assert not any(Requirement(r).name == "intel-extension-for-pytorch"
                       for r in requirements)
    readme = (ROOT / "README.md").read_text()
    assert "diffrt[npu]" in readme  # the README says what each vendor install brings
    for name in REMOVED:
        assert f"'diffrt[{name}]'" not in readme and f"`diffrt[{name}]`" not in readme


def test_every_extra_resolves_against_the_pinned_torch(tmp_path):
    found = extras()
    requirements = sorted({r for reqs in found.values() for r in reqs})
    report = tmp_path / "report.json"
    out = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--report",
         str(report), "-c", str(ROOT / "requirements" / "cpu.txt"), *requirements],
        capture_output=True, text=True, timeout=240)
    if out.returncode != 0:
        why = index_unreachable()
        if why is not None:
            pytest.skip(why)
    assert out.returncode == 0, out.stderr[-2000:]
    install = {canonicalize_name(item["metadata"]["name"]): item["metadata"]["version"]
               for item in json.loads(report.read_text())["install"]}
    assert "torch" not in install, f"an extra replaces torch {version('torch')}: {install}"
    pinned = re.search(r"^torch==(\S+)", (ROOT / "requirements" / "cpu.txt").read_text(),
                       re.M).group(1)
    assert version("torch").split("+")[0] == pinned
    for name, reqs in found.items():
        for text in reqs:
            req = Requirement(text)
            key = canonicalize_name(req.name)
            got = install.get(key) or version(req.name)  # to install, or installed already
            assert req.specifier.contains(got, prereleases=True), (name, text, got)
    torch_minor = pinned.rsplit(".", 1)[0] + "."
    # the one vendor package PyPI carries is the pinned torch's build
    assert install["torch-npu"].startswith(torch_minor), install
    # IPEX refuses (and diffrt does not import) another torch's major.minor
    ipex = install.get("intel-extension-for-pytorch")
    assert ipex is None or ipex.startswith(torch_minor), ipex
