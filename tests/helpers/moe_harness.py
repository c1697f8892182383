"""The tiny Qwen3-MoE reference of the MoE tests (test_moe, test_moe_lora,
test_moe_metrics) and its random expert adapters.

Sizes: MH's V, D and dense F; LAYERS layers, layer 0 dense (mlp_only_layers), 1 and 2 MoE;
EXPERTS experts of width FE, TOP_K per token.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from helpers import model_harness as MH
from helpers.hf_models import tiny_hf
from jcp import lora as lora_lib

HEADS, KV_HEADS, HEAD_DIM, EXPERTS, TOP_K, FE = 8, 4, 16, 8, 2, 32
LAYERS = 3  # layer 0 dense, 1 and 2 MoE
MOE_LAYERS = (1, 2)  # the model layers of hf_moe that are MoE
RANK, ALPHA = 4, 8.0  # of the random expert adapters


def hf_moe(norm_topk_prob: bool, seed: int = 0):
    """The random tiny Qwen3MoeForCausalLM (fp32, eval), routers decisive (0.3·N)."""
    return tiny_hf(
        "qwen3_moe",
        seed=seed,
        vocab_size=MH.V,
        hidden_size=MH.D,
        intermediate_size=MH.F,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        moe_intermediate_size=FE,
        norm_topk_prob=norm_topk_prob,
        mlp_only_layers=[0],
    )


@functools.cache
def model(tmp):
    """(hf_moe(True), its saved folder under tmp)."""
    hm = hf_moe(True)
    return hm, MH.save(hm, f"{tmp}/moe_lora")


def random_adapter(cfg, expert_lora, seed):
    """Nonzero factors of every target in lora.adapter_shapes' layout."""
    rng = np.random.default_rng(seed)
    targets = lora_lib.resolve_targets(None, cfg)
    shapes = lora_lib.adapter_shapes(cfg, RANK, targets, expert_lora)
    return {
        m: {k: (0.15 * rng.standard_normal(s)).astype(np.float32) for k, s in ks.items()}
        for m, ks in shapes.items()
    }


def install(tr, tree, expert_lora):
    a = tr.create_adapter(rank=RANK, alpha=ALPHA, expert_lora=expert_lora)
    tr.state.install(a, tr.adapters[a], tree)
    return a


def merged(params64, tree, scale, leaves):
    """functional_call overrides: every targeted weight with its LoRA merged in (torch)."""
    t = {m: {k: leaves[(id(tree), m, k)] for k in ab} for m, ab in tree.items()}
    out = {}
    for li in range(LAYERS):
        for m in lora_lib.ATTN:
            name = f"model.layers.{li}.self_attn.{m}.weight"
            out[name] = params64[name] + scale * (t[m]["a"][li] @ t[m]["b"][li]).T
    for j, li in enumerate(MOE_LAYERS):

        def per_expert(m, key):
            if key == "a" and set(t[m]) == {"b"}:  # fused_gate_up: up's A is gate's leaf
                m = "expert_gate"
            x = t[m][key][j] if key in t[m] else t[m][key + "_shared"][j]
            return x if x.dim() == 3 else x.expand(EXPERTS, *x.shape)

        d = {
            m: scale * torch.einsum("eir,ero->eoi", per_expert(m, "a"), per_expert(m, "b"))
            for m in lora_lib.EXPERT
        }
        gu = f"model.layers.{li}.mlp.experts.gate_up_proj"  # [E, 2F, D], gate rows first
        out[gu] = params64[gu] + torch.cat([d["expert_gate"], d["expert_up"]], dim=1)
        dn = f"model.layers.{li}.mlp.experts.down_proj"  # [E, D, F]
        out[dn] = params64[dn] + d["expert_down"]
    out["lm_head.weight"] = (
        params64["lm_head.weight"] + scale * (t["lm_head"]["a"] @ t["lm_head"]["b"]).T
    )
    return out
