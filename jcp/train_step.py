"""The jitted pure steps: forward and forward_backward.

Owns the one shard_map over (dp, cp, tp) that runs model + losses (the body of one device's
stream: jcp/model_loss.py, whose model_loss, StepConfig, training_attend and unroll_layers
are importable from here) and the gradient w.r.t. the active adapter slots only: taken
outside it, or — for a pass over many adapters — inside it, each layer's factor gradient
added into the accumulators' pages in place (_paged_value_and_grad). AdamW is jcp.optim's.
It must never differentiate base weights, never psum a gradient beyond the one sum over dp
and cp that the replicated adapters' transpose makes (vary_on_entry; a paged pass makes
the same sums layer by layer; in a multi-process CPU job, host_sum.HostSummedStep's sum of
each process's devices on the host and of the processes' sums after it), and never touch
a slot other than the one being stepped.

Shapes: see the legend in jcp/mesh.py.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jcp import custom_loss as custom_loss_lib
from jcp import lora as lora_lib
from jcp import losses as losses_lib
from jcp import mesh as mesh_lib
from jcp import model as model_lib
from jcp.config import QwenConfig
from jcp.mesh import BATCH_AXES, SPECS

# The model + loss body (jcp/model_loss.py), re-exported: the design card names train_step.
from jcp.model_loss import LossOptions, Stream, layer_span, model_loss
from jcp.model_loss import StepConfig as StepConfig
from jcp.model_loss import training_attend as training_attend
from jcp.model_loss import unroll_layers as unroll_layers
from jcp.program_cache import shared


@dataclasses.dataclass(frozen=True)
class Batch:
    """A packed micro-batch as global arrays: streams [DP, CP, S], spans [DP, CP, A, 2],
    active [A] and client vectors (losses.FLOAT_INPUTS: weights, advantages, logprobs,
    sequence_ratio_mask) [DP, CP, S]; loss_id indexes each token's loss in the step's
    static tuple of loss names; call_tokens (int32 [], replicated): the real tokens of the
    whole call this micro-batch is part of (it weights the router auxiliary loss)."""

    tokens: jax.Array
    targets: jax.Array
    segment: jax.Array
    position: jax.Array
    loss_id: jax.Array
    weights: jax.Array
    advantages: jax.Array
    logprobs: jax.Array
    sequence_ratio_mask: jax.Array
    spans: jax.Array
    active: jax.Array
    call_tokens: jax.Array


jax.tree_util.register_dataclass(
    Batch, data_fields=[f.name for f in dataclasses.fields(Batch)], meta_fields=[]
)


def batch_specs() -> Batch:
    s = SPECS.stream_DPxCPxS
    return Batch(
        tokens=s,
        targets=s,
        segment=s,
        position=s,
        loss_id=s,
        **{k: s for k in losses_lib.FLOAT_INPUTS},
        spans=SPECS.spans_DPxCPxAx2,
        active=SPECS.replicated,
        call_tokens=SPECS.replicated,
    )


@dataclasses.dataclass(frozen=True)
class BatchStatics:
    """What a compiled step is specialised on besides its arguments' shapes, one static
    (hashable) argument of the jitted steps: the batch's loss names (tokens pick theirs by
    loss_id), its datum slots, the call's CustomLoss (or None) and the LoRA modules its
    adapters target (used_modules; None: all). Equal values reuse a compiled program,
    exactly as the four separate static arguments did."""

    loss_fns: tuple[str, ...]
    num_slots: int
    custom: custom_loss_lib.CustomLoss | None = None
    modules: tuple[str, ...] | None = None


@dataclasses.dataclass(frozen=True)
class PassConfig:
    """What a compiled step fixes for its shard_map'd pass: the model, the mesh, the step
    settings, the batch's loss names (tokens pick theirs by loss_id) and datum slots."""

    cfg: QwenConfig
    mesh: object
    step_cfg: StepConfig
    loss_fns: tuple[str, ...]
    num_slots: int

    def stream_loss(self, lora_active, params, slot_meta, b: Batch, loss_cfg, **kw):
        """stream_loss of this pass (inside the shard_map)."""
        return stream_loss(self, lora_active, params, slot_meta, b, loss_cfg, **kw)


def stream_loss(
    p: PassConfig,
    lora_active,
    params,
    slot_meta,
    b: Batch,
    loss_cfg,
    pages=None,
    after=None,
    **kw,
):
    """model_loss of this device's row of the batch, inside the shard_map (kw: its
    keep_token_logprobs / summed, LossOptions; pages: the lora.PageSource of lora_active's
    PagedFactor leaves, _paged_value_and_grad's; after: model_loss's, the layers from a
    split on)."""
    route, stream = _stream_of(p, slot_meta, b, pages)
    opts = LossOptions(p.loss_fns, p.num_slots, **kw)
    return model_loss(
        p.cfg, p.step_cfg, params, lora_active, route, stream, loss_cfg, opts, after=after
    )


