"""Custom per-datum losses: Tinker's traced graphs rebuilt as JAX functions, and JAX ones.

A custom loss is a per-datum function `fn(logprobs, *inputs) -> (loss, metrics)`: logprobs
is the datum's [N] (or [N, K] for 2-D target_tokens) target log-probs, each input one of
its loss_fn_inputs at a declared rank (0 scalar, 1 [N]-like, 2 [N, K]-like), loss a scalar
and metrics {"custom/<name>:sum" | ":mean": scalar}. The Trainer sums the datums' losses.

Owns the interpreter of the SDK's `CustomLossGraph` (torch.fx nodes as plain data: the
`placeholder / call_function / call_method / getattr / output` ops, targets such as
`torch.exp` or `operator.mul`, encoded arguments). Every operation a graph may use is an
entry of this module's own tables (FUNCTIONS, METHODS, ATTRIBUTES), mapped to jax.numpy
with torch's semantics (argument names, `dim`/`keepdim`, `max(dim)` -> (values,
indices), clamp's gradient at its bounds). It never evaluates, imports or looks up a name
a node carries: a name that is not a key of those tables is refused with an InputError
naming the node. Graphs are bounded in nodes, inputs and depth.

A graph comes from a client, and its Python-level values (shape arithmetic, constants) run
on the worker holding the GIL, so it evaluates bounded operations only. At creation a cost
model types every node (tensor, int with a bound on its magnitude, float, shape, sequence)
and refuses, naming the node, integer arithmetic that may leave int64 (a power with a large
or computed exponent, long products), sequence repetition and string arithmetic, integer
literals outside int64 and more than MAX_LITERALS literal entries. When it runs, the same
bounds hold on the values (an int outside int64, a built tuple over MAX_SEQUENCE entries, an
array over MAX_ELEMENTS is refused at its node), so no node costs more than a bounded step;
`check` runs under a wall-clock deadline (CHECK_BUDGET_S per request, batch.validate), and
a request traces at most MAX_TRACED_OPS graph operations (nodes × datums).

It is pure: no device state, no server imports; `check` evaluates shapes only
(jax.eval_shape), so a datum whose inputs do not fit the loss is refused before any
device work.
"""

from __future__ import annotations

import contextvars
import dataclasses
import math
import operator
import re
import time
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jcp.errors import InputError

MAX_NODES = 4096
MAX_INPUTS = 16  # logprobs included, as the SDK's tracer allows
MAX_DEPTH = 512
MAX_LITERAL = 1024  # entries of one encoded argument (lists, tuples, dicts)
MAX_LITERALS = 1 << 16  # entries of all of a graph's encoded arguments together
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1  # every Python int a graph holds
MAX_SEQUENCE = 64  # entries of a tuple or list a graph builds (shapes, concatenations)
MAX_ELEMENTS = 1 << 24  # elements of one node's array (a dimension is at most this too)
MAX_DATUM_ELEMENTS = 1 << 29  # elements of all of one datum's intermediate arrays
# A dimension, and so any shape-derived int, is below 2**SHAPE_BITS.
SHAPE_BITS = MAX_ELEMENTS.bit_length()
# Seconds of graph evaluation (shapes) while one request's datums are checked, and graph
# operations one request may trace into its step (the loss is traced once per datum); at
# about 50 µs per traced operation the two agree.
CHECK_BUDGET_S = 5.0
MAX_TRACED_OPS = 1 << 16
METRIC_KEY = re.compile(r"custom/[a-z0-9_./-]{1,64}:(sum|mean)")
INPUT_NAME = re.compile(r"[a-z_][a-z0-9_]{0,63}")

# torch dtype names a graph may pass (x.to(torch.float32), x.float(), dtype=...): floats
# compute in float32 (the device dtype), integers in int32.
DTYPES = {
    "float32": jnp.float32,
    "float": jnp.float32,
    "float64": jnp.float32,
    "double": jnp.float32,
    "float16": jnp.float32,
    "bfloat16": jnp.float32,
    "int64": jnp.int32,
    "long": jnp.int32,
    "int32": jnp.int32,
    "int": jnp.int32,
    "bool": jnp.bool_,
}


# ----------------------------------------------------------------------------------------
# torch semantics on jax.numpy


def _dims(dim):
    if dim is None:
        return None
    return tuple(dim) if isinstance(dim, (tuple, list)) else dim


def _dtype(dtype):
    if dtype is None:
        return None
    if isinstance(dtype, _DType):
        return dtype.jnp
    raise TypeError(f"expected a dtype, got {dtype!r}")


def _sum(x, dim=None, keepdim=False, *, dtype=None):
    return jnp.sum(jnp.asarray(x), axis=_dims(dim), keepdims=keepdim, dtype=_dtype(dtype))


def _mean(x, dim=None, keepdim=False, *, dtype=None):
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError("mean() needs a floating tensor (torch refuses integer means)")
    return jnp.mean(x, axis=_dims(dim), keepdims=keepdim, dtype=_dtype(dtype))


def _amax(x, dim=(), keepdim=False):
    return jnp.max(x, axis=None if dim == () else _dims(dim), keepdims=keepdim)


def _amin(x, dim=(), keepdim=False):
    return jnp.min(x, axis=None if dim == () else _dims(dim), keepdims=keepdim)


class MinMax(tuple):
    """torch.return_types.max / min: (values, indices)."""

    @property
    def values(self):
        return self[0]

    @property
    def indices(self):
        return self[1]


