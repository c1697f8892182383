"""The Qwen2/Qwen3 decoder as a per-shard function (runs inside the one shard_map).

Owns the forward pass from tokens to final hidden states (over the parameter tree of
model.params). The layer is built from two blocks, attention and MLP, and the differing
piece of each use is passed in: the attention strategy (`attend`, see attention.Attend: training's CP attention, or
prefill / decode over a KV cache) and the MLP block (dense SwiGLU, or an MoE block with
the same signature). It must never compute the unembedding's full logits (losses.py does
that, chunked) and never update base weights: they are frozen and not differentiated.

Shapes: see the legend in jcp/mesh.py. Under tp, the q/k/v projections hold this rank's
Q/tp and K/tp heads (widths Q·H and K·H), gate/up/down F/tp.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jcp import attention as attention_lib
from jcp import delta_rule as delta_rule_lib
from jcp import lora as lora_lib
from jcp import mesh as mesh_lib
from jcp.config import QwenConfig
from jcp.mesh import TP
from jcp.model import moe as moe_lib


def rms_norm(x, w, eps):
    """RMSNorm in fp32 math, cast back to x's dtype, then scaled (as Hugging Face Qwen)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return w.astype(x.dtype) * xf.astype(x.dtype)


class Rotary(NamedTuple):
    """RoPE's per-token tables [S, R] (R = the rotary dims of a head): cos and sin of each
    token's angles, each frequency twice (the rotate-half layout)."""

    cos_SxR: jax.Array
    sin_SxR: jax.Array


def rotary(position_S, theta, rotary_dim) -> Rotary:
    """The Rotary tables of tokens at position_S (their position in their datum), computed
    once per call and shared by every layer's q and k.

    Held apart by a lax.cond: fused into their consumers, XLA:CPU took cos and sin once per
    element of q and k — every head of every layer, and again in the backward pass (~5 % of
    benchmarks/throughput.py's 8 × 512 CPU step), where the tables hold S · R of each.
    """

    def tables(position_S):
        inv_freq = 1.0 / (theta ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim))
        ang = position_S.astype(jnp.float32)[:, None] * inv_freq[None, :]
        ang = jnp.concatenate([ang, ang], axis=-1)
        return Rotary(jnp.cos(ang), jnp.sin(ang))

    # Both branches compute the tables: the cond only keeps XLA from fusing them into
    # their consumers (an optimization barrier does not: XLA:CPU removes it before fusion).
    return jax.lax.cond(position_S.shape[0] > 0 and position_S[0] >= -1, tables, tables, position_S)


def rope(x, rot: Rotary):
    """Rotary embedding, rotate-half form, by the tokens' Rotary tables.

    x: [S, heads, H] (q with Q heads or k with K heads), H the tables' width.
    """
    cos, sin = rot.cos_SxR[:, None, :], rot.sin_SxR[:, None, :]
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    turned = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos + turned * sin).astype(x.dtype)


def partial_rope(x, rot: Rotary):
    """rope on the first R dims of each head, R the tables' width (Qwen3.5's
    partial_rotary_factor); the rest pass unchanged."""
    rotary_dim = rot.cos_SxR.shape[-1]
    if rotary_dim == x.shape[-1]:
        return rope(x, rot)
    turned = rope(x[..., :rotary_dim], rot)
    return jnp.concatenate([turned, x[..., rotary_dim:]], axis=-1)


def embed(embed_VxD, tokens_S):
    """Vocab-parallel lookup: each tp rank holds V/tp rows; psum over "tp" combines them."""
    v_local = embed_VxD.shape[0]
    local = tokens_S - jax.lax.axis_index(TP) * v_local
    inside = (local >= 0) & (local < v_local)
    rows = jnp.take(embed_VxD, jnp.where(inside, local, 0), axis=0)
    return jax.lax.psum(jnp.where(inside[:, None], rows, 0), TP)


def _linear(x_SxI, w_IxO, lora_ab, route, bias_O=None):
    """x @ W (+ bias) (+ each token's own LoRA update) in x's dtype: [S, O]."""
    y = jnp.einsum("si,io->so", x_SxI, w_IxO.astype(x_SxI.dtype))
    if bias_O is not None:
        y = y + bias_O.astype(x_SxI.dtype)
    if lora_ab is not None:
        y = y + lora_lib.delta(x_SxI, lora_ab["a"], lora_ab["b"], route)
    return y