def _stream_of(p: PassConfig, slot_meta, b: Batch, pages=None):
    """(the adapters' routing, the Stream) of this device's row of the batch."""
    one = lambda x: x[0, 0]  # noqa: E731  (this device's [S] row)
    kernel = p.step_cfg.lora_impl == "cpu"
    route = slot_meta.routing(b.active, one(b.spans), s_len=b.tokens.shape[-1], kernel=kernel)
    if pages is not None:
        route = dataclasses.replace(route, pages=pages)
    inputs = losses_lib.TokenInputs(**{k: one(getattr(b, k)) for k in losses_lib.FLOAT_INPUTS})
    stream = Stream(
        one(b.tokens),
        one(b.segment),
        one(b.position),
        one(b.targets),
        inputs,
        loss_id_S=one(b.loss_id),
        call_tokens=b.call_tokens,
    )
    return route, stream


def _loss_and_outputs(
    p: PassConfig,
    lora_active,
    params,
    slot_meta,
    batch: Batch,
    loss_cfg,
    custom=None,
    custom_args=(),
    after=None,
):
    """The shard_map'd model + loss, and a custom loss after it. Returns (replicated loss,
    ShardOutputs).

    loss_cfg {name: {setting: scalar}} (p.loss_fns' settings); custom: the call's CustomLoss
    (static) or None, with custom_args its datums (see custom_terms); after: (split, the
    hidden states [DP, CP, S, D] of layers [0, split): make_forward_halves' first
    program's), to run the layers from split on only.
    """
    cfg, mesh = p.cfg, p.mesh
    split, h_DPxCPxSxD = after if after is not None else (None, None)

    def shard(lora_active, params, slot_meta, b: Batch, loss_cfg, h):
        loss, out = p.stream_loss(
            vary_on_entry(lora_active),
            params,
            slot_meta,
            b,
            loss_cfg,
            after=None if h is None else (split, h[0, 0]),
            keep_token_logprobs=custom is not None,
        )
        if custom is None:
            return loss, out, None
        lp = out.token_logprobs
        return loss, dataclasses.replace(out, token_logprobs=None), lp[None, None]

    in_specs = (
        lora_lib.slot_specs_active(cfg, lora_active),
        model_lib.param_specs(cfg),
        SPECS.slot_G,
        batch_specs(),
        SPECS.replicated,
        None if after is None else SPECS.stream_DPxCPxSxD,
    )
    loss, out, lp = jax.shard_map(
        shard,
        mesh=mesh,
        in_specs=in_specs,
        out_specs=(P(), P(), P() if custom is None else SPECS.stream_DPxCPxS),
    )(lora_active, params, slot_meta, batch, loss_cfg, h_DPxCPxSxD)
    if custom is None:
        return loss, out
    c_loss, c_metrics = custom_terms(custom, lp, custom_args)
    # Replicated, like everything else the host reads back.
    rep = lambda x: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P()))  # noqa: E731
    out = dataclasses.replace(
        out,
        custom_loss=rep(jax.lax.stop_gradient(c_loss)),
        custom_metrics=jax.tree.map(rep, jax.lax.stop_gradient(c_metrics)),
    )
    return rep(loss + jnp.sum(c_loss)), out


def folds_outputs(cfg: QwenConfig, custom) -> bool:
    """Whether forward_backward sums the per-datum outputs in the gradient's all-reduce
    (_folded_value_and_grad): dense models without a custom loss (a MoE model's router
    statistics and a custom loss's terms are used in the forward pass, summed there)."""
    return custom is None and not cfg.is_moe


def _folded_value_and_grad(p: PassConfig, lora_active, params, slot_meta, batch: Batch, loss_cfg):
    """(gradient w.r.t. lora_active, loss, ShardOutputs) — _loss_and_outputs and its
    gradient, with the outputs summed over (dp, cp) in the backward pass's one all-reduce
    (_folded_vjp, then _folded_pull).
    """
    losses_DPxCP, pull = _folded_vjp(p, lora_active, params, slot_meta, batch, loss_cfg)
    return _folded_pull(p, losses_DPxCP, pull, batch)


