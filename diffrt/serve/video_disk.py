"""The folder a video store keeps its jobs in (``--video-dir``): what lies
where, and how it is written so that a crash leaves either the old file or
the new one, never half of one.

Each job is ``<id>.json`` (its ``VideoJob``) beside its files
``<id>.<variant>.<ext>``; a file is written under a hidden temporary name
in the same folder, flushed to disk, then renamed over its final name (one
atomic step on POSIX). Only the server's own user may enter the folder
(mode 0700; one owned by another user is refused), and one server at a time
uses it: ``VideoDir`` holds an exclusive lock on ``.lock`` while open, so a
second server (or replica) pointed at the same folder is refused at start
instead of taking the first one's running jobs for a restart's leftovers.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import secrets
from collections.abc import Iterator
from pathlib import Path

from diffrt.engine.models.folder_check import cache_dir
from diffrt.serve.video_jobs import VideoJob, decode_job, encode_job, is_job_id

logger = logging.getLogger(__name__)

#: variant -> (file extension, media type)
FILE_KINDS = {"video": ("mp4", "video/mp4"), "thumbnail": ("png", "image/png"),
              "spritesheet": ("jpg", "image/jpeg")}
_TEMP_MARK = ".tmp-"
#: a name this store writes: a record or a file, or (group 2) its temporary name
_OWN_FILE = re.compile(r"\.?(video_[0-9a-f]{32})\.[a-z0-9.]+?(\.tmp-[0-9a-f]+)?")


def default_video_dir() -> str:
    """``--video-dir``'s default: ``videos`` in diffrt's cache folder
    (``$DIFFRT_CACHE_DIR``, else ``$XDG_CACHE_HOME/diffrt``, else ``~/.cache/diffrt``)."""
    return os.path.join(cache_dir(), "videos")


class DirInUse(RuntimeError):
    """Another store (this process or another) holds the folder."""


class VideoDir:
    """The files of a video store under ``path`` (made if missing)."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = self.path.stat()
        if info.st_uid != os.geteuid():
            raise PermissionError(f"--video-dir {str(self.path)!r}: owned by uid {info.st_uid}, "
                                  f"not this server's ({os.geteuid()}); give a folder of its own")
        os.chmod(self.path, 0o700)
        self._lock = os.open(self.path / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock)
            raise DirInUse(f"--video-dir {str(self.path)!r} is in use by another diffrt server; "
                           "give each server (each replica) a folder of its own") from None

    def close(self) -> None:
        if self._lock >= 0:
            os.close(self._lock)  # releases the lock
            self._lock = -1

    # -- names -----------------------------------------------------------------
    def record_path(self, job_id: str) -> Path:
        return self.path / f"{job_id}.json"

    def file_path(self, job_id: str, variant: str) -> Path:
        return self.path / f"{job_id}.{variant}.{FILE_KINDS[variant][0]}"

    # -- writing ---------------------------------------------------------------
    def write_atomic(self, target: Path, data: bytes) -> None:
        """``data`` at ``target``, whole or not at all (temp file, fsync, rename)."""
        temp = target.with_name(f".{target.name}{_TEMP_MARK}{secrets.token_hex(4)}")
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(temp, target)
        except BaseException:
            temp.unlink(missing_ok=True)
            raise

    def save(self, job: VideoJob) -> None:
        self.write_atomic(self.record_path(job.id), encode_job(job))

    def remove(self, job_id: str) -> None:
        """A job's record and files (those there are)."""
        for variant in FILE_KINDS:
            self.file_path(job_id, variant).unlink(missing_ok=True)
        self.record_path(job_id).unlink(missing_ok=True)

    # -- reading back (a restart) ----------------------------------------------
    def records(self) -> Iterator[VideoJob]:
        """Every readable job record; an unreadable one is logged and removed
        with its files (a record whose name is not its id's, or not JSON)."""
        for path in sorted(self.path.glob("video_*.json")):
            job_id = path.name[:-len(".json")]
            try:
                job = decode_job(path.read_bytes())
                if job.id != job_id or not is_job_id(job_id):
                    raise ValueError(f"the record names {job.id!r}")
            except (OSError, ValueError) as exc:
                logger.warning("video store: removing unreadable job record %s (%s)", path, exc)
                if is_job_id(job_id):
                    self.remove(job_id)
                else:
                    path.unlink(missing_ok=True)
                continue
            yield job

    def sweep(self, known: set[str]) -> int:
        """Remove what no job record claims: temporary files of writes a crash
        cut short, and files of jobs without a record. Only names this store
        makes are touched (anything else in the folder is left alone).
        Returns the count removed."""
        removed = 0
        for path in self.path.iterdir():
            match = _OWN_FILE.fullmatch(path.name)
            if match is None or path.name.endswith(".json") and not match.group(2):
                continue
            if match.group(2) or match.group(1) not in known:
                path.unlink(missing_ok=True)
                removed += 1
        if removed:
            logger.warning("video store: removed %d files no job claims (cut-short writes or "
                           "jobs without a record) from %s", removed, self.path)
        return removed

    def size_of(self, job_id: str, variant: str) -> int | None:
        try:
            return self.file_path(job_id, variant).stat().st_size
        except FileNotFoundError:
            return None


__all__ = ["FILE_KINDS", "DirInUse", "VideoDir", "default_video_dir"]
