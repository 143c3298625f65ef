"""The LoRA adapters' routes: ``GET /v1/loras`` (the registered adapters),
``POST /v1/loras`` (register one), ``DELETE /v1/loras/{name}``; new factors
for one are ``PUT /v1/loras/{name}`` (``weight_routes.py``). The API key
of /v1 applies (``guards.py``); requests name adapters in their ``loras``
field (``routes.py`` passes it to the engine with the other sampling fields).

Registering makes the server read a file a client names, so it is off unless
the server was given a folder to read adapters from (``ServeSettings.lora_dir``,
``diffrt serve --lora-dir``): a path is accepted when its real path (symlinks
and ``..`` resolved) lies inside the folder's real path, and the engine is
handed that resolved path, so a symlink inside the folder cannot lead it
elsewhere. A relative path is taken inside the folder.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import msgspec
from fastapi import APIRouter, Request

from diffrt.engine import InvalidRequestError
from diffrt.engine.errors import EngineError
from diffrt.engine.lora.adapter_file import AdapterFileError
from diffrt.engine.lora.registry import LoraExistsError, LoraInfo
from diffrt.serve.error_mapping import engine_error
from diffrt.serve.errors import ApiError, echoed
from diffrt.serve.json_body import StrictJsonRoute
from diffrt.serve.protocol import ErrorResponse, LoraCard, LoraList, LoraRegistration

logger = logging.getLogger(__name__)

_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 403, 404, 409, 501, 503, 504)}

router = APIRouter(route_class=StrictJsonRoute)  # each JSON key once


def confined_path(path: str, lora_dir: str | None) -> str:
    """``path``'s real path when it lies inside ``lora_dir``'s; else the 403
    that says why (no folder: registration over HTTP is off)."""
    if lora_dir is None:
        raise ApiError(403, "registering LoRA adapters over HTTP is off on this server: "
                            "start it with --lora-dir DIR to allow adapters inside DIR "
                            "(or give them at start with --lora-modules NAME=PATH)",
                       param="path", code="lora_registration_disabled")
    return inside_folder(path, lora_dir, "--lora-dir")


def inside_folder(path: str, folder: str, flag: str) -> str:
    """``path``'s real path (a relative one taken inside ``folder``) when it
    and, for a folder, every file in it lie inside ``folder``'s real path;
    else 403 naming ``flag``, the server option that set the folder."""
    root = os.path.realpath(folder)
    try:
        real = os.path.realpath(os.path.join(root, path))
    except ValueError as exc:  # e.g. an embedded NUL
        raise ApiError(400, f"path: {exc}", param="path", code="invalid_value") from None
    inside = [real]
    if os.path.isdir(real):  # diffusers opens a file in it: each must stay inside too
        inside += [os.path.realpath(os.path.join(real, f)) for f in os.listdir(real)]
    if any(os.path.commonpath([root, p]) != root for p in inside):
        raise ApiError(403, f"path: {echoed(path)} is outside the server's {flag}, or a folder "
                            "with a link leading out of it (real paths, symlinks resolved, "
                            "must lie inside it)",
                       param="path", code=f"path_outside_{flag.strip('-').replace('-', '_')}")
    return real


def card(info: LoraInfo) -> LoraCard:
    return LoraCard(**msgspec.structs.asdict(info))


def check_changes_allowed(client: Any) -> None:
    """Run-time changes need one engine behind the server (``runtime_loras``)."""
    if not client.runtime_loras:
        raise ApiError(501, "adapters cannot be registered or removed at run time on "
                            "this server (each Ray Serve replica has an engine of its own); give "
                            "them at start with --lora-modules NAME=PATH",
                       code="not_implemented")


@router.get("/v1/loras", response_model=LoraList, responses=_ERRORS)
async def list_loras(request: Request) -> LoraList:
    """The registered LoRA adapters, by name."""
    infos = await request.app.state.client.list_loras()
    return LoraList(data=[card(info) for info in infos])


@router.post("/v1/loras", status_code=201, response_model=LoraCard, responses=_ERRORS)
async def add_lora(body: LoraRegistration, request: Request) -> LoraCard:
    """Register a LoRA adapter file (or folder) inside the server's
    ``--lora-dir`` under ``name``; answers once every worker has read it."""
    client = request.app.state.client
    check_changes_allowed(client)
    path = confined_path(body.path, request.app.state.settings.lora_dir)
    try:
        info = await client.add_lora(body.name, path)
    except LoraExistsError as exc:
        raise ApiError(409, str(exc), param="name", code="lora_exists") from None
    except AdapterFileError as exc:
        raise ApiError(400, str(exc), param="path", code="invalid_lora_file") from None
    except InvalidRequestError as exc:
        raise ApiError(400, str(exc), param=exc.field, code="invalid_value") from None
    except TimeoutError as exc:
        raise ApiError(504, str(exc), param="path", code="timeout") from None
    except EngineError as exc:
        raise engine_error(exc) from None
    return card(info)


@router.delete("/v1/loras/{name:path}", responses=_ERRORS)
async def remove_lora(name: str, request: Request) -> dict[str, Any]:
    """Unregister a LoRA adapter: new requests naming it are refused (400),
    those accepted with it are served."""
    client = request.app.state.client
    check_changes_allowed(client)
    try:
        await client.remove_lora(name)
    except KeyError:
        raise ApiError(404, f"no LoRA adapter named {echoed(name)}", param="name",
                       code="lora_not_found") from None
    except EngineError as exc:
        raise engine_error(exc) from None
    return {"name": name, "object": "lora", "deleted": True}
