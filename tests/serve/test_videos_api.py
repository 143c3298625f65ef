"""OpenAI's videos API over tiny-wan (``serve/video_routes.py``), through
the in-process app around one shared engine (in-process executor, step
mode): the ``openai`` client's create_and_poll, download_content, remix,
list and delete; the MP4 decodes to the engine's own frames for the same
seed (within H.264's loss), the thumbnail is the first frame exactly; Range
requests; progress as server-sent events; a job outlives the connection
that created it; a deleted running job is aborted in the engine and leaves
no file; the store full is 429; a restarted server lists its finished jobs
and fails its unfinished ones; bad seconds, size and uploads are 400s
naming the field; /metrics counts the jobs."""

from __future__ import annotations

import asyncio
import io
import sys
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import PIL.Image
import pytest
from engine_helpers import assert_clean, shared_engine

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # video_decode
from video_decode import decode_mp4, psnr  # noqa: E402

from diffrt.engine import DiffusionEngine, DiffusionRequest, EngineConfig, SamplingParams  # noqa: E402
from diffrt.serve import ServeSettings, build_app  # noqa: E402

openai = pytest.importorskip("openai")
pytest.importorskip("diffusers")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # openai marks Sora's API

PROMPT = "a red fox runs"


@pytest.fixture(scope="module")
def engine():
    config = EngineConfig(model="tiny-wan", executor_backend="inproc", warmup=False,
                          step_execution=True, max_num_seqs=2, max_request_seconds=3600)
    with shared_engine(DiffusionEngine.make_engine(config)) as shared:
        yield shared


def make_app(engine: DiffusionEngine, folder: Path, **settings: Any) -> Any:
    return build_app(settings=ServeSettings(video_dir=str(folder), **settings), engine=engine)


def run(app: Any, scenario: Any) -> Any:
    """``scenario(openai_client, http)`` on one event loop (the jobs' tasks run on it)."""
    async def main() -> Any:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t",
                                     timeout=60) as http:
            client = openai.AsyncOpenAI(base_url="http://t/v1", api_key="k", http_client=http)
            return await scenario(client, http)

    return asyncio.run(main())


def engine_frames(engine: DiffusionEngine, seed: int) -> np.ndarray:
    out = engine.generate(DiffusionRequest(prompt=PROMPT, sampling_params=SamplingParams(
        seed=seed, output_type="np")))
    assert out.ok, out.error
    return out.output[0]


async def until_finished(http: httpx.AsyncClient, video_id: str) -> dict:
    for _ in range(600):
        job = (await http.get(f"/v1/videos/{video_id}")).json()
        if job["status"] in ("completed", "failed"):
            return job
        await asyncio.sleep(0.05)
    raise AssertionError(f"{video_id} never finished")


