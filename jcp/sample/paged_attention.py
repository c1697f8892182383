"""Attention through page tables: the strategies (attention.Attend) the engine's paged
programs (paged.py) pass to the decoder.

Owns extend's attention of a row's C new tokens over its cached pages and each other
(paged_attend), decode's one new token per row over its gathered pages
(paged_decode_attend) or read in place by one Pallas kernel (pallas_decode_attend,
attention.paged; its layer state: layer_indices). Each reads the pool's K/V [P, page, K,
H] through a row's page table [M] (−1: no page); none writes the pool (paged.write_pages
does, after the layer stack) or decides which pages a row holds (admission.py,
pages.py). paged.py re-exports every name.

Shapes: see jcp/mesh.py; B = rows of the call (per device inside shard_map), C = new
tokens per row, M = table entries per row, P = pool pages (per device).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jcp.attention import paged as paged_kernel
from jcp.sample import kv_cache


def paged_attend(table_BxM, start_B, valid_BxC):
    """Attention of each row's C new tokens over its cached positions and each other.

    table_BxM: device-local page of each table entry (−1 none); start_B: the position of
    the row's first new token (cached positions are 0 … start − 1); valid_BxC: which new
    tokens are real (padding neither sees nor is seen). Query c sees cached positions
    < start and new tokens c' ≤ c. state: this layer's KV(k [P, page, K, H], v); q, k,
    v: [B·C, ·, H] (row-major). Returns (out [B·C, Q, H], KV(k, v) of the new tokens).
    """
    b, m = table_BxM.shape
    c = valid_BxC.shape[1]

    def attend(q_NxQxH, k_NxKxH, v_NxKxH, state: kv_cache.KV):
        q_heads, head_dim = q_NxQxH.shape[1:]
        kv_heads = k_NxKxH.shape[1]
        per_kv = q_heads // kv_heads
        page = state.k.shape[1]
        q = q_NxQxH.reshape(b, c, kv_heads, per_kv, head_dim)
        k_new = k_NxKxH.reshape(b, c, kv_heads, head_dim)
        v_new = v_NxKxH.reshape(b, c, kv_heads, head_dim)
        take = jnp.maximum(table_BxM, 0)
        k_old, v_old = (
            jnp.take(x, take, axis=0).reshape(b, m * page, kv_heads, head_dim)
            for x in (state.k, state.v)
        )
        t = jnp.arange(m * page)
        seen_BxT = (t[None] < start_B[:, None]) & jnp.repeat(table_BxM >= 0, page, axis=1)
        causal = jnp.arange(c)[:, None] >= jnp.arange(c)[None, :]
        seen_BxCxC = causal[None] & valid_BxC[:, None, :]
        scale = 1.0 / np.sqrt(head_dim)
        s_old = (
            jnp.einsum("bckmh,btkh->bkmct", q, k_old, preferred_element_type=jnp.float32) * scale
        )
        s_new = (
            jnp.einsum("bckmh,bdkh->bkmcd", q, k_new, preferred_element_type=jnp.float32) * scale
        )
        s = jnp.concatenate(
            [
                jnp.where(seen_BxT[:, None, None, None], s_old, -jnp.inf),
                jnp.where(seen_BxCxC[:, None, None], s_new, -jnp.inf),
            ],
            -1,
        )
        top = jnp.max(s, -1, keepdims=True)
        p = jnp.exp(s - jnp.where(jnp.isfinite(top), top, 0.0))
        total = jnp.sum(p, -1)
        vals = jnp.concatenate([v_old, v_new], 1).astype(jnp.float32)
        out = jnp.einsum("bkmct,btkh->bckmh", p, vals)
        out = out / jnp.where(total == 0, 1.0, total).transpose(0, 3, 1, 2)[..., None]
        return (
            out.reshape(b * c, q_heads, head_dim).astype(q_NxQxH.dtype),
            kv_cache.KV(k_NxKxH, v_NxKxH),
        )

    return attend


def paged_decode_attend(table_BxM, position_B, page: int):
    """paged_attend for one new token per row (decode), as the static sampler's decode
    step: each row's pages are gathered into its T = M·page cached positions (one copy,
    in the layout the score and value dots read) and kv_cache.decode_attend runs on them —
    the cached positions, then the row's own new key, by online softmax. paged_attend's
    general form concatenates the gathered K/V with the new ones ([T + 1]): one more copy
    of them per layer and step, and its exps run in a transposed layout (measured on the
    tiny model, B 512, T 64: 1.29 vs 1.26 ms CPU per layer and step; the static sampler's
    1.12 reads its rows without a gather). Positions without a page (−1) or at ≥ the
    row's position are not seen."""
    b, m = table_BxM.shape
    t = jnp.arange(m * page)
    have_BxT = jnp.repeat(table_BxM >= 0, page, axis=1)
    inner = kv_cache.decode_attend(position_B, jnp.where(have_BxT, t[None], -1))
    take = jnp.maximum(table_BxM, 0)

    def attend(q_BxQxH, k_BxKxH, v_BxKxH, state: kv_cache.KV):
        kv_heads, head_dim = state.k.shape[2:]
        k_old, v_old = (
            jnp.take(x, take, axis=0).reshape(b, m * page, kv_heads, head_dim)
            for x in (state.k, state.v)
        )
        return inner(q_BxQxH, k_BxKxH, v_BxKxH, kv_cache.KV(k_old, v_old))

    return attend


def pallas_decode_attend(table_BxM, position_B, pool_k, pool_v):
    """paged_decode_attend as one Pallas kernel (attention.paged.paged_decode) that reads
    each row's pages where they lie: no gathered copy, the live K/V read once per layer
    and step. Same values to fp32 rounding.

    pool_k, pool_v: every layer's pages [L, P, page, K, H] (the loop's store), seen as
    [L·P, page, K, H] (a view). The layer stack's state for this strategy is each layer's
    index (KV(l, l): layer_indices), not its slice of the pool: a kernel's operand sliced
    out of the stack would be a copy of the layer's whole pool on GPU."""
    n_pages = pool_k.shape[1]
    flat_k, flat_v = (x.reshape((-1,) + x.shape[2:]) for x in (pool_k, pool_v))

    def attend(q_BxQxH, k_BxKxH, v_BxKxH, layer: kv_cache.KV):
        pages_BxM = jnp.where(table_BxM >= 0, layer.k * n_pages + table_BxM, -1)
        out = paged_kernel.paged_decode(
            q_BxQxH, k_BxKxH, v_BxKxH, flat_k, flat_v, pages_BxM, position_B
        )
        return out, kv_cache.KV(k_BxKxH, v_BxKxH)

    return attend


def layer_indices(pool_k):
    """int32 [L]: the per-layer state pallas_decode_attend's layer stack threads."""
    return jnp.arange(pool_k.shape[0], dtype=jnp.int32)
