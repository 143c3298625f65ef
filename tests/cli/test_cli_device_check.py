"""`diffrt env --check`: the prepared device check, run small on this CPU.

Its figures mean something on an accelerator only; here the test proves the
check runs every part through the real paths (worker processes, both output
modes, both tiny models) and prints one JSON that says what it measured.
"""

from __future__ import annotations

import json


def test_the_quick_check_prints_one_json_with_every_part(cli, tmp_path):
    proc = cli("env", "--check", "--quick", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(proc.stdout)  # stdout is exactly one JSON object
    assert result["ok"] is True
    assert result["env"]["platform"] == "cpu" and result["env"]["output_path"] == "host"
    assert result["d2h"]["pageable"] > 0
    assert result["d2h"]["pinned"] is None  # no pinned memory on CPU: said, not faked
    assert result["d2h"]["registered_arena"] is None
    same = result["async_vs_sync"]
    assert same["requests"] == 4 and same["identical"] == 4 and same["mismatched_ids"] == []
    bubble = result["bubble"]
    assert bubble["widths"] == "tiny" and bubble["steps_per_request"] >= 1
    assert set(bubble["requests_per_s"]) == {"async", "sync", "no_output"}
    assert all(v > 0 for v in bubble["requests_per_s"].values())
    overhead = result["engine_overhead"]
    assert overhead["ms_per_request"]["engine"] > 0 and overhead["ms_per_request"]["bare"] > 0
    weights = result["weights"]
    assert weights["ok"] is True and weights["none"]["requests_per_s"] > 0
    assert weights["int8"]["weights_on_device_bytes"] < weights["none"]["weights_on_device_bytes"]
    assert weights["int8"]["psnr_min_db"] > 20
    assert "float8 matmuls" in weights["fp8"]["skipped"]  # refused here, with the reason
    for label in ("offload_layerwise", "offload_model"):
        assert "the host is the device" in weights[label]["skipped"]
    for part in ("env", "d2h", "async_vs_sync", "bubble", "engine_overhead", "weights"):
        assert "error" not in result[part], result[part]
    for part in ("host_register_error", "rank_devices"):  # a lent NVIDIA GPU only
        assert result[part]["skipped"] == "needs an NVIDIA GPU (platform cpu)"


def test_a_failing_part_fails_the_check_and_keeps_the_others(monkeypatch):
    """One part raising is reported in its entry; the rest still run; exit 1."""
    from diffrt.cli import device_check

    def broken(opts):
        raise RuntimeError("copy engine on fire")

    monkeypatch.setattr(device_check, "async_vs_sync", broken)
    monkeypatch.setattr(device_check, "bubble", lambda opts: {"stub": True})
    monkeypatch.setattr(device_check, "engine_overhead", lambda opts: {"stub": True})
    from diffrt.cli import weights_check

    monkeypatch.setattr(weights_check, "weights_part", lambda **kw: {"stub": True})
    result, ok = device_check.run_check(device_check.CheckOptions.quick())
    assert ok is False and result["ok"] is False
    assert result["async_vs_sync"]["error"] == "RuntimeError: copy engine on fire"
    assert result["bubble"]["stub"] and result["engine_overhead"]["stub"]
    assert result["d2h"]["pageable"] > 0
