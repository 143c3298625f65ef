"""diffrt test plugin: a simulated asynchronous device.

Active only when ``DIFFRT_SIMDEVICE=1`` (or ``DIFFRT_PLATFORM=simdevice``), so
installing it into the test environment changes nothing for other tests.
Importing this package is cheap: the platform module (and torch) is imported
only once diffrt chose it.
"""

from __future__ import annotations

import os

CLASS_PATH = "diffrt_simdevice.platform.SimDevicePlatform"


def detect() -> str | None:
    """Entry point of group ``diffrt.platform_plugins``."""
    if os.environ.get("DIFFRT_SIMDEVICE") == "1":
        return CLASS_PATH
    if os.environ.get("DIFFRT_PLATFORM", "").strip().lower() == "simdevice":
        return CLASS_PATH
    return None
