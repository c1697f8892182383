"""Token draws on vocab-parallel logits, each row with its own sampling parameters.

Owns the draw of one decode step (greedy, temperature, top-k, top-p; Gumbel-max with a
per-sequence key folded with the sequence's own token count, so a draw never depends on
the rows around it or on how steps are grouped into calls), its row-split form over tp
(sample_rows_over_tp: each tp rank draws B/tp rows) and the gathers a decode step needs
inside shard_map. It must never read weights or caches.

Shapes: see the legend in jcp/mesh.py; B = rows of the decode batch on this device.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jcp.mesh import TP, vary_like
from jcp.sample.params import MIN_TEMPERATURE


def nucleus_mask(x_BxV, top_k_B, top_p_B):
    """[B, V] bool: the tokens top-k then top-p keep (by rank, so exactly k survive top-k).

    top_k_B int32 [B] (≤ 0: all), top_p_B float32 [B] (scalars broadcast). top-p keeps a
    token iff the probability (renormalised over the top-k survivors) of the tokens ranked
    strictly above it is < top_p: the smallest set reaching top_p.
    """
    b, v = x_BxV.shape
    top_k_B = jnp.broadcast_to(jnp.asarray(top_k_B), (b,))
    top_p_B = jnp.broadcast_to(jnp.asarray(top_p_B, jnp.float32), (b,))
    order_BxV = jnp.argsort(-x_BxV, axis=-1, stable=True)
    sorted_BxV = jnp.take_along_axis(x_BxV, order_BxV, axis=-1)
    rank_V = jnp.arange(v)
    in_k = rank_V[None, :] < jnp.where(top_k_B > 0, top_k_B, v)[:, None]
    p_BxV = jax.nn.softmax(jnp.where(in_k, sorted_BxV, -jnp.inf), axis=-1)
    before = jnp.cumsum(p_BxV, axis=-1) - p_BxV
    keep_sorted = in_k & ((top_p_B[:, None] >= 1.0) | (before < top_p_B[:, None]))
    return jnp.zeros((b, v), bool).at[jnp.arange(b)[:, None], order_BxV].set(keep_sorted)


def sample_tokens(
    logits_BxV,
    keys_Bx2,
    count_B,
    temperature_B,
    top_k_B,
    top_p_B,
    *,
    topk: int = 0,
    want_B=True,
):
    """(token int32 [B], log-prob float32 [B]) of one decode step, per row; with topk > 0
    also (ids int32 [B, topk], log-probs [B, topk]): the topk most likely tokens of the
    distribution the log-probs are taken from (ids −1 past the vocabulary) for the rows
    with want_B (the others' are −1 / −inf unless a wanting row shares the call).

    Row b with temperature 0: argmax (the first, as torch), log-prob log_softmax(logits).
    Else x = logits / T_b; log-prob log_softmax(x) of the drawn token (before truncation);
    the draw is restricted to nucleus_mask(x, top_k, top_p). The draw is Gumbel-max with
    key fold_in(key_b, count_b), count_b = tokens the sequence has drawn before: a
    sequence's draws depend on its key and its own step only. Scalars broadcast over rows.

    One program serves every mix of rows: what a call needs is chosen at run time
    (lax.cond on the rows' parameters), so a call whose rows are all greedy draws no noise,
    one where no row truncates sorts no vocabulary, and one where no row wants top-k
    log-probs takes no top-k — the same values, row by row, as the draw of that row alone
    (a greedy row divides by exactly 1; the mask keeps every token of a row that does not
    truncate).
    """
    logits_BxV = logits_BxV.astype(jnp.float32)
    b = logits_BxV.shape[0]
    temperature_B = jnp.broadcast_to(jnp.asarray(temperature_B, jnp.float32), (b,))
    cold_B = temperature_B == 0.0
    drawn = functools.partial(
        _drawn, logits_BxV, keys_Bx2, count_B, temperature_B, top_k_B, top_p_B
    )
    tok_B, logp_BxV = jax.lax.cond(jnp.all(cold_B), functools.partial(_greedy, logits_BxV), drawn)
    lp_B = jnp.take_along_axis(logp_BxV, tok_B[:, None], axis=-1)[:, 0]
    if not topk:
        return tok_B.astype(jnp.int32), lp_B
    return (tok_B.astype(jnp.int32), lp_B, *_top_logprobs(logp_BxV, topk, want_B))


def _greedy(logits_BxV):
    """sample_tokens where every row is greedy: (argmax [B], log_softmax(logits) [B, V])."""
    return jnp.argmax(logits_BxV, axis=-1), jax.nn.log_softmax(logits_BxV, axis=-1)


def _drawn(logits_BxV, keys_Bx2, count_B, temperature_B, top_k_B, top_p_B):
    """sample_tokens where some row draws: (token [B], log_softmax(logits / T) [B, V]);
    greedy rows take the argmax and divide by exactly 1, so their log-probs are
    log_softmax(logits); the vocabulary is sorted (nucleus_mask) only when some drawing row
    truncates."""
    b = logits_BxV.shape[0]
    cold_B = temperature_B == 0.0
    t_B = jnp.where(cold_B, 1.0, jnp.maximum(temperature_B, MIN_TEMPERATURE))
    x_BxV = logits_BxV / t_B[:, None]
    logp_BxV = jax.nn.log_softmax(x_BxV, axis=-1)
    top_k = jnp.broadcast_to(jnp.asarray(top_k_B, jnp.int32), (b,))
    top_p = jnp.broadcast_to(jnp.asarray(top_p_B, jnp.float32), (b,))
    truncates = jnp.any(~cold_B & ((top_k > 0) | (top_p < 1.0)))
    x_BxV = jax.lax.cond(
        truncates,
        lambda x: jnp.where(nucleus_mask(x, top_k, top_p), x, -jnp.inf),
        lambda x: x,
        x_BxV,
    )

    def draw(key_2, count, row_V):
        key = jax.random.fold_in(jax.random.wrap_key_data(key_2, impl="threefry2x32"), count)
        return jnp.argmax(row_V + jax.random.gumbel(key, row_V.shape, jnp.float32))

    count = jnp.broadcast_to(jnp.asarray(count_B, jnp.int32), (b,))
    drawn_B = jax.vmap(draw)(keys_Bx2, count, x_BxV)
    return jnp.where(cold_B, jnp.argmax(logits_BxV, axis=-1), drawn_B), logp_BxV


def _top_logprobs(logp_BxV, topk: int, want_B):
    """(ids int32 [B, topk], log-probs [B, topk]): the topk most likely tokens of logp_BxV
    (ids −1, log-probs −inf past the vocabulary), taken only when some row wants them
    (want_B; else all −1 / −inf)."""
    b = logp_BxV.shape[0]
    k = min(topk, logp_BxV.shape[1])

    def top():
        val, idx = jax.lax.top_k(logp_BxV, k)
        return idx.astype(jnp.int32), val

    def none():
        return (
            vary_like(jnp.full((b, k), -1, jnp.int32), logp_BxV),
            vary_like(jnp.full((b, k), -jnp.inf, jnp.float32), logp_BxV),
        )

    want = jnp.any(jnp.broadcast_to(jnp.asarray(want_B, bool), (b,)))
    idx, val = jax.lax.cond(want, top, none)
    pad = ((0, 0), (0, topk - k))
    return jnp.pad(idx, pad, constant_values=-1), jnp.pad(val, pad, constant_values=-jnp.inf)


def sample_rows_over_tp(
    logits_BxVloc,
    keys_Bx2,
    count_B,
    temperature_B,
    top_k_B,
    top_p_B,
    *,
    topk: int = 0,
    want_B=True,
):
    """sample_tokens of vocab-parallel logits [B, V/tp] (each tp rank its vocab slice), the
    rows split over tp: an all_to_all gives each rank B/tp rows over the whole vocabulary,
    each rank draws its rows, and the rows' results are gathered back (replicated over tp).
    The same draws and log-probs as sample_tokens(gather_vocab(logits), …) — a row's draw
    depends on its own logits, key and count only — for 1/tp of the draw work per rank
    (on CPU the draw, B × V Gumbel noise, is ~half a tiny-model decode step) and 1/tp of
    the logits moved. With B not a multiple of tp: gather_vocab and every rank draws
    every row."""
    tp = jax.lax.axis_size(TP)
    b = logits_BxVloc.shape[0]
    if tp == 1 or b % tp:
        return sample_tokens(
            gather_vocab(logits_BxVloc),
            keys_Bx2,
            count_B,
            temperature_B,
            top_k_B,
            top_p_B,
            topk=topk,
            want_B=want_B,
        )
    n = b // tp
    x_NxV = jax.lax.all_to_all(logits_BxVloc, TP, 0, 1, tiled=True)  # rank-major vocab
    start = jax.lax.axis_index(TP) * n

    def mine(x, dtype):
        x = jnp.broadcast_to(jnp.asarray(x, dtype), (b,) + jnp.shape(x)[1:])
        return jax.lax.dynamic_slice_in_dim(x, start, n, axis=0)

    out = sample_tokens(
        x_NxV,
        mine(keys_Bx2, jnp.uint32),
        mine(count_B, jnp.int32),
        mine(temperature_B, jnp.float32),
        mine(top_k_B, jnp.int32),
        mine(top_p_B, jnp.float32),
        topk=topk,
        want_B=mine(want_B, bool),
    )
    return tuple(gather_batch(x, TP) for x in out)


def gather_vocab(x_BxVloc):
    """[B, V/tp] on each tp rank -> [B, V] on all: a psum of each rank's slice placed in a
    zero grid (typed replicated over tp, unlike all_gather), vocab order rank-major."""
    tp = jax.lax.axis_size(TP)
    grid = jnp.zeros((tp,) + x_BxVloc.shape, x_BxVloc.dtype)
    grid = grid.at[jax.lax.axis_index(TP)].set(x_BxVloc)
    b, v_loc = x_BxVloc.shape
    return jnp.moveaxis(jax.lax.psum(grid, TP), 0, 1).reshape(b, tp * v_loc)


def gather_batch(x_BxN, axes):
    """[B, …] on each device along `axes` -> [n·B, …] on all (device-major over axes in
    order, n = their total size), replicated over them."""
    grid = jnp.zeros((jax.lax.axis_size(axes),) + x_BxN.shape, x_BxN.dtype)
    grid = grid.at[jax.lax.axis_index(axes)].set(x_BxN)
    return jax.lax.psum(grid, axes).reshape((-1,) + x_BxN.shape[1:])
