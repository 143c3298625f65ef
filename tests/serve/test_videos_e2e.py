"""The videos API against a real ``diffrt serve --model tiny-wan`` (the
session's ``video_server``), verbatim as OpenAI's docs use the ``openai``
package: create, then the connection that created the job is gone (a new
client polls it to completion and downloads it); the MP4 decodes to 9
frames at 16 fps."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from serve_helpers import API_KEY

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # video_decode
from video_decode import decode_mp4  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.filterwarnings("ignore::DeprecationWarning")]


def test_a_job_created_by_a_client_that_left_is_fetched_by_another(video_server):
    from openai import OpenAI

    with OpenAI(base_url=f"{video_server.url}/v1", api_key=API_KEY, max_retries=0) as gone:
        video = gone.videos.create(model="tiny-wan", prompt="A calico cat playing a piano",
                                   size="64x64", seconds="0.5")
    assert video.status == "queued"
    client = OpenAI(base_url=f"{video_server.url}/v1", api_key=API_KEY, max_retries=0)
    video = client.videos.poll(video.id, poll_interval_ms=100)
    assert video.status == "completed" and video.progress == 100
    content = client.videos.download_content(video.id, variant="video")
    decoded = decode_mp4(content.read())
    assert decoded.frames.shape == (9, 64, 64, 3) and decoded.fps == 16
    assert client.videos.delete(video.id).deleted