def _folded_vjp(p: PassConfig, lora_active, params, slot_meta, batch: Batch, loss_cfg, after=None):
    """(each shard's loss [DP, CP], the pullback) of _folded_value_and_grad's forward pass.

    The loss and outputs are only read, never differentiated, so nothing in the forward
    pass needs their sum: each shard's parts (losses.shard_loss(summed=False)) become the
    cotangent of a zero `sink` vector that enters the shard_map beside the adapters
    (_emit), and the transpose of vary_on_entry sums the sink's cotangent with the
    adapters' gradient as one vector (mesh.psum_flat). Across processes each all-reduce is
    a gloo ring of TCP messages, so the step runs one ring where it ran two (the forward's
    outputs and the backward's gradient). The gradient is that of the summed loss: each
    shard's loss is a [DP, CP] output whose cotangent is 1, as psum's transpose gives it.

    after: (start, the hidden states [DP, CP, S, D] the layers before start left): the
    layers from start on, the head and the loss only (start = L: the head and the loss
    alone, from the final hidden states), lora_active holding their factors (span_lora's
    last piece); the pullback then also gives those hidden states' cotangent
    (make_forward_backward_turns).
    """
    cfg, mesh, num_slots = p.cfg, p.mesh, p.num_slots
    size = sum(math.prod(s) for s in part_shapes(batch, num_slots))
    start, h_DPxCPxSxD = after if after is not None else (0, None)

    def shard(lora_active, sink, h, params, slot_meta, b: Batch, loss_cfg):
        lora_active, sink = vary_on_entry((lora_active, sink))
        lora = all_layers(cfg, lora_active, start)
        kw = {} if h is None else {"after": (start, h[0, 0])}
        loss, parts = p.stream_loss(lora, params, slot_meta, b, loss_cfg, summed=False, **kw)
        payload = jnp.concatenate([x.reshape(-1) for x in parts])
        return _emit(sink, loss, payload)[None, None]

    in_specs = (
        lora_lib.slot_specs_active(cfg, lora_active),
        SPECS.replicated,
        None if h_DPxCPxSxD is None else SPECS.stream_DPxCPxSxD,
        model_lib.param_specs(cfg),
        SPECS.slot_G,
        batch_specs(),
        SPECS.replicated,
    )

    def losses_of(lora_active, sink, h=None):  # [DP, CP]: each shard's loss
        return jax.shard_map(shard, mesh=mesh, in_specs=in_specs, out_specs=P(*BATCH_AXES))(
            lora_active, sink, h, params, slot_meta, batch, loss_cfg
        )

    sink = jnp.zeros(size, jnp.float32)
    if h_DPxCPxSxD is None:
        return jax.vjp(losses_of, lora_active, sink)
    return jax.vjp(losses_of, lora_active, sink, h_DPxCPxSxD)


def _span_vjp(p: PassConfig, piece, h_DPxCPxSxD, params, slot_meta, batch: Batch, start, stop):
    """(the hidden states [DP, CP, S, D] that layers [start, stop) leave, the pullback) of
    a folded pass in turns: differentiated w.r.t. piece (those layers' factors, span_lora's)
    and h (what the layers before start left; None where start is 0: the tokens). Their
    gradient is summed over dp and cp on entry (vary_on_entry), like the whole pass's."""
    cfg = p.cfg

    def shard(piece, h, params, slot_meta, b: Batch):
        piece = vary_on_entry(piece)
        route, stream = _stream_of(p, slot_meta, b)
        lora = all_layers(cfg, piece, start)
        x = None if h is None else h[0, 0]
        return layer_span(cfg, p.step_cfg, params, lora, route, stream, start, stop, x)[None, None]

    in_specs = (
        lora_lib.slot_specs_active(cfg, piece),
        None if h_DPxCPxSxD is None else SPECS.stream_DPxCPxSxD,
        model_lib.param_specs(cfg),
        SPECS.slot_G,
        batch_specs(),
    )

    def hidden_of(piece, h=None):
        return jax.shard_map(
            shard, mesh=p.mesh, in_specs=in_specs, out_specs=SPECS.stream_DPxCPxSxD
        )(piece, h, params, slot_meta, batch)

    if h_DPxCPxSxD is None:
        return jax.vjp(hidden_of, piece)
    return jax.vjp(hidden_of, piece, h_DPxCPxSxD)


