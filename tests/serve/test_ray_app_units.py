"""The Ray Serve application's parts that need no cluster: resources asked of
Ray per platform, the statistics board's expiry, the ingress's view of the
replicas' health and of which replica answered, a rank actor's environment."""

from __future__ import annotations

import os
import time

import pytest

from diffrt.engine import EngineConfig
from diffrt.runtime.ray_executor import (
    FORWARDED_ENV_NAMES,
    FORWARDED_ENV_PREFIXES,
    rank_environment,
    ray_bundle,
    ray_device_options,
)
from diffrt.serve import ServeSettings
from diffrt.serve.ray_app import ReplicaClient, ReplicaSettings, StatsBoard


class Platform:
    def __init__(self, resource):
        self.ray_resource = resource


def test_devices_are_asked_of_ray_under_the_platforms_resource(monkeypatch):
    for name in list(os.environ):  # no forwarded settings: no runtime_env to compare
        if name.startswith(FORWARDED_ENV_PREFIXES) or name in FORWARDED_ENV_NAMES:
            monkeypatch.delenv(name)
    assert ray_device_options(Platform(None), 2) == {}
    assert ray_device_options(Platform("GPU"), 2) == {"num_gpus": 2}
    assert ray_device_options(Platform("NPU"), 4) == {"resources": {"NPU": 4}}
    assert ray_bundle(Platform("GPU"), 2) == {"CPU": 2.0, "GPU": 1.0}
    assert ray_bundle(Platform("MUSA"), 0.5) == {"CPU": 0.5, "MUSA": 1}
    config = EngineConfig(model="tiny-flux", cfg_parallel_size=2, max_num_seqs=4)
    options = ReplicaSettings(replicas=3, replica_cpus=0.5).deployment_options(
        config, ServeSettings(max_pending=7), Platform("GPU"))
    assert options["ray_actor_options"] == {"num_cpus": 0.5, "num_gpus": 2}  # one per rank
    assert options["num_replicas"] == 3 and options["max_ongoing_requests"] == 4
    assert options["max_queued_requests"] == 7
    ranks_on_ray = EngineConfig(model="tiny-flux", cfg_parallel_size=2, executor_backend="ray")
    actor = ReplicaSettings().deployment_options(ranks_on_ray, ServeSettings(), Platform("GPU"))
    assert actor["ray_actor_options"] == {"num_cpus": 1.0}  # the rank actors reserve the GPUs
    auto = ReplicaSettings(max_replicas=4, min_replicas=2, target_ongoing_requests=3,
                           upscale_delay_s=1, downscale_delay_s=5).deployment_options(
        config, ServeSettings(), Platform(None))
    assert "num_replicas" not in auto and auto["autoscaling_config"]["max_replicas"] == 4
    assert auto["autoscaling_config"]["target_ongoing_requests"] == 3


def test_the_board_forgets_a_replica_that_went_silent(monkeypatch):
    board = StatsBoard()
    board.put("a", "stats-a")
    board.put("b", "stats-b")
    assert board.snapshot() == [("a", "stats-a"), ("b", "stats-b")]
    now = time.monotonic()
    monkeypatch.setattr(time, "monotonic", lambda: now + 60)
    board.put("b", "stats-b2")
    assert board.snapshot(max_age_s=10) == [("b", "stats-b2")]
    board.remove("b")
    assert board.snapshot() == []


class Stats:
    def __init__(self, healthy, stall=None):
        self.healthy = healthy
        self.stall = stall


def test_the_ingress_is_healthy_while_a_replica_says_so():
    client = ReplicaClient(model=None, board=None, settings=ServeSettings(), model_name="m",
                           step_execution=True)
    assert client.healthy() and client.ready()  # before any report: Ray checked them
    client._snapshots, client._heard_from_replicas = [("a", Stats(False)), ("b", Stats(True))], True
    assert client.healthy()
    client._snapshots = [("a", Stats(False))]
    assert not client.healthy() and not client.ready()
    client._snapshots = []  # every replica silent (or the board gone)
    assert not client.healthy()
    assert client.metric_snapshots() == []
    client._served_by["r1"] = "replica-a"
    assert client.response_headers("r1") == {"x-diffrt-replica": "replica-a"}
    assert client.response_headers("r1") == {}  # read once


