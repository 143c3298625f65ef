"""Sizing the Ray Serve application to the cluster, and refusing one that
cannot be placed.

Ray Serve waits for ever, saying nothing, for a replica whose resources no
node has (two CPU replicas of 1 CPU each and the ingress's 0.5 on a 2-CPU
machine). So: on CPU the replicas default to an equal share of the node's
CPUs; what the application asks is checked against
``ray.cluster_resources()`` before anything is deployed, refused in one line
naming what is missing and what the cluster has; and what only placement
finds (resources spread over nodes, held by others) is caught by a watchdog
(``wait_until_placed``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

#: CPUs the ingress deployment reserves
INGRESS_CPUS = 0.5
#: the least a CPU replica reserves when the node's share is smaller
MIN_REPLICA_CPUS = 0.1


class PlacementError(Exception):
    """The application cannot be placed on this cluster (one line, for the CLI)."""


def cpu_share(node_cpus: float, replicas: int, ingress_cpus: float = INGRESS_CPUS) -> float:
    """Each CPU replica's equal share of the node: (CPUs - the ingress's) / replicas."""
    return max(MIN_REPLICA_CPUS, (node_cpus - ingress_cpus) / max(1, replicas))


def torch_threads_for(cpus: float, ranks: int = 1) -> int:
    """A CPU replica's torch threads per rank: max(1, floor(its CPUs / ranks))."""
    return max(1, math.floor(cpus / max(1, ranks)))


def demand(actor_options: dict[str, Any], count: int,
           ingress_cpus: float = INGRESS_CPUS) -> dict[str, float]:
    """The resources ``count`` replicas with ``actor_options`` and the ingress ask."""
    need: dict[str, float] = {"CPU": ingress_cpus}

    def add(name: str, amount: float) -> None:
        if amount:
            need[name] = need.get(name, 0.0) + amount * count

    add("CPU", actor_options.get("num_cpus", 1.0))
    add("GPU", actor_options.get("num_gpus", 0.0))
    for name, amount in (actor_options.get("resources") or {}).items():
        add(name, amount)
    return need


def check_fits(need: dict[str, float], cluster: dict[str, float], what: str) -> None:
    """PlacementError naming every resource ``need`` asks beyond ``cluster``."""
    short = [f"{name} {amount:g} (the cluster has {cluster.get(name, 0):g})"
             for name, amount in sorted(need.items())
             if amount > cluster.get(name, 0) + 1e-9]
    if short:
        have = ", ".join(f"{k} {v:g}" for k, v in sorted(cluster.items())
                         if not k.startswith(("node:", "memory", "object_store_memory")))
        raise PlacementError(f"{what} cannot be placed: it needs {'; '.join(short)}; "
                             f"the cluster has {have or 'nothing'}")


def wait_until_placed(status: Callable[[], tuple[str, str]], timeout_s: float, *,
                      poll_s: float = 0.5, clock: Callable[[], float] = time.monotonic,
                      sleep: Callable[[float], None] = time.sleep) -> None:
    """Wait for the application to run; ``status()`` gives (state, message)
    with state "RUNNING", "DEPLOY_FAILED" or anything else (still deploying).
    PlacementError when it failed, or is not running after ``timeout_s``
    (naming what Ray last said)."""
    deadline = clock() + timeout_s
    while True:
        state, message = status()
        if state == "RUNNING":
            return
        if state == "DEPLOY_FAILED":
            raise PlacementError(f"the application failed to deploy: {_one_line(message)}")
        if clock() >= deadline:
            raise PlacementError(f"the application was not placed within {timeout_s:g} s "
                                 f"(--placement-timeout): {_one_line(message) or state}")
        sleep(poll_s)


def _one_line(text: str) -> str:
    return " ".join(str(text or "").split())
