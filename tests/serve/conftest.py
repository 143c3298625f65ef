"""Server test fixtures: apps around engines on the in-process executor, called
through httpx's ASGI transport (no socket), shared per module. The real-server
tests (a ``diffrt serve`` process, real clients) are in test_server_*.py."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))  # engine_toy

import engine_toy  # noqa: E402,F401  (registers the "toy" models)
from serve_helpers import API_KEY  # noqa: E402
from server_process import ServerProcess, served  # noqa: E402

from diffrt.engine import DiffusionEngine, EngineConfig  # noqa: E402
from diffrt.serve import ServeSettings, build_app  # noqa: E402


@pytest.fixture(scope="module")
def flux_app(flux_step_engine):
    return build_app(settings=ServeSettings(api_key=API_KEY), engine=flux_step_engine)


@pytest.fixture
def toy_app():
    """A fresh app around a fresh toy engine (step mode, one request at a time,
    short request timeout): for timeouts, failures, overload and states."""
    engine_toy.open_gates()
    engines = []

    def make(settings: ServeSettings | None = None, **engine_kw):
        kw = dict(model="toy", executor_backend="inproc", step_execution=True,
                  max_num_seqs=1, warmup=False)
        kw.update(engine_kw)
        engine = DiffusionEngine.make_engine(EngineConfig(**kw))
        engines.append(engine)
        return build_app(settings=settings or ServeSettings(api_key=API_KEY), engine=engine)

    yield make
    engine_toy.open_gates()
    for engine in engines:
        engine.close()


@contextlib.contextmanager
def _shared_server(*flags: str, default_video: bool = False):
    with served(ServerProcess("--api-key", API_KEY, "--max-num-seqs", "8", "--max-pending", "64",
                              *flags, default_video=default_video)) as proc:
        yield proc


@pytest.fixture(scope="session")
def real_server(tmp_path_factory):
    """One ``diffrt serve`` process (the default model diffrt-shapes, step mode, an API key) shared
    by the end-to-end tests that can share it, with its video engine (the
    default video model diffrt-motion; its jobs in a folder of the session's).
    No ``--max-request-seconds`` (by
    default 120 s): that limit judges a request by its run-time estimate,
    which follows the steps measured under the machine's momentary load, so a
    request a test needs admitted could be refused on a busy machine."""
    folder = tmp_path_factory.mktemp("default-videos")
    with _shared_server("--max-request-seconds", "none", "--video-dir", str(folder),
                        default_video=True) as proc:
        yield proc


#: seconds: fuzzed requests estimated to run longer alone (n=10 at 1000
#: steps...) are refused at once, so schemathesis stays fast; which ones that
#: is follows the machine's load, which the fuzzing test does not mind (it
#: asks for no 5xx and the error shape, not for a request's admission), and
#: since the estimate follows the load, an admitted one runs about this long
#: on a busy machine too (30 s here took 25 examples past 300 s under load)
MAX_REQUEST_SECONDS = "5"


@pytest.fixture(scope="session")
def costed_server():
    """The shared server's twin with a cost limit, for schemathesis."""
    with _shared_server("--max-request-seconds", MAX_REQUEST_SECONDS) as proc:
        yield proc


@pytest.fixture(scope="session")
def video_server(tmp_path_factory):
    """One ``diffrt serve --model tiny-wan`` process (its jobs in a folder of
    the session's) shared by the videos' end-to-end and browser tests."""
    folder = tmp_path_factory.mktemp("videos")
    with served(ServerProcess("--model", "tiny-wan", "--api-key", API_KEY, "--video-dir",
                              str(folder), "--max-request-seconds", "none")) as proc:
        yield proc  # as real_server: no load-dependent refusal
