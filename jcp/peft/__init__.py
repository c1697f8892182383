"""PEFT LoRA adapters: key names, the torch layout, and reading and writing folders.

Owns everything about the PEFT format: `base_model.model.…lora_A.weight` names, lora_A
[r, I] / lora_B [O, r] (torch layout), adapter_config.json and adapter_model.safetensors.
It must never accept a file it would read inexactly — a config option that changes what
the tensors mean, a tensor it would not use, a malformed file — and never write a partial
file where a complete one stood (files are written aside and renamed into place).

Shapes: see the legend in jcp/mesh.py. An adapter tree is {module: {"a": [L, I, r],
"b": [L, r, O]}} over its target modules (lm_head without L), r its own rank; the expert
modules of a MoE model hold [Lm, E, I, r] / [Lm, E, r, O] per expert, or a shared
hidden-side factor (lora.expert_keys), over the Lm MoE layers. F here is the expert width
(moe_intermediate_size).

The experts in files. transformers 5 holds Qwen3-MoE experts as two fused 3-D parameters,
gate_up_proj [E, 2F, D] (gate rows first) and down_proj [E, D, F], and peft adapts them with
`target_parameters` (ParamWrapper): one LoRA per parameter, lora_A [r·E, I] with rows
ordered (expert, rank), lora_B [O, r·E] with columns ordered (rank, expert) (pack_experts),
scale alpha / r. A folder peft wrote is read as jcp's "fused_gate_up" adapter: gate and
up share that one A_e (a tied parameter, so it trains as peft trains it) and split B_e's
columns; it is written back the same way, at rank r. jcp's separate gate and up factors
(per_expert, shared_outer) are one LoRA over the fused [gate; up] output: at rank 2r with
A_e = [gate.A_e | up.A_e] and block-diagonal B_e, alpha 2·alpha through rank_pattern /
alpha_pattern (exactly what peft's own per-expert -> fused conversion writes); reading
such a file gives rank r back, gate and up untied. vLLM reads Qwen3-MoE adapters
as per-expert 2-D keys instead (write_vllm_folder).

The package: tensors.py (names, layout, trees to and from PEFT tensors), experts.py (the
MoE experts' fused and per-expert layouts), folder.py (adapter folders read and written).
"""

from jcp.peft.experts import (
    DOWN,
    GATE_UP,
    GATE_UP_PATTERN,
    VLLM_EXPERT,
    expert_key,
    experts_from_peft,
    experts_to_peft,
    fuse_gate_up,
    moe_layer_ids,
    pack_experts,
    per_expert,
    unpack_experts,
    vllm_key,
)
from jcp.peft.folder import (
    CONFIG_FILE,
    PEFT_MODULES,
    WEIGHTS_FILE,
    check_export_path,
    read_folder,
    write_folder,
    write_vllm_folder,
)
from jcp.peft.tensors import BASE_HEAD_KEY, from_peft, peft_key, to_peft, to_vllm, tree_rank

__all__ = [
    "BASE_HEAD_KEY",
    "CONFIG_FILE",
    "DOWN",
    "GATE_UP",
    "GATE_UP_PATTERN",
    "PEFT_MODULES",
    "VLLM_EXPERT",
    "WEIGHTS_FILE",
    "check_export_path",
    "expert_key",
    "experts_from_peft",
    "experts_to_peft",
    "from_peft",
    "fuse_gate_up",
    "moe_layer_ids",
    "pack_experts",
    "peft_key",
    "per_expert",
    "read_folder",
    "to_peft",
    "to_vllm",
    "tree_rank",
    "unpack_experts",
    "vllm_key",
    "write_folder",
    "write_vllm_folder",
]
