"""The flags of `diffrt serve` that are not engine settings, made from their
declarations, and read back into them.

Every server option is a declared field (``serve/settings.py``:
``ServeSettings``, ``HttpLimits``, ``ReplicaOptions``; the command's own
``ServeCommand`` below) and becomes a flag as an engine setting does
(``engine_opts.add_declared``: the name with dashes, seconds ending in
``-s``, the declaration's help and default). The values given are checked
against the declarations when they are read back (``convert_declared``: one
line naming the field). Flags of earlier releases exit 2 naming the new one.
"""

from __future__ import annotations

import argparse
import os
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from diffrt.cli.engine_opts import UNSET, add_declared, flag_of
from diffrt.cli.errors import CliError
from diffrt.cli.renamed import add_renamed
from diffrt.engine.declarations import DeclaredExtra, declared_fields
from diffrt.runtime.types import convert_declared
from diffrt.serve.settings import AUTOSCALING_FIELDS, HttpLimits, ReplicaOptions, ServeSettings


class ServeCommand(msgspec.Struct, kw_only=True, frozen=True):
    """What only the command reads: where it listens, and how long a Ray
    Serve application may take to start."""

    host: Annotated[str, Meta(min_length=1, description="the address to bind")] = "127.0.0.1"
    # no declared range: binding checks it, naming --port (before anything loads)
    port: Annotated[int, Meta(description=(
        "the port, 0-65535 (0: a free one, printed once ready)"))] = 8000
    placement_timeout_s: Annotated[float, Meta(gt=0, extra={"group": "ray", "metavar": "S"},
                                               description=(
        "seconds the Ray Serve application may take to be placed and start before the "
        "command gives up, naming what Ray reported (what the cluster cannot hold is "
        "refused at once; on a busy 2-CPU machine placing and loading two tiny replicas "
        "took over 90 s)"))] = 300.0


#: each declaration of serve's flags and the --help group its fields sit in
#: (a field's ``extra["group"]`` moves it), in the order --help lists them
DECLARATIONS: tuple[tuple[type[msgspec.Struct], str], ...] = (
    (ServeCommand, "server"), (ServeSettings, "server"), (HttpLimits, "edge"),
    (ReplicaOptions, "ray"))
#: group -> (title, description) of --help
GROUPS = {
    "server": ("the server (ServeSettings; docs/serving.md)", None),
    "edge": ("the HTTP edge (HttpLimits; docs/limits.md#http)",
             "Bounds on what one client may hold, each checked before a request reaches the "
             "engine."),
    "ray": ("replicas on Ray Serve (ReplicaOptions; the ray extra; docs/scale-out.md)",
            "Any of these but --placement-timeout-s serves the same API as a Ray Serve "
            "application: an ingress and model replicas, each owning one engine on its own "
            "device(s)."),
}
#: serve's flags of earlier releases -> what replaced them (seconds end in -s)
SERVE_RENAMED_FLAGS = {
    "--shutdown-timeout": "--shutdown-timeout-s",
    "--url-ttl": "--url-ttl-s",
    "--header-timeout": "--header-timeout-s",
    "--body-timeout": "--body-timeout-s",
    "--keep-alive-timeout": "--keep-alive-timeout-s",
    "--upscale-delay": "--upscale-delay-s",
    "--downscale-delay": "--downscale-delay-s",
    "--placement-timeout": "--placement-timeout-s",
}
#: the flags that put the server on Ray Serve (--ray-address is the engine's
#: setting, which also says which cluster Ray Serve joins)
RAY_FLAGS = (*ReplicaOptions.__struct_fields__, "ray_address")


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """One flag per declared server option. A Ray flag's default stays unset
    (given at all, it serves on Ray); the others hold the declared default."""
    groups = {name: p.add_argument_group(title, description)
              for name, (title, description) in GROUPS.items()}
    for struct, home in DECLARATIONS:
        for field in declared_fields(struct):
            default = UNSET if struct is ReplicaOptions else field.default
            add_declared(groups[field.extra.get("group", home)], {}, field, (), default)
    add_renamed(p, SERVE_RENAMED_FLAGS)


def serve_flags() -> dict[str, str]:
    """Field name -> its flag, for every declared server option."""
    return {f.name: flag_of(f) for struct, _ in DECLARATIONS for f in declared_fields(struct)}


def given(args: argparse.Namespace, struct: type[msgspec.Struct]) -> dict[str, Any]:
    """The values of ``struct``'s fields on the command line (unset ones left out)."""
    values = {name: getattr(args, name, UNSET) for name in struct.__struct_fields__}
    return {name: value for name, value in values.items() if value is not UNSET}


def on_ray(args: argparse.Namespace) -> bool:
    """Any Ray flag given."""
    return any(getattr(args, flag, None) not in (None, UNSET) for flag in RAY_FLAGS)


