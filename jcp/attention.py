"""Context-parallel attention over zigzag shards, and the attention strategies of the model.

Owns the K/V all-gather over "cp", the (segment, position) mask, the online-softmax block
update (shared by every kernel that visits keys block by block: this flash kernel, and
ring attention or decode when they come) and the blockwise kernel with its custom VJP. It
must never build an array of [local tokens, all tokens]: memory is O(local tokens × block).
Blocks that the mask empties are skipped, so with the zigzag layout every cp rank does the
same work.

Shapes: see the legend in jcp/mesh.py (S queries on this rank, T = CP·S gathered keys,
Q and K heads on this tp shard, M = Q/K, H head dim, Bq and Bk block rows). Einsum
letters: s query rows, t key rows, k kv heads, m query heads per kv head, h head dim.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from jcp.mesh import CP, block_size, vary, varying_axes

DEFAULT_BLOCK = 512
IMPLEMENTATIONS = ("blockwise", "dense")
# Residuals of the blockwise kernel that a remat policy may save (see model.hidden_states).
SAVED_NAMES = ("attention_out", "attention_lse")


class Attend(Protocol):
    """An attention strategy: what the decoder layer calls between RoPE and o_proj.

    (q [S, Q, H], k [S, K, H], v [S, K, H], state) -> (out [S, Q, H], new state). q and k
    carry RoPE already. `state` is this layer's attention state (a pytree, scanned over
    layers with the weights): None for training; a KV cache for prefill (written) and
    decode (read and extended). Everything else a strategy needs (segments, positions,
    cache indices) it closes over, so the model threads no mode flags.
    """

    def __call__(self, q_SxQxH, k_SxKxH, v_SxKxH, state: Any) -> tuple[jax.Array, Any]: ...


def _vary_like(x, ref):
    """Cast x to vary over every mesh axis that ref varies over (for scan carries)."""
    return vary(x, varying_axes(ref))


def block_summary(segment, position, block, xp=jnp):
    """Per block of `block` tokens: (any real token, min/max segment, min/max position).

    Padding (segment < 0) is left out. Works on NumPy (xp=np) and jax arrays alike.
    """
    seg = segment.reshape(-1, block)
    pos = position.reshape(-1, block)
    real = seg >= 0
    big = np.iinfo(np.int32).max
    return (real.any(-1),
            xp.where(real, seg, big).min(-1), xp.where(real, seg, -1).max(-1),
            xp.where(real, pos, big).min(-1), xp.where(real, pos, -1).max(-1))


def blocks_needed(q_summary, k_summary, xp=jnp):
    """[nq, nk] bool: may some query of block i see some key of block j?

    Conservative: segment ranges overlap and the earliest key is not after the latest query.
    """
    qa, qs0, qs1, _, qp1 = q_summary
    ka, ks0, ks1, kp0, _ = k_summary
    return (qa[:, None] & ka[None, :] & (qs0[:, None] <= ks1[None, :])
            & (ks0[None, :] <= qs1[:, None]) & (kp0[None, :] <= qp1[:, None]))


def needed_range(need_AxB):
    """Per row a of the [A, B] block predicate: [lo, hi) spanning its needed columns
    (lo = hi = 0 when none), so loops visit only that range, not all B columns."""
    b = need_AxB.shape[1]
    anyb = need_AxB.any(axis=1)
    lo = jnp.argmax(need_AxB, axis=1)
    hi = b - jnp.argmax(need_AxB[:, ::-1], axis=1)
    return jnp.where(anyb, lo, 0), jnp.where(anyb, hi, 0)


def _mask(seg_q, pos_q, seg_k, pos_k):
    """[Bq, Bk]: same datum, key not after query, query is a real token."""
    return ((seg_q[:, None] == seg_k[None, :]) & (seg_q[:, None] >= 0)
            & (pos_k[None, :] <= pos_q[:, None]))


def _scores(q_BqxKxMxH, k_BkxKxH, scale):
    """[K, M, Bq, Bk] fp32 scaled scores of a query block against a key block."""
    return jnp.einsum("skmh,tkh->kmst", q_BqxKxMxH, k_BkxKxH,
                      preferred_element_type=jnp.float32) * scale


# ----------------------------------------------------------------------------------------
# Online softmax: visit key blocks one at a time, keep a running max, sum and accumulator


class SoftmaxState(NamedTuple):
    """Running online-softmax state of a block of queries, all fp32.

    max_KxMxBq: largest score seen (−inf while every key so far was masked);
    sum_KxMxBq: Σ exp(score − max); acc_KxMxBqxH: Σ exp(score − max) · v.
    """

    max_KxMxBq: jax.Array
    sum_KxMxBq: jax.Array
    acc_KxMxBqxH: jax.Array


def online_softmax_init(kv_heads: int, per_kv: int, rows: int, head_dim: int) -> SoftmaxState:
    """The state before any key: max −inf, sum 0, accumulator 0 ([K, M, Bq(, H)])."""
    return SoftmaxState(jnp.full((kv_heads, per_kv, rows), -jnp.inf, jnp.float32),
                        jnp.zeros((kv_heads, per_kv, rows), jnp.float32),
                        jnp.zeros((kv_heads, per_kv, rows, head_dim), jnp.float32))


def online_softmax_update(state: SoftmaxState, s_KxMxBqxBk, v_BkxKxH) -> SoftmaxState:
    """Fold one key block into the state.

    s: fp32 scores with invisible pairs already −inf; v: that block's values. The old sum
    and accumulator are rescaled by exp(old max − new max); a row whose max is still −inf
    (nothing visible yet) subtracts 0 instead, so it stays exactly 0, never NaN.
    """
    m_new = jnp.maximum(state.max_KxMxBq, s_KxMxBqxBk.max(-1))
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    p = jnp.exp(s_KxMxBqxBk - m_safe[..., None])
    corr = jnp.exp(state.max_KxMxBq - m_safe)
    l_new = state.sum_KxMxBq * corr + p.sum(-1)
    acc = state.acc_KxMxBqxH * corr[..., None] + jnp.einsum(
        "kmst,tkh->kmsh", p, v_BkxKxH.astype(jnp.float32))
    return SoftmaxState(m_new, l_new, acc)


def online_softmax_finish(state: SoftmaxState):
    """(out [K, M, Bq, H], lse [K, M, Bq]) in fp32: acc / sum and max + log(sum).

    Rows that saw no key (padding queries) give out 0 and lse 0.
    """
    m, l, acc = state
    empty = l == 0.0
    out = acc / jnp.where(empty, 1.0, l)[..., None]
    lse = jnp.where(empty, 0.0, m + jnp.log(jnp.where(empty, 1.0, l)))
    return out, lse


# ----------------------------------------------------------------------------------------
# The blockwise (flash) kernel over all-gathered keys


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def _flash(q, k, v, seg_q, pos_q, seg_k, pos_k, block_q, block_k):
    return _flash_fwd(q, k, v, seg_q, pos_q, seg_k, pos_k, block_q, block_k)[0]


def _flash_fwd(q, k, v, seg_q, pos_q, seg_k, pos_k, block_q, block_k):
    """q [S, K, M, H]; k, v [T, K, H] -> out [S, K, M, H], residuals (… lse [K, M, S])."""
    s_len, kv_heads, per_kv, head_dim = q.shape
    scale = 1.0 / np.sqrt(head_dim)
    nq, nk = s_len // block_q, k.shape[0] // block_k
    # Under the layers' lax.scan, seg and pos are loop-invariant, and JAX's scan partial
    # evaluation (when differentiating) splits off everything in this loop nest that
    # depends only on them and on constants (block predicates, masks, fills) and stacks
    # it per block as [nq, nk, …, Bq, Bk] residuals: O(S·T) memory. Tying seg and pos to
    # q (loop-variant) through a barrier keeps the whole loop nest in one piece.
    q, seg_q, pos_q, seg_k, pos_k = jax.lax.optimization_barrier(
        (q, seg_q, pos_q, seg_k, pos_k))
    need = blocks_needed(block_summary(seg_q, pos_q, block_q), block_summary(seg_k, pos_k, block_k))
    k_lo, k_hi = needed_range(need)
    qb = q.reshape(nq, block_q, kv_heads, per_kv, head_dim)
    kb = k.reshape(nk, block_k, kv_heads, head_dim)
    vb = v.reshape(nk, block_k, kv_heads, head_dim)
    sqb, pqb = seg_q.reshape(nq, block_q), pos_q.reshape(nq, block_q)
    skb, pkb = seg_k.reshape(nk, block_k), pos_k.reshape(nk, block_k)

    def q_block(i):
        qi = qb[i]

        def k_step(j, state):
            def compute(state):
                s = _scores(qi, kb[j], scale)
                mask = _mask(sqb[i], pqb[i], skb[j], pkb[j])
                return online_softmax_update(state, jnp.where(mask, s, -jnp.inf), vb[j])

            return jax.lax.cond(need[i, j], compute, lambda c: c, state)

        init = online_softmax_init(kv_heads, per_kv, block_q, head_dim)
        init = jax.tree.map(lambda x: _vary_like(x, qi), init)
        return online_softmax_finish(jax.lax.fori_loop(k_lo[i], k_hi[i], k_step, init))

    out, lse = jax.lax.map(q_block, jnp.arange(nq))  # [nq, K, M, Bq, H], [nq, K, M, Bq]
    out = jnp.einsum("nkmsh->nskmh", out).reshape(s_len, kv_heads, per_kv, head_dim)
    out = out.astype(q.dtype)
    lse = jnp.einsum("nkms->kmns", lse).reshape(kv_heads, per_kv, s_len)
    # Named so a remat policy can keep them: the backward pass then needs no second run of
    # this loop nest (q, k, v are cheap to recompute; out and lse are not).
    out = checkpoint_name(out, SAVED_NAMES[0])
    lse = checkpoint_name(lse, SAVED_NAMES[1])
    return out, (q, k, v, seg_q, pos_q, seg_k, pos_k, out, lse)


def _flash_bwd(block_q, block_k, res, d_out):
    q, k, v, seg_q, pos_q, seg_k, pos_k, out, lse = res
    s_len, kv_heads, per_kv, head_dim = q.shape
    scale = 1.0 / np.sqrt(head_dim)
    nq, nk = s_len // block_q, k.shape[0] // block_k
    need = blocks_needed(block_summary(seg_q, pos_q, block_q), block_summary(seg_k, pos_k, block_k))
    q_lo, q_hi = needed_range(need.T)
    delta = jnp.einsum("skmh,skmh->kms", d_out.astype(jnp.float32), out.astype(jnp.float32))
    qb = q.reshape(nq, block_q, kv_heads, per_kv, head_dim)
    dob = d_out.reshape(nq, block_q, kv_heads, per_kv, head_dim).astype(jnp.float32)
    lseb = lse.reshape(kv_heads, per_kv, nq, block_q)
    deltab = delta.reshape(kv_heads, per_kv, nq, block_q)
    kb = k.reshape(nk, block_k, kv_heads, head_dim)
    vb = v.reshape(nk, block_k, kv_heads, head_dim)
    sqb, pqb = seg_q.reshape(nq, block_q), pos_q.reshape(nq, block_q)
    skb, pkb = seg_k.reshape(nk, block_k), pos_k.reshape(nk, block_k)

    def k_block(dq, j):
        kj, vj = kb[j], vb[j]

        def q_step(i, carry):
            def compute(carry):
                dq, dk, dv = carry
                qi, doi = qb[i], dob[i]
                s = _scores(qi, kj, scale)
                mask = _mask(sqb[i], pqb[i], skb[j], pkb[j])
                p = jnp.where(mask, jnp.exp(s - lseb[:, :, i, :, None]), 0.0)
                dv = dv + jnp.einsum("kmst,skmh->tkh", p, doi)
                dp = jnp.einsum("skmh,tkh->kmst", doi, vj.astype(jnp.float32))
                ds = p * (dp - deltab[:, :, i, :, None]) * scale
                dq_i = jnp.einsum("kmst,tkh->skmh", ds, kj.astype(jnp.float32))
                dq = jax.lax.dynamic_update_slice_in_dim(
                    dq, jax.lax.dynamic_slice_in_dim(dq, i * block_q, block_q) + dq_i,
                    i * block_q, axis=0)
                dk = dk + jnp.einsum("kmst,skmh->tkh", ds, qi.astype(jnp.float32))
                return dq, dk, dv

            return jax.lax.cond(need[i, j], compute, lambda c: c, carry)

        init = (dq, _vary_like(jnp.zeros((block_k, kv_heads, head_dim), jnp.float32), dq),
                _vary_like(jnp.zeros((block_k, kv_heads, head_dim), jnp.float32), dq))
        dq, dk, dv = jax.lax.fori_loop(q_lo[j], q_hi[j], q_step, init)
        return dq, (dk, dv)

    dq0 = jnp.zeros((s_len, kv_heads, per_kv, head_dim), jnp.float32)
    dq0 = _vary_like(_vary_like(_vary_like(dq0, q), k), d_out)
    dq, (dk, dv) = jax.lax.scan(k_block, dq0, jnp.arange(nk))
    dk = dk.reshape(k.shape).astype(k.dtype)
    dv = dv.reshape(v.shape).astype(v.dtype)
    zeros = [np.zeros(x.shape, jax.dtypes.float0) for x in (seg_q, pos_q, seg_k, pos_k)]
    return (dq.astype(q.dtype), dk, dv, *zeros)


_flash.defvjp(_flash_fwd, _flash_bwd)


def _dense(q, k, v, seg_q, pos_q, seg_k, pos_k):
    """Reference: the full [S, T] mask. Tests only — O(S·T) memory."""
    s = _scores(q, k, 1.0 / np.sqrt(q.shape[-1]))
    mask = _mask(seg_q, pos_q, seg_k, pos_k)
    s = jnp.where(mask, s, -jnp.inf)
    m = s.max(-1, keepdims=True)
    p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
    l = p.sum(-1, keepdims=True)
    p = p / jnp.where(l == 0, 1.0, l)
    return jnp.einsum("kmst,tkh->skmh", p, v.astype(jnp.float32)).astype(q.dtype)


def gather_cp(x):
    """[S, …] on each cp rank -> [CP·S, …]: the streams of ranks 0 … CP−1, concatenated.

    Transposes (under autodiff) to a reduce-scatter, so each rank gets back the gradient of
    its own keys and values.
    """
    return jax.lax.all_gather(x, CP, axis=0, tiled=True)


def _check_implementation(implementation: str) -> None:
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"attention implementation must be one of {IMPLEMENTATIONS}, "
                         f"got {implementation!r}")


def cp_attention(q_SxQxH, k_SxKxH, v_SxKxH, segment_S, position_S, *,
                 implementation: str = "blockwise", block: int = DEFAULT_BLOCK):
    """Causal, datum-isolated attention of this rank's queries over every cp rank's keys.

    q: [S, Q, H] (RoPE applied), k, v: [S, K, H]; segment: datum slot (−1 = padding);
    position: index within the datum. A query sees a key iff both belong to the same datum
    and the key's position ≤ the query's. Queries that see nothing (padding) give zeros.
    Returns [S, Q, H].
    """
    _check_implementation(implementation)
    s_len, q_heads, head_dim = q_SxQxH.shape
    kv_heads = k_SxKxH.shape[1]
    q_SxKxMxH = q_SxQxH.reshape(s_len, kv_heads, q_heads // kv_heads, head_dim)
    k_TxKxH, v_TxKxH = gather_cp(k_SxKxH), gather_cp(v_SxKxH)
    seg_T, pos_T = gather_cp(segment_S), gather_cp(position_S)
    if implementation == "dense":
        out = _dense(q_SxKxMxH, k_TxKxH, v_TxKxH, segment_S, position_S, seg_T, pos_T)
    else:
        out = _flash(q_SxKxMxH, k_TxKxH, v_TxKxH, segment_S, position_S, seg_T, pos_T,
                     block_size(s_len, block), block_size(k_TxKxH.shape[0], block))
    return out.reshape(s_len, q_heads, head_dim)


def cp_attend(segment_S, position_S, *, implementation: str = "blockwise",
              block: int = DEFAULT_BLOCK) -> Attend:
    """The training strategy: cp_attention over the packed streams, state passed through.

    Closes over this rank's (segment, position) [S]; the state is None (training keeps no
    cache), returned unchanged.
    """
    _check_implementation(implementation)

    def attend(q_SxQxH, k_SxKxH, v_SxKxH, state):
        return cp_attention(q_SxQxH, k_SxKxH, v_SxKxH, segment_S, position_S,
                            implementation=implementation, block=block), state

    return attend


def block_work(segment_CPxS: np.ndarray, position_CPxS: np.ndarray,
               block: int = DEFAULT_BLOCK) -> np.ndarray:
    """Host-side count of attention blocks each cp rank computes: int [CP].

    Uses the same skip predicate as the kernel, on one dp row of a packed batch.
    """
    cp, s_len = segment_CPxS.shape
    bq, bk = block_size(s_len, block), block_size(cp * s_len, block)
    k_sum = block_summary(segment_CPxS.reshape(-1), position_CPxS.reshape(-1), bk, xp=np)
    return np.array([
        blocks_needed(block_summary(segment_CPxS[r], position_CPxS[r], bq, xp=np), k_sum,
                      xp=np).sum() for r in range(cp)])
