"""Model configuration: QwenConfig, one frozen dataclass validated on construction, and
config_from_hf, a Hugging Face config made into one.

Never parses strings: reading a Hugging Face config's fields is jcp.hf_config's (its
ARCHITECTURES and MULTIMODAL are re-exported here); never reads weights (jcp.hf does).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

from jcp.hf_config import ARCHITECTURES, MULTIMODAL, qwen_fields


@dataclasses.dataclass(frozen=True)
class QwenConfig:
    """A Qwen2- or Qwen3-style decoder.

    qk_norm: Qwen3's per-head RMSNorm on q and k before RoPE.
    attention_bias: Qwen2's biases on q, k, v.
    Mixture of experts (Qwen3-MoE; num_experts = 0: every layer dense): layer i is MoE
    unless i is in mlp_only_layers or (i + 1) % decoder_sparse_step ≠ 0, as transformers
    decides; a MoE layer routes each token to num_experts_per_tok of num_experts SwiGLU
    experts of width moe_intermediate_size (weights renormalised when norm_topk_prob);
    dense layers use intermediate_size.
    Hybrid linear attention (Qwen3.5; layer_types () : every layer full attention):
    layer_types[i] is "full_attention" or "linear_attention" (Gated DeltaNet, with
    linear_num_key_heads / linear_num_value_heads heads of linear_key_head_dim /
    linear_value_head_dim, a depthwise causal conv of linear_conv_kernel_dim);
    attn_output_gate: q_proj also yields a per-head gate, the attention output is multiplied
    by sigmoid(gate); partial_rotary_factor: RoPE turns the first head_dim · factor dims.
    Qwen3.5's RMSNorm weights are stored as offsets (x · (1 + w)): jcp holds 1 + w.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qk_norm: bool = True
    attention_bias: bool = False
    max_position_embeddings: int = 32768
    dtype: str = "float32"
    # Tokens that end a sampled sequence by default (SamplingParams.stop=None); from
    # config.json / generation_config.json. Not part of the model's shape (fingerprint).
    eos_token_ids: tuple[int, ...] = ()
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    layer_types: tuple[str, ...] = ()
    attn_output_gate: bool = False
    partial_rotary_factor: float = 1.0
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4
    # Qwen3.5-MoE: every MoE layer also runs one shared SwiGLU expert of this width, its
    # output scaled by sigmoid(x · shared_expert_gate) (0: none).
    shared_expert_intermediate_size: int = 0

    def __post_init__(self):
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"QwenConfig.{name} must be a positive integer, got {v!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"QwenConfig.num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"QwenConfig.head_dim must be even for RoPE, got {self.head_dim}")
        if not self.rope_theta > 0:
            raise ValueError(f"QwenConfig.rope_theta must be positive, got {self.rope_theta}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"QwenConfig.rms_norm_eps must be positive, got {self.rms_norm_eps}")
        if not isinstance(self.eos_token_ids, tuple) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.vocab_size
            for t in self.eos_token_ids
        ):
            raise ValueError(
                f"QwenConfig.eos_token_ids must be a tuple of token ids in "
                f"[0, {self.vocab_size}), got {self.eos_token_ids!r}"
            )
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(
                f"QwenConfig.dtype must be 'float32' or 'bfloat16', got {self.dtype!r}"
            )
        self._check_moe()
        self._check_hybrid()

    def _check_hybrid(self):
        kinds = self.layer_types
        if not isinstance(kinds, tuple) or (
            kinds
            and (
                len(kinds) != self.num_layers
                or not set(kinds) <= {"full_attention", "linear_attention"}
            )
        ):
            raise ValueError(
                f"QwenConfig.layer_types must be () or a tuple of "
                f"{self.num_layers} of 'full_attention' / 'linear_attention', "
                f"got {kinds!r}"
            )
        if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim % 2 or not self.rotary_dim:
            raise ValueError(
                f"QwenConfig.partial_rotary_factor must be in (0, 1] and turn an "
                f"even number of dims, got {self.partial_rotary_factor!r}"
            )
        if not self.is_hybrid:
            return
        if self.is_moe and not all(self.moe_layers):
            raise ValueError(
                "a hybrid (linear attention) mixture-of-experts model must have "
                "MoE MLPs in every layer (as Qwen3.5-MoE), got mlp_only_layers="
                f"{self.mlp_only_layers!r}, decoder_sparse_step="
                f"{self.decoder_sparse_step!r}"
            )
        for name in (
            "linear_num_key_heads",
            "linear_num_value_heads",
            "linear_key_head_dim",
            "linear_value_head_dim",
            "linear_conv_kernel_dim",
        ):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(
                    f"QwenConfig.{name} must be a positive integer for linear "
                    f"attention layers, got {v!r}"
                )
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(
                f"QwenConfig.linear_num_value_heads ({self.linear_num_value_heads})"
                f" must be a multiple of linear_num_key_heads "
                f"({self.linear_num_key_heads})"
            )

    @property
    def is_hybrid(self) -> bool:
        """Whether some layers are linear attention (Gated DeltaNet)."""
        return "linear_attention" in self.layer_types

    @property
    def linear_layers(self) -> tuple[bool, ...]:
        """Whether each layer is a linear-attention layer."""
        return tuple(t == "linear_attention" for t in self.layer_types) or (
            (False,) * self.num_layers
        )

    @property
    def rotary_dim(self) -> int:
        """Dims of each head that RoPE turns (the first ones)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    def _check_moe(self):
        for name in (
            "num_experts",
            "num_experts_per_tok",
            "moe_intermediate_size",
            "shared_expert_intermediate_size",
        ):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"QwenConfig.{name} must be a non-negative integer, got {v!r}")
        step = self.decoder_sparse_step
        if not isinstance(step, int) or isinstance(step, bool) or step < 1:
            raise ValueError(
                f"QwenConfig.decoder_sparse_step must be a positive integer, got {step!r}"
            )
        if not isinstance(self.norm_topk_prob, bool):
            raise ValueError(
                f"QwenConfig.norm_topk_prob must be a bool, got {self.norm_topk_prob!r}"
            )
        only = self.mlp_only_layers
        if not isinstance(only, tuple) or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < self.num_layers
            for i in only
        ):
            raise ValueError(
                f"QwenConfig.mlp_only_layers must be a tuple of layer indices in "
                f"[0, {self.num_layers}), got {only!r}"
            )
        if self.num_experts == 0:
            return
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"QwenConfig.num_experts_per_tok must be in [1, num_experts="
                f"{self.num_experts}], got {self.num_experts_per_tok}"
            )
        if self.moe_intermediate_size < 1:
            raise ValueError("QwenConfig.moe_intermediate_size must be positive for a MoE model")
        if self.shared_expert_intermediate_size and not self.num_experts:
            raise ValueError("QwenConfig.shared_expert_intermediate_size needs num_experts > 0")

    @property
    def moe_layers(self) -> tuple[bool, ...]:
        """Whether each layer is a MoE layer (transformers' Qwen3MoeDecoderLayer rule)."""
        return tuple(
            self.num_experts > 0
            and i not in self.mlp_only_layers
            and (i + 1) % self.decoder_sparse_step == 0
            for i in range(self.num_layers)
        )

    @property
    def is_moe(self) -> bool:
        return any(self.moe_layers)

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def tiny(cls, **overrides) -> QwenConfig:
        """A small Qwen3-style config for tests and the demo job."""
        base = dict(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            head_dim=16,
            rope_theta=10_000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            qk_norm=True,
            attention_bias=False,
            max_position_embeddings=4096,
        )
        base.update(overrides)
        return cls(**base)

    @classmethod
    def tiny_moe(cls, **overrides) -> QwenConfig:
        """A small Qwen3-MoE config (8 experts, top 2; layer 0 dense) for tests and demos."""
        base = dict(
            num_layers=3,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            mlp_only_layers=(0,),
        )
        base.update(overrides)
        return cls.tiny(**base)

    @classmethod
    def tiny_qwen3_5(cls, **overrides) -> QwenConfig:
        """A small Qwen3.5-style hybrid: layers 0–2 Gated DeltaNet (2 key heads, 4 value
        heads), layer 3 gated full attention with RoPE on a quarter of each head."""
        base = dict(
            num_layers=4,
            layer_types=("linear_attention",) * 3 + ("full_attention",),
            attn_output_gate=True,
            partial_rotary_factor=0.25,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=8,
            linear_conv_kernel_dim=4,
        )
        base.update(overrides)
        return cls.tiny(**base)

    @classmethod
    def tiny_qwen3_5_moe(cls, **overrides) -> QwenConfig:
        """tiny_qwen3_5 with a Qwen3.5-MoE MLP in every layer: 8 experts, top 2
        (renormalised), and a shared expert of width 48."""
        base = dict(
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            shared_expert_intermediate_size=48,
        )
        base.update(overrides)
        return cls.tiny_qwen3_5(**base)

    @classmethod
    def from_hf(cls, config) -> QwenConfig:
        """From a Hugging Face config: a dict, a config.json path, or a model folder."""
        return config_from_hf(config)

    def check_mesh(self, tp: int) -> None:
        """Raise a clear error when tensor parallelism tp cannot split this model."""
        for name, n in (
            ("num_kv_heads", self.num_kv_heads),
            ("num_heads", self.num_heads),
            ("intermediate_size", self.intermediate_size),
            ("vocab_size", self.vocab_size),
        ):
            if n % tp:
                raise ValueError(f"tp={tp} does not divide {name}={n}; choose tp dividing it")
        if self.is_hybrid:
            for name in ("linear_num_key_heads", "linear_num_value_heads"):
                if getattr(self, name) % tp:
                    raise ValueError(
                        f"tp={tp} does not divide {name}={getattr(self, name)}; "
                        "choose tp dividing it"
                    )
        if self.shared_expert_intermediate_size % tp:
            raise ValueError(
                f"tp={tp} does not divide shared_expert_intermediate_size="
                f"{self.shared_expert_intermediate_size}; choose tp dividing it"
            )
        if self.is_moe and self.num_experts % tp:
            # Experts are split whole over tp (E/tp per rank), never cut inside.
            raise ValueError(
                f"tp={tp} does not divide num_experts={self.num_experts}; choose tp dividing it"
            )

    def fingerprint(self) -> str:
        """A stable hash of everything that shapes the base model (not its dtype)."""
        d = dataclasses.asdict(self)
        d.pop("dtype")
        d.pop("eos_token_ids")
        if not self.shared_expert_intermediate_size:
            d.pop("shared_expert_intermediate_size")
        if not self.num_experts:  # dense configs keep the fingerprint they had before MoE
            for k in (
                "num_experts",
                "num_experts_per_tok",
                "moe_intermediate_size",
                "norm_topk_prob",
                "decoder_sparse_step",
                "mlp_only_layers",
            ):
                d.pop(k)
        if not self.layer_types and not self.attn_output_gate and self.partial_rotary_factor == 1:
            for k in (
                "layer_types",
                "attn_output_gate",
                "partial_rotary_factor",
                "linear_num_key_heads",
                "linear_num_value_heads",
                "linear_key_head_dim",
                "linear_value_head_dim",
                "linear_conv_kernel_dim",
            ):
                d.pop(k)  # older configs keep their fingerprint
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def config_from_hf(config, dtype: str = "float32") -> QwenConfig:
    """QwenConfig from a Hugging Face config (dict, config.json, or model folder)."""
    return QwenConfig(**qwen_fields(config), dtype=dtype)


__all__ = ["ARCHITECTURES", "MULTIMODAL", "QwenConfig", "config_from_hf"]
