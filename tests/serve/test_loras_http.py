"""LoRA adapters over HTTP: GET/POST/DELETE /v1/loras, ``loras`` in the images
body (sent by the openai client as ``extra_body``), the refusals of
registration (no --lora-dir, a path outside it, a duplicate, a bad file), the
API key, and the adapters' metrics. One tiny-flux engine of this module's own
(adapters registered here must not reach the shared engines)."""

from __future__ import annotations

import asyncio
import base64
import io
import os

import httpx
import numpy as np
import pytest
from lora_files import make_adapter
from PIL import Image
from serve_helpers import API_KEY, call

from diffrt.engine import DiffusionEngine, EngineConfig
from diffrt.serve import ServeSettings, build_app

LORAS = "/v1/loras"
GEN = "/v1/images/generations"


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory):
    """A --lora-dir holding one tiny adapter (``style/``), a text file named
    like an adapter, a symlink that leads outside it and a folder whose
    weights file is such a link."""
    from diffrt.engine.models.embedded import embedded_folder
    from diffrt.engine.pipelines.flux.spec import LORA_TARGET_MODULES

    root = tmp_path_factory.mktemp("loras")
    outside = tmp_path_factory.mktemp("elsewhere")
    make_adapter(embedded_folder("tiny-flux"), "FluxPipeline", root / "style",
                 targets=LORA_TARGET_MODULES, rank=4, seed=1)
    make_adapter(embedded_folder("tiny-flux"), "FluxPipeline", outside / "secret",
                 targets=LORA_TARGET_MODULES, rank=4, seed=2)
    (root / "x.safetensors").write_text("not an adapter")
    os.symlink(outside / "secret", root / "leak")
    # a real folder inside whose weights file is a link leading out
    (root / "trojan").mkdir()
    os.symlink(outside / "secret" / "pytorch_lora_weights.safetensors",
               root / "trojan" / "pytorch_lora_weights.safetensors")
    return root, outside


@pytest.fixture(scope="module")
def lora_engine():
    with DiffusionEngine.make_engine(EngineConfig(
            model="tiny-flux", executor_backend="inproc", step_execution=True,
            max_num_seqs=4, max_loras=2, warmup=False)) as engine:
        yield engine


@pytest.fixture(scope="module")
def app(lora_engine, lora_dir):
    return build_app(settings=ServeSettings(api_key=API_KEY, lora_dir=str(lora_dir[0])),
                     engine=lora_engine)


def _pixels(b64_json: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64_json))).convert("RGB"),
                      dtype=np.float32)


def _error(r: httpx.Response, status: int, param: str | None, needle: str) -> None:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and needle in error["message"], error


def test_register_list_generate_with_and_without_and_delete(app, lora_dir):
    from openai import AsyncOpenAI, BadRequestError

    root, _ = lora_dir
    assert call(app, "GET", LORAS).json() == {"object": "list", "data": []}
    r = call(app, "POST", LORAS, json={"name": "style", "path": "style"})  # inside the dir
    assert r.status_code == 201, r.text
    card = r.json()
    assert card["name"] == "style" and card["path"] == os.path.realpath(root / "style")
    assert card["rank"] == 4 and card["modules"] > 0 and card["nbytes"] > 0
    assert card["requests"] == 0 and card["active"] == 0
    assert call(app, "GET", LORAS).json() == {"object": "list", "data": [card]}

    async def images() -> tuple[np.ndarray, np.ndarray, BadRequestError]:
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app))
        client = AsyncOpenAI(base_url="http://testserver/v1", api_key=API_KEY, http_client=http)
        kw = dict(model="tiny-flux", prompt="a red fox", size="64x64")
        common = {"seed": 3, "num_inference_steps": 2}
        plain = await client.images.generate(**kw, extra_body=common)
        styled = await client.images.generate(**kw, extra_body={**common,
                                                                "loras": {"style": 1.0}})
        with pytest.raises(BadRequestError) as refused:
            await client.images.generate(**kw, extra_body={**common, "loras": {"nope": 1.0}})
        await http.aclose()
        return _pixels(plain.data[0].b64_json), _pixels(styled.data[0].b64_json), refused.value

    plain, styled, refused = asyncio.run(images())
    assert np.abs(plain - styled).mean() > 4.0, "the adapter changed little"  # 20 measured
    assert refused.status_code == 400
    assert refused.body["param"] == "loras" and "no adapter named 'nope'" in refused.body["message"]

    _error(call(app, "POST", GEN, json={"prompt": "x", "loras": {"style": "strong"}}),
           400, "loras.style", "loras.style")
    listed = call(app, "GET", LORAS).json()["data"][0]
    assert listed["requests"] == 1 and listed["active"] == 0 and listed["slot"] is not None

    metrics = call(app, "GET", "/metrics").text
    for line in ("diffrt_loras_registered 1.0", "diffrt_lora_slots 2.0",
                 "diffrt_lora_slots_used 1.0", "diffrt_lora_loads_total 1.0",
                 "diffrt_lora_evictions_total 0.0",
                 'diffrt_lora_requests_total{adapter="style"} 1.0'):
        assert line in metrics, metrics

    r = call(app, "DELETE", f"{LORAS}/style")
    assert r.status_code == 200 and r.json() == {"name": "style", "object": "lora",
                                                 "deleted": True}
    assert call(app, "GET", LORAS).json()["data"] == []
    _error(call(app, "DELETE", f"{LORAS}/style"), 404, "name", "no LoRA adapter named 'style'")
    _error(call(app, "POST", GEN, json={"prompt": "x", "loras": {"style": 1.0}}),
           400, "loras", "no adapter named 'style'")


