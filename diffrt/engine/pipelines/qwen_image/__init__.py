"""The Qwen-Image family: its spec (``spec.py``), its pipeline
(``pipeline.py``), its sequence-parallel attention (``parallel.py``) and its
tiny test folder (``tiny_folder.py``)."""

from diffrt.engine.pipelines.family import Family

FAMILY = Family("qwen-image", diffusers_pipelines=("QwenImagePipeline", "QwenImageEditPipeline",
                                                  "QwenImageEditPlusPipeline"),
                transformer_classes=("QwenImageTransformer2DModel",),
                describe="diffrt.engine.pipelines.qwen_image.spec:describe")
