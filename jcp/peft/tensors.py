"""PEFT tensors to and from jcp's adapter trees: `base_model.model.…lora_A.weight` names
(peft_key), lora_A [r, I] / lora_B [O, r] (torch layout), the vLLM export (to_vllm), the rank
of a tree. It reads and writes no file (folder.py does).

Shapes: see the legend in jcp/mesh.py (an adapter tree: jcp/peft/__init__.py).
"""

from __future__ import annotations

import numpy as np

from jcp import lora as lora_lib
from jcp.config import QwenConfig
from jcp.errors import InputError
from jcp.peft.experts import (
    experts_from_peft,
    experts_to_peft,
    moe_layer_ids,
    per_expert,
    vllm_key,
)


def peft_key(module: str, layer: int | None, which: str) -> str:
    """PEFT's tensor name of lora_A ("a") or lora_B ("b") of a module in a layer."""
    ab = {"a": "lora_A", "b": "lora_B"}[which]
    if module == lora_lib.HEAD:
        return f"base_model.model.lm_head.{ab}.weight"
    sub = (
        "self_attn"
        if module in lora_lib.ATTN
        else "linear_attn"
        if module in lora_lib.LINEAR
        else "mlp"
    )
    return f"base_model.model.model.layers.{layer}.{sub}.{module}.{ab}.weight"


def _layers(module: str, num_layers: int, cfg: QwenConfig | None = None):
    """The HF layer index of each row of a module's stacked factors (None: lm_head)."""
    if module == lora_lib.HEAD:
        return [None]
    return lora_lib.module_layer_ids(cfg, module) if cfg is not None else range(num_layers)


def _b_of(ab: dict) -> np.ndarray:
    """A module's whole B [.., R, O]: in_proj_qkv's b_q | b_k | b_v side by side."""
    keys = lora_lib.QKV_B if "b_q" in ab else ("b",)
    return np.concatenate([np.asarray(ab[k]) for k in keys], axis=-1)


def to_peft(
    tree: dict, rank: int, targets, num_layers: int, *, cfg: QwenConfig | None = None
) -> dict[str, np.ndarray]:
    """An adapter tree (at rank ≥ r) -> PEFT dict: lora_A [r, I], lora_B [O, r] of every
    target module and layer; expert modules as peft's fused 3-D parameters (experts_to_peft,
    which needs `cfg`)."""
    out = {}
    for m in targets:
        if m in lora_lib.EXPERT:
            continue
        a, b = np.asarray(tree[m]["a"]), _b_of(tree[m])
        for row, li in enumerate(_layers(m, num_layers, cfg)):
            al = a if li is None else a[row]
            bl = b if li is None else b[row]
            out[peft_key(m, li, "a")] = np.ascontiguousarray(al[:, :rank].T)
            out[peft_key(m, li, "b")] = np.ascontiguousarray(bl[:rank, :].T)
    experts = [m for m in targets if m in lora_lib.EXPERT]
    if experts:
        if cfg is None:
            raise ValueError(
                "to_peft: an adapter on the experts needs cfg (which layers are MoE layers)"
            )
        out.update(experts_to_peft(tree, rank, experts, cfg))
    return out


def to_vllm(tree: dict, rank: int, targets, cfg: QwenConfig) -> dict[str, np.ndarray]:
    """An adapter tree -> the per-expert 2-D layout vLLM loads for Qwen3-MoE: attention and
    lm_head as to_peft, every expert e of every MoE layer with lora_A [r, I], lora_B [O, r]
    for each of gate_proj, up_proj, down_proj. vLLM packs all three of every expert, so an
    untargeted one is written as zeros (no change to the model)."""
    out = to_peft(tree, rank, [m for m in targets if m not in lora_lib.EXPERT], cfg.num_layers)
    if not set(targets) & set(lora_lib.EXPERT):
        return out
    for m in lora_lib.EXPERT:
        if m in targets and set(tree[m]) == {"b"}:  # fused_gate_up: up's A is gate's
            a = per_expert(tree["expert_gate"], rank, cfg.num_experts)[0]
            b = per_expert({"a": a, "b": tree[m]["b"]}, rank, cfg.num_experts)[1]
        elif m in targets:
            a, b = per_expert(tree[m], rank, cfg.num_experts)
        else:
            i, o = lora_lib.module_dims(cfg, m)
            lead = (len(moe_layer_ids(cfg)), cfg.num_experts)
            a, b = np.zeros(lead + (i, rank), np.float32), np.zeros(lead + (rank, o), np.float32)
        for lm, li in enumerate(moe_layer_ids(cfg)):
            for e in range(cfg.num_experts):
                out[vllm_key(li, e, m, "a")] = np.ascontiguousarray(a[lm, e].T)
                out[vllm_key(li, e, m, "b")] = np.ascontiguousarray(b[lm, e].T)
    return out


# peft's save_pretrained also writes the base unembedding when lm_head is a target
# (save_embedding_layers): loading such a folder restores that weight, so it is accepted
# only when it is this model's own.
BASE_HEAD_KEY = "base_model.model.lm_head.base_layer.weight"


