"""The Qwen-Image family: its spec (``spec.py``), its pipeline
(``pipeline.py``), its sequence-parallel attention (``parallel.py``);
its tiny test folder is ``engine/models/tiny``'s."""

from diffrt.engine.models.family import Family

FAMILY = Family("qwen-image", diffusers_pipelines=("QwenImagePipeline", "QwenImageEditPipeline",
                                                  "QwenImageEditPlusPipeline"),
                transformer_classes=("QwenImageTransformer2DModel",),
                describe="diffrt.engine.pipelines.qwen_image.spec:describe")
