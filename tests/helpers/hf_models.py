"""The one tiny Hugging Face model builder of the tests, and the one LoRA randomiser.

tiny_hf builds a random Qwen2 / Qwen3 / Qwen3-MoE model in fp32 eval mode from sizes
given as arguments (transformers' config names), with non-unit norms (1 + 0.3·N), biases
0.1·N, MoE routers 0.3·N (decisive routing, no near-ties) and every other weight
weight_std·N, drawn in parameter order after torch.manual_seed(seed) — so a given
(arch, sizes, seed, weight_std) is always the same model. peft_model wraps a copy in
peft's LoRA with its factors randomised (peft initialises B to zero).
"""

from __future__ import annotations

import copy

import peft
import torch
import transformers

ARCHS = {
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
}


def tiny_hf(arch: str = "qwen3", *, seed: int = 0, weight_std: float = 0.05, **config):
    """A random tiny `arch` model; `config`: its transformers config fields (sizes, and
    e.g. tie_word_embeddings, attention_bias, num_experts). Defaults: rope_theta 1e4,
    rms_norm_eps 1e-6, max_position_embeddings 1024, untied; MoE experts in eager mode."""
    config_cls, model_cls = ARCHS[arch]
    kw = dict(
        rope_theta=10_000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    if arch == "qwen3_moe":
        kw.update(decoder_sparse_step=1, experts_implementation="eager")
    kw.update(config)
    torch.manual_seed(seed)
    hm = model_cls(config_cls(**kw))
    with torch.no_grad():
        for name, p in hm.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):
                p.copy_(0.3 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(weight_std * torch.randn_like(p))
    return hm.eval().float()


def peft_model(hm, seed: int, *, std: float = 0.05, factors: str = "lora_B", **lora_kw):
    """get_peft_model on a copy of hm (LoraConfig(**lora_kw), no dropout, no bias) with the
    parameters whose name contains `factors` ("lora_B", or "lora_" for A and B) set to
    std·N from a generator seeded with `seed`."""
    pm = peft.get_peft_model(
        copy.deepcopy(hm),
        peft.LoraConfig(lora_dropout=0.0, bias="none", task_type="CAUSAL_LM", **lora_kw),
    )
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if factors in name:
                p.copy_(std * torch.randn(p.shape, generator=g))
    return pm.eval()
