"""adapter_config.json options that change what a PEFT adapter's tensors mean: read as
plain LoRA they would give silently wrong results, so jcp.peft's reader and jcp-serve's
upload check (jcp.server.checkpoint_api, which must not import jax) both refuse them."""

# A bias on lora_B, a transposed layout, other layers, modules or parameters.
TENSOR_MEANING_OPTIONS = (
    "modules_to_save",
    "layers_to_transform",
    "layers_pattern",
    "lora_bias",
    "fan_in_fan_out",
    "layer_replication",
    "target_parameters",
    "trainable_token_indices",
    "alora_invocation_tokens",
    "use_qalora",
)
