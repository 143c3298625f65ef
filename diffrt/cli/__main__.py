"""`python -m diffrt.cli` runs the same command as the `diffrt` console script."""

import sys

from diffrt.cli import main

sys.exit(main())
