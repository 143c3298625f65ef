"""Adapters applied per row inside one transformer call, unmerged.

The technique is Punica's and S-LoRA's (batched LoRA over rows that use
different adapters): the base weights stay as loaded, and each targeted
linear layer adds, to each row of its input, that row's adapters' low-rank
terms, gathered by row and computed with batched matmuls — never a loop over
requests or adapters. Per targeted linear there is one table of every
device slot's ``A`` rows and one of its (scaled) ``B`` columns:

    table_a  (slots x R + 1, in)     slot s's rank-j row at s * R + j
    table_bt (slots x R + 1, out)    the same rows of (scaling * B)^T

``R`` (the slot rank) is the largest rank installed; a smaller adapter, or a
module of an adapter with a smaller rank there, leaves its rows zero, and the
last row is zero for padding. A call's rows are described once per call
(``RowLoras.rows``) by an index (rows, K) into those tables — row i's
adapters' rank rows one after another, padded with the zero row — and the
matching per-request scales (``SamplingParams.loras``, as diffusers'
``set_adapters`` weights). Each targeted linear then adds

    h = x_i @ table_a[index_i]^T * scale_i        (one batched matmul)
    y_i += h @ table_bt[index_i]                  (one batched matmul)

so the matmuls per targeted linear are two whatever the number of distinct
adapters in the batch; rows of different ranks, adapters composed in one
row, rows without any adapter and adapters targeting different modules mix
in one call, and the work of a row is its own adapters' ranks (padded to the
call's largest). Where every row of a call uses the same adapters the gather
is of one index row and the matmuls are plain ones over all rows' tokens.

The layers are hooked (``register_forward_hook``) when an adapter first
targets them, so the model's module tree and state dict stay diffusers' own;
a hook without active rows returns at once. Installs run on the worker's
thread between calls (the runner applies the engine's slot assignments at
the start of an execute); reading files is the loader thread's
(``loader.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from diffrt.engine.lora.adapter_file import AdapterWeights

#: one row's adapters: (device slot, scale) pairs
RowUses = tuple[tuple[int, float], ...]


@dataclass
class _Tables:
    a: torch.Tensor   # (slots * R + 1, in)
    bt: torch.Tensor  # (slots * R + 1, out)
    #: the slots with factors for this layer
    slots: set[int]


@dataclass(frozen=True)
class _ActiveRows:
    rows: int
    index: torch.Tensor  # (rows, K) long
    scale: torch.Tensor  # (rows, K), float32
    #: every row uses the same adapters: one index row serves all
    shared: bool
    slots: frozenset[int]


class RowLoras:
    """The device slots of one worker's transformer and its hooked layers."""

    def __init__(self, model: torch.nn.Module, slots: int, *, device: torch.device,
                 dtype: torch.dtype, others: dict[str, torch.nn.Module] | None = None):
        """``others``: further models an adapter may target (Wan 2.2's second
        expert), their linears named ``<key>.<name>``."""
        self.linears: dict[str, torch.nn.Linear] = {
            name: m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        for key, other in (others or {}).items():
            self.linears.update({f"{key}.{name}": m for name, m in other.named_modules()
                                 if isinstance(m, torch.nn.Linear)})
        self.num_slots = slots
        self.device, self.dtype = device, dtype
        #: the adapter id and weights in each slot
        self.installed: list[tuple[int, AdapterWeights] | None] = [None] * slots
        self.rank = 0  # R: table rows per slot
        self.tables: dict[str, _Tables] = {}
        self._hooked: set[str] = set()
        self._active: _ActiveRows | None = None

    def shapes(self) -> dict[str, tuple[int, int]]:
        """The model's linear layers: name -> (out, in) (what an adapter must fit)."""
        return {n: (m.out_features, m.in_features) for n, m in self.linears.items()}

    def device_bytes(self) -> int:
        return sum(t.a.numel() * t.a.element_size() + t.bt.numel() * t.bt.element_size()
                   for t in self.tables.values())

    # -- slots (the worker's thread, between calls) ----------------------------------------
    def install(self, slot: int, adapter_id: int, weights: AdapterWeights) -> None:
        """Put ``weights`` in ``slot`` (replacing what was there). A slot is
        marked as holding an adapter only once its rows are written, so a
        failure (out of memory) leaves it empty, never half written."""
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} outside 0..{self.num_slots - 1}")
        self.clear(slot)
        rank = max([weights.rank] + [e[1].rank for e in self.installed if e is not None])
        if rank != self.rank:  # the slot rank changes: lay every slot out anew
            kept = [(s, e) for s, e in enumerate(self.installed) if e is not None]
            self.installed = [None] * self.num_slots
            self.tables.clear()
            self.rank = rank
            for s, entry in kept:
                self._write(s, entry[1])
                self.installed[s] = entry
        self._write(slot, weights)
        self.installed[slot] = (adapter_id, weights)

    def clear(self, slot: int) -> None:
        """Empty ``slot`` (its rows are zeroed when the next adapter is installed there)."""
        self.installed[slot] = None
        for tables in self.tables.values():
            tables.slots.discard(slot)

    def slot_of(self, adapter_id: int) -> int | None:
        for slot, entry in enumerate(self.installed):
            if entry is not None and entry[0] == adapter_id:
                return slot
        return None

    def _write(self, slot: int, weights: AdapterWeights) -> None:
        r = self.rank
        rows = slice(slot * r, (slot + 1) * r)
        for name, tables in self.tables.items():  # layers it does not target: zero
            if name not in weights.modules:
                tables.a[rows] = 0
                tables.bt[rows] = 0
                tables.slots.discard(slot)
        for name, factors in weights.modules.items():
            tables = self.tables.get(name) or self._new_tables(name)
            k = factors.rank
            a = factors.a.to(self.device, self.dtype)
            bt = (factors.b.to(self.device, torch.float32) * factors.scaling).t().to(self.dtype)
            tables.a[rows] = 0
            tables.bt[rows] = 0
            tables.a[slot * r:slot * r + k] = a
            tables.bt[slot * r:slot * r + k] = bt
            tables.slots.add(slot)

    def _new_tables(self, name: str) -> _Tables:
        layer = self.linears[name]
        n = self.num_slots * self.rank + 1
        tables = _Tables(torch.zeros(n, layer.in_features, device=self.device, dtype=self.dtype),
                         torch.zeros(n, layer.out_features, device=self.device, dtype=self.dtype),
                         set())
        self.tables[name] = tables
        if name not in self._hooked:
            layer.register_forward_hook(self._hook(name))
            self._hooked.add(name)
        return tables

    # -- calls -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def rows(self, uses: tuple[RowUses, ...]) -> Iterator[None]:
        """While a transformer call over rows whose adapters are ``uses`` (one
        entry per row, in row order; () or all empty: none) runs."""
        previous = self._active  # a sub-batch's rows inside a call's (``engine.cache``)
        if not any(uses):
            self._active = None
            try:
                yield
            finally:
                self._active = previous
            return
        pad = self.num_slots * self.rank
        index_rows: list[list[int]] = []
        scale_rows: list[list[float]] = []
        for row in uses:
            index: list[int] = []
            scale: list[float] = []
            for slot, weight in row:
                entry = self.installed[slot]
                if entry is None:
                    raise RuntimeError(f"a row uses LoRA slot {slot}, which holds no adapter")
                k = entry[1].rank
                index += range(slot * self.rank, slot * self.rank + k)
                scale += [weight] * k
            index_rows.append(index)
            scale_rows.append(scale)
        width = max(len(i) for i in index_rows)
        index_t = torch.tensor([i + [pad] * (width - len(i)) for i in index_rows],
                               dtype=torch.long, device=self.device)
        # float32 whatever the compute dtype: PEFT scales by a Python float
        scale_t = torch.tensor([s + [0.0] * (width - len(s)) for s in scale_rows],
                               dtype=torch.float32, device=self.device)
        self._active = _ActiveRows(
            rows=len(uses), index=index_t, scale=scale_t, shared=len(set(uses)) == 1,
            slots=frozenset(slot for row in uses for slot, _ in row))
        try:
            yield
        finally:
            self._active = previous

    @contextlib.contextmanager
    def subset(self, rows: torch.Tensor | None) -> Iterator[None]:
        """While a call over ``rows`` (positions) of the described call's
        rows runs alone (a family that sends some rows to another model,
        such as Wan 2.2's second expert); None: all of them, as described."""
        previous = self._active
        if previous is None or rows is None:
            yield
            return
        self._active = _ActiveRows(rows=len(rows), index=previous.index[rows.to(self.device)],
                                   scale=previous.scale[rows.to(self.device)],
                                   shared=previous.shared, slots=previous.slots)
        try:
            yield
        finally:
            self._active = previous

    def _hook(self, name: str) -> Callable[[torch.nn.Module, tuple[torch.Tensor, ...], torch.Tensor],
                                           torch.Tensor | None]:
        def add_low_rank(module: torch.nn.Module, args: tuple[torch.Tensor, ...],
                         output: torch.Tensor) -> torch.Tensor | None:
            active = self._active
            tables = self.tables.get(name)
            if active is None or tables is None or not (tables.slots & active.slots):
                return None
            x = args[0]
            if x.shape[0] != active.rows:
                raise RuntimeError(f"LoRA on {name}: {x.shape[0]} rows in, {active.rows} described")
            if active.shared:  # one gather for all rows, plain matmuls over every token
                index, scale = active.index[0], active.scale[0]
                h = (torch.matmul(x, tables.a[index].t()).float() * scale).to(x.dtype)
                return output + torch.matmul(h, tables.bt[index])
            rows = x.reshape(active.rows, -1, x.shape[-1])
            h = torch.bmm(rows, tables.a[active.index].transpose(1, 2))
            h = (h.float() * active.scale[:, None, :]).to(x.dtype)
            return output + torch.bmm(h, tables.bt[active.index]).view_as(output)

        return add_low_rank


__all__ = ["RowLoras", "RowUses"]
