"""Pieces of the CLI that need no engine: tables, percentiles, specs, paths, the env report."""

from __future__ import annotations

import pytest

from diffrt.cli import main
from diffrt.cli.bench import build_configs, parse_spec, render_results, text_encoding_summary
from diffrt.cli.bench_stats import Sample, median, percentile, summarize
from diffrt.cli.env import render_report
from diffrt.cli.errors import CliError
from diffrt.cli.paths import check_writable_file, image_paths
from diffrt.cli.table import format_table
from diffrt.engine.outputs import TextEncoderStats


def test_percentile_interpolates_like_numpy():
    import numpy as np

    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 50) == median(values) == 2.5
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 4.0
    assert percentile(values, 99) == pytest.approx(float(np.percentile(values, 99)))
    assert percentile([5.0], 99) == 5.0
    assert percentile([], 50) is None and median([]) is None


def test_summary_counts_failures_and_ignores_them_in_latency():
    samples = [Sample(latency=0.1, ok=True, images=1, queue_wait=0.01, forward_time=0.05),
               Sample(latency=0.3, ok=True, images=1, queue_wait=0.03, forward_time=0.05),
               Sample(latency=9.0, ok=False)]
    stats = summarize(samples, wall_s=0.5)
    assert stats["failed"] == 1 and stats["requests"] == 3
    assert stats["throughput_rps"] == pytest.approx(4.0)
    assert stats["latency_p50_ms"] == pytest.approx(200.0)
    assert stats["queue_wait_ms"] == pytest.approx(20.0)
    assert stats["output_wait_ms"] is None


def test_goodput_counts_the_requests_that_finished_within_their_deadline():
    samples = [Sample(latency=0.1, ok=True, deadline=0.2),   # in time
               Sample(latency=0.3, ok=True, deadline=0.2),   # late
               Sample(latency=0.1, ok=False, deadline=1.0),  # failed: missed
               Sample(latency=0.1, ok=True)]                 # no deadline: not counted
    stats = summarize(samples, wall_s=0.5)
    assert stats["goodput_rps"] == pytest.approx(2.0)
    assert stats["deadlines_met"] == pytest.approx(1 / 3)
    assert summarize(samples[3:], wall_s=0.5)["goodput_rps"] is None
    load = {"num_requests": 4, "concurrency": 2, "request_rate": None, "height": 64,
            "width": 64, "num_inference_steps": 2}
    row = {"label": "slo", "load": load, "throughput_vs_first": 1.0, "p50_vs_first": 1.0,
           **stats, **text_encoding_summary(TextEncoderStats(), 4)}
    text = render_results([row])
    assert "goodput/s" in text and "33%" in text
    assert "goodput/s" not in render_results([{**row, "goodput_rps": None}])


def test_table_aligns_columns():
    text = format_table(["config", "req/s"], [["a", 1.5], ["longer name", 12.25]])
    lines = text.splitlines()
    assert len({len(ln) for ln in lines}) == 1  # right-aligned numbers: equal widths
    assert lines[2].startswith("a ") and lines[3].endswith("12.2")


def test_compare_specs_parse_and_apply_over_the_base(tmp_path):
    assert parse_spec("step_execution=on, max-num-seqs=8,async_output=false") == {
        "step_execution": True, "max_num_seqs": 8, "async_output": False}
    for bad in ("step_execution=sideways", "max_num_seqs=0", "colour=red", "step_execution",
                "scheduling_policy=lifo"):
        with pytest.raises(CliError):
            parse_spec(bad)
    from diffrt.cli import build_parser
    from diffrt.cli.engine_opts import UNSET

    args = build_parser().parse_args(["bench", "--steps", "3", "--compare", "async_output=off",
                                      "executor_backend=inproc,max_num_seqs=4"])
    configs = build_configs(args)
    assert [label for label, _ in configs] == ["async_output=off",
                                               "executor_backend=inproc,max_num_seqs=4"]
    assert configs[0][1]["num_inference_steps"] == 3 and configs[0][1]["max_num_seqs"] is UNSET
    assert configs[1][1]["max_num_seqs"] == 4 and configs[1][1]["async_output"] is UNSET


