"""Python's cyclic garbage collector kept off the serving path.

A full collection stops every thread (the worker and the HTTP loop) for as long as it scans
the tracked objects: traced beside a noisy neighbour, collections of 0.2-0.78 s over the
model, modules and compiled programs stalled every tenant. So what exists when the worker
starts is frozen out of the collector (`gc.freeze`), and so is what a compile made later
(a program a tenant's new shape needed, with its Python objects): after each worker turn
in which XLA compiled (or loaded from the persistent cache) a program, the worker collects
what is garbage now and freezes the rest. That pause falls on a turn that already waited
seconds for the compile. Frozen objects are never collected as cycles (plain reference
counting still frees them): the price is bounded by the compiles, which the warm-up and the
shape buckets keep few.
"""

from __future__ import annotations

import gc

import jax

# jax.monitoring's events for an XLA compile and for a program loaded from the persistent
# compilation cache.
COMPILE_EVENTS = frozenset(
    {
        "/jax/core/compile/backend_compile_duration",
        "/jax/compilation_cache/cache_retrieval_time_sec",
    }
)


class Freezer:
    """start(): collect and freeze what exists; after_turn(): again if a program was
    compiled since (-> whether it froze); stop(): unfreeze, stop counting."""

    def __init__(self):
        self.compiles = 0  # programs compiled or loaded since start
        self._frozen_at = 0

    def _count(self, event: str, duration: float, **kwargs) -> None:
        if event in COMPILE_EVENTS:
            self.compiles += 1

    def start(self) -> None:
        gc.collect()
        gc.freeze()
        jax.monitoring.register_event_duration_secs_listener(self._count)

    def after_turn(self) -> bool:
        if self.compiles == self._frozen_at:
            return False
        self._frozen_at = self.compiles
        gc.collect()
        gc.freeze()
        return True

    def stop(self) -> None:
        jax.monitoring.unregister_event_duration_listener(self._count)
        gc.unfreeze()
