"""The Flux family: its spec (``spec.py``), its pipeline (``pipeline.py``),
its sequence-parallel attention (``parallel.py``) and its tiny test folder
(``tiny_folder.py``)."""

from diffrt.engine.pipelines.family import Family

FAMILY = Family("flux", diffusers_pipelines=("FluxPipeline", "FluxKontextPipeline"),
                transformer_classes=("FluxTransformer2DModel",),
                describe="diffrt.engine.pipelines.flux.spec:describe")