def _lora(lora_layer, module):
    """One module's {"a", "b"} of this layer's active adapters, or None without LoRA (or
    when the table has no such module: a MoE model's dense-layer MLP)."""
    return None if lora_layer is None else lora_layer.get(module)


def attention_block(
    cfg: QwenConfig,
    h_SxD,
    layer,
    lora_layer,
    route: lora_lib.Routing | None,
    position_S,
    attend: attention_lib.Attend,
    attn_state,
    rot: Rotary | None = None,
):
    """Pre-norm self-attention of one layer: (its output [S, D], psum'd over tp; new state).

    norm → q/k/v projections (+ bias, + LoRA) → qk-norm (Qwen3) → RoPE at position_S →
    attend(q [S, Q, H], k, v [S, K, H], attn_state) → o_proj (+ LoRA) → psum over tp.
    The caller adds the residual. layer / lora_layer: this layer's slice of the stacked
    weights and of the active adapters ({module: {"a": [A, I, R], "b": [A, R, O]}} or None).
    rot: rotary(position_S, …) taken once for all layers by the caller, or None (taken here).
    """
    if rot is None:
        rot = rotary(position_S, cfg.rope_theta, cfg.rotary_dim)
    s_len = h_SxD.shape[0]
    x_SxD = rms_norm(h_SxD, layer["input_norm"], cfg.rms_norm_eps)
    q = _linear(x_SxD, layer["q_proj"], _lora(lora_layer, "q_proj"), route, layer.get("q_bias"))
    k = _linear(x_SxD, layer["k_proj"], _lora(lora_layer, "k_proj"), route, layer.get("k_bias"))
    v = _linear(x_SxD, layer["v_proj"], _lora(lora_layer, "v_proj"), route, layer.get("v_bias"))
    gate_SxQH = None
    if cfg.attn_output_gate:  # per head [query | gate] (transformers' torch.chunk)
        q_gate = q.reshape(s_len, -1, 2 * cfg.head_dim)
        q, gate_SxQH = q_gate[..., : cfg.head_dim], q_gate[..., cfg.head_dim :]
        gate_SxQH = gate_SxQH.reshape(s_len, -1)
    q_SxQxH = q.reshape(s_len, -1, cfg.head_dim)
    k_SxKxH = k.reshape(s_len, -1, cfg.head_dim)
    v_SxKxH = v.reshape(s_len, -1, cfg.head_dim)
    if cfg.qk_norm:
        q_SxQxH = rms_norm(q_SxQxH, layer["q_norm"], cfg.rms_norm_eps)
        k_SxKxH = rms_norm(k_SxKxH, layer["k_norm"], cfg.rms_norm_eps)
    q_SxQxH = partial_rope(q_SxQxH, rot)
    k_SxKxH = partial_rope(k_SxKxH, rot)
    o_SxQxH, attn_state = attend(q_SxQxH, k_SxKxH, v_SxKxH, attn_state)
    o_SxQH = o_SxQxH.reshape(s_len, -1)
    if gate_SxQH is not None:
        o_SxQH = o_SxQH * jax.nn.sigmoid(gate_SxQH)
    o_SxD = _linear(o_SxQH, layer["o_proj"], _lora(lora_layer, "o_proj"), route)
    return jax.lax.psum(o_SxD, TP), attn_state


