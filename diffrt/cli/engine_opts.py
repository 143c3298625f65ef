"""Options shared by `generate` and `bench`: model, sampling and engine settings.

Parsing only checks the shape of the input; the model-specific limits (size
multiple, largest size) come from the pipeline's own `check_inputs`, so the
CLI never disagrees with the engine about what is valid.
"""

from __future__ import annotations

import argparse
from typing import Any

from diffrt.cli.errors import CliError

#: the shipped demo model (tiny, trained: its pictures follow the prompt)
DEFAULT_MODEL = "diffrt-shapes"
MODEL_HELP = ("a model name (diffrt-shapes, tiny-flux, tiny-sd3), a local diffusers folder, or a "
              "hub id in the local Hugging Face cache (default: %(default)s)")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def positive_float(text: str) -> float:
    value = non_negative_float(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be > 0")
    return value


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", default=DEFAULT_MODEL,
                   help=MODEL_HELP)
    p.add_argument("--height", type=positive_int, default=None,
                   help="pixels (default: the model's; 64 for diffrt-shapes, 128 for tiny-flux, 1024 for "
                        "FLUX.1 and SD3, as diffusers)")
    p.add_argument("--width", type=positive_int, default=None,
                   help="pixels (default: the model's)")
    p.add_argument("--steps", type=positive_int, default=None,
                   help="denoising steps (default: the model's; 4 for the embedded models, "
                        "28 for FLUX.1 and SD3, as diffusers)")
    p.add_argument("--guidance-scale", type=non_negative_float, default=None,
                   help="SD3: classifier-free guidance runs when > 1; Flux: the embedded "
                        "guidance of guidance-distilled checkpoints (default: the model's; "
                        "3.5 for Flux, 7.0 for SD3, as diffusers)")
    p.add_argument("--true-cfg-scale", type=non_negative_float, default=None,
                   help="Flux, Qwen-Image: true classifier-free guidance, runs when > 1 with "
                        "a --negative-prompt or the model's default one (default: the model's: "
                        "3.0 against \"\" for diffrt-shapes, 4.0 for Qwen-Image as diffusers, "
                        "else 1.0)")


def add_engine_args(p: argparse.ArgumentParser, *, executor: str | None,
                    mode: str = "request") -> None:
    p.add_argument("--mode", choices=("request", "step"), default=mode,
                   help="request: whole-request batches; step: continuous batching at step "
                        "boundaries (default: %(default)s)")
    p.add_argument("--step-execution", dest="mode", action="store_const", const="step",
                   help="same as --mode step")
    p.add_argument("--max-num-seqs", type=positive_int, default=None,
                   help="requests the engine runs together (default: the number of prompts "
                        "for generate, 1 for bench)")
    p.add_argument("--async-output", choices=("auto", "on", "off"), default="auto",
                   help="copy outputs off the device on a background thread (default: auto)")
    p.add_argument("--world-size", type=positive_int, default=None,
                   help="worker processes (ranks) per engine; must equal the product of "
                        "the parallel degrees below, which is the default")
    p.add_argument("--executor", choices=("mp", "inproc", "ray"), default=executor,
                   help="mp: worker processes; inproc: the runner in this process; ray: the "
                        "ranks as Ray actors, across machines if need be (the ray extra; "
                        "joins $RAY_ADDRESS or starts a local instance) (default: %(default)s)")
    p.add_argument("--dtype", choices=("auto", "bfloat16", "float16", "float32"), default="auto",
                   help="weights dtype in the workers; auto: bfloat16 where the device "
                        "supports it, else float16, float32 on CPU (default: %(default)s)")
    p.add_argument("--vae-tiling", action="store_true",
                   help="decode in overlapping tiles (large images on one device)")
    p.add_argument("--vae-slicing", action="store_true",
                   help="decode one image at a time (large batches on one device)")
    p.add_argument("--offload-text-encoders", action="store_true",
                   help="keep text encoders on the CPU between encodings (small devices)")
    p.add_argument("--plugin-module", action="append", default=[], metavar="MODULE",
                   help="import MODULE here and in every worker before the model is "
                        "resolved, e.g. one that registers a pipeline (repeatable)")
    p.add_argument("--request-timeout", type=positive_float, default=None, metavar="S",
                   help="end a request still running after S seconds (default: the "
                        "engine's 600)")
    p.add_argument("--unread-output-timeout", type=positive_float, default=None, metavar="S",
                   help="free a finished output nobody has read after S seconds (default: "
                        "never; serve: 120)")
    p.add_argument("--max-request-cost", type=positive_float, default=None, metavar="MPS",
                   help="refuse requests above MPS megapixel-steps (height x width x steps x "
                        "images / 1e6, x2 with CFG; default: the engine's 1000)")
    p.add_argument("--startup-timeout", type=positive_float, default=None,
                   help="seconds each worker may take to import and load the model (a "
                        "multi-GB checkpoint takes minutes; default: the runtime's 300)")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="torch intra-op threads in each worker (default: the engine's choice; "
                        "on a busy CPU, more threads than free cores is much slower)")
    p.add_argument("--policy", choices=("fifo", "skip_ahead"), default="fifo",
                   help="scheduling policy: fifo, or skip_ahead (compatible younger requests "
                        "may pass an incompatible one, with aging) (default: %(default)s)")
    p.add_argument("--cfg-parallel-size", type=int, choices=(1, 2), default=1,
                   help="2: split classifier-free guidance's two branches across two worker "
                        "ranks (a batch without CFG: its rows)")
    p.add_argument("--ulysses-degree", type=positive_int, default=1, metavar="N",
                   help="split each transformer call's image tokens across N worker ranks "
                        "(Ulysses sequence parallelism; the heads must divide by N)")
    p.add_argument("--ring-degree", type=positive_int, default=1, metavar="N",
                   help="the same split with ring attention (any head count); with "
                        "--ulysses-degree, Ulysses inside and the ring across. The ranks are "
                        "the product of the three degrees")
    p.add_argument("--vae-parallel", action="store_true",
                   help="decode each image in bands of rows, one per rank (exact: halo rows "
                        "and shared norm statistics)")
    p.add_argument("--compile", nargs="?", const="inductor", default=None, metavar="BACKEND",
                   help="torch.compile each worker's denoiser (BACKEND, default inductor); "
                        "it compiles at warm-up and once more when a shape first changes")
    p.add_argument("--steps-per-tick", type=positive_int, default=None, metavar="N",
                   help="step mode: denoise steps one worker call may run while no request "
                        "waits to join (default: the engine's 4; 1 = one step per call)")
    p.add_argument("--batch-wait-ms", type=non_negative_float, default=None,
                   help="how long an idle engine holds a new batch open so a burst can join "
                        "it; 0 schedules at once (default: 20 for several prompts in generate, "
                        "else sized from measured request times, at most 50)")


