"""The micro-batches a Trainer call packs its data into, through public names."""

from __future__ import annotations

from jcp import calls


def micro_batches(tr, data, loss_fn, adapters) -> list:
    """The packed micro-batches (batch.PackedBatch) a forward / forward_backward call of
    tr packs data into: calls.prepare under tr.call_limits, checked to be tr's own packing
    against its pass_shapes."""
    _, packed, _ = calls.prepare(
        data, loss_fn, None, adapters, lambda a, what="": int(a), tr.call_limits
    )
    shapes = [(pb.loss_fns, pb.tokens.shape[-1], len(pb.active), pb.num_slots) for pb in packed]
    assert shapes == tr.pass_shapes(data, loss_fn, adapters)
    return packed
