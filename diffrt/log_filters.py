"""Log filters that keep prompt text out of the logs.

diffusers' Flux and SD3 pipelines warn, on every prompt longer than a text
encoder takes, with the cut-off part of the prompt itself ("The following
part of your input was truncated because ...: ['...']"): a client sending long
prompts fills the disk at twice its request bytes and discloses prompts to
whoever reads the log. ``install`` drops each such warning. What was cut is
reported instead by the pipeline runner, once per request, as counts of
tokens per text encoder: at DEBUG and in the request's
``RequestMetrics.prompt_tokens_dropped`` — never the text.

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


_FILTER = PromptTruncationFilter()


def install() -> None:
    """Add the filter to the truncation loggers (idempotent)."""
    for name in TRUNCATION_LOGGERS:
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)
