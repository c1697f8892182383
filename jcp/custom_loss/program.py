"""A checked graph as a bounded program: its steps run in order, each node's value held to
the bounds (an int outside int64, a built tuple over MAX_SEQUENCE entries, an array over
MAX_ELEMENTS is refused at its node), under `check`'s wall-clock deadline.
"""

from __future__ import annotations

import contextvars
import dataclasses
import math
import re
import time

from jcp.custom_loss.args import resolve
from jcp.custom_loss.limits import (
    CHECK_BUDGET_S,
    INT64_MAX,
    INT64_MIN,
    MAX_DATUM_ELEMENTS,
    MAX_ELEMENTS,
    MAX_SEQUENCE,
)
from jcp.custom_loss.ops import DType
from jcp.custom_loss.python_ops import ARRAYS
from jcp.errors import InputError

# The deadline of the `check` in progress (time.monotonic()); None while a checked loss is
# traced into a step.
DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "custom_loss_deadline", default=None
)


@dataclasses.dataclass(frozen=True, eq=False)
class Program:
    """A checked graph as fn(logprobs, *inputs) -> (loss, metrics): its steps in order,
    each value held to the bounds (_bounded) at its node, under `check`'s deadline."""

    placeholders: tuple[str, ...]
    steps: tuple  # (name, fn, args, kwargs, where)
    output: object

    def __call__(self, *values):
        deadline = DEADLINE.get()
        env = dict(zip(self.placeholders, values))
        elements = 0
        for name, fn, args, kwargs, where in self.steps:
            if deadline is not None and time.monotonic() > deadline:
                raise InputError(
                    f"{where}: evaluating the custom loss ran past its time "
                    f"budget ({CHECK_BUDGET_S} s per request)"
                )
            try:
                value = fn(*resolve(args, env), **resolve(kwargs, env))
            except InputError:
                raise
            except Exception as e:  # noqa: BLE001 — report the node, not a jax traceback
                raise InputError(f"{where}: {brief(e)}") from None
            elements += _bounded(value, where)
            if elements > MAX_DATUM_ELEMENTS:
                raise InputError(
                    f"{where}: the custom loss's arrays hold over "
                    f"{MAX_DATUM_ELEMENTS} elements for one datum"
                )
            env[name] = value
        loss, metrics = resolve(self.output, env)
        return loss, dict(metrics)


_PATH = re.compile(r"(?<![\w.])/(?:[\w.@+-]+/)+[\w.@+-]*(?::\d+)?")


def brief(e: Exception) -> str:
    """An error as one short line for the client: jax's messages run to many lines and
    name the server's files ("while tracing the function program at /…/custom_loss.py")."""
    text = str(e).split("The error occurred while tracing")[0]
    return f"{type(e).__name__}: " + _PATH.sub("<file>", " ".join(text.split()))[:300]


def _bounded(v, where: str) -> int:
    """The elements of a node's arrays; InputError naming the node if its value is out of
    bounds (an int outside int64, a tuple over MAX_SEQUENCE entries, an array over
    MAX_ELEMENTS, a value of a kind no allowed operation makes, such as a complex)."""
    if v is None or isinstance(v, (bool, float, DType)):
        return 0
    if isinstance(v, int):
        if not INT64_MIN <= v <= INT64_MAX:
            raise InputError(f"{where}: an integer result outside int64")
        return 0
    if isinstance(v, (tuple, list)):
        if len(v) > MAX_SEQUENCE:
            raise InputError(
                f"{where}: a {type(v).__name__} of {len(v)} entries; at most {MAX_SEQUENCE}"
            )
        return sum(_bounded(x, where) for x in v)
    if isinstance(v, ARRAYS):
        shape = tuple(v.shape)
        if math.prod(shape) > MAX_ELEMENTS or any(d > MAX_ELEMENTS for d in shape):
            raise InputError(
                f"{where}: an array of shape {list(shape)}, over {MAX_ELEMENTS} elements"
            )
        return math.prod(shape)
    raise InputError(f"{where}: a {type(v).__name__} value is not allowed in a custom loss")
