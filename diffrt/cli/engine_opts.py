"""The engine and sampling flags of `generate`, `bench` and `serve`, made
from their declarations.

Every ``EngineConfig`` setting (``engine/settings.py``) and every
``SamplingParams`` field (``engine/sampling.py``) declares its type, default,
limits and help once; this module turns each into a flag of the same name
(``max_num_seqs`` -> ``--max-num-seqs``; a bool ``--x/--no-x``; a sequence or
a mapping repeatable), with a few short aliases (``-m``, ``--steps``, ``-n``).
A flag left out means "the engine's default" (or the command's profile's,
``cli/profiles.py``, shown in ``--help``), so the CLI never has a default of
its own that disagrees with the engine's. Flags of earlier releases exit 2
naming the new one (``cli/renamed.py``). ``add_declared`` makes the flag of
any declared field: the server's (``cli/serve_opts.py``) too.
Model-specific limits (size multiple, largest size) come from the model's
``ModelSpec``, checked before anything loads.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Iterable
from typing import Any

import msgspec

from diffrt.cli.errors import CliError
from diffrt.cli.profiles import Profile
from diffrt.cli.renamed import RENAMED_FLAGS, RENAMED_VALUES, add_renamed
from diffrt.engine.declarations import Declared, declared_fields
from diffrt.engine.settings import DEFAULT_MODEL, DEFAULT_VIDEO_MODEL, FIELD_GROUP, GROUPS

__all__ = ["DEFAULT_MODEL", "DEFAULT_VIDEO_MODEL", "RENAMED_FLAGS", "UNSET", "add_declared", "add_engine_args",
           "add_sampling_args", "check_requests", "flag_of",
           "engine_settings", "flag_parsers", "make_engine", "model_defaults", "model_spec",
           "non_negative_float", "positive_float", "positive_int", "sampling_params"]


class _Unset:
    """A flag that was not given (the engine's default applies)."""

    def __repr__(self) -> str:
        return "unset"


UNSET: Any = _Unset()

#: short or familiar extra spellings of engine flags
ENGINE_ALIASES = {"model": ("-m",), "plugin_modules": ("--plugin-module",)}
# -- value parsers (also used by bench --compare) -------------------------------------------
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


_BYTE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def byte_size(text: str) -> int:
    """``24GiB``, ``512MiB``, ``1.5GB`` or a plain number of bytes."""
    number = text.strip().rstrip("bBiIkKmMgGtT")
    unit = text.strip()[len(number):].lower()
    try:
        value = float(number) * _BYTE_UNITS[unit]
    except (KeyError, ValueError):
        raise ValueError(f"expected bytes (e.g. 24GiB, 512MiB, 1000000), got {text!r}") from None
    if not math.isfinite(value):
        raise ValueError(f"expected a finite size, got {text!r}")
    return int(value)


def _bool(text: str) -> bool:
    value = {"on": True, "true": True, "yes": True, "1": True,
             "off": False, "false": False, "no": False, "0": False}.get(text.lower())
    if value is None:
        raise argparse.ArgumentTypeError(f"expected on or off, got {text!r}")
    return value


def _bounded(convert: Callable[[str], Any], bounds: dict[str, Any]) -> Callable[[str], Any]:
    """``convert`` plus the declaration's bounds (ge, gt, le, lt)."""
    def parse(text: str) -> Any:
        try:
            value = convert(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(
                str(exc) if convert is byte_size else
                f"expected {'a whole number' if convert is int else 'a number'}, got {text!r}"
            ) from None
        if bounds and isinstance(value, float) and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
        for bound, ok in (("ge", lambda b: value >= b), ("gt", lambda b: value > b),
                          ("le", lambda b: value <= b), ("lt", lambda b: value < b)):
            limit = bounds.get(bound)
            if limit is not None and not ok(limit):
                sign = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}[bound]
                raise argparse.ArgumentTypeError(f"must be {sign} {limit:g}, got {text}")
        return value
    return parse


def _one_of(convert: Callable[[str], Any], choices: tuple[Any, ...]) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            value = convert(text)
        except ValueError:
            value = text
        if value not in choices:
            raise argparse.ArgumentTypeError(
                f"must be one of {', '.join(map(str, choices))}, got {text!r}")
        return value
    return parse


def _optional(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """``none`` (or ``auto``) is None: the setting's "no limit" / "automatic"."""
    return lambda text: None if text.lower() in ("none", "auto") else parse(text)


def _key_value(convert: Callable[[str], Any] = str) -> Callable[[str], tuple[str, Any]]:
    """``KEY=VALUE`` -> (key, value), the value read as the mapping declares
    its values (a number for ``--loras name=0.8``)."""
    def parse(text: str) -> tuple[str, Any]:
        key, sep, value = text.partition("=")
        if not sep or not key:
            raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
        if convert is str:
            return key, value
        try:
            number = convert(value)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{key}: expected a number after '=', got {value!r}") from None
        if not math.isfinite(number):
            raise argparse.ArgumentTypeError(f"{key}: must be a finite number, got {value}")
        return key, number
    return parse


#: how a mapping's values are read from ``KEY=VALUE``, by their declared kind
_ITEM_CONVERT: dict[str, Callable[[str], Any]] = {"float": float, "int": int}


# -- flags from declarations ------------------------------------------------------------------
def flag_of(field: Declared) -> str:
    """A declaration's flag: its name with dashes, unless it names its own
    (``extra["flag"]``)."""
    return field.extra.get("flag") or "--" + field.name.replace("_", "-")


def add_declared(group: Any, parsers: dict[str, Callable[[str], Any]], field: Declared,
                 aliases: Iterable[str], default: Any, *, shown: str | None = None) -> None:
    """Add ``field``'s flag to ``group``; ``default``: the command's own (UNSET:
    the declaration's), ``shown``: what --help says a rule of the command's
    profile makes it (the flag's default staying UNSET)."""
    flag = flag_of(field)
    help_text = field.description.replace("%", "%%")
    if shown is not None:
        help_text += f" (default: {shown})".replace("%", "%%")
    elif (not field.has_factory_default or default is not UNSET) and "default" not in help_text:
        help_text += f" (default: {field.default if default is UNSET else default!r})"
    kw: dict[str, Any] = {"dest": field.name, "default": default, "help": help_text}
    parse: Callable[[str], Any]
    convert: Callable[[str], Any]
    if field.kind == "bool":
        kw["action"] = argparse.BooleanOptionalAction
        parse = _optional(_bool) if field.optional else _bool
    elif field.kind == "choice":
        convert = int if all(isinstance(v, int) for v in field.choices) else str
        kw.update(type=convert, choices=list(field.choices))
        parse = _one_of(convert, field.choices)
    elif field.kind in ("sequence", "mapping"):  # repeatable; None until given
        parse = str if field.kind == "sequence" else _key_value(
            _ITEM_CONVERT.get(field.item_kind, str))
        kw.update(action="append", type=parse, default=None if default is UNSET else default,
                  metavar="VALUE" if field.kind == "sequence" else
                  "KEY=N" if field.item_kind in _ITEM_CONVERT else "KEY=VALUE")
        _REPEATABLE.add(field.name)
        if field.kind == "mapping":
            _MAPPINGS[field.name] = flag
    elif field.kind in ("int", "float"):
        # the flag converts; the limits are the owner's check (EngineConfig,
        # SamplingParams.validate, the server's convert_declared), whose error
        # names the field in one line (bench --compare checks them at once)
        number: Callable[[str], Any] = (byte_size if field.extra.get("unit") == "bytes" else
                                        int if field.kind == "int" else float)
        convert = _bounded(number, {})
        parse = _bounded(number, field.bounds)
        if field.optional:
            convert, parse = _optional(convert), _optional(parse)
        kw.update(type=convert, metavar="N")
    else:
        parse = _optional(str) if field.optional else str
        kw.update(type=parse)
    if "metavar" in field.extra:
        kw["metavar"] = field.extra["metavar"]
    parsers[field.name] = parse
    group.add_argument(flag, *aliases, **kw)


_ENGINE_PARSERS: dict[str, Callable[[str], Any]] = {}
_SAMPLING_PARSERS: dict[str, Callable[[str], Any]] = {}
#: repeatable flags (their argparse default is None, not UNSET)
_REPEATABLE: set[str] = set()
#: KEY=VALUE fields -> their flag: given as (key, value) pairs, taken as a dict
_MAPPINGS: dict[str, str] = {}


def flag_parsers() -> dict[str, Callable[[str], Any]]:
    """Setting or field name (and alias without dashes) -> how its flag reads
    a value: what ``bench --compare key=value`` parses with."""
    if not _ENGINE_PARSERS or not _SAMPLING_PARSERS:  # made with the flags
        scratch = argparse.ArgumentParser()
        add_engine_args(scratch)
        add_sampling_args(scratch)
    parsers = {**_ENGINE_PARSERS, **_SAMPLING_PARSERS}
    aliases = {**ENGINE_ALIASES, **{f.name: tuple(f.extra.get("cli") or ()) for f in _sampling_fields()}}
    for name, spellings in aliases.items():
        for alias in spellings:
            if alias.startswith("--") and name in parsers:
                parsers.setdefault(alias[2:].replace("-", "_"), parsers[name])
    return parsers


def add_engine_args(p: argparse.ArgumentParser, *, profile: Profile | None = None) -> None:
    """One flag per EngineConfig setting; ``profile``: the command's own
    defaults (shown in --help), else the engine's."""
    profile = profile or Profile("")
    defaults, shown = profile.fixed(FIELD_GROUP), profile.shown(FIELD_GROUP)
    group = p.add_argument_group("engine settings (EngineConfig; docs/engine.md)",
                                 profile.describe(FIELD_GROUP) or None)
    for cls in GROUPS.values():
        for field in declared_fields(cls):
            add_declared(group, _ENGINE_PARSERS, field, ENGINE_ALIASES.get(field.name, ()),
                         defaults.get(field.name, UNSET), shown=shown.get(field.name))
    add_renamed(p, RENAMED_FLAGS, RENAMED_VALUES)


def _sampling_fields() -> list[Declared]:
    """The SamplingParams fields that have a meaning on the command line."""
    from diffrt.engine.sampling import SamplingParams

    return [f for f in declared_fields(SamplingParams) if f.extra.get("cli") is not None]


def add_sampling_args(p: argparse.ArgumentParser, *, profile: Profile | None = None) -> None:
    """One flag per SamplingParams field that has a meaning on the command
    line; ``profile``: the command's own defaults, else the model's."""
    profile = profile or Profile("")
    fields = _sampling_fields()
    names = {f.name for f in fields}
    defaults = profile.fixed(names)
    group = p.add_argument_group("sampling (SamplingParams; unset: the model's defaults)",
                                 profile.describe(names) or None)
    for field in fields:
        add_declared(group, _SAMPLING_PARSERS, field, field.extra.get("cli") or (),
                     defaults.get(field.name, UNSET))


def _given(args: argparse.Namespace | dict[str, Any]) -> dict[str, Any]:
    values = args if isinstance(args, dict) else vars(args)
    return {k: v for k, v in values.items()
            if v is not UNSET and not (v is None and k in _REPEATABLE)}


def engine_settings(args: argparse.Namespace | dict[str, Any]) -> dict[str, Any]:
    """The EngineConfig keywords of a parsed command line (or a dict of it):
    the settings given, with sequences and KEY=VALUE mappings as the config
    takes them, and the model ``model_name`` picks when none is given (a clip:
    the default video model); a CLI run's log level reaches the workers."""
    given = _given(args)
    settings: dict[str, Any] = {}
    for name in FIELD_GROUP:
        if name not in given:
            continue
        value = given[name]
        if name in _MAPPINGS:
            value = as_mapping(name, value)
        elif name == "plugin_modules":
            value = tuple(value)
        settings[name] = value
    if "model" not in settings and model_name(given) != DEFAULT_MODEL:  # a clip asked for
        settings["model"] = model_name(given)
    level = given.get("log_level")
    if level not in (None, "WARNING"):  # workers log as this process does
        settings["worker_env"] = {"DIFFRT_LOG_LEVEL": worker_log_spec(level),
                                  **settings.get("worker_env", {})}
    return settings


def as_mapping(name: str, value: Any) -> dict[str, Any]:
    """A repeatable ``KEY=VALUE`` flag's (key, value) pairs as the dict its
    setting takes; a key given twice is refused (which one was meant?)."""
    if isinstance(value, dict):
        return value
    out: dict[str, Any] = {}
    for key, item in value:
        if key in out:
            raise CliError(f"{_MAPPINGS.get(name, name)}: {key!r} given twice")
        out[key] = item
    return out


def worker_log_spec(level: str) -> str:
    """``DIFFRT_LOG_LEVEL`` for workers of a CLI run at ``level``: that level,
    loading progress at INFO or more verbose."""
    progress = "DEBUG" if level == "DEBUG" else "INFO"
    return f"{level},diffrt.load={progress}"


def make_engine(settings: dict[str, Any]) -> Any:
    """Build and start an engine; user mistakes surface as ValueError (shown cleanly)."""
    from diffrt.engine import DiffusionEngine, EngineConfig

    return DiffusionEngine.make_engine(EngineConfig(**settings))


def sampling_params(args: argparse.Namespace | dict[str, Any], **overrides: Any) -> Any:
    """The SamplingParams of the flags given, with ``overrides`` (e.g. a
    per-prompt seed)."""
    from diffrt.engine.sampling import SamplingParams

    given = _given(args)
    fields = {f.name: as_mapping(f.name, given[f.name]) if f.kind == "mapping" else given[f.name]
              for f in _sampling_fields() if f.name in given}
    return SamplingParams(**{**fields, **overrides})


def plugin_modules(args: argparse.Namespace | dict[str, Any]) -> list[str]:
    value = _given(args).get("plugin_modules")
    return list(value or ())


def model_name(args: argparse.Namespace | dict[str, Any]) -> str:
    """``--model``; none given: the default video model when ``--num-frames``
    asks for a clip, else the default (image) model."""
    given = _given(args)
    if given.get("model"):
        return given["model"]
    return DEFAULT_VIDEO_MODEL if given.get("num_frames") is not None else DEFAULT_MODEL


def model_spec(model: str, plugins: Iterable[str] = ()) -> Any:
    """The model's ModelSpec, after importing the plugins that may register it."""
    import importlib

    from diffrt.engine.models.registry import resolve_model_spec

    for name in plugins:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise CliError(f"--plugin-modules {name!r}: cannot import it ({exc})") from None
    return resolve_model_spec(model)


def check_requests(model: str, requests: list[Any], plugins: Iterable[str] = ()) -> None:
    """Refuse an unknown model or bad sampling parameters before loading anything.

    The model's spec checks without weights; its errors name the field.
    """
    spec = model_spec(model, plugins)
    for request in requests:
        request.validate()
        spec.check(request)


def model_defaults(model: str, plugins: Iterable[str] = ()) -> dict[str, Any]:
    """The model's sampling defaults (what options left unset become)."""
    return msgspec.structs.asdict(model_spec(model, plugins).defaults)