@jax.named_scope("gated_delta_net")  # names its ops in compiled programs (memory reports)
def linear_attention_block(
    cfg: QwenConfig, h_SxD, layer, lora_layer, route: lora_lib.Routing | None, mix, state=None
):
    """Pre-norm Gated DeltaNet of one layer (Qwen3.5's linear attention): (its output
    [S, D], psum'd over tp; its outgoing state).

    state: the layer's incoming delta_rule.Recurrent (decode: one row per sequence) or None
    (training, prefill); the outgoing one is the mix's (None in training; prefill hands out
    each piece's, decode each row's).

    norm → in_proj q, k, v (this rank's heads) → mix.conv (depthwise causal conv + SiLU over
    each datum) → L2-normalised q, k → β = sigmoid(b), g = −exp(A_log)·softplus(a + dt_bias)
    → mix.rule (the gated delta rule over each datum, delta_rule.CPMix in training) →
    RMSNorm gated by SiLU(z) → out_proj → psum over tp. The caller adds the residual.
    """
    s_len = h_SxD.shape[0]
    x_SxD = rms_norm(h_SxD, layer["input_norm"], cfg.rms_norm_eps)
    lin = lambda m: _linear(x_SxD, layer[m], _lora(lora_layer, m), route)  # noqa: E731
    q, k, v = lin("in_proj_q"), lin("in_proj_k"), lin("in_proj_v")
    qkv_lora = _lora(lora_layer, lora_lib.QKV)
    if qkv_lora is not None:  # one A, its B split into this rank's q, k, v columns
        u_QxR = lora_lib.low_rank_input(x_SxD, qkv_lora["a"], route)
        q, k, v = (
            y + lora_lib.expand(u_QxR, qkv_lora[b], route, y.dtype)
            for y, b in zip((q, k, v), lora_lib.QKV_B)
        )
    widths = (q.shape[1], k.shape[1])
    mixed, conv_state = mix.conv(
        jnp.concatenate([q, k, v], axis=-1),
        jnp.concatenate([layer["conv_q"], layer["conv_k"], layer["conv_v"]], -1),
        None if state is None else state.conv,
    )
    q, k, v = jnp.split(mixed, [widths[0], widths[0] + widths[1]], axis=-1)
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    q_SxHkxDk = delta_rule_lib.l2norm(q.reshape(s_len, -1, dk))
    k_SxHkxDk = delta_rule_lib.l2norm(k.reshape(s_len, -1, dk))
    v_SxHxDv = v.reshape(s_len, -1, dv)
    beta_SxH = jax.nn.sigmoid(lin("in_proj_b")).astype(jnp.float32)
    g_SxH = -jnp.exp(layer["a_log"].astype(jnp.float32)) * jax.nn.softplus(
        lin("in_proj_a").astype(jnp.float32) + layer["dt_bias"].astype(jnp.float32)
    )
    o_SxHxDv, ssm_state = mix.rule(
        q_SxHkxDk, k_SxHkxDk, v_SxHxDv, g_SxH, beta_SxH, None if state is None else state.ssm
    )
    o_SxHxDv = o_SxHxDv.astype(x_SxD.dtype)
    z_SxHxDv = lin("in_proj_z").reshape(s_len, -1, dv)
    normed = rms_norm(o_SxHxDv, layer["gated_norm"], cfg.rms_norm_eps)
    gated = normed.astype(jnp.float32) * jax.nn.silu(z_SxHxDv.astype(jnp.float32))
    o_SxD = _linear(
        gated.astype(x_SxD.dtype).reshape(s_len, -1),
        layer["out_proj"],
        _lora(lora_layer, "out_proj"),
        route,
    )
    new = None if ssm_state is None else delta_rule_lib.Recurrent(conv_state, ssm_state)
    return jax.lax.psum(o_SxD, TP), new


def dense_mlp(cfg: QwenConfig, h_SxD, layer, lora_layer, route: lora_lib.Routing | None):
    """Pre-norm SwiGLU MLP of one layer: (down(silu(gate(x)) · up(x)), psum'd over tp [S, D];
    its record, None).

    The MLP strategy of decoder_layer; an MoE block with this signature can replace it.
    A block returns its output and a per-layer record (a pytree the layer scan stacks;
    moe_mlp's routing statistics). The caller adds the residual.
    """
    x_SxD = rms_norm(h_SxD, layer["post_norm"], cfg.rms_norm_eps)
    g_SxF = _linear(x_SxD, layer["gate_proj"], _lora(lora_layer, "gate_proj"), route)
    u_SxF = _linear(x_SxD, layer["up_proj"], _lora(lora_layer, "up_proj"), route)
    y_SxD = _linear(
        jax.nn.silu(g_SxF) * u_SxF, layer["down_proj"], _lora(lora_layer, "down_proj"), route
    )
    return jax.lax.psum(y_SxD, TP), None


