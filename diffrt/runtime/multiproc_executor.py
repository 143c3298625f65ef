"""Multiprocess executor (the default): one spawned process per rank.

Processes are started with ``subprocess`` running ``diffrt.runtime.worker``
(no multiprocessing re-import of ``__main__``, no resource tracker) and get
plain pipes plus the output arena's memfd as inherited descriptors. Rank 0 is
the output rank. The pump thread waits on every rank's result pipe and on a
pidfd per process (the process sentinel): a dead worker fails every pending
future within one poll period and makes ``is_healthy()`` False.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, cast

from diffrt.runtime.input_arena import InputArena
from diffrt.runtime.messages import FreeSlots, Shutdown, encode
from diffrt.runtime.pumped_executor import PumpedExecutor, WorkerDied
from diffrt.runtime.types import ExecutorConfig

if TYPE_CHECKING:
    from diffrt.platforms.interface import Platform

logger = logging.getLogger(__name__)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_device_env(platform: Platform, rank: int, world_size: int,
                      environ: Mapping[str, str]) -> dict[str, str]:
    """Pin rank ``rank`` to one device through the vendor's visibility variable
    (e.g. CUDA_VISIBLE_DEVICES), so its compute stream and its output thread's
    side stream live on the same, right device (index 0 inside the worker).
    Which variable, and in which syntax, is the platform's to say
    (``Platform.rank_pinning_env``: ROCm's several variables, Intel's
    ``ONEAPI_DEVICE_SELECTOR`` under Ray)."""
    if world_size <= 1 or platform.device_type == "cpu":
        return {}
    pinning = getattr(platform, "rank_pinning_env", None)
    if pinning is not None:
        return pinning(rank, environ, platform.device_count)
    from diffrt.platforms.interface import pin_rank  # a duck-typed platform: its one variable

    var = getattr(platform, "device_control_env_var", None)
    return pin_rank((var,) if var else (), rank, environ, platform.device_count)


class _Proc:
    """One worker process and the parent's ends of its pipes."""

    def __init__(self, rank: int, popen: subprocess.Popen, requests: Connection,
                 results: Connection):
        self.rank = rank
        self.popen = popen
        self.requests = requests
        self.results = results
        self.results_open = True
        self.pidfd: int | None = None
        try:
            self.pidfd = os.pidfd_open(popen.pid)
        except (AttributeError, OSError):  # old kernel: EOF on the result pipe still tells
            self.pidfd = None

    def describe(self) -> str:
        code = self.popen.poll()
        state = "closed its result pipe" if code is None else (
            f"killed by signal {-code}" if code < 0 else f"exit code {code}")
        return f"worker rank {self.rank} (pid {self.popen.pid}) {state}"


