"""A real ``diffrt serve`` process on 127.0.0.1 for end-to-end tests."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
from waiting import HANG_GUARD_S, wait_until


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children(pid: int) -> list[int]:
    """Processes whose parent is ``pid`` (the server's workers)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(entry))
    return out


class ServerProcess:
    """``diffrt serve ARGS`` on a free loopback port; ``wait_ready`` blocks
    (bounded) until /ready answers 200. The default model's server runs
    without its video engine (``--no-default-video``: one worker, as most
    tests need) unless ``default_video``."""

    def __init__(self, *args: str, env: dict[str, str] | None = None,
                 default_video: bool = False):
        if not default_video:
            args = (*args, "--no-default-video")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="diffrt-serve-", suffix=".log",
                                               delete=False)
        script = Path(sys.executable).parent / "diffrt"
        full_env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
        self.proc = subprocess.Popen(
            [str(script), "serve", "--host", "127.0.0.1", "--port", str(self.port), *args],
            stdout=self.log, stderr=subprocess.STDOUT, env=full_env, text=True)
        #: the output, read once the log file is gone (``stop``)
        self._output: str | None = None

    def output(self) -> str:
        """What the server printed (kept once ``stop`` removed its log file)."""
        if self._output is not None:
            return self._output
        try:
            return Path(self.log.name).read_text()
        except FileNotFoundError:  # removed by another stop meanwhile
            return self._output or ""

    def wait_ready(self, timeout: float = HANG_GUARD_S) -> ServerProcess:
        def ready() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited {self.proc.returncode}:\n{self.output()}")
            try:
                return httpx.get(f"{self.url}/ready", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(ready, timeout=timeout, interval=0.2,
                   message=lambda: f"server not ready:\n{self.output()}")
        return self

    def signal(self, sig: int = signal.SIGTERM) -> None:
        self.proc.send_signal(sig)

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self._output is None:  # a second stop (a failed start, then the fixture) is a no-op
            self.log.close()
            self._output = Path(self.log.name).read_text()
            Path(self.log.name).unlink(missing_ok=True)
        return self.proc.returncode


@contextlib.contextmanager
def served(proc: ServerProcess, timeout: float = HANG_GUARD_S) -> Iterator[ServerProcess]:
    """``proc`` once ready, stopped after the block with exit status 0
    asserted. A start that failed (the server exited, or never got ready) is
    reported as it is: the process is stopped and its output kept, not
    replaced by the stop's own complaint; so is an error of the block."""
    try:
        proc.wait_ready(timeout)
    except BaseException:
        proc.stop()
        raise
    failed = True
    try:
        yield proc
        failed = False
    finally:
        code = proc.stop()
        if not failed:
            assert code == 0, proc.output()