def test_create_poll_download_remix_list_as_the_openai_client_does(engine, tmp_path):
    app = make_app(engine, tmp_path)

    async def scenario(client: Any, http: httpx.AsyncClient) -> dict:
        got: dict[str, Any] = {}
        jobs = [await client.videos.create_and_poll(prompt=PROMPT, seconds="0.5",
                                                    size="64x64", poll_interval_ms=50,
                                                    extra_body={"seed": seed})
                for seed in (1, 2)]
        got["jobs"] = jobs
        got["mp4"] = [(await client.videos.download_content(j.id)).read() for j in jobs]
        got["thumb"] = (await client.videos.download_content(jobs[0].id,
                                                             variant="thumbnail")).read()
        got["sprite"] = await http.get(f"/v1/videos/{jobs[0].id}/content",
                                       params={"variant": "spritesheet"})
        got["range"] = await http.get(f"/v1/videos/{jobs[0].id}/content",
                                      headers={"Range": "bytes=100-299"})
        got["suffix"] = await http.get(f"/v1/videos/{jobs[0].id}/content",
                                       headers={"Range": "bytes=-50"})
        got["bad_range"] = await http.get(f"/v1/videos/{jobs[0].id}/content",
                                          headers={"Range": "bytes=99999999-"})
        remix = await client.videos.remix(jobs[0].id, prompt="a blue fox runs")
        got["remix"] = await until_finished(http, remix.id)
        got["events"] = (await http.get(f"/v1/videos/{remix.id}/events")).text
        first = await client.videos.list(limit=2, order="asc")
        got["page1"] = first
        got["page2"] = await client.videos.list(limit=2, order="asc", after=first.data[-1].id)
        got["bad_after"] = await http.get("/v1/videos", params={"after": "video_" + "0" * 32})
        got["metrics"] = (await http.get("/metrics")).text
        return got

    got = run(app, scenario)
    jobs = got["jobs"]
    assert [j.status for j in jobs] == ["completed"] * 2
    assert (jobs[0].progress, jobs[0].seconds, jobs[0].size, jobs[0].model) == (
        100, "0.5", "64x64", "tiny-wan")
    want = [engine_frames(engine, seed) for seed in (1, 2)]
    for i, mp4 in enumerate(got["mp4"]):
        decoded = decode_mp4(mp4)
        assert decoded.frames.shape == want[i].shape and decoded.fps == 16
        assert min(psnr(frame, own) for frame, own in zip(decoded.frames, want[i], strict=True)) >= 20
        # tiny-wan's seeds differ little in their first frames (47 dB apart at
        # frame 0, 33 at frame 2), less than H.264's loss: the clip as a whole
        # must be closer to its own seed's by 3 dB
        assert psnr(decoded.frames, want[i]) >= psnr(decoded.frames, want[1 - i]) + 3, (
            psnr(decoded.frames, want[i]), psnr(decoded.frames, want[1 - i]))
    thumb = np.asarray(PIL.Image.open(io.BytesIO(got["thumb"])).convert("RGB"))
    assert np.array_equal(thumb, want[0][0])
    assert got["sprite"].status_code == 200 and got["sprite"].headers["content-type"] == \
        "image/jpeg"
    mp4 = got["mp4"][0]
    assert got["range"].status_code == 206 and got["range"].content == mp4[100:300]
    assert got["range"].headers["content-range"] == f"bytes 100-299/{len(mp4)}"
    assert got["suffix"].status_code == 206 and got["suffix"].content == mp4[-50:]
    assert got["bad_range"].status_code == 416
    remix = got["remix"]
    assert remix["status"] == "completed" and remix["remixed_from_video_id"] == jobs[0].id
    assert remix["prompt"] == "a blue fox runs"
    names = [line.split(": ", 1)[1] for line in got["events"].splitlines()
             if line.startswith("event: ")]
    assert names == ["video.completed"]  # it had finished: one event
    assert [v.id for v in got["page1"].data] == [jobs[0].id, jobs[1].id]
    assert got["page1"].has_more and not got["page2"].has_more
    assert [v.id for v in got["page2"].data] == [remix["id"]]
    assert got["bad_after"].status_code == 400
    assert got["bad_after"].json()["error"]["param"] == "after"
    assert 'diffrt_videos_total{outcome="completed"} 3.0' in got["metrics"]
    assert "diffrt_video_encode_seconds_count 3.0" in got["metrics"]
    assert "diffrt_video_store_bytes" in got["metrics"]
    assert_clean(engine)


