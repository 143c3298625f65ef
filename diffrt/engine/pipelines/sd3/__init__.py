"""The SD3 family: its spec (``spec.py``), its pipeline (``pipeline.py``)
on patch-token latents (``patches.py``), its forward over rows of several
sizes (``mixed.py``), its sequence-parallel attention (``parallel.py``) and
its tiny test folder (``tiny_folder.py``)."""

from diffrt.engine.pipelines.family import Family

FAMILY = Family("sd3", diffusers_pipelines=("StableDiffusion3Pipeline",),
                transformer_classes=("SD3Transformer2DModel",),
                describe="diffrt.engine.pipelines.sd3.spec:describe")