def serve_command(args: argparse.Namespace) -> ServeCommand:
    return convert_declared(ServeCommand, given(args, ServeCommand))


def build_serve_settings(args: argparse.Namespace) -> ServeSettings:
    """The ServeSettings of the command line: the values given, the API key
    from the environment when no flag gives one, the host names, URL and
    LoRA and weights folders checked as ``diffrt serve`` takes them."""
    values = given(args, ServeSettings)
    values["api_key"] = api_keys(values.get("api_key"))
    values.update(allowed_hosts=allowed_hosts(args), public_url=public_url(args),
                  lora_dir=lora_dir(args), weights_dir=weights_dir(args))
    return convert_declared(ServeSettings, values)


def api_keys(given: list[str] | None) -> tuple[str, ...] | None:
    """``--api-key`` (repeatable, each a comma list), else ``$DIFFRT_API_KEY``
    (a comma list too), as the keys accepted; None: no key."""
    env = _extra(ServeSettings, "api_key")["env"]
    texts = given if given is not None else [os.environ.get(env, "")]
    keys = tuple(dict.fromkeys(k.strip() for text in texts for k in text.split(",")
                               if k.strip()))
    return keys or None


def http_limits(args: argparse.Namespace) -> HttpLimits:
    return convert_declared(HttpLimits, given(args, HttpLimits))


def replica_values(args: argparse.Namespace) -> dict[str, Any]:
    """The ``ReplicaOptions`` given, checked against their declarations;
    autoscaling ones need ``--max-replicas``."""
    values = given(args, ReplicaOptions)
    if values.get("max_replicas") is None and any(a in values for a in AUTOSCALING_FIELDS):
        flags = [serve_flags()[a] for a in AUTOSCALING_FIELDS]
        raise CliError(f"{', '.join(flags[:-1])} and {flags[-1]} need --max-replicas "
                       "(which turns autoscaling on)")
    convert_declared(ReplicaOptions, values)
    return values


def _extra(struct: type[msgspec.Struct], name: str) -> DeclaredExtra:
    return next(f.extra for f in declared_fields(struct) if f.name == name)


def allowed_hosts(args: argparse.Namespace) -> tuple[str, ...] | None:
    """``--allowed-hosts`` (repeatable, each comma-separated) as a tuple
    (None: any host), or its default for ``--host``."""
    from diffrt.serve.guards import default_allowed_hosts

    if args.allowed_hosts is None:
        return default_allowed_hosts(args.host)
    hosts = tuple(h.strip() for given in args.allowed_hosts for h in given.split(",")
                  if h.strip())
    for host in hosts:
        if "*" in host[1:] or (host.startswith("*") and host != "*"
                               and not host.startswith("*.")):
            raise CliError(f"--allowed-hosts: {host!r}: a pattern is '*' or '*.example.com'")
    if not hosts:
        raise CliError("--allowed-hosts: give at least one host name (or '*' for any)")
    return None if "*" in hosts else hosts


def public_url(args: argparse.Namespace) -> str | None:
    from urllib.parse import urlsplit

    if args.public_url is None:
        return None
    parts = urlsplit(args.public_url)
    if parts.scheme not in ("http", "https") or not parts.netloc or parts.query:
        raise CliError(f"--public-url {args.public_url!r}: must be an http(s) URL such as "
                       "https://images.example.com (a path prefix allowed, no query)")
    return str(args.public_url).rstrip("/")


def lora_dir(args: argparse.Namespace) -> str | None:
    """``--lora-dir`` as its real path: an existing folder, one engine (Ray
    Serve replicas register adapters at start only)."""
    if args.lora_dir is None:
        return None
    if on_ray(args):
        raise CliError("--lora-dir: adapters cannot be registered at run time on Ray Serve "
                       "replicas (each has an engine of its own); give them with "
                       "--lora-modules NAME=PATH")
    return _folder(args.lora_dir, "--lora-dir")


def weights_dir(args: argparse.Namespace) -> str | None:
    """``--weights-dir`` as its real path: an existing folder (on Ray Serve
    every replica reads a path in it: the same folder on every node)."""
    if args.weights_dir is None:
        return None
    return _folder(args.weights_dir, "--weights-dir")


def _folder(path: str, flag: str) -> str:
    real = os.path.realpath(path)
    if not os.path.isdir(real):
        raise CliError(f"{flag} {path!r}: not an existing folder")
    return real


__all__ = ["DECLARATIONS", "RAY_FLAGS", "SERVE_RENAMED_FLAGS", "ServeCommand", "add_serve_args",
           "allowed_hosts", "api_keys", "build_serve_settings", "given", "http_limits", "lora_dir",
           "on_ray", "public_url", "replica_values", "serve_command", "serve_flags",
           "weights_dir"]
