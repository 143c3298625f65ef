"""A complete tiny Qwen-Image folder, built locally and deterministically.

``build_tiny_qwen_image_folder`` writes a folder diffusers' own
``QwenImagePipeline`` loads offline: a ``QwenImageTransformer2DModel``, an
``AutoencoderKLQwenImage`` (with Qwen-Image's per-channel latent mean and
std), Qwen-Image's scheduler configuration (exponential dynamic shift, a
terminal sigma) and a tiny ``Qwen2_5_VLForConditionalGeneration`` with a
byte-level BPE ``Qwen2Tokenizer`` built here.

The pipeline wraps every prompt in a chat template and drops the first 34
tokens of the encoder's output (the template's system prefix), so the
tokenizer must split that prefix into exactly 34 tokens, as Qwen2.5's does:
its BPE merges are learned from the template's words first (each becomes
one token, with or without its leading space), then from the common prompt
words of ``tiny/shared.py``; Qwen2.5's added tokens (``<|im_start|>``, the
vision markers ...) are special tokens. ``build_qwen_tokenizer`` checks the
count.

With default initialisation a tiny transformer barely reacts to its prompt
(0.2/255 between two prompts); a few weights are scaled up (``QWEN_BOOST``)
so that different prompts give clearly different images.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from diffrt.engine.models.tiny.shared import (
    _WORDS,
    ComponentConfig,
    _boost,
    _bytes_to_unicode,
    _save,
    _write_index,
    learn_bpe_merges,
    seeded_init,
)

if TYPE_CHECKING:
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer

#: QwenImagePipeline's prompt template and the tokens it drops from the front
QWEN_TEMPLATE = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, "
                 "texture, quantity, text, spatial relationships of the objects and background:"
                 "<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n")
TEMPLATE_DROP = 34
_USER_TURN = "<|im_start|>user\n"
#: Qwen2.5's added tokens, in its order
QWEN_SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
]
_TEMPLATE_WORDS = tuple("system user assistant Describe the image by detailing color shape size "
                        "texture quantity text spatial relationships of objects and background"
                        .split())

TINY_QWEN_TEXT: ComponentConfig = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, max_position_embeddings=2048, rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]},
)
TINY_QWEN_VISION: ComponentConfig = dict(
    depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
    patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
    fullatt_block_indexes=[0],
)
TINY_QWEN_TRANSFORMER: ComponentConfig = dict(
    patch_size=2, in_channels=64, out_channels=16, num_layers=2, attention_head_dim=16,
    num_attention_heads=2, joint_attention_dim=TINY_QWEN_TEXT["hidden_size"],
    axes_dims_rope=(4, 6, 6),
)
TINY_QWEN_VAE: ComponentConfig = dict(
    base_dim=16, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
    temperal_downsample=[False, True, True],
)
#: Qwen-Image's own scheduler configuration
QWEN_SCHEDULER: ComponentConfig = dict(
    num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5,
    max_shift=0.9, base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02,
    time_shift_type="exponential",
)
#: See the module docstring: sharper attention from image queries to the text
#: keys (RMS q/k norm: the logits scale with its weight), larger text values,
#: a stronger text projection. Mean |difference| between the 64x64 images of
#: four prompts (4 steps, fp32, CPU): 0.1-0.2/255 before, 7.0-9.0 after.
QWEN_BOOST: dict[str, float] = {
    "attn.norm_added_k.weight": 16.0,
    "attn.add_v_proj.weight": 32.0,
    "txt_in.weight": 4.0,
}
_SEED_OFFSETS = {"transformer": 0, "vae": 1, "text_encoder": 2}


def learn_byte_bpe_merges(weights: dict[str, int], num_merges: int) -> list[tuple[str, str]]:
    """GPT-2-style byte-level BPE merges (a leading space is ``Ġ``), each
    word counted with and without its space."""
    table = _bytes_to_unicode()

    def symbols(text: str) -> tuple[str, ...]:
        return tuple(table[b] for b in text.encode("utf-8"))

    words: dict[tuple[str, ...], int] = {}
    for word, freq in weights.items():
        for form in (word, " " + word):
            key = symbols(form)
            words[key] = words.get(key, 0) + freq
    return learn_bpe_merges(words, num_merges)


def qwen_vocab_and_merges(num_merges: int = 700, template_words: tuple[str, ...] = _TEMPLATE_WORDS
                          ) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """256 byte symbols, one entry per merge (``template_words`` first)."""
    weights = dict.fromkeys(template_words, 100_000)
    for rank, word in enumerate(_WORDS):
        weights.setdefault(word, len(_WORDS) - rank)
    merges = learn_byte_bpe_merges(weights, num_merges)
    vocab: dict[str, int] = {}
    for token in [*_bytes_to_unicode().values(), *(a + b for a, b in merges)]:
        vocab.setdefault(token, len(vocab))
    return vocab, merges


def template_prefix(template: str) -> str:
    """The system part of a chat ``template``, through ``<|im_start|>user\\n``:
    the tokens a Qwen-Image pipeline drops from the encoder's output."""
    return template[:template.index(_USER_TURN) + len(_USER_TURN)]


