"""Every vendor backend against a fake torch.<vendor>: one stream/event family."""

from __future__ import annotations

import sys
from types import ModuleType

import pytest
import torch
from vendor_fakes import page_aligned_arena

from diffrt.platforms.cuda import CudaPlatform
from diffrt.platforms.interface import Platform
from diffrt.platforms.musa import MusaPlatform
from diffrt.platforms.npu import NpuPlatform
from diffrt.platforms.rocm import RocmPlatform
from diffrt.platforms.xpu import XpuPlatform

# (platform class, torch attribute it uses, vendor package that must be present)
BACKENDS = [
    (CudaPlatform, "cuda", None),
    (RocmPlatform, "cuda", None),
    (NpuPlatform, "npu", "torch_npu"),
    (XpuPlatform, "xpu", None),
    (MusaPlatform, "musa", "torch_musa"),
]


def _fake_accelerator(module):
    """A torch-accelerator platform whose device module is ``module`` (its
    ``module`` attribute: a test may swap it)."""
    from diffrt.platforms.accelerator import TorchAcceleratorPlatform

    class Fake(TorchAcceleratorPlatform):
        name = "fake"
        device_type = "fake"

        def device_module(self):
            return self.module

    platform = Fake()
    platform.module = module
    return platform


@pytest.fixture(params=BACKENDS, ids=lambda b: b[0].name)
def backend(request, monkeypatch, device_module_factory):
    cls, attr, package = request.param
    mod = device_module_factory(attr)
    monkeypatch.setattr(torch, attr, mod, raising=False)
    if package:
        monkeypatch.setitem(sys.modules, package, ModuleType(package))
    return cls(), mod


def test_identity_is_class_attributes(backend):
    platform, _ = backend
    cls = type(platform)
    assert cls.name in {"cuda", "rocm", "npu", "xpu", "musa"}
    assert cls.device_type in {"cuda", "npu", "xpu", "musa"}
    assert cls.dist_backend and cls.device_control_env_var
    assert cls.supports_async_output is True
    if cls.device_type in ("cuda", "xpu"):  # npu/musa exist once the vendor renames PrivateUse1
        assert platform.torch_device(1) == torch.device(cls.device_type, 1)


def test_device_facts_delegate_to_vendor_module(backend):
    platform, mod = backend
    assert platform.is_available() is True
    assert platform.device_count() == 2
    assert platform.device_name(1) == f"Fake {mod.__name__.split('_')[-1]} 1"
    assert platform.mem_get_info() == (1 << 20, 1 << 30)
    platform.synchronize()
    assert ("synchronize",) in mod.calls


def test_record_and_wait_use_one_family(backend):
    platform, mod = backend
    side = platform.new_side_stream()
    assert isinstance(side, mod.Stream)
    event = platform.record_device_event()
    assert isinstance(event, mod.Event)
    assert event.recorded_on == "default"
    platform.wait_event(side, event)
    assert ("wait_event", "side", event) in mod.calls

    on_side = platform.record_device_event(side)
    assert on_side.recorded_on == "side"
    assert platform.event_query(on_side) is False
    on_side.busy_queries = 4  # completes by itself, for backends that poll
    platform.event_synchronize(on_side)
    assert platform.event_query(on_side) is True


def test_foreign_families_are_refused(backend, device_module_factory):
    platform, _ = backend
    other = device_module_factory("other")
    side = platform.new_side_stream()
    with pytest.raises(TypeError, match="Event only"):
        platform.wait_event(side, other.Event())
    with pytest.raises(TypeError, match="Event only"):
        platform.wait_event(side, torch.Event("cpu"))  # the generic family
    with pytest.raises(TypeError, match="Stream only"):
        platform.record_device_event(other.Stream())
    with pytest.raises(TypeError, match="Stream only"):
        with platform.stream_context(other.Stream()):
            pass


