"""The videos API on Ray Serve (``diffrt serve --replicas 2 --model tiny-wan``):
two tiny-wan replicas behind the ingress, on the session's local Ray
instance. The jobs live in the ingress's store and run on the replicas, so
the ``openai`` client creates, polls, downloads, lists and deletes them
through the one endpoint whichever replica ran them; deleting a running
job aborts its request in the replica that runs it; what the engine
refuses at submission is a 400 before a job exists. One short module: one
application, small clips."""

from __future__ import annotations

import concurrent.futures as cf
import socket

import httpx
import pytest
from video_decode import decode_mp4
from waiting import HANG_GUARD_S, wait_until

from diffrt.engine import EngineConfig
from diffrt.serve import ServeSettings

openai = pytest.importorskip("openai")
#: the hang guard of the other Ray modules: the fixture deploys two replicas,
#: each starting an engine, which took over the default 300 s beside other load
pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning"),  # openai marks Sora's API
              pytest.mark.timeout(HANG_GUARD_S)]

APP = "diffrt-videos"
#: no run-time cost limit: the long job must be admitted however busy the machine;
#: each replica runs its engine in its own process (inproc: no second worker
#: process to start per replica)
CONFIG = EngineConfig(model="tiny-wan", step_execution=True, max_num_seqs=2,
                      executor_backend="inproc", warmup=False, max_request_seconds=None)
SHORT = {"seconds": "0.25", "size": "32x32"}  # 5 frames


@pytest.fixture(scope="module")
def videos_url(ray_cluster, tmp_path_factory):
    from ray import serve

    from diffrt.serve.ray_app import ReplicaSettings, StatsBoard, build_application

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    board = ray_cluster.remote(StatsBoard).options(num_cpus=0).remote()
    settings = ServeSettings(max_pending=16, video_dir=str(tmp_path_factory.mktemp("ray-videos")))
    serve.run(build_application(CONFIG, settings, ReplicaSettings(replicas=2, replica_cpus=0.25),
                                board), name=APP, route_prefix="/")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.delete(APP)
        serve.shutdown()


def finished(url: str, outcome: str) -> float:
    """The replicas' engines' requests that ended with ``outcome``, all replicas together."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("diffrt_requests_total{") and f'outcome="{outcome}"' in line)


def test_two_replicas_serve_video_jobs_through_the_ingress(videos_url):
    client = openai.OpenAI(base_url=f"{videos_url}/v1", api_key="unused", max_retries=0,
                           timeout=300)

    def make(seed: int):
        return client.videos.create_and_poll(prompt=f"a fox {seed}", poll_interval_ms=200,
                                             extra_body={"seed": seed,
                                                         "num_inference_steps": 2}, **SHORT)

    with cf.ThreadPoolExecutor(4) as pool:
        jobs = list(pool.map(make, range(4)))
    assert [j.status for j in jobs] == ["completed"] * 4, [j.error for j in jobs]
    for job in jobs:
        clip = decode_mp4(client.videos.download_content(job.id).read())
        assert clip.frames.shape == (5, 32, 32, 3)
    # the four ran on the replicas (their engines counted them), whichever each was
    assert wait_until(lambda: finished(videos_url, "success") >= 4, timeout=300)
    listed = client.videos.list(limit=10)
    assert {v.id for v in listed.data} == {j.id for j in jobs}

    # a running job deleted through the ingress is aborted in its replica
    aborted = finished(videos_url, "aborted")
    long = client.videos.create(prompt="a long walk", size="32x32",
                                extra_body={"num_inference_steps": 1000})
    assert wait_until(lambda: client.videos.retrieve(long.id).progress > 0, timeout=600)
    assert client.videos.delete(long.id).deleted
    assert wait_until(lambda: finished(videos_url, "aborted") > aborted, timeout=300)
    assert httpx.get(f"{videos_url}/v1/videos/{long.id}").status_code == 404
    assert client.videos.delete(jobs[0].id).deleted
    assert {v.id for v in client.videos.list(limit=10).data} == {j.id for j in jobs[1:]}

    # what a replica's engine refuses at submission: a 400 naming the field, no job
    refused = httpx.post(f"{videos_url}/v1/videos", timeout=60, json={
        "prompt": "x", "loras": {"nope": 1.0}, **SHORT})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "loras", \
        refused.text
    assert len(client.videos.list(limit=10).data) == 3
