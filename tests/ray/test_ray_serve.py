"""The images API on Ray Serve: two tiny-flux replicas behind one endpoint,
on the session's local Ray instance, Serve's HTTP on loopback.

Concurrent requests through the openai client spread over both replicas and
give one engine's pixels; a weight update reaches both replicas or neither
(a test seam, ``weight_seam.py``, makes one read other bytes), and so does
an adapter's new factors; /metrics
labels every series with its replica; POST /sleep and POST /wake_up reach
both replicas (a request sent meanwhile waits, and both draw as before);
overload answers 429; a client that leaves aborts its request in the
replica; a killed replica fails only its own requests and is replaced (by
one that applies the weight update first); the
autoscaling flags reach Ray Serve, which adds a replica under load and
removes it when idle; last, two SIGTERMs stop the application as `diffrt
serve --replicas 2` stops it (the second ends the drain: 503)."""

from __future__ import annotations

import base64
import concurrent.futures as cf
import io
import os
import shutil
import signal
import socket
import threading
from typing import Any

import httpx
import numpy as np
import pytest
import torch
import weight_seam
from PIL import Image
from waiting import HANG_GUARD_S, wait_until

from diffrt.engine import DiffusionEngine, DiffusionRequest, EngineConfig, SamplingParams
from diffrt.engine.models.embedded import embedded_folder
from diffrt.engine.weights.update import checksum
from diffrt.serve import ServeSettings

#: replicas start, die and scale here: beside a model training and the suite's
#: servers a test's calls took up to 220 s (a hang guard only)
pytestmark = pytest.mark.timeout(HANG_GUARD_S)

#: no run-time cost limit: its estimate follows the momentary step time, and a
#: busy machine would refuse the long requests the tests need admitted
CONFIG = EngineConfig(model="tiny-flux", step_execution=True, max_num_seqs=4,
                      max_request_seconds=None)
#: queued beyond the replicas' running requests before 429 (room for every test's
#: burst: Ray's router may refuse a little early under a burst)
MAX_PENDING = 64
TRANSFORMER = "transformer/diffusion_pytorch_model.safetensors"
#: what the module's application was deployed with (its statistics board)
DEPLOYED: dict[str, Any] = {}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def serve_url(ray_cluster, tmp_path_factory):
    from lora_files import make_adapter
    from ray import serve

    from diffrt.serve.ray_app import APP_NAME, ReplicaSettings, build_application

    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    ray_cluster.cloudpickle.register_pickle_by_value(weight_seam)
    board = ray_cluster.remote(weight_seam.SeamBoard).options(num_cpus=0).remote()
    style = make_adapter(embedded_folder("tiny-flux"), "FluxPipeline",
                         tmp_path_factory.mktemp("loras") / "style", rank=4, seed=1,
                         targets=("to_q", "to_k", "to_v", "proj_mlp"))
    DEPLOYED["style"] = style
    weights = tmp_path_factory.mktemp("weights")  # --weights-dir: the original transformer
    shutil.copy(f"{embedded_folder('tiny-flux')}/{TRANSFORMER}", weights / "original.safetensors")
    serve.run(build_application(CONFIG.replace(lora_modules={"style": style}),
                                ServeSettings(max_pending=MAX_PENDING, weights_dir=str(weights)),
                                ReplicaSettings(replicas=2, replica_cpus=0.25), board),
              name=APP_NAME, route_prefix="/")
    DEPLOYED["board"] = board
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        if APP_NAME in serve.status().applications:  # the last test deletes it itself
            serve.delete(APP_NAME)
        serve.shutdown()


def png_pixels(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64)))).astype(np.int16)


def generate(url: str, i: int, steps: int = 2, timeout: float = 120,
             **extra: Any) -> httpx.Response:
    return httpx.post(f"{url}/v1/images/generations", timeout=timeout, json={
        "prompt": f"a red fox {i}", "size": "64x64", "seed": i,
        "num_inference_steps": steps, **extra})


