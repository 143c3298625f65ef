"""Log filters that keep prompt text out of the logs.

diffusers' Flux and SD3 pipelines warn, on every prompt longer than a text
encoder takes, with the cut-off part of the prompt itself ("The following
part of your input was truncated because ...: ['...']"): a client sending long
prompts fills the disk at twice its request bytes and discloses prompts to
whoever reads the log. ``install`` turns each such warning into one DEBUG
line with the limit and the number of prompts cut — never their text — and
drops it unless DEBUG is on for that logger.

A leaf (standard library only): the worker's and the CLI's logging set-up
install it; the loggers are named before the libraries are imported, so the
order does not matter.
"""

from __future__ import annotations

import ast
import logging
import re

#: the loggers of the diffusers pipelines whose encode_prompt diffrt calls
TRUNCATION_LOGGERS = (
    "diffusers.pipelines.flux.pipeline_flux",
    "diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3",
)
_TRUNCATED = re.compile(r"The following part of your input was truncated because (.*?) "
                        r"(\d+) tokens: (.*)", re.S)


class PromptTruncationFilter(logging.Filter):
    """Replaces a truncation warning's prompt text by a count (see the module)."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a record that cannot be formatted is not ours to judge
            return True
        match = _TRUNCATED.match(message)
        if match is None:
            return True
        if not logging.getLogger(record.name).isEnabledFor(logging.DEBUG):
            return False
        why, limit, removed = match.groups()
        record.msg = "%d prompt(s) cut at %s tokens (%s; the cut text is not logged)"
        record.args = (_count(removed), limit, why.replace("`", ""))
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return True


def _count(removed: str) -> int:
    """The prompts that lost text, from the printed list (1 if unreadable)."""
    try:
        parts = ast.literal_eval(removed.strip())
    except (ValueError, SyntaxError):
        return 1
    return sum(1 for part in parts if str(part).strip()) if isinstance(parts, list) else 1


_FILTER = PromptTruncationFilter()


def install() -> None:
    """Add the filter to the truncation loggers (idempotent)."""
    for name in TRUNCATION_LOGGERS:
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)