def test_current_stream_is_cached_and_follows_stream_context(backend):
    platform, mod = backend
    first = platform.current_stream()
    assert platform.current_stream() is first
    assert platform.current_stream() is first
    assert sum(1 for c in mod.calls if c[0] == "current_stream") == 1

    side = platform.new_side_stream()
    with platform.stream_context(side):
        assert platform.current_stream() is side
        assert platform.record_device_event().recorded_on == "side"
    assert ("stream_enter", "side") in mod.calls  # the vendor's own context was entered too
    assert platform.current_stream() is first


def test_copy_async_runs_inside_the_given_stream(backend):
    platform, mod = backend
    side = platform.new_side_stream()
    dst, src = torch.zeros(3), torch.arange(3.0)
    platform.copy_async(dst, src, side)
    assert ("stream_enter", "side") in mod.calls
    assert torch.equal(dst, src)


def test_pinning_falls_back_to_pageable_memory(backend, caplog):
    platform, _ = backend
    assert platform.pinned_memory_available() is True
    # CPU torch refuses pin_memory=True: the platform degrades and says so once.
    buf = platform.empty_pinned((4, 2), torch.bfloat16)
    buf2 = platform.empty_pinned((1,), torch.uint8)
    assert buf.shape == (4, 2) and buf.dtype == torch.bfloat16 and not buf.is_pinned()
    assert buf2.numel() == 1
    assert sum("pinning host memory failed" in r.message for r in caplog.records) == 1


def test_unavailable_backend_reports_it(monkeypatch, device_module_factory):
    monkeypatch.setattr(torch, "cuda", device_module_factory("cuda", available=False))
    platform = CudaPlatform()
    assert platform.is_available() is False
    assert platform.device_count() == 0
    assert platform.pinned_memory_available() is False


def test_npu_imports_torch_npu_only_when_torch_npu_missing(monkeypatch, device_module_factory):
    imported: list[str] = []
    fake = device_module_factory("npu")

    def import_module(name: str, package: str | None = None):
        imported.append(name)
        monkeypatch.setattr(torch, "npu", fake, raising=False)  # what torch_npu does
        return ModuleType(name)

    monkeypatch.delattr(torch, "npu", raising=False)
    monkeypatch.setattr("importlib.import_module", import_module)
    assert NpuPlatform().device_module() is fake
    assert imported == ["torch_npu"]


def test_base_platform_names_missing_methods():
    class Bare(Platform):
        name = "bare"

    with pytest.raises(NotImplementedError, match="'bare' does not provide new_side_stream"):
        Bare().new_side_stream()
    assert Bare().record_device_event() is None  # "no usable events" → synchronous path


def test_current_stream_cache_is_per_thread(backend):
    import threading

    platform, mod = backend
    side = platform.new_side_stream()
    seen: list[object] = []
    with platform.stream_context(side):
        t = threading.Thread(target=lambda: seen.append(platform.current_stream()))
        t.start()
        t.join()
    assert seen[0] is not side and seen[0].name == "default"


def test_empty_cache_gives_the_device_cache_back_where_there_is_one():
    from types import SimpleNamespace

    from diffrt.platforms.cpu import CpuPlatform

    calls = []
    with_cache = SimpleNamespace(empty_cache=lambda: calls.append("empty"))

    platform = _fake_accelerator(with_cache)
    platform.empty_cache()
    assert calls == ["empty"]
    platform.module = SimpleNamespace()  # a backend without a cache: nothing to do
    platform.empty_cache()
    CpuPlatform().empty_cache()  # the base: nothing cached


# -- how each vendor waits for a copy ------------------------------------------------
SLEEPING_EVENTS = {"cuda", "rocm", "musa"}  # Event(blocking=True) sleeps on these


def test_host_waits_never_spin_on_the_vendor_event(backend):
    """CUDA-like backends create blocking-sync events and let them sleep; NPU
    and XPU (whose blocking flag does nothing) poll query() with sleeps
    instead of calling the spinning synchronize()."""
    platform, mod = backend
    event = platform.record_device_event()
    sleeps = platform.name in SLEEPING_EVENTS
    assert event.blocking is sleeps
    event.busy_queries = 5
    platform.event_synchronize(event)
    assert event.done
    synchronized = ("event_synchronize", event) in mod.calls
    assert synchronized is sleeps
    assert event.queries == (0 if sleeps else 6)