def test_two_replicas_serve_concurrent_requests_as_one_engine_would(serve_url):
    import openai

    client = openai.OpenAI(base_url=f"{serve_url}/v1", api_key="unused", max_retries=0)

    def one(i: int):
        raw = client.images.with_raw_response.generate(
            prompt=f"a red fox {i}", size="64x64",
            extra_body={"seed": i, "num_inference_steps": 2})
        return raw.headers["x-diffrt-replica"], png_pixels(raw.parse().data[0].b64_json)

    with cf.ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(one, range(16)))
    assert len({replica for replica, _ in answers}) == 2  # both replicas served
    with DiffusionEngine.make_engine(EngineConfig(model="tiny-flux", executor_backend="inproc",
                                                  max_num_seqs=4)) as engine:
        want = engine.generate([DiffusionRequest(
            prompt=f"a red fox {i}", sampling_params=SamplingParams(
                height=64, width=64, num_inference_steps=2, seed=i)) for i in range(16)])
    for (_, got), ref in zip(answers, want, strict=True):
        # other batch mates than here: float reassociation, at most one level
        assert np.abs(got - np.asarray(ref.images[0]).astype(np.int16)).max() <= 1


def upload(tensors: dict[str, torch.Tensor], **fields: str) -> dict[str, Any]:
    from safetensors.torch import save

    return {"files": {"file": ("w.safetensors", save(tensors), "application/octet-stream")},
            "data": fields}


#: seconds ``from_both_replicas`` keeps asking: longer than Ray Serve's
#: queue-length cache lives (RAY_SERVE_QUEUE_LENGTH_CACHE_TIMEOUT_S, 10 s).
#: A stale entry (one replica cached as busy) has the router send every
#: request of a sequence to the other replica until it expires; in one CI run
#: 24 requests in a row went to one replica
BOTH_REPLICAS_S = 60.0


def from_both_replicas(url: str, **extra: Any) -> dict[str, list[dict]]:
    """One request (the same prompt and seed), sent one at a time until both
    replicas have answered and there are at least four answers: each
    replica's answers."""
    seen: dict[str, list[dict]] = {}

    def both_answered() -> bool:
        r = generate(url, 7, **extra)
        r.raise_for_status()
        seen.setdefault(r.headers["x-diffrt-replica"], []).append(r.json())
        return len(seen) == 2 and sum(map(len, seen.values())) >= 4

    wait_until(both_answered, timeout=BOTH_REPLICAS_S, interval=0.25,
               message=lambda: f"answers per replica: {({k: len(v) for k, v in seen.items()})}")
    return seen


