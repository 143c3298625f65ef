"""``POST /sleep`` and ``POST /wake_up`` across Ray Serve replicas without a
cluster: the ingress's routes and ``ReplicaClient`` over the real
``StatsBoard`` rounds, in process, with replicas whose engines are stand-ins
(``ray_sleep.py``). Checked: every replica sleeps and wakes, /health and
/metrics say so, a generation is refused at the ingress as on the single
server (``sleep_requests="refuse"``) or goes on to its replica ("wait"); a
round that splits the replicas answers 503 naming each one's state, one
every replica refuses changes nothing; a replica that starts (or missed a
round) follows the deployment; a level-2 wake forgets the transformer
updates the board kept for later replicas. The cluster test is
tests/ray/test_ray_serve.py."""

from __future__ import annotations

import dataclasses
import re

import pytest
from ray_board_helpers import with_ingress
from serve_helpers import AUTH

from diffrt.engine import DiffusionRequest, SamplingParams
from diffrt.engine.runner_messages import SleepReport
from diffrt.engine.stats import StatsRecorder
from diffrt.engine.weights.update import WeightUpdateError
from diffrt.serve import ServeSettings, ray_sleep, ray_weights
from diffrt.serve.errors import ApiError
from diffrt.serve.ray_app import StatsBoard

GEN = "/v1/images/generations"
BODY = {"prompt": "p", "size": "64x64", "num_inference_steps": 2}
#: the bytes a stand-in engine frees, pins and gets back
NBYTES = 1000


class Engine:
    """A replica's engine, as far as sleep and wake go."""

    def __init__(self, fail: Exception | None = None):
        self.sleeping = False
        self.level: int | None = None
        self.weights_version: int | str = 3
        self.fail = fail
        self.calls: list[str] = []

    def sleep(self, level: int) -> SleepReport:
        self.calls.append(f"sleep {level}")
        if self.fail is not None:
            raise self.fail
        self.sleeping, self.level = True, level
        return SleepReport(freed_bytes=NBYTES, pinned_bytes=NBYTES)

    def wake(self) -> SleepReport:
        self.calls.append("wake")
        reloaded = self.level == 2
        self.sleeping, self.level = False, None
        if reloaded:
            self.weights_version = 0
        return SleepReport(restored_bytes=NBYTES, reloaded=reloaded)

    def stats(self):
        """What its replica publishes to the board."""
        got = StatsRecorder().snapshot(waiting=0, running=0, pending_output_bytes=0,
                                       healthy=True)
        return dataclasses.replace(got, sleeping=self.sleeping)


def request() -> DiffusionRequest:
    return DiffusionRequest(prompt="p", sampling_params=SamplingParams(
        height=64, width=64, num_inference_steps=2))


def test_every_replica_sleeps_and_wakes_and_the_ingress_says_so():
    engines = {"a": Engine(), "b": Engine()}
    settings = ServeSettings(sleep_requests="refuse", sleep_retry_after_s=7)

    async def steps(c, client, board):
        slept = await c.post("/sleep?level=1", headers=AUTH)
        assert slept.status_code == 200, slept.text
        assert slept.json() == {
            "sleeping": True, "level": 1, "freed_bytes": 2 * NBYTES, "pinned_bytes": 2 * NBYTES,
            "replicas": {r: {"freed_bytes": NBYTES, "pinned_bytes": NBYTES} for r in "ab"}}
        assert [e.level for e in engines.values()] == [1, 1]
        health = await c.get("/health")
        assert health.status_code == 200 and health.json()["sleeping"] is True
        for name, engine in engines.items():  # each replica's next publication
            board.put(name, engine.stats())
        await client.read_board_once()
        metrics = (await c.get("/metrics")).text
        assert re.search(r'^diffrt_sleeping\{replica="a"\} 1\.0$', metrics, re.M), metrics
        assert re.search(r'^diffrt_sleeping\{replica="b"\} 1\.0$', metrics, re.M)
        refused = await c.post(GEN, json=BODY, headers=AUTH)  # decided at the ingress
        assert refused.status_code == 503 and refused.headers["Retry-After"] == "7"
        assert refused.json()["error"]["code"] == "sleeping"
        woke = await c.post("/wake_up", headers=AUTH)
        assert woke.status_code == 200, woke.text
        assert woke.json() == {
            "sleeping": False, "restored_bytes": 2 * NBYTES, "weights_version": 3,
            "replicas": {r: {"restored_bytes": NBYTES, "weights_version": 3} for r in "ab"}}
        assert not any(e.sleeping for e in engines.values())
        assert "sleeping" not in (await c.get("/health")).json()
        assert board.sleep_level() is None and not client.sleeping()

    with_ingress(engines, settings, steps)


