"""Shared fixtures of the runtime tests: executors built around the trivial EchoRunner."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from diffrt.runtime import ExecutorConfig, make_executor

HERE = Path(__file__).resolve().parent
RUNNER = "runtime_test_runners:EchoRunner"


def config(**kw) -> ExecutorConfig:
    """A config whose spawned workers can import the test runners."""
    env = {"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    kw.setdefault("worker_env", env)
    kw.setdefault("startup_timeout_s", 120.0)
    return ExecutorConfig(runner_cls=RUNNER, **kw)


@pytest.fixture(scope="module")
def inproc():
    ex = make_executor("inproc", config(runner_kwargs={"tag": "inproc"},
                                        max_pending_output_bytes=64 << 20))
    yield ex
    ex.shutdown()


def memfd_arenas() -> int:
    """How many output arenas this process still maps (memfds live in /proc, not /dev/shm)."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if "diffrt-output-arena" in os.readlink(f"/proc/self/fd/{fd}"):
                count += 1
        except OSError:
            pass
    return count