def test_progress_events_then_a_deleted_running_job_is_aborted_and_gone(engine, tmp_path):
    app = make_app(engine, tmp_path)

    async def scenario(client: Any, http: httpx.AsyncClient) -> tuple:
        short = await client.videos.create(prompt=PROMPT, seconds="0.25", size="32x32",
                                           extra_body={"num_inference_steps": 4})
        stream = (await http.get(f"/v1/videos/{short.id}/events")).text
        long = await client.videos.create(prompt=PROMPT, size="32x32",
                                          extra_body={"num_inference_steps": 300})
        for _ in range(400):
            job = await client.videos.retrieve(long.id)
            if job.progress > 0:
                break
            await asyncio.sleep(0.02)
        deleted = await client.videos.delete(long.id)
        gone = await http.get(f"/v1/videos/{long.id}")
        return stream, job, deleted, gone, long.id

    stream, running, deleted, gone, long_id = run(app, scenario)
    import json

    events = [(block.split("\n")[0][7:], json.loads(block.split("\n")[1][6:]))
              for block in stream.strip().split("\n\n")]
    assert events[-1][0] == "video.completed" and events[-1][1]["progress"] == 100
    progress = [data["progress"] for _, data in events]
    assert progress == sorted(progress) and len(events) >= 2
    assert running.status == "in_progress" and 0 < running.progress < 100
    assert deleted.deleted and deleted.id == long_id and gone.status_code == 404
    assert_clean(engine)  # aborted in the engine
    assert not [p for p in tmp_path.iterdir() if long_id in p.name]


def test_a_job_outlives_its_client_and_a_restart_lists_finished_and_fails_unfinished(
        engine, tmp_path):
    app = make_app(engine, tmp_path)

    async def first(client: Any, http: httpx.AsyncClient) -> tuple:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://t") as gone_client:
            made = (await gone_client.post("/v1/videos", json={
                "prompt": PROMPT, "size": "32x32", "seconds": "0.25"})).json()
        # that client is closed: the job goes on
        done = await until_finished(http, made["id"])
        long = await client.videos.create(prompt=PROMPT, size="32x32",
                                          extra_body={"num_inference_steps": 300})
        await app.state.video_runs.close()  # the server dies with the job unfinished
        app.state.videos.close()
        return done, long.id

    done, unfinished = run(app, first)
    assert done["status"] == "completed"
    assert_clean(engine)
    again = make_app(engine, tmp_path)

    async def second(client: Any, http: httpx.AsyncClient) -> tuple:
        listed = await client.videos.list()
        mp4 = (await client.videos.download_content(done["id"])).read()
        return listed, mp4

    listed, mp4 = run(again, second)
    by_id = {v.id: v for v in listed.data}
    assert by_id[done["id"]].status == "completed" and decode_mp4(mp4).frames.shape[0] == 5
    assert by_id[unfinished].status == "failed"
    assert by_id[unfinished].error.code == "server_restarted"
    again.state.videos.close()


def test_a_full_store_is_429_with_retry_after(engine, tmp_path):
    app = make_app(engine, tmp_path, video_store_bytes=1_300_000)

    async def scenario(client: Any, http: httpx.AsyncClient) -> tuple:
        body = {"prompt": PROMPT, "size": "64x64", "num_inference_steps": 200}
        first = await http.post("/v1/videos", json=body)
        second = await http.post("/v1/videos", json=body)
        await http.delete(f"/v1/videos/{first.json()['id']}")
        too_big = await http.post("/v1/videos", json={**body, "size": "512x512",
                                                       "num_inference_steps": 2})
        return first, second, too_big

    first, second, too_big = run(app, scenario)
    assert first.status_code == 200
    assert second.status_code == 429 and int(second.headers["retry-after"]) >= 1
    assert second.json()["error"]["code"] == "video_store_full"
    assert too_big.status_code == 400
    assert_clean(engine)
    app.state.videos.close()


@pytest.mark.parametrize("fields,param", [
    ({"seconds": "0.3"}, "seconds"), ({"seconds": "four"}, "seconds"),
    ({"size": "63x64"}, "size"), ({"size": "big"}, "size"),
    ({"num_frames": 6}, "num_frames"), ({"n": 2}, "n")])
def test_bad_fields_are_400_naming_them(engine, tmp_path, fields, param):
    app = make_app(engine, tmp_path)
    got = run(app, lambda _, http: http.post("/v1/videos", json={"prompt": PROMPT, **fields}))
    assert got.status_code == 400, got.text
    assert got.json()["error"]["param"] == param
    app.state.videos.close()


