"""Token log-probs, chunked and vocab-parallel: target_logprobs (training's, with a custom
VJP that recomputes each chunk's logits) and prompt_stats (sampling's forward-only top-k and
draws of the same log_softmax), of the logits' factors (Unembedding: the base unembedding
and its LoRA, each row by its own adapter — HeadLora).

Both run per shard inside the one shard_map, the vocabulary split over "tp". They must never
build an array of [tokens, vocab] (forward or backward) and never gather the vocabulary.

Shapes: see the legend in jcp/mesh.py.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jcp.lora_grouped import plan_rows, plan_spans, tile_product, tile_product_grads_into, tile_rows
from jcp.mesh import BATCH_AXES, TP, block_size, vary, varying_axes

DEFAULT_CHUNK = 1024


@dataclasses.dataclass(frozen=True)
class HeadLora:
    """The unembedding's LoRA, each row by its own adapter only: logits[s] += u_SxR[s] @
    b_AxRxV[k(s)], in tiles of one adapter's rows (jcp.lora_grouped), chunk by chunk — so
    it costs what the rows cost, whatever the number A of adapters (a stacked [S, A·R] @
    [A·R, V] costs A times that).

    u_SxR: each row's (h @ a_k)·scale_k in the stream's rows, zero for rows of no adapter;
    b_AxRxV: the active adapters' B, this tp rank's vocab slice. The rows' adapters, as
    the model's Routing gives them: spans_Ax2 [start, end) (rows contiguous per adapter;
    live_A False for entries without LoRA) or, where spans_Ax2 is None, k_S each row's
    index into the A adapters (any order: a decode batch).
    """

    u_SxR: jax.Array
    b_AxRxV: jax.Array
    live_A: jax.Array
    spans_Ax2: jax.Array | None = None
    k_S: jax.Array | None = None

    def tiles(self, start, rows: int):
        """(u [rows, R] in the tiles' row order, Tiles) of rows [start, start + rows)."""
        n_a = self.b_AxRxV.shape[0]
        tile = tile_rows(rows, n_a)
        u = jax.lax.dynamic_slice_in_dim(self.u_SxR, start, rows, axis=0)
        scale_A = jnp.ones((n_a,), jnp.float32)  # unused: u holds the scales
        if self.spans_Ax2 is None:
            k = jax.lax.dynamic_slice_in_dim(self.k_S, start, rows)
            t = plan_rows(k, self.live_A, scale_A, tile)
            return u[t.order_Q], t
        spans = jnp.clip(self.spans_Ax2 - start, 0, rows)
        return u, plan_spans(spans, self.live_A, scale_A, rows, tile)

    def logits(self, start, rows: int):
        """fp32 [rows, V/tp]: the LoRA's logits of rows [start, start + rows)."""
        u_QxR, t = self.tiles(start, rows)
        y = tile_product(u_QxR, self.b_AxRxV, t)
        return y if t.place_S is None else y[t.place_S]

    def grads_into(self, start, rows: int, d_logits, d_b):
        """(d u [rows, R] fp32, d_b + the gradient of b) for the cotangent d_logits of
        logits(start, rows); d_b [A, R, V/tp] fp32, added tile by tile."""
        u_QxR, t = self.tiles(start, rows)
        if t.order_Q is not None:
            d_logits = d_logits[t.order_Q]
        f32 = jnp.float32
        du, d_b = tile_product_grads_into(
            u_QxR.astype(f32), d_logits, self.b_AxRxV.astype(f32), t, d_b
        )
        return (du if t.place_S is None else du[t.place_S]), d_b


jax.tree_util.register_dataclass(
    HeadLora, data_fields=["u_SxR", "b_AxRxV", "live_A", "spans_Ax2", "k_S"], meta_fields=[]
)


@dataclasses.dataclass(frozen=True)
class Unembedding:
    """The factors of the logits, vocab split over "tp": logits = Σ_i lefts[i] @ rights[i]
    (+ head's). lefts[i]: [S, D_i], the same on every tp rank; rights[i]: [D_i, V/tp], this
    rank's vocab slice (rank t holds vocab rows t·V/tp …); head: the unembedding's LoRA by
    tiles (HeadLora), or None (no LoRA there, or the few adapters' stacked in lefts /
    rights)."""

    lefts: tuple
    rights: tuple
    head: HeadLora | None = None

    def logits(self):
        """fp32 logits [S, V/tp] of every row at once (a decode batch's)."""
        return _chunk_logits(self, 0, self.lefts[0].shape[0])

    def varying(self, axes) -> Unembedding:
        """The factors typed varying over axes (before a custom VJP: see target_logprobs)."""
        head = self.head
        if head is not None:
            head = dataclasses.replace(
                head, u_SxR=vary(head.u_SxR, axes), b_AxRxV=vary(head.b_AxRxV, axes)
            )
        return Unembedding(
            tuple(vary(x, axes) for x in self.lefts),
            tuple(vary(r, axes) for r in self.rights),
            head,
        )


jax.tree_util.register_dataclass(
    Unembedding, data_fields=["lefts", "rights", "head"], meta_fields=[]
)


def _chunk_logits(f: Unembedding, i, chunk):
    """fp32 logits [chunk, V/tp] of token chunk i: Σ left[chunk] @ right (+ the head's)."""
    out = None
    for left, right in zip(f.lefts, f.rights):
        part = jax.lax.dynamic_slice_in_dim(left, i * chunk, chunk, axis=0)
        y = jnp.einsum("sd,dv->sv", part, right, preferred_element_type=jnp.float32)
        out = y if out is None else out + y
    if f.head is not None:
        out = out + f.head.logits(i * chunk, chunk)
    return out


def _local_targets(targets_SxK, v_local):
    """Targets as indices into this tp rank's vocab slice, and whether they fall in it
    (a padding target −1 falls in no slice: its log-prob is −lse, masked by the caller)."""
    local = targets_SxK - jax.lax.axis_index(TP) * v_local
    inside = (local >= 0) & (local < v_local)
    return jnp.where(inside, local, 0), inside


def _lp_fwd_impl(f: Unembedding, targets_SxK, chunk):
    s_len = targets_SxK.shape[0]
    v_local = f.rights[0].shape[1]
    n_chunks = s_len // chunk
    tgt_SxK, inside_SxK = _local_targets(targets_SxK, v_local)

    def body(_, i):
        logits = _chunk_logits(f, i, chunk)
        m = jax.lax.pmax(jnp.max(logits, axis=-1), TP)
        se = jax.lax.psum(jnp.sum(jnp.exp(logits - m[:, None]), axis=-1), TP)
        lse = m + jnp.log(se)
        t = jax.lax.dynamic_slice_in_dim(tgt_SxK, i * chunk, chunk)
        ins = jax.lax.dynamic_slice_in_dim(inside_SxK, i * chunk, chunk)
        picked = jnp.take_along_axis(logits, t, axis=-1)  # [chunk, K]
        picked = jax.lax.psum(jnp.where(ins, picked, 0.0), TP)
        return None, (picked - lse[:, None], lse)

    _, (lp, lse) = jax.lax.scan(body, None, jnp.arange(n_chunks))
    return lp.reshape(targets_SxK.shape), lse.reshape(s_len)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _target_logprobs(f: Unembedding, targets_SxK, chunk, right_grads):
    return _lp_fwd_impl(f, targets_SxK, chunk)[0]


def _lp_fwd(f, targets_SxK, chunk, right_grads):
    lp, lse = _lp_fwd_impl(f, targets_SxK, chunk)
    return lp, (f, targets_SxK, lse)


def _zero_cotangent(x):
    """The cotangent of an input that gets none: float0 for integer and bool arrays."""
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return jnp.zeros_like(x)
    return np.zeros(x.shape, dtype=jax.dtypes.float0)


def _lp_bwd(chunk, right_grads, res, g_SxK):
    f, targets_SxK, lse_S = res
    s_len = targets_SxK.shape[0]
    v_local = f.rights[0].shape[1]
    tgt_SxK, inside_SxK = _local_targets(targets_SxK, v_local)
    # Frozen factors (the base unembedding) get no gradient work at all.
    d_rights0 = tuple(
        vary(jnp.zeros(r.shape if want else (), jnp.float32), varying_axes(r))
        for r, want in zip(f.rights, right_grads)
    )
    head = f.head
    d_b0 = (
        None
        if head is None
        else vary(jnp.zeros(head.b_AxRxV.shape, jnp.float32), varying_axes(head.b_AxRxV))
    )

    def body(carry, i):
        d_rights, d_b = carry
        logits = _chunk_logits(f, i, chunk)
        lse = jax.lax.dynamic_slice_in_dim(lse_S, i * chunk, chunk)
        g = jax.lax.dynamic_slice_in_dim(g_SxK, i * chunk, chunk)
        t = jax.lax.dynamic_slice_in_dim(tgt_SxK, i * chunk, chunk)
        ins = jax.lax.dynamic_slice_in_dim(inside_SxK, i * chunk, chunk)
        # d lp_k / d logits = onehot(target_k) − softmax; the one-hot parts are a scatter
        # of g, so no [chunk, V] index or mask array is built.
        d_logits = -jnp.sum(g, axis=-1)[:, None] * jnp.exp(logits - lse[:, None])
        d_logits = d_logits.at[jnp.arange(chunk)[:, None], t].add(jnp.where(ins, g, 0.0))
        d_lefts = []
        new_d_rights = []
        for left, right, dr, want in zip(f.lefts, f.rights, d_rights, right_grads):
            part = jax.lax.dynamic_slice_in_dim(left, i * chunk, chunk, axis=0)
            dl = jnp.einsum("sv,dv->sd", d_logits, right.astype(jnp.float32))
            d_lefts.append(jax.lax.psum(dl, TP))  # sum over the vocab shards
            if want:
                dr = dr + jnp.einsum("sd,sv->dv", part.astype(jnp.float32), d_logits)
            new_d_rights.append(dr)
        d_u = None
        if head is not None:
            d_u, d_b = head.grads_into(i * chunk, chunk, d_logits, d_b)
            d_u = jax.lax.psum(d_u, TP)
        return (tuple(new_d_rights), d_b), (tuple(d_lefts), d_u)

    (d_rights, d_b), (d_lefts, d_u) = jax.lax.scan(
        body, (d_rights0, d_b0), jnp.arange(s_len // chunk)
    )
    d_lefts = tuple(dl.reshape(left.shape).astype(left.dtype) for dl, left in zip(d_lefts, f.lefts))
    d_rights = tuple(
        dr.astype(r.dtype) if want else jnp.zeros_like(r)
        for dr, r, want in zip(d_rights, f.rights, right_grads)
    )
    d_head = None
    if head is not None:
        d_head = jax.tree.map(_zero_cotangent, head)
        d_head = dataclasses.replace(
            d_head,
            u_SxR=d_u.reshape(head.u_SxR.shape).astype(head.u_SxR.dtype),
            b_AxRxV=d_b.astype(head.b_AxRxV.dtype),
        )
    targets_ct = np.zeros(targets_SxK.shape, dtype=jax.dtypes.float0)
    return Unembedding(d_lefts, d_rights, d_head), targets_ct


_target_logprobs.defvjp(_lp_fwd, _lp_bwd)


def target_logprobs(f: Unembedding, targets_S, chunk: int = DEFAULT_CHUNK, right_grads=None):
    """log p(target) [S] for the logits of f (Unembedding), vocab split over "tp"; [S, K]
    for targets [S, K] (K scored targets per token, e.g. a teacher's top-k: one softmax
    per token, K picks; a target −1 gets −lse, for the caller to mask).

    The softmax pieces are combined with pmax / psum over "tp". Tokens are processed
    `chunk` at a time under a custom VJP that keeps only the log-sum-exp [S] and recomputes
    each chunk's logits in the backward pass, so no [S, V] array ever exists.
    right_grads[i] = False skips the gradient of a frozen f.rights[i] (its cotangent is
    zero); the head's LoRA always gets its gradient.
    """
    chunk = block_size(targets_S.shape[0], chunk)
    # The batch axes vary across devices; weights replicated over them must be marked
    # varying before the custom VJP so that their cotangents are summed by the transpose
    # of this cast (outside), not inside the rule.
    f = f.varying(BATCH_AXES)
    right_grads = (True,) * len(f.rights) if right_grads is None else tuple(right_grads)
    if targets_S.ndim == 1:
        return _target_logprobs(f, targets_S[:, None], chunk, right_grads)[:, 0]
    return _target_logprobs(f, targets_S, chunk, right_grads)


def _gather_tp(x_CxK):
    """[C, K] on each tp rank -> [C, tp·K] on all (rank-major), typed replicated over tp."""
    tp = jax.lax.axis_size(TP)
    grid = jnp.zeros((tp,) + x_CxK.shape, x_CxK.dtype).at[jax.lax.axis_index(TP)].set(x_CxK)
    return jnp.moveaxis(jax.lax.psum(grid, TP), 0, 1).reshape(x_CxK.shape[0], -1)


def _lse_tp(x):
    """The log-sum-exp over the last axis of logits split over "tp"."""
    m = jax.lax.pmax(jnp.max(x, axis=-1), TP)
    return m + jnp.log(jax.lax.psum(jnp.sum(jnp.exp(x - m[:, None]), axis=-1), TP))


def prompt_stats(
    f: Unembedding,
    targets_SxK,
    chunk: int = DEFAULT_CHUNK,
    *,
    topk: int = 0,
    alt: int = 0,
    temperature_S=None,
    keys_Sx2=None,
    position_S=None,
) -> dict:
    """Forward-only log-prob statistics of every token of f's logits (Unembedding),
    vocab-parallel over "tp" (no [tokens, V] array, no vocab gather): {"lp": [S, K] log_softmax(logits) of targets
    (as target_logprobs; −1 gets −lse, for the caller to mask)} and, with topk > 0,
    "topk_ids" int32 / "topk_lp" [S, topk]: the topk most likely tokens and their
    log-probs (each rank's own top-k of its vocab slice, merged: tp·topk candidates per
    token; ids −1 / −inf past the vocabulary); with alt > 0, "alt_ids" int32 / "alt_lp"
    [S, alt]: alt independent draws from softmax(logits / T) (T = temperature_S; T = 0:
    the argmax every time) with their log-probs log_softmax(logits / T) (T = 0: of the
    logits) — Gumbel-max on each rank's slice, the max merged over tp; draw j of a token
    uses key fold_in(fold_in(fold_in(keys_Sx2, position_S), j), tp rank), so draws
    depend on the seed, the position and tp, not on the batch around the token.
    """
    f = f.varying(BATCH_AXES)
    s_len = targets_SxK.shape[0]
    chunk = block_size(s_len, chunk)
    v_local = f.rights[0].shape[1]
    tgt_SxK, inside_SxK = _local_targets(targets_SxK, v_local)

    def body(_, i):
        sl = lambda x: jax.lax.dynamic_slice_in_dim(x, i * chunk, chunk)  # noqa: E731
        logits = _chunk_logits(f, i, chunk)
        lse = _lse_tp(logits)
        picked = jnp.take_along_axis(logits, sl(tgt_SxK), axis=-1)
        out = {"lp": jax.lax.psum(jnp.where(sl(inside_SxK), picked, 0.0), TP) - lse[:, None]}
        if topk:
            out["topk_lp"], out["topk_ids"] = _top_k(logits, lse, topk)
        if alt:
            out["alt_ids"], out["alt_lp"] = _draws(
                logits, sl(temperature_S), sl(keys_Sx2), sl(position_S), alt
            )
        return None, out

    _, out = jax.lax.scan(body, None, jnp.arange(s_len // chunk))
    return {k: v.reshape((s_len,) + v.shape[2:]) for k, v in out.items()}


def _top_k(logits_CxV, lse_C, topk: int):
    """(log-probs [C, topk], ids int32 [C, topk]) of a chunk's topk most likely tokens:
    each rank's own top-k of its vocab slice, merged over tp (ids −1 / −inf past the
    vocabulary)."""
    v_local = logits_CxV.shape[1]
    offset = jax.lax.axis_index(TP) * v_local
    k_loc = min(topk, v_local)
    val, idx = jax.lax.top_k(logits_CxV, k_loc)
    val, idx = _gather_tp(val), _gather_tp(idx.astype(jnp.int32) + offset)
    val, at = jax.lax.top_k(val, min(topk, val.shape[1]))
    idx = jnp.take_along_axis(idx, at, axis=-1)
    pad = topk - val.shape[1]
    return (
        jnp.pad(val - lse_C[:, None], ((0, 0), (0, pad)), constant_values=-jnp.inf),
        jnp.pad(idx, ((0, 0), (0, pad)), constant_values=-1),
    )


def _draws(logits_CxV, t_C, keys_Cx2, pos_C, alt: int):
    """(ids int32 [C, alt], log-probs [C, alt]) of alt Gumbel-max draws per token from
    softmax(logits / T) (T = 0: the argmax, its log-prob of the logits), the max merged over
    tp; see prompt_stats for the keys."""
    v_local = logits_CxV.shape[1]
    rank = jax.lax.axis_index(TP)
    v_total = v_local * jax.lax.axis_size(TP)
    offset = rank * v_local
    x = logits_CxV / jnp.where(t_C > 0, t_C, 1.0)[:, None]
    lse_t = _lse_tp(x)

    def draw(_, j):
        def noise(key_2, p):
            key = jax.random.wrap_key_data(key_2, impl="threefry2x32")
            key = jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(key, p), j), rank)
            return jax.random.gumbel(key, (v_local,), jnp.float32)

        y = jnp.where((t_C > 0)[:, None], x + jax.vmap(noise)(keys_Cx2, pos_C), x)
        best = jnp.max(y, axis=-1)
        top = jax.lax.pmax(best, TP)
        tok = jax.lax.pmin(jnp.where(best == top, jnp.argmax(y, axis=-1) + offset, v_total), TP)
        here = (tok >= offset) & (tok < offset + v_local)
        xi = jnp.take_along_axis(x, jnp.clip(tok - offset, 0, v_local - 1)[:, None], axis=-1)[:, 0]
        return None, (tok.astype(jnp.int32), jax.lax.psum(jnp.where(here, xi, 0.0), TP) - lse_t)

    _, (ids, lps) = jax.lax.scan(draw, None, jnp.arange(alt))
    return ids.T, lps.T
