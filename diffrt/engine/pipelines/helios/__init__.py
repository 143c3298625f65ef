"""The Helios family (long text-to-video in chunks): its spec (``spec.py``),
its chunks' history (``history.py``) and its pipeline (``pipeline.py``,
where the design of a chunked request on the step loop is described); it
reuses the Wan package's UMT5 prompts, video latents and VAE decode. Its
tiny test folder is ``engine/models/tiny/helios.py``'s."""

from diffrt.engine.models.family import Family

FAMILY = Family("helios", diffusers_pipelines=("HeliosPipeline",),
                transformer_classes=("HeliosTransformer3DModel",),
                describe="diffrt.engine.pipelines.helios.spec:describe")