def _extremum(pick, arg, elementwise):
    def fn(x, dim=None, keepdim=False, *, other=None):
        if other is not None or isinstance(dim, (jax.Array, np.ndarray)):
            return elementwise(x, dim if other is None else other)
        if dim is None:
            return pick(x)
        values = pick(x, axis=dim, keepdims=keepdim)
        idx = arg(x, axis=dim, keepdims=keepdim).astype(jnp.int32)
        return MinMax((values, jax.lax.stop_gradient(idx)))

    return fn


def _clamp(x, min=None, max=None):  # noqa: A002 — torch's argument names
    # torch passes the gradient at the bounds (x == min or max): so does this.
    x = jnp.asarray(x)
    if min is not None:
        x = jnp.where(
            x < min, jnp.asarray(min, x.dtype) if not isinstance(min, jax.Array) else min, x
        )
    if max is not None:
        x = jnp.where(
            x > max, jnp.asarray(max, x.dtype) if not isinstance(max, jax.Array) else max, x
        )
    return x


def _logsumexp(x, dim, keepdim=False):
    return jax.nn.logsumexp(x, axis=_dims(dim), keepdims=keepdim)


def _cumsum(x, dim, *, dtype=None):
    return jnp.cumsum(x, axis=dim, dtype=_dtype(dtype))


def _softmax(x, dim, *, dtype=None, _stacklevel=None):
    return jax.nn.softmax(jnp.asarray(x, _dtype(dtype)), axis=dim)


def _log_softmax(x, dim, *, dtype=None, _stacklevel=None):
    return jax.nn.log_softmax(jnp.asarray(x, _dtype(dtype)), axis=dim)


def _reshape(x, *shape):
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        shape = tuple(shape[0])
    return jnp.reshape(x, shape)


def _squeeze(x, dim=None):
    x = jnp.asarray(x)
    if dim is None:
        return jnp.squeeze(x)
    dims = tuple(d % x.ndim for d in (dim if isinstance(dim, (tuple, list)) else (dim,)))
    return jnp.squeeze(x, tuple(d for d in dims if x.shape[d] == 1))  # torch: a no-op if ≠ 1


def _transpose(x, dim0, dim1):
    return jnp.swapaxes(x, dim0, dim1)


def _permute(x, *dims):
    if len(dims) == 1 and isinstance(dims[0], (tuple, list)):
        dims = tuple(dims[0])
    return jnp.transpose(x, dims)


def _t(x):
    return jnp.transpose(x)


def _flatten(x, start_dim=0, end_dim=-1):
    x = jnp.asarray(x)
    if x.ndim == 0:
        return x.reshape(1)
    s, e = start_dim % x.ndim, end_dim % x.ndim
    return x.reshape(x.shape[:s] + (-1,) + x.shape[e + 1 :])


def _where(cond, x=None, y=None):
    if x is None or y is None:
        raise TypeError("where(cond) without values has a data-dependent shape")
    return jnp.where(cond, x, y)


def _masked_fill(x, mask, value):
    return jnp.where(mask, jnp.asarray(value, jnp.asarray(x).dtype), x)


def _gather(x, dim, index):
    return jnp.take_along_axis(x, jnp.asarray(index, jnp.int32), axis=dim)


def _to(x, *args, dtype=None, **_ignored):
    # x.to(torch.float32), x.to(dtype=...), x.to("cpu"), x.to(other): the dtype matters only.
    for a in args:
        if isinstance(a, _DType):
            dtype = a
        elif isinstance(a, (jax.Array, np.ndarray)):
            dtype = _DType(str(a.dtype))
    return x if dtype is None else jnp.asarray(x).astype(_dtype(dtype))


def _cast(target):
    return lambda x, *a, **k: jnp.asarray(x).astype(target)


def _type(x, dtype=None):
    if dtype is None:
        raise TypeError("type() without a dtype returns a string")
    return jnp.asarray(x).astype(_dtype(dtype))


def _shape(x) -> tuple:
    if not isinstance(x, (bool, int, float, *_ARRAYS)):
        raise TypeError(f"a {type(x).__name__} has no shape")
    return tuple(jnp.shape(x))


def _size(x, dim=None):
    shape = _shape(x)
    return shape if dim is None else shape[dim]


def _full_like(x, fill_value, *, dtype=None, **_ignored):
    return jnp.full_like(x, fill_value, dtype=_dtype(dtype))


def _like(fill):
    return lambda x, *, dtype=None, **_ignored: jnp.full_like(x, fill, dtype=_dtype(dtype))


def _stack(tensors, dim=0):
    return jnp.stack(list(tensors), axis=dim)


def _cat(tensors, dim=0):
    return jnp.concatenate(list(tensors), axis=dim)


def _tensor(data, *, dtype=None, **_ignored):
    # torch.tensor(constant): scalars and lists of numbers only (graphs capture no arrays).
    if not isinstance(data, (int, float, bool, list, tuple)):
        raise TypeError("tensor() takes numbers only")
    return jnp.asarray(
        data,
        _dtype(dtype)
        or (
            jnp.float32
            if isinstance(data, float)
            or (isinstance(data, (list, tuple)) and any(isinstance(v, float) for v in data))
            else None
        ),
    )


def _expand(x, *sizes):
    if len(sizes) == 1 and isinstance(sizes[0], (tuple, list)):
        sizes = tuple(sizes[0])
    x = jnp.asarray(x)
    lead = len(sizes) - x.ndim
    shape = tuple(x.shape[i - lead] if s == -1 else s for i, s in enumerate(sizes))
    return jnp.broadcast_to(x, shape)


