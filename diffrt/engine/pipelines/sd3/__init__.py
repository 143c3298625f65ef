"""The SD3 family: its spec (``spec.py``), its pipeline (``pipeline.py``)
on patch-token latents (``patches.py``), its forward over rows of several
sizes (``mixed.py``), its sequence-parallel attention (``parallel.py``);
its tiny test folder is ``engine/models/tiny``'s."""

from diffrt.engine.models.family import Family

FAMILY = Family("sd3", diffusers_pipelines=("StableDiffusion3Pipeline",),
                transformer_classes=("SD3Transformer2DModel",),
                describe="diffrt.engine.pipelines.sd3.spec:describe")
