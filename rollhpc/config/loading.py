"""Turning a plain dict into typed dataclasses: unknown and missing keys, wrong types and failed checks are
reported as a ``ConfigError`` that names the dotted key."""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration mistake, with the dotted path of the offending key."""


def _type_name(tp: object) -> str:
    """A type as an error message shows it: a union as its alternatives (typing's own name for one is "Union")."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " | ".join(_type_name(alt) for alt in typing.get_args(tp))
    if typing.get_origin(tp) is typing.Literal:
        return " | ".join(repr(v) for v in typing.get_args(tp))
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _convert(value: object, tp: object, where: str) -> object:
    """``value`` checked against the annotation ``tp`` (dataclasses built, ints widened to floats); ``Any`` and
    ``object`` take any value."""
    origin = typing.get_origin(tp)
    if tp is Any or tp is object:
        return value
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, where)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in typing.get_args(tp):
            # before the dataclass alternatives, which would read None as "all defaults"
            return None
        errors = []
        for alt in typing.get_args(tp):
            if alt is type(None):
                if value is None:
                    return None
                continue
            try:
                return _convert(value, alt, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(f"{where}: {value!r} does not match {_type_name(tp)}")
    if origin is typing.Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(f"{where}: {value!r} is not one of {list(typing.get_args(tp))}")
        return value
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {type(value).__name__}")
        _, vt = typing.get_args(tp)
        return {str(k): _convert(v, vt, f"{where}.{k}") for k, v in value.items()}
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {type(value).__name__}")
        (et, *_) = typing.get_args(tp) or (Any,)
        items = [_convert(v, et, f"{where}[{i}]") for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp in (int, float, str, bool):
        if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
            raise ConfigError(
                f"{where}: expected {tp.__name__}, got {value!r} ({type(value).__name__})"
            )
        return value
    raise ConfigError(f"{where}: unsupported field type {_type_name(tp)}")


def from_dict(cls: type[T], data: object, where: str = "config") -> T:
    """Build dataclass ``cls`` from ``data``, recursively, rejecting unknown and missing keys."""
    if isinstance(data, cls):
        return data
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping for {cls.__name__}, got {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = [k for k in data if k not in fields]
    if unknown:
        raise ConfigError(
            f"{where}: unknown key {unknown[0]!r}"
            + (f" (and {unknown[1:]})" if unknown[1:] else "")
            + f"; valid keys: {', '.join(fields)}"
        )
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for name, f in fields.items():
        if name in data:
            kwargs[name] = _convert(data[name], hints[name], f"{where}.{name}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{where}: missing required key {name!r}")
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"{where}: {e}") from e


def component_options(component: type, options: object, where: str) -> object:
    """Validate a component's options against its ``Options`` dataclass (a dict if it has none)."""
    opts_cls = getattr(component, "Options", None)
    if not isinstance(options, dict) and not (opts_cls and isinstance(options, opts_cls)):
        raise ConfigError(f"{where}: expected a mapping, got {options!r}")
    if opts_cls is None:
        if options:
            name = component.__name__.removesuffix("Spec")  # a spec speaks for its runtime class
            raise ConfigError(f"{where}: {name} takes no options, got {sorted(options)}")
        return {}
    return from_dict(opts_cls, options, where)
