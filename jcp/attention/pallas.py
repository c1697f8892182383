"""The "pallas" attention implementation: fused flash-attention kernels in Pallas (Triton).

Owns three Pallas kernels — the forward (output and log-sum-exp), dQ, and dK/dV — that
apply exactly jcp's (segment, position) mask (attention.tiling.visible: same datum, segment ≥ 0,
key position ≤ query position) with GQA, the plan that tells each kernel program which
blocks to visit, and the two strategies built on them: `flash_attention` (the all-gather
path of attention.cp_attention, custom VJP) and `ring_attention` (the cp ring, one kernel
call per step, partial results merged by their log-sum-exp). It must never materialise
an [S, T] array (memory is O(S·Q·H + T·K·H)), never differentiate through a kernel (the
VJPs are written out), and never be the default on CPU: there the kernels run in Pallas
interpret mode, which is for tests only, and inside a shard_map each device then also
computes every other device's kernels (_interpret_invariant says why). On GPUs it is the
default for 16-bit models (strategies.resolve_implementation; measured on an H200, see
benchmarks/RESULTS.md, "GPU run").

Block skipping. Outside the kernels, attention.tiling.block_kinds classifies every (query block,
key block) pair from per-block min/max segment and position as skipped, masked or fully
visible. visit_plan turns each row of that table into a list — its masked blocks, then
its fully visible ones — so a program loops over exactly the blocks it needs (no branch
per skipped block; under zigzag the needed key blocks of a query block are not
contiguous) and does no mask arithmetic on fully visible ones. The dK/dV kernel uses the
transposed table: each key block visits only the query blocks that can see it.

Why Pallas and not cuDNN (jax.nn.dot_product_attention(implementation="cudnn")): cuDNN
takes causal/padding/sliding-window masks and per-batch sequence lengths, not an arbitrary
mask (a `bias` of −inf would be the O(S·T) array this module exists to avoid). Under the
zigzag layout each (query chunk, key chunk) pair within one datum is full, causal-diagonal
or empty, so cuDNN could be driven per chunk pair — but datums are packed ragged into a
stream, so the pairs and their lengths are data-dependent; with static shapes that means
padding every pair to the longest chunk and one call per pair, with the partial results
merged outside. The kernels here read segment and position directly and need no
per-layout case analysis.

Layouts: q, out, dq [S, Q, H]; k, v, dk, dv [T, K, H] — the model's own layouts, no
transposes (a BlockSpec picks a head out of the middle dimension); lse and delta [Q, S]
fp32. Query head h uses kv head h // M. Rows that see no key (padding) have out 0 and
lse −inf inside this module; their gradients are exactly 0.

Shapes: see the legend in jcp/mesh.py (S queries on this rank, T keys, Q and K heads on
this tp shard, M = Q/K, H head dim, Bq and Bk tile rows, nq = S/Bq and nk = T/Bk blocks).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jcp.attention.tiling import (
    SoftmaxState,
    block_kinds,
    delta_QxS,
    kernel_ring_bwd,
    kernel_ring_fwd,
    no_grads,
    online_softmax_finish,
    online_softmax_step,
    saved_out_lse,
    visible,
)
from jcp.mesh import CP, block_size, vary_all, varying_axes


@dataclasses.dataclass(frozen=True)
class Tiles:
    """Largest tile rows (queries, keys) of each kernel; each is further capped by the
    caller's `block` and cut to a power of two dividing its stream (mesh.block_size).

    The defaults follow the Triton fused-attention tutorial for head dim 128 on Hopper:
    wide query tiles for the forward and dQ (queries stay in registers while key tiles
    stream past), wide key tiles for dK/dV. Tunables, not measured on a GPU here.
    """

    fwd_q: int = 128
    fwd_k: int = 64
    dq_q: int = 128
    dq_k: int = 32
    dkv_q: int = 32
    dkv_k: int = 128


TILES = Tiles()
# tl.dot needs operands of at least 16 × 16; Triton, every loaded tile a power of two.
MIN_TILE = 16


def interpret_mode() -> bool:
    """True on CPU (Pallas interpret mode, tests only); False on GPU (Triton).

    Refuses other backends: the kernels are written for the Triton lowering.
    """
    backend = jax.default_backend()
    if backend not in ("cpu", "gpu"):
        raise ValueError(
            f"attention implementation 'pallas' runs on GPU (Triton) or, "
            f"interpreted, on CPU; not on {backend!r} — use 'blockwise'"
        )
    return backend == "cpu"


def tile_rows(n: int, cap: int, block: int, interpret: bool) -> int:
    t = block_size(n, min(cap, block))
    if not interpret and t < MIN_TILE:
        raise ValueError(
            f"attention implementation 'pallas' needs streams whose length has a "
            f"power-of-two divisor ≥ {MIN_TILE} (and block ≥ {MIN_TILE}); got "
            f"{n} rows, block {block} → tile {t}"
        )
    return t


def check_head_dim(head_dim: int, interpret: bool) -> None:
    if not interpret and (head_dim < MIN_TILE or head_dim & (head_dim - 1)):
        raise ValueError(
            f"attention implementation 'pallas' needs a power-of-two head dim "
            f"≥ {MIN_TILE} on GPU, got {head_dim}"
        )


def visit_plan(kinds_AxB):
    """[A, 2 + B] int32: per row a of a block-kind table (0 skipped, 1 masked, 2 fully
    visible), (number masked, number full, then the columns to visit — its masked ones,
    then its full ones, each ascending — then columns never read).

    Example, kinds [[2, 0, 1, 1]] -> [[2, 1, 2, 3, 0, 1]]: visit 2 and 3 masked, 0 full.
    """
    order = jnp.argsort(
        jnp.where(kinds_AxB == 1, 0, jnp.where(kinds_AxB == 2, 1, 2)), axis=1, stable=True
    )
    counts = jnp.stack([(kinds_AxB == 1).sum(1), (kinds_AxB == 2).sum(1)], axis=1)
    return jnp.concatenate([counts, order], axis=1).astype(jnp.int32)


def _visit(plan_ref, body, carry):
    """carry = body(block, masked, carry) over the blocks of this program's plan row."""
    n_masked, n_full = plan_ref[0], plan_ref[1]
    carry = jax.lax.fori_loop(0, n_masked, lambda t, c: body(plan_ref[2 + t], True, c), carry)
    return jax.lax.fori_loop(
        n_masked, n_masked + n_full, lambda t, c: body(plan_ref[2 + t], False, c), carry
    )


