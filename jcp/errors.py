"""InputError and the scalar checks every public entry point shares.

Owns what "a valid number" means for jcp: checked in float32, the dtype the device uses,
so a value that passes can never overflow, underflow to zero or round to a bad value on the
device. It must never import jax or touch device state.
"""

from __future__ import annotations

import math

import numpy as np

F32 = np.finfo(np.float32)


class InputError(ValueError):
    """Invalid client input; raised before any device work, with no state changed."""


def float32_number(value, what: str) -> float:
    """value cast to float32 and checked finite there -> that float32 value as a float.

    InputError naming `what` for a non-number, a bool, or a value that is not finite in
    float32 (1e39 overflows to inf).
    """
    if isinstance(value, (bool, np.bool_, bytes)) or np.iscomplexobj(value):
        raise InputError(f"{what} must be a real number, got {value!r}")
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise InputError(f"{what} must be a number, got {value!r}") from None
    except OverflowError:  # an int beyond float64 (10**400)
        raise InputError(
            f"{what} = {_short(value)} overflows float32 (largest finite {F32.max:.4g})"
        ) from None
    if not math.isfinite(out):
        raise InputError(f"{what} must be finite, got {out}")
    with np.errstate(over="ignore"):
        out32 = np.float32(out)
    if not np.isfinite(out32):
        raise InputError(f"{what} = {out} overflows float32 (largest finite {F32.max:.4g})")
    return float(out32)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:20]}...({len(text)} digits)"
