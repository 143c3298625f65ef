"""Log filters that keep prompt text — and import-time noise — out of the logs.

diffusers' Flux and SD3 pipelines warn, on every prompt longer than a text
encoder takes, with the cut-off part of the prompt itself ("The following
part of your input was truncated because ...: ['...']"): a client sending long
prompts fills the disk at twice its request bytes and discloses prompts to
whoever reads the log. ``install`` drops each such warning. What was cut is
reported instead by the pipeline runner, once per request, as counts of
tokens per text encoder: at DEBUG and in the request's
``RequestMetrics.prompt_tokens_dropped`` — never the text.

torchao (the ``int8`` / ``fp8`` weights), once installed, is imported by
diffusers in every process, and on a host without CUDA kernels or triton it
warns about each library it cannot load; diffusers 0.42 then warns it cannot
find classes torchao 0.18 moved (needed only to unpickle torchao
checkpoints, which diffrt does not load), and torch warns about an enum
torchao registers. None concerns what diffrt runs: ``install`` drops those
exact messages (``IMPORT_NOISE``), nothing else from those loggers.

A leaf (standard library only): the worker's and the CLI's logging set-up
install it; the loggers are named before the libraries are imported, so the
order does not matter.
"""

from __future__ import annotations

import logging

#: the loggers of the diffusers pipelines whose encode_prompt diffrt calls
TRUNCATION_LOGGERS = (
    "diffusers.pipelines.flux.pipeline_flux",
    "diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3",
)
_TRUNCATED = "The following part of your input was truncated because"


class PromptTruncationFilter(logging.Filter):
    """Drops diffusers' truncation warnings, which quote the cut text (see the module)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (isinstance(record.msg, str) and record.msg.startswith(_TRUNCATED))


#: logger -> the starts of the import-time warnings dropped there (see the module)
IMPORT_NOISE = {
    "torchao": ("Failed to load ", "Skipping import of cpp extensions"),
    "torchao.kernel.intmm": ("Warning: Detected no triton",),
    "diffusers.quantizers.torchao.torchao_quantizer": ("Unable to import `torchao` Tensor",),
    "torch.utils._pytree": ("%s is an Enum subclass and is now natively supported",),
}


class ImportNoiseFilter(logging.Filter):
    """Drops the messages of one logger that start with ``starts``."""

    def __init__(self, starts: tuple[str, ...]):
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not (isinstance(record.msg, str) and record.msg.startswith(self.starts))


_FILTER = PromptTruncationFilter()
_NOISE = {name: ImportNoiseFilter(starts) for name, starts in IMPORT_NOISE.items()}


def install() -> None:
    """Add the filters to their loggers (idempotent)."""
    for name in TRUNCATION_LOGGERS:
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)
    for name, noise in _NOISE.items():
        logger = logging.getLogger(name)
        if noise not in logger.filters:
            logger.addFilter(noise)