class MultiprocExecutor(PumpedExecutor):
    def __init__(self, config: ExecutorConfig, inputs: InputArena | None = None):
        super().__init__(config, inputs)
        self._procs: list[_Proc] = []
        self._death: str | None = None
        self._platform: Platform | None = None
        if config.world_size > 1:
            from diffrt.platforms import current_platform

            self._platform = current_platform
        self._free_conn: Connection | None = None
        self._free_lock = threading.Lock()
        self.router = self._make_router(self._send_free)
        dist = f"tcp://127.0.0.1:{_free_port()}" if config.world_size > 1 else None
        self._launch(self._spawn_all, dist)

    def _spawn_all(self, init_messages: list[bytes]) -> None:
        for rank in range(self.config.world_size):
            self._spawn(rank)
        for proc, msg in zip(self._procs, init_messages, strict=True):
            proc.requests.send_bytes(msg)

    @property
    def worker_pids(self) -> list[int]:
        return [p.popen.pid for p in self._procs]

    def _spawn(self, rank: int) -> None:
        req_r, req_w = os.pipe()
        res_r, res_w = os.pipe()
        child_fds = [req_r, res_w]
        cmd = [sys.executable, "-m", "diffrt.runtime.worker", "--parent-pid", str(os.getpid()),
               "--request-fd", str(req_r), "--result-fd", str(res_w)]
        shared = {self.arena.fd}
        if self.inputs is not None:  # every rank prepares requests: every rank reads inputs
            child_fds.append(self.inputs.fd)
            cmd += ["--input-fd", str(self.inputs.fd)]
            shared.add(self.inputs.fd)
        free_w = None
        if rank == 0:
            free_r, free_w = os.pipe()
            child_fds += [free_r, self.arena.fd]
            cmd += ["--free-fd", str(free_r), "--arena-fd", str(self.arena.fd)]
        env = dict(os.environ)
        if self._platform is not None:
            env.update(worker_device_env(self._platform, rank, self.config.world_size, os.environ))
        env.update(self.config.worker_env)  # an explicit setting wins
        try:
            # Its own session: a Ctrl-C in the terminal reaches the engine only,
            # at any moment (even while the worker still imports torch), and the
            # engine stops its workers; they die with it in any case.
            popen = subprocess.Popen(cmd, pass_fds=child_fds, env=env, stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        finally:
            for fd in child_fds:
                if fd not in shared:
                    os.close(fd)
        self._procs.append(_Proc(rank, popen, Connection(req_w, readable=False),
                                 Connection(res_r, writable=False)))
        if free_w is not None:
            self._free_conn = Connection(free_w, readable=False)

    # -- PumpedExecutor hooks ---------------------------------------------------------------
    def _send_free(self, msg: FreeSlots) -> None:
        if self._free_conn is None:
            return
        data = encode(msg)
        with self._free_lock:
            self._free_conn.send_bytes(data)

    def _broadcast(self, data: bytes) -> None:
        for proc in self._procs:
            proc.requests.send_bytes(data)

    def _poll_results(self, timeout: float) -> list[bytes]:
        if self._death is not None:
            raise WorkerDied(self._death)
        conns = {p.results: p for p in self._procs if p.results_open}
        sentinels = {p.pidfd: p for p in self._procs if p.pidfd is not None}
        out: list[bytes] = []
        dead: _Proc | None = None
        # wait() hands back some of the objects it was given: pipes and pidfds
        ready = cast("list[Connection | int]", wait(list(conns) + list(sentinels), timeout))
        for obj in ready:
            proc = sentinels[obj] if isinstance(obj, int) else conns[obj]
            try:  # also drains what a dead worker managed to send
                while proc.results_open and proc.results.poll():
                    out.append(proc.results.recv_bytes())
            except (EOFError, OSError):
                proc.results_open = False
            if not proc.results_open or obj in sentinels:
                dead = proc
        if dead is not None and not self._stopping.is_set():
            try:
                dead.popen.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                pass
            # Raised on the next poll, after the messages read here were routed.
            self._death = f"{dead.describe()}; failing all pending work"
        return out

    def _workers_alive(self) -> bool:
        return all(p.popen.poll() is None for p in self._procs)

    def _kill_workers(self) -> bool:
        for proc in self._procs:
            if proc.popen.poll() is None:
                proc.popen.kill()  # SIGKILL: also ends a stopped (SIGSTOP) process
        return True

    def _stop_workers(self) -> None:
        for proc in self._procs:
            try:
                proc.requests.send_bytes(encode(Shutdown()))
            except OSError:
                pass
        # a worker still starting (importing torch, loading the model) reads no
        # request until it serves: asking it to stop would only wait
        self._escalate(self.config.shutdown_grace_s if self.started else 0.0)
        for proc in self._procs:
            for conn in (proc.requests, proc.results):
                conn.close()
            if proc.pidfd is not None:
                os.close(proc.pidfd)
                proc.pidfd = None
        if self._free_conn is not None:
            with self._free_lock:
                self._free_conn.close()
            self._free_conn = None

    def _escalate(self, grace: float) -> None:
        """Wait politely, then SIGTERM, then SIGKILL; never leaves a process behind."""
        for action, wait_s in (("ask", grace), ("terminate", 2.0), ("kill", 5.0)):
            alive = [p for p in self._procs if p.popen.poll() is None]
            if not alive:
                return
            if action != "ask":  # expected for workers stopped while starting
                logger.log(logging.WARNING if self.started else logging.INFO,
                           "%s %d worker(s) still running", action, len(alive))
            for p in alive:
                if action == "terminate":
                    p.popen.terminate()
                elif action == "kill":
                    p.popen.kill()
            for p in alive:
                try:
                    p.popen.wait(timeout=wait_s)
                except subprocess.TimeoutExpired:
                    pass


__all__ = ["MultiprocExecutor"]