def layer_bounds(cfg: QwenConfig, spans: int) -> tuple[int, ...]:
    """(0, …, L): the edges of min(spans, L) consecutive layer spans of near-equal lengths
    that a pass in turns runs (make_forward_backward_turns); one span for a hybrid model
    (its layers run whole: decoder.hidden_span is a dense model's)."""
    n = 1 if cfg.is_hybrid else max(1, min(spans, cfg.num_layers))
    return tuple(cfg.num_layers * i // n for i in range(n + 1))


def turn_parts(cfg: QwenConfig, spans: int) -> int:
    """The parts of a forward_backward in turns (make_forward_backward_turns), a forward
    and a backward program each: a dense model's layer spans (layer_bounds) and its head
    and loss; a hybrid model's whole pass, one part."""
    return 1 if cfg.is_hybrid else len(layer_bounds(cfg, spans))


def span_lora(lora_active: dict, bounds, head_apart: bool) -> list[dict]:
    """take_active's factors ([L, A, …] per layer module, the head's [A, …]) as one tree
    per layer span of `bounds`, each its layers' slice; the head's factors in a tree of
    their own after them where head_apart (empty where the adapters have none), else in
    the last span's."""
    head = {m: ab for m, ab in lora_active.items() if m == lora_lib.HEAD}
    pieces = [
        {
            m: jax.tree.map(lambda x, a=start, b=stop: x[a:b], ab)
            for m, ab in lora_active.items()
            if m != lora_lib.HEAD
        }
        for start, stop in zip(bounds, bounds[1:])
    ]
    if head_apart:
        return [*pieces, head]
    pieces[-1].update(head)
    return pieces


def joined_lora(pieces: list[dict]) -> dict:
    """span_lora's inverse: the per-span trees (or their gradients) as one."""
    spans = [piece for piece in pieces if set(piece) - {lora_lib.HEAD}]
    out = {
        m: jax.tree.map(lambda *xs: jnp.concatenate(xs), *(piece[m] for piece in spans))
        for m in (spans[0] if spans else ())
        if m != lora_lib.HEAD
    }
    out.update({m: ab for m, ab in pieces[-1].items() if m == lora_lib.HEAD})
    return out


def all_layers(cfg: QwenConfig, piece: dict, start: int) -> dict:
    """A span's factors (span_lora's piece, from layer `start`) as the [L, …] stacks the
    layers slice (decoder.hidden_span), zeros outside the span: XLA folds the slice of
    the concatenation back to the piece, so nothing is computed or summed for them. Where
    the piece holds every layer, the piece itself."""
    out = {}
    for m, ab in piece.items():
        if m == lora_lib.HEAD:
            out[m] = ab
            continue

        def widen(x):
            after = cfg.num_layers - start - x.shape[0]
            if start == 0 and after == 0:
                return x
            zeros = lambda n: jnp.zeros((n, *x.shape[1:]), x.dtype)  # noqa: E731
            return jnp.concatenate([zeros(start), x, zeros(after)])

        out[m] = jax.tree.map(widen, ab)
    return out


def _folded_pull(p: PassConfig, losses_DPxCP, pull, batch: Batch):
    """(gradient, loss, ShardOutputs) from _folded_vjp's pullback: the backward pass, whose
    all-reduce also sums the outputs."""
    grads, sums = pull(jnp.ones_like(losses_DPxCP))
    loss, out = losses_lib.shard_outputs(split_parts(sums, part_shapes(batch, p.num_slots)))
    return grads, loss, out


def part_shapes(batch: Batch, num_slots: int) -> tuple:
    """The global shapes of losses.shard_loss(summed=False)'s OUTPUT_PARTS."""
    return ((), batch.targets.shape, batch.tokens.shape, (num_slots,), (num_slots,))


def split_parts(flat, shapes) -> list:
    """A concatenated vector back into arrays of `shapes`, in order."""
    ends = np.cumsum([math.prod(s) for s in shapes])
    return [flat[e - math.prod(s) : e].reshape(s) for e, s in zip(ends, shapes)]


@jax.custom_vjp
def _emit(sink, loss, payload):
    """loss, and `payload` as the cotangent of `sink` in the backward pass (not scaled by
    the loss's cotangent, which is 1: so an infinite output is passed on as it is, never
    multiplied into a NaN)."""
    return loss


def _emit_fwd(sink, loss, payload):
    return loss, jax.lax.stop_gradient(payload)


def _emit_bwd(payload, ct):
    return payload, ct, jnp.zeros_like(payload)


_emit.defvjp(_emit_fwd, _emit_bwd)


def pages_in_place(cfg: QwenConfig, custom, slot_meta, active_A, fold: bool = True) -> bool:
    """Whether forward_backward takes _paged_value_and_grad: a pass of the grouped products
    (more than DENSE_MAX_ADAPTERS active adapters) over paged tables, of a dense model
    without a custom loss (folds_outputs)."""
    return (
        fold
        and folds_outputs(cfg, custom)
        and slot_meta.page_GK is not None
        and active_A.shape[0] > lora_lib.DENSE_MAX_ADAPTERS
    )


def _paged_value_and_grad(p: PassConfig, acc, lora, params, slot_meta, batch: Batch, loss_cfg):
    """(acc with the pass's gradient added, loss, ShardOutputs, finite_A) of a pass over
    many adapters (pages_in_place), its per-layer modules' gradients added in place.

    Each per-layer module's factors stay in the slot tables' pages: the layers get
    lora.PagedFactor leaves, whose grouped products (lora_grouped.paged_product) read each
    tile's factors from the pages and, in the backward, add each layer's factor gradient —
    summed over dp and cp — into the accumulator's pages (a jax.Ref per table, made inside
    the shard_map from this device's shard). So the pass holds neither the active adapters'
    gathered factors [L, A, …] nor their stacked gradient, which grow with A (at 256
    adapters of r16 on a 1024-wide model, 1 GiB each). The gradient is therefore taken
    inside the shard_map, w.r.t. a zero probe that every paged product takes (and the
    other modules' gathered factors, the unembedding's, as _folded_value_and_grad does):
    each shard's loss is seeded with 1, as there. The outputs are summed over dp and cp
    in one all-reduce; the sums, the accumulators and finite_A are the gathered path's, bit
    for bit (tests/test_lora_grouped.py compares them at (1,2,2)).
    """
    cfg, mesh, num_slots = p.cfg, p.mesh, p.num_slots
    tables, other = lora_lib.layer_tables(lora)
    other = lora_lib.take_active(other, slot_meta.page_GK, batch.active)
    table_specs = lora_lib.slot_specs_active(cfg, tables)  # the tables' own specs
    every = BATCH_AXES + (mesh_lib.TP,)

    def shard(acc_t, tables, other, params, slot_meta, b: Batch, loss_cfg):
        grads = jax.tree.map(jax.new_ref, acc_t)
        finite = jax.new_ref(mesh_lib.vary(jnp.ones(b.active.shape[0], bool), every))
        page_AK = jnp.take(slot_meta.page_GK, b.active, axis=0)
        paged = lora_lib.paged_leaves(tables)

        def local(probe, other):
            kernel = p.step_cfg.lora_impl == "cpu"
            src = lora_lib.PageSource(tables, page_AK, grads, finite, probe, kernel)
            lora_active = {**vary_on_entry(other), **paged}
            return p.stream_loss(
                lora_active, params, slot_meta, b, loss_cfg, pages=src, summed=False
            )

        probe = jnp.zeros((), jnp.float32)
        (_, parts), (_, g_other) = jax.value_and_grad(local, (0, 1), has_aux=True)(probe, other)
        sums = mesh_lib.psum_flat(jnp.concatenate([x.reshape(-1) for x in parts]), BATCH_AXES)
        ok = jax.lax.pmin(jax.ref.freeze(finite).astype(jnp.int32), every)
        return jax.tree.map(jax.ref.freeze, grads), g_other, sums, ok

    in_specs = (
        table_specs,
        table_specs,
        lora_lib.slot_specs_active(cfg, other),
        model_lib.param_specs(cfg),
        SPECS.slot_G,
        batch_specs(),
        SPECS.replicated,
    )
    out_specs = (table_specs, lora_lib.slot_specs_active(cfg, other), P(), P())
    acc_t, g_other, sums, ok = jax.shard_map(
        shard, mesh=mesh, in_specs=in_specs, out_specs=out_specs
    )({m: acc[m] for m in tables}, tables, other, params, slot_meta, batch, loss_cfg)
    acc, finite_A = accumulate(
        {**acc, **acc_t}, slot_meta, lora_lib.untake_active(g_other), batch.active
    )
    loss, out = losses_lib.shard_outputs(split_parts(sums, part_shapes(batch, num_slots)))
    return acc, loss, out, finite_A & (ok > 0)


def vary_on_entry(tree):
    """The adapters made device-varying over dp and cp on entry to the shard_map, their
    gradient summed over dp and cp as one flat vector.

    The gradient of an input the shard_map holds replicated is summed over the devices
    (psum) where the input first meets varying data: left implicit, that is inside the
    layer scan, one all-reduce per layer in the backward pass. Cast here, the whole
    stacked gradient is summed once, after the scan — the same sums, L times fewer
    collectives, which is what a collective costs across processes (gloo: each one is TCP
    round trips, benchmarks/serve_multiprocess.py). On CPU the ~25 leaves are summed as
    one concatenated vector (mesh.psum_flat): XLA:CPU runs each operand of a combined
    all-reduce as its own gloo ring.
    """
    axes = BATCH_AXES  # (tp: custom VJPs inside the layers keep the adapters' tp type)
    leaves, treedef = jax.tree.flatten(tree)
    had = tuple(frozenset(mesh_lib.varying_axes(x)) for x in leaves)
    return jax.tree.unflatten(treedef, _vary(axes, had, *leaves))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _vary(axes, had, *leaves):
    out = []
    for x, h in zip(leaves, had):
        missing = tuple(a for a in axes if a not in h)
        out.append(jax.lax.pcast(x, missing, to="varying") if missing else x)
    return out


def _vary_fwd(axes, had, *leaves):
    return _vary(axes, had, *leaves), None


def _vary_bwd(axes, had, _, cts):
    """The transpose: each leaf's cotangent summed over the axes it varies over and its
    primal did not (dp and cp), the leaves of the same axes as one vector (psum_flat)."""
    out = list(cts)
    groups = {}
    for i, (ct, h) in enumerate(zip(cts, had)):
        m = tuple(sorted(set(mesh_lib.varying_axes(ct)) - h))
        if m:
            groups.setdefault(m, []).append(i)
    for m, idx in groups.items():
        for i, x in zip(idx, mesh_lib.psum_flat([cts[i] for i in idx], m)):
            out[i] = x
    return tuple(out)


_vary.defvjp(_vary_fwd, _vary_bwd)


def custom_terms(custom: custom_loss_lib.CustomLoss, lp_DPxCPxS, custom_args):
    """A custom loss on each of its datums -> (losses [n], {metric: [n]}).

    Outside the shard_map, on the global log-prob stream lp_DPxCPxS ([DP, CP, S] or
    [DP, CP, S, K], zero at padding): custom_args holds per datum (index, inputs), index
    int32 [N] or [N, K_d] into the flattened stream (batch.PackedBatch.custom) — so each
    datum's loss sees its whole log-prob vector, in original order, whatever the mesh.
    Each loss is one replicated scalar, counted once; its gradient reaches each rank's own
    log-probs through the gather's transpose, so it equals CP = 1's.
    """
    flat = lp_DPxCPxS.reshape(-1)
    losses, metrics = [], []
    for index, inputs in custom_args:
        loss, m = custom(flat[index], *inputs)
        losses.append(loss)
        metrics.append(m)
    return jnp.stack(losses), {k: jnp.stack([m[k] for m in metrics]) for k in metrics[0]}


def active_lora(lora: dict, slot_meta, batch: Batch, static: BatchStatics):
    """The batch's active slots' factors of the modules the call uses (used_modules,
    lora.take_active): what a step's shard_map takes."""
    return lora_lib.take_active(used_modules(lora, static.modules), slot_meta.page_GK, batch.active)


def used_modules(lora: dict, modules) -> dict:
    """The slot tables of `modules` only (None: all). An adapter's untargeted modules hold
    zeros, so leaving out those no adapter of the batch targets changes no value or
    gradient and skips their work: an attention + MLP adapter's lm_head factor costs
    ~5 % of throughput.py's CPU step (its B gradient is a transposed-lhs GEMM)."""
    return lora if modules is None else {m: lora[m] for m in modules if m in lora}


@functools.cache
def _cpu_has_avx512() -> bool:
    """Whether this host's CPU has AVX-512F (Linux /proc/cpuinfo; False where unreadable)."""
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " avx512f" in line for line in f)
    except OSError:
        return False


