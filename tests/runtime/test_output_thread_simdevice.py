"""The async output path on a simulated asynchronous device.

Forward's outputs are written by "kernels" that run late on the compute stream
and copies land late on the side stream, so an output thread that skips the
wait on the compute event, or reads before its own copy event completed,
delivers wrong bytes (checked: removing either wait makes these tests fail).
"""

from __future__ import annotations

import pytest
import torch
from runtime_helpers import config
from runtime_test_runners import MakeLate, make_tensor

simdevice = pytest.importorskip("diffrt_simdevice.platform",
                                reason="the diffrt-simdevice test plugin is not installed")


class NoEventSimDevice(simdevice.SimDevicePlatform):
    """A device backend without usable events: the runtime must copy synchronously."""

    name = "simdevice-noevents"

    def record_device_event(self, stream=None):
        return None


def _executor(platform, **kw):
    from diffrt.runtime.inproc_executor import InprocExecutor

    cfg = config(max_pending_output_bytes=8 << 20,
                 runner_cls="runtime_test_runners:LateKernelRunner", **kw)
    return InprocExecutor(cfg, platform=platform)


def _check(ex, seed: int, keys: list[str], dtype: str = "float32"):
    out = ex.execute(MakeLate(keys=keys, seed=seed, shape=[64, 64], dtype=dtype))
    for i, key in enumerate(keys):
        value = ex.wait_output_ready(out.output_ids[key]).result(timeout=30).take()
        expected = make_tensor(seed + i, [64, 64], dtype)
        assert torch.equal(value, expected), f"request seed {seed} key {key}: stale or partial bytes"
    return out


def test_async_copy_waits_for_compute_and_for_its_own_copy_event():
    ex = _executor(simdevice.SimDevicePlatform(copy_delay_s=0.03))
    try:
        for seed in range(4):  # distinct contents: a reused slot cannot hide a missing wait
            out = _check(ex, seed * 10, ["a", "b"], dtype=["float32", "bfloat16"][seed % 2])
            assert out.async_output_id is not None
    finally:
        ex.shutdown()


def test_back_to_back_requests_overlap_without_corruption():
    ex = _executor(simdevice.SimDevicePlatform(copy_delay_s=0.02))
    try:
        outs = [ex.execute(MakeLate(keys=["k"], seed=100 + s, kernel_s=0.01))
                for s in range(5)]
        for s, out in enumerate(outs):
            value = ex.wait_output_ready(out.output_ids["k"]).result(timeout=30).take()
            assert torch.equal(value, make_tensor(100 + s, [64, 64], "float32"))
    finally:
        ex.shutdown()


def test_without_events_the_copy_is_synchronous_and_correct():
    ex = _executor(NoEventSimDevice(copy_delay_s=0.03))
    try:
        for seed in range(3):
            out = _check(ex, 50 + seed, ["a"])
            assert out.async_output_id is None  # sync fallback on the worker's main thread
    finally:
        ex.shutdown()


def test_async_output_disabled_in_config_is_synchronous():
    ex = _executor(simdevice.SimDevicePlatform(copy_delay_s=0.01), async_output=False)
    try:
        out = _check(ex, 7, ["a"])
        assert out.async_output_id is None
    finally:
        ex.shutdown()


HOST_PATHS = {  # host path -> what the simulated device can do
    "page-locked": {},
    "staged": {"host_register": False},
    "pageable": {"host_register": False, "pinned": False},
}


@pytest.mark.parametrize("path", list(HOST_PATHS))
def test_every_host_path_delivers_the_right_bytes(path):
    """Registered arena, pinned staging, or pageable: the same bytes arrive. Only
    the pageable path makes copies that block their issuing thread (counted
    by the simulated device, which blocks them as CUDA does)."""
    sim = simdevice.SimDevicePlatform(copy_delay_s=0.01, **HOST_PATHS[path])
    ex = _executor(sim)
    try:
        for seed in range(3):
            out = _check(ex, 200 + seed * 10, ["a", "b"], dtype=["float32", "bfloat16"][seed % 2])
            assert out.async_output_id is not None
        assert ex.core.writer.host_path == path
        assert (sim.blocking_copies > 0) == (path == "pageable")
    finally:
        ex.shutdown()


def test_staged_copies_reuse_their_pinned_buffers():
    sim = simdevice.SimDevicePlatform(copy_delay_s=0.0, host_register=False)
    ex = _executor(sim)
    try:
        for seed in range(4):
            _check(ex, 300 + seed, ["a"])
        pool = ex.core.writer._staging.pool
        assert pool.allocations == 1 and pool.reuses == 3
    finally:
        ex.shutdown()
