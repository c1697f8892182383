"""The op table of a custom loss: torch semantics on jax.numpy, by the names a graph uses.

Every operation a graph may use is an entry of this module's tables (FUNCTIONS, METHODS,
ATTRIBUTES), mapped to jax.numpy with torch's semantics (argument names, `dim`/`keepdim`,
`max(dim)` -> (values, indices), clamp's gradient at its bounds). A name that is not a key
of these tables is refused by the graph compiler (graph.py); nothing here evaluates, imports
or looks up a name a node carries.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jcp.custom_loss.python_ops import ARRAYS, MATH, OPERATORS

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
    if isinstance(dtype, DType):
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
        if isinstance(a, DType):
            dtype = a
        elif isinstance(a, (jax.Array, np.ndarray)):
            dtype = DType(str(a.dtype))
    return x if dtype is None else jnp.asarray(x).astype(_dtype(dtype))


def _cast(target):
    return lambda x, *a, **k: jnp.asarray(x).astype(target)


def _type(x, dtype=None):
    if dtype is None:
        raise TypeError("type() without a dtype returns a string")
    return jnp.asarray(x).astype(_dtype(dtype))


def _shape(x) -> tuple:
    if not isinstance(x, (bool, int, float, *ARRAYS)):
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
    **OPERATORS,
    "operator.getitem": _getitem,
    **MATH,
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
    "dtype": lambda x: DType(str(jnp.asarray(x).dtype)),
}


def _no_attr(x, name):
    raise TypeError(f"{type(x).__name__} has no attribute {name!r}")


@dataclasses.dataclass(frozen=True)
class DType:
    """A torch dtype constant ({"dtype": "float32"}), mapped to jcp's device dtypes."""

    name: str

    @property
    def jnp(self):
        return DTYPES[self.name]
