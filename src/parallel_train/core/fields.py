"""The machinery of typed config sections: a field with help, allowed values and a range; turning YAML or
command-line values into the field's type; checking ranges. Each failure is one line naming the key.

config/load.py builds the run's sections from it, and each model declares its own keys with it (models/*.py),
so this module imports nothing of the package but errors.py.
"""

from __future__ import annotations

import dataclasses
import keyword
import math
import types
import typing
from dataclasses import field
from typing import Any

from parallel_train.errors import UserError

# Integers that reach torch end up as int64 tensor sizes, generator seeds or C++ timeouts; values past these
# raise deep inside torch ("Overflow when unpacking long"), so every integer key has an upper bound.
INT_MAX = 2**31 - 1


def opt(
    default: Any,
    help: str,
    choices: tuple | None = None,
    min: float | None = None,
    max: float | None = None,
    above: float | None = None,
    below: float | None = None,
    aliases: dict[str, str] | None = None,
) -> Any:
    """A config field with its help text, its allowed values if the set is closed, and its range:
    `min`/`max` inclusive, `above`/`below` exclusive. Integers default to at most INT_MAX; numbers must be finite.
    `aliases`: old or short values and the value each stands for (a key that was a bool and grew more choices)."""
    meta = {"help": help, "choices": choices, "min": min, "max": max, "above": above, "below": below, "aliases": aliases or {}}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


def key_name(field_name: str) -> str:
    """The config key of a field: its name, except that a Python keyword (`checkpoint.async`) is spelled with a
    trailing underscore in the dataclass (`async_`), which the key drops."""
    bare = field_name[:-1] if field_name.endswith("_") else field_name
    return bare if keyword.iskeyword(bare) else field_name


def fields_of(obj: Any) -> dict[str, dataclasses.Field]:
    """The fields of a section by config key."""
    return {key_name(f.name): f for f in dataclasses.fields(obj)}


def as_dict(obj: Any) -> Any:
    """A section (recursively) as a dict keyed by config keys, for config.yaml and trackers."""
    if dataclasses.is_dataclass(obj):
        return {key_name(f.name): as_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    return list(obj) if isinstance(obj, list) else obj


def hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def type_name(tp: Any) -> str:
    if typing.get_origin(tp):  # list[str] says what goes in the list; its __name__ would say only "list"
        return str(tp).replace("typing.", "")
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def optional(tp: Any) -> Any:
    """X of a field typed `X | None` (a key whose default, None, means "not given": model.dropout of a Hub model
    leaves its folder's values), else None."""
    args = typing.get_args(tp) if typing.get_origin(tp) in (types.UnionType, typing.Union) else ()
    return next((a for a in args if a is not type(None)), None) if type(None) in args else None


def coerce(key: str, value: Any, tp: Any) -> Any:
    """Convert a YAML/command-line value to the field's type, or raise a UserError naming the key."""
    if (inner := optional(tp)) is not None:  # null, none or nothing: not given
        return None if value is None or (isinstance(value, str) and value.lower() in ("", "none", "null")) else coerce(key, value, inner)
    origin = typing.get_origin(tp)
    if origin in (list, types.GenericAlias) or tp is list:
        if isinstance(value, str):  # `key=cpu` or `key=a,b` on the command line
            value = [v for v in value.split(",") if v] if value else []
        if not isinstance(value, list):
            raise UserError(f"{key}: expected a list like [a,b], got {value!r}")
        return [str(v) for v in value]
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise UserError(f"{key}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, (int, str, float)):
            raise UserError(f"{key}: expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        try:
            as_float = float(value)
        except ValueError:
            raise UserError(f"{key}: expected an integer, got {value!r}") from None
        if not math.isfinite(as_float) or as_float != int(as_float):
            raise UserError(f"{key}: expected an integer, got {value!r}")
        return int(as_float)
    if tp is float:
        if isinstance(value, bool):
            raise UserError(f"{key}: expected a number, got {value!r}")
        try:
            return float(value)  # also takes "1e-3", which YAML 1.1 reads as a string
        except (TypeError, ValueError, OverflowError):
            raise UserError(f"{key}: expected a number, got {value!r}") from None
    if tp is str:
        if isinstance(value, (dict, list)):
            raise UserError(f"{key}: expected a string, got {value!r}")
        if isinstance(value, bool):  # YAML 1.1 reads no/yes/off/on as booleans: `mixed_precision=no` means "no"
            return "yes" if value else "no"
        return "none" if value is None else str(value)
    raise AssertionError(f"unsupported config type {tp}")  # a bug in a config class, not user input


def _bounds(meta: dict[str, Any], is_int: bool) -> tuple[tuple[str, float] | None, tuple[float, str] | None, bool]:
    """(lower bound and its bracket, upper bound and its bracket, whether the upper one is only INT_MAX)."""
    low = ("[", meta["min"]) if meta["min"] is not None else ("(", meta["above"]) if meta["above"] is not None else None
    high = (meta["max"], "]") if meta["max"] is not None else (meta["below"], ")") if meta["below"] is not None else None
    if is_int and high is None:
        return low, (INT_MAX, "]"), True
    return low, high, False


def in_range(value: float, meta: dict[str, Any], is_int: bool) -> bool:
    low, high, _ = _bounds(meta, is_int)
    return (
        (is_int or math.isfinite(value))
        and (low is None or (value >= low[1] if low[0] == "[" else value > low[1]))
        and (high is None or (value <= high[0] if high[1] == "]" else value < high[0]))
    )


def _range_text(value: float, meta: dict[str, Any], is_int: bool) -> str:
    """`>= 1`, `in [0, 1)`, `<= 2,147,483,647`: the words of the range check's error message."""
    low, high, implicit_high = _bounds(meta, is_int)
    fmt = (lambda v: f"{v:,}" if abs(v) >= 10**6 else str(v)) if is_int else (lambda v: f"{v:g}")  # noqa: E731
    if implicit_high and low is not None:  # name only the side that was crossed
        low, high = (low, None) if value < low[1] or (low[0] == "(" and value == low[1]) else (None, high)
    if low and high:
        return f"in {low[0]}{fmt(low[1])}, {fmt(high[0])}{high[1]}"
    if low:
        return f"{'>=' if low[0] == '[' else '>'} {fmt(low[1])}"
    if high:
        return f"{'<=' if high[1] == ']' else '<'} {fmt(high[0])}"
    return "a finite number"


def check_section(section: Any, prefix: str) -> None:
    """Every field of one section: in its closed set of choices, and numbers in their range (finite floats)."""
    types_ = hints(type(section))
    for f in dataclasses.fields(section):
        value, key = getattr(section, f.name), prefix + key_name(f.name)
        choices = f.metadata.get("choices")
        if value == "" and isinstance(f.default, str) and f.default:  # '' means something only where it is the default
            raise UserError(f"{key}: must not be empty; its default is {f.default!r}")
        if choices and value not in choices:
            raise UserError(f"{key}: must be one of {', '.join(choices)}, got {value!r}")
        kind = optional(types_[f.name]) or types_[f.name]
        if kind in (int, float) and f.metadata and value is not None:
            is_int = kind is int
            if not in_range(value, f.metadata, is_int):
                words = _range_text(value, f.metadata, is_int)
                if not is_int and not math.isfinite(value) and words != "a finite number":
                    words = "a finite number " + words
                raise UserError(f"{key}: must be {words}, got {value}")


def check(ok: bool, message: str) -> None:
    if not ok:
        raise UserError(message)
