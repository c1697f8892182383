"""The Qwen2/Qwen3 decoder as a per-shard function (runs inside the one shard_map).

Owns the forward pass from tokens to final hidden states (over the parameter tree of
model.params): the layer stack, scanned by runs of same-kind layers (dense / MoE, full
attention / Gated DeltaNet), over the blocks of jcp.model.blocks (re-exported here). The
differing piece of each use is passed in: the attention strategy (`attend`, see
attention.Attend: training's CP attention, or prefill / decode over a KV cache), the
sequence mixing and the MLP block (dense SwiGLU, or an MoE block with the same
signature). It must never compute the unembedding's full logits (losses.py does that,
chunked) and never update base weights: they are frozen and not differentiated.

Shapes: see the legend in jcp/mesh.py.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jcp import attention as attention_lib
from jcp import logprobs as logprobs_lib
from jcp import lora as lora_lib
from jcp.config import QwenConfig
from jcp.model.blocks import (
    LayerInputs,
    Rotary,
    attention_block,
    decoder_layer,
    dense_mlp,
    embed,
    linear_attention_block,
    moe_mlp,
    partial_rope,
    rms_norm,
    rope,
    rotary,
)

__all__ = [
    "Hidden",
    "HybridState",
    "LayerInputs",
    "Pass",
    "Rotary",
    "attention_block",
    "decoder_layer",
    "dense_mlp",
    "embed",
    "hidden_span",
    "hidden_states",
    "kind_runs",
    "layer_slices",
    "linear_attention_block",
    "moe_mlp",
    "partial_rope",
    "rms_norm",
    "rope",
    "rotary",
    "scan_layers",
    "unembed_factors",
]


def _split_lora(lora):
    """(per-layer modules [L, …], expert modules [Lm, …]) of the active adapters' tree."""
    if lora is None:
        return None, None
    return (
        {m: lora[m] for m in lora_lib.LAYER_MODULES if m in lora},
        {m: lora[m] for m in lora_lib.EXPERT if m in lora},
    )


def layer_slices(cfg: QwenConfig, params, lora=None) -> tuple:
    """Every layer's (weights, LoRA of the active adapters) as separate arrays: [L, …] ->
    L × […], each layer's MLP weights (and expert factors) merged in for MoE models.
    Taken once outside a loop that runs the decoder many times (sampling's decode loop),
    so each step reads whole arrays instead of slicing the stacked weights per layer and
    step; pass the result to hidden_states as Pass(…, layers=…)."""
    layer_lora, expert_lora = _split_lora(lora)
    out = []
    for i in range(cfg.num_layers):
        layer, lo = jax.tree.map(lambda x: x[i], (params["layers"], layer_lora))
        if cfg.is_moe:
            kind = cfg.moe_layers[i]
            j = sum(1 for k in cfg.moe_layers[:i] if k == kind)  # index among its kind
            layer = {
                **layer,
                **jax.tree.map(lambda x: x[j], params["moe_mlp" if kind else "dense_mlp"]),
            }
            if kind and expert_lora is not None:
                lo = {**lo, **jax.tree.map(lambda x: x[j], expert_lora)}
        out.append((layer, lo))
    return tuple(out)


class Hidden(NamedTuple):
    """hidden_states' result: h_SxD the final-norm hidden states; attn_state the attention
    state after the layers (stacked [L, …]; None for training); router_stats the MoE
    routing statistics (moe.RouterStats, [Lm, E] each) when asked for, else None."""

    h_SxD: jax.Array
    attn_state: Any
    router_stats: Any


