"""Issue 52: the vendor paths a second audit read against the vendors' own
sources, each against a fake rebuilt from the real API
(tests/platforms/vendor_fakes.py names the vendor file each mirrors)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from vendor_fakes import broken_install, cuda_device, flash_attn_module, ray_module

from diffrt.engine import EngineConfig, EngineConfigError
from diffrt.engine.config import usable_methods
from diffrt.engine.pipeline_runner import resolve_dtype
from diffrt.platforms import cuda, device_facts
from diffrt.platforms.cuda import CudaPlatform
from diffrt.platforms.musa import MusaPlatform
from diffrt.platforms.npu import NpuPlatform
from diffrt.platforms.rocm import RocmPlatform

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def fresh_caches():
    cuda._flash_attn.cache_clear()
    device_facts.clear_cache()
    yield
    cuda._flash_attn.cache_clear()
    device_facts.clear_cache()


def gpu(monkeypatch, device_module_factory, cls, major, minor, arch="", hip=None,
        initialized=True):
    """``cls`` over a fake torch.cuda with one device; ``hip``: torch.version.hip."""
    mod = cuda_device(device_module_factory("cuda"), major, minor, arch, initialized=initialized)
    monkeypatch.setattr(torch, "cuda", mod)
    monkeypatch.setattr(torch.version, "hip", hip)
    return cls(), mod


# -- 4. flash-attention's varlen kernel only where the kernel accepts the device ----------
@pytest.mark.parametrize("capability,release,runs", [
    ((7, 5), "2.8.3", False),        # T4: "FlashAttention only supports Ampere GPUs or newer"
    ((7, 0), "2.6.3", False),        # V100
    ((8, 0), "2.6.3", True), ((8, 6), "2.5.9", True), ((9, 0), "2.7.2.post1", True),
    ((10, 0), "2.7.2.post1", False),  # is_sm90 || is_sm8x before 2.7.3
    ((10, 0), "2.7.3", True), ((12, 0), "2.8.3", True),  # cc_major >= 8 since
])
def test_cuda_varlen_attention_follows_mha_varlen_fwds_check(
        capability, release, runs, monkeypatch, device_module_factory):
    monkeypatch.setitem(sys.modules, "flash_attn", flash_attn_module(release))
    platform, mod = gpu(monkeypatch, device_module_factory, CudaPlatform, *capability)
    attend = platform.varlen_attention(torch.float16)
    assert (attend is not None) is runs  # else SDPA with a key mask
    assert mod.contexts_created == 0  # a worker's existing context was asked


@pytest.mark.parametrize("arch,release,runs", [
    ("gfx90a:sramecc+:xnack-", "2.6.3", True), ("gfx942:sramecc+:xnack-", "2.8.3", True),
    ("gfx941", "2.7.4.post1", True), ("gfx941", "2.8.0", False),
    ("gfx950", "2.7.4.post1", False), ("gfx950", "2.8.3", True),
    ("gfx1100", "2.8.3", False), ("gfx1100", "2.8.4", True),
    ("gfx906", "2.8.3", False), ("gfx908", "2.8.4", False),  # MI50, MI100: no CK kernels
])
def test_rocm_varlen_attention_only_on_the_archs_its_ck_build_compiles(
        arch, release, runs, monkeypatch, device_module_factory):
    monkeypatch.setitem(sys.modules, "flash_attn", flash_attn_module(release))
    platform, _ = gpu(monkeypatch, device_module_factory, RocmPlatform, 9, 4, arch, hip="6.4.1")
    assert (platform.varlen_attention(torch.bfloat16) is not None) is runs


# -- 5. ROCm fp8: where torchao's float8 assert and torch's _scaled_mm both accept --------
@pytest.mark.parametrize("arch,hip,supported", [
    ("gfx942:sramecc+:xnack-", "6.2.41133", True), ("gfx940", "6.0.0", True),
    ("gfx941", "6.1.0", True),
    ("gfx950", "6.4.43482", False),  # torch's _scaled_mm: gfx95x only from ROCm 6.5
    ("gfx950", "7.0.1", True),
    ("gfx951", "7.0.1", False),      # not torchao's is_MI350 ("gfx950")
    ("gfx1201", "6.4.1", False),     # Navi 4: torch accepts, torchao's assert does not
    ("gfx90a", "6.4.1", False),      # MI200
])
def test_rocm_fp8_follows_torchaos_float8_check(arch, hip, supported, monkeypatch,
                                                device_module_factory):
    platform, _ = gpu(monkeypatch, device_module_factory, RocmPlatform, 9, 4, arch, hip=hip)
    assert platform.fp8_matmul_supported() is supported


# -- 10. the engine process asks a child, never creating a context itself ----------------
def child_says(monkeypatch, facts: dict | None) -> list[int]:
    """What the child process prints (device_facts.CHILD_CODE's JSON); counts runs."""
    runs: list[int] = []

    def run_child() -> str:
        runs.append(1)
        return json.dumps(facts)

    monkeypatch.setattr(device_facts, "run_child", run_child)
    return runs


def test_the_engines_config_check_probes_fp8_and_bf16_without_a_context(
        monkeypatch, device_module_factory):
    config = EngineConfig(model="tiny-flux", quantization="fp8", dtype="bfloat16")
    config.model_spec()  # diffusers' imports, before torch.cuda is the fake
    platform, mod = gpu(monkeypatch, device_module_factory, CudaPlatform, 7, 5,
                        initialized=False)
    runs = child_says(monkeypatch, {"capability": [7, 5], "arch": "", "bf16": False})  # T4
    with pytest.raises(EngineConfigError) as info:
        config.executor_config(platform=platform)
    assert info.value.field == "quantization"
    assert resolve_dtype("auto", platform) is torch.float16  # bf16 only emulated on a T4
    assert mod.contexts_created == 0 and runs == [1]  # one child, its answer kept
    device_facts.clear_cache()
    runs = child_says(monkeypatch, {"capability": [9, 0], "arch": "", "bf16": True})  # H100
    assert platform.fp8_matmul_supported() and resolve_dtype("auto", platform) is torch.bfloat16
    assert mod.contexts_created == 0


def test_a_worker_with_its_context_asks_the_device_directly(monkeypatch, device_module_factory):
    platform, mod = gpu(monkeypatch, device_module_factory, CudaPlatform, 8, 9)
    runs = child_says(monkeypatch, None)
    assert platform.fp8_matmul_supported() and platform.bf16_supported()
    assert runs == [] and mod.contexts_created == 0


def test_the_child_probe_answers_none_without_a_gpu():
    """The real child, on this CPU build of torch: no device, so nothing is
    claimed (fp8 refused, float16 for "auto")."""
    assert device_facts.parse_child(device_facts.run_child()) is None
    assert device_facts.parse_child('{"capability": [9, 4], "arch": "gfx942:xnack-", '
                                    '"bf16": true}').arch == "gfx942"


# -- 11. fp8-storage refused on Ascend ------------------------------------------------------
@pytest.mark.parametrize("field", ["quantization", "text_encoder_quantization"])
def test_fp8_storage_is_refused_on_npu(field, monkeypatch, device_module_factory):
    """torch_npu's torch_npu/csrc/aten/ops/op_api/CopyKernelOpApi.cpp (Ascend/pytorch
    master): ``is_aclnn_cast_unsupported_dtype`` lists ACL_FLOAT8_E4M3FN among what
    aclnnCast rejects on A2 and later, which a float8 weight's cast on the device is."""
    monkeypatch.setattr(torch, "npu", device_module_factory("npu"), raising=False)
    monkeypatch.setitem(sys.modules, "torch_npu", ModuleType("torch_npu"))
    config = EngineConfig(model="tiny-flux", **{field: "fp8-storage"})
    with pytest.raises(EngineConfigError) as info:
        config.executor_config(platform=NpuPlatform())
    assert info.value.field == field and "aclnnCast" in str(info.value)
    assert "fp8-storage" not in usable_methods(config.model_spec(), NpuPlatform())
    assert "fp8-storage" in usable_methods(config.model_spec(), CudaPlatform())


# -- 6. MUSA under Ray: pinned first, through the inherited list ---------------------------
def test_ray_ids_index_the_inherited_musa_visibility(monkeypatch):
    """Ray 2.60's get_gpu_ids (python/ray/_private/worker.py) maps its ids
    through an inherited CUDA_VISIBLE_DEVICES only; a raylet started with
    MUSA_VISIBLE_DEVICES=2,3 hands out 0 and 1."""
    from diffrt.runtime.ray_executor import pin_to_ray_devices

    monkeypatch.setitem(sys.modules, "ray", ray_module([0, 1]))
    env = {"MUSA_VISIBLE_DEVICES": "2,3"}
    assert pin_to_ray_devices("MUSA_VISIBLE_DEVICES", env) == {"MUSA_VISIBLE_DEVICES": "2,3"}
    monkeypatch.setitem(sys.modules, "ray", ray_module([1]))
    env = {"MUSA_VISIBLE_DEVICES": "2,3"}
    assert pin_to_ray_devices("MUSA_VISIBLE_DEVICES", env)["MUSA_VISIBLE_DEVICES"] == "3"
    assert pin_to_ray_devices("MUSA_VISIBLE_DEVICES", {}) == {"MUSA_VISIBLE_DEVICES": "1"}
    monkeypatch.setitem(sys.modules, "ray", ray_module([3]))
    with pytest.raises(RuntimeError, match="--num-gpus 2"):
        pin_to_ray_devices("MUSA_VISIBLE_DEVICES", {"MUSA_VISIBLE_DEVICES": "2,3"})


def test_a_musa_replica_pins_before_the_platform_is_resolved(monkeypatch):
    """torch_musa's is_available()/device_count() (torch_musa/core/device.py,
    MooreThreads/torch_musa main) ask the runtime for the device count, which
    reads MUSA_VISIBLE_DEVICES once and is cached: the replica must be pinned
    before the platform's probe runs."""
    import diffrt.platforms as platforms
    from diffrt.engine import EngineConfig
    from diffrt.serve import ServeSettings, ray_app

    seen: dict[str, str | None] = {}
    ray = ray_module([1])
    ray.serve = ModuleType("ray.serve")
    ray.serve.get_replica_context = lambda: type(  # ray/serve/context.py ReplicaContext
        "Ctx", (), {"replica_id": type("Id", (), {"unique_id": "r1"})()})()
    monkeypatch.setitem(sys.modules, "ray", ray)
    monkeypatch.setitem(sys.modules, "ray.serve", ray.serve)
    monkeypatch.setenv("MUSA_VISIBLE_DEVICES", "2,3")  # the raylet's

    def resolve() -> MusaPlatform:
        seen["at_resolution"] = os.environ.get("MUSA_VISIBLE_DEVICES")
        return MusaPlatform()

    class Stop(Exception):
        pass

    def make_engine(config):
        raise Stop

    monkeypatch.setattr(platforms, "_resolve", resolve)
    monkeypatch.setattr(ray_app.DiffusionEngine, "make_engine", staticmethod(make_engine))
    with pytest.raises(Stop):
        ray_app.ModelReplica(EngineConfig(model="tiny-flux"), ServeSettings(), board=None,
                             pin_var="MUSA_VISIBLE_DEVICES")
    assert seen == {"at_resolution": "3"}


# -- 9. what rank actors inherit ----------------------------------------------------------
def test_rank_actors_inherit_every_vendors_runtime_settings(monkeypatch):
    """ROCm's HSA_*/HIP_*/MIOPEN_*/HIPBLASLT_*, CUDA's module loading, MUSA's
    settings, torch_npu's TASK_QUEUE_ENABLE and ACL_*, Intel's UR_*/IPEX_*,
    and LD_LIBRARY_PATH (DeepSpeed exports it to NPU ranks); visibility stays
    behind."""
    from diffrt.runtime.ray_executor import rank_environment

    forwarded = {"HSA_OVERRIDE_GFX_VERSION": "9.4.2", "HIP_FORCE_DEV_KERNARG": "1",
                 "MIOPEN_USER_DB_PATH": "/tmp/miopen", "HIPBLASLT_TENSILE_LIBPATH": "/x",
                 "CUDA_MODULE_LOADING": "LAZY", "CUDA_DEVICE_MAX_CONNECTIONS": "1",
                 "MUSA_LAUNCH_BLOCKING": "0", "TASK_QUEUE_ENABLE": "2",
                 "ACL_OP_COMPILER_CACHE_DIR": "/tmp/acl", "UR_L0_USE_IMMEDIATE_COMMANDLISTS": "1",
                 "IPEX_FP32_MATH_MODE": "TF32", "LD_LIBRARY_PATH": "/usr/local/Ascend/lib64"}
    visibility = {"HIP_VISIBLE_DEVICES": "0", "ROCR_VISIBLE_DEVICES": "0",
                  "CUDA_VISIBLE_DEVICES": "0", "MUSA_VISIBLE_DEVICES": "0"}
    for k, v in {**forwarded, **visibility}.items():
        monkeypatch.setenv(k, v)
    env = rank_environment({})
    assert forwarded.items() <= env.items()
    assert not set(visibility) & set(env)



def test_serve_replicas_inherit_them_too(monkeypatch):
    """A Serve replica is an actor as well: Ray starts it from the raylet's
    environment plus its ``ray_actor_options["runtime_env"]["env_vars"]``
    (ray/serve/_private/config.py ``_validate_ray_actor_options`` admits
    ``runtime_env``; ray/serve/_private/utils.py
    ``override_runtime_envs_except_env_vars`` merges its env_vars with the
    application's), so without them its engine —
    and the worker processes or rank actors it starts — never see the
    settings; visibility stays behind here too."""
    from diffrt.engine import EngineConfig
    from diffrt.serve import ServeSettings
    from diffrt.serve.ray_app import ReplicaSettings

    monkeypatch.setenv("HSA_OVERRIDE_GFX_VERSION", "9.4.2")
    monkeypatch.setenv("LD_LIBRARY_PATH", "/usr/local/Ascend/lib64")
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "0")

    class Gpu:  # the platform as deployment_options reads it
        ray_resource = "GPU"

    for backend in ("mp", "ray"):  # the engine's workers, or its own rank actors
        config = EngineConfig(model="tiny-flux", executor_backend=backend)
        actor = ReplicaSettings().deployment_options(config, ServeSettings(),
                                                     Gpu())["ray_actor_options"]
        env = actor["runtime_env"]["env_vars"]
        assert env["HSA_OVERRIDE_GFX_VERSION"] == "9.4.2"
        assert env["LD_LIBRARY_PATH"] == "/usr/local/Ascend/lib64"
        assert "HIP_VISIBLE_DEVICES" not in env

