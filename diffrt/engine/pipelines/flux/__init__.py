"""The Flux family: its spec (``spec.py``), its pipeline (``pipeline.py``),
its sequence-parallel attention (``parallel.py``);
its tiny test folder is ``engine/models/tiny``'s."""

from diffrt.engine.models.family import Family

FAMILY = Family("flux", diffusers_pipelines=("FluxPipeline", "FluxKontextPipeline"),
                transformer_classes=("FluxTransformer2DModel",),
                describe="diffrt.engine.pipelines.flux.spec:describe")
