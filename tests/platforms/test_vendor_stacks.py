"""Issue 28: what the vendors' own sources show, each item against fakes
rebuilt from the real APIs (tests/platforms/vendor_fakes.py names the vendor
file and version each mirrors)."""

from __future__ import annotations

import logging
import sys
import threading
from pathlib import Path
from types import ModuleType

import pytest
import torch
from vendor_fakes import (
    CudaRuntime,
    NpuRuntime,
    bf16_check,
    broken_install,
    device_properties,
    level_zero_visible,
    locked_bytes,
    page_aligned_arena,
    ray_module,
    runtime_binding,
)

import diffrt.platforms as platforms
from diffrt.platforms.cuda import CudaPlatform
from diffrt.platforms.musa import MusaPlatform
from diffrt.platforms.npu import NpuPlatform
from diffrt.platforms.rocm import RocmPlatform
from diffrt.platforms.xpu import XpuPlatform

ROOT = Path(__file__).resolve().parents[2]
ACL_HOST_REG_MAPPED = 0x2  # aclrtHostRegisterV2's MAPPED flag (CANN acl_rt.h)
BACKENDS = {  # platform -> (torch attribute, vendor package that must be importable)
    CudaPlatform: ("cuda", None), RocmPlatform: ("cuda", None), NpuPlatform: ("npu", "torch_npu"),
    XpuPlatform: ("xpu", None), MusaPlatform: ("musa", "torch_musa"),
}


def install(monkeypatch, device_module_factory, cls, count=2):
    attr, package = BACKENDS[cls]
    mod = device_module_factory(attr, count=count)
    monkeypatch.setattr(torch, attr, mod, raising=False)
    if package:
        monkeypatch.setitem(sys.modules, package, ModuleType(package))
    return cls(), mod


# -- 1. Ascend: lock the arena, then register it MAPPED --------------------------------
@pytest.fixture
def host_lock():
    from diffrt.platforms import host_lock

    return host_lock


@pytest.fixture
def npu(monkeypatch, device_module_factory, host_lock):
    platform, mod = install(monkeypatch, device_module_factory, NpuPlatform)
    runtime = NpuRuntime(old_kernel=True)
    runtime_binding(mod, "npurt", runtime)
    monkeypatch.setattr(host_lock, "kernel_version", lambda release=None: (5, 10))
    return platform, runtime


def test_npu_locks_the_arena_before_registering_it_mapped(npu):
    platform, runtime = npu
    mm, arena = page_aligned_arena(1 << 16)
    handle = platform.register_host_memory(arena)
    assert handle is not None  # CANN on 5.10 refuses unlocked memory: it was locked first
    [(what, ptr, size, flags, locked)] = runtime.calls
    assert (what, ptr, size, flags) == ("register", arena.data_ptr(), 1 << 16, ACL_HOST_REG_MAPPED)
    assert locked >= size
    platform.unregister_host_memory(handle)
    assert runtime.calls[-1][0] == "unregister" and locked_bytes(ptr) == 0  # unlocked after
    del arena
    mm.close()


def test_npu_without_the_lock_on_510_takes_the_staged_path(npu, monkeypatch, caplog,
                                                            host_lock):
    platform, runtime = npu
    monkeypatch.setattr(host_lock, "lock_pages", lambda ptr, n: "mlock failed (RLIMIT_MEMLOCK "
                        "is 65536 bytes: raise it)")
    mm, arena = page_aligned_arena(1 << 16)
    assert platform.register_host_memory(arena) is None
    assert runtime.calls == []  # documented to fail: not even tried
    [line] = [r.message for r in caplog.records if r.levelno == logging.WARNING]
    assert "RLIMIT_MEMLOCK" in line and "staged" in line and "\n" not in line
    del arena
    mm.close()


