"""Priorities and deadlines over HTTP: ``priority`` and ``deadline_ms`` in the
body, ``client_priority_floor`` refusing (400) the classes kept for others, a
deadline the queue cannot meet answered 429 ``deadline_unmeetable`` with
Retry-After, the deadline counted from the handler's arrival, and the
scheduling series on /metrics. The toy model on the in-process executor."""

from __future__ import annotations

import time
from types import SimpleNamespace

from prometheus_client.parser import text_string_to_metric_families
from serve_helpers import API_KEY, call

from diffrt.engine import DiffusionRequest, SamplingParams
from diffrt.serve import ServeSettings
from diffrt.serve.routes import counted_from_arrival

GEN = "/v1/images/generations"


def body(**kw) -> dict:
    return {"prompt": "a red fox", "size": "16x16", "num_inference_steps": 2, "seed": 1, **kw}


def test_priority_floor_deadlines_and_their_series(toy_app):
    app = toy_app(ServeSettings(api_key=API_KEY, client_priority_floor=0),
                  scheduling_policy="slo", refuse_unmeetable=True)
    r = call(app, "POST", GEN, json=body(priority=-1))
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority", r.text
    r = call(app, "POST", GEN, json=body(priority=11))  # the engine's own bound
    assert r.status_code in (400, 422), r.text
    assert call(app, "POST", GEN, json=body(priority=3)).status_code == 200  # measures a tick
    r = call(app, "POST", GEN, json=body(deadline_ms=0.001))
    assert r.status_code == 429, r.text
    error = r.json()["error"]
    assert (error["code"], error["param"]) == ("deadline_unmeetable", "deadline_ms")
    assert int(r.headers["retry-after"]) >= 1
    r = call(app, "POST", GEN, json=body(deadline_ms=60_000, priority=0))
    assert r.status_code == 200, r.text
    r = call(app, "POST", GEN, json=body(deadline_ms=5_000, timeout_ms=1_000))
    assert r.status_code == 400 and r.json()["error"]["param"] == "deadline_ms", r.text
    families = {f.name: f for f in text_string_to_metric_families(
        call(app, "GET", "/metrics", headers={}).text)}
    met = [s for s in families["diffrt_requests_deadline"].samples
           if s.labels.get("priority_class") == "0" and s.labels.get("outcome") == "met"]
    assert met and met[0].value == 1
    refused = [s for s in families["diffrt_requests_deadline"].samples
               if s.labels.get("outcome") == "refused"]
    assert [s.value for s in refused] == [1]
    for name in ("diffrt_preemptions", "diffrt_requests_paused", "diffrt_paused_state_bytes"):
        assert families[name].samples[0].value == 0, name


def test_a_deadline_counts_from_the_arrival_at_the_handler():
    engine_request = DiffusionRequest("x", sampling_params=SamplingParams(deadline_s=5.0))
    arrived = SimpleNamespace(scope={"state": {"arrived_at": time.monotonic() - 2.0}})
    left = counted_from_arrival(engine_request, arrived).sampling_params.deadline_s  # type: ignore[arg-type]
    assert left is not None and 2.9 < left <= 3.0
    late = SimpleNamespace(scope={"state": {"arrived_at": time.monotonic() - 9.0}})
    assert counted_from_arrival(engine_request, late).sampling_params.deadline_s == 1e-3  # type: ignore[arg-type]
    assert counted_from_arrival(DiffusionRequest("x"), arrived).sampling_params.deadline_s is None  # type: ignore[arg-type]


def test_a_floor_above_the_default_is_what_a_body_without_priority_gets(toy_app):
    app = toy_app(ServeSettings(api_key=API_KEY, client_priority_floor=2),
                  scheduling_policy="slo")
    assert call(app, "POST", GEN, json=body(deadline_ms=60_000)).status_code == 200
    families = {f.name: f for f in text_string_to_metric_families(
        call(app, "GET", "/metrics", headers={}).text)}
    classes = {s.labels["priority_class"] for s in families["diffrt_requests_deadline"].samples}
    assert classes == {"2"}  # it ran at the floor, not at the default 0
    r = call(app, "POST", GEN, json=body(priority=1))
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority", r.text
    assert call(app, "POST", GEN, json=body(priority=5)).status_code == 200