def test_results_table_shows_ratios_against_the_first():
    load = {"num_requests": 4, "concurrency": 2, "request_rate": None, "height": 64,
            "width": 64, "num_inference_steps": 2}
    text_a = text_encoding_summary(TextEncoderStats(encoded=4, cache_hits=0, seconds=0.2), 4)
    text_b = text_encoding_summary(TextEncoderStats(encoded=1, cache_hits=3, seconds=0.02), 4)
    assert text_a == {"text_encode_ms": pytest.approx(50.0), "prompts_encoded": 4,
                      "prompt_cache_hit_rate": 0.0}
    assert text_b["prompt_cache_hit_rate"] == 0.75 and text_b["text_encode_ms"] == pytest.approx(5)
    rows = [{"label": "a", "load": load, "throughput_vs_first": 1.0, "p50_vs_first": 1.0,
             **summarize([Sample(0.1, True, 1)], 1.0), **text_a},
            {"label": "b", "load": {**load, "distinct_prompts": 1}, "throughput_vs_first": 2.0,
             "p50_vs_first": 0.5, **summarize([Sample(0.05, True, 1)], 0.5), **text_b}]
    text = render_results(rows)
    assert "x first" in text and "encode ms" in text and "cache hit" in text
    assert "rows/step" in text and "tokens/step" in text
    assert "load: per configuration" in text  # the two loads differ in distinct prompts
    line_b = [ln for ln in text.splitlines() if ln.startswith("b ")][0]
    assert "2.00x" in line_b and "0.50x" in line_b and "75%" in line_b
    single = render_results(rows[:1])
    assert "4 req, concurrency 2, 64x64, 2 steps" in single


def test_image_paths(tmp_path):
    assert image_paths(str(tmp_path / "x.png"), 1, 1) == [[tmp_path / "x.png"]]
    assert image_paths(str(tmp_path / "x.png"), 2, 1) == [[tmp_path / "x-0.png"], [tmp_path / "x-1.png"]]
    assert image_paths(str(tmp_path / "x.png"), 1, 2) == [[tmp_path / "x-0.png", tmp_path / "x-1.png"]]
    with pytest.raises(CliError, match="must end in"):
        image_paths(str(tmp_path / "x.gif"), 1, 1)
    with pytest.raises(CliError, match="does not exist"):
        check_writable_file(tmp_path / "missing" / "x.png", "images")
    with pytest.raises(CliError, match="is a directory"):
        check_writable_file(tmp_path, "images")


def test_a_place_that_cannot_take_files_is_refused_even_for_root(tmp_path):
    # Permission bits say nothing to root: the check opens the file. /proc takes
    # no new files whoever asks; a new file is removed again after the check.
    with pytest.raises(CliError, match="cannot write images to '/proc/x.png'"):
        check_writable_file("/proc/x.png", "images")
    assert check_writable_file(tmp_path / "new.png", "images") == tmp_path / "new.png"
    assert not (tmp_path / "new.png").exists()
    kept = tmp_path / "kept.png"
    kept.write_bytes(b"old")
    check_writable_file(kept, "images")
    assert kept.read_bytes() == b"old"


def test_env_report_renders_sections():
    text = render_report({"platform": "cpu", "chosen_by": "fallback",
                          "versions": {"torch": "2.13.0"},
                          "capabilities": {"events": False, "async_output": True}})
    assert "platform" in text and "chosen_by" in text and "fallback" in text
    assert "capabilities" in text and "events" in text and "no" in text and "yes" in text


