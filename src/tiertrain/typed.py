"""One typed check for every value that reaches us from a flag, a config, a plan or a checkpoint.

Each dataclass that users (or files they can edit) fill declares its fields' types and, in the
field's metadata, their ranges (``at_least``, ``between``, ``choices``); ``load`` builds one from
a mapping and ``check`` validates one already built. Both raise one error that names the field,
the value and what would be accepted, instead of the scattered checks (and the silent coercions:
``bool("false")``, ``int(2.7)``, ``int(1e400)``) we had. Why not pydantic: these rules are all we
need, and our dataclasses stay plain (frozen where they are data, no runtime dependency).
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import math
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from tiertrain.errors import ConfigError, UserError

T = TypeVar("T")
_NONE = type(None)


def read_text(path: Path, what: str, fix: str, error: type[UserError] = ConfigError) -> str:
    """A file the user named, as text, or one error naming it and ``fix``: missing, unreadable, or not text."""
    if not path.is_file():
        raise error(f"{what} {path} does not exist; {fix}")
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise error(f"{what} {path} cannot be read as text ({exc}); {fix}") from None


def load_json(cls: type[T], text: str, where: str, fix: str) -> T:
    """``cls`` from a JSON text (a plan, a profile, a machine description), every field checked by
    ``load``; text that is not JSON is one message that says how to write a good one (``fix``)."""
    import json

    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"{where} is not valid JSON ({exc}); {fix}") from None
    return load(cls, data, where)


def at_least(low: float) -> dict[str, Any]:
    """Field metadata: the value must be >= ``low``."""
    return {"min": low}


def between(low: float, high: float, high_open: bool = False) -> dict[str, Any]:
    """Field metadata: ``low <= value <= high`` (``< high`` with ``high_open``)."""
    return {"min": low, "max": high, "max_open": high_open}


def above(low: float) -> dict[str, Any]:
    """Field metadata: the value must be > ``low``."""
    return {"min": low, "min_open": True}


def one_of(*choices: str) -> dict[str, Any]:
    """Field metadata: the value must be one of ``choices``."""
    return {"choices": choices}


def load(cls: type[T], data: Any, where: str, error: type[UserError] = ConfigError) -> T:
    """A ``cls`` from ``data`` (a mapping from JSON/YAML), every field checked; unknown keys are
    refused with the closest valid name. ``where`` names the source in messages ("plan file x")."""
    if not isinstance(data, Mapping):
        raise error(f"{where} must be a mapping of field: value, not {_kind(data)}")
    names = [f.name for f in dataclasses.fields(cls) if f.init]  # type: ignore[arg-type]
    for key in data:
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise error(f"unknown {where} field {key!r}{hint}; valid fields: {', '.join(names)}")
    missing = [f.name for f in dataclasses.fields(cls)  # type: ignore[arg-type]
               if f.init and f.name not in data and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise error(f"{where}: missing field(s) {', '.join(missing)}")
    hints = typing.get_type_hints(cls)
    values = {k: convert(v, hints[k], f"{where}: {k}", error, _meta(cls, k)) for k, v in data.items()}
    return cls(**values)


def check(obj: Any, where: str, error: type[UserError] = ConfigError) -> None:
    """Validate (and normalise: lists to tuples, ints to floats) a dataclass built in code."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        if f.name not in hints or f.metadata.get("unchecked"):
            continue
        value = convert(getattr(obj, f.name), hints[f.name], f"{where}: {f.name}", error, f.metadata)
        object.__setattr__(obj, f.name, value)  # frozen dataclasses too


def convert(value: Any, hint: Any, name: str, error: type[UserError] = ConfigError,
            meta: Mapping[str, Any] | None = None) -> Any:
    """``value`` as type ``hint``, or ``error`` naming ``name``. Never coerces across kinds:
    a bool is not a number, a string is not a bool, 2.7 is not a whole number."""
    meta = meta or {}
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and _NONE in args:
            return None
        inner = [a for a in args if a is not _NONE]
        if len(inner) == 1:
            return convert(value, inner[0], name, error, meta)
        for option in inner:  # str | int and the like: the first that takes it
            try:
                return convert(value, option, name, error, meta)
            except UserError:
                continue
        raise error(f"{name} has the wrong type: got {value!r}")
    if hint is Any:
        return value
    if origin is typing.Literal:
        if value not in args:
            raise error(f"{name} must be one of {', '.join(map(repr, args))}, got {value!r}")
        return value
    if origin is tuple:
        return _tuple(value, args, name, error, meta)
    if origin in (list, dict) or hint in (list, dict):
        want = origin or hint
        if not isinstance(value, want):
            raise error(f"{name} must be a {want.__name__}, got {_kind(value)}")
        return value
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        try:
            return hint(value)
        except ValueError:
            raise error(f"{name} must be one of {', '.join(repr(m.value) for m in hint)}, got {value!r}") from None
    if dataclasses.is_dataclass(hint):
        return value if isinstance(value, hint) else load(hint, value, name, error)
    return _scalar(value, hint, name, error, meta)


def _scalar(value: Any, hint: Any, name: str, error: type[UserError], meta: Mapping[str, Any]) -> Any:
    if hint is bool:
        if not isinstance(value, bool):
            raise error(f"{name} must be true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise error(f"{name} must be a whole number, got {value!r}")
    elif hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise error(f"{name} must be a number, got {value!r}")
        if not math.isfinite(value):
            raise error(f"{name} must be a finite number, got {value!r}")
        value = float(value)
    elif hint is str:
        if not isinstance(value, str):
            raise error(f"{name} must be a string, got {value!r}")
        if "choices" in meta and value not in meta["choices"]:
            raise error(f"{name} must be one of {', '.join(meta['choices'])}, got {value!r}")
        return value
    else:
        return value
    _range(value, name, error, meta, whole=hint is int)
    return value


def _range(value: float, name: str, error: type[UserError], meta: Mapping[str, Any], whole: bool) -> None:
    low, high = meta.get("min"), meta.get("max")
    if whole and low in (0, 1) and high is None and value < low:
        kind = "a positive whole number" if low == 1 else "a whole number >= 0"
        raise error(f"{name} must be {kind}, got {value!r}")
    if low is not None and (value <= low if meta.get("min_open") else value < low):
        raise error(f"{name} must be {'>' if meta.get('min_open') else '>='} {low}, got {value!r}")
    if high is not None and (value >= high if meta.get("max_open") else value > high):
        raise error(f"{name} must be {'<' if meta.get('max_open') else '<='} {high}, got {value!r}")


def _tuple(value: Any, args: tuple, name: str, error: type[UserError], meta: Mapping[str, Any]) -> tuple:
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise error(f"{name} must be a list, got {_kind(value)}")
    if len(args) == 2 and args[1] is Ellipsis:
        return tuple(convert(v, args[0], f"{name}[{i}]", error, meta) for i, v in enumerate(value))
    if len(value) != len(args):
        raise error(f"{name} must hold {len(args)} values, got {len(value)}")
    return tuple(convert(v, a, f"{name}[{i}]", error, meta) for i, (v, a) in enumerate(zip(value, args)))


def _meta(cls: type, name: str) -> Mapping[str, Any]:
    return next(f.metadata for f in dataclasses.fields(cls) if f.name == name)  # type: ignore[arg-type]


def _kind(value: Any) -> str:
    return {list: "a list", dict: "a mapping", str: "a string", type(None): "null"}.get(type(value),
                                                                                      type(value).__name__)
