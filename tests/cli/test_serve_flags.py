"""`diffrt serve`'s own flags are its declarations (``serve/settings.py``,
``cli/serve_opts.py``), as the engine's are: one flag per declared field and
no other, the declared default, the same ``-s`` rule; flags of earlier
releases (and the value-taking forms of flags that take none now) exit 2
naming the new spelling; the commands' own defaults are declared profiles
shown in --help."""

from __future__ import annotations

import argparse

import pytest

from diffrt.cli import build_parser, main
from diffrt.cli.engine_opts import flag_of
from diffrt.cli.profiles import BURST_WAIT_MS, GENERATE, SERVE
from diffrt.cli.renamed import RENAMED_VALUES
from diffrt.cli.serve_opts import (
    DECLARATIONS,
    SERVE_RENAMED_FLAGS,
    build_serve_settings,
    http_limits,
    serve_flags,
)
from diffrt.engine.declarations import declared_fields
from diffrt.engine.settings import FIELD_GROUP
from diffrt.serve.guards import default_allowed_hosts
from diffrt.serve.settings import HttpLimits, ServeSettings


def _subcommand(name: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def _serve_actions() -> dict[str, argparse.Action]:
    """dest -> action of every serve flag that is not an engine setting."""
    return {a.dest: a for a in _subcommand("serve")._actions
            if a.option_strings and a.dest not in FIELD_GROUP and a.dest != "help"
            and a.help is not argparse.SUPPRESS}


def test_every_serve_flag_is_a_declaration_and_every_declaration_a_flag():
    declared = {f.name: f for struct, _ in DECLARATIONS for f in declared_fields(struct)}
    actions = _serve_actions()
    assert set(actions) == set(declared)
    for name, action in actions.items():
        field = declared[name]
        # a bool's flag comes with its --no- twin
        assert action.option_strings[0] == flag_of(field)
        assert field.description and field.description in action.help.replace("%%", "%")
        # the name with dashes, or the one the declaration names (vLLM's --served-model-name)
        assert flag_of(field) == field.extra.get("flag", "--" + name.replace("_", "-"))
    assert serve_flags()["model_name"] == "--served-model-name"


@pytest.mark.parametrize("command", ["generate", "bench", "serve"])
def test_flags_in_seconds_end_in_s(command):
    """A timeout, delay or TTL says its unit: ``-s`` (or ``-ms``)."""
    for action in _subcommand(command)._actions:
        if action.help is argparse.SUPPRESS:  # flags of earlier releases
            continue
        for flag in action.option_strings:
            if any(word in flag for word in ("timeout", "delay", "ttl", "wait")):
                assert flag.endswith(("-s", "-ms")), flag


def test_the_command_line_gives_the_declared_defaults():
    args = build_parser().parse_args(["serve"])
    assert build_serve_settings(args) == ServeSettings(
        allowed_hosts=default_allowed_hosts("127.0.0.1"))
    assert http_limits(args) == HttpLimits()
    from diffrt.cli.serve_ray import replica_settings
    from diffrt.serve.ray_app import ReplicaSettings

    assert replica_settings(args) == ReplicaSettings()


def test_serve_values_become_the_settings(monkeypatch):
    monkeypatch.setenv("DIFFRT_API_KEY", "from-env")
    args = build_parser().parse_args([
        "serve", "--max-body-bytes", "2MiB", "--url-ttl-s", "60", "--header-timeout-s", "0.5",
        "--allowed-hosts", "a.example.com,*.b.example.com", "--allowed-hosts", "c",
        "--served-model-name", "m", "--client-priority-floor", "-2", "--retry-after-s", "3"])
    settings = build_serve_settings(args)
    assert settings.max_body_bytes == 2 << 20 and settings.url_ttl_s == 60.0
    assert settings.allowed_hosts == ("a.example.com", "*.b.example.com", "c")
    assert (settings.model_name, settings.client_priority_floor) == ("m", -2)
    assert settings.api_keys == ("from-env",) and settings.retry_after_s == 3
    assert http_limits(args).header_timeout_s == 0.5
    assert build_serve_settings(build_parser().parse_args(
        ["serve", "--api-key", "flag"])).api_keys == ("flag",)


def test_several_api_keys_from_repeated_flags_comma_lists_or_the_environment(monkeypatch):
    """Each key once, in order; the flag wins over $DIFFRT_API_KEY (a comma
    list there too); empty items and none at all mean no key."""
    def keys(*argv: str) -> tuple[str, ...]:
        return build_serve_settings(build_parser().parse_args(["serve", *argv])).api_keys

    monkeypatch.setenv("DIFFRT_API_KEY", "env-a, env-b")
    assert keys() == ("env-a", "env-b")
    assert keys("--api-key", "a,b", "--api-key", "c", "--api-key", "a") == ("a", "b", "c")
    monkeypatch.setenv("DIFFRT_API_KEY", " , ")
    assert keys() == () and keys("--api-key", ",") == ()
    monkeypatch.delenv("DIFFRT_API_KEY")
    assert keys() == ()
    assert ServeSettings(api_key="one").api_keys == ("one",)  # a single key in Python


@pytest.mark.parametrize("argv, message", [
    (["--max-pending", "0"], "max_pending: must be an int >= 1, got 0"),
    (["--shutdown-timeout-s", "-1"], "shutdown_timeout_s: must be a number >= 0"),
    (["--header-timeout-s", "0"], "header_timeout_s: must be a number > 0"),
    (["--client-priority-floor", "11"], "client_priority_floor: must be an int <= 10"),
    (["--url-ttl-s", "inf"], "url_ttl_s: must be a finite number"),
    (["--placement-timeout-s", "0"], "placement_timeout_s: must be a number > 0"),
    (["--replicas", "0"], "replicas: must be an int >= 1"),
])
def test_out_of_range_serve_flags_are_the_declarations_one_line_refusals(argv, message,
                                                                          capsys):
    assert main(["serve", "--port", "0", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("command, old, new", [
    *(("serve", old, new) for old, new in sorted(SERVE_RENAMED_FLAGS.items())),
    ("bench", "--http-timeout", "--http-timeout-s")])
def test_renamed_serve_flags_exit_2_naming_the_new_one(command, old, new, capsys):
    with pytest.raises(SystemExit) as exc:
        main([command, old, "5"])
    assert exc.value.code == 2
    assert f"{old} was renamed: use {new}" in capsys.readouterr().err


@pytest.mark.parametrize("command, argv, new", [
    ("generate", ["--async-output", "on"], RENAMED_VALUES["--async-output"]),
    ("serve", ["--async-output", "off"], RENAMED_VALUES["--async-output"]),
    ("generate", ["--compile", "inductor"], RENAMED_VALUES["--compile"]),
    ("bench", ["--compile=aot_eager"], RENAMED_VALUES["--compile"]),
    ("bench", ["--warmup", "3"], "--warmup-requests N"),
])
def test_old_value_taking_spellings_exit_2_naming_the_new_one(command, argv, new, capsys):
    extra = ["-p", "x"] if command == "generate" else []
    with pytest.raises(SystemExit) as exc:
        main([command, *extra, *argv])
    assert exc.value.code == 2
    flag, _, value = argv[0].partition("=")
    value = value or argv[1]
    assert f"{flag} {value} was renamed: use {new}" in capsys.readouterr().err


def test_the_flags_without_a_value_still_parse():
    from diffrt.cli.engine_opts import engine_settings

    args = build_parser().parse_args(["generate", "-p", "x", "--compile", "--compile-backend",
                                      "aot_eager", "--no-async-output", "--warmup"])
    assert engine_settings(args) == {"compile": True, "compile_backend": "aot_eager",
                                     "async_output": False, "warmup": True}
    args = build_parser().parse_args(["bench", "--no-warmup", "--warmup-requests", "2"])
    assert args.warmup is False and args.warmup_requests == 2


def test_the_profiles_are_shown_in_help():
    serve = _subcommand("serve").format_help()
    assert "serve's own defaults: step_execution=True" in serve
    for name, default in SERVE.defaults.items():
        assert f"{name}={default.value!r} ({default.why.split()[0]}" in " ".join(serve.split())
    generate = " ".join(_subcommand("generate").format_help().split())
    assert "generate's own defaults: max_num_seqs=the number of prompts" in generate
    assert "(default: the number of prompts)" in generate
    assert f"(default: {BURST_WAIT_MS:g} with several prompts, with --step-execution)" in generate
    assert "seed=0" in " ".join(_subcommand("bench").format_help().split())


def test_the_profiles_are_the_commands_defaults():
    from diffrt.cli.engine_opts import engine_settings

    assert engine_settings(build_parser().parse_args(["serve"])) == {
        name: d.value for name, d in SERVE.defaults.items()}
    assert GENERATE.apply({}, prompts=1) == {"max_num_seqs": 1}
    assert GENERATE.apply({}, prompts=3) == {"max_num_seqs": 3,
                                             "request_batch_max_wait_ms": BURST_WAIT_MS}
    assert GENERATE.apply({"step_execution": True, "max_num_seqs": 2}, prompts=3) == {
        "step_execution": True, "max_num_seqs": 2, "step_batch_max_wait_ms": BURST_WAIT_MS}
    assert GENERATE.apply({"request_batch_max_wait_ms": 0.0}, prompts=3)[
        "request_batch_max_wait_ms"] == 0.0  # a value given wins
    assert build_parser().parse_args(["generate", "-p", "x"]).seed == 0


def test_the_serve_docs_are_the_declarations():
    """docs/serving.md's table of serve flags and the profiles' tables are
    written from the declarations, and so is every default the docs quote
    (``<!-- default:NAME -->``): scripts/settings_docs.py, as for the engine's."""
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "scripts" / "settings_docs.py"
    spec = importlib.util.spec_from_file_location("settings_docs", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for path in module.DOCS:
        text = path.read_text(encoding="utf-8")
        assert module.render(text, path) == text, f"{path}: run python scripts/settings_docs.py"
    serving = module.SERVING.read_text(encoding="utf-8")
    for flag in serve_flags().values():
        assert f"| `{flag}` |" in serving, flag
    for name in SERVE.defaults:
        assert f"| `{name}` |" in serving, name
    limits = (module.ROOT / "docs" / "limits.md").read_text(encoding="utf-8")
    assert "<!-- default:max_header_bytes -->16 KiB<!-- /default -->" in limits
