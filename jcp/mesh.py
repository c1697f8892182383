"""The device mesh, its axis names, every PartitionSpec, and the zigzag sequence layout.

This module owns the three axis names and the one table of PartitionSpecs; no other module
writes an axis string. It also owns the moves between host arrays and global arrays (put,
replicate, host, gather) and the bucketing of sizes. It must never look at model weights
or data values: it only says where things live and which original position each rank
holds.

Shape legend — the one set of letters every jcp module uses in names and docstrings:

    DP, CP, TP  mesh axis sizes             L  layers
    G  adapter slots (the whole table)      A  active adapters of one micro-batch
    R  max LoRA rank (r: an adapter's own)  D  hidden width
    F  MLP width                            V  vocabulary (V/tp on one tp rank)
    I, O  in / out features of a projection (local shards under tp)
    Q  query heads                          K  key/value heads
    M = Q/K  query heads per kv head        H  head dim
    S  tokens of one device's stream        T  key tokens a query block may see (CP·S);
                                            in a KV cache, its rows per sequence
    N  tokens of one datum                  C  zigzag chunk length
    B  datum slots of one micro-batch (in decoding: the sequences of the decode batch)
    Bq, Bk  attention block rows (queries, keys)
    W = S·M  query rows of an attention kernel (one per token and query head of a kv group)
    Nb  blocks of a tiled stream
    E  experts (MoE)                        X  experts chosen per token (num_experts_per_tok)
    Z = S·X  (token, choice) rows of the expert matmuls
    Fe  an expert's MLP width               Lm, Ld  MoE / dense layers of a MoE model

Under tp the per-device sizes of split axes are the local ones (Q/tp heads, F/tp, V/tp).
"""

from __future__ import annotations

import dataclasses
import math
import os

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

DP = "dp"
CP = "cp"
TP = "tp"
AXES = (DP, CP, TP)


@dataclasses.dataclass(frozen=True)
class Specs:
    """Every PartitionSpec jcp uses; field names carry the global shape."""

    # Host-packed streams: one row of S tokens per (dp, cp) device pair.
    stream_DPxCPxS: P = P(DP, CP, None)
    stream_DPxCPxSxD: P = P(DP, CP, None, None)
    # Per-(dp, cp) adapter spans (start, end) of the active adapters.
    spans_DPxCPxAx2: P = P(DP, CP, None, None)
    replicated: P = P()
    # Base weights (frozen).
    embed_VxD: P = P(TP, None)
    unembed_DxV: P = P(None, TP)
    norm_D: P = P()
    norm_LxD: P = P(None, None)
    column_LxDxO: P = P(None, None, TP)  # q, k, v, gate, up: split on out
    column_bias_LxO: P = P(None, TP)
    row_LxIxD: P = P(None, TP, None)  # o, down: split on in, psum over tp after
    # MoE layers (Lm of them): the router replicated; whole experts over tp (E/tp per rank),
    # so every rank routes alike, runs its own experts, and the MLP's psum over tp combines.
    router_LxDxE: P = P(None, None, None)
    experts_LxExIxO: P = P(None, TP, None, None)  # gate, up [Lm, E, D, F]; down [Lm, E, F, D]
    # LoRA slots (slot-major), sharded like the base layer they adapt.
    lora_a_column_GxLxDxR: P = P(None, None, None, None)
    lora_b_column_GxLxRxO: P = P(None, None, None, TP)
    lora_a_row_GxLxIxR: P = P(None, None, TP, None)
    lora_b_row_GxLxRxD: P = P(None, None, None, None)
    lora_a_head_GxDxR: P = P(None, None, None)
    lora_b_head_GxRxV: P = P(None, None, TP)
    # LoRA on the experts ([Lm] MoE layers): per-expert factors split with their experts,
    # the shared-outer hidden-side factor (no E axis) replicated like the router.
    lora_expert_GxLxExIxR: P = P(None, None, TP, None, None)
    lora_expert_GxLxExRxO: P = P(None, None, TP, None, None)
    lora_shared_GxLxIxR: P = P(None, None, None, None)
    slot_G: P = P(None)
    # Sampling (jcp/sample/kv_cache.py, jcp/sample/), kv heads over tp throughout.
    # Cache mode "batch": the decode batch of B sequences spread over (dp, cp) — cp ranks
    # act as extra data parallelism — each sequence's whole cache (T rows) on one device.
    cache_LxBxTxKxH: P = P(None, (DP, CP), None, TP, None)
    cache_position_BxT: P = P((DP, CP), None)
    seqs_B: P = P((DP, CP))
    seqs_Bx2: P = P((DP, CP), None)
    # Cache mode "split": sequences over dp only, each sequence's T = CP·Tc cache rows split
    # over cp (rank c holds rows c·Tc … (c+1)·Tc − 1); spans are per dp shard ([DP, 1, A, 2]).
    split_cache_LxBxTxKxH: P = P(None, DP, CP, TP, None)
    split_cache_position_BxT: P = P(DP, CP)
    split_seqs_B: P = P(DP)
    split_seqs_Bx2: P = P(DP, None)
    split_spans_DPx1xAx2: P = P(DP, None, None, None)