def test_registration_refusals(app, lora_engine, lora_dir):
    root, outside = lora_dir
    closed = build_app(settings=ServeSettings(api_key=API_KEY), engine=lora_engine)
    _error(call(closed, "POST", LORAS, json={"name": "a", "path": str(root / "style")}),
           403, "path", "--lora-dir")
    for path in (str(outside / "secret"), "../" + outside.name + "/secret", "leak", "trojan"):
        _error(call(app, "POST", LORAS, json={"name": "a", "path": path}),
               403, "path", "outside the server's --lora-dir")
    _error(call(app, "POST", LORAS, json={"name": "a", "path": "x.safetensors"}),
           400, "path", "x.safetensors")
    _error(call(app, "POST", LORAS, json={"name": "a", "path": "missing"}),
           400, "path", "no such file")
    _error(call(app, "POST", LORAS, json={"name": "a"}), 400, "path", "required")
    assert call(app, "POST", LORAS, json={"name": "dup", "path": "style"}).status_code == 201
    try:
        _error(call(app, "POST", LORAS, json={"name": "dup", "path": "style"}),
               409, "name", "registered already")
        assert [c["name"] for c in call(app, "GET", LORAS).json()["data"]] == ["dup"]
    finally:
        assert call(app, "DELETE", f"{LORAS}/dup").status_code == 200


def test_the_lora_routes_need_the_api_key(app):
    for method, path, kw in (("GET", LORAS, {}),
                             ("POST", LORAS, {"json": {"name": "a", "path": "style"}}),
                             ("DELETE", f"{LORAS}/a", {})):
        _error(call(app, method, path, headers={}, **kw), 401, None, "API key")
        _error(call(app, method, path, headers={"Authorization": "Bearer wrong"}, **kw),
               401, None, "API key")
    assert call(app, "GET", LORAS).json()["data"] == []  # nothing was registered


def test_registration_runs_off_the_event_loop(app, lora_engine, monkeypatch):
    """add_lora waits for every worker to read the file: meanwhile the server
    answers other requests."""
    import threading

    from diffrt.engine import LoraInfo

    entered, release = threading.Event(), threading.Event()

    def add_lora(name: str, path: str) -> LoraInfo:  # a file that takes long to read
        entered.set()
        release.wait(10)
        return LoraInfo(name=name, path=path, rank=1, modules=1, nbytes=1, requests=0,
                        active=0, slot=None)

    monkeypatch.setattr(lora_engine, "add_lora", add_lora)

    async def main() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver",
                                     headers={"Authorization": f"Bearer {API_KEY}"}) as c:
            posting = asyncio.ensure_future(c.post(LORAS, json={"name": "slow", "path": "style"}))
            assert await asyncio.to_thread(entered.wait, 10)
            health = await asyncio.wait_for(c.get("/health"), 5)  # not stuck behind add_lora
            assert health.status_code == 200
            assert not posting.done()
            release.set()
            assert (await posting).json()["name"] == "slow"

    asyncio.run(main())
