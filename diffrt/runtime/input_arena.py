"""Shared memory for request inputs (input images): the engine writes, every rank reads.

The mirror of the output arena (``shm_transport``): one memfd per executor,
created at start-up and inherited by every worker rank, so nothing appears in
/dev/shm and the kernel frees it whatever way the processes end. The engine
carves one slot per input array (first fit, lowest addresses first, so a
steady stream of requests reuses the same pages), writes the bytes there and
sends the worker only an ``InputHandle``: an input never travels inside a
message. A rank copies its input out by handle when it prepares the request;
the slot stays the engine's until the request ends, whatever the ending
(``free``), so a restarted worker can read it again.

An engine keeps its arena across worker restarts (requests waiting for the
fresh workers hold handles into it): each executor given it ``retain``s it
and every holder's ``close`` gives one hold back; the memory goes with the
last.

The arena's size is ``max_pending_input_bytes``: the bound on the input bytes
of all requests the engine holds. An input that does not fit now is refused
(``InputArenaFullError``) instead of waiting: a submission must not block on
other requests finishing.
"""

from __future__ import annotations

import threading

import msgspec
import numpy as np
import torch

from diffrt.runtime.shm_transport import ALIGN, Arena, SlotAllocator


class InputHandle(msgspec.Struct, frozen=True, tag="input_handle"):
    """Where one input array waits in the input arena: a uint8 array of ``shape``."""

    offset: int
    shape: tuple[int, ...]
    #: the slot's generation: a stale handle's free is ignored (a read is
    #: not checked: the engine frees a slot only once its request ended, so
    #: a rank reading it then computes an output nobody reads)
    generation: int

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


class InputArenaFullError(RuntimeError):
    """The inputs of the requests held now leave no room for this one
    (``max_pending_input_bytes``)."""


class InputArenaClosedError(RuntimeError):
    """A ``put`` after the last holder closed the arena (the engine shut down)."""


class InputArena:
    """The engine's side: writes inputs, frees them; thread-safe (submitting
    threads write, the core frees)."""

    def __init__(self, size: int):
        self.arena = Arena.create(size, name="diffrt-input-arena")
        self._slots = SlotAllocator(size)
        self._lock = threading.Lock()
        self._holders = 1

    @property
    def fd(self) -> int:
        return self.arena.fd

    @property
    def size(self) -> int:
        return self.arena.size

    @property
    def used_bytes(self) -> int:
        """Bytes held by live slots (each rounded up to the arena's alignment)."""
        with self._lock:
            return self._slots.used_bytes

    def put(self, array: np.ndarray) -> InputHandle:
        """Copy one uint8 array into a fresh slot. The copy runs under the
        lock, so the last ``close`` (engine shutdown on another thread) cannot
        unmap the arena under it; one image's memcpy is short next to the
        submission that decoded it."""
        if array.dtype != np.uint8:
            raise TypeError(f"inputs travel as uint8 arrays, got {array.dtype}")
        nbytes = int(array.nbytes)
        flat = np.ascontiguousarray(array).reshape(-1)
        with self._lock:
            if self._holders <= 0:
                raise InputArenaClosedError("the input arena is closed")
            if max(nbytes, ALIGN) > self.size:
                raise InputArenaFullError(
                    f"an input of {nbytes} bytes is larger than max_pending_input_bytes "
                    f"({self.size})")
            slot = self._slots.try_allocate(nbytes)
            if slot is None:
                raise InputArenaFullError(
                    f"the inputs of the requests held now leave no room for {nbytes} more "
                    f"bytes (max_pending_input_bytes={self.size}, "
                    f"{self._slots.used_bytes} in use)")
            offset, generation = slot
            view = self.arena.bytes_view(offset, nbytes).numpy()
            view[:] = flat
        return InputHandle(offset, tuple(int(s) for s in array.shape), generation)

    def free(self, handle: InputHandle) -> None:
        with self._lock:
            self._slots.free(handle.offset, handle.generation)

    def retain(self) -> InputArena:
        """One more holder (an executor of the same engine); ``close`` each."""
        with self._lock:
            if self._holders <= 0:
                raise RuntimeError("the input arena is already closed")
            self._holders += 1
        return self

    def close(self) -> None:
        """One holder is done; the last unmaps the arena (under the lock, so
        no ``put`` is copying into it)."""
        with self._lock:
            self._holders -= 1
            if self._holders == 0:
                self.arena.close()


def read_input(arena: Arena, handle: InputHandle) -> torch.Tensor:
    """A rank's copy of one input (uint8, ``handle.shape``): the slot may be
    freed as soon as the request ends, the copy lives as long as its state."""
    view = arena.bytes_view(handle.offset, handle.nbytes)
    return view.clone().view(handle.shape)


__all__ = ["InputArena", "InputArenaClosedError", "InputArenaFullError", "InputHandle",
           "read_input"]
