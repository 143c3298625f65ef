"""Loading a diffusers folder one component at a time, with progress.

A FLUX.1 folder is 30+ GB (the transformer 24 GB, T5-XXL 9.5 GB); loading it
takes minutes, and a start-up that prints nothing for minutes looks hung. So
each weight component is loaded by its own class (what diffusers'
``DiffusionPipeline.from_pretrained`` would call for it: the class named in
model_index.json, the component's subfolder, the dtype) with a line on the
``diffrt.load`` logger before and after, and the components are then handed
to the family's diffusers pipeline, which loads only what is left (tokenizers,
scheduler). The libraries' own progress bars are turned off meanwhile: from a
worker they interleave with other processes' output on one terminal.

The lines are INFO for a checkpoint of ``PROGRESS_BYTES`` or more and DEBUG
below (the embedded tiny models load in a blink). The CLI and the workers show
``diffrt.load`` at INFO whatever the other loggers' level.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import os
import re
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from diffrt.engine.models.folder_check import JsonObject, read_json_object

if TYPE_CHECKING:
    from diffusers import DiffusionPipeline as DiffusersPipeline

#: The logger of loading progress (shown by the CLI and the server).
PROGRESS_LOGGER = "diffrt.load"
logger = logging.getLogger(PROGRESS_LOGGER)

#: Checkpoints at least this large (1 GB) report each component at INFO.
PROGRESS_BYTES = 10**9

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf")
#: "model.fp16.safetensors", "model.fp16-00001-of-00002.safetensors": variants
#: that the default load (no ``variant=``) leaves alone.
_VARIANT = re.compile(r"\.(fp16|bf16|fp32|ema|non_ema)[.-]")


def component_bytes(folder: str, name: str) -> int:
    """Bytes of the weight files a default load reads from ``folder/name`` (0
    for tokenizers and schedulers): no variants, and only safetensors where a
    component ships both safetensors and pickles, as diffusers prefers."""
    sub = os.path.join(folder, name)
    if not os.path.isdir(sub):
        return 0
    files = [f for f in os.listdir(sub) if f.endswith(_WEIGHT_SUFFIXES) and not _VARIANT.search(f)]
    if any(f.endswith(".safetensors") for f in files):
        files = [f for f in files if f.endswith(".safetensors")]
    return sum(os.path.getsize(os.path.join(sub, f)) for f in files)


def weight_components(folder: str) -> list[tuple[str, str, str, int]]:
    """(name, library, class, bytes) of each component with weights, in the
    order model_index.json lists them."""
    index = read_json_object(os.path.join(folder, "model_index.json"))
    out = []
    for name, entry in index.items():
        if name.startswith("_") or not isinstance(entry, list) or len(entry) != 2:
            continue
        library, class_name = entry
        if library is None or class_name is None:
            continue
        size = component_bytes(folder, name)
        if size:
            out.append((name, library, class_name, size))
    return out


def format_bytes(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


@contextlib.contextmanager
def library_bars_off() -> Iterator[None]:
    """diffusers' and transformers' tqdm bars off (restored afterwards)."""
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    was = (diffusers_logging.is_progress_bar_enabled(),
           transformers_logging.is_progress_bar_enabled())
    diffusers_logging.disable_progress_bar()
    transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was[0]:
            diffusers_logging.enable_progress_bar()
        if was[1]:
            transformers_logging.enable_progress_bar()


def _diffusers_pipeline_class(name: str) -> type[DiffusersPipeline]:
    """``diffusers.<name>``. Importing a pipeline module makes transformers warn
    that the image processors of IP-adapters want torchvision; text-to-image
    never builds one, so that warning is held back (only during the import)."""
    import diffusers
    from transformers.utils import logging as transformers_logging

    verbosity = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()
    try:
        return getattr(diffusers, name)
    finally:
        transformers_logging.set_verbosity(verbosity)


def load_diffusers_pipeline(folder: str, pipeline_class: str, *, dtype: torch.dtype,
                            preloaded: JsonObject | None = None) -> DiffusersPipeline:
    """``diffusers.<pipeline_class>.from_pretrained(folder)`` offline in
    ``dtype``, reporting each weight component as it loads; ``preloaded``:
    components the family loaded its own way (given to ``from_pretrained``)."""
    from diffrt.engine.models.gguf_file import gguf_path, load_gguf

    components = weight_components(folder)
    total = sum(size for *_, size in components)
    level = logging.INFO if total >= PROGRESS_BYTES else logging.DEBUG
    logger.log(level, "loading %s: %d components with weights, %s", folder, len(components),
               format_bytes(total))
    start = time.monotonic()
    loaded: JsonObject = dict(preloaded or {})
    pipeline_cls = _diffusers_pipeline_class(pipeline_class)
    with library_bars_off():
        for i, (name, library, class_name, size) in enumerate(components, 1):
            logger.log(level, "[%d/%d] %s (%s, %s)...", i, len(components), name, class_name,
                       format_bytes(size))
            began = time.monotonic()
            if importlib.util.find_spec(library) is None:
                # a component of one of diffusers' pipeline packages (LTX-2's
                # ["ltx2", "LTX2Vocoder"]): from_pretrained resolves it itself
                continue
            cls = getattr(importlib.import_module(library), class_name)
            sub = os.path.join(folder, name)

            if gguf_path(sub) is not None:  # quantised blocks, dequantised per layer
                loaded[name] = load_gguf(cls, sub, dtype)
            else:
                loaded[name] = cls.from_pretrained(sub, dtype=dtype, local_files_only=True)
            logger.log(level, "[%d/%d] %s loaded in %.1f s", i, len(components), name,
                       time.monotonic() - began)
        pipeline = pipeline_cls.from_pretrained(
            folder, dtype=dtype, local_files_only=True, **loaded)
    logger.log(level, "loaded %s in %.1f s", folder, time.monotonic() - start)
    return pipeline
