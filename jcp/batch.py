"""Datums, their validation, packing into sharded [dp, cp, S] streams, and unpacking.

Owns everything between the client's per-datum vectors and the device streams. It runs on
the host in NumPy, before any device work; it must never modify the caller's arrays, and
every refusal is an `InputError` naming the datum and the field.

Shapes: see the legend in jcp/mesh.py.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence

import numpy as np

from jcp import losses as losses_lib
from jcp import mesh as mesh_lib
from jcp.custom_loss import CHECK_BUDGET_S, MAX_TRACED_OPS, CustomLoss
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
    def from_json(cls, obj: Mapping) -> Datum:
        """From a Tinker-style JSON object {"model_input": [...], "loss_fn_inputs": {...}}."""
        mi = obj.get("model_input")
        if isinstance(mi, Mapping):  # Tinker's ModelInput: {"chunks": [{"tokens": [...]}]}
            mi = [t for ch in mi.get("chunks", []) for t in ch.get("tokens", [])]
        return cls(model_input=mi, loss_fn_inputs=dict(obj.get("loss_fn_inputs") or {}))


@dataclasses.dataclass(frozen=True)
class CheckedDatum:
    """A validated private copy of a Datum: tokens int32 [N]; targets int32 [N], or [N, K]
    (cross_entropy and custom losses; −1 pads); floats float32 [N] (weights [N, K] with
    2-D targets); the name of its loss; extra: a custom loss's inputs (float32 or int32 at
    their declared ranks), by name."""

    tokens: np.ndarray
    targets: np.ndarray
    floats: dict[str, np.ndarray]
    loss_fn: str = "cross_entropy"
    extra: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)

    @property
    def n(self) -> int:
        return int(self.tokens.shape[0])


def _int_vector(i: int, field: str, value, vocab_size: int, two_d: bool = False) -> np.ndarray:
    """Token ids [N]; with two_d also [N, K] (K ≥ 1), where −1 marks a padding target."""
    try:
        arr = np.array(value, copy=True)
    except Exception as e:  # ragged lists and the like
        raise InputError(f"datum {i}: {field} is not a vector of token ids ({e})") from None
    if arr.ndim != 1 and not (two_d and arr.ndim == 2 and arr.shape[1] >= 1):
        raise InputError(
            f"datum {i}: {field} must be 1-D"
            + (" or 2-D [N, K]" if two_d else "")
            + f", got shape {arr.shape}"
        )
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        if (
            arr.dtype == object
            or not np.issubdtype(arr.dtype, np.number)
            or np.issubdtype(arr.dtype, np.complexfloating)
        ):
            raise InputError(f"datum {i}: {field} must hold integer token ids, got {arr.dtype}")
        if not np.all(np.isfinite(arr)) or np.any(arr != np.round(arr)):
            raise InputError(f"datum {i}: {field} must hold integer token ids")
    if arr.size:
        low = -1 if arr.ndim == 2 else 0
        bad = np.argwhere((arr < low) | (arr >= vocab_size))
        if bad.size:
            j = tuple(int(x) for x in bad[0])
            where = ", ".join(map(str, j))
            raise InputError(
                f"datum {i}: {field}[{where}] = {arr[j]} is outside the vocabulary "
                f"[0, {vocab_size})" + (" (−1 pads)" if low < 0 else "")
            )
    return arr.astype(np.int32)


def _float_vector(i: int, field: str, value, n: int, shape=None) -> np.ndarray:
    """A float32 copy of a client vector, checked finite *in float32* (the device's dtype):
    1e39 passes as a float64 but is inf on the device, so it is refused here. shape: the
    exact shape wanted instead of [n]."""
    try:
        arr = np.array(value, copy=True)
        if arr.dtype.kind not in "biuf":
            raise TypeError(f"dtype {arr.dtype}")
        with np.errstate(over="ignore"):
            arr32 = arr.astype(np.float32)
    except Exception as e:
        raise InputError(f"datum {i}: {field} is not a vector of numbers ({e})") from None
    if shape is not None:
        if arr32.shape != tuple(shape):
            raise InputError(
                f"datum {i}: {field} has shape {list(arr32.shape)}, expected "
                f"{list(shape)} (the shape of target_tokens)"
            )
    elif arr32.ndim != 1:
        raise InputError(f"datum {i}: {field} must be 1-D, got shape {arr32.shape}")
    elif arr32.shape[0] != n:
        raise InputError(
            f"datum {i}: {field} has length {arr32.shape[0]}, model_input has length {n}"
        )
    bad = np.argwhere(~np.isfinite(arr32))
    if bad.size:
        j = tuple(int(x) for x in bad[0]) if arr32.ndim > 1 else int(bad[0][0])
        what = "is not finite" if not np.isfinite(float(arr[j])) else "overflows float32"
        raise InputError(f"datum {i}: {field}[{j}] = {arr[j]} {what}")
    return arr32


def _custom_input(i: int, name: str, value) -> np.ndarray:
    """A custom loss input: a float32 (finite in float32) or int32 copy, any shape."""
    field = f"loss_fn_inputs.{name}"
    try:
        arr = np.array(value, copy=True)
    except Exception as e:
        raise InputError(f"datum {i}: {field} is not an array of numbers ({e})") from None
    if arr.dtype.kind in "iu":
        if arr.size and (arr.min() < np.iinfo(np.int32).min or arr.max() > np.iinfo(np.int32).max):
            raise InputError(f"datum {i}: {field} overflows int32")
        return arr.astype(np.int32)
    if arr.dtype.kind not in "bf":
        raise InputError(f"datum {i}: {field} must hold numbers, got {arr.dtype}")
    if arr.ndim > 2:
        raise InputError(f"datum {i}: {field} has rank {arr.ndim}; at most 2")
    return _float_vector(i, field, arr, 0, shape=arr.shape)


def _check_custom(
    i: int, d, custom: CustomLoss, vocab_size: int, n: int, shapes_seen: set, deadline: float
) -> CheckedDatum:
    # Inputs the loss does not read are ignored, as the SDK's client-side path ignores them.
    inputs = d.loss_fn_inputs
    for key in ("target_tokens",) + custom.input_names:
        if key not in inputs:
            raise InputError(
                f"datum {i}: loss_fn_inputs.{key} is missing (needed by custom "
                f"loss {custom.name!r})"
            )
    targets = _int_vector(
        i, "loss_fn_inputs.target_tokens", inputs["target_tokens"], vocab_size, two_d=True
    )
    if targets.shape[0] != n:
        raise InputError(
            f"datum {i}: loss_fn_inputs.target_tokens has length "
            f"{targets.shape[0]}, model_input has length {n}"
        )
    extra = {k: _custom_input(i, k, inputs[k]) for k in custom.input_names}
    key = (targets.shape, tuple((v.shape, v.dtype.str) for v in extra.values()))
    if key not in shapes_seen:  # evaluating the shapes traces the graph: once per shape
        custom.check(i, targets.shape, extra, deadline)
        shapes_seen.add(key)
    return CheckedDatum(np.zeros(0), targets, {}, losses_lib.CUSTOM, extra)


def per_datum_losses(loss_fn, n: int) -> list[str]:
    """One loss name (or a CustomLoss) or one name per datum -> a checked list of n names."""
    if isinstance(loss_fn, CustomLoss):
        return [losses_lib.CUSTOM] * n
    if isinstance(loss_fn, str):
        return [losses_lib.check_loss_fn(loss_fn)] * n
    if not isinstance(loss_fn, Sequence) or len(loss_fn) != n:
        raise InputError(
            f"loss_fn must be a loss name or one name per datum ({n}), got {loss_fn!r}"
        )
    return [losses_lib.check_loss_fn(name, f"datum {i}") for i, name in enumerate(loss_fn)]


def validate(data: Sequence[Datum], loss_fn, vocab_size: int, token_cap: int) -> list[CheckedDatum]:
    """Check every datum for its loss (`loss_fn`: one name, or one per datum); return
    private validated copies.

    loss_fn may be a jcp.custom_loss.CustomLoss (every datum's loss): target_tokens [N] or
    [N, K] at its logprobs rank, and the inputs it reads at their declared ranks, checked
    by evaluating the loss's shapes. Built-in losses: target_tokens [N]; cross_entropy
    also [N, K] (−1 pads) with weights of the same shape.

    Raises InputError naming the datum index and the field. Nothing is mutated.
    """
    custom = loss_fn if isinstance(loss_fn, CustomLoss) else None
    if isinstance(loss_fn, str):
        losses_lib.check_loss_fn(loss_fn)
    if isinstance(data, (Datum, Mapping)) or not isinstance(data, Sequence):
        raise InputError("data must be a list of Datum")
    if len(data) == 0:
        raise InputError("data is empty: pass at least one Datum")
    names = per_datum_losses(loss_fn, len(data))
    if custom is not None and (custom.ops or 0) * len(data) > MAX_TRACED_OPS:
        raise InputError(
            f"custom loss {custom.name!r} has {custom.ops} operations, traced "
            f"once per datum: {len(data)} datums would trace "
            f"{custom.ops * len(data)}, over {MAX_TRACED_OPS} per request (send "
            "fewer datums per request)"
        )
    out = []
    shapes_seen: set = set()
    deadline = time.monotonic() + CHECK_BUDGET_S  # for evaluating a custom loss's shapes
    for i, d in enumerate(data):
        loss_fn = names[i]
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
        if custom is not None:
            c = _check_custom(i, d, custom, vocab_size, n, shapes_seen, deadline)
            out.append(dataclasses.replace(c, tokens=tokens))
            continue
        needed = ("target_tokens",) + losses_lib.LOSSES[loss_fn].inputs
        for key in inputs:
            if key not in KNOWN_FIELDS:
                raise InputError(
                    f"datum {i}: loss_fn_inputs.{key} is not a known field; expected "
                    f"{list(KNOWN_FIELDS)}"
                )
        for key in needed:
            if key not in inputs:
                raise InputError(
                    f"datum {i}: loss_fn_inputs.{key} is missing (needed by {loss_fn})"
                )
        two_d = loss_fn == "cross_entropy"
        targets = _int_vector(
            i, "loss_fn_inputs.target_tokens", inputs["target_tokens"], vocab_size, two_d=two_d
        )
        if targets.shape[0] != n:
            raise InputError(
                f"datum {i}: loss_fn_inputs.target_tokens has length {targets.shape[0]}, "
                f"model_input has length {n}"
            )
        floats = {
            k: _float_vector(
                i,
                f"loss_fn_inputs.{k}",
                inputs[k],
                n,
                shape=targets.shape if k == "weights" and targets.ndim == 2 else None,
            )
            for k in FLOAT_FIELDS
            if k in inputs
        }
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
    if any(d.targets.ndim == 2 for d in datums) and not set(loss_fns) <= {
        "cross_entropy",
        losses_lib.CUSTOM,
    }:
        j = next(j for j, d in enumerate(datums) if d.targets.ndim == 2)
        raise InputError(
            f"datum {j}: 2-D target_tokens are for cross_entropy and custom "
            f"losses; this call also has {sorted(loss_fns)}"
        )
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
        kk = (max(widths),) if widths else ()
        tokens = np.zeros((dp, cp, s_len), np.int32)
        targets = np.full((dp, cp, s_len) + kk, -1 if kk else 0, np.int32)
        segment = np.full((dp, cp, s_len), -1, np.int32)
        position = np.zeros((dp, cp, s_len), np.int32)
        loss_id = np.zeros((dp, cp, s_len), np.int32)
        floats = {
            k_: np.zeros((dp, cp, s_len) + (kk if k_ == "weights" else ()), np.float32)
            for k_ in FLOAT_FIELDS
        }
        spans = np.zeros((dp, cp, k, 2), np.int32)
        placements = []
        custom = []
        for s, shard in enumerate(shards):
            off = 0
            for j in sorted(shard, key=lambda j: (int(adapters[j]), j)):
                d = datums[j]
                idx = mesh_lib.zigzag_indices(d.n, cp)  # [cp, 2C]
                valid = idx >= 0
                safe = np.where(valid, idx, 0)
                sl = slice(off, off + rows[j])
                tokens[s, :, sl] = np.where(valid, d.tokens[safe], 0)
                tgt = d.targets if d.targets.ndim == len(kk) + 1 else d.targets[:, None]
                cut = np.where(valid[(...,) + (None,) * len(kk)], tgt[safe], 0)
                if kk:
                    targets[s, :, sl, : cut.shape[-1]] = cut
                else:
                    targets[s, :, sl] = cut
                # Datum slots (segment ids) in stream order, so that they ascend along
                # every stream: attention skips blocks by their segment ranges
                # (attention.tiling.blocks_needed), which out-of-order ids would widen.
                segment[s, :, sl] = np.where(valid, len(placements), -1)
                position[s, :, sl] = np.where(valid, idx, 0)
                loss_id[s, :, sl] = loss_fns.index(d.loss_fn)
                for name, vec in d.floats.items():
                    if name == "weights" and kk:
                        vec = vec if vec.ndim == 2 else vec[:, None]
                        floats[name][s, :, sl, : vec.shape[1]] = np.where(
                            valid[..., None], vec[safe], 0.0
                        )
                    else:
                        floats[name][s, :, sl] = np.where(valid, vec[safe], 0.0)
                if d.loss_fn == losses_lib.CUSTOM:
                    custom.append(
                        (
                            j,
                            _stream_index(idx, valid, s, off, cp, s_len, kk, d.targets),
                            tuple(d.extra.values()),
                        )
                    )
                a = where[int(adapters[j])]
                if spans[s, 0, a, 1] == 0:
                    spans[s, :, a, 0] = off
                spans[s, :, a, 1] = off + rows[j]
                placements.append(Placement(j, s, off, d.n, rows[j]))
                off += rows[j]
        out.append(
            PackedBatch(
                tokens,
                targets,
                segment,
                position,
                loss_id,
                floats,
                spans,
                active,
                num_slots,
                tuple(placements),
                loss_fns,
                tuple(sorted(custom, key=lambda c: c[0])),
            )
        )
    return out


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
