"""Attention: the tiling every kernel shares, the kernels, and the strategies over cp.

- tiling: the (segment, position) mask, block summaries and skipping, tile sizes, and what
  every kernel shares: the online-softmax step (decode's too) and the ring schedule.
- blockwise: the reference kernel in plain JAX (flash over a gathered stream, and the ring);
  what "auto" runs where neither fused kernel applies.
- pallas: the fused Pallas (Triton) kernels, "pallas" implementation ("auto" on GPUs for
  16-bit models).
- paged: the Pallas paged decode kernel (each row's K/V pages read in place through its
  page table; the engine's decode for attn_impl "pallas").
- cpu: the fused C++ kernels for XLA:CPU (built on first use), "cpu" implementation ("auto"
  on CPU where they build).
- strategies: cp_attend / ring_attend (what the decoder layer calls) and the rule choosing one.

`from jcp import attention` gives the names callers use; the modules hold the rest.
"""

from jcp.attention import blockwise, cpu, paged, pallas, strategies, tiling
from jcp.attention.strategies import (
    CP_ATTENTION,
    IMPLEMENTATIONS,
    RING_ABOVE_BYTES,
    RING_IMPLEMENTATIONS,
    Attend,
    choose_cp_attention,
    cp_attend,
    cp_attention,
    gather_cp,
    gathered_kv_bytes,
    resolve_implementation,
    ring_attend,
    ring_attention,
)
from jcp.attention.tiling import (
    DEFAULT_BLOCK,
    GROWN_TILE,
    SAVED_NAMES,
    TILES_PER_STREAM,
    SoftmaxState,
    block_summary,
    block_work,
    blocks_needed,
    needed_range,
    online_softmax_finish,
    online_softmax_init,
    online_softmax_update,
    ring_block_work,
    tile,
)

__all__ = [
    "blockwise",
    "cpu",
    "paged",
    "pallas",
    "strategies",
    "tiling",
    "CP_ATTENTION",
    "IMPLEMENTATIONS",
    "RING_ABOVE_BYTES",
    "RING_IMPLEMENTATIONS",
    "Attend",
    "resolve_implementation",
    "choose_cp_attention",
    "cp_attend",
    "cp_attention",
    "gather_cp",
    "gathered_kv_bytes",
    "ring_attend",
    "ring_attention",
    "DEFAULT_BLOCK",
    "GROWN_TILE",
    "SAVED_NAMES",
    "TILES_PER_STREAM",
    "SoftmaxState",
    "block_summary",
    "block_work",
    "blocks_needed",
    "needed_range",
    "online_softmax_finish",
    "online_softmax_init",
    "online_softmax_update",
    "ring_block_work",
    "tile",
]
