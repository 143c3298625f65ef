"""OutputRef: one output on its way from the workers, and the executor that
holds it.

The core hands these to the output processor in each ``TickResult``, so the
output processor never holds the executor itself: after a worker restart the
outputs of new ticks simply come with the new executor, and an output of the
old one still answers (its future failed with the old workers).
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass

from diffrt.runtime.executor import Executor
from diffrt.runtime.shm_transport import OutputLease


@dataclass(frozen=True, eq=False)
class OutputRef:
    output_id: str
    executor: Executor

    def ready(self) -> concurrent.futures.Future[OutputLease]:
        """Resolves once the output is in host memory (its lease), or fails."""
        return self.executor.wait_output_ready(self.output_id)

    def release(self) -> None:
        """Nobody will read it: free it now (or when it lands)."""
        self.executor.release_output(self.output_id)


__all__ = ["OutputRef"]
