"""Runtime-owned shared memory for outputs: one arena, leased slots, handles.

The executor creates one arena per executor at start-up with ``memfd_create``
and hands the descriptor to the output rank at spawn. Nothing ever appears in
/dev/shm and no name can leak: the kernel frees the memory when the last
mapping or descriptor goes away, whether the processes exit, crash or are
SIGKILLed. There is no per-output segment creation: the output rank carves
slots out of the arena (first fit, lowest addresses first so pages stay warm),
the executor reads them in place through ``OutputLease`` and gives them back
with ``FreeSlots``. The arena's size is the bound on pending output bytes: a
full arena makes the writer wait for frees, which throttles the worker.

A slot carries one key's output (a tensor or a nested list/tuple/dict of
them); each tensor is copied contiguously in its own dtype (bf16 stays bf16),
so a per-request slice of a batched output carries only its own bytes.
"""

from __future__ import annotations

import bisect
import logging
import mmap
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from diffrt.runtime.messages import KeyOutput, TensorMeta

logger = logging.getLogger(__name__)

ALIGN = 256  # bytes; every tensor starts on this boundary (any dtype view is legal)


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in an output handle")
    return dtype


class Arena:
    """A shared mapping of one memfd; ``create`` in the executor, ``attach`` in the
    output rank (which receives the descriptor at spawn)."""

    def __init__(self, fd: int, size: int):
        if size <= 0:
            raise ValueError(f"arena size must be positive, got {size}")
        self.fd = fd
        self.size = size
        self._mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self._u8: torch.Tensor | None = torch.frombuffer(self._mm, dtype=torch.uint8)

    @classmethod
    def create(cls, size: int, name: str = "diffrt-output-arena") -> Arena:
        """Anonymous shared memory; the descriptor is close-on-exec (passed
        explicitly). ``name`` is what /proc/<pid>/fd shows."""
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            return cls(fd, size)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def attach(cls, fd: int, size: int) -> Arena:
        return cls(fd, size)

    def bytes_view(self, offset: int, nbytes: int) -> torch.Tensor:
        if offset < 0 or offset + nbytes > self.size:
            raise ValueError(f"slot [{offset}, {offset + nbytes}) outside the arena of {self.size} bytes")
        if self._u8 is None:
            raise ValueError("the arena is closed")
        return self._u8[offset:offset + nbytes]

    def tensor_view(self, offset: int, dtype: torch.dtype, shape: list[int] | tuple[int, ...]) -> torch.Tensor:
        numel = 1
        for s in shape:
            numel *= s
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        return self.bytes_view(offset, nbytes).view(dtype).view(tuple(shape))

    def close(self) -> None:
        """Drop this process's mapping and descriptor. Views still alive keep the
        mapping (and the memory) until they are collected."""
        self._u8 = None
        try:
            self._mm.close()
        except BufferError:
            logger.debug("arena still viewed by live tensors; the mapping goes with them")
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class ArenaFullError(RuntimeError):
    """An output is larger than the whole arena (raise max_pending_output_bytes)."""


class SlotAllocator:
    """First-fit allocator over the arena, used only by the writer's output thread.

    Slots are tagged with a generation so a stale or duplicate free is ignored.
    """

    def __init__(self, size: int):
        self.size = size
        self._free: list[list[int]] = [[0, size]]  # sorted [offset, length]
        self._live: dict[int, tuple[int, int]] = {}  # offset -> (generation, length)
        self._gen = 0

    @property
    def used_bytes(self) -> int:
        return sum(length for _, length in self._live.values())

    def try_allocate(self, nbytes: int) -> tuple[int, int] | None:
        """(offset, generation) of a new slot, or None when nothing fits now."""
        length = max(_align(nbytes), ALIGN)
        if length > self.size:
            raise ArenaFullError(
                f"an output of {nbytes} bytes exceeds the output arena ({self.size} bytes); "
                "raise ExecutorConfig.max_pending_output_bytes")
        for i, (off, free_len) in enumerate(self._free):
            if free_len >= length:
                if free_len == length:
                    del self._free[i]
                else:
                    self._free[i] = [off + length, free_len - length]
                self._gen += 1
                self._live[off] = (self._gen, length)
                return off, self._gen
        return None

    def try_allocate_many(self, sizes: list[int]) -> list[tuple[int, int]] | None:
        """Consecutive slots for one batch, carved from one free range, each freed on
        its own later. All or nothing: a batch never holds part of the arena while
        waiting for the rest (which could wait forever on its own unsent slots)."""
        lengths = [max(_align(n), ALIGN) for n in sizes]
        total = sum(lengths)
        if total > self.size:
            raise ArenaFullError(
                f"outputs of {sum(sizes)} bytes exceed the output arena ({self.size} bytes); "
                "raise ExecutorConfig.max_pending_output_bytes")
        if not lengths:
            return []
        first = self.try_allocate(total)
        if first is None:
            return None
        base = first[0]
        del self._live[base]
        slots = []
        for length in lengths:
            self._gen += 1
            self._live[base] = (self._gen, length)
            slots.append((base, self._gen))
            base += length
        return slots

    def free(self, offset: int, generation: int) -> bool:
        live = self._live.get(offset)
        if live is None or live[0] != generation:
            logger.debug("ignoring stale free of slot %d gen %d", offset, generation)
            return False
        del self._live[offset]
        length = live[1]
        i = bisect.bisect_left(self._free, [offset, 0])
        self._free.insert(i, [offset, length])
        # coalesce with the next and the previous free ranges
        if i + 1 < len(self._free) and offset + length == self._free[i + 1][0]:
            self._free[i][1] += self._free[i + 1][1]
            del self._free[i + 1]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == offset:
            self._free[i - 1][1] += self._free[i][1]
            del self._free[i]
        return True