def test_only_xpu_also_synchronises_the_copy_stream(backend):
    """XPU's event once completed before a device-to-host copy landed: waiting
    for a copy there synchronises the side stream as well."""
    platform, mod = backend
    side = platform.new_side_stream()
    event = platform.record_device_event(side)
    event.busy_queries = 1
    platform.wait_copied(event, side)
    assert event.done
    assert (("stream_synchronize", "side") in mod.calls) is (platform.name == "xpu")


REGISTER_API = {  # platform -> (runtime binding, register, unregister, flags)
    "cuda": ("cudart", "cudaHostRegister", "cudaHostUnregister", 0),
    "rocm": ("cudart", "cudaHostRegister", "cudaHostUnregister", 0),
    "npu": ("npurt", "npuHostRegister", "npuHostUnregister", 2),
    "musa": ("musart", "musaHostRegister", "musaHostUnregister", 0),
}


def _fake_runtime(mod, binding, register, unregister, result=0):
    from types import SimpleNamespace

    calls = []

    def reg(ptr, nbytes, flags):
        calls.append(("register", ptr, nbytes, flags))
        return result

    def unreg(ptr):
        calls.append(("unregister", ptr))
        return 0

    runtime = SimpleNamespace(**{register: reg, unregister: unreg})
    setattr(mod, binding, lambda: runtime)
    return calls


def test_each_vendor_page_locks_through_its_runtime_binding(backend):
    from diffrt.platforms.interface import output_path

    platform, mod = backend
    mm, arena = page_aligned_arena(1 << 16)  # like the memfd arena (npu's MAPPED needs it)
    if platform.name == "xpu":  # torch.xpu has no host-register call
        assert platform.can_register_host_memory() is False
        assert platform.register_host_memory(arena) is None
        assert output_path(platform) == "staged"  # pinned buffers still exist
        return
    assert platform.can_register_host_memory() is False  # this vendor build lacks it
    assert output_path(platform) == "staged"
    binding, register, unregister, flags = REGISTER_API[platform.name]
    calls = _fake_runtime(mod, binding, register, unregister)
    assert platform.can_register_host_memory() is True
    assert output_path(platform) == "page-locked"
    handle = platform.register_host_memory(arena)
    assert calls == [("register", arena.data_ptr(), arena.numel(), flags)]
    platform.unregister_host_memory(handle)
    assert calls[-1] == ("unregister", arena.data_ptr())
    assert platform.register_host_memory(arena[::2]) is None  # not contiguous: never registered


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b[0].name in REGISTER_API],
                         ids=lambda b: b[0].name, indirect=True)
def test_a_failed_registration_is_the_unregistered_path(backend, caplog):
    platform, mod = backend
    binding, register, unregister, _ = REGISTER_API[platform.name]
    _fake_runtime(mod, binding, register, unregister, result=2)  # e.g. out of memory
    mm, arena = page_aligned_arena(4096)
    assert platform.register_host_memory(arena) is None
    assert any("page-locking 4096 bytes failed" in r.message for r in caplog.records)


def test_trim_memory_and_what_a_platform_holds():
    """An accelerator trims through its cache and reports the reservation of
    its selected device; a vendor module without ``memory_reserved`` cannot
    tell (None: never trimmed for size)."""
    from types import SimpleNamespace

    calls: list[object] = []

    platform = _fake_accelerator(SimpleNamespace(
        empty_cache=lambda: calls.append("empty"),
        memory_reserved=lambda i: calls.append(i) or 7 << 20, current_device=lambda: 0))
    platform._device_index = 3
    platform.trim_memory()
    assert platform.held_memory_bytes() == 7 << 20
    assert calls == ["empty", 3]
    platform.module = SimpleNamespace(current_device=lambda: 0)
    assert platform.held_memory_bytes() is None


