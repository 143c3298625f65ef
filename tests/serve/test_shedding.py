"""Shedding by ``max_pending`` against bursts (issue 27, item 1): a seat among
the waiting is taken when the server accepts a request, so the waiting count
never passes the bound whatever the arrival pattern, and every way a request
can end gives its seat back (the count returns to 0)."""

from __future__ import annotations

import asyncio
import contextlib
import re

import engine_toy
import httpx
import pytest
from serve_helpers import API_KEY, AUTH
from waiting import wait_for, wait_until

from diffrt.serve import ServeSettings
from diffrt.serve.errors import ApiError

GEN = "/v1/images/generations"
BODY = {"size": "16x16", "num_inference_steps": 2}


def _waiting_gauge(text: str) -> float:
    match = re.search(r"^diffrt_requests_waiting (\S+)$", text, re.M)
    assert match, text
    return float(match.group(1))


def test_a_burst_of_ten_times_the_bound_never_passes_it(toy_app):
    """Two bursts of 60 requests at once against max_pending=6,
    max_num_seqs=4, the running ones held in their first step: the waiting
    gauge (engine and /metrics, read throughout) never exceeds 6; the first
    burst leaves at least 6 - 4 waiting, the second fills the room to 6
    exactly, and each of the others gets 429, shed while 6 were waiting.
    Once the step goes on every accepted request succeeds and nothing waits."""
    max_pending, seqs, burst = 6, 4, 60
    app = toy_app(ServeSettings(api_key=API_KEY, max_pending=max_pending), max_num_seqs=seqs)
    engine = app.state.client.engine
    engine_toy.reset()
    engine_toy.gate("burst").clear()
    body = {"prompt": "block:burst", **BODY}

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", headers=AUTH,
                                     timeout=60) as c:
            seen: list[float] = []
            stop = asyncio.Event()

            async def sample() -> None:
                while not stop.is_set():
                    seen.append(engine.stats().requests_waiting)
                    seen.append(_waiting_gauge((await c.get("/metrics")).text))
                    await asyncio.sleep(0.001)

            sampler = asyncio.create_task(sample())

            async def wave() -> tuple[list[httpx.Response], list[asyncio.Task], object]:
                """A burst, until each request is answered, running or waiting."""
                before = engine.stats()
                tasks = [asyncio.create_task(c.post(GEN, json=body)) for _ in range(burst)]

                def settled() -> bool:
                    stats = engine.stats()
                    done = sum(t.done() for t in tasks)
                    return (done + stats.requests_running + stats.requests_waiting
                            == burst + before.requests_running + before.requests_waiting)

                await wait_for(settled, timeout=120, message=lambda: engine.stats())
                # the running batch is in its held step: no admission until the gate opens
                await wait_for(lambda: engine_toy.calls("step"), timeout=120)
                return ([t.result() for t in tasks if t.done()],
                        [t for t in tasks if not t.done()], engine.stats())

            shed, held, first = await wave()
            # the first step batch holds what it admitted; a second burst
            # fills the waiting room exactly
            shed2, held2, second = await wave()
            engine_toy.gate("burst").set()
            accepted = await asyncio.gather(*held, *held2)
            await wait_for(lambda: engine.stats().requests_running == 0, timeout=120)
            stop.set()
            await sampler
            return seen, shed + shed2, accepted, first, second, len(held2)

    seen, shed, accepted, first, second, late = asyncio.run(main())
    assert seen and max(seen) <= max_pending, max(seen)
    # whatever the first burst's interleaving, no 429 left fewer than
    # max_pending - max_num_seqs waiting ...
    assert max_pending - seqs <= first.requests_waiting <= max_pending
    # ... and the second found the rest of the room, and no more
    assert late == max_pending - first.requests_waiting
    assert second.requests_waiting == max_pending
    assert second.requests_running == first.requests_running <= seqs
    assert all(r.status_code == 200 for r in accepted), [r.text for r in accepted]
    assert len(accepted) == first.requests_running + max_pending
    assert len(shed) == 2 * burst - len(accepted)
    for r in shed:
        assert r.status_code == 429, r.text
        # shed while the bound was full, never with room left
        assert f"{max_pending} requests are waiting" in r.json()["error"]["message"]
        # the engine's predicted time to its next admission, at least --retry-after-s
        retry = r.headers["retry-after"]
        assert int(retry) >= 1 and f"retry in {retry} s" in r.json()["error"]["message"]
    final = engine.stats()
    assert final.requests_waiting == final.requests_running == 0


