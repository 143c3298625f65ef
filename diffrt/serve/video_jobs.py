"""One video job as the server keeps it: OpenAI's job object
(``openai.types.Video``: id, status, progress, the times, model, seconds,
size, prompt, remix source, error) and what only the server reads (who
made it, its files, when it was fetched, the request's settings for a
remix). A ``VideoJob`` is immutable: the store replaces it as the job moves
on, so a reader always holds one consistent state. It is what the store
writes beside the job's files (JSON, ``msgspec``), so a restarted server
reads the job back.

Ids are ``video_`` and 128 random bits (``secrets``): unguessable, and the
only name a job's files have on disk, so an id is checked (``is_job_id``)
before it comes near a path. The owner is a digest of the API key that made
the job (``owner_of``), never the key itself.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from typing import Any, Literal, get_args

import msgspec

#: OpenAI's job statuses
Status = Literal["queued", "in_progress", "completed", "failed"]
#: the statuses of a job still being made
UNFINISHED: tuple[Status, ...] = ("queued", "in_progress")
#: a job's files, by OpenAI's download ``variant`` (``video``: the MP4;
#: ``thumbnail``: the first frame as PNG; ``spritesheet``: frames on one image)
Variant = Literal["video", "thumbnail", "spritesheet"]
VARIANTS: tuple[Variant, ...] = get_args(Variant)
#: the most jobs one page of ``GET /v1/videos`` lists
MAX_PAGE = 100
_ID = re.compile(r"video_[0-9a-f]{32}")


class VideoError(msgspec.Struct, frozen=True):
    """Why a job failed (OpenAI's ``error``): a machine-readable ``code`` and a message."""

    code: str
    message: str


class VideoJob(msgspec.Struct, frozen=True, kw_only=True):
    """A video job: OpenAI's fields first, then the server's own."""

    id: str
    status: Status
    progress: int = 0
    created_at: int
    completed_at: int | None = None
    model: str
    seconds: str
    size: str
    prompt: str | None = None
    remixed_from_video_id: str | None = None
    error: VideoError | None = None
    # -- the server's own (never shown to a client) --
    #: the creating API key's digest (``owner_of``); None: made without a key
    owner: str | None = None
    #: creation order (nanoseconds, strictly increasing within a store): the list's order
    created_ns: int = 0
    #: when the job's files (or, failed, its record) go (Unix seconds); None: unfinished
    expires_s: float | None = None
    #: bytes held for the job while it runs (its estimated files)
    reserved_bytes: int = 0
    #: variant -> bytes of its file on disk
    files: dict[str, int] = msgspec.field(default_factory=dict)
    #: when the video was first downloaded (Unix seconds): from then on it may
    #: make room for a new job before it expires
    fetched_s: float | None = None
    #: the request's fields (a remix starts from them)
    settings: dict[str, Any] = msgspec.field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return self.status not in UNFINISHED

    def public(self) -> dict[str, Any]:
        """OpenAI's job object (what ``GET /v1/videos/{id}`` answers)."""
        return {"id": self.id, "object": "video", "status": self.status,
                "progress": self.progress, "created_at": self.created_at,
                "completed_at": self.completed_at,
                "expires_at": None if self.expires_s is None else int(self.expires_s),
                "model": self.model, "seconds": self.seconds, "size": self.size,
                "prompt": self.prompt, "remixed_from_video_id": self.remixed_from_video_id,
                "error": None if self.error is None else {"code": self.error.code,
                                                          "message": self.error.message}}


def new_job_id() -> str:
    return "video_" + secrets.token_hex(16)


def is_job_id(text: str) -> bool:
    """Whether ``text`` is an id this server makes (and so a safe file name)."""
    return _ID.fullmatch(text) is not None


def owner_of(api_key: str | None) -> str | None:
    """The owner recorded for a job made with ``api_key``: a SHA-256 digest
    (a record on disk never holds a key); None without a key."""
    if api_key is None:
        return None
    return hashlib.sha256(b"diffrt-video-owner:" + api_key.encode("utf-8")).hexdigest()[:32]


encode_job = msgspec.json.Encoder().encode
decode_job = msgspec.json.Decoder(VideoJob).decode

__all__ = ["MAX_PAGE", "UNFINISHED", "VARIANTS", "Status", "Variant", "VideoError", "VideoJob",
           "decode_job", "encode_job", "is_job_id", "new_job_id", "owner_of"]