def _block_slice(i, b):
    return pl.ds(pl.multiple_of(i * b, b), b)


# ----------------------------------------------------------------------------------------
# Kernels. One program per (block, head); refs are that program's blocks (BlockSpecs below).


def _fwd_kernel(
    plan_ref,
    q_ref,
    k_ref,
    v_ref,
    segq_ref,
    posq_ref,
    segk_ref,
    posk_ref,
    o_ref,
    lse_ref,
    *,
    scale,
    block_k,
):
    """Query block i of head h ([Bq, H]) against the key blocks of its plan (keys [T, H])."""
    q_BqxH = q_ref[...]
    seg_q, pos_q = segq_ref[...], posq_ref[...]

    def body(j, masked, state):
        keys = _block_slice(j, block_k)
        s_BqxBk = plgpu.dot(q_BqxH, k_ref[keys, :], trans_b=True) * scale
        if masked:
            s_BqxBk = jnp.where(
                visible(seg_q, pos_q, segk_ref[keys], posk_ref[keys]), s_BqxBk, -jnp.inf
            )
        v_BkxH = v_ref[keys, :]
        return online_softmax_step(
            state, s_BqxBk, lambda p: plgpu.dot(p.astype(v_BkxH.dtype), v_BkxH)
        )

    rows, head_dim = q_BqxH.shape
    state = _visit(
        plan_ref,
        body,
        SoftmaxState(
            jnp.full((rows,), -jnp.inf, jnp.float32),
            jnp.zeros((rows,), jnp.float32),
            jnp.zeros((rows, head_dim), jnp.float32),
        ),
    )
    out_BqxH, lse_Bq = online_softmax_finish(state, empty_lse=-jnp.inf)
    o_ref[...] = out_BqxH.astype(o_ref.dtype)
    lse_ref[...] = lse_Bq


def _probs(q_BqxH, k_BkxH, lse_Bq, mask, scale):
    """p = exp(q·kᵀ·scale − lse), 0 where masked (mask None: all visible; lse finite)."""
    s_BqxBk = plgpu.dot(q_BqxH, k_BkxH, trans_b=True) * scale - lse_Bq[:, None]
    return jnp.exp(s_BqxBk if mask is None else jnp.where(mask, s_BqxBk, -jnp.inf))


