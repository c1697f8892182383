"""The decoder's blocks, one layer at a time on this shard: RMSNorm, RoPE, embedding, the
attention block (gated, partial RoPE for Qwen3.5), the Gated DeltaNet block, the dense and
MoE MLP blocks, and the pre-norm layer that joins attention and MLP.

Each block takes this layer's slice of the stacked weights and of the active adapters;
the differing piece of each use is passed in (the attention strategy `attend`, the
sequence mixing `mix`, the MLP block). jcp.model.decoder runs them over the layer stack
(and re-exports them). They never compute the unembedding's logits and never update base
weights.

Shapes: see the legend in jcp/mesh.py. Under tp, the q/k/v projections hold this rank's
Q/tp and K/tp heads (widths Q·H and K·H), gate/up/down F/tp.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

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


@dataclasses.dataclass(frozen=True, eq=False)  # holds arrays: hashed by identity
class LayerInputs:
    """What every attention layer of one pass shares besides its weights: route (the
    active adapters' token spans, or None without LoRA), position_S (each token's position
    in its datum), attend (the attention strategy, attention.Attend) and rot (the rotary
    tables of position_S, taken once for all layers: `of`)."""

    route: lora_lib.Routing | None
    position_S: jax.Array
    attend: attention_lib.Attend
    rot: Rotary

    @classmethod
    def of(cls, cfg: QwenConfig, route, position_S, attend) -> LayerInputs:
        return cls(route, position_S, attend, rotary(position_S, cfg.rope_theta, cfg.rotary_dim))


def attention_block(cfg: QwenConfig, h_SxD, layer, lora_layer, inputs: LayerInputs, attn_state):
    """Pre-norm self-attention of one layer: (its output [S, D], psum'd over tp; new state).

    norm → q/k/v projections (+ bias, + LoRA) → qk-norm (Qwen3) → RoPE at position_S →
    attend(q [S, Q, H], k, v [S, K, H], attn_state) → o_proj (+ LoRA) → psum over tp.
    The caller adds the residual. layer / lora_layer: this layer's slice of the stacked
    weights and of the active adapters ({module: {"a": [A, I, R], "b": [A, R, O]}} or None).
    """
    route, rot = inputs.route, inputs.rot
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
    o_SxQxH, attn_state = inputs.attend(q_SxQxH, k_SxKxH, v_SxKxH, attn_state)
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
        moe_lib.ExpertWeights(layer["expert_gate"], layer["expert_up"], layer["expert_down"]),
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
    cfg: QwenConfig, h_SxD, layer, lora_layer, inputs: LayerInputs, attn_state, mlp=dense_mlp
):
    """One pre-norm decoder layer on this shard: (h + attention, then + mlp; new state; the
    mlp's record)."""
    a_SxD, attn_state = attention_block(cfg, h_SxD, layer, lora_layer, inputs, attn_state)
    h_SxD = h_SxD + a_SxD
    y_SxD, record = mlp(cfg, h_SxD, layer, lora_layer, inputs.route)
    return h_SxD + y_SxD, attn_state, record
