"""A real ``diffrt serve`` process under overload, SIGTERM and a dead worker:
429 with Retry-After, a drain that lets requests in flight finish and exits 0
leaving no worker and no arena, and a killed worker answered with an error,
/health 503 until fresh workers serve — never a hang. A server that fails
to start is reported by its own failure (the shared fixtures' ``served``)."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time

import httpx
import pytest
from leaks import arena_refs
from server_process import ServerProcess, children, served
from waiting import HANG_GUARD_S, wait_until

#: two LONG requests one after the other ran past pytest's 300 s on a machine
#: other processes kept busy, and past 600 s beside a model training and the
#: suite's own servers: a hang guard only
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(HANG_GUARD_S)]

GEN = "/v1/images/generations"
#: a request that runs for a few seconds on a 2-core CPU (tiny-flux)
LONG = {"size": "32x32", "num_inference_steps": 800}
#: every server here admits LONG and lets it finish however busy the machine:
#: no run-time cost limit (120 s by default; a busy machine once estimated
#: LONG at 1,380 s) and no request timeout (600 s by default: beside a model
#: training, the drain test's second LONG, queued behind the first, ended
#: with 504 after 600 s)
NO_TIME_LIMITS = ("--max-request-seconds", "none", "--request-timeout-s", "none")
#: seconds a test polls the server for a state it expects within a second or
#: two: bounded, but generous enough for a machine other processes keep busy
POLL_S = 120


async def _poll(c: httpx.AsyncClient, path: str, done, what: str) -> httpx.Response:
    """GET ``path`` until ``done(response)``; AssertionError after POLL_S seconds."""
    give_up = time.monotonic() + POLL_S
    while True:
        response = await c.get(path)
        if done(response):
            return response
        if time.monotonic() > give_up:
            raise AssertionError(f"{what}: not within {POLL_S} s ({response.text[:300]})")
        await asyncio.sleep(0.05)


def _status(url: str, path: str) -> int:
    return httpx.get(f"{url}{path}", timeout=10).status_code


#: the drain test's two requests, one queued behind the other: long enough (about
#: 4 s each, quiet) to be in flight while the test fills the queue and signals,
#: and no longer, as a busy machine stretches both (800 steps each took 660 s
#: beside a model training)
DRAINED = {"size": "32x32", "num_inference_steps": 300}


def test_overload_then_a_drain_on_sigterm():
    # the drain, and the client's wait for the queued request's answer (no
    # byte comes before it), are hang guards: both requests finish however
    # busy the machine
    server = ServerProcess("--max-num-seqs", "1", "--max-pending", "1",
                           "--shutdown-timeout-s", str(HANG_GUARD_S),
                           *NO_TIME_LIMITS).wait_ready()
    workers = children(server.proc.pid)
    assert workers, "the server runs its model in worker processes"
    try:
        async def main():
            async with httpx.AsyncClient(base_url=server.url, timeout=HANG_GUARD_S) as c:
                async def metric_is(name: str, value: float) -> None:
                    await _poll(c, "/metrics", lambda r: f"{name} {value}" in r.text,
                                f"{name} {value}")

                running = asyncio.create_task(c.post(GEN, json={"prompt": "one", **DRAINED}))
                await metric_is("diffrt_requests_running", 1.0)
                waiting = asyncio.create_task(c.post(GEN, json={"prompt": "two", **DRAINED}))
                await metric_is("diffrt_requests_waiting", 1.0)
                overloaded = await c.post(GEN, json={"prompt": "three", **DRAINED})
                server.signal(signal.SIGTERM)  # both requests in flight
                ready = (await _poll(c, "/ready", lambda r: r.status_code == 503,
                                     "/ready 503 while draining")).status_code
                refused = await c.post(GEN, json={"prompt": "late", "size": "32x32"})
                return overloaded, ready, refused, await running, await waiting

        overloaded, ready, refused, running, waiting = asyncio.run(main())
        assert overloaded.status_code == 429 and int(overloaded.headers["retry-after"]) >= 1
        assert overloaded.json()["error"]["code"] == "rate_limit_exceeded"
        assert ready == 503
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "shutting_down"
        assert running.status_code == waiting.status_code == 200  # finished within the timeout
        assert server.proc.wait(POLL_S) == 0, server.output()
        assert wait_until(lambda: not any(os.path.exists(f"/proc/{pid}") for pid in workers))
        assert all(arena_refs(pid) == 0 for pid in [server.proc.pid, *workers])
        assert "draining" in server.output()
    finally:
        server.stop()


async def _long_request_running(c: httpx.AsyncClient) -> asyncio.Task:
    """A LONG request in flight, once the engine runs it (bounded: POLL_S)."""
    in_flight = asyncio.create_task(c.post(GEN, json={"prompt": "x", **LONG}))
    await _poll(c, "/metrics", lambda r: "diffrt_requests_running 1.0" in r.text,
                "the LONG request running")
    return in_flight


def test_a_killed_worker_fails_its_request_and_is_replaced():
    """The request running on a SIGKILLed worker answers 503 (never a hang);
    /health is 503 until fresh workers serve, then 200, and requests succeed
    again (``diffrt serve`` restarts workers by default)."""
    server = ServerProcess("--max-num-seqs", "2", *NO_TIME_LIMITS).wait_ready()
    try:
        [worker] = children(server.proc.pid)

        async def main():
            # a hang would end at the client's timeout, with no answer
            async with httpx.AsyncClient(base_url=server.url, timeout=POLL_S) as c:
                in_flight = await _long_request_running(c)
                os.kill(worker, signal.SIGKILL)
                return await in_flight

        response = asyncio.run(main())
        assert response.status_code == 503, response.text  # an error, not a hang
        assert response.json()["error"]["code"] == "engine_down"
        assert _status(server.url, "/health") == 503  # fresh workers are still starting
        assert wait_until(lambda: _status(server.url, "/health") == 200, timeout=120)
        assert _status(server.url, "/ready") == 200
        [fresh] = children(server.proc.pid)
        assert fresh != worker
        late = httpx.post(f"{server.url}{GEN}", json={"prompt": "x", "size": "32x32"},
                          timeout=POLL_S)
        assert late.status_code == 200, late.text
        assert "diffrt_worker_restarts_total 1.0" in httpx.get(f"{server.url}/metrics").text
    finally:
        code = server.stop()
    assert code == 0


def test_a_stopped_worker_turns_health_503_within_the_stall_bound():
    """SIGSTOP of the worker while a request runs: /health and /ready turn 503
    within seconds (--stall-timeout-s 2, naming the stall), long before the
    watchdog's execute_timeout_s (--execute-timeout-s, far longer than the
    test may wait); after SIGCONT they are 200 again, the request finishes
    and no worker was replaced."""
    server = ServerProcess("--max-num-seqs", "1", "--stall-timeout-s", "2",
                           "--execute-timeout-s", str(10 * POLL_S), *NO_TIME_LIMITS).wait_ready()
    try:
        [worker] = children(server.proc.pid)

        async def main():
            async with httpx.AsyncClient(base_url=server.url, timeout=10 * POLL_S) as c:
                in_flight = await _long_request_running(c)
                os.kill(worker, signal.SIGSTOP)
                try:  # POLL_S is well within the watchdog's limit
                    health = await _poll(c, "/health", lambda r: r.status_code == 503,
                                         "/health 503 for the stall")
                    ready = await c.get("/ready")
                finally:
                    os.kill(worker, signal.SIGCONT)
                healthy_again = await _poll(c, "/health", lambda r: r.status_code == 200,
                                            "/health 200 after SIGCONT")
                return health, ready, healthy_again, await in_flight

        health, ready, healthy_again, answer = asyncio.run(main())
        assert health.status_code == 503, health.text
        assert health.json()["status"] == "stalled"
        reason = re.fullmatch(r"no progress for (\d+) s \(stall_timeout_s=2\)",
                              health.json()["reason"])
        assert reason and int(reason.group(1)) >= 2, health.json()
        assert ready.status_code == 503
        assert healthy_again.status_code == 200, healthy_again.text
        assert answer.status_code == 200, answer.text
        assert "diffrt_worker_restarts_total 0.0" in httpx.get(f"{server.url}/metrics").text
    finally:
        code = server.stop()
    assert code == 0


def test_a_server_that_fails_to_start_is_reported_by_its_own_failure():
    """``served`` (the shared servers' fixtures): a start that fails raises
    the start's error with the server's output, not the FileNotFoundError of
    a stop that had already removed the log; a second stop is a no-op."""
    proc = ServerProcess("--model", "no-such-model")
    with pytest.raises(AssertionError, match="server exited 2") as failure:
        with served(proc):
            raise AssertionError("the block must not run")
    assert "no-such-model" in str(failure.value)
    assert proc.stop() == 2 and "no-such-model" in proc.output()
