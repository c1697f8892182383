"""Hugging Face configs: which architectures jcp loads, and a config.json's fields as
QwenConfig's.

Owns the reading of a Hugging Face config (a dict, a config.json, or a model folder): the
architectures and model types jcp loads, a multimodal checkpoint's text model, the EOS ids
(generation_config.json first), the MoE and hybrid (Qwen3.5) fields, and the refusal of
what jcp does not implement (RoPE scaling, sliding windows, Qwen3's o_proj bias). Pure dict
work: it never builds a QwenConfig (jcp.config.config_from_hf does, and QwenConfig
validates the fields) and never reads weights (jcp.hf does).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

ARCHITECTURES = {
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen3_5ForCausalLM": "qwen3_5",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe",
}
# Image-text checkpoints whose text model jcp reads (text_config; weights under
# model.language_model., see hf.text_model_tensors): the causal LM each holds.
MULTIMODAL = {
    "Qwen3_5ForConditionalGeneration": "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeForCausalLM",
}


def _text_config(d: dict) -> dict:
    """A multimodal config (MULTIMODAL, or model_type qwen3_5 / qwen3_5_moe with a
    text_config) -> its text model's config as a causal LM's, the top level's
    tie_word_embeddings and eos_token_id winning (the top-level model owns lm_head)."""
    archs = d.get("architectures") or []
    causal = next((MULTIMODAL[a] for a in archs if a in MULTIMODAL), None)
    if causal is None and not archs and isinstance(d.get("text_config"), Mapping):
        causal = {"qwen3_5": "Qwen3_5ForCausalLM", "qwen3_5_moe": "Qwen3_5MoeForCausalLM"}.get(
            d.get("model_type")
        )
    if causal is None:
        return d
    text = d.get("text_config")
    if not isinstance(text, Mapping):
        raise ValueError(f"the {archs or d.get('model_type')} config lacks its text_config")
    out = {**text, "architectures": [causal]}
    for key in ("tie_word_embeddings", "eos_token_id"):
        if key in d:
            out[key] = d[key]
    return out


def _read_config(config) -> dict:
    if isinstance(config, Mapping):
        return dict(config)
    path = os.fspath(config)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"no Hugging Face config at {path}")
    with open(path) as f:
        return json.load(f)


def _eos_ids(d: dict, config) -> tuple[int, ...]:
    """The EOS ids: generation_config.json's eos_token_id (next to a config path) when
    present, else config.json's; an int or a list (Qwen lists several)."""
    eos = d.get("eos_token_id")
    if not isinstance(config, Mapping):
        path = os.fspath(config)
        folder = path if os.path.isdir(path) else os.path.dirname(path)
        gen = os.path.join(folder, "generation_config.json")
        if os.path.isfile(gen):
            with open(gen) as f:
                eos = json.load(f).get("eos_token_id", eos)
    if eos is None:
        return ()
    ids = eos if isinstance(eos, list) else [eos]
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise ValueError(f"eos_token_id must be a token id or a list of them, got {eos!r}")
    return tuple(dict.fromkeys(ids))


def _qwen3_5_fields(d: dict, rope: dict) -> dict:
    """Qwen3.5's hybrid fields of QwenConfig (text positions only: the mrope sections all
    see the same position, which is plain RoPE on the rotary dims)."""
    layers = d["num_hidden_layers"]
    kinds = d.get("layer_types") or [
        "linear_attention" if (i + 1) % d.get("full_attention_interval", 4) else "full_attention"
        for i in range(layers)
    ]
    if d.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {d.get('hidden_act')!r} is not supported (silu only)")
    return dict(
        layer_types=tuple(kinds),
        attn_output_gate=True,
        partial_rotary_factor=float(
            rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 0.25))
        ),
        linear_num_key_heads=d.get("linear_num_key_heads", 16),
        linear_num_value_heads=d.get("linear_num_value_heads", 32),
        linear_key_head_dim=d.get("linear_key_head_dim", 128),
        linear_value_head_dim=d.get("linear_value_head_dim", 128),
        linear_conv_kernel_dim=d.get("linear_conv_kernel_dim", 4),
    )