def test_npu_on_a_newer_kernel_registers_unlocked_memory_and_says_so(npu, monkeypatch, caplog,
                                                                       host_lock):
    platform, runtime = npu
    runtime.old_kernel = False
    monkeypatch.setattr(host_lock, "kernel_version", lambda release=None: (6, 6))
    monkeypatch.setattr(host_lock, "lock_pages", lambda ptr, n: "mlock failed (RLIMIT_MEMLOCK)")
    mm, arena = page_aligned_arena(1 << 16)
    handle = platform.register_host_memory(arena)
    assert handle is not None and runtime.calls[0][3] == ACL_HOST_REG_MAPPED
    assert any("registering the output arena unlocked" in r.message for r in caplog.records)
    platform.unregister_host_memory(handle)
    del arena
    mm.close()


def test_npu_needs_4k_aligned_boundaries(npu, caplog):
    platform, runtime = npu
    mm, arena = page_aligned_arena(3 * 4096)
    assert platform.register_host_memory(arena[16:]) is None  # unaligned start: staged
    assert runtime.calls == [] and any("4 KiB" in r.message for r in caplog.records)
    handle = platform.register_host_memory(arena[:4096 + 100])  # unaligned tail: left out
    assert runtime.calls[0][2] == 4096
    platform.unregister_host_memory(handle)
    del arena
    mm.close()


def test_kernel_version_reads_the_release(host_lock):
    assert host_lock.kernel_version("5.10.0-60.18.0.50.oe2203.aarch64") == (5, 10)
    assert host_lock.kernel_version("weird") == (0, 0)


# -- 2. a failed host-register leaves no error on the calling thread ----------------------
@pytest.mark.parametrize("cls,binding,prefix", [(CudaPlatform, "cudart", "cuda"),
                                                (RocmPlatform, "cudart", "cuda"),
                                                (MusaPlatform, "musart", "musa")])
def test_a_failed_registration_leaves_the_callers_thread_clean(
        cls, binding, prefix, monkeypatch, device_module_factory):
    platform, mod = install(monkeypatch, device_module_factory, cls)
    runtime = CudaRuntime(prefix, device_module=mod)
    runtime_binding(mod, binding, runtime)
    platform.set_device(1)
    arena = torch.zeros(1 << 12, dtype=torch.uint8)
    handle = platform.register_host_memory(arena)
    assert platform.register_host_memory(arena) is None  # already registered: an error code
    runtime.launch()  # the next kernel on this thread must not see that error
    me = threading.get_ident()
    assert [c[4:] for c in runtime.calls if c[0] == "register"] != [] and all(
        c[4] != me and c[5] == 1 for c in runtime.calls)  # own thread, the rank's device
    platform.unregister_host_memory(handle)


# -- 3. Intel GPUs under Ray: the selector, not a second filter ----------------------------
def test_an_xpu_rank_under_rays_selector_sees_its_own_device(monkeypatch, device_module_factory):
    from diffrt.runtime.multiproc_executor import worker_device_env

    platform, _ = install(monkeypatch, device_module_factory, XpuPlatform)
    ray_env = {"ONEAPI_DEVICE_SELECTOR": "level_zero:2,3"}  # a replica holding GPUs 2 and 3
    for rank, physical in enumerate([2, 3]):
        env = {**ray_env, **worker_device_env(platform, rank, 2, ray_env)}
        assert level_zero_visible(4, env) == [physical]
        assert "ZE_AFFINITY_MASK" not in env
    plain = worker_device_env(platform, 1, 2, {})  # no Ray: ZE_AFFINITY_MASK as before
    assert plain == {"ZE_AFFINITY_MASK": "1"} and level_zero_visible(4, plain) == [1]


