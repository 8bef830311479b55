"""One value of the run's config read as its field's type: the choices of a ``Literal``, the
``Optional`` and ``Union`` forms, strings from the command line, and each type's name in the
help. ``ConfigError`` is every configuration error; its message names the key."""

import types
import typing
from typing import Any, Literal, Optional, get_args, get_origin

import yaml


class ConfigError(ValueError):
    """A configuration that cannot be read or does not make sense; the message names the key."""


def _optional(tp: Any) -> Optional[Any]:
    """``X`` when ``tp`` is ``Optional[X]``, else None."""
    if get_origin(tp) in (typing.Union, types.UnionType) and type(None) in get_args(tp):
        return next(a for a in get_args(tp) if a is not type(None))
    return None


def _alternatives(tp: Any) -> tuple:
    """The types of a ``Union`` without None (e.g. ``Union[int, Literal["auto"]]``), else ()."""
    if get_origin(tp) in (typing.Union, types.UnionType) and type(None) not in get_args(tp):
        return get_args(tp)
    return ()


def choices(tp: Any) -> tuple:
    """The allowed values of a ``Literal`` (or ``Optional[Literal]``) type; () for other types."""
    tp = _optional(tp) or tp
    return get_args(tp) if get_origin(tp) is Literal else ()


def coerce(key: str, value: Any, tp: Any, cli: bool) -> Any:
    """``value`` as type ``tp`` (a ``Literal``: one of its values; a ``Union``: the first of
    its types that reads it); strings from the command line are parsed."""
    if _optional(tp):
        if value is None or (cli and value.lower() in ("none", "null")):
            return None
        tp = _optional(tp)
    if _alternatives(tp):
        return _coerce_union(key, value, tp, cli)
    allowed = choices(tp)
    parsed = _parse(value, type(allowed[0]) if allowed else tp, cli)
    if allowed and parsed not in allowed:
        raise ConfigError(f"{key} must be one of {allowed}, got {value!r}")
    if parsed is _INVALID:
        raise ConfigError(f"key {key!r} expects {tp.__name__}, got {value!r}")
    return parsed


def _coerce_union(key: str, value: Any, tp: Any, cli: bool) -> Any:
    """``value`` as the first type of the ``Union`` ``tp`` that reads it."""
    for option in _alternatives(tp):
        try:
            return coerce(key, value, option, cli)
        except ConfigError:
            pass
    raise ConfigError(f"{key} must be {' or '.join(map(type_name, _alternatives(tp)))}, "
                      f"got {value!r}")


_INVALID = object()
BOOLS = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}


def _parse(value: Any, tp: type, cli: bool) -> Any:
    """``value`` converted to ``tp``, or ``_INVALID``. YAML reads ``1e-3`` as a string, so
    numbers are accepted as strings from files too."""
    if tp is bool:
        if isinstance(value, bool):
            return value
        return BOOLS.get(value.lower(), _INVALID) if cli else _INVALID
    if tp in (int, float):
        if isinstance(value, bool):
            return _INVALID
        if isinstance(value, tp) or (tp is float and isinstance(value, int)):
            return tp(value)
        try:
            return tp(value) if isinstance(value, str) else _INVALID
        except ValueError:
            return _INVALID
    if tp is dict and cli:
        try:
            value = yaml.safe_load(value) or {}
        except yaml.YAMLError:
            return _INVALID
    return value if isinstance(value, tp) else _INVALID


def type_name(tp: Any) -> str:
    """``{a,b}`` for a choice, ``INT`` for int, ``INT|null`` for Optional[int],
    ``INT|{auto}`` for Union[int, Literal["auto"]], ..."""
    if _alternatives(tp):
        return "|".join(map(type_name, _alternatives(tp)))
    if choices(tp):
        name = "{" + ",".join(map(str, choices(tp))) + "}"
    else:
        name = (_optional(tp) or tp).__name__.upper()
    return name + ("|null" if _optional(tp) else "")