def moe_mlp(
    cfg: QwenConfig, h_SxD, layer, lora_layer, route: lora_lib.Routing | None, count_S=None
):
    """Pre-norm sparse MoE MLP of one layer (Qwen3-MoE): (output psum'd over tp [S, D];
    moe.RouterStats [E] of the tokens where count_S (bool [S]), or None without count_S).

    Same signature as dense_mlp (count_S bound by the caller). A shared expert
    (cfg.shared_expert_intermediate_size, Qwen3.5-MoE) is added to every token, gated by
    sigmoid(x · shared_expert_gate); it is not adapted. h is identical on every tp
    rank, so every rank routes alike (moe.route: softmax in fp32, top-k, renormalised when
    cfg.norm_topk_prob), runs only its own E/tp experts (layer["expert_*"]: [E/tp, …]) on
    the rows routed to them, dropless, and the psum over tp adds the ranks' parts. The
    experts' LoRA factors (lora_layer["expert_*"], see moe.experts) are split over tp with
    their experts; the router is not adapted. The caller adds the residual.
    """
    x_SxD = rms_norm(h_SxD, layer["post_norm"], cfg.rms_norm_eps)
    weights_SxX, experts_SxX = moe_lib.route(
        x_SxD, layer["router"], cfg.num_experts_per_tok, cfg.norm_topk_prob
    )
    # The same tp-invariant routing on every rank: its statistics need no collective here.
    stats = (
        None
        if count_S is None
        else moe_lib.router_stats(
            moe_lib.router_probs(x_SxD, layer["router"]), experts_SxX, count_S
        )
    )
    num_local = layer["expert_gate"].shape[0]
    # x is invariant over tp but each rank uses its own rows of it: cast it to varying
    # explicitly so its cotangent is psum'd over tp by that cast's transpose. Left to the
    # implicit casts, the gradient w.r.t. x came out wrong at tp > 1 (jax 0.10.2; caught by
    # test_moe's two-mesh gradient test; a lone gather or scatter at varying indices
    # transposes correctly, the combination in moe.experts did not). The shared-outer
    # factors (replicated, used by every rank's experts) are cast likewise.
    lora = None
    if lora_layer is not None and lora_lib.EXPERT[0] in lora_layer:
        lora = jax.tree.map(
            lambda w: mesh_lib.vary(w, (TP,)), {m: lora_layer[m] for m in lora_lib.EXPERT}
        )
    y_SxD = moe_lib.experts(
        mesh_lib.vary(x_SxD, (TP,)),
        weights_SxX,
        experts_SxX,
        layer["expert_gate"],
        layer["expert_up"],
        layer["expert_down"],
        jax.lax.axis_index(TP) * num_local,
        lora,
        route,
    )
    if "shared_gate" in layer:
        # Qwen3.5-MoE's shared expert: this rank's F/tp of a SwiGLU MLP (row-parallel down,
        # summed by the psum below), scaled by the tp-invariant sigmoid(x · w_gate).
        shared_SxD = jnp.einsum(
            "sf,fd->sd",
            jax.nn.silu(x_SxD @ layer["shared_gate"].astype(x_SxD.dtype))
            * (x_SxD @ layer["shared_up"].astype(x_SxD.dtype)),
            layer["shared_down"].astype(x_SxD.dtype),
        )
        gate_Sx1 = jax.nn.sigmoid(x_SxD @ layer["shared_expert_gate"].astype(x_SxD.dtype))
        y_SxD = y_SxD + (gate_Sx1 * shared_SxD).astype(y_SxD.dtype)
    return jax.lax.psum(y_SxD, TP), stats


