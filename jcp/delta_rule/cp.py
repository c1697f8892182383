"""Gated DeltaNet across context-parallel ranks, and the mixing strategies the decoder's
linear layers call.

A rank's stream holds *pieces* — maximal runs of consecutive positions of one datum (in the
zigzag layout, chunks r and 2cp−1−r of each datum, merged when adjacent) — and every piece
needs what came before it in its datum: the conv's last (kernel − 1) inputs and the delta
rule's state. Both are found by exchanging one small summary per piece over "cp"
(all_gather) and composing the summaries in datum order; they never grow with the number
of tokens. Owns Pieces, the causal conv1d, gated_delta_rule over cp, and the strategies
(cp_mix for training and prefill, StepMix for decode, Recurrent the per-sequence state).

Shapes: see jcp/delta_rule/__init__.py.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jcp.delta_rule.rule import DEFAULT_CHUNK, chunked, recurrent
from jcp.mesh import vary, varying_axes

# ----------------------------------------------------------------------------------------
# Pieces of a stream and their order across cp ranks


@dataclasses.dataclass(frozen=True)
class Pieces:
    """The pieces of this rank's stream and, over all cp ranks, who precedes whom.

    start_S: token begins a piece (a datum's first local token, a jump in position, the
    stream's first token); piece_S: its piece, 0 … P−1 in stream order; end_P: stream index
    of each piece's last real token (0 for an unused or all-padding piece); length_P: its
    real tokens. Over the X = CP·P pieces of all ranks (rank-major): pred_X, the piece
    holding each piece's preceding position of the same datum (−1: it starts its datum, or
    is unused); length_X, the real tokens of each; order_X, the pieces in datum order
    (by datum, then first position; unused pieces last) — a piece with a predecessor comes
    right after it there, since one datum's pieces are disjoint runs of its positions;
    rank: this rank's index on the axis (its pieces are X = rank·P + p).
    """

    start_S: jax.Array
    piece_S: jax.Array
    end_P: jax.Array
    length_P: jax.Array
    pred_X: jax.Array
    length_X: jax.Array
    order_X: jax.Array
    rank: jax.Array
    axis: str | None


jax.tree_util.register_dataclass(
    Pieces,
    data_fields=[
        "start_S",
        "piece_S",
        "end_P",
        "length_P",
        "pred_X",
        "length_X",
        "order_X",
        "rank",
    ],
    meta_fields=["axis"],
)


def _gather(x, axis):
    """[P, …] of every rank, rank-major: [CP·P, …] (the identity without an axis).

    Callers stack what they exchange: one all_gather per exchange (pieces' four counts,
    the transitions' U and M), not several small ones side by side."""
    return x if axis is None else jax.lax.all_gather(x, axis, axis=0, tiled=True)


def pieces(segment_S, position_S, max_pieces: int, axis: str | None = None) -> Pieces:
    """The Pieces of a packed stream (segment: datum slot, −1 padding; position: index in
    the datum). max_pieces: a static bound on pieces per stream — a datum makes at most two
    on a rank (zigzag chunks r and 2cp−1−r), and a stream that begins with padding one more:
    2·B + 1 for B datum slots. axis: the cp mesh axis inside shard_map (None: one stream).
    """
    s_len = segment_S.shape[0]
    t = jnp.arange(s_len)
    real = segment_S >= 0
    prev_seg = jnp.concatenate([jnp.full((1,), -2, segment_S.dtype), segment_S[:-1]])
    prev_pos = jnp.concatenate([jnp.full((1,), -2, position_S.dtype), position_S[:-1]])
    start = (t == 0) | (real & ((segment_S != prev_seg) | (position_S != prev_pos + 1)))
    piece = jnp.cumsum(start) - 1
    p = max_pieces
    first_seg = jnp.full((p,), -1, jnp.int32).at[piece].max(jnp.where(start & real, segment_S, -1))
    first_pos = jnp.full((p,), -1, jnp.int32).at[piece].max(jnp.where(start, position_S, -1))
    last_pos = jnp.full((p,), -1, jnp.int32).at[piece].max(jnp.where(real, position_S, -1))
    end = jnp.full((p,), -1, jnp.int32).at[piece].max(jnp.where(real, t, -1))
    length = jnp.zeros((p,), jnp.int32).at[piece].add(real.astype(jnp.int32))
    seg_x, first_x, last_x, len_x = jnp.moveaxis(
        _gather(jnp.stack([first_seg, first_pos, last_pos, length], axis=1), axis), 1, 0
    )
    link = (
        (seg_x[:, None] == seg_x[None, :])
        & (seg_x[:, None] >= 0)
        & (first_x[:, None] > 0)
        & (last_x[None, :] == first_x[:, None] - 1)
        & (len_x[None, :] > 0)
    )
    pred = jnp.where(link.any(1), jnp.argmax(link, axis=1), -1)
    used = (seg_x >= 0) & (len_x > 0)
    order = jnp.lexsort((first_x, jnp.where(used, seg_x, jnp.iinfo(jnp.int32).max)))
    rank = jnp.zeros((), jnp.int32) if axis is None else jax.lax.axis_index(axis)
    return Pieces(
        start_S=start,
        piece_S=piece.astype(jnp.int32),
        end_P=jnp.maximum(end, 0),
        length_P=length,
        pred_X=pred.astype(jnp.int32),
        length_X=len_x,
        order_X=order.astype(jnp.int32),
        rank=rank,
        axis=axis,
    )


def _one_rank(pcs: Pieces) -> bool:
    """Whether the stream is its cp axis's only rank (cp = 1). There a datum's local
    positions are all of them, in order (the zigzag layout at cp = 1 is the identity,
    batch.pack and the engine's streams place each datum in one run), so every piece
    starts its datum and nothing comes in from another: the composition (_incoming) and
    the delta rule's pass 1 are skipped. A stream outside shard_map (axis None) may hold one datum's pieces apart,
    and keeps them."""
    return pcs.axis is not None and jax.lax.axis_size(pcs.axis) == 1


def _incoming(pcs: Pieces, out_of, own_X, zero):
    """This rank's pieces' incoming summaries (what their datums' earlier pieces leave
    them) and outgoing ones: ([P, …], [P, …]).

    out_of(incoming, own) -> outgoing summary of one piece (own: its row of own_X); a
    piece without a predecessor receives `zero`. One scan over all CP·P pieces in datum
    order (pcs.order_X), carrying the previous piece's outgoing summary: a piece's
    predecessor is the piece just before it there. Its backward keeps one summary per
    piece (the carries) — [CP·P, …] once, where composing by Jacobi iterations over the
    whole table (2·CP of them, the longest chain) kept 2·CP copies, which grew as cp².
    On one rank (_one_rank) no piece has a predecessor: each receives `zero`, no scan.
    """
    if _one_rank(pcs):
        p = pcs.end_P.shape[0]
        inc = jax.tree.map(lambda z: jnp.broadcast_to(z, (p,) + z.shape), zero)
        return inc, jax.vmap(out_of, in_axes=(None, 0))(zero, own_X)
    order = pcs.order_X
    has = jnp.take(pcs.pred_X, order) >= 0

    def step(prev_out, xs):
        has_pred, x = xs  # own_X is read in place (a sorted copy would be one more table)
        inc = jax.tree.map(lambda o, z: jnp.where(has_pred, o, z), prev_out, zero)
        out = out_of(inc, jax.tree.map(lambda t: t[x], own_X))
        return out, (inc, out)

    axes = sorted({a for x in jax.tree.leaves(own_X) for a in varying_axes(x)})
    start = jax.tree.map(lambda z: vary(z, axes), zero)
    _, (inc_sorted, out_sorted) = jax.lax.scan(step, start, (has, order))
    # Where this rank's pieces (rows rank·P + p of the rank-major table) fall in `order`.
    p = pcs.end_P.shape[0]
    where = jnp.argsort(order)[pcs.rank * p + jnp.arange(p)]
    mine = lambda t: jax.tree.map(lambda x: jnp.take(x, where, axis=0), t)  # noqa: E731
    return mine(inc_sorted), mine(out_sorted)


def causal_conv(x_SxC, w_KxC, pcs: Pieces, hand_out: bool = False):
    """SiLU(depthwise causal conv1d) over each datum: [S, C] (transformers' causal_conv1d_fn
    with weight [C, 1, Kc] as w [Kc, C]: out_t = Σ_j w[j] · x_{t−Kc+1+j}, no bias).
    hand_out: also return each of this rank's pieces' last Kc − 1 inputs of its datum
    [P, Kc − 1, C] fp32 (oldest first; the conv window decode continues from).

    Inputs before a piece's first token come from its datum's earlier pieces — a halo of
    Kc − 1 rows, built from each piece's last Kc − 1 inputs exchanged over cp (a piece
    shorter than the halo passes on part of its own incoming halo too); before a datum's
    first token, zeros.
    """
    kc = w_KxC.shape[0]
    halo = kc - 1
    s_len = x_SxC.shape[0]
    x32 = x_SxC.astype(jnp.float32)
    # Own tail: rows end−halo+1 … end (slot halo−1 = the last); rows before the piece
    # start are filled from the incoming halo in out_of.
    back = halo - 1 - jnp.arange(halo)  # slot j holds the input `back[j]` rows before end
    rows = pcs.end_P[:, None] - back[None, :]
    tail_PxHxC = x32[jnp.clip(rows, 0, s_len - 1)]
    len_x = pcs.length_X
    tail_x = _gather(tail_PxHxC, pcs.axis)

    def out_of(inc_HxC, own):
        """A piece's last Kc − 1 inputs: its own, preceded by its incoming halo's."""
        tail_HxC, length = own
        inside = back < length  # [halo]
        src = jnp.clip(jnp.arange(halo) + length, 0, halo - 1)
        return jnp.where(inside[:, None], tail_HxC, inc_HxC[src])

    zero = jnp.zeros((halo, x_SxC.shape[1]), jnp.float32)
    inc_PxHxC, window_PxHxC = _incoming(pcs, out_of, (tail_x, len_x), zero)
    # Each token's offset in its piece; lag l reads x[t − l] inside the piece, else the
    # incoming halo's row halo − (l − offset).
    t = jnp.arange(s_len)
    first = jax.lax.cummax(jnp.where(pcs.start_S, t, 0))
    offset = t - first
    out = x32 * w_KxC[halo].astype(jnp.float32)
    for lag in range(1, kc):
        shifted = jnp.concatenate([jnp.zeros((lag, x32.shape[1]), x32.dtype), x32[:-lag]])
        slot = jnp.clip(halo - (lag - offset), 0, halo - 1)
        halo_row = inc_PxHxC[pcs.piece_S, slot]
        val = jnp.where((offset >= lag)[:, None], shifted, halo_row)
        out = out + val * w_KxC[halo - lag].astype(jnp.float32)
    y = jax.nn.silu(out).astype(x_SxC.dtype)
    return (y, window_PxHxC) if hand_out else y


def gated_delta_rule(
    q_SxHkxDk,
    k_SxHkxDk,
    v_SxHxDv,
    g_SxH,
    beta_SxH,
    segment_S,
    pcs: Pieces,
    chunk: int = DEFAULT_CHUNK,
    hand_out: bool = False,
):
    """The gated delta rule over a packed stream, every piece from its datum's true state:
    o [S, H, Dv] fp32 (q, k L2-normalised; padding tokens' rows are meaningless).
    hand_out: (o, the state after each of this rank's pieces [P, H, Dk, Dv]) — after a
    datum's last piece, the state decode continues from.

    Pass 1: each piece's transition S_out = M·S_in + U, from the chunked kernel run on
    values [v | 0] from the state [0 | I] (the state's right block then tracks M). The
    [P, H, Dk, Dk + Dv] transitions are exchanged over cp (all_gather) and composed in
    datum order (_incoming) into each piece's incoming state. Pass 2: the chunked kernel
    from those states. At cp = 1 (_one_rank) every piece starts from zero: pass 2 only.
    Padding tokens are made identities (g = 0, β = 0) so they never touch a state.
    """
    h, dk, dv = v_SxHxDv.shape[1], q_SxHkxDk.shape[-1], v_SxHxDv.shape[-1]
    real = (segment_S >= 0)[:, None]
    g = jnp.where(real, g_SxH.astype(jnp.float32), 0.0)
    beta = jnp.where(real, beta_SxH.astype(jnp.float32), 0.0)
    v32 = v_SxHxDv.astype(jnp.float32)
    if _one_rank(pcs):
        # Every piece starts its datum (_one_rank): each comes in from the zero state, what
        # pass 1 and the composition would find, so they are skipped: the kernel runs once,
        # on [v], instead of on [v | 0] and then [v] (at Qwen3.5's Dk = Dv, a third of the
        # value-wide work and half the blocks' factors).
        inc_PxHxDkxDv = jnp.zeros((pcs.end_P.shape[0], h, dk, dv), jnp.float32)
    else:
        inc_PxHxDkxDv = _transitions_in(q_SxHkxDk, k_SxHkxDk, v32, g, beta, pcs, chunk)
    o, final = chunked(
        q_SxHkxDk,
        k_SxHkxDk,
        v32,
        g,
        beta,
        pcs.start_S,
        pcs.piece_S,
        inc_PxHxDkxDv,
        chunk,
        ends_P=pcs.end_P if hand_out else None,
    )
    return (o, final) if hand_out else o


def _transitions_in(q_SxHkxDk, k_SxHkxDk, v32, g, beta, pcs: Pieces, chunk: int):
    """gated_delta_rule's pass 1 and composition: each of this rank's pieces' incoming
    state [P, H, Dk, Dv]."""
    h, dk, dv = v32.shape[1], q_SxHkxDk.shape[-1], v32.shape[-1]
    v_aug = jnp.concatenate([v32, jnp.zeros(v32.shape[:2] + (dk,), jnp.float32)], axis=-1)
    eye = jnp.broadcast_to(jnp.eye(dk, dtype=jnp.float32), (h, dk, dk))
    init_aug = jnp.concatenate([jnp.zeros((h, dk, dv), jnp.float32), eye], axis=-1)[None]
    zeros_piece = jnp.zeros((v32.shape[0],), jnp.int32)
    _, ends = chunked(
        q_SxHkxDk,
        k_SxHkxDk,
        v_aug,
        g,
        beta,
        pcs.start_S,
        zeros_piece,
        init_aug,
        chunk,
        ends_P=pcs.end_P,
    )
    ends_x = _gather(ends, pcs.axis)  # one exchange of [U | M] (see _gather)

    def out_of(inc_HxDkxDv, um_HxDkxDvDk):
        m_HxDkxDk, u_HxDkxDv = um_HxDkxDvDk[..., dv:], um_HxDkxDvDk[..., :dv]
        return jnp.einsum("hkj,hjv->hkv", m_HxDkxDk, inc_HxDkxDv) + u_HxDkxDv

    return _incoming(pcs, out_of, ends_x, jnp.zeros((h, dk, dv), jnp.float32))[0]


# ----------------------------------------------------------------------------------------
# The mixing strategy the decoder's Gated DeltaNet layers call


class Recurrent(NamedTuple):
    """A Gated DeltaNet layer's recurrent state per sequence (or, stacked on a leading
    axis, per layer): conv [.., B, Kc − 1, C] the last Kc − 1 conv inputs (oldest first),
    ssm [.., B, H, Dk, Dv] the delta rule's state, both fp32. In prefill's hand-out, B is
    this rank's pieces P instead (the state after each piece)."""

    conv: jax.Array
    ssm: jax.Array


@dataclasses.dataclass(frozen=True)
class CPMix:
    """Training's (and prefill's) sequence mixing of Gated DeltaNet layers over cp shards:
    `conv` and `rule`, closing over the stream's pieces so the model threads no flags.
    Build it once per step with cp_mix; every linear layer reuses its pieces. Each takes
    the layer's incoming state (ignored: a stream starts its datums from zero) and returns
    (output, its part of the outgoing state): None, or with hand_out the state after each
    of this rank's pieces (Recurrent's conv / ssm fields, [P, …])."""

    segment_S: jax.Array
    pcs: Pieces
    chunk: int
    hand_out: bool = False

    def conv(self, x_SxC, w_KxC, state=None):
        out = causal_conv(x_SxC, w_KxC, self.pcs, self.hand_out)
        return out if self.hand_out else (out, None)

    def rule(self, q_SxHkxDk, k_SxHkxDk, v_SxHxDv, g_SxH, beta_SxH, state=None):
        out = gated_delta_rule(
            q_SxHkxDk,
            k_SxHkxDk,
            v_SxHxDv,
            g_SxH,
            beta_SxH,
            self.segment_S,
            self.pcs,
            self.chunk,
            self.hand_out,
        )
        return out if self.hand_out else (out, None)


def cp_mix(
    segment_S,
    position_S,
    max_pieces: int,
    axis: str | None,
    chunk: int = DEFAULT_CHUNK,
    hand_out: bool = False,
) -> CPMix:
    """CPMix of a packed stream (see pieces for max_pieces and axis; hand_out: CPMix)."""
    return CPMix(segment_S, pieces(segment_S, position_S, max_pieces, axis), chunk, hand_out)


@dataclasses.dataclass(frozen=True)
class StepMix:
    """Decode's sequence mixing: one new token per sequence (rows B), continuing each
    sequence's Recurrent state (conv window, delta-rule state) by the recurrent form.
    fresh_B: the row's token is its sequence's first (position 0) — it continues from
    zeros whatever the state rows hold (a reused slot, a one-token prompt)."""

    fresh_B: jax.Array

    def _start(self, state):
        return jnp.where(self.fresh_B.reshape((-1,) + (1,) * (state.ndim - 1)), 0.0, state)

    def conv(self, x_BxC, w_KxC, window_BxHxC):
        """(SiLU(Σ_j w[j] · [window | x][j]) [B, C], the new window [B, Kc − 1, C])."""
        full = jnp.concatenate(
            [self._start(window_BxHxC), x_BxC.astype(jnp.float32)[:, None]], axis=1
        )
        out = jnp.einsum("bjc,jc->bc", full, w_KxC.astype(jnp.float32))
        return jax.nn.silu(out).astype(x_BxC.dtype), full[:, 1:]

    def rule(self, q_BxHkxDk, k_BxHkxDk, v_BxHxDv, g_BxH, beta_BxH, s_BxHxDkxDv):
        """(o [B, H, Dv] fp32, the new state [B, H, Dk, Dv]): one step of `recurrent`."""
        one = lambda q, k, v, g, b, s: recurrent(q[None], k[None], v[None], g[None], b[None], s)  # noqa: E731
        o, s = jax.vmap(one)(
            q_BxHkxDk, k_BxHkxDk, v_BxHxDv, g_BxH, beta_BxH, self._start(s_BxHxDkxDv)
        )
        return o[:, 0], s
