"""Step caches over HTTP: ``cache`` and ``cache_threshold`` in the images
bodies, what the cache did as ``diffrt.cache`` (JSON response and a stream's
completed event, generations and edits), the refusals naming the field, and
the cache counters on /metrics (one engine and several). tiny-flux on the
in-process executor, shared with the other server tests (the counters are
read as differences)."""

from __future__ import annotations

import dataclasses
import io

import numpy as np
import pytest
from PIL import Image
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from serve_helpers import call
from serve_helpers import events as _events

from diffrt.serve.metrics import ServerMetrics

GEN = "/v1/images/generations"
EDITS = "/v1/images/edits"
#: a request whose first-block cache reuses steps on tiny-flux
CACHED = {"prompt": "a red fox", "size": "64x64", "seed": 5, "num_inference_steps": 8,
          "cache": "first-block", "cache_threshold": 0.3}
CACHE_KEYS = {"policy", "threshold", "steps_computed", "steps_reused", "reused_steps",
              "uncached_reason"}


def _samples(text: str) -> dict[tuple[str, frozenset], float]:
    """Prometheus text -> {(sample name, its labels): value}."""
    return {(sample.name, frozenset(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def _reused_steps_metric(app) -> float:
    samples = _samples(call(app, "GET", "/metrics", headers={}).text)
    key = ("diffrt_cache_steps_total", _labels(policy="first-block", outcome="reused"))
    return samples.get(key, 0.0)


def _labels(**labels: str) -> frozenset:
    return frozenset(labels.items())


def _assert_cached(cache: dict, steps: int = 8) -> None:
    assert cache["policy"] == "first-block" and cache["threshold"] == 0.3, cache
    assert cache["steps_reused"] > 0, cache
    assert cache["steps_computed"] + cache["steps_reused"] == steps, cache
    assert len(cache["reused_steps"]) == cache["steps_reused"]
    assert all(0 < s < steps for s in cache["reused_steps"])  # step 0 always computes
    assert cache.get("uncached_reason") is None


def test_a_cached_request_says_what_its_cache_did_and_is_counted(flux_app):
    before = _reused_steps_metric(flux_app)
    r = call(flux_app, "POST", GEN, json=CACHED)
    assert r.status_code == 200, r.text
    info = r.json()["diffrt"]
    _assert_cached(info["cache"])
    assert set(info["cache"]) <= CACHE_KEYS
    assert info["timings"]["inference"] > 0  # beside the timings, which stay
    after = _reused_steps_metric(flux_app)
    assert after - before == info["cache"]["steps_reused"]

    uncached = {**CACHED, "num_inference_steps": 2, "cache_threshold": None}
    plain = call(flux_app, "POST", GEN, json={**uncached, "cache": None})
    assert plain.status_code == 200, plain.text
    assert "cache" not in plain.json()["diffrt"]  # tiny-flux has no default cache
    off = call(flux_app, "POST", GEN, json={**uncached, "cache": "off"})
    assert off.status_code == 200 and "cache" not in off.json()["diffrt"], off.text


@pytest.mark.parametrize(("change", "param", "needle"), [
    ({"cache": "fast"}, "cache", "first-block"),
    ({"cache": 1}, "cache", ""),
    ({"cache_threshold": -1}, "cache_threshold", "greater than or equal to 0"),
    ({"cache_threshold": 101}, "cache_threshold", "less than or equal to 100"),
    ({"cache_threshold": "0.3"}, "cache_threshold", ""),  # strict: no strings for numbers
    ({"cache": "off"}, "cache_threshold", 'cache="off"'),  # the engine's check
])
def test_bad_cache_fields_are_400_naming_the_field(flux_app, change, param, needle):
    r = call(flux_app, "POST", GEN, json={**CACHED, "num_inference_steps": 2, **change})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and needle in error["message"], error
    assert error["type"] == "invalid_request_error"


def test_a_streams_completed_event_carries_the_cache(flux_app):
    r = call(flux_app, "POST", GEN, json={**CACHED, "stream": True})
    assert r.status_code == 200, r.text
    kind, data = _events(r.text)[-1]
    assert kind == "image_generation.completed"
    assert set(data["diffrt"]["cache"]) == CACHE_KEYS
    _assert_cached(data["diffrt"]["cache"])
    plain = call(flux_app, "POST", GEN, json={"prompt": "x", "size": "64x64",
                                               "num_inference_steps": 2, "stream": True})
    assert _events(plain.text)[-1][1]["diffrt"]["cache"] is None


def test_an_edit_takes_the_cache_fields_as_form_parts(flux_app):
    """Multipart text parts (what the openai client sends for ``extra_body``),
    streamed: the edit's completed event carries the cache too."""
    rng = np.random.default_rng(1)
    image = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(image, "PNG")
    fields = {k: str(v) for k, v in CACHED.items()}
    fields.update(strength="0.75", stream="true")  # 6 of the 8 steps run
    r = call(flux_app, "POST", EDITS, data=fields,
             files=[("image", ("in.png", image.getvalue(), "image/png"))])
    assert r.status_code == 200, r.text
    kind, data = _events(r.text)[-1]
    assert kind == "image_edit.completed"
    assert data["diffrt"]["num_inference_steps"] == 6
    _assert_cached(data["diffrt"]["cache"], steps=6)
    bad = call(flux_app, "POST", EDITS, data={**fields, "cache": "fast"},
               files=[("image", ("in.png", image.getvalue(), "image/png"))])
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "cache", bad.text


def test_cache_counters_carry_each_engines_labels(flux_step_engine):
    """Behind the Ray Serve application every replica's series has its
    ``replica`` label; the uncached requests are counted by reason."""
    stats = flux_step_engine.stats()
    a = dataclasses.replace(stats, cache_steps_total={("teacache", "computed"): 5,
                                                      ("teacache", "reused"): 3},
                            cache_uncached_total={"cache_state_bytes": 2})
    b = dataclasses.replace(stats, cache_steps_total={("first-block", "reused"): 1},
                            cache_uncached_total={})
    metrics = ServerMetrics(lambda: [({"replica": "a"}, a), ({"replica": "b"}, b)])
    text = generate_latest(metrics.registry).decode()
    found = {key: v for key, v in _samples(text).items() if key[0].startswith("diffrt_cache_")}
    steps, uncached = "diffrt_cache_steps_total", "diffrt_cache_uncached_requests_total"
    assert found == {
        (steps, _labels(replica="a", policy="teacache", outcome="computed")): 5,
        (steps, _labels(replica="a", policy="teacache", outcome="reused")): 3,
        (steps, _labels(replica="b", policy="first-block", outcome="reused")): 1,
        (uncached, _labels(replica="a", reason="cache_state_bytes")): 2}
    assert "# TYPE diffrt_cache_steps_total counter" in text