def decoder_layer(
    cfg: QwenConfig,
    h_SxD,
    layer,
    lora_layer,
    route: lora_lib.Routing | None,
    position_S,
    attend: attention_lib.Attend,
    attn_state,
    mlp=dense_mlp,
    rot: Rotary | None = None,
):
    """One pre-norm decoder layer on this shard: (h + attention, then + mlp; new state; the
    mlp's record). rot: as attention_block's."""
    a_SxD, attn_state = attention_block(
        cfg, h_SxD, layer, lora_layer, route, position_S, attend, attn_state, rot
    )
    h_SxD = h_SxD + a_SxD
    y_SxD, record = mlp(cfg, h_SxD, layer, lora_layer, route)
    return h_SxD + y_SxD, attn_state, record


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
    step; pass the result to hidden_states(…, layers=…)."""
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
    saved buys not running attention twice). unroll: unroll the loop (lax.scan's unroll) —
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
    return jax.lax.scan(
        step, h, (jnp.arange(n_layers), scanned, xs), unroll=n_layers if unroll else 1
    )


def _layer_of(stack_LxN, index):
    """stack[index], the stack tied to the (loop-variant) index by a barrier (see
    scan_layers)."""
    stack_LxN, index = jax.lax.optimization_barrier((stack_LxN, index))
    return jax.lax.dynamic_index_in_dim(stack_LxN, index, 0, keepdims=False)


def hidden_states(
    cfg: QwenConfig,
    params,
    tokens_S,
    position_S,
    attend: attention_lib.Attend,
    lora=None,
    route: lora_lib.Routing | None = None,
    *,
    attn_state=None,
    mlp=dense_mlp,
    remat: bool = True,
    layers=None,
    count_S=None,
    mix=None,
    unroll: bool = False,
):
    """Hidden(final-norm hidden states [S, D] of this shard's tokens, new attention state,
    the routing statistics when count_S is given, else None).

    params: this shard's base weights (see param_shapes); lora: active adapters
    {module: {"a": [L, A, I, R], "b": [L, A, R, O]}} or None; route: their token spans.
    attend: the attention strategy (attention.cp_attend(segment_S, position_S, …) for
    training); attn_state: per-layer attention state stacked on a leading [L] axis (None,
    an empty pytree, for training), scanned with the weights and returned likewise.
    mlp: the MLP block of dense layers (dense_mlp); MoE layers (cfg.moe_layers) use
    moe_mlp, each run of same-kind layers scanned on its own. Layers run under lax.scan
    (compile time independent of depth), each rematerialised in the backward pass when
    `remat` (all but the attention kernel's output and lse). layers: layer_slices(cfg, params,
    lora) taken by the caller — the layers then run unrolled on those slices
    (params["layers"] and lora's layer modules are not read; attn_state is sliced and
    restacked per layer); inference only. count_S: bool [S], the tokens whose routing to
    record (training passes its real tokens), or None; given, router_stats is
    moe.RouterStats of this shard's counted tokens stacked over the MoE layers in order
    ([Lm, E] each, local: not summed over dp / cp), None for a dense model.
    mix: the sequence-mixing strategy of a hybrid model's Gated DeltaNet layers
    (delta_rule.cp_mix for training and prefill, delta_rule.StepMix for decode); hybrid
    layers run as scans over runs of one kind. A hybrid model's attn_state is a
    HybridState: the full-attention layers' states stacked [Lf, …] and the linear layers'
    delta_rule.Recurrent stacked [Ll, …]; its result likewise. unroll: unroll the layer
    scans of a dense or MoE model (scan_layers).
    """
    if layers is not None and cfg.is_hybrid:
        raise NotImplementedError("unrolled layer slices of a hybrid model")
    dtype = jnp.dtype(cfg.dtype)
    h = embed(params["embed"], tokens_S).astype(dtype)
    layer_lora, expert_lora = _split_lora(lora)
    moe_block = moe_mlp if count_S is None else functools.partial(moe_mlp, count_S=count_S)
    rot = rotary(position_S, cfg.rope_theta, cfg.rotary_dim)  # once, for every layer

    def body(h, xs):
        layer, lora_layer, state = xs
        block = moe_block if "router" in layer else mlp
        h, state, record = decoder_layer(
            cfg, h, layer, lora_layer, route, position_S, attend, state, block, rot
        )
        return h, (state, record)

    def finish(h, attn_state, records):
        """The final norm, and the MoE layers' records (one [n, E] stack per run) joined."""
        h = rms_norm(h, params["final_norm"], cfg.rms_norm_eps)
        stats = (
            jax.tree.map(lambda *xs: jnp.concatenate(xs), *records)
            if records and count_S is not None
            else None
        )
        return Hidden(h, attn_state, stats)

    if layers is not None:
        states, records = [], []
        for i, (layer, lora_layer) in enumerate(layers):
            state = jax.tree.map(lambda x: x[i], attn_state)
            h, (state, record) = body(h, (layer, lora_layer, state))
            states.append(state)
            if record is not None:
                records.append(jax.tree.map(lambda x: x[None], record))
        attn_state = jax.tree.map(lambda *xs: jnp.stack(xs), *states)
        return finish(h, attn_state, records)

    if cfg.is_hybrid:
        return _hybrid_hidden(
            cfg,
            params,
            h,
            position_S,
            attend,
            mix,
            layer_lora,
            route,
            moe_block if cfg.is_moe else mlp,
            remat,
            finish,
            expert_lora,
            count_S is not None,
            attn_state,
            rot,
        )
    if not cfg.is_moe:
        h, (attn_state, _) = scan_layers(
            body, h, params["layers"], (layer_lora, attn_state), remat, unroll
        )
        return finish(h, attn_state, [])
    # MoE and dense layers have different MLP weights, so each run of same-kind layers is
    # its own scan over its slice of the stacks (one scan when every layer is MoE).
    states, records = [], []
    for is_moe, start, end, first in kind_runs(cfg.moe_layers):
        cut = lambda t, a=start, b=end: jax.tree.map(lambda x: x[a:b], t)
        cut_kind = lambda t, a=first, n=end - start: jax.tree.map(lambda x: x[a : a + n], t)
        mlp_w = cut_kind(params["moe_mlp" if is_moe else "dense_mlp"])
        lora_w = (
            None
            if lora is None
            else {**cut(layer_lora), **(cut_kind(expert_lora) if is_moe else {})}
        )
        h, (state, record) = scan_layers(
            body, h, {**cut(params["layers"]), **mlp_w}, (lora_w, cut(attn_state)), remat, unroll
        )
        states.append(state)
        if is_moe and count_S is not None:
            records.append(record)
    attn_state = jax.tree.map(lambda *xs: jnp.concatenate(xs), *states)
    return finish(h, attn_state, records)


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


