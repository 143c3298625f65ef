"""`diffrt bench`: load an engine (or, with `--base-url`, a running server),
print throughput, latency percentiles and where the time went; `--compare`
runs several configurations in one go."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from diffrt.cli.bench_load import EngineTarget, drive
from diffrt.cli.bench_stats import ratio, summarize
from diffrt.cli.engine_opts import (
    UNSET,
    add_engine_args,
    add_sampling_args,
    check_requests,
    engine_settings,
    flag_parsers,
    make_engine,
    model_defaults,
    model_name,
    plugin_modules,
    positive_float,
    positive_int,
    sampling_params,
)
from diffrt.cli.errors import EXIT_FAILURE, CliError
from diffrt.cli.paths import check_writable_file
from diffrt.cli.profiles import BENCH
from diffrt.cli.renamed import add_renamed
from diffrt.cli.table import format_table
from diffrt.cli.trace_session import (
    TraceWindows,
    add_trace_args,
    check_trace_args,
    trace_session,
)
from diffrt.serve.settings import API_KEY_ENV

#: load keys a --compare spec may change, and how their values are read (the
#: engine settings and sampling fields read theirs as their flags do)
LOAD_PARSERS = {"concurrency": positive_int, "request_rate": positive_float,
                "num_requests": positive_int, "distinct_prompts": positive_int}
#: bench's own flags of earlier releases -> what replaced them
RENAMED_FLAGS = {"--http-timeout": "--http-timeout-s"}
#: bench's flags that took a value in earlier releases -> how to say it now
RENAMED_VALUES = {"--warmup": "--warmup-requests N (--warmup/--no-warmup is the engine's "
                              "warm-up)"}
#: compare keys of earlier releases -> their names now
RENAMED_KEYS = {"mode": "step_execution", "threads": "torch_threads",
                "policy": "scheduling_policy", "executor": "executor_backend",
                "batch_wait_ms": "request_batch_max_wait_ms or step_batch_max_wait_ms"}


def compare_keys() -> dict[str, Any]:
    return {**flag_parsers(), **LOAD_PARSERS}


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "bench", help="measure throughput and latency under load",
        description="Drive an engine with a configurable load and print throughput, "
                    "p50/p90/p99 latency, queue wait, forward time and output wait.",
        epilog="--compare example: diffrt bench --compare async_output=off async_output=on "
               "'step_execution=on,max_num_seqs=8'  (keys: every engine setting and sampling "
               "field by name, and " + ", ".join(LOAD_PARSERS) + ")")
    p.add_argument("--num-requests", "-N", type=positive_int, default=16,
                   help="measured requests per configuration (default: %(default)s)")
    p.add_argument("--concurrency", "-c", type=positive_int, default=4,
                   help="requests in flight, closed loop (default: %(default)s)")
    p.add_argument("--request-rate", type=positive_float, default=None,
                   help="open loop instead: Poisson arrivals at this many requests/s")
    p.add_argument("--warmup-requests", type=int, default=1, metavar="N",
                   help="unmeasured requests run first on each engine (default: %(default)s)")
    p.add_argument("--distinct-prompts", type=positive_int, default=None, metavar="K",
                   help="draw the prompts from K distinct ones, in turn, as real traffic "
                        "repeats prompts (default: every request its own prompt); the "
                        "'cache hit' column shows what the prompt-embedding cache saved")
    # --seed seeds the requests (request i: seed+i) and the arrival times
    add_sampling_args(p, profile=BENCH)
    add_engine_args(p)
    add_renamed(p, RENAMED_FLAGS, RENAMED_VALUES)
    p.add_argument("--compare", nargs="+", metavar="SPEC",
                   help="run one configuration per SPEC ('key=value,key=value' on top of the "
                        "other options) and print ratios against the first")
    p.add_argument("--json", metavar="RESULTS.json", help="also write the results as JSON")
    p.add_argument("--base-url", metavar="URL",
                   help="load a running server over HTTP (POST URL/v1/images/generations) "
                        "instead of an in-process engine; engine options do not apply")
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                   help=f"with --base-url: the server's key (default: ${API_KEY_ENV})")
    p.add_argument("--http-timeout-s", type=positive_float, default=300.0, metavar="S",
                   help="with --base-url: a request unanswered after S seconds fails; after "
                        "3 in a row the rest are not sent (default: %(default)s)")
    p.add_argument("--explain", action="store_true",
                   help="print why requests of different sizes (adapters, caches) shared a "
                        "step or ran apart (the step-cost model's decisions), and its "
                        "prediction error")
    add_trace_args(p)
    p.set_defaults(func=run)


def parse_spec(spec: str) -> dict[str, Any]:
    """'step_execution=on,max_num_seqs=8' -> {"step_execution": True, "max_num_seqs": 8}."""
    overrides: dict[str, Any] = {}
    keys = compare_keys()
    for part in filter(None, (s.strip() for s in spec.split(","))):
        key, sep, text = part.partition("=")
        key = key.strip().replace("-", "_")
        if key in RENAMED_KEYS:
            raise CliError(f"--compare {spec!r}: {key} was renamed: use {RENAMED_KEYS[key]}")
        # repeatable flags: the same for every configuration
        if key in ("plugin_modules", "worker_env", "lora_modules", "loras", "lora"):
            raise CliError(f"--compare {spec!r}: {key} is not compared; give it as "
                           f"--{key.replace('_', '-')} for all configurations")
        if not sep or key not in keys:
            raise CliError(f"--compare {spec!r}: expected key=value with a key among the "
                           f"engine settings, the sampling fields and "
                           f"{', '.join(LOAD_PARSERS)}, got {part!r}")
        key = {"steps": "num_inference_steps", "num_images": "num_outputs_per_prompt"}.get(
            key, key)
        try:
            overrides[key] = keys[key](text.strip())
        except argparse.ArgumentTypeError as exc:
            raise CliError(f"--compare {spec!r}: {key} {exc}") from None
    return overrides


def build_configs(args: argparse.Namespace) -> list[tuple[str, dict[str, Any]]]:
    """(label, options) for each configuration; without --compare just the base one."""
    # every option (engine options such as --dtype too), then what a spec changes
    base = {k: v for k, v in vars(args).items() if k not in ("func", "compare")}
    if not args.compare and getattr(args, "base_url", None):
        return [(args.base_url, base)]
    if not args.compare:
        def shown(name: str, default: Any) -> Any:
            return default if base.get(name, UNSET) is UNSET else base[name]

        mode = "step" if shown("step_execution", False) else "request"
        label = (f"{mode} mode, max_num_seqs={shown('max_num_seqs', 1)}, "
                 f"async_output={shown('async_output', 'auto')}, "
                 f"executor={shown('executor_backend', 'mp')}")
        return [(label, base)]
    return [(spec, {**base, **parse_spec(spec)}) for spec in args.compare]


def _requests(opts: dict[str, Any], count: int, seed: int, tag: str) -> list[Any]:
    from diffrt.engine.request import DiffusionRequest

    distinct = opts.get("distinct_prompts") or count
    return [DiffusionRequest(prompt=f"bench {tag} prompt {i % distinct}",
                             sampling_params=sampling_params(opts, seed=seed + i))
            for i in range(count)]


def _run_config(engine: Any, label: str, opts: dict[str, Any], args: argparse.Namespace,
                tw: TraceWindows) -> dict:
    if args.warmup_requests > 0:
        drive(EngineTarget(engine),
              _requests(opts, args.warmup_requests, args.seed + 10_000, f"{label} warmup"),
              concurrency=args.warmup_requests, rate=None)
    # Prompts of their own per configuration: configurations sharing an engine
    # would otherwise find the previous one's prompts in the prompt cache.
    requests = _requests(opts, opts["num_requests"], args.seed, f"{label} measured")
    before = engine.stats()
    with tw.window(label):  # the trace shows the measured requests only
        samples, wall = drive(EngineTarget(engine), requests, concurrency=opts["concurrency"],
                              rate=opts["request_rate"], seed=args.seed)
    after = engine.stats()
    return {**summarize(samples, wall),
            **text_encoding_summary(after.text_encoding - before.text_encoding, len(requests)),
            **step_batch_summary(before, after)}


def step_batch_summary(before: Any, after: Any) -> dict[str, float | None]:
    """Mean rows and tokens per denoise step between two stats snapshots
    (None in REQUEST_BATCH, which does not count them)."""
    def mean(field: str) -> float | None:
        b, a = getattr(before, field), getattr(after, field)
        steps = a.count - b.count
        return (a.sum - b.sum) / steps if steps else None

    return {"step_rows_mean": mean("step_batch_rows"),
            "step_tokens_mean": mean("step_batch_tokens")}


def text_encoding_summary(delta: Any, num_requests: int) -> dict[str, Any]:
    """Text-encoder time per request and the share of prompts the cache answered
    (a request with CFG looks up two prompts: its own and the negative one)."""
    lookups = delta.encoded + delta.cache_hits
    return {"text_encode_ms": delta.seconds * 1000.0 / num_requests if num_requests else None,
            "prompts_encoded": delta.encoded,
            "prompt_cache_hit_rate": delta.cache_hits / lookups if lookups else None}


#: the sampling fields a model gives defaults for, shown in the table
_DEFAULTED = ("height", "width", "num_inference_steps", "guidance_scale")


def _fill_model_defaults(opts: dict[str, Any]) -> None:
    """Options left unset take the model's defaults, so the table and the JSON
    say what ran."""
    defaults = model_defaults(model_name(opts), plugin_modules(opts))
    for field in _DEFAULTED:
        if opts.get(field, UNSET) in (UNSET, None):
            opts[field] = defaults[field]


#: what a --compare spec may change when the bench drives a server (the load)
LOAD_KEYS = ("concurrency", "request_rate", "num_requests", "height", "width",
             "num_inference_steps", "guidance_scale", "true_cfg_scale", "distinct_prompts")
#: the load a result reports
_LOAD_SHOWN = ("num_requests", "concurrency", "request_rate", "height", "width",
               "num_inference_steps", "distinct_prompts")


def run(args: argparse.Namespace) -> int:
    if args.seed is None:
        raise CliError("--seed: bench needs a number (it seeds the requests and the arrival "
                       "times)")
    configs = build_configs(args)
    if args.json:
        check_writable_file(args.json, "the results")
    if args.base_url:
        return _run_http(args, configs)
    check_trace_args(args)
    from diffrt.engine import EngineConfig

    for _, opts in configs:  # every configuration is checked before the first one runs
        check_requests(model_name(opts), _requests(opts, 1, args.seed, "check"),
                       plugin_modules(opts))
        _fill_model_defaults(opts)
        EngineConfig(**engine_settings(opts)).model_spec()  # the model refuses what it cannot run

    results = []
    engine, engine_key = None, None
    title = f"diffrt bench: {model_name(args)}, {_load_text(configs[0][1])}"
    with trace_session(args, title=title) as tw:
        try:
            for i, (label, opts) in enumerate(configs, 1):
                tag = f"[{i}/{len(configs)}] {label}"
                settings = engine_settings(opts)
                key = json.dumps(settings, sort_keys=True)
                if key != engine_key:  # configurations differing only in load share an engine
                    if engine is not None:
                        engine.close()
                        engine = None
                    print(f"{tag}: starting the engine", file=sys.stderr, flush=True)
                    engine, engine_key = make_engine(settings), key
                stats = _run_config(engine, label, opts, args, tw)
                if args.explain:
                    _explain(engine, tag)
                results.append({"label": label, "engine": settings,
                                "load": {k: opts[k] for k in _LOAD_SHOWN}, **stats})
                print(f"{tag}: {stats['throughput_rps'] or 0:.2f} req/s, "
                      f"p50 {stats['latency_p50_ms'] or 0:.0f} ms", file=sys.stderr, flush=True)
        finally:
            if engine is not None:
                engine.close()
        _report(results, args)  # before the trace summary
    return EXIT_FAILURE if any(r["failed"] for r in results) else 0


def _explain(engine: Any, tag: str) -> None:
    """The share/split decisions of the run so far and the step-cost model's fit."""
    share = getattr(engine.scheduler, "share", None)
    run_time = engine.run_time
    error = run_time.online.error()
    print(f"{tag}: step-cost model {run_time.coefficients}; prediction error "
          + ("none yet" if error is None else f"median {error[0]:.1%}, p90 {error[1]:.1%}"))
    if share is None:
        print(f"{tag}: no share decisions (share_steps=always, or sizes keyed apart)")
        return
    print(f"{tag}: {share.shared} shared, {share.split} split")
    for decision in share.log:
        print(f"  {decision.explain()}")
    share.log.clear()


