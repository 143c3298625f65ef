"""A complete tiny Qwen-Image-Edit folder, built locally and deterministically.

``build_tiny_qwen_image_edit_folder`` writes the layout of Qwen/Qwen-Image-Edit:
the components of the tiny Qwen-Image folder (``tiny/qwen_image.py``: transformer,
VAE, scheduler, a Qwen2.5-VL text encoder whose vision tower now sees the
input image, the tokenizer) plus a ``processor`` (``Qwen2VLProcessor``: the
same tokenizer and a ``Qwen2VLImageProcessor``). ``QwenImageEditPipeline``,
``QwenImageEditPlusPipeline`` and ``QwenImageEditInpaintPipeline`` all take
these six components, so one folder serves the three; ``plus=True`` names the
Plus pipeline in model_index.json, as Qwen-Image-Edit-2509 does, and
``zero_cond_t=True`` gives the transformer of Qwen-Image-Edit-2511 (the image
condition's tokens modulated at timestep 0).

The edit pipelines wrap a prompt in their own template (a longer system
prompt, then ``<|vision_start|><|image_pad|><|vision_end|>`` before the
instruction) and drop its first 64 tokens, through ``<|im_start|>user\\n``;
the tokenizer learns that template's words too, so both the text-to-image
prefix (34 tokens) and the edit prefix (64) come out right, and
``build_qwen_tokenizer`` checks both counts.

The image processor is sized for tiny inputs: the pipelines hand the VL
encoder the image at about 1024x1024 (Edit) or 384x384 (Plus) pixels, and at
most 64x64 pixels (``max_pixels``) it becomes 56x56, 4x4 patches of 14 pixels,
4 image tokens after the 2x2 merge. Loading the processor needs torchvision
in transformers 5; ``vl_processor.load_vl_processor`` loads it without.

The input image shows in the output through the VL encoder (its tokens are
part of the prompt embeddings, which ``QWEN_BOOST`` amplifies): 64x64 outputs
for different input images differ by 9/255 on average. The VAE path carries
almost nothing (0.004/255 with the VL input held fixed): the tiny random VAE
gives nearly the same latents for any image, and the transformer's attention
barely reaches the image tokens; a parity test that drops the image latents
would not see it.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from diffrt.engine.models.tiny.qwen_image import (
    _TEMPLATE_WORDS,
    QWEN_IMAGE_COMPONENTS,
    QWEN_TEMPLATE,
    TEMPLATE_DROP,
    TINY_QWEN_VISION,
    build_qwen_tokenizer,
    save_qwen_models,
    template_prefix,
)
from diffrt.engine.models.tiny.shared import ComponentConfig, _write_index

if TYPE_CHECKING:
    from transformers import Qwen2Tokenizer

#: QwenImageEditPipeline's prompt template and the tokens it drops (its
#: ``prompt_template_encode`` / ``prompt_template_encode_start_idx``; the Plus
#: pipeline has the same system prefix and puts "Picture N: " + the vision
#: tokens of each image before the prompt instead)
EDIT_TEMPLATE = (
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, "
    "texture, objects, background), then explain how the user's text instruction should alter "
    "or modify the image. Generate a new image that meets the user's requirements while "
    "maintaining consistency with the original input where appropriate.<|im_end|>\n"
    "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>{}<|im_end|>\n"
    "<|im_start|>assistant\n")
EDIT_TEMPLATE_DROP = 64
#: the words and punctuation runs of the edit prefix ("(", "),", "'s" ...), in order
_EDIT_TEMPLATE_WORDS = tuple(dict.fromkeys(re.findall(
    r"'s|[A-Za-z]+|[^\sA-Za-z]+", re.sub(r"<\|\w+\|>", " ", template_prefix(EDIT_TEMPLATE)))))

#: Qwen2VLImageProcessor settings: patches as the tiny vision tower cuts them,
#: images of at most 64x64 pixels (4 tokens for a square one)
TINY_VL_IMAGE_PROCESSOR: ComponentConfig = dict(
    min_pixels=28 * 28,
    max_pixels=64 * 64,
    patch_size=TINY_QWEN_VISION["patch_size"],
    temporal_patch_size=TINY_QWEN_VISION["temporal_patch_size"],
    merge_size=TINY_QWEN_VISION["spatial_merge_size"],
)

#: Qwen2-VL's chat format (``processor.apply_chat_template``; the pipelines
#: format their own template and do not use it)
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

#: a Qwen-Image-Edit folder's components (model_index.json)
QWEN_IMAGE_EDIT_COMPONENTS: dict[str, tuple[str, str]] = {
    **QWEN_IMAGE_COMPONENTS, "processor": ("transformers", "Qwen2VLProcessor")}


def build_edit_tokenizer(folder: str | os.PathLike) -> Qwen2Tokenizer:
    """The tiny Qwen tokenizer, its merges learned from both templates' words."""
    return build_qwen_tokenizer(
        folder, templates=((QWEN_TEMPLATE, TEMPLATE_DROP), (EDIT_TEMPLATE, EDIT_TEMPLATE_DROP)),
        template_words=tuple(dict.fromkeys((*_TEMPLATE_WORDS, *_EDIT_TEMPLATE_WORDS))))


def save_vl_processor(folder: Path, tokenizer: Qwen2Tokenizer) -> None:
    """A ``Qwen2VLProcessor`` folder as Qwen's checkpoints lay it out
    (``preprocessor_config.json`` naming the processor class, the
    tokenizer's files, ``chat_template.jinja``), written part by part:
    transformers 5 cannot build the processor itself without torchvision."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    tokenizer.save_pretrained(folder)
    Qwen2VLImageProcessorPil(**TINY_VL_IMAGE_PROCESSOR).save_pretrained(folder)
    config_path = folder / "preprocessor_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["processor_class"] = "Qwen2VLProcessor"
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")


def build_tiny_qwen_image_edit_folder(path: str | os.PathLike, *, seed: int = 0, plus: bool = False,
                                      zero_cond_t: bool = False) -> Path:
    """A complete tiny Qwen-Image-Edit folder at ``path``: the edit pipelines
    load it offline (pass ``processor=load_vl_processor(path / "processor")``
    where torchvision is missing). ``plus``: model_index.json names
    ``QwenImageEditPlusPipeline``; ``zero_cond_t``: the 2511 transformer."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_edit_tokenizer(path / "tokenizer")
    save_vl_processor(path / "processor", tokenizer)
    save_qwen_models(path, tokenizer, seed=seed, zero_cond_t=zero_cond_t)
    _write_index(path, "QwenImageEditPlusPipeline" if plus else "QwenImageEditPipeline",
                 QWEN_IMAGE_EDIT_COMPONENTS)
    return path


__all__ = ["CHAT_TEMPLATE", "EDIT_TEMPLATE", "EDIT_TEMPLATE_DROP", "QWEN_IMAGE_EDIT_COMPONENTS",
           "TINY_VL_IMAGE_PROCESSOR", "build_edit_tokenizer", "build_tiny_qwen_image_edit_folder",
           "save_vl_processor"]
