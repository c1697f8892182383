"""Multi-LoRA: stacked adapter slots, their initialisation, routing and PEFT names.

Owns the slot layout (`lora_a [L, G, in, R]`, `lora_b [L, G, R, out]` per target module,
lm_head without L), per-slot scaling, and the span routing used inside the model. It must
never copy adapter weights per token, and never hold base weights.

Legend: L layers; G slots; K active adapters of a micro-batch; S tokens on this shard;
I in features; O out features (local shards under tp); R max rank; D hidden; V vocab.
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


def resolve_targets(targets) -> tuple[str, ...]:
    """Target names or groups ("attn", "mlp", "unembed", "all") -> module names in order."""
    if targets is None:
        return ALL_MODULES
    if isinstance(targets, str):
        targets = (targets,)
    chosen = set()
    for t in targets:
        if t in TARGET_GROUPS:
            chosen.update(TARGET_GROUPS[t])
        elif t in ALL_MODULES:
            chosen.add(t)
        else:
            raise ValueError(f"unknown LoRA target {t!r}; expected modules {list(ALL_MODULES)} "
                             f"or groups {list(TARGET_GROUPS)}")
    if not chosen:
        raise ValueError("an adapter needs at least one target module")
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


def init_slot(cfg: QwenConfig, rank: int, max_rank: int, targets, seed: int) -> dict:
    """One adapter's weights as PEFT initialises them, padded to max_rank with zeros.

    A ~ U(±1/√in) (kaiming-uniform with a = √5, as PEFT), B = 0; untargeted modules are 0.
    Returns {module: {"a": [L, in, R], "b": [L, R, out]}} NumPy float32 (no L for lm_head).
    """
    rng = np.random.default_rng(seed)
    out = {}
    for m in ALL_MODULES:
        i, o = module_dims(cfg, m)
        lead = () if m == HEAD else (cfg.num_layers,)
        a = np.zeros(lead + (i, max_rank), np.float32)
        if m in targets:
            bound = 1.0 / np.sqrt(i)
            a[..., :rank] = rng.uniform(-bound, bound, lead + (i, rank)).astype(np.float32)
        out[m] = {"a": a, "b": np.zeros(lead + (max_rank, o), np.float32)}
    return out


@dataclasses.dataclass(frozen=True)
class Routing:
    """Which slots a micro-batch uses and which of this shard's tokens go to each.

    active_K: slot of each active adapter; spans_Kx2: [start, end) rows of this shard's
    stream routed to it (adapters are contiguous because packing sorts by adapter);
    scale_K: alpha / rank of each active slot.
    """

    active_K: jax.Array
    spans_Kx2: jax.Array
    scale_K: jax.Array

    def mask_SxK(self, s_len: int) -> jax.Array:
        t = jnp.arange(s_len)[:, None]
        return (t >= self.spans_Kx2[None, :, 0]) & (t < self.spans_Kx2[None, :, 1])


jax.tree_util.register_dataclass(Routing, data_fields=["active_K", "spans_Kx2", "scale_K"],
                                 meta_fields=[])


def take_active(slots: dict, active_K) -> dict:
    """Gather the active slots for the model: [G, L, …] -> [L, K, …]; lm_head [G, …] -> [K, …].

    Only K adapters are copied (not one per token); layers lead so lax.scan can slice them.
    """
    out = {}
    for m, ab in slots.items():
        picked = jax.tree.map(lambda x: jnp.take(x, active_K, axis=0), ab)
        out[m] = picked if m == HEAD else jax.tree.map(lambda x: jnp.moveaxis(x, 0, 1), picked)
    return out


def untake_active(active: dict) -> dict:
    """Inverse layout of take_active: [L, K, …] -> [K, L, …] (lm_head unchanged)."""
    return {m: ab if m == HEAD else jax.tree.map(lambda x: jnp.moveaxis(x, 1, 0), ab)
            for m, ab in active.items()}


def slot_specs_active() -> dict:
    """Specs of take_active's result inside the shard_map. [L, K, …] puts tp on the same
    axis as [G, L, …], so the slot table serves unchanged."""
    return slot_specs()


def low_rank_input(x_SxI, a_KxIxR, route: Routing):
    """(x @ A_k)·scale_k for each token's own adapter k, zero elsewhere: [S, K·R].

    Cost O(S·K·R·I) with K the adapters active in the batch, independent of the slot count.
    """
    s_len = x_SxI.shape[0]
    xa_SxKxR = jnp.einsum("si,kir->skr", x_SxI, a_KxIxR.astype(x_SxI.dtype),
                          preferred_element_type=jnp.float32)
    w_SxK = jnp.where(route.mask_SxK(s_len), route.scale_K[None, :], 0.0)
    return (xa_SxKxR * w_SxK[:, :, None]).reshape(s_len, -1)


def delta(x_SxI, a_KxIxR, b_KxRxO, route: Routing):
    """LoRA update of each token by its own adapter: [S, O]."""
    u = low_rank_input(x_SxI, a_KxIxR, route)
    b = b_KxRxO.reshape(-1, b_KxRxO.shape[-1])
    return jnp.einsum("sr,ro->so", u.astype(x_SxI.dtype), b.astype(x_SxI.dtype),
                      preferred_element_type=jnp.float32).astype(x_SxI.dtype)


# ----------------------------------------------------------------------------------------
# PEFT names and layout


def peft_key(module: str, layer: int | None, which: str) -> str:
    ab = {"a": "lora_A", "b": "lora_B"}[which]
    if module == HEAD:
        return f"base_model.model.lm_head.{ab}.weight"
    sub = "self_attn" if module in ATTN else "mlp"
    return f"base_model.model.model.layers.{layer}.{sub}.{module}.{ab}.weight"


def to_peft(slot: dict, rank: int, targets, num_layers: int) -> dict[str, np.ndarray]:
    """One slot {module: {"a": [L?, in, R], "b": [L?, R, out]}} -> PEFT dict (torch layout).

    lora_A [r, in], lora_B [out, r] at the adapter's own rank, only its target modules.
    """
    out = {}
    for m in targets:
        a, b = np.asarray(slot[m]["a"]), np.asarray(slot[m]["b"])
        layers = [None] if m == HEAD else range(num_layers)
        for li in layers:
            al = a if li is None else a[li]
            bl = b if li is None else b[li]
            out[peft_key(m, li, "a")] = np.ascontiguousarray(al[:, :rank].T)
            out[peft_key(m, li, "b")] = np.ascontiguousarray(bl[:rank, :].T)
    return out