def _hybrid_hidden(
    cfg: QwenConfig,
    params,
    h,
    position_S,
    attend,
    mix,
    layer_lora,
    route,
    mlp,
    remat,
    finish,
    expert_lora=None,
    record=False,
    state: HybridState | None = None,
    rot: Rotary | None = None,
):
    """hidden_states of a hybrid model: each run of same-kind layers (gated full attention
    or Gated DeltaNet) one lax.scan over its slice of `layers` (norms, MLP), of its kind's
    mixer weights (full_attn [Lf, …] / linear_attn [Ll, …]) and of its kind's state. A
    hybrid MoE model (Qwen3.5-MoE) has MoE MLPs in every layer: moe_mlp [L, …] and the
    experts' LoRA are cut like `layers`; `record`: collect their routing statistics."""

    def body_of(linear):
        def body(h, xs):
            layer, lora_layer, st = xs
            if linear:
                a_SxD, st = linear_attention_block(cfg, h, layer, lora_layer, route, mix, st)
            else:
                a_SxD, st = attention_block(
                    cfg, h, layer, lora_layer, route, position_S, attend, st, rot
                )
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
            body_of(linear), h, {**cut(params["layers"]), **mixer, **mlp_w}, (lora_w, st), remat
        )
        outs[linear].append(out)
        if record:
            records.append(stats)
    return finish(h, HybridState(_concat(outs[False]), _concat(outs[True])), records)


def unembed_factors(params, h_SxD, lora=None, route: lora_lib.Routing | None = None):
    """(lefts, rights) with logits = Σ lefts[i] @ rights[i], rights split over vocab.

    Base: h [S, D] @ W [D, V/tp] (W = lm_head, or embed^T when tied); LoRA on lm_head adds
    [S, A·R] @ [A·R, V/tp]: each token's (h @ lora_a[a])·scale[a] in its own adapter a's
    R columns, zero elsewhere, times the stacked lora_b. losses.target_logprobs consumes
    these.
    """
    w_DxV = params["lm_head"] if "lm_head" in params else params["embed"].T
    lefts, rights = [h_SxD], [w_DxV]
    if lora is not None and lora_lib.HEAD in lora:
        head = lora[lora_lib.HEAD]
        lefts.append(lora_lib.stacked_input(h_SxD, head["a"], route).astype(h_SxD.dtype))
        rights.append(head["b"].reshape(-1, head["b"].shape[-1]))
    return tuple(lefts), tuple(rights)