def scan_layers(body, h, weights, xs, remat: bool, unroll: bool = False):
    """jax.lax.scan of body(h, (layer weights, *layer xs)) -> (h, ys) over the layers.

    weights: base weights stacked [L, …] (frozen); xs: a tuple of the other per-layer
    pytrees (LoRA, attention state) stacked likewise. remat: recompute each layer in the
    backward pass except the attention kernel's output and log-sum-exp (O(S·Q·H) per layer
    saved buys not running attention twice). unroll: unroll the loop (a Python loop) —
    each layer then reads static slices of the stacks and writes its saved activations
    apart, where a rolled loop dynamic-slices every stack and dynamic-update-slices every
    saved activation into an [L, …] stack, each a copy (on XLA:CPU ~10 % of a small
    model's training step); it costs compile time ∝ L (see unroll_layers).

    On XLA:CPU the low-precision (bf16 / f16) weights are not scanned but indexed inside
    the body (_layer_of), each stack passed with the layer index through an optimization
    barrier: XLA:CPU has no bf16 dynamic-slice, so its float normalization slices an f32
    conversion of the whole stack, and loop-invariant code motion hoists that conversion
    out of the loop — an f32 copy of every stacked weight (twice the bf16 layers, 13 GB at
    Qwen3-8B's shape, benchmarks/memory.py). Tied to the index, the conversion is no longer
    loop-invariant; it stays fused with the slice and converts one layer at a time.
    (Slicing a uint16 view instead does not help: the hoisted bitcast is a copy too.)
    """
    leaves, tree = jax.tree.flatten(weights)
    held = [
        jax.default_backend() == "cpu"
        and x.dtype.itemsize == 2
        and jnp.issubdtype(x.dtype, jnp.floating)
        for x in leaves
    ]
    stacks = [x for x, h_ in zip(leaves, held) if h_]
    n_layers = jax.tree.leaves((weights, xs))[0].shape[0]

    def step(h, args):
        index, scanned, layer_xs = args
        scanned, stacked = iter(scanned), iter(stacks)
        layer = tree.unflatten(
            [_layer_of(next(stacked), index) if h_ else next(scanned) for h_ in held]
        )
        return body(h, (layer, *layer_xs))

    if remat:
        policy = jax.checkpoint_policies.save_only_these_names(*attention_lib.SAVED_NAMES)
        step = jax.checkpoint(step, prevent_cse=False, policy=policy)
    scanned = [x for x, h_ in zip(leaves, held) if not h_]
    per_layer = (jnp.arange(n_layers), scanned, xs)
    if not unroll:
        return jax.lax.scan(step, h, per_layer)
    # Unrolled as a Python loop over static layer indices: lax.scan of a single layer
    # (a hybrid model's run of one) keeps its loop whatever its unroll.
    ys = []
    for i in range(n_layers):
        h, y = step(h, jax.tree.map(lambda x, i=i: x[i], per_layer))
        ys.append(y)
    return h, jax.tree.map(lambda *y: jnp.stack(y), *ys)


def _layer_of(stack_LxN, index):
    """stack[index], the stack tied to the (loop-variant) index by a barrier (see
    scan_layers)."""
    stack_LxN, index = jax.lax.optimization_barrier((stack_LxN, index))
    return jax.lax.dynamic_index_in_dim(stack_LxN, index, 0, keepdims=False)


@dataclasses.dataclass(frozen=True, eq=False)  # holds strategies over arrays: by identity
class Pass:
    """How one hidden_states call runs its layers: the pieces each use passes in. Built
    once per call site, inside the traced function (never a static argument).

    attend: the attention strategy (attention.cp_attend(segment_S, position_S, …) for
    training, kv_cache.prefill_attend / decode_attend, paged.paged_attend). mix: the
    sequence-mixing strategy of a hybrid model's Gated DeltaNet layers (delta_rule.cp_mix
    for training and prefill, delta_rule.StepMix for decode); None for other models. mlp:
    the MLP block of dense layers (dense_mlp); MoE layers (cfg.moe_layers) use moe_mlp.
    remat: rematerialise each layer in the backward pass (all but the attention kernel's
    output and lse). unroll: unroll the layer scans (scan_layers; a hybrid model's runs each).
    layers: layer_slices(cfg, params, lora) taken by the caller — the layers then run
    unrolled on those slices (params["layers"] and lora's layer modules are not read);
    inference only. count_S: bool [S], the tokens whose MoE routing to record (training
    passes its real tokens), or None: no routing statistics.
    """

    attend: attention_lib.Attend
    mix: Any = None
    mlp: Any = dense_mlp
    remat: bool = False
    unroll: bool = False
    layers: tuple | None = None
    count_S: Any = None


# hidden_states' keyword arguments before Pass held them (and their defaults then).
_LEGACY_PASS = {"attend": None, "mix": None, "mlp": dense_mlp, "remat": True, "unroll": False}
_LEGACY_PASS |= {"layers": None, "count_S": None}


def _legacy_pass(attend, legacy: dict) -> Pass:
    """A Pass from hidden_states' old call form (attend positional or keyword, the options
    as keywords), with a DeprecationWarning."""
    unknown = set(legacy) - set(_LEGACY_PASS)
    if unknown:
        raise TypeError(f"hidden_states() got unexpected keyword arguments {sorted(unknown)}")
    if "attend" in legacy and attend is not None:
        raise TypeError("hidden_states() got multiple values for argument 'attend'")
    warnings.warn(
        "hidden_states(…, attend, …, remat=, mlp=, mix=, unroll=, layers=, count_S=) is "
        "deprecated: pass a model.Pass(attend, …) as its fifth argument",
        DeprecationWarning,
        stacklevel=3,
    )
    fields = _LEGACY_PASS | legacy
    if attend is not None:
        fields["attend"] = attend
    return Pass(**fields)


