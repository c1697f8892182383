"""The KV cache of sampling: its two layouts, how prefill fills it, how decode reads and
writes it.

Prefill and decode are `attention.Attend` strategies passed to the one decoder
(model.hidden_states), so sampling runs the same layers, LoRA routing and CP attention as
training. Prefill runs training's CP attention (gathered K/V or the ring, as training
picks it) over the packed zigzag streams and hands every layer's K/V out; `fill` (inside
the prefill program) moves those rows into the cache. Decode reads a layer's cache,
merges the partial softmax states of the ranks that hold its rows, adds the step's own
key, and hands the step's K/V out; the caller writes them once per step (`write_rows`),
outside the layer scan, so the scan never copies the cache. This module must never hold
weights or run the model itself.

Two layouts (`LAYOUTS`), one code path — they differ only in which mesh axes the
sequences and the rows of one sequence are spread over:

    "batch"  sequences over (dp, cp), a sequence's T rows on one device (cp ranks act as
             extra data parallelism); decode needs no cross-device attention.
    "split"  sequences over dp, a sequence's T = CP·Tc rows split over cp: rank c keeps the
             rows it prefilled (its zigzag chunks) and every CP-th new token (round robin),
             so per-device cache memory is ∝ tokens / cp. A query's partial softmax over
             each rank's rows is merged over cp by log-sum-exp (`merge_partials`).

Every cache row carries its true position (−1 = empty), and masks compare positions, so
the order of rows never matters.

Shapes: see the legend in jcp/mesh.py; here B = sequences of the decode batch on this
device, T = cache rows per sequence on this device. Einsum letters: b sequence, t cache
row, k kv heads, m query heads per kv head, h head dim.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jcp import attention as attention_lib
from jcp import delta_rule
from jcp.mesh import CP, DP, SPECS, TP


class KV(NamedTuple):
    """Keys and values of one layer (or, stacked on a leading [L], of every layer); rec: a
    hybrid model's recurrent state of its Gated DeltaNet layers beside them
    (delta_rule.Recurrent [Ll, B, …]; None for a model without linear attention)."""

    k: jax.Array
    v: jax.Array
    rec: delta_rule.Recurrent | None = None


class Cache(NamedTuple):
    """The cache: k, v [L, B, T, K, H] (L: the full-attention layers), position int32
    [B, T] (the true position of each row's key in its sequence; −1 = empty) and, for a
    hybrid model, rec: every sequence's recurrent state (delta_rule.Recurrent: conv
    [Ll, B, Kc − 1, C], ssm [Ll, B, H, Dk, Dv], fp32) — one row per sequence, beside the
    rows of the full-attention layers."""

    k: jax.Array
    v: jax.Array
    position: jax.Array
    rec: delta_rule.Recurrent | None = None


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where a cache layout puts sequences and rows (see the module docstring).

    seq_axes: mesh axes the decode batch is spread over; row_axes: mesh axes one sequence's
    rows are spread over (merged by log-sum-exp in decode). The specs come from mesh.SPECS.
    """

    name: str
    seq_axes: tuple[str, ...]
    row_axes: tuple[str, ...]
    kv_LxBxTxKxH: P
    position_BxT: P
    seqs_B: P
    seqs_Bx2: P
    spans: P  # [DP, CP, A, 2] ("batch") or [DP, 1, A, 2] ("split")

    @property
    def specs(self) -> Cache:
        return Cache(self.kv_LxBxTxKxH, self.kv_LxBxTxKxH, self.position_BxT)

    @property
    def rec_specs(self) -> delta_rule.Recurrent:
        """The recurrent state's specs: a sequence's row on the devices of its sequence
        axes (replicated over cp under "split": every rank of the sequence runs its
        recurrent step alike), channels and heads over tp."""
        return delta_rule.Recurrent(
            P(None, self.seq_axes, None, TP), P(None, self.seq_axes, TP, None, None)
        )

    def cache_specs(self, hybrid: bool) -> Cache:
        """specs, with rec_specs for a hybrid model."""
        return self.specs._replace(rec=self.rec_specs if hybrid else None)

    def kv_specs(self, hybrid: bool) -> KV:
        """The KV the prefill program takes and returns (rec for a hybrid model)."""
        return KV(self.kv_LxBxTxKxH, self.kv_LxBxTxKxH, self.rec_specs if hybrid else None)


LAYOUTS = {
    "batch": Layout(
        "batch",
        (DP, CP),
        (),
        SPECS.cache_LxBxTxKxH,
        SPECS.cache_position_BxT,
        SPECS.seqs_B,
        SPECS.seqs_Bx2,
        SPECS.spans_DPxCPxAx2,
    ),
    "split": Layout(
        "split",
        (DP,),
        (CP,),
        SPECS.split_cache_LxBxTxKxH,
        SPECS.split_cache_position_BxT,
        SPECS.split_seqs_B,
        SPECS.split_seqs_Bx2,
        SPECS.split_spans_DPx1xAx2,
    ),
}


# ----------------------------------------------------------------------------------------
# Prefill