def _dq_kernel(
    plan_ref,
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    delta_ref,
    segq_ref,
    posq_ref,
    segk_ref,
    posk_ref,
    dq_ref,
    *,
    scale,
    block_k,
):
    """dQ of query block i of head h: Σ over its plan's key blocks of dS·k."""
    q_BqxH, do_BqxH = q_ref[...], do_ref[...]
    lse_Bq, delta_Bq = lse_ref[...], delta_ref[...]
    seg_q, pos_q = segq_ref[...], posq_ref[...]

    def body(j, masked, dq_BqxH):
        keys = _block_slice(j, block_k)
        k_BkxH = k_ref[keys, :]
        mask = visible(seg_q, pos_q, segk_ref[keys], posk_ref[keys]) if masked else None
        p = _probs(q_BqxH, k_BkxH, lse_Bq, mask, scale)
        dp = plgpu.dot(do_BqxH, v_ref[keys, :], trans_b=True)
        ds = p * (dp - delta_Bq[:, None]) * scale
        return dq_BqxH + plgpu.dot(ds.astype(k_BkxH.dtype), k_BkxH)

    dq = _visit(plan_ref, body, jnp.zeros(q_BqxH.shape, jnp.float32))
    dq_ref[...] = dq.astype(dq_ref.dtype)


def _dkv_kernel(
    plan_ref,
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    delta_ref,
    segq_ref,
    posq_ref,
    segk_ref,
    posk_ref,
    dk_ref,
    dv_ref,
    *,
    scale,
    block_q,
    per_kv,
):
    """dK, dV of key block j of kv head g: Σ over its M query heads and over the query
    blocks of its plan (q, do [S, M, H]; lse, delta [M, S] of this group)."""
    k_BkxH, v_BkxH = k_ref[...], v_ref[...]
    seg_k, pos_k = segk_ref[...], posk_ref[...]

    def body(m, i, masked, carry):
        dk_BkxH, dv_BkxH = carry
        rows = _block_slice(i, block_q)
        q_BqxH, do_BqxH = q_ref[rows, m, :], do_ref[rows, m, :]
        mask = visible(segq_ref[rows], posq_ref[rows], seg_k, pos_k) if masked else None
        p = _probs(q_BqxH, k_BkxH, lse_ref[m, rows], mask, scale)
        dv_BkxH = dv_BkxH + plgpu.dot(p.astype(do_BqxH.dtype), do_BqxH, trans_a=True)
        dp = plgpu.dot(do_BqxH, v_BkxH, trans_b=True)
        ds = p * (dp - delta_ref[m, rows][:, None]) * scale
        return dk_BkxH + plgpu.dot(ds.astype(q_BqxH.dtype), q_BqxH, trans_a=True), dv_BkxH

    carry = (jnp.zeros(k_BkxH.shape, jnp.float32), jnp.zeros(k_BkxH.shape, jnp.float32))
    for m in range(per_kv):  # static: the head index of every load is a constant
        carry = _visit(plan_ref, functools.partial(body, m), carry)
    dk_ref[...] = carry[0].astype(dk_ref.dtype)
    dv_ref[...] = carry[1].astype(dv_ref.dtype)


# ----------------------------------------------------------------------------------------
# The pallas_calls


def call_kernel(kernel, grid, in_specs, out_specs, out_shapes, args, name, head_dim, interpret):
    """pallas_call with every input cast to vary alike (inside shard_map) and the outputs
    varying as the inputs do."""
    args = [vary_all(a, *args) for a in args]

    def call(*args):
        mat = jax.typeof(args[1]).manual_axis_type
        return pl.pallas_call(
            kernel,
            grid=grid,
            in_specs=in_specs,
            out_specs=out_specs,
            out_shape=[jax.ShapeDtypeStruct(s, d, manual_axis_type=mat) for s, d in out_shapes],
            compiler_params=plgpu.CompilerParams(
                num_warps=4 if head_dim <= 64 else 8, num_stages=2
            ),
            interpret=interpret,
            name=name,
        )(*args)

    axes = varying_axes(args[1])
    return _interpret_invariant(call, args, axes) if interpret and axes else call(*args)


def _interpret_invariant(call, args, axes):
    """call(*args) for interpret mode inside a shard_map that checks varying axes.

    jax 0.10.2's Pallas interpreter evaluates the kernel — traced without varying types —
    on blocks that carry them, and fails while lowering (the Triton lowering has no such
    step). So here every device gathers every device's inputs as an invariant stack
    [n, …] (a psum of one-hot slots), runs the kernels on all n under vmap, and keeps its
    own row: n× the work, tests only.
    """
    me, n = jax.lax.axis_index(axes), jax.lax.axis_size(axes)
    stacked = [jax.lax.psum(jnp.zeros((n,) + a.shape, a.dtype).at[me].set(a), axes) for a in args]
    return [out[me] for out in jax.vmap(call)(*stacked)]