def from_peft(
    tensors,
    cfg: QwenConfig,
    rank: int,
    targets,
    where: str,
    is_base_head=None,
    gate_up_rank: int | None = None,
) -> dict:
    """Inverse of to_peft: {PEFT name: array (or loader)} -> adapter tree.

    Accepts peft's on-disk names with or without the adapter name (".default.weight").
    Refuses (InputError naming `where` and the tensor) a missing, misshapen or non-finite
    tensor, and any tensor it would not use: a layer past the model's depth, a module
    outside `targets`, an unknown name. A saved base unembedding (BASE_HEAD_KEY, torch
    layout [V, D]) is accepted when is_base_head(array) says it equals this model's.

    Expert modules (a MoE cfg) come back per expert. The fused gate_up is read at
    gate_up_rank k (default r) and gives gate and up alike (targets hold both): when
    k = 2r and every expert's B is block-diagonal (fuse_gate_up's form) gate and up get
    rank r back (per_expert); otherwise they keep the one A (expert_up holds only its B
    half, gate's the first F columns: fused_gate_up), at rank k. The tree's rank is then
    max(r, k), every module zero-padded to it (exact).
    """

    def plain(name):
        return name.replace(".default.weight", ".weight")

    by_name = {plain(n): n for n in tensors}
    tree, used = {}, set()

    def fetch(key, want):
        if key not in by_name:
            raise InputError(f"{where}: tensor {key} is missing")
        used.add(key)
        t = tensors[by_name[key]]
        t = np.asarray(t() if callable(t) else t, np.float32)
        if t.shape != want:
            raise InputError(f"{where}: tensor {key} has shape {t.shape}, expected {want}")
        if not np.all(np.isfinite(t)):
            raise InputError(f"{where}: tensor {key} has non-finite values")
        return t

    for m in targets:
        if m not in lora_lib.EXPERT:
            tree[m] = _module_from_peft(fetch, cfg, m, rank)
    experts = [m for m in targets if m in lora_lib.EXPERT]
    if experts:
        tree.update(experts_from_peft(fetch, cfg, rank, experts, gate_up_rank or rank, where))
        tree = _pad_rank(tree, tree_rank(tree))
    if BASE_HEAD_KEY in by_name and lora_lib.HEAD in targets and is_base_head is not None:
        t = tensors[by_name[BASE_HEAD_KEY]]
        t = np.asarray(t() if callable(t) else t)
        if t.shape != (cfg.vocab_size, cfg.hidden_size) or not is_base_head(t):
            raise InputError(
                f"{where}: tensor {BASE_HEAD_KEY} is not this base model's "
                "unembedding; jcp keeps the base weights frozen"
            )
        used.add(BASE_HEAD_KEY)
    extra = sorted(set(by_name) - used)
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise InputError(
            f"{where}: tensor {by_name[extra[0]]}{more} is not used by an adapter "
            f"of this model ({cfg.num_layers} layers, target modules "
            f"{list(targets)}); refusing to drop it silently"
        )
    return tree


def _module_from_peft(fetch, cfg: QwenConfig, m: str, rank: int) -> dict:
    """One non-expert module's factors {"a": [L, I, r], "b": [L, r, O]} (lm_head without L;
    in_proj_qkv's B as its q, k, v columns), each tensor read by fetch(key, torch shape)."""
    i, o = lora_lib.module_dims(cfg, m)
    ids = _layers(m, cfg.num_layers, cfg)
    lead = () if m == lora_lib.HEAD else (len(ids),)
    ab = {
        "a": np.zeros(lead + (i, rank), np.float32),
        "b": np.zeros(lead + (rank, o), np.float32),
    }
    for row, li in enumerate(ids):
        for which, want in (("a", (rank, i)), ("b", (o, rank))):
            t = fetch(peft_key(m, li, which), want)
            dst = ab[which] if li is None else ab[which][row]
            dst[...] = t.T
    if m == lora_lib.QKV:  # split B into q, k, v columns (lora.LINEAR)
        cuts = np.cumsum(list(lora_lib.qkv_widths(cfg).values()))[:-1]
        b = ab.pop("b")
        ab.update(zip(lora_lib.QKV_B, map(np.ascontiguousarray, np.split(b, cuts, axis=-1))))
    return ab


def tree_rank(tree: dict) -> int:
    """The largest rank among an adapter tree's factors (its rank, once padded)."""
    return max(
        x.shape[-1] if k.startswith("a") else x.shape[-2]
        for ab in tree.values()
        for k, x in ab.items()
    )


def _pad_rank(tree: dict, rank: int) -> dict:
    """Every factor zero-padded to `rank` ("a*" on its last axis, "b*" second to last)."""

    def pad(k, x):
        axis = x.ndim - 1 if k.startswith("a") else x.ndim - 2
        width = [(0, 0)] * x.ndim
        width[axis] = (0, rank - x.shape[axis])
        return np.pad(x, width) if rank > x.shape[axis] else x

    return {m: {k: pad(k, x) for k, x in ab.items()} for m, ab in tree.items()}