def engine_settings(args: argparse.Namespace | dict[str, Any]) -> dict[str, Any]:
    """The EngineConfig keyword arguments for a parsed command line (or a dict of it)."""
    get = args.get if isinstance(args, dict) else lambda k: getattr(args, k, None)
    settings: dict[str, Any] = {
        "model": get("model"),
        "step_execution": get("mode") == "step",
        "max_num_seqs": get("max_num_seqs") or 1,
    }
    if get("async_output") != "auto":
        settings["async_output"] = get("async_output") == "on"
    if get("world_size") is not None:
        settings["world_size"] = get("world_size")
    if get("executor"):
        settings["executor_backend"] = get("executor")
    if get("threads"):
        settings["torch_threads"] = get("threads")
    if get("dtype") not in (None, "auto"):  # auto is the engine's default
        settings["dtype"] = get("dtype")
    for flag in ("vae_tiling", "vae_slicing", "offload_text_encoders", "vae_parallel"):
        if get(flag):
            settings[flag] = True
    if get("request_timeout"):
        settings["request_timeout_s"] = get("request_timeout")
    if get("unread_output_timeout"):
        settings["unread_output_timeout_s"] = get("unread_output_timeout")
    if get("max_request_cost"):
        settings["max_request_cost"] = get("max_request_cost")
    if get("plugin_module"):
        settings["plugin_modules"] = list(get("plugin_module"))
    options: dict[str, Any] = {}
    if get("startup_timeout"):
        options["startup_timeout_s"] = get("startup_timeout")
    if get("log_level") not in (None, "WARNING"):  # workers log as this process does
        options["worker_env"] = {"DIFFRT_LOG_LEVEL": worker_log_spec(get("log_level"))}
    if options:
        settings["executor_options"] = options
    for degree in ("cfg_parallel_size", "ulysses_degree", "ring_degree"):
        if (get(degree) or 1) > 1:  # the engine derives world_size from them
            settings[degree] = get(degree)
    if get("compile"):
        settings["compile"] = True
        settings["compile_backend"] = get("compile")
    if get("steps_per_tick"):
        settings["max_steps_per_tick"] = get("steps_per_tick")
    if get("policy") != "fifo":
        settings["scheduling_policy"] = get("policy")
    if get("batch_wait_ms") is not None:
        settings[batch_wait_field(get("mode"))] = get("batch_wait_ms")
    return settings


def worker_log_spec(level: str) -> str:
    """``DIFFRT_LOG_LEVEL`` for workers of a CLI run at ``level``: that level,
    loading progress at INFO or more verbose."""
    progress = "DEBUG" if level == "DEBUG" else "INFO"
    return f"{level},diffrt.load={progress}"


def batch_wait_field(mode: str) -> str:
    """The EngineConfig field of the coalescing window in ``mode``."""
    return "step_batch_max_wait_ms" if mode == "step" else "request_batch_max_wait_ms"


def make_engine(settings: dict[str, Any]) -> Any:
    """Build and start an engine; user mistakes surface as ValueError (shown cleanly)."""
    from diffrt.engine import DiffusionEngine, EngineConfig

    return DiffusionEngine.make_engine(EngineConfig(**settings))


def sampling_params(args: argparse.Namespace, *, seed: int | None, n: int = 1) -> Any:
    from diffrt.engine.sampling import SamplingParams

    return SamplingParams(height=args.height, width=args.width, num_inference_steps=args.steps,
                          guidance_scale=args.guidance_scale, seed=seed,
                          num_outputs_per_prompt=n, true_cfg_scale=args.true_cfg_scale)


def pipeline_class(model: str, plugin_modules: list[str] = ()) -> Any:
    """The model's pipeline class, after importing the plugins that may register it."""
    import importlib

    from diffrt.engine.pipelines.registry import resolve_pipeline_class

    for name in plugin_modules:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise CliError(f"--plugin-module {name!r}: cannot import it ({exc})") from None
    return resolve_pipeline_class(model)


def check_requests(model: str, requests: list[Any], plugin_modules: list[str] = ()) -> None:
    """Refuse an unknown model or bad sampling parameters before loading anything.

    The pipeline class checks without weights; its errors name the field.
    """
    cls = pipeline_class(model, plugin_modules)
    for request in requests:
        request.validate()
        cls.check_inputs(request)


def model_defaults(model: str, plugin_modules: list[str] = ()) -> dict[str, Any]:
    """The model's sampling defaults (what options left unset become)."""
    return dict(pipeline_class(model, plugin_modules).sampling_defaults)

