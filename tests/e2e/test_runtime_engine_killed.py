"""The engine's process dies by SIGKILL: its workers exit on their own within
seconds, nothing is left in /dev/shm and no resource-tracker warning appears."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

RUNTIME_TESTS = Path(__file__).resolve().parents[1] / "runtime"

DRIVER = textwrap.dedent("""
    import json, sys
    from diffrt.runtime import ExecutorConfig, make_executor
    ex = make_executor("mp", ExecutorConfig(
        runner_cls="runtime_test_runners:EchoRunner", world_size=int(sys.argv[2]),
        max_pending_output_bytes=1 << 20, startup_timeout_s=120))
    out = ex.execute("make", {"keys": ["a"], "shape": [64]})
    lease = ex.wait_output_ready(out.output_ids["a"]).result(timeout=60)  # held, never released
    print(json.dumps(ex.worker_pids), flush=True)
    if sys.argv[1] == "busy":
        ex.execute("sleep_then_make", {"sleep_s": 60, "keys": ["b"]})
    else:
        import time; time.sleep(60)
""")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("state,ranks", [("busy", 2), ("idle", 1)])
def test_workers_exit_and_nothing_leaks_when_the_engine_is_sigkilled(tmp_path, state, ranks):
    shm_before = set(os.listdir("/dev/shm"))
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(RUNTIME_TESTS), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, str(script), state, str(ranks)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert line, proc.stderr.read()
        pids = json.loads(line)
        assert all(_alive(p) for p in pids)
        time.sleep(0.3)  # the workers are now inside forward (busy) or waiting (idle)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_alive(p) for p in pids), f"workers {pids} outlived their engine"
        stderr = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "resource_tracker" not in stderr and "leaked" not in stderr, stderr
    assert set(os.listdir("/dev/shm")) == shm_before
