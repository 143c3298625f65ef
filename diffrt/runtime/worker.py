"""Entry point of a spawned worker process: ``python -m diffrt.runtime.worker``.

The executor passes inherited descriptors: the request pipe (read), the
result pipe (write), and on the output rank the free pipe (read) and the
output arena's memfd. The first request is ``InitWorker``; then the busy loop
handles ``Rpc`` until ``Shutdown``. The worker exits within a second or so if
its parent dies, even by SIGKILL: EOF on the request pipe ends the busy loop,
and a thread watching the parent pid covers a main thread busy in forward.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

PARENT_POLL_S = 0.5
logger = logging.getLogger("diffrt.runtime.worker")


def _die_with_parent(parent_pid: int) -> None:
    # A thread, not PR_SET_PDEATHSIG: that signal fires when the *thread* that
    # spawned us exits, which would kill workers of an executor built off-main.
    if os.getppid() != parent_pid:
        os._exit(1)

    def watch() -> None:
        while True:
            time.sleep(PARENT_POLL_S)
            if os.getppid() != parent_pid:
                os._exit(1)  # orphaned: no cleanup can matter, memfds go with us

    threading.Thread(target=watch, name="diffrt-parent-watch", daemon=True).start()


def _free_source(conn: Connection | None):
    from diffrt.runtime.messages import free_decoder

    def source(timeout: float) -> Any:
        try:
            if conn is None or not conn.poll(timeout):
                return None
            return free_decoder.decode(conn.recv_bytes())
        except (EOFError, OSError):
            return None
    return source


#: A worker's logging without ``DIFFRT_LOG_LEVEL``: warnings, plus the
#: progress of loading a model (minutes for a large checkpoint).
DEFAULT_LOG_SPEC = "WARNING,diffrt.load=INFO"


def configure_logging(spec: str) -> None:
    """``DIFFRT_LOG_LEVEL``: comma-separated parts, each a root level (``INFO``)
    or a ``logger=LEVEL`` pair (``diffrt.load=INFO``); the root defaults to WARNING."""
    from diffrt import log_filters

    log_filters.install()  # no prompt text in the logs (diffusers' truncation warnings)
    parts = [part.strip() for part in spec.split(",") if part.strip()]
    roots = [p for p in parts if "=" not in p]
    logging.basicConfig(level=(roots[-1] if roots else "WARNING").upper(),
                        format=f"[worker pid {os.getpid()}] %(levelname)s %(name)s: %(message)s")
    for pair in parts:
        if "=" in pair:
            name, _, level = pair.partition("=")
            logging.getLogger(name.strip()).setLevel(level.strip().upper() or "INFO")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--parent-pid", type=int, required=True)
    ap.add_argument("--request-fd", type=int, required=True)
    ap.add_argument("--result-fd", type=int, required=True)
    ap.add_argument("--free-fd", type=int, default=-1)
    ap.add_argument("--arena-fd", type=int, default=-1)
    ap.add_argument("--input-fd", type=int, default=-1)
    args = ap.parse_args(argv)
    # Ctrl-C in a terminal reaches the whole process group. The engine owns the
    # shutdown (it asks, then terminates); a worker dying on its own SIGINT
    # would only turn a clean stop into "executor died" errors.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent(args.parent_pid)
    configure_logging(os.environ.get("DIFFRT_LOG_LEVEL", DEFAULT_LOG_SPEC))

    from diffrt.runtime.messages import InitWorker, encode
    from diffrt.runtime.shm_transport import Arena
    from diffrt.runtime.worker_core import WorkerCore, build_core, leave_process_group, serve

    requests = Connection(args.request_fd, writable=False)
    results = Connection(args.result_fd, readable=False)
    frees = Connection(args.free_fd, writable=False) if args.free_fd >= 0 else None
    send_lock = threading.Lock()  # the main thread and the output thread share the pipe
    world_size = 1

    def send(msg: Any) -> None:
        data = encode(msg)
        with send_lock:
            results.send_bytes(data)

    def recv() -> bytes | None:
        try:
            return requests.recv_bytes()
        except EOFError:  # the executor is gone
            return None

    def build(init: InitWorker) -> WorkerCore:
        nonlocal world_size
        world_size = init.world_size
        arena = Arena.attach(args.arena_fd, init.arena_bytes) if args.arena_fd >= 0 else None
        inputs = (Arena.attach(args.input_fd, init.input_arena_bytes)
                  if args.input_fd >= 0 and init.input_arena_bytes else None)
        return build_core(init, send, arena, _free_source(frees), inputs)

    try:
        if not serve(recv, send, build):
            return 1
    finally:
        if world_size > 1:
            leave_process_group()
    return 0


if __name__ == "__main__":
    try:
        code = main()
    except BaseException:
        logger.exception("worker failed")
        code = 1
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown of torch threads
