"""Packing validated datums into sharded [dp, cp, S] streams, and unpacking.

Owns everything between the checked per-datum vectors (jcp.datum: `Datum`, `validate`,
re-exported here) and the device streams. It runs on the host in NumPy, before any device
work; it must never modify the caller's arrays, and every refusal is an `InputError`
naming the datum and the field.

Shapes: see the legend in jcp/mesh.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jcp import losses as losses_lib
from jcp import mesh as mesh_lib
from jcp.datum import (
    FLOAT_FIELDS,
    KNOWN_FIELDS,
    CheckedDatum,
    Datum,
    per_datum_losses,
    validate,
)
from jcp.errors import InputError

__all__ = [
    "FLOAT_FIELDS",
    "KNOWN_FIELDS",
    "CheckedDatum",
    "Datum",
    "InputError",
    "PackedBatch",
    "pack",
    "per_datum_losses",
    "unpack",
    "validate",
]


# ----------------------------------------------------------------------------------------
# Packing


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where one datum of a micro-batch lives: dp shard, row offset in every cp stream."""

    index: int  # position in the caller's list
    shard: int
    offset: int
    n: int
    rows: int  # 2C rows on every cp rank


@dataclasses.dataclass(frozen=True)
class PackedBatch:
    """One micro-batch as host arrays in the global [DP, CP, S] layout.

    segment: datum slot in 0..B-1 (−1 = padding), numbered in stream order (slot_datums);
    position: index within the datum;
    loss_id: index of each token's loss in `loss_fns` (sorted names of the whole call);
    floats: weights / advantages / logprobs already cut to each rank's zigzag shard;
    spans: [DP, CP, K, 2] row range of each active adapter; active: [K] adapter slots.
    """

    tokens: np.ndarray
    targets: np.ndarray
    segment: np.ndarray
    position: np.ndarray
    loss_id: np.ndarray
    floats: dict[str, np.ndarray]
    spans: np.ndarray
    active: np.ndarray
    num_slots: int
    placements: tuple[Placement, ...]  # in stream order: datum slot b is placements[b]
    loss_fns: tuple[str, ...] = ("cross_entropy",)
    # Custom-loss datums: (caller's index, flat index [N] or [N, K] of its log-probs in
    # the [DP, CP, S(, K)] log-prob stream, its inputs in the loss's order).
    custom: tuple[tuple[int, np.ndarray, tuple[np.ndarray, ...]], ...] = ()

    @property
    def slot_datums(self) -> tuple[int, ...]:
        """The caller's index of the datum in each datum slot (segment id) 0, 1, …"""
        return tuple(p.index for p in self.placements)


def _assign(lengths_rows: list[int], dp: int, capacity: int) -> list[list[list[int]]]:
    """Greedy longest-first assignment of datums to (micro-batch, dp shard), balanced by rows.

    Each shard's stream holds at most `capacity` rows; a datum that fits nowhere opens a new
    micro-batch. Returns micro-batches -> shards -> datum indices.
    """
    order = sorted(range(len(lengths_rows)), key=lambda j: (-lengths_rows[j], j))
    batches: list[list[list[int]]] = []
    loads: list[list[int]] = []
    for j in order:
        r = lengths_rows[j]
        placed = False
        for b, shard_loads in enumerate(loads):
            s = int(np.argmin(shard_loads))
            if shard_loads[s] + r <= capacity:
                batches[b][s].append(j)
                shard_loads[s] += r
                placed = True
                break
        if not placed:
            batches.append([[] for _ in range(dp)])
            loads.append([0] * dp)
            batches[-1][0].append(j)
            loads[-1][0] += r
    return batches


def active_bucket(k: int, max_adapters: int) -> int:
    """Static number of active-adapter entries: next power of two ≥ k, at most max_adapters."""
    return max(k, min(mesh_lib.pow2_at_least(k), max_adapters))


