"""The Wan family (Wan 2.1 / 2.2 text- and image-to-video): its spec
(``spec.py``), its video latents as frames x patch tokens (``latents.py``),
its pipeline (``pipeline.py``: UMT5 prompts, the one or two
``WanTransformer3DModel`` experts, ``AutoencoderKLWan``'s decode); its tiny
test folders are ``engine/models/tiny/wan.py``'s."""

from diffrt.engine.models.family import Family

FAMILY = Family("wan", diffusers_pipelines=("WanPipeline", "WanImageToVideoPipeline"),
                transformer_classes=("WanTransformer3DModel",),
                describe="diffrt.engine.pipelines.wan.spec:describe")
