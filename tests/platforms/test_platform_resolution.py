"""Resolution: override → plugins → built-in probes → cpu, and its errors."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import EntryPoint
from types import ModuleType

import pytest
import torch

import diffrt.platforms as platforms
from diffrt.platforms import PlatformResolutionError, detect
from diffrt.platforms.cpu import CpuPlatform

FAKE_PLUGINS = "fake_diffrt_plugins"
FAKE_CLASS = "diffrt.platforms.cpu:CpuPlatform"  # any Platform class will do as a target


@pytest.fixture
def plugins(monkeypatch):
    """Install fake entry points: ``plugins["name"] = class path | None``."""
    mod = ModuleType(FAKE_PLUGINS)
    monkeypatch.setitem(sys.modules, FAKE_PLUGINS, mod)
    active: dict[str, str | None] = {}
    builtin = [
        EntryPoint(n, f"diffrt.platforms.detect:{f.__name__}", platforms.PLUGIN_GROUP)
        for n, f in detect.BUILTIN_PROBES.items()
    ]

    def fake_entry_points(group: str):
        assert group == platforms.PLUGIN_GROUP
        for name in active:
            setattr(mod, f"detect_{name}", lambda name=name: active[name])
        return builtin + [
            EntryPoint(n, f"{FAKE_PLUGINS}:detect_{n}", group) for n in active
        ]

    monkeypatch.setattr(platforms, "entry_points", fake_entry_points)
    return active


@pytest.fixture
def builtins(monkeypatch):
    """Make built-in probes report: ``builtins["cuda"] = True``."""
    state: dict[str, bool] = {}
    for name in detect.BUILTIN_PROBES:
        if name != "cpu":
            monkeypatch.setitem(
                detect.BUILTIN_PROBES, name,
                lambda name=name: detect.BUILTIN_CLASSES[name] if state.get(name) else None,
            )
    return state


def test_cpu_fallback_records_why(plugins, builtins):
    assert isinstance(platforms.current_platform, CpuPlatform)
    choice = platforms.platform_choice()
    assert (choice.name, choice.how) == ("cpu", "fallback")
    assert "no accelerator detected" in choice.reason
    assert platforms.current_platform is platforms.current_platform  # cached


def test_builtin_probe_chosen(plugins, builtins):
    builtins["xpu"] = True
    path, choice = platforms.resolve_platform()
    assert path == detect.XPU and (choice.name, choice.how) == ("xpu", "builtin")


def test_unavailable_builtin_not_selected(plugins, builtins):
    builtins["cuda"] = False
    assert platforms.resolve_platform()[1].name == "cpu"


def test_two_active_builtins_error_names_both(plugins, builtins):
    builtins["npu"] = builtins["musa"] = True
    with pytest.raises(PlatformResolutionError, match=r"built-in .*npu .*musa .*DIFFRT_PLATFORM"):
        platforms.resolve_platform()


def test_plugin_beats_builtin(plugins, builtins):
    builtins["cuda"] = True
    plugins["acme"] = FAKE_CLASS
    plugins["sleepy"] = None
    path, choice = platforms.resolve_platform()
    assert (path, choice.name, choice.how) == (FAKE_CLASS, "acme", "plugin")
    assert "entry point 'acme'" in choice.reason


def test_two_active_plugins_error_names_both(plugins, builtins):
    plugins["acme"] = FAKE_CLASS
    plugins["zeta"] = FAKE_CLASS
    with pytest.raises(PlatformResolutionError, match="plugin .*acme.*zeta"):
        _ = platforms.current_platform


def test_failing_plugin_probe_is_inactive(plugins, builtins, monkeypatch, caplog):
    plugins["broken"] = None
    monkeypatch.setattr(sys.modules[FAKE_PLUGINS], "detect_broken", None, raising=False)

    def fake_entry_points(group):
        return [EntryPoint("broken", "no_such_module_xyz:detect", group)]

    monkeypatch.setattr(platforms, "entry_points", fake_entry_points)
    assert platforms.resolve_platform()[1].name == "cpu"
    assert "platform probe 'broken' failed" in caplog.text


def test_override_beats_everything(plugins, builtins, monkeypatch):
    builtins["cuda"] = True
    plugins["acme"] = FAKE_CLASS
    monkeypatch.setenv("DIFFRT_PLATFORM", "CPU")
    path, choice = platforms.resolve_platform()
    assert (path, choice.how, choice.reason) == (detect.CPU, "override", "DIFFRT_PLATFORM=CPU")


def test_override_forces_a_builtin_even_if_its_probe_is_inactive(plugins, builtins, monkeypatch):
    monkeypatch.setattr(torch.version, "hip", "6.4.0", raising=False)  # a ROCm build
    monkeypatch.setenv("DIFFRT_PLATFORM", "rocm")
    assert platforms.resolve_platform()[0] == detect.ROCM


@pytest.mark.parametrize(("name", "needle"), [
    ("cuda", "needs a CUDA build of torch"), ("rocm", "needs a ROCm build of torch"),
    ("npu", r"pip install 'diffrt\[npu\]'"), ("musa", "torch_musa")])
def test_forcing_a_builtin_without_its_runtime_fails_at_once(plugins, builtins, monkeypatch,
                                                               name, needle):
    monkeypatch.setattr(torch.version, "cuda", None, raising=False)
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    for module in ("torch_npu", "torch_musa"):
        monkeypatch.delitem(sys.modules, module, raising=False)
    monkeypatch.setenv("DIFFRT_PLATFORM", name)
    with pytest.raises(PlatformResolutionError, match=needle) as info:
        platforms.resolve_platform()
    assert str(info.value).startswith(f"DIFFRT_PLATFORM={name}: ")
    assert "\n" not in str(info.value)


def test_a_vendor_package_present_satisfies_the_override(plugins, builtins, monkeypatch):
    import types

    monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))
    monkeypatch.setenv("DIFFRT_PLATFORM", "npu")
    assert platforms.resolve_platform()[0] == detect.NPU


def test_override_names_a_plugin(plugins, builtins, monkeypatch):
    plugins["acme"] = FAKE_CLASS
    monkeypatch.setenv("DIFFRT_PLATFORM", "acme")
    assert platforms.resolve_platform()[1].name == "acme"
    plugins["acme"] = None
    with pytest.raises(PlatformResolutionError, match="'acme' .* not active"):
        platforms.resolve_platform()


def test_unknown_override_lists_known_names(plugins, builtins, monkeypatch):
    plugins["acme"] = None
    monkeypatch.setenv("DIFFRT_PLATFORM", "tpu")
    with pytest.raises(PlatformResolutionError) as info:
        _ = platforms.current_platform
    message = str(info.value)
    assert "'tpu'" in message
    for name in ("acme", "cpu", "cuda", "musa", "npu", "rocm", "xpu"):
        assert name in message
    assert platforms.known_platform_names() == ["acme", "cpu", "cuda", "musa", "npu", "rocm", "xpu"]


@pytest.mark.parametrize("path, error", [
    ("nomodule", "malformed"),
    ("no_such_module_xyz.Thing", "cannot load"),
    ("diffrt.platforms.detect:detect_cpu", "not a diffrt Platform"),
])
def test_bad_class_paths(path, error):
    with pytest.raises(PlatformResolutionError, match=error):
        platforms.load_platform_class(path)


def test_class_path_forms():
    assert platforms.load_platform_class("diffrt.platforms.cpu.CpuPlatform") is CpuPlatform
    assert platforms.load_platform_class("diffrt.platforms.cpu:CpuPlatform") is CpuPlatform


def test_set_and_reset(plugins, builtins):
    class Custom(CpuPlatform):
        name = "custom"

    platforms.set_current_platform(Custom(), reason="test")
    assert platforms.current_platform.name == "custom"
    assert platforms.platform_choice().how == "explicit"
    platforms.reset_platform()
    assert platforms.current_platform.name == "cpu"


# -- the installed diffrt-simdevice distribution, through real entry points -----------
PROBE = """
import json, os, sys
from diffrt.platforms import current_platform, platform_choice, reset_platform

