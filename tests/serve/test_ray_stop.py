"""How ``diffrt serve --replicas N`` stops (issue 52 item 1), against a fake
Ray: SIGTERM while the application deploys, SIGTERM once it serves, and a
second SIGTERM during the drain, each ending with exit 0.

``FakeRay.init`` installs the handler ``ray.init`` installs in the driver
(ray/_private/worker.py: ``def sigterm_handler(signum, frame):
sys.exit(signum)``, set before the driver connects), so a signal that finds
Ray's handler in place ends the call with SystemExit, as it ended the real
process midway (there, by SIGABRT: Ray's threads still ran). ``FakeServe``
follows ray/serve/api.py's ``run_many``, ``run``, ``delete(name,
_blocking)``, ``status`` and ``shutdown``: an application deploys until
told it runs, and a deleted one drains until the test lets it go.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import types
from typing import Any

import pytest

from diffrt.cli import main

ARGS = ["serve", "--replicas", "2", "--model", "tiny-flux", "--host", "127.0.0.1", "--port",
        "0", "--placement-timeout-s", "60"]


class FakeBoard:
    def __init__(self) -> None:
        self.drain_ended = threading.Event()
        self.end_drain = types.SimpleNamespace(remote=self.drain_ended.set)


class FakeServe:
    """Ray Serve's driver API as ``serve_ray`` calls it."""

    def __init__(self) -> None:
        self.state = "NONE"          # NONE, DEPLOYING, RUNNING, DELETING, GONE
        self.submitted = threading.Event()
        self.deleting = threading.Event()
        self.let_go = threading.Event()  # the drain is over: the application goes
        self.shut_down = False
        self.starts = 0
        self.RunTarget = lambda target, name, route_prefix: (target, name)

    def start(self, http_options: dict) -> None:
        self.starts += 1
        if self.starts == 1:  # as Ray Serve when its proxy takes over 60 s
            raise TimeoutError("HTTP proxies not available after 60s.")

    def run_many(self, targets: list, **kw: Any) -> list:
        self.state = "DEPLOYING"
        self.submitted.set()
        return []

    def run(self, app: Any, name: str, route_prefix: str) -> None:
        """serve.run: deploys, then waits until the application runs."""
        self.run_many([app])
        while self.state == "DEPLOYING":
            time.sleep(0.01)
        if self.state != "RUNNING":
            raise RuntimeError(f"Waiting for application {name} to be RUNNING, but it was "
                               "deleted.")

    def delete(self, name: str, _blocking: bool = True) -> None:
        self.state = "DELETING"
        self.deleting.set()
        if _blocking:  # Ray's client polls up to 60 s (here 10) for the deletion
            if not self.let_go.wait(10):
                raise TimeoutError(f"Some of these applications weren't deleted: {[name]}")
            self.state = "GONE"

    def status(self) -> Any:
        if self.state == "DELETING" and self.let_go.is_set():
            self.state = "GONE"
        apps = {}
        if self.state in ("DEPLOYING", "RUNNING", "DELETING"):
            apps["diffrt"] = types.SimpleNamespace(
                status=types.SimpleNamespace(value=self.state), message="", deployments={})
        return types.SimpleNamespace(applications=apps)

    def shutdown(self) -> None:
        self.shut_down = True


class FakeRay(types.ModuleType):
    def __init__(self, serve: FakeServe) -> None:
        super().__init__("ray")
        self.serve = serve
        self.board = FakeBoard()
        self.is_shut_down = False

    def init(self, **kw: Any) -> None:
        self.environ_at_init = dict(os.environ)
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(signum))

    def cluster_resources(self) -> dict[str, float]:
        return {"CPU": 4.0}

    def remote(self, cls: type) -> Any:
        board = self.board
        return types.SimpleNamespace(options=lambda **kw: types.SimpleNamespace(
            remote=lambda: board))

    def shutdown(self) -> None:
        self.is_shut_down = True


@pytest.fixture
def fake_ray(monkeypatch):
    for name in ("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S"):
        monkeypatch.setenv(name, "")  # undone after the test (serve_ray sets them)...
        monkeypatch.delenv(name)  # ...and absent during it
    serve = FakeServe()
    ray = FakeRay(serve)
    monkeypatch.setitem(sys.modules, "ray", ray)
    monkeypatch.setitem(sys.modules, "ray.serve", serve)
    import diffrt.serve.ray_app as ray_app
    monkeypatch.setattr(ray_app, "build_application", lambda *a, **kw: "the application")
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield ray
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def _after(event: threading.Event, then: Any) -> threading.Thread:
    def run() -> None:
        assert event.wait(30)
        time.sleep(0.1)  # the main thread is waiting on Ray by now
        then()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _sigterm() -> None:
    os.kill(os.getpid(), signal.SIGTERM)


def test_sigterm_while_the_application_deploys_drains_it_and_exits_0(fake_ray, capsys):
    serve = fake_ray.serve
    _after(serve.submitted, _sigterm)
    _after(serve.deleting, serve.let_go.set)
    assert main(ARGS) == 0
    assert serve.state == "GONE" and serve.shut_down and fake_ray.is_shut_down
    assert "draining the replicas" in capsys.readouterr().err
    assert serve.starts == 2  # a slow proxy's TimeoutError waited out
    # the local instance's Serve proxy gets minutes, not Ray's 5 s checks
    from diffrt.serve.ray_patience import PROXY_CHECKS_S

    for name, seconds in PROXY_CHECKS_S.items():
        assert fake_ray.environ_at_init[name] == seconds


def test_a_second_sigterm_ends_the_drain_through_the_replicas_and_exits_0(fake_ray, capsys):
    serve, board = fake_ray.serve, fake_ray.board

    def ready_then_stop() -> None:
        serve.state = "RUNNING"
        time.sleep(0.3)  # "ready" printed, waiting for a signal
        _sigterm()

    _after(serve.submitted, ready_then_stop)
    _after(serve.deleting, _sigterm)  # the second, while the replicas drain
    _after(board.drain_ended, serve.let_go.set)  # the replicas abort: the drain is over
    assert main(ARGS) == 0
    assert board.drain_ended.is_set() and serve.state == "GONE" and fake_ray.is_shut_down
    err = capsys.readouterr().err
    assert "draining the replicas" in err and "ending the drain now" in err
