"""The ``processor`` of a Qwen-Image-Edit folder, loadable without torchvision.

diffusers' ``QwenImageEditPipeline`` (and its Plus and inpaint variants)
take a ``Qwen2VLProcessor``: the tokenizer plus a ``Qwen2VLImageProcessor``
that cuts an image into 14x14 patches and expands each ``<|image_pad|>`` of
the prompt into one token per 2x2 merged patches. In transformers 5 that
processor also holds a video processor, and video processors need
torchvision: without it ``Qwen2VLProcessor(...)`` and
``Qwen2VLProcessor.from_pretrained(...)`` raise (the ``video_processor``
argument cannot even be checked), so diffusers cannot load such a folder.
PyPI's torchvision wheels are built for torch's CUDA builds and do not
import beside the CPU build the project pins.

``load_vl_processor`` returns the real ``Qwen2VLProcessor`` where torchvision
is installed, and otherwise ``ImageOnlyQwen2VLProcessor``: the same class
without its video half, with the PIL backend of the image processor (the
pipelines never pass videos). Pass it to ``from_pretrained(folder,
processor=...)``. The PIL and torchvision backends resize differently, so
pixel values (not token counts) may differ slightly between the two.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from transformers import Qwen2VLProcessor

if TYPE_CHECKING:
    from transformers import BaseImageProcessor, PreTrainedTokenizerBase


class ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):
    """``Qwen2VLProcessor`` with an image processor and a tokenizer only.

    transformers reads a processor's parts from its ``__init__`` signature,
    so this one neither loads nor checks a video processor; text and images
    go through ``Qwen2VLProcessor.__call__`` unchanged.
    """

    def __init__(self, image_processor: BaseImageProcessor | None = None,
                 tokenizer: PreTrainedTokenizerBase | None = None,
                 chat_template: str | None = None, **kwargs: object) -> None:
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)


def load_vl_processor(path: str | os.PathLike) -> Qwen2VLProcessor:
    """The processor saved at ``path`` (a folder's ``processor/``), offline:
    ``Qwen2VLProcessor`` with torchvision, ``ImageOnlyQwen2VLProcessor``
    (PIL image backend) without."""
    from transformers.utils import is_torchvision_available

    if is_torchvision_available():
        return Qwen2VLProcessor.from_pretrained(path, local_files_only=True)
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    template = os.path.join(path, "chat_template.jinja")
    chat_template = None
    if os.path.isfile(template):
        with open(template, encoding="utf-8") as f:
            chat_template = f.read()
    return ImageOnlyQwen2VLProcessor(
        Qwen2VLImageProcessorPil.from_pretrained(path, local_files_only=True),
        AutoTokenizer.from_pretrained(path, local_files_only=True),
        chat_template=chat_template)


__all__ = ["ImageOnlyQwen2VLProcessor", "load_vl_processor"]