def seen():
    c = platform_choice()
    return [c.name, c.how, c.reason]

results = {"plugin": seen()}
os.environ["DIFFRT_PLATFORM"] = "cpu"
reset_platform()
results["override"] = seen()
del os.environ["DIFFRT_PLATFORM"], os.environ["DIFFRT_SIMDEVICE"]
reset_platform()
results["plain"] = seen()
vendors = ("torch_npu", "torch_musa", "intel_extension_for_pytorch")
results["vendors"] = [m for m in vendors if m in sys.modules]
print(json.dumps(results))
"""


def test_installed_plugin_selected_and_overridden():
    """A fresh process started with DIFFRT_SIMDEVICE=1: real entry-point loading."""
    import importlib.metadata
    import json

    names = {ep.name for ep in importlib.metadata.entry_points(group=platforms.PLUGIN_GROUP)}
    if "simdevice" not in names:
        pytest.fail("diffrt-simdevice is not installed: pip install ./tests/plugins/diffrt_simdevice")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DIFFRT_")}
    env["DIFFRT_SIMDEVICE"] = "1"
    proc = subprocess.run([sys.executable, "-c", PROBE], env=env, text=True,
                          capture_output=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert results["plugin"][:2] == ["simdevice", "plugin"]
    assert "diffrt_simdevice:detect" in results["plugin"][2]
    assert results["override"] == ["cpu", "override", "DIFFRT_PLATFORM=cpu"]
    assert results["plain"][:2] == ["cpu", "fallback"]
    assert results["vendors"] == []  # no vendor package was imported
