"""Shared fixtures of the runtime tests: executors built around the trivial EchoRunner.

The executors a module shares (``inproc`` here, ``mp2`` in the multiprocess
tests) are checked idle and healthy before and after every test that uses
them, so no test depends on what ran before it.
"""

from __future__ import annotations

import pytest
from runtime_helpers import config
from waiting import wait_until

from diffrt.runtime.factory import make_executor

#: module-scoped executor fixtures that several tests share
SHARED_EXECUTORS = ("inproc", "mp2")


@pytest.fixture(scope="module")
def inproc():
    ex = make_executor("inproc", config(tag="inproc",
                                        max_pending_output_bytes=64 << 20))
    yield ex
    ex.shutdown()


def assert_idle(ex) -> None:
    """A healthy executor that holds nothing: no rpc in flight, no output waited
    for, parked, claimed or dropped but not yet freed."""
    assert ex.is_healthy()
    idle = {"rpcs": 0, "blocked": 0, "waiting": 0, "arrived": 0, "claimed": 0, "dropped": 0}
    wait_until(lambda: ex.router.counts() == idle, message=lambda: str(ex.router.counts()))


@pytest.fixture(autouse=True)
def idle_shared_executors(request: pytest.FixtureRequest):
    """A shared executor is idle before the test; after it too, so a test that
    leaves an output unreleased or the executor broken is the one reported."""
    shared = [request.getfixturevalue(name) for name in SHARED_EXECUTORS
              if name in request.fixturenames]
    for ex in shared:
        assert_idle(ex)
    yield
    for ex in shared:
        assert_idle(ex)