def test_without_dpctl_ray_sees_no_intel_gpu_and_start_up_says_so(monkeypatch, caplog,
                                                                  fake_installed):
    from diffrt.runtime import ray_executor

    monkeypatch.setattr(ray_executor, "_noted", set())
    monkeypatch.setattr("importlib.util.find_spec",
                        lambda name, package=None: None if name == "dpctl" else object())
    options = ray_executor.ray_device_options(XpuPlatform(), 1)
    ray_executor.ray_device_options(XpuPlatform(), 1)
    assert options == {"num_gpus": 1}
    [line] = [r.message for r in caplog.records if "dpctl" in r.message]
    assert "never placed" in line


# -- 4. MUSA under Ray: GPU resource, pinned from ray.get_gpu_ids() -----------------------
def test_musa_ranks_and_replicas_pin_themselves_from_rays_gpu_ids(monkeypatch):
    from diffrt.runtime import ray_executor

    monkeypatch.setattr(ray_executor, "_noted", set())
    monkeypatch.delenv("MUSA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setitem(sys.modules, "ray", ray_module([5]))
    assert ray_executor.ray_device_options(MusaPlatform(), 2) == {"num_gpus": 2}
    var = ray_executor.ray_pinning_var(MusaPlatform())
    assert var == "MUSA_VISIBLE_DEVICES"
    ray_executor.RankActor(0, {"DIFFRT_X": "1"}, var)
    import os

    assert os.environ["MUSA_VISIBLE_DEVICES"] == "5"
    assert ray_executor.ray_pinning_var(CudaPlatform()) is None  # Ray sets CUDA's itself
    monkeypatch.setitem(sys.modules, "ray", ray_module([]))
    assert ray_executor.pin_to_ray_devices(var, {}) == {}  # no GPU reserved: nothing to pin


# -- 5. each rank selects its device: tensors, streams and events agree ---------------------
@pytest.mark.parametrize("cls", list(BACKENDS), ids=lambda c: c.name)
def test_a_ranks_tensors_streams_and_events_share_its_device(cls, monkeypatch,
                                                             device_module_factory):
    from diffrt.engine.pipeline_runner import rank_device

    platform, mod = install(monkeypatch, device_module_factory, cls, count=2)
    if cls.device_type not in ("cuda", "xpu"):  # named once the vendor renames PrivateUse1
        monkeypatch.setattr(platform, "torch_device",
                            lambda i=None: torch.device("privateuseone", i))
    device = rank_device(platform, rank=3)  # two visible devices: 3 % 2
    assert device.index == 1 and ("set_device", 1) in mod.calls
    seen: dict[str, int] = {}

    def output_thread() -> None:  # a new thread starts on the vendor's device 0
        side = platform.new_side_stream()
        seen["side"] = side.device
        seen["side_event"] = platform.record_device_event(side).device
        seen["thread_current"] = platform.current_stream().device

    thread = threading.Thread(target=output_thread)
    thread.start()
    thread.join()
    seen["current"] = platform.current_stream().device
    seen["event"] = platform.record_device_event().device
    assert seen == dict.fromkeys(seen, device.index)


# -- 6. dtype="auto": native bfloat16 only ---------------------------------------------
@pytest.mark.parametrize("cls", [CudaPlatform, XpuPlatform], ids=lambda c: c.name)
def test_auto_dtype_is_float16_where_bfloat16_is_only_emulated(cls, monkeypatch,
                                                               device_module_factory):
    from diffrt.engine.pipeline_runner import resolve_dtype

    platform, mod = install(monkeypatch, device_module_factory, cls)
    # a worker: its context exists, so the device is asked directly (the
    # engine process asks a child: test_vendor_paths.py)
    mod.is_initialized = lambda: True
    mod.get_device_properties = lambda i=0: device_properties(7, 5)
    mod.is_bf16_supported = bf16_check(native=False)  # T4, V100, Arc A-series
    assert resolve_dtype("auto", platform) is torch.float16
    assert mod.is_bf16_supported.calls == [False]
    mod.is_bf16_supported = bf16_check(native=True)  # A100, H100, PVC
    assert resolve_dtype("auto", platform) is torch.bfloat16


def test_a_bf16_check_without_the_keyword_is_asked_plainly(monkeypatch, device_module_factory):
    platform, mod = install(monkeypatch, device_module_factory, NpuPlatform)
    mod.is_bf16_supported = lambda: True  # torch_npu's takes no argument
    assert platform.bf16_supported() is True


# -- 7. installs that cannot work ---------------------------------------------------------
@pytest.fixture
def broken_torch_musa(tmp_path, monkeypatch):
    """An installed torch_musa built for torch 2.7.1 (its wheel's METADATA, as
    MooreThreads/torch_musa's setup.py writes it): importing it fails."""
    broken_install(tmp_path, "torch_musa", "torch_musa", "2.7.1", "torch==2.7.1",
                   "libmusa.so.4: cannot open shared object file")
    monkeypatch.syspath_prepend(str(tmp_path))
    from diffrt.platforms import vendor_packages

    monkeypatch.setattr(vendor_packages, "_failures", {})
    yield
    sys.modules.pop("torch_musa", None)


def test_a_broken_vendor_package_is_named_with_the_torch_it_needs(broken_torch_musa):
    from diffrt.platforms.report import platform_report

    _, choice = platforms.resolve_platform()
    assert choice.name == "cpu" and choice.how == "fallback"
    assert "torch_musa 2.7.1 is installed but cannot be imported" in choice.reason
    assert "libmusa.so.4" in choice.reason
    assert f"requires torch==2.7.1, this is torch {torch.__version__}" in choice.reason
    report = platform_report()
    assert report["reason"] == choice.reason
    assert "torch_musa" in report["vendor_import_failures"]


def test_forcing_a_broken_vendor_platform_exits_2_in_one_line(broken_torch_musa, monkeypatch,
                                                              capsys):
    from diffrt.cli import main

    monkeypatch.setenv("DIFFRT_PLATFORM", "musa")
    assert main(["env"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "torch_musa 2.7.1 is installed but cannot be imported" in err
    assert "requires torch==2.7.1" in err


def test_each_vendor_extra_is_pinned_to_the_torch_it_needs():
    import re

    line = re.search(r"^npu = (.*)$", (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    assert line == '["torch-npu==2.13.*", "torch==2.13.*"]'  # torch-npu 2.14 replaces torch


# -- 8. XPU before torch 2.8: ccl needs oneCCL's bindings -----------------------------------
def test_several_xpu_ranks_on_old_torch_import_oneccl_or_are_refused(monkeypatch):
    import diffrt.platforms.xpu as xpu

    monkeypatch.setattr(XpuPlatform, "dist_backend", "ccl")
    monkeypatch.delitem(sys.modules, xpu.ONECCL, raising=False)
    real = xpu.importlib.import_module

    def no_oneccl(name, package=None):
        if name == xpu.ONECCL:
            raise ImportError(f"No module named {name!r}")
        return real(name, package)

    monkeypatch.setattr(xpu.importlib, "import_module", no_oneccl)
    with pytest.raises(RuntimeError, match="need oneccl_bindings_for_pytorch .* torch >= 2.8"):
        XpuPlatform().distributed_backend()
    monkeypatch.setattr(xpu.importlib, "import_module", real)
    monkeypatch.setitem(sys.modules, xpu.ONECCL, ModuleType(xpu.ONECCL))
    assert XpuPlatform().distributed_backend() == "ccl"
    monkeypatch.setattr(XpuPlatform, "dist_backend", "xccl")
    assert XpuPlatform().distributed_backend() == "xccl"


def test_a_rank_asks_the_platform_for_its_backend(monkeypatch):
    from diffrt.runtime.messages import InitWorker
    from diffrt.runtime.worker_core import build_core

    class Refusing(CudaPlatform):
        def distributed_backend(self) -> str:
            raise RuntimeError("xpu: several ranks ... need oneccl_bindings_for_pytorch")

    def rendezvous(**kwargs):  # the old code went straight here (and waited for rank 1)
        raise AssertionError(f"init_process_group({kwargs}) without asking the platform")

    monkeypatch.setattr(torch.distributed, "init_process_group", rendezvous)
    platforms.set_current_platform(Refusing())
    init = InitWorker(rank=0, world_size=2, runner_cls="x:y", runner_settings=b"",
                      async_output=True, arena_bytes=4096, output_queue_depth=1,
                      dist_init_method="tcp://127.0.0.1:1", rpc_id=0)
    with pytest.raises(RuntimeError, match="oneccl"):
        build_core(init, lambda msg: None, None, None)


# -- 9. what rank actors inherit; ROCm's two variables --------------------------------------
def test_rank_actors_inherit_vendor_runtime_settings_but_not_visibility(monkeypatch):
    from diffrt.runtime.ray_executor import rank_environment

    forwarded = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
                 "ASCEND_GLOBAL_LOG_LEVEL": "3", "ZE_FLAT_DEVICE_HIERARCHY": "FLAT",
                 "SYCL_CACHE_PERSISTENT": "1"}
    for k, v in {**forwarded, "ZE_AFFINITY_MASK": "0", "ASCEND_RT_VISIBLE_DEVICES": "0"}.items():
        monkeypatch.setenv(k, v)
    env = rank_environment({})
    assert forwarded.items() <= env.items()
    assert "ZE_AFFINITY_MASK" not in env and "ASCEND_RT_VISIBLE_DEVICES" not in env


def test_rocm_with_hip_and_cuda_visible_devices_pins_both(monkeypatch, device_module_factory):
    from diffrt.runtime.multiproc_executor import worker_device_env

    platform, _ = install(monkeypatch, device_module_factory, RocmPlatform, count=4)
    both = {"HIP_VISIBLE_DEVICES": "2,3", "CUDA_VISIBLE_DEVICES": "2,3"}
    assert worker_device_env(platform, 1, 2, both) == dict.fromkeys(both, "3")
    assert worker_device_env(platform, 1, 2, {"HIP_VISIBLE_DEVICES": "2,3"}) == \
        {"HIP_VISIBLE_DEVICES": "3"}


# -- diffrt env --check: the two GPU parts skip cleanly elsewhere -----------------------------
def test_the_gpu_parts_of_the_check_skip_with_a_reason_without_an_nvidia_gpu(
        monkeypatch, device_module_factory):
    from diffrt.cli import gpu_checks
    from diffrt.platforms.cpu import CpuPlatform

    for part in (gpu_checks.host_register_error, gpu_checks.rank_devices):
        assert part(CpuPlatform()) == {"skipped": "needs an NVIDIA GPU (platform cpu)"}
    platform, _ = install(monkeypatch, device_module_factory, CudaPlatform, count=0)
    assert gpu_checks.rank_devices(platform) == {"skipped": "needs an NVIDIA GPU (none visible)"}


def test_health_names_a_broken_vendor_package(monkeypatch):
    """/health's details carry what detection recorded (the server serves on CPU)."""
    import asyncio

    import httpx

    from diffrt.engine import EngineConfig
    from diffrt.platforms import vendor_packages
    from diffrt.serve import ServeSettings, build_app

    class Engine:  # what /health asks of the engine
        config = EngineConfig(model="tiny-flux")
        sleeping = False

        def is_healthy(self) -> bool:
            return True

        def stall(self) -> None:
            return None

    why = vendor_packages.describe_failure("torch_musa", ImportError("libmusa.so.4: cannot open"))
    monkeypatch.setattr(vendor_packages, "_failures", {"torch_musa": why})
    app = build_app(settings=ServeSettings(), engine=Engine())

    async def health() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.get("/health")

    response = asyncio.run(health())
    assert response.status_code == 200
    assert response.json()["details"] == {"vendor_import_failures": {"torch_musa": why}}
