"""Gated DeltaNet's sequence mixing (Qwen3.5's linear attention), exact over cp zigzag
shards: one package for the mixer.

- rule: the gated delta rule, recurrent and chunked (WY / UT transform) over pieces;
- cp: pieces of a stream across cp ranks, the causal conv, gated_delta_rule over cp, and
  the strategies the decoder calls (cp_mix, StepMix, Recurrent);
- pallas: the chunked rule's per-block factors as a Pallas kernel (the GPU path).
The engine's chunked-prefill strategy over page rows is jcp.sample.paged.ChunkMix.
Standalone: it imports only mesh-level helpers.

Shapes: S tokens of this stream, H value heads (local under tp), Hk key heads, dk / dv key /
value head dims (letters Dk, Dv in names), Ck the kernel block (chunk) length, P the static
bound on pieces per stream, Kc the conv kernel, C conv channels.
"""

from jcp.delta_rule.cp import (
    CPMix,
    Pieces,
    Recurrent,
    StepMix,
    causal_conv,
    cp_mix,
    gated_delta_rule,
    pieces,
)
from jcp.delta_rule.rule import (
    DEFAULT_CHUNK,
    block_factors,
    chunked,
    l2norm,
    recurrent,
    unit_lower_inverse,
)

__all__ = [
    "CPMix",
    "DEFAULT_CHUNK",
    "Pieces",
    "Recurrent",
    "StepMix",
    "block_factors",
    "causal_conv",
    "chunked",
    "cp_mix",
    "gated_delta_rule",
    "l2norm",
    "pieces",
    "recurrent",
    "unit_lower_inverse",
]
