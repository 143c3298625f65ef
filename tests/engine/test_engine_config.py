"""EngineConfig validation: every error names the field or the model."""

from __future__ import annotations

import pytest
import torch

from diffrt.engine import EngineConfig, EngineConfigError, ExecutionMode


@pytest.mark.parametrize("kw, field", [
    ({"request_batch_max_wait_ms": -1}, "request_batch_max_wait_ms"),
    ({"request_batch_max_wait_ms": float("nan")}, "request_batch_max_wait_ms"),
    ({"step_batch_max_wait_ms": -0.5}, "step_batch_max_wait_ms"),
    ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"max_num_seqs": 2.0}, "max_num_seqs"),
    ({"executor_backend": "slurm"}, "executor_backend"),
    ({"world_size": 0}, "world_size"),
    ({"executor_backend": "inproc", "world_size": 2}, "world_size"),
    ({"executor_backend": "inproc", "ulysses_degree": 2}, "executor_backend"),
    ({"cfg_parallel_size": 3}, "cfg_parallel_size"),
    ({"cfg_parallel_size": 2, "world_size": 4}, "world_size"),  # the product or unset
    ({"world_size": 2}, "world_size"),  # replicated ranks add nothing: refused
    ({"vae_parallel": True}, "vae_parallel"),  # one rank: nothing to split
    ({"vae_parallel": True, "cfg_parallel_size": 2, "vae_tiling": True}, "vae_parallel"),
    ({"vae_parallel": 1, "cfg_parallel_size": 2}, "vae_parallel"),
    ({"compile": "yes"}, "compile"),
    ({"ulysses_degree": 0}, "ulysses_degree"),
    ({"ulysses_degree": 2, "world_size": 2, "cfg_parallel_size": 2}, "world_size"),
    ({"ring_degree": 2, "ulysses_degree": 2, "world_size": 2}, "world_size"),
    ({"max_steps_per_tick": 0}, "max_steps_per_tick"),
    ({"scheduling_policy": "lifo"}, "scheduling_policy"),
    ({"scheduling_max_bypass": -1}, "scheduling_max_bypass"),
    ({"async_output": "yes"}, "async_output"),
    ({"output_timeout_s": 0}, "output_timeout_s"),
    ({"warmup_timeout_s": -5}, "warmup_timeout_s"),
    ({"dtype": "int8"}, "dtype"),
    ({"torch_threads": 0}, "torch_threads"),
    ({"step_execution": 1}, "step_execution"),
])
def test_bad_field_is_named(kw, field):
    with pytest.raises(EngineConfigError) as info:
        EngineConfig(model="toy", **kw)
    assert info.value.field == field
    assert str(info.value).startswith(field)


@pytest.mark.parametrize("model, kw, field, reason", [
    ("tiny-flux", {"ulysses_degree": 3}, "ulysses_degree", "2 attention heads"),
    ("tiny-sd3", {"ulysses_degree": 4, "ring_degree": 2}, "ulysses_degree", "2 attention heads"),
    ("toy", {"cfg_parallel_size": 2}, "world_size", "one rank only"),
    ("tiny-wan", {"ulysses_degree": 4}, "ulysses_degree", "2 attention heads"),
])
def test_parallel_configurations_the_model_cannot_run_are_refused(model, kw, field, reason):
    """Refused when the model is resolved (``model_spec()``, which the engine
    calls at its start), before any worker starts."""
    with pytest.raises(EngineConfigError, match=reason) as info:
        EngineConfig(model=model, **kw).model_spec()
    assert info.value.field == field


def test_world_size_is_the_product_of_the_parallel_degrees():
    config = EngineConfig(model="tiny-flux", cfg_parallel_size=2, ulysses_degree=2, ring_degree=2,
                          vae_parallel=True)
    from diffrt.platforms import current_platform

    assert config.ranks == 8 and config.executor_config(platform=current_platform).world_size == 8
    assert EngineConfig(model="tiny-flux").ranks == 1
    assert EngineConfig(model="tiny-flux", ring_degree=3, world_size=3).ranks == 3
    # the derived size is not written back: a copy with other degrees is valid
    assert config.replace(cfg_parallel_size=1).ranks == 4


@pytest.mark.parametrize("field, value", [("refuse_unmeetable", True), ("slo_aging_ticks", 4),
                                          ("max_paused_state_bytes", 0)])
def test_slo_settings_under_another_policy_are_refused(field, value):
    """They would change nothing under fifo or skip_ahead: said, not ignored."""
    for policy in ("fifo", "skip_ahead"):
        with pytest.raises(EngineConfigError, match="scheduling_policy='slo' only") as info:
            EngineConfig(model="tiny-flux", scheduling_policy=policy, **{field: value})
        assert info.value.field == field
    assert getattr(EngineConfig(model="tiny-flux", scheduling_policy="slo", **{field: value})
                   .scheduling, field) == value


