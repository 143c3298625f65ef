"""Reading a declaration: what one msgspec field says about itself.

Engine settings (``settings.py``) and sampling fields (``sampling.py``) are
declared once, as msgspec Struct fields with ``Meta`` (limits, description,
``extra``). ``declared_fields`` reads them back as plain ``Declared``
records, the one reader for every surface built from them: the CLI flags,
the HTTP body model and the docs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypedDict

import msgspec

_BOUNDS = ("ge", "gt", "le", "lt", "min_length", "max_length")


class DeclaredExtra(TypedDict, total=False):
    """What a declaration's ``Meta(extra=...)`` may say for the surfaces
    built from it (each key optional)."""

    #: the HTTP body's name ("" the field's own; None: not over HTTP)
    http: str | None
    #: the command line's extra aliases (None: no flag)
    cli: list[str] | None
    #: means something only for a request with input images
    needs_image: bool
    #: an upper bound beyond msgspec's int64 ones, checked by the owner
    le: int
    #: the flag's spelling when it is not ``--<name>``
    flag: str
    #: the environment variable that also sets it
    env: str
    #: the flag's metavar in ``--help``
    metavar: str
    #: "bytes": the flag takes a size such as 8GiB
    unit: str
    #: the ``--help`` group the flag is listed in
    group: str


_KINDS = {msgspec.inspect.BoolType: "bool", msgspec.inspect.IntType: "int",
          msgspec.inspect.FloatType: "float", msgspec.inspect.StrType: "str",
          msgspec.inspect.LiteralType: "choice", msgspec.inspect.VarTupleType: "sequence",
          msgspec.inspect.ListType: "sequence", msgspec.inspect.TupleType: "sequence",
          msgspec.inspect.DictType: "mapping"}


@dataclass(frozen=True)
class Declared:
    """One field's declaration."""

    name: str
    #: "bool", "int", "float", "str", "choice", "sequence" or "mapping"
    kind: str
    #: None is a value it takes (its "automatic" or "no limit")
    optional: bool
    #: the default (NODEFAULT when a factory makes it)
    default: object
    description: str
    #: ge/gt/le/lt/min_length/max_length that apply
    bounds: dict[str, int | float] = field(default_factory=dict)
    #: the allowed values of a choice
    choices: tuple[object, ...] = ()
    #: what the declaration adds for other surfaces (``Meta(extra=...)``)
    extra: DeclaredExtra = field(default_factory=lambda: DeclaredExtra())
    #: the kind of a mapping's values or a sequence's items ("" for the others),
    #: so a surface can read ``name=1.5`` as a number where one is declared
    item_kind: str = ""

    @property
    def has_factory_default(self) -> bool:
        return self.default is msgspec.NODEFAULT


def declared_fields(struct: type) -> list[Declared]:
    """The fields of ``struct`` as ``Declared``, in declaration order."""
    info = msgspec.inspect.type_info(struct)
    assert isinstance(info, msgspec.inspect.StructType | msgspec.inspect.DataclassType)
    return [_declared(f) for f in info.fields]


def _declared(f: msgspec.inspect.Field) -> Declared:
    t: msgspec.inspect.Type = f.type
    extra = DeclaredExtra()
    description = ""
    optional = False
    bounds: dict[str, int | float] = {}
    while True:
        if isinstance(t, msgspec.inspect.Metadata):
            extra = {**DeclaredExtra(**(t.extra or {})), **extra}
            description = description or (t.extra_json_schema or {}).get("description", "")
            t = t.type
        elif isinstance(t, msgspec.inspect.UnionType):
            others = [m for m in t.types if not isinstance(m, msgspec.inspect.NoneType)]
            optional = optional or len(others) < len(t.types)
            t = others[0]
        else:
            break
    for name in _BOUNDS:
        value = getattr(t, name, None)
        if value is not None:
            bounds[name] = value
    if "le" in extra:  # a bound beyond msgspec's int64, checked by the owner
        bounds["le"] = extra["le"]
    kind = next(k for cls, k in _KINDS.items() if isinstance(t, cls))
    choices = tuple(t.values) if isinstance(t, msgspec.inspect.LiteralType) else ()
    default = f.default if f.default_factory is msgspec.NODEFAULT else msgspec.NODEFAULT
    return Declared(f.name, kind, optional, default, description, bounds, choices, extra,
                    _item_kind(t))


def _item_kind(t: msgspec.inspect.Type) -> str:
    """The kind of a mapping's values or a sequence's items ("" otherwise)."""
    item = getattr(t, "value_type", None) or getattr(t, "item_type", None)
    if item is None:  # a fixed-length tuple has item_types; not a repeatable kind
        return ""
    while isinstance(item, msgspec.inspect.Metadata):
        item = item.type
    return next((k for cls, k in _KINDS.items() if isinstance(item, cls)), "")


__all__ = ["Declared", "DeclaredExtra", "declared_fields"]
