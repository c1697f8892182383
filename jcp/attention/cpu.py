"""The "cpu" attention implementation: fused flash-attention kernels in C++ for XLA:CPU.

Owns the use of cpu_flash.cc's kernels (built, cached, verified and registered with jcp's
other CPU kernels by jcp/cpu_kernels.py, whose Unavailable, library_path and refusal are
re-exported here) and the two strategies on its forward (out, lse) and backward (dq, dk, dv) kernels:
`flash_attention` (the all-gather path, custom VJP) and `ring_attention` (one kernel call
per cp ring step, partials merged by their log-sum-exp, tiling.merge_partials). It
applies exactly jcp's mask (attention.tiling.visible) with GQA and skips the tiles the
mask empties, as tiling.block_kinds classifies them. It must never materialise an
[S, T] array, never be chosen where it cannot build (`available()` says why), and never
load a cached file it has not verified (a truncated .so kills the process with SIGBUS on
load; another user's file would run as ours).

Why a kernel and not XLA: at 8k tokens on one core XLA's blockwise kernel spends 62 % of
its time in GEMMs, 13 % in softmax passes over whole score tiles and 17 % in per-tile
overhead (slices, conds, accumulation copies), and XLA:CPU uses a second thread only
inside large ops. Here a tile's scores stay in L1 between the product, the exp and the
next product; the forward splits (head, query tile) items, and the backward query heads,
over XLA's intra-op thread pool.

dtypes: the kernels are fp32; other inputs are converted to fp32 around the call (the
results are cast back), so bf16 costs two conversions but runs.

Layouts: q, out, dq [S, Q, H]; k, v, dk, dv [T, K, H]; lse and delta [Q, S] fp32, −inf
lse where a row sees nothing (its out and gradients 0). Head dims: HEAD_DIMS.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jcp import cpu_kernels
from jcp.attention.tiling import (
    delta_QxS,
    kernel_ring_bwd,
    kernel_ring_fwd,
    no_grads,
    saved_out_lse,
)
from jcp.cpu_kernels import NoCompiler, Unavailable, library_path, refusal  # noqa: F401
from jcp.mesh import CP

HEAD_DIMS = (16, 32, 64, 96, 128, 256)  # the instantiations in cpu_flash.cc
FWD_TARGET, BWD_TARGET = "jcp_cpu_flash_forward", "jcp_cpu_flash_backward"


def available() -> bool:
    """True iff the kernels build and load here (the first call builds them)."""
    return cpu_kernels.available()


def require(head_dim: int) -> None:
    """Refuses what the kernels cannot run: no build, a non-CPU backend, a head dim not
    instantiated."""
    if jax.default_backend() != "cpu":
        raise ValueError(
            f"attention implementation 'cpu' runs on CPU, not on "
            f"{jax.default_backend()!r}; use 'blockwise' or 'pallas'"
        )
    if head_dim not in HEAD_DIMS:
        raise ValueError(
            f"attention implementation 'cpu' supports head dims {HEAD_DIMS}, "
            f"got {head_dim}; use 'blockwise'"
        )
    why = cpu_kernels.load()
    if why:
        raise Unavailable(why)


def supports(head_dim: int) -> bool:
    """Whether require(head_dim) passes (what attn_impl 'auto' asks)."""
    return jax.default_backend() == "cpu" and head_dim in HEAD_DIMS and available()


def _f32(*xs):
    return [x.astype(jnp.float32) for x in xs]


def _i32(*xs):
    return [x.astype(jnp.int32) for x in xs]


def kernel_forward(q_SxQxH, k_TxKxH, v_TxKxH, seg_q, pos_q, seg_k, pos_k, out_dtype):
    """(out [S, Q, H] in out_dtype, lse [Q, S] fp32, −inf where a row sees nothing)."""
    require(q_SxQxH.shape[-1])
    s_len, q_heads, _ = q_SxQxH.shape
    out, lse = cpu_kernels.call(
        FWD_TARGET,
        [q_SxQxH.shape, (q_heads, s_len)],
        *_f32(q_SxQxH, k_TxKxH, v_TxKxH),
        *_i32(seg_q, pos_q, seg_k, pos_k),
    )
    return out.astype(out_dtype), lse


def kernel_backward(
    q_SxQxH, k_TxKxH, v_TxKxH, seg_q, pos_q, seg_k, pos_k, do_SxQxH, lse_QxS, delta_QxS
):
    """fp32 (dq [S, Q, H], dk, dv [T, K, H]) of the attention whose (global) lse and
    delta = Σ_h do·out are given: over one key stream of several, the gradients add."""
    require(q_SxQxH.shape[-1])
    return cpu_kernels.call(
        BWD_TARGET,
        [q_SxQxH.shape, k_TxKxH.shape, k_TxKxH.shape],
        *_f32(q_SxQxH, k_TxKxH, v_TxKxH, do_SxQxH, lse_QxS, delta_QxS),
        *_i32(seg_q, pos_q, seg_k, pos_k),
    )


# ----------------------------------------------------------------------------------------
# The all-gather path


@jax.custom_vjp
def flash_attention(q_SxQxH, k_TxKxH, v_TxKxH, seg_q, pos_q, seg_k, pos_k):
    """Attention of queries q [S, Q, H] (seg_q, pos_q [S]) over keys and values k, v
    [T, K, H] (seg_k, pos_k [T]) under jcp's mask. Returns out [S, Q, H] in q's dtype
    (0 for a query that sees nothing)."""
    return _flash_fwd(q_SxQxH, k_TxKxH, v_TxKxH, seg_q, pos_q, seg_k, pos_k)[0]


def _flash_fwd(q, k, v, seg_q, pos_q, seg_k, pos_k):
    out, lse = saved_out_lse(*kernel_forward(q, k, v, seg_q, pos_q, seg_k, pos_k, q.dtype))
    return out, (q, k, v, seg_q, pos_q, seg_k, pos_k, out, lse)


def _flash_bwd(res, d_out):
    q, k, v, seg_q, pos_q, seg_k, pos_k, out, lse = res
    dq, dk, dv = kernel_backward(
        q, k, v, seg_q, pos_q, seg_k, pos_k, d_out, lse, delta_QxS(d_out, out)
    )
    return (
        dq.astype(q.dtype),
        dk.astype(k.dtype),
        dv.astype(v.dtype),
        *no_grads(seg_q, pos_q, seg_k, pos_k),
    )


flash_attention.defvjp(_flash_fwd, _flash_bwd)


# ----------------------------------------------------------------------------------------
# The ring (as attention.pallas's: one kernel call per step, partials merged by lse)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _ring(q, k, v, seg, pos, cp):
    return _ring_fwd(q, k, v, seg, pos, cp)[0]


def _ring_fwd(q, k, v, seg, pos, cp):
    return kernel_ring_fwd(lambda *a: kernel_forward(*a, jnp.float32), q, k, v, seg, pos, cp)


def _ring_bwd(cp, res, d_out):
    return kernel_ring_bwd(kernel_backward, cp, res, d_out)


_ring.defvjp(_ring_fwd, _ring_bwd)


def ring_attention(q_SxQxH, k_SxKxH, v_SxKxH, segment_S, position_S):
    """attention.ring_attention with these kernels: same arguments, mask and result; runs
    inside shard_map over "cp"; per-device memory O(S)."""
    return _ring(q_SxQxH, k_SxKxH, v_SxKxH, segment_S, position_S, jax.lax.axis_size(CP))