def test_more_ranks_than_devices_are_refused():
    class TwoGpus:
        device_type = "cuda"
        supports_async_output = True

        @staticmethod
        def device_count() -> int:
            return 2

    config = EngineConfig(model="tiny-flux", cfg_parallel_size=2, ulysses_degree=2)
    with pytest.raises(EngineConfigError, match="4 ranks.*2 cuda device") as info:
        config.executor_config(platform=TwoGpus())
    assert info.value.field == "ulysses_degree"
    EngineConfig(model="tiny-flux", cfg_parallel_size=2).executor_config(platform=TwoGpus())


def test_unknown_model_names_the_model_and_lists_known_ones():
    with pytest.raises(EngineConfigError, match="no-such-model") as info:
        EngineConfig(model="no-such-model").model_spec()
    assert info.value.field == "model"
    assert "tiny-flux" in str(info.value)


def test_capabilities_of_the_model_are_checked():
    with pytest.raises(EngineConfigError, match="request batching") as info:
        EngineConfig(model="toy-serial", max_num_seqs=2).model_spec()
    assert info.value.field == "max_num_seqs" and "toy-serial" in str(info.value)
    with pytest.raises(EngineConfigError, match="step protocol") as info:
        EngineConfig(model="toy-serial", step_execution=True).model_spec()
    assert info.value.field == "step_execution"
    EngineConfig(model="toy-serial", max_num_seqs=1).model_spec()  # serial request mode is fine


def test_mode_follows_step_execution():
    assert EngineConfig(model="toy").mode is ExecutionMode.REQUEST_BATCH
    assert EngineConfig(model="toy", step_execution=True, max_num_seqs=8).mode is ExecutionMode.STEP_BATCH


def test_executor_config_names_the_pipeline_runner_and_its_typed_settings():
    from diffrt.engine.runner_messages import PIPELINE_PROTOCOL, RunnerSettings

    cfg = EngineConfig(model="toy", dtype="bfloat16", torch_threads=3, plugin_modules=["engine_toy"],
                       max_pending_output_bytes=1 << 20, output_timeout_s=7.0,
                       startup_timeout_s=9.0)
    from types import SimpleNamespace

    no_async_cpu = SimpleNamespace(supports_async_output=False, device_type="cpu")
    ex = cfg.executor_config(platform=no_async_cpu)
    assert ex.runner.cls == "diffrt.engine.pipeline_runner:PipelineRunner"
    assert ex.runner.protocol is PIPELINE_PROTOCOL
    assert ex.runner.settings == RunnerSettings(spec=cfg.model_spec(), model=cfg.model_config,
                                                parallel=cfg.parallel)
    assert (cfg.model_config.dtype, cfg.model_config.torch_threads,
            cfg.model_config.plugin_modules) == ("bfloat16", 3, ("engine_toy",))
    assert (ex.max_pending_output_bytes, ex.output_timeout_s, ex.startup_timeout_s) == \
        (1 << 20, 7.0, 9.0)
    assert ex.async_output is False  # auto follows the platform
    assert EngineConfig(model="toy", async_output=True).executor_config(
        platform=no_async_cpu).async_output is True


def test_cpu_workers_start_with_the_cpu_policy_and_the_user_wins(monkeypatch):
    """A CPU worker keeps freed memory for reuse (no per-request page faults)
    and takes every core; an accelerator's worker gets neither; a value the
    user set, in the environment or in worker_env, wins."""
    from types import SimpleNamespace

    from diffrt.engine.cpu_policy import cpu_worker_threads

    cpu = SimpleNamespace(supports_async_output=True, device_type="cpu")
    gpu = SimpleNamespace(supports_async_output=True, device_type="cuda")
    monkeypatch.delenv("MALLOC_MMAP_MAX_", raising=False)
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_", raising=False)
    env = EngineConfig(model="toy").executor_config(platform=cpu).worker_env
    assert env["MALLOC_MMAP_MAX_"] == "0" and int(env["MALLOC_TRIM_THRESHOLD_"]) >= 1 << 30
    assert EngineConfig(model="toy").executor_config(platform=gpu).worker_env == {}
    mine = EngineConfig(model="toy", worker_env={"MALLOC_MMAP_MAX_": "7"})
    assert mine.executor_config(platform=cpu).worker_env["MALLOC_MMAP_MAX_"] == "7"
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "123")
    assert "MALLOC_TRIM_THRESHOLD_" not in EngineConfig(model="toy").executor_config(
        platform=cpu).worker_env  # inherited from the user's environment as it is
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert cpu_worker_threads(cpu, 1) == 4 and cpu_worker_threads(cpu, 2) == 2
    assert cpu_worker_threads(gpu, 1) is None


@pytest.mark.parametrize("field,value", [
    ("plugin_modules", "engine_toy"),          # a str, not a sequence of names
    ("plugin_modules", ["ok", ""]),
    ("executor_options", {"startup_timeout_s": 1}),  # gone: each option is a setting
    ("worker_env", {"A": 1}),
    ("max_pending_output_bytes", 1),
    ("ray_output_transport", "carrier-pigeon"),
    ("ray_cpus_per_rank", 0),
])
def test_worker_options_are_checked(field, value):
    with pytest.raises(EngineConfigError) as info:
        EngineConfig(model="toy", **{field: value})
    assert info.value.field == field


