"""Splitting one request across the ranks of a process group.

Layers only (this step of the parallelism work): sequence-parallel attention
(Ulysses all-to-all and ring attention) and the classifier-free-guidance
gather. Each takes the ``torch.distributed`` group it runs in, so the
pipelines can build one group per parallel dimension. Every rank holds the
full weights: nothing here shards parameters.
"""

from diffrt.engine.parallel.attention import ring_attention, ulysses_attention
from diffrt.engine.parallel.cfg import cfg_parallel_combine

__all__ = ["cfg_parallel_combine", "ring_attention", "ulysses_attention"]
