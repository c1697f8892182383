"""Context-parallel attention over zigzag shards, and the attention strategies of the model.

Owns the two ways a rank's queries reach every cp rank's keys — the K/V all-gather over
"cp" (cp_attend) and the ring (ring_attend: K/V passed around with ppermute, never held
whole) and the rule that picks one (choose_cp_attention) —, the (segment, position) mask,
the online-softmax block update (shared by every kernel that visits keys block by block:
this flash kernel, the ring, decode) and the blockwise kernel with its custom VJP. It must
never build an array of [local tokens, all tokens]: memory is O(local tokens × block).
Blocks that the mask empties are skipped, so with the zigzag layout every cp rank does the
same work (and, on the ring, the same work at every step).

Shapes: see the legend in jcp/mesh.py (S queries on this rank, T = CP·S gathered keys,
Q and K heads on this tp shard, M = Q/K, H head dim, Bq and Bk block rows). Einsum
letters: s query rows, t key rows, k kv heads, m query heads per kv head, h head dim; in
the kernel r = a query row, one (token, head in group) pair (R = S·M), n = a block index.
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
# Tiles grow with the stream: at least `block` rows, and up to GROWN_TILE rows while a
# stream still spans ≥ TILES_PER_STREAM of them (on CPU, 64-row tiles skip the most masked
# work on short datums, but their loop overhead dominates long ones; measured 1.36× faster
# fwd+bwd at 16k tokens with 256-row tiles than with 64).
GROWN_TILE, TILES_PER_STREAM = 256, 64
# "pallas": the fused kernels of jcp/pallas_attention.py (Triton on GPU; on CPU, interpret
# mode, tests only). The default stays "blockwise".
IMPLEMENTATIONS = ("blockwise", "dense", "pallas")
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
    return _online_update(state, s_KxMxBqxBk, lambda p: jnp.einsum(
        "kmst,tkh->kmsh", p, v_BkxKxH.astype(jnp.float32)))


def _online_update(state: SoftmaxState, s, pv) -> SoftmaxState:
    """online_softmax_update for any layout: s [..., rows, Bk]; pv(p) -> [..., rows, H]."""
    m_new = jnp.maximum(state.max_KxMxBq, s.max(-1))
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    p = jnp.exp(s - m_safe[..., None])
    corr = jnp.exp(state.max_KxMxBq - m_safe)
    l_new = state.sum_KxMxBq * corr + p.sum(-1)
    return SoftmaxState(m_new, l_new, state.acc_KxMxBqxH * corr[..., None] + pv(p))


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
# The blockwise (flash) kernel: queries in blocks, each folding in a stream of keys block by
# block. The all-gather path folds the one gathered stream; the ring folds cp streams in turn.
#
# Inside the kernel a query row is one (token, head-in-group) pair: q [S, K, M, H] becomes
# q_KxRxH with R = S·M rows (token-major), and keys and values become [K, T, H], once per
# call. Every per-block product is then a batched GEMM with the kv heads as the batch
# dimension and the GQA group folded into the rows — no transposes inside the loops.


def _vary_all(x, *refs):
    """Cast x to vary over every mesh axis that any of refs varies over."""
    for r in refs:
        x = _vary_like(x, r)
    return x


def _rows(q_SxKxMxH):
    """[S, K, M, H] -> [K, S·M, H]: kv heads lead, one row per (token, head in group)."""
    s_len, kv_heads, per_kv, head_dim = q_SxKxMxH.shape
    return jnp.einsum("skmh->ksmh", q_SxKxMxH).reshape(kv_heads, s_len * per_kv, head_dim)


def _unrows(x_KxRxH, per_kv):
    """Inverse of _rows: [K, S·M, H] -> [S, K, M, H]."""
    kv_heads, rows, head_dim = x_KxRxH.shape
    return jnp.einsum("ksmh->skmh", x_KxRxH.reshape(kv_heads, rows // per_kv, per_kv, head_dim))


def _heads_first(x_TxKxH):
    return jnp.einsum("tkh->kth", x_TxKxH)


def _heads_last(x_KxTxH):
    return jnp.einsum("kth->tkh", x_KxTxH)


def _block_kinds(seg_q, pos_q, seg_k, pos_k, block_q, block_k):
    """[nq, nk] int32: 0 = no query of the block sees a key of the block (skipped),
    1 = some pairs visible (masked), 2 = every pair visible (no mask arithmetic)."""
    need = blocks_needed(block_summary(seg_q, pos_q, block_q), block_summary(seg_k, pos_k, block_k))
    _, qs0, qs1, qp0, _ = block_summary(seg_q, pos_q, block_q)
    _, ks0, ks1, _, kp1 = block_summary(seg_k, pos_k, block_k)
    q_one = (seg_q.reshape(-1, block_q) >= 0).all(-1) & (qs0 == qs1)
    k_one = (seg_k.reshape(-1, block_k) >= 0).all(-1) & (ks0 == ks1)
    full = (q_one[:, None] & k_one[None, :] & (qs0[:, None] == ks0[None, :])
            & (kp1[None, :] <= qp0[:, None]))
    return need.astype(jnp.int32) + (need & full).astype(jnp.int32), need


def _tiling(q_KxRxH, k_KxTxH, seg_q, pos_q, seg_k, pos_k, block_q, block_k):
    """The tiling _fold_keys and _grad_keys share: (scale, rq rows per query block, nq, nk
    block counts, block kinds and need [nq, nk], seg / pos of the query rows [nq, rq], of
    the key blocks [nk, Bk])."""
    rows, head_dim = q_KxRxH.shape[1:]
    s_len = seg_q.shape[0]
    per_kv = rows // s_len
    rq = block_q * per_kv
    nq, nk = s_len // block_q, k_KxTxH.shape[1] // block_k
    kinds, need = _block_kinds(seg_q, pos_q, seg_k, pos_k, block_q, block_k)
    return (1.0 / np.sqrt(head_dim), rq, nq, nk, kinds, need,
            jnp.repeat(seg_q, per_kv).reshape(nq, rq), jnp.repeat(pos_q, per_kv).reshape(nq, rq),
            seg_k.reshape(nk, block_k), pos_k.reshape(nk, block_k))


def _fold_keys(states, q_KxRxH, k_KxTxH, v_KxTxH, seg_q, pos_q, seg_k, pos_k, block_q,
               block_k):
    """Fold keys k, v [K, Tk, H] (seg_k, pos_k [Tk]) into the states of q's blocks.

    q_KxRxH: the query rows (R = S·M); seg_q, pos_q [S]; block_q in tokens (Bq·M rows);
    states: SoftmaxState of [nq, K, Bq·M(, H)]. Skipped blocks cost a branch; fully
    visible ones skip the mask.
    """
    scale, rq, nq, nk, kinds, need, seg_r, pos_r, skb, pkb = _tiling(
        q_KxRxH, k_KxTxH, seg_q, pos_q, seg_k, pos_k, block_q, block_k)
    k_lo, k_hi = needed_range(need)
    qb, kb = _split_blocks(q_KxRxH, nq), _split_blocks(k_KxTxH, nk)
    vb = _split_blocks(v_KxTxH.astype(jnp.float32), nk)

    def q_block(args):
        i, state = args
        qi, sr, pr = qb[i], seg_r[i], pos_r[i]

        def k_step(j, state):
            kj, vj = kb[j], vb[j]
            pv = lambda p: jnp.einsum("krt,kth->krh", p, vj)  # noqa: E731

            def full(state):
                s = jnp.einsum("krh,kth->krt", qi, kj, preferred_element_type=jnp.float32)
                return _online_update(state, s * scale, pv)

            def masked(state):
                s = jnp.einsum("krh,kth->krt", qi, kj, preferred_element_type=jnp.float32)
                mask = _mask(sr, pr, skb[j], pkb[j])
                return _online_update(state, jnp.where(mask, s * scale, -jnp.inf), pv)

            return jax.lax.cond(kinds[i, j] > 0, lambda c: jax.lax.cond(
                kinds[i, j] > 1, full, masked, c), lambda c: c, state)

        state = jax.tree.map(lambda x: _vary_all(x, qi, k_KxTxH, v_KxTxH), state)
        return jax.lax.fori_loop(k_lo[i], k_hi[i], k_step, state)

    return jax.lax.map(q_block, (jnp.arange(nq), states))


def _split_blocks(x_KxRxH, n):
    """[K, n·B, H] -> [n, K, B, H]: blocks on a leading axis, so a loop indexes whole,
    contiguous blocks (one copy per call instead of a strided slice per visit)."""
    kv_heads, rows, head_dim = x_KxRxH.shape
    return jnp.einsum("knbh->nkbh", x_KxRxH.reshape(kv_heads, n, rows // n, head_dim))


def _join_blocks(x_NxKxBxH):
    """Inverse of _split_blocks."""
    n, kv_heads, b, head_dim = x_NxKxBxH.shape
    return jnp.einsum("nkbh->knbh", x_NxKxBxH).reshape(kv_heads, n * b, head_dim)


def _blocks_init(q_KxRxH, k, block_rows):
    """Empty online-softmax states of q's blocks of block_rows rows: [nq, K, rows(, H)]."""
    kv_heads, rows, head_dim = q_KxRxH.shape
    nq = rows // block_rows
    init = SoftmaxState(jnp.full((nq, kv_heads, block_rows), -jnp.inf, jnp.float32),
                        jnp.zeros((nq, kv_heads, block_rows), jnp.float32),
                        jnp.zeros((nq, kv_heads, block_rows, head_dim), jnp.float32))
    return jax.tree.map(lambda x: _vary_all(x, q_KxRxH, k), init)


