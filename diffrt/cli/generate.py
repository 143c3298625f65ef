"""`diffrt generate`: prompts in, image files out, one progress bar per request.

Every prompt becomes one request; all of them go to the engine at once and are
consumed concurrently (asyncio.gather over `step_streaming`), so the engine can
batch them. Progress bars are driven by the engine's step progress outputs.

``--image`` (and ``--mask``) turn every prompt's request into image-to-image
(inpainting): the files are read as the server reads an upload
(``engine.image_files``: EXIF orientation, the pixel bound, a mask's alpha
convention), and ``--strength`` says how much is re-drawn.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

from diffrt.cli.engine_opts import (
    add_engine_args,
    add_sampling_args,
    check_requests,
    engine_settings,
    make_engine,
    model_name,
    model_spec,
    plugin_modules,
    sampling_params,
)
from diffrt.cli.errors import EXIT_FAILURE, CliError
from diffrt.cli.paths import image_paths
from diffrt.cli.profiles import GENERATE
from diffrt.cli.trace_session import add_trace_args, check_trace_args, trace_session


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "generate", help="generate images from prompts",
        description="Generate images. Several prompts (--prompt repeated, or --prompts-file) "
                    "run concurrently through one engine.")
    p.add_argument("--prompt", "-p", action="append", default=[],
                   help="a prompt; repeat for several")
    p.add_argument("--prompts-file", type=Path,
                   help="a text file with one prompt per line, '-' for stdin (blank lines and "
                        "lines starting with # are skipped)")
    p.add_argument("--negative-prompt", default=None)
    p.add_argument("--output", "-o", default="out.png",
                   help="image file (a video model: .mp4 for the H.264 clip, .png for its "
                        "frames in one strip); with several prompts out.png becomes out-<i>.png (i: the "
                        "prompt's index), with -n > 1 out[-<i>]-<k>.png (default: %(default)s)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    p.add_argument("--image", action="append", default=[], type=Path, metavar="FILE",
                   help="an input image (PNG, JPEG, WebP, GIF, BMP): image-to-image with "
                        "--strength, inpainting with --mask; repeat for a model that takes "
                        "several")
    p.add_argument("--mask", type=Path, default=None, metavar="FILE",
                   help="where to repaint the (first) --image, as large as it: white "
                        "(without alpha, as diffusers), or fully transparent pixels (with "
                        "alpha, as OpenAI's edits)")
    # --seed is the first prompt's: prompt i uses seed+i
    add_sampling_args(p, profile=GENERATE)
    add_engine_args(p, profile=GENERATE)
    add_trace_args(p)
    p.set_defaults(func=run)


#: request fields -> the flags that set them (in refusals)
_FLAGS = {"images": "--image", "mask_image": "--mask"}


def read_inputs(args: argparse.Namespace) -> tuple[list[Any], Any]:
    """The ``--image`` files and the ``--mask`` file as the engine takes them."""
    from diffrt.engine.image_files import decode_image, mask_for_engine

    if args.mask is not None and not args.image:
        raise CliError("--mask needs an --image to mask")
    images = [decode_image(_read_file(path, "--image"), f"--image {str(path)!r}")
              for path in args.image]
    mask = None
    if args.mask is not None:
        name = f"--mask {str(args.mask)!r}"
        mask = mask_for_engine(decode_image(_read_file(args.mask, "--mask"), name), name)
    return images, mask


def _read_file(path: Path, flag: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise CliError(f"cannot read {flag} {str(path)!r}: {exc.strerror or exc}") from None


def _check(model: str, requests: list[Any], plugins: list[str]) -> None:
    """``check_requests``, and the input images converted as submission will
    convert them (a mask of another size than its image is refused here,
    before the engine starts); refusals name the image flags."""
    from diffrt.engine.input_images import to_arrays
    from diffrt.engine.sampling import InvalidRequestError

    try:
        check_requests(model, requests, plugins)
        if requests[0].images:
            spec = model_spec(model, plugins)
            resolved = spec.with_defaults(requests[0])
            to_arrays(resolved.images, resolved.mask_image,
                      lambda w, h: spec.input_size(resolved, w, h))
    except InvalidRequestError as exc:
        field = exc.field.split("[", 1)[0]
        if field not in _FLAGS:
            raise
        raise CliError(f"{_FLAGS[field]}: {str(exc)[len(exc.field) + 2:]}") from None


def read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompt)
    if args.prompts_file is not None:
        name = str(args.prompts_file)
        try:
            text = sys.stdin.read() if name == "-" else args.prompts_file.read_text("utf-8")
        except OSError as exc:
            raise CliError(f"cannot read --prompts-file {name!r}: {exc.strerror or exc}") from None
        except UnicodeDecodeError as exc:
            raise CliError(f"--prompts-file {name!r} is not UTF-8 text (byte {exc.start} of "
                           "the file); give one prompt per line") from None
        if "\x00" in text:
            raise CliError(f"--prompts-file {name!r} looks binary (it holds NUL bytes); "
                           "give one prompt per line")
        prompts += [ln.strip() for ln in text.splitlines()
                    if ln.strip() and not ln.lstrip().startswith("#")]
    if not prompts:
        raise CliError("give at least one --prompt (or a --prompts-file with prompts in it)")
    return prompts


class _Progress:
    """One tqdm bar per request, updated from its step progress outputs."""

    def __init__(self, prompts: list[str], steps: int, enabled: bool):
        self.bars: list[Any] = []
        if not enabled:
            return
        from tqdm import tqdm

        for i, prompt in enumerate(prompts):
            label = prompt if len(prompt) <= 24 else prompt[:21] + "..."
            self.bars.append(tqdm(total=steps, desc=f"[{i}] {label}", unit="step",
                                  position=i, leave=True, file=sys.stderr, dynamic_ncols=True))

    def update(self, index: int, output: Any) -> None:
        if not self.bars:
            return
        bar = self.bars[index]
        if output.total_steps and bar.total != output.total_steps:
            bar.total = output.total_steps
        done = bar.total if output.finished and output.ok else output.step
        if done > bar.n:
            bar.update(done - bar.n)
        if output.finished and not output.ok:
            bar.set_postfix_str("aborted" if output.aborted else "failed")

    def close(self) -> None:
        for bar in self.bars:
            bar.close()


async def _consume(engine: Any, index: int, request: Any, progress: _Progress) -> Any:
    final = None
    async for output in engine.step_streaming(request):
        progress.update(index, output)
        if output.finished:
            final = output
    return final


async def _run_all(engine: Any, requests: list[Any], progress: _Progress) -> list[Any]:
    return await asyncio.gather(*(_consume(engine, i, r, progress) for i, r in enumerate(requests)))


def run(args: argparse.Namespace) -> int:
    prompts = read_prompts(args)
    outputs = sampling_params(args).num_outputs_per_prompt  # the declared default if unset
    paths = image_paths(args.output, len(prompts), outputs)
    check_trace_args(args)
    from diffrt.engine.request import DiffusionRequest

    model, plugins = model_name(args), plugin_modules(args)
    images, mask = read_inputs(args)
    # a .mp4 path: the engine encodes each clip (output_type "mp4"), off its loop
    encoded = {"output_type": "mp4"} if str(args.output).lower().endswith(".mp4") else {}
    requests = [DiffusionRequest(prompt=p, negative_prompt=args.negative_prompt,
                                 sampling_params=sampling_params(
                                     args, seed=None if args.seed is None else args.seed + i,
                                     **encoded),
                                 images=list(images), mask_image=mask)
                for i, p in enumerate(prompts)]
    _check(model, requests, plugins)
    # the profile's rules: the whole burst joins one batch
    settings = GENERATE.apply(engine_settings(args), prompts=len(requests))

    start = time.perf_counter()
    with trace_session(args, title=f"diffrt generate ({model}, {len(prompts)} prompts)") as tw:
        engine = make_engine(settings)
        steps = _denoise_steps(requests[0], model, plugins)
        progress = _Progress(prompts, steps, enabled=not args.no_progress)
        try:
            with tw.window():  # the trace leaves out start-up and warm-up
                finals = asyncio.run(_run_all(engine, requests, progress))
        finally:
            progress.close()
            engine.close()
        elapsed = time.perf_counter() - start
        failed = _save(prompts, finals, paths)
        print(f"{len(prompts) - failed} of {len(prompts)} prompts done in {elapsed:.2f} s "
              f"(engine start-up included)")
    return EXIT_FAILURE if failed else 0


def _denoise_steps(request: Any, model: str, plugins: list[str]) -> int:
    """The steps a request's progress bar counts: with an input image, those
    ``--strength`` leaves (the engine's outputs correct the bar otherwise)."""
    return model_spec(model, plugins).with_defaults(request).sampling_params.denoise_steps()


def _save(prompts: list[str], finals: list[Any], paths: list[list[Path]]) -> int:
    """Write every image, say where; return the number of prompts that failed."""
    failed = 0
    for prompt, final, targets in zip(prompts, finals, paths, strict=True):
        if final is None or not final.ok:
            failed += 1
            reason = "no output" if final is None else (final.error or "aborted")
            print(f"failed: {prompt!r}: {reason}", file=sys.stderr)
            continue
        m = final.metrics
        took = (f", {m.finished_time - m.arrival_time:.2f} s"
                if m.finished_time is not None and m.arrival_time else "")
        took += _cache_note(m.cache)
        for image, path in zip(final.images or [], targets, strict=False):
            image.save(path)
            print(f"wrote {path} ({image.width}x{image.height}{took}) for {prompt!r}")
        for k, (frames, path) in enumerate(zip(final.frames or [], targets, strict=False)):
            seconds = len(frames) / final.fps if final.fps else 0.0
            sound = _sound_note(final)
            if path.suffix.lower() == ".mp4":
                path.write_bytes(final.output[k])
                print(f"wrote {path} (H.264{sound[0]}, {len(frames)} frames of {frames[0].width}x"
                      f"{frames[0].height}, a {seconds:.2f} s clip at {final.fps:g} fps{took}) "
                      f"for {prompt!r}")
                continue
            frame_strip(frames).save(path)
            print(f"wrote {path} (a strip of {len(frames)} frames of {frames[0].width}x"
                  f"{frames[0].height}, a {seconds:.2f} s clip at {final.fps:g} fps{took}"
                  f"{sound[1]}) for {prompt!r}")
    return failed


def _sound_note(final: Any) -> tuple[str, str]:
    """What a clip's line says of its sound (LTX-2 makes one): in an .mp4
    ("+ AAC sound ...") and beside a strip (where it is not written)."""
    if final.waveform is None:
        return "", ""
    channels = final.waveform.shape[1]
    what = f"{'stereo' if channels == 2 else f'{channels}-channel'} sound at {final.sample_rate} Hz"
    return f" + AAC {what}", f"; its {what} is written with an .mp4 path only"


def frame_strip(frames: list[Any]) -> Any:
    """A video's frames side by side in one image, first to last (what a
    .png path gets; a .mp4 path gets the encoded clip)."""
    from PIL import Image

    width, height = frames[0].size
    strip = Image.new("RGB", (width * len(frames), height))
    for i, frame in enumerate(frames):
        strip.paste(frame, (i * width, 0))
    return strip


def _cache_note(cache: Any) -> str:
    """What a request's step cache did (``CacheMetrics``), for the line that
    says where its images went: the reuse is what ``--cache-threshold`` tunes."""
    if cache is None:
        return ""
    if cache.uncached_reason is not None:
        return f", ran without its {cache.policy} cache ({cache.uncached_reason})"
    steps = cache.steps_computed + cache.steps_reused
    return f", {cache.policy} cache reused {cache.steps_reused} of {steps} steps"