def hidden_states(
    cfg: QwenConfig,
    params,
    tokens_S,
    position_S,
    run: Pass | None = None,
    lora=None,
    route: lora_lib.Routing | None = None,
    *,
    attn_state=None,
    **legacy,
):
    """Hidden(final-norm hidden states [S, D] of this shard's tokens, new attention state,
    the routing statistics when run.count_S is given, else None).

    params: this shard's base weights (see param_shapes); run: how the layers run (Pass:
    the attention and mixing strategies, the MLP block, remat, unrolling, which tokens'
    routing to record); lora: active adapters {module: {"a": [L, A, I, R], "b": [L, A, R,
    O]}} or None; route: their token spans. attn_state: per-layer attention state stacked
    on a leading [L] axis (None, an empty pytree, for training), scanned with the weights
    and returned likewise. MoE layers (cfg.moe_layers) use moe_mlp, each run of same-kind
    layers scanned on its own. Layers run under lax.scan (compile time independent of
    depth) unless run.layers holds layer slices (attn_state is then sliced and restacked
    per layer). Given run.count_S, router_stats is moe.RouterStats of this shard's counted
    tokens stacked over the MoE layers in order ([Lm, E] each, local: not summed over dp /
    cp), None for a dense model. Hybrid layers run as scans over runs of one kind; a hybrid
    model's attn_state is a HybridState: the full-attention layers' states stacked [Lf, …]
    and the linear layers' delta_rule.Recurrent stacked [Ll, …]; its result likewise.

    The old call form (attend in run's place, the options as keywords: remat=, mlp=, mix=,
    unroll=, layers=, count_S=) still works, with a DeprecationWarning.
    """
    if legacy or not isinstance(run, Pass):
        run = _legacy_pass(run, legacy)
    if run.layers is not None and cfg.is_hybrid:
        raise NotImplementedError("unrolled layer slices of a hybrid model")
    h = embed(params["embed"], tokens_S).astype(jnp.dtype(cfg.dtype))
    layer_lora, expert_lora = _split_lora(lora)
    stack = _Layers.of(cfg, params, run, route, position_S)
    if run.layers is not None:
        return _unrolled_hidden(stack, h, run.layers, attn_state)
    if cfg.is_hybrid:
        return _hybrid_hidden(stack, h, layer_lora, expert_lora, attn_state)
    if not cfg.is_moe:
        h, (attn_state, _) = scan_layers(
            stack.body, h, params["layers"], (layer_lora, attn_state), run.remat, run.unroll
        )
        return stack.finish(h, attn_state, [])
    return _moe_hidden(stack, h, layer_lora, expert_lora, attn_state)


@dataclasses.dataclass(frozen=True, eq=False)  # holds arrays: hashed by identity
class _Layers:
    """What every layer of one hidden_states call shares (its arguments, the LayerInputs
    with the rotary tables taken once, the MoE block), and the steps its paths share:
    `body`, one dense or MoE layer as a scan step, and `finish`, the final norm and the
    routing records."""

    cfg: QwenConfig
    params: Any
    inputs: LayerInputs
    mlp: Any
    moe_block: Any
    mix: Any
    remat: bool
    unroll: bool
    record: bool

    @classmethod
    def of(cls, cfg: QwenConfig, params, run: Pass, route, position_S) -> _Layers:
        """The layers of one call that runs as `run` says."""
        count_S = run.count_S
        return cls(
            cfg=cfg,
            params=params,
            inputs=LayerInputs.of(cfg, route, position_S, run.attend),  # rotary once, for all
            mlp=run.mlp,
            moe_block=moe_mlp if count_S is None else functools.partial(moe_mlp, count_S=count_S),
            mix=run.mix,
            remat=run.remat,
            unroll=run.unroll,
            record=count_S is not None,
        )

    def body(self, h, xs):
        layer, lora_layer, state = xs
        block = self.moe_block if "router" in layer else self.mlp
        h, state, record = decoder_layer(self.cfg, h, layer, lora_layer, self.inputs, state, block)
        return h, (state, record)

    def finish(self, h, attn_state, records) -> Hidden:
        """The final norm, and the MoE layers' records (one [n, E] stack per run) joined."""
        h = rms_norm(h, self.params["final_norm"], self.cfg.rms_norm_eps)
        stats = (
            jax.tree.map(lambda *xs: jnp.concatenate(xs), *records)
            if records and self.record
            else None
        )
        return Hidden(h, attn_state, stats)


