"""Datums and their validation: a Tinker `Datum`, and `validate` turning datums into
private checked copies (`CheckedDatum`) for their losses, built-in or custom.

It runs on the host in NumPy, before any device work; it must never modify the caller's
arrays, and every refusal is an `InputError` naming the datum and the field. Packing the
checked datums into streams is jcp.batch's (which re-exports these names).

Shapes: see the legend in jcp/mesh.py.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence

import numpy as np

from jcp import losses as losses_lib
from jcp.custom_loss import CHECK_BUDGET_S, MAX_TRACED_OPS, CustomLoss
from jcp.errors import InputError

FLOAT_FIELDS = losses_lib.FLOAT_INPUTS
KNOWN_FIELDS = ("target_tokens",) + FLOAT_FIELDS


@dataclasses.dataclass
class Datum:
    """One training example in Tinker's form.

    model_input: token ids [N]; loss_fn_inputs: "target_tokens" [N] and, by loss,
    "weights", "advantages", "logprobs" [N]. Position i of model_input predicts
    target_tokens[i]. Lists or NumPy arrays are accepted and never modified.
    """

    model_input: Sequence[int] | np.ndarray
    loss_fn_inputs: Mapping[str, Sequence[float] | np.ndarray]

    @classmethod
    def from_json(cls, obj: Mapping) -> Datum:
        """From a Tinker-style JSON object {"model_input": [...], "loss_fn_inputs": {...}}."""
        mi = obj.get("model_input")
        if isinstance(mi, Mapping):  # Tinker's ModelInput: {"chunks": [{"tokens": [...]}]}
            mi = [t for ch in mi.get("chunks", []) for t in ch.get("tokens", [])]
        return cls(model_input=mi, loss_fn_inputs=dict(obj.get("loss_fn_inputs") or {}))


@dataclasses.dataclass(frozen=True)
class CheckedDatum:
    """A validated private copy of a Datum: tokens int32 [N]; targets int32 [N], or [N, K]
    (cross_entropy and custom losses; −1 pads); floats float32 [N] (weights [N, K] with
    2-D targets); the name of its loss; extra: a custom loss's inputs (float32 or int32 at
    their declared ranks), by name."""

    tokens: np.ndarray
    targets: np.ndarray
    floats: dict[str, np.ndarray]
    loss_fn: str = "cross_entropy"
    extra: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)

    @property
    def n(self) -> int:
        return int(self.tokens.shape[0])


def _int_vector(i: int, field: str, value, vocab_size: int, two_d: bool = False) -> np.ndarray:
    """Token ids [N]; with two_d also [N, K] (K ≥ 1), where −1 marks a padding target."""
    try:
        arr = np.array(value, copy=True)
    except Exception as e:  # ragged lists and the like
        raise InputError(f"datum {i}: {field} is not a vector of token ids ({e})") from None
    if arr.ndim != 1 and not (two_d and arr.ndim == 2 and arr.shape[1] >= 1):
        raise InputError(
            f"datum {i}: {field} must be 1-D"
            + (" or 2-D [N, K]" if two_d else "")
            + f", got shape {arr.shape}"
        )
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        if (
            arr.dtype == object
            or not np.issubdtype(arr.dtype, np.number)
            or np.issubdtype(arr.dtype, np.complexfloating)
        ):
            raise InputError(f"datum {i}: {field} must hold integer token ids, got {arr.dtype}")
        if not np.all(np.isfinite(arr)) or np.any(arr != np.round(arr)):
            raise InputError(f"datum {i}: {field} must hold integer token ids")
    if arr.size:
        low = -1 if arr.ndim == 2 else 0
        bad = np.argwhere((arr < low) | (arr >= vocab_size))
        if bad.size:
            j = tuple(int(x) for x in bad[0])
            where = ", ".join(map(str, j))
            raise InputError(
                f"datum {i}: {field}[{where}] = {arr[j]} is outside the vocabulary "
                f"[0, {vocab_size})" + (" (−1 pads)" if low < 0 else "")
            )
    return arr.astype(np.int32)


def _float_vector(i: int, field: str, value, n: int, shape=None) -> np.ndarray:
    """A float32 copy of a client vector, checked finite *in float32* (the device's dtype):
    1e39 passes as a float64 but is inf on the device, so it is refused here. shape: the
    exact shape wanted instead of [n]."""
    try:
        arr = np.array(value, copy=True)
        if arr.dtype.kind not in "biuf":
            raise TypeError(f"dtype {arr.dtype}")
        with np.errstate(over="ignore"):
            arr32 = arr.astype(np.float32)
    except Exception as e:
        raise InputError(f"datum {i}: {field} is not a vector of numbers ({e})") from None
    if shape is not None:
        if arr32.shape != tuple(shape):
            raise InputError(
                f"datum {i}: {field} has shape {list(arr32.shape)}, expected "
                f"{list(shape)} (the shape of target_tokens)"
            )
    elif arr32.ndim != 1:
        raise InputError(f"datum {i}: {field} must be 1-D, got shape {arr32.shape}")
    elif arr32.shape[0] != n:
        raise InputError(
            f"datum {i}: {field} has length {arr32.shape[0]}, model_input has length {n}"
        )
    bad = np.argwhere(~np.isfinite(arr32))
    if bad.size:
        j = tuple(int(x) for x in bad[0]) if arr32.ndim > 1 else int(bad[0][0])
        what = "is not finite" if not np.isfinite(float(arr[j])) else "overflows float32"
        raise InputError(f"datum {i}: {field}[{j}] = {arr[j]} {what}")
    return arr32


def _custom_input(i: int, name: str, value) -> np.ndarray:
    """A custom loss input: a float32 (finite in float32) or int32 copy, any shape."""
    field = f"loss_fn_inputs.{name}"
    try:
        arr = np.array(value, copy=True)
    except Exception as e:
        raise InputError(f"datum {i}: {field} is not an array of numbers ({e})") from None
    if arr.dtype.kind in "iu":
        if arr.size and (arr.min() < np.iinfo(np.int32).min or arr.max() > np.iinfo(np.int32).max):
            raise InputError(f"datum {i}: {field} overflows int32")
        return arr.astype(np.int32)
    if arr.dtype.kind not in "bf":
        raise InputError(f"datum {i}: {field} must hold numbers, got {arr.dtype}")
    if arr.ndim > 2:
        raise InputError(f"datum {i}: {field} has rank {arr.ndim}; at most 2")
    return _float_vector(i, field, arr, 0, shape=arr.shape)


def _check_custom(
    i: int, d, custom: CustomLoss, vocab_size: int, n: int, shapes_seen: set, deadline: float
) -> CheckedDatum:
    # Inputs the loss does not read are ignored, as the SDK's client-side path ignores them.
    inputs = d.loss_fn_inputs
    for key in ("target_tokens",) + custom.input_names:
        if key not in inputs:
            raise InputError(
                f"datum {i}: loss_fn_inputs.{key} is missing (needed by custom "
                f"loss {custom.name!r})"
            )
    targets = _int_vector(
        i, "loss_fn_inputs.target_tokens", inputs["target_tokens"], vocab_size, two_d=True
    )
    if targets.shape[0] != n:
        raise InputError(
            f"datum {i}: loss_fn_inputs.target_tokens has length "
            f"{targets.shape[0]}, model_input has length {n}"
        )
    extra = {k: _custom_input(i, k, inputs[k]) for k in custom.input_names}
    key = (targets.shape, tuple((v.shape, v.dtype.str) for v in extra.values()))
    if key not in shapes_seen:  # evaluating the shapes traces the graph: once per shape
        custom.check(i, targets.shape, extra, deadline)
        shapes_seen.add(key)
    return CheckedDatum(np.zeros(0), targets, {}, losses_lib.CUSTOM, extra)


def per_datum_losses(loss_fn, n: int) -> list[str]:
    """One loss name (or a CustomLoss) or one name per datum -> a checked list of n names."""
    if isinstance(loss_fn, CustomLoss):
        return [losses_lib.CUSTOM] * n
    if isinstance(loss_fn, str):
        return [losses_lib.check_loss_fn(loss_fn)] * n
    if not isinstance(loss_fn, Sequence) or len(loss_fn) != n:
        raise InputError(
            f"loss_fn must be a loss name or one name per datum ({n}), got {loss_fn!r}"
        )
    return [losses_lib.check_loss_fn(name, f"datum {i}") for i, name in enumerate(loss_fn)]


def validate(data: Sequence[Datum], loss_fn, vocab_size: int, token_cap: int) -> list[CheckedDatum]:
    """Check every datum for its loss (`loss_fn`: one name, or one per datum); return
    private validated copies.

    loss_fn may be a jcp.custom_loss.CustomLoss (every datum's loss): target_tokens [N] or
    [N, K] at its logprobs rank, and the inputs it reads at their declared ranks, checked
    by evaluating the loss's shapes. Built-in losses: target_tokens [N]; cross_entropy
    also [N, K] (−1 pads) with weights of the same shape.

    Raises InputError naming the datum index and the field. Nothing is mutated.
    """
    custom = loss_fn if isinstance(loss_fn, CustomLoss) else None
    if isinstance(loss_fn, str):
        losses_lib.check_loss_fn(loss_fn)
    if isinstance(data, (Datum, Mapping)) or not isinstance(data, Sequence):
        raise InputError("data must be a list of Datum")
    if len(data) == 0:
        raise InputError("data is empty: pass at least one Datum")
    names = per_datum_losses(loss_fn, len(data))
    if custom is not None and (custom.ops or 0) * len(data) > MAX_TRACED_OPS:
        raise InputError(
            f"custom loss {custom.name!r} has {custom.ops} operations, traced "
            f"once per datum: {len(data)} datums would trace "
            f"{custom.ops * len(data)}, over {MAX_TRACED_OPS} per request (send "
            "fewer datums per request)"
        )
    out = []
    shapes_seen: set = set()
    deadline = time.monotonic() + CHECK_BUDGET_S  # for evaluating a custom loss's shapes
    for i, d in enumerate(data):
        loss_fn = names[i]
        if not isinstance(d, Datum):
            raise InputError(f"datum {i}: expected jcp.Datum, got {type(d).__name__}")
        tokens = _int_vector(i, "model_input", d.model_input, vocab_size)
        n = tokens.shape[0]
        if n == 0:
            raise InputError(f"datum {i}: model_input is empty")
        if n > token_cap:
            raise InputError(
                f"datum {i}: model_input has {n} tokens, over the cap of {token_cap} tokens per "
                "datum (raise max_tokens_per_device or cp)"
            )
        inputs = d.loss_fn_inputs
        if not isinstance(inputs, Mapping):
            raise InputError(f"datum {i}: loss_fn_inputs must be a dict")
        if custom is not None:
            c = _check_custom(i, d, custom, vocab_size, n, shapes_seen, deadline)
            out.append(dataclasses.replace(c, tokens=tokens))
            continue
        out.append(_check_builtin(i, inputs, loss_fn, vocab_size, tokens))
    return out


def _check_builtin(i: int, inputs: Mapping, loss_fn: str, vocab_size: int, tokens) -> CheckedDatum:
    """Datum i's loss_fn_inputs for the built-in loss `loss_fn` (tokens: its checked
    model_input)."""
    n = tokens.shape[0]
    needed = ("target_tokens",) + losses_lib.LOSSES[loss_fn].inputs
    for key in inputs:
        if key not in KNOWN_FIELDS:
            raise InputError(
                f"datum {i}: loss_fn_inputs.{key} is not a known field; expected "
                f"{list(KNOWN_FIELDS)}"
            )
    for key in needed:
        if key not in inputs:
            raise InputError(f"datum {i}: loss_fn_inputs.{key} is missing (needed by {loss_fn})")
    two_d = loss_fn == "cross_entropy"
    targets = _int_vector(
        i, "loss_fn_inputs.target_tokens", inputs["target_tokens"], vocab_size, two_d=two_d
    )
    if targets.shape[0] != n:
        raise InputError(
            f"datum {i}: loss_fn_inputs.target_tokens has length {targets.shape[0]}, "
            f"model_input has length {n}"
        )
    floats = {
        k: _float_vector(
            i,
            f"loss_fn_inputs.{k}",
            inputs[k],
            n,
            shape=targets.shape if k == "weights" and targets.ndim == 2 else None,
        )
        for k in FLOAT_FIELDS
        if k in inputs
    }
    return CheckedDatum(tokens, targets, floats, loss_fn)
