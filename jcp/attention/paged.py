"""Paged decode attention as one Pallas (Triton) kernel: each row's pages read in place.

Owns `paged_decode`: one new query token per row against the K/V of that row's cached
positions, which live in pages of a pool [N, T, K, H] listed by the row's page table, then
against the row's own new key. The kernel reads every page through the table where it
lies; the XLA path (sample/paged.paged_decode_attend) first gathers each row's pages into
a contiguous [B, W·T, K, H] copy per layer and step and then reads that copy — the live
K/V crosses HBM three times instead of once. Decode is bound by those reads.

One program per (row, kv head): its M query heads together (GQA: the group shares every
page it loads), padded to Mp rows for tl.dot (≥ 16, a power of two), loop over blocks of
`per_block` pages (≥ 64 keys when pages are small, so each load is wide), the online-
softmax step of attention.tiling, then the row's own key. Position t of a row is visible
iff its table entry is a page (≥ 0) and t < the row's position — exactly
kv_cache.decode_attend's mask over the gathered rows, so both paths give the same values
to fp32 rounding (both dots accumulate fp32 and the probabilities meet fp32 values, as
the XLA path's einsums do; never tf32).

It must never gather a row's pages into a copy, nor index a layer out of a stacked pool
before the call (on GPU that slice is a copy of the whole layer's pool): callers pass the
pool with layers and pages flattened ([L·P, T, K, H], a free reshape) and page ids offset
by layer · P. Like attention.pallas it runs interpreted on CPU (tests only) and is never
the CPU default (sample/paged.make_decode takes it for attn_impl "pallas").

Shapes: B rows, Q query heads, K kv heads (this tp shard), M = Q / K, Mp ≥ M padded,
H head dim, N pool pages, T positions per page, W table entries per row.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jcp.attention.pallas import MIN_TILE, call_kernel, check_head_dim, interpret_mode
from jcp.attention.tiling import SoftmaxState, online_softmax_finish, online_softmax_step

# Keys per loop step at least this many (pages of T < 64 positions are loaded several at
# a time): wider loads keep more bytes in flight per program. A tunable, not measured on a
# GPU here.
BLOCK_KEYS = 64


def _kernel(
    pages_ref, q_ref, pos_ref, knew_ref, vnew_ref, k_ref, v_ref, o_ref, *, scale, per_block
):
    """Row b, kv head g: q [Mp, H] against the pages pages_ref [Wp] lists (k, v [N, T, H]),
    positions < pos_ref[0], then its own key knew, vnew [H]."""
    q_MpxH = q_ref[...]
    rows, head_dim = q_MpxH.shape
    page = k_ref.shape[1]
    keys = per_block * page
    pos = pos_ref[0]
    n_blocks = jnp.minimum(pl.cdiv(pos, keys), pages_ref.shape[0] // per_block)

    def body(j, state):
        ids = pages_ref[pl.ds(pl.multiple_of(j * per_block, per_block), per_block)]
        at = jnp.maximum(ids, 0)
        k_BkxH = k_ref[at].reshape(keys, head_dim)
        v_BkxH = v_ref[at].reshape(keys, head_dim)
        s_MpxBk = plgpu.dot(q_MpxH, k_BkxH, trans_b=True, allow_tf32=False) * scale
        have = jnp.broadcast_to((ids >= 0)[:, None], (per_block, page)).reshape(keys)
        t = j * keys + jax.lax.broadcasted_iota(jnp.int32, (keys,), 0)
        s_MpxBk = jnp.where((have & (t < pos))[None, :], s_MpxBk, -jnp.inf)
        return online_softmax_step(
            state, s_MpxBk, lambda p: plgpu.dot(p, v_BkxH.astype(jnp.float32), allow_tf32=False)
        )

    state = jax.lax.fori_loop(
        0,
        n_blocks,
        body,
        SoftmaxState(
            jnp.full((rows,), -jnp.inf, jnp.float32),
            jnp.zeros((rows,), jnp.float32),
            jnp.zeros((rows, head_dim), jnp.float32),
        ),
    )
    # The row's own key: always visible (so no row ends empty).
    knew_1xH = knew_ref[...].astype(jnp.float32)[None, :]
    s_Mpx1 = jnp.sum(q_MpxH.astype(jnp.float32) * knew_1xH, axis=1, keepdims=True) * scale
    vnew_1xH = vnew_ref[...].astype(jnp.float32)[None, :]
    state = online_softmax_step(state, s_Mpx1, lambda p: p * vnew_1xH)
    o_ref[...] = online_softmax_finish(state)[0].astype(o_ref.dtype)


def _pow2_at_least(n: int, floor: int) -> int:
    return max(floor, 1 << max(n - 1, 0).bit_length())


def paged_decode(
    q_BxQxH,
    k_new_BxKxH,
    v_new_BxKxH,
    k_NxTxKxH,
    v_NxTxKxH,
    pages_BxW,
    position_B,
    block_keys: int = BLOCK_KEYS,
):
    """Decode attention of each row's new token over its pages, read in place.

    q: the rows' queries; k_new, v_new: their own new keys and values; k, v: the page
    pool (every layer's pages, flattened: the caller offsets page ids by its layer);
    pages_BxW: row b's page ids in position order (−1: no page); position_B: the new
    token's position (cached positions 0 … position − 1 are seen, where they have a page,
    then the new key). Returns out [B, Q, H] in q's dtype.
    """
    interpret = interpret_mode()
    b, q_heads, head_dim = q_BxQxH.shape
    kv_heads = k_new_BxKxH.shape[1]
    page = k_NxTxKxH.shape[1]
    per_kv = q_heads // kv_heads
    check_head_dim(head_dim, interpret)
    if not interpret and (page & (page - 1)):
        raise ValueError(
            f"the Pallas paged decode kernel needs a power-of-two page size on GPU, got {page}"
        )
    # Pages per loop step: a power of two, so every load has power-of-two sides.
    per_block = _pow2_at_least(-(-block_keys // page), 1)
    if not interpret and per_block * page < MIN_TILE:
        raise ValueError(f"the Pallas paged decode kernel needs ≥ {MIN_TILE} keys per step")
    # Up to a whole number of blocks; the padding entries are no page (never visible).
    w = pages_BxW.shape[1]
    wp = -(-w // per_block) * per_block
    pages = jnp.pad(pages_BxW.astype(jnp.int32), ((0, 0), (0, wp - w)), constant_values=-1)
    mp = _pow2_at_least(per_kv, MIN_TILE)
    q = jnp.pad(
        q_BxQxH.reshape(b, kv_heads, per_kv, head_dim), ((0, 0), (0, 0), (0, mp - per_kv), (0, 0))
    )
    n_pages = k_NxTxKxH.shape[0]
    pool_spec = pl.BlockSpec((n_pages, page, None, head_dim), lambda i, g: (0, 0, g, 0))
    new_spec = pl.BlockSpec((None, None, head_dim), lambda i, g: (i, g, 0))
    q_spec = pl.BlockSpec((None, None, mp, head_dim), lambda i, g: (i, g, 0, 0))
    (out,) = call_kernel(
        functools.partial(_kernel, scale=1.0 / np.sqrt(head_dim), per_block=per_block),
        (b, kv_heads),
        [
            pl.BlockSpec((None, wp), lambda i, g: (i, 0)),
            q_spec,
            pl.BlockSpec((1,), lambda i, g: (i,)),
            new_spec,
            new_spec,
            pool_spec,
            pool_spec,
        ],
        [q_spec],
        [((b, kv_heads, mp, head_dim), q_BxQxH.dtype)],
        [pages, q, position_B.astype(jnp.int32), k_new_BxKxH, v_new_BxKxH, k_NxTxKxH, v_NxTxKxH],
        "jcp_paged_decode",
        head_dim,
        interpret,
    )
    return out[:, :, :per_kv].reshape(b, q_heads, head_dim)
