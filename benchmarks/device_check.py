"""The prepared device check, as a benchmark script: ``diffrt env --check``.

    .venv/bin/python benchmarks/device_check.py            # full check, one JSON
    .venv/bin/python benchmarks/device_check.py --quick    # small, for a CPU

See docs/platforms.md ("The device check") for its parts.
"""

from __future__ import annotations

import sys

from diffrt.cli import main

if __name__ == "__main__":
    sys.exit(main(["env", "--check", *sys.argv[1:]]))