# A training pass's compiled program is specialised on its stream length S and on its
# counts of active-adapter entries (A) and datum slots (B). With floors (Trainer: pack's
# adapter_rows and slot_tokens) A and B follow S wherever the batch fits them, so every
# grouping of tenants into a fused pass of one S bucket runs one program, and a warm-up
# compiles one program per S bucket (Trainer.warmup). ADAPTER_ROWS: an active entry per
# 256 rows (entries without rows cost the grouped LoRA products nothing; lora.tile_rows
# sizes their tiles by the entry count: 256 rows at S = 4096; up to
# lora.DENSE_MAX_ADAPTERS entries the products run dense, and an empty entry costs R
# columns); a stream shorter than 512 rows keeps one entry (with a second entry the tiny
# model's forward_backward took 1.6× the CPU seconds to compile);
# SLOT_TOKENS: room for datums of ≥ 128 tokens on average. A batch with more adapters or
# datums than that takes the next bucket up (a program of its own).
ADAPTER_ROWS = 256
SLOT_TOKENS = 128


def static_counts(
    s_len: int,
    dp: int,
    cp: int,
    n_active: int,
    n_datums: int,
    max_adapters: int,
    adapter_rows: int | None = None,
    slot_tokens: int | None = None,
) -> tuple[int, int]:
    """(A, B) of a micro-batch of S = s_len rows per device: its active-adapter entries
    (active_bucket, at least the power of two ≥ ⌊S / adapter_rows⌋, capped at
    max_adapters: a power of two, as active_bucket's are, so that a length's warm-up
    program serves every count up to its floor) and datum slots (mesh.bucket_length ≥ 8,
    at least the bucket of dp·cp·S / slot_tokens). None: no floor. E.g. dp = cp = 2, floors
    256 / 128: S = 1024 -> (A, B) = (4, 32) for 1 to 4 adapters and 1 to 32 datums; S =
    768 -> A = 4 (3 adapters take active_bucket's 4, not a floor of 2)."""
    a = active_bucket(n_active, max_adapters)
    if adapter_rows:
        a = max(a, min(max_adapters, mesh_lib.pow2_at_least(max(1, s_len // adapter_rows))))
    b = mesh_lib.bucket_length(n_datums, minimum=8)
    if slot_tokens:
        b = max(b, mesh_lib.bucket_length(dp * cp * s_len // slot_tokens, minimum=8))
    return a, b


def pack(
    datums: Sequence[CheckedDatum],
    adapters: Sequence[int],
    dp: int,
    cp: int,
    max_rows: int,
    max_adapters: int,
    *,
    adapter_rows: int | None = None,
    slot_tokens: int | None = None,
) -> list[PackedBatch]:
    """Pack validated datums into micro-batches of [DP, CP, S] streams.

    Datums are spread over dp by token count (longest first onto the lightest shard),
    sorted by adapter within a shard so adapters form contiguous spans, and zigzag-cut
    over cp. S is bucketed (see mesh.bucket_length) and never exceeds max_rows; the
    counts of active entries and datum slots are static_counts' (adapter_rows and
    slot_tokens: their floors by S, None: none).
    With any 2-D target_tokens, targets and weights are [DP, CP, S, K] (K the widest in
    the micro-batch; −1 targets and 0 weights pad, a 1-D datum in column 0).
    """
    rows = [2 * mesh_lib.zigzag_chunk(d.n, cp) for d in datums]
    loss_fns = tuple(sorted({d.loss_fn for d in datums}))
    _check_two_d(datums, loss_fns)
    out = []
    for shards in _assign(rows, dp, max_rows):
        need = max(sum(rows[j] for j in shard) for shard in shards)
        s_len = mesh_lib.bucket_length(need, maximum=max_rows)
        members = sorted(j for shard in shards for j in shard)
        active_list = sorted({int(adapters[j]) for j in members})
        k, num_slots = static_counts(
            s_len, dp, cp, len(active_list), len(members), max_adapters, adapter_rows, slot_tokens
        )
        active = np.array(active_list + [active_list[0]] * (k - len(active_list)), np.int32)
        where = {a: i for i, a in enumerate(active_list)}
        widths = [datums[j].targets.shape[1] for j in members if datums[j].targets.ndim == 2]
        st = _Streams.empty(dp, cp, s_len, (max(widths),) if widths else (), k)
        placements = []
        custom = []
        for s, shard in enumerate(shards):
            off = 0
            for j in sorted(shard, key=lambda j: (int(adapters[j]), j)):
                d = datums[j]
                # Datum slots (segment ids) in stream order, so that they ascend along
                # every stream: attention skips blocks by their segment ranges
                # (attention.tiling.blocks_needed), which out-of-order ids would widen.
                idx, valid = st.place(d, s, off, loss_fns.index(d.loss_fn), len(placements))
                if d.loss_fn == losses_lib.CUSTOM:
                    flat = _stream_index(idx, valid, s, off, cp, s_len, st.kk, d.targets)
                    custom.append((j, flat, tuple(d.extra.values())))
                a = where[int(adapters[j])]
                if st.spans[s, 0, a, 1] == 0:
                    st.spans[s, :, a, 0] = off
                st.spans[s, :, a, 1] = off + rows[j]
                placements.append(Placement(j, s, off, d.n, rows[j]))
                off += rows[j]
        out.append(
            PackedBatch(
                st.tokens,
                st.targets,
                st.segment,
                st.position,
                st.loss_id,
                st.floats,
                st.spans,
                active,
                num_slots,
                tuple(placements),
                loss_fns,
                tuple(sorted(custom, key=lambda c: c[0])),
            )
        )
    return out


def _check_two_d(datums: Sequence[CheckedDatum], loss_fns: tuple[str, ...]) -> None:
    """2-D target_tokens only where every loss of the call takes them."""
    if any(d.targets.ndim == 2 for d in datums) and not set(loss_fns) <= {
        "cross_entropy",
        losses_lib.CUSTOM,
    }:
        j = next(j for j, d in enumerate(datums) if d.targets.ndim == 2)
        raise InputError(
            f"datum {j}: 2-D target_tokens are for cross_entropy and custom "
            f"losses; this call also has {sorted(loss_fns)}"
        )


@dataclasses.dataclass
class _Streams:
    """One micro-batch's host arrays while pack fills them: [DP, CP, S] streams (targets
    and weights [DP, CP, S, K] where kk = (K,): some datum has 2-D targets), spans
    [DP, CP, k, 2]."""

    kk: tuple
    tokens: np.ndarray
    targets: np.ndarray
    segment: np.ndarray
    position: np.ndarray
    loss_id: np.ndarray
    floats: dict[str, np.ndarray]
    spans: np.ndarray

    @classmethod
    def empty(cls, dp: int, cp: int, s_len: int, kk: tuple, k: int) -> _Streams:
        shape = (dp, cp, s_len)
        return cls(
            kk=kk,
            tokens=np.zeros(shape, np.int32),
            targets=np.full(shape + kk, -1 if kk else 0, np.int32),
            segment=np.full(shape, -1, np.int32),
            position=np.zeros(shape, np.int32),
            loss_id=np.zeros(shape, np.int32),
            floats={
                f: np.zeros(shape + (kk if f == "weights" else ()), np.float32)
                for f in FLOAT_FIELDS
            },
            spans=np.zeros((dp, cp, k, 2), np.int32),
        )

    def place(self, d: CheckedDatum, s: int, off: int, loss_index: int, slot: int):
        """Write datum d zigzag-cut over cp at rows off.. of shard s's streams, as datum
        slot `slot` -> (its zigzag indices [CP, 2C] (−1 = padding), their validity)."""
        kk = self.kk
        idx = mesh_lib.zigzag_indices(d.n, self.tokens.shape[1])  # [cp, 2C]
        valid = idx >= 0
        safe = np.where(valid, idx, 0)
        sl = slice(off, off + idx.shape[1])
        self.tokens[s, :, sl] = np.where(valid, d.tokens[safe], 0)
        tgt = d.targets if d.targets.ndim == len(kk) + 1 else d.targets[:, None]
        cut = np.where(valid[(...,) + (None,) * len(kk)], tgt[safe], 0)
        if kk:
            self.targets[s, :, sl, : cut.shape[-1]] = cut
        else:
            self.targets[s, :, sl] = cut
        self.segment[s, :, sl] = np.where(valid, slot, -1)
        self.position[s, :, sl] = np.where(valid, idx, 0)
        self.loss_id[s, :, sl] = loss_index
        for name, vec in d.floats.items():
            if name == "weights" and kk:
                vec = vec if vec.ndim == 2 else vec[:, None]
                self.floats[name][s, :, sl, : vec.shape[1]] = np.where(
                    valid[..., None], vec[safe], 0.0
                )
            else:
                self.floats[name][s, :, sl] = np.where(valid, vec[safe], 0.0)
        return idx, valid


def _stream_index(
    idx_CPx2C, valid, shard: int, offset: int, cp: int, s_len: int, kk: tuple, targets: np.ndarray
) -> np.ndarray:
    """Where a datum's log-probs lie in the flattened [DP, CP, S(, K)] stream: int32 [N]
    (1-D targets) or [N, K_d] (2-D), in original token order."""
    rows = np.arange(idx_CPx2C.shape[1])[None, :] + offset
    flat = (shard * cp + np.arange(cp)[:, None]) * s_len + rows  # [cp, 2C] stream rows
    pos = np.empty(targets.shape[0], np.int64)
    pos[idx_CPx2C[valid]] = flat[valid]
    if not kk:
        return pos.astype(np.int32)
    width = kk[0]
    if targets.ndim == 1:
        return (pos * width).astype(np.int32)
    return (pos[:, None] * width + np.arange(targets.shape[1])[None, :]).astype(np.int32)


def pad_streams(pb: PackedBatch, s_len: int) -> PackedBatch:
    """pb with every [DP, CP, S] stream (tokens, targets, segment, position, loss_id and the
    client vectors) right-padded to s_len rows of padding (segment −1); pb itself when it
    is already that long."""
    pad = s_len - pb.tokens.shape[-1]
    if pad < 0:
        raise ValueError(f"cannot pad streams of {pb.tokens.shape[-1]} rows to {s_len}")
    if pad == 0:
        return pb
    if pb.custom:  # its stream indices are positions in the unpadded streams
        raise ValueError("pad_streams: a batch with custom-loss datums cannot be re-padded")

    def grow(x, value=0):  # [DP, CP, S] or [DP, CP, S, K] (2-D targets and weights)
        return np.pad(
            x,
            ((0, 0), (0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 3),
            constant_values=-1 if x is pb.targets and x.ndim == 4 else value,
        )

    return dataclasses.replace(
        pb,
        tokens=grow(pb.tokens),
        targets=grow(pb.targets),
        segment=grow(pb.segment, -1),
        position=grow(pb.position),
        loss_id=grow(pb.loss_id),
        floats={k: grow(v) for k, v in pb.floats.items()},
    )


def unpack(stream_DPxCPxS: np.ndarray, batch: PackedBatch) -> dict[int, np.ndarray]:
    """Per-token stream values -> {caller's datum index: vector [N] (or [N, K] for a
    [DP, CP, S, K] stream) in original order}."""
    out = {}
    for p in batch.placements:
        local = stream_DPxCPxS[p.shard, :, p.offset : p.offset + p.rows]
        out[p.index] = mesh_lib.unzigzag(local, p.n)
    return out