def _run_http(args: argparse.Namespace, configs: list[tuple[str, dict[str, Any]]]) -> int:
    """The same load on a running server, over HTTP (``http_target.py``)."""
    from diffrt.cli.http_target import HttpTarget, served_model

    if args.trace or args.plot:
        raise CliError("--trace/--plot record this process's engine: not with --base-url")
    for spec in args.compare or ():
        engine_keys = set(parse_spec(spec)) - set(LOAD_KEYS)
        if engine_keys:
            raise CliError(f"--compare {spec!r}: {', '.join(sorted(engine_keys))} would change "
                           "the engine; with --base-url only the load can change "
                           f"({', '.join(LOAD_KEYS)})")
    model = served_model(args.base_url, args.api_key)
    results = []
    for i, (label, opts) in enumerate(configs, 1):
        tag = f"[{i}/{len(configs)}] {label}"

        def target() -> HttpTarget:
            return HttpTarget(args.base_url, api_key=args.api_key, timeout_s=args.http_timeout_s)

        if args.warmup_requests > 0:
            drive(target(), _requests(opts, args.warmup_requests, args.seed + 10_000,
                                      f"{label} warmup"),
                  concurrency=args.warmup_requests, rate=None)
        requests = _requests(opts, opts["num_requests"], args.seed, f"{label} measured")
        samples, wall = drive(target(), requests, concurrency=opts["concurrency"],
                              rate=opts["request_rate"], seed=args.seed)
        stats = {**summarize(samples, wall), "text_encode_ms": None, "prompts_encoded": None,
                 "prompt_cache_hit_rate": None, "step_rows_mean": None, "step_tokens_mean": None}
        results.append({"label": label, "engine": {"base_url": args.base_url, "model": model},
                        "load": {k: _shown(opts.get(k)) for k in _LOAD_SHOWN}, **stats})
        print(f"{tag}: {stats['throughput_rps'] or 0:.2f} req/s, "
              f"p50 {stats['latency_p50_ms'] or 0:.0f} ms, {stats['failed']} failed",
              file=sys.stderr, flush=True)
    _report(results, args)
    return EXIT_FAILURE if any(r["failed"] for r in results) else 0