def hidden_span(
    cfg: QwenConfig,
    params,
    x,
    position_S,
    run: Pass,
    lora=None,
    route: lora_lib.Routing | None = None,
    *,
    start: int,
    stop: int,
):
    """Layers [start, stop) of a dense model's hidden_states (training: no attention
    state, no routing records): x is the tokens [S] when start is 0 (embedded first), else
    the hidden states [S, D] the layers before start left; the final norm follows when stop
    is the last layer. -> [S, D]. Chained over consecutive spans it computes what
    hidden_states(...).h_SxD does, layer by layer the same operations, so that a pass can
    run as two programs (train_step.make_forward_halves)."""
    if cfg.is_moe or cfg.is_hybrid or run.layers is not None or run.count_S is not None:
        raise NotImplementedError("hidden_span: a dense model's scanned layers only")
    if not 0 <= start < stop <= cfg.num_layers:
        raise ValueError(f"hidden_span: layers [{start}, {stop}) of {cfg.num_layers}")
    h = embed(params["embed"], x).astype(jnp.dtype(cfg.dtype)) if start == 0 else x
    layer_lora, _ = _split_lora(lora)
    span = lambda tree: jax.tree.map(lambda a: a[start:stop], tree)  # noqa: E731
    stack = _Layers.of(cfg, params, run, route, position_S)
    h, _ = scan_layers(
        stack.body, h, span(params["layers"]), (span(layer_lora), None), run.remat, run.unroll
    )
    return stack.finish(h, None, []).h_SxD if stop == cfg.num_layers else h


def _unrolled_hidden(run: _Layers, h, layers, attn_state) -> Hidden:
    """hidden_states over layer_slices: each layer unrolled on its own arrays, attn_state
    sliced and restacked per layer."""
    states, records = [], []
    for i, (layer, lora_layer) in enumerate(layers):
        state = jax.tree.map(lambda x: x[i], attn_state)
        h, (state, record) = run.body(h, (layer, lora_layer, state))
        states.append(state)
        if record is not None:
            records.append(jax.tree.map(lambda x: x[None], record))
    attn_state = jax.tree.map(lambda *xs: jnp.stack(xs), *states)
    return run.finish(h, attn_state, records)


def _moe_hidden(run: _Layers, h, layer_lora, expert_lora, attn_state) -> Hidden:
    """hidden_states of a MoE model: MoE and dense layers have different MLP weights, so
    each run of same-kind layers is its own scan over its slice of the stacks (one scan
    when every layer is MoE)."""
    params = run.params
    states, records = [], []
    for is_moe, start, end, first in kind_runs(run.cfg.moe_layers):
        cut = lambda t, a=start, b=end: jax.tree.map(lambda x: x[a:b], t)
        cut_kind = lambda t, a=first, n=end - start: jax.tree.map(lambda x: x[a : a + n], t)
        mlp_w = cut_kind(params["moe_mlp" if is_moe else "dense_mlp"])
        lora_w = (
            None
            if layer_lora is None
            else {**cut(layer_lora), **(cut_kind(expert_lora) if is_moe else {})}
        )
        h, (state, record) = scan_layers(
            run.body,
            h,
            {**cut(params["layers"]), **mlp_w},
            (lora_w, cut(attn_state)),
            run.remat,
            run.unroll,
        )
        states.append(state)
        if is_moe and run.record:
            records.append(record)
    attn_state = jax.tree.map(lambda *xs: jnp.concatenate(xs), *states)
    return run.finish(h, attn_state, records)


def kind_runs(kinds) -> tuple[tuple[bool, int, int, int], ...]:
    """Maximal runs of consecutive layers of one kind: (kind, start, end, first) with layers
    [start, end) and `first` their index among the layers of that kind.
    Example: (lin, lin, lin, full) -> ((True, 0, 3, 0), (False, 3, 4, 0))."""
    runs, seen = [], {}
    for i, kind in enumerate(kinds):
        if runs and runs[-1][0] == kind:
            runs[-1][2] = i + 1
        else:
            runs.append([kind, i, i + 1, seen.get(kind, 0)])
        seen[kind] = seen.get(kind, 0) + 1
    return tuple(tuple(r) for r in runs)


class HybridState(NamedTuple):
    """A hybrid model's per-layer state: full, the full-attention layers' attention states
    stacked [Lf, …] (the attend strategy's); linear, the Gated DeltaNet layers'
    delta_rule.Recurrent stacked [Ll, …]. Either is None where nothing is carried."""

    full: Any
    linear: Any