def _getitem(x, index):
    if isinstance(x, (tuple, list, MinMax)):
        return x[index]
    items = index if isinstance(index, tuple) else (index,)
    for it in items:
        if isinstance(it, (jax.Array, np.ndarray)) and jnp.asarray(it).dtype == jnp.bool_:
            raise TypeError(
                "indexing with a boolean tensor has a data-dependent shape; "
                "use torch.where(mask, x, 0) instead"
            )
    return jnp.asarray(x)[index]


def _binary(fn):
    return lambda a, b, *, alpha=None: fn(a, b if alpha is None else b * alpha)


def _div(a, b, *, rounding_mode=None):
    if rounding_mode is None:
        return jnp.true_divide(a, b)
    if rounding_mode == "floor":
        return jnp.floor_divide(a, b)
    if rounding_mode == "trunc":
        return jnp.trunc(jnp.true_divide(a, b))
    raise TypeError(f"rounding_mode {rounding_mode!r}")


def _pow(a, b):
    return (
        jnp.power(a, b)
        if isinstance(a, (jax.Array, np.ndarray)) or isinstance(b, (jax.Array, np.ndarray))
        else operator.pow(a, b)
    )


_ARRAYS = (jax.Array, np.ndarray, np.generic)
_COMPARE = frozenset({"eq", "ne", "gt", "ge", "lt", "le"})


def _python_op(name: str, op: Callable) -> Callable:
    """operator.<name>, refusing (before it runs) what would cost more than a bounded step
    on Python values: sequence repetition or string arithmetic, operands outside int64, an
    integer power beyond int64. Tensors pass through to jax.numpy's own semantics."""

    def fn(*args, **kwargs):
        if kwargs:
            raise TypeError(f"operator.{name} takes no keyword arguments")
        if any(isinstance(a, _ARRAYS) for a in args):
            return op(*args)
        seqs = [a for a in args if isinstance(a, (str, bytes, list, tuple, dict))]
        if seqs and name not in _COMPARE:
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


def _scalar_or(jfn, pyfn):
    """A function on tensors, or on Python numbers (shape arithmetic: math.sqrt(n))."""
    return lambda x, *a: (
        pyfn(x, *a) if isinstance(x, (int, float)) and not isinstance(x, bool) else jfn(x, *a)
    )


def _softplus(x, beta=1.0, threshold=20.0):
    # torch: linear above threshold / beta.
    bx = x * beta
    return jnp.where(bx > threshold, x, jax.nn.softplus(bx) / beta)


def _numel(x):
    return int(np.prod(_shape(x), dtype=np.int64))


def _dim(x):
    return len(_shape(x))


def _detach(x):
    return jax.lax.stop_gradient(x)


def _nan_to_num(x, nan=0.0, posinf=None, neginf=None):
    return jnp.nan_to_num(x, nan=nan, posinf=posinf, neginf=neginf)


_ELEMENTWISE = {
    "exp": jnp.exp,
    "log": jnp.log,
    "log1p": jnp.log1p,
    "expm1": jnp.expm1,
    "log2": jnp.log2,
    "log10": jnp.log10,
    "exp2": jnp.exp2,
    "sigmoid": jax.nn.sigmoid,
    "tanh": jnp.tanh,
    "abs": jnp.abs,
    "sqrt": jnp.sqrt,
    "rsqrt": jax.lax.rsqrt,
    "square": jnp.square,
    "sign": jnp.sign,
    "neg": jnp.negative,
    "negative": jnp.negative,
    "relu": jax.nn.relu,
    "floor": jnp.floor,
    "ceil": jnp.ceil,
    "round": jnp.round,
    "trunc": jnp.trunc,
    "reciprocal": jnp.reciprocal,
    "isfinite": jnp.isfinite,
    "isnan": jnp.isnan,
    "isinf": jnp.isinf,
    "logical_not": jnp.logical_not,
    "logsigmoid": jax.nn.log_sigmoid,
    "log_sigmoid": jax.nn.log_sigmoid,
    "softplus": _softplus,
    "nan_to_num": _nan_to_num,
    "detach": _detach,
}
_BINARY = {
    "add": _binary(jnp.add),
    "sub": _binary(jnp.subtract),
    "subtract": _binary(jnp.subtract),
    "mul": jnp.multiply,
    "multiply": jnp.multiply,
    "div": _div,
    "divide": _div,
    "true_divide": jnp.true_divide,
    "floor_divide": jnp.floor_divide,
    "pow": jnp.power,
    "minimum": jnp.minimum,
    "maximum": jnp.maximum,
    "fmin": jnp.fmin,
    "fmax": jnp.fmax,
    "eq": jnp.equal,
    "ne": jnp.not_equal,
    "gt": jnp.greater,
    "ge": jnp.greater_equal,
    "lt": jnp.less,
    "le": jnp.less_equal,
    "logical_and": jnp.logical_and,
    "logical_or": jnp.logical_or,
    "logical_xor": jnp.logical_xor,
    "remainder": jnp.remainder,
    "fmod": jnp.fmod,
    "matmul": jnp.matmul,
}
_SHARED = {
    "sum": _sum,
    "mean": _mean,
    "amax": _amax,
    "amin": _amin,
    "max": _extremum(jnp.max, jnp.argmax, jnp.maximum),
    "min": _extremum(jnp.min, jnp.argmin, jnp.minimum),
    "logsumexp": _logsumexp,
    "cumsum": _cumsum,
    "clamp": _clamp,
    "clip": _clamp,
    "clamp_min": lambda x, min: _clamp(x, min=min),  # noqa: A006
    "clamp_max": lambda x, max: _clamp(x, max=max),  # noqa: A006
    "where": _where,
    "softmax": _softmax,
    "log_softmax": _log_softmax,
    "reshape": _reshape,
    "squeeze": _squeeze,
    "unsqueeze": lambda x, dim: jnp.expand_dims(x, dim),
    "transpose": _transpose,
    "permute": _permute,
    "flatten": _flatten,
    "gather": _gather,
    "masked_fill": _masked_fill,
    "prod": lambda x, dim=None, keepdim=False, *, dtype=None: jnp.prod(
        x, axis=dim, keepdims=keepdim, dtype=_dtype(dtype)
    ),
    "argmax": lambda x, dim=None, keepdim=False: jnp.argmax(x, axis=dim, keepdims=keepdim).astype(
        jnp.int32
    ),
    "argmin": lambda x, dim=None, keepdim=False: jnp.argmin(x, axis=dim, keepdims=keepdim).astype(
        jnp.int32
    ),
    "any": lambda x, dim=None, keepdim=False: jnp.any(x, axis=dim, keepdims=keepdim),
    "all": lambda x, dim=None, keepdim=False: jnp.all(x, axis=dim, keepdims=keepdim),
    "var": lambda x, dim=None, *, correction=1, keepdim=False: jnp.var(
        x, axis=_dims(dim), ddof=correction, keepdims=keepdim
    ),
    "std": lambda x, dim=None, *, correction=1, keepdim=False: jnp.std(
        x, axis=_dims(dim), ddof=correction, keepdims=keepdim
    ),
    "norm": lambda x, p=2, dim=None, keepdim=False: jnp.linalg.norm(
        x, ord=p, axis=_dims(dim), keepdims=keepdim
    ),
    "dot": jnp.dot,
}