def compiler_options(mesh) -> dict:
    """XLA options of the training programs (forward, forward_backward) on `mesh`.

    On XLA:CPU with AVX-512: prefer 512-bit vectors (LLVM's default for these CPUs is 256).
    The attention kernel's elementwise tile passes (the exp of the scores, the softmax row
    terms) are the gain: fwd + bwd of one causal datum of 8,192 tokens on one core
    1.50 → 1.39 CPU s, bit-identical results (benchmarks/profile_cpu.py --kernel); the
    whole 1 × 8k step 7.6 → 7.4 CPU s, 8 × 512 unchanged. Nothing elsewhere.
    """
    if mesh.devices.flat[0].platform == "cpu" and _cpu_has_avx512():
        return {"xla_cpu_prefer_vector_width": 512}
    return {}


@shared
def make_forward(cfg: QwenConfig, mesh, step_cfg: StepConfig):
    """jit(forward)(lora, params, slot_meta, batch, loss_cfg, custom_args, *, static) ->
    (loss, out); static: the batch's BatchStatics."""

    @functools.partial(
        jax.jit, static_argnames=("static",), compiler_options=compiler_options(mesh)
    )
    def forward(lora, params, slot_meta, batch, loss_cfg, custom_args=(), *, static: BatchStatics):
        active = active_lora(lora, slot_meta, batch, static)
        p = PassConfig(cfg, mesh, step_cfg, static.loss_fns, static.num_slots)
        return _loss_and_outputs(
            p, active, params, slot_meta, batch, loss_cfg, static.custom, custom_args
        )

    return forward


