"""The host-side layout of a sampling call: pure NumPy, no devices.

Owns the choice of cache layout and its size (Plan), which decode row each sequence gets,
which cache row holds which prompt position, where each packed prefill token goes in the
cache, and the per-row vectors the decode program reads. Everything here is a pure
function of the call's lengths, adapters and the mesh's sizes, tested with NumPy alone
(tests/sample/test_sample_layout.py). It must never create or read a device array.

Shapes: B = decode rows of the whole call (b_local per device along the layout's sequence
axes), T = cache rows per sequence over the whole call (t_local per device; CP·t_local
under "split").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jcp.errors import InputError
from jcp.mesh import pow2_at_least, zigzag_chunk, zigzag_indices

CACHE_MODES = ("batch", "split")
# Auto choice: the cp-split cache when the per-device cache of mode "batch" would exceed
# this and splitting makes it smaller. Below it, "batch" decodes faster (no collective per
# layer and step, no work repeated over cp).
SPLIT_ABOVE_BYTES = 1 << 30


def ladder(n: int, full: int, floor: int, step: int = 4) -> int:
    """The least rung ≥ n of full, max(floor, ⌈full / step⌉), max(floor, ⌈full / step²⌉),
    … (n ≤ full). Few rungs keep the number of compiled programs small: e.g. full 512,
    floor 8 → 512, 128, 32, 8."""
    b = full
    while b > floor:
        nxt = max(floor, -(-b // step))
        if nxt < n:
            break
        b = nxt
    return b


def choose_cache_mode(requested: str | None, cp: int, batch_bytes: int, split_bytes: int) -> str:
    """The cache layout of a call: `requested` when given; else "split" iff cp > 1, the
    per-device cache of "batch" exceeds SPLIT_ABOVE_BYTES and "split"'s is smaller."""
    if requested is not None:
        return requested
    if cp > 1 and batch_bytes > SPLIT_ABOVE_BYTES and split_bytes < batch_bytes:
        return "split"
    return "batch"


@dataclasses.dataclass(frozen=True)
class Plan:
    """The cache layout of one sample call, decided on the host before any device work.

    mode: "batch" | "split" (kv_cache.LAYOUTS); b_local: sequences per device along the
    layout's sequence axes; t_local: cache rows per sequence per device (a sequence has
    t_local rows under "batch", CP·t_local under "split"); out_len: bucketed max_tokens;
    batch_bytes / split_bytes: per-device cache bytes (K, V and row positions) of either
    layout, the figures choose_cache_mode compared.
    """

    mode: str
    b_local: int
    t_local: int
    out_len: int
    batch_bytes: int
    split_bytes: int

    @property
    def cache_bytes(self) -> int:
        return self.batch_bytes if self.mode == "batch" else self.split_bytes


def kv_row_bytes(num_layers: int, kv_heads_local: int, head_dim: int, itemsize: int) -> int:
    """Bytes of one cache row on one device: K and V of every layer plus its position."""
    return 2 * num_layers * kv_heads_local * head_dim * itemsize + 4


