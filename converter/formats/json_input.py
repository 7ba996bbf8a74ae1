"""JSON read from files we did not write (config, index, a DST's manifest): numbers bounded.

Python's json takes ``Infinity``, ``NaN``, ``1e400`` (as inf) and integers of any length,
and a 5001-digit one raises a ValueError that is not a JSONDecodeError. Here every number
is checked as it is parsed: integers fit in 64 bits (what serde_json, hence safetensors and
the Hub, would accept), floats are finite, the constants are refused. A count read later
still needs its own bound before it sizes anything (profiles.expected_modules).
"""
from __future__ import annotations

import json
from typing import Any

from ..safepath import open_regular

INT_DIGITS = 20            # a 64-bit integer has at most 20 digits: longer ones are never converted
INT_LIMIT = 1 << 63


def _int(s: str) -> int:
    if len(s.lstrip("-")) > INT_DIGITS:
        raise ValueError(f"integer {s[:12]}... ({len(s.lstrip('-'))} digits) does not fit in 64 bits")
    n = int(s)
    if not -INT_LIMIT <= n < INT_LIMIT:
        raise ValueError(f"integer {s} does not fit in 64 bits")
    return n


def _float(s: str) -> float:
    x = float(s)
    if x in (float("inf"), float("-inf")):
        raise ValueError(f"number {s[:24]} is out of range (not a finite double)")
    return x


def _constant(s: str) -> Any:
    raise ValueError(f"{s} is not JSON (not a finite number)")


def loads(text: str, constants: bool = False) -> Any:
    """``json.loads`` with every number bounded; ValueError (a JSONDecodeError or ours) otherwise.

    ``constants``: take ``Infinity``/``NaN``, which Python's own json writes for a non-finite
    float (our state files and report may hold one); never in a source file.
    """
    try:
        return json.loads(text, parse_int=_int, parse_float=_float,
                          parse_constant=None if constants else _constant)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def load_file(path: str, constants: bool = False) -> Any:
    """A JSON file's value (FileNotFoundError, UnicodeDecodeError, ValueError pass through).
    Only a regular file is read: a FIFO (which would wait for a writer for ever) or a device is
    refused with BadInput naming what it is (safepath.open_regular)."""
    with open(open_regular(path, missing_ok=True), encoding="utf-8") as f:
        return loads(f.read(), constants)


def type_name(value: Any) -> str:
    """The JSON name of a Python value's type, for messages."""
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "an integer",
            float: "a number", type(None): "null"}.get(type(value), type(value).__name__)


# --------------------------------------------------------------------------- expected types

class MapOf:
    """An object whose every value matches ``spec`` (a shard table, a weight map)."""

    def __init__(self, spec: Any):
        self.spec = spec


class ListOf:
    """An array whose every item matches ``spec``."""

    def __init__(self, spec: Any):
        self.spec = spec


class Nullable:
    """``spec`` or null."""

    def __init__(self, spec: Any):
        self.spec = spec


def _is(value: Any, t: type) -> bool:
    if type(value) is bool:
        return t is bool
    if t is float:
        return type(value) in (int, float)
    return type(value) is t


def _expected(t: type) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "an integer",
            float: "a number"}[t]


def type_problems(value: Any, spec: Any, where: str = "") -> list[str]:
    """Each place where ``value`` is not of the type ``spec`` says, as "field A.B is X, expected Y".

    ``spec``: a type (int excludes booleans; float takes integers), a dict of key -> spec
    (keys absent are not this check's business), :class:`MapOf`, :class:`ListOf`, :class:`Nullable`.
    """
    at = f"field {where}" if where else "the file"
    if isinstance(spec, Nullable):
        return [] if value is None else type_problems(value, spec.spec, where)
    if isinstance(spec, (dict, MapOf)):
        if not isinstance(value, dict):
            return [f"{at} is {type_name(value)}, expected an object"]
        items = [(k, s) for k, s in spec.items() if k in value] if isinstance(spec, dict) else \
            [(k, spec.spec) for k in value]
        return [p for k, s in items for p in type_problems(value[k], s, f"{where}.{k}" if where else k)]
    if isinstance(spec, ListOf):
        if not isinstance(value, list):
            return [f"{at} is {type_name(value)}, expected an array"]
        return [p for i, v in enumerate(value) for p in type_problems(v, spec.spec, f"{where}[{i}]")]
    if _is(value, spec):
        return []
    shown = f" ({json.dumps(value)[:40]})" if isinstance(value, (str, int, float)) else ""
    return [f"{at} is {type_name(value)}{shown}, expected {_expected(spec)}"]