def test_every_way_a_request_ends_gives_its_seat_back(toy_app):
    """One request running (held), then waiting requests that end every way —
    success, a generation error, a timeout while waiting, a client that
    disconnects (a plain request and a stream), a refusal at submission (400)
    and a shed (429): the waiting count follows, and returns to 0."""
    app = toy_app(ServeSettings(api_key=API_KEY, max_pending=4), max_num_seqs=1)
    engine = app.state.client.engine
    engine_toy.gate("mixed").clear()

    def waiting() -> int:
        return engine.stats().requests_waiting

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", headers=AUTH,
                                     timeout=60) as c:
            def post(prompt: str, **extra):
                return asyncio.create_task(c.post(GEN, json={"prompt": prompt, **BODY, **extra}))

            running = post("block:mixed")
            await wait_for(lambda: engine.stats().requests_running == 1)
            ok, failing, leaving = post("p"), post("fail"), post("p")
            await wait_for(lambda: waiting() == 3)
            refused = await c.post(GEN, json={"prompt": "p", **BODY, "size": "12x12"})
            assert waiting() == 3  # refused at submission: its seat came back
            stream = post("p", stream=True)
            await wait_for(lambda: waiting() == 4)
            shed = await c.post(GEN, json={"prompt": "p", **BODY})
            leaving.cancel()  # clients that disconnect while waiting
            stream.cancel()
            await wait_for(lambda: waiting() == 2)
            late = post("p", timeout_ms=200)  # times out while waiting
            timed_out = await late
            assert waiting() == 2
            engine_toy.gate("mixed").set()
            answers = await asyncio.gather(running, ok, failing)
            return refused, shed, timed_out, answers

    refused, shed, timed_out, (running, ok, failing) = asyncio.run(main())
    assert refused.status_code == 400 and shed.status_code == 429
    assert timed_out.status_code == 504
    assert running.status_code == ok.status_code == 200 and failing.status_code == 500
    stats = engine.stats()  # waiting counts the seats not yet queued, too
    assert stats.requests_waiting == stats.requests_running == 0


def test_a_request_counts_as_waiting_from_its_acceptance(toy_app):
    """The seat is taken when the server accepts the request, a turn of the
    event loop before the submission (what a check of the queue alone
    missed); a client that leaves then gives it back."""
    from diffrt.engine import DiffusionRequest, SamplingParams

    app = toy_app(ServeSettings(api_key=API_KEY, max_pending=1))
    client, engine = app.state.client, app.state.client.engine
    request = DiffusionRequest(prompt="p", sampling_params=SamplingParams(
        height=16, width=16, num_inference_steps=2))

    async def main():
        outputs = client.run(request)
        first = asyncio.ensure_future(outputs.__anext__())
        await asyncio.sleep(0)  # run() took the seat; the submission is scheduled
        taken = engine.stats().requests_waiting, engine.scheduler.num_waiting
        with pytest.raises(ApiError) as shed:  # the bound is full already
            await client.run(request).__anext__()
        first.cancel()  # the client leaves
        with contextlib.suppress(asyncio.CancelledError):
            await first
        await outputs.aclose()
        return taken, shed.value

    taken, shed = asyncio.run(main())
    assert taken == (1, 0)  # a seat, nothing in the engine's queue yet
    assert shed.status == 429
    assert engine.stats().requests_waiting == 0
    assert wait_until(lambda: engine.num_active_requests() == 0)


def test_retry_after_is_the_predicted_admission_within_its_floor_and_an_hour():
    from diffrt.serve.engine_client import MAX_RETRY_AFTER_S, retry_after

    assert retry_after(None, 1) == 1  # no prediction yet: the setting
    assert retry_after(0.2, 1) == 1 and retry_after(0.2, 3) == 3  # never under the setting
    assert retry_after(7.01, 1) == 8  # whole seconds, rounded up: not too early
    assert retry_after(1e6, 1) == MAX_RETRY_AFTER_S