# call_function targets, by the qualified name the SDK encodes (operator.*, torch.*, math.*,
# getattr). Anything else is refused.
FUNCTIONS: dict[str, Callable] = {
    **{
        f"operator.{k}": _python_op(k, v)
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
    },
    "operator.getitem": _getitem,
    "math.exp": math.exp,
    "math.log": math.log,
    "math.sqrt": math.sqrt,
    "math.log1p": math.log1p,
    "math.expm1": math.expm1,
    "math.pow": math.pow,
    "math.tanh": math.tanh,
    "math.floor": math.floor,
    "math.ceil": math.ceil,
    "torch.zeros_like": _like(0),
    "torch.ones_like": _like(1),
    "torch.full_like": _full_like,
    "torch.stack": _stack,
    "torch.cat": _cat,
    "torch.concat": _cat,
    "torch.tensor": _tensor,
    "torch.numel": _numel,
    "torch.nn.functional.softplus": _softplus,
    "torch._C._nn.softplus": _softplus,
    "torch.nn.functional.logsigmoid": jax.nn.log_sigmoid,
    "torch._C._nn.log_sigmoid": jax.nn.log_sigmoid,
    "torch.nn.functional.relu": jax.nn.relu,
    "torch.nn.functional.sigmoid": jax.nn.sigmoid,
    "torch.nn.functional.softmax": _softmax,
    "torch.nn.functional.log_softmax": _log_softmax,
    "torch.nn.functional.tanh": jnp.tanh,
    **{f"torch.{k}": v for k, v in {**_ELEMENTWISE, **_BINARY, **_SHARED}.items()},
}
# call_method targets (tensor methods).
METHODS: dict[str, Callable] = {
    **_ELEMENTWISE,
    **_BINARY,
    **_SHARED,
    "view": _reshape,
    "view_as": lambda x, other: jnp.reshape(x, _shape(other)),
    "reshape_as": lambda x, other: jnp.reshape(x, _shape(other)),
    "expand": _expand,
    "expand_as": lambda x, o: jnp.broadcast_to(x, _shape(o)),
    "t": _t,
    "to": _to,
    "type": _type,
    "float": _cast(jnp.float32),
    "double": _cast(jnp.float32),
    "half": _cast(jnp.float32),
    "bfloat16": _cast(jnp.float32),
    "long": _cast(jnp.int32),
    "int": _cast(jnp.int32),
    "bool": _cast(jnp.bool_),
    "size": _size,
    "dim": _dim,
    "numel": _numel,
    "contiguous": lambda x, *a, **k: x,
    "clone": lambda x, *a, **k: x,
    "type_as": lambda x, o: jnp.asarray(x).astype(jnp.asarray(o).dtype),
    "__getitem__": _getitem,
}
# getattr targets (a node reads an attribute of a value).
ATTRIBUTES = {
    "shape": _shape,
    "ndim": lambda x: len(_shape(x)),
    "T": _t,
    "values": lambda x: x.values if isinstance(x, MinMax) else _no_attr(x, "values"),
    "indices": lambda x: x.indices if isinstance(x, MinMax) else _no_attr(x, "indices"),
    "dtype": lambda x: _DType(str(jnp.asarray(x).dtype)),
}


def _no_attr(x, name):
    raise TypeError(f"{type(x).__name__} has no attribute {name!r}")


@dataclasses.dataclass(frozen=True)
class _DType:
    """A torch dtype constant ({"dtype": "float32"}), mapped to jcp's device dtypes."""

    name: str

    @property
    def jnp(self):
        return DTYPES[self.name]


# ----------------------------------------------------------------------------------------
# The graph