def test_a_weight_update_reaches_both_replicas_or_neither(serve_url, ray_cluster):
    """POST /v1/weights (an upload): first with one replica reading other bytes
    (the board's test seam): 409 and both keep version 0; then with one
    replica failing to apply (the seam): 503 and the other rolled back, both
    drawing as before, bit for bit; then for real: the
    version and each replica's checksum, and both replicas answer on it, bit
    for bit alike, as one engine updated in process draws it; last, back to
    the original weights by path (inside --weights-dir)."""
    from safetensors.torch import load_file

    original = load_file(f"{embedded_folder('tiny-flux')}/{TRANSFORMER}")
    generator = torch.Generator().manual_seed(7)
    perturbed = {k: t + 0.05 * torch.randn(t.shape, generator=generator).to(t.dtype)
                 for k, t in original.items()}
    other = [ray_cluster.put({k: 2 * t for k, t in perturbed.items()})]
    ray_cluster.get(DEPLOYED["board"].arm.remote(other))
    r = httpx.post(f"{serve_url}/v1/weights", timeout=120, **upload(perturbed, version="5"))
    assert r.status_code == 409, r.text
    assert r.json()["error"]["code"] == "weights_checksum_mismatch"
    before = from_both_replicas(serve_url)
    assert {a["diffrt"]["weights_version"] for got in before.values() for a in got} == {0}

    # one replica fails to apply (the seam): the other rolls back, bit for bit
    ray_cluster.get(DEPLOYED["board"].fail_next_apply.remote())
    r = httpx.post(f"{serve_url}/v1/weights", timeout=120, **upload(perturbed, version="6"))
    assert r.status_code == 503 and "rolled back on" in r.json()["error"]["message"], r.text
    rolled = from_both_replicas(serve_url)
    assert {a["diffrt"]["weights_version"] for got in rolled.values() for a in got} == {0}
    assert all(np.array_equal(png_pixels(a["data"][0]["b64_json"]),
                              png_pixels(before[replica][0]["data"][0]["b64_json"]))
               for replica, got in rolled.items() for a in got)

    r = httpx.post(f"{serve_url}/v1/weights", timeout=120, **upload(perturbed, version="7"))
    assert r.status_code == 200, r.text
    doc, want = r.json(), checksum(perturbed)
    assert doc["version"] == 7 and doc["checksum"] == want
    assert list(doc["replica_checksums"].values()) == [want, want]
    after = from_both_replicas(serve_url)
    assert set(doc["replica_checksums"]) == set(after)
    pixels = [png_pixels(a["data"][0]["b64_json"]) for got in after.values() for a in got]
    assert {a["diffrt"]["weights_version"] for got in after.values() for a in got} == {7}
    assert all(np.array_equal(p, pixels[0]) for p in pixels)  # both replicas alike
    old = png_pixels(next(iter(before.values()))[0]["data"][0]["b64_json"])
    assert np.abs(pixels[0] - old).max() > 8
    with DiffusionEngine.make_engine(EngineConfig(model="tiny-flux", executor_backend="inproc",
                                                  max_num_seqs=4)) as engine:
        engine.update_weights(perturbed, version=7)
        ref = engine.generate([DiffusionRequest(prompt="a red fox 7", sampling_params=(
            SamplingParams(height=64, width=64, num_inference_steps=2, seed=7)))])[0]
    assert ref.weights_version == 7
    # another process's thread count: float reassociation, at most one level
    assert np.abs(pixels[0] - np.asarray(ref.images[0]).astype(np.int16)).max() <= 1

    # back by path (inside --weights-dir): both replicas draw as before, bit for bit
    r = httpx.post(f"{serve_url}/v1/weights", timeout=120,
                   json={"path": "original.safetensors", "version": "restored"})
    assert r.status_code == 200, r.text
    assert set(r.json()["replica_checksums"].values()) == {checksum(original)}
    back = from_both_replicas(serve_url)
    assert {a["diffrt"]["weights_version"] for got in back.values() for a in got} == {"restored"}
    assert all(np.array_equal(png_pixels(a["data"][0]["b64_json"]), old)
               for got in back.values() for a in got)


def test_an_adapter_update_reaches_both_replicas(serve_url):
    """PUT /v1/loras/style (an upload, the factors scaled): both replicas
    answer with the adapter's new version, bit for bit alike, and differ
    from before."""
    from safetensors.torch import load_file

    factors = load_file(f"{DEPLOYED['style']}/pytorch_lora_weights.safetensors")
    styled = {"loras": {"style": 1.0}}
    before = from_both_replicas(serve_url, **styled)
    r = httpx.put(f"{serve_url}/v1/loras/style", timeout=120,
                  **upload({k: 1.5 * t for k, t in factors.items()}, version="3"))
    assert r.status_code == 200 and r.json()["version"] == 3, r.text
    after = from_both_replicas(serve_url, **styled)
    assert {str(a["diffrt"]["lora_versions"]) for got in after.values() for a in got} == {
        str({"style": 3})}
    pixels = [png_pixels(a["data"][0]["b64_json"]) for got in after.values() for a in got]
    assert all(np.array_equal(p, pixels[0]) for p in pixels)
    old = png_pixels(next(iter(before.values()))[0]["data"][0]["b64_json"])
    assert np.abs(pixels[0] - old).max() > 8
    r = httpx.put(f"{serve_url}/v1/loras/nope", timeout=120, **upload(factors))
    assert r.status_code == 404 and r.json()["error"]["code"] == "lora_not_found", r.text


