"""Helpers of the server tests (imported by name: ``from serve_helpers import ...``)."""

from __future__ import annotations

import asyncio
import json

import httpx

API_KEY = "test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def events(text: str) -> list[tuple[str, dict]]:
    """Server-sent events -> [(event, data)]."""
    out = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines())
        out.append((lines["event"], json.loads(lines["data"])))
    return out


def call(app, method: str, path: str, **kw) -> httpx.Response:
    """One request to ``app`` (headers default to the API key)."""
    async def main() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as c:
            kw.setdefault("headers", AUTH)
            return await c.request(method, path, **kw)

    return asyncio.run(main())
