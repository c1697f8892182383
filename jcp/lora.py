"""Multi-LoRA: the routing of tokens to adapters, the pages of the slot tables a pass
reads and writes, and the products.

The slot layout — target modules, dims, the experts' parameterisations, the shapes and
PartitionSpecs of the stacked slots (`a [G, L, I, R]`, `b [G, L, R, O]` per target
module), PEFT's initialisation — is jcp.lora_slots', re-exported here. This module owns the
routing of tokens to adapters used inside the model (`Routing`, `SlotMeta`), the active
slots' pages (`take_active`, `add_active`), and the products that multiply each token by
its own adapter only (delta): dense up to DENSE_MAX_ADAPTERS active adapters, in tiles of
one adapter's tokens beyond (jcp/lora_grouped.py: Tiles, their plan and product), so a
pass costs what its tokens cost, whatever the number of adapters in it. It must never
copy adapter weights per token, never multiply a token by another adapter's factors, and
never hold base weights or slot arrays (jcp/adapter_state.py owns those).

Shapes: see the legend in jcp/mesh.py.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jcp.config import QwenConfig
from jcp.logprobs import HeadLora
from jcp.lora_grouped import (
    PagedFactor,
    PageSource,
    Tiles,
    array_product,
    join_pages,
    paged_product,
    plan_rows,
    plan_spans,
    rank_axis,
    split_pages,
)
from jcp.lora_grouped import tile_rows as tile_rows  # re-exported: jcp.lora.tile_rows
from jcp.lora_slots import (
    ALL_MODULES,
    ATTN,
    EXPERT,
    EXPERT_LORA,
    HEAD,
    LAYER_MODULES,
    LINEAR,
    MLP,
    QKV,
    QKV_B,
    ROW_PARALLEL,
    TARGET_GROUPS,
    adapter_shapes,
    at_rank,
    expert_keys,
    factor_shapes,
    init_adapter,
    module_dims,
    module_layer_ids,
    qkv_widths,
    resolve_targets,
    slot_shapes,
    slot_specs,
    table_modules,
    tree_expert_lora,
)
from jcp.mesh import vary_all

# The slot layout lives in jcp.lora_slots; its names stay importable from here.
__all__ = [
    "ALL_MODULES",
    "ATTN",
    "DENSE_MAX_ADAPTERS",
    "EXPERT",
    "EXPERT_LORA",
    "HEAD",
    "LAYER_MODULES",
    "LINEAR",
    "MLP",
    "PageSource",
    "PagedFactor",
    "QKV",
    "QKV_B",
    "ROW_PARALLEL",
    "Routing",
    "SlotMeta",
    "TARGET_GROUPS",
    "adapter_shapes",
    "add_active",
    "at_rank",
    "delta",
    "expand",
    "expert_keys",
    "factor_shapes",
    "gather_pages",
    "init_adapter",
    "head_lora",
    "layer_tables",
    "low_rank_input",
    "module_dims",
    "module_layer_ids",
    "paged_leaves",
    "qkv_widths",
    "rank_axis",
    "reads_in_place",
    "resolve_targets",
    "route_for_forward",
    "scatter_pages",
    "slot_shapes",
    "slot_specs",
    "slot_specs_active",
    "table_modules",
    "take_active",
    "take_for_forward",
    "tile_rows",
    "tree_expert_lora",
    "untake_active",
]


# Up to this many active adapters the LoRA products run dense (SlotMeta.routing makes no
# Tiles): every row times the stacked [I, A·R], masked to its own adapter's R columns —
# at most A times one adapter's product (a few % of the frozen projection beside it at
# R / I ≤ 1/64), and about 3× cheaper to compile than the grouped tiles on XLA:CPU (a
# tiny Qwen3's forward_backward at A = 3: 3.7 against 1.1 CPU s per program). More
# adapters take the grouped products, whose work does not grow with A.
DENSE_MAX_ADAPTERS = 4


@dataclasses.dataclass(frozen=True)
class Routing:
    """Which slots a micro-batch uses and which of this shard's tokens go to each.

    active_A: slot of each active adapter; spans_Ax2: [start, end) rows of this shard's
    stream routed to it (adapters are contiguous because packing sorts by adapter);
    scale_A: alpha / rank of each active slot; shared_A: 1 where the slot's experts are
    shared-outer, 0 where per-expert (see expert_keys); tied_A: 1 where the slot's
    expert_up reads expert_gate's A (fused_gate_up), None in tables without that mode.
    index_S: instead of spans, each row's index into active_A (int32 [S]) — the sampling
    engine's decode batch, whose rows come and go in any adapter order; spans_Ax2 is then
    unused. tiles: the plan of the grouped products (low_rank_input, expand; None: the
    dense products, up to DENSE_MAX_ADAPTERS active slots), made once
    per routing by SlotMeta.routing. pages: where the grouped products read the factors
    given as PagedFactor and add their gradients (PageSource; training's in-place pass),
    None where every factor is an array. kernel: the grouped products of array factors
    run jcp.lora_cpu's kernels where they take the factor (lora_grouped.array_product;
    lora_impl "cpu"), else the tiles in XLA.
    """

    active_A: jax.Array
    spans_Ax2: jax.Array
    scale_A: jax.Array
    shared_A: jax.Array
    tied_A: jax.Array | None = None
    index_S: jax.Array | None = None
    tiles: Tiles | None = None
    pages: PageSource | None = None
    kernel: bool = False

    def mask_SxA(self, s_len: int) -> jax.Array:
        if self.index_S is not None:
            return self.index_S[:, None] == jnp.arange(self.active_A.shape[0])[None, :]
        t = jnp.arange(s_len)[:, None]
        return (t >= self.spans_Ax2[None, :, 0]) & (t < self.spans_Ax2[None, :, 1])


jax.tree_util.register_dataclass(
    Routing,
    data_fields=[
        "active_A",
        "spans_Ax2",
        "scale_A",
        "shared_A",
        "tied_A",
        "index_S",
        "tiles",
        "pages",
    ],
    meta_fields=["kernel"],
)


@dataclasses.dataclass(frozen=True)
class SlotMeta:
    """What the model reads per slot besides its weights: scale_G alpha / rank (0 for a
    free slot), shared_G 1.0 where the slot's experts are shared-outer, tied_G 1.0 where
    they are fused_gate_up (None: no such slot possible); page_GK the pages of each slot
    in a paged table (take_active; an entry ≥ the table's page count: no page, zeros),
    None where the table holds one row per slot."""

    scale_G: jax.Array
    shared_G: jax.Array
    tied_G: jax.Array | None = None
    page_GK: jax.Array | None = None

    def routing(
        self,
        active_A,
        spans_Ax2,
        index_S=None,
        *,
        s_len: int | None = None,
        grouped: bool | None = None,
        kernel: bool = False,
    ) -> Routing:
        """Routing of the active slots (entries < 0: the base model, no LoRA, scale 0), by
        spans_Ax2 over a stream of s_len rows or, given index_S, by each row's index into
        active_A; with the plan of its grouped products (Tiles) where grouped (default:
        more than DENSE_MAX_ADAPTERS active slots), run by jcp.lora_cpu's kernels where
        kernel (Routing.kernel)."""
        slot_A = jnp.maximum(active_A, 0)
        scale_A = jnp.where(active_A < 0, 0.0, jnp.take(self.scale_G, slot_A))
        tied_A = None if self.tied_G is None else jnp.take(self.tied_G, slot_A)
        if grouped is None:
            grouped = active_A.shape[0] > DENSE_MAX_ADAPTERS
        if not grouped:
            tiles = None
        elif index_S is not None:
            tiles = plan_rows(index_S, active_A >= 0, scale_A)
        elif s_len is None:
            raise ValueError("routing by spans needs the stream's length s_len")
        else:
            tiles = plan_spans(spans_Ax2, active_A >= 0, scale_A, s_len)
        return Routing(
            active_A=slot_A,
            spans_Ax2=spans_Ax2,
            scale_A=scale_A,
            shared_A=jnp.take(self.shared_G, slot_A),
            tied_A=tied_A,
            index_S=index_S,
            tiles=tiles,
            kernel=kernel,
        )


jax.tree_util.register_dataclass(
    SlotMeta, data_fields=["scale_G", "shared_G", "tied_G", "page_GK"], meta_fields=[]
)


def gather_pages(which: str, x_P, page_AK):
    """[P, …page] -> [A, …slot]: row a holds pages page_AK[a] of factor `which` joined
    along the rank axis (join_pages); an index ≥ P reads zeros. Only the A·K pages are
    copied."""
    return join_pages(which, jnp.take(x_P, page_AK, axis=0, mode="fill", fill_value=0))


def scatter_pages(which: str, x_P, page_AK, v_A, *, add: bool):
    """x_P with v_A [A, …slot] (gather_pages' layout) added into or written over the pages
    page_AK; indices ≥ P are dropped."""
    v = split_pages(which, v_A, page_AK.shape[1]).reshape((-1,) + x_P.shape[1:])
    v, at = v.astype(x_P.dtype), x_P.at[page_AK.reshape(-1)]
    return at.add(v, mode="drop") if add else at.set(v, mode="drop")


def take_active(slots: dict, page_GK, active_A) -> dict:
    """Gather the active slots for the model: [G, L, …] -> [L, A, …]; lm_head [G, …] -> [A, …].
    page_GK (SlotMeta.page_GK): the tables are paged ([P, L, …, r] pages, gather_pages);
    None: one row per slot.

    Only A adapters are copied (not one per token); layers lead so lax.scan can slice them.
    """
    out = {}
    for m, ab in slots.items():
        if page_GK is None:
            picked = {k: jnp.take(x, active_A, axis=0) for k, x in ab.items()}
        else:
            page_AK = jnp.take(page_GK, active_A, axis=0)
            picked = {k: gather_pages(k, x, page_AK) for k, x in ab.items()}
        out[m] = picked if m == HEAD else jax.tree.map(lambda x: jnp.moveaxis(x, 0, 1), picked)
    return out


def add_active(acc: dict, page_GK, active_A, grads_A: dict) -> dict:
    """acc (a table like take_active's `slots`) with grads_A {module: {key: [A, …slot]}}
    (untake_active's layout) added into the rows or pages of the slots active_A; the
    modules of acc absent from grads_A unchanged."""
    out = dict(acc)
    for m, ab in grads_A.items():
        if page_GK is None:
            out[m] = {k: acc[m][k].at[active_A].add(g) for k, g in ab.items()}
        else:
            page_AK = jnp.take(page_GK, active_A, axis=0)
            out[m] = {k: scatter_pages(k, acc[m][k], page_AK, g, add=True) for k, g in ab.items()}
    return out


def untake_active(active: dict) -> dict:
    """Inverse layout of take_active: [L, A, …] -> [A, L, …] (lm_head unchanged)."""
    return {
        m: ab if m == HEAD else jax.tree.map(lambda x: jnp.moveaxis(x, 1, 0), ab)
        for m, ab in active.items()
    }


def layer_tables(slots: dict) -> tuple[dict, dict]:
    """(the per-layer modules' tables, the rest): the factors a grouped pass can read from
    the pages in place (PagedFactor), and those it gathers (take_active)."""
    tables = {m: ab for m, ab in slots.items() if m in LAYER_MODULES}
    return tables, {m: ab for m, ab in slots.items() if m not in tables}


def paged_leaves(tables: dict) -> dict:
    """PagedFactor leaves for layer_tables' tables {module: {key: [P, L, …page]}}, every
    layer stacked [L] (the layer loop slices them as any per-layer array)."""
    return {
        m: {k: PagedFactor(jnp.arange(x.shape[1]), m, k) for k, x in ab.items()}
        for m, ab in tables.items()
    }


def reads_in_place(page_GK, active_A, kernel: bool) -> bool:
    """Whether a forward-only pass (sampling's prefill, extend and decode) leaves the
    per-layer modules' factors in the slot tables' pages for jcp.lora_cpu's kernels to read
    in place (take_for_forward, route_for_forward): lora_impl "cpu" (`kernel`), a paged
    table, more than DENSE_MAX_ADAPTERS active adapters (the grouped products). Gathering
    them instead copies every active adapter's factors per call: 1 GiB at 256 adapters of
    r16 on a 1024-wide model's attn + mlp, as much again as a decode step reads."""
    return kernel and page_GK is not None and active_A.shape[0] > DENSE_MAX_ADAPTERS


def take_for_forward(slots: dict, page_GK, active_A, kernel: bool) -> dict:
    """The factors a forward-only pass hands its shard_map (specs: slot_specs_active's):
    take_active's, except that where reads_in_place the per-layer modules' tables come as
    they are. Inside, route_for_forward makes them the model's."""
    if not reads_in_place(page_GK, active_A, kernel):
        return take_active(slots, page_GK, active_A)
    tables, other = layer_tables(slots)
    return {**take_active(other, page_GK, active_A), **tables}


def route_for_forward(taken: dict, page_GK, route: Routing) -> tuple[dict, Routing]:
    """(the model's LoRA, its routing) inside the shard_map from take_for_forward's result
    and `route` (SlotMeta.routing of the same active slots, with the same kernel): where
    reads_in_place, the tables as PagedFactor leaves and the PageSource they read (no
    gradient); else both unchanged."""
    if not reads_in_place(page_GK, route.active_A, route.kernel):
        return taken, route
    tables, _ = layer_tables(taken)
    page_AK = jnp.take(page_GK, route.active_A, axis=0)
    src = PageSource(tables, page_AK, None, None, jnp.zeros((), jnp.float32), kernel=True)
    return {**taken, **paged_leaves(tables)}, dataclasses.replace(route, pages=src)


def slot_specs_active(cfg: QwenConfig, active: dict) -> dict:
    """Specs of take_active's result `active` inside the shard_map. [L, A, …] puts tp on
    the same axis as [G, L, …], so the slot table serves unchanged (for the factors the
    table holds, and for take_for_forward's tables)."""
    specs = slot_specs(cfg)
    return {m: {k: specs[m][k] for k in ab} for m, ab in active.items()}


def low_rank_input(x_SxI, a_AxIxR, route: Routing):
    """(x @ A_k)·scale_k of each row by its own adapter k, zero for rows of no adapter.
    Grouped (route.tiles): u [Q, R] fp32, its rows in the routing's adapter order (Tiles:
    the stream's own order under spans); dense (no tiles): u [S, A·R], each row's values
    in its own adapter's R columns. expand takes either back to the stream's rows.

    Cost O(S·I·R + E·T·I·R) grouped (Tiles), whatever the number of adapters; O(S·I·A·R)
    dense. The backward keeps x and the factors, no activation of its own.
    """
    t = route.tiles
    if t is None:
        return _dense_input(x_SxI, a_AxIxR, route)
    if t.order_Q is not None:
        x_SxI = x_SxI[t.order_Q]
    if isinstance(a_AxIxR, PagedFactor):
        return paged_product(x_SxI, a_AxIxR, route.pages, t) * t.weight_Q[:, None]
    # One varying type for both (a custom VJP's cotangents must match its inputs'): the
    # casts' transposes sum A's gradient over the devices where x varies and A does not.
    x_QxI, a_AxIxR = (vary_all(v, x_SxI, a_AxIxR) for v in (x_SxI, a_AxIxR.astype(x_SxI.dtype)))
    return array_product("a", x_QxI, a_AxIxR, t, route.kernel) * t.weight_Q[:, None]


def _dense_input(x_SxI, a_AxIxR, route: Routing):
    """low_rank_input without tiles: one GEMM x [S, I] @ [I, A·R], masked to each row's own
    adapter: [S, A·R] fp32."""
    s_len = x_SxI.shape[0]
    n_a, i_len, rank = a_AxIxR.shape
    # [I, A·R] written out: contracting the middle axis of [A, I, R] ("si,air->sar") makes
    # XLA copy A into [I, A, R] inside the dot, per module and step.
    a_IxAR = jnp.moveaxis(a_AxIxR, 0, 1).reshape(i_len, n_a * rank)
    x_SxI, a_IxAR = (vary_all(v, x_SxI, a_IxAR) for v in (x_SxI, a_IxAR.astype(x_SxI.dtype)))
    xa_SxAR = _down_project(x_SxI, a_IxAR)
    w_SxA = jnp.where(route.mask_SxA(s_len), route.scale_A[None, :], 0.0)
    return (xa_SxAR.reshape(s_len, n_a, rank) * w_SxA[:, :, None]).reshape(s_len, -1)


@jax.custom_vjp
def _down_project(x_SxI, a_IxR):
    """x @ A in fp32: [S, R], with the A gradient written narrow side first (dAᵀ = duᵀ·x,
    as tile_product's: XLA:CPU runs autodiff's xᵀ·du off its fast GEMM path)."""
    return jnp.einsum("si,ir->sr", x_SxI, a_IxR, preferred_element_type=jnp.float32)


def _down_project_fwd(x_SxI, a_IxR):
    return _down_project(x_SxI, a_IxR), (x_SxI, a_IxR)


def _down_project_bwd(res, du_SxR):
    x_SxI, a_IxR = res
    du_SxR = du_SxR.astype(x_SxI.dtype)
    da_RxI = jnp.einsum("sr,si->ri", du_SxR, x_SxI, preferred_element_type=jnp.float32)
    da_IxR = jax.lax.optimization_barrier(da_RxI).T
    dx_SxI = jnp.einsum("sr,ir->si", du_SxR, a_IxR, preferred_element_type=jnp.float32)
    return dx_SxI.astype(x_SxI.dtype), da_IxR.astype(a_IxR.dtype)


_down_project.defvjp(_down_project_fwd, _down_project_bwd)


def expand(u, b_AxRxO, route: Routing, dtype):
    """The second half of delta: low_rank_input's u times each row's own B -> [S, O] in
    the stream's rows (several B of one A, as in_proj_qkv's, share one u). The backward
    keeps u: [S, R] per module grouped, [S, A·R] dense."""
    t = route.tiles
    if t is None:  # u [S, A·R] @ the stacked B [A·R, O]
        b_ARxO = b_AxRxO.reshape(-1, b_AxRxO.shape[-1])
        return jnp.einsum(
            "sr,ro->so", u.astype(dtype), b_ARxO.astype(dtype), preferred_element_type=jnp.float32
        ).astype(dtype)
    if isinstance(b_AxRxO, PagedFactor):
        y_QxO = paged_product(u.astype(dtype), b_AxRxO, route.pages, t).astype(dtype)
    else:
        u_QxR, b_AxRxO = (vary_all(v, u, b_AxRxO) for v in (u.astype(dtype), b_AxRxO.astype(dtype)))
        y_QxO = array_product("b", u_QxR, b_AxRxO, t, route.kernel).astype(dtype)
    return y_QxO if t.place_S is None else y_QxO[t.place_S]


def delta(x_SxI, a_AxIxR, b_AxRxO, route: Routing):
    """LoRA update of each token by its own adapter: [S, O]."""
    return expand(low_rank_input(x_SxI, a_AxIxR, route), b_AxRxO, route, x_SxI.dtype)


def head_lora(x_SxI, a_AxIxR, b_AxRxO, route: Routing) -> HeadLora:
    """The unembedding's LoRA of a grouped routing (route.tiles) as jcp.logprobs multiplies
    it, chunk by chunk and each row by its own adapter's B only: each row's u = (x @ a_k)·
    scale_k in the stream's rows (in x's dtype), the B [A, R, O], and the rows' adapters
    (the routing's spans, or each row's index)."""
    t = route.tiles
    u = low_rank_input(x_SxI, a_AxIxR, route)
    if t.place_S is not None:
        u = u[t.place_S]
    live_A = route.scale_A != 0
    if route.index_S is not None:
        return HeadLora(u.astype(x_SxI.dtype), b_AxRxO, live_A, k_S=route.index_S)
    return HeadLora(u.astype(x_SxI.dtype), b_AxRxO, live_A, spans_Ax2=route.spans_Ax2)