def test_metrics_label_every_series_with_its_replica(serve_url):
    generate(serve_url, 100).raise_for_status()

    def replicas_in_metrics() -> set[str]:
        text = httpx.get(f"{serve_url}/metrics").text
        return {line.split('replica="')[1].split('"')[0] for line in text.splitlines()
                if line.startswith("diffrt_requests_total{")}

    assert wait_until(lambda: len(replicas_in_metrics()) == 2, timeout=60)
    text = httpx.get(f"{serve_url}/metrics").text
    for line in text.splitlines():
        if line.startswith(("diffrt_requests_running", "diffrt_step_seconds_count",
                            "diffrt_http_responses")):
            assert 'replica="' in line, line
    assert httpx.get(f"{serve_url}/health").status_code == 200
    assert httpx.get(f"{serve_url}/ready").status_code == 200


def test_sleep_and_wake_reach_both_replicas_which_then_draw_as_before(serve_url):
    """POST /sleep (level 1) puts both replicas' engines to sleep: /health on
    the ingress says so, /metrics says each replica sleeps, and a request
    sent meanwhile waits in a replica; after POST /wake_up it is served, and
    so is a new one, bit for bit as before the sleep."""
    before = generate(serve_url, 11)
    before.raise_for_status()
    r = httpx.post(f"{serve_url}/sleep", params={"level": 1}, timeout=120)
    assert r.status_code == 200, r.text
    with cf.ThreadPoolExecutor(1) as pool:
        try:
            assert len(r.json()["replicas"]) == 2 and r.json()["level"] == 1
            health = httpx.get(f"{serve_url}/health")
            assert health.status_code == 200 and health.json()["sleeping"] is True
            waiting = pool.submit(generate, serve_url, 11)

            def asleep_with_a_request_waiting() -> bool:
                text = httpx.get(f"{serve_url}/metrics").text
                lines = text.splitlines()
                return (sum(line.startswith("diffrt_sleeping{") and line.endswith(" 1.0")
                            for line in lines) == 2
                        and sum(float(line.rsplit(" ", 1)[1]) for line in lines
                                if line.startswith("diffrt_requests_waiting{")) >= 1)

            assert wait_until(asleep_with_a_request_waiting, timeout=60, interval=0.2)
            assert not waiting.done()
        finally:
            woke = httpx.post(f"{serve_url}/wake_up", timeout=120)
        assert woke.status_code == 200 and woke.json()["sleeping"] is False, woke.text
        assert "sleeping" not in httpx.get(f"{serve_url}/health").json()
        answers = [waiting.result(timeout=120), generate(serve_url, 11)]
    want = png_pixels(before.json()["data"][0]["b64_json"])
    for answer in answers:
        answer.raise_for_status()
        assert np.array_equal(png_pixels(answer.json()["data"][0]["b64_json"]), want)


