"""Splitting one request across the ranks of an engine.

- ``degrees``: how a request is split (CFG × ring × Ulysses), the rank layout;
- ``groups``: one process group per parallel dimension, and the joint
  attention over the sequence group;
- ``attention``: Ulysses all-to-all and ring attention (and both, USP);
- ``cfg``: guidance's two branches on two ranks, or a CFG-less batch's rows
  shared out between them;
- ``sequence``, ``flux_attention``, ``sd3_attention``: the transformer hooks
  that shard the image tokens, attend over the group and gather;
- ``vae``: the VAE decode in bands of rows (halo rows, shared norm statistics);
- ``collectives``: uneven splits and their gather.

Every rank holds the full weights: nothing here shards parameters. All
collectives take the group they run in, through the platform's
``dist_backend`` (gloo on CPU, which has ``all_to_all_single`` but not the
list form; only the former is used). This package imports only ``degrees``
(no torch), so the engine's configuration stays light to import.
"""

from diffrt.engine.parallel.degrees import ParallelConfigError, ParallelDegrees

__all__ = ["ParallelConfigError", "ParallelDegrees"]