def _moe_fields(d: dict, kind: str) -> dict:
    """QwenConfig's MoE fields of a Hugging Face config of this kind ({} for a dense one)."""
    moe = {}
    if kind == "qwen3_moe":
        # transformers 5 writes num_local_experts (its attribute_map); published
        # checkpoints say num_experts.
        experts = d.get("num_experts", d.get("num_local_experts"))
        if experts is None:
            raise ValueError("the Hugging Face config lacks 'num_experts'")
        moe = dict(
            num_experts=experts,
            num_experts_per_tok=d.get("num_experts_per_tok"),
            moe_intermediate_size=d.get("moe_intermediate_size"),
            norm_topk_prob=bool(d.get("norm_topk_prob", False)),
            decoder_sparse_step=d.get("decoder_sparse_step", 1),
            mlp_only_layers=tuple(d.get("mlp_only_layers") or ()),
        )
    if kind == "qwen3_5_moe":
        # transformers' Qwen3_5MoeSparseMoeBlock: every layer MoE, top-k weights always
        # renormalised, plus a gated shared expert.
        moe = dict(
            num_experts=d.get("num_experts", d.get("num_local_experts")),
            num_experts_per_tok=d.get("num_experts_per_tok"),
            moe_intermediate_size=d.get("moe_intermediate_size"),
            norm_topk_prob=True,
            shared_expert_intermediate_size=d.get("shared_expert_intermediate_size", 0),
        )
        if None in moe.values():
            raise ValueError(f"the Hugging Face config lacks one of {sorted(moe)}")
    return moe


# model_type -> kind, for a config that names no architecture.
MODEL_TYPES = {
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3_moe",
    "qwen3_5_text": "qwen3_5",
    "qwen3_5_moe_text": "qwen3_5_moe",
}
# The kinds with Qwen3's per-head q/k RMSNorm (and no o_proj bias in jcp's decoder).
QK_NORM = ("qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_moe")


def qwen_fields(config) -> dict:
    """QwenConfig's fields (all but dtype) from a Hugging Face config: a dict, a
    config.json path, or a model folder. Refuses (ValueError) an architecture jcp does not
    load, a setting it does not implement, or a missing field."""
    d = _text_config(_read_config(config))
    kind = _kind(d)
    rope = d.get("rope_parameters") or {}
    hybrid = _qwen3_5_fields(d, rope) if kind in ("qwen3_5", "qwen3_5_moe") else {}
    theta = _rope_theta(d, rope)
    _refuse_unsupported(d, kind)
    moe = _moe_fields(d, kind)
    try:
        heads = d["num_attention_heads"]
        return dict(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            # Qwen3.5-MoE has no dense MLP width (every layer is MoE): the shared one's.
            intermediate_size=(
                d["intermediate_size"]
                if kind != "qwen3_5_moe"
                else d.get("intermediate_size") or moe["moe_intermediate_size"]
            ),
            num_layers=d["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rope_theta=float(theta),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qk_norm=kind in QK_NORM,
            attention_bias=True if kind == "qwen2" else bool(d.get("attention_bias", False)),
            max_position_embeddings=d.get("max_position_embeddings", 32768),
            eos_token_ids=_eos_ids(d, config),
            **moe,
            **hybrid,
        )
    except KeyError as e:
        raise ValueError(f"the Hugging Face config lacks {e.args[0]!r}") from None


def _kind(d: dict) -> str:
    """The kind of model a (text) config describes: by its architectures, else (none
    named) its model_type."""
    archs = d.get("architectures") or []
    kind = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
    if kind is None and not archs:
        kind = MODEL_TYPES.get(d.get("model_type"))
    if kind is None:
        raise ValueError(
            f"unsupported architecture {archs or d.get('model_type')!r}; jcp loads "
            f"{sorted(ARCHITECTURES)}"
        )
    return kind


def _rope_theta(d: dict, rope: dict):
    """RoPE's base as the config writes it (top level or rope_parameters); any RoPE
    scaling is refused."""
    theta = d.get("rope_theta", rope.get("rope_theta"))
    if theta is None:
        raise ValueError(
            "the Hugging Face config has no rope_theta (nor rope_parameters.rope_theta)"
        )
    scaling = d.get("rope_scaling") or {}
    rope_type = scaling.get("rope_type", scaling.get("type")) or rope.get("rope_type", "default")
    if rope_type not in ("default", None):
        raise ValueError(f"rope scaling {rope_type!r} is not supported; jcp implements plain RoPE")
    return theta


def _refuse_unsupported(d: dict, kind: str) -> None:
    """Refuse the attention settings jcp's decoder does not implement."""
    if kind in QK_NORM and d.get("attention_bias"):
        # Qwen3's attention_bias also puts a bias on o_proj, which jcp's decoder lacks.
        raise ValueError(
            "Qwen3 with attention_bias (biases on q, k, v and o_proj) is not supported"
        )
    if d.get("use_sliding_window"):
        raise ValueError("sliding-window attention (use_sliding_window) is not supported")
