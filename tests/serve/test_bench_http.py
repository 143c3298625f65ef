"""`diffrt bench --base-url`: the bench's load over HTTP on the session's real
server; failures counted by status, a missing server never hangs the bench."""

from __future__ import annotations

import asyncio
import json

import pytest
from serve_helpers import API_KEY
from server_process import free_port

from diffrt.cli import main
from diffrt.cli.http_target import HttpTarget, request_body
from diffrt.engine import DiffusionRequest, SamplingParams


def test_a_request_becomes_the_openai_body():
    request = DiffusionRequest("a fox", SamplingParams(height=64, width=96, seed=3,
                                                       num_inference_steps=4, true_cfg_scale=2.0,
                                                       num_outputs_per_prompt=2),
                               negative_prompt="blur")
    assert request_body(request) == {
        "prompt": "a fox", "n": 2, "response_format": "b64_json", "size": "96x64",
        "negative_prompt": "blur", "num_inference_steps": 4, "seed": 3, "true_cfg_scale": 2.0}
    assert "size" not in request_body(DiffusionRequest("x"))  # the server's default


def test_no_server_is_a_failure_not_a_hang():
    target = HttpTarget(f"http://127.0.0.1:{free_port()}", timeout_s=5)

    async def main_():
        try:
            return await target.run_request(DiffusionRequest("x"))
        finally:
            await target.aclose()

    sample = asyncio.run(main_())
    assert not sample.ok and sample.status == 0 and "no answer" in sample.error


@pytest.mark.e2e
def test_bench_drives_a_running_server(real_server, tmp_path, capsys):
    out = tmp_path / "http.json"
    code = main(["bench", "--base-url", real_server.url, "--api-key", API_KEY, "-N", "6",
                 "-c", "3", "--height", "64", "--width", "64", "--steps", "2", "--warmup-requests", "1",
                 "--compare", "concurrency=1", "concurrency=3", "--json", str(out)])
    assert code == 0, capsys.readouterr().err
    results = json.loads(out.read_text())["results"]
    assert [r["label"] for r in results] == ["concurrency=1", "concurrency=3"]
    for r in results:
        assert r["requests"] == 6 and r["failed"] == 0 and r["throughput_rps"] > 0
        assert r["engine"]["model"] == "diffrt-shapes" and r["forward_ms"] > 0
    assert "req/s" in capsys.readouterr().out

    # a size the model refuses: every request fails with its status, the exit is 1
    code = main(["bench", "--base-url", real_server.url, "--api-key", API_KEY, "-N", "3",
                 "-c", "3", "--height", "65", "--width", "64", "--warmup-requests", "0",
                 "--json", str(out)])
    assert code == 1
    [r] = json.loads(out.read_text())["results"]
    assert r["failed"] == 3 and r["failed_by_status"] == {"400": 3}
    assert "3 (400: 3)" in capsys.readouterr().out


def _run(target, count: int) -> list:
    async def main_():
        try:
            return [await target.run_request(DiffusionRequest("x")) for _ in range(count)]
        finally:
            await target.aclose()

    return asyncio.run(main_())


def test_a_malformed_answer_is_a_failure():
    import httpx

    answers = iter([httpx.Response(200, text="<html>not the API</html>"),
                    httpx.Response(200, json=[1, 2]),
                    httpx.Response(200, json={"data": []}),
                    httpx.Response(200, json={"data": [{"b64_json": "x"}], "diffrt": {
                        "timings": {"queue": 0.1, "inference": 0.2, "output": 0.01}}})])
    target = HttpTarget("http://server", transport=httpx.MockTransport(lambda r: next(answers)))
    samples = _run(target, 4)
    assert [s.ok for s in samples] == [False, False, False, True]
    assert all("malformed answer" in s.error for s in samples[:3])
    assert (samples[3].queue_wait, samples[3].forward_time) == (0.1, 0.2)


def test_a_server_that_stops_answering_is_not_waited_for_again():
    import httpx

    sent = []

    def refuse(request):
        sent.append(request)
        raise httpx.ConnectError("connection refused")

    samples = _run(HttpTarget("http://server", transport=httpx.MockTransport(refuse)), 6)
    assert len(sent) == HttpTarget.GONE_AFTER  # the rest were not sent
    assert all(s.status == 0 and not s.ok for s in samples)
    assert "not sent" in samples[-1].error
