"""Tiling of attention into blocks, and every piece the kernels (blockwise, Pallas, decode)
share, in one place.

Owns the (segment, position) mask, the per-block summaries and the predicate that skips
blocks the mask empties (and its host-side work counts), the tile sizes, the one
online-softmax step, the one ring schedule, and the names of the residuals a remat policy
may keep (the shard_map typing helpers they use, vary_all / vary_like, are mesh.py's). It
must never build an array of [local tokens, all tokens].

Shapes: see the legend in jcp/mesh.py (S queries on this rank, T keys, Bq and Bk block rows).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from jcp.mesh import CP, block_size, vary, vary_all, varying_axes

DEFAULT_BLOCK = 512


# Tiles grow with the stream: at least `block` rows, and up to GROWN_TILE rows while a
# stream still spans ≥ TILES_PER_STREAM of them (on CPU, 64-row tiles skip the most masked
# work on short datums, but their loop overhead dominates long ones). XLA:CPU runs one op
# at a time and uses a second core only inside a large enough op, so on the usual 2+
# threads larger tiles win even though they compute more masked entries: one causal datum,
# fwd + bwd + AdamW, 2 threads (benchmarks/throughput.py --side jcp, quiet), 8k tokens
# 1,060 / 1,580 / 1,763 / 1,641 tok/s with 128 / 256 / 512 / 1024-row tiles, 16k 555 /
# 891 / 1,015 with 128 / 256 / 512; 8 × 512 packed 5,260 / 5,820 / 4,900–5,700 with 64 /
# 256 / 512. (On one core 128 measured best at 8k: 1.52–1.80 vs 1.63–2.04 CPU s with 256.)
GROWN_TILE, TILES_PER_STREAM = 512, 16


# Residuals of the blockwise kernel that a remat policy may save (see model.hidden_states).
SAVED_NAMES = ("attention_out", "attention_lse")


def block_summary(segment, position, block, xp=jnp):
    """Per block of `block` tokens: (any real token, min/max segment, min/max position).

    Padding (segment < 0) is left out. Works on NumPy (xp=np) and jax arrays alike.
    """
    seg = segment.reshape(-1, block)
    pos = position.reshape(-1, block)
    real = seg >= 0
    big = np.iinfo(np.int32).max
    return (
        real.any(-1),
        xp.where(real, seg, big).min(-1),
        xp.where(real, seg, -1).max(-1),
        xp.where(real, pos, big).min(-1),
        xp.where(real, pos, -1).max(-1),
    )


def blocks_needed(q_summary, k_summary, xp=jnp):
    """[nq, nk] bool: may some query of block i see some key of block j?

    Conservative: segment ranges overlap and the earliest key is not after the latest query.
    """
    qa, qs0, qs1, _, qp1 = q_summary
    ka, ks0, ks1, kp0, _ = k_summary
    return (
        qa[:, None]
        & ka[None, :]
        & (qs0[:, None] <= ks1[None, :])
        & (ks0[None, :] <= qs1[:, None])
        & (kp0[None, :] <= qp1[:, None])
    )


def needed_range(need_AxB):
    """Per row a of the [A, B] block predicate: [lo, hi) spanning its needed columns
    (lo = hi = 0 when none), so loops visit only that range, not all B columns."""
    b = need_AxB.shape[1]
    anyb = need_AxB.any(axis=1)
    lo = jnp.argmax(need_AxB, axis=1)
    hi = b - jnp.argmax(need_AxB[:, ::-1], axis=1)
    return jnp.where(anyb, lo, 0), jnp.where(anyb, hi, 0)


def visible(seg_q, pos_q, seg_k, pos_k):
    """[Bq, Bk] bool, jcp's attention mask: same datum, key not after query, query is a real token."""
    return (
        (seg_q[:, None] == seg_k[None, :])
        & (seg_q[:, None] >= 0)
        & (pos_k[None, :] <= pos_q[:, None])
    )


