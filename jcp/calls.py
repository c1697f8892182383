"""One forward / forward_backward call's host side: validation and packing (`prepare`),
its micro-batches on the mesh (`device_batch`), the stepper that dispatches them one at a
time (`Steps`), and their results read back into the caller's order
(`outputs` -> `ForwardBackwardOutput`), with the finiteness checks that refuse a call.

Owned by jcp.trainer (which re-exports ForwardBackwardOutput and Steps); it never touches
adapter state or compiles anything.

Shapes: see the legend in jcp/mesh.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np

from jcp import batch as batch_lib
from jcp import custom_loss as custom_loss_lib
from jcp import losses as losses_lib
from jcp import train_step
from jcp.errors import InputError
from jcp.mesh import bucket_length, host, put
from jcp.model import moe as moe_lib

# Micro-batches of one call dispatched ahead of the oldest's completion: enough to keep
# the device fed, few enough that XLA:CPU's collective rendezvous never times out.
MAX_IN_FLIGHT = 4


@dataclasses.dataclass(frozen=True)
class CallLimits:
    """What a call is validated and packed against: the model's vocabulary, the datum
    token cap, the mesh's dp and cp, rows per device, adapter slots, and whether the model
    is hybrid (its Gated DeltaNet layers pay per datum slot, so no slot floor)."""

    vocab_size: int
    token_cap: int
    dp: int
    cp: int
    max_tokens_per_device: int
    max_adapters: int
    hybrid: bool


@dataclasses.dataclass
class ForwardBackwardOutput:
    """Per-datum outputs in the caller's order, and batch metrics (Tinker's names)."""

    loss_fn_outputs: list[dict]
    metrics: dict


class Steps:
    """A forward / forward_backward run one micro-batch at a time (Trainer.forward_steps,
    forward_backward_steps), so that a caller may do other work between its micro-batches
    (jcp-serve interleaves other tenants' passes: docs/serving.md, "Fairness").

    Validation and packing happen when it is made (InputError then, nothing changed);
    each `step()` dispatches the next micro-batch (at most MAX_IN_FLIGHT run
    ahead of the oldest unread one), and the last one also reads every result back ->
    True, and `output` holds the ForwardBackwardOutput. The same micro-batches, programs
    and accumulation order as forward / forward_backward, so the same results bit for
    bit. Between steps, other Trainer calls may run if none of them touches this call's
    adapters (their gradient rows are restored on failure, a copy taken on entry). A
    step that raises (a non-finite loss or gradient: InputError) has rolled the call's
    accumulation back; `close()` before the end does the same. With `turns` set, a
    full-length micro-batch takes several steps where it can, the same results bit for
    bit: a forward_backward's, the forward pass of each of its layer spans, then the
    backward pass of each (StepPrograms.first_turn); a forward's, its two halves of the
    layers (StepPrograms.forward_first).
    """

    def __init__(self, gen, passes: int, turns: bool = False):
        self._gen, self.passes = gen, passes
        # Whether each later full-length micro-batch runs in turns where it can
        # (Trainer.forward_steps, forward_backward_steps); settable between steps.
        self.turns = turns
        self.done, self.output = False, None
        self._dispatched: list = []

    def step(self, settle: bool = False) -> bool:
        """Dispatch the next micro-batch (read everything back after the last) -> whether
        the call is over. settle: also wait until every dispatched micro-batch has run (a
        caller about to hand the device to other work; no result changes)."""
        try:
            self._dispatched = next(self._gen)
        except StopIteration as end:
            self.done, self.output = True, end.value
            return True
        if settle:
            jax.block_until_ready(self._dispatched)
        return False

    def close(self) -> None:
        """Abandon the call: its accumulation so far is rolled back."""
        self._gen.close()
        self.done = True


def prepare(data, loss_fn, loss_fn_config, adapters, check_adapter, limits: CallLimits):
    """Validate everything and pack -> (checked datums, packed micro-batches, {loss:
    settings}); no device work, nothing changed. check_adapter(id, what) -> the slot of
    an allocated adapter, or InputError."""
    if isinstance(data, batch_lib.Datum) or not isinstance(data, Sequence):
        raise InputError("data must be a list of Datum")
    names = batch_lib.per_datum_losses(loss_fn, len(data))
    if isinstance(loss_fn, custom_loss_lib.CustomLoss):
        if loss_fn_config:
            raise InputError(
                "loss_fn_config: a custom loss takes no settings (close "
                "over them, or pass them as loss_fn_inputs)"
            )
        loss_cfg = {losses_lib.CUSTOM: {}}
    else:
        loss_cfg = loss_configs(sorted(set(names)), loss_fn_config)
    if isinstance(adapters, (int, np.integer)) and not isinstance(adapters, bool):
        per_datum = [check_adapter(adapters)] * len(data)
    elif isinstance(adapters, Sequence) and not isinstance(adapters, str):
        if len(adapters) != len(data):
            raise InputError(f"adapters has {len(adapters)} entries for {len(data)} datums")
        per_datum = [check_adapter(a, f"datum {i}: adapter") for i, a in enumerate(adapters)]
    else:
        raise InputError(f"adapters must be an adapter id or one id per datum, got {adapters!r}")
    checked = batch_lib.validate(
        data,
        loss_fn if isinstance(loss_fn, custom_loss_lib.CustomLoss) else names,
        limits.vocab_size,
        limits.token_cap,
    )
    # A pass's adapter and datum counts follow its stream length (batch.static_counts),
    # except a hybrid model's datum slots: its Gated DeltaNet layers pay per slot.
    packed = batch_lib.pack(
        checked,
        per_datum,
        limits.dp,
        limits.cp,
        limits.max_tokens_per_device,
        limits.max_adapters,
        adapter_rows=batch_lib.ADAPTER_ROWS,
        slot_tokens=None if limits.hybrid else batch_lib.SLOT_TOKENS,
    )
    return checked, packed, loss_cfg


def loss_configs(distinct: list[str], loss_fn_config) -> dict[str, dict[str, np.float32]]:
    """{loss: settings}. With one loss, loss_fn_config holds its settings; with several,
    it maps loss names to settings."""
    if loss_fn_config is not None and not isinstance(loss_fn_config, dict):
        raise InputError(f"loss_fn_config must be a dict, got {type(loss_fn_config).__name__}")
    given = loss_fn_config or {}
    if len(distinct) == 1 and not (given and set(given) <= set(losses_lib.LOSSES)):
        per_loss = {distinct[0]: given}
    else:
        extra = set(given) - set(distinct)
        if extra:
            raise InputError(
                f"loss_fn_config: with losses {distinct}, its keys must be "
                f"loss names of the batch; got {sorted(extra)}"
            )
        per_loss = {name: given.get(name) for name in distinct}
    return {
        name: {k: np.float32(v) for k, v in losses_lib.resolve_config(name, per_loss[name]).items()}
        for name in distinct
    }


def device_batch(mesh, pb: batch_lib.PackedBatch, call_tokens: int) -> train_step.Batch:
    """A packed micro-batch on the mesh, as train_step.Batch (call_tokens: the whole
    call's real tokens)."""
    specs = train_step.batch_specs()
    on_host = train_step.Batch(
        tokens=pb.tokens,
        targets=pb.targets,
        segment=pb.segment,
        position=pb.position,
        loss_id=pb.loss_id,
        **pb.floats,
        spans=pb.spans,
        active=pb.active,
        call_tokens=np.asarray(call_tokens, np.int32),
    )
    return jax.tree.map(lambda x, spec: put(mesh, x, spec), on_host, specs)


def outputs(checked, packed, results) -> ForwardBackwardOutput:
    """Read back every micro-batch's results; InputError (the caller rolls back) when a
    datum's loss or an adapter's gradient is not finite in float32.

    MoE models add moe.load_metrics of the expert counts summed over micro-batches, and
    with the router auxiliary loss on, router_aux_loss:sum (its micro-batch terms summed;
    the step's loss includes them, loss:sum does not)."""
    outputs: list[dict | None] = [None] * len(checked)
    total, clipped, counts, aux = 0.0, 0, None, None
    custom_metrics: dict[str, list[float]] = {}
    for pb, (loss, out, finite_A) in zip(packed, results):
        lp = batch_lib.unpack(host(out.logprobs), pb)
        el = batch_lib.unpack(host(out.elementwise_loss), pb)
        datum_loss, datum_clipped = host(out.datum_loss), host(out.clipped)
        members = pb.slot_datums
        custom_loss = {}
        if pb.custom:  # per-datum custom losses and metrics, in pb.custom's order
            custom_loss = dict(zip((c[0] for c in pb.custom), host(out.custom_loss)))
            for key, values in out.custom_metrics.items():
                custom_metrics.setdefault(key, []).extend(map(float, host(values)))
        for slot_i, j in enumerate(members):
            lp_j = lp[j]
            if lp_j.ndim == 2:  # a [DP, CP, S, K] stream: the datum's own K columns
                lp_j = (
                    lp_j[:, : checked[j].targets.shape[1]]
                    if (checked[j].targets.ndim == 2)
                    else lp_j[:, 0]
                )
            outputs[j] = {
                "logprobs": lp_j,
                "elementwise_loss": el[j],
                "loss:sum": float(custom_loss.get(j, datum_loss[slot_i])),
            }
            if checked[j].loss_fn in losses_lib.LOSSES and (
                losses_lib.LOSSES[checked[j].loss_fn].clips
            ):
                outputs[j]["clipped_tokens:sum"] = int(datum_clipped[slot_i])
            check_finite(j, checked[j], outputs[j])
        if finite_A is not None and not host(finite_A).all():
            bad = sorted({int(a) for a, ok in zip(pb.active, host(finite_A)) if not ok})
            raise InputError(
                f"the gradient of adapter(s) {bad} is not finite in float32 "
                f"for this batch (datums {sorted(members)}); nothing was accumulated"
            )
        total += float(host(loss))
        clipped += int(datum_clipped.sum())
        if out.expert_counts is not None:
            c = host(out.expert_counts).astype(np.int64)
            counts = c if counts is None else counts + c
        if out.router_aux_loss is not None:
            a = float(host(out.router_aux_loss))
            total -= a
            aux = a if aux is None else aux + a
    if not np.isfinite(total):
        raise InputError(
            f"the batch's loss:sum overflows float32 ({total}) although every "
            "datum's loss is finite; split the batch"
        )
    metrics = {"loss:sum": total}
    for key, values in custom_metrics.items():  # combined over datums as named
        metrics[key] = float(np.sum(values) if key.endswith(":sum") else np.mean(values))
    if any(d.loss_fn in losses_lib.LOSSES and losses_lib.LOSSES[d.loss_fn].clips for d in checked):
        metrics["clipped_tokens:sum"] = clipped
    if counts is not None:
        metrics.update(moe_lib.load_metrics(counts))
    if aux is not None:
        metrics["router_aux_loss:sum"] = aux
    return ForwardBackwardOutput(loss_fn_outputs=outputs, metrics=metrics)


def check_finite(i: int, datum, out: dict) -> None:
    """losses.check_finite_outputs, and for a custom loss: its value must be finite."""
    if datum.loss_fn != losses_lib.CUSTOM:
        return losses_lib.check_finite_outputs(i, datum, out)
    if not np.isfinite(out["loss:sum"]):
        raise InputError(
            f"datum {i}: its custom loss is {out['loss:sum']} (not finite in "
            "float32); nothing was accumulated"
        )


def per_datum_slots(packed) -> list[int]:
    """Every adapter slot a packed call routes tokens to."""
    return sorted({int(a) for pb in packed for a in pb.active})


def stream_lengths(max_tokens_per_device: int, limit: int | None = None) -> list[int]:
    """The stream lengths (rows per device) a packed micro-batch can have, shortest first:
    mesh.bucket_length's buckets below max_tokens_per_device, and it; only those ≤ limit
    when given (what warm-up compiles)."""
    top = max_tokens_per_device if limit is None else min(limit, max_tokens_per_device)
    out, b = [], bucket_length(1)
    while b < top:
        out.append(b)
        b = bucket_length(b + 1)
    return out + [bucket_length(top, maximum=max_tokens_per_device)]


def filling_data(names: tuple[str, ...], s_len: int, limits: CallLimits):
    """(datums, their losses) of zero weight that fill streams of s_len rows per device
    (at most the token cap), with every loss of `names`: Trainer.warmup's call. Each dp
    shard's stream gets one datum of every loss, of an even share of its rows (packing
    deals equal lengths out one per shard, longest first)."""
    total = max(2 * len(names), min(s_len, limits.token_cap // limits.cp))
    data = []
    for i, name in enumerate(names):
        r = 2 * (total // (2 * len(names)) + (i < total // 2 % len(names)))
        n = r * limits.cp  # zigzag rows 2·ceil(n / 2cp) = r
        inputs = {
            f: np.ones(n, np.float32) if f == "sequence_ratio_mask" else np.zeros(n, np.float32)
            for f in losses_lib.LOSSES[name].inputs
        }
        data += [
            batch_lib.Datum(
                np.zeros(n, np.int32),
                {"target_tokens": np.zeros(n, np.int32), **inputs},
            )
        ] * limits.dp
    return data, [d_loss for d_loss in names for _ in range(limits.dp)]
