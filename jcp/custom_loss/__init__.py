"""Custom per-datum losses: Tinker's traced graphs rebuilt as JAX functions, and JAX ones.

A custom loss is a per-datum function `fn(logprobs, *inputs) -> (loss, metrics)`: logprobs
is the datum's [N] (or [N, K] for 2-D target_tokens) target log-probs, each input one of
its loss_fn_inputs at a declared rank (0 scalar, 1 [N]-like, 2 [N, K]-like), loss a scalar
and metrics {"custom/<name>:sum" | ":mean": scalar}. The Trainer sums the datums' losses.

Owns the interpreter of the SDK's `CustomLossGraph` (torch.fx nodes as plain data: the
`placeholder / call_function / call_method / getattr / output` ops, targets such as
`torch.exp` or `operator.mul`, encoded arguments). Every operation a graph may use is an
entry of the op table's (ops.py) (FUNCTIONS, METHODS, ATTRIBUTES), mapped to jax.numpy
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

The package, one idea a module: limits.py (the bounds), python_ops.py (bounded Python
arithmetic), ops.py (the op table), args.py (encoded arguments), cost.py (the cost model),
program.py (the bounded program), graph.py (graph -> program), loss.py (CustomLoss).
"""

from jcp.custom_loss.limits import (
    CHECK_BUDGET_S,
    INPUT_NAME,
    INT64_MAX,
    INT64_MIN,
    MAX_DATUM_ELEMENTS,
    MAX_DEPTH,
    MAX_ELEMENTS,
    MAX_INPUTS,
    MAX_LITERAL,
    MAX_LITERALS,
    MAX_NODES,
    MAX_SEQUENCE,
    MAX_TRACED_OPS,
    METRIC_KEY,
    SHAPE_BITS,
)
from jcp.custom_loss.loss import CustomLoss
from jcp.custom_loss.ops import ATTRIBUTES, DTYPES, FUNCTIONS, METHODS, MinMax

__all__ = [
    "ATTRIBUTES",
    "CHECK_BUDGET_S",
    "CustomLoss",
    "DTYPES",
    "FUNCTIONS",
    "INPUT_NAME",
    "INT64_MAX",
    "INT64_MIN",
    "MAX_DATUM_ELEMENTS",
    "MAX_DEPTH",
    "MAX_ELEMENTS",
    "MAX_INPUTS",
    "MAX_LITERAL",
    "MAX_LITERALS",
    "MAX_NODES",
    "MAX_SEQUENCE",
    "MAX_TRACED_OPS",
    "METHODS",
    "METRIC_KEY",
    "MinMax",
    "SHAPE_BITS",
]