def test_overload_answers_429_with_retry_after(serve_url, ray_cluster):
    """An application of one replica running one request with one more
    allowed to wait: of ten at once, the excess is refused with Retry-After.
    Deleting the application then lets the request in flight finish."""
    from ray import serve

    from diffrt.serve.ray_app import ReplicaSettings, StatsBoard, build_application

    board = ray_cluster.remote(StatsBoard).options(num_cpus=0).remote()
    tight = CONFIG.replace(max_num_seqs=1)
    # a drain long enough for the 1000-step request however busy the machine
    serve.run(build_application(tight, ServeSettings(max_pending=1, shutdown_timeout_s=600),
                                ReplicaSettings(replicas=1, replica_cpus=0.25), board),
              name="diffrt-tight", route_prefix="/tight")
    try:
        with cf.ThreadPoolExecutor(10) as pool:
            answers = list(pool.map(lambda i: generate(f"{serve_url}/tight", 200 + i, 60),
                                    range(10)))
            # deleting the application drains it: a request in flight finishes
            running = pool.submit(generate, f"{serve_url}/tight", 299, 1000, 600)
            # in the replica (not a fixed sleep: a busy machine may not have sent it yet)
            assert wait_until(lambda: running_total(f"{serve_url}/tight") >= 1, timeout=120)
            assert not running.done()  # still in the replica when the delete starts
            # not blocking: Serve's own wait gives up after 60 s, less than a
            # busy machine's drain of 1000 steps
            serve.delete("diffrt-tight", _blocking=False)
            assert running.result().status_code == 200
            assert wait_until(lambda: "diffrt-tight" not in serve.status().applications,
                              timeout=HANG_GUARD_S, interval=1.0)
    finally:
        if "diffrt-tight" in serve.status().applications:
            serve.delete("diffrt-tight")
    refused = [a for a in answers if a.status_code == 429]
    assert all(a.status_code in (200, 429) for a in answers), [
        (a.status_code, a.text[:200]) for a in answers if a.status_code not in (200, 429)]
    assert len(refused) >= 5 and all(a.headers.get("retry-after") for a in refused)
    assert any(a.status_code == 200 for a in answers)


