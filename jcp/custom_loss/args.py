"""A graph node's encoded arguments (the SDK's JSON form: numbers, strings, lists and
{"ref" | "tuple" | "slice" | "dict" | "ellipsis" | "float" | "dtype": …}) decoded into values
with placeholders for earlier nodes (Ref, Tuple, Dict, Slice), bounded in nesting and
entries, and resolved against the values of the nodes when the program runs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from jcp.custom_loss.limits import INT64_MAX, INT64_MIN, MAX_LITERAL
from jcp.custom_loss.ops import DTYPES, DType
from jcp.errors import InputError


@dataclasses.dataclass(frozen=True)
class Ref:
    name: str


@dataclasses.dataclass(frozen=True)
class Tuple:
    items: tuple


@dataclasses.dataclass(frozen=True)
class Dict:
    items: tuple  # ((key, value), ...)


@dataclasses.dataclass(frozen=True)
class Slice:
    parts: tuple


_FLOATS = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


def decode(a, depth, refs, where, level=0):
    """An encoded argument -> a value with Ref / Tuple / Dict / Slice placeholders."""
    if level > 8:
        raise InputError(f"{where}: an argument nests deeper than 8 levels")
    if a is None or isinstance(a, (bool, int, float, str)):
        if isinstance(a, str) and len(a) > 256:
            raise InputError(f"{where}: a string argument is too long")
        if isinstance(a, int) and not INT64_MIN <= a <= INT64_MAX:
            raise InputError(f"{where}: an integer argument outside int64")
        return a
    if isinstance(a, list):
        if len(a) > MAX_LITERAL:
            raise InputError(f"{where}: a list argument has over {MAX_LITERAL} entries")
        return [decode(x, depth, refs, where, level + 1) for x in a]
    if not isinstance(a, Mapping) or len(a) != 1:
        raise InputError(f"{where}: argument {a!r:.80} is not an encoded value")
    ((kind, v),) = a.items()
    if kind == "ref":
        if v not in depth:
            raise InputError(f"{where}: refers to {v!r}, which is not an earlier node")
        refs.append(v)
        return Ref(v)
    if kind in ("tuple", "slice") and isinstance(v, list) and len(v) <= MAX_LITERAL:
        items = tuple(decode(x, depth, refs, where, level + 1) for x in v)
        if kind == "tuple":
            return Tuple(items)
        if len(items) != 3 or not all(x is None or isinstance(x, (int, Ref)) for x in items):
            raise InputError(f"{where}: a slice is [start, stop, step] of integers")
        return Slice(items)
    if kind == "dict" and isinstance(v, Mapping) and len(v) <= MAX_LITERAL:
        return Dict(tuple((str(k), decode(x, depth, refs, where, level + 1)) for k, x in v.items()))
    if kind == "ellipsis" and v is True:
        return Ellipsis
    if kind == "float" and v in _FLOATS:
        return _FLOATS[v]
    if kind == "dtype" and v in DTYPES:
        return DType(v)
    if kind in ("device", "layout", "memory_format") and isinstance(v, str):
        return None  # placement hints: meaningless here
    raise InputError(f"{where}: argument {{{kind!r}: {v!r:.60}}} is not allowed")


def resolve(a, env):
    if isinstance(a, Ref):
        return env[a.name]
    if isinstance(a, Tuple):
        return tuple(resolve(x, env) for x in a.items)
    if isinstance(a, Dict):
        return {k: resolve(x, env) for k, x in a.items}
    if isinstance(a, Slice):
        return slice(*(resolve(x, env) for x in a.parts))
    if isinstance(a, list):
        return [resolve(x, env) for x in a]
    if isinstance(a, dict):
        return {k: resolve(x, env) for k, x in a.items()}
    return a


def entries(a) -> int:
    """Literal entries of a decoded argument (what MAX_LITERALS counts)."""
    if isinstance(a, (list, tuple)):
        return len(a) + sum(entries(x) for x in a)
    if isinstance(a, (Tuple, Slice)):
        return entries(a.items if isinstance(a, Tuple) else a.parts)
    if isinstance(a, Dict):
        return entries([v for _, v in a.items])
    return 0
