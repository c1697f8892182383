"""jcp/server/collector.py: what a compile made during serving is frozen out of the cyclic
garbage collector after the worker's turn, and nothing is frozen after a turn that
compiled nothing (host-only but for one tiny jit)."""

import gc
import weakref

import jax
import jax.numpy as jnp

from jcp.server.collector import Freezer


class _Cycle:
    def __init__(self):
        self.me = self


def test_a_turn_that_compiled_freezes_what_it_made_and_collects_garbage_first():
    f = Freezer()
    f.start()
    try:
        frozen = gc.get_freeze_count()
        assert not f.after_turn()  # nothing compiled since start
        kept = [_Cycle() for _ in range(100)]  # objects serving made, still in use
        garbage = weakref.ref(_Cycle())  # a garbage cycle: collected, not frozen
        jax.jit(lambda x: x * 3 + 1)(jnp.arange(5.0)).block_until_ready()  # a new program
        assert f.compiles >= 1
        assert f.after_turn()
        grown = gc.get_freeze_count() - frozen
        assert grown >= len(kept)
        assert garbage() is None
        later = [_Cycle() for _ in range(100)]  # made after: not frozen without a compile
        assert not f.after_turn()  # no compile since: no pause
        # (Frozen objects freed meanwhile, e.g. by another thread, lower the count.)
        assert gc.get_freeze_count() - frozen <= grown
        del later
    finally:
        f.stop()
    assert gc.get_freeze_count() == 0
    counted = f.compiles  # stopped: no longer counting
    jax.jit(lambda x: x - 7)(jnp.arange(3.0)).block_until_ready()
    assert f.compiles == counted
