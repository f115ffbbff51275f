"""Frozen-dataclass <-> plain-dict conversion with strict key checking.

Every config object is a frozen dataclass. ``from_dict`` rejects unknown keys
with a close-match hint ("did you mean ...?") so a typo in a recipe never
silently falls back to a default.
"""
from __future__ import annotations

import collections.abc
import dataclasses
import difflib
import enum
import math
import types
import typing
from typing import Any, TypeVar

from trt_sora.errors import ConfigError

T = TypeVar("T")


def did_you_mean(word: str, choices) -> str:
    """A ' (did you mean 'x'?)' hint, or '' when nothing is close."""
    match = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.5)
    return f" (did you mean {match[0]!r}?)" if match else ""


def enum_member(tp: type[enum.Enum], value: Any, where: str) -> enum.Enum:
    """``value`` (a member or its value) as a member of ``tp``; ConfigError naming the choices otherwise."""
    try:
        return tp(value)
    except ValueError:
        choices = [m.value for m in tp]
        raise ConfigError(f"{where}: {value!r} is not one of {choices}{did_you_mean(str(value), choices)}") from None


def _convert(tp: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        non_none = [a for a in args if a is not type(None)]
        last: Exception | None = None
        for a in non_none:
            try:
                return _convert(a, value, where)
            except ConfigError as exc:
                last = exc
        raise last or ConfigError(f"{where}: cannot read {value!r}")
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if hasattr(tp, "from_yaml"):
            return tp.from_yaml(value, where=where)
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {type(value).__name__} {value!r}")
        return from_dict(tp, value, where=where)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return enum_member(tp, value, where)
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(args[0], v, f"{where}[{i}]") for i, v in enumerate(value))
        if origin is tuple and args:
            if len(args) != len(value):
                raise ConfigError(f"{where}: expected {len(args)} items, got {len(value)}")
            return tuple(_convert(a, v, f"{where}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
        inner = args[0] if args else Any
        return tuple(_convert(inner, v, f"{where}[{i}]") for i, v in enumerate(value))
    if origin in (dict, collections.abc.Mapping):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        kt, vt = args if args else (Any, Any)
        return types.MappingProxyType(
            {_convert(kt, k, where): _convert(vt, v, f"{where}.{k}") for k, v in value.items()}
        )
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        if not math.isfinite(value):
            raise ConfigError(f"{where}: expected a finite number, got {value!r}; write a number (or remove "
                              "the key for the default)")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    return value


def from_dict(cls: type[T], data: dict, *, where: str = "") -> T:
    """Build the frozen dataclass ``cls`` from ``data``; unknown keys are errors."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where or cls.__name__}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    for key, value in data.items():
        path = f"{where}.{key}" if where else str(key)
        if key not in fields:
            raise ConfigError(
                f"unknown key {path!r}{did_you_mean(key, fields)}; "
                f"valid keys here: {', '.join(sorted(fields))}"
            )
        kwargs[key] = _convert(hints[key], value, path)
    missing = [
        n for n, f in fields.items()
        if n not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ConfigError(f"{where or cls.__name__}: missing required key(s) {missing}")
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        if where and not str(exc).startswith(where):
            raise ConfigError(f"{where}: {exc}") from None
        raise


def to_dict(obj: Any) -> Any:
    """Plain (YAML/JSON-safe) form of a config object."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, (tuple, list)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, (dict, types.MappingProxyType)):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj
