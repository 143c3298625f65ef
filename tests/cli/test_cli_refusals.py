"""What the CLI refuses, and how: one line, exit 2, before any engine starts;
a Ctrl-C at any moment of start-up ends in one line too."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from waiting import wait_until


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        kids += [int(k) for k in text]
    return kids


def run_main(*argv: str) -> tuple[int, str]:
    """The CLI's ``main`` in this process (refusals come before any engine starts)."""
    import contextlib
    import io

    from diffrt.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as exc:  # argparse's own exit 2
            code = int(exc.code or 0)
    return code, err.getvalue()


@pytest.mark.parametrize("case", ["seed", "output", "prompts_file", "broken_folder"])
def test_bad_inputs_are_refused_in_one_line_before_any_engine_starts(tmp_path, monkeypatch,
                                                                     case):
    monkeypatch.chdir(tmp_path)
    if case == "seed":
        args, needle = ["-p", "x", "--seed", str(2**70)], "seed: must be <= 18446744073709551615"
    elif case == "output":
        args, needle = ["-p", "x", "-o", "/proc/diffrt-test.png"], \
            "cannot write images to '/proc/diffrt-test.png'"
    elif case == "prompts_file":
        binary = tmp_path / "prompts.bin"
        binary.write_bytes(bytes(range(256)))
        args, needle = ["--prompts-file", str(binary)], f"--prompts-file '{binary}' is not UTF-8"
    else:
        from diffrt.engine.models.embedded import embedded_folder

        folder = tmp_path / "flux"
        shutil.copytree(embedded_folder("tiny-flux"), folder)
        [weights] = (folder / "vae").glob("*.safetensors")
        os.truncate(weights, weights.stat().st_size // 2)
        args, needle = ["-p", "x", "--model", str(folder)], f"{weights}: truncated"
    code, stderr = run_main("generate", *args, "--executor-backend", "inproc")
    assert code == 2, stderr
    assert needle in stderr and "Traceback" not in stderr
    assert len(stderr.strip().splitlines()) == 1, stderr


def test_a_refusal_from_the_console_script_is_one_line(cli, clean_error, tmp_path):
    proc = cli("generate", "-p", "x", "--seed", str(2**70), "--executor-backend", "inproc", cwd=tmp_path)
    clean_error(proc, "seed: must be <= 18446744073709551615")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


@pytest.mark.e2e
def test_ctrl_c_during_start_up_ends_in_one_line(tmp_path):
    """SIGINT to the CLI's process group (what a terminal's Ctrl-C sends) while
    its worker is still starting: one line, exit 130, no worker left."""
    script = Path(sys.executable).parent / "diffrt"
    proc = subprocess.Popen([str(script), "generate", "-p", "x", "--no-progress"], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True,  # its own group, as a terminal job
                            # as from a terminal: a test run in the background of a
                            # non-interactive shell inherits SIGINT ignored
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        workers = wait_until(lambda: _children(proc.pid), timeout=60,
                             message="the CLI never started its worker")
        os.killpg(proc.pid, signal.SIGINT)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, stderr
    assert stderr.strip() == "diffrt: interrupted", stderr
    for pid in workers:
        wait_until(lambda pid=pid: not Path(f"/proc/{pid}").exists()
                   or "Z" in Path(f"/proc/{pid}/stat").read_text().split(")")[-1][:3],
                   timeout=20, message=f"worker {pid} outlived the CLI")


@pytest.mark.parametrize("command", ["bench", "serve"])
def test_a_setting_the_model_refuses_ends_bench_and_serve_in_one_line(command):
    """The model's refusals (here: Ulysses over a head count it does not
    divide) come before any engine starts, as generate's do."""
    extra = ["--num-requests", "1"] if command == "bench" else ["--host", "127.0.0.1", "--port", "0"]
    code, stderr = run_main(command, "--model", "tiny-flux", "--ulysses-degree", "3",
                            "--executor-backend", "mp", *extra)
    assert code == 2, stderr
    assert "ulysses_degree" in stderr and "Traceback" not in stderr
    assert len(stderr.strip().splitlines()) == 1, stderr


def test_generate_refuses_frames_of_an_image_model_in_one_line():
    """An image model asked for frames is refused naming the field. (A video
    model on Ray is served: tests/ray/test_ray_videos.py.)"""
    code, stderr = run_main("generate", "-p", "x", "--model", "tiny-sd3", "--num-frames", "9",
                            "--executor-backend", "inproc")
    assert code == 2 and "num_frames: tiny-sd3 draws images, not video" in stderr, stderr