def build_qwen_tokenizer(folder: str | os.PathLike, *,
                         templates: tuple[tuple[str, int], ...] = ((QWEN_TEMPLATE, TEMPLATE_DROP),),
                         template_words: tuple[str, ...] = _TEMPLATE_WORDS) -> Qwen2Tokenizer:
    """Write a ``Qwen2Tokenizer`` to ``folder`` and return it; raises unless
    each template's system prefix splits into the number of tokens its
    pipeline drops (``templates``: (template, drop) pairs; the merges are
    learned from ``template_words`` first, so each becomes one token)."""
    from transformers import Qwen2Tokenizer

    vocab, merges = qwen_vocab_and_merges(template_words=template_words)
    # transformers annotates merges as strings; the BPE model takes these pairs
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges,
                               model_max_length=32768)
    tokenizer.add_special_tokens({"additional_special_tokens": QWEN_SPECIAL_TOKENS[1:]})
    tokenizer.add_tokens(["<|endoftext|>"], special_tokens=True)
    for template, drop in templates:
        count = len(tokenizer(template_prefix(template), add_special_tokens=False).input_ids)
        if count != drop:
            raise RuntimeError(f"the tiny Qwen tokenizer splits the template prefix "
                               f"{template_prefix(template)!r} into {count} tokens; the pipeline "
                               f"drops {drop}")
    tokenizer.save_pretrained(folder)
    return tokenizer


def _text_encoder(seed: int,
                  tokenizer: Qwen2Tokenizer) -> Qwen2_5_VLForConditionalGeneration:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = tokenizer.convert_tokens_to_ids
    special = {"bos_token_id": ids("<|endoftext|>"), "eos_token_id": ids("<|im_end|>"),
               "pad_token_id": ids("<|endoftext|>")}
    config = Qwen2_5_VLConfig(
        text_config={**TINY_QWEN_TEXT, "vocab_size": len(tokenizer), **special},
        vision_config=TINY_QWEN_VISION,
        image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"), **special)
    with seeded_init(seed):
        return Qwen2_5_VLForConditionalGeneration(config).eval()


#: a QwenImagePipeline folder's components (model_index.json)
QWEN_IMAGE_COMPONENTS: dict[str, tuple[str, str]] = {
    "scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler"),
    "text_encoder": ("transformers", "Qwen2_5_VLForConditionalGeneration"),
    "tokenizer": ("transformers", "Qwen2Tokenizer"),
    "transformer": ("diffusers", "QwenImageTransformer2DModel"),
    "vae": ("diffusers", "AutoencoderKLQwenImage"),
}


def save_qwen_models(path: Path, tokenizer: Qwen2Tokenizer, *, seed: int,
                     **transformer: object) -> None:
    """The transformer (``TINY_QWEN_TRANSFORMER`` updated by ``transformer``,
    boosted), the VAE, the scheduler and the text encoder (sized for
    ``tokenizer``) of a tiny Qwen-Image folder, each from its own seed."""
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImageTransformer2DModel,
    )

    with seeded_init(seed + _SEED_OFFSETS["transformer"]):
        model = QwenImageTransformer2DModel(**{**TINY_QWEN_TRANSFORMER, **transformer})
    _boost(model, QWEN_BOOST)
    _save(model, path / "transformer")
    with seeded_init(seed + _SEED_OFFSETS["vae"]):
        vae = AutoencoderKLQwenImage(**TINY_QWEN_VAE)
    _save(vae, path / "vae")
    scheduler = FlowMatchEulerDiscreteScheduler(**QWEN_SCHEDULER)
    scheduler.save_pretrained(path / "scheduler")
    _save(_text_encoder(seed + _SEED_OFFSETS["text_encoder"], tokenizer), path / "text_encoder")


def build_tiny_qwen_image_folder(path: str | os.PathLike, *, seed: int = 0) -> Path:
    """A complete tiny Qwen-Image folder at ``path`` (``QwenImagePipeline``
    loads it offline)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_qwen_tokenizer(path / "tokenizer")
    save_qwen_models(path, tokenizer, seed=seed)
    _write_index(path, "QwenImagePipeline", QWEN_IMAGE_COMPONENTS)
    return path


__all__ = ["QWEN_IMAGE_COMPONENTS", "QWEN_TEMPLATE", "TEMPLATE_DROP", "build_qwen_tokenizer",
           "build_tiny_qwen_image_folder", "learn_byte_bpe_merges", "qwen_vocab_and_merges",
           "save_qwen_models", "template_prefix"]
