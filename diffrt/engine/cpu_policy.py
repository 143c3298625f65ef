"""How a CPU worker uses the machine: torch threads and the allocator's policy.

Both were measured on the 2-core CI machine with tiny-flux at 256x256
(``benchmarks/bench_vs_diffusers.py``; docs/engine.md has the figures):

- **Threads.** A worker takes every core its process may use (divided among
  the ranks). Leaving one to the engine process cost 30 - 45 % of serial
  throughput, and the engine process is idle while a forward runs. The
  oversubscription once seen with all cores (a tiny op taking milliseconds)
  came from a second OpenMP team in the worker — the output thread running
  torch copies, which made libgomp stop spinning at barriers — and the
  output thread no longer runs torch ops on CPU
  (``diffrt.runtime.shm_transport.copy_host``).
- **The allocator.** A diffusion forward allocates and frees activations of
  tens of MB per layer; glibc serves those from fresh ``mmap`` regions and
  gives them back at ``free``, so every request pays their page faults again
  (30 000 minor faults, about a quarter of a 256x256 request). The worker
  keeps freed memory for reuse instead (``MALLOC_MMAP_MAX_=0``, a large
  ``MALLOC_TRIM_THRESHOLD_``) — what a device's caching allocator does for
  device memory. The cost: the worker's resident size stays at its peak.
  A value the user set in the environment is left alone.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from diffrt.platforms.interface import Platform

#: glibc tunables of a CPU worker's environment (read when the process starts)
CPU_WORKER_MALLOC_ENV = {
    "MALLOC_MMAP_MAX_": "0",                   # big blocks from the heap, reusable
    "MALLOC_TRIM_THRESHOLD_": str(1 << 40),    # never give the heap back
}


def cpu_worker_threads(platform: Platform, world_size: int) -> int | None:
    """Default torch threads of a CPU worker: the cores this process may use,
    shared among the ranks. None (torch's default) off CPU."""
    if platform.device_type != "cpu":
        return None
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, world_size))


def cpu_worker_env(platform: Platform, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """Environment a CPU worker process starts with (empty off CPU): the
    allocator settings above, except those the user already set."""
    if platform.device_type != "cpu":
        return {}
    return {k: v for k, v in CPU_WORKER_MALLOC_ENV.items() if k not in environ}