def prefill_attend(train: attention_lib.Attend) -> attention_lib.Attend:
    """Training's CP attention strategy `train` over the packed streams (gathered K/V or
    the ring, whichever training would use: train_step.training_attend); the new state is
    this rank's K/V.

    The incoming state is ignored (None: nothing is cached yet); the returned state is
    KV(k [S, K, H], v [S, K, H]) of this rank's stream rows (RoPE applied), which
    hidden_states stacks over layers to [L, S, K, H]. Only this rank's rows leave the
    layer, so the ring keeps prefill's K/V O(S) per device until `fill`.
    """

    def attend(q_SxQxH, k_SxKxH, v_SxKxH, state):
        out, _ = train(q_SxQxH, k_SxKxH, v_SxKxH, None)
        return out, KV(k_SxKxH, v_SxKxH)

    return attend


def fill(kv: KV, source_BxT, layout: Layout, old: KV | None) -> KV:
    """Inside shard_map: this device's cache rows from the prefill streams' K/V.

    kv: this device's stream rows [L, S, K, H]. They are all-gathered over the layout's
    sequence axes (device-major: flat row g·S + s of device g = (d·CP + c) for "batch",
    d for "split" — under "split" each cp rank gathers only its own cp slice, so memory
    stays ∝ 1/cp), and row (b, t) of the cache takes flat row source_BxT[b, t]; source −1
    keeps `old`'s row (zeros when old is None). Returns KV [L, B, T, K, H].
    Example ("batch", cp = 2, one prompt of 5 prefill tokens, S = 4): rank 0 streams
    positions [0, 1, -, -] and rank 1 [2, 3, 4, -], so source[0] = [0, 1, 4, 5, 6, -1, …].
    """
    b, t = source_BxT.shape
    keep = (source_BxT >= 0)[None, :, :, None, None]

    def one(x_LxSxKxH, old_LxBxTxKxH):
        flat = jax.lax.all_gather(x_LxSxKxH, layout.seq_axes, axis=1, tiled=True)
        rows = jnp.take(flat, jnp.maximum(source_BxT, 0).reshape(-1), axis=1)
        rows = rows.reshape((rows.shape[0], b, t) + rows.shape[2:])
        if old_LxBxTxKxH is None:
            old_LxBxTxKxH = jnp.zeros_like(rows)
        return jnp.where(keep, rows, old_LxBxTxKxH)

    return KV(
        *(
            one(x, None if old is None else o)
            for x, o in zip(kv[:2], (None, None) if old is None else old[:2])
        )
    )


def fill_recurrent(
    rec: delta_rule.Recurrent, source_B, old: delta_rule.Recurrent | None, layout: Layout
) -> delta_rule.Recurrent:
    """Inside shard_map: this device's rows of the recurrent state from prefill's hand-out.

    rec: the state after each of this device's stream pieces [Ll, P, …]. All-gathered over
    (dp, cp) (device-major: flat row (d·CP + c)·P + p); row b takes flat row source_B[b]
    — its prompt's last prefill piece, so the num_samples rows of one prompt copy one
    state — and source −1 keeps `old`'s row (zeros when old is None). Returns [Ll, B, …]
    (under "split", the same on every cp rank: one rank's rows, psum'd over cp, so that
    the result is typed cp-invariant as its spec says).
    """
    keep = source_B >= 0
    spread = tuple(a for a in (DP, CP) if a not in layout.seq_axes)
    # One all_gather of both fields side by side (flattened), never two independent ones
    # (see delta_rule.cp._gather: XLA:CPU may order independent collectives differently on
    # each device).
    ll, p = rec.conv.shape[:2]
    flat = jax.lax.all_gather(
        jnp.concatenate([x.reshape(ll, p, -1) for x in rec], axis=-1), (DP, CP), axis=1, tiled=True
    )
    rows = jnp.take(flat, jnp.maximum(source_B, 0), axis=1)  # [Ll, B, conv + ssm]
    if spread:
        first = sum(jax.lax.axis_index(a) for a in spread) == 0
        rows = jax.lax.psum(jnp.where(first, rows, 0.0), spread)
    cut = rec.conv[0, 0].size
    b = source_B.shape[0]
    new = delta_rule.Recurrent(
        rows[..., :cut].reshape((ll, b) + rec.conv.shape[2:]),
        rows[..., cut:].reshape((ll, b) + rec.ssm.shape[2:]),
    )
    if old is None:
        old = jax.tree.map(jnp.zeros_like, new)
    return keep_recurrent(old, new, keep)


# ----------------------------------------------------------------------------------------
# Decode


