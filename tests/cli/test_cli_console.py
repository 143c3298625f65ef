"""The real console script: `diffrt env` and clean errors for bad input."""

from __future__ import annotations

import json


def test_env_prints_platform_choice_versions_and_capabilities(cli, tmp_path):
    proc = cli("env", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for needle in ("cpu", "torch", "2.13", "capabilities", "async_output"):
        assert needle in out, out
    assert "chosen" in out or "how" in out, out  # how the platform was chosen

    proc = cli("env", "--json", cwd=tmp_path)
    assert json.loads(proc.stdout)


def test_env_with_an_unknown_platform_override_is_a_clean_error(cli, clean_error, tmp_path):
    proc = cli("env", cwd=tmp_path, env={"DIFFRT_PLATFORM": "no-such-vendor"})
    clean_error(proc, "no-such-vendor", "cpu")
    assert proc.returncode == 2


def test_bad_input_gives_clean_error(cli, clean_error, tmp_path):
    clean_error(cli("generate", "-p", "a fox", "--model", "no-such-model", cwd=tmp_path),
                "no-such-model", "tiny-flux")
    clean_error(cli("generate", "-p", "a fox", "-o", str(tmp_path / "nope" / "x.png"), cwd=tmp_path),
                "does not exist")
    clean_error(cli("generate", "-p", "a fox", "--height", "-16", cwd=tmp_path),
                "height: must be an int >= 1")
    clean_error(cli("bench", "--width", "1000", "--executor-backend", "inproc", cwd=tmp_path), "width")
    assert not list(tmp_path.iterdir())
