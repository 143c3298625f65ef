"""Reading a declaration: what one msgspec field says about itself.

Engine settings (``settings.py``) and sampling fields (``sampling.py``) are
declared once, as msgspec Struct fields with ``Meta`` (limits, description,
``extra``). ``declared_fields`` reads them back as plain ``Declared``
records, the one reader for every surface built from them: the CLI flags,
the HTTP body model and the docs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

_BOUNDS = ("ge", "gt", "le", "lt", "min_length", "max_length")
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
    default: Any
    description: str
    #: ge/gt/le/lt/min_length/max_length that apply
    bounds: dict[str, Any] = field(default_factory=dict)
    #: the allowed values of a choice
    choices: tuple[Any, ...] = ()
    #: what the declaration adds for other surfaces (``Meta(extra=...)``)
    extra: dict[str, Any] = field(default_factory=dict)
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
    t: Any = f.type
    extra: dict[str, Any] = {}
    description = ""
    optional = False
    bounds: dict[str, Any] = {}
    while True:
        if isinstance(t, msgspec.inspect.Metadata):
            extra = {**(t.extra or {}), **extra}
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
    choices = tuple(t.values) if kind == "choice" else ()
    default = f.default if f.default_factory is msgspec.NODEFAULT else msgspec.NODEFAULT
    return Declared(f.name, kind, optional, default, description, bounds, choices, extra,
                    _item_kind(t))


def _item_kind(t: Any) -> str:
    """The kind of a mapping's values or a sequence's items ("" otherwise)."""
    item = getattr(t, "value_type", None) or getattr(t, "item_type", None)
    if item is None:  # a fixed-length tuple has item_types; not a repeatable kind
        return ""
    while isinstance(item, msgspec.inspect.Metadata):
        item = item.type
    return next((k for cls, k in _KINDS.items() if isinstance(item, cls)), "")


__all__ = ["Declared", "declared_fields"]
