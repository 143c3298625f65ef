"""The jobs behind ``/v1/videos``: each lives here, apart from the
connection that asked for it, so a client that leaves after ``create``
loses nothing, and on disk (``VideoDir``), so a restarted server lists its
finished videos again.

Bounds: ``max_bytes`` (``--video-store-bytes``) over everything the jobs
hold (each job's record counts ``RECORD_BYTES``; a running job the bytes
reserved for its files at creation, a finished one its files' real sizes)
and ``ttl_s`` (``--video-ttl-s``): a finished job (its files, or its
failure) is kept that long. A job that does not fit is refused at creation
(``StoreFull``, which the routes answer 429 with Retry-After); a finished
video nobody fetched is never evicted before it expires. One already
downloaded may be: to make room, videos fetched longest ago go first.
Retry-After is the time until expiries alone free enough room; when running
jobs hold it instead (their files will need it), it is the TTL, the longest
those may keep it once finished unless fetched sooner.

A job is seen only with the owner it was made with (``owner_of`` the API
key; the routes pass None to everyone when the server has one key or none):
to another owner it does not exist. Pages are OpenAI's cursor lists
(``after``: the last id of the previous page; ``order`` by creation).

A restart (a new store over the same folder): finished jobs within their
TTL are back; a job that was queued or running is reported ``failed`` with
code ``server_restarted`` (its work is gone with the old process); a
completed job whose video file is missing is ``failed`` with
``video_file_missing``; expired ones are removed. Thread-safe: the routes
call it from the event loop, the encoder from its threads.
"""

from __future__ import annotations

import heapq
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import IO, Any, Literal

import msgspec

from diffrt.serve.images import StoreFull
from diffrt.serve.video_disk import FILE_KINDS, VideoDir
from diffrt.serve.video_jobs import MAX_PAGE, VideoError, VideoJob, is_job_id, new_job_id

logger = logging.getLogger(__name__)

#: what each job's record is counted as (its JSON and the folder's entry)
RECORD_BYTES = 4096


class VideoPage(msgspec.Struct, frozen=True):
    """One page of a listing."""

    jobs: list[VideoJob]
    has_more: bool

    def public(self) -> dict[str, Any]:
        """OpenAI's list object."""
        return {"object": "list", "data": [job.public() for job in self.jobs],
                "first_id": self.jobs[0].id if self.jobs else None,
                "last_id": self.jobs[-1].id if self.jobs else None,
                "has_more": self.has_more}


