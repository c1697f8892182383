"""The chunked gated delta rule's block factors as one Pallas kernel (the GPU path).

Owns `block_factors`: for every kernel block and value head at once (grid [N, H], no
order between programs), the state-independent O(Ck²) work of delta_rule._block — the
decay matrix within each piece, A = β k kᵀ ⊙ decay (strictly lower), T = (I + A)^−1 by
forward substitution over the block's rows, and P = q kᵀ ⊙ decay. What depends on the
incoming state (matmuls against [Dk, Dv] states, the sequential scan over blocks) stays in
XLA (delta_rule.chunked(factors=block_factors)). The backward pass is the reference's
(delta_rule.block_factors) through jax.vjp, recomputed: exact, not a Pallas kernel.

Here (CPU) it runs in Pallas interpret mode, tests only; tests/delta_rule/test_delta_rule.py checks
values and gradients against delta_rule.block_factors and the chunked rule end to end, and
tests/attention/test_paged_pallas.py that it lowers to Triton IR for "cuda" (Ck = 64, Dk = 128). A
GPU run must check: that Triton compiles it (registers: T and A are [Ck, Ck] fp32 per
program), values against delta_rule.block_factors in fp32 (and bf16 inputs), and its
time against the XLA chunked form at 16k tokens (benchmarks/qwen3_5.py kernel).
It must never hold a [tokens, Dk, Dv] array.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jcp.delta_rule import rule as delta_rule


def _kernel(q_ref, k_ref, g_ref, beta_ref, start_ref, t_ref, p_ref):
    """One (block, head): q, k [Ck, Dk], g, β [Ck], start [Ck] -> T, P [Ck, Ck].

    Written for the Triton lowering, which has no cummax, cumsum, dynamic slice of a value
    or dot with fewer than 16 rows: the scans are masked reductions over [Ck, Ck] (the
    same O(Ck²) as the products), and T stays in registers, each substitution row a masked
    reduction. Both dots in fp32, never tf32 (T amplifies rounding)."""
    ck = q_ref.shape[0]
    q, k = q_ref[...], k_ref[...]
    g, beta = g_ref[...], beta_ref[...]
    rows = jax.lax.broadcasted_iota(jnp.int32, (ck, ck), 0)
    cols = jax.lax.broadcasted_iota(jnp.int32, (ck, ck), 1)
    causal = cols <= rows
    # head_i: the last piece start ≤ i (−1: none); cum_i = Σ_{j ≤ i} g_j.
    head = jnp.max(jnp.where(causal & (start_ref[...] != 0)[None, :], cols, -1), axis=1)
    cum = jnp.sum(jnp.where(causal, g[None, :], 0.0), axis=1)
    same = (head[:, None] == head[None, :]) & causal
    decay = jnp.where(same, jnp.exp(jnp.where(same, cum[:, None] - cum[None, :], 0.0)), 0.0)
    kk = plgpu.dot(k, k, trans_b=True, allow_tf32=False)
    a = jnp.where(cols < rows, beta[:, None] * kk * decay, 0.0)
    p_ref[...] = plgpu.dot(q, k, trans_b=True, allow_tf32=False) * decay
    # (I + A) T = I, row by row: T_i = e_i − Σ_{j<i} A_ij T_j (rows ≥ i of T are still
    # those of I, and A_ij = 0 for j ≥ i).
    eye = (rows == cols).astype(jnp.float32)

    def row(i, t_CxC):
        a_i = jnp.sum(jnp.where(rows == i, a, 0.0), axis=0)  # A's row i, along j
        t_i = jnp.sum(a_i[:, None] * t_CxC, axis=0)  # Σ_j A_ij T_j
        return jnp.where(rows == i, eye - t_i[None, :], t_CxC)

    t_ref[...] = jax.lax.fori_loop(1, ck, row, eye)


def _pallas(q_NxCxHxDk, k_NxCxHxDk, g_NxCxH, beta_NxCxH, start_NxC, interpret):
    n, ck, h, dk = q_NxCxHxDk.shape
    qk_spec = pl.BlockSpec((None, ck, None, dk), lambda i, j: (i, 0, j, 0))
    vec_spec = pl.BlockSpec((None, ck, None), lambda i, j: (i, 0, j))
    out_spec = pl.BlockSpec((None, None, ck, ck), lambda i, j: (i, j, 0, 0))
    shape = jax.ShapeDtypeStruct((n, h, ck, ck), jnp.float32)
    # Triton's compiler parameters select the Triton lowering (without them jax 0.10 lowers
    # a pallas_call for Mosaic GPU, which rejects this kernel).
    return pl.pallas_call(
        _kernel,
        grid=(n, h),
        in_specs=[
            qk_spec,
            qk_spec,
            vec_spec,
            vec_spec,
            pl.BlockSpec((None, ck), lambda i, j: (i, 0)),
        ],
        out_specs=[out_spec, out_spec],
        out_shape=[shape, shape],
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        name="delta_rule_block_factors",
    )(
        q_NxCxHxDk.astype(jnp.float32),
        k_NxCxHxDk.astype(jnp.float32),
        g_NxCxH.astype(jnp.float32),
        beta_NxCxH.astype(jnp.float32),
        start_NxC.astype(jnp.int32),
    )


def _reference(q, k, g, beta, start):
    return jax.vmap(delta_rule.block_factors)(q, k, g, beta, start)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _factors(q, k, g, beta, start, interpret):
    return tuple(_pallas(q, k, g, beta, start, interpret))


def _factors_fwd(q, k, g, beta, start, interpret):
    return _factors(q, k, g, beta, start, interpret), (q, k, g, beta, start)


def _factors_bwd(interpret, res, cot):
    q, k, g, beta, start = res
    _, vjp = jax.vjp(lambda *x: _reference(*x, start), q, k, g, beta)
    return tuple(vjp(tuple(cot))) + (None,)


_factors.defvjp(_factors_fwd, _factors_bwd)


def block_factors(
    q_NxCxHxDk, k_NxCxHxDk, g_NxCxH, beta_NxCxH, start_NxC, interpret: bool | None = None
):
    """delta_rule.block_factors of every block: (T, P) [N, H, Ck, Ck] fp32, from blocked
    q, k [N, Ck, H, Dk] (heads expanded), g, β [N, Ck, H], start bool [N, Ck].
    interpret: Pallas interpret mode (default: off on GPU, on elsewhere)."""
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    return _factors(q_NxCxHxDk, k_NxCxHxDk, g_NxCxH, beta_NxCxH, start_NxC, interpret)