def kernel_forward(q_SxQxH, k_TxKxH, v_TxKxH, seg_q, pos_q, seg_k, pos_k, block, tiles, out_dtype):
    """(out [S, Q, H] in out_dtype, lse [Q, S] fp32, −inf where a row sees nothing)."""
    interpret = interpret_mode()
    s_len, q_heads, head_dim = q_SxQxH.shape
    t_len, kv_heads, _ = k_TxKxH.shape
    per_kv = q_heads // kv_heads
    check_head_dim(head_dim, interpret)
    bq = tile_rows(s_len, tiles.fwd_q, block, interpret)
    bk = tile_rows(t_len, tiles.fwd_k, block, interpret)
    plan = visit_plan(block_kinds(seg_q, pos_q, seg_k, pos_k, bq, bk)[0])  # [nq, 2 + nk]
    kv_spec = pl.BlockSpec((t_len, None, head_dim), lambda i, h: (0, h // per_kv, 0))
    q_spec = pl.BlockSpec((bq, None, head_dim), lambda i, h: (i, h, 0))
    out, lse = call_kernel(
        functools.partial(_fwd_kernel, scale=1.0 / np.sqrt(head_dim), block_k=bk),
        (s_len // bq, q_heads),
        [pl.BlockSpec((None, plan.shape[1]), lambda i, h: (i, 0)), q_spec, kv_spec, kv_spec]
        + [pl.BlockSpec((bq,), lambda i, h: (i,))] * 2
        + [pl.BlockSpec((t_len,), lambda i, h: (0,))] * 2,
        [q_spec, pl.BlockSpec((None, bq), lambda i, h: (h, i))],
        [((s_len, q_heads, head_dim), out_dtype), ((q_heads, s_len), jnp.float32)],
        [plan, q_SxQxH, k_TxKxH, v_TxKxH, seg_q, pos_q, seg_k, pos_k],
        "jcp_attention_fwd",
        head_dim,
        interpret,
    )
    return out, lse


def kernel_backward(
    q_SxQxH,
    k_TxKxH,
    v_TxKxH,
    seg_q,
    pos_q,
    seg_k,
    pos_k,
    do_SxQxH,
    lse_QxS,
    delta_QxS,
    block,
    tiles,
    dtype,
):
    """(dq [S, Q, H], dk, dv [T, K, H]) in dtype, of the attention whose (global) lse and
    delta = Σ_h do·out are given: over one key stream of several, the streams' gradients
    simply add."""
    interpret = interpret_mode()
    s_len, q_heads, head_dim = q_SxQxH.shape
    t_len, kv_heads, _ = k_TxKxH.shape
    per_kv = q_heads // kv_heads
    scale = 1.0 / np.sqrt(head_dim)
    args = [q_SxQxH, k_TxKxH, v_TxKxH, do_SxQxH, lse_QxS, delta_QxS, seg_q, pos_q, seg_k, pos_k]

    bq, bk = (
        tile_rows(s_len, tiles.dq_q, block, interpret),
        tile_rows(t_len, tiles.dq_k, block, interpret),
    )
    plan = visit_plan(block_kinds(seg_q, pos_q, seg_k, pos_k, bq, bk)[0])  # [nq, 2 + nk]
    q_spec = pl.BlockSpec((bq, None, head_dim), lambda i, h: (i, h, 0))
    kv_spec = pl.BlockSpec((t_len, None, head_dim), lambda i, h: (0, h // per_kv, 0))
    row_spec = pl.BlockSpec((None, bq), lambda i, h: (h, i))
    (dq,) = call_kernel(
        functools.partial(_dq_kernel, scale=scale, block_k=bk),
        (s_len // bq, q_heads),
        [
            pl.BlockSpec((None, plan.shape[1]), lambda i, h: (i, 0)),
            q_spec,
            kv_spec,
            kv_spec,
            q_spec,
            row_spec,
            row_spec,
        ]
        + [pl.BlockSpec((bq,), lambda i, h: (i,))] * 2
        + [pl.BlockSpec((t_len,), lambda i, h: (0,))] * 2,
        [q_spec],
        [((s_len, q_heads, head_dim), dtype)],
        [plan] + args,
        "jcp_attention_dq",
        head_dim,
        interpret,
    )

    bq, bk = (
        tile_rows(s_len, tiles.dkv_q, block, interpret),
        tile_rows(t_len, tiles.dkv_k, block, interpret),
    )
    plan = visit_plan(block_kinds(seg_q, pos_q, seg_k, pos_k, bq, bk)[0].T)  # [nk, 2 + nq]
    group_spec = pl.BlockSpec((s_len, per_kv, head_dim), lambda j, g: (0, g, 0))
    group_rows_spec = pl.BlockSpec((per_kv, s_len), lambda j, g: (g, 0))
    kv_spec = pl.BlockSpec((bk, None, head_dim), lambda j, g: (j, g, 0))
    dk, dv = call_kernel(
        functools.partial(_dkv_kernel, scale=scale, block_q=bq, per_kv=per_kv),
        (t_len // bk, kv_heads),
        [
            pl.BlockSpec((None, plan.shape[1]), lambda j, g: (j, 0)),
            group_spec,
            kv_spec,
            kv_spec,
            group_spec,
            group_rows_spec,
            group_rows_spec,
        ]
        + [pl.BlockSpec((s_len,), lambda j, g: (0,))] * 2
        + [pl.BlockSpec((bk,), lambda j, g: (j,))] * 2,
        [kv_spec, kv_spec],
        [((t_len, kv_heads, head_dim), dtype)] * 2,
        [plan] + args,
        "jcp_attention_dkv",
        head_dim,
        interpret,
    )
    return dq, dk, dv


# ----------------------------------------------------------------------------------------
# The all-gather path


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def flash_attention(q_SxQxH, k_TxKxH, v_TxKxH, seg_q, pos_q, seg_k, pos_k, block, tiles=TILES):
    """Attention of queries q [S, Q, H] (seg_q, pos_q [S]) over keys and values k, v
    [T, K, H] (seg_k, pos_k [T]) under jcp's mask; `tiles`, each capped at `block` rows.
    Returns out [S, Q, H] (0 for a query that sees nothing)."""
    return _flash_fwd(q_SxQxH, k_TxKxH, v_TxKxH, seg_q, pos_q, seg_k, pos_k, block, tiles)[0]


def _flash_fwd(q, k, v, seg_q, pos_q, seg_k, pos_k, block, tiles):
    out, lse = saved_out_lse(
        *kernel_forward(q, k, v, seg_q, pos_q, seg_k, pos_k, block, tiles, q.dtype)
    )
    return out, (q, k, v, seg_q, pos_q, seg_k, pos_k, out, lse)


def _flash_bwd(block, tiles, res, d_out):
    q, k, v, seg_q, pos_q, seg_k, pos_k, out, lse = res
    # Each program sums its block's whole gradient in fp32 registers: written once, in
    # the inputs' dtype.
    dq, dk, dv = kernel_backward(
        q,
        k,
        v,
        seg_q,
        pos_q,
        seg_k,
        pos_k,
        d_out.astype(q.dtype),
        lse,
        delta_QxS(d_out, out),
        block,
        tiles,
        q.dtype,
    )
    return (
        dq.astype(q.dtype),
        dk.astype(k.dtype),
        dv.astype(v.dtype),
        *no_grads(seg_q, pos_q, seg_k, pos_k),
    )


flash_attention.defvjp(_flash_fwd, _flash_bwd)


# ----------------------------------------------------------------------------------------
# The ring: one kernel call per step over the keys then held, partials merged by lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _ring(q, k, v, seg, pos, block, cp):
    return _ring_fwd(q, k, v, seg, pos, block, cp)[0]


def _ring_fwd(q, k, v, seg, pos, block, cp):
    return kernel_ring_fwd(
        lambda *a: kernel_forward(*a, block, TILES, jnp.float32), q, k, v, seg, pos, cp
    )


def _ring_bwd(block, cp, res, d_out):
    def backward(q, k, v, seg_q, pos_q, seg_k, pos_k, d_out, lse, delta):
        return kernel_backward(
            q,
            k,
            v,
            seg_q,
            pos_q,
            seg_k,
            pos_k,
            d_out.astype(q.dtype),
            lse,
            delta,
            block,
            TILES,
            jnp.float32,
        )

    return kernel_ring_bwd(backward, cp, res, d_out)


_ring.defvjp(_ring_fwd, _ring_bwd)


def ring_attention(q_SxQxH, k_SxKxH, v_SxKxH, segment_S, position_S, *, block: int):
    """attention.ring_attention with these kernels: same arguments, mask and result; runs
    inside shard_map over "cp"; per-device memory O(S)."""
    return _ring(q_SxQxH, k_SxKxH, v_SxKxH, segment_S, position_S, block, jax.lax.axis_size(CP))
