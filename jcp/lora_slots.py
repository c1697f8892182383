"""Multi-LoRA's slot layout: the target modules and their groups, each module's dims and
layer ids (per kind on hybrid models), the experts' parameterisations, the shapes and
PartitionSpecs of the stacked slots (`a [G, L, I, R]`, `b [G, L, R, O]` per module,
lm_head without L, an E axis for the experts) and of one adapter at its own rank, and
PEFT's initialisation.

Pure layout: no routing, no products (jcp.lora, which re-exports every name here), no
slot arrays (jcp/adapter_state.py).

Shapes: see the legend in jcp/mesh.py.
"""

from __future__ import annotations

import numpy as np

from jcp.config import QwenConfig
from jcp.mesh import SPECS

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
# Gated DeltaNet (Qwen3.5's linear attention). in_proj_qkv's output is q, k and v of
# different widths side by side, each split over tp by heads like the base in_proj_q / _k /
# _v: its B is held as three factors "b_q", "b_k", "b_v" (module_keys) so that every rank
# gets the columns of its own heads.
LINEAR = ("in_proj_qkv", "in_proj_z", "out_proj")
QKV = "in_proj_qkv"
QKV_B = ("b_q", "b_k", "b_v")
LAYER_MODULES = ATTN + MLP + LINEAR
# The experts of a MoE layer ([Lm] MoE layers, E experts each, see expert_keys).
EXPERT = ("expert_gate", "expert_up", "expert_down")
HEAD = "lm_head"
ALL_MODULES = LAYER_MODULES + EXPERT + (HEAD,)
# Row-parallel modules are split on their input under tp; the rest on their output.
ROW_PARALLEL = ("o_proj", "down_proj", "out_proj")

TARGET_GROUPS = {
    "attn": ATTN,
    "mlp": MLP,
    "linear_attn": LINEAR,
    "experts": EXPERT,
    "unembed": (HEAD,),
    "all": ALL_MODULES,
}
# How an adapter parameterises the experts: one factor pair per expert; Tinker's
# shared-outer scheme — the hidden-size side (gate.A, up.A, down.B) one factor shared by
# all experts of a layer, the other side per expert; or PEFT's fused gate_up — per expert,
# with gate and up sharing one A (peft's lora_A of gate_up_proj), what a PEFT folder holds.
EXPERT_LORA = ("shared_outer", "per_expert", "fused_gate_up")


def table_modules(cfg: QwenConfig) -> tuple[str, ...]:
    """The modules a slot table holds for this model: dense MLP modules on a dense model,
    the experts on a MoE model (its dense layers' MLPs, if any, are not adaptable); the
    Gated DeltaNet projections (LINEAR) on a hybrid (Qwen3.5) model only."""
    skip = (EXPERT if not cfg.is_moe else MLP) + (() if cfg.is_hybrid else LINEAR)
    if all(cfg.linear_layers):  # a hybrid without full-attention layers
        skip += ATTN
    return tuple(m for m in ALL_MODULES if m not in skip)


def module_dims(cfg: QwenConfig, module: str) -> tuple[int, int]:
    """(in, out) features of a target module (of one expert, for the expert modules).
    With an output gate q_proj yields each head's query and gate (2·Q·H); in_proj_qkv
    yields q, k (Hk·dk each) and v (H·dv)."""
    d, f, fe = cfg.hidden_size, cfg.intermediate_size, cfg.moe_intermediate_size
    q_out = 2 * cfg.q_dim if cfg.attn_output_gate else cfg.q_dim
    kd, vd = cfg.linear_key_dim, cfg.linear_value_dim
    return {
        "q_proj": (d, q_out),
        "k_proj": (d, cfg.kv_dim),
        "v_proj": (d, cfg.kv_dim),
        "o_proj": (cfg.q_dim, d),
        "gate_proj": (d, f),
        "up_proj": (d, f),
        "down_proj": (f, d),
        "in_proj_qkv": (d, 2 * kd + vd),
        "in_proj_z": (d, vd),
        "out_proj": (vd, d),
        "expert_gate": (d, fe),
        "expert_up": (d, fe),
        "expert_down": (fe, d),
        HEAD: (d, cfg.vocab_size),
    }[module]


def qkv_widths(cfg: QwenConfig) -> dict[str, int]:
    """Output width of each of in_proj_qkv's B factors: {"b_q": Hk·dk, "b_k": Hk·dk,
    "b_v": H·dv} (peft's lora_B is their concatenation, in this order)."""
    kd = cfg.linear_key_dim
    return dict(zip(QKV_B, (kd, kd, cfg.linear_value_dim)))