def _report(results: list[dict[str, Any]], args: argparse.Namespace) -> None:
    base = results[0]
    for r in results:
        r["throughput_vs_first"] = ratio(r["throughput_rps"], base["throughput_rps"])
        r["p50_vs_first"] = ratio(r["latency_p50_ms"], base["latency_p50_ms"])
    print(render_results(results))
    if args.json:
        from diffrt.platforms import current_platform

        doc = {"platform": current_platform.name, "results": results}
        Path(args.json).write_text(json.dumps(doc, indent=2))
        print(f"results: {args.json}")


def _load_text(load: dict[str, Any]) -> str:
    shape = (f"rate {load['request_rate']:g}/s" if load["request_rate"]
             else f"concurrency {load['concurrency']}")
    prompts = (f", {load['distinct_prompts']} distinct prompts"
               if load.get("distinct_prompts") else "")
    height, width = _shown(load.get("height")), _shown(load.get("width"))
    size = f"{height}x{width}" if height and width else "the model's size"
    steps = _shown(load.get("num_inference_steps"))
    steps = f"{steps} steps" if steps else "the model's steps"
    return f"{load['num_requests']} req, {shape}, {size}, {steps}{prompts}"


def _shown(value: Any) -> Any:
    """A load value for the report (a flag left unset: None, the model's)."""
    return None if value is UNSET else value


