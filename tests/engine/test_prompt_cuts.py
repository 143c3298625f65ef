"""What a text encoder cuts from a long prompt is reported per request as
token counts (``RequestMetrics.prompt_tokens_dropped``, one DEBUG line), and
the prompt's text reaches no log (issue 27 item 8)."""

from __future__ import annotations

import logging

import pytest
from test_log_filters import FLUX_LOGGER, records
from transformers import AutoTokenizer

from diffrt import log_filters
from diffrt.engine import DiffusionRequest, SamplingParams
from diffrt.engine.models.registry import resolve_model_spec
from diffrt.engine.pipelines.folder_text import PromptWindow


def tiny_request(prompt: str, **kw) -> DiffusionRequest:
    return DiffusionRequest(prompt=prompt, sampling_params=SamplingParams(
        height=32, width=32, num_inference_steps=1, seed=0, **kw))


@pytest.fixture(scope="module")
def flux_tokenizers():
    folder = resolve_model_spec("tiny-flux").folder
    return (AutoTokenizer.from_pretrained(folder, subfolder="tokenizer"),
            AutoTokenizer.from_pretrained(folder, subfolder="tokenizer_2"))


def token_count(tokenizer, text: str) -> int:
    return len(tokenizer(text, truncation=False, verbose=False)["input_ids"])


def test_a_window_counts_the_tokens_past_its_end(flux_tokenizers):
    clip, _ = flux_tokenizers
    words = ["red"] * 74
    window = PromptWindow("text_encoder", clip, 77)
    fits = " ".join(words + ["fox"])  # 75 words + begin and end: exactly 77 tokens
    assert token_count(clip, fits) == 77 and window.tokens_dropped(fits) == 0
    assert window.tokens_dropped(fits + " fox") == 1
    assert window.tokens_dropped(fits + " fox fox fox") == 3


def test_a_short_text_is_not_tokenized_again():
    calls = []
    window = PromptWindow("text_encoder", lambda *a, **k: calls.append(a), 77)
    assert window.tokens_dropped("a red fox " * 7) == 0 and calls == []


def test_a_template_counts_with_the_prompt(flux_tokenizers):
    clip, _ = flux_tokenizers
    plain = PromptWindow("e", clip, 20)
    wrapped = PromptWindow("e", clip, 20, template="red red red {}")
    prompt = " ".join(["fox"] * 25)
    assert wrapped.tokens_dropped(prompt) == plain.tokens_dropped(prompt) + 3 == 10


def test_long_prompts_report_their_cuts_and_never_their_text(flux_step_engine,
                                                            flux_tokenizers, caplog):
    clip, t5 = flux_tokenizers
    log_filters.install()
    prompt = "zebraword " * 300
    caplog.set_level(logging.DEBUG, logger="diffrt.engine.pipeline_runner")
    with records(FLUX_LOGGER, logging.DEBUG) as diffusers_lines:
        out = flux_step_engine.generate(tiny_request(prompt))
        short = flux_step_engine.generate(tiny_request("a red fox"))
    assert out.ok and short.ok, (out.error, short.error)
    expected = {"text_encoder": token_count(clip, prompt) - 77,
                "text_encoder_2": token_count(t5, prompt) - 512}
    assert min(expected.values()) > 0
    assert out.metrics.prompt_tokens_dropped == expected
    assert short.metrics.prompt_tokens_dropped == {}
    assert diffusers_lines == []
    ours = [r.getMessage() for r in caplog.records if "prompt tokens cut" in r.getMessage()]
    assert ours == [f"request {out.request_id}: prompt tokens cut by text_encoder "
                    f"{expected['text_encoder']}, text_encoder_2 {expected['text_encoder_2']}"]
    assert not any("zebraword" in r.getMessage() for r in caplog.records)


def test_request_mode_counts_the_negative_prompt_too(flux_tokenizers):
    """A whole-request batch, with CFG: the negative prompt's cut adds to the prompt's."""
    from engine_helpers import shared_engine

    from diffrt.engine import DiffusionEngine, EngineConfig

    clip, _ = flux_tokenizers
    prompt, negative = "fox " * 100, "blurry " * 90
    with shared_engine(DiffusionEngine.make_engine(EngineConfig(
            model="tiny-flux", executor_backend="inproc", warmup=False))) as engine:
        out = engine.generate(DiffusionRequest(
            prompt=prompt, negative_prompt=negative, sampling_params=SamplingParams(
                height=32, width=32, num_inference_steps=1, seed=0, true_cfg_scale=2.0)))
    assert out.ok, out.error
    assert out.metrics.prompt_tokens_dropped == {
        "text_encoder": token_count(clip, prompt) - 77 + token_count(clip, negative) - 77}


def test_sd3_counts_both_clips_and_its_t5():
    import diffusers

    from diffrt.engine.pipelines.sd3.pipeline import SD3Pipeline

    pipe = diffusers.StableDiffusion3Pipeline.from_pretrained(
        resolve_model_spec("tiny-sd3").folder, local_files_only=True)
    windows = SD3Pipeline.prompt_windows(pipe)
    assert [(w.encoder, w.max_tokens) for w in windows] == [
        ("text_encoder", 77), ("text_encoder_2", 77), ("text_encoder_3", 256)]
    prompt = "zebraword " * 200
    assert [w.tokens_dropped(prompt) for w in windows] == [
        token_count(pipe.tokenizer, prompt) - 77, token_count(pipe.tokenizer_2, prompt) - 77,
        token_count(pipe.tokenizer_3, prompt) - 256]


def test_qwen_image_counts_what_its_encoder_leaves_out(tmp_path):
    """Checked against diffusers' own encoding: the embedding of a prompt
    longer than the window has exactly the window's tokens."""
    import diffusers

    from diffrt.engine.models.tiny.qwen_image import build_tiny_qwen_image_folder
    from diffrt.engine.pipelines.qwen_image.pipeline import QwenImagePipeline

    pipe = diffusers.QwenImagePipeline.from_pretrained(
        str(build_tiny_qwen_image_folder(tmp_path / "qwen", seed=0)), local_files_only=True)
    (window,) = QwenImagePipeline.prompt_windows(pipe)
    short, long = "a red fox", "a red fox " * 400
    assert window.tokens_dropped(short) == 0
    dropped = window.tokens_dropped(long)
    embeds, _ = pipe.encode_prompt(prompt=[long], device="cpu", max_sequence_length=1024)
    kept = embeds.shape[1]
    total = token_count(pipe.tokenizer, pipe.prompt_template_encode.format(long))
    assert kept == 1024 and dropped == total - pipe.prompt_template_encode_start_idx - kept > 0
