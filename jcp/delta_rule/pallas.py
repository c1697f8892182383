"""The chunked gated delta rule's block factors as one Pallas kernel (the GPU path).

Owns `block_factors`: for every kernel block and value head at once (grid [N, H], no
order between programs), the state-independent O(Ck²) work of delta_rule._block — the
decay matrix within each piece, A = β k kᵀ ⊙ decay (strictly lower), T = (I + A)^−1 by
forward substitution over the block's rows, and P = q kᵀ ⊙ decay. What depends on the
incoming state (matmuls against [Dk, Dv] states, the sequential scan over blocks) stays in
XLA (delta_rule.chunked(factors=block_factors)). The backward pass is the reference's
(delta_rule.block_factors) through jax.vjp, recomputed: exact, not a Pallas kernel.

Here (CPU) it runs in Pallas interpret mode, tests only; tests/test_delta_rule.py checks
values and gradients against delta_rule.block_factors and the chunked rule end to end. A
GPU run must check: that it lowers (Triton; Ck = 64 rows, Dk ≥ 16, the row loop's
dynamic row stores), values against delta_rule.block_factors in fp32 (and bf16 inputs),
and its time against the XLA chunked form at 16k tokens (benchmarks/qwen3_5.py kernel).
It must never hold a [tokens, Dk, Dv] array.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jcp.delta_rule import rule as delta_rule


def _kernel(q_ref, k_ref, g_ref, beta_ref, start_ref, t_ref, p_ref):
    """One (block, head): q, k [Ck, Dk], g, β [Ck], start [Ck] -> T, P [Ck, Ck]."""
    ck = q_ref.shape[0]
    q, k = q_ref[...], k_ref[...]
    g, beta = g_ref[...], beta_ref[...]
    idx = jax.lax.broadcasted_iota(jnp.int32, (ck,), 0)
    head = jax.lax.cummax(jnp.where(start_ref[...], idx, -1))
    cum = jnp.cumsum(g)
    rows = jax.lax.broadcasted_iota(jnp.int32, (ck, ck), 0)
    cols = jax.lax.broadcasted_iota(jnp.int32, (ck, ck), 1)
    same = (head[:, None] == head[None, :]) & (cols <= rows)
    decay = jnp.where(same, jnp.exp(jnp.where(same, cum[:, None] - cum[None, :], 0.0)), 0.0)
    kk = jnp.dot(k, k.T, preferred_element_type=jnp.float32)
    a = jnp.where(cols < rows, beta[:, None] * kk * decay, 0.0)
    p_ref[...] = jnp.dot(q, k.T, preferred_element_type=jnp.float32) * decay
    # (I + A) T = I, row by row: T_i = e_i − Σ_{j<i} A_ij T_j (rows ≥ i of T are still
    # those of I, and A_ij = 0 for j ≥ i).
    t_ref[...] = (rows == cols).astype(jnp.float32)

    def row(i, carry):
        a_i = jax.lax.dynamic_slice_in_dim(a, i, 1, axis=0)  # [1, Ck]
        t_i = (cols[0:1] == i).astype(jnp.float32) - jnp.dot(
            a_i, t_ref[...], preferred_element_type=jnp.float32)
        t_ref[pl.ds(i, 1), :] = t_i
        return carry

    jax.lax.fori_loop(1, ck, row, 0)


def _pallas(q_NxCxHxDk, k_NxCxHxDk, g_NxCxH, beta_NxCxH, start_NxC, interpret):
    n, ck, h, dk = q_NxCxHxDk.shape
    qk_spec = pl.BlockSpec((None, ck, None, dk), lambda i, j: (i, 0, j, 0))
    vec_spec = pl.BlockSpec((None, ck, None), lambda i, j: (i, 0, j))
    out_spec = pl.BlockSpec((None, None, ck, ck), lambda i, j: (i, j, 0, 0))
    shape = jax.ShapeDtypeStruct((n, h, ck, ck), jnp.float32)
    return pl.pallas_call(
        _kernel, grid=(n, h),
        in_specs=[qk_spec, qk_spec, vec_spec, vec_spec,
                  pl.BlockSpec((None, ck), lambda i, j: (i, 0))],
        out_specs=[out_spec, out_spec], out_shape=[shape, shape], interpret=interpret,
        name="delta_rule_block_factors")(
        q_NxCxHxDk.astype(jnp.float32), k_NxCxHxDk.astype(jnp.float32),
        g_NxCxH.astype(jnp.float32), beta_NxCxH.astype(jnp.float32), start_NxC)


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


def block_factors(q_NxCxHxDk, k_NxCxHxDk, g_NxCxH, beta_NxCxH, start_NxC,
                  interpret: bool | None = None):
    """delta_rule.block_factors of every block: (T, P) [N, H, Ck, Ck] fp32, from blocked
    q, k [N, Ck, H, Dk] (heads expanded), g, β [N, Ck, H], start bool [N, Ck].
    interpret: Pallas interpret mode (default: off on GPU, on elsewhere)."""
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    return _factors(q_NxCxHxDk, k_NxCxHxDk, g_NxCxH, beta_NxCxH, start_NxC, interpret)
