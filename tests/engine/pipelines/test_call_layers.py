"""The transformer call's feature layers (``pipelines.transformer_call``):
composed in the one declared order, each routing a call to the family entry
its feature names and passing the rest down, and the two that install
model hooks (offload, sequence split) owning them. A fake host records
which entry each call reached; the pixel-equality of each route is tested
with the real families (test_mixed_sizes, test_offload, test_parallel_layers)."""

from __future__ import annotations

import torch

from diffrt.engine.pipelines.segments import RowLayout
from diffrt.engine.pipelines.transformer_call import (
    CALL_LAYERS,
    BlockOffload,
    FamilyCall,
    LoraRows,
    RowsBySize,
    RowsCall,
    RowsPacked,
    RowsPadded,
    SequenceShard,
    StepCache,
    build_call,
)
from diffrt.platforms.cpu import CpuPlatform


class Host:
    """The parts of ``FlowMatchHost`` the layers read; each entry records its name."""

    def __init__(self, mixed_rows: str = "padded", packs_rows: bool = True):
        self.mixed_rows, self.packs_rows = mixed_rows, packs_rows
        self.row_loras = None
        self.sequence_split = None
        self.offload = None
        self.reached: list[tuple[str, tuple[int, ...]]] = []

    def _entry(self, name: str, latents: torch.Tensor, layout: RowLayout) -> torch.Tensor:
        self.reached.append((name, layout.tokens))
        return latents + 1

    def transformer_forward(self, latents, timesteps, embeds, extra, guidance, layout):
        assert layout.uniform
        return self._entry("forward", latents, layout)

    def padded_forward(self, latents, timesteps, embeds, extra, guidance, layout):
        return self._entry("padded", latents, layout)

    def packed_forward(self, latents, timesteps, embeds, extra, guidance, layout):
        return self._entry("packed", latents, layout)

    def offload_blocks(self):
        from diffrt.engine.weights.offload import transformer_blocks

        return transformer_blocks(self.eager_transformer)


def call_of(sizes: list[tuple[int, int]], loras: tuple = ()) -> RowsCall:
    layout = RowLayout.join([RowLayout.uniform_rows(size, size[0] * size[1], 1, loras)
                             for size in sizes])
    rows, longest = len(sizes), layout.longest
    return RowsCall(torch.zeros(rows, longest, 4), torch.ones(rows), torch.zeros(rows, 3, 4),
                    torch.zeros(rows, 4), torch.ones(rows), layout)


def test_the_layers_compose_in_the_declared_order():
    assert CALL_LAYERS == (BlockOffload, RowsBySize, LoraRows, StepCache, RowsPacked,
                           RowsPadded, SequenceShard)
    call, chain = build_call(Host()), []
    while not isinstance(call, FamilyCall):
        chain.append(type(call))
        call = call.inner
    assert tuple(chain) == CALL_LAYERS


def test_rows_of_one_size_reach_the_family_forward_whatever_the_arrangement():
    for arrangement in ("padded", "by_size", "packed"):
        host = Host(arrangement)
        build_call(host)(call_of([(2, 2), (2, 2)]))
        assert host.reached == [("forward", (4, 4))]


def test_each_arrangement_of_mixed_rows_is_its_layer():
    sizes = [(2, 2), (2, 3), (2, 2)]
    host = Host("padded")
    out = build_call(host)(call_of(sizes))
    assert host.reached == [("padded", (4, 6, 4))] and out.shape == (3, 6, 4)
    host = Host("packed")
    build_call(host)(call_of(sizes))
    assert host.reached == [("packed", (4, 6, 4))]
    host = Host("packed", packs_rows=False)  # a family without a packed forward: padded
    build_call(host)(call_of(sizes))
    assert host.reached == [("padded", (4, 6, 4))]
    host = Host("by_size")
    out = build_call(host)(call_of(sizes))
    assert host.reached == [("forward", (4, 4)), ("forward", (6,))]
    assert torch.equal(out[[0, 2], :4], torch.ones(2, 4, 4))
    assert torch.equal(out[1], torch.ones(6, 4)) and torch.equal(out[0, 4:], torch.zeros(2, 4))


def test_packed_rows_with_adapters_go_on_to_the_padded_call():
    host = Host("packed")
    build_call(host)(call_of([(2, 2), (2, 3)], loras=((0, 1.0),)))
    assert host.reached == [("padded", (4, 6))]


class Split:
    """A sequence split's calls (``SequenceSplit``'s interface), recorded."""

    def __init__(self):
        self.events: list[str] = []
        self.active, self.text_len = False, 0

    def begin(self, tokens: int) -> bool:
        self.events.append(f"begin {tokens}")
        self.active = True
        return True

    def end(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        self.events.append(f"end {self.text_len}")
        self.active = False
        return x


def test_the_sequence_layer_begins_and_ends_one_size_calls_only():
    host = Host("padded")
    host.sequence_split = split = Split()
    build_call(host)(call_of([(2, 2), (2, 2)]))
    assert split.events == ["begin 4", "end 3"] and not split.active
    build_call(host)(call_of([(2, 2), (2, 3)]))  # a padded call runs whole
    assert split.events == ["begin 4", "end 3"]


def test_the_sequence_layer_installs_the_family_hooks_once(monkeypatch):
    from diffrt.engine.pipelines import transformer_call

    class Family(Host):
        def __init__(self):
            super().__init__()
            self.hooked: list[object] = []

        def sequence_hooks(self, split):
            self.hooked.append(split)

    made = []
    monkeypatch.setattr(transformer_call, "SequenceSplit",
                        lambda group, attend: made.append((group, attend)) or Split())
    host, group, attend = Family(), object(), object()
    split = SequenceShard.install(host, group, attend)
    assert made == [(group, attend)]
    assert host.sequence_split is split and host.hooked == [split]


def test_the_offload_layer_installs_and_removes_its_block_hooks():
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return x

    host = Host()
    host.eager_transformer = model = Model()
    x = torch.randn(2, 4)
    expected = model(x)
    offload = BlockOffload.install(host, CpuPlatform(), 1, torch.device("cpu"))
    assert host.offload is offload
    assert all(block._forward_pre_hooks for block in model.blocks)
    assert torch.equal(model(x), expected)
    BlockOffload.remove(host)
    assert host.offload is None
    assert not any(block._forward_pre_hooks for block in model.blocks)
