"""Program builders shared by every Trainer, Sampler and engine of one process.

A builder `make_x(cfg, mesh, …)` returns a jitted function; JAX keeps traces and compiled
programs per jitted function, so two Trainers of the same model, mesh and settings used to
trace, lower and compile every program twice (a second tiny Trainer's first
forward_backward + optim_step: 4.2 s, against 0.14 s when they share). `shared` caches the
builder on its arguments, which must be hashable and fix everything the program depends
on (QwenConfig, StepConfig and Mesh compare by value).

Module constants a builder's program reads while tracing (lora_grouped.tile_rows,
model_loss.CPU_UNROLL_LAYERS, …) are constants of the process: code that changes one must
call jax.clear_caches(), or programs traced before the change are reused.
"""

from __future__ import annotations

import functools

# Builder results kept per builder: a process serves one model, tests a few at a time.
KEPT = 8


def shared(make=None, *, kept: int = KEPT):
    """`make`, cached on its (hashable) arguments: equal arguments, the same jitted
    function, and so its traces and compiled programs. `@shared(kept=n)` keeps n results
    (a builder per table leaf kind and sharding needs more than KEPT)."""
    if make is None:
        return lambda f: functools.lru_cache(maxsize=kept)(f)
    return functools.lru_cache(maxsize=kept)(make)
