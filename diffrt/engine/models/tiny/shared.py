"""The pieces every tiny diffusers folder shares, built locally and deterministically.

Each family's builder lives in its own module (``tiny/flux.py``,
``tiny/sd3.py``, ``tiny/qwen_image.py``) and writes a folder that
diffusers' own pipeline for that family loads with
``from_pretrained(path, local_files_only=True)``. What they have in common is
here: seeded module construction, the tiny CLIP and T5 text encoders, their
tokenizers built from a fixed word list (so nothing is ever downloaded), the
VAE both Flux and SD3 use, the prompt boost and ``model_index.json``.

Same seed, same library versions -> byte-identical files: every module is
built under its own fixed seed (``seed`` + a per-component offset, so the two
CLIP encoders of SD3 differ), and the tokenizers come from a deterministic
byte-level BPE (CLIP) and Unigram (T5) vocabulary.

With default initialisation a tiny transformer barely reacts to its prompt
(the prompt reaches the image only through a few of hundreds of attention
keys and a pooled vector next to the timestep embedding). A few weights are
scaled up after initialisation (each family's ``PROMPT_BOOST``, applied by
``_boost``) so that two different prompts give clearly different images: text
tokens carry larger values into the joint attention and the pooled prompt
modulates the blocks more strongly (changing only the T5 prompt moves a 64x64
image by 7-10/255 after the boost, 0.0-0.1 before).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from diffusers import ModelMixin
    from transformers import CLIPTokenizer, PreTrainedModel, T5EncoderModel, T5Tokenizer

#: a component's constructor arguments, as its config.json holds them
ComponentConfig = dict[str, Any]



@contextlib.contextmanager
def seeded_init(seed: int) -> Iterator[None]:
    """Run module construction with the CPU RNG seeded to ``seed``.

    Modules built inside draw their default initialisation from the seeded
    generator, so every process builds the same weights; the caller's RNG
    state is restored afterwards (no side effect on user sampling).
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


# ---------------------------------------------------------------------------
# Configurations
# ---------------------------------------------------------------------------

#: CLIP text encoder (both families; SD3 has two of them).
TINY_CLIP_TEXT: ComponentConfig = dict(
    hidden_size=32,
    intermediate_size=37,
    num_hidden_layers=2,
    num_attention_heads=2,
    max_position_embeddings=77,
    projection_dim=32,
    hidden_act="quick_gelu",
    layer_norm_eps=1e-5,
)

#: T5 v1.1-style encoder (gated GELU, untied), as in FLUX.1 and SD3.
TINY_T5: ComponentConfig = dict(
    d_model=32,
    d_kv=8,
    d_ff=37,
    num_layers=2,
    num_heads=2,
    relative_attention_num_buckets=32,
    relative_attention_max_distance=128,
    feed_forward_proj="gated-gelu",
    dropout_rate=0.0,
)

#: The VAE of the Flux and SD3 folders (8x, 4 latent channels), without quant
#: convs like the FLUX.1 and SD3 VAEs; each family adds its real scaling and
#: shift factors.
TINY_VAE: ComponentConfig = dict(
    in_channels=3,
    out_channels=3,
    latent_channels=4,
    block_out_channels=(32, 32, 64, 64),
    down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4,
    layers_per_block=1,
    norm_num_groups=32,
    sample_size=128,
    use_quant_conv=False,
    use_post_quant_conv=False,
)

#: The scheduler keys of a resolution-dependent shift (FLUX.1's values; an SD3
#: folder with ``dynamic_shifting`` takes them too).
DYNAMIC_SHIFT: ComponentConfig = dict(
    use_dynamic_shifting=True,
    base_shift=0.5,
    max_shift=1.15,
    base_image_seq_len=256,
    max_image_seq_len=4096,
)

#: The prefix of the pooled-prompt projection's weights (added to the
#: timestep embedding, so it modulates every block), which both the Flux and
#: the SD3 boost scale.
POOLED_PROJECTION = "time_text_embed.text_embedder.linear_"

CLIP_MAX_LENGTH = 77
T5_MAX_LENGTH = 512

# Per-component seed offsets: fixed, so a component's weights do not depend
# on which other components a folder has.
_SEED_OFFSETS = {
    "transformer": 0,
    "vae": 1,
    "text_encoder": 2,
    "text_encoder_2": 3,
    "text_encoder_3": 4,
}

# ---------------------------------------------------------------------------
# Tokenizers
# ---------------------------------------------------------------------------