def test_a_first_frame_on_a_text_to_video_model_and_a_bad_upload_are_refused(engine,
                                                                             tmp_path):
    app = make_app(engine, tmp_path)
    png = io.BytesIO()
    PIL.Image.new("RGB", (64, 64), (9, 99, 200)).save(png, format="PNG")

    async def scenario(client: Any, http: httpx.AsyncClient) -> tuple:
        t2v = await http.post("/v1/videos", data={"prompt": PROMPT},
                              files={"input_reference": ("f.png", png.getvalue(), "image/png")})
        junk = await http.post("/v1/videos", data={"prompt": PROMPT},
                               files={"input_reference": ("f.png", b"not an image",
                                                          "image/png")})
        return t2v, junk

    t2v, junk = run(app, scenario)
    for got in (t2v, junk):
        assert got.status_code == 400 and got.json()["error"]["param"] == "input_reference"
    assert "text only" in t2v.json()["error"]["message"]
    app.state.videos.close()


def test_input_reference_is_the_first_frame_of_an_image_to_video_folder(tmp_path):
    config = EngineConfig(model="tiny-wan-i2v", executor_backend="inproc", warmup=False,
                          step_execution=True)
    png = io.BytesIO()
    PIL.Image.new("RGB", (64, 64), (9, 99, 200)).save(png, format="PNG")
    with DiffusionEngine.make_engine(config) as i2v:
        app = make_app(i2v, tmp_path)

        async def scenario(client: Any, http: httpx.AsyncClient) -> tuple:
            made = await client.videos.create(
                prompt=PROMPT, size="64x64", seconds="0.25",
                input_reference=("first.png", png.getvalue(), "image/png"),
                extra_body={"seed": 5, "num_inference_steps": 2})
            done = await until_finished(http, made.id)
            mp4 = (await client.videos.download_content(made.id)).read()
            return done, mp4

        done, mp4 = run(app, scenario)
        assert done["status"] == "completed", done
        want = i2v.generate(DiffusionRequest(
            prompt=PROMPT, images=[PIL.Image.open(io.BytesIO(png.getvalue()))],
            sampling_params=SamplingParams(seed=5, num_inference_steps=2, num_frames=5,
                                           height=64, width=64, output_type="np")))
        decoded = decode_mp4(mp4).frames
        assert decoded.shape == (5, 64, 64, 3)
        assert min(psnr(d, w) for d, w in zip(decoded, want.output[0], strict=True)) >= 20
        app.state.videos.close()


def test_max_pending_sheds_jobs_with_429_before_they_exist(engine, tmp_path):
    """Two jobs run (max_num_seqs=2), one may wait (max_pending=1): a fourth
    is refused with Retry-After and no job is made for it."""
    app = make_app(engine, tmp_path, max_pending=1)

    async def scenario(client: Any, http: httpx.AsyncClient) -> tuple:
        body = {"prompt": PROMPT, "size": "32x32", "num_inference_steps": 300}
        answers = []
        for _ in range(5):
            answers.append(await http.post("/v1/videos", json=body))
            if answers[-1].status_code == 429:
                break
        listed = (await http.get("/v1/videos")).json()["data"]
        for job in listed:
            await http.delete(f"/v1/videos/{job['id']}")
        return answers, listed

    answers, listed = run(app, scenario)
    refused = answers[-1]
    assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert 1 <= len(listed) == len(answers) - 1 <= 3  # the refused one made no job
    assert_clean(engine)
    app.state.videos.close()


