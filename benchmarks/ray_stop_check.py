"""Stops of a real ``diffrt serve --replicas 2``, one after another, by SIGTERM.

Each run starts ``diffrt serve --replicas 2 --model tiny-flux --host 127.0.0.1``
on a free port (its own local Ray instance), waits for ``/ready``, answers
``--requests`` requests, sends SIGTERM (``--second-signal``: a second one
while it drains) and records the exit status; a Kubernetes or systemd stop
is that SIGTERM, and it must end with 0 every time. Prints one line per run
and the statuses together; exits 1 unless every run exited 0.

    .venv/bin/python benchmarks/ray_stop_check.py --runs 5
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> None:
    give_up = time.monotonic() + timeout
    while time.monotonic() < give_up:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited {proc.returncode} before it was ready")
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server was not ready within {timeout:g} s")


def one_stop(args: argparse.Namespace, run: int) -> tuple[int | None, float, str]:
    """(exit status, seconds from SIGTERM to exit, the server's output) of one run."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tempfile.NamedTemporaryFile("w+", prefix="diffrt-ray-stop-", suffix=".log",
                                      delete=False)
    command = [str(Path(sys.executable).parent / "diffrt"), "serve", "--replicas", "2",
               "--model", args.model, "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"}, text=True)
    try:
        try:
            serve_some(url, proc, args, run)
        except RuntimeError as exc:  # the run failed before its stop: say why, with the log
            print(f"run {run}: {exc}\n{Path(log.name).read_text()[-4000:]}", flush=True)
            return None, 0.0, Path(log.name).read_text()
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        if args.second_signal:
            time.sleep(args.second_signal)
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        try:
            status: int | None = proc.wait(args.stop_timeout)
        except subprocess.TimeoutExpired:
            status = None
        return status, time.monotonic() - sent, Path(log.name).read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        log.close()
        os.unlink(log.name)


def serve_some(url: str, proc: subprocess.Popen, args: argparse.Namespace,
                   run: int) -> None:
    """Wait for the server, then send it ``--requests`` requests one by one."""
    wait_ready(url, proc, args.ready_timeout)
    for i in range(args.requests):
        r = httpx.post(f"{url}/v1/images/generations", timeout=120, json={
            "prompt": f"a red fox {run}.{i}", "size": "64x64", "seed": i,
            "num_inference_steps": 2})
        if r.status_code != 200:
            raise RuntimeError(f"request {i}: {r.status_code} {r.text[:200]}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--model", default="tiny-flux")
    p.add_argument("--second-signal", type=float, default=0.0, metavar="S",
                   help="send a second SIGTERM S seconds after the first (0: none)")
    p.add_argument("--ready-timeout", type=float, default=300.0)
    p.add_argument("--stop-timeout", type=float, default=120.0)
    p.add_argument("--show-output", action="store_true",
                   help="print the server's output of runs that did not exit 0")
    args = p.parse_args()
    statuses = []
    for run in range(1, args.runs + 1):
        status, seconds, output = one_stop(args, run)
        statuses.append(status)
        print(f"run {run}: exit status {status} ({seconds:.1f} s after SIGTERM)", flush=True)
        if status != 0 and args.show_output:
            print(output[-4000:], flush=True)
    print(f"exit statuses: {statuses}")
    return 0 if all(s == 0 for s in statuses) else 1


if __name__ == "__main__":
    sys.exit(main())
