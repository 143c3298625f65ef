"""One declaration per setting and per request field: every surface built
from it (EngineConfig, the worker's settings, the runtime's executor config,
the CLI flags, the HTTP body) agrees with it and with the others."""

from __future__ import annotations

import argparse
import math
from typing import Annotated

import msgspec
import pytest
from msgspec import Meta
from pydantic import ValidationError

from diffrt.cli import build_parser
from diffrt.cli.engine_opts import RENAMED_FLAGS, add_engine_args, add_sampling_args
from diffrt.engine import EngineConfig, EngineConfigError, InvalidRequestError, SamplingParams
from diffrt.engine.declarations import declared_fields
from diffrt.engine.runner_messages import RunnerSettings
from diffrt.engine.settings import FIELD_GROUP, GROUPS, ModelConfig, ParallelConfig
from diffrt.runtime.types import ExecutorConfig, ExecutorOptions
from diffrt.serve.protocol import (
    GENERATION_FIELDS,
    SAMPLING_FIELDS,
    ImageEditForm,
    ImageGenerationRequest,
)


def _flags(parser: argparse.ArgumentParser, title: str) -> dict[str, list[str]]:
    """dest -> option strings of the flags in the argument group ``title``."""
    [group] = [g for g in parser._action_groups if g.title and g.title.startswith(title)]
    return {a.dest: a.option_strings for a in group._group_actions}


