"""Errors the CLI reports as one clean line (no traceback) with a non-zero exit."""

from __future__ import annotations

#: exit status for input the user can fix (argparse uses the same)
EXIT_USAGE = 2
#: exit status when the run itself failed (a request errored, an internal error)
EXIT_FAILURE = 1


class CliError(Exception):
    """Bad command-line input, explained in words the user can act on."""


def is_user_error(exc: BaseException) -> bool:
    """True for errors caused by the input rather than by a bug.

    Validation in diffrt raises ValueError subclasses that name the field and
    the allowed range (InvalidRequestError, UnknownModelError, config errors),
    so they are shown as they are.
    """
    if isinstance(exc, (CliError, ValueError)):
        return True
    from diffrt.platforms import PlatformResolutionError  # a bad DIFFRT_PLATFORM, two plugins

    return isinstance(exc, PlatformResolutionError)
