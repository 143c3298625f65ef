"""platform_report(): pure data for `diffrt env`."""

from __future__ import annotations

import sys

import pytest
import torch

import diffrt.platforms as platforms
from diffrt.platforms.interface import output_path
from diffrt.platforms.report import platform_report


def test_cpu_report():
    report = platform_report()
    assert report["platform"] == "cpu" and report["chosen_by"] == "fallback"
    assert "no accelerator" in report["reason"]
    assert report["versions"]["torch"] == torch.__version__
    assert report["capabilities"] == {
        "events": False, "side_streams": False, "pinned_memory": False,
        "async_output": True, "errors": {},
    }
    assert report["devices"]["count"] == 1
    assert not {"torch_npu", "torch_musa", "intel_extension_for_pytorch"} & set(sys.modules)


def test_report_of_an_async_platform():
    sim = pytest.importorskip("diffrt_simdevice.platform")
    platforms.set_current_platform(sim.SimDevicePlatform(copy_delay_s=0), reason="test")
    report = platform_report()
    assert report["platform"] == "simdevice" and report["chosen_by"] == "explicit"
    caps = report["capabilities"]
    assert caps["events"] and caps["side_streams"] and caps["async_output"]
    assert caps["pinned_memory"]  # simulated: registered ordinary memory


def test_report_names_failing_capabilities(device_module_factory, monkeypatch):
    from diffrt.platforms.cuda import CudaPlatform

    mod = device_module_factory("cuda")

    def no_streams():
        raise RuntimeError("driver says no")

    real_init = mod.Stream.__init__

    def init(self, device=None, priority=0, *, name="side"):  # only side streams fail
        if name == "side":
            no_streams()
        real_init(self, device, priority, name=name)

    mod.Stream.__init__ = init
    monkeypatch.setattr(torch, "cuda", mod)
    platforms.set_current_platform(CudaPlatform())
    caps = platform_report()["capabilities"]
    assert caps["events"] is True and caps["side_streams"] is False
    assert "driver says no" in caps["errors"]["side_streams"]


def test_the_output_path_each_platform_takes():
    """The report names the path a worker's output writer will take (the
    vendors' register calls are covered against fake runtimes in
    test_platform_backends.py)."""
    from diffrt_simdevice.platform import SimDevicePlatform

    from diffrt.platforms.cpu import CpuPlatform
    from diffrt.platforms.cuda import CudaPlatform
    from diffrt.platforms.report import platform_report

    assert platform_report()["output_path"] == "host"  # this machine: the CPU platform
    assert output_path(CpuPlatform()) == "host"
    # this CPU build of torch has no CUDA runtime binding and no pinned memory
    assert output_path(CudaPlatform()) == "pageable"
    assert output_path(SimDevicePlatform(copy_delay_s=0.0)) == "page-locked"
    assert output_path(SimDevicePlatform(copy_delay_s=0.0, host_register=False)) == "staged"
    assert output_path(SimDevicePlatform(copy_delay_s=0.0, host_register=False,
                                         pinned=False)) == "pageable"