def _subcommand(name: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


@pytest.mark.parametrize("command", ["generate", "bench", "serve"])
def test_every_setting_has_a_flag_and_every_flag_a_setting(command):
    flags = _flags(_subcommand(command), "engine settings")
    assert set(flags) == set(FIELD_GROUP)
    for name, spellings in flags.items():
        assert "--" + name.replace("_", "-") in spellings  # the same name up to dashes
        extra = [s for s in spellings if s != "--" + name.replace("_", "-")
                 and not s.startswith("--no-")]
        assert all(s.startswith("-") for s in extra)  # short aliases only beside it
    assert len(FIELD_GROUP) == sum(len(cls.__struct_fields__) for cls in GROUPS.values())


def test_executor_options_are_declared_once_for_every_layer():
    """The engine's executor group is the runtime's declaration: a setting
    has one default in EngineConfig, in ExecutorConfig and on the CLI."""
    engine = EngineConfig(model="toy")
    runtime = ExecutorConfig(runner=engine.executor_config(
        platform=_Platform()).runner)
    for name in ExecutorOptions.__struct_fields__:
        if name == "worker_env":  # the engine adds the CPU policy to the user's
            continue
        assert getattr(engine.executor, name) == getattr(runtime, name), name
    assert engine.executor.execute_timeout_s == runtime.execute_timeout_s == 300.0


def test_the_worker_settings_are_the_engines_own_groups():
    """RunnerSettings carries ModelConfig and ParallelConfig: no default of
    its own can disagree (prompt_cache_bytes was 64 MiB here, 0 there)."""
    config = EngineConfig(model="toy")
    settings = config.executor_config(platform=_Platform()).runner.settings
    assert settings.model == config.model_config and settings.parallel == config.parallel
    assert RunnerSettings(spec=settings.spec).model == ModelConfig()
    assert RunnerSettings(spec=settings.spec).parallel == ParallelConfig()
    assert ModelConfig().prompt_cache_bytes == config.prompt_cache_bytes == 64 << 20


def test_an_unknown_keyword_names_the_nearest_setting():
    with pytest.raises(EngineConfigError, match="did you mean 'max_num_seqs'") as info:
        EngineConfig(model="toy", max_num_seq=4)
    assert info.value.field == "max_num_seq"
    with pytest.raises(EngineConfigError, match="executor_options: not an EngineConfig setting"):
        EngineConfig(model="toy", executor_options={})


def test_a_config_reads_flat_copies_and_travels():
    import pickle

    config = EngineConfig(model="toy", max_num_seqs=3, startup_timeout_s=9, dtype="float32")
    assert config.max_num_seqs == config.scheduling.max_num_seqs == 3
    assert config.startup_timeout_s == 9.0 and isinstance(config.startup_timeout_s, float)
    assert pickle.loads(pickle.dumps(config)) == config
    assert config.replace(max_num_seqs=5).max_num_seqs == 5 and config.max_num_seqs == 3
    with pytest.raises(AttributeError):
        config.max_num_seqs = 4
    with pytest.raises(AttributeError, match="no setting 'max_num_seq'"):
        config.max_num_seq  # noqa: B018
    assert EngineConfig(**config.settings()) == config


# -- requests -----------------------------------------------------------------------------------
SAMPLING = {d.name: d for d in declared_fields(SamplingParams)}
#: HTTP body fields that are not SamplingParams fields (OpenAI's own, the texts)
NOT_SAMPLING = {"prompt", "model", "size", "response_format", "output_format",
                "output_compression", "user", "stream", "quality", "background", "moderation",
                "style", "complexity", "safety_identifier", "negative_prompt", "stream_progress"}


def _body_of(field: str) -> type:
    """The HTTP body that carries a sampling field: an edit's when it needs an
    input image, else a generation's (an edit's carries it too)."""
    return ImageEditForm if SAMPLING[field].extra["needs_image"] else ImageGenerationRequest


def test_the_three_surfaces_accept_the_same_fields():
    body = set(ImageGenerationRequest.model_fields) - NOT_SAMPLING
    assert body == {f.http for f in GENERATION_FIELDS}
    edit = set(ImageEditForm.model_fields) - NOT_SAMPLING - {"input_fidelity"}
    assert edit == {f.http for f in SAMPLING_FIELDS}
    # what a generation lacks is what needs an input image
    assert {f.field for f in SAMPLING_FIELDS if f not in GENERATION_FIELDS} == {
        n for n, d in SAMPLING.items() if d.extra["needs_image"]} == {"strength"}
    over_http = {f.field for f in SAMPLING_FIELDS} | {"height", "width"}  # size: both
    assert over_http == {n for n, d in SAMPLING.items() if d.extra["http"] is not None}
    p = argparse.ArgumentParser()
    add_sampling_args(p)
    on_cli = set(_flags(p, "sampling"))
    assert on_cli == {n for n, d in SAMPLING.items() if d.extra["cli"] is not None}
    # a field left off a surface says so in its declaration, with its reason
    for name, d in SAMPLING.items():
        if d.extra["http"] is None or d.extra["cli"] is None:
            assert d.description, name
    assert SAMPLING["output_type"].extra["http"] is None  # no meaning over HTTP
    # OpenAI's names: n, size, *_ms
    assert {(f.field, f.http) for f in SAMPLING_FIELDS} >= {
        ("num_outputs_per_prompt", "n"), ("timeout_s", "timeout_ms")}


def _past(bound: str, value: float, kind: str) -> float:
    step = 1 if kind == "int" else max(abs(value) * 1e-6, 1e-6)
    return {"ge": value - step, "gt": value, "le": value + step, "lt": value}[bound]


@pytest.mark.parametrize("field", [f.field for f in SAMPLING_FIELDS])
def test_the_same_limits_refuse_the_same_values_on_every_surface(field):
    """A value just past each declared bound: refused by SamplingParams,
    by the HTTP body and (through the engine's check) from the CLI; the bound
    itself is accepted by all three."""
    d = SAMPLING[field]
    http = next(f for f in SAMPLING_FIELDS if f.field == field)
    # sampler flow-sde: noise_level means something only there
    base = {"height": 64, "width": 64, "num_inference_steps": 2, "guidance_scale": 1.0,
            "true_cfg_scale": 1.0, "sampler": "flow-sde"}
    for bound, limit in d.bounds.items():
        if bound not in ("ge", "gt", "le", "lt"):
            continue
        inside = limit if bound in ("ge", "le") else (limit + 1 if bound == "gt" else limit - 1)
        bad = _past(bound, limit, d.kind)
        if d.kind == "int":
            bad, inside = int(bad), int(inside)
        for value, ok in ((inside, True), (bad, False)):
            params = SamplingParams(**{**base, field: value})
            if ok:
                params.validate()
            else:
                with pytest.raises(InvalidRequestError) as info:
                    params.validate()
                assert info.value.field == field
            sent = value * http.scale if http.scale != 1.0 else value
            body = {"prompt": "x", http.http: sent}
            model = _body_of(field)
            if ok:
                model(**body)
            elif not math.isinf(sent):
                with pytest.raises(ValidationError):
                    model(**body)
            if d.extra["cli"] is None:
                continue
            from diffrt.cli.engine_opts import sampling_params

            args = _subcommand("generate").parse_args(
                ["-p", "x", f"--{field.replace('_', '-')}={value!r}"])
            from_cli = sampling_params(args, **{k: v for k, v in base.items()
                                                if k != field})
            if ok:
                from_cli.validate()
            else:
                with pytest.raises(InvalidRequestError) as info:
                    from_cli.validate()
                assert info.value.field == field


def test_a_new_request_field_needs_only_its_declaration():
    """A field declared on a Struct like SamplingParams gets its HTTP field,
    its flag and its check from the declaration alone (what a new request
    field costs: one declaration plus the pipeline code that uses it)."""
    [d] = declared_fields(WithBrightness)
    assert (d.kind, d.optional, d.bounds, d.description) == ("float", True,
                                                             {"ge": 0, "le": 2}, "how bright")
    p = argparse.ArgumentParser()
    from diffrt.cli.engine_opts import add_declared

    add_declared(p, {}, d, (), None)
    assert p.parse_args(["--brightness", "1.5"]).brightness == 1.5


def test_renamed_flags_are_not_settings(capsys):
    for old in RENAMED_FLAGS:
        assert old[2:].replace("-", "_") not in FIELD_GROUP
    p = argparse.ArgumentParser()
    add_engine_args(p)
    for old, new in RENAMED_FLAGS.items():
        with pytest.raises(SystemExit) as exc:
            p.parse_args([old, "2"])
        assert exc.value.code == 2
        assert f"{old} was renamed: use {new}" in capsys.readouterr().err


class WithBrightness(msgspec.Struct, kw_only=True):
    brightness: Annotated[Annotated[float, Meta(ge=0, le=2)] | None, Meta(
        description="how bright", extra={"http": "", "cli": []})] = None


class _Platform:
    device_type = "cpu"
    supports_async_output = True


def test_the_docs_tables_are_the_declarations():
    """docs/engine.md's tables of settings and request fields are written from
    the declarations (scripts/settings_docs.py): they cannot drift apart."""
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "scripts" / "settings_docs.py"
    spec = importlib.util.spec_from_file_location("settings_docs", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    text = module.DOC.read_text(encoding="utf-8")
    assert module.render(text) == text, "run: python scripts/settings_docs.py"
    for name in FIELD_GROUP:
        assert f"| `{name}` |" in text
