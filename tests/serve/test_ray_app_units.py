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
