"""The gated delta rule (Gated DeltaNet, Qwen3.5's linear attention) on one stream: the
recurrent form (the reference, and decode) and the chunked WY / UT-transform form over
pieces, with each piece's transition for the cp composition (jcp.delta_rule.cp).

The rule, per value head (transformers' torch_recurrent_gated_delta_rule):
    S_t = exp(g_t) · (I − β_t k_t k_tᵀ) · S_{t−1} + β_t k_t v_tᵀ,   o_t = S_tᵀ q_t · dk^−½
with S [dk, dv]. Over a piece, S_out = M · S_in + U (M [dk, dk], U [dk, dv]): affine in the
incoming state, so pieces compose. A piece that starts a datum starts from S = 0. It must
never hold a [tokens, dk, dv] array: states are per chunk (kernel block) and per piece.

Shapes: see jcp/delta_rule/__init__.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jcp.mesh import vary, varying_axes

DEFAULT_CHUNK = 64


def l2norm(x, eps: float = 1e-6):
    """x / sqrt(Σ x² + eps) over the last axis, in fp32 (as transformers' / FLA's l2norm)."""
    xf = x.astype(jnp.float32)
    return xf * jax.lax.rsqrt(jnp.sum(xf * xf, axis=-1, keepdims=True) + eps)


def _expand_heads(q_SxHkxDk, k_SxHkxDk, heads: int):
    """Each key head serves heads/Hk consecutive value heads (transformers' repeat_interleave)."""
    rep = heads // q_SxHkxDk.shape[1]
    return jnp.repeat(q_SxHkxDk, rep, axis=1), jnp.repeat(k_SxHkxDk, rep, axis=1)


def recurrent(q_SxHkxDk, k_SxHkxDk, v_SxHxDv, g_SxH, beta_SxH, initial_HxDkxDv=None):
    """The gated delta rule token by token: (o [S, H, Dv] fp32, final state [H, Dk, Dv]).

    q, k already L2-normalised (the layer does it); q is scaled by dk^−½ here, as
    transformers does inside its kernels.
    """
    h, dk, dv = v_SxHxDv.shape[1], q_SxHkxDk.shape[-1], v_SxHxDv.shape[-1]
    q, k = _expand_heads(q_SxHkxDk, k_SxHkxDk, h)
    q = q.astype(jnp.float32) * dk**-0.5
    s0 = (
        jnp.zeros((h, dk, dv), jnp.float32)
        if initial_HxDkxDv is None
        else initial_HxDkxDv.astype(jnp.float32)
    )

    def step(s_HxDkxDv, xs):
        q_t, k_t, v_t, g_t, b_t = xs
        s = s_HxDkxDv * jnp.exp(g_t)[:, None, None]
        delta = (v_t - jnp.einsum("hkv,hk->hv", s, k_t)) * b_t[:, None]
        s = s + k_t[:, :, None] * delta[:, None, :]
        return s, jnp.einsum("hkv,hk->hv", s, q_t)

    xs = (
        q,
        k.astype(jnp.float32),
        v_SxHxDv.astype(jnp.float32),
        g_SxH.astype(jnp.float32),
        beta_SxH.astype(jnp.float32),
    )
    s, o = jax.lax.scan(step, s0, xs)
    return o, s


# ----------------------------------------------------------------------------------------
# Chunked form with pieces


def unit_lower_inverse(a_XxCxC):
    """(I + a)^−1 for strictly lower-triangular a [..., Ck, Ck] (Ck a power of two), exact:
    blockwise, doubling the diagonal block each round — [[T1, 0], [A21, T2]]^−1 =
    [[T1⁻¹, 0], [−T2⁻¹ A21 T1⁻¹, T2⁻¹]] — so log2(Ck) rounds of batched matmuls. XLA:CPU
    runs jax.scipy.linalg.solve_triangular as a slow loop (8 ms per 64-row block of 4
    heads, 60× this); transformers and FLA substitute row by row. solve_triangular also
    hung: its LAPACK kernel splits the batch over the intra-op thread pool and blocks a pool
    thread until the parts finish; with 8 devices in it at once every pool thread waited on
    parts queued behind them (the Qwen3.5 model test at meshes (2,2,2) and (1,8,1): all 8
    tf_XLAEigen threads in jax::ParallelBatchMap's BlockingCounter::Wait, seen with gdb).
    """
    c = a_XxCxC.shape[-1]
    lead = a_XxCxC.shape[:-2]
    t = jnp.ones(lead + (c, 1, 1), a_XxCxC.dtype)  # inverses of the 1×1 diagonal blocks
    b = 1
    while b < c:
        n = c // (2 * b)
        pairs = a_XxCxC.reshape(lead + (n, 2 * b, n, 2 * b))
        diag = jnp.moveaxis(jnp.diagonal(pairs, axis1=-4, axis2=-2), -1, -3)  # [.., n, 2b, 2b]
        t1, t2 = t[..., 0::2, :, :], t[..., 1::2, :, :]
        low = -jnp.matmul(t2, jnp.matmul(diag[..., b:, :b], t1))
        t = jnp.concatenate(
            [jnp.concatenate([t1, jnp.zeros_like(t1)], -1), jnp.concatenate([low, t2], -1)], -2
        )
        b *= 2
    return t[..., 0, :, :]


def _piece_decay(g_CxH, start_C):
    """(first token of each token's piece [Ck] (−1: before the block's first piece start),
    cumulative log decay γ [H, Ck], exp(γ_i − γ_j) for j ≤ i in one piece, else 0
    [H, Ck, Ck])."""
    ck = g_CxH.shape[0]
    idx = jnp.arange(ck)
    head = jax.lax.cummax(jnp.where(start_C, idx, -1))
    cum_HxC = jnp.cumsum(g_CxH, axis=0).T
    same_CxC = (head[:, None] == head[None, :]) & (idx[None, :] <= idx[:, None])
    diff_HxCxC = cum_HxC[:, :, None] - cum_HxC[:, None, :]
    return head, cum_HxC, jnp.where(same_CxC, jnp.exp(jnp.where(same_CxC, diff_HxCxC, 0.0)), 0.0)


def block_factors(q_CxHxDk, k_CxHxDk, g_CxH, beta_CxH, start_C):
    """The state-independent factors of one block: (T = (I + A)^−1 [H, Ck, Ck] with A_ij =
    β_i k_i·k_j exp(γ_i − γ_j) for j < i in one piece; P_ij = q_i·k_j exp(γ_i − γ_j) for
    j ≤ i in one piece [H, Ck, Ck]) — the O(Ck²) work of the block (jcp.delta_rule.pallas
    computes the same in a Pallas kernel, every block at once)."""
    ck = q_CxHxDk.shape[0]
    idx = jnp.arange(ck)
    _, _, decay_HxCxC = _piece_decay(g_CxH, start_C)
    lower_CxC = idx[None, :] < idx[:, None]
    kk_HxCxC = jnp.einsum("ihd,jhd->hij", k_CxHxDk, k_CxHxDk)
    a_HxCxC = jnp.where(lower_CxC, beta_CxH.T[:, :, None] * kk_HxCxC * decay_HxCxC, 0.0)
    qk_HxCxC = jnp.einsum("ihd,jhd->hij", q_CxHxDk, k_CxHxDk) * decay_HxCxC
    return unit_lower_inverse(a_HxCxC), qk_HxCxC


def _block(
    q_CxHxDk,
    k_CxHxDk,
    v_CxHxDv,
    g_CxH,
    beta_CxH,
    start_C,
    piece_C,
    cand_XxHxDkxDv,
    row,
    factors=None,
):
    """One kernel block of Ck tokens: (o [Ck, H, Dv], state just after token `row`).
    factors: block_factors of the block when computed outside (the Pallas path), else
    computed here.

    cand: the block's candidate incoming states [1 + P, H, Dk, Dv] — row 0 the carry (the
    state before the block, continued by tokens before the block's first piece start),
    row 1 + p piece p's incoming state; a token with start_C begins piece piece_C there.
    Within a piece, the UT transform: with A_ij = β_i k_i·k_j exp(γ_i − γ_j) (j < i, same
    piece; γ the cumulative log decay), T = (I + A)^−1, v_new = T (βv − β k exp(γ − γ_0) ·
    S_init), o_i = exp(γ_i − γ_0) q_i·S_init + Σ_{j ≤ i, same piece} q_i·k_j exp(γ_i − γ_j)
    v_new_j — transformers' torch_chunk_gated_delta_rule with the state entering at each
    piece's first token. The incoming-state products run as matmuls against every
    candidate ([Ck, Dk] × [Dk, Dv] per candidate), then each token keeps its own: a
    per-token gather of states ([Ck, H, Dk, Dv]) and matvecs cost 80 % of the block.
    """
    head, cum_HxC, decay_HxCxC = _piece_decay(g_CxH, start_C)
    which_C = jnp.where(head >= 0, piece_C[jnp.maximum(head, 0)] + 1, 0)  # its candidate
    before = jnp.where(head >= 0, (cum_HxC - g_CxH.T)[:, jnp.maximum(head, 0)], 0.0)
    t_HxCxC, qk_HxCxC = (
        block_factors(q_CxHxDk, k_CxHxDk, g_CxH, beta_CxH, start_C) if factors is None else factors
    )
    from_init_HxC = jnp.exp(cum_HxC - before)

    def against_own(x_CxHxDk):
        """x_t · (token t's incoming state): [Ck, H, Dv]."""
        all_XxCxHxDv = jnp.einsum("chk,xhkv->xchv", x_CxHxDk, cand_XxHxDkxDv)
        return jnp.take_along_axis(all_XxCxHxDv, which_C[None, :, None, None], axis=0)[0]

    kb_CxHxDk = k_CxHxDk * (beta_CxH * from_init_HxC.T)[:, :, None]
    rhs_HxCxDv = jnp.swapaxes(v_CxHxDv * beta_CxH[:, :, None] - against_own(kb_CxHxDk), 0, 1)
    vnew_HxCxDv = jnp.matmul(t_HxCxC, rhs_HxCxDv)
    o_CxHxDv = against_own(q_CxHxDk * from_init_HxC.T[:, :, None]) + jnp.swapaxes(
        jnp.einsum("hij,hjv->hiv", qk_HxCxC, vnew_HxCxDv), 0, 1
    )
    # State after `row`: the decayed incoming state of row's piece plus its updates so far.
    d_row_HxC = decay_HxCxC[:, row, :]
    s_HxDkxDv = cand_XxHxDkxDv[which_C[row]] * from_init_HxC[:, row][:, None, None] + jnp.einsum(
        "hj,jhk,hjv->hkv", d_row_HxC, k_CxHxDk, vnew_HxCxDv
    )
    return o_CxHxDv, s_HxDkxDv


def _blocks(x, chunk):
    """[S, …] -> [S/Ck, Ck, …]."""
    return x.reshape((x.shape[0] // chunk, chunk) + x.shape[1:])


def chunked(
    q_SxHkxDk,
    k_SxHkxDk,
    v_SxHxDv,
    g_SxH,
    beta_SxH,
    start_S=None,
    piece_S=None,
    init_PxHxDkxDv=None,
    chunk: int = DEFAULT_CHUNK,
    ends_P=None,
    factors=None,
):
    """The gated delta rule in blocks of `chunk` tokens (a power of two; S is padded to
    whole blocks with tokens that leave the state unchanged).

    factors: None (each block's block_factors inside the block scan), or a function of
    the blocked (q, k, g, β, start) [N, Ck, …] -> (T, P) [N, H, Ck, Ck] of every block at
    once, run before the scan (jcp.delta_rule.pallas.block_factors, the Pallas path).

    Without pieces (start_S None): one sequence from state init_PxHxDkxDv[0] (or 0).
    With pieces: token t with start_S[t] begins piece piece_S[t], whose incoming state is
    init_PxHxDkxDv[piece_S[t]]; other tokens continue the state of the token before them.
    Returns (o [S, H, Dv] fp32, state after each token ends_P [P] ([P, H, Dk, Dv]), or the
    final state [H, Dk, Dv] when ends_P is None).
    """
    s_len, h = v_SxHxDv.shape[:2]
    dk, dv = q_SxHkxDk.shape[-1], v_SxHxDv.shape[-1]
    if chunk < 1 or chunk & (chunk - 1):
        raise ValueError(f"chunk must be a power of two, got {chunk}")
    q, k = _expand_heads(q_SxHkxDk, k_SxHkxDk, h)
    q = jnp.asarray(q, jnp.float32) * dk**-0.5
    k = jnp.asarray(k, jnp.float32)
    v = jnp.asarray(v_SxHxDv, jnp.float32)
    g, beta = jnp.asarray(g_SxH, jnp.float32), jnp.asarray(beta_SxH, jnp.float32)
    if init_PxHxDkxDv is None:
        init_PxHxDkxDv = jnp.zeros((1, h, dk, dv), jnp.float32)
    if start_S is None:
        start_S = jnp.arange(s_len) == 0
        piece_S = jnp.zeros((s_len,), jnp.int32)
    init_P = jnp.asarray(init_PxHxDkxDv, jnp.float32)
    start_S, piece_S = jnp.asarray(start_S), jnp.asarray(piece_S, jnp.int32)
    pad = -s_len % chunk  # identity tokens (g = 0, β = 0) up to whole blocks
    if pad:
        q, k, v, g, beta, start_S, piece_S = (
            jnp.concatenate([x, jnp.zeros((pad,) + x.shape[1:], x.dtype)])
            for x in (q, k, v, g, beta, start_S, piece_S)
        )

    def run(s0, blk, row):
        qb, kb, vb, gb, bb, stb, pb, fb = blk
        return _block(qb, kb, vb, gb, bb, stb, pb, jnp.concatenate([s0[None], init_P]), row, fb)

    blocks = tuple(_blocks(x, chunk) for x in (q, k, v, g, beta, start_S, piece_S))
    blocks = blocks + (None if factors is None else factors(*(blocks[i] for i in (0, 1, 3, 4, 5))),)

    @functools.partial(jax.checkpoint, prevent_cse=False)
    def body(s0, blk):
        o, s1 = run(s0, blk, chunk - 1)
        return s1, (o, s0)

    axes = sorted({a for x in (q, k, v, g, beta, init_P) for a in varying_axes(x)})
    s0 = vary(jnp.zeros((h, dk, dv), jnp.float32), axes)
    final, (o_NxCxHxDv, carries) = jax.lax.scan(body, s0, blocks)
    o = o_NxCxHxDv.reshape(-1, h, dv)[:s_len]
    if ends_P is None:
        return o, final

    # The state after each piece's last token: rerun that token's block from its carry.
    def at(end):
        b = end // chunk
        return run(carries[b], jax.tree.map(lambda x: x[b], blocks), end % chunk)[1]

    return o, jax.vmap(at)(ends_P)
