"""What a runner (the engine's code inside a worker) returns to the runtime.

The runtime is generic: it constructs ``RunnerCls(rank=..., world_size=...,
platform=..., **runner_kwargs)`` in each worker and calls
``runner.<method>(payload)`` with the payload round-tripped through msgspec
msgpack (builtins; use ``msgspec.convert`` for typed objects). Methods called
through ``Executor.execute`` return a ``RunnerResult``; methods called through
``collective_rpc`` return any msgspec-encodable value. ``runner.close()`` is
called at shutdown when it exists.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RunnerResult:
    #: msgspec-encodable summary; travels back with COMPUTE_DONE.
    meta: Any = None
    #: key (e.g. request id) -> device tensor or nested list/dict/tuple of them;
    #: travels through the (async) output path, one ``OutputLease`` per key.
    outputs: dict[str, Any] = field(default_factory=dict)


def resolve_runner_cls(path: str) -> type:
    """Import ``"pkg.module:Class"``."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"runner class must be 'pkg.module:Class', got {path!r}")
    module = importlib.import_module(module_name)
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ValueError(f"module {module_name!r} has no runner class {attr!r}") from None
