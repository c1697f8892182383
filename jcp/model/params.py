"""The base-parameter tree: names, shapes, PartitionSpecs, random initialisation, placement.

Owns what a checkpoint loader or a trainer needs to know about the base weights without
running the model (jcp.hf reads only this). It must never run a layer and never hold
device state beyond the arrays `place` returns.

Shapes: see the legend in jcp/mesh.py.
"""

from __future__ import annotations

import jax
import numpy as np

from jcp.config import QwenConfig
from jcp.mesh import SPECS, put

# Layer modules in the stacked `layers` tree: name -> spec field.
COLUMN = (
    "q_proj",
    "k_proj",
    "v_proj",
    "gate_proj",
    "up_proj",
    # Gated DeltaNet (hybrid models): in_proj_qkv held as its q, k, v parts (and the
    # conv's channels likewise) so that a column split gives each tp rank whole heads.
    "in_proj_q",
    "in_proj_k",
    "in_proj_v",
    "in_proj_z",
    "in_proj_b",
    "in_proj_a",
    "conv_q",
    "conv_k",
    "conv_v",
    "shared_gate",
    "shared_up",
)
ROW = ("o_proj", "down_proj", "out_proj", "shared_down")
# Qwen3.5-MoE's shared expert (in moe_mlp, beside the router and experts).
SHARED_EXPERT = ("shared_gate", "shared_up", "shared_down")
# Per-head vectors of Gated DeltaNet, split over tp with their heads.
HEAD_VECTORS = ("dt_bias", "a_log")
ATTENTION = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "q_bias",
    "k_bias",
    "v_bias",
    "q_norm",
    "k_norm",
)


def param_shapes(cfg: QwenConfig) -> dict:
    """The base-parameter tree as shapes. Projections are stored [in, out] (x @ W).

    A MoE config moves the MLP weights out of `layers` (which keeps attention and norms of
    all L layers) into `dense_mlp` ([Ld, …], its dense layers, if any) and `moe_mlp`
    (router [Lm, D, E], expert_gate / expert_up [Lm, E, D, F], expert_down [Lm, E, F, D]).
    """
    L, d, f, v = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    layers = {
        "input_norm": (L, d),
        "post_norm": (L, d),
        "q_proj": (L, d, cfg.q_dim),
        "k_proj": (L, d, cfg.kv_dim),
        "v_proj": (L, d, cfg.kv_dim),
        "o_proj": (L, cfg.q_dim, d),
        "gate_proj": (L, d, f),
        "up_proj": (L, d, f),
        "down_proj": (L, f, d),
    }
    if cfg.attention_bias:
        layers.update(q_bias=(L, cfg.q_dim), k_bias=(L, cfg.kv_dim), v_bias=(L, cfg.kv_dim))
    if cfg.qk_norm:
        layers.update(q_norm=(L, cfg.head_dim), k_norm=(L, cfg.head_dim))
    out = {"embed": (v, d), "final_norm": (d,), "layers": layers}
    if cfg.is_moe:
        # MLP weights stacked per kind of layer (layers[i] keeps attention and norms);
        # hidden_states scans each run of same-kind layers (decoder.kind_runs).
        dense = {m: layers.pop(m) for m in ("gate_proj", "up_proj", "down_proj")}
        lm, ld = sum(cfg.moe_layers), L - sum(cfg.moe_layers)
        if ld:
            out["dense_mlp"] = {m: (ld,) + s[1:] for m, s in dense.items()}
        e, fe = cfg.num_experts, cfg.moe_intermediate_size
        out["moe_mlp"] = {
            "router": (lm, d, e),
            "expert_gate": (lm, e, d, fe),
            "expert_up": (lm, e, d, fe),
            "expert_down": (lm, e, fe, d),
        }
        fs = cfg.shared_expert_intermediate_size
        if fs:  # Qwen3.5-MoE's shared expert, split over tp like a dense MLP
            out["moe_mlp"].update(
                shared_gate=(lm, d, fs),
                shared_up=(lm, d, fs),
                shared_down=(lm, fs, d),
                shared_expert_gate=(lm, d, 1),
            )
    if cfg.attn_output_gate:  # q_proj yields each head's query then its gate
        layers["q_proj"] = (L, d, 2 * cfg.q_dim)
    if cfg.is_hybrid:
        # Mixer weights stacked per kind (layers keeps norms and MLP of all L layers).
        lf = cfg.linear_layers.count(False)
        ll = L - lf
        if lf:
            out["full_attn"] = {m: (lf,) + layers[m][1:] for m in ATTENTION if m in layers}
        for m in ATTENTION:
            layers.pop(m, None)
        kd, vd, hv = cfg.linear_key_dim, cfg.linear_value_dim, cfg.linear_num_value_heads
        kc = cfg.linear_conv_kernel_dim
        out["linear_attn"] = {
            "in_proj_q": (ll, d, kd),
            "in_proj_k": (ll, d, kd),
            "in_proj_v": (ll, d, vd),
            "conv_q": (ll, kc, kd),
            "conv_k": (ll, kc, kd),
            "conv_v": (ll, kc, vd),
            "in_proj_z": (ll, d, vd),
            "in_proj_b": (ll, d, hv),
            "in_proj_a": (ll, d, hv),
            "dt_bias": (ll, hv),
            "a_log": (ll, hv),
            "gated_norm": (ll, cfg.linear_value_head_dim),
            "out_proj": (ll, vd, d),
        }
    if not cfg.tie_word_embeddings:
        out["lm_head"] = (d, v)
    return out