#: The words both tokenizers are built from, most frequent first (their rank
#: sets their weight when the BPE merges and Unigram scores are derived).
_WORDS = """
a the of and in on with to is at by for from an it this that as are was be or
photo picture painting drawing image portrait landscape close up view of style
red orange yellow green blue purple pink brown black white gray grey gold silver
dark light bright colorful small big large tiny huge tall old young new
cat dog fox bird horse cow sheep lion tiger bear wolf rabbit mouse fish owl deer
man woman girl boy child person people face eyes hair hand
tree trees forest flower flowers grass leaf leaves garden field mountain mountains
river lake sea ocean beach sand snow ice rain cloud clouds sky sun moon star stars
night day morning evening sunset sunrise winter summer spring autumn fall
house city street road car bridge castle tower window door room table chair
water fire stone rock wood glass metal paper
standing sitting running walking flying sleeping looking holding wearing
beautiful cute detailed realistic high quality masterpiece digital art oil
watercolor sketch cinematic lighting sharp focus soft background foreground
one two three under over near behind between inside outside above below
very much more most some all no not but if then so his her their its
""".split()

# bytes_to_unicode() of GPT-2/CLIP: printable bytes map to themselves, the
# rest to code points from 256 up, in this order.


def _bytes_to_unicode() -> dict[int, str]:
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs), strict=True))


def _word_weights(extra: tuple[str, ...] = ()) -> dict[str, int]:
    """Word -> weight, ``extra`` words first (a vocabulary's own words, which
    then become whole tokens), then the common list."""
    words = [*extra, *_WORDS]
    weights: dict[str, int] = {}
    for rank, word in enumerate(words):
        if word not in weights:
            weights[word] = len(words) - rank
    return weights


def learn_bpe_merges(words: dict[tuple[str, ...], int],
                     num_merges: int) -> list[tuple[str, str]]:
    """BPE merges learned from ``words`` (symbol sequence -> frequency): the
    most frequent adjacent pair each time, ties broken on the pair itself,
    so always the same."""
    merges: list[tuple[str, str]] = []
    while len(merges) < num_merges:
        counts: dict[tuple[str, str], int] = {}
        for symbols, freq in words.items():
            for pair in zip(symbols, symbols[1:], strict=False):
                counts[pair] = counts.get(pair, 0) + freq
        if not counts:
            break
        best = min(counts, key=lambda p: (-counts[p], p))
        merges.append(best)
        merged = best[0] + best[1]
        new_words: dict[tuple[str, ...], int] = {}
        for symbols, freq in words.items():
            out: list[str] = []
            i = 0
            while i < len(symbols):
                if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == best:
                    out.append(merged)
                    i += 2
                else:
                    out.append(symbols[i])
                    i += 1
            new_words[tuple(out)] = freq
        words = new_words
    return merges


def learn_clip_merges(num_merges: int = 400,
                      extra: tuple[str, ...] = ()) -> list[tuple[str, str]]:
    """Byte-level BPE merges, CLIP style (``</w>`` closes a word), from the
    fixed word list."""
    words = {tuple(w[:-1]) + (w[-1] + "</w>",): f for w, f in _word_weights(extra).items()}
    return learn_bpe_merges(words, num_merges)


def clip_vocab_and_merges(num_merges: int = 400, extra: tuple[str, ...] = ()
                          ) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """CLIP's layout: 256 byte symbols, their ``</w>`` forms, one entry per
    merge, then ``<|startoftext|>`` and ``<|endoftext|>`` (the highest id)."""
    symbols = list(_bytes_to_unicode().values())
    tokens = symbols + [s + "</w>" for s in symbols]
    merges = learn_clip_merges(num_merges, extra)
    tokens += [a + b for a, b in merges]
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    vocab: dict[str, int] = {}
    for token in tokens:
        vocab.setdefault(token, len(vocab))
    return vocab, merges


def build_clip_tokenizer(folder: str | os.PathLike, *, extra: tuple[str, ...] = (),
                         max_length: int | None = None) -> CLIPTokenizer:
    """Write a CLIP tokenizer to ``folder`` (``vocab.json`` + ``merges.txt``
    + ``tokenizer.json`` and its configs) and return it; ``extra`` words come
    first (whole tokens), ``max_length`` is what prompts are padded to."""
    from transformers import CLIPTokenizer

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    vocab, merges = clip_vocab_and_merges(600 if extra else 400, extra)
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False) + "\n",
                                       encoding="utf-8")
    (folder / "merges.txt").write_text(
        "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8")
    # transformers annotates merges as strings; the BPE model takes these pairs
    tokenizer = CLIPTokenizer(vocab=vocab, merges=merges,
                              model_max_length=max_length or CLIP_MAX_LENGTH)
    tokenizer.save_pretrained(folder)
    return tokenizer


def t5_pieces(extra: tuple[str, ...] = ()) -> list[tuple[str, float]]:
    """Unigram pieces with SentencePiece-like log-probability scores:
    ``<pad>`` 0, ``</s>`` 1, ``<unk>`` 2, then "▁", whole words ("▁red"),
    frequent sub-words from the BPE merges and single characters. A whole
    word always scores better than its spelling."""
    pieces: list[tuple[str, float]] = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0),
                                       ("▁", -2.0)]
    seen = {p for p, _ in pieces}

    def add(piece: str, score: float) -> None:
        if piece not in seen:
            seen.add(piece)
            pieces.append((piece, round(score, 4)))

    for rank, word in enumerate(_word_weights(extra)):
        add("▁" + word, -5.0 - 0.01 * rank)
    for rank, (a, b) in enumerate(learn_clip_merges(200)):
        sub = (a + b).replace("</w>", "")
        if len(sub) > 1:
            add(sub, -8.0 - 0.01 * rank)
    chars = ("abcdefghijklmnopqrstuvwxyz" "ABCDEFGHIJKLMNOPQRSTUVWXYZ" "0123456789"
             "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~")
    for rank, ch in enumerate(chars):
        add(ch, -12.0 - 0.01 * rank)
    return pieces


