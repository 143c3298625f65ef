"""The Ray Serve application's parts that need no cluster: resources asked of
Ray per platform, the statistics board's expiry, the ingress's view of the
replicas' health and of which replica answered, a rank actor's environment."""

from __future__ import annotations

import time

import pytest

from diffrt.engine import EngineConfig
from diffrt.runtime.ray_executor import rank_environment, ray_bundle, ray_device_options
from diffrt.serve import ServeSettings
from diffrt.serve.ray_app import ReplicaClient, ReplicaSettings, StatsBoard


class Platform:
    def __init__(self, resource):
        self.ray_resource = resource


def test_devices_are_asked_of_ray_under_the_platforms_resource():
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
    def __init__(self, healthy):
        self.healthy = healthy


def test_the_ingress_is_healthy_while_a_replica_says_so():
    client = ReplicaClient(model=None, board=None, settings=ServeSettings(), model_name="m",
                           step_mode=True)
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

    args = build_parser().parse_args(["serve", "--replicas", "2", "--placement-timeout", "3"])
    assert args.placement_timeout == 3.0
    assert build_parser().parse_args(["serve"]).placement_timeout == 60.0