def _finish_blocks(states, per_kv, dtype):
    """(out [S, K, M, H] in dtype, lse [K, R] fp32) of the blocks' states, named so a remat
    policy can keep them: the backward pass then needs no second run of the forward loop
    nest (q, k, v are cheap to recompute; out and lse are not)."""
    out, lse = online_softmax_finish(states)  # [nq, K, rows, H], [nq, K, rows]
    nq, kv_heads, rq, head_dim = out.shape
    out = jnp.einsum("nkrh->nrkh", out).reshape(nq * rq // per_kv, per_kv, kv_heads, head_dim)
    out = jnp.einsum("smkh->skmh", out)
    lse = jnp.einsum("nkr->knr", lse).reshape(kv_heads, nq * rq)
    return (checkpoint_name(out.astype(dtype), SAVED_NAMES[0]),
            checkpoint_name(lse, SAVED_NAMES[1]))


def _grad_keys(dq, q_KxRxH, k_KxTxH, v_KxTxH, seg_q, pos_q, seg_k, pos_k, do_KxRxH, lse_KxR,
               delta_KxR, block_q, block_k):
    """Backward of q's attention over one key stream k, v [K, Tk, H] (seg_k, pos_k [Tk]).

    lse and delta = Σ_h d_out·out [K, R] are of the whole attention (every stream), so the
    streams' gradients simply add. dq [K, R, H] fp32 accumulates; returns (dq, dk, dv),
    dk and dv [K, Tk, H] fp32.
    """
    scale, rq, nq, nk, kinds, need, seg_r, pos_r, skb, pkb = _tiling(
        q_KxRxH, k_KxTxH, seg_q, pos_q, seg_k, pos_k, block_q, block_k)
    q_lo, q_hi = needed_range(need.T)
    kv_heads, _, head_dim = q_KxRxH.shape
    qb, dob = _split_blocks(q_KxRxH, nq), _split_blocks(do_KxRxH, nq)
    kb, vb = _split_blocks(k_KxTxH, nk), _split_blocks(v_KxTxH.astype(jnp.float32), nk)
    lseb = jnp.einsum("knr->nkr", lse_KxR.reshape(kv_heads, nq, rq))
    deltab = jnp.einsum("knr->nkr", delta_KxR.reshape(kv_heads, nq, rq))

    def k_block(dq, j):
        kj, vj, skj, pkj = kb[j], vb[j], skb[j], pkb[j]
        kj32 = kj.astype(jnp.float32)

        def q_step(i, carry):
            def compute(carry, masked):
                dq, dk, dv = carry
                qi, doi = qb[i], dob[i]
                s = jnp.einsum("krh,kth->krt", qi, kj, preferred_element_type=jnp.float32)
                p = jnp.exp(s * scale - lseb[i][..., None])
                if masked:
                    p = jnp.where(_mask(seg_r[i], pos_r[i], skj, pkj), p, 0.0)
                dv = dv + jnp.einsum("krt,krh->kth", p, doi)
                dp = jnp.einsum("krh,kth->krt", doi, vj)
                ds = p * (dp - deltab[i][..., None]) * scale
                dq = dq.at[i].add(jnp.einsum("krt,kth->krh", ds, kj32))
                dk = dk + jnp.einsum("krt,krh->kth", ds, qi.astype(jnp.float32))
                return dq, dk, dv

            return jax.lax.cond(kinds[i, j] > 0, lambda c: jax.lax.cond(
                kinds[i, j] > 1, lambda c: compute(c, False), lambda c: compute(c, True), c),
                lambda c: c, carry)

        zeros = _vary_like(jnp.zeros((kv_heads, block_k, head_dim), jnp.float32), dq)
        dq, dk, dv = jax.lax.fori_loop(q_lo[j], q_hi[j], q_step, (dq, zeros, zeros))
        return dq, (dk, dv)

    dq = _vary_all(_split_blocks(dq, nq), q_KxRxH, k_KxTxH, v_KxTxH, do_KxRxH)
    dq, (dk, dv) = jax.lax.scan(k_block, dq, jnp.arange(nk))  # [nk, K, Bk, H]
    return _join_blocks(dq), _join_blocks(dk), _join_blocks(dv)


def _delta(d_out, out):
    """Σ_h d_out · out in query rows: [K, R] fp32, the softmax-backward row term."""
    kv_heads = d_out.shape[1]
    return jnp.einsum("skmh,skmh->ksm", d_out.astype(jnp.float32),
                      out.astype(jnp.float32)).reshape(kv_heads, -1)


def _no_grads(*xs):
    return [np.zeros(x.shape, jax.dtypes.float0) for x in xs]


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def _flash(q, k, v, seg_q, pos_q, seg_k, pos_k, block_q, block_k):
    return _flash_fwd(q, k, v, seg_q, pos_q, seg_k, pos_k, block_q, block_k)[0]


def _flash_fwd(q, k, v, seg_q, pos_q, seg_k, pos_k, block_q, block_k):
    """q [S, K, M, H]; k, v [T, K, H] -> out [S, K, M, H], residuals (… lse [K, S·M])."""
    # Under the layers' lax.scan, seg and pos are loop-invariant, and JAX's scan partial
    # evaluation (when differentiating) splits off everything in this loop nest that
    # depends only on them and on constants (block predicates, masks, fills) and stacks
    # it per block as [nq, nk, …, Bq, Bk] residuals: O(S·T) memory. Tying seg and pos to
    # q (loop-variant) through a barrier keeps the whole loop nest in one piece.
    q, seg_q, pos_q, seg_k, pos_k = jax.lax.optimization_barrier(
        (q, seg_q, pos_q, seg_k, pos_k))
    per_kv = q.shape[2]
    q_r = _rows(q)
    states = _fold_keys(_blocks_init(q_r, k, block_q * per_kv), q_r, _heads_first(k),
                        _heads_first(v), seg_q, pos_q, seg_k, pos_k, block_q, block_k)
    out, lse = _finish_blocks(states, per_kv, q.dtype)
    return out, (q, k, v, seg_q, pos_q, seg_k, pos_k, out, lse)


def _flash_bwd(block_q, block_k, res, d_out):
    q, k, v, seg_q, pos_q, seg_k, pos_k, out, lse = res
    per_kv = q.shape[2]
    q_r = _rows(q)
    dq = jnp.zeros(q_r.shape, jnp.float32)
    dq, dk, dv = _grad_keys(dq, q_r, _heads_first(k), _heads_first(v), seg_q, pos_q, seg_k,
                            pos_k, _rows(d_out.astype(jnp.float32)), lse, _delta(d_out, out),
                            block_q, block_k)
    return (_unrows(dq, per_kv).astype(q.dtype), _heads_last(dk).astype(k.dtype),
            _heads_last(dv).astype(v.dtype), *_no_grads(seg_q, pos_q, seg_k, pos_k))


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


def tile(n: int, block: int) -> int:
    """Rows of a tile of a stream of n rows: a power of two dividing n, ≥ min(block, its
    largest such) and grown toward GROWN_TILE on long streams."""
    return block_size(n, max(block, min(n // TILES_PER_STREAM, GROWN_TILE)))


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
    Returns [S, Q, H]. implementation: one of IMPLEMENTATIONS; `block` caps its tiles.
    """
    _check_implementation(implementation)
    s_len, q_heads, head_dim = q_SxQxH.shape
    kv_heads = k_SxKxH.shape[1]
    q_SxKxMxH = q_SxQxH.reshape(s_len, kv_heads, q_heads // kv_heads, head_dim)
    k_TxKxH, v_TxKxH = gather_cp(k_SxKxH), gather_cp(v_SxKxH)
    seg_T, pos_T = gather_cp(segment_S), gather_cp(position_S)
    if implementation == "pallas":
        from jcp import pallas_attention  # here, not at the top: it builds on this module

        return pallas_attention.flash_attention(q_SxQxH, k_TxKxH, v_TxKxH, segment_S,
                                                position_S, seg_T, pos_T, block)
    if implementation == "dense":
        out = _dense(q_SxKxMxH, k_TxKxH, v_TxKxH, segment_S, position_S, seg_T, pos_T)
    else:
        out = _flash(q_SxKxMxH, k_TxKxH, v_TxKxH, segment_S, position_S, seg_T, pos_T,
                     tile(s_len, block), tile(k_TxKxH.shape[0], block))
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
    bq, bk = tile(s_len, block), tile(cp * s_len, block)
    k_sum = block_summary(segment_CPxS.reshape(-1), position_CPxS.reshape(-1), bk, xp=np)
    return np.array([
        blocks_needed(block_summary(segment_CPxS[r], position_CPxS[r], bq, xp=np), k_sum,
                      xp=np).sum() for r in range(cp)])


# ----------------------------------------------------------------------------------------
# Ring attention over cp: K/V never gathered whole


def _ring_perm(cp: int):
    """One hop around the cp ring: rank r sends to r + 1 (so at step t it holds r − t's)."""
    return [(r, (r + 1) % cp) for r in range(cp)]


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _ring(q, k, v, seg, pos, block, cp):
    return _ring_fwd(q, k, v, seg, pos, block, cp)[0]


def _ring_fwd(q, k, v, seg, pos, block, cp):
    """q [S, K, M, H]; k, v [S, K, H] of this rank -> out [S, K, M, H], residuals.

    Step t (unrolled: a loop would cost one more K/V transfer) folds the keys of rank
    r − t into the online-softmax states while the keys of rank r − t − 1 travel: the
    ppermute of the next block is issued before the compute that does not depend on it.
    K and V travel as one packed [2, K, S, H] message, segment and position as [2, S].
    """
    # The barrier: see _flash_fwd.
    q, seg, pos = jax.lax.optimization_barrier((q, seg, pos))
    per_kv = q.shape[2]
    q_r = _rows(q)
    kv, meta = jnp.stack([_heads_first(k), _heads_first(v)]), jnp.stack([seg, pos])
    states = _blocks_init(q_r, k, block * per_kv)
    for step in range(cp):
        if step + 1 < cp:
            kv_next, meta_next = jax.lax.ppermute((kv, meta), CP, _ring_perm(cp))
        states = _fold_keys(states, q_r, kv[0], kv[1], seg, pos, meta[0], meta[1], block, block)
        if step + 1 < cp:
            kv, meta = kv_next, meta_next
    out, lse = _finish_blocks(states, per_kv, q.dtype)
    return out, (q, k, v, seg, pos, out, lse)


def _ring_bwd(block, cp, res, d_out):
    """The keys go round again; each block's dK/dV (fp32 [2, K, S, H]) travels with it,
    gathering every rank's contribution, and one last hop returns it to its owner."""
    q, k, v, seg, pos, out, lse = res
    per_kv = q.shape[2]
    q_r, do_r, delta = _rows(q), _rows(d_out.astype(jnp.float32)), _delta(d_out, out)
    dq = jnp.zeros(q_r.shape, jnp.float32)
    kv, meta = jnp.stack([_heads_first(k), _heads_first(v)]), jnp.stack([seg, pos])
    dkv = _vary_all(jnp.zeros(kv.shape, jnp.float32), q, kv, d_out)
    for step in range(cp):
        if step + 1 < cp:
            kv_next, meta_next = jax.lax.ppermute((kv, meta), CP, _ring_perm(cp))
        dq, dk, dv = _grad_keys(dq, q_r, kv[0], kv[1], seg, pos, meta[0], meta[1], do_r, lse,
                                delta, block, block)
        dkv = dkv + jnp.stack([dk, dv])
        if cp > 1:  # to the rank that holds this block next; after the last step, its owner
            dkv = jax.lax.ppermute(dkv, CP, _ring_perm(cp))
        if step + 1 < cp:
            kv, meta = kv_next, meta_next
    return (_unrows(dq, per_kv).astype(q.dtype), _heads_last(dkv[0]).astype(k.dtype),
            _heads_last(dkv[1]).astype(v.dtype), *_no_grads(seg, pos))


_ring.defvjp(_ring_fwd, _ring_bwd)


def ring_attention(q_SxQxH, k_SxKxH, v_SxKxH, segment_S, position_S, *,
                   block: int = DEFAULT_BLOCK, implementation: str = "blockwise"):
    """cp_attention's result without gathering K/V: they travel the cp ring instead.

    Same arguments, mask and result as cp_attention (blockwise); per-device memory is
    O(S) — this rank's K/V, the one in flight, and their fp32 gradients — never O(CP·S).
    Runs inside shard_map over "cp". With the zigzag layout every rank computes the same
    number of blocks at every step (ring_block_work), so no rank waits at a hop.
    implementation: "blockwise" or "pallas" (pallas_attention.ring_attention: one fused
    kernel call per step).
    """
    if implementation not in ("blockwise", "pallas"):
        raise ValueError(f"ring attention implementation must be 'blockwise' or 'pallas', "
                         f"got {implementation!r}")
    if implementation == "pallas":
        from jcp import pallas_attention  # here, not at the top: it builds on this module

        return pallas_attention.ring_attention(q_SxQxH, k_SxKxH, v_SxKxH, segment_S,
                                               position_S, block=block)
    s_len, q_heads, head_dim = q_SxQxH.shape
    kv_heads = k_SxKxH.shape[1]
    q_SxKxMxH = q_SxQxH.reshape(s_len, kv_heads, q_heads // kv_heads, head_dim)
    out = _ring(q_SxKxMxH, k_SxKxH, v_SxKxH, segment_S, position_S, tile(s_len, block),
                jax.lax.axis_size(CP))
    return out.reshape(s_len, q_heads, head_dim)


def ring_attend(segment_S, position_S, *, block: int = DEFAULT_BLOCK,
                implementation: str = "blockwise") -> Attend:
    """The training strategy with ring_attention: like cp_attend, state passed through."""

    def attend(q_SxQxH, k_SxKxH, v_SxKxH, state):
        return ring_attention(q_SxQxH, k_SxKxH, v_SxKxH, segment_S, position_S,
                              block=block, implementation=implementation), state

    return attend


CP_ATTENTION = ("auto", "gather", "ring")
# "auto" rings once the all-gather would hold more than this per layer (gathered_kv_bytes).
# Below it the gathered K/V are small next to the rest of a layer's memory and one
# collective beats cp − 1 hops; above it they dominate per-device memory as cp grows.
RING_ABOVE_BYTES = 64 << 20


def gathered_kv_bytes(cp: int, s_len: int, kv_heads: int, head_dim: int, itemsize: int) -> int:
    """Bytes the all-gather path holds for one layer: K and V [CP·S, K, H] and, in the
    backward pass, their fp32 gradients."""
    return cp * s_len * kv_heads * head_dim * 2 * (itemsize + 4)


def choose_cp_attention(choice: str, cp: int, s_len: int, kv_heads: int, head_dim: int,
                        itemsize: int) -> str:
    """"gather" or "ring": choice itself unless "auto"; then ring iff cp > 1 and
    gathered_kv_bytes > RING_ABOVE_BYTES."""
    if choice not in CP_ATTENTION:
        raise ValueError(f"cp_attention must be one of {CP_ATTENTION}, got {choice!r}")
    if choice != "auto":
        return choice
    big = gathered_kv_bytes(cp, s_len, kv_heads, head_dim, itemsize) > RING_ABOVE_BYTES
    return "ring" if cp > 1 and big else "gather"


def ring_block_work(segment_CPxS: np.ndarray, position_CPxS: np.ndarray,
                    block: int = DEFAULT_BLOCK) -> np.ndarray:
    """Host-side count of attention blocks each rank computes at each ring step: int
    [CP steps, CP ranks] (at step t, rank r holds the keys of rank r − t)."""
    cp, s_len = segment_CPxS.shape
    b = tile(s_len, block)
    summ = [block_summary(segment_CPxS[r], position_CPxS[r], b, xp=np) for r in range(cp)]
    return np.array([[blocks_needed(summ[r], summ[(r - t) % cp], xp=np).sum()
                      for r in range(cp)] for t in range(cp)])