@dataclasses.dataclass(frozen=True, eq=False)
class CustomLoss:
    """A per-datum loss: fn(logprobs, *inputs) -> (scalar loss, {metric: scalar}).

    inputs: ((name, rank), ...) with ("logprobs", 1 | 2) first, then the loss_fn_inputs
    the loss reads in the order fn takes them (rank 0, 1 or 2). Compared by identity (a
    compiled step is cached per CustomLoss object). Build one from a JAX function with
    `CustomLoss.from_function`, or from the SDK's graph with `from_graph`.
    """

    name: str
    inputs: tuple[tuple[str, int], ...]
    fn: Callable = dataclasses.field(repr=False)

    @property
    def input_names(self) -> tuple[str, ...]:
        """The loss_fn_inputs it reads (logprobs excluded)."""
        return tuple(n for n, _ in self.inputs[1:])

    @property
    def logprobs_rank(self) -> int:
        return self.inputs[0][1]

    @property
    def ops(self) -> int | None:
        """A graph loss's operations (traced once per datum); None for a JAX function."""
        return len(self.fn.steps) if isinstance(self.fn, _Program) else None

    @classmethod
    def from_function(
        cls, fn: Callable, input_ranks: Mapping[str, int], name: str | None = None
    ) -> CustomLoss:
        """A JAX per-datum function fn(logprobs, *inputs) -> (loss, metrics); input_ranks
        maps "logprobs" and each other input (in fn's order, as given) to its rank."""
        if not callable(fn):
            raise InputError(f"custom loss: expected a function, got {type(fn).__name__}")
        return cls(
            name or getattr(fn, "__name__", "custom"),
            _check_inputs([{"name": k, "rank": v} for k, v in dict(input_ranks).items()]),
            fn,
        )

    @classmethod
    def from_graph(
        cls, graph: Mapping, inputs: Sequence[Mapping], name: str = "custom"
    ) -> CustomLoss:
        """Rebuild a CustomLossGraph (its JSON form: {"format": 1, "nodes": [...]}) with
        `inputs` [{"name", "rank"}, ...] (logprobs first) -> CustomLoss, or InputError
        naming the node that is not allowed or malformed."""
        checked = _check_inputs(inputs)
        program = _compile(graph, [n for n, _ in checked])
        return cls(str(name)[:128], checked, program)

    def check(
        self,
        i: int,
        lp_shape: tuple[int, ...],
        values: Mapping[str, np.ndarray],
        deadline: float | None = None,
    ) -> None:
        """InputError naming datum i unless the loss evaluates on these shapes to a scalar
        loss and scalar custom/… metrics (shapes only; no device work). A graph loss that
        is still evaluating at `deadline` (time.monotonic()) is refused at the node it
        reached."""
        if len(lp_shape) != self.logprobs_rank:
            raise InputError(
                f"datum {i}: loss_fn_inputs.target_tokens has rank {len(lp_shape)}, but "
                f"custom loss {self.name!r} declared logprobs with rank {self.logprobs_rank}"
            )
        args = [jax.ShapeDtypeStruct(lp_shape, jnp.float32)]
        for name, rank in self.inputs[1:]:
            v = values[name]
            if v.ndim != rank:
                raise InputError(
                    f"datum {i}: loss_fn_inputs.{name} has rank {v.ndim}, but "
                    f"custom loss {self.name!r} declared it with rank {rank}"
                )
            args.append(jax.ShapeDtypeStruct(v.shape, v.dtype))
        token = _DEADLINE.set(deadline)
        try:
            loss, metrics = jax.eval_shape(self.fn, *args)
        except InputError as e:
            raise InputError(f"datum {i}: {e}") from None
        except Exception as e:  # noqa: BLE001 — any failure on these shapes is the input's
            raise InputError(
                f"datum {i}: custom loss {self.name!r} fails on its inputs "
                f"(logprobs {lp_shape}, "
                + ", ".join(f"{n} {values[n].shape}" for n in self.input_names)
                + f"): {_brief(e)}"
            ) from None
        finally:
            _DEADLINE.reset(token)
        if tuple(getattr(loss, "shape", (None,))) != ():
            raise InputError(
                f"datum {i}: custom loss {self.name!r} must return a scalar loss, "
                f"got shape {getattr(loss, 'shape', type(loss).__name__)}"
            )
        if not isinstance(metrics, Mapping):
            raise InputError(f"custom loss {self.name!r} must return (loss, metrics dict)")
        for key, m in metrics.items():
            if not (isinstance(key, str) and METRIC_KEY.fullmatch(key)):
                raise InputError(
                    f"custom loss {self.name!r}: metric {key!r} must be named "
                    "custom/<name>:sum or custom/<name>:mean"
                )
            if tuple(getattr(m, "shape", (None,))) != ():
                raise InputError(
                    f"datum {i}: custom loss {self.name!r} metric {key!r} must "
                    f"be a scalar, got shape {getattr(m, 'shape', None)}"
                )

    def __call__(self, logprobs, *inputs):
        loss, metrics = self.fn(logprobs, *inputs)
        return (
            jnp.asarray(loss, jnp.float32),
            {k: jnp.asarray(v, jnp.float32) for k, v in metrics.items()},
        )


