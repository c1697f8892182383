"""The blockwise (flash) attention kernel in plain JAX, the default implementation.

Owns the online-softmax block update (shared by every kernel that visits keys block by
block: this flash kernel, its ring, decode), the blockwise kernel over one gathered key
stream (flash) and over the cp ring (ring), each with its custom VJP, and the dense
reference (tests only). It must never build an array of [local tokens, all tokens]: memory
is O(local tokens × block). Blocks that the mask empties are skipped (attention.tiling), so
with the zigzag layout every cp rank does the same work (and, on the ring, the same work at
every step).

Shapes: see the legend in jcp/mesh.py (S queries on this rank, T = CP·S gathered keys,
Q and K heads on this tp shard, M = Q/K, H head dim, Bq and Bk block rows). Einsum
letters: s query rows, t key rows, k kv heads, m query heads per kv head, h head dim; in
the kernel r = a query row, one (token, head in group) pair (W = S·M of them), n = a block
index.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from jcp.attention.tiling import (
    SAVED_NAMES,
    SoftmaxState,
    block_kinds,
    needed_range,
    no_grads,
    online_softmax_finish,
    online_softmax_step,
    ring_fold,
    ring_fold_grads,
    visible,
)
from jcp.mesh import vary_all


def _scores(q_BqxKxMxH, k_BkxKxH, scale):
    """[K, M, Bq, Bk] fp32 scaled scores of a query block against a key block."""
    return (
        jnp.einsum("skmh,tkh->kmst", q_BqxKxMxH, k_BkxKxH, preferred_element_type=jnp.float32)
        * scale
    )


# ----------------------------------------------------------------------------------------
# The blockwise (flash) kernel: queries in blocks, each folding in a stream of keys block by
# block. The all-gather path folds the one gathered stream; the ring folds cp streams in turn.
#
# Inside the kernel a query row is one (token, head-in-group) pair: q [S, K, M, H] becomes
# q_KxWxH with W = S·M rows (token-major), and keys and values become [K, T, H], once per
# call. Every per-block product is then a batched GEMM with the kv heads as the batch
# dimension and the GQA group folded into the rows — no transposes inside the loops.


def _rows(q_SxKxMxH):
    """[S, K, M, H] -> [K, S·M, H]: kv heads lead, one row per (token, head in group)."""
    s_len, kv_heads, per_kv, head_dim = q_SxKxMxH.shape
    return jnp.einsum("skmh->ksmh", q_SxKxMxH).reshape(kv_heads, s_len * per_kv, head_dim)


def _unrows(x_KxWxH, per_kv):
    """Inverse of _rows: [K, S·M, H] -> [S, K, M, H]."""
    kv_heads, rows, head_dim = x_KxWxH.shape
    return jnp.einsum("ksmh->skmh", x_KxWxH.reshape(kv_heads, rows // per_kv, per_kv, head_dim))


def _heads_first(x_TxKxH):
    return jnp.einsum("tkh->kth", x_TxKxH)


def _heads_last(x_KxTxH):
    return jnp.einsum("kth->tkh", x_KxTxH)


def _tiling(q_KxWxH, k_KxTxH, seg_q, pos_q, seg_k, pos_k, block_q, block_k):
    """The tiling _fold_keys and _grad_keys share: (scale, rq rows per query block, nq, nk
    block counts, block kinds and need [nq, nk], seg / pos of the query rows [nq, rq], of
    the key blocks [nk, Bk])."""
    rows, head_dim = q_KxWxH.shape[1:]
    s_len = seg_q.shape[0]
    per_kv = rows // s_len
    rq = block_q * per_kv
    nq, nk = s_len // block_q, k_KxTxH.shape[1] // block_k
    kinds, need = block_kinds(seg_q, pos_q, seg_k, pos_k, block_q, block_k)
    return (
        1.0 / np.sqrt(head_dim),
        rq,
        nq,
        nk,
        kinds,
        need,
        jnp.repeat(seg_q, per_kv).reshape(nq, rq),
        jnp.repeat(pos_q, per_kv).reshape(nq, rq),
        seg_k.reshape(nk, block_k),
        pos_k.reshape(nk, block_k),
    )


def _fold_keys(states, q_KxWxH, k_KxTxH, v_KxTxH, seg_q, pos_q, seg_k, pos_k, block_q, block_k):
    """Fold keys k, v [K, Tk, H] (seg_k, pos_k [Tk]) into the states of q's blocks.

    q_KxWxH: the query rows (W = S·M); seg_q, pos_q [S]; block_q in tokens (Bq·M rows);
    states: SoftmaxState of [nq, K, Bq·M(, H)]. Skipped blocks cost a branch; fully
    visible ones skip the mask.
    """
    scale, rq, nq, nk, kinds, need, seg_r, pos_r, skb, pkb = _tiling(
        q_KxWxH, k_KxTxH, seg_q, pos_q, seg_k, pos_k, block_q, block_k
    )
    k_lo, k_hi = needed_range(need)
    qb, kb = _split_blocks(q_KxWxH, nq), _split_blocks(k_KxTxH, nk)
    vb = _split_blocks(v_KxTxH.astype(jnp.float32), nk)

    def q_block(args):
        i, state = args
        qi, sr, pr = qb[i], seg_r[i], pos_r[i]

        def k_step(j, state):
            kj, vj = kb[j], vb[j]
            pv = lambda p: jnp.einsum("krt,kth->krh", p, vj)  # noqa: E731

            def full(state):
                s = jnp.einsum("krh,kth->krt", qi, kj, preferred_element_type=jnp.float32)
                return online_softmax_step(state, s, pv, scale)

            def masked(state):
                s = jnp.einsum("krh,kth->krt", qi, kj, preferred_element_type=jnp.float32)
                mask = visible(sr, pr, skb[j], pkb[j])
                return online_softmax_step(state, jnp.where(mask, s, -jnp.inf), pv, scale)

            return jax.lax.cond(
                kinds[i, j] > 0,
                lambda c: jax.lax.cond(kinds[i, j] > 1, full, masked, c),
                lambda c: c,
                state,
            )

        state = jax.tree.map(lambda x: vary_all(x, qi, k_KxTxH, v_KxTxH), state)
        return jax.lax.fori_loop(k_lo[i], k_hi[i], k_step, state)

    return jax.lax.map(q_block, (jnp.arange(nq), states))


def _split_blocks(x_KxWxH, n):
    """[K, n·B, H] -> [n, K, B, H]: blocks on a leading axis, so a loop indexes whole,
    contiguous blocks (one copy per call instead of a strided slice per visit)."""
    kv_heads, rows, head_dim = x_KxWxH.shape
    return jnp.einsum("knbh->nkbh", x_KxWxH.reshape(kv_heads, n, rows // n, head_dim))


def _join_blocks(x_NbxKxBxH):
    """Inverse of _split_blocks."""
    n, kv_heads, b, head_dim = x_NbxKxBxH.shape
    return jnp.einsum("nkbh->knbh", x_NbxKxBxH).reshape(kv_heads, n * b, head_dim)


def _blocks_init(q_KxWxH, k, block_rows):
    """Empty online-softmax states of q's blocks of block_rows rows: [nq, K, rows(, H)]."""
    kv_heads, rows, head_dim = q_KxWxH.shape
    nq = rows // block_rows
    init = SoftmaxState(
        jnp.full((nq, kv_heads, block_rows), -jnp.inf, jnp.float32),
        jnp.zeros((nq, kv_heads, block_rows), jnp.float32),
        jnp.zeros((nq, kv_heads, block_rows, head_dim), jnp.float32),
    )
    return jax.tree.map(lambda x: vary_all(x, q_KxWxH, k), init)


