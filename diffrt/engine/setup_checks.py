"""The dry run of the worker's set-up plan: what each step would refuse.

``worker_setup.PLAN`` pairs each step that can fail with a check here, run in
the engine process when the engine starts (``EngineConfig.executor_config``),
before any worker loads weights: the same settings, the same platform, the
model's folder read for what it holds (saved methods, weights' sizes), and an
``EngineConfigError`` naming the field. ``EngineConfig`` itself reads no
folder: these checks are where the configuration meets the model on disk.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from diffrt.engine.errors import EngineConfigError
from diffrt.engine.model_spec import ModelSpec
from diffrt.engine.settings import ModelConfig

if TYPE_CHECKING:
    import torch

    from diffrt.platforms.interface import Platform



def resolve_dtype(name: str, platform: Platform) -> torch.dtype:
    """``"auto"``: float32 on CPU; elsewhere bfloat16 where the device computes
    in it natively (``Platform.bf16_supported``: not the emulated bfloat16 of
    T4/V100 or Arc A-series), else float16."""
    import torch  # here: the engine process imports this module before it needs torch

    if name != "auto":
        return {"float32": torch.float32, "float16": torch.float16,
                "bfloat16": torch.bfloat16}[name]
    if platform.device_type == "cpu":
        return torch.float32
    try:
        supported = bool(platform.bf16_supported())
    except Exception:  # a backend that cannot tell: the safe half type
        supported = False
    return torch.bfloat16 if supported else torch.float16


def usable_methods(spec: ModelSpec, platform: Platform) -> list[str]:
    """The weight methods of ``spec`` that ``platform`` runs, with what is
    installed (torchao's: ``int8``, ``fp8``)."""
    from diffrt.engine.weights.quantize import torchao_available

    torchao = torchao_available()
    return [q for q in spec.quantization
            if (q != "fp8" or platform.fp8_matmul_supported())
            and (q != "fp8-storage" or platform.fp8_storage_refusal is None)
            and (q not in ("int8", "fp8") or torchao)]


def check_saved_methods(m: ModelConfig, spec: ModelSpec) -> None:
    """A folder whose components are saved quantised (torchao, through
    diffusers' ``TorchAoConfig``, or GGUF) loads as saved: converting them
    again is refused, and they need their library."""
    if spec.folder is None:
        return
    from diffrt.engine.weights.prequantized import folder_methods
    from diffrt.engine.weights.quantize import TORCHAO_MISSING, torchao_available

    saved = folder_methods(spec.folder)
    for name, method in saved.items():
        field = ("quantization" if name == "transformer" else
                 "text_encoder_quantization" if name.startswith("text_encoder") else None)
        if field is not None and getattr(m, field) != "none":
            raise EngineConfigError(field, (
                f"the folder's {name} is saved quantised ({method}) and loads as "
                f"saved: leave {field}='none'"))
        if name == "transformer" and m.offload == "layerwise":
            raise EngineConfigError("offload", (
                f"the folder's transformer is saved quantised ({method}): its "
                "quantised tensor subclasses do not pack into layer-wise slots; use "
                "offload='model'"))
    listed = ", ".join(f"{n}: {m_}" for n, m_ in saved.items())
    if any(m_ != "gguf" for m_ in saved.values()) and not torchao_available():
        raise EngineConfigError("model", f"{m.model!r} is saved quantised ({listed}); "
                                f"{TORCHAO_MISSING}")
    if "gguf" in saved.values():
        from diffrt.engine.models.gguf_file import GGUF_MISSING, gguf_available

        if not gguf_available():
            raise EngineConfigError("model", f"{m.model!r} ships GGUF weights "
                                    f"({listed}); {GGUF_MISSING}")


# -- one check per plan step (group, spec, platform) ---------------------------------------
def check_weights(m: ModelConfig, spec: ModelSpec, platform: Platform) -> None:
    """``fp8`` only where the device multiplies float8, in bfloat16; a folder
    saved in fp8 likewise."""
    if m.quantization == "fp8" and not platform.fp8_matmul_supported():
        raise EngineConfigError("quantization", (
            f"fp8 needs float8 matmuls, which {platform.device_type} does not have "
            "(CUDA compute capability 8.9+; ROCm MI300, or MI350 with ROCm 6.5+); int8 "
            "runs everywhere"))
    for field in ("quantization", "text_encoder_quantization"):
        if getattr(m, field) == "fp8-storage" and (
                cannot_cast := platform.fp8_storage_refusal):
            raise EngineConfigError(field, (
                f"fp8-storage keeps weights in float8 e4m3 and casts them on the "
                f"{platform.device_type} at each call; {cannot_cast}: use int8 or none"))
    if spec.folder is not None:
        from diffrt.engine.weights.prequantized import folder_methods

        saved = folder_methods(spec.folder)
        if "fp8" in saved.values() and not platform.fp8_matmul_supported():
            raise EngineConfigError("model", (
                f"{m.model!r} is saved with fp8 weights (float8 matmuls), which "
                f"{platform.device_type} does not have"))
    if m.quantization == "fp8":
        import torch

        dtype = resolve_dtype(m.dtype, platform)
        if dtype is not torch.bfloat16:
            raise EngineConfigError("quantization", (
                f"fp8's per-row scales (torchao) take bfloat16 weights; dtype {m.dtype!r} "
                f"is {str(dtype).removeprefix('torch.')} here: use dtype='bfloat16' or "
                "int8"))


#: the video families whose pipelines offload every transformer they hold
#: (Wan: both of Wan 2.2's experts, one on the device at a time)
OFFLOADING_VIDEO_FAMILIES = ("wan",)


def check_offload(m: ModelConfig, spec: ModelSpec, platform: Platform) -> None:
    """Offload moves weights from host to device memory: not where they are
    one; on video, in the families that offload all their transformers."""
    if m.offload != "none" and spec.frame_factor and spec.family not in OFFLOADING_VIDEO_FAMILIES:
        raise EngineConfigError("offload", (
            f"{spec.name} is a video model: offload does not run on its family's video yet; "
            "use offload='none'"))
    if m.offload != "none" and platform.host_is_device:
        what = "blocks" if m.offload == "layerwise" else "components"
        raise EngineConfigError("offload", (
            f"{m.offload} offload moves {what} from host to device memory; on "
            f"{platform.name} the host is the device"))


def check_memory(m: ModelConfig, spec: ModelSpec, platform: Platform) -> None:
    """The weights' estimate (from the folder's headers, as the earlier steps
    leave them) within ``device_memory_budget``."""
    if m.device_memory_budget is None or spec.folder is None:
        return
    from diffrt.engine.memory_estimate import value_bytes
    from diffrt.engine.weights.budget import components, device_bytes, refusal, weight_settings

    size = value_bytes(m.dtype, platform)
    host_is_device = platform.host_is_device
    chosen = weight_settings(m)
    if host_is_device:  # offload_text_encoders does nothing there
        chosen["offload_text_encoders"] = False
    need = device_bytes(components(spec.folder), size, chosen)
    if need > m.device_memory_budget:
        raise EngineConfigError("device_memory_budget", refusal(
            need, m.device_memory_budget, spec.folder, size, current=chosen,
            methods=usable_methods(spec, platform), host_is_device=host_is_device))


__all__ = ["check_memory", "check_offload", "check_saved_methods",
           "check_weights", "resolve_dtype", "usable_methods"]