def _check_inputs(inputs) -> tuple[tuple[str, int], ...]:
    if not isinstance(inputs, Sequence) or not inputs:
        raise InputError("custom loss: inputs must be a non-empty list, logprobs first")
    if len(inputs) > MAX_INPUTS:
        raise InputError(
            f"custom loss: {len(inputs)} inputs; at most {MAX_INPUTS}, logprobs included"
        )
    out = []
    for j, x in enumerate(inputs):
        if not isinstance(x, Mapping):
            raise InputError(f"custom loss: inputs[{j}] must be {{name, rank}}")
        name, rank = x.get("name"), x.get("rank")
        if not isinstance(name, str) or not INPUT_NAME.fullmatch(name):
            raise InputError(f"custom loss: inputs[{j}].name {name!r} is not a lowercase name")
        if isinstance(rank, bool) or rank not in (0, 1, 2):
            raise InputError(
                f"custom loss: inputs[{j}] ({name}) rank must be 0, 1 or 2, got {rank!r}"
            )
        if name == "target_tokens":
            raise InputError("custom loss: target_tokens is not an input (logprobs has its shape)")
        out.append((name, int(rank)))
    if out[0][0] != "logprobs" or out[0][1] == 0:
        raise InputError("custom loss: the first input must be logprobs, of rank 1 or 2")
    names = [n for n, _ in out]
    if len(set(names)) != len(names):
        raise InputError(f"custom loss: input names repeat: {names}")
    return tuple(out)


def _compile(graph, input_names: list[str]) -> Callable:
    """The graph checked and turned into fn(logprobs, *inputs); InputError on anything not
    allowed, naming the node."""
    if not isinstance(graph, Mapping) or not isinstance(graph.get("nodes"), list):
        raise InputError("custom loss graph must be {format: 1, nodes: [...]}")
    if graph.get("format", 1) != 1:
        raise InputError(f"custom loss graph format {graph.get('format')!r} is not 1")
    nodes = graph["nodes"]
    if not nodes:
        raise InputError("custom loss graph has no nodes")
    if len(nodes) > MAX_NODES:
        raise InputError(f"custom loss graph has {len(nodes)} nodes; at most {MAX_NODES}")
    depth: dict[str, int] = {}
    kinds: dict[str, _Kind] = {}  # the cost model's view of each node's value
    literals = 0
    steps = []  # (name, callable, args, kwargs, where) in order
    placeholders = []
    output = None
    for j, node in enumerate(nodes):
        if not isinstance(node, Mapping):
            raise InputError(f"custom loss graph: nodes[{j}] is not an object")
        op, name, target = node.get("op"), node.get("name"), node.get("target")
        where = f"custom loss graph: node {j} ({name!r}"
        if not isinstance(name, str) or not name or len(name) > 128 or name in depth:
            raise InputError(f"{where}): name must be a unique string")
        if not isinstance(target, str) or len(target) > 256:
            raise InputError(f"{where}): target must be a string")
        where = f"{where}, {op} {target!r})"
        if output is not None:
            raise InputError(f"{where}: follows the output node")
        args, kwargs = node.get("args", []), node.get("kwargs", {})
        if not isinstance(args, list) or not isinstance(kwargs, Mapping):
            raise InputError(f"{where}: args must be a list and kwargs an object")
        refs: list[str] = []
        args = [_decode(a, depth, refs, where) for a in args]
        kwargs = {str(k): _decode(v, depth, refs, where) for k, v in kwargs.items()}
        literals += _entries(args) + _entries(list(kwargs.values()))
        if literals > MAX_LITERALS:
            raise InputError(
                f"{where}: the graph's arguments hold over {MAX_LITERALS} literal entries"
            )
        d = 1 + max((depth[r] for r in refs), default=0)
        if d > MAX_DEPTH:
            raise InputError(f"{where}: the graph is deeper than {MAX_DEPTH} operations")
        if op == "placeholder":
            if (
                steps
                or len(placeholders) >= len(input_names)
                or (target != input_names[len(placeholders)])
            ):
                raise InputError(
                    f"{where}: placeholders must be the declared inputs {input_names} in order"
                )
            placeholders.append(name)
        elif op == "call_function":
            fn = FUNCTIONS.get(target)
            if target == "getattr":
                if (
                    len(args) != 2
                    or kwargs
                    or not isinstance(args[1], str)
                    or args[1] not in ATTRIBUTES
                ):
                    raise InputError(
                        f"{where}: reads attribute "
                        f"{args[1] if len(args) > 1 else None!r}; allowed: "
                        f"{sorted(ATTRIBUTES)}"
                    )
                kinds[name] = _ATTRIBUTE_KINDS.get(args[1], _TENSOR)
                fn, args = ATTRIBUTES[args[1]], args[:1]
            if fn is None:
                raise InputError(f"{where}: {target!r} is not an allowed function of a custom loss")
            steps.append((name, fn, args, kwargs, where))
        elif op == "call_method":
            fn = METHODS.get(target)
            if fn is None:
                raise InputError(
                    f"{where}: tensor method {target!r} is not allowed in a custom loss"
                )
            if not args:
                raise InputError(f"{where}: a method call needs its tensor")
            steps.append((name, fn, args, kwargs, where))
        elif op == "output":
            if len(args) != 1 or kwargs:
                raise InputError(f"{where}: the output node has one argument")
            output = args[0]
        else:
            raise InputError(
                f"{where}: op {op!r} is not allowed in a custom loss (only "
                "placeholder, call_function, call_method, output)"
            )
        if op != "output" and name not in kinds:
            kinds[name] = _node_kind(op, target, args, kwargs, kinds, where)
        depth[name] = d
    if len(placeholders) != len(input_names):
        raise InputError(
            f"custom loss graph reads {len(placeholders)} inputs, declared "
            f"{len(input_names)} ({input_names})"
        )
    if output is None:
        raise InputError("custom loss graph has no output node")
    if not (
        isinstance(output, _Tuple) and len(output.items) == 2 and isinstance(output.items[1], _Dict)
    ):
        raise InputError("custom loss graph must return (loss, metrics dict)")

    return _Program(tuple(placeholders), tuple(steps), output)