def _concat(parts):
    """The runs' stacked states joined along the layer axis (None when none carries one)."""
    parts = [p for p in parts if p is not None and jax.tree.leaves(p)]
    return jax.tree.map(lambda *xs: jnp.concatenate(xs), *parts) if parts else None


def _hybrid_hidden(run: _Layers, h, layer_lora, expert_lora, state: HybridState | None) -> Hidden:
    """hidden_states of a hybrid model: each run of same-kind layers (gated full attention
    or Gated DeltaNet) one lax.scan over its slice of `layers` (norms, MLP), of its kind's
    mixer weights (full_attn [Lf, …] / linear_attn [Ll, …]) and of its kind's state. A
    hybrid MoE model (Qwen3.5-MoE) has MoE MLPs in every layer: moe_mlp [L, …] and the
    experts' LoRA are cut like `layers`; run.record: collect their routing statistics."""
    cfg, params = run.cfg, run.params
    mlp = run.moe_block if cfg.is_moe else run.mlp

    def body_of(linear):
        def body(h, xs):
            layer, lora_layer, st = xs
            route = run.inputs.route
            if linear:
                a_SxD, st = linear_attention_block(cfg, h, layer, lora_layer, route, run.mix, st)
            else:
                a_SxD, st = attention_block(cfg, h, layer, lora_layer, run.inputs, st)
            h = h + a_SxD
            y_SxD, stats = mlp(cfg, h, layer, lora_layer, route)
            return h + y_SxD, (st, stats)

        return body

    state = state or HybridState(None, None)
    outs = {False: [], True: []}
    records = []
    for linear, start, end, first in kind_runs(cfg.linear_layers):
        cut = lambda t, a=start, b=end: jax.tree.map(lambda x: x[a:b], t)
        cut_kind = lambda t, a=first, n=end - start: jax.tree.map(lambda x: x[a : a + n], t)
        mixer = cut_kind(params["linear_attn" if linear else "full_attn"])
        st = cut_kind(state.linear if linear else state.full)
        # LoRA likewise: the MLP's factors are [L, …], the mixer's per kind (lora.LINEAR
        # [Ll, …], lora.ATTN [Lf, …]; lora.module_layer_ids).
        lora_w = (
            None
            if layer_lora is None
            else {
                **cut({m: x for m, x in layer_lora.items() if m in lora_lib.MLP}),
                **cut_kind(
                    {
                        m: x
                        for m, x in layer_lora.items()
                        if m in (lora_lib.LINEAR if linear else lora_lib.ATTN)
                    }
                ),
                **cut(expert_lora or {}),
            }
        )
        mlp_w = cut(params["moe_mlp"]) if cfg.is_moe else {}
        h, (out, stats) = scan_layers(
            body_of(linear),
            h,
            {**cut(params["layers"]), **mixer, **mlp_w},
            (lora_w, st),
            run.remat,
            run.unroll,
        )
        outs[linear].append(out)
        if run.record:
            records.append(stats)
    return run.finish(h, HybridState(_concat(outs[False]), _concat(outs[True])), records)


def unembed_factors(
    params, h_SxD, lora=None, route: lora_lib.Routing | None = None
) -> logprobs_lib.Unembedding:
    """The factors of the logits (logprobs.Unembedding), vocab split over tp.

    Base: h [S, D] @ W [D, V/tp] (W = lm_head, or embed^T when tied). LoRA on lm_head:
    grouped (route.tiles), each row's (h @ lora_a[a])·scale[a] times its own adapter's
    lora_b only (logprobs.HeadLora, by tiles); dense (a few adapters), [S, A·R] @ [A·R,
    V/tp]: each row's values in its own adapter's R columns, zero elsewhere, times the
    stacked lora_b. losses.target_logprobs / prompt_stats consume these.
    """
    w_DxV = params["lm_head"] if "lm_head" in params else params["embed"].T
    if lora is None or lora_lib.HEAD not in lora:
        return logprobs_lib.Unembedding((h_SxD,), (w_DxV,))
    a, b = lora[lora_lib.HEAD]["a"], lora[lora_lib.HEAD]["b"]
    if route.tiles is not None:
        return logprobs_lib.Unembedding((h_SxD,), (w_DxV,), lora_lib.head_lora(h_SxD, a, b, route))
    u = lora_lib.low_rank_input(h_SxD, a, route).astype(h_SxD.dtype)
    return logprobs_lib.Unembedding((h_SxD, u), (w_DxV, b.reshape(-1, b.shape[-1])))