def test_an_accelerator_measures_peaks_and_free_memory_on_its_selected_device():
    """The peak is the allocator's peak reservation since the reset; free is
    the device's free memory plus what the allocator holds unused. A module
    without the calls cannot tell."""
    from types import SimpleNamespace

    calls: list[object] = []
    platform = _fake_accelerator(SimpleNamespace(
        reset_peak_memory_stats=lambda i: calls.append(("reset", i)),
        max_memory_reserved=lambda i: 9 << 20, mem_get_info=lambda i: (100 << 20, 800 << 20),
        memory_reserved=lambda i: 30 << 20, memory_allocated=lambda i: 20 << 20,
        current_device=lambda: 0))
    platform._device_index = 2
    platform.reset_peak_memory()
    assert calls == [("reset", 2)]
    assert platform.peak_memory_bytes() == 9 << 20
    assert platform.free_memory_bytes() == 110 << 20
    platform.module = SimpleNamespace(current_device=lambda: 0, mem_get_info=lambda i: (1, 2))
    platform.reset_peak_memory()  # nothing to reset: no error
    assert platform.peak_memory_bytes() is None and platform.free_memory_bytes() is None


def test_the_cpu_platform_reads_its_resident_peak(tmp_path):
    from diffrt.platforms.cpu import peak_resident_bytes, reset_peak_resident

    status = tmp_path / "status"
    status.write_text("Name:\tpython\nVmHWM:\t  4096 kB\nVmRSS:\t  2048 kB\n")
    assert peak_resident_bytes(str(status)) == 4096 * 1024
    assert peak_resident_bytes(str(tmp_path / "none")) is None
    reset_peak_resident(str(tmp_path / "no-dir" / "clear_refs"))  # cannot: nothing raised


def test_the_cpu_platform_trims_the_c_heap_and_reads_its_resident_set(tmp_path):
    import os

    from diffrt.platforms.cpu import CpuPlatform, libc_malloc_trim, resident_bytes

    if os.path.exists("/proc/self/statm"):
        assert CpuPlatform().held_memory_bytes() > 10 << 20  # torch alone is more
    statm = tmp_path / "statm"
    statm.write_text("1000 250 10 1 0 200 0\n")
    assert resident_bytes(str(statm)) == 250 * os.sysconf("SC_PAGE_SIZE")
    assert resident_bytes(str(tmp_path / "none")) is None  # not Linux: cannot tell
    if libc_malloc_trim() is not None:  # glibc
        CpuPlatform().trim_memory()


def test_cuda_offers_flash_attentions_varlen_for_half_types(monkeypatch, device_module_factory):
    """``flash_attn_varlen_func`` with the same offsets for queries and keys,
    not causal, on a device its kernel accepts (an A100 here, in a worker
    whose context exists); None for float32 (no such kernel) and without
    the package."""
    import sys

    import torch
    from vendor_fakes import cuda_device, flash_attn_module

    from diffrt.platforms import cuda

    fake = flash_attn_module("2.8.3")
    monkeypatch.setitem(sys.modules, "flash_attn", fake)
    monkeypatch.setattr(torch, "cuda", cuda_device(device_module_factory("cuda"), 8, 0,
                                                    initialized=True))
    cuda._flash_attn.cache_clear()
    try:
        platform = cuda.CudaPlatform()
        assert platform.varlen_attention(torch.float32) is None
        attend = platform.varlen_attention(torch.bfloat16)
        starts = torch.tensor([0, 3, 5], dtype=torch.int32)
        assert attend("q", "k", "v", starts, 3) == "q"
        assert fake.calls == [(3, 3, False)]
        monkeypatch.setitem(sys.modules, "flash_attn", None)  # not installed
        cuda._flash_attn.cache_clear()
        assert platform.varlen_attention(torch.float16) is None
    finally:
        cuda._flash_attn.cache_clear()
