"""The Ray ingress over the real ``StatsBoard`` rounds, in process: the
board's methods called as a Ray actor's (``board.method.remote(...)``) and
model replicas whose round threads are asyncio tasks over stand-in engines.
Shared by the weight updates' and the sleep's unit tests."""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import httpx

from diffrt.serve import ServeSettings, build_app
from diffrt.serve.ray_app import ReplicaClient, StatsBoard
from diffrt.serve.ray_weights import ReplicaWeights

T = TypeVar("T")


class Method:
    def __init__(self, fn):
        self.fn = fn

    async def remote(self, *args):
        got = self.fn(*args)
        return await got if inspect.isawaitable(got) else got


class LocalBoard:
    """The board as the ingress calls it (``board.method.remote(...)``), in process."""

    def __init__(self, board: StatsBoard):
        self.board = board

    def __getattr__(self, name):
        return Method(getattr(self.board, name))


class Stats:
    healthy = True


async def replica(board: StatsBoard, weights: ReplicaWeights) -> None:
    """``ReplicaWeights._watch`` without Ray: poll, handle, answer."""
    seen = 0
    while True:
        got = await board.next_round(weights.name, seen, 0.05)
        if got is not None:
            seen, task = got
            board.answer(weights.name, seen, weights.handle(task))


def with_ingress(engines: dict[str, Any], settings: ServeSettings,
                 steps: Callable[[httpx.AsyncClient, ReplicaClient, StatsBoard], Awaitable[T]],
                 silent: tuple[str, ...] = (), board: StatsBoard | None = None) -> T:
    """Run ``steps`` against an ingress app whose board heard from
    ``engines``' replicas (and the ``silent`` ones, which never answer)."""
    board = StatsBoard() if board is None else board
    names = [*engines, *silent]

    def stats(name: str) -> Any:
        engine = engines.get(name)
        return engine.stats() if hasattr(engine, "stats") else Stats()

    async def publish() -> None:
        # as a replica's statistics thread: every second, so the board never
        # counts a replica gone however long a loaded machine takes to build
        # the app or run the steps
        while True:
            for name in names:
                board.put(name, stats(name))
            await asyncio.sleep(1.0)

    for name in names:
        board.put(name, stats(name))

    async def main() -> T:
        replicas = [ReplicaWeights(name, None, engine, threading.Event())
                    for name, engine in engines.items()]
        tasks = [asyncio.create_task(replica(board, weights)) for weights in replicas]
        tasks.append(asyncio.create_task(publish()))
        client = ReplicaClient(None, LocalBoard(board), settings, "tiny-flux", True)
        app = build_app(settings=settings, client=client)
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                         base_url="http://testserver") as c:
                return await steps(c, client, board)
        finally:
            for task in tasks:
                task.cancel()
            for weights in replicas:
                weights.close()

    return asyncio.run(main())
