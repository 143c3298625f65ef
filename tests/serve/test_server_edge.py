"""The real uvicorn server of ``diffrt serve`` (in a thread, on 127.0.0.1): the
bounds of a connection (head size and time, idle time, how many), the address
bound before anything loads, and a second SIGTERM that ends a drain cleanly
(issue 27, items 6 and 11)."""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
import threading
import time

import engine_toy
import httpx
import pytest
from serve_helpers import AUTH
from waiting import wait_until

from diffrt.serve.server import DrainingServer, HttpLimits, uvicorn_config


async def _hello(scope, receive, send):
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            pass
        return
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


@contextlib.contextmanager
def running(app, limits: HttpLimits, client=None, shutdown_timeout_s: float = 30):
    """``app`` behind diffrt's uvicorn configuration on a free port."""
    import uvicorn

    config = uvicorn_config(app, limits, host="127.0.0.1", port=0)
    if client is None:
        server = uvicorn.Server(config)
        config.lifespan = "off"
    else:
        server = DrainingServer(config, (client,), shutdown_timeout_s=shutdown_timeout_s)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    assert wait_until(lambda: server.started, timeout=60)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield server, port
    finally:
        server.should_exit = True
        thread.join(10)


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    """True when the server closes ``sock`` (EOF) within ``seconds``."""
    sock.settimeout(seconds)
    try:
        while sock.recv(4096):
            pass
        return True
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def test_a_head_too_large_is_400_and_a_late_one_is_cut_off():
    limits = HttpLimits(max_header_bytes=4096, header_timeout_s=0.5, keep_alive_timeout_s=0.5)
    with running(_hello, limits) as (_, port):
        with socket.create_connection(("127.0.0.1", port)) as big:
            big.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 64 * 1024 + b"\r\n\r\n")
            assert big.recv(100).startswith(b"HTTP/1.1 400")
        silent = socket.create_connection(("127.0.0.1", port))  # opens, sends nothing
        slow = socket.create_connection(("127.0.0.1", port))
        slow.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")  # and never the end of its head
        # without the head's timer a head that never ends keeps its connection
        # for ever (uvicorn stops the idle timer at the first byte): a generous
        # bound still tells them apart on a busy machine
        assert _closed_within(silent, 30) and _closed_within(slow, 30)
        with socket.create_connection(("127.0.0.1", port)) as kept:  # answered, then idle
            kept.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            assert kept.recv(100).startswith(b"HTTP/1.1 200")
            assert _closed_within(kept, 30)
        assert httpx.get(f"http://127.0.0.1:{port}/", timeout=5).status_code == 200
        silent.close()
        slow.close()


def test_connections_beyond_the_limit_get_503():
    with running(_hello, HttpLimits(limit_concurrency=2, header_timeout_s=30)) as (_, port):
        held = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]
        # once the server has taken both (no fixed sleep: a busy machine takes longer)
        assert wait_until(lambda: httpx.get(f"http://127.0.0.1:{port}/",
                                            timeout=30).status_code == 503, timeout=60)
        for sock in held:
            sock.close()
        assert wait_until(lambda: httpx.get(f"http://127.0.0.1:{port}/",
                                            timeout=30).status_code == 200, timeout=60)


# -- item 11: the address, before anything loads -----------------------------------------
@pytest.fixture
def no_model_load(monkeypatch):
    from diffrt.cli import serve

    def loads(*args, **kw):
        raise AssertionError("the model was resolved before the address was checked")

    monkeypatch.setattr(serve, "model_spec", loads)


@pytest.mark.parametrize("flags", [["--port", "99999"], ["--port", "-1"],
                                   ["--host", "256.1.1.1"], ["--host", "10.255.255.254"],
                                   ["--allowed-hosts", "a.*.com"],
                                   ["--public-url", "ftp://x"]])
def test_a_bad_address_is_one_line_and_status_2(flags, no_model_load, capsys):
    from diffrt.cli import main

    assert main(["serve", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("diffrt serve: error: ") and "\n" not in err, err
    assert flags[0] in err


def test_a_port_in_use_is_one_line_and_status_2(no_model_load, capsys):
    from diffrt.cli import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--host", "127.0.0.1", "--port", str(port)]) == 2
    err = capsys.readouterr().err.strip()
    assert "already in use" in err and "\n" not in err, err


# -- item 11: a second SIGTERM during the drain ---------------------------------------------
def test_a_second_sigterm_ends_the_drain_cleanly(toy_app, caplog):
    """The first signal drains (the blocked request keeps running); the second
    aborts it, answers it 503 shutting_down and stops the server: no
    traceback, no 'engine closed'."""
    app = toy_app()
    engine_toy.gate("held").clear()
    caplog.set_level(logging.INFO)
    # a drain far longer than the test may wait: the answer can only come from
    # the second signal, however busy the machine
    drain_s = 600
    with running(app, HttpLimits(), client=app.state.client,
                 shutdown_timeout_s=drain_s) as (server, port):
        result: dict = {}

        def post() -> None:
            result["r"] = httpx.post(f"http://127.0.0.1:{port}/v1/images/generations",
                                     headers=AUTH, timeout=drain_s,
                                     json={"prompt": "block:held", "size": "16x16",
                                           "num_inference_steps": 2})

        poster = threading.Thread(target=post)
        poster.start()
        engine = app.state.client.engine
        assert wait_until(lambda: engine.stats().requests_running == 1, timeout=60)
        server.handle_exit(signal.SIGTERM, None)
        assert wait_until(lambda: app.state.client.state == "draining", timeout=60)
        time.sleep(0.3)
        assert poster.is_alive()  # the drain waits for it
        server.handle_exit(signal.SIGTERM, None)
        poster.join(drain_s / 5)
        assert not poster.is_alive()  # answered long before the drain would have ended
    engine_toy.gate("held").set()
    response = result["r"]
    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == "shutting_down"
    assert not server.force_exit
    for record in caplog.records:
        assert record.exc_info is None, record.getMessage()
        assert "CancelledError" not in record.getMessage()


def test_a_refusal_before_the_body_closes_the_connection(toy_app):
    """401 for a 1 MB body that never comes: answered at once, and the
    connection closed instead of left open to receive it."""
    app = toy_app()
    with running(app, HttpLimits(), client=app.state.client) as (_, port):
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(b"POST /v1/images/generations HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                         b"Content-Type: application/json\r\nContent-Length: 1000000\r\n\r\n"
                         + b"{" * 1000)
            sock.settimeout(5)
            answer = b""
            while chunk := sock.recv(4096):
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 401") and b"connection: close" in answer.lower()