def test_the_ingress_is_stalled_while_every_live_replica_is():
    """Issue 27 item 7 over Ray: /health and /ready follow the replicas'
    stall reports (a stalled replica next to a working one is not the
    application's stall; a dead one does not count)."""
    client = ReplicaClient(model=None, board=None, settings=ServeSettings(), model_name="m",
                           step_execution=True)
    client._heard_from_replicas = True
    stalled = Stats(True, "no progress for 31 s (stall_timeout_s=30)")
    client._snapshots = [("a", stalled), ("b", Stats(True))]
    assert client.stall() is None and client.ready()
    client._snapshots = [("a", stalled), ("b", Stats(False))]
    assert client.stall() == stalled.stall and not client.ready()
    assert client.healthy()  # alive, only stalled: /health says which


def test_a_rank_actor_starts_with_the_engines_settings(monkeypatch):
    monkeypatch.setenv("DIFFRT_LOG_LEVEL", "INFO")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    monkeypatch.setenv("UNRELATED", "x")
    env = rank_environment({"HF_HUB_OFFLINE": "1"})
    assert env["DIFFRT_LOG_LEVEL"] == "INFO" and env["GLOO_SOCKET_IFNAME"] == "lo"
    assert env["HF_HUB_OFFLINE"] == "1" and "UNRELATED" not in env


def test_autoscaling_flags_without_max_replicas_are_refused():
    from diffrt.cli import main

    assert main(["serve", "--min-replicas", "2", "--port", "0"]) == 2


@pytest.mark.parametrize("flags", [["--replicas", "2"], ["--max-replicas", "3"]])
def test_replica_settings_follow_the_flags(flags):
    from diffrt.cli import build_parser
    from diffrt.cli.serve_ray import replica_settings

    settings = replica_settings(build_parser().parse_args(["serve", *flags]))
    assert settings.replicas == (2 if "--replicas" in flags else 1)
    assert settings.max_replicas == (3 if "--max-replicas" in flags else None)


# -- issue 27 item 3: sizing to the cluster, refusing what cannot be placed -------------------
def test_cpu_replicas_default_to_an_equal_share_of_the_node():
    from diffrt.cli.serve_ray import check_placement
    from diffrt.serve.ray_placement import torch_threads_for

    config = EngineConfig(model="tiny-flux", max_num_seqs=2)
    sized = check_placement(ReplicaSettings(replicas=2), config, ServeSettings(), Platform(None),
                            {"CPU": 2.0})
    assert sized.replica_cpus == 0.75  # (2 - the ingress's 0.5) / 2: it fits, it deploys
    assert torch_threads_for(sized.replica_cpus) == 1 and torch_threads_for(7.5, 2) == 3
    on_gpu = ReplicaSettings(replicas=2).sized_for(Platform("GPU"), 16.0)
    assert on_gpu.replica_cpus == 1.0


@pytest.mark.parametrize(("replicas", "platform", "cluster", "needle"), [
    (ReplicaSettings(replicas=2, replica_cpus=1.0), Platform(None), {"CPU": 2.0},
     "CPU 2.5 (the cluster has 2)"),
    (ReplicaSettings(replicas=2), Platform("GPU"), {"CPU": 8.0, "GPU": 1.0},
     "GPU 2 (the cluster has 1)"),
    (ReplicaSettings(replicas=1), Platform("NPU"), {"CPU": 8.0},
     "NPU 1 (the cluster has 0)"),
])
def test_a_deployment_that_cannot_be_placed_is_refused_naming_what_is_missing(
        replicas, platform, cluster, needle):
    from diffrt.cli.serve_ray import check_placement
    from diffrt.serve.ray_placement import PlacementError

    with pytest.raises(PlacementError) as info:
        check_placement(replicas, EngineConfig(model="tiny-flux"), ServeSettings(), platform,
                        cluster)
    message = str(info.value)
    assert needle in message and "\n" not in message and "the cluster has CPU" in message