def merge_partials(state: attention_lib.SoftmaxState, axes) -> attention_lib.SoftmaxState:
    """Log-sum-exp merge of online-softmax states over mesh `axes` (flash-decoding).

    Each device holds the state of its own key rows (max m_i, sum l_i, acc_i, any shape);
    with m = pmax(m_i): l = psum(l_i·e^(m_i − m)), acc = psum(acc_i·e^(m_i − m)) — the state
    of all rows together, the same on every device. A device that saw no visible key
    (m_i = −inf) contributes exactly 0. axes = (): the state unchanged.
    Example: two ranks with one key each, scores 0 and log 3, values 1 and 5: m = log 3,
    l = 1/3 + 1, acc = 1/3 + 5, acc / l = 4.
    """
    if not axes:
        return state
    m_i, l_i, acc_i = state
    m = jax.lax.pmax(m_i, axes)
    corr = jnp.exp(m_i - jnp.where(jnp.isfinite(m), m, 0.0))
    l = jax.lax.psum(l_i * corr, axes)
    acc = jax.lax.psum(acc_i * corr[..., None], axes)
    return attention_lib.SoftmaxState(m, l, acc)


def decode_attend(position_B, row_position_BxT, merge_axes=()) -> attention_lib.Attend:
    """The decode strategy: one new token per sequence against that sequence's cache.

    position_B: the true position of each sequence's new token; row_position_BxT: the
    position held by each of this device's cache rows (−1 = empty). A query sees a row iff
    0 ≤ row position < its own position, then its own new key. merge_axes: the mesh axes
    a sequence's rows are split over (the layout's row_axes). state: this layer's
    KV(k [B, T, K, H], v [B, T, K, H]); returns (out [B, Q, H], KV(k_new [B, K, H],
    v_new [B, K, H])) — the caller writes the new rows (write_rows).
    """
    visible_BxT = (row_position_BxT >= 0) & (row_position_BxT < position_B[:, None])

    def attend(q_BxQxH, k_BxKxH, v_BxKxH, state: KV):
        b, q_heads, head_dim = q_BxQxH.shape
        kv_heads = k_BxKxH.shape[1]
        per_kv = q_heads // kv_heads
        scale = 1.0 / np.sqrt(head_dim)
        q_BxKxMxH = q_BxQxH.reshape(b, kv_heads, per_kv, head_dim)

        def rows(q_KxMxH, k_TxKxH, v_TxKxH, visible_T):
            s_KxMxT = (
                jnp.einsum("kmh,tkh->kmt", q_KxMxH, k_TxKxH, preferred_element_type=jnp.float32)
                * scale
            )
            s_KxMxT = jnp.where(visible_T, s_KxMxT, -jnp.inf)
            init = attention_lib.online_softmax_init(kv_heads, per_kv, 1, head_dim)
            return attention_lib.online_softmax_update(init, s_KxMxT[:, :, None, :], v_TxKxH)

        def own(st, q_KxMxH, k_new_KxH, v_new_KxH):
            s_KxM = (
                jnp.einsum("kmh,kh->km", q_KxMxH, k_new_KxH, preferred_element_type=jnp.float32)
                * scale
            )
            st = attention_lib.online_softmax_update(st, s_KxM[:, :, None, None], v_new_KxH[None])
            return attention_lib.online_softmax_finish(st)[0][:, :, 0]

        st = jax.vmap(rows)(q_BxKxMxH, state.k, state.v, visible_BxT)
        st = merge_partials(st, merge_axes)
        out = jax.vmap(own)(st, q_BxKxMxH, k_BxKxH, v_BxKxH)
        return out.reshape(b, q_heads, head_dim).astype(q_BxQxH.dtype), KV(k_BxKxH, v_BxKxH)

    return attend


def write_rows(cache: Cache, new: KV, row_B, position_B) -> Cache:
    """cache with row row_B[b] of sequence b set to new [L, B, K, H] at position_B[b].

    Rows ≥ T are dropped, never wrapped: a finished sequence running on, or (layout
    "split") a rank that is not this step's writer.
    """
    b = jnp.arange(row_B.shape[0])
    k, v = (
        c.at[:, b, row_B].set(n.astype(c.dtype), mode="drop")
        for c, n in zip((cache.k, cache.v), new)
    )
    pos = cache.position.at[b, row_B].set(position_B.astype(jnp.int32), mode="drop")
    return cache._replace(k=k, v=v, position=pos)


def keep_recurrent(
    old: delta_rule.Recurrent, new: delta_rule.Recurrent, live_B
) -> delta_rule.Recurrent:
    """The recurrent state after a decode step: new [Ll, B, …] on live rows, old elsewhere
    (a finished or empty row keeps what it had)."""
    return jax.tree.map(
        lambda o, n: jnp.where(live_B.reshape((1, -1) + (1,) * (o.ndim - 2)), n, o), old, new
    )


def step_rows(count_B, base_B, layout: Layout, t_len: int):
    """Where this device writes each row's next cache row: int32 [B] (t_len = nowhere).

    Sequence b's decode rows start at base_B[b] on every rank of its row axes; its draw
    number count_B[b] goes to rank count mod n (n = size of the row axes, 1 for "batch"),
    row base + count // n — round robin, so every rank of a "split" cache gains the same
    number of rows.
    """
    if not layout.row_axes:
        return base_B + count_B
    n = jax.lax.axis_size(layout.row_axes)
    mine = jax.lax.axis_index(layout.row_axes) == count_B % n
    return jnp.where(mine, base_B + count_B // n, t_len)