@dataclasses.dataclass(frozen=True)
class _Ref:
    name: str


@dataclasses.dataclass(frozen=True)
class _Tuple:
    items: tuple


@dataclasses.dataclass(frozen=True)
class _Dict:
    items: tuple  # ((key, value), ...)


@dataclasses.dataclass(frozen=True)
class _Slice:
    parts: tuple


_FLOATS = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


def _decode(a, depth, refs, where, level=0):
    """An encoded argument -> a value with _Ref / _Tuple / _Dict / _Slice placeholders."""
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
        return [_decode(x, depth, refs, where, level + 1) for x in a]
    if not isinstance(a, Mapping) or len(a) != 1:
        raise InputError(f"{where}: argument {a!r:.80} is not an encoded value")
    ((kind, v),) = a.items()
    if kind == "ref":
        if v not in depth:
            raise InputError(f"{where}: refers to {v!r}, which is not an earlier node")
        refs.append(v)
        return _Ref(v)
    if kind in ("tuple", "slice") and isinstance(v, list) and len(v) <= MAX_LITERAL:
        items = tuple(_decode(x, depth, refs, where, level + 1) for x in v)
        if kind == "tuple":
            return _Tuple(items)
        if len(items) != 3 or not all(x is None or isinstance(x, (int, _Ref)) for x in items):
            raise InputError(f"{where}: a slice is [start, stop, step] of integers")
        return _Slice(items)
    if kind == "dict" and isinstance(v, Mapping) and len(v) <= MAX_LITERAL:
        return _Dict(
            tuple((str(k), _decode(x, depth, refs, where, level + 1)) for k, x in v.items())
        )
    if kind == "ellipsis" and v is True:
        return Ellipsis
    if kind == "float" and v in _FLOATS:
        return _FLOATS[v]
    if kind == "dtype" and v in DTYPES:
        return _DType(v)
    if kind in ("device", "layout", "memory_format") and isinstance(v, str):
        return None  # placement hints: meaningless here
    raise InputError(f"{where}: argument {{{kind!r}: {v!r:.60}}} is not allowed")


def _resolve(a, env):
    if isinstance(a, _Ref):
        return env[a.name]
    if isinstance(a, _Tuple):
        return tuple(_resolve(x, env) for x in a.items)
    if isinstance(a, _Dict):
        return {k: _resolve(x, env) for k, x in a.items}
    if isinstance(a, _Slice):
        return slice(*(_resolve(x, env) for x in a.parts))
    if isinstance(a, list):
        return [_resolve(x, env) for x in a]
    if isinstance(a, dict):
        return {k: _resolve(x, env) for k, x in a.items()}
    return a


# ----------------------------------------------------------------------------------------
# The cost model (at creation) and the bounded program (when it runs)


@dataclasses.dataclass(frozen=True)
class _Kind:
    """A node's value as the graph alone tells it, before any shape is known: what it is
    ("tensor", "int", "float", "shape", "seq", "str", "other") and, for an int, a bound
    |value| < 2**bits (None: unknown; the program's own checks hold it when it runs)."""

    what: str
    bits: int | None = None


_TENSOR, _FLOAT, _SHAPE, _OTHER = (_Kind("tensor"), _Kind("float"), _Kind("shape"), _Kind("other"))
_DIM = _Kind("int", SHAPE_BITS)  # a dimension, a rank or a number of elements
_ATTRIBUTE_KINDS = {"shape": _SHAPE, "ndim": _DIM, "dtype": _OTHER}


def _too_big(where: str, what: str, bits) -> InputError:
    return InputError(
        f"{where}: {what} may reach 2**{bits}, beyond int64 (a custom loss's "
        "integers stay within int64; compute large values on tensors)"
    )


def _kind_of(a, kinds: Mapping[str, _Kind]) -> _Kind:
    if isinstance(a, _Ref):
        return kinds[a.name]
    if isinstance(a, bool):
        return _Kind("int", 1)
    if isinstance(a, int):
        return _Kind("int", abs(a).bit_length())
    if isinstance(a, float):
        return _FLOAT
    if isinstance(a, str):
        return _Kind("str")
    return _Kind("seq") if isinstance(a, (list, _Tuple)) else _OTHER


def _node_kind(op, target, args, kwargs, kinds, where) -> _Kind:
    """The cost model's kind of one node's value; InputError naming the node where what it
    computes could grow without bound (sequence repetition, an int beyond int64)."""
    if op == "placeholder":
        return _TENSOR
    if target in ("operator.getitem", "__getitem__"):
        base = _kind_of(args[0], kinds) if args else _OTHER
        if base.what == "shape":  # x.shape[0] is a dimension, x.shape[1:] a shape
            index = _kind_of(args[1], kinds) if len(args) > 1 else _OTHER
            return _DIM if index.what == "int" else _SHAPE
        return _TENSOR if base.what == "tensor" else _OTHER
    if op == "call_method":
        if target == "size":
            return _DIM if len(args) > 1 or "dim" in kwargs else _SHAPE
        return _DIM if target in ("dim", "numel") else _TENSOR
    if target == "torch.numel":
        return _DIM
    if target.startswith("math."):
        if any(_kind_of(a, kinds).what == "tensor" for a in args):
            return _OTHER
        return _Kind("int") if target in ("math.floor", "math.ceil") else _FLOAT
    if target.startswith("operator."):
        return _operator_kind(target.removeprefix("operator."), args, kinds, where)
    return _TENSOR