def param_specs(cfg: QwenConfig) -> dict:
    """The PartitionSpec of every base parameter, from the one table in mesh.py."""

    def layer_spec(name):
        if name in COLUMN:
            return SPECS.column_LxDxO
        if name in ROW:
            return SPECS.row_LxIxD
        if name.endswith("_bias") or name in HEAD_VECTORS:
            return SPECS.column_bias_LxO
        return SPECS.norm_LxD

    shapes = param_shapes(cfg)
    out = {
        "embed": SPECS.embed_VxD,
        "final_norm": SPECS.norm_D,
        "layers": {k: layer_spec(k) for k in shapes["layers"]},
    }
    if "lm_head" in shapes:
        out["lm_head"] = SPECS.unembed_DxV
    if "dense_mlp" in shapes:
        out["dense_mlp"] = {k: layer_spec(k) for k in shapes["dense_mlp"]}
    for group in ("full_attn", "linear_attn"):
        if group in shapes:
            out[group] = {k: layer_spec(k) for k in shapes[group]}
    if "moe_mlp" in shapes:
        out["moe_mlp"] = {
            k: SPECS.router_LxDxE
            if k in ("router", "shared_expert_gate")
            else layer_spec(k)
            if k in SHARED_EXPERT
            else SPECS.experts_LxExIxO
            for k in shapes["moe_mlp"]
        }
    return out


def random_params(cfg: QwenConfig, seed: int = 0) -> dict:
    """Random host weights (NumPy float32) for tests and the demo: N(0, 0.02), norms ~1."""
    rng = np.random.default_rng(seed)

    def make(name, shape):
        if "norm" in name:
            return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        if name == "a_log":
            return np.log(rng.uniform(1.0, 16.0, shape)).astype(np.float32)
        if name.startswith("conv_"):
            return (0.3 * rng.standard_normal(shape)).astype(np.float32)
        return (0.02 * rng.standard_normal(shape)).astype(np.float32)

    return {
        k: {kk: make(kk, ss) for kk, ss in s.items()} if isinstance(s, dict) else make(k, s)
        for k, s in param_shapes(cfg).items()
    }


def place(tree_host, specs, mesh, dtype=None):
    """Host arrays (or lazy tensors) -> global arrays in their sharded layout (mesh.put:
    each device receives only its own slice, so no device ever holds a full replicated copy
    of a sharded weight, and every process reads only the slices of its own devices)."""
    return jax.tree.map(lambda x, spec: put(mesh, x, spec, dtype), tree_host, specs)


def check_shapes(cfg: QwenConfig, params) -> None:
    """Raise ValueError naming the first parameter whose shape differs from cfg's."""
    want = param_shapes(cfg)
    groups = {k for k, s in want.items() if isinstance(s, dict)}
    have_keys, want_keys = set(params) - groups, set(want) - groups
    if have_keys != want_keys or any(
        not isinstance(params.get(g), dict) or set(params[g]) != set(want[g]) for g in groups
    ):
        have = {
            g: sorted(params[g]) if isinstance(params.get(g), dict) else None
            for g in sorted(groups)
        }
        raise ValueError(
            f"base parameters do not match the config: expected {sorted(want_keys)} and "
            f"{ {g: sorted(want[g]) for g in sorted(groups)} }, got {sorted(have_keys)} and "
            f"{have}"
        )
    for k, s in want.items():
        for name, arr, ss in (
            [(f"{k}.{kk}", params[k][kk], sss) for kk, sss in s.items()]
            if k in groups
            else [(k, params[k], s)]
        ):
            if tuple(arr.shape) != ss:
                raise ValueError(
                    f"base parameter {name} has shape {tuple(arr.shape)}, expected {ss}"
                )