def _finish_blocks(states, per_kv, dtype):
    """(out [S, K, M, H] in dtype, lse [K, W] fp32) of the blocks' states, named so a remat
    policy can keep them: the backward pass then needs no second run of the forward loop
    nest (q, k, v are cheap to recompute; out and lse are not)."""
    out, lse = online_softmax_finish(states)  # [nq, K, rows, H], [nq, K, rows]
    nq, kv_heads, rq, head_dim = out.shape
    out = jnp.einsum("nkrh->nrkh", out).reshape(nq * rq // per_kv, per_kv, kv_heads, head_dim)
    out = jnp.einsum("smkh->skmh", out)
    lse = jnp.einsum("nkr->knr", lse).reshape(kv_heads, nq * rq)
    return (
        checkpoint_name(out.astype(dtype), SAVED_NAMES[0]),
        checkpoint_name(lse, SAVED_NAMES[1]),
    )


def _grad_keys(
    dq,
    dk,
    dv,
    q_KxWxH,
    k_KxTxH,
    v_KxTxH,
    seg_q,
    pos_q,
    seg_k,
    pos_k,
    do_KxWxH,
    lse_KxW,
    delta_KxW,
    block_q,
    block_k,
):
    """Backward of q's attention over one key stream k, v [K, Tk, H] (seg_k, pos_k [Tk]).

    lse and delta = Σ_h d_out·out [K, W] are of the whole attention (every stream), so the
    streams' gradients simply add. dq [K, W, H], dk and dv [K, Tk, H], all fp32,
    accumulate: this stream's gradients are added into them (never into fresh buffers:
    see tiling.ring_fold_grads) and (dq, dk, dv) returned.

    Key-major: a tile's scores are computed transposed, [K, Bk, rows] (t before r), so
    every one of its five products is a plain (batched) GEMM — A·B or A·Bᵀ — with no
    transposed left operand (which XLA:CPU runs off its fast GEMM path): dV += Pᵀ·dO,
    dK += dSᵀ·Q, and dQ is accumulated transposed, dQᵀ [H, rows] += Kᵀ·dSᵀ, with Kᵀ
    [H, Bk] made once per call.
    """
    scale, rq, nq, nk, kinds, need, seg_r, pos_r, skb, pkb = _tiling(
        q_KxWxH, k_KxTxH, seg_q, pos_q, seg_k, pos_k, block_q, block_k
    )
    q_lo, q_hi = needed_range(need.T)
    kv_heads, _, head_dim = q_KxWxH.shape
    qb, dob = _split_blocks(q_KxWxH, nq), _split_blocks(do_KxWxH, nq)
    kb, vb = _split_blocks(k_KxTxH, nk), _split_blocks(v_KxTxH.astype(jnp.float32), nk)
    k_tb = jnp.einsum("nkth->nkht", kb.astype(jnp.float32))  # [nk, K, H, Bk]
    lseb = jnp.einsum("knr->nkr", lse_KxW.reshape(kv_heads, nq, rq))
    deltab = jnp.einsum("knr->nkr", delta_KxW.reshape(kv_heads, nq, rq))

    def k_block(carry, j):
        dq_t, dkb, dvb = carry
        kj, vj, k_tj, skj, pkj = kb[j], vb[j], k_tb[j], skb[j], pkb[j]

        def q_step(i, carry):
            def compute(dkv, masked):
                dk, dv = dkv
                qi, doi = qb[i], dob[i]
                s_t = jnp.einsum("kth,krh->ktr", kj, qi, preferred_element_type=jnp.float32)
                p_t = jnp.exp(s_t * scale - lseb[i][:, None, :])
                if masked:
                    p_t = jnp.where(visible(seg_r[i], pos_r[i], skj, pkj).T, p_t, 0.0)
                dv = dv + jnp.einsum("ktr,krh->kth", p_t, doi)
                dp_t = jnp.einsum("kth,krh->ktr", vj, doi)
                ds_t = p_t * (dp_t - deltab[i][:, None, :]) * scale
                dk = dk + jnp.einsum("ktr,krh->kth", ds_t, qi.astype(jnp.float32))
                return jnp.einsum("kht,ktr->khr", k_tj, ds_t), (dk, dv)

            def skip(dkv):
                return vary_all(jnp.zeros(dq_t.shape[1:], jnp.float32), dq_t), dkv

            # The conds return this q block's dQᵀ part and dQᵀ is updated outside them: a
            # buffer updated inside a cond branch is copied whole at every visit.
            dq_t, dk, dv = carry
            part, (dk, dv) = jax.lax.cond(
                kinds[i, j] > 0,
                lambda c: jax.lax.cond(
                    kinds[i, j] > 1, lambda c: compute(c, False), lambda c: compute(c, True), c
                ),
                skip,
                (dk, dv),
            )
            dq_t = jax.lax.dynamic_update_index_in_dim(
                dq_t, jax.lax.dynamic_index_in_dim(dq_t, i, 0, keepdims=False) + part, i, 0
            )
            return dq_t, dk, dv

        dq_t, dk, dv = jax.lax.fori_loop(q_lo[j], q_hi[j], q_step, (dq_t, dkb[j], dvb[j]))
        return (dq_t, dkb.at[j].set(dk), dvb.at[j].set(dv)), None

    refs = (q_KxWxH, k_KxTxH, v_KxTxH, do_KxWxH, dq, dk, dv)
    dq_t = jnp.einsum("knrh->nkhr", dq.reshape(kv_heads, nq, rq, head_dim))  # [nq, K, H, rq]
    dq_t, dkb, dvb = (
        vary_all(x, *refs) for x in (dq_t, _split_blocks(dk, nk), _split_blocks(dv, nk))
    )
    (dq_t, dkb, dvb), _ = jax.lax.scan(k_block, (dq_t, dkb, dvb), jnp.arange(nk))
    dq = jnp.einsum("nkhr->knrh", dq_t).reshape(kv_heads, nq * rq, head_dim)
    return dq, _join_blocks(dkb), _join_blocks(dvb)


def _delta_KxW(d_out, out):
    """Σ_h d_out · out in query rows: [K, W] fp32, the softmax-backward row term."""
    kv_heads = d_out.shape[1]
    return jnp.einsum("skmh,skmh->ksm", d_out.astype(jnp.float32), out.astype(jnp.float32)).reshape(
        kv_heads, -1
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def flash(q, k, v, seg_q, pos_q, seg_k, pos_k, block_q, block_k):
    return _flash_fwd(q, k, v, seg_q, pos_q, seg_k, pos_k, block_q, block_k)[0]


def _flash_fwd(q, k, v, seg_q, pos_q, seg_k, pos_k, block_q, block_k):
    """q [S, K, M, H]; k, v [T, K, H] -> out [S, K, M, H], residuals (… lse [K, S·M])."""
    # Under the layers' lax.scan, seg and pos are loop-invariant, and JAX's scan partial
    # evaluation (when differentiating) splits off everything in this loop nest that
    # depends only on them and on constants (block predicates, masks, fills) and stacks
    # it per block as [nq, nk, …, Bq, Bk] residuals: O(S·T) memory. Tying seg and pos to
    # q (loop-variant) through a barrier keeps the whole loop nest in one piece.
    q, seg_q, pos_q, seg_k, pos_k = jax.lax.optimization_barrier((q, seg_q, pos_q, seg_k, pos_k))
    per_kv = q.shape[2]
    q_r = _rows(q)
    states = _fold_keys(
        _blocks_init(q_r, k, block_q * per_kv),
        q_r,
        _heads_first(k),
        _heads_first(v),
        seg_q,
        pos_q,
        seg_k,
        pos_k,
        block_q,
        block_k,
    )
    out, lse = _finish_blocks(states, per_kv, q.dtype)
    return out, (q, k, v, seg_q, pos_q, seg_k, pos_k, out, lse)


def _flash_bwd(block_q, block_k, res, d_out):
    q, k, v, seg_q, pos_q, seg_k, pos_k, out, lse = res
    per_kv = q.shape[2]
    q_r, k_h, v_h = _rows(q), _heads_first(k), _heads_first(v)
    dq = jnp.zeros(q_r.shape, jnp.float32)
    dk = jnp.zeros(k_h.shape, jnp.float32)
    dq, dk, dv = _grad_keys(
        dq,
        dk,
        dk,
        q_r,
        k_h,
        v_h,
        seg_q,
        pos_q,
        seg_k,
        pos_k,
        _rows(d_out.astype(jnp.float32)),
        lse,
        _delta_KxW(d_out, out),
        block_q,
        block_k,
    )
    return (
        _unrows(dq, per_kv).astype(q.dtype),
        _heads_last(dk).astype(k.dtype),
        _heads_last(dv).astype(v.dtype),
        *no_grads(seg_q, pos_q, seg_k, pos_k),
    )


flash.defvjp(_flash_fwd, _flash_bwd)


def dense(q, k, v, seg_q, pos_q, seg_k, pos_k):
    """Reference: the full [S, T] mask. Tests only — O(S·T) memory."""
    s = _scores(q, k, 1.0 / np.sqrt(q.shape[-1]))
    mask = visible(seg_q, pos_q, seg_k, pos_k)
    s = jnp.where(mask, s, -jnp.inf)
    m = s.max(-1, keepdims=True)
    p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
    l = p.sum(-1, keepdims=True)
    p = p / jnp.where(l == 0, 1.0, l)
    return jnp.einsum("kmst,tkh->skmh", p, v.astype(jnp.float32)).astype(q.dtype)


# ----------------------------------------------------------------------------------------
# Ring attention over cp: K/V never gathered whole


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def ring(q, k, v, seg, pos, block, cp):
    return _ring_fwd(q, k, v, seg, pos, block, cp)[0]


def _ring_fwd(q, k, v, seg, pos, block, cp):
    """q [S, K, M, H]; k, v [S, K, H] of this rank -> out [S, K, M, H], residuals.

    tiling.ring_fold folds the keys of every rank into the online-softmax states, the
    next block in flight meanwhile. K and V travel as one packed [2, K, S, H] message,
    segment and position as [2, S].
    """
    # The barrier: see _flash_fwd.
    q, seg, pos = jax.lax.optimization_barrier((q, seg, pos))
    per_kv = q.shape[2]
    q_r = _rows(q)
    kv, meta = jnp.stack([_heads_first(k), _heads_first(v)]), jnp.stack([seg, pos])

    def fold(states, kv, meta):
        return _fold_keys(states, q_r, kv[0], kv[1], seg, pos, meta[0], meta[1], block, block)

    states = ring_fold(fold, _blocks_init(q_r, k, block * per_kv), kv, meta, cp)
    out, lse = _finish_blocks(states, per_kv, q.dtype)
    return out, (q, k, v, seg, pos, out, lse)


def _ring_bwd(block, cp, res, d_out):
    """tiling.ring_fold_grads: the keys go round again; each block's dK/dV (fp32
    [2, K, S, H]) travels with it and returns to its owner."""
    q, k, v, seg, pos, out, lse = res
    per_kv = q.shape[2]
    q_r, do_r, delta = _rows(q), _rows(d_out.astype(jnp.float32)), _delta_KxW(d_out, out)
    kv, meta = jnp.stack([_heads_first(k), _heads_first(v)]), jnp.stack([seg, pos])

    def grad(dq, dkv, kv, meta):
        dq, dk, dv = _grad_keys(
            dq,
            dkv[0],
            dkv[1],
            q_r,
            kv[0],
            kv[1],
            seg,
            pos,
            meta[0],
            meta[1],
            do_r,
            lse,
            delta,
            block,
            block,
        )
        return dq, jnp.stack([dk, dv])

    dq, dkv = ring_fold_grads(
        grad,
        jnp.zeros(q_r.shape, jnp.float32),
        vary_all(jnp.zeros(kv.shape, jnp.float32), q, kv, d_out),
        kv,
        meta,
        cp,
    )
    return (
        _unrows(dq, per_kv).astype(q.dtype),
        _heads_last(dkv[0]).astype(k.dtype),
        _heads_last(dkv[1]).astype(v.dtype),
        *no_grads(seg, pos),
    )


ring.defvjp(_ring_fwd, _ring_bwd)