# -- 7. a vendor backend that breaks `import torch` -----------------------------------------
def test_a_backend_failing_inside_import_torch_is_named_in_one_line(tmp_path):
    """torch-npu 2.14.0 on this torch, its CANN libraries missing: torch
    imports it inside ``import torch`` (torch/__init__.py
    ``_import_device_backends``) through its ``torch.backends`` entry point."""
    site = broken_install(tmp_path, "torch_npu", "torch-npu", "2.14.0", "torch==2.14.0",
                          "libhccl.so: cannot open shared object file", entry_point=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])}
    env.pop("TORCH_DEVICE_BACKEND_AUTOLOAD", None)
    out = subprocess.run([sys.executable, "-m", "diffrt.cli", "env", "--json"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    line = out.stderr.strip()
    assert "\n" not in line and "Traceback" not in line
    torch_here = torch.__version__
    for part in ("torch-npu 2.14.0", "libhccl.so", "requires torch==2.14.0",
                 f"this is torch {torch_here}", "TORCH_DEVICE_BACKEND_AUTOLOAD=0"):
        assert part in line, part
    report = json.loads(out.stdout)  # diffrt env reports it
    assert report["platform"] is None
    assert report["torch_backend_autoload_failure"]["package"] == "torch-npu"
    assert report["versions"]["torch-npu"] == "2.14.0"


#: a program that imports diffrt and uses the engine (and the server), not the CLI
PROGRAM = """
import diffrt
from diffrt.vendor_metadata import BackendAutoloadError
for _ in range(2):  # the second try names the first failure, not torch's retry
    try:
        from diffrt.engine import DiffusionEngine
    except BackendAutoloadError as exc:
        print(type(exc).__name__, exc)
try:
    from diffrt.serve import build_app
except BackendAutoloadError as exc:
    print(type(exc).__name__, exc)
"""


def test_a_program_importing_diffrt_gets_the_same_named_error(tmp_path):
    """The same broken torch_npu, met by ``import diffrt`` in a program: the
    engine's (and the server's) first import of torch raises an exception
    naming the package, its version, the torch it needs and the variable,
    instead of torch's bare RuntimeError."""
    site = broken_install(tmp_path, "torch_npu", "torch-npu", "2.14.0", "torch==2.14.0",
                          "libhccl.so: cannot open shared object file", entry_point=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])}
    env.pop("TORCH_DEVICE_BACKEND_AUTOLOAD", None)
    out = subprocess.run([sys.executable, "-c", PROGRAM], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 3, out.stdout
    for line in lines:
        assert line.startswith("BackendAutoloadError ")
        for part in ("torch-npu 2.14.0", "libhccl.so", "requires torch==2.14.0",
                     f"this is torch {torch.__version__}", "TORCH_DEVICE_BACKEND_AUTOLOAD=0"):
            assert part in line, (part, line)

def test_ipex_refusal_and_a_failing_xpu_check_are_in_the_report(monkeypatch, fake_installed):
    """IPEX checks torch's major.minor on import (its 2.8.0, a CPU build on
    PyPI); torch.xpu.is_available() can raise where the Level Zero loader
    fails (torch/xpu/__init__.py calls into the driver)."""
    from diffrt.platforms import detect, vendor_packages, xpu
    from diffrt.platforms.report import platform_report

    monkeypatch.setattr(vendor_packages, "_failures", {})
    monkeypatch.delitem(sys.modules, xpu.IPEX, raising=False)
    fake_installed.add(xpu.IPEX)
    monkeypatch.setattr(xpu.importlib.metadata, "version", lambda dist: "2.8.0")
    assert xpu.load_ipex() is False

    def broken() -> bool:
        raise RuntimeError("level_zero backend failed with error: 2147483646")

    fake_xpu = ModuleType("xpu")
    fake_xpu.is_available = broken
    monkeypatch.setattr(torch, "xpu", fake_xpu)
    assert detect.detect_xpu() is None
    failures = platform_report()["vendor_import_failures"]
    assert "built for torch 2.8" in failures[xpu.IPEX]
    assert "torch.xpu.is_available() failed" in failures["torch.xpu"]
    assert "level_zero" in failures["torch.xpu"]
