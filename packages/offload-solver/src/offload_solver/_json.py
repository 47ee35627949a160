"""Reading and writing the solver's JSON documents, and sizes as users write them.

Every top-level record (``ModelProfile``, ``HardwareProfile``, ``CostModel``, ``Plan``)
writes :data:`SCHEMA_VERSION` and reads only that version; these helpers name the field at
fault in every error.
"""

from __future__ import annotations

import contextlib
import json
import math
import operator
import os
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import fields
from enum import Enum
from pathlib import Path
from typing import Any, TypeVar

SCHEMA_VERSION = 1
"""Version of the JSON documents written by ``to_json``; readers reject any other."""

_T = TypeVar("_T")


def to_jsonable(obj: object) -> Any:
    """``obj`` as JSON values: a dataclass as an object of its fields, an enum as its
    value, a tuple or list as a list."""
    if isinstance(obj, Enum):
        return obj.value
    if hasattr(obj, "__dataclass_fields__"):
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in fields(obj)}  # type: ignore[arg-type]
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(x) for x in obj]
    return obj


def load_document(text: str, kind: str) -> dict[str, Any]:
    """The JSON object in ``text``, a ``kind`` document of :data:`SCHEMA_VERSION`;
    ``ValueError`` naming ``kind`` otherwise."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{kind} JSON is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{kind} JSON must be an object, got {type(data).__name__}")
    version = data.get("schema_version")
    if version != SCHEMA_VERSION:
        raise ValueError(
            f"{kind} JSON has schema_version {version!r}; this solver reads version "
            f"{SCHEMA_VERSION}"
        )
    return data


_MISSING = object()


def get_field(data: Mapping[str, Any], key: str, typ: Any, default: Any = _MISSING) -> Any:
    """``data[key]``, which must be of type ``typ`` (a bool is no number); ``default``
    where the key is missing, ``ValueError`` without one."""
    if key not in data:
        if default is _MISSING:
            raise ValueError(f"JSON field {key!r} is missing")
        return default
    value = data[key]
    if (isinstance(value, bool) and typ is not bool) or not isinstance(value, typ):
        raise ValueError(f"JSON field {key!r} has type {type(value).__name__}, expected {typ}")
    return value


def str_list(value: object, where: str) -> list[str]:
    """``value`` as a list of strings; ``ValueError`` naming ``where`` otherwise."""
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"JSON field {where} must be a list of strings")
    return value


def record(cls: type[_T], value: object, where: str) -> _T:
    """Build dataclass ``cls`` from a JSON object, naming ``where`` in every error."""
    if not isinstance(value, dict):
        raise ValueError(f"JSON field {where} must be an object")
    names = {f.name: f for f in fields(cls)}  # type: ignore[arg-type]
    unknown = set(value) - set(names)
    if unknown:
        raise ValueError(f"JSON field {where} has unknown keys {sorted(unknown)}")
    kwargs: dict[str, Any] = {}
    for key, raw in value.items():
        kwargs[key] = tuple(raw) if isinstance(raw, list) else raw
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise ValueError(f"JSON field {where}: {exc}") from exc


def enum_value(cls: type[Enum], value: object, where: str) -> Any:
    """The member of ``cls`` whose value is ``value``; ``ValueError`` naming ``where`` and
    the allowed values otherwise."""
    try:
        return cls(value)
    except ValueError:
        allowed = ", ".join(repr(m.value) for m in cls)
        raise ValueError(f"JSON field {where} is {value!r}; expected one of {allowed}") from None


def parse_bytes(text: str) -> int:
    """Parse a size such as ``16GiB``, ``16GB``, ``512MiB`` or ``1000`` into bytes.

    ``GB``/``MB``/``KB`` are decimal (1e9...), ``GiB``/``MiB``/``KiB`` binary.
    """
    units = {
        "": 1,
        "b": 1,
        "kb": 10**3,
        "mb": 10**6,
        "gb": 10**9,
        "tb": 10**12,
        "kib": 2**10,
        "mib": 2**20,
        "gib": 2**30,
        "tib": 2**40,
    }
    s = text.strip().lower().replace(" ", "")
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(num) :]
    if unit not in units or not num:
        raise ValueError(f"cannot parse size {text!r}; write e.g. '16GiB', '16GB' or '512MiB'")
    try:
        value = float(num)
    except ValueError:
        raise ValueError(f"cannot parse size {text!r}; write e.g. '16GiB'") from None
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"size {text!r} is not a finite, non-negative number of bytes")
    return int(value * units[unit])


def write_atomic(path: Path, data: str | Callable[[Path], None]) -> None:
    """Write ``data`` to ``path`` through a temporary file in its folder and a rename, so
    that a reader, or another writer of the same path, never sees half a file. ``data``
    is text (UTF-8), or a function that writes the temporary file it is given (e.g.
    ``lambda tmp: torch.save(state, tmp)``)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            if isinstance(data, str):
                f.write(data)
        if callable(data):
            data(Path(tmp))  # the file exists, empty: the writer replaces its contents
        Path(tmp).replace(path)
    except BaseException:
        with contextlib.suppress(OSError):
            Path(tmp).unlink()
        raise


def check_numbers(obj: object, where: str) -> None:
    """Every number among dataclass ``obj``'s fields finite and >= 0 (a bool is no
    number); ``ValueError`` naming ``where.field`` otherwise. The solver's records hold
    counts, sizes, rates and times, none of which is negative, NaN or infinite."""
    for f in fields(obj):  # type: ignore[arg-type]
        value = getattr(obj, f.name)
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{where}.{f.name} is {value!r}; must be a finite number >= 0")


def as_bytes(value: object, what: str = "memory_budget") -> int:
    """``value`` as a positive whole number of bytes, rounded down: an int or any
    integer-like object (``__index__``: numpy integers), or a finite real number (float,
    numpy floats, ``Fraction``, ``Decimal``). Anything else, NaN, infinity, zero,
    negatives and values under one byte are a ``ValueError`` naming ``what``."""
    if isinstance(value, bool | str | bytes):
        raise ValueError(f"{what} must be a number of bytes, got {value!r}")
    out: int
    if hasattr(value, "__index__"):
        out = operator.index(value)
    else:
        try:
            number = float(value)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            raise ValueError(f"{what} must be a number of bytes, got {value!r}") from None
        if not math.isfinite(number):
            raise ValueError(f"{what} must be a finite number of bytes, got {value!r}")
        out = math.floor(number)
    if out <= 0:
        raise ValueError(f"{what} must be a positive number of bytes (at least 1), got {value!r}")
    return out