def module_layer_ids(cfg: QwenConfig, module: str) -> tuple[int, ...]:
    """The model layers a layer module's stacked factors [n, …] belong to, in order: on a
    hybrid model the attention modules live in its full-attention layers and the Gated
    DeltaNet ones in its linear-attention layers (the per-kind stacks of the base weights);
    otherwise every layer."""
    if cfg.is_hybrid and module in ATTN + LINEAR:
        want = module in LINEAR
        return tuple(i for i, lin in enumerate(cfg.linear_layers) if lin == want)
    return tuple(range(cfg.num_layers))


def expert_keys(module: str, mode: str | None) -> tuple[str, str]:
    """The factor keys an adapter holds for `module` under expert parameterisation `mode`.

    ("a", "b") except in_proj_qkv's ("a", "b_q", "b_k", "b_v") (see LINEAR) and on the
    hidden-size side of a shared-outer expert module: gate / up
    ("a_shared" [Lm, D, r], "b" [Lm, E, r, Fe]) and down ("a" [Lm, E, Fe, r], "b_shared"
    [Lm, r, D]). Under fused_gate_up, expert_up holds only "b": its A is expert_gate's
    (tied, so one parameter gets both gradients, as peft's fused gate_up lora_A does). A
    slot table holds all three keys of an expert module; an adapter's unused one stays
    exactly zero (the model reads only the key its mode selects).
    """
    if module == QKV:
        return ("a",) + QKV_B
    if mode == "fused_gate_up" and module == "expert_up":
        return ("b",)
    if module not in EXPERT or mode in ("per_expert", "fused_gate_up"):
        return ("a", "b")
    return ("a", "b_shared") if module == "expert_down" else ("a_shared", "b")


def tree_expert_lora(tree: dict) -> str | None:
    """The expert parameterisation an adapter tree's keys show (None without experts)."""
    if "expert_up" in tree and set(tree["expert_up"]) == {"b"}:
        return "fused_gate_up"
    for m in EXPERT:
        if m in tree:
            return "per_expert" if set(tree[m]) == {"a", "b"} else "shared_outer"
    return None


def at_rank(which: str, x, rank: int):
    """A factor cut to rank r: "a*" keys end in R, "b*" keys have R second to last."""
    return x[..., :rank] if which.startswith("a") else x[..., :rank, :]


def resolve_targets(targets, cfg: QwenConfig | None = None) -> tuple[str, ...]:
    """Target names or groups ("attn", "mlp", "experts", "unembed", "all") -> module names
    in order; default and "all": every module the model has (table_modules).

    ValueError for anything else (an unknown name, a non-string entry, an empty choice,
    the experts of a dense model, the dense MLP modules of a MoE model).
    """
    moe = cfg is not None and cfg.is_moe
    # "all" (and the default): what the model has; without a cfg, a dense model's modules.
    every = (
        table_modules(cfg)
        if cfg is not None
        else tuple(m for m in ALL_MODULES if m not in EXPERT + LINEAR)
    )
    if targets is None:
        return every
    if isinstance(targets, str):
        targets = (targets,)
    if not isinstance(targets, (list, tuple)):
        raise ValueError(f"LoRA targets must be a list of module names or groups, got {targets!r}")
    chosen = set()
    for t in targets:
        if t == "all":
            chosen.update(every)
        elif isinstance(t, str) and t in TARGET_GROUPS:
            chosen.update(TARGET_GROUPS[t])
        elif isinstance(t, str) and t in ALL_MODULES:
            chosen.add(t)
        else:
            raise ValueError(
                f"unknown LoRA target {t!r}; expected modules {list(ALL_MODULES)} "
                f"or groups {list(TARGET_GROUPS)}"
            )
    if not chosen:
        raise ValueError("an adapter needs at least one target module")
    if moe and chosen & set(MLP):
        raise ValueError(
            f"LoRA targets {sorted(chosen & set(MLP))} are dense MLP modules, "
            "which a mixture-of-experts model does not adapt; target its experts "
            "('experts'), attention ('attn') and the unembedding ('unembed')"
        )
    if cfg is not None and not cfg.is_hybrid and chosen & set(LINEAR):
        raise ValueError(
            f"LoRA targets {sorted(chosen & set(LINEAR))} are Gated DeltaNet "
            "modules, but this model has no linear-attention layers"
        )
    if cfg is not None and not moe and chosen & set(EXPERT):
        raise ValueError(
            f"LoRA targets {sorted(chosen & set(EXPERT))} are experts, but this "
            "is a dense model (no mixture-of-experts layers)"
        )
    return tuple(m for m in ALL_MODULES if m in chosen)


