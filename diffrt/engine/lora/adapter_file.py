"""Reading one LoRA adapter file into the low-rank factors diffrt applies.

The file is read by the family's own diffusers pipeline class
(``<Pipeline>.lora_state_dict``), which accepts every format diffusers'
``load_lora_weights`` accepts for it — diffusers/PEFT files, and for Flux the
kohya, xlabs and other community layouts it converts — so diffrt writes no
converter. What ``load_lora_weights`` would then do with the transformer's
part (diffusers ``PeftAdapterMixin.load_lora_adapter``: strip the
``transformer.`` prefix, turn old ``lora.down``/``lora.up`` names into PEFT's,
build a ``LoraConfig`` from the ranks, the alphas or the file's metadata) is
done here with the same diffusers and PEFT functions, but instead of wrapping
the model's layers in PEFT layers the factors are returned: for each targeted
linear layer ``A`` (rank, in), ``B`` (out, rank) and PEFT's scaling
(``lora_alpha / r``, or ``/ sqrt(r)`` with rsLoRA, the rank and alpha
resolved per module by PEFT's own pattern rule). The engine applies them
unmerged, per row (``row_lora``).

A model with a second transformer (Wan 2.2's low-noise expert,
``transformer_2``: its linears named ``transformer_2.<name>``) takes an
adapter for both experts as the folder Wan 2.2 adapters are released in —
``high_noise_model.safetensors`` for ``transformer`` and
``low_noise_model.safetensors`` for ``transformer_2`` — each file read as
diffusers' ``load_lora_weights`` reads it (the second as with
``load_into_transformer_2=True``); a single file changes ``transformer``
only, as ``load_lora_weights`` loads it by default.

Refused, naming the file and why: a file diffusers cannot read as a LoRA for
the family, one carrying text-encoder weights (diffrt keeps one prompt cache
for all adapters, so an adapter may only change the transformer), DoRA,
LoRA biases, LoKr and Flux Control LoRA norm layers (no batched kernel here),
a module the model lacks or the spec does not let adapters target, and
factors whose shapes do not fit the model's layer.
"""

from __future__ import annotations

import inspect
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from diffusers.loaders.lora_base import LoraBaseMixin


class AdapterFileError(ValueError):
    """A file that is not a LoRA adapter this model can serve (the message
    names the file and why)."""


@dataclass(frozen=True)
class ModuleFactors:
    """One linear layer's low-rank update: ``y += scaling * x A^T B^T``."""

    a: torch.Tensor  # (rank, in)
    b: torch.Tensor  # (out, rank)
    scaling: float

    @property
    def rank(self) -> int:
        return int(self.a.shape[0])


@dataclass(frozen=True)
class AdapterWeights:
    """An adapter as read from its file, on the host: module name -> factors."""

    path: str
    modules: dict[str, ModuleFactors]

    @property
    def rank(self) -> int:
        """The largest rank of any of its modules (its slot's rows)."""
        return max(f.rank for f in self.modules.values())

    @property
    def nbytes(self) -> int:
        return sum(f.a.numel() * f.a.element_size() + f.b.numel() * f.b.element_size()
                   for f in self.modules.values())


def target_matches(module: str, targets: tuple[str, ...]) -> bool:
    """PEFT's ``target_modules`` rule for a list of names: the module's full
    name is a target or ends with ``.<target>``."""
    return any(module == t or module.endswith(f".{t}") for t in targets)


#: a two-expert adapter's files in its folder (high noise: ``transformer``;
#: low noise: ``transformer_2``), as Wan 2.2 adapters are released
EXPERT_FILES = ("high_noise_model.safetensors", "low_noise_model.safetensors")
#: the second expert's linears' prefix in ``linears``
SECOND_EXPERT = "transformer_2."


def read_adapter(path: str, diffusers_pipeline: str, linears: dict[str, tuple[int, int]],
                 targets: tuple[str, ...]) -> AdapterWeights:
    """Read ``path`` (a file, or a folder holding diffusers'
    ``pytorch_lora_weights.safetensors``, or a two-expert adapter's
    ``EXPERT_FILES``) as an adapter for the transformer(s) of a
    ``diffusers.<diffusers_pipeline>`` model whose linear layers are
    ``linears`` (name -> (out, in)); raise ``AdapterFileError`` otherwise."""
    if not os.path.exists(path):
        raise AdapterFileError(f"{path}: no such file or folder")
    files = [os.path.join(path, name) for name in EXPERT_FILES]
    if not (os.path.isdir(path) and all(os.path.isfile(f) for f in files)):
        return _read_one(path, diffusers_pipeline, linears, targets)
    second = {name.removeprefix(SECOND_EXPERT): shape for name, shape in linears.items()
              if name.startswith(SECOND_EXPERT)}
    if not second:
        raise AdapterFileError(f"{path}: an adapter for two experts ({', '.join(EXPERT_FILES)}); "
                               "this model has one transformer")
    first = {name: shape for name, shape in linears.items()
             if not name.startswith(SECOND_EXPERT)}
    high = _read_one(files[0], diffusers_pipeline, first, targets)
    low = _read_one(files[1], diffusers_pipeline, second, targets)
    return AdapterWeights(path=path, modules={
        **high.modules, **{SECOND_EXPERT + name: f for name, f in low.modules.items()}})


