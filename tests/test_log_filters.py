"""No prompt text in the logs: diffusers' truncation warning becomes one DEBUG
line with a count (issue 27 item 8)."""

from __future__ import annotations

import contextlib
import logging

from diffrt import log_filters
from diffrt.engine import DiffusionRequest, SamplingParams

FLUX_LOGGER = "diffusers.pipelines.flux.pipeline_flux"


@contextlib.contextmanager
def records(name: str, level: int):
    """What logger ``name`` emits at ``level`` (diffusers' loggers do not
    propagate to the root, where caplog listens)."""
    got: list[logging.LogRecord] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = got.append  # type: ignore[method-assign]
    logger = logging.getLogger(name)
    old = logger.level
    logger.addHandler(handler)
    logger.setLevel(level)
    try:
        yield got
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)


def test_a_truncation_warning_keeps_its_count_not_its_text():
    log_filters.install()
    message = ("The following part of your input was truncated because `max_sequence_length` "
               "is set to  16 tokens: ['secret words here', '']")
    with records(FLUX_LOGGER, logging.WARNING) as got:
        logging.getLogger(FLUX_LOGGER).warning(message)
    assert got == []  # at WARNING: nothing
    with records(FLUX_LOGGER, logging.DEBUG) as got:
        logging.getLogger(FLUX_LOGGER).warning(message)
        logging.getLogger(FLUX_LOGGER).warning("another warning")
    assert [r.levelno for r in got] == [logging.DEBUG, logging.WARNING]
    line = got[0].getMessage()
    assert "secret" not in line and "1 prompt(s) cut at 16 tokens" in line


def test_a_long_prompt_leaves_no_text_in_the_log(flux_step_engine):
    """The real warning, from diffusers' Flux pipeline encoding a long prompt."""
    log_filters.install()
    prompt = "zebraword " * 300
    with records(FLUX_LOGGER, logging.DEBUG) as got:
        out = flux_step_engine.generate(DiffusionRequest(prompt=prompt, sampling_params=(
            SamplingParams(height=32, width=32, num_inference_steps=1, seed=0))))
    assert out.ok, out.error
    lines = [r.getMessage() for r in got]
    assert lines and all("cut at" in line for line in lines), lines
    assert not any("zebraword" in line for line in lines)
