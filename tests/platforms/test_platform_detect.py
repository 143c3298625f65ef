"""Built-in probes: never initialise a device, never import what is not installed."""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

import pytest
import torch

from diffrt.platforms import detect, xpu

VENDOR_PACKAGES = ("torch_npu", "torch_musa", "intel_extension_for_pytorch")


@pytest.fixture
def no_device_init(monkeypatch):
    """Calls that would initialise CUDA/HIP fail the test."""

    def boom(*args, **kwargs):
        raise AssertionError("detection initialised the device")

    monkeypatch.setattr(torch.cuda, "is_available", boom)
    monkeypatch.setattr(torch.cuda, "device_count", boom)
    monkeypatch.setattr(torch.cuda, "init", boom)
    monkeypatch.setattr(torch._C, "_cuda_getDeviceCount", boom, raising=False)


@pytest.fixture
def import_spy(monkeypatch):
    imported: list[str] = []
    real = importlib.import_module

    def spy(name: str, package: str | None = None):
        imported.append(name)
        return real(name, package)

    monkeypatch.setattr(importlib, "import_module", spy)
    return imported


def set_build(monkeypatch, cuda=None, hip=None, nvml=-1, amdsmi=-1, child=-1):
    monkeypatch.setattr(torch.version, "cuda", cuda)
    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setattr(torch.cuda, "_device_count_nvml", lambda: nvml)
    monkeypatch.setattr(torch.cuda, "_device_count_amdsmi", lambda: amdsmi)
    # the count a short-lived child process would report
    monkeypatch.setattr(detect, "subprocess_device_count", lambda: child)


def test_cpu_machine_has_no_accelerator_and_imports_nothing(import_spy, no_device_init):
    for name, probe in detect.BUILTIN_PROBES.items():
        if name != "cpu":
            assert probe() is None, name
    assert detect.detect_cpu() == detect.CPU
    assert not set(import_spy) & set(VENDOR_PACKAGES)
    assert not set(sys.modules) & set(VENDOR_PACKAGES)


@pytest.mark.parametrize(
    "build, expected",
    [
        (dict(cuda="12.8", nvml=2), detect.CUDA),
        (dict(cuda="12.8", nvml=0), None),  # NVML works, no GPU
        (dict(cuda="12.8", nvml=-1, child=-1), None),  # NVML unusable, the child failed
        (dict(cuda="12.8", nvml=-1, child=0), None),  # NVML unusable, no GPU
        (dict(cuda="12.8", nvml=-1, child=2), detect.CUDA),  # NVML unusable, GPUs there
        (dict(cuda=None, nvml=2), None),  # CPU build
    ],
)
def test_detect_cuda_never_initialises_the_driver_here(monkeypatch, no_device_init, caplog,
                                                       build, expected):
    """NVML counts; when NVML is unusable a child process counts (the driver is
    initialised there, not here), with a warning naming NVML."""
    set_build(monkeypatch, **build)
    monkeypatch.setattr(detect.os.path, "exists", lambda p: False)
    assert detect.detect_cuda() == expected
    assert detect.detect_rocm() is None
    if build.get("nvml", 0) < 0 and build["cuda"]:
        assert "NVML is unusable here" in caplog.text


def test_the_subprocess_count_runs_in_a_child(monkeypatch):
    calls = []

    def fake_run(cmd, **kw):
        calls.append(cmd)
        return detect.subprocess.CompletedProcess(cmd, 0, stdout="3\n", stderr="")

    monkeypatch.setattr(detect.subprocess, "run", fake_run)
    detect.subprocess_device_count.cache_clear()  # counted once per process
    assert detect.subprocess_device_count() == 3
    assert detect.subprocess_device_count() == 3 and len(calls) == 1
    assert calls[0][0] == sys.executable and "device_count" in calls[0][-1]

    def failing(cmd, **kw):
        raise detect.subprocess.TimeoutExpired(cmd, 60)

    monkeypatch.setattr(detect.subprocess, "run", failing)
    detect.subprocess_device_count.cache_clear()
    assert detect.subprocess_device_count() == -1
    detect.subprocess_device_count.cache_clear()


def test_detect_rocm_from_hip_build(monkeypatch, no_device_init):
    set_build(monkeypatch, hip="6.2.4", amdsmi=1)
    assert detect.detect_rocm() == detect.ROCM
    assert detect.detect_cuda() is None  # a HIP build is never "cuda"
    set_build(monkeypatch, hip="6.2.4", amdsmi=0)
    assert detect.detect_rocm() is None
    set_build(monkeypatch, hip="6.2.4", amdsmi=-1)  # no amdsmi: fall back to /dev/kfd
    monkeypatch.setattr(detect.os.path, "exists", lambda p: p == "/dev/kfd")
    assert detect.detect_rocm() == detect.ROCM
    set_build(monkeypatch, hip="6.2.4", amdsmi=-1, child=2)  # no amdsmi, no /dev/kfd: a child
    monkeypatch.setattr(detect.os.path, "exists", lambda p: False)
    assert detect.detect_rocm() == detect.ROCM


@pytest.mark.parametrize("attr, package, probe, path", [
    ("npu", "torch_npu", detect.detect_npu, detect.NPU),
    ("musa", "torch_musa", detect.detect_musa, detect.MUSA),
])
def test_privateuse1_vendor_detected_only_when_installed_and_available(
    monkeypatch, fake_installed, import_spy, device_module_factory, attr, package, probe, path
):
    assert probe() is None  # not installed: never imported
    assert package not in import_spy

    fake_installed.add(package)
    monkeypatch.setitem(sys.modules, package, ModuleType(package))
    monkeypatch.setattr(torch, attr, device_module_factory(attr, available=False), raising=False)
    assert probe() is None  # installed, no device
    monkeypatch.setattr(torch, attr, device_module_factory(attr, available=True))
    assert probe() == path
    assert import_spy.count(package) == 2


def test_broken_vendor_install_is_inactive_not_fatal(monkeypatch, fake_installed, caplog):
    fake_installed.add("torch_npu")  # found, but importing it fails (no CANN libraries)
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    assert detect.detect_npu() is None
    assert "torch_npu is installed but cannot be imported" in caplog.text


def test_detect_xpu_native(monkeypatch, device_module_factory):
    monkeypatch.setattr(torch, "xpu", device_module_factory("xpu", available=True))
    assert detect.detect_xpu() == detect.XPU
    monkeypatch.setattr(torch, "xpu", device_module_factory("xpu", available=False))
    assert detect.detect_xpu() is None


def test_ipex_is_optional_and_version_checked(monkeypatch, fake_installed, import_spy):
    monkeypatch.delitem(sys.modules, xpu.IPEX, raising=False)
    assert xpu.load_ipex() is False  # not installed: nothing imported
    assert xpu.IPEX not in import_spy

    fake_installed.add(xpu.IPEX)
    monkeypatch.setattr(xpu.importlib.metadata, "version", lambda dist: "2.3.110+xpu")
    monkeypatch.setattr(torch, "__version__", "2.8.0+xpu")
    assert xpu.load_ipex() is False  # built for another torch: refused before importing
    assert xpu.IPEX not in import_spy

    monkeypatch.setattr(torch, "__version__", "2.3.1+cxx11.abi")
    assert xpu.load_ipex() is False  # matching but import fails: logged, not raised
    assert xpu.IPEX in import_spy


def test_xpu_dist_backend_follows_torch_version():
    assert xpu._major_minor("2.13.0+cpu") == (2, 13)
    assert xpu.XpuPlatform.dist_backend == "xccl"  # torch 2.13 ships XCCL
