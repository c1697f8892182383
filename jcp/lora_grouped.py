"""The grouped multi-LoRA products: each row multiplied by its own adapter's factors only,
in tiles of one adapter's rows (Tiles), so a pass costs what its rows cost whatever the
number of adapters in it.

Owns the tile size (tile_rows), the plan of a stream's rows routed by spans (training,
prefill) or row by row (a decode batch) into tiles and extra tiles (plan_spans, plan_rows),
the product over the tiles with its custom VJP (tile_product), and the same product reading
its factors from the slot table's pages and adding its factor gradient into the
accumulator's pages in place (paged_product: a training pass over many adapters holds no
gathered copy of their factors and no stacked copy of their gradients), and both through
jcp.lora_cpu's C++ kernels instead of the tiles where lora_impl is "cpu" (kernel_product
for array factors, Routing.kernel; PageSource.kernel for the pages). jcp/lora.py routes
to these past DENSE_MAX_ADAPTERS active adapters. It never copies adapter weights per token
and never multiplies a token by another adapter's factors.

Shapes: see the legend in jcp/mesh.py (Q: a stream's rows in adapter order, N tiles of T
rows, E extra tiles, A active adapters).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from jcp import lora_cpu
from jcp.mesh import BATCH_AXES, TP, block_size, vary, vary_all, varying_axes

# Extra tiles (Tiles) are multiplied EXTRA_CHUNK at a time, in a loop over those in use, or
# EXTRA_CHUNK_MANY at a time past EXTRA_CHUNK_MANY of them (extra_chunk). Measured
# (benchmarks/multi_lora.py, CPU s against one adapter, one run each): a 1024-wide model over
# 256 / 64 adapters 1.40 / 1.11× in chunks of 8, 1.27–1.30 / 1.05–1.06× in chunks of 16 or
# 32; the tiny model's served passes (many_tenants.py --in-process: 16 adapters a
# micro-batch, 15 extras) ~3.1 s in chunks of 8 against ~3.8 s in one chunk of 15.
EXTRA_CHUNK = 8
EXTRA_CHUNK_MANY = 32


def extra_chunk(n_e: int) -> int:
    """The extra tiles one step of their loop multiplies, of n_e extras (a multiple of it
    once _plan has rounded n_e up)."""
    return min(n_e, EXTRA_CHUNK if n_e <= EXTRA_CHUNK_MANY else EXTRA_CHUNK_MANY)


def tile_rows(s_len: int, n_active: int) -> int:
    """Rows T of a tile of the grouped LoRA products over s_len rows and n_active adapters:
    the largest power of two dividing s_len and at most S / A, the adapters' mean rows.

    Work: the S rows, the extra tiles of adapters starting inside a tile (up to A − 1 of T
    rows) and, per tile, a gather of its adapter's factors — rows of product ≤ S + (A − 1)·T
    < 2S, factor copies ≤ S / T + A − 1 < 2A. Measured (benchmarks/multi_lora.py's fused
    forward_backward, 4096 rows of a 1024-wide model, r16 on attn + mlp, CPU s against one
    adapter; 256 datums of 8–24 rows, so 64 / 256 adapters hold 64 / 16 rows each):
    T = S / (4√(A − 1)) (128 / 64) 1.17 / 1.56×, S / (16√(A − 1)) (32 / 16) 0.99–1.06 /
    1.31–1.39×, S / A (64 / 16) 1.06 / 1.27× (with the extras in chunks of 32); the tiny
    model's served passes (16 adapters of 255 rows in 4096) run T = 256 best (T = 64: ~20 %
    slower). Training's 4096 rows: 1024, 256, 64, 16 at A = 4, 16, 64, 256; decode's 256
    rows: 16 at A = 16, 4 at 64, 1 at 256.
    """
    return block_size(s_len, s_len // n_active)


@dataclasses.dataclass(frozen=True)
class Tiles:
    """How the rows of one stream meet their own adapter's factors, in tiles of T rows.

    The rows are taken in adapter order (Q: the stream's rows in that order; order_Q the
    stream row at each place, place_S each stream row's place — both None for spans, where
    packing already sorted the stream by adapter) and cut into N = Q / T tiles. Each tile
    is multiplied by one adapter, its first routed row's: pick_N (index into the A active
    adapters); keep_NxT marks the rows that adapter owns. A tile in which further adapters
    start is multiplied again for each of them: the extras tile_E, pick_E, keep_ExT, the
    first count_E of E ≤ A − 1 (rounded up to extra_chunk) in use — the products loop over
    those only, so active entries without rows (a padded bucket) cost nothing. Rows of no
    adapter (padding, the base model)
    are kept by no tile. rank_N / rank_E: those adapters' order along the stream
    (nondecreasing: the factor gradients' sorted segment sums), rank_of_A the rank of each
    active adapter; pick_Q the active adapter of each row (any where it has none);
    weight_Q its scale alpha / r (0 for none); row_Q its active adapter, -1 for none (the
    CPU kernels' routing, jcp.lora_cpu).

    Worked example, T = 4, adapters a (rows 0–5), b (6–6), c (7–11), padding 12–15:
        tiles     [0 1 2 3 | 4 5 6 7 | 8 9 10 11 | 12 13 14 15]
        pick_N      a         a         c           (c, keeps nothing)
        keep_NxT  [1 1 1 1 | 1 1 0 0 | 1 1 1  1  | 0  0  0  0 ]
        extras    (tile 1, b: keep 0 0 1 0), (tile 1, c: keep 0 0 0 1)
    Work: N + count_E tiles of T rows, each with its own adapter's factors gathered once
    per tile: cost (Q + count_E·T)·I·R, whatever A is — never A·R columns per row.
    """

    pick_N: jax.Array
    rank_N: jax.Array
    keep_NxT: jax.Array
    tile_E: jax.Array
    pick_E: jax.Array
    rank_E: jax.Array
    keep_ExT: jax.Array
    count_E: jax.Array
    rank_of_A: jax.Array
    pick_Q: jax.Array
    weight_Q: jax.Array
    row_Q: jax.Array
    order_Q: jax.Array | None = None
    place_S: jax.Array | None = None


jax.tree_util.register_dataclass(
    Tiles, data_fields=[f.name for f in dataclasses.fields(Tiles)], meta_fields=[]
)


def _plan(rank_Q, has_Q, start_A, live_A, slot_A, scale_A, tile: int, order_Q=None) -> Tiles:
    """Tiles of rows already in adapter order. rank_Q: each row's adapter as its rank along
    the rows (nondecreasing where has_Q); start_A / live_A: the first row of each rank and
    whether it has rows; slot_A: the active adapter of each rank; scale_A by active
    adapter."""
    n_q, n_a = rank_Q.shape[0], slot_A.shape[0]
    n = n_q // tile
    rank_NxT, has_NxT = rank_Q.reshape(n, tile), has_Q.reshape(n, tile)
    lead_N = jnp.take_along_axis(rank_NxT, jnp.argmax(has_NxT, axis=1)[:, None], axis=1)[:, 0]
    # A tile of no adapter's rows keeps nothing; its rank keeps rank_N nondecreasing.
    rank_N = jax.lax.cummax(jnp.where(has_NxT.any(axis=1), lead_N, 0))
    keep_NxT = has_NxT & (rank_NxT == rank_N[:, None])
    # An adapter whose first tile leads with another one's rows needs that tile again.
    first_A = jnp.clip(start_A // tile, 0, n - 1)
    extra_A = live_A & (rank_N[first_A] != jnp.arange(n_a))
    n_e = min(n_a - 1, n * (tile - 1))
    chunk = extra_chunk(n_e)
    n_e = -(-n_e // chunk) * chunk if n_e else 0
    (rank_E,) = jnp.nonzero(extra_A, size=n_e, fill_value=n_a - 1)
    tile_E = first_A[rank_E]
    count = jnp.sum(extra_A, dtype=jnp.int32)
    keep_ExT = (
        (jnp.arange(n_e) < count)[:, None]
        & jnp.take(has_NxT, tile_E, axis=0)
        & (jnp.take(rank_NxT, tile_E, axis=0) == rank_E[:, None])
    )
    pick_Q = slot_A[rank_Q]
    return Tiles(
        pick_N=slot_A[rank_N],
        rank_N=rank_N,
        keep_NxT=keep_NxT,
        tile_E=tile_E,
        pick_E=slot_A[rank_E],
        rank_E=rank_E,
        keep_ExT=keep_ExT,
        count_E=count,
        rank_of_A=jnp.argsort(slot_A),
        pick_Q=pick_Q,
        weight_Q=jnp.where(has_Q, scale_A[pick_Q], 0.0),
        row_Q=jnp.where(has_Q, pick_Q, -1).astype(jnp.int32),
        order_Q=order_Q,
        place_S=None if order_Q is None else jnp.argsort(order_Q),
    )


def plan_spans(spans_Ax2, lora_A, scale_A, s_len: int, tile: int | None = None) -> Tiles:
    """Tiles of a stream routed by disjoint row spans [start, end) (any order, empty ones
    anywhere); lora_A: False for an entry without LoRA (the base model), whose rows are
    kept by no tile. tile: T (a power of two dividing s_len; default tile_rows)."""
    start_A, end_A = spans_Ax2[:, 0], spans_Ax2[:, 1]
    key_A = jnp.where((end_A > start_A) & lora_A, start_A, s_len)
    slot_A = jnp.argsort(key_A)  # rank -> active adapter: adapters in the order of their rows
    q_S = jnp.arange(s_len)
    rank_S = jnp.searchsorted(key_A[slot_A], q_S, side="right") - 1
    has_S = (rank_S >= 0) & (q_S < end_A[slot_A[jnp.maximum(rank_S, 0)]])
    return _plan(
        jnp.maximum(rank_S, 0),
        has_S,
        key_A[slot_A],
        key_A[slot_A] < s_len,
        slot_A,
        scale_A,
        tile or tile_rows(s_len, slot_A.shape[0]),
    )


def plan_rows(index_S, lora_A, scale_A, tile: int | None = None, live_S=None) -> Tiles:
    """Tiles of rows routed one by one (index_S: each row's active adapter, in any order —
    a decode batch): the rows sorted by adapter (stable), rows of an entry without LoRA
    (lora_A False) or, given live_S, of no LoRA themselves (live_S False) first and kept by
    no tile."""
    n_a = lora_A.shape[0]
    live = lora_A[index_S] if live_S is None else lora_A[index_S] & live_S
    key_S = jnp.where(live, index_S, -1)
    order_Q = jnp.argsort(key_S, stable=True)
    rank_Q = key_S[order_Q]
    bounds = jnp.searchsorted(rank_Q, jnp.arange(n_a + 1), side="left")
    return _plan(
        jnp.maximum(rank_Q, 0),
        rank_Q >= 0,
        bounds[:-1],
        bounds[1:] > bounds[:-1],
        jnp.arange(n_a),
        scale_A,
        tile or tile_rows(index_S.shape[0], n_a),
        order_Q,
    )


def _keep(x_KxTxC, keep_KxT):
    return jnp.where(keep_KxT[..., None], x_KxTxC, jnp.zeros((), x_KxTxC.dtype))


def _extra_chunk(t: Tiles, e):
    """(tile_C, pick_C, keep_CxT) of the extra_chunk extra tiles from e on."""
    chunk = extra_chunk(t.tile_E.shape[0])
    return tuple(
        jax.lax.dynamic_slice_in_dim(v, e, chunk) for v in (t.tile_E, t.pick_E, t.keep_ExT)
    )


def _over_extras(t: Tiles, body, carry):
    """carry through body(e, carry) for the chunks of extra tiles in use (e: the chunk's
    first extra): a loop of as many steps as count_E needs, none without extras."""
    n_e = t.tile_E.shape[0]
    if not n_e:
        return carry
    chunk = extra_chunk(n_e)
    steps = (t.count_E + chunk - 1) // chunk
    return jax.lax.fori_loop(0, steps, lambda i, c: body(i * chunk, c), carry)


@jax.custom_vjp
def tile_product(x_QxI, w_AxIxO, t: Tiles):
    """y[q] = x[q] @ w[k(q)] fp32 [Q, O], k(q) row q's adapter (Tiles; 0 for rows of none):
    one batched product over the N tiles (x viewed as [N, T, I], no copy) plus one over
    the E extra tiles, added in. Each row is kept by exactly one tile, so the sum adds
    zeros only. The mask falls on the narrower side (x's I or y's O).

    Custom VJP: autodiff's gradient of w contracts the token axis with the wide operand
    first (xᵀ·dy [I, R] for the down projection), which XLA:CPU runs off its fast GEMM path
    (x [4096, 256], dy [4096, 8]: 2.1 ms on one core, batched per tile likewise); written
    with the narrow side leading (dyᵀ·x [R, I]) it takes 0.6 ms. The barrier keeps XLA from
    folding the small [R, I] → [I, R] transpose back into the dot. The per-tile gradients
    of w are summed per adapter in stream order (sorted segment sums), never by a
    scatter.
    """
    return _tiles_forward(x_QxI, lambda pick_K: w_AxIxO[pick_K], t)


def _tiles_forward(x_QxI, take, t: Tiles):
    """tile_product with each tile's factors from take(pick_K) -> [K, I, O] (K tiles' own
    adapters' factors, in x's dtype): the factors are read tile by tile, never as one
    [A, I, O] copy first."""
    n, tile = t.keep_NxT.shape
    x_NxTxI = x_QxI.reshape(n, tile, -1)

    def part(x_KxTxI, pick_K, keep_KxT):
        w_KxIxO = take(pick_K)
        narrow_in = x_KxTxI.shape[2] <= w_KxIxO.shape[2]
        x = _keep(x_KxTxI, keep_KxT) if narrow_in else x_KxTxI
        y = jnp.einsum("kti,kio->kto", x, w_KxIxO, preferred_element_type=jnp.float32)
        return y if narrow_in else _keep(y, keep_KxT)

    def extra(e, y_NxTxO):
        tile_C, pick_C, keep_CxT = _extra_chunk(t, e)
        return y_NxTxO.at[tile_C].add(part(x_NxTxI[tile_C], pick_C, keep_CxT))

    y_NxTxO = _over_extras(t, extra, part(x_NxTxI, t.pick_N, t.keep_NxT))
    return y_NxTxO.reshape(n * tile, -1)


def _tile_product_fwd(x_QxI, w_AxIxO, t):
    return tile_product(x_QxI, w_AxIxO, t), (x_QxI, w_AxIxO, t)


def _part_grads(x_KxTxI, dy_KxTxO, w_KxIxO, keep_KxT):
    """(dx [K, T, I], dw per tile) of K tiles, each by its adapter's factors w_KxIxO and
    rows keep_KxT: dw [K, I, O] where I ≤ O (the narrow side leads), else [K, O, I] (see
    tile_product)."""
    if x_KxTxI.shape[2] <= dy_KxTxO.shape[2]:
        dw = jnp.einsum(
            "kti,kto->kio", _keep(x_KxTxI, keep_KxT), dy_KxTxO, preferred_element_type=jnp.float32
        )
        dx = _keep(
            jnp.einsum("kto,kio->kti", dy_KxTxO, w_KxIxO, preferred_element_type=jnp.float32),
            keep_KxT,
        )
        return dx, dw
    dy = _keep(dy_KxTxO, keep_KxT)
    dw = jnp.einsum("kto,kti->koi", dy, x_KxTxI, preferred_element_type=jnp.float32)
    return jnp.einsum("kto,kio->kti", dy, w_KxIxO, preferred_element_type=jnp.float32), dw


def _after(x):
    """A bool XLA can only compute once x exists (whether x's first entry is NaN): what ties
    a value that depends on nothing else to the point where it is needed. XLA:CPU drops
    optimization barriers before its CSE and scheduling, so a barrier does not."""
    return jnp.isnan(x.reshape(-1)[0])


def zeros_after(shape, dtype, x):
    """Zeros that XLA cannot make before x exists: left constant, an accumulator's zeros are a
    copy of a broadcast that XLA:CPU schedules anywhere — early in the forward pass, say,
    alive through to the backward's use (one [A, I, R] per product at a time became 34 of
    them at the peak of a 256-adapter pass). -0.0 where x's first entry is NaN (a sum
    from -0.0 is the sum from 0.0 but for the sign of a zero)."""
    return jnp.full(shape, jnp.where(_after(x), -0.0, 0.0).astype(dtype))


def _tile_product_bwd(res, dy_QxO):
    x_QxI, w_AxIxO, t = res
    dx_QxI, dw_A = _tiles_backward(
        x_QxI, lambda pick_K: w_AxIxO[pick_K], w_AxIxO.shape[0], t, dy_QxO
    )
    return dx_QxI, dw_A.astype(w_AxIxO.dtype), None


def _tiles_backward(x_QxI, take, n_a: int, t: Tiles, dy_QxO):
    """(dx [Q, I] in x's dtype, dw [A, I, O] fp32 by active adapter) of _tiles_forward for
    the cotangent dy, each tile's factors from take (as there)."""
    n, tile = t.keep_NxT.shape
    x_NxTxI = x_QxI.reshape(n, tile, -1)
    dy_NxTxO = dy_QxO.astype(x_QxI.dtype).reshape(n, tile, -1)

    def per_adapter(dw_K, rank_K):  # jax.ops.segment_sum's sums, from zeros_after
        zeros = zeros_after((n_a,) + dw_K.shape[1:], dw_K.dtype, dy_QxO)
        return zeros.at[rank_K].add(dw_K, indices_are_sorted=True, mode="drop")

    def extra(e, carry):
        dx_NxTxI, dw_A = carry
        tile_C, pick_C, keep_CxT = _extra_chunk(t, e)
        dx_C, dw_C = _part_grads(x_NxTxI[tile_C], dy_NxTxO[tile_C], take(pick_C), keep_CxT)
        rank_C = jax.lax.dynamic_slice_in_dim(t.rank_E, e, tile_C.shape[0])
        return dx_NxTxI.at[tile_C].add(dx_C), dw_A + per_adapter(dw_C, rank_C)

    dx_NxTxI, dw_N = _part_grads(x_NxTxI, dy_NxTxO, take(t.pick_N), t.keep_NxT)
    dx_NxTxI, dw_A = _over_extras(t, extra, (dx_NxTxI, per_adapter(dw_N, t.rank_N)))
    dw_A = dw_A[t.rank_of_A]
    if x_QxI.shape[1] > dy_QxO.shape[1]:
        dw_A = jnp.swapaxes(jax.lax.optimization_barrier(dw_A), 1, 2)
    return dx_NxTxI.reshape(x_QxI.shape).astype(x_QxI.dtype), dw_A


def tile_product_grads_into(x_QxI, dy_QxO, w_AxIxO, t: Tiles, dw_AxIxO):
    """(dx [Q, I], dw_AxIxO + the gradient of w) of tile_product(x, w, t) for the cotangent
    dy, in the operands' dtypes (pass fp32 for an fp32 gradient), with I ≤ O: each
    tile's gradient is added into the accumulator at its own adapter (a scatter of the
    tiles' adapters only, no [A, I, O] temporary) — for a product repeated chunk by chunk
    into one gradient, as the unembedding's per log-prob chunk (jcp.logprobs)."""
    n, tile = t.keep_NxT.shape
    if x_QxI.shape[1] > w_AxIxO.shape[2]:
        raise ValueError("tile_product_grads_into takes the narrow side as x (I ≤ O)")
    x_NxTxI = x_QxI.reshape(n, tile, -1)
    dy_NxTxO = dy_QxO.astype(x_QxI.dtype).reshape(n, tile, -1)

    def extra(e, carry):
        dx_NxTxI, dw = carry
        tile_C, pick_C, keep_CxT = _extra_chunk(t, e)
        dx_C, dw_C = _part_grads(x_NxTxI[tile_C], dy_NxTxO[tile_C], w_AxIxO[pick_C], keep_CxT)
        return dx_NxTxI.at[tile_C].add(dx_C), dw.at[pick_C].add(dw_C.astype(dw.dtype))

    dx_NxTxI, dw_N = _part_grads(x_NxTxI, dy_NxTxO, w_AxIxO[t.pick_N], t.keep_NxT)
    dw = dw_AxIxO.at[t.pick_N].add(dw_N.astype(dw_AxIxO.dtype))
    dx_NxTxI, dw = _over_extras(t, extra, (dx_NxTxI, dw))
    return dx_NxTxI.reshape(x_QxI.shape), dw


tile_product.defvjp(_tile_product_fwd, _tile_product_bwd)


# ----------------------------------------------------------------------------------------
# Factors read from the slot table's pages, gradients added into the accumulator's pages


def rank_axis(which: str, ndim: int) -> int:
    """The rank axis of a factor of `ndim` axes: last for "a*" keys, second to last for "b*"."""
    return ndim - 1 if which.startswith("a") else ndim - 2


def join_pages(which: str, g):
    """[A, K, …page] -> [A, …slot]: each row's K pages of factor `which` joined along the
    rank axis, page k as rank columns [k·r, (k+1)·r) (r the page's rank)."""
    ax = rank_axis(which, g.ndim - 1)
    g = jnp.moveaxis(g, 1, ax)  # K just before the page's rank axis
    return g.reshape(g.shape[:ax] + (g.shape[ax] * g.shape[ax + 1],) + g.shape[ax + 2 :])


def split_pages(which: str, v, k: int):
    """join_pages' inverse: [A, …slot] -> [A, K, …page]."""
    ax = rank_axis(which, v.ndim)
    v = v.reshape(v.shape[:ax] + (k, v.shape[ax] // k) + v.shape[ax + 1 :])
    return jnp.moveaxis(v, ax, 1)


@dataclasses.dataclass(frozen=True)
class PagedFactor:
    """A factor of the active adapters left in the slot table's pages: `key` of `module` at
    `layer` (int32 [] inside the layer loop; [L] stacked before it, sliced by the loop as
    any per-layer array), which the grouped products read from the Routing's PageSource."""

    layer: jax.Array
    module: str
    key: str


jax.tree_util.register_dataclass(PagedFactor, data_fields=["layer"], meta_fields=["module", "key"])


@dataclasses.dataclass(frozen=True)
class PageSource:
    """Where a pass's grouped products read their factors and (training) put their
    gradients (inside the shard_map, this device's shards): tables {module: {key: [P, L,
    …page]}} the slot tables' pages; page_AK the pages of each active adapter
    (SlotMeta.page_GK's rows; an entry ≥ P: no page, zeros); grads {module: {key: Ref}} the
    gradient accumulators' pages, which each product's backward adds its factor gradient
    into (summed over dp and cp first), None in a forward-only pass (sampling's,
    lora.route_for_forward); finite a Ref bool [A], varying over every mesh axis, cleared
    where an active adapter's gradient is not finite; probe a zero f32 [] that each product takes as an input, so
    the pass's gradient w.r.t. it runs every product's backward (its own gradient is zero);
    kernel: the products run jcp.lora_cpu's kernels where they support the table
    (lora_impl "cpu"), else the tiles in XLA."""

    tables: dict
    page_AK: jax.Array
    grads: dict
    finite: Any
    probe: jax.Array
    kernel: bool = False


jax.tree_util.register_dataclass(
    PageSource,
    data_fields=["tables", "page_AK", "grads", "finite", "probe"],
    meta_fields=["kernel"],
)


def read_layer(which: str, table_P, page_AK, layer):
    """[A, …slot] factor `which` of the adapters page_AK at `layer` from its table's pages
    [P, L, …page]: only those A·K pages of that layer are read (an index ≥ P reads zeros)."""
    return join_pages(which, table_P.at[page_AK, layer].get(mode="fill", fill_value=0))


def paged_product(x_QxI, f: PagedFactor, src: PageSource, t: Tiles):
    """tile_product(x, w, t) of the factor f read from src's pages (read_layer, in x's
    dtype), whose gradient the backward adds into src.grads' pages of f's layer (summed
    over the devices where x varies and the table does not, as the casts of an array
    factor do) instead of returning it; x's gradient is returned as tile_product's."""
    table = src.tables[f.module][f.key]
    x_QxI = vary_all(x_QxI, table)
    grad = None if src.grads is None else src.grads[f.module][f.key]
    args = (x_QxI, src.probe, f.layer, table, src.page_AK, grad, src.finite, t)
    if src.kernel and lora_cpu.supports(table, f.key):
        return _paged_kernel(f.key, *args)
    return _paged(f.key, *args)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _paged(which, x_QxI, probe, layer, table_P, page_AK, grad_ref, finite_ref, t: Tiles):
    del probe, grad_ref, finite_ref
    return _tiles_forward(x_QxI, _tile_reader(which, table_P, page_AK, layer, x_QxI, x_QxI), t)


def _tile_reader(which, table_P, page_AK, layer, after, x):
    """take(pick_K) for _tiles_forward / _tiles_backward: the K tiles' adapters' factors
    read from the table's pages at `layer` (read_layer of page_AK[pick_K], in x's dtype,
    varying as x), each read made after `after` exists (_read_after). The pages are read
    tile by tile: no [A, …] copy of every active adapter's factors comes first."""
    return lambda pick_K: vary_all(
        _read_after(which, table_P, page_AK[pick_K], layer, after, x.dtype), x
    )


def _read_after(which, table_P, page_AK, layer, x, dtype):
    """read_layer in `dtype`, made after x exists: the forward pass's read after its input,
    the backward's after its cotangent. Left free, XLA:CPU reads every layer's factors at
    the start (they depend on nothing else) and keeps them alive to their use, or merges the
    backward's read with the forward's, keeping them from the forward pass to the backward
    (_after). Indices ≥ P read zeros, so P or P + 1 as the indices' limit reads the same."""
    limit = table_P.shape[0] + _after(x).astype(page_AK.dtype)
    return read_layer(which, table_P, jnp.minimum(page_AK, limit), layer).astype(dtype)


def _paged_fwd(which, x_QxI, probe, layer, table_P, page_AK, grad_ref, finite_ref, t):
    y = _paged(which, x_QxI, probe, layer, table_P, page_AK, grad_ref, finite_ref, t)
    return y, (x_QxI, probe, layer, table_P, page_AK, grad_ref, finite_ref, t)


def _paged_bwd(which, res, dy_QxO):
    x_QxI, probe, layer, table_P, page_AK, grad_ref, finite_ref, t = res
    take = _tile_reader(which, table_P, page_AK, layer, dy_QxO, x_QxI)
    dx_QxI, dw_A = _tiles_backward(x_QxI, take, page_AK.shape[0], t, dy_QxO)
    v = split_pages(which, dw_A.astype(x_QxI.dtype), page_AK.shape[1])
    _add_into_pages(v, table_P, page_AK, layer, grad_ref, finite_ref)
    return dx_QxI, jnp.zeros_like(probe), None, None, None, None, None, None


def _add_into_pages(dw_AK, table_P, page_AK, layer, grad_ref, finite_ref):
    """Adds the active adapters' factor gradient dw_AK [A, K, …page] (in x's dtype) into
    the accumulator's pages of `layer`, summed where an array factor's gradient is: over
    tp (or any non-data axis) at its cast in the layer, in x's dtype; over dp and cp at the
    pass's entry, in the table's dtype. Clears finite_ref where an adapter's is not
    finite."""
    summed = [a for a in varying_axes(dw_AK) if a not in varying_axes(table_P)]
    for axes, dtype in (
        ([a for a in summed if a not in BATCH_AXES], dw_AK.dtype),
        ([a for a in summed if a in BATCH_AXES], table_P.dtype),
    ):
        dw_AK = dw_AK.astype(dtype)
        if axes:
            dw_AK = jax.lax.psum(dw_AK, tuple(axes))
    ok_A = jnp.all(jnp.isfinite(dw_AK), axis=tuple(range(1, dw_AK.ndim)))
    finite_ref[...] = finite_ref[...] & vary(ok_A, BATCH_AXES + (TP,))
    grad_ref[...] = grad_ref[...].at[page_AK, layer].add(dw_AK, mode="drop")


_paged.defvjp(_paged_fwd, _paged_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _paged_kernel(which, x_QxI, probe, layer, table_P, page_AK, grad_ref, finite_ref, t: Tiles):
    """_paged with jcp.lora_cpu's kernels: each row times its own adapter's pages read in
    place (no tiles, no copies of the factors); the backward adds the factor gradient
    into the accumulator's pages as _paged's does. fp32 out, as _tiles_forward's."""
    del probe, grad_ref, finite_ref
    return lora_cpu.forward(which, x_QxI, table_P, layer, page_AK, t.row_Q)


def _paged_kernel_fwd(which, x_QxI, probe, layer, table_P, page_AK, grad_ref, finite_ref, t):
    y = _paged_kernel(which, x_QxI, probe, layer, table_P, page_AK, grad_ref, finite_ref, t)
    return y, (x_QxI, probe, layer, table_P, page_AK, grad_ref, finite_ref, t)


def _paged_kernel_bwd(which, res, dy_QxO):
    x_QxI, probe, layer, table_P, page_AK, grad_ref, finite_ref, t = res
    routed = (table_P, layer, page_AK, t.row_Q)
    if _sums_nothing(x_QxI, dy_QxO, table_P, grad_ref):  # the kernel adds in place
        dx, acc, ok_A = lora_cpu.backward_into(which, x_QxI, dy_QxO, *routed, grad_ref[...])
        grad_ref[...] = acc
        finite_ref[...] = finite_ref[...] & vary(ok_A, BATCH_AXES + (TP,))
    else:
        dx, dw_AK = lora_cpu.backward(which, x_QxI, dy_QxO, *routed)
        _add_into_pages(dw_AK.astype(x_QxI.dtype), table_P, page_AK, layer, grad_ref, finite_ref)
    return dx.astype(x_QxI.dtype), jnp.zeros_like(probe), None, None, None, None, None, None


def _sums_nothing(x_QxI, dy_QxO, table_P, grad_ref) -> bool:
    """Whether _add_into_pages would sum the factor gradient over no device (every axis x
    or dy varies over and the table does not has one device) and add it in its own dtype
    (fp32 everywhere): then adding it into the accumulator in place is the same sum."""
    axes = {*varying_axes(x_QxI), *varying_axes(dy_QxO)} - {*varying_axes(table_P)}
    return (
        all(jax.lax.axis_size(a) == 1 for a in axes)
        and x_QxI.dtype == table_P.dtype == grad_ref.dtype == jnp.float32
    )


_paged_kernel.defvjp(_paged_kernel_fwd, _paged_kernel_bwd)


# ----------------------------------------------------------------------------------------
# Gathered factors through jcp.lora_cpu's kernels


def array_product(which: str, x_QxI, w_AxIxO, t: Tiles, kernel: bool):
    """The grouped product of an array factor (which: "a", w [A, I, R]; "b", w [A, R, O]):
    kernel_product where `kernel` (Routing.kernel) and the kernels take w, else
    tile_product; fp32 out. x and w cast to vary alike first (see tile_product)."""
    if kernel and lora_cpu.supports(w_AxIxO[:, None], which):
        return kernel_product(which, x_QxI, w_AxIxO, t)
    return tile_product(x_QxI, w_AxIxO, t)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def kernel_product(which, x_QxI, w_AxIxO, t: Tiles):
    """tile_product(x, w, t) through jcp.lora_cpu's kernels (routing.kernel, lora_impl
    "cpu"): each row times its own adapter's factor, read in place — w as a table of A
    pages of its whole rank, one per adapter. which: "a" (w [A, I, R]) or "b" (w [A, R, O]);
    fp32 out. Inputs cast to vary alike first, as tile_product's are (the casts'
    transposes sum w's gradient where x varies and w does not)."""
    return lora_cpu.forward(which, x_QxI, w_AxIxO[:, None], 0, _own_pages(w_AxIxO), t.row_Q)


def _own_pages(w_AxIxO):
    return jnp.arange(w_AxIxO.shape[0], dtype=jnp.int32)[:, None]


def _kernel_product_fwd(which, x_QxI, w_AxIxO, t):
    return kernel_product(which, x_QxI, w_AxIxO, t), (x_QxI, w_AxIxO, t)


def _kernel_product_bwd(which, res, dy_QxO):
    x_QxI, w_AxIxO, t = res
    table = w_AxIxO[:, None]
    dx, dw = lora_cpu.backward(which, x_QxI, dy_QxO, table, 0, _own_pages(w_AxIxO), t.row_Q)
    return dx.astype(x_QxI.dtype), dw.reshape(w_AxIxO.shape).astype(w_AxIxO.dtype), None


kernel_product.defvjp(_kernel_product_fwd, _kernel_product_bwd)
