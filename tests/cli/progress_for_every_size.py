"""Test plugin (``--plugin-module``): report loading progress for checkpoints
of every size, so a test of the tiny models sees the lines that a multi-GB
checkpoint prints in a worker."""

from diffrt.engine.models import loading

loading.PROGRESS_BYTES = 0
