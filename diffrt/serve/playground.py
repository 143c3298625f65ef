"""``GET /``: the playground page (one static HTML file shipped in the package,
no build step, no CDN). It talks to the same public API as any client."""

from __future__ import annotations

from functools import lru_cache
from importlib import resources

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

router = APIRouter()


@lru_cache(maxsize=1)
def page() -> str:
    return resources.files(__package__).joinpath("static/playground.html").read_text("utf-8")


@router.get("/", response_class=HTMLResponse, include_in_schema=False)
async def playground() -> HTMLResponse:
    return HTMLResponse(page())