def test_the_placement_watchdog_names_what_ray_last_said():
    from diffrt.serve.ray_placement import PlacementError, wait_until_placed

    now = [0.0]

    def sleep(s):
        now[0] += s

    said = ("DEPLOYING", "ModelReplica: 1 replica has taken more than 30s to be scheduled.\n"
                         "Resources required for each replica: {'CPU': 4}")
    with pytest.raises(PlacementError) as info:
        wait_until_placed(lambda: said, 5.0, clock=lambda: now[0], sleep=sleep)
    assert "within 5 s" in str(info.value) and "to be scheduled" in str(info.value)
    assert "\n" not in str(info.value) and now[0] >= 5.0
    states = iter([("DEPLOYING", ""), ("RUNNING", "")])
    wait_until_placed(lambda: next(states), 5.0, clock=lambda: now[0], sleep=sleep)
    with pytest.raises(PlacementError, match="failed to deploy: boom"):
        wait_until_placed(lambda: ("DEPLOY_FAILED", "boom"), 5.0, clock=lambda: now[0],
                          sleep=sleep)


def test_the_placement_timeout_is_a_flag():
    from diffrt.cli import build_parser

    args = build_parser().parse_args(["serve", "--replicas", "2", "--placement-timeout-s", "3"])
    assert args.placement_timeout_s == 3.0
    assert build_parser().parse_args(["serve"]).placement_timeout_s == 300.0


# -- issue 27 item 1: the single ingress holds max_pending ---------------------------------
class FakeReplicas:
    """A Ray Serve handle over replicas that run ``capacity`` requests at a
    time: a call waits for room, yields ``ADMITTED`` once it has it, then its
    final output when the test sets ``finish``."""

    def __init__(self, capacity: int):
        import asyncio

        self.capacity = capacity
        self.running = 0
        self.waiting = 0
        self.most_waiting = 0
        self.finish = asyncio.Event()

    def options(self, **kw):
        return self

    @property
    def generate(self):
        return self

    def remote(self, request):
        return FakeCall(self._serve(request))

    async def _serve(self, request):
        import asyncio

        from diffrt.engine import DiffusionOutput
        from diffrt.serve.ingress_seats import ADMITTED

        self.waiting += 1
        self.most_waiting = max(self.most_waiting, self.waiting)
        try:
            while self.running >= self.capacity:
                await asyncio.sleep(0.001)
        finally:
            self.waiting -= 1
        self.running += 1
        try:
            yield "replica-a", ADMITTED
            await self.finish.wait()
            yield "replica-a", DiffusionOutput(request.request_id, finished=True, images=[])
        finally:
            self.running -= 1


class FakeCall:
    """A streaming call: iterable, and ``cancel`` closes it (as Ray's does)."""

    def __init__(self, gen):
        self._gen = gen

    def __aiter__(self):
        return self

    def __anext__(self):
        return self._gen.__anext__()

    def cancel(self):
        import asyncio

        asyncio.get_running_loop().create_task(self._gen.aclose())


