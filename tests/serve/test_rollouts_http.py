"""A trainer over HTTP (docs/rollouts.md), in-process on one tiny-flux engine
of this module's own (its weights and adapters change here): a request's
log-probs and trajectory as a safetensors download beside its images (JSON
and stream), bit-identical to the engine's ``out.rollout``, owned by its
API key, bounded (429, 400, 404); ``POST /v1/weights`` from an upload and
from a path inside ``--weights-dir``, with its checksums and refusals (the
old weights stay); ``PUT /v1/loras/{name}``. That the last latent decodes
to the returned image is the engine's test (tests/engine/test_rollouts.py).
"""

from __future__ import annotations

import base64
import io
import json
import shutil

import httpx
import numpy as np
import pytest
import torch
from lora_files import make_adapter
from PIL import Image
from serve_helpers import API_KEY, call, events

from diffrt.engine import DiffusionEngine, DiffusionRequest, EngineConfig, SamplingParams
from diffrt.engine.models.embedded import embedded_folder
from diffrt.engine.weights import update as update_module
from diffrt.engine.weights.update import checksum
from diffrt.serve import ServeSettings, build_app
from diffrt.serve.images import StoreFull
from diffrt.serve.rollout_store import RolloutStore, estimate_bytes

GEN = "/v1/images/generations"
OTHER_KEY = "other-key"
TARGETS = ("to_q", "to_k", "to_v", "proj_mlp")
TRANSFORMER = "transformer/diffusion_pytorch_model.safetensors"
ROLLOUT = {"sampler": "flow-sde", "noise_level": 0.8, "return_log_probs": True}
PLAIN = {"prompt": "a red square", "size": "32x32", "num_inference_steps": 2, "seed": 1}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """--weights-dir with the original transformer file, --lora-dir with two
    adapters (``a``, ``b``: other seeds)."""
    original = embedded_folder("tiny-flux")
    weights = tmp_path_factory.mktemp("weights")
    shutil.copy(f"{original}/{TRANSFORMER}", weights / "original.safetensors")
    loras = tmp_path_factory.mktemp("loras")
    for name, seed in (("a", 1), ("b", 2)):
        make_adapter(original, "FluxPipeline", loras / name, targets=TARGETS, rank=4, seed=seed)
    return weights, loras


@pytest.fixture(scope="module")
def engine(dirs):
    _, loras = dirs
    with DiffusionEngine.make_engine(EngineConfig(
            model="tiny-flux", executor_backend="inproc", step_execution=True, max_num_seqs=4,
            warmup=False, max_request_seconds=None,
            lora_modules={"a": str(loras / "a"), "b": str(loras / "b")})) as e:
        yield e


@pytest.fixture(scope="module")
def app(engine, dirs):
    weights, loras = dirs
    return build_app(settings=ServeSettings(api_key=(API_KEY, OTHER_KEY), weights_dir=str(weights),
                                            lora_dir=str(loras)), engine=engine)


def _pixels(doc: dict) -> np.ndarray:
    return np.stack([np.asarray(Image.open(io.BytesIO(base64.b64decode(d["b64_json"]))))
                     for d in doc["data"]])


def _error(r: httpx.Response, status: int, param: str | None, needle: str) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and needle in error["message"], error
    return error