def block_kinds(seg_q, pos_q, seg_k, pos_k, block_q, block_k):
    """[nq, nk] int32: 0 = no query of the block sees a key of the block (skipped),
    1 = some pairs visible (masked), 2 = every pair visible (no mask arithmetic)."""
    need = blocks_needed(block_summary(seg_q, pos_q, block_q), block_summary(seg_k, pos_k, block_k))
    _, qs0, qs1, qp0, _ = block_summary(seg_q, pos_q, block_q)
    _, ks0, ks1, _, kp1 = block_summary(seg_k, pos_k, block_k)
    q_one = (seg_q.reshape(-1, block_q) >= 0).all(-1) & (qs0 == qs1)
    k_one = (seg_k.reshape(-1, block_k) >= 0).all(-1) & (ks0 == ks1)
    full = (
        q_one[:, None]
        & k_one[None, :]
        & (qs0[:, None] == ks0[None, :])
        & (kp1[None, :] <= qp0[:, None])
    )
    return need.astype(jnp.int32) + (need & full).astype(jnp.int32), need


def no_grads(*xs):
    return [np.zeros(x.shape, jax.dtypes.float0) for x in xs]


def tile(n: int, block: int) -> int:
    """Rows of a tile of a stream of n rows: a power of two dividing n, ≥ min(block, its
    largest such) and grown toward GROWN_TILE on long streams."""
    return block_size(n, max(block, min(n // TILES_PER_STREAM, GROWN_TILE)))


def block_work(
    segment_CPxS: np.ndarray, position_CPxS: np.ndarray, block: int = DEFAULT_BLOCK
) -> np.ndarray:
    """Host-side count of attention blocks each cp rank computes: int [CP].

    Uses the same skip predicate as the kernel, on one dp row of a packed batch.
    """
    cp, s_len = segment_CPxS.shape
    bq, bk = tile(s_len, block), tile(cp * s_len, block)
    k_sum = block_summary(segment_CPxS.reshape(-1), position_CPxS.reshape(-1), bk, xp=np)
    return np.array(
        [
            blocks_needed(
                block_summary(segment_CPxS[r], position_CPxS[r], bq, xp=np), k_sum, xp=np
            ).sum()
            for r in range(cp)
        ]
    )


def ring_perm(cp: int):
    """One hop around the cp ring: rank r sends to r + 1 (so at step t it holds r − t's)."""
    return [(r, (r + 1) % cp) for r in range(cp)]


def ring_block_work(
    segment_CPxS: np.ndarray, position_CPxS: np.ndarray, block: int = DEFAULT_BLOCK
) -> np.ndarray:
    """Host-side count of attention blocks each rank computes at each ring step: int
    [CP steps, CP ranks] (at step t, rank r holds the keys of rank r − t)."""
    cp, s_len = segment_CPxS.shape
    b = tile(s_len, block)
    summ = [block_summary(segment_CPxS[r], position_CPxS[r], b, xp=np) for r in range(cp)]
    return np.array(
        [
            [blocks_needed(summ[r], summ[(r - t) % cp], xp=np).sum() for r in range(cp)]
            for t in range(cp)
        ]
    )


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
    return SoftmaxState(
        jnp.full((kv_heads, per_kv, rows), -jnp.inf, jnp.float32),
        jnp.zeros((kv_heads, per_kv, rows), jnp.float32),
        jnp.zeros((kv_heads, per_kv, rows, head_dim), jnp.float32),
    )


def online_softmax_update(state: SoftmaxState, s_KxMxBqxBk, v_BkxKxH) -> SoftmaxState:
    """Fold one key block into the state.

    s: fp32 scores with invisible pairs already −inf; v: that block's values. The old sum
    and accumulator are rescaled by exp(old max − new max); a row whose max is still −inf
    (nothing visible yet) subtracts 0 instead, so it stays exactly 0, never NaN.
    """
    return online_softmax_step(
        state, s_KxMxBqxBk, lambda p: jnp.einsum("kmst,tkh->kmsh", p, v_BkxKxH.astype(jnp.float32))
    )


def online_softmax_step(state: SoftmaxState, s, pv, scale: float = 1.0) -> SoftmaxState:
    """online_softmax_update for any layout, the one online-softmax step of every kernel
    (blockwise, the Pallas forward kernel, decode): s [..., rows, Bk] fp32 scores (−inf
    where invisible), to be multiplied by `scale` (> 0); pv(p) -> [..., rows, H], the
    probabilities' product with the block's values.

    The scale is applied to the row max (a [rows] vector: max(scale·s) = scale·max(s)) and
    inside the one elementwise pass that takes the exp, so an unscaled score block is read
    once by the max and once by the exp, never rewritten scaled (a whole pass over the
    [rows, Bk] block on CPU).
    """
    s_max = s.max(-1)
    m_new = jnp.maximum(state.max_KxMxBq, s_max * scale if scale != 1.0 else s_max)
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    p = jnp.exp((s * scale if scale != 1.0 else s) - m_safe[..., None])
    corr = jnp.exp(state.max_KxMxBq - m_safe)
    l_new = state.sum_KxMxBq * corr + p.sum(-1)
    return SoftmaxState(m_new, l_new, state.acc_KxMxBqxH * corr[..., None] + pv(p))


def online_softmax_finish(state: SoftmaxState, empty_lse: float = 0.0):
    """(out [K, M, Bq, H], lse [K, M, Bq]) in fp32: acc / sum and max + log(sum).

    Rows that saw no key (padding queries) give out 0 and lse `empty_lse`.
    """
    m, l, acc = state
    empty = l == 0.0
    out = acc / jnp.where(empty, 1.0, l)[..., None]
    lse = jnp.where(empty, empty_lse, m + jnp.log(jnp.where(empty, 1.0, l)))
    return out, lse


# ----------------------------------------------------------------------------------------
# The ring schedule over cp, shared by the blockwise and Pallas ring kernels


def _vary_together(state):
    """Every leaf of a ring loop's state cast to vary over "cp" and over every axis some
    leaf varies over: what a hop (ppermute) and a fold make of them, as a loop carry's
    type must be."""
    axes = sorted({CP}.union(*(varying_axes(x) for x in jax.tree.leaves(state))))
    return jax.tree.map(lambda x: vary(x, axes), state)


def ring_fold(fold, carry, kv, meta, cp: int):
    """carry = fold(carry, kv, meta) over the key blocks of all cp ranks, in ring order.

    kv: this rank's keys and values as one packed [2, …] message, meta its [2, S] segment
    and position. Step t folds the block of rank r − t while the block of rank r − t − 1
    travels: the ppermute of the next block is issued before the compute that does not
    depend on it. Steps 0 … cp − 2 are one loop; the last, which sends nothing, is peeled
    off (no wasted hop). A loop, not cp unrolled steps: unrolled, XLA was free to issue
    every hop, and each step's kernel-layout copies of its block, ahead of the folds, so a
    rank held about one whole K/V (benchmarks/RESULTS.md, "Ring memory"); a loop body
    holds one step's block and the one in flight. Runs inside shard_map over "cp".
    """

    def hop(_, state):
        carry, kv, meta = state
        kv_next, meta_next = jax.lax.ppermute((kv, meta), CP, ring_perm(cp))
        return fold(carry, kv, meta), kv_next, meta_next

    if cp > 1:
        carry, kv, meta = jax.lax.fori_loop(0, cp - 1, hop, _vary_together((carry, kv, meta)))
    return fold(carry, kv, meta)


def ring_fold_grads(grad, carry, dkv, kv, meta, cp: int):
    """The backward of a ring_fold: the key blocks go round again, and each block's
    gradient (dkv, fp32, the shape of kv) travels with it, gathering every rank's part;
    one last hop returns it to its owner. grad(carry, dkv, kv, meta) -> (carry, dkv with
    this rank's part of the held block's gradient added). Returns (carry, the gradient of
    this rank's kv). A loop with the last step peeled off, as ring_fold: per rank, one
    step's block and gradient and the ones in flight, at every cp.

    grad adds into the dkv it is given rather than returning a part to add: a part
    computed into a fresh zero buffer needs no input, so XLA may allocate (and zero) the
    buffers of every step before the first one — cp of them live at once, O(CP·S) per
    rank. Found with benchmarks/memory.py --explain (15 × 2 MiB at cp = 8, 32k tokens).
    """

    def hop(_, state):
        carry, dkv, kv, meta = state
        kv_next, meta_next = jax.lax.ppermute((kv, meta), CP, ring_perm(cp))
        carry, dkv = grad(carry, dkv, kv, meta)
        # to the rank that holds this block next
        return carry, jax.lax.ppermute(dkv, CP, ring_perm(cp)), kv_next, meta_next

    if cp == 1:
        return grad(carry, dkv, kv, meta)
    carry, dkv, kv, meta = jax.lax.fori_loop(0, cp - 1, hop, _vary_together((carry, dkv, kv, meta)))
    carry, dkv = grad(carry, dkv, kv, meta)
    return carry, jax.lax.ppermute(dkv, CP, ring_perm(cp))  # to its owner


# ----------------------------------------------------------------------------------------
# What the fused kernels (pallas, cpu) share around their kernel calls


def delta_QxS(do_SxQxH, out_SxQxH):
    """Σ_h do·out: [Q, S] fp32, the softmax-backward row term."""
    return jnp.einsum("sqh,sqh->qs", do_SxQxH.astype(jnp.float32), out_SxQxH.astype(jnp.float32))


def saved_out_lse(out, lse):
    """Named so the model's remat policy keeps them (attention.SAVED_NAMES): the backward
    then never reruns the forward kernel."""
    return checkpoint_name(out, SAVED_NAMES[0]), checkpoint_name(lse, SAVED_NAMES[1])


def merge_partials(out_SxQxH, lse_QxS, part_SxQxH, part_lse_QxS):
    """Two partial attentions of the same queries over disjoint keys -> their union's.

    lse = log(e^lse + e^part_lse); out = Σ e^(lse_i − lse)·out_i; rows empty in both stay
    (0, −inf), never NaN.
    """
    lse = jnp.logaddexp(lse_QxS, part_lse_QxS)
    safe = jnp.where(lse == -jnp.inf, 0.0, lse)
    w, w_part = jnp.exp(lse_QxS - safe).T[..., None], jnp.exp(part_lse_QxS - safe).T[..., None]
    return out_SxQxH * w + part_SxQxH * w_part, lse


def kernel_ring_fwd(forward, q, k, v, seg, pos, cp: int):
    """The cp ring over a fused kernel (Pallas, C++): ring_fold with K and V travelling as one
    [2, S, K, H] message, one `forward(q, k, v, seg_q, pos_q, seg_k, pos_k) -> (out fp32,
    lse)` call per step, the fp32 partials merged by merge_partials. Returns (out in q's
    dtype, residuals for kernel_ring_bwd), out and lse named for the remat policy."""

    def fold(partial, kv, meta):
        return merge_partials(*partial, *forward(q, kv[0], kv[1], seg, pos, meta[0], meta[1]))

    # The empty partial (0, −inf): merging a part into it gives that part bit for bit
    # (weights exp(−inf) = 0 and exp(0) = 1), so the loop's carry has one structure.
    kv, meta = jnp.stack([k, v]), jnp.stack([seg, pos])
    s_len, q_heads = q.shape[:2]
    empty = (
        vary_all(jnp.zeros(q.shape, jnp.float32), q, kv),
        vary_all(jnp.full((q_heads, s_len), -jnp.inf, jnp.float32), q, kv),
    )
    out, lse = ring_fold(fold, empty, kv, meta, cp)
    out, lse = saved_out_lse(out.astype(q.dtype), lse)
    return out, (q, k, v, seg, pos, out, lse)


def kernel_ring_bwd(backward, cp: int, res, d_out):
    """kernel_ring_fwd's VJP through ring_fold_grads: the keys go round again; each block's
    fp32 dK/dV ([2, S, K, H]) travels with it and returns to its owner. `backward(q, k, v,
    seg_q, pos_q, seg_k, pos_k, d_out, lse, delta) -> (dq, dk, dv)` in fp32, one call per
    step."""
    q, k, v, seg, pos, out, lse = res
    delta = delta_QxS(d_out, out)
    kv, meta = jnp.stack([k, v]), jnp.stack([seg, pos])

    def grad(dq, dkv, kv, meta):
        dq_t, dk, dv = backward(q, kv[0], kv[1], seg, pos, meta[0], meta[1], d_out, lse, delta)
        return dq + dq_t, dkv + jnp.stack([dk, dv])

    dq, dkv = ring_fold_grads(
        grad,
        vary_all(jnp.zeros(q.shape, jnp.float32), q, kv, d_out),
        vary_all(jnp.zeros(kv.shape, jnp.float32), q, kv, d_out),
        kv,
        meta,
        cp,
    )
    return (dq.astype(q.dtype), dkv[0].astype(k.dtype), dkv[1].astype(v.dtype), *no_grads(seg, pos))
