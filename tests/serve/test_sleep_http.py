"""POST /sleep and POST /wake_up (docs/rollouts.md) on a toy engine: they need
the API key; while the engine sleeps /health and /metrics say so and a
generation waits (the default) or gets 503 with Retry-After
(``sleep_requests="refuse"``); after /wake_up it runs again."""

from __future__ import annotations

import re

from serve_helpers import API_KEY, call

from diffrt.serve import ServeSettings

GEN = "/v1/images/generations"
BODY = {"prompt": "p", "size": "16x16", "num_inference_steps": 2}


def test_sleep_and_wake_over_http(toy_app):
    app = toy_app(ServeSettings(api_key=API_KEY, sleep_requests="refuse", sleep_retry_after_s=7))
    assert call(app, "POST", "/sleep", headers={}).status_code == 401
    assert call(app, "POST", "/sleep?level=3").status_code == 400
    slept = call(app, "POST", "/sleep?level=1")
    assert slept.status_code == 200, slept.text
    assert slept.json()["sleeping"] is True and slept.json()["freed_bytes"] == 0  # CPU
    health = call(app, "GET", "/health")
    assert health.status_code == 200 and health.json()["sleeping"] is True
    assert re.search(r"^diffrt_sleeping 1\.0$", call(app, "GET", "/metrics").text, re.M)
    refused = call(app, "POST", GEN, json=BODY)
    assert refused.status_code == 503 and refused.headers["Retry-After"] == "7"
    assert refused.json()["error"]["code"] == "sleeping"
    woke = call(app, "POST", "/wake_up")
    assert woke.status_code == 200 and woke.json()["sleeping"] is False
    assert "sleeping" not in call(app, "GET", "/health").json()
    assert re.search(r"^diffrt_sleeping 0\.0$", call(app, "GET", "/metrics").text, re.M)
    assert call(app, "POST", GEN, json=BODY).status_code == 200