def _operator_kind(name, args, kinds, where) -> _Kind:
    ks = [_kind_of(a, kinds) for a in args]
    if not ks or len(ks) > 2 or (name == "pow" and len(ks) != 2):
        return _OTHER  # a wrong arity fails when it runs, naming the node
    if any(k.what == "tensor" for k in ks):
        return _TENSOR
    if name in _COMPARE:
        return _Kind("int", 1)
    if any(k.what in ("shape", "seq", "str") for k in ks):
        if name == "add" and len(ks) == 2 and all(k.what in ("shape", "seq") for k in ks):
            return _Kind("seq")  # a concatenation: at most MAX_SEQUENCE entries when it runs
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
        return _Kind("int")
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
    return _Kind("int", out)


def _power_kind(args, ks, where) -> _Kind:
    """int ** int: bounded only when the exponent is; |b| < 2**bb, so |b**e| < 2**(bb·e)."""
    base, exp = args
    bb, be = ks[0].bits, ks[1].bits
    if isinstance(exp, int):  # a constant exponent
        if exp < 0:
            return _FLOAT
        if exp == 0:
            return _Kind("int", 1)
        if isinstance(base, int):  # both constant: exact, once it is known to be small
            if abs(base) > 1 and (abs(base).bit_length() - 1) * exp > 63:
                raise _too_big(where, f"{base} ** {exp}", (abs(base).bit_length() - 1) * exp)
            value = base**exp
            if not INT64_MIN <= value <= INT64_MAX:
                raise _too_big(where, f"{base} ** {exp}", abs(value).bit_length())
            return _Kind("int", abs(value).bit_length())
        if bb is not None and bb <= 1:
            return _Kind("int", 1)
        bits = bb * exp if bb is not None else None
        if exp > 63 or (bits is not None and bits > 63):
            raise _too_big(where, f"an integer power (exponent {exp})", bits or exp)
        return _Kind("int", bits)
    if isinstance(base, int) and abs(base) <= 1:
        return _Kind("int", 1)
    if bb is not None and be is not None and be <= 6:  # |exp| < 2**be
        bits = max(bb, 1) * ((1 << be) - 1)
        if bits <= 63:
            return _Kind("int", bits)
    raise InputError(
        f"{where}: an integer power with a computed exponent may leave int64 "
        "(a custom loss's integers stay within int64; use a constant exponent "
        "or a tensor)"
    )


def _entries(a) -> int:
    """Literal entries of a decoded argument (what MAX_LITERALS counts)."""
    if isinstance(a, (list, tuple)):
        return len(a) + sum(_entries(x) for x in a)
    if isinstance(a, (_Tuple, _Slice)):
        return _entries(a.items if isinstance(a, _Tuple) else a.parts)
    if isinstance(a, _Dict):
        return _entries([v for _, v in a.items])
    return 0


# The deadline of the `check` in progress (time.monotonic()); None while a checked loss is
# traced into a step.
_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "custom_loss_deadline", default=None
)


@dataclasses.dataclass(frozen=True, eq=False)
class _Program:
    """A checked graph as fn(logprobs, *inputs) -> (loss, metrics): its steps in order,
    each value held to the bounds (_bounded) at its node, under `check`'s deadline."""

    placeholders: tuple[str, ...]
    steps: tuple  # (name, fn, args, kwargs, where)
    output: object

    def __call__(self, *values):
        deadline = _DEADLINE.get()
        env = dict(zip(self.placeholders, values))
        elements = 0
        for name, fn, args, kwargs, where in self.steps:
            if deadline is not None and time.monotonic() > deadline:
                raise InputError(
                    f"{where}: evaluating the custom loss ran past its time "
                    f"budget ({CHECK_BUDGET_S} s per request)"
                )
            try:
                value = fn(*_resolve(args, env), **_resolve(kwargs, env))
            except InputError:
                raise
            except Exception as e:  # noqa: BLE001 — report the node, not a jax traceback
                raise InputError(f"{where}: {_brief(e)}") from None
            elements += _bounded(value, where)
            if elements > MAX_DATUM_ELEMENTS:
                raise InputError(
                    f"{where}: the custom loss's arrays hold over "
                    f"{MAX_DATUM_ELEMENTS} elements for one datum"
                )
            env[name] = value
        loss, metrics = _resolve(self.output, env)
        return loss, dict(metrics)


_PATH = re.compile(r"(?<![\w.])/(?:[\w.@+-]+/)+[\w.@+-]*(?::\d+)?")


def _brief(e: Exception) -> str:
    """An error as one short line for the client: jax's messages run to many lines and
    name the server's files ("while tracing the function program at /…/custom_loss.py")."""
    text = str(e).split("The error occurred while tracing")[0]
    return f"{type(e).__name__}: " + _PATH.sub("<file>", " ".join(text.split()))[:300]


def _bounded(v, where: str) -> int:
    """The elements of a node's arrays; InputError naming the node if its value is out of
    bounds (an int outside int64, a tuple over MAX_SEQUENCE entries, an array over
    MAX_ELEMENTS, a value of a kind no allowed operation makes, such as a complex)."""
    if v is None or isinstance(v, (bool, float, _DType)):
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
    if isinstance(v, _ARRAYS):
        shape = tuple(v.shape)
        if math.prod(shape) > MAX_ELEMENTS or any(d > MAX_ELEMENTS for d in shape):
            raise InputError(
                f"{where}: an array of shape {list(shape)}, over {MAX_ELEMENTS} elements"
            )
        return math.prod(shape)
    raise InputError(f"{where}: a {type(v).__name__} value is not allowed in a custom loss")