# -- packing (writer side) -------------------------------------------------------------
class PackPlan:
    """The layout of one key's value inside a slot, computed before any copy."""

    def __init__(self, value: Any):
        self.tensors: list[torch.Tensor] = []
        self.metas: list[TensorMeta] = []
        self.nbytes = 0  # payload bytes (what the user receives)
        self._cursor = 0
        self.tree = self._flatten(value)

    @property
    def slot_bytes(self) -> int:
        return self._cursor

    def _flatten(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            n = value.numel() * value.element_size()
            self.metas.append(TensorMeta(self._cursor, dtype_name(value.dtype), list(value.shape)))
            self.tensors.append(value)
            self._cursor += _align(n)
            self.nbytes += n
            return ["T", len(self.tensors) - 1]
        if isinstance(value, list):
            return ["L", [self._flatten(v) for v in value]]
        if isinstance(value, tuple):
            return ["U", [self._flatten(v) for v in value]]
        if isinstance(value, dict):
            return ["D", [[k, self._flatten(v)] for k, v in value.items()]]
        return ["V", value]

    def copy_into(self, arena: Arena, slot_offset: int,
                  copy: Callable[[torch.Tensor, torch.Tensor], None]) -> None:
        """``copy(dst_view, src)`` for every tensor; dst is contiguous in src's dtype."""
        for meta, src in zip(self.metas, self.tensors, strict=True):
            if src.numel():
                copy(arena.tensor_view(slot_offset + meta.offset, src.dtype, meta.shape), src)

    def key_output(self, output_id: str, slot_offset: int, generation: int) -> KeyOutput:
        return KeyOutput(output_id, slot_offset, self.slot_bytes, generation, self.metas,
                         self.tree, self.nbytes)


def copy_host(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` for host tensors, as one single-threaded memcpy.

    A torch op on the output thread would make that thread an OpenMP master
    with a team of its own; libgomp then counts more threads than cores and
    stops spinning at barriers, so every parallel region of the main thread's
    forward pays a futex wake-up (measured: a 256x256 tiny-flux request went
    from 110 to 170 ms on 2 cores). numpy copies without OpenMP.
    """
    if (src.device.type == "cpu" and src.dtype == dst.dtype and src.is_contiguous()
            and dst.is_contiguous() and src.numel() == dst.numel() and not src.requires_grad):
        np.copyto(dst.reshape(-1).view(torch.uint8).numpy(),
                  src.reshape(-1).view(torch.uint8).numpy())
    else:
        dst.copy_(src)


# -- reading (executor side) ---------------------------------------------------------------
def _build(node: Any, tensors: list[torch.Tensor]) -> Any:
    tag, body = node
    if tag == "T":
        return tensors[body]
    if tag == "L":
        return [_build(n, tensors) for n in body]
    if tag == "U":
        return tuple(_build(n, tensors) for n in body)
    if tag == "D":
        return {k: _build(n, tensors) for k, n in body}
    return body


def read_views(arena: Arena, out: KeyOutput) -> Any:
    """The value of one key as tensors viewing the slot (no copy)."""
    tensors = [arena.tensor_view(out.slot_offset + m.offset, dtype_from_name(m.dtype), m.shape)
               for m in out.tensors]
    return _build(out.tree, tensors)


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):  # a memcpy: no OpenMP team in the reader's process
        owned = torch.empty_like(value, memory_format=torch.contiguous_format)
        copy_host(owned, value)
        return owned
    if isinstance(value, list):
        return [_clone(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_clone(v) for v in value)
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    return value


class OutputLease:
    """Host view of one key's output inside the arena.

    ``value`` views shared memory that is reused once the lease is released:
    read it while you hold the lease, or call ``take()`` for owned copies.
    Releasing is idempotent and also happens when the lease is collected.
    """

    def __init__(self, output_id: str, value: Any, nbytes: int, release_cb: Callable[[], None]):
        self.output_id = output_id
        self.value = value
        self.nbytes = nbytes
        self._finalizer = weakref.finalize(self, release_cb)
        self._lock = threading.Lock()

    @property
    def released(self) -> bool:
        return not self._finalizer.alive

    def release(self) -> None:
        """Give the slot back to the worker (idempotent)."""
        self._finalizer()

    def take(self) -> Any:
        """Owned copies of ``value``, then release the slot."""
        with self._lock:
            if self.released:
                raise RuntimeError(f"output {self.output_id} was already released")
            value = _clone(self.value)
            self.value = None
            self.release()
        return value

    def __repr__(self) -> str:
        state = "released" if self.released else "held"
        return f"<OutputLease {self.output_id} {self.nbytes} B {state}>"
