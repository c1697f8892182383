"""The programs over the adapter tables that jcp.adapter_state jits (once per
AdapterState) and alone calls: write one slot (`install_slot` of a `SlotWrite`), read one
slot's pages (`gather_slot`) or export it at its own rank (`export_slot`), copy table rows
out and back (`take_rows`, `put_rows`).

Pure functions of the tables they are given: every write is `.at[slot].set` or a scatter
into the slot's own pages; they hold no state.

Shapes: see the legend in jcp/mesh.py.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jcp import lora as lora_lib


def sans_slot(spec) -> P:
    """The PartitionSpec of one slot: the table's spec without its leading G axis."""
    return P(*tuple(spec)[1:])


def _slot_shape(which: str, page_shape: tuple, k: int) -> tuple:
    """The shape of one slot's factor (rank K·r) from its page's shape (rank r)."""
    ax = lora_lib.rank_axis(which, len(page_shape))
    return page_shape[:ax] + (page_shape[ax] * k,) + page_shape[ax + 1 :]


def _pad_into(table_P, pages_K, small):
    """table_P with the pages pages_K overwritten by `small` zero-padded to the slot's
    rank; modules and factors absent from `small` (not targeted, not of its expert mode)
    become zero."""
    out = {}
    for m, ab in table_P.items():
        out[m] = {}
        for which, x in ab.items():
            full = jnp.zeros(_slot_shape(which, x.shape[1:], pages_K.shape[0]), x.dtype)
            if which in small.get(m, {}):
                v = jnp.asarray(small[m][which], x.dtype)
                full = jax.lax.dynamic_update_slice(full, v, (0,) * v.ndim)
            out[m][which] = lora_lib.scatter_pages(which, x, pages_K[None], full[None], add=False)
    return out


def gather_slot(tree, pages_K):
    """One slot's factors [..., K·r] from its pages (lora.gather_pages)."""
    return {
        m: {k: lora_lib.gather_pages(k, x, pages_K[None])[0] for k, x in ab.items()}
        for m, ab in tree.items()
    }


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SlotWrite:
    """One slot written by install_slot (AdapterState.install, reset): the pages pages_K
    are overwritten by weights, grads, mu and nu zero-padded to the slot's rank (absent
    modules zero), and the slot's count, scale, shared and tied flags (scalars) and page
    list row_K [K] set."""

    slot: jax.Array
    pages_K: jax.Array
    row_K: jax.Array
    weights: dict
    grads: dict
    mu: dict
    nu: dict
    count: jax.Array
    scale: jax.Array
    shared: jax.Array
    tied: jax.Array


def install_slot(tables, w: SlotWrite):
    """(weights, grads, mu, nu, count, meta) with one slot written (SlotWrite); jitted
    with the tables donated."""
    weights, grads, mu, nu, count, meta = tables
    return (
        _pad_into(weights, w.pages_K, w.weights),
        _pad_into(grads, w.pages_K, w.grads),
        _pad_into(mu, w.pages_K, w.mu),
        _pad_into(nu, w.pages_K, w.nu),
        count.at[w.slot].set(w.count),
        lora_lib.SlotMeta(
            meta.scale_G.at[w.slot].set(w.scale),
            meta.shared_G.at[w.slot].set(w.shared),
            meta.tied_G.at[w.slot].set(w.tied),
            meta.page_GK.at[w.slot].set(w.row_K),
        ),
    )


def take_rows(tree, rows):
    """The pages `rows` of every table of `tree` (a row past the end reads zeros)."""
    return jax.tree.map(lambda x: jnp.take(x, rows, axis=0, mode="fill", fill_value=0), tree)


def put_rows(tree, rows, v):
    """`tree` with the pages `rows` set to v (take_rows' inverse; past the end dropped)."""
    return jax.tree.map(lambda x, y: x.at[rows].set(y, mode="drop"), tree, v)


def read_count(count, slot):
    return count[slot]


def export_slot(mesh, specs, tables, slot, pages_K, *, rank, targets, expert_lora):
    """One slot of (weights, mu, nu, count) at its own rank over its targets, each factor
    sharded like its table without the slot axis (specs: lora.slot_specs); jitted with
    rank, targets and expert_lora static."""
    weights, mu, nu, count = tables

    def one(tree):
        out = {}
        for m in targets:
            out[m] = {}
            for which in lora_lib.expert_keys(m, expert_lora):
                x = lora_lib.gather_pages(which, tree[m][which], pages_K[None])[0]
                y = lora_lib.at_rank(which, x, rank)
                spec = NamedSharding(mesh, sans_slot(specs[m][which]))
                out[m][which] = jax.lax.with_sharding_constraint(y, spec)
        return out

    rep = NamedSharding(mesh, P())
    return one(weights), one(mu), one(nu), jax.lax.with_sharding_constraint(count[slot], rep)
