"""``POST /v1/weights`` across Ray Serve replicas without a cluster: the
ingress's route and ``ReplicaClient`` over the real ``StatsBoard`` rounds,
in process, with replicas whose engines are stand-ins (``ray_weights.py``).
Checked: all-or-none (a refusal in either phase leaves every replica on its
version; a failure in phase 2 rolls back those that applied, weights or an
adapter's old file), the 503 that names each replica's state when a
roll-back fails too, and replicas that do not answer a check or an apply. The cluster test is tests/ray/test_ray_serve.py."""

from __future__ import annotations

import shutil
import threading

import httpx
import msgspec
import pytest
import torch
from ray_board_helpers import with_ingress
from safetensors.torch import save_file
from serve_helpers import AUTH

from diffrt.engine import LoraInfo
from diffrt.engine.weight_sync import WeightsMismatchError, WeightsUpdate
from diffrt.engine.weights.update import WeightUpdateError, checksum, read_tensors
from diffrt.serve import ServeSettings, ray_weights
from diffrt.serve.ray_app import StatsBoard
from diffrt.serve.ray_weights import ReplicaWeights

TENSORS = {"proj.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3)}
OLD_FACTORS = {"proj.lora_A.weight": torch.ones(4, 3)}


class Engine:
    """A replica's engine, as far as an update goes."""

    sleeping = False

    def __init__(self, fail: Exception | None = None, version: int | str = 0,
                 revert_fail: Exception | None = None):
        self.weights_version = version
        self.fail, self.revert_fail = fail, revert_fail
        self.applied: list[dict] = []
        #: the version ``keep_previous`` kept, and what happened to it
        self.kept: int | str | None = None
        self.reverted = self.forgotten = 0
        self.lora = LoraInfo(name="style", path="/a/style", rank=4, modules=1, nbytes=24,
                             requests=0, active=0, slot=0)

    def list_loras(self):
        return [self.lora]

    def update_lora(self, name, tensors, *, version):
        assert name == self.lora.name
        if self.fail is not None and version != 0:  # rolling back to 0 works
            raise self.fail
        self.applied.append(tensors if isinstance(tensors, str) else dict(tensors))
        self.lora = msgspec.structs.replace(self.lora, version=version)
        return self.lora

    def update_weights_report(self, tensors, *, version, policy, keep_previous=False):
        if self.fail is not None:
            raise self.fail
        self.kept = self.weights_version if keep_previous else None
        self.weights_version = version
        self.applied.append(dict(tensors))
        got = checksum(tensors)
        return WeightsUpdate(version=version, checksum=got, rank_checksums=[got, got])


    def revert_weights(self):
        if self.revert_fail is not None:
            raise self.revert_fail
        if self.kept is None:
            raise WeightUpdateError("no previous weights are kept to roll back to")
        self.weights_version, self.kept = self.kept, None
        self.reverted += 1
        return self.weights_version

    def forget_previous_weights(self):
        self.kept = None
        self.forgotten += 1


def post(tmp_path, engines: dict[str, Engine], body: dict, silent: tuple[str, ...] = (),
         route: tuple[str, str] = ("POST", "/v1/weights"),
         keep_adapter_file: bool = False) -> httpx.Response:
    """``POST /v1/weights`` (or ``route``) with ``body`` to an ingress whose
    board heard from ``engines``' replicas (and the ``silent`` ones, which
    never answer)."""
    save_file(TENSORS, tmp_path / "w.safetensors")
    if not keep_adapter_file:
        save_file(OLD_FACTORS, tmp_path / "style.safetensors")  # the adapter's current file
    for engine in engines.values():
        engine.lora = msgspec.structs.replace(engine.lora, path=str(tmp_path / "style.safetensors"))
    settings = ServeSettings(weights_dir=str(tmp_path), lora_dir=str(tmp_path))

    async def steps(c, client, board) -> httpx.Response:
        return await c.request(*route, json=body, headers=AUTH)

    return with_ingress(engines, settings, steps, silent)


def test_an_update_reaches_every_replica_with_one_version(tmp_path):
    engines = {"a": Engine(), "b": Engine()}
    r = post(tmp_path, engines, {"path": "w.safetensors"})
    assert r.status_code == 200, r.text
    want = checksum(TENSORS)
    assert r.json() == {"object": "weights", "version": 1, "checksum": want,
                        "rank_checksums": [want] * 4,
                        "replica_checksums": {"a": want, "b": want}}
    for engine in engines.values():
        assert engine.weights_version == 1
        assert torch.equal(engine.applied[0]["proj.weight"], TENSORS["proj.weight"])


def test_a_refusal_in_either_phase_leaves_every_replica_on_its_version(tmp_path):
    engines = {"a": Engine(), "b": Engine()}
    r = post(tmp_path, engines, {"path": "no-such.safetensors"})  # phase 1: unreadable
    assert r.status_code == 400 and r.json()["error"]["param"] == "path", r.text
    for fail, status, code in ((WeightUpdateError("shape [2, 3], the model's is [3]"), 400,
                                "invalid_weights"),
                               (WeightsMismatchError("rank 1 read checksum 0"), 409,
                                "weights_checksum_mismatch")):
        engines = {"a": Engine(fail), "b": Engine(fail)}  # phase 2: every engine refuses
        r = post(tmp_path, engines, {"path": "w.safetensors", "version": 3})
        assert r.status_code == status and r.json()["error"]["code"] == code, r.text
        assert [e.weights_version for e in engines.values()] == [0, 0]
    # replicas on different versions, none named: which one follows is the caller's to say
    engines = {"a": Engine(version="x"), "b": Engine()}
    r = post(tmp_path, engines, {"path": "w.safetensors"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "version", r.text
    assert not engines["b"].applied


def test_a_replica_failing_to_apply_rolls_the_others_back(tmp_path):
    engines = {"a": Engine(), "b": Engine(RuntimeError("the worker died")), "c": Engine()}
    r = post(tmp_path, engines, {"path": "w.safetensors", "version": "v2"})
    assert r.status_code == 503, r.text
    error = r.json()["error"]
    assert error["code"] == "engine_down"
    assert "replica b: RuntimeError: the worker died; rolled back on a, c" in error["message"]
    assert [e.weights_version for e in engines.values()] == [0, 0, 0]
    assert [e.reverted for e in engines.values()] == [1, 0, 1]
    # a refusal in phase 2 (the engine's own check) answers as it would alone
    engines = {"a": Engine(), "b": Engine(WeightUpdateError("shape [2, 3], the model's is [3]"))}
    r = post(tmp_path, engines, {"path": "w.safetensors"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_weights", r.text
    assert "rolled back on a" in r.json()["error"]["message"]
    assert engines["a"].weights_version == 0


def test_a_failed_roll_back_is_reported_with_every_replicas_state(tmp_path):
    engines = {"a": Engine(revert_fail=RuntimeError("the host copy is gone")),
               "b": Engine(RuntimeError("the worker died"))}
    r = post(tmp_path, engines, {"path": "w.safetensors", "version": "v2"})
    assert r.status_code == 503, r.text
    error = r.json()["error"]
    assert error["code"] == "weights_partially_updated"
    assert "failed on b and rolling it back failed too" in error["message"]
    assert "a: version 'v2' (failed: RuntimeError: the host copy is gone)" in error["message"]
    assert "b: version 0 (failed: RuntimeError: the worker died)" in error["message"]


class LateBoard(StatsBoard):
    """Loses replica b's answer to the next apply, as if b had applied after
    the round ended."""

    def __init__(self) -> None:
        super().__init__()
        self.lose = True

    def answer(self, replica, round_id, reply):
        task = self._rounds.get(replica, (0, None))[1]
        if (self.lose and replica == "b" and isinstance(task, ray_weights.WeightsRound)
                and task.phase == "apply"):
            self.lose = False
            return
        super().answer(replica, round_id, reply)


def test_a_replica_that_applied_after_its_round_rolls_back_at_the_next_check(
        tmp_path, monkeypatch):
    """b's apply answer never comes: a rolls back at once, without waiting
    for b again; b, which did apply, rolls back before it checks the next
    update, and the next update reaches both."""
    monkeypatch.setattr(ray_weights, "APPLY_TIMEOUT_S", 0.5)
    save_file(TENSORS, tmp_path / "w.safetensors")
    engines = {"a": Engine(), "b": Engine()}
    settings = ServeSettings(weights_dir=str(tmp_path), lora_dir=str(tmp_path))

    async def steps(c, client, board):
        first = await c.post("/v1/weights", json={"path": "w.safetensors", "version": 5},
                             headers=AUTH)
        late = (engines["b"].weights_version, engines["b"].kept)
        second = await c.post("/v1/weights", json={"path": "w.safetensors", "version": 6},
                              headers=AUTH)
        return first, late, second

    first, late, second = with_ingress(engines, settings, steps, board=LateBoard())
    assert first.status_code == 503 and first.json()["error"]["code"] == "engine_down"
    message = first.json()["error"]["message"]
    assert "rolled back on a; no answer from b (each rolls back" in message, message
    assert late == (5, 0)  # b applied and kept version 0's weights
    assert second.status_code == 200, second.text
    assert [e.reverted for e in engines.values()] == [1, 1]
    assert [e.weights_version for e in engines.values()] == [6, 6]


def test_an_adapter_update_rolls_back_to_the_old_factors(tmp_path):
    engines = {"a": Engine(), "b": Engine(RuntimeError("no slot"))}
    r = post(tmp_path, engines, {"path": "w.safetensors", "version": 4},
             route=("PUT", "/v1/loras/style"))
    assert r.status_code == 503 and "rolled back on a" in r.text, r.text
    assert [e.lora.version for e in engines.values()] == [0, 0]
    new, old = engines["a"].applied
    assert torch.equal(new["proj.weight"], TENSORS["proj.weight"])
    # the old file, copied before the update (its LoRA metadata with it), registered again
    assert isinstance(old, str) and old != str(tmp_path / "style.safetensors")
    assert torch.equal(read_tensors(old)["proj.lora_A.weight"], OLD_FACTORS["proj.lora_A.weight"])
    shutil.rmtree(old)  # the engine's registry would own it
    # an adapter whose file already holds the new factors cannot go back: said so
    save_file(TENSORS, tmp_path / "style.safetensors")
    engines = {"a": Engine(), "b": Engine(RuntimeError("no slot"))}
    r = post(tmp_path, engines, {"path": "style.safetensors", "version": 5},
             route=("PUT", "/v1/loras/style"), keep_adapter_file=True)
    assert r.status_code == 503 and r.json()["error"]["code"] == "weights_partially_updated"
    assert "overwritten in place" in r.json()["error"]["message"], r.text


def test_a_replica_settles_or_rolls_back_as_the_board_says(tmp_path):
    """Between rounds (``follow``): an update the board committed drops the
    kept copy; one it rolled back while this replica was still applying it
    (its apply outlived the revert round) is rolled back here too."""
    save_file(TENSORS, tmp_path / "w.safetensors")
    path = str(tmp_path / "w.safetensors")
    engine = Engine()
    weights = ReplicaWeights("a", None, engine, threading.Event())

    def update(update: str, version: int) -> None:
        for phase in ("check", "apply"):
            reply = weights.handle(ray_weights.WeightsRound(
                update=update, phase=phase, source=path, version=version))
            assert reply.error is None, reply

    update("u1", 1)
    assert engine.kept == 0
    entry = ray_weights.Committed(names=["proj.weight"], source=path, version=1,
                                  checksum=checksum(TENSORS), update="u1")
    weights.follow([entry], [], None)
    assert engine.kept is None and engine.forgotten == 1 and engine.weights_version == 1
    update("u2", 2)
    weights.follow([entry], ["u2"], None)
    assert engine.weights_version == 1 and engine.reverted == 1


def test_a_replica_that_does_not_answer_refuses_the_update(tmp_path, monkeypatch):
    monkeypatch.setattr(ray_weights, "CHECK_TIMEOUT_S", 0.3)
    engines = {"a": Engine()}
    r = post(tmp_path, engines, {"path": "w.safetensors"}, silent=("gone",))
    assert r.status_code == 503 and "gone" in r.json()["error"]["message"], r.text
    assert engines["a"].weights_version == 0 and not engines["a"].applied


def test_a_replica_applies_only_what_it_checked():
    weights = ReplicaWeights("a", None, Engine(), threading.Event())
    reply = weights.handle(ray_weights.WeightsRound(update="u", phase="apply", version=1))
    assert reply.error == "failed" and "did not check" in reply.message


def test_the_board_keeps_the_updates_a_later_replica_applies():
    board = StatsBoard()
    entry = ray_weights.Committed
    board.commit(entry(names=["a", "b"], source="1", version=1, checksum="x"))
    board.commit(entry(names=["c"], source="2", version=2, checksum="y"))
    assert [e.version for e in board.committed()] == [1, 2]
    board.commit(entry(names=["a", "b", "d"], source="3", version=3, checksum="z"))
    assert [e.version for e in board.committed()] == [2, 3]  # 1's tensors all replaced


def test_an_adapter_update_reaches_every_replica_or_none(tmp_path):
    engines = {"a": Engine(), "b": Engine()}
    r = post(tmp_path, engines, {"path": "w.safetensors", "version": 4},
             route=("PUT", "/v1/loras/style"))
    assert r.status_code == 200 and r.json()["version"] == 4, r.text
    assert [e.lora.version for e in engines.values()] == [4, 4]
    assert all(torch.equal(e.applied[0]["proj.weight"], TENSORS["proj.weight"])
               for e in engines.values())
    r = post(tmp_path, engines, {"path": "w.safetensors"}, route=("PUT", "/v1/loras/other"))
    assert r.status_code == 404 and r.json()["error"]["code"] == "lora_not_found", r.text
    assert [len(e.applied) for e in engines.values()] == [1, 1]


def test_a_replica_applies_the_committed_updates_it_missed_in_order(tmp_path):
    """One that started while an update was between its phases missed it and
    may have applied a later one since: both go again, in order."""
    save_file(TENSORS, tmp_path / "w.safetensors")
    path, want = str(tmp_path / "w.safetensors"), checksum(TENSORS)
    entries = [ray_weights.Committed(names=["proj.weight"], source=path, version=v, checksum=want)
               for v in (1, 2)]
    engine = Engine()
    weights = ReplicaWeights("late", None, engine, threading.Event())
    weights._apply(None, TENSORS, 2, "wait")  # update 2 came by its round
    assert weights.apply_committed(entries) == 2 and engine.weights_version == 2
    assert weights.apply_committed(entries) == 0 and len(engine.applied) == 3
    entries[1] = msgspec.structs.replace(entries[1], checksum="other")
    weights = ReplicaWeights("new", None, Engine(), threading.Event())
    with pytest.raises(RuntimeError, match="read checksum"):
        weights.apply_committed(entries)