def test_with_several_keys_a_job_is_seen_only_with_the_key_that_made_it(engine, tmp_path):
    """``api_key`` of two keys: Alice's job is listed, retrieved, downloaded,
    followed, remixed and deleted with her key only; to Bob it does not
    exist (404, as OpenAI answers for another organisation's objects) and
    his list is empty; /v1/models answers both."""
    app = make_app(engine, tmp_path, api_key=("alice-key", "bob-key"))

    async def scenario(_: Any, http: httpx.AsyncClient) -> dict:
        alice = {"Authorization": "Bearer alice-key"}
        bob = {"Authorization": "Bearer bob-key"}
        made = (await http.post("/v1/videos", headers=alice, json={
            "prompt": PROMPT, "size": "32x32", "seconds": "0.25",
            "num_inference_steps": 2})).json()
        vid = made["id"]
        for _ in range(600):
            job = (await http.get(f"/v1/videos/{vid}", headers=alice)).json()
            if job["status"] in ("completed", "failed"):
                break
            await asyncio.sleep(0.05)
        got: dict[str, Any] = {"job": job}
        got["bob"] = [await http.get(f"/v1/videos/{vid}", headers=bob),
                      await http.get(f"/v1/videos/{vid}/content", headers=bob),
                      await http.get(f"/v1/videos/{vid}/events", headers=bob),
                      await http.post(f"/v1/videos/{vid}/remix", headers=bob,
                                      json={"prompt": "mine now"}),
                      await http.delete(f"/v1/videos/{vid}", headers=bob)]
        got["bob_list"] = (await http.get("/v1/videos", headers=bob)).json()
        got["bob_after"] = await http.get("/v1/videos", headers=bob, params={"after": vid})
        got["models"] = [(await http.get("/v1/models", headers=h)).status_code
                         for h in (alice, bob)]
        got["alice_list"] = (await http.get("/v1/videos", headers=alice)).json()
        got["alice_mp4"] = await http.get(f"/v1/videos/{vid}/content", headers=alice)
        got["alice_delete"] = await http.delete(f"/v1/videos/{vid}", headers=alice)
        return got

    got = run(app, scenario)
    assert got["job"]["status"] == "completed", got["job"]
    for answer in got["bob"]:
        assert answer.status_code == 404, (answer.request.url, answer.text)
        assert answer.json()["error"]["code"] == "video_not_found"
    assert got["bob_list"]["data"] == [] and got["bob_after"].status_code == 400
    assert got["models"] == [200, 200]
    assert [v["id"] for v in got["alice_list"]["data"]] == [got["job"]["id"]]
    assert got["alice_mp4"].status_code == 200 and decode_mp4(got["alice_mp4"].content)
    assert got["alice_delete"].json()["deleted"] is True
    assert_clean(engine)
    app.state.videos.close()


def test_what_the_engine_refuses_at_submission_is_a_400_and_no_job(engine, tmp_path):
    """An adapter the engine does not have is refused when the job is asked
    for (400 naming ``loras``), not by a job that then fails."""
    error = refused_without_a_job(engine, tmp_path, {"loras": {"nope": 1.0}})
    assert error["param"] == "loras" and "nope" in error["message"]


def refused_without_a_job(engine: DiffusionEngine, folder: Path, fields: dict) -> dict:
    """POST a 32x32 job with ``fields``; its 400 error, once no job was made of it."""
    app = make_app(engine, folder)

    async def scenario(_: Any, http: httpx.AsyncClient) -> tuple:
        refused = await http.post("/v1/videos", json={"prompt": PROMPT, "size": "32x32",
                                                       **fields})
        return refused, (await http.get("/v1/videos")).json()["data"]

    refused, listed = run(app, scenario)
    app.state.videos.close()
    assert refused.status_code == 400, refused.text
    assert listed == []
    assert_clean(engine)
    return refused.json()["error"]


def test_a_clip_past_max_request_seconds_is_a_400_naming_seconds(tmp_path):
    """The engine's run-time limit, on its estimate (measured from a first
    run; a limit no clip meets): a 400 naming the body's ``seconds``, and
    no job."""
    config = EngineConfig(model="tiny-wan", executor_backend="inproc", warmup=False,
                          step_execution=True, max_request_seconds=1e-6)
    with DiffusionEngine.make_engine(config) as tight:
        # the first run is measured (no estimate before it: admitted)
        assert tight.generate(DiffusionRequest(prompt=PROMPT, sampling_params=SamplingParams(
            num_frames=5, height=32, width=32, num_inference_steps=1))).ok
        error = refused_without_a_job(tight, tmp_path, {"seconds": "0.25"})
    assert error["param"] == "seconds" and "max_request_seconds" in error["message"]