@pytest.mark.parametrize("argv, needle", [
    (["generate", "-p", "x", "--height", "102"], "height"),  # not a multiple of 4
    (["generate", "-p", "x", "--width", "8192"], "width"),
    (["generate"], "--prompt"),
    (["generate", "-p", "x", "--prompts-file", "/nonexistent/prompts.txt"], "prompts-file"),
    (["bench", "--compare", "step_execution=sideways"], "step_execution"),
    # a bad later configuration is refused before the first one runs
    (["bench", "--executor-backend", "inproc", "--compare", "max_num_seqs=1",
      "cfg_parallel_size=2"],
     "executor_backend"),
    (["bench", "--json", "/nonexistent/r.json"], "does not exist"),
    (["generate", "-p", "x", "--trace", "/nonexistent/t.json"], "does not exist"),
])
def test_bad_input_is_one_line_and_exit_2(argv, needle, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not list(tmp_path.iterdir())  # nothing written


def test_prompts_come_from_flags_a_file_and_stdin(tmp_path, monkeypatch):
    import io

    from diffrt.cli import build_parser
    from diffrt.cli.generate import read_prompts

    f = tmp_path / "p.txt"
    f.write_text("first\n\n# comment\n  second  \n")
    args = build_parser().parse_args(["generate", "-p", "zero", "--prompts-file", str(f)])
    assert read_prompts(args) == ["zero", "first", "second"]
    monkeypatch.setattr("sys.stdin", io.StringIO("from stdin\n"))
    args = build_parser().parse_args(["generate", "--prompts-file", "-"])
    assert read_prompts(args) == ["from stdin"]


def test_argparse_rejects_non_numbers(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["generate", "-p", "x", "--steps", "many"])
    assert exc.value.code == 2
    assert "--steps" in capsys.readouterr().err


def test_engine_settings_follow_the_command_line():
    from diffrt.cli import build_parser
    from diffrt.cli.engine_opts import engine_settings

    args = build_parser().parse_args(["bench"])
    assert engine_settings(args) == {}  # nothing given: the engine's defaults
    args = build_parser().parse_args([
        "bench", "--step-execution", "--max-num-seqs", "4", "--no-async-output",
        "--cfg-parallel-size", "2", "--world-size", "2", "--executor-backend", "mp",
        "--torch-threads", "1", "--scheduling-policy", "skip_ahead",
        "--step-batch-max-wait-ms", "5", "-m", "tiny-flux"])
    assert engine_settings(args) == {
        "model": "tiny-flux", "step_execution": True, "max_num_seqs": 4, "async_output": False,
        "world_size": 2, "executor_backend": "mp", "torch_threads": 1, "cfg_parallel_size": 2,
        "scheduling_policy": "skip_ahead", "step_batch_max_wait_ms": 5.0}
    from diffrt.engine import EngineConfig

    EngineConfig(**engine_settings(args))  # names the engine knows


@pytest.mark.parametrize("argv, model", [
    (["generate", "-p", "x"], "diffrt-shapes"),  # a picture: the default model
    (["generate", "-p", "x", "--num-frames", "9"], "diffrt-motion"),  # a clip: the video one
    (["bench", "--num-frames", "9"], "diffrt-motion"),
    (["generate", "-p", "x", "--num-frames", "9", "-m", "tiny-wan"], "tiny-wan"),  # as named
    (["generate", "-p", "x", "-m", "tiny-flux"], "tiny-flux"),
])
def test_a_clip_without_a_model_runs_the_default_video_model(argv, model):
    from diffrt.cli import build_parser
    from diffrt.cli.engine_opts import engine_settings, model_name

    args = build_parser().parse_args(argv)
    assert model_name(args) == model
    # the engine runs what the checks and the progress bars were told
    assert engine_settings(args).get("model", "diffrt-shapes") == model


def test_engine_flags_reach_the_engine_config():
    import argparse

    from diffrt.cli.engine_opts import add_engine_args, add_sampling_args, engine_settings

    p = argparse.ArgumentParser()
    add_sampling_args(p)
    add_engine_args(p)
    args = p.parse_args(["--dtype", "bfloat16", "--startup-timeout-s", "900",
                         "--true-cfg-scale", "4"])
    settings = engine_settings(args)
    assert settings == {"dtype": "bfloat16", "startup_timeout_s": 900.0}
    assert args.true_cfg_scale == 4.0
    assert engine_settings(p.parse_args(["--vae-tiling"]))["vae_tiling"] is True
    assert engine_settings(p.parse_args(["--no-warmup"]))["warmup"] is False
    assert engine_settings(p.parse_args(["--plugin-module", "a.b", "--plugin-modules", "c"])
                           )["plugin_modules"] == ("a.b", "c")
    assert engine_settings(p.parse_args(["--worker-env", "A=1", "--worker-env", "B=x=y"])
                           )["worker_env"] == {"A": "1", "B": "x=y"}
    compiled = engine_settings(p.parse_args(["--compile", "--compile-backend", "aot_eager"]))
    assert compiled == {"compile": True, "compile_backend": "aot_eager"}
    assert engine_settings(p.parse_args(["--max-steps-per-tick", "1"]))["max_steps_per_tick"] == 1
    cfg = engine_settings(p.parse_args(["--cfg-parallel-size", "2"]))
    assert cfg == {"cfg_parallel_size": 2}  # the engine derives world_size
    assert engine_settings(p.parse_args(["--request-timeout-s", "none"])) == {
        "request_timeout_s": None}  # None: no limit, as the setting says
    assert engine_settings(p.parse_args(["--request-batch-max-wait-ms", "0"]))[
        "request_batch_max_wait_ms"] == 0.0  # 0 turns the automatic window off


@pytest.mark.parametrize("old, new", [
    ("--threads 2", "--torch-threads"), ("--policy fifo", "--scheduling-policy"),
    ("--batch-wait-ms 5", "--request-batch-max-wait-ms"), ("--mode step", "--step-execution"),
    ("--steps-per-tick 2", "--max-steps-per-tick"), ("--executor mp", "--executor-backend"),
])
def test_renamed_flags_exit_2_naming_the_new_one(capsys, old, new):
    with pytest.raises(SystemExit) as exc:
        main(["generate", "-p", "x", *old.split()])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"{old.split()[0]} was renamed: use {new}" in err


def test_out_of_range_flags_are_the_declarations_one_line_refusals(capsys):
    """A flag's limits are its declaration's: the engine's own check refuses
    the value in one line naming the field, before anything starts."""
    for argv, message in ((["--max-num-seqs", "0"], "max_num_seqs: must be an int >= 1"),
                          (["--num-inference-steps", "1001"],
                           "num_inference_steps: must be an int <= 1000"),
                          (["--guidance-scale", "nan"], "guidance_scale: must be a finite number"),
                          (["--height", "0"], "height: must be an int >= 1")):
        assert main(["generate", "-p", "x", "--executor-backend", "inproc", *argv]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err


def test_bench_configurations_keep_every_engine_flag():
    from diffrt.cli import build_parser
    from diffrt.cli.engine_opts import engine_settings

    args = build_parser().parse_args(["bench", "--dtype", "float16", "--vae-slicing",
                                      "--compare", "step_execution=on", "max_num_seqs=2"])
    for _, opts in build_configs(args):
        settings = engine_settings(opts)
        assert settings["dtype"] == "float16" and settings["vae_slicing"] is True
    args = build_parser().parse_args(["bench", "--compare", "cfg_parallel_size=2,vae_parallel=on",
                                      "ulysses_degree=2,vae_parallel=off,steps=3"])
    (_, first), (_, second) = build_configs(args)
    assert engine_settings(first)["cfg_parallel_size"] == 2
    assert engine_settings(first)["vae_parallel"] is True
    assert engine_settings(second)["ulysses_degree"] == 2
    assert engine_settings(second)["vae_parallel"] is False
    assert second["num_inference_steps"] == 3  # the --steps alias


def test_bench_compare_keys_of_earlier_releases_name_the_new_one():
    from diffrt.cli import build_parser

    args = build_parser().parse_args(["bench", "--compare", "mode=step"])
    with pytest.raises(CliError, match="mode was renamed: use step_execution"):
        build_configs(args)


def test_serve_refuses_a_bad_model_before_starting(capsys):
    assert main(["serve", "--model", "no-such-model", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "unknown model 'no-such-model'" in err and len(err.strip().splitlines()) == 1


def test_serve_defaults_to_step_mode():
    from diffrt.cli import build_parser
    from diffrt.cli.engine_opts import engine_settings

    args = build_parser().parse_args(["serve"])
    assert args.port == 8000 and args.host == "127.0.0.1"
    assert engine_settings(args) == {"step_execution": True, "max_num_seqs": 8,
                                     "unread_output_timeout_s": 120.0, "restart_workers": True}
    args = build_parser().parse_args(["serve", "--no-step-execution", "--request-timeout-s",
                                      "5", "--max-request-seconds", "2", "--no-restart-workers"])
    settings = engine_settings(args)
    assert settings["step_execution"] is False and settings["restart_workers"] is False
    assert (settings["request_timeout_s"], settings["max_request_seconds"]) == (5.0, 2.0)


def test_env_refuses_a_forced_platform_without_its_package(monkeypatch, capsys):
    import sys

    import diffrt.platforms as platforms

    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    monkeypatch.setenv("DIFFRT_PLATFORM", "npu")
    platforms.reset_platform()
    try:
        assert main(["env"]) == 2
    finally:
        platforms.reset_platform()
    err = capsys.readouterr().err.strip()
    assert err == ("diffrt env: error: DIFFRT_PLATFORM=npu: needs torch_npu: pip install "
                   "'diffrt[npu]' (torch-npu 2.13.* for torch 2.13.*; torch-npu X.Y needs "
                   "torch X.Y exactly)")


def test_serve_on_ray_without_the_extra_names_it(monkeypatch, capsys):
    """--replicas with Ray missing: one line naming the extra, exit 2."""
    import sys

    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    assert main(["serve", "--replicas", "2", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "pip install 'diffrt[ray]'" in err and len(err.strip().splitlines()) == 1


def test_bench_reports_mean_rows_and_tokens_per_step():
    """From two stats snapshots: the steps between them, their rows and tokens;
    None when no step was counted (request mode)."""
    from types import SimpleNamespace

    from diffrt.cli.bench import step_batch_summary
    from diffrt.engine.stats import Histogram

    def snap(steps: int, rows: float, tokens: float):
        return SimpleNamespace(step_batch_rows=Histogram((1,), (0, steps), rows),
                               step_batch_tokens=Histogram((1,), (0, steps), tokens))

    assert step_batch_summary(snap(2, 4, 1000), snap(6, 24, 9000)) == {
        "step_rows_mean": 5.0, "step_tokens_mean": 2000.0}
    assert step_batch_summary(snap(2, 4, 1000), snap(2, 4, 1000)) == {
        "step_rows_mean": None, "step_tokens_mean": None}


def test_lora_flags_become_the_config_mapping_and_the_request_scales(capsys):
    from diffrt.cli import build_parser
    from diffrt.cli.engine_opts import engine_settings, sampling_params
    from diffrt.engine import EngineConfig

    args = build_parser().parse_args([
        "generate", "-p", "x", "--lora-modules", "a=/adapters/a.safetensors",
        "--lora-modules", "b=rel/b", "--loras", "a=0.5", "--lora", "b=-1"])
    settings = engine_settings(args)
    assert settings["lora_modules"] == {"a": "/adapters/a.safetensors", "b": "rel/b"}
    EngineConfig(**settings)  # the config takes the mapping as it is
    assert sampling_params(args).loras == {"a": 0.5, "b": -1.0}
    assert sampling_params(build_parser().parse_args(["generate", "-p", "x"])).loras is None
    for key in ("loras", "lora_modules"):  # repeatable: the same in every configuration
        with pytest.raises(CliError, match=f"{key} is not compared"):
            parse_spec(f"{key}=a=1")
    with pytest.raises(CliError, match="--lora-modules: 'a' given twice"):
        engine_settings(build_parser().parse_args(
            ["generate", "-p", "x", "--lora-modules", "a=1", "--lora-modules", "a=2"]))
    for flag, value, needle in (("--lora-modules", "a", "expected KEY=VALUE, got 'a'"),
                                ("--loras", "a=strong", "a: expected a number after '='"),
                                ("--lora", "a=inf", "a: must be a finite number"),
                                ("--loras", "=1", "expected KEY=VALUE")):
        with pytest.raises(SystemExit) as exc:
            main(["generate", "-p", "x", flag, value])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert "--loras/--lora" in err or "--lora-modules" in err, err
        assert needle in err, err


def test_serve_lora_dir_must_be_a_folder_and_one_engine(tmp_path, capsys):
    from diffrt.cli import build_parser
    from diffrt.cli.serve import build_serve_settings

    assert build_serve_settings(build_parser().parse_args(["serve"])).lora_dir is None
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    args = build_parser().parse_args(["serve", "--lora-dir", str(tmp_path / "link")])
    assert build_serve_settings(args).lora_dir == str((tmp_path / "real").resolve())
    for argv, needle in ((["--lora-dir", str(tmp_path / "none")], "not an existing folder"),
                         (["--lora-dir", str(tmp_path / "real"), "--replicas", "2"],
                          "Ray Serve")):
        assert main(["serve", "--port", "0", *argv]) == 2
        err = capsys.readouterr().err
        assert "--lora-dir" in err and needle in err and len(err.strip().splitlines()) == 1
    # --weights-dir is taken on Ray Serve replicas too (every replica reads its paths)
    args = build_parser().parse_args(["serve", "--weights-dir", str(tmp_path / "link"),
                                      "--replicas", "2"])
    assert build_serve_settings(args).weights_dir == str((tmp_path / "real").resolve())


def test_cache_flags_reach_the_request_and_the_engine_and_are_refused_in_one_line(capsys):
    """``--cache``/``--cache-threshold`` (declared by ``SamplingParams``) and
    ``--cache-state-bytes`` (by ``ModelConfig``); a bad value is refused
    before anything starts, naming the field."""
    from diffrt.cli import build_parser
    from diffrt.cli.engine_opts import engine_settings, sampling_params
    from diffrt.engine import EngineConfig

    args = build_parser().parse_args(["generate", "-p", "x", "--cache", "first-block",
                                      "--cache-threshold", "0.3", "--cache-state-bytes", "0"])
    params = sampling_params(args)
    assert (params.cache, params.cache_threshold) == ("first-block", 0.3)
    assert engine_settings(args) == {"cache_state_bytes": 0}
    assert EngineConfig(**engine_settings(args)).model_config.cache_state_bytes == 0
    unset = sampling_params(build_parser().parse_args(["generate", "-p", "x"]))
    assert (unset.cache, unset.cache_threshold) == (None, None)  # the model's default
    serve = build_parser().parse_args(["serve", "--cache-state-bytes", "4096"])
    assert engine_settings(serve)["cache_state_bytes"] == 4096

    with pytest.raises(SystemExit) as exc:
        main(["generate", "-p", "x", "--cache", "fast"])
    assert exc.value.code == 2 and "--cache" in capsys.readouterr().err
    for argv, message in (
            (["--cache", "off", "--cache-threshold", "0.3"], "cache_threshold: applies to a "
                                                             'step cache, not to cache="off"'),
            (["--cache", "teacache", "--cache-threshold", "-1"],
             "cache_threshold: must be a number >= 0"),
            (["--cache-state-bytes", "-1"], "cache_state_bytes: must be an int >= 0")):
        assert main(["generate", "-p", "x", "--executor-backend", "inproc", *argv]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err


def test_generate_says_what_each_requests_cache_did():
    from diffrt.cli.generate import _cache_note
    from diffrt.engine.outputs import CacheMetrics

    assert _cache_note(None) == ""
    assert _cache_note(CacheMetrics("first-block", 0.3, steps_computed=3, steps_reused=5,
                                    reused_steps=[1, 2, 4, 5, 6])) == (
        ", first-block cache reused 5 of 8 steps")
    assert _cache_note(CacheMetrics("teacache", 0.1, steps_computed=8,
                                    uncached_reason="cache_state_bytes")) == (
        ", ran without its teacache cache (cache_state_bytes)")
