"""Helpers of the runtime tests (a uniquely named module: several test folders
have a conftest.py, so ``from conftest import`` would be ambiguous)."""

from __future__ import annotations

import os
from pathlib import Path

from runtime_test_runners import ECHO_PROTOCOL, EchoSettings

from diffrt.runtime import ExecutorConfig, RunnerSpec

HERE = Path(__file__).resolve().parent
RUNNER = "runtime_test_runners:EchoRunner"


def runner_spec(tag: str = "", cls: str = RUNNER) -> RunnerSpec:
    return RunnerSpec(cls, ECHO_PROTOCOL, EchoSettings(tag=tag))


def config(*, tag: str = "", runner_cls: str = RUNNER, **kw) -> ExecutorConfig:
    """A config whose spawned workers can import the test runners."""
    env = {"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    kw.setdefault("worker_env", env)
    kw.setdefault("startup_timeout_s", 120.0)
    return ExecutorConfig(runner=runner_spec(tag, runner_cls), **kw)
