"""Multi-LoRA: the slot layout, initialisation, target modules and span routing.

Owns the layout of the stacked slots (`a [G, L, I, R]`, `b [G, L, R, O]` per target
module, lm_head without L), PEFT's initialisation, and the span routing used inside the
model. It must never copy adapter weights per token, and never hold base weights or slot
arrays (jcp/adapter_state.py owns those).

Shapes: see the legend in jcp/mesh.py.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jcp.config import QwenConfig
from jcp.mesh import SPECS

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
LAYER_MODULES = ATTN + MLP
HEAD = "lm_head"
ALL_MODULES = LAYER_MODULES + (HEAD,)
# Row-parallel modules are split on their input under tp; the rest on their output.
ROW_PARALLEL = ("o_proj", "down_proj")

TARGET_GROUPS = {"attn": ATTN, "mlp": MLP, "unembed": (HEAD,), "all": ALL_MODULES}


def module_dims(cfg: QwenConfig, module: str) -> tuple[int, int]:
    """(in, out) features of a target module."""
    d, f = cfg.hidden_size, cfg.intermediate_size
    return {
        "q_proj": (d, cfg.q_dim), "k_proj": (d, cfg.kv_dim), "v_proj": (d, cfg.kv_dim),
        "o_proj": (cfg.q_dim, d), "gate_proj": (d, f), "up_proj": (d, f), "down_proj": (f, d),
        HEAD: (d, cfg.vocab_size),
    }[module]


def resolve_targets(targets, cfg: QwenConfig | None = None) -> tuple[str, ...]:
    """Target names or groups ("attn", "mlp", "unembed", "all") -> module names in order.

    ValueError for anything else (an unknown name, a non-string entry, an empty choice).
    For a MoE cfg the MLP modules are not adaptable yet (LoRA on the experts is a later
    step): the default and "all" are attention + unembedding, and naming an MLP module or
    the "mlp" group is refused.
    """
    moe = cfg is not None and cfg.is_moe
    if targets is None or (moe and targets in ("all", ["all"], ("all",))):
        return tuple(m for m in ALL_MODULES if m not in MLP) if moe else ALL_MODULES
    if isinstance(targets, str):
        targets = (targets,)
    if not isinstance(targets, (list, tuple)):
        raise ValueError(f"LoRA targets must be a list of module names or groups, got "
                         f"{targets!r}")
    chosen = set()
    for t in targets:
        if isinstance(t, str) and t in TARGET_GROUPS:
            chosen.update(TARGET_GROUPS[t])
        elif isinstance(t, str) and t in ALL_MODULES:
            chosen.add(t)
        else:
            raise ValueError(f"unknown LoRA target {t!r}; expected modules {list(ALL_MODULES)} "
                             f"or groups {list(TARGET_GROUPS)}")
    if not chosen:
        raise ValueError("an adapter needs at least one target module")
    if moe and chosen & set(MLP):
        raise ValueError(f"LoRA targets {sorted(chosen & set(MLP))} are MLP modules, which "
                         "jcp cannot adapt on a mixture-of-experts model yet; target "
                         "attention ('attn') and the unembedding ('unembed')")
    return tuple(m for m in ALL_MODULES if m in chosen)


def slot_shapes(cfg: QwenConfig, max_adapters: int, max_rank: int) -> dict:
    """{module: {"a": shape, "b": shape}} of the stacked slots, slot axis first."""
    out = {}
    for m in ALL_MODULES:
        i, o = module_dims(cfg, m)
        lead = (max_adapters,) if m == HEAD else (max_adapters, cfg.num_layers)
        out[m] = {"a": lead + (i, max_rank), "b": lead + (max_rank, o)}
    return out


def slot_specs() -> dict:
    """The PartitionSpec of every slot array, from the one table in mesh.py."""
    def spec(m):
        if m == HEAD:
            return {"a": SPECS.lora_a_head_GxDxR, "b": SPECS.lora_b_head_GxRxV}
        if m in ROW_PARALLEL:
            return {"a": SPECS.lora_a_row_GxLxIxR, "b": SPECS.lora_b_row_GxLxRxD}
        return {"a": SPECS.lora_a_column_GxLxDxR, "b": SPECS.lora_b_column_GxLxRxO}

    return {m: spec(m) for m in ALL_MODULES}


def init_adapter(cfg: QwenConfig, rank: int, targets, seed: int) -> dict:
    """One adapter's weights as PEFT initialises them, at its own rank over its targets.

    A ~ U(±1/√I) (kaiming-uniform with a = √5, as PEFT), B = 0. Returns {module: {"a":
    [L, I, r], "b": [L, r, O]}} NumPy float32 (no L for lm_head).
    """
    rng = np.random.default_rng(seed)
    out = {}
    for m in ALL_MODULES:
        if m not in targets:
            continue
        i, o = module_dims(cfg, m)
        lead = () if m == HEAD else (cfg.num_layers,)
        bound = 1.0 / np.sqrt(i)
        a = rng.uniform(-bound, bound, lead + (i, rank)).astype(np.float32)
        out[m] = {"a": a, "b": np.zeros(lead + (rank, o), np.float32)}
    return out


@dataclasses.dataclass(frozen=True)
class Routing:
    """Which slots a micro-batch uses and which of this shard's tokens go to each.

    active_A: slot of each active adapter; spans_Ax2: [start, end) rows of this shard's
    stream routed to it (adapters are contiguous because packing sorts by adapter);
    scale_A: alpha / rank of each active slot.
    """

    active_A: jax.Array
    spans_Ax2: jax.Array
    scale_A: jax.Array

    def mask_SxA(self, s_len: int) -> jax.Array:
        t = jnp.arange(s_len)[:, None]
        return (t >= self.spans_Ax2[None, :, 0]) & (t < self.spans_Ax2[None, :, 1])


jax.tree_util.register_dataclass(Routing, data_fields=["active_A", "spans_Ax2", "scale_A"],
                                 meta_fields=[])


def take_active(slots: dict, active_A) -> dict:
    """Gather the active slots for the model: [G, L, …] -> [L, A, …]; lm_head [G, …] -> [A, …].

    Only A adapters are copied (not one per token); layers lead so lax.scan can slice them.
    """
    out = {}
    for m, ab in slots.items():
        picked = jax.tree.map(lambda x: jnp.take(x, active_A, axis=0), ab)
        out[m] = picked if m == HEAD else jax.tree.map(lambda x: jnp.moveaxis(x, 0, 1), picked)
    return out


def untake_active(active: dict) -> dict:
    """Inverse layout of take_active: [L, A, …] -> [A, L, …] (lm_head unchanged)."""
    return {m: ab if m == HEAD else jax.tree.map(lambda x: jnp.moveaxis(x, 1, 0), ab)
            for m, ab in active.items()}


def slot_specs_active() -> dict:
    """Specs of take_active's result inside the shard_map. [L, A, …] puts tp on the same
    axis as [G, L, …], so the slot table serves unchanged."""
    return slot_specs()


def low_rank_input(x_SxI, a_AxIxR, route: Routing):
    """(x @ A_k)·scale_k for each token's own adapter k, zero elsewhere: [S, A·R].

    Cost O(S·A·R·I) with A the adapters active in the batch, independent of the slot count.
    """
    s_len = x_SxI.shape[0]
    n_a, i_len, rank = a_AxIxR.shape
    # One plain GEMM x [S, I] @ [I, A·R]. Contracting the middle axis of [A, I, R] directly
    # ("si,air->sar") makes XLA copy A into [I, A, R] inside the dot, where no caller can
    # reach it: per module and decode step (1.2–1.3× the decode time at A = 4, tiny model).
    # Written out, a loop can hold A as [I, A, R] and XLA folds the two transposes
    # (sample.make_decode does).
    a_IxAR = jnp.moveaxis(a_AxIxR, 0, 1).reshape(i_len, n_a * rank)
    xa_SxAR = jnp.einsum("si,ir->sr", x_SxI, a_IxAR.astype(x_SxI.dtype),
                         preferred_element_type=jnp.float32)
    w_SxA = jnp.where(route.mask_SxA(s_len), route.scale_A[None, :], 0.0)
    return (xa_SxAR.reshape(s_len, n_a, rank) * w_SxA[:, :, None]).reshape(s_len, -1)


def delta(x_SxI, a_AxIxR, b_AxRxO, route: Routing):
    """LoRA update of each token by its own adapter: [S, O]."""
    u = low_rank_input(x_SxI, a_AxIxR, route)
    b = b_AxRxO.reshape(-1, b_AxRxO.shape[-1])
    return jnp.einsum("sr,ro->so", u.astype(x_SxI.dtype), b.astype(x_SxI.dtype),
                      preferred_element_type=jnp.float32).astype(x_SxI.dtype)
