"""CustomLoss: a per-datum loss from a JAX function or from the SDK's graph (graph.py), its
declared inputs checked, and `check`: the loss evaluated on a datum's shapes only
(jax.eval_shape, under a wall-clock deadline) so that a datum whose inputs do not fit is
refused before any device work.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jcp.custom_loss.graph import compile_graph
from jcp.custom_loss.limits import INPUT_NAME, MAX_INPUTS, METRIC_KEY
from jcp.custom_loss.program import DEADLINE, Program, brief
from jcp.errors import InputError


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
        return len(self.fn.steps) if isinstance(self.fn, Program) else None

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
        program = compile_graph(graph, [n for n, _ in checked])
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
        token = DEADLINE.set(deadline)
        try:
            loss, metrics = jax.eval_shape(self.fn, *args)
        except InputError as e:
            raise InputError(f"datum {i}: {e}") from None
        except Exception as e:  # noqa: BLE001 — any failure on these shapes is the input's
            raise InputError(
                f"datum {i}: custom loss {self.name!r} fails on its inputs "
                f"(logprobs {lp_shape}, "
                + ", ".join(f"{n} {values[n].shape}" for n in self.input_names)
                + f"): {brief(e)}"
            ) from None
        finally:
            DEADLINE.reset(token)
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