def test_while_asleep_a_request_goes_on_to_wait_in_its_replica_by_default():
    async def steps(c, client, board):
        assert (await c.post("/sleep?level=1", headers=AUTH)).status_code == 200
        assert client.sleeping()
        outputs, seat = client.open_run(request())  # not refused: it waits in the engine
        await outputs.aclose()
        seat.release()
        client.settings = ServeSettings(sleep_requests="refuse", sleep_retry_after_s=9)
        with pytest.raises(ApiError) as refused:
            client.open_run(request())
        assert refused.value.status == 503 and refused.value.code == "sleeping"
        assert refused.value.headers == {"Retry-After": "9"}

    with_ingress({"a": Engine()}, ServeSettings(), steps)


def test_a_round_that_splits_the_replicas_names_each_ones_state():
    engines = {"a": Engine(), "b": Engine(RuntimeError("the worker died"))}

    async def steps(c, client, board):
        r = await c.post("/sleep?level=1", headers=AUTH)
        assert r.status_code == 503, r.text
        error = r.json()["error"]
        assert error["code"] == "partially_asleep"
        assert "a: version 3 (asleep)" in error["message"]
        assert "b: version 3 (failed: RuntimeError: the worker died)" in error["message"]
        # the deployment sleeps: the ingress says so, and b follows once it can
        assert board.sleep_level() == 1 and client.sleeping()
        assert (await c.get("/health")).json()["sleeping"] is True
        engines["b"].fail = None
        ray_sleep.follow(engines["b"], board.sleep_level())
        assert engines["b"].sleeping

    with_ingress(engines, ServeSettings(), steps)


def test_a_sleep_every_replica_refuses_changes_nothing(monkeypatch):
    engines = {"a": Engine(WeightUpdateError("sleep works on the parameters as loaded")),
               "b": Engine(WeightUpdateError("sleep works on the parameters as loaded"))}

    async def steps(c, client, board):
        r = await c.post("/sleep?level=2", headers=AUTH)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_value", r.text
        assert "as loaded (replica a)" in r.json()["error"]["message"]
        assert board.sleep_level() is None and not client.sleeping()
        assert "sleeping" not in (await c.get("/health")).json()

    with_ingress(engines, ServeSettings(), steps)
    monkeypatch.setattr(ray_sleep, "ROUND_TIMEOUT_S", 0.3)

    async def silent(c, client, board):
        r = await c.post("/sleep?level=1", headers=AUTH)
        assert r.status_code == 503 and "gone: no answer" in r.json()["error"]["message"]
        return r

    engines = {"a": Engine()}
    with_ingress(engines, ServeSettings(), silent, silent=("gone",))
    assert engines["a"].sleeping  # the one that answered sleeps: POST /wake_up wakes it

    async def nobody(c, client, board):
        r = await c.post("/wake_up", headers=AUTH)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_down", r.text

    with_ingress({}, ServeSettings(), nobody)


def test_a_replica_follows_the_deployments_state():
    """One Ray starts while the deployment sleeps (``catch_up``), or one that
    missed a round (between rounds): it sleeps or wakes, else is left alone."""
    engine = Engine()
    ray_sleep.follow(engine, None)
    ray_sleep.follow(engine, 2)
    assert engine.sleeping and engine.level == 2
    ray_sleep.follow(engine, 1)  # asleep already: no second sleep
    ray_sleep.follow(engine, None)
    assert not engine.sleeping and engine.calls == ["sleep 2", "wake"]


def test_a_replica_started_while_the_deployment_sleeps_sleeps_before_it_serves(monkeypatch):
    """``ReplicaWeights.catch_up`` (in ``ModelReplica.__init__``) reads the
    board's state after its kept updates; between rounds the replica reads
    it again (``ray.get`` of an in-process board here)."""
    import ray
    from ray_board_helpers import LocalBoard

    monkeypatch.setattr(ray, "get", lambda got, timeout=None: got)

    class Board(LocalBoard):  # the board's methods answer at once
        def __getattr__(self, name):
            method = getattr(self.board, name)
            return type("Remote", (), {"remote": staticmethod(method)})

    board = StatsBoard()
    board.set_sleep_level(1)
    engine = Engine()
    weights = ray_weights.ReplicaWeights("late", Board(board), engine, None)
    weights.catch_up()
    assert engine.sleeping and engine.level == 1
    board.set_sleep_level(None)  # a wake round it missed
    weights._check_committed()
    assert not engine.sleeping and engine.calls == ["sleep 1", "wake"]


def test_a_level_2_wake_forgets_the_transformer_updates_kept_for_later_replicas():
    board = StatsBoard()
    entry = ray_weights.Committed
    board.commit(entry(names=["w"], source="1", version=1, checksum="x"))
    board.commit(entry(names=["l"], source="2", version=1, checksum="y", lora="style"))
    engines = {"a": Engine(), "b": Engine()}

    async def steps(c, client, board):
        assert (await c.post("/sleep?level=2", headers=AUTH)).status_code == 200
        assert len(board.committed()) == 2  # a replica starting now applies them, then sleeps
        woke = await c.post("/wake_up", headers=AUTH)
        assert woke.status_code == 200 and woke.json()["weights_version"] == 0, woke.text
        assert [e.lora for e in board.committed()] == ["style"]

    with_ingress(engines, ServeSettings(), steps, board=board)
