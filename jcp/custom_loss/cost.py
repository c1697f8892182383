"""The cost model of a custom loss graph, at creation: every node typed (tensor, int with a
bound on its magnitude, float, shape, sequence) before any shape is known, and the integer
arithmetic that may leave int64 (a power with a large or computed exponent, long products),
sequence repetition and string arithmetic refused, naming the node.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from jcp.custom_loss.args import Ref, Tuple
from jcp.custom_loss.limits import INT64_MAX, INT64_MIN, SHAPE_BITS
from jcp.custom_loss.python_ops import COMPARE
from jcp.errors import InputError


@dataclasses.dataclass(frozen=True)
class Kind:
    """A node's value as the graph alone tells it, before any shape is known: what it is
    ("tensor", "int", "float", "shape", "seq", "str", "other") and, for an int, a bound
    |value| < 2**bits (None: unknown; the program's own checks hold it when it runs)."""

    what: str
    bits: int | None = None


TENSOR, _FLOAT, _SHAPE, _OTHER = (Kind("tensor"), Kind("float"), Kind("shape"), Kind("other"))
_DIM = Kind("int", SHAPE_BITS)  # a dimension, a rank or a number of elements
ATTRIBUTE_KINDS = {"shape": _SHAPE, "ndim": _DIM, "dtype": _OTHER}


def _too_big(where: str, what: str, bits) -> InputError:
    return InputError(
        f"{where}: {what} may reach 2**{bits}, beyond int64 (a custom loss's "
        "integers stay within int64; compute large values on tensors)"
    )


def _kind_of(a, kinds: Mapping[str, Kind]) -> Kind:
    if isinstance(a, Ref):
        return kinds[a.name]
    if isinstance(a, bool):
        return Kind("int", 1)
    if isinstance(a, int):
        return Kind("int", abs(a).bit_length())
    if isinstance(a, float):
        return _FLOAT
    if isinstance(a, str):
        return Kind("str")
    return Kind("seq") if isinstance(a, (list, Tuple)) else _OTHER


def node_kind(op, target, args, kwargs, kinds, where) -> Kind:
    """The cost model's kind of one node's value; InputError naming the node where what it
    computes could grow without bound (sequence repetition, an int beyond int64)."""
    if op == "placeholder":
        return TENSOR
    if target in ("operator.getitem", "__getitem__"):
        base = _kind_of(args[0], kinds) if args else _OTHER
        if base.what == "shape":  # x.shape[0] is a dimension, x.shape[1:] a shape
            index = _kind_of(args[1], kinds) if len(args) > 1 else _OTHER
            return _DIM if index.what == "int" else _SHAPE
        return TENSOR if base.what == "tensor" else _OTHER
    if op == "call_method":
        if target == "size":
            return _DIM if len(args) > 1 or "dim" in kwargs else _SHAPE
        return _DIM if target in ("dim", "numel") else TENSOR
    if target == "torch.numel":
        return _DIM
    if target.startswith("math."):
        if any(_kind_of(a, kinds).what == "tensor" for a in args):
            return _OTHER
        return Kind("int") if target in ("math.floor", "math.ceil") else _FLOAT
    if target.startswith("operator."):
        return _operator_kind(target.removeprefix("operator."), args, kinds, where)
    return TENSOR


def _operator_kind(name, args, kinds, where) -> Kind:
    ks = [_kind_of(a, kinds) for a in args]
    if not ks or len(ks) > 2 or (name == "pow" and len(ks) != 2):
        return _OTHER  # a wrong arity fails when it runs, naming the node
    if any(k.what == "tensor" for k in ks):
        return TENSOR
    if name in COMPARE:
        return Kind("int", 1)
    if any(k.what in ("shape", "seq", "str") for k in ks):
        if name == "add" and len(ks) == 2 and all(k.what in ("shape", "seq") for k in ks):
            return Kind("seq")  # a concatenation: at most MAX_SEQUENCE entries when it runs
        raise InputError(
            f"{where}: operator.{name} on a sequence or string (repetition, "
            "formatting) is not allowed in a custom loss; arithmetic takes "
            "tensors and numbers"
        )
    if not all(k.what in ("int", "float") for k in ks):
        return _OTHER
    if name == "truediv" or any(k.what == "float" for k in ks):
        return _FLOAT
    if name == "pow":
        return _power_kind(args, ks, where)
    bits = [k.bits for k in ks]
    if None in bits or name == "matmul":
        return Kind("int")
    a, b = bits[0], bits[-1]
    out = {
        "add": max(a, b) + 1,
        "sub": max(a, b) + 1,
        "mul": a + b,
        "floordiv": a,
        "mod": b,
        "neg": a,
        "pos": a,
        "abs": a,
        "invert": a + 1,
        "and_": max(a, b) + 1,
        "or_": max(a, b) + 1,
        "xor": max(a, b) + 1,
    }[name]
    if out > 63:
        raise _too_big(where, f"integer operator.{name}", out)
    return Kind("int", out)


def _power_kind(args, ks, where) -> Kind:
    """int ** int: bounded only when the exponent is; |b| < 2**bb, so |b**e| < 2**(bb·e)."""
    base, exp = args
    bb, be = ks[0].bits, ks[1].bits
    if isinstance(exp, int):  # a constant exponent
        if exp < 0:
            return _FLOAT
        if exp == 0:
            return Kind("int", 1)
        if isinstance(base, int):  # both constant: exact, once it is known to be small
            if abs(base) > 1 and (abs(base).bit_length() - 1) * exp > 63:
                raise _too_big(where, f"{base} ** {exp}", (abs(base).bit_length() - 1) * exp)
            value = base**exp
            if not INT64_MIN <= value <= INT64_MAX:
                raise _too_big(where, f"{base} ** {exp}", abs(value).bit_length())
            return Kind("int", abs(value).bit_length())
        if bb is not None and bb <= 1:
            return Kind("int", 1)
        bits = bb * exp if bb is not None else None
        if exp > 63 or (bits is not None and bits > 63):
            raise _too_big(where, f"an integer power (exponent {exp})", bits or exp)
        return Kind("int", bits)
    if isinstance(base, int) and abs(base) <= 1:
        return Kind("int", 1)
    if bb is not None and be is not None and be <= 6:  # |exp| < 2**be
        bits = max(bb, 1) * ((1 << be) - 1)
        if bits <= 63:
            return Kind("int", bits)
    raise InputError(
        f"{where}: an integer power with a computed exponent may leave int64 "
        "(a custom loss's integers stay within int64; use a constant exponent "
        "or a tensor)"
    )
