"""The engine's process dies by SIGKILL: its workers exit on their own within
seconds (taking the output arena, a memfd, with them) and no resource-tracker
warning appears."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from leaks import arena_mappings
from waiting import wait_until

RUNTIME_TESTS = Path(__file__).resolve().parents[1] / "runtime"

DRIVER = textwrap.dedent("""
    import json, sys, time
    from runtime_helpers import config
    from runtime_test_runners import Make
    from diffrt.runtime.factory import make_executor
    ex = make_executor("mp", config(world_size=int(sys.argv[2]), max_pending_output_bytes=1 << 20))
    out = ex.execute(Make(keys=["a"], shape=[64]))
    lease = ex.wait_output_ready(out.output_ids["a"]).result(timeout=60)  # held, never released
    print(json.dumps(ex.worker_pids), flush=True)
    if sys.argv[1] == "busy":
        ex.execute(Make(keys=["b"], sleep_s=60, started_path=sys.argv[3]))
    else:
        time.sleep(60)
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
    started = tmp_path / "started"
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(RUNTIME_TESTS), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, str(script), state, str(ranks), str(started)],
                            stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert line, proc.stderr.read()
        pids = json.loads(line)
        assert all(_alive(p) for p in pids)
        assert arena_mappings(proc.pid) and arena_mappings(pids[0])  # the output rank maps it
        if state == "busy":  # the workers are inside forward
            wait_until(started.exists, message="the busy request never started")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        wait_until(lambda: not any(_alive(p) for p in pids),
                   message=f"workers {pids} outlived their engine")
        stderr = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "resource_tracker" not in stderr and "leaked" not in stderr, stderr
    # Every process that mapped the arena is gone, so the kernel has freed it.
    assert not any(arena_mappings(p) for p in [proc.pid, *pids])
