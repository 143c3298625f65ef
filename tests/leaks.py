"""Where an output arena lives, and whether a process does, for leak checks.

The arena is a memfd named "diffrt-output-arena" (diffrt/runtime/shm_transport.py):
it never appears in /dev/shm. A process holds it while it maps it (a
``memfd:diffrt-output-arena`` line in ``/proc/<pid>/maps``: the engine process and
the output rank worker) or keeps its descriptor open (a link to
``/memfd:diffrt-output-arena`` in ``/proc/<pid>/fd``); the kernel frees it when
the last of both is gone. Every test folder imports these as ``from leaks import
arena_mappings`` (pyproject puts tests/ on ``sys.path``).
"""

from __future__ import annotations

import os

ARENA_NAME = "diffrt-output-arena"
#: the requests' input images (diffrt/runtime/input_arena.py): mapped by every rank
INPUT_ARENA_NAME = "diffrt-input-arena"


def arena_mappings(pid: int, name: str = ARENA_NAME) -> int:
    """How many mappings of output arenas (or the arenas ``name`` names) process ``pid`` has.

    Returns:
        The count of ``memfd:diffrt-output-arena`` lines in its maps; 0 for a
        process that is gone (a dead process maps nothing).
    """
    try:
        with open(f"/proc/{pid}/maps") as f:
            return sum(f"memfd:{name}" in line for line in f)
    except (FileNotFoundError, ProcessLookupError):
        return 0


def arena_fds(pid: int, name: str = ARENA_NAME) -> int:
    """How many descriptors of output arenas process ``pid`` holds open (an
    arena's own fd and, while mapped, mmap's duplicate of it); 0 once it is gone."""
    fd_dir = f"/proc/{pid}/fd"
    try:
        fds = os.listdir(fd_dir)
    except (FileNotFoundError, ProcessLookupError):
        return 0
    count = 0
    for fd in fds:
        try:
            count += f"memfd:{name}" in os.readlink(f"{fd_dir}/{fd}")
        except OSError:  # closed since the listing (e.g. listdir's own descriptor)
            pass
    return count


def arena_refs(pid: int, name: str = ARENA_NAME) -> int:
    """Everything by which process ``pid`` keeps output arenas (or those
    ``name`` names) alive: mappings plus descriptors. A leak check compares
    this before and after."""
    return arena_mappings(pid, name) + arena_fds(pid, name)


def alive(pid: int) -> bool:
    """Process ``pid`` exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def fails_when_a_rank_dies(engine, kill, wait_until, after) -> None:
    """Run a long request on ``engine``, call ``kill()`` once it is inside its
    forward: the request must fail saying a worker died (a hang would end at
    the generous timeout, saying so), the engine turn unhealthy and refuse
    ``after`` (the caller closes it). The engine must have no
    ``max_request_seconds``: the long request's estimate follows the machine's
    momentary load and may pass any fixed limit on a busy machine."""
    import threading
    import time

    import pytest

    from diffrt.engine import DiffusionRequest, EngineDeadError, SamplingParams

    long = DiffusionRequest(prompt="a long one", sampling_params=SamplingParams(
        height=128, width=128, num_inference_steps=1000, seed=0))
    got: list = []
    runner = threading.Thread(target=lambda: got.append(engine.generate(long, timeout=300)))
    runner.start()
    assert wait_until(lambda: engine.scheduler.num_running == 1)
    time.sleep(0.3)  # inside the forward, between collectives
    kill()
    runner.join(300)
    assert got and not got[0].ok and "died" in got[0].error, got
    assert wait_until(lambda: not engine.is_healthy())
    with pytest.raises(EngineDeadError):
        engine.generate(after)