SPECS = Specs()

# Axes over which the batch is split; the loss is summed over both.
BATCH_AXES = (DP, CP)


def make_mesh(dp: int = 1, cp: int = 1, tp: int = 1, devices=None) -> Mesh:
    """A mesh with axes ("dp", "cp", "tp") over `devices` (default: all of jax.devices()).

    tp is the innermost axis so tensor-parallel collectives stay within a host when they can.
    """
    for name, size in (("dp", dp), ("cp", cp), ("tp", tp)):
        if not isinstance(size, (int, np.integer)) or size < 1:
            raise ValueError(f"mesh axis {name} must be a positive integer, got {size!r}")
    devices = list(jax.devices() if devices is None else devices)
    need = dp * cp * tp
    if need > len(devices):
        raise ValueError(
            f"mesh dp={dp} cp={cp} tp={tp} needs {need} devices, only {len(devices)} available"
        )
    if need < len(devices) and jax.process_count() > 1:
        raise ValueError(
            f"mesh dp={dp} cp={cp} tp={tp} uses {need} of {len(devices)} devices; a multi-process "
            "run must use every device"
        )
    return jax.make_mesh(
        (dp, cp, tp), AXES, axis_types=(AxisType.Auto,) * 3, devices=devices[:need]
    )


def axis_size(mesh: Mesh, axis: str) -> int:
    return int(mesh.shape[axis])


# ----------------------------------------------------------------------------------------
# Zigzag layout


