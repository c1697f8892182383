"""The programs over the adapter tables that jcp.adapter_state jits (once per
AdapterState) and alone calls: free one slot (`clear_slot`), write one slot's header
(`write_header`) and factors (`write_pages`, one program per table leaf), read them
(`read_pages`, one program per table leaf), copy table rows out and back (`take_rows`,
`put_rows`).

Pure functions of the tables they are given: every write is `.at[slot].set` or a scatter
into the slot's own pages; they hold no state.

Shapes: see the legend in jcp/mesh.py.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jcp import lora as lora_lib


def sans_slot(spec) -> P:
    """The PartitionSpec of one slot: the table's spec without its leading G axis."""
    return P(*tuple(spec)[1:])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SlotHeader:
    """A slot's scalars and page list, as install and reset write them: its step count,
    scale, shared and tied flags and page list row_K [K] (entries ≥ P: no page)."""

    slot: jax.Array
    count: jax.Array
    scale: jax.Array
    shared: jax.Array
    tied: jax.Array
    row_K: jax.Array


def write_header(count, meta, h: SlotHeader):
    """(count, meta) with slot h.slot's scalars and page list set (SlotHeader)."""
    return (
        count.at[h.slot].set(h.count),
        lora_lib.SlotMeta(
            meta.scale_G.at[h.slot].set(h.scale),
            meta.shared_G.at[h.slot].set(h.shared),
            meta.tied_G.at[h.slot].set(h.tied),
            meta.page_GK.at[h.slot].set(h.row_K),
        ),
    )


def clear_slot(tables, pages_K, h: SlotHeader):
    """(weights, grads, mu, nu, count, meta) with the pages pages_K of every table zero
    (indices ≥ P dropped) and the header h written (a freed slot's: all zero, no pages);
    jitted with the tables donated. Pages are zero when freed, and so whenever free:
    `write_pages` relies on that."""
    weights, grads, mu, nu, count, meta = tables

    def zero(table_P):
        return jax.tree.map(
            lambda x: x.at[pages_K].set(
                jnp.zeros(pages_K.shape + x.shape[1:], x.dtype), mode="drop"
            ),
            table_P,
        )

    return (zero(weights), zero(grads), zero(mu), zero(nu), *write_header(count, meta, h))


def rank_padding(which: str, shape: tuple, pages: int, page_rank: int) -> list:
    """np.pad / jnp.pad widths that take factor `which` of `shape` (a slot's layout) to
    the rank of `pages` whole pages."""
    ax = lora_lib.rank_axis(which, len(shape))
    pad = [(0, 0)] * len(shape)
    pad[ax] = (0, pages * page_rank - shape[ax])
    return pad


def write_pages(which: str, page_rank: int, x_P, pages_K, v):
    """x_P with one slot's factor `which` v ([…slot] at rank ≤ K·page_rank, gather_pages'
    layout without its A axis) written over the K pages pages_K, its rank zero-padded to
    K·page_rank; jitted per table leaf with x_P donated. One program per leaf shape and K
    (not per adapter rank when v comes padded: AdapterState.install pads host arrays), so
    adapters of any rank and target set install without compiling."""
    v = jnp.pad(v.astype(x_P.dtype), rank_padding(which, v.shape, pages_K.shape[0], page_rank))
    return lora_lib.scatter_pages(which, x_P, pages_K[None], v[None], add=False)


def copy_pages(x_P, src_K, dst_K):
    """x_P with the pages src_K copied over the pages dst_K (whole pages: a slot's rank
    padding and untargeted factors are zero in both); jitted per table leaf with x_P
    donated."""
    return x_P.at[dst_K].set(jnp.take(x_P, src_K, axis=0))


def read_pages(which: str, x_P, pages_K):
    """One table leaf's factor of one slot [..., K·r] from its pages (lora.gather_pages; K
    is every slot's page count, so the program depends on neither the adapter's rank nor
    its targets); jitted per table leaf."""
    return lora_lib.gather_pages(which, x_P, pages_K[None])[0]


def take_rows(tree, rows):
    """The pages `rows` of every table of `tree` (a row past the end reads zeros)."""
    return jax.tree.map(lambda x: jnp.take(x, rows, axis=0, mode="fill", fill_value=0), tree)


def put_rows(tree, rows, v):
    """`tree` with the pages `rows` set to v (take_rows' inverse; past the end dropped)."""
    return jax.tree.map(lambda x, y: x.at[rows].set(y, mode="drop"), tree, v)


def read_count(count, slot):
    return count[slot]
