"""Tiling of attention into blocks, shared by every kernel (blockwise, Pallas, decode).

Owns the (segment, position) mask, the per-block summaries and the predicate that skips
blocks the mask empties (and its host-side work counts), the tile sizes, the ring's hop,
the names of the residuals a remat policy may keep, and the small shard_map typing helpers
the kernels' custom VJPs need. It must never build an array of [local tokens, all tokens].

Shapes: see the legend in jcp/mesh.py (S queries on this rank, T keys, Bq and Bk block rows).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jcp.mesh import block_size, vary, varying_axes

DEFAULT_BLOCK = 512


# Tiles grow with the stream: at least `block` rows, and up to GROWN_TILE rows while a
# stream still spans ≥ TILES_PER_STREAM of them (on CPU, 64-row tiles skip the most masked
# work on short datums, but their loop overhead dominates long ones; measured 1.36× faster
# fwd+bwd at 16k tokens with 256-row tiles than with 64).
GROWN_TILE, TILES_PER_STREAM = 256, 64


# Residuals of the blockwise kernel that a remat policy may save (see model.hidden_states).
SAVED_NAMES = ("attention_out", "attention_lse")


def vary_like(x, ref):
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


def visible(seg_q, pos_q, seg_k, pos_k):
    """[Bq, Bk] bool, jcp's attention mask: same datum, key not after query, query is a real token."""
    return ((seg_q[:, None] == seg_k[None, :]) & (seg_q[:, None] >= 0)
            & (pos_k[None, :] <= pos_q[:, None]))


def vary_all(x, *refs):
    """Cast x to vary over every mesh axis that any of refs varies over."""
    for r in refs:
        x = vary_like(x, r)
    return x


def block_kinds(seg_q, pos_q, seg_k, pos_k, block_q, block_k):
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


def no_grads(*xs):
    return [np.zeros(x.shape, jax.dtypes.float0) for x in xs]


def tile(n: int, block: int) -> int:
    """Rows of a tile of a stream of n rows: a power of two dividing n, ≥ min(block, its
    largest such) and grown toward GROWN_TILE on long streams."""
    return block_size(n, max(block, min(n // TILES_PER_STREAM, GROWN_TILE)))


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


def ring_perm(cp: int):
    """One hop around the cp ring: rank r sends to r + 1 (so at step t it holds r − t's)."""
    return [(r, (r + 1) % cp) for r in range(cp)]


def ring_block_work(segment_CPxS: np.ndarray, position_CPxS: np.ndarray,
                    block: int = DEFAULT_BLOCK) -> np.ndarray:
    """Host-side count of attention blocks each rank computes at each ring step: int
    [CP steps, CP ranks] (at step t, rank r holds the keys of rank r − t)."""
    cp, s_len = segment_CPxS.shape
    b = tile(s_len, block)
    summ = [block_summary(segment_CPxS[r], position_CPxS[r], b, xp=np) for r in range(cp)]
    return np.array([[blocks_needed(summ[r], summ[(r - t) % cp], xp=np).sum()
                      for r in range(cp)] for t in range(cp)])
