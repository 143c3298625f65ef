"""POST /v1/images/edits on the session's real ``diffrt serve`` process
(diffrt-shapes, worker processes, sockets on 127.0.0.1): the official
``openai`` client, and memory that stays bounded over many edits of
megabyte uploads, in the server process (the engine) and in its workers."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image
from serve_helpers import API_KEY, AUTH
from server_process import children

pytestmark = pytest.mark.e2e

EDITS = "/v1/images/edits"


def _file(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def _noise(seed: int, side: int) -> Image.Image:
    """Random pixels: a PNG of them is about 3 bytes a pixel (noise does not compress)."""
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8))


def _rss(pid: int) -> int:
    """Resident bytes of a process (``VmRSS``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def test_the_openai_client_edits_on_a_real_server(real_server):
    from openai import OpenAI

    client = OpenAI(base_url=f"{real_server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    picture = Image.new("RGB", (64, 64), (250, 220, 0))  # a yellow background
    mask = Image.new("RGBA", (64, 64), (0, 0, 0, 255))
    mask.paste((0, 0, 0, 0), (16, 16, 48, 48))  # OpenAI's mask: edit the transparent middle
    kw = dict(model="diffrt-shapes", image=("in.png", _file(picture), "image/png"),
              mask=("mask.png", _file(mask), "image/png"),
              prompt="a red circle on a yellow background in the center",
              extra_body={"seed": 5, "strength": 0.9})
    first = client.images.edit(**kw)
    image = Image.open(io.BytesIO(base64.b64decode(first.data[0].b64_json)))
    assert image.size == (64, 64) and first.model_extra["diffrt"]["seed"] == 5
    pixels = np.asarray(image.convert("RGB"), dtype=np.int16)
    # outside the mask the picture is kept (the engine blends the known region back per
    # step, as diffusers' inpainting does): the corners stay near the input's yellow
    corners = np.concatenate([pixels[:12, :12], pixels[:12, -12:], pixels[-12:, :12],
                              pixels[-12:, -12:]]).reshape(-1, 3)
    assert np.abs(corners.mean(axis=0) - (250, 220, 0)).max() < 40, corners.mean(axis=0)

    events = list(client.images.edit(**kw, stream=True, partial_images=2))
    assert [e.type for e in events] == ["image_edit.partial_image"] * 2 + [
        "image_edit.completed"]
    assert events[-1].b64_json == first.data[0].b64_json  # the same edit, streamed


def test_memory_stays_bounded_over_fifty_megabyte_edits(real_server):
    """50 edits at 64x64, each of a fresh ~1 MB PNG (every other one with a
    mask): the server process (the engine, its input arena, the decoders)
    and every worker hold no more after edit 50 than after edit 10, within
    32 MiB."""
    server = real_server.proc.pid
    workers = children(server)
    assert workers, "the server runs its workers as processes (the mp backend)"
    seen: dict[int, dict[int, int]] = {}
    with httpx.Client(base_url=real_server.url, headers=AUTH, timeout=120) as client:
        for i in range(1, 51):
            picture = _file(_noise(i, 580))
            assert len(picture) > 1_000_000
            files = [("image", ("in.png", picture, "image/png"))]
            if i % 2:
                mask = Image.new("L", (580, 580), 0)
                mask.paste(255, (0, 0, 290, 290))
                files.append(("mask", ("mask.png", _file(mask), "image/png")))
            response = client.post(EDITS, files=files, data={
                "prompt": "a blue square on a white background in the center",
                "size": "64x64", "num_inference_steps": "2", "strength": "0.5",
                "true_cfg_scale": "1", "seed": str(i)})  # one step, one row: the bytes matter
            assert response.status_code == 200, response.text[:300]
            if i in (10, 50):
                seen[i] = {pid: _rss(pid) for pid in (server, *workers)}
    assert children(server) == workers  # no worker was replaced on the way
    for pid in (server, *workers):
        grown = seen[50][pid] - seen[10][pid]
        what = "server" if pid == server else f"worker {pid}"
        print(f"{what}: RSS after edit 10 {seen[10][pid] >> 20} MiB, after 50 "
              f"{seen[50][pid] >> 20} MiB ({grown / 2**20:+.1f} MiB)")
        assert grown <= 32 << 20, f"{what}: RSS {seen[10][pid]} -> {seen[50][pid]} bytes"