def build_t5_tokenizer(folder: str | os.PathLike, *, extra: tuple[str, ...] = (),
                       max_length: int | None = None) -> T5Tokenizer:
    """Write a T5 (Unigram, Metaspace) tokenizer to ``folder`` and return it
    (``extra`` words first, padded to ``max_length``)."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import Unigram
    from transformers import T5Tokenizer  # T5TokenizerFast is the same class (transformers 5)

    backend = Tokenizer(Unigram(t5_pieces(extra), unk_id=2, byte_fallback=False))
    # The same pipeline as transformers' T5 tokenizer rebuilds on loading.
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.WhitespaceSplit(),
        pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True),
    ])
    backend.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    backend.post_processor = processors.TemplateProcessing(
        single=["$A", "</s>"], pair=["$A", "</s>", "$B", "</s>"], special_tokens=[("</s>", 1)])
    tokenizer = T5Tokenizer(tokenizer_object=backend, extra_ids=0,
                                model_max_length=max_length or T5_MAX_LENGTH)
    tokenizer.save_pretrained(folder)
    return tokenizer


# ---------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------


def _boost(module: torch.nn.Module, factors: dict[str, float]) -> None:
    hits = dict.fromkeys(factors, 0)
    with torch.no_grad():
        for name, param in module.named_parameters():
            for suffix, factor in factors.items():
                if name.endswith(suffix):
                    param.mul_(factor)
                    hits[suffix] += 1
    missing = [suffix for suffix, n in hits.items() if not n]
    if missing:  # a diffusers rename would silently undo the boost
        raise RuntimeError(f"no parameter ends with {missing} in {type(module).__name__}")


def _clip_text(cls: type[PreTrainedModel], seed: int, vocab: dict[str, int]) -> PreTrainedModel:
    from transformers import CLIPTextConfig

    config = CLIPTextConfig(
        vocab_size=len(vocab),
        bos_token_id=vocab["<|startoftext|>"],
        eos_token_id=vocab["<|endoftext|>"],
        pad_token_id=vocab["<|endoftext|>"],
        **TINY_CLIP_TEXT,
    )
    with seeded_init(seed):
        return cls(config).eval()


def _t5(seed: int, vocab_size: int, config_kwargs: ComponentConfig) -> T5EncoderModel:
    from transformers import T5Config, T5EncoderModel

    # T5Config keeps keys it does not list (config.json carries decoder_start_token_id)
    config = T5Config(vocab_size=vocab_size, pad_token_id=0, eos_token_id=1,
                      decoder_start_token_id=0, is_encoder_decoder=False, **config_kwargs)
    with seeded_init(seed):
        return T5EncoderModel(config).eval()


def _save(module: PreTrainedModel | ModelMixin, folder: Path) -> None:
    module.save_pretrained(folder, safe_serialization=True)


def save_seeded(folder: Path, cls: type[ModelMixin], seed: int, *,
                boost: dict[str, float] | None = None, **config: object) -> None:
    """Build ``cls(**config)`` under ``seed``, scale its ``boost`` weights up
    (a family's ``PROMPT_BOOST``) and save it to ``folder``: a transformer's or
    a VAE's weights then depend on the seed alone."""
    with seeded_init(seed):
        module = cls(**config)
    if boost:
        _boost(module, boost)
    _save(module, folder)


def _write_index(path: Path, class_name: str,
                 components: Mapping[str, tuple[str | None, str | None]]) -> None:
    """``model_index.json``: (library, class) per component, (None, None)
    for an optional component the folder leaves out."""
    import diffusers

    index: ComponentConfig = {"_class_name": class_name, "_diffusers_version": diffusers.__version__}
    index.update({name: list(lib_cls) for name, lib_cls in sorted(components.items())})
    (path / "model_index.json").write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")


#: a FluxPipeline folder's components (model_index.json)
FLUX_COMPONENTS: dict[str, tuple[str, str]] = {
    "scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler"),
    "text_encoder": ("transformers", "CLIPTextModel"),
    "text_encoder_2": ("transformers", "T5EncoderModel"),
    "tokenizer": ("transformers", "CLIPTokenizer"),
    "tokenizer_2": ("transformers", "T5TokenizerFast"),
    "transformer": ("diffusers", "FluxTransformer2DModel"),
    "vae": ("diffusers", "AutoencoderKL"),
}
