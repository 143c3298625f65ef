"""The LTX-2 family (video with its sound, text- and image-to-video): its
spec (``spec.py``), its rows of video then audio tokens (``latents.py``),
its pipeline (``pipeline.py``: Gemma 3 prompts through the text connectors,
``LTX2VideoTransformer3DModel``'s two streams, the video VAE's frames and the
audio VAE + vocoder's waveform); its tiny test folders are
``engine/models/tiny/ltx2.py``'s."""

from diffrt.engine.models.family import Family

FAMILY = Family("ltx2", diffusers_pipelines=("LTX2Pipeline", "LTX2ImageToVideoPipeline"),
                transformer_classes=("LTX2VideoTransformer3DModel",),
                describe="diffrt.engine.pipelines.ltx2.spec:describe")
