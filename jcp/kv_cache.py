"""The KV cache of sampling and its two attention strategies: prefill (writes) and decode
(reads).

Both are `attention.Attend` strategies passed to the one decoder (model.hidden_states), so
sampling runs the same layers, LoRA routing and CP attention as training. Prefill runs
training's CP attention over the packed zigzag streams and hands every layer's K/V out as
its new state; `to_cache` then lays those rows out as a per-sequence cache. Decode reads a
layer's cache, adds the step's own key, and hands the step's new K/V out; the caller
writes them into the cache once per step, outside the layer scan, so the scan never
copies the cache. This module must never hold weights or run the model itself.

Shapes: see the legend in jcp/mesh.py; here B = sequences of the decode batch on this
device and T = cache rows per sequence (row t holds position t). Einsum letters: b
sequence, t cache row, k kv heads, m query heads per kv head, h head dim.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jcp import attention as attention_lib


class KV(NamedTuple):
    """Keys and values of one layer (or, stacked on a leading [L], of every layer)."""

    k: jax.Array
    v: jax.Array


def prefill_attend(segment_S, position_S, *, implementation: str = "blockwise",
                   block: int = attention_lib.DEFAULT_BLOCK) -> attention_lib.Attend:
    """Training's CP attention over the packed streams; the new state is this rank's K/V.

    The incoming state is ignored (None: nothing is cached yet); the returned state is
    KV(k [S, K, H], v [S, K, H]) of this rank's stream rows (RoPE applied), which
    hidden_states stacks over layers to [L, S, K, H].
    """
    train = attention_lib.cp_attend(segment_S, position_S, implementation=implementation,
                                    block=block)

    def attend(q_SxQxH, k_SxKxH, v_SxKxH, state):
        out, _ = train(q_SxQxH, k_SxKxH, v_SxKxH, None)
        return out, KV(k_SxKxH, v_SxKxH)

    return attend


def _attend_one(q_KxMxH, k_TxKxH, v_TxKxH, k_new_KxH, v_new_KxH, length):
    """One sequence's query over its cache rows t < length and its own new key.

    Uses the blockwise kernel's online softmax: one update with the cache, one with the
    query's own key/value. Returns out [K, M, H] fp32.
    """
    kv_heads, per_kv, head_dim = q_KxMxH.shape
    scale = 1.0 / np.sqrt(head_dim)
    state = attention_lib.online_softmax_init(kv_heads, per_kv, 1, head_dim)
    s_KxMxT = jnp.einsum("kmh,tkh->kmt", q_KxMxH, k_TxKxH,
                         preferred_element_type=jnp.float32) * scale
    visible_T = jnp.arange(k_TxKxH.shape[0]) < length
    s_KxMxT = jnp.where(visible_T, s_KxMxT, -jnp.inf)
    state = attention_lib.online_softmax_update(state, s_KxMxT[:, :, None, :], v_TxKxH)
    s_self_KxM = jnp.einsum("kmh,kh->km", q_KxMxH, k_new_KxH,
                            preferred_element_type=jnp.float32) * scale
    state = attention_lib.online_softmax_update(state, s_self_KxM[:, :, None, None],
                                                v_new_KxH[None])
    out, _ = attention_lib.online_softmax_finish(state)
    return out[:, :, 0]


def decode_attend(position_B) -> attention_lib.Attend:
    """The decode strategy: one new token per sequence against that sequence's cache.

    position_B: the position of each sequence's new token; its cache holds positions
    0 … position−1 in rows 0 … position−1 (rows beyond are not read). state: this
    layer's KV(k [B, T, K, H], v [B, T, K, H]); returns (out [B, Q, H], KV(k_new [B, K, H],
    v_new [B, K, H])) — the caller writes the new rows at position_B (write_rows).
    """

    def attend(q_BxQxH, k_BxKxH, v_BxKxH, state: KV):
        b, q_heads, head_dim = q_BxQxH.shape
        kv_heads = k_BxKxH.shape[1]
        q_BxKxMxH = q_BxQxH.reshape(b, kv_heads, q_heads // kv_heads, head_dim)
        out = jax.vmap(_attend_one)(q_BxKxMxH, state.k, state.v, k_BxKxH, v_BxKxH,
                                    position_B)
        return out.reshape(b, q_heads, head_dim).astype(q_BxQxH.dtype), KV(k_BxKxH, v_BxKxH)

    return attend


def write_rows(cache: KV, new: KV, position_B) -> KV:
    """cache [L, B, T, K, H] with row position_B[b] of sequence b set to new [L, B, K, H].

    Positions ≥ T (a finished sequence running on) are dropped, never wrapped.
    """
    b = jnp.arange(position_B.shape[0])
    return KV(*(c.at[:, b, position_B].set(n.astype(c.dtype), mode="drop")
                for c, n in zip(cache, new)))


def to_cache(cache: KV, prefill_kv: KV, source_BxT) -> KV:
    """Copy prefill rows into the cache: row (b, t) ← flat stream row source_BxT[b, t].

    prefill_kv: [L, DP, CP, S, K, H] as the packed streams hold them (flat row
    (d·CP + c)·S + s); source −1 keeps the cache row as it is. Runs under jit outside any
    shard_map: the partitioner moves each row to the device that owns its sequence.
    Example (cp = 2, one prompt of 5 prefill tokens, S = 4): rank 0 holds positions
    [0, 1, -, -] and rank 1 [2, 3, 4, -], so source[0] = [0, 1, 4, 5, 6, -1, …].
    """
    def one(c, x):
        l, dp, cp, s = x.shape[:4]
        flat = x.reshape((l, dp * cp * s) + x.shape[4:])
        rows = jnp.take(flat, jnp.maximum(source_BxT, 0).reshape(-1), axis=1)
        rows = rows.reshape(c.shape)
        return jnp.where((source_BxT >= 0)[None, :, :, None, None], rows.astype(c.dtype), c)

    return KV(*(one(c, x) for c, x in zip(cache, prefill_kv)))
