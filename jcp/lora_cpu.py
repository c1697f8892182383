"""The "cpu" grouped LoRA products: jcp/lora_cpu.cc's kernels for XLA:CPU, each row times
its own adapter's factors read in place from the slot table's pages (built and registered
with jcp's other CPU kernels by jcp/cpu_kernels.py).

Why a kernel and not XLA: XLA:CPU runs the grouped products (jcp/lora_grouped.py) as a
gather of each tile's factors, a batched dot over tiles of one adapter's rows and a loop
over the extra tiles of adapters starting inside a tile, then sums the tiles' gradients
per adapter: at 256 adapters of 16 rows each that is 4-5× the time of one adapter's
product. The kernels walk the rows in runs of one adapter and read that adapter's pages
where they lie, so a product costs about what its rows cost whatever the number of
adapters (benchmarks/multi_lora.py --parts kernels).

Contract (jcp/lora_cpu.cc): fp32 in and out; a page's rank R is one of RANKS (a gathered factor [A, I, R] is a
table of A pages of its whole rank: lora_grouped.kernel_product);
row_k [Q] each row's adapter (an index into page_AK's rows, < 0 for none: its outputs are
0); page_AK [A, K] each adapter's pages (one outside the table: zeros); layer [] int32.
The factor gradients come back per adapter in the pages' layout ([A, K, …page]).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jcp import cpu_kernels
from jcp.mesh import vary, vary_all, varying_axes

RANKS = (4, 8, 16, 32)  # a page's ranks lora_cpu.cc is instantiated for


def supports(table_P, which: str) -> bool:
    """Whether the kernels take products of `which` ("a*" / "b*" keys) over this table of
    pages [P, L, …page]: fp32 pages of a rank in RANKS (lora_impl "cpu" says the
    kernels are built and the devices CPUs)."""
    rank = table_P.shape[-1] if which.startswith("a") else table_P.shape[-2]
    return table_P.dtype == jnp.float32 and rank in RANKS


def available() -> bool:
    """True iff the kernels build and load here (the first call builds them)."""
    return cpu_kernels.available()


def _routing(layer, page_AK, row_k):
    return (
        jnp.asarray(layer, jnp.int32).reshape(1),
        page_AK.astype(jnp.int32),
        row_k.astype(jnp.int32),
    )


def forward(which: str, x_QxI, table_P, layer, page_AK, row_k):
    """y [Q, K·R] = x · A (an "a" factor, table [P, L, I, R]) or y [Q, O] = x · B (a "b"
    factor, table [P, L, R, O]), each row by its own adapter's pages; fp32."""
    n_a, k = page_AK.shape
    if which.startswith("a"):
        target, width = "jcp_cpu_lora_a_forward", k * table_P.shape[-1]
    else:
        target, width = "jcp_cpu_lora_b_forward", table_P.shape[-1]
    (y,) = cpu_kernels.call(
        target,
        [(x_QxI.shape[0], width)],
        x_QxI.astype(jnp.float32),
        table_P,
        *_routing(layer, page_AK, row_k),
    )
    return y


def backward(which: str, x_QxI, dy_QxO, table_P, layer, page_AK, row_k):
    """(dx [Q, I], dw [A, K, …page]) of forward(which, x, …) for the cotangent dy; fp32.
    dw is each adapter's gradient of its pages (summed over its rows)."""
    n_a, k = page_AK.shape
    target = "jcp_cpu_lora_a_backward" if which.startswith("a") else "jcp_cpu_lora_b_backward"
    dx, dw = cpu_kernels.call(
        target,
        [x_QxI.shape, (n_a, k) + table_P.shape[2:]],
        x_QxI.astype(jnp.float32),
        dy_QxO.astype(jnp.float32),
        table_P,
        *_routing(layer, page_AK, row_k),
    )
    return dx, dw


def backward_into(which: str, x_QxI, dy_QxO, table_P, layer, page_AK, row_k, acc_P):
    """(dx [Q, I], acc_P with the factor gradient added into the pages of `layer`, ok_A:
    whether each adapter's gradient is all finite) of forward(which, x, …) for the
    cotangent dy: backward's, the gradient added in place (the accumulator's buffer is the
    result's; a page outside the table dropped) instead of returned. For a device whose
    gradient needs no sum over other devices: acc_P's result has acc_P's varying type."""
    n_a, _ = page_AK.shape
    target = (
        "jcp_cpu_lora_a_backward_into" if which.startswith("a") else "jcp_cpu_lora_b_backward_into"
    )
    args = [x_QxI.astype(jnp.float32), dy_QxO.astype(jnp.float32), table_P, acc_P]
    args += _routing(layer, page_AK, row_k)
    args = [vary_all(a, *args) for a in args]
    dx, acc, ok = jax.ffi.ffi_call(
        target,
        [
            jax.ShapeDtypeStruct(x_QxI.shape, jnp.float32),
            jax.ShapeDtypeStruct(acc_P.shape, jnp.float32),
            jax.ShapeDtypeStruct((n_a,), jnp.int32),
        ],
        vmap_method="sequential",
        input_output_aliases={3: 1},
    )(*args)
    # ffi_call types its results invariant; the accumulator keeps its own type (the axes
    # it varies over are all the inputs vary over that have more than one device).
    return vary_all(dx, *args), vary(acc, varying_axes(acc_P)), vary_all(ok != 0, *args)
