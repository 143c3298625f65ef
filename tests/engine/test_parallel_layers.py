"""The parallel layers in real gloo groups of 2 and 4 processes on loopback:
Ulysses and ring attention equal full attention, Ulysses refuses a head count
it cannot split, the CFG gather equals guidance computed in one process; the
banded decodes and Wan's video tokens split equal their one-process forms,
and tiny-wan-i2v's pipeline under CFG parallel (2 ranks) draws one rank's
frames."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest
import torch.multiprocessing as mp

HERE = Path(__file__).resolve().parent

pytestmark = pytest.mark.e2e


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, init_method: str) -> None:
    sys.path.insert(0, str(HERE))
    from parallel_checks import run_checks

    run_checks(rank, world, init_method)


@pytest.mark.parametrize("world", [2, 4])
def test_parallel_layers_match_their_single_process_reference(world, monkeypatch):
    from diffrt.engine.models.embedded import embedded_folder

    embedded_folder("tiny-wan-i2v")  # built here once, not by each rank at the same time
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    init = f"tcp://127.0.0.1:{_free_port()}"
    mp.start_processes(_rank_main, args=(world, init), nprocs=world, start_method="spawn",
                       join=True)
