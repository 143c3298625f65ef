"""The worker's adapter files, read on a thread of their own.

Registering an adapter (``LoadAdapter``) only queues its file here and answers
at once, so the worker's thread goes on running denoise steps while the file
is read and checked; the engine asks how far it got (``AdapterStatus``) until
every rank has it or one failed. Each adapter is read once into host memory
and kept until it is dropped; the device holds only what the engine assigned
to its slots (``row_lora``).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from diffrt.engine.lora.adapter_file import AdapterFileError, AdapterWeights

logger = logging.getLogger(__name__)

#: what ``status`` says of an adapter still being read
LOADING = "loading"
READY = "ready"


class AdapterLoader:
    """Adapter id -> its weights on the host (or why it failed), read by one thread."""

    def __init__(self, read: Callable[[str], AdapterWeights]):
        self._read = read
        self._lock = threading.Lock()
        self._results: dict[int, AdapterWeights | str] = {}
        self._loading: set[int] = set()
        self._queue: queue.SimpleQueue[tuple[int, str] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def start(self, adapter_id: int, path: str) -> None:
        """Queue ``path``'s read as ``adapter_id`` (a second start of one id is ignored)."""
        with self._lock:
            if adapter_id in self._loading or adapter_id in self._results:
                return
            self._loading.add(adapter_id)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="diffrt-lora-loader",
                                                daemon=True)
                self._thread.start()
        self._queue.put((adapter_id, path))

    def status(self, adapter_id: int) -> str:
        """``READY``, ``LOADING``, or the error that refused the file."""
        with self._lock:
            if adapter_id in self._loading:
                return LOADING
            result = self._results.get(adapter_id)
        if result is None:
            return "RuntimeError: this worker was never asked to load it"
        return READY if isinstance(result, AdapterWeights) else result

    def get(self, adapter_id: int) -> AdapterWeights:
        with self._lock:
            result = self._results.get(adapter_id)
        if not isinstance(result, AdapterWeights):
            raise RuntimeError(f"LoRA adapter {adapter_id} is not loaded in this worker")
        return result

    def drop(self, adapter_id: int) -> None:
        """Forget ``adapter_id`` (one still being read is forgotten when its read ends)."""
        with self._lock:
            self._results.pop(adapter_id, None)
            if adapter_id in self._loading:
                self._results[adapter_id] = "dropped"  # marks the read to discard

    def host_bytes(self) -> int:
        with self._lock:
            return sum(r.nbytes for r in self._results.values() if isinstance(r, AdapterWeights))

    def close(self) -> None:
        self._queue.put(None)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            adapter_id, path = item
            try:
                result: AdapterWeights | str = self._read(path)
            except AdapterFileError as exc:
                result = str(exc)
            except Exception as exc:  # a bug or an unreadable file: the registration says so
                logger.exception("reading LoRA adapter %s failed", path)
                result = f"{path}: {type(exc).__name__}: {exc}"
            with self._lock:
                self._loading.discard(adapter_id)
                if self._results.pop(adapter_id, None) == "dropped":
                    continue
                self._results[adapter_id] = result


__all__ = ["LOADING", "READY", "AdapterLoader"]