def factor_shapes(cfg: QwenConfig, module: str, rank: int, lead=(), modes=EXPERT_LORA) -> dict:
    """{key: shape} of every factor a slot table holds for `module` (lead: leading axes,
    e.g. (G,)). Layer modules [L, I, R] / [L, R, O]; lm_head without L; expert modules
    per expert [Lm, E, I, R] / [Lm, E, R, O] and the shared hidden-side factor [Lm, D, R]
    ("a_shared") or [Lm, R, D] ("b_shared") — the keys the expert parameterisations
    `modes` use (expert_keys): a table for shared-outer adapters only holds no per-expert
    hidden-side factor, the bulk of a per-expert adapter."""
    i, o = module_dims(cfg, module)
    if module == HEAD:
        return {"a": lead + (i, rank), "b": lead + (rank, o)}
    if module not in EXPERT:
        lead = lead + (len(module_layer_ids(cfg, module)),)
        if module == QKV:
            return {
                "a": lead + (i, rank),
                **{k: lead + (rank, w) for k, w in qkv_widths(cfg).items()},
            }
        return {"a": lead + (i, rank), "b": lead + (rank, o)}
    lead = lead + (sum(cfg.moe_layers),)
    e = cfg.num_experts
    shapes = {
        "a": lead + (e, i, rank),
        "b": lead + (e, rank, o),
        "a_shared": lead + (i, rank),
        "b_shared": lead + (rank, o),
    }
    keys = {k for mode in modes for k in expert_keys(module, mode)}
    return {k: s for k, s in shapes.items() if k in keys}


def slot_shapes(cfg: QwenConfig, max_adapters: int, max_rank: int, modes=EXPERT_LORA) -> dict:
    """{module: {key: shape}} of the stacked slots, slot axis first (factor_shapes)."""
    return {m: factor_shapes(cfg, m, max_rank, (max_adapters,), modes) for m in table_modules(cfg)}


def slot_specs(cfg: QwenConfig, modes=EXPERT_LORA) -> dict:
    """The PartitionSpec of every slot array, from the one table in mesh.py."""

    def spec(m):
        if m == HEAD:
            return {"a": SPECS.lora_a_head_GxDxR, "b": SPECS.lora_b_head_GxRxV}
        if m in EXPERT:
            keys = {k for mode in modes for k in expert_keys(m, mode)}
            return {
                k: s
                for k, s in (
                    ("a", SPECS.lora_expert_GxLxExIxR),
                    ("b", SPECS.lora_expert_GxLxExRxO),
                    ("a_shared", SPECS.lora_shared_GxLxIxR),
                    ("b_shared", SPECS.lora_shared_GxLxIxR),
                )
                if k in keys
            }
        if m in ROW_PARALLEL:
            return {"a": SPECS.lora_a_row_GxLxIxR, "b": SPECS.lora_b_row_GxLxRxD}
        bs = QKV_B if m == QKV else ("b",)
        return {"a": SPECS.lora_a_column_GxLxDxR, **{b: SPECS.lora_b_column_GxLxRxO for b in bs}}

    return {m: spec(m) for m in table_modules(cfg)}


def adapter_shapes(cfg: QwenConfig, rank: int, targets, expert_lora: str | None) -> dict:
    """{module: {key: shape}} of one adapter at its own rank over its targets: the factors
    its expert parameterisation uses (expert_keys), no slot axis."""
    return {
        m: {
            k: s for k, s in factor_shapes(cfg, m, rank).items() if k in expert_keys(m, expert_lora)
        }
        for m in targets
    }


def init_adapter(
    cfg: QwenConfig, rank: int, targets, seed: int, expert_lora: str | None = None
) -> dict:
    """One adapter's weights as PEFT initialises them, at its own rank over its targets.

    A ~ U(±1/√I) (kaiming-uniform with a = √5, as PEFT), B = 0: {module: {key: array}}
    NumPy float32 in adapter_shapes' layout (a shared A of the experts is drawn once).
    """
    rng = np.random.default_rng(seed)
    out = {}
    for m, shapes in adapter_shapes(cfg, rank, targets, expert_lora).items():
        bound = 1.0 / np.sqrt(module_dims(cfg, m)[0])
        out[m] = {
            k: (
                rng.uniform(-bound, bound, s).astype(np.float32)
                if k.startswith("a")
                else np.zeros(s, np.float32)
            )
            for k, s in shapes.items()
        }
    return out