def zigzag_chunk(n: int, cp: int) -> int:
    """Chunk length C = ceil(n / 2cp) of a datum of n tokens."""
    return -(-n // (2 * cp))


def zigzag_indices(n: int, cp: int) -> np.ndarray:
    """Original position held by each rank, in local order: int32 [cp, 2C]; -1 = padding.

    The datum is right-padded to 2cp·C and cut into 2cp chunks; rank r holds chunks r and
    2cp−1−r, in that order, so every rank does the same causal-attention work.
    Example, n = 8, cp = 2 (C = 2): [[0, 1, 6, 7], [2, 3, 4, 5]].
    Example, n = 5, cp = 2 (C = 2): [[0, 1, -1, -1], [2, 3, 4, -1]].
    """
    if n < 1 or cp < 1:
        raise ValueError(f"zigzag_indices needs n >= 1 and cp >= 1, got n={n}, cp={cp}")
    c = zigzag_chunk(n, cp)
    chunks = np.arange(2 * cp * c, dtype=np.int32).reshape(2 * cp, c)
    ranks = np.arange(cp)
    idx = np.concatenate([chunks[ranks], chunks[2 * cp - 1 - ranks]], axis=1)
    return np.where(idx < n, idx, -1).astype(np.int32)


def unzigzag(local_CPx2C: np.ndarray, n: int) -> np.ndarray:
    """Inverse of zigzag_indices: [cp, 2C, ...] rank-local rows -> [n, ...] original order.

    Example, n = 5, cp = 2: [[a0, a1, p, p], [a2, a3, a4, p]] -> [a0, a1, a2, a3, a4].
    """
    cp = local_CPx2C.shape[0]
    idx = zigzag_indices(n, cp).reshape(-1)
    flat = local_CPx2C.reshape((-1,) + local_CPx2C.shape[2:])
    out = np.empty((n,) + flat.shape[1:], dtype=flat.dtype)
    keep = idx >= 0
    out[idx[keep]] = flat[keep]
    return out


def datum_token_cap(max_tokens_per_device: int, cp: int, tp: int, pad_multiple: int = 1) -> int:
    """Most tokens one datum may hold.

    With M tokens per device and pad multiple p = tp·pad_multiple: (floor(M / p)·p, made
    even)·cp. A datum at the cap fills exactly one device's stream on every cp rank.
    """
    p = tp * pad_multiple
    per_rank = (max_tokens_per_device // p) * p
    per_rank -= per_rank % 2
    return per_rank * cp


def bucket_length(n: int, minimum: int = 16, maximum: int | None = None) -> int:
    """Round n up to the next bucket: powers of two and 1.5 × powers of two, ≥ minimum.

    Few distinct lengths keep the number of compiled programs small; the 1.5× steps cap
    padding waste at 33%. `maximum` (if given and ≥ n) clips the result.
    """
    b = minimum
    while b < n:
        nxt = b * 3 // 2 if (b & (b - 1)) == 0 and b >= 4 else 1 << math.ceil(math.log2(b + 1))
        b = max(nxt, b + 1)
    if maximum is not None and n <= maximum:
        b = min(b, maximum)
    return b


def pow2_at_least(n: int, minimum: int = 1) -> int:
    """The smallest power of two ≥ max(n, minimum): the bucket of a count (active adapters,
    sampling streams and lengths), so a run compiles few distinct shapes."""
    b = 1
    while b < max(n, minimum):
        b *= 2
    return b


def block_size(n: int, maximum: int) -> int:
    """Largest power of two ≤ maximum that divides n (n > 0): the tile of a stream."""
    b = 1
    while b * 2 <= maximum and n % (b * 2) == 0:
        b *= 2
    return b


# ----------------------------------------------------------------------------------------
# Varying-manual-axes types inside shard_map


def varying_axes(x) -> tuple[str, ...]:
    """The mesh axes over which x (inside shard_map) may differ between devices."""
    return tuple(sorted(jax.typeof(x).manual_axis_type.varying))


def vary(x, axes):
    """Cast x to varying over `axes` where it is not already (scan carries, custom VJPs)."""
    missing = tuple(a for a in axes if a not in varying_axes(x))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def vary_like(x, ref):
    """Cast x to vary over every mesh axis that ref varies over (for scan carries)."""
    return vary(x, varying_axes(ref))


def vary_all(x, *refs):
    """Cast x to vary over every mesh axis that any of refs varies over."""
    for r in refs:
        x = vary_like(x, r)
    return x


def psum_flat(tree, axes):
    """jax.lax.psum(tree, axes) as one all-reduce of a concatenated vector per group of
    leaves with the same dtype and varying axes (inside shard_map; the same sums).

    XLA combines a step's all-reduces into one tuple all-reduce, but XLA:CPU runs a
    tuple's operands one by one, and in a multi-process job each is a gloo ring of
    2 (devices - 1) TCP hops, latency-bound at these sizes: 25 small leaves over 8
    devices in 2 processes took 193 ms (100 CPU ms a process) against 8.6 ms as one
    vector of the same 101 KB (2 cores at load ≈ 13; in one process 2.3 vs 2.7 ms).
    Use it where one program sums many small arrays.
    Leaves that differ only in varying over mesh axes of one device (tp = 1: the adapters'
    tp-sharded factors against the others) share a vector: cast to vary over them for the
    sum, each is given its own type back by a psum over those axes (a sum over one device:
    the same values, and no communication).
    Other backends run a tuple all-reduce as one (NCCL groups it): there it is a plain
    psum, with no concatenated copy.
    """
    if jax.default_backend() != "cpu":
        return jax.lax.psum(tree, axes)
    leaves, treedef = jax.tree.flatten(tree)
    sizes = {}

    def single(a):  # a mesh axis of one device
        if a not in sizes:
            sizes[a] = jax.lax.axis_size(a)
        return sizes[a] == 1

    groups = {}
    for i, x in enumerate(leaves):
        own = varying_axes(x)
        groups.setdefault((x.dtype, tuple(a for a in own if not single(a))), []).append(i)
    out = list(leaves)
    for idx in groups.values():
        summed = (axes,) if isinstance(axes, str) else tuple(axes)  # invariant after it
        extra = sorted({a for i in idx for a in varying_axes(leaves[i]) if single(a)})
        flat = jax.lax.psum(
            jax.numpy.concatenate([vary(leaves[i], extra).reshape(-1) for i in idx]), axes
        )
        start = 0
        for i in idx:
            x = flat[start : start + leaves[i].size].reshape(leaves[i].shape)
            back = tuple(a for a in extra if a not in varying_axes(leaves[i]) and a not in summed)
            out[i] = jax.lax.psum(x, back) if back else x
            start += leaves[i].size
    return jax.tree.unflatten(treedef, out)


# ----------------------------------------------------------------------------------------
# Host arrays <-> global arrays


def put(mesh: Mesh, x, spec: P, dtype=None) -> jax.Array:
    """A host array (or anything NumPy-indexable, e.g. a lazy tensor) -> a global array laid
    out by `spec`, each device receiving only its own slice (jax.make_array_from_callback):
    no device ever holds a replicated copy of a sharded array, and each process reads only
    the slices of its own devices. Every process passes the same value. dtype: cast each
    slice (default: x's dtype). A writable NumPy array's slices are copies (host_slice).
    """
    return jax.make_array_from_callback(
        tuple(x.shape), NamedSharding(mesh, spec), lambda idx: host_slice(x, idx, dtype)
    )


def host_slice(x, idx, dtype=None) -> np.ndarray:
    """x[idx] as NumPy that no one else writes: a copy when x is a writable NumPy array.
    On CPU a device array may alias the NumPy memory it was made from, so a host array
    changed after a call was dispatched (the adapter tables' page lists, the engine's
    tables) would change what the call reads: served models trained through offloads
    and sampler snapshots came out wrong, at random (tests/server/test_server_lifecycle.py)."""
    v = x[idx]
    if isinstance(x, np.ndarray) and x.flags.writeable:
        return np.array(v, dtype=dtype, copy=True)
    return np.asarray(v, dtype)


def replicate(mesh: Mesh, x) -> jax.Array:
    """A host array as a global array replicated over the mesh (put with P())."""
    return put(mesh, np.asarray(x), SPECS.replicated)


def host(x) -> np.ndarray:
    """A replicated global array as NumPy, readable on every process (no collective)."""
    return np.asarray(x.addressable_data(0))


def gather(x) -> np.ndarray:
    """Any global array's whole value on this host. A collective: every process calls it."""
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def device_memory(mesh) -> tuple[int, int]:
    """(limit, in use) of one device's memory: an accelerator's own figures, or half the
    host's physical memory over the mesh's devices in this process (CPU, in use unknown:
    0; a mesh over some of a process's fake CPU devices shares the host among its own: a
    (1,1,1) mesh in a process of 8 got an eighth, which made remat "auto" recompute what a
    one-device process keeps); the smallest free memory over processes."""
    device = mesh.devices.flat[0]
    stats = device.memory_stats() if device.platform != "cpu" else None
    if stats and stats.get("bytes_limit"):
        limit, used = int(stats["bytes_limit"]), int(stats.get("bytes_in_use", 0))
    else:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        mine = sum(d.process_index == jax.process_index() for d in mesh.devices.flat)
        limit, used = int(0.5 * physical / max(1, mine)), 0
    if jax.process_count() > 1:
        # In MiB as int32: without jax_enable_x64 an int64 gathers as int32 and bytes
        # beyond 2 GiB wrapped negative.
        mib = np.asarray([limit >> 20, (limit - used) >> 20], np.int32)
        both = np.asarray(multihost_utils.process_allgather(mib)).reshape(-1, 2)
        limit, free = int(np.min(both[:, 0])) << 20, int(np.min(both[:, 1])) << 20
        used = limit - free
    return limit, used
