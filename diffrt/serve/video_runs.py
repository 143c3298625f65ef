"""The video jobs' runs: each a background task the server owns (not the
connection that created it), so a client that leaves after ``create`` loses
nothing.

A run follows one job through the engine (``EngineClient.open_run``: the
seat among the waiting was taken when the route created the job, so
``--max-pending`` answered 429 then), records the engine's step progress
(0 - 99; 100 once completed), encodes the frames (``video_files.clip_files``:
MP4, thumbnail, spritesheet) and writes them to the store, both in a thread:
never on the event loop, never in the engine's loop. ``abort`` cancels a run,
which aborts its request in the engine (``EngineClient.run``'s ``finally``).
``watch`` gives a job's states as they change (the ``/events`` stream),
and, for a chunked model (Helios), each finished chunk's frames as soon as
the engine streams them (``video.chunk``: a small animated WebP, base64,
encoded in a thread; kept for the run and ``CHUNK_KEEP_S`` after it, so a
watcher that joins late still gets them before ``video.completed``).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import TYPE_CHECKING, Any

import numpy as np

from diffrt.engine import DiffusionOutput, InvalidRequestError
from diffrt.engine.errors import EngineError
from diffrt.engine.seats import Seat
from diffrt.engine.video_files import preview_webp
from diffrt.serve.errors import ApiError
from diffrt.serve.video_jobs import VideoJob
from diffrt.serve.video_metrics import VideoMetrics
from diffrt.serve.video_store import VideoStore

if TYPE_CHECKING:
    from diffrt.engine.video_files import Waveform

logger = logging.getLogger(__name__)

#: how often a watcher looks again when nothing told it of a change (a
#: deletion, an expiry)
WATCH_POLL_S = 1.0
#: seconds a finished run's chunk events stay for watchers that come late
CHUNK_KEEP_S = 60.0
#: the largest side of a chunk event's WebP (the MP4 has the full frames)
CHUNK_PREVIEW_SIDE = 256


class VideoRuns:
    """The runs of ``store``'s jobs on the engine behind ``client``."""

    def __init__(self, store: VideoStore, metrics: VideoMetrics):
        self.store, self.metrics = store, metrics
        self._tasks: dict[str, asyncio.Task] = {}
        self._changed: dict[str, asyncio.Event] = {}
        #: job id -> its chunk events so far (a chunked model's)
        self._chunks: dict[str, list[dict[str, Any]]] = {}

    def start(self, job: VideoJob, opened: tuple[AsyncGenerator[DiffusionOutput, None], Seat]
              ) -> None:
        """Run ``job`` on ``opened`` (``EngineClient.open_run``'s) in the background."""
        task = asyncio.create_task(self._run(job.id, *opened), name=f"diffrt-{job.id}")
        self._tasks[job.id] = task
        seat = opened[1]

        def ended(_: asyncio.Task) -> None:
            self._tasks.pop(job.id, None)
            seat.release()  # a task cancelled before it began never reached the engine

        task.add_done_callback(ended)

    def running(self) -> int:
        return len(self._tasks)

    async def abort(self, job_id: str) -> None:
        """Stop ``job_id``'s run (its request is aborted in the engine)."""
        task = self._tasks.get(job_id)
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task

    async def close(self) -> None:
        """Stop every run (at shutdown: a restart reports them failed)."""
        for job_id in list(self._tasks):
            await self.abort(job_id)

    async def watch(self, job_id: str, owner: str | None
                    ) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        """The job's events as (name, data): its states as they change
        (``video.<status>``, the job object), each streamed chunk
        (``video.chunk``) before the state that follows it, ending with a
        finished state (or when the job is gone)."""
        last: tuple[str, int] | None = None
        sent = 0
        while True:
            event = self._changed.setdefault(job_id, asyncio.Event())
            event.clear()
            job = self.store.get(job_id, owner)
            if job is None:
                return
            chunks = self._chunks.get(job_id, [])
            for chunk in chunks[sent:]:
                yield "video.chunk", chunk
            sent = max(sent, len(chunks))
            if (job.status, job.progress) != last:
                last = (job.status, job.progress)
                yield f"video.{job.status}", job.public()
            if job.finished:
                return
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(event.wait(), WATCH_POLL_S)

    def _tell(self, job_id: str) -> None:
        event = self._changed.get(job_id)
        if event is not None:
            event.set()

    async def _run(self, job_id: str, outputs: AsyncGenerator[DiffusionOutput, None],
                   seat: Seat) -> None:
        outcome = "failed"
        try:
            await asyncio.to_thread(self.store.start, job_id)
            self._tell(job_id)
            final: DiffusionOutput | None = None
            async for out in outputs:
                if out.finished:
                    final = out
                    continue
                if out.preview is not None:  # a chunked model's finished chunk
                    await self._chunk(job_id, out)
                if out.total_steps:
                    self.store.set_progress(job_id, 100 * out.step / out.total_steps)
                    self._tell(job_id)
            outcome = await self._finish(job_id, final)
        except asyncio.CancelledError:
            outcome = "deleted"
            raise
        except InvalidRequestError as exc:  # the engine's checks at submission
            await asyncio.to_thread(self.store.fail, job_id, "invalid_request", str(exc))
        except (EngineError, ApiError) as exc:  # capacity, a restart, a dead engine, a drain
            await asyncio.to_thread(self.store.fail, job_id, "engine_unavailable", str(exc))
        except Exception as exc:  # a run must never end without its job's record saying so
            logger.exception("video job %s failed", job_id)
            await asyncio.to_thread(self.store.fail, job_id, "internal_error",
                                    f"{type(exc).__name__}: {exc}")
        finally:
            await outputs.aclose()
            seat.release()
            self.metrics.count(outcome)
            self._tell(job_id)
            self._changed.pop(job_id, None)
            asyncio.get_running_loop().call_later(CHUNK_KEEP_S, self._chunks.pop, job_id, None)

    async def _chunk(self, job_id: str, out: DiffusionOutput) -> None:
        """A streamed chunk (``out.preview``: the one output's frames) as a
        ``video.chunk`` event for the watchers."""
        chunks = self._chunks.setdefault(job_id, [])
        clip: Any = out.preview  # each output's frames: PIL images, or an (N, F, H, W, 3) array
        frames = np.stack([np.asarray(f) for f in clip[0]])
        fps = 24.0 if out.fps is None else out.fps
        webp = await asyncio.to_thread(preview_webp, frames, fps, max_side=CHUNK_PREVIEW_SIDE)
        first = sum(c["frames"] for c in chunks)
        chunks.append({"id": job_id, "object": "video.chunk", "chunk_index": len(chunks),
                       "first_frame": first, "frames": len(frames),
                       "step": out.step, "total_steps": out.total_steps,
                       "media_type": "image/webp",
                       "b64_webp": base64.b64encode(webp).decode("ascii")})
        self._tell(job_id)

    async def _finish(self, job_id: str, final: DiffusionOutput | None) -> str:
        if final is None or not final.ok or not final.frames:
            reason = "the request ended without an output" if final is None else (
                final.error or ("aborted" if final.aborted else "no frames"))
            code = "timeout" if final is not None and final.timed_out else "generation_failed"
            await asyncio.to_thread(self.store.fail, job_id, code, reason)
            return "failed"
        frames = np.stack([np.asarray(f) for f in final.frames[0]])
        fps = final.fps or 16.0
        sound = None
        if final.waveform is not None and final.sample_rate:  # LTX-2's: muxed as AAC
            from diffrt.engine.video_files import Waveform

            sound = Waveform(final.waveform[0], final.sample_rate)
        files = await asyncio.to_thread(self._encode, frames, fps, sound)
        done = await asyncio.to_thread(self.store.complete, job_id, files)
        return "completed" if done is not None else "deleted"

    def _encode(self, frames: np.ndarray, fps: float,
                sound: Waveform | None = None) -> dict[str, bytes]:
        from diffrt.engine.video_files import clip_files

        began = time.perf_counter()
        files = clip_files(frames, fps, audio=sound)
        self.metrics.encoded(time.perf_counter() - began)
        return files


def estimate_bytes(frames: int, height: int, width: int) -> int:
    """The room reserved for a job's files: its raw frames bound the MP4
    from above (0.04 - 0.09x raw by default), plus the thumbnail (a raw
    frame at most) and the spritesheet (a small JPEG)."""
    return frames * height * width * 3 + height * width * 3 + (1 << 20)


def settings_of(body: Any) -> dict[str, Any]:
    """The body's fields a remix starts from (all but the first frame)."""
    return {k: v for k, v in body.model_dump(exclude_unset=True).items()
            if k != "input_reference"}


__all__ = ["VideoRuns", "estimate_bytes", "settings_of"]