def _failed(r: dict[str, Any]) -> str:
    """``3 (429: 2, no answer: 1)``: failures, and their statuses over HTTP."""
    by_status = {k: v for k, v in r.get("failed_by_status", {}).items() if k != "error"}
    detail = ", ".join(f"{k}: {v}" for k, v in by_status.items())
    return f"{r['failed']} ({detail})" if detail else str(r["failed"])


def _times(value: float | None) -> str | None:
    return None if value is None else f"{value:.2f}x"


def _percent(value: float | None) -> str | None:
    return None if value is None else f"{100 * value:.0f}%"


def render_results(results: list[dict[str, Any]]) -> str:
    headers = ["config", "req/s", "x first", "p50 ms", "p90 ms", "p99 ms", "p50 x first",
               "queue ms", "forward ms", "encode ms", "cache hit", "out wait ms", "post ms",
               "rows/step", "tokens/step", "failed"]
    deadlines = any(r.get("goodput_rps") is not None for r in results)
    if deadlines:
        headers[2:2] = ["goodput/s", "in time"]
    rows = [[r["label"], r["throughput_rps"], _times(r["throughput_vs_first"]), r["latency_p50_ms"],
             r["latency_p90_ms"], r["latency_p99_ms"], _times(r["p50_vs_first"]), r["queue_wait_ms"],
             r["forward_ms"], r["text_encode_ms"], _percent(r["prompt_cache_hit_rate"]),
             r["output_wait_ms"], r["postprocess_ms"], r.get("step_rows_mean"),
             r.get("step_tokens_mean"), _failed(r)]
            for r in results]
    if deadlines:
        for row, r in zip(rows, results, strict=True):
            row[2:2] = [r.get("goodput_rps"), _percent(r.get("deadlines_met"))]
    loads = {_load_text(r["load"]) for r in results}
    title = "load: " + (loads.pop() if len(loads) == 1 else "per configuration")
    return format_table(headers, rows, title=title)