def plan(
    prompt_lengths: Sequence[int],
    max_tokens: int,
    num_samples: int,
    dp: int,
    cp: int,
    row_bytes: int,
    cache_mode: str | None = None,
) -> Plan:
    """The cache layout a call with these prompt lengths would use.

    "batch": b_local = pow2(⌈sequences / (dp·cp)⌉), t_local = pow2(longest − 1 +
    max_tokens, ≥ 64). "split": b_local = pow2(⌈sequences / dp⌉), t_local = pow2(2C +
    ⌈max_tokens / cp⌉, ≥ 16) with 2C the zigzag rows per rank of the longest prompt's
    prefill; pow2 = mesh.pow2_at_least. cache_mode None: choose_cache_mode.
    """
    if cache_mode is not None and cache_mode not in CACHE_MODES:
        raise InputError(
            f'cache_mode must be None (automatic), "batch" or "split", got {cache_mode!r}'
        )
    n_seq = len(prompt_lengths) * num_samples
    longest = max(prompt_lengths)
    b_batch = pow2_at_least(-(-n_seq // (dp * cp)))
    t_batch = pow2_at_least(longest - 1 + max_tokens, 64)
    b_split = pow2_at_least(-(-n_seq // dp))
    t_split = pow2_at_least(2 * zigzag_chunk(max(longest - 1, 1), cp) + -(-max_tokens // cp), 16)
    batch_bytes = b_batch * t_batch * row_bytes
    split_bytes = b_split * t_split * row_bytes
    mode = choose_cache_mode(cache_mode, cp, batch_bytes, split_bytes)
    b_local, t_local = (b_batch, t_batch) if mode == "batch" else (b_split, t_split)
    return Plan(mode, b_local, t_local, pow2_at_least(max_tokens, 16), batch_bytes, split_bytes)


@dataclasses.dataclass(frozen=True)
class CallLayout:
    """Where a call's sequences live.

    row_of int [prompts, num_samples]: the decode row of sample j of prompt i;
    row_position int32 [B, T]: the true position each cache row holds after prefill (−1
    empty); base int32 [B]: a row's first decode cache row; adapter int64 [B]: a row's
    adapter slot (BASE for none; padding rows int32 min); n_groups: devices along the
    sequence axes; b_local, t_local: as in Plan.
    """

    row_of: np.ndarray
    row_position: np.ndarray
    base: np.ndarray
    adapter: np.ndarray
    n_groups: int
    b_local: int
    t_local: int
    split: bool

    @property
    def shape(self) -> tuple[int, int]:
        return self.row_position.shape


PADDING = np.iinfo(np.int32).min  # adapter key of a decode row that holds no sequence


def call_layout(
    prompt_lengths: Sequence[int],
    adapters: Sequence[int],
    num_samples: int,
    p: Plan,
    dp: int,
    cp: int,
) -> CallLayout:
    """Decode rows and prefilled cache rows of a call.

    Sequences are sorted by (adapter, prompt, sample) and dealt round robin over the
    devices along the sequence axes (dp·cp for "batch", dp for "split"). "batch": cache
    row t of a sequence holds position t of its prompt's prefill (prompt[:-1]); "split":
    rank r's first 2C rows hold its zigzag chunks of the prefill. Example ("batch", dp·cp
    = 2, b_local = 2, prompts of lengths 3 and 2 with adapters 1 and 0, one sample each):
    sorted [(0, prompt 1), (1, prompt 0)] → rows [2, 0] (prompt 0 on device 1, row 2),
    row_position[2] = [0, 1, -1, …], base = [1, 0, 2, 0].
    """
    split = p.mode == "split"
    n_groups = dp if split else dp * cp
    b_total = p.b_local * n_groups
    t_total = p.t_local * (cp if split else 1)
    n_prompts = len(prompt_lengths)
    seqs = sorted((adapters[i], i, j) for i in range(n_prompts) for j in range(num_samples))
    row_of = np.zeros((n_prompts, num_samples), np.int64)
    adapter = np.full(b_total, PADDING, np.int64)
    for k, (a, i, j) in enumerate(seqs):
        row_of[i, j] = (k % n_groups) * p.b_local + k // n_groups
        adapter[row_of[i, j]] = a
    row_position = np.full((b_total, t_total), -1, np.int32)
    base = np.zeros(b_total, np.int32)
    for i, length in enumerate(prompt_lengths):
        n = length - 1
        rows = row_of[i]
        if n == 0:
            continue
        if split:
            idx = zigzag_indices(n, cp)  # [cp, 2C]
            cols = np.arange(cp)[:, None] * p.t_local + np.arange(idx.shape[1])
            row_position[np.ix_(rows, cols.reshape(-1))] = idx.reshape(-1)
            base[rows] = idx.shape[1]
        else:
            row_position[rows, :n] = np.arange(n)
            base[rows] = n
    return CallLayout(row_of, row_position, base, adapter, n_groups, p.b_local, p.t_local, split)


def prefill_source(lay: CallLayout, placements, prompt_of, s_len: int, cp: int) -> np.ndarray:
    """int32 [B, T]: the flat prefill stream row each cache row takes from one packed
    micro-batch (−1: none), for kv_cache.fill.

    placements: the micro-batch's batch.Placement list (index = prefill datum, shard,
    offset, n); prompt_of[index] = the call's prompt index of that datum. Flat rows are
    device-major over the layout's sequence axes: "batch" d·CP + r for dp shard d and cp
    rank r, "split" d (each cp rank gathers only its own cp slice, so the column is
    r·t_local + q on rank r).
    """
    source = np.full(lay.shape, -1, np.int32)
    for pl in placements:
        rows = lay.row_of[prompt_of[pl.index]]
        idx = zigzag_indices(pl.n, cp)  # [cp, 2C] positions
        r, q = np.nonzero(idx >= 0)
        if lay.split:
            source[np.ix_(rows, r * lay.t_local + q)] = pl.shard * s_len + pl.offset + q
        else:
            source[np.ix_(rows, idx[r, q])] = (pl.shard * cp + r) * s_len + pl.offset + q
    return source


def active_index(
    adapter_B: np.ndarray, bucket: int, base_key: int
) -> tuple[np.ndarray, np.ndarray]:
    """(active int32 [bucket]: the distinct adapters of the rows, sorted, padded with
    base_key; index int32 [B]: each row's index into active — padding rows (PADDING)
    point at a base_key entry when there is one, else at entry 0, and decode nothing)."""
    used = sorted({int(a) for a in adapter_B if a != PADDING})
    if len(used) > bucket:
        raise ValueError(f"{len(used)} adapters exceed the active bucket of {bucket}")
    active = np.array(used + [base_key] * (bucket - len(used)), np.int32)
    pad_at = int(np.flatnonzero(active == base_key)[0]) if base_key in active else 0
    where = {a: k for k, a in enumerate(used)}
    index = np.array([where.get(int(a), pad_at) for a in adapter_B], np.int32)
    return active, index


def stop_table(stops: Sequence[Sequence[int]], minimum: int = 8) -> np.ndarray:
    """int32 [B, NS]: each row's stop ids, −1 padded, NS = pow2_at_least(longest, minimum)."""
    width = pow2_at_least(max((len(s) for s in stops), default=0), minimum)
    out = np.full((len(stops), width), -1, np.int32)
    for b, s in enumerate(stops):
        out[b, : len(s)] = s
    return out


def stream_pieces(segment: np.ndarray, position: np.ndarray) -> tuple[np.ndarray, int]:
    """(piece index of every token [..., S], pieces bound P): NumPy's copy of
    delta_rule.pieces' numbering (a piece starts at a stream's first token, a new datum or
    a jump in position; padding continues the piece before it). P: the most pieces of any
    stream, as a power of two (the prefill program's static bound)."""
    real = segment >= 0
    lead = segment.shape[:-1]
    prev_seg = np.concatenate([np.full(lead + (1,), -2), segment[..., :-1]], axis=-1)
    prev_pos = np.concatenate([np.full(lead + (1,), -2), position[..., :-1]], axis=-1)
    start = real & ((segment != prev_seg) | (position != prev_pos + 1))
    start[..., 0] = True
    piece = np.cumsum(start, axis=-1) - 1
    return piece.astype(np.int32), pow2_at_least(int(piece.max()) + 1)


def recurrent_source(
    row_of, placements, prompt_of, piece: np.ndarray, pieces: int, n_rows: int, cp: int
) -> np.ndarray:
    """int32 [B]: the flat prefill piece whose final recurrent state each decode row takes
    (−1: none), for kv_cache.fill_recurrent — its prompt's last prefill token's piece, on
    the device holding that token (flat row (d·CP + r)·P + p over (dp, cp), whatever the
    cache layout). row_of[i]: the decode rows of prompt i; placements, prompt_of as in
    prefill_source; piece: stream_pieces' numbering [DP, CP, S]."""
    source = np.full(n_rows, -1, np.int32)
    for pl in placements:
        idx = zigzag_indices(pl.n, cp)  # [cp, 2C] positions
        (r,), (q,) = np.nonzero(idx == pl.n - 1)
        p = piece[pl.shard, r, pl.offset + q]
        source[np.asarray(row_of[prompt_of[pl.index]])] = (pl.shard * cp + r) * pieces + p
    return source
