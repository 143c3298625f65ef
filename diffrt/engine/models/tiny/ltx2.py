"""A complete tiny LTX-2 folder (video with its sound), built locally and
deterministically.

``build_tiny_ltx2_folder`` writes a folder diffusers' own ``LTX2Pipeline``
loads offline (``i2v=True``: the same components under
``LTX2ImageToVideoPipeline``): an ``LTX2VideoTransformer3DModel`` (video and
audio streams with their cross-attention both ways), an
``AutoencoderKLLTX2Video``, an ``AutoencoderKLLTX2Audio`` (mel spectrogram
latents), an ``LTX2Vocoder`` (mel -> stereo waveform), the
``LTX2TextConnectors`` (Gemma's stacked hidden states -> the video and audio
streams' text), the flow-matching scheduler, and a tiny Gemma 3 text encoder
with a Gemma BPE tokenizer from the shared word list (nothing downloaded).

Shapes (read from diffusers' pipelines): the tiny video VAE compresses 2x in
time and space (one scaling stage), so a clip has 2k + 1 frames and its
latents k + 1; the transformer patches 1 x 1 x 1; LTX2Pipeline wants sides
that are multiples of 32 px. The audio VAE's latents are 4x shorter than the
mel spectrogram (16 kHz, hop 160: 25 latent frames a second) with 8 mel bins
-> 2; 2 latent channels x 2 bins = 4 features a token, the video's 4
channels' width too. The vocoder upsamples 160x (the hop), so the waveform
lasts as long as the clip.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from diffrt.engine.models.tiny import shared

#: Gemma 3's text model at its smallest (the released LTX-2 uses Gemma 3 12B)
TINY_GEMMA3_TEXT: shared.ComponentConfig = dict(
    hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, head_dim=8, max_position_embeddings=2048, sliding_window=64,
)
#: its SigLIP vision tower (unused by LTX-2's prompts; Gemma3ForConditionalGeneration has one)
TINY_GEMMA3_VISION: shared.ComponentConfig = dict(
    hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
    image_size=28, patch_size=14,
)

TINY_LTX2_TRANSFORMER: shared.ComponentConfig = dict(
    in_channels=4, out_channels=4, patch_size=1, patch_size_t=1,
    num_attention_heads=2, attention_head_dim=8, cross_attention_dim=16,
    audio_in_channels=4, audio_out_channels=4, audio_num_attention_heads=2,
    audio_attention_head_dim=4, audio_cross_attention_dim=8, num_layers=2,
    qk_norm="rms_norm_across_heads", caption_channels=TINY_GEMMA3_TEXT["hidden_size"],
    rope_double_precision=False, rope_type="split",
)

TINY_LTX2_CONNECTORS: shared.ComponentConfig = dict(
    caption_channels=TINY_GEMMA3_TEXT["hidden_size"],
    text_proj_in_factor=TINY_GEMMA3_TEXT["num_hidden_layers"] + 1,
    video_connector_num_attention_heads=4, video_connector_attention_head_dim=8,
    video_connector_num_layers=1, video_connector_num_learnable_registers=None,
    audio_connector_num_attention_heads=4, audio_connector_attention_head_dim=8,
    audio_connector_num_layers=1, audio_connector_num_learnable_registers=None,
    connector_rope_base_seq_len=32, rope_theta=10000.0, rope_double_precision=False,
    causal_temporal_positioning=False, rope_type="split",
)

TINY_LTX2_VAE: shared.ComponentConfig = dict(
    in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 8),
    decoder_block_out_channels=(8, 8), layers_per_block=(1, 1),
    decoder_layers_per_block=(1, 1, 1), spatio_temporal_scaling=(True, True),
    decoder_spatio_temporal_scaling=(True, True), decoder_inject_noise=(False, False, False),
    downsample_type=("spatial", "spatial"), upsample_residual=(False, False),
    upsample_factor=(1, 1), timestep_conditioning=False, patch_size=1, patch_size_t=1,
    encoder_causal=True, decoder_causal=False,
)

#: the audio VAE's sample rate (mel frames of 160 samples)
SAMPLE_RATE = 16000

TINY_LTX2_AUDIO_VAE: shared.ComponentConfig = dict(
    base_channels=4, output_channels=2, ch_mult=(1, 1, 1), num_res_blocks=1, attn_resolutions=None,
    in_channels=2, resolution=32, latent_channels=2, norm_type="pixel", causality_axis="height",
    dropout=0.0, mid_block_add_attention=False, sample_rate=SAMPLE_RATE, mel_hop_length=160,
    is_causal=True, mel_bins=8,
)

#: 4 x 4 x 10 = 160 samples a mel frame (the hop): a waveform as long as its clip
TINY_LTX2_VOCODER: shared.ComponentConfig = dict(
    in_channels=2 * 8, hidden_channels=32, out_channels=2, upsample_kernel_sizes=[8, 8, 20],
    upsample_factors=[4, 4, 10], resnet_kernel_sizes=[3], resnet_dilations=[[1, 3, 5]],
    leaky_relu_negative_slope=0.1, output_sampling_rate=SAMPLE_RATE,
)

#: the prompt length the tiny folder's prompts are padded to (Gemma's left
#: padding): its tokenizer's model_max_length, which diffrt's LTX-2 family
#: reads (LTX2Pipeline's ``max_sequence_length`` defaults to 1024; the tiny
#: model's 128 keeps its attention over text small)
LTX2_MAX_LENGTH = 128

#: Factors applied to the fresh transformer's weights so the prompt shows in
#: the frames and the sound (see ``tiny/shared.py``): the video and audio
#: streams' text cross-attention keys and values (``attn2`` and, by suffix,
#: ``audio_attn2``) read the text
PROMPT_BOOST: dict[str, float] = {
    "attn2.to_k.weight": 8.0,
    "attn2.to_v.weight": 16.0,
}

#: So the sound follows the audio latents (see ``tiny/shared.py``): at their
#: fresh initialisation the vocoder's biases, not its input, make nearly all
#: of the waveform (two seeds' clips differed by 5e-5 against a spread of
#: 0.09), so they are zeroed and its input convolution scaled up, and the
#: audio VAE's decoder reads its latents more strongly; two seeds' waveforms
#: then differ by about a third of their spread.
AUDIO_VAE_BOOST: dict[str, float] = {"decoder.conv_in.conv.weight": 4.0}
VOCODER_BOOST: dict[str, float] = {"bias": 0.0, "conv_in.weight": 100.0}

_SEED_OFFSETS = {**shared._SEED_OFFSETS, "audio_vae": 6, "vocoder": 7, "connectors": 8}

#: Gemma's special tokens, with the ids its tokenizer gives them
GEMMA_SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>")


def gemma_vocab_and_merges(num_merges: int = 400) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A Gemma-style BPE vocabulary: the special tokens (pad 0, eos 1, bos 2,
    unk 3, mask 4), single characters and "▁" (Gemma's space), then one
    token per merge learned from the shared word list, each word after a
    "▁" as Gemma's normaliser writes it."""
    chars = ("▁abcdefghijklmnopqrstuvwxyz" "ABCDEFGHIJKLMNOPQRSTUVWXYZ" "0123456789"
             "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~")
    words = {("▁", *word): weight for word, weight in shared._word_weights().items()}
    merges = shared.learn_bpe_merges(words, num_merges)
    vocab: dict[str, int] = {}
    for token in (*GEMMA_SPECIALS, *chars, *(a + b for a, b in merges)):
        vocab.setdefault(token, len(vocab))
    return vocab, merges