def running_total(url: str) -> float:
    """Requests running in the application's replicas (as they last published)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("diffrt_requests_running"))


def aborted_total(url: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith('diffrt_requests_total{outcome="aborted"'))


def test_a_client_that_leaves_aborts_its_request_in_the_replica(serve_url):
    before = aborted_total(serve_url)
    with httpx.stream("POST", f"{serve_url}/v1/images/generations", timeout=60, json={
            "prompt": "a long walk", "size": "64x64", "num_inference_steps": 1000,
            "stream": True, "stream_progress": True}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("event: diffrt.progress"):
                break  # the request runs in a replica: leave now
    assert wait_until(lambda: aborted_total(serve_url) > before, timeout=120)


def test_a_killed_replica_fails_its_own_requests_and_is_replaced(serve_url, ray_cluster):
    from ray import serve

    from diffrt.serve.ray_app import APP_NAME

    handle = serve.get_deployment_handle("ModelReplica", app_name=APP_NAME)
    pids: set[int] = set()
    for _ in range(50):  # the router picks replicas at random: ask until both answered
        pids.add(handle.pid.remote().result(timeout_s=30))
        if len(pids) == 2:
            break
    assert len(pids) == 2
    victim = min(pids)
    with cf.ThreadPoolExecutor(6) as pool:
        running = [pool.submit(generate, serve_url, 300 + i, 400, 600) for i in range(6)]
        # all six running (max_num_seqs 4: two at least on each replica), however
        # long a busy machine takes to get them there
        assert wait_until(lambda: running_total(serve_url) >= 6, timeout=120)
        os.kill(victim, signal.SIGKILL)
        answers = [f.result() for f in running]
    codes = sorted(a.status_code for a in answers)
    assert 200 in codes and any(c >= 500 for c in codes), codes
    assert all(c == 200 or c >= 500 for c in codes)

    def two_fresh_replicas() -> bool:
        answers = [generate(serve_url, 400 + i) for i in range(6)]
        # the replacement applied the updates the module's weights test made first
        assert {a.json()["diffrt"]["weights_version"] for a in answers
                if a.status_code == 200} <= {"restored"}
        return len({a.headers.get("x-diffrt-replica") for a in answers}) == 2
    assert wait_until(two_fresh_replicas, timeout=90, interval=1.0)
    new_pids = {handle.pid.remote().result(timeout_s=30) for _ in range(20)}
    assert victim not in new_pids


def test_autoscaling_adds_a_replica_under_load_and_removes_it_when_idle(serve_url, ray_cluster):
    from ray import serve

    from diffrt.serve.ray_app import ReplicaSettings, StatsBoard, build_application

    scale = ReplicaSettings(replicas=1, min_replicas=1, max_replicas=2,
                            target_ongoing_requests=1, upscale_delay_s=0.5,
                            downscale_delay_s=2.0, look_back_s=1.0, replica_cpus=0.25)
    options = scale.deployment_options(CONFIG, ServeSettings(), platform=None)
    assert options["autoscaling_config"]["max_replicas"] == 2 and "num_replicas" not in options
    board = ray_cluster.remote(StatsBoard).options(num_cpus=0).remote()
    serve.run(build_application(CONFIG, ServeSettings(), scale, board), name="diffrt-auto",
              route_prefix="/auto")

    def running() -> int:
        app = serve.status().applications["diffrt-auto"]
        return app.deployments["ModelReplica"].replica_states.get("RUNNING", 0)

    url = f"{serve_url}/auto"
    loaded = threading.Event()

    def keep_busy(i: int) -> list[int]:
        """Requests back to back until the second replica runs: a new
        replica imports torch and loads the model (30 s and more on a busy
        machine), and Serve stops a starting one if the load ends first."""
        codes = []
        while not loaded.is_set() and len(codes) < 200:
            codes.append(generate(url, 500 + 10 * len(codes) + i, 40, 300).status_code)
        return codes

    try:
        assert running() == 1
        with cf.ThreadPoolExecutor(6) as pool:
            load = [pool.submit(keep_busy, i) for i in range(6)]
            try:
                assert wait_until(lambda: running() == 2, timeout=200, interval=0.5)
            finally:
                loaded.set()
            codes = [code for f in load for code in f.result()]
            assert codes and set(codes) == {200}, codes
        assert wait_until(lambda: running() == 1, timeout=180, interval=0.5)
    finally:
        serve.delete("diffrt-auto")



def test_a_second_sigterm_ends_the_drain_with_the_request_in_flight_answered_503(
        serve_url, ray_cluster):
    """Last in this module: it stops the module's application (two replicas)
    as `diffrt serve --replicas 2` does (``serve_ray.delete_app`` under
    ``StopSignals``, the handlers installed in this process as the command
    installs them in its own): a first SIGTERM starts the drain while a
    long request runs, a second one ends it; the request is answered 503
    (aborted in its replica), the application is gone and no third signal
    was needed. The signals themselves, around a fake Ray: test_ray_stop.py."""
    from ray import serve

    from diffrt.cli.serve_ray import StopSignals, delete_app
    from diffrt.serve.ray_app import APP_NAME

    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    with cf.ThreadPoolExecutor(1) as pool:
        running = pool.submit(generate, serve_url, 600, 1000, 600)
        assert wait_until(lambda: running_total(serve_url) >= 1, timeout=120)
        try:
            signals = StopSignals.install()
            os.kill(os.getpid(), signal.SIGTERM)  # the first: the drain starts
            assert signals.first.wait(10)
            # the second, while delete_app waits for the drain (the request is
            # far from done: 1000 steps, and the drain would wait 30 s for it)
            second = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM))
            second.start()
            delete_app(serve, APP_NAME, DEPLOYED["board"], signals, give_up_s=120)
            second.join()
            assert signals.second.wait(10)  # handled before the handlers go back
        finally:
            for sig, handler in saved.items():
                signal.signal(sig, handler)
        answer = running.result()
    assert answer.status_code == 503, answer.text
    assert answer.json()["error"]["code"] == "shutting_down"
    assert not signals.third.is_set()  # the drain ended: nobody gave up on Ray
    gone = serve.status().applications.get(APP_NAME)
    assert gone is None or str(getattr(gone.status, "value", gone.status)) == "NOT_STARTED"
