"""The attention strategies of the model over context-parallel zigzag shards.

Owns the two ways a rank's queries reach every cp rank's keys — the K/V all-gather over
"cp" (cp_attend) and the ring (ring_attend: K/V passed around with ppermute, never held
whole) — and the rule that picks one (choose_cp_attention), each over one of the kernels
(attention.blockwise, attention.pallas, attention.cpu), and the rule resolving attn_impl
"auto" (resolve_implementation). It must never build an array of [local tokens,
all tokens].

Shapes: see the legend in jcp/mesh.py (S queries on this rank, T = CP·S gathered keys,
Q and K heads on this tp shard, M = Q/K, H head dim).
"""

from __future__ import annotations

from typing import Any, Protocol

import jax
import jax.numpy as jnp

from jcp.attention import blockwise, cpu, pallas
from jcp.attention.tiling import DEFAULT_BLOCK, tile
from jcp.mesh import CP

# "pallas": the fused kernels of jcp/attention/pallas.py (Triton on GPU; on CPU, interpret
# mode, tests only). "cpu": the fused C++ kernels of jcp/attention/cpu.py (XLA:CPU only,
# built on first use). "auto" is not an implementation: resolve_implementation turns it
# into one before anything is traced.
IMPLEMENTATIONS = ("blockwise", "dense", "pallas", "cpu")
RING_IMPLEMENTATIONS = ("blockwise", "pallas", "cpu")


def resolve_implementation(choice: str, platform: str, head_dim: int, dtype) -> str:
    """The attention implementation for attn_impl `choice` on devices of `platform` for a
    model of `head_dim` and compute `dtype`: choice itself unless "auto" (checked by the
    caller: train_step.StepConfig). "auto" is
    - "pallas" on GPUs for 16-bit models (on an H200, bf16, 8k tokens, 32/8 heads × 128:
      forward + backward 11.1 ms against blockwise's 45.5; in fp32 Pallas's backward was the
      slower, 63.9 vs 46.6 ms, so fp32 models keep blockwise);
    - "cpu" on CPU where the C++ kernels build and support head_dim (cpu.supports): they
      beat the blockwise kernel end to end (training throughput, benchmarks/RESULTS.md,
      issue 22);
    - "blockwise" otherwise."""
    if choice != "auto":
        return choice
    if platform == "gpu" and jnp.dtype(dtype).itemsize == 2:
        return "pallas"
    return "cpu" if platform == "cpu" and cpu.supports(head_dim) else "blockwise"


class Attend(Protocol):
    """An attention strategy: what the decoder layer calls between RoPE and o_proj.

    (q [S, Q, H], k [S, K, H], v [S, K, H], state) -> (out [S, Q, H], new state). q and k
    carry RoPE already. `state` is this layer's attention state (a pytree, scanned over
    layers with the weights): None for training; a KV cache for prefill (written) and
    decode (read and extended). Everything else a strategy needs (segments, positions,
    cache indices) it closes over, so the model threads no mode flags.
    """

    def __call__(self, q_SxQxH, k_SxKxH, v_SxKxH, state: Any) -> tuple[jax.Array, Any]: ...


def gather_cp(x):
    """[S, …] on each cp rank -> [CP·S, …]: the streams of ranks 0 … CP−1, concatenated.

    Transposes (under autodiff) to a reduce-scatter, so each rank gets back the gradient of
    its own keys and values.
    """
    return jax.lax.all_gather(x, CP, axis=0, tiled=True)


def _check_implementation(implementation: str) -> None:
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"attention implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}"
        )