def forward_halves_apply(cfg: QwenConfig, custom) -> bool:
    """Whether a forward runs in two programs (make_forward_halves): a dense model of two
    layers or more, without a custom loss."""
    return custom is None and not cfg.is_moe and not cfg.is_hybrid and cfg.num_layers > 1


@shared
def make_forward_halves(cfg: QwenConfig, mesh, step_cfg: StepConfig):
    """forward as two programs, (first, second), for a pass where forward_halves_apply:

    - jit(first)(lora, params, slot_meta, batch, *, static) -> the hidden states [DP, CP,
      S, D] after the first half of the layers (model_loss.layer_span);
    - jit(second)(lora, params, slot_meta, batch, loss_cfg, h, *, static) -> (loss, out),
      as make_forward's forward returns them: the other layers, the head and the loss.

    Each layer runs the same operations as in make_forward's one program, so the results
    are the same (tests/test_trainer.py). A caller may run other programs between the two
    (jcp-serve: another tenant's work, each holding the device about half as long)."""
    options = compiler_options(mesh)
    split = cfg.num_layers // 2

    @functools.partial(jax.jit, static_argnames=("static",), compiler_options=options)
    def first(lora, params, slot_meta, batch, *, static: BatchStatics):
        p = PassConfig(cfg, mesh, step_cfg, static.loss_fns, static.num_slots)
        active = active_lora(lora, slot_meta, batch, static)

        def shard(lora_active, params, slot_meta, b: Batch):
            route, stream = _stream_of(p, slot_meta, b)
            h = layer_span(cfg, step_cfg, params, lora_active, route, stream, 0, split)
            return h[None, None]

        in_specs = (
            lora_lib.slot_specs_active(cfg, active),
            model_lib.param_specs(cfg),
            SPECS.slot_G,
            batch_specs(),
        )
        return jax.shard_map(shard, mesh=mesh, in_specs=in_specs, out_specs=SPECS.stream_DPxCPxSxD)(
            active, params, slot_meta, batch
        )

    @functools.partial(jax.jit, static_argnames=("static",), compiler_options=options)
    def second(lora, params, slot_meta, batch, loss_cfg, h, *, static: BatchStatics):
        p = PassConfig(cfg, mesh, step_cfg, static.loss_fns, static.num_slots)
        active = active_lora(lora, slot_meta, batch, static)
        return _loss_and_outputs(p, active, params, slot_meta, batch, loss_cfg, after=(split, h))

    return first, second