def _read_one(path: str, diffusers_pipeline: str, linears: dict[str, tuple[int, int]],
              targets: tuple[str, ...]) -> AdapterWeights:
    """One file (or diffusers' folder) for the transformer whose linears are ``linears``."""
    import diffusers

    cls = getattr(diffusers, diffusers_pipeline)
    try:
        state, alphas, metadata = _state_dict(cls, path)
    except AdapterFileError:
        raise
    except Exception as exc:
        raise AdapterFileError(f"{path}: not a LoRA file diffusers reads for "
                               f"{diffusers_pipeline} ({type(exc).__name__}: {exc})") from None
    outside = sorted({key.split(".", 1)[0] for key in state if not key.startswith("transformer.")})
    if outside:
        raise AdapterFileError(
            f"{path}: carries weights for {', '.join(outside)}; diffrt serves adapters of the "
            "transformer only (its prompt cache is shared by all adapters)")
    try:
        return _factors(path, state, alphas, metadata, linears, targets)
    except AdapterFileError:
        raise
    except Exception as exc:
        raise AdapterFileError(f"{path}: cannot be applied ({type(exc).__name__}: {exc})") from None


def _state_dict(cls: type[LoraBaseMixin], path: str) -> tuple[dict[str, torch.Tensor], dict | None, dict | None]:
    """``cls.lora_state_dict`` with the metadata (and, where the family has
    them, kohya's alphas), as ``load_lora_weights`` calls it."""
    kwargs: dict[str, object] = {"return_lora_metadata": True, "local_files_only": True}
    if os.path.isfile(path):
        kwargs["weight_name"] = os.path.basename(path)
        path = os.path.dirname(path) or "."
    with_alphas = "return_alphas" in inspect.signature(cls.lora_state_dict).parameters
    if with_alphas:
        state, alphas, metadata = cls.lora_state_dict(path, return_alphas=True, **kwargs)
    else:
        (state, metadata), alphas = cls.lora_state_dict(path, **kwargs), None
    if not state or not any("lora" in key for key in state):
        raise AdapterFileError(f"{path}: holds no LoRA weights")
    return dict(state), alphas, metadata


def _factors(path: str, state: dict[str, torch.Tensor], alphas: dict | None,
             metadata: dict | None, linears: dict[str, tuple[int, int]],
             targets: tuple[str, ...]) -> AdapterWeights:
    from diffusers.utils.peft_utils import _create_lora_config
    from diffusers.utils.state_dict_utils import convert_unet_state_dict_to_peft
    from peft.utils.other import get_pattern_key

    prefix = "transformer."
    state = {k.removeprefix(prefix): v for k, v in state.items()}
    if metadata:
        metadata = {k.removeprefix(prefix): v for k, v in metadata.items()
                    if k.startswith(prefix)} or None
    if alphas:
        alphas = {k.removeprefix(prefix): v for k, v in alphas.items()
                  if k.startswith(prefix)} or None
    if alphas and metadata:
        raise AdapterFileError(f"{path}: carries both network alphas and PEFT metadata")
    for kind in ("lokr_", "lora_magnitude_vector", "lora_controlnet"):
        if any(kind in key for key in state):
            raise AdapterFileError(f"{path}: a {kind.strip('_')} adapter; diffrt serves plain LoRA")
    if "lora_A" not in next(iter(state)):
        state = convert_unet_state_dict_to_peft(state)
    others = sorted(k for k in state if not k.endswith((".lora_A.weight", ".lora_B.weight")))
    if others:
        raise AdapterFileError(f"{path}: weights other than LoRA factors ({', '.join(others[:3])}"
                               f"{' ...' if len(others) > 3 else ''}); diffrt serves plain LoRA")
    ranks = {f"^{k}": v.shape[1] for k, v in state.items() if k.endswith(".lora_B.weight")}
    config = _create_lora_config(state, alphas, metadata, ranks, model_state_dict=None,
                                 adapter_name="diffrt")
    if getattr(config, "use_dora", False) or getattr(config, "lora_bias", False):
        raise AdapterFileError(f"{path}: DoRA or LoRA biases; diffrt serves plain LoRA")
    modules: dict[str, ModuleFactors] = {}
    for name in sorted({k.rsplit(".lora_", 1)[0] for k in state}):
        if name not in linears:
            raise AdapterFileError(f"{path}: targets {name!r}, which is not a linear layer of "
                                   "this model's transformer (an adapter for another model?)")
        if not target_matches(name, targets):
            raise AdapterFileError(f"{path}: targets {name!r}; this model's adapters may target "
                                   f"{', '.join(targets)}")
        a, b = state.get(f"{name}.lora_A.weight"), state.get(f"{name}.lora_B.weight")
        if a is None or b is None:
            raise AdapterFileError(f"{path}: {name} has only one of lora_A and lora_B")
        out_features, in_features = linears[name]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_features or b.shape[0] != out_features \
                or a.shape[0] != b.shape[1]:
            raise AdapterFileError(
                f"{path}: {name} factors {tuple(b.shape)} x {tuple(a.shape)} do not fit the "
                f"model's layer ({out_features} x {in_features}); an adapter for another model?")
        r = config.rank_pattern.get(get_pattern_key(config.rank_pattern.keys(), name), config.r)
        alpha = config.alpha_pattern.get(get_pattern_key(config.alpha_pattern.keys(), name),
                                         config.lora_alpha)
        scaling = alpha / math.sqrt(r) if config.use_rslora else alpha / r
        if not math.isfinite(scaling):
            raise AdapterFileError(f"{path}: {name} has a scaling of {scaling}")
        modules[name] = ModuleFactors(a.detach().contiguous(), b.detach().contiguous(),
                                      float(scaling))
    if not modules:
        raise AdapterFileError(f"{path}: holds no LoRA weights for the transformer")
    return AdapterWeights(path=path, modules=modules)


__all__ = ["EXPERT_FILES", "AdapterFileError", "AdapterWeights", "ModuleFactors", "read_adapter",
           "target_matches"]
