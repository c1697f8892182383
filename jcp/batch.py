"""Datums, their validation, packing into sharded [dp, cp, S] streams, and unpacking.

Owns everything between the client's per-datum vectors and the device streams. It runs on
the host in NumPy, before any device work; it must never modify the caller's arrays, and
every refusal is an `InputError` naming the datum and the field.

Shapes: see the legend in jcp/mesh.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from jcp import losses as losses_lib
from jcp import mesh as mesh_lib
from jcp.errors import InputError

FLOAT_FIELDS = losses_lib.FLOAT_INPUTS
KNOWN_FIELDS = ("target_tokens",) + FLOAT_FIELDS

__all__ = ["CheckedDatum", "Datum", "InputError", "PackedBatch", "pack", "unpack", "validate"]


@dataclasses.dataclass
class Datum:
    """One training example in Tinker's form.

    model_input: token ids [N]; loss_fn_inputs: "target_tokens" [N] and, by loss,
    "weights", "advantages", "logprobs" [N]. Position i of model_input predicts
    target_tokens[i]. Lists or NumPy arrays are accepted and never modified.
    """

    model_input: Sequence[int] | np.ndarray
    loss_fn_inputs: Mapping[str, Sequence[float] | np.ndarray]

    @classmethod
    def from_json(cls, obj: Mapping) -> "Datum":
        """From a Tinker-style JSON object {"model_input": [...], "loss_fn_inputs": {...}}."""
        mi = obj.get("model_input")
        if isinstance(mi, Mapping):  # Tinker's ModelInput: {"chunks": [{"tokens": [...]}]}
            mi = [t for ch in mi.get("chunks", []) for t in ch.get("tokens", [])]
        return cls(model_input=mi, loss_fn_inputs=dict(obj.get("loss_fn_inputs") or {}))


@dataclasses.dataclass(frozen=True)
class CheckedDatum:
    """A validated private copy of a Datum: tokens, targets int32 [N]; floats float32 [N];
    the name of its loss."""

    tokens: np.ndarray
    targets: np.ndarray
    floats: dict[str, np.ndarray]
    loss_fn: str = "cross_entropy"

    @property
    def n(self) -> int:
        return int(self.tokens.shape[0])


def _int_vector(i: int, field: str, value, vocab_size: int) -> np.ndarray:
    try:
        arr = np.array(value, copy=True)
    except Exception as e:  # ragged lists and the like
        raise InputError(f"datum {i}: {field} is not a vector of token ids ({e})") from None
    if arr.ndim != 1:
        raise InputError(f"datum {i}: {field} must be 1-D, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        if (arr.dtype == object or not np.issubdtype(arr.dtype, np.number)
                or np.issubdtype(arr.dtype, np.complexfloating)):
            raise InputError(f"datum {i}: {field} must hold integer token ids, got {arr.dtype}")
        if not np.all(np.isfinite(arr)) or np.any(arr != np.round(arr)):
            raise InputError(f"datum {i}: {field} must hold integer token ids")
    if arr.size:
        bad = np.flatnonzero((arr < 0) | (arr >= vocab_size))
        if bad.size:
            j = int(bad[0])
            raise InputError(
                f"datum {i}: {field}[{j}] = {arr[j]} is outside the vocabulary [0, {vocab_size})"
            )
    return arr.astype(np.int32)


def _float_vector(i: int, field: str, value, n: int) -> np.ndarray:
    """A float32 copy of a client vector, checked finite *in float32* (the device's dtype):
    1e39 passes as a float64 but is inf on the device, so it is refused here."""
    try:
        arr = np.array(value, copy=True)
        if arr.dtype.kind not in "biuf":
            raise TypeError(f"dtype {arr.dtype}")
        with np.errstate(over="ignore"):
            arr32 = arr.astype(np.float32)
    except Exception as e:
        raise InputError(f"datum {i}: {field} is not a vector of numbers ({e})") from None
    if arr32.ndim != 1:
        raise InputError(f"datum {i}: {field} must be 1-D, got shape {arr32.shape}")
    if arr32.shape[0] != n:
        raise InputError(
            f"datum {i}: {field} has length {arr32.shape[0]}, model_input has length {n}"
        )
    bad = np.flatnonzero(~np.isfinite(arr32))
    if bad.size:
        j = int(bad[0])
        what = "is not finite" if not np.isfinite(float(arr[j])) else "overflows float32"
        raise InputError(f"datum {i}: {field}[{j}] = {arr[j]} {what}")
    return arr32


def per_datum_losses(loss_fn, n: int) -> list[str]:
    """One loss name or one per datum -> a checked list of n names."""
    if isinstance(loss_fn, str):
        return [losses_lib.check_loss_fn(loss_fn)] * n
    if not isinstance(loss_fn, Sequence) or len(loss_fn) != n:
        raise InputError(f"loss_fn must be a loss name or one name per datum ({n}), got "
                         f"{loss_fn!r}")
    return [losses_lib.check_loss_fn(name, f"datum {i}") for i, name in enumerate(loss_fn)]


def validate(data: Sequence[Datum], loss_fn, vocab_size: int, token_cap: int
             ) -> list[CheckedDatum]:
    """Check every datum for its loss (`loss_fn`: one name, or one per datum); return
    private validated copies.

    Raises InputError naming the datum index and the field. Nothing is mutated.
    """
    if isinstance(loss_fn, str):
        losses_lib.check_loss_fn(loss_fn)
    if isinstance(data, (Datum, Mapping)) or not isinstance(data, Sequence):
        raise InputError("data must be a list of Datum")
    if len(data) == 0:
        raise InputError("data is empty: pass at least one Datum")
    names = per_datum_losses(loss_fn, len(data))
    out = []
    for i, d in enumerate(data):
        loss_fn = names[i]
        needed = ("target_tokens",) + losses_lib.LOSSES[loss_fn].inputs
        if not isinstance(d, Datum):
            raise InputError(f"datum {i}: expected jcp.Datum, got {type(d).__name__}")
        tokens = _int_vector(i, "model_input", d.model_input, vocab_size)
        n = tokens.shape[0]
        if n == 0:
            raise InputError(f"datum {i}: model_input is empty")
        if n > token_cap:
            raise InputError(
                f"datum {i}: model_input has {n} tokens, over the cap of {token_cap} tokens per "
                "datum (raise max_tokens_per_device or cp)"
            )
        inputs = d.loss_fn_inputs
        if not isinstance(inputs, Mapping):
            raise InputError(f"datum {i}: loss_fn_inputs must be a dict")
        for key in inputs:
            if key not in KNOWN_FIELDS:
                raise InputError(
                    f"datum {i}: loss_fn_inputs.{key} is not a known field; expected "
                    f"{list(KNOWN_FIELDS)}"
                )
        for key in needed:
            if key not in inputs:
                raise InputError(f"datum {i}: loss_fn_inputs.{key} is missing (needed by {loss_fn})")
        targets = _int_vector(i, "loss_fn_inputs.target_tokens", inputs["target_tokens"], vocab_size)
        if targets.shape[0] != n:
            raise InputError(
                f"datum {i}: loss_fn_inputs.target_tokens has length {targets.shape[0]}, "
                f"model_input has length {n}"
            )
        floats = {k: _float_vector(i, f"loss_fn_inputs.{k}", inputs[k], n)
                  for k in FLOAT_FIELDS if k in inputs}
        out.append(CheckedDatum(tokens, targets, floats, loss_fn))
    return out


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

    segment: datum slot in 0..B-1 (−1 = padding); position: index within the datum;
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
    placements: tuple[Placement, ...]
    loss_fns: tuple[str, ...] = ("cross_entropy",)


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


def pack(datums: Sequence[CheckedDatum], adapters: Sequence[int], dp: int, cp: int,
         max_rows: int, max_adapters: int) -> list[PackedBatch]:
    """Pack validated datums into micro-batches of [DP, CP, S] streams.

    Datums are spread over dp by token count (longest first onto the lightest shard),
    sorted by adapter within a shard so adapters form contiguous spans, and zigzag-cut
    over cp. S is bucketed (see mesh.bucket_length) and never exceeds max_rows.
    """
    rows = [2 * mesh_lib.zigzag_chunk(d.n, cp) for d in datums]
    loss_fns = tuple(sorted({d.loss_fn for d in datums}))
    out = []
    for shards in _assign(rows, dp, max_rows):
        need = max(sum(rows[j] for j in shard) for shard in shards)
        s_len = mesh_lib.bucket_length(need, maximum=max_rows)
        members = sorted(j for shard in shards for j in shard)
        active_list = sorted({int(adapters[j]) for j in members})
        k = active_bucket(len(active_list), max_adapters)
        active = np.array(active_list + [active_list[0]] * (k - len(active_list)), np.int32)
        where = {a: i for i, a in enumerate(active_list)}
        slot_of = {j: b for b, j in enumerate(members)}
        num_slots = mesh_lib.bucket_length(len(members), minimum=8)

        tokens = np.zeros((dp, cp, s_len), np.int32)
        targets = np.zeros((dp, cp, s_len), np.int32)
        segment = np.full((dp, cp, s_len), -1, np.int32)
        position = np.zeros((dp, cp, s_len), np.int32)
        loss_id = np.zeros((dp, cp, s_len), np.int32)
        floats = {k_: np.zeros((dp, cp, s_len), np.float32) for k_ in FLOAT_FIELDS}
        spans = np.zeros((dp, cp, k, 2), np.int32)
        placements = []
        for s, shard in enumerate(shards):
            off = 0
            for j in sorted(shard, key=lambda j: (int(adapters[j]), j)):
                d = datums[j]
                idx = mesh_lib.zigzag_indices(d.n, cp)  # [cp, 2C]
                valid = idx >= 0
                safe = np.where(valid, idx, 0)
                sl = slice(off, off + rows[j])
                tokens[s, :, sl] = np.where(valid, d.tokens[safe], 0)
                targets[s, :, sl] = np.where(valid, d.targets[safe], 0)
                segment[s, :, sl] = np.where(valid, slot_of[j], -1)
                position[s, :, sl] = np.where(valid, idx, 0)
                loss_id[s, :, sl] = loss_fns.index(d.loss_fn)
                for name, vec in d.floats.items():
                    floats[name][s, :, sl] = np.where(valid, vec[safe], 0.0)
                a = where[int(adapters[j])]
                if spans[s, 0, a, 1] == 0:
                    spans[s, :, a, 0] = off
                spans[s, :, a, 1] = off + rows[j]
                placements.append(Placement(j, s, off, d.n, rows[j]))
                off += rows[j]
        out.append(PackedBatch(tokens, targets, segment, position, loss_id, floats, spans,
                               active, num_slots, tuple(placements), loss_fns))
    return out


def pad_streams(pb: PackedBatch, s_len: int) -> PackedBatch:
    """pb with every [DP, CP, S] stream (tokens, targets, segment, position, loss_id and the
    client vectors) right-padded to s_len rows of padding (segment −1); pb itself when it
    is already that long."""
    pad = s_len - pb.tokens.shape[-1]
    if pad < 0:
        raise ValueError(f"cannot pad streams of {pb.tokens.shape[-1]} rows to {s_len}")
    if pad == 0:
        return pb

    def grow(x, value=0):
        return np.pad(x, ((0, 0), (0, 0), (0, pad)), constant_values=value)

    return dataclasses.replace(
        pb, tokens=grow(pb.tokens), targets=grow(pb.targets), segment=grow(pb.segment, -1),
        position=grow(pb.position), loss_id=grow(pb.loss_id),
        floats={k: grow(v) for k, v in pb.floats.items()})


def unpack(stream_DPxCPxS: np.ndarray, batch: PackedBatch) -> dict[int, np.ndarray]:
    """Per-token stream values -> {caller's datum index: vector [N] in original order}."""
    out = {}
    for p in batch.placements:
        local = stream_DPxCPxS[p.shard, :, p.offset:p.offset + p.rows]
        out[p.index] = mesh_lib.unzigzag(local, p.n)
    return out