def _load(app, url: str, key: str = API_KEY) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    from safetensors import safe_open
    from safetensors.torch import load

    r = call(app, "GET", url, headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/octet-stream"
    with open_bytes(r.content) as path, safe_open(path, framework="pt") as f:
        metadata = f.metadata()
    return load(r.content), metadata


class open_bytes:
    """``data`` in a temporary file (safetensors reads metadata from a file)."""

    def __init__(self, data: bytes):
        import tempfile

        self.file = tempfile.NamedTemporaryFile(suffix=".safetensors")
        self.file.write(data)
        self.file.flush()

    def __enter__(self) -> str:
        return self.file.name

    def __exit__(self, *exc) -> None:
        self.file.close()


def test_the_rollout_downloads_bit_identical_to_the_engines(app, engine):
    body = {"prompt": "a blue circle", "size": "32x32", "num_inference_steps": 3, "n": 2,
            "seeds": [5, 6], "return_trajectory": True, **ROLLOUT}
    r = call(app, "POST", GEN, json=body)
    assert r.status_code == 200, r.text
    info = r.json()["diffrt"]
    ref = info["rollout"]
    assert info["seeds"] == [5, 6] and info["weights_version"] == 0
    assert ref["url"] == f"/v1/rollouts/{ref['id']}" and ref["weights_version"] == 0
    assert ref["tensors"] == ["latents", "log_probs", "sigmas", "timesteps"]
    got, metadata = _load(app, ref["url"])
    assert ref["bytes"] == len(call(app, "GET", ref["url"]).content)

    out = engine.generate(DiffusionRequest(prompt="a blue circle", sampling_params=SamplingParams(
        height=32, width=32, num_inference_steps=3, num_outputs_per_prompt=2, seeds=[5, 6],
        sampler="flow-sde", noise_level=0.8, return_log_probs=True, return_trajectory=True,
        partial_images=0)))
    want = out.rollout
    for name in ref["tensors"]:
        assert torch.equal(got[name], getattr(want, name)), name
        assert got[name].dtype == getattr(want, name).dtype
    assert got["log_probs"].shape == (2, 3) and got["latents"].shape[:2] == (2, 4)
    assert json.loads(metadata["seeds"]) == [5, 6] and metadata["prompt"] == "a blue circle"
    assert json.loads(metadata["weights_version"]) == 0 and metadata["sampler"] == "flow-sde"
    assert json.loads(metadata["noise_level"]) == 0.8 and metadata["format"] == "diffrt-rollout/1"
    # the store measured a latent's bytes: the next such request reserves what its file takes
    request = DiffusionRequest(prompt="a blue circle", sampling_params=SamplingParams(
        height=32, width=32, num_inference_steps=3, num_outputs_per_prompt=2,
        return_log_probs=True, sampler="flow-sde", return_trajectory=True))
    store = app.state.rollouts
    assert store.latent_bytes_per_pixel == want.latents.nbytes / (2 * 4 * 32 * 32)
    assert ref["bytes"] <= estimate_bytes(None, request, store.latent_bytes_per_pixel) < (
        ref["bytes"] + 20_000)

    # keyed, and its key's: no key 401, another key 404; DELETE frees it
    _error(call(app, "GET", ref["url"], headers={}), 401, None, "API key")
    _error(call(app, "GET", ref["url"], headers={"Authorization": f"Bearer {OTHER_KEY}"}),
           404, "rollout_id", "not found")
    assert call(app, "DELETE", ref["url"]).json() == {"id": ref["id"], "object": "rollout",
                                                       "deleted": True}
    _error(call(app, "GET", ref["url"]), 404, "rollout_id", "not found")


def test_a_stream_carries_the_rollout_in_its_completed_event(app):
    body = {"prompt": "a green square", "size": "32x32", "num_inference_steps": 2,
            "seeds": [9], "stream": True, **ROLLOUT}
    r = call(app, "POST", GEN, json=body)
    assert r.status_code == 200, r.text
    name, data = events(r.text)[-1]
    assert name == "image_generation.completed"
    ref = data["diffrt"]["rollout"]
    assert ref["tensors"] == ["log_probs", "sigmas", "timesteps"]
    got, metadata = _load(app, ref["url"])
    assert got["log_probs"].shape == (1, 2) and torch.isfinite(got["log_probs"]).all()
    assert json.loads(metadata["seeds"]) == [9]
    assert app.state.rollouts.usage()["reserved_bytes"] == 0  # the stream gave its room back


def test_the_rollout_fields_refusals_and_a_full_store(engine):
    small = build_app(settings=ServeSettings(api_key=API_KEY, rollout_max_bytes=40_000),
                      engine=engine)
    # a trajectory: estimated at the arena's 3 bytes a pixel until one is seen
    _error(call(small, "POST", GEN, json={**PLAIN, "size": "64x64", "return_trajectory": True}),
           400, "return_trajectory", "--rollout-max-bytes")
    _error(call(small, "POST", GEN, json={**PLAIN, "return_log_probs": True}),
           400, "return_log_probs", "flow-sde")
    png = io.BytesIO()
    Image.new("RGB", (32, 32), "red").save(png, format="PNG")
    edit = call(small, "POST", "/v1/images/edits", files={"image": ("a.png", png.getvalue())},
                data={"prompt": "x", "size": "32x32", "sampler": "flow-sde",
                      "return_log_probs": "true"})
    _error(edit, 400, "sampler", "text-to-image")  # rollouts are text-to-image
    assert small.state.rollouts.usage()["reserved_bytes"] == 0  # its room given back
    other = small.state.rollouts.reserve(1, 30_000)  # another request's room, in flight
    full = call(small, "POST", GEN, json={**PLAIN, **ROLLOUT})
    assert full.status_code == 429 and int(full.headers["Retry-After"]) >= 1
    assert full.json()["error"]["code"] == "rollout_store_full"
    other.release()
    kept = call(small, "POST", GEN, json={**PLAIN, **ROLLOUT})
    assert kept.status_code == 200, kept.text
    size = kept.json()["diffrt"]["rollout"]["bytes"]
    metrics = call(small, "GET", "/metrics").text
    assert f"diffrt_rollout_bytes {float(size)}" in metrics and "diffrt_rollouts 1.0" in metrics
    assert "diffrt_rollout_bytes_reserved 0.0" in metrics
    plain = call(small, "POST", GEN, json=PLAIN).json()["diffrt"]  # no rollout asked: none
    assert "rollout" not in plain and plain["weights_version"] == 0


def test_the_rollout_store_expires_and_keeps_owners_apart():
    now = [0.0]
    store = RolloutStore(ttl_s=10, max_bytes=100, clock=lambda: now[0])
    kept = store.reserve(1, 60, owner="o1")
    rollout_id = kept.put(b"x" * 50, "application/octet-stream")
    assert store.get(rollout_id, "o1") == (b"x" * 50, "application/octet-stream")
    assert store.get(rollout_id, "o2") is None and not store.delete(rollout_id, "o2")
    with pytest.raises(StoreFull) as full:
        store.reserve(1, 60, owner="o2")
    assert full.value.retry_after_s == 10
    now[0] = 10.0
    assert store.get(rollout_id, "o1") is None  # expired: 404
    assert store.reserve(1, 60).count == 1  # and its room is free
    with pytest.raises(ValueError, match="rollout-max-bytes"):
        store.reserve(1, 101)


def _upload(tensors: dict[str, torch.Tensor], **fields) -> dict:
    from safetensors.torch import save

    return {"files": {"file": ("w.safetensors", save(tensors), "application/octet-stream")},
            "data": fields}


def test_post_weights_from_an_upload_and_a_path(app, engine, dirs):
    from safetensors.torch import load_file

    weights, _ = dirs
    original = load_file(weights / "original.safetensors")
    before = call(app, "POST", GEN, json=PLAIN).json()
    generator = torch.Generator().manual_seed(7)
    perturbed = {k: t + 0.05 * torch.randn(t.shape, generator=generator).to(t.dtype)
                 for k, t in original.items()}
    r = call(app, "POST", "/v1/weights", **_upload(perturbed, version="7"))
    assert r.status_code == 200, r.text
    assert r.json() == {"object": "weights", "version": 7, "checksum": checksum(perturbed),
                        "rank_checksums": [checksum(perturbed)]}
    after = call(app, "POST", GEN, json=PLAIN).json()
    assert after["diffrt"]["weights_version"] == 7
    assert not np.array_equal(_pixels(after), _pixels(before))

    r = call(app, "POST", "/v1/weights", json={"path": "original.safetensors",
                                               "version": "restored", "policy": "abort"})
    assert r.status_code == 200 and r.json()["version"] == "restored", r.text
    back = call(app, "POST", GEN, json=PLAIN).json()
    assert back["diffrt"]["weights_version"] == "restored"
    assert np.array_equal(_pixels(back), _pixels(before))
    engine.update_weights(original, version=0)


def test_post_weights_refusals_keep_the_old_weights(app, engine, dirs, monkeypatch, tmp_path):
    name = next(iter(engine_tensors(dirs)))
    _error(call(app, "POST", "/v1/weights", files={"file": ("w", b"nonsense", "x/y")}),
           400, "file", "not a safetensors file")
    _error(call(app, "POST", "/v1/weights", **_upload({"no.such": torch.zeros(2)})),
           400, "file", "does not have")
    _error(call(app, "POST", "/v1/weights", **_upload({name: torch.zeros(3, 1)})),
           400, "file", "shape")
    _error(call(app, "POST", "/v1/weights", json={"path": str(tmp_path)}),
           403, "path", "outside the server's --weights-dir")
    _error(call(app, "POST", "/v1/weights", json={"path": "missing"}), 400, "path", "no such")
    _error(call(app, "POST", "/v1/weights", json={"path": "original.safetensors",
                                                  "policy": "later"}), 400, "policy", "")
    _error(call(app, "POST", "/v1/weights", json={}), 400, "path", "required")
    _error(call(app, "POST", "/v1/weights", json={"path": "x"}, headers={}), 401, None, "API key")
    closed = build_app(settings=ServeSettings(api_key=API_KEY, max_upload_body_bytes=1000),
                       engine=engine)
    _error(call(closed, "POST", "/v1/weights", json={"path": "original.safetensors"}),
           403, "path", "--weights-dir")
    assert call(closed, "POST", "/v1/weights",
                **_upload(engine_tensors(dirs))).status_code == 413

    monkeypatch.setattr(update_module, "checksum", lambda tensors: "0badc0de")
    _error(call(app, "POST", "/v1/weights", json={"path": "original.safetensors"}),
           409, "path", "0badc0de")
    monkeypatch.undo()
    assert engine.weights_version == 0  # nothing applied


def engine_tensors(dirs) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(dirs[0] / "original.safetensors")


def test_put_lora_gives_the_adapter_new_factors(app, dirs):
    from safetensors.torch import load_file

    _, loras = dirs
    with_a = call(app, "POST", GEN, json={**PLAIN, "loras": {"a": 1.0}}).json()
    with_b = call(app, "POST", GEN, json={**PLAIN, "loras": {"b": 1.0}}).json()
    assert with_a["diffrt"]["lora_versions"] == {"a": 0}
    assert not np.array_equal(_pixels(with_a), _pixels(with_b))
    factors = load_file(loras / "b" / "pytorch_lora_weights.safetensors")
    r = call(app, "PUT", "/v1/loras/a", **_upload(factors))
    assert r.status_code == 200, r.text
    assert r.json()["name"] == "a" and r.json()["version"] == 1
    now = call(app, "POST", GEN, json={**PLAIN, "loras": {"a": 1.0}}).json()
    assert now["diffrt"]["lora_versions"] == {"a": 1}
    assert np.array_equal(_pixels(now), _pixels(with_b))  # as registering b's factors gives

    r = call(app, "PUT", "/v1/loras/a", json={"path": "a", "version": "original"})  # a path
    assert r.status_code == 200 and r.json()["version"] == "original", r.text
    listed = {c["name"]: c["version"] for c in call(app, "GET", "/v1/loras").json()["data"]}
    assert listed == {"a": "original", "b": 0}

    _error(call(app, "PUT", "/v1/loras/nope", json={"path": "a"}), 404, "name", "nope")
    _error(call(app, "PUT", "/v1/loras/a", json={"path": "/etc"}), 403, "path", "--lora-dir")
    _error(call(app, "PUT", "/v1/loras/a", files={"file": ("f", b"junk", "x/y")}),
           400, "file", "not a safetensors file")
    _error(call(app, "PUT", "/v1/loras/a", json={"path": "a"}, headers={}), 401, None, "API key")