@shared
def make_forward_backward(cfg: QwenConfig, mesh, step_cfg: StepConfig, fold: bool = True):
    """jit(fb)(acc, lora, params, slot_meta, batch, loss_cfg, custom_args, *, static) ->
    (acc + grad, loss, out, finite_A).

    The gradient is taken w.r.t. the A active slots only (outside the shard_map) and
    scatter-added into the donated accumulators; padding entries of `active` route no
    tokens, so their gradient is zero. finite_A: whether each active adapter's gradient
    is finite (the caller refuses the call and restores the accumulators otherwise).
    static (BatchStatics): the batch's loss names and datum slots, the CustomLoss of its
    custom datums (custom_args) or None, and the LoRA modules its adapters target
    (used_modules; the others' accumulators are left as they are).
    fold: sum the loss and outputs in the gradient's all-reduce where folds_outputs allows
    (the same values; False: in the forward pass, for tests that compare the two).
    """

    @functools.partial(
        jax.jit,
        static_argnames=("static",),
        donate_argnums=(0,),
        compiler_options=compiler_options(mesh),
    )
    def forward_backward(
        acc, lora, params, slot_meta, batch, loss_cfg, custom_args=(), *, static: BatchStatics
    ):
        p = PassConfig(cfg, mesh, step_cfg, static.loss_fns, static.num_slots)
        custom = static.custom

        def loss_of(active):
            return _loss_and_outputs(
                p, active, params, slot_meta, batch, loss_cfg, custom, custom_args
            )

        if pages_in_place(cfg, custom, slot_meta, batch.active, fold):
            used = used_modules(lora, static.modules)
            return _paged_value_and_grad(p, acc, used, params, slot_meta, batch, loss_cfg)
        active = active_lora(lora, slot_meta, batch, static)
        if folds_outputs(cfg, custom) and fold:
            grads, loss, out = _folded_value_and_grad(p, active, params, slot_meta, batch, loss_cfg)
        else:
            (loss, out), grads = jax.value_and_grad(loss_of, has_aux=True)(active)
        acc, finite_A = accumulate(acc, slot_meta, lora_lib.untake_active(grads), batch.active)
        return acc, loss, out, finite_A

    return forward_backward


def turns_apply(cfg: QwenConfig, custom, slot_meta, active_A) -> bool:
    """Whether a forward_backward pass may run in turns (make_forward_backward_turns): the
    folded pass (folds_outputs) over gathered factors, not a paged one."""
    return folds_outputs(cfg, custom) and not pages_in_place(cfg, custom, slot_meta, active_A)


def _own(out, inputs):
    """`out` with every array of `inputs` it holds as it is copied (see
    make_forward_backward_turns: a slot write between turns donates the tables and the
    header)."""
    own = {id(x) for x in jax.tree.leaves(inputs)}
    return jax.tree.map(lambda x: jnp.copy(x) if id(x) in own else x, out)