def test_the_ingress_holds_max_pending_over_the_replicas():
    """Bursts of 10x the bound through the ingress's client: the requests it
    accepted and no replica admitted yet never pass max_pending (nor do those
    waiting at the replicas); each 429 is sent with the bound full, a second
    burst fills it exactly, and every seat comes back — also a client's that
    left while waiting."""
    import asyncio

    from diffrt.engine import DiffusionRequest
    from diffrt.serve.errors import ApiError

    max_pending, seqs, burst = 6, 4, 60
    replicas = FakeReplicas(seqs)
    client = ReplicaClient(model=replicas, board=None,
                           settings=ServeSettings(max_pending=max_pending), model_name="m",
                           step_execution=True)

    async def one(i: int):
        try:
            async for out in client.run(DiffusionRequest(prompt="p", request_id=f"r{i}")):
                last = out
            return last
        except ApiError as exc:
            return exc

    async def main():
        seen: list[int] = []
        stop = asyncio.Event()

        async def sample():
            while not stop.is_set():
                seen.append(client.seats.taken)
                await asyncio.sleep(0.001)

        sampler = asyncio.create_task(sample())

        async def wave(start: int):
            tasks = [asyncio.create_task(one(start + i)) for i in range(burst)]
            for _ in range(2000):  # until each is shed or held by a seat or a replica
                if sum(t.done() for t in tasks) + client.seats.taken + replicas.running \
                        >= burst + before:
                    break
                await asyncio.sleep(0.002)
            return tasks

        before = 0
        first = await wave(0)
        held_after_first = client.seats.taken
        before = client.seats.taken + replicas.running
        second = await wave(burst)
        assert client.seats.taken == max_pending
        # the last one accepted waits (the replicas run the first ones)
        leaving = [t for t in first + second if not t.done()][-1]
        leaving.cancel()  # a client that leaves while waiting
        for _ in range(500):
            if client.seats.taken == max_pending - 1:
                break
            await asyncio.sleep(0.002)
        assert client.seats.taken == max_pending - 1
        replicas.finish.set()
        answers = await asyncio.gather(*[t for t in first + second if t is not leaving])
        stop.set()
        await sampler
        await client.close()
        return seen, held_after_first, answers

    seen, held_after_first, answers = asyncio.run(main())
    assert max(seen) <= max_pending and replicas.most_waiting <= max_pending
    assert max_pending - seqs <= held_after_first <= max_pending
    assert client.seats.taken == 0 and replicas.running == 0
    shed = [a for a in answers if isinstance(a, ApiError)]
    served = [a for a in answers if not isinstance(a, ApiError)]
    assert all(a.status == 429 and a.headers["Retry-After"] for a in shed)
    assert all(out.finished for out in served)
    assert len(served) == seqs + max_pending - 1  # the one that left is not answered


def test_a_replica_announces_admission_before_any_output():
    """``announce_admission``: ADMITTED as soon as the engine says so, though
    the request-mode forward's only output comes later; leaving early closes
    the outputs (which aborts the request)."""
    import asyncio
    import threading

    from diffrt.serve.ingress_seats import ADMITTED, announce_admission

    closed = []

    async def outputs(release: asyncio.Event):
        try:
            await release.wait()
            yield "final"
        finally:
            closed.append(True)

    async def main():
        loop = asyncio.get_running_loop()
        admitted, release = asyncio.Event(), asyncio.Event()
        stream = announce_admission(outputs(release), admitted)
        first = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0.05)
        assert not first.done()
        threading.Thread(target=lambda: loop.call_soon_threadsafe(admitted.set)).start()
        assert await first == ADMITTED
        second = asyncio.ensure_future(stream.__anext__())
        release.set()
        assert await second == "final"
        rest = [item async for item in stream]
        left = announce_admission(outputs(asyncio.Event()), asyncio.Event())
        pending = asyncio.ensure_future(left.__anext__())
        await asyncio.sleep(0.02)
        pending.cancel()
        try:
            await pending
        except asyncio.CancelledError:
            pass
        await left.aclose()
        return rest

    assert asyncio.run(main()) == []
    assert closed == [True, True]


def test_the_ingress_lists_a_replicas_adapters_and_refuses_run_time_changes():
    """Each replica has an engine of its own: /v1/loras lists what one replica
    holds (all register --lora-modules at start), POST and DELETE answer
    501 (POST /v1/weights and PUT reach every replica: test_ray_weights_units.py)."""
    from serve_helpers import call

    from diffrt.engine import LoraInfo
    from diffrt.serve import build_app

    info = LoraInfo(name="style", path="/adapters/style", rank=4, modules=12, nbytes=1024,
                    requests=3, active=1, slot=0)

    class Handle:
        @property
        def list_loras(self):
            return self

        async def remote(self):
            return [info]

    settings = ServeSettings(lora_dir="/adapters")
    client = ReplicaClient(Handle(), None, settings, "tiny-flux", True)
    app = build_app(settings=settings, client=client)
    doc = call(app, "GET", "/v1/loras").json()
    assert doc == {"object": "list", "data": [{
        "name": "style", "path": "/adapters/style", "rank": 4, "modules": 12, "nbytes": 1024,
        "requests": 3, "active": 1, "slot": 0, "version": 0}]}
    for method, kw in (("POST", {"json": {"name": "b", "path": "b"}}), ("DELETE", {})):
        path = "/v1/loras" if method == "POST" else "/v1/loras/style"
        r = call(app, method, path, **kw)
        assert r.status_code == 501 and "--lora-modules" in r.json()["error"]["message"], r.text
