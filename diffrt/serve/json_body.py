"""JSON bodies read with every key once: a key given twice is a 400 naming it.

``json.loads`` keeps the last of two equal keys, so ``{"prompt": "a",
"prompt": "b"}`` would be served with "b" while a proxy or a log that read
the first saw "a"; which one the client meant cannot be known, so the body
is refused, as a multipart body's field given twice is (``edit_body.py``).
``StrictJsonRoute`` is the route class of the routers whose bodies FastAPI
parses (their requests' ``json()`` is ``loads_unique``); the edit route,
which reads its own body, calls ``loads_unique`` itself.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine, Iterable
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute

from diffrt.serve.errors import ApiError, BodyRefused, field_name


class _Object(dict):
    """A JSON object that named ``twice`` more than once (None: every key once)."""

    twice: str | None = None


def loads_unique(data: bytes | str) -> Any:
    """``data`` parsed as JSON; ApiError 400 naming the first key an object
    gives twice (its path: ``loras.a``). Malformed JSON raises
    ``json.JSONDecodeError`` as ``json.loads`` does."""
    seen_twice = False

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        nonlocal seen_twice
        doc = _Object(items)
        if len(doc) < len(items):
            doc.twice = _repeated(items)
            seen_twice = True
        return doc

    doc = json.loads(data, object_pairs_hook=pairs)
    if seen_twice:
        path = _first_twice(doc, ())
        if path is not None:
            name = field_name(".".join(path))
            raise ApiError(400, f"{name}: given more than once", param=name,
                           code="invalid_value")
    return doc


def _repeated(items: list[tuple[str, Any]]) -> str:
    """The first key of ``items`` that an earlier pair holds already."""
    keys: set[str] = set()
    for key, _ in items:
        if key in keys:
            return key
        keys.add(key)
    raise AssertionError("no key repeats")  # the caller saw fewer keys than pairs


def _first_twice(value: Any, path: tuple[str, ...]) -> tuple[str, ...] | None:
    """The path of the first key given twice in ``value`` (outermost first)."""
    children: Iterable[tuple[str, Any]]
    if isinstance(value, _Object):
        if value.twice is not None:
            return (*path, value.twice)
        children = value.items()
    elif isinstance(value, list):
        children = ((str(i), v) for i, v in enumerate(value))
    else:
        return None
    for key, child in children:
        found = _first_twice(child, (*path, key))
        if found is not None:
            return found
    return None


class _UniqueKeysRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            try:
                self._json = loads_unique(await self.body())
            except ApiError as exc:  # FastAPI passes an HTTPException on, nothing else
                raise BodyRefused(exc) from None
        return self._json


class StrictJsonRoute(APIRoute):
    """A route whose JSON body may give each key once (``loads_unique``)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def strict_handler(request: Request) -> Response:
            return await handler(_UniqueKeysRequest(request.scope, request.receive))

        return strict_handler


__all__ = ["StrictJsonRoute", "loads_unique"]