@shared
def make_forward_backward_turns(cfg: QwenConfig, mesh, step_cfg: StepConfig, spans: int):
    """forward_backward as programs run one after another, for a pass where turns_apply:
    the forward pass of each of n parts, first to last, then the backward pass of each,
    last to first. The parts of a dense model: its layer spans (layer_bounds(cfg, spans)),
    then the head and the loss (a unit of its own: on a real vocabulary it costs a few
    layers); a hybrid model's: the whole pass, one part. The first part's backward pass
    does the accumulation. Returns (start, forward, backward):

    - jit(start)(lora, params, slot_meta, batch, loss_cfg, *, static) -> (out, pullback,
      the other parts' factors): the active slots' factors gathered and split by part
      (span_lora), and part 0's forward pass; out: the hidden states it leaves [DP, CP,
      S, D], or (n = 1) each shard's loss [DP, CP];
    - jit(forward)(piece, h, params, slot_meta, batch, loss_cfg, *, static, i) -> (out,
      pullback): part i's (i ≥ 1) forward pass from the hidden states h part i - 1 left
      (the head's: the final hidden states, after the final norm);
    - jit(backward)(acc, pullback, out_ct, later, slot_meta, batch, *, static, i) -> part
      i's backward pass: out_ct is the cotangent of its output (the last part: its
      losses, whose cotangent is 1). For i ≥ 1: (its factors' gradient, the cotangent of
      part i - 1's output, (loss, out) for the last part, else None), acc None. For i =
      0: (acc + grad, finite_A, (loss, out) where n = 1, else None), acc donated; later:
      the gradients of parts 1 … n - 1.

    Each layer runs the same operations as in make_forward_backward's folded pass, so the
    results are the same bit for bit (tests/test_trainer.py,
    test_steps_with_other_calls_between_equal_one_call, test_turns_equal_one_pass). A
    caller may run other programs between any two (jcp-serve runs another tenant's work
    there, which then waits for one program, not the whole pass: benchmarks/
    pass_turns.py), slot writes among them (create, optim_step), which donate
    the adapter tables and the slot header: a pullback holds arrays its program computed
    (the factors are gathered into new ones), and an input it would hold as it is, the
    base weights aside (never donated), is copied (_own) — none is today, so the copy
    costs nothing; it keeps a later change from holding a table a slot write then
    deletes. Each program takes the header as it is when it runs.
    """
    options = compiler_options(mesh)
    bounds = layer_bounds(cfg, spans)
    n = turn_parts(cfg, spans)
    head_apart = n == len(bounds)  # a part beyond the layer spans (not a hybrid model's)

    def forward_span(p, i, piece, h, params, slot_meta, batch, loss_cfg):
        if i == n - 1:  # the head and the loss (a hybrid model: the whole pass)
            after = None if h is None else (cfg.num_layers, h)
            return _folded_vjp(p, piece, params, slot_meta, batch, loss_cfg, after=after)
        return _span_vjp(p, piece, h, params, slot_meta, batch, bounds[i], bounds[i + 1])

    @functools.partial(jax.jit, static_argnames=("static",), compiler_options=options)
    def start(lora, params, slot_meta, batch, loss_cfg, *, static: BatchStatics):
        p = PassConfig(cfg, mesh, step_cfg, static.loss_fns, static.num_slots)
        pieces = span_lora(active_lora(lora, slot_meta, batch, static), bounds, head_apart)
        out, pull = forward_span(p, 0, pieces[0], None, params, slot_meta, batch, loss_cfg)
        return out, _own(pull, (lora, slot_meta, batch, loss_cfg)), pieces[1:]

    @functools.partial(jax.jit, static_argnames=("static", "i"), compiler_options=options)
    def forward(piece, h, params, slot_meta, batch, loss_cfg, *, static: BatchStatics, i: int):
        p = PassConfig(cfg, mesh, step_cfg, static.loss_fns, static.num_slots)
        out, pull = forward_span(p, i, piece, h, params, slot_meta, batch, loss_cfg)
        return out, _own(pull, (piece, h, slot_meta, batch, loss_cfg))

    @functools.partial(
        jax.jit, static_argnames=("static", "i"), donate_argnums=(0,), compiler_options=options
    )
    def backward(acc, pull, out_ct, later, slot_meta, batch, *, static: BatchStatics, i: int):
        last = i == n - 1
        cts = pull(jnp.ones_like(out_ct) if last else out_ct)
        grads = cts[0]
        outputs = None
        if last:  # the outputs' sums arrive as the sink's cotangent
            outputs = losses_lib.shard_outputs(
                split_parts(cts[1], part_shapes(batch, static.num_slots))
            )
        if i > 0:
            return grads, cts[-1], outputs
        grads = lora_lib.untake_active(joined_lora([grads, *later]))
        acc, finite_A = accumulate(acc, slot_meta, grads, batch.active)
        return acc, finite_A, outputs

    return start, forward, backward


def accumulate(acc, slot_meta, grads, active_A):
    """(acc with `grads` [A, …] of the A active slots added — the modules grads holds —,
    finite_A: whether each active slot's gradient is finite)."""
    acc = lora_lib.add_active(acc, slot_meta.page_GK, active_A, grads)
    finite = [
        jnp.all(jnp.isfinite(g), axis=tuple(range(1, g.ndim))) for g in jax.tree.leaves(grads)
    ]
    finite_A = jnp.all(jnp.stack(finite), axis=0) if finite else jnp.ones(active_A.shape, bool)
    return acc, finite_A