class VideoStore:
    """Video jobs in ``directory``, within ``max_bytes`` and ``ttl_s``."""

    def __init__(self, directory: str | os.PathLike[str], *, max_bytes: int, ttl_s: float,
                 clock: Callable[[], float] = time.time):
        self.max_bytes, self.ttl_s = max_bytes, ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._dir = VideoDir(directory)
        self._jobs: dict[str, VideoJob] = {}
        self._expiry: list[tuple[float, str]] = []  # (expires_s, id): a heap
        self._last_ns = 0
        self._bytes = 0
        self._reload()

    @property
    def directory(self) -> str:
        return str(self._dir.path)

    def close(self) -> None:
        """Let the folder go (another store may open it); the jobs stay on disk."""
        self._dir.close()

    # -- a job's life ------------------------------------------------------------
    def create(self, *, model: str, seconds: str, size: str, prompt: str | None,
               owner: str | None, reserve_bytes: int, settings: Mapping[str, Any] | None = None,
               remixed_from: str | None = None) -> VideoJob:
        """A queued job holding ``reserve_bytes`` for its files (an estimate
        at least their size). ``ValueError`` when it would not fit even an
        empty store, ``StoreFull`` while others hold the room."""
        if reserve_bytes < 0:
            raise ValueError(f"reserve_bytes must be >= 0, got {reserve_bytes}")
        need = RECORD_BYTES + reserve_bytes
        if need > self.max_bytes:
            raise ValueError(f"a video of about {reserve_bytes} bytes does not fit in the video "
                             f"store (--video-store-bytes {self.max_bytes}); ask for fewer "
                             "frames or a smaller size")
        with self._lock:
            now = self._clock()
            self._expire_locked(now)
            self._evict_fetched_locked(need)
            if self._bytes + need > self.max_bytes:
                raise self._full_locked(need, now)
            job = VideoJob(id=new_job_id(), status="queued", created_at=int(now), model=model,
                           seconds=seconds, size=size, prompt=prompt,
                           remixed_from_video_id=remixed_from, owner=owner,
                           created_ns=self._next_ns(), reserved_bytes=reserve_bytes,
                           settings=dict(settings or {}))
            self._dir.save(job)
            self._put_locked(job)
        return job

    def start(self, job_id: str) -> VideoJob | None:
        """The job is running (None: it was deleted)."""
        return self._update(job_id, lambda job: msgspec.structs.replace(
            job, status="in_progress"), persist=True)

    def set_progress(self, job_id: str, progress: float) -> VideoJob | None:
        """Progress 0-100 (kept in memory: a restart fails the job anyway)."""
        value = max(0, min(99, int(progress)))
        return self._update(job_id, lambda job: msgspec.structs.replace(
            job, progress=max(job.progress, value)), persist=False)

    def complete(self, job_id: str, files: Mapping[str, bytes]) -> VideoJob | None:
        """Write the job's files (``variant -> bytes``; ``video`` required)
        and mark it completed, expiring ``ttl_s`` from now. None (and the
        files removed) when the job was deleted meanwhile. Files larger than
        the job's reservation are kept all the same (a finished video is
        never thrown away): the excess holds off later jobs until it frees."""
        if "video" not in files or not set(files) <= set(FILE_KINDS):
            raise ValueError(f"files must hold 'video' and only {sorted(FILE_KINDS)}, "
                             f"got {sorted(files)}")
        with self._lock:
            if self._unfinished_locked(job_id) is None:
                return None
        for variant, data in files.items():  # outside the lock: a large write blocks nobody
            self._dir.write_atomic(self._dir.file_path(job_id, variant), data)
        now = self._clock()
        sizes = {variant: len(data) for variant, data in files.items()}
        done = self._update(job_id, lambda job: msgspec.structs.replace(
            job, status="completed", progress=100, completed_at=int(now),
            expires_s=now + self.ttl_s, reserved_bytes=0, files=sizes), persist=True)
        if done is None:  # deleted while its files were written
            self._dir.remove(job_id)
        return done

    def fail(self, job_id: str, code: str, message: str) -> VideoJob | None:
        """The job failed: its reservation goes, its record stays ``ttl_s``."""
        now = self._clock()
        return self._update(job_id, lambda job: msgspec.structs.replace(
            job, status="failed", completed_at=int(now), expires_s=now + self.ttl_s,
            reserved_bytes=0, error=VideoError(code, message)), persist=True)

    def delete(self, job_id: str, owner: str | None) -> VideoJob | None:
        """Remove a job, its record and files; the job as it was (the routes
        abort it in the engine when it was unfinished), or None: no such job."""
        with self._lock:
            job = self._owned_locked(job_id, owner)
            if job is None:
                return None
            self._drop_locked(job)
        return job

    # -- reading ------------------------------------------------------------------
    def get(self, job_id: str, owner: str | None) -> VideoJob | None:
        with self._lock:
            return self._owned_locked(job_id, owner)

    def open_file(self, job_id: str, owner: str | None,
                  variant: str) -> tuple[IO[bytes], int, str] | None:
        """A completed job's file, opened (the caller closes it; an eviction
        or expiry after this does not cut the read short), its size and media
        type; None: no such job or file, or not completed. Fetching the video
        marks it fetched (from then on it may make room before it expires)."""
        with self._lock:
            job = self._owned_locked(job_id, owner)
            if job is None or job.status != "completed" or variant not in job.files:
                return None
            try:
                handle = open(self._dir.file_path(job_id, variant), "rb")
            except FileNotFoundError:  # removed behind the server's back
                logger.warning("video store: %s's %s file is gone from %s", job_id, variant,
                               self._dir.path)
                return None
            if variant == "video" and job.fetched_s is None:
                fetched = msgspec.structs.replace(job, fetched_s=self._clock())
                self._jobs[job_id] = fetched
                self._dir.save(fetched)
        return handle, job.files[variant], FILE_KINDS[variant][1]

    def list(self, owner: str | None, *, after: str | None = None, limit: int = 20,
             order: Literal["asc", "desc"] = "desc") -> VideoPage:
        """``owner``'s jobs by creation (``desc``: newest first), ``limit`` of
        them after the job ``after``; KeyError when ``after`` is not one of them."""
        if not 1 <= limit <= MAX_PAGE:
            raise ValueError(f"limit: must be 1-{MAX_PAGE}, got {limit}")
        with self._lock:
            self._expire_locked(self._clock())
            jobs = sorted((j for j in self._jobs.values() if j.owner == owner),
                          key=lambda j: j.created_ns, reverse=order == "desc")
        start = 0
        if after is not None:
            ids = [job.id for job in jobs]
            if after not in ids:
                raise KeyError(after)
            start = ids.index(after) + 1
        return VideoPage(jobs[start:start + limit], start + limit < len(jobs))

    def usage(self) -> dict[str, float]:
        """What /metrics shows: bytes held, jobs by status, the bounds."""
        with self._lock:
            self._expire_locked(self._clock())
            counts = {status: 0 for status in ("queued", "in_progress", "completed", "failed")}
            for job in self._jobs.values():
                counts[job.status] += 1
            return {"bytes": self._bytes, "max_bytes": self.max_bytes,
                    "ttl_seconds": self.ttl_s, **{f"jobs_{k}": v for k, v in counts.items()}}

    # -- bookkeeping (under the lock) ----------------------------------------------
    @staticmethod
    def _held(job: VideoJob) -> int:
        """Bytes ``job`` counts for: its record, and its files or their reservation."""
        return RECORD_BYTES + job.reserved_bytes + sum(job.files.values())

    def _put_locked(self, job: VideoJob) -> None:
        old = self._jobs.get(job.id)
        if old is not None:
            self._bytes -= self._held(old)
        self._jobs[job.id] = job
        self._bytes += self._held(job)
        if job.expires_s is not None and (old is None or old.expires_s != job.expires_s):
            heapq.heappush(self._expiry, (job.expires_s, job.id))

    def _drop_locked(self, job: VideoJob) -> None:
        del self._jobs[job.id]
        self._bytes -= self._held(job)
        self._dir.remove(job.id)

    def _update(self, job_id: str, change: Callable[[VideoJob], VideoJob], *,
                persist: bool) -> VideoJob | None:
        """Apply ``change`` to an unfinished job (None: there is none)."""
        with self._lock:
            job = self._unfinished_locked(job_id)
            if job is None:
                return None
            new = change(job)
            if persist:
                self._dir.save(new)
            self._put_locked(new)
            return new

    def _unfinished_locked(self, job_id: str) -> VideoJob | None:
        job = self._jobs.get(job_id)
        return None if job is None or job.finished else job

    def _owned_locked(self, job_id: str, owner: str | None) -> VideoJob | None:
        if not is_job_id(job_id):
            return None
        self._expire_locked(self._clock())
        job = self._jobs.get(job_id)
        return job if job is not None and job.owner == owner else None

    def _expire_locked(self, now: float) -> None:
        while self._expiry and self._expiry[0][0] <= now:
            expires, job_id = heapq.heappop(self._expiry)
            job = self._jobs.get(job_id)
            if job is not None and job.expires_s == expires:
                self._drop_locked(job)

    def _evict_fetched_locked(self, need: int) -> None:
        """Room for ``need`` bytes from videos already downloaded, fetched
        longest ago first; none is evicted when all of them would not make
        enough (the job is refused anyway: they stay for another download)."""
        if self._bytes + need <= self.max_bytes:
            return
        fetched = sorted((j for j in self._jobs.values() if j.fetched_s is not None),
                         key=lambda j: j.fetched_s or 0.0)
        if self._bytes - sum(self._held(j) for j in fetched) + need > self.max_bytes:
            return
        for job in fetched:
            if self._bytes + need <= self.max_bytes:
                break
            logger.info("video store: evicting %s (fetched, %d bytes) to make room",
                        job.id, self._held(job))
            self._drop_locked(job)

    def _full_locked(self, need: int, now: float) -> StoreFull:
        """The refusal of a job of ``need`` bytes, with an honest Retry-After."""
        short = self._bytes + need - self.max_bytes
        freed, retry_s = 0, None
        for job in sorted((j for j in self._jobs.values() if j.expires_s is not None),
                          key=lambda j: j.expires_s or 0.0):
            freed += self._held(job)
            if freed >= short:
                retry_s = (job.expires_s or now) - now
                break
        running = [j for j in self._jobs.values() if not j.finished]
        why = ("as finished videos expire" if retry_s is not None else
               f"once the {len(running)} unfinished jobs' videos are fetched or expire")
        message = (f"the video store is full ({self._bytes} of {self.max_bytes} bytes held by "
                   f"{len(self._jobs)} jobs, {len(running)} unfinished; this one needs {need}); "
                   f"room frees {why}")
        return StoreFull(message, max(1, math.ceil(self.ttl_s if retry_s is None else retry_s)))

    def _next_ns(self) -> int:
        self._last_ns = max(time.time_ns(), self._last_ns + 1)
        return self._last_ns

    # -- a restart ------------------------------------------------------------------
    def _reload(self) -> None:
        """The jobs of the folder as a restart finds them (the module's docstring)."""
        now = self._clock()
        counts = {"kept": 0, "expired": 0, "failed": 0}
        for job in self._dir.records():
            if job.expires_s is not None and job.expires_s <= now:
                self._dir.remove(job.id)
                counts["expired"] += 1
                continue
            job, failed = self._restarted(job, now)
            counts["failed"] += failed
            self._put_locked(job)
            self._last_ns = max(self._last_ns, job.created_ns)
            counts["kept"] += 1
        self._dir.sweep(set(self._jobs))
        if any(counts.values()):
            logger.info("video store %s: %d jobs back (%d reported failed: unfinished at the "
                        "restart, or their video missing), %d expired and removed",
                        self._dir.path, counts["kept"], counts["failed"], counts["expired"])

    def _restarted(self, job: VideoJob, now: float) -> tuple[VideoJob, bool]:
        """``job`` as a restart reports it, and whether that failed it (then saved)."""
        if not job.finished:
            error = VideoError("server_restarted", "the server restarted before this video was "
                                                   "finished; create it again")
        elif job.status == "completed" and any(
                self._dir.size_of(job.id, variant) != size for variant, size in job.files.items()):
            error = VideoError("video_file_missing", "this video's file is missing or damaged "
                                                     "on the server; create it again")
        else:
            return job, False
        failed = msgspec.structs.replace(job, status="failed", completed_at=int(now),
                                         expires_s=now + self.ttl_s, reserved_bytes=0,
                                         files={}, error=error)
        for variant in job.files:
            self._dir.file_path(job.id, variant).unlink(missing_ok=True)
        self._dir.save(failed)
        return failed, True


__all__ = ["RECORD_BYTES", "VideoPage", "VideoStore"]