def test_plugin_modules_are_imported_before_the_model_is_resolved(tmp_path, capsys):
    import sys

    from diffrt.cli import main
    from diffrt.engine.models import registry

    sys.modules.pop("plugin_registers_model", None)  # its import is what registers
    registry.unregister_model("toy-from-plugin")
    try:
        with pytest.raises(EngineConfigError, match="toy-from-plugin"):
            EngineConfig(model="toy-from-plugin").model_spec()  # not registered without its plugin
        cfg = EngineConfig(model="toy-from-plugin", plugin_modules=["plugin_registers_model"])
        assert cfg.model_spec().pipeline == "engine_toy:ToyPipeline"
        # the CLI checks the request against the plugin's model before any engine starts
        sys.modules.pop("plugin_registers_model")
        registry.unregister_model("toy-from-plugin")
        code = main(["generate", "--model", "toy-from-plugin", "--plugin-modules",
                     "plugin_registers_model", "--executor-backend", "inproc", "-p", "x",
                     "--height", "16", "--width", "16", "--steps", "2", "--no-progress",
                     "-o", str(tmp_path / "x.png")])
        assert code == 0, capsys.readouterr().err
        assert (tmp_path / "x.png").exists()
    finally:
        registry.unregister_model("toy-from-plugin")
    with pytest.raises(EngineConfigError, match="cannot import 'no_such_plugin_module'") as info:
        EngineConfig(model="toy", plugin_modules=["no_such_plugin_module"]).model_spec()
    assert info.value.field == "plugin_modules"
    assert main(["generate", "-p", "x", "--plugin-module", "no_such_plugin_module"]) == 2
    assert "--plugin-modules 'no_such_plugin_module'" in capsys.readouterr().err


def test_auto_dtype_is_float32_on_cpu_and_half_on_devices():
    from diffrt.engine.pipeline_runner import resolve_dtype

    class Device:
        def __init__(self, device_type):
            self.device_type = device_type

    assert EngineConfig(model="toy").dtype == "auto"
    assert resolve_dtype("auto", Device("cpu")) is torch.float32
    assert resolve_dtype("float16", Device("cpu")) is torch.float16
    # a device type torch has no module for cannot say it supports bf16: fp16
    assert resolve_dtype("auto", Device("nosuchdevice")) is torch.float16


def test_the_output_arena_is_what_the_configured_outputs_need():
    """Issue 28, item 10: the arena (page-locked where the platform registers
    it) is the smaller of max_pending_output_bytes and what the model's
    largest outputs need for a batch plus the output threads' queue, so a
    small model does not lock 2 GiB it can never fill."""
    from types import SimpleNamespace

    cpu = SimpleNamespace(supports_async_output=True, device_type="cpu")
    shapes = EngineConfig(model="diffrt-shapes", max_num_seqs=2)
    spec = shapes.model_spec()
    # 512 px at most, float32 latents of a 2x VAE with 4 channels: 4 bytes a pixel
    assert (spec.max_size, spec.output_bytes_per_pixel) == (512, 4.0)
    largest = 512 * 512 * 4 * 16
    arena = shapes.executor_config(platform=cpu).max_pending_output_bytes
    assert arena == -(-largest * (2 + 2) // (1 << 20)) * (1 << 20) == 64 << 20
    small = EngineConfig(model="diffrt-shapes", max_pending_output_bytes=1 << 20)
    assert small.executor_config(platform=cpu).max_pending_output_bytes == 1 << 20  # the user's
    assert EngineConfig(model="tiny-sd3").executor_config(
        platform=cpu).max_pending_output_bytes == 36 << 20  # 512 px images, 3 bytes a pixel


def test_the_largest_requests_fit_the_derived_arena():
    """Two of the largest requests the toy model accepts (512x512, 16 outputs)
    at once in an arena sized for them: both arrive whole."""
    import engine_toy as toy
    from engine_helpers import toy_engine, toy_request

    with toy_engine(max_num_seqs=2, max_pending_output_bytes=2 << 30, warmup=False,
                    request_batch_max_wait_ms=200) as engine:
        arena = engine.config.executor_config(
            platform=_cpu()).max_pending_output_bytes
        assert arena == -(-(512 * 512 * 3 * 16) * 4 // (1 << 20)) * (1 << 20)
        big = [toy_request(seed=s, steps=1, size=512, num_outputs_per_prompt=16)
               for s in (1, 2)]
        outs = engine.generate(big, timeout=60)
        assert all(o.ok for o in outs), [o.error for o in outs]
        for request, out in zip(big, outs, strict=True):
            assert len(out.images) == 16 and out.images[0].size == (512, 512)
            assert out.images[15].getpixel((511, 511))[0] == toy.expected_pixel(
                request.sampling_params.seed, 1)


def _cpu():
    from types import SimpleNamespace

    return SimpleNamespace(supports_async_output=True, device_type="cpu")