def build_gemma_tokenizer(folder: str | os.PathLike) -> object:
    """Write a ``GemmaTokenizer`` (BPE, Gemma's normaliser, <bos> first) to
    ``folder`` and return it."""
    from transformers import GemmaTokenizer

    vocab, merges = gemma_vocab_and_merges()
    # transformers annotates merges as strings; the BPE model takes these pairs
    tokenizer = GemmaTokenizer(vocab=vocab, merges=merges, model_max_length=LTX2_MAX_LENGTH)
    tokenizer.save_pretrained(folder)
    return tokenizer


def gemma3(seed: int, vocab_size: int) -> torch.nn.Module:
    """The tiny Gemma 3 (text and a tiny vision tower) under ``seed``."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    config = Gemma3Config(
        text_config=dict(vocab_size=vocab_size, pad_token_id=0, eos_token_id=1, bos_token_id=2,
                         **TINY_GEMMA3_TEXT),
        vision_config=TINY_GEMMA3_VISION, mm_tokens_per_image=4, image_token_index=vocab_size - 1)
    with shared.seeded_init(seed):
        return Gemma3ForConditionalGeneration(config).eval()


#: an LTX-2 folder's components (model_index.json); the optional ones left out
LTX2_COMPONENTS: dict[str, tuple[str | None, str | None]] = {
    "scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler"),
    "text_encoder": ("transformers", "Gemma3ForConditionalGeneration"),
    "tokenizer": ("transformers", "GemmaTokenizer"),
    "connectors": ("ltx2", "LTX2TextConnectors"),
    "transformer": ("diffusers", "LTX2VideoTransformer3DModel"),
    "vae": ("diffusers", "AutoencoderKLLTX2Video"),
    "audio_vae": ("diffusers", "AutoencoderKLLTX2Audio"),
    "vocoder": ("ltx2", "LTX2Vocoder"),
    "processor": (None, None), "prompt_enhancer": (None, None), "duration_head": (None, None),
}


def build_tiny_ltx2_folder(path: str | os.PathLike, *, seed: int = 0, i2v: bool = False) -> Path:
    """A complete tiny LTX-2 folder at ``path`` for ``LTX2Pipeline`` (with
    ``i2v``: ``LTX2ImageToVideoPipeline``, the same weights)."""
    from diffusers import (
        AutoencoderKLLTX2Audio,
        AutoencoderKLLTX2Video,
        FlowMatchEulerDiscreteScheduler,
        LTX2VideoTransformer3DModel,
    )
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    vocab, _ = gemma_vocab_and_merges()
    build_gemma_tokenizer(path / "tokenizer")
    shared.save_seeded(path / "transformer", LTX2VideoTransformer3DModel,
                       seed + _SEED_OFFSETS["transformer"], boost=PROMPT_BOOST,
                       **TINY_LTX2_TRANSFORMER)
    shared.save_seeded(path / "connectors", LTX2TextConnectors, seed + _SEED_OFFSETS["connectors"],
                       **TINY_LTX2_CONNECTORS)
    shared.save_seeded(path / "vae", AutoencoderKLLTX2Video, seed + _SEED_OFFSETS["vae"],
                       **TINY_LTX2_VAE)
    shared.save_seeded(path / "audio_vae", AutoencoderKLLTX2Audio,
                       seed + _SEED_OFFSETS["audio_vae"], boost=AUDIO_VAE_BOOST,
                       **TINY_LTX2_AUDIO_VAE)
    shared.save_seeded(path / "vocoder", LTX2Vocoder, seed + _SEED_OFFSETS["vocoder"],
                       boost=VOCODER_BOOST, **TINY_LTX2_VOCODER)
    # LTX-2's schedule: the sequence-length shift between 0.95 and 2.05 (no
    # ``shift_terminal``: with it a one-step schedule, the engine's warm-up,
    # divides by zero in diffusers' scheduler)
    FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05, base_image_seq_len=1024,
        max_image_seq_len=4096).save_pretrained(path / "scheduler")
    shared._save(gemma3(seed + _SEED_OFFSETS["text_encoder"], len(vocab)), path / "text_encoder")
    pipeline = "LTX2ImageToVideoPipeline" if i2v else "LTX2Pipeline"
    shared._write_index(path, pipeline, LTX2_COMPONENTS)
    return path


__all__ = ["AUDIO_VAE_BOOST", "LTX2_COMPONENTS", "LTX2_MAX_LENGTH", "PROMPT_BOOST", "SAMPLE_RATE",
           "TINY_LTX2_AUDIO_VAE", "TINY_LTX2_CONNECTORS", "TINY_LTX2_TRANSFORMER",
           "TINY_LTX2_VAE", "TINY_LTX2_VOCODER", "VOCODER_BOOST", "build_gemma_tokenizer",
           "build_tiny_ltx2_folder", "gemma3", "gemma_vocab_and_merges"]
