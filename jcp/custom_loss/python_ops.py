"""Python-level operations a graph may run on plain values (shape arithmetic, constants):
`operator.*` and `math.*`, each refusing before it runs what would cost more than a bounded
step (sequence repetition, string arithmetic, integers outside int64, an integer power
beyond int64). Tensors pass through to jax.numpy's own semantics.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jcp.custom_loss.limits import INT64_MAX, INT64_MIN, MAX_SEQUENCE

ARRAYS = (jax.Array, np.ndarray, np.generic)
COMPARE = frozenset({"eq", "ne", "gt", "ge", "lt", "le"})


def _pow(a, b):
    return (
        jnp.power(a, b)
        if isinstance(a, (jax.Array, np.ndarray)) or isinstance(b, (jax.Array, np.ndarray))
        else operator.pow(a, b)
    )


def python_op(name: str, op: Callable) -> Callable:
    """operator.<name>, refusing (before it runs) what would cost more than a bounded step
    on Python values: sequence repetition or string arithmetic, operands outside int64, an
    integer power beyond int64. Tensors pass through to jax.numpy's own semantics."""

    def fn(*args, **kwargs):
        if kwargs:
            raise TypeError(f"operator.{name} takes no keyword arguments")
        if any(isinstance(a, ARRAYS) for a in args):
            return op(*args)
        seqs = [a for a in args if isinstance(a, (str, bytes, list, tuple, dict))]
        if seqs and name not in COMPARE:
            if not (
                name == "add" and len(seqs) == 2 and all(isinstance(a, (list, tuple)) for a in seqs)
            ):
                raise TypeError(
                    f"operator.{name} on a {type(seqs[0]).__name__} (sequence "
                    "repetition or string arithmetic) is not allowed in a custom "
                    "loss"
                )
            if len(seqs[0]) + len(seqs[1]) > MAX_SEQUENCE:
                raise OverflowError(f"a concatenation over {MAX_SEQUENCE} entries")
        for a in args:
            if isinstance(a, int) and not INT64_MIN <= a <= INT64_MAX:
                raise OverflowError("an integer outside int64")
        if name == "pow" and all(isinstance(a, int) for a in args):
            base, exp = abs(args[0]), args[1]
            if base > 1 and exp > 0 and (base.bit_length() - 1) * exp > 63:
                raise OverflowError(f"an integer power beyond int64 ({args[0]} ** {exp})")
        return op(*args)

    return fn


# The `operator.*` and `math.*` call_function targets (FUNCTIONS holds them too).
OPERATORS: dict[str, Callable] = {
    f"operator.{k}": python_op(k, v)
    for k, v in {
        "add": operator.add,
        "sub": operator.sub,
        "mul": operator.mul,
        "truediv": operator.truediv,
        "floordiv": operator.floordiv,
        "mod": operator.mod,
        "pow": _pow,
        "neg": operator.neg,
        "pos": operator.pos,
        "abs": operator.abs,
        "matmul": operator.matmul,
        "eq": operator.eq,
        "ne": operator.ne,
        "gt": operator.gt,
        "ge": operator.ge,
        "lt": operator.lt,
        "le": operator.le,
        "and_": operator.and_,
        "or_": operator.or_,
        "xor": operator.xor,
        "invert": operator.invert,
    }.items()
}
MATH: dict[str, Callable] = {
    "math.exp": math.exp,
    "math.log": math.log,
    "math.sqrt": math.sqrt,
    "math.log1p": math.log1p,
    "math.expm1": math.expm1,
    "math.pow": math.pow,
    "math.tanh": math.tanh,
    "math.floor": math.floor,
    "math.ceil": math.ceil,
}