def cp_attention(
    q_SxQxH,
    k_SxKxH,
    v_SxKxH,
    segment_S,
    position_S,
    *,
    implementation: str = "blockwise",
    block: int = DEFAULT_BLOCK,
):
    """Causal, datum-isolated attention of this rank's queries over every cp rank's keys.

    q: [S, Q, H] (RoPE applied), k, v: [S, K, H]; segment: datum slot (−1 = padding);
    position: index within the datum. A query sees a key iff both belong to the same datum
    and the key's position ≤ the query's. Queries that see nothing (padding) give zeros.
    Returns [S, Q, H]. implementation: one of IMPLEMENTATIONS; `block` caps its tiles.
    """
    _check_implementation(implementation)
    s_len, q_heads, head_dim = q_SxQxH.shape
    kv_heads = k_SxKxH.shape[1]
    q_SxKxMxH = q_SxQxH.reshape(s_len, kv_heads, q_heads // kv_heads, head_dim)
    k_TxKxH, v_TxKxH = gather_cp(k_SxKxH), gather_cp(v_SxKxH)
    seg_T, pos_T = gather_cp(segment_S), gather_cp(position_S)
    if implementation == "pallas":
        return pallas.flash_attention(
            q_SxQxH, k_TxKxH, v_TxKxH, segment_S, position_S, seg_T, pos_T, block
        )
    if implementation == "cpu":  # its own tiles: `block` is not used
        return cpu.flash_attention(q_SxQxH, k_TxKxH, v_TxKxH, segment_S, position_S, seg_T, pos_T)
    if implementation == "dense":
        out = blockwise.dense(q_SxKxMxH, k_TxKxH, v_TxKxH, segment_S, position_S, seg_T, pos_T)
    else:
        out = blockwise.flash(
            q_SxKxMxH,
            k_TxKxH,
            v_TxKxH,
            segment_S,
            position_S,
            seg_T,
            pos_T,
            tile(s_len, block),
            tile(k_TxKxH.shape[0], block),
        )
    return out.reshape(s_len, q_heads, head_dim)


def cp_attend(
    segment_S, position_S, *, implementation: str = "blockwise", block: int = DEFAULT_BLOCK
) -> Attend:
    """The training strategy: cp_attention over the packed streams, state passed through.

    Closes over this rank's (segment, position) [S]; the state is None (training keeps no
    cache), returned unchanged.
    """
    _check_implementation(implementation)

    def attend(q_SxQxH, k_SxKxH, v_SxKxH, state):
        return cp_attention(
            q_SxQxH,
            k_SxKxH,
            v_SxKxH,
            segment_S,
            position_S,
            implementation=implementation,
            block=block,
        ), state

    return attend


def ring_attention(
    q_SxQxH,
    k_SxKxH,
    v_SxKxH,
    segment_S,
    position_S,
    *,
    block: int = DEFAULT_BLOCK,
    implementation: str = "blockwise",
):
    """cp_attention's result without gathering K/V: they travel the cp ring instead.

    Same arguments, mask and result as cp_attention (blockwise); per-device memory is
    O(S) — this rank's K/V, the one in flight, and their fp32 gradients — never O(CP·S).
    Runs inside shard_map over "cp". With the zigzag layout every rank computes the same
    number of blocks at every step (ring_block_work), so no rank waits at a hop.
    implementation: one of RING_IMPLEMENTATIONS ("pallas", "cpu": one fused kernel call
    per step).
    """
    if implementation not in RING_IMPLEMENTATIONS:
        raise ValueError(
            f"ring attention implementation must be one of "
            f"{RING_IMPLEMENTATIONS}, got {implementation!r}"
        )
    if implementation == "cpu":
        return cpu.ring_attention(q_SxQxH, k_SxKxH, v_SxKxH, segment_S, position_S)
    if implementation == "pallas":
        return pallas.ring_attention(q_SxQxH, k_SxKxH, v_SxKxH, segment_S, position_S, block=block)
    s_len, q_heads, head_dim = q_SxQxH.shape
    kv_heads = k_SxKxH.shape[1]
    q_SxKxMxH = q_SxQxH.reshape(s_len, kv_heads, q_heads // kv_heads, head_dim)
    out = blockwise.ring(
        q_SxKxMxH,
        k_SxKxH,
        v_SxKxH,
        segment_S,
        position_S,
        tile(s_len, block),
        jax.lax.axis_size(CP),
    )
    return out.reshape(s_len, q_heads, head_dim)


def ring_attend(
    segment_S, position_S, *, block: int = DEFAULT_BLOCK, implementation: str = "blockwise"
) -> Attend:
    """The training strategy with ring_attention: like cp_attend, state passed through."""

    def attend(q_SxQxH, k_SxKxH, v_SxKxH, state):
        return ring_attention(
            q_SxQxH,
            k_SxKxH,
            v_SxKxH,
            segment_S,
            position_S,
            block=block,
            implementation=implementation,
        ), state

    return attend


CP_ATTENTION = ("auto", "gather", "ring")


# "auto" rings once the all-gather would hold more than this per layer (gathered_kv_bytes).
# Below it the gathered K/V are small next to the rest of a layer's memory and one
# collective beats cp − 1 hops; above it they dominate per-device memory as cp grows.
RING_ABOVE_BYTES = 64 << 20


def gathered_kv_bytes(cp: int, s_len: int, kv_heads: int, head_dim: int, itemsize: int) -> int:
    """Bytes the all-gather path holds for one layer: K and V [CP·S, K, H] and, in the
    backward pass, their fp32 gradients."""
    return cp * s_len * kv_heads * head_dim * 2 * (itemsize + 4)


def choose_cp_attention(
    choice: str, cp: int, s_len: int, kv_heads: int, head_dim: int, itemsize: int
) -> str:
    """ "gather" or "ring": choice itself unless "auto"; then ring iff cp > 1 and
    gathered_kv_bytes > RING_ABOVE_BYTES."""
    if choice not in CP_ATTENTION:
        raise ValueError(f"cp_attention must be one of {CP_ATTENTION}, got {choice!r}")
    if choice != "auto":
        return choice
    big = gathered_kv_bytes(cp, s_len, kv_heads, head_dim, itemsize) > RING_ABOVE_BYTES
    return "ring" if cp > 1 and big else "gather"
