"""No prompt text in the logs: diffusers' truncation warning, which quotes the
cut text, is dropped (issue 27 item 8; the counts that replace it are
``tests/engine/test_prompt_cuts.py``'s)."""

from __future__ import annotations

import contextlib
import logging

from diffrt import log_filters

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


def test_a_truncation_warning_is_dropped_at_every_level():
    log_filters.install()
    log_filters.install()  # idempotent
    message = ("The following part of your input was truncated because `max_sequence_length` "
               "is set to  16 tokens: ['secret words here', '']")
    for level in (logging.WARNING, logging.DEBUG):
        with records(FLUX_LOGGER, level) as got:
            logging.getLogger(FLUX_LOGGER).warning(message)
            logging.getLogger(FLUX_LOGGER).warning("another warning")
        assert [r.getMessage() for r in got] == ["another warning"]
    assert logging.getLogger(FLUX_LOGGER).filters.count(log_filters._FILTER) == 1


def test_torchaos_import_time_warnings_are_dropped_and_nothing_else():
    """The messages torchao, diffusers and torch log when torchao is imported
    on a host without CUDA kernels or triton (see ``IMPORT_NOISE``)."""
    log_filters.install()
    noise = [("torchao", "Failed to load /x/_C_mxfp8.so: Could not load this library", ()),
             ("torchao.kernel.intmm", "Warning: Detected no triton, on systems without", ()),
             ("diffusers.quantizers.torchao.torchao_quantizer",
              "Unable to import `torchao` Tensor objects. This may affect loading", ()),
             ("torch.utils._pytree", "%s is an Enum subclass and is now natively supported by "
              "torch.compile", ("KernelPreference",))]
    for name, message, args in noise:
        with records(name, logging.DEBUG) as got:
            logging.getLogger(name).warning(message, *args)
            logging.getLogger(name).warning("quantize_ failed on layer %s", "x")
        assert [r.getMessage() for r in got] == ["quantize_ failed on layer x"], name
