"""Test plugin (``plugin_modules``): importing it stops every platform's
``trim_memory`` from giving anything back, so a test can show what a worker
holds without the trim (fault injection lives here, not in the library)."""

from diffrt.platforms.cpu import CpuPlatform
from diffrt.platforms.interface import Platform


def _keep_everything(self: Platform) -> None:
    return None


# the base (every accelerator inherits it) and the CPU platform's own
for cls in (Platform, CpuPlatform):
    cls.trim_memory = _keep_everything  # type: ignore[method-assign]
