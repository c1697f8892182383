"""The model: its parameter tree, the decoder layer and its blocks, and the MoE block.

- params: base-parameter names, shapes, PartitionSpecs, random init, placement (what
  jcp.hf needs; imports neither attention nor lora).
- blocks: RMSNorm, RoPE, embedding, attention / Gated DeltaNet / dense / MoE MLP blocks,
  the layer.
- decoder: the layer stack (hidden_states, scanned by runs of one kind), the
  unembedding's factors; re-exports the blocks.
- moe: routing, grouped expert matmuls, router statistics.

`from jcp import model` gives the names callers use; the modules hold the rest.
"""

from jcp.model import blocks, decoder, moe, params
from jcp.model.decoder import (
    Hidden,
    HybridState,
    LayerInputs,
    Pass,
    Rotary,
    attention_block,
    decoder_layer,
    dense_mlp,
    embed,
    hidden_span,
    hidden_states,
    layer_slices,
    moe_mlp,
    rms_norm,
    rope,
    rotary,
    unembed_factors,
)
from jcp.model.params import (
    COLUMN,
    ROW,
    check_shapes,
    param_shapes,
    param_specs,
    place,
    random_params,
)

__all__ = [
    "blocks",
    "decoder",
    "moe",
    "params",
    "Hidden",
    "HybridState",
    "LayerInputs",
    "Pass",
    "attention_block",
    "decoder_layer",
    "dense_mlp",
    "embed",
    "hidden_span",
    "hidden_states",
    "layer_slices",
    "moe_mlp",
    "rms_norm",
    "rope",
    "rotary",
    "Rotary",
    "unembed_factors",
    "COLUMN",
    "ROW",
    "check_shapes",
    "param_shapes",
    "param_specs",
    "place",
    "random_params",
]
