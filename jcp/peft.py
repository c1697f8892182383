"""PEFT LoRA adapters: key names, the torch layout, and reading and writing folders.

Owns everything about the PEFT format: `base_model.model.…lora_A.weight` names, lora_A
[r, I] / lora_B [O, r] (torch layout), adapter_config.json and adapter_model.safetensors.
It must never accept a file it would read inexactly — a config option that changes what
the tensors mean, a tensor it would not use, a malformed file — and never write a partial
file where a complete one stood (files are written aside and renamed into place).

Shapes: see the legend in jcp/mesh.py. An adapter tree is {module: {"a": [L, I, r],
"b": [L, r, O]}} over its target modules (lm_head without L), r its own rank; the expert
modules of a MoE model hold [Lm, E, I, r] / [Lm, E, r, O] per expert, or a shared
hidden-side factor (lora.expert_keys), over the Lm MoE layers. F here is the expert width
(moe_intermediate_size).

The experts in files. transformers 5 holds Qwen3-MoE experts as two fused 3-D parameters,
gate_up_proj [E, 2F, D] (gate rows first) and down_proj [E, D, F], and peft adapts them with
`target_parameters` (ParamWrapper): one LoRA per parameter, lora_A [r·E, I] with rows
ordered (expert, rank), lora_B [O, r·E] with columns ordered (rank, expert) (pack_experts),
scale alpha / r. A folder peft wrote is read as jcp's "fused_gate_up" adapter: gate and
up share that one A_e (a tied parameter, so it trains as peft trains it) and split B_e's
columns; it is written back the same way, at rank r. jcp's separate gate and up factors
(per_expert, shared_outer) are one LoRA over the fused [gate; up] output: at rank 2r with
A_e = [gate.A_e | up.A_e] and block-diagonal B_e, alpha 2·alpha through rank_pattern /
alpha_pattern (exactly what peft's own per-expert -> fused conversion writes); reading
such a file gives rank r back, gate and up untied. vLLM reads Qwen3-MoE adapters
as per-expert 2-D keys instead (write_vllm_folder).
"""

from __future__ import annotations

import json
import math
import os
import re

import numpy as np
from safetensors.numpy import save_file

from jcp import lora as lora_lib
from jcp.config import QwenConfig
from jcp.errors import InputError
from jcp.files import atomic_write
from jcp.hf import SafetensorsFile

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# What PEFT can name in target_modules (the expert modules are parameters, not modules).
PEFT_MODULES = lora_lib.ATTN + lora_lib.MLP + lora_lib.LINEAR + (lora_lib.HEAD,)
# peft's target_parameters for the fused experts, and the rank_pattern / alpha_pattern key
# its own per-expert -> fused conversion uses for gate_up.
GATE_UP, DOWN = "mlp.experts.gate_up_proj", "mlp.experts.down_proj"
GATE_UP_PATTERN = r".*\.gate_up_proj"
# Spellings of target_parameters that select exactly that parameter of every MoE layer.
_PARAM_NAMES = {
    n: full
    for full in (GATE_UP, DOWN)
    for n in (full, full.removeprefix("mlp."), full.rpartition(".")[2])
}
# vLLM's per-expert module names.
VLLM_EXPERT = {"expert_gate": "gate_proj", "expert_up": "up_proj", "expert_down": "down_proj"}


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


# ----------------------------------------------------------------------------------------
# The experts


def moe_layer_ids(cfg: QwenConfig) -> list[int]:
    """Model layer index of each MoE layer: MoE layer l is model layer moe_layer_ids[l]."""
    return [i for i, moe in enumerate(cfg.moe_layers) if moe]


def expert_key(layer: int, param: str, which: str, nested: bool) -> str:
    """PEFT's tensor name of lora_A ("a") or lora_B ("b") of fused expert parameter `param`
    (GATE_UP or DOWN) in model layer `layer`.

    peft wraps the experts module once per targeted parameter, in the order the module
    defines them (gate_up_proj, then down_proj), each wrapper around the previous one. With
    both targeted (nested) gate_up's wrapper is the inner one, `…experts.base_layer.lora_A`,
    and down's the outer, `…experts.lora_A`; a lone target is `…experts.lora_A`.
    """
    ab = {"a": "lora_A", "b": "lora_B"}[which]
    inner = ".base_layer" if nested and param == GATE_UP else ""
    return f"base_model.model.model.layers.{layer}.mlp.experts{inner}.{ab}.weight"


def pack_experts(a_ExIxr: np.ndarray, b_ExrxO: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-expert factors (jcp layout) -> peft's fused (lora_A [r·E, I], lora_B [O, r·E]).

    lora_A rows are ordered (expert, rank), lora_B columns (rank, expert), so expert e's
    delta weight [O, I] is lora_B[:, e::E] @ lora_A[e·r:(e+1)·r]. Example, E = 2, r = 2:
    lora_A rows [e0r0, e0r1, e1r0, e1r1]; lora_B columns [r0e0, r0e1, r1e0, r1e1].
    Inverse: unpack_experts.
    """
    e, i, r = a_ExIxr.shape
    lora_a = a_ExIxr.transpose(0, 2, 1).reshape(e * r, i)
    lora_b = b_ExrxO.transpose(2, 1, 0).reshape(b_ExrxO.shape[2], r * e)
    return np.ascontiguousarray(lora_a), np.ascontiguousarray(lora_b)


def unpack_experts(lora_a, lora_b, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of pack_experts: (lora_A [r·E, I], lora_B [O, r·E]) -> (a [E, I, r],
    b [E, r, O])."""
    r = lora_a.shape[0] // num_experts
    a_ExIxr = lora_a.reshape(num_experts, r, lora_a.shape[1]).transpose(0, 2, 1)
    b_ExrxO = lora_b.reshape(lora_b.shape[0], r, num_experts).transpose(2, 1, 0)
    return a_ExIxr, b_ExrxO


def per_expert(factors: dict, rank: int, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """One expert module's factors, either parameterisation (lora.expert_keys), at rank r
    -> (a [Lm, E, I, r], b [Lm, E, r, O]); a shared factor is repeated over the experts."""

    def get(which):
        if which in factors:
            return lora_lib.at_rank(which, np.asarray(factors[which]), rank)
        x = lora_lib.at_rank(which, np.asarray(factors[which + "_shared"]), rank)
        return np.broadcast_to(x[:, None], (x.shape[0], num_experts) + x.shape[1:])

    return get("a"), get("b")


def fuse_gate_up(gate, up) -> tuple[np.ndarray, np.ndarray]:
    """gate and up factors (a [E, D, r], b [E, r, F]; either may be None, not targeted)
    -> one LoRA over the fused [gate; up] output: (a [E, D, k], b [E, k, 2F]).

    Both: k = 2r, a = [gate.a | up.a], b = [[gate.b, 0], [0, up.b]] (block-diagonal), so
    x @ a @ b = [x @ gate.a @ gate.b, x @ up.a @ up.b]; the caller doubles alpha to keep
    the scale. One of them: k = r, the other half of b zero.
    """
    if gate is not None and up is not None:
        (ga, gb), (ua, ub) = gate, up
        e, r, f = gb.shape
        b = np.zeros((e, 2 * r, 2 * f), np.float32)
        b[:, :r, :f], b[:, r:, f:] = gb, ub
        return np.concatenate([ga, ua], axis=-1), b
    a, b = gate if gate is not None else up
    halves = [b, np.zeros_like(b)] if gate is not None else [np.zeros_like(b), b]
    return a, np.concatenate(halves, axis=-1)


def experts_to_peft(tree: dict, rank: int, experts, cfg: QwenConfig) -> dict[str, np.ndarray]:
    """The expert modules of an adapter tree (either parameterisation) -> peft's fused 3-D
    tensors of every MoE layer: gate_up at rank 2r when gate and up are both targeted (r
    when one is, or when they share A: fused_gate_up), down at rank r (see expert_key,
    pack_experts, fuse_gate_up)."""
    gate_up = [m for m in ("expert_gate", "expert_up") if m in experts]
    nested = bool(gate_up) and "expert_down" in experts
    tied = lora_lib.tree_expert_lora(tree) == "fused_gate_up"
    f = {
        m: per_expert(tree[m], rank, cfg.num_experts)
        for m in experts
        if not (tied and m == "expert_up")
    }
    out = {}
    for lm, li in enumerate(moe_layer_ids(cfg)):
        pairs = []
        if tied:  # already peft's one LoRA over [gate; up], at rank r
            up_b = lora_lib.at_rank("b", np.asarray(tree["expert_up"]["b"][lm]), rank)
            pairs.append(
                (
                    GATE_UP,
                    (f["expert_gate"][0][lm], np.concatenate([f["expert_gate"][1][lm], up_b], -1)),
                )
            )
        elif gate_up:
            pairs.append(
                (
                    GATE_UP,
                    fuse_gate_up(
                        *(
                            (f[m][0][lm], f[m][1][lm]) if m in f else None
                            for m in ("expert_gate", "expert_up")
                        )
                    ),
                )
            )
        if "expert_down" in f:
            pairs.append((DOWN, (f["expert_down"][0][lm], f["expert_down"][1][lm])))
        for param, (a, b) in pairs:
            lora_a, lora_b = pack_experts(np.asarray(a, np.float32), np.asarray(b, np.float32))
            out[expert_key(li, param, "a", nested)] = lora_a
            out[expert_key(li, param, "b", nested)] = lora_b
    return out


def vllm_key(layer: int, expert: int, module: str, which: str) -> str:
    """vLLM's per-expert 2-D tensor name of an expert module (what transformers 4 wrote)."""
    ab = {"a": "lora_A", "b": "lora_B"}[which]
    return (
        f"base_model.model.model.layers.{layer}.mlp.experts.{expert}."
        f"{VLLM_EXPERT[module]}.{ab}.weight"
    )


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
        if m in lora_lib.EXPERT:
            continue
        i, o = lora_lib.module_dims(cfg, m)
        ids = _layers(m, cfg.num_layers, cfg)
        lead = () if m == lora_lib.HEAD else (len(ids),)
        tree[m] = {
            "a": np.zeros(lead + (i, rank), np.float32),
            "b": np.zeros(lead + (rank, o), np.float32),
        }
        for row, li in enumerate(ids):
            for which, want in (("a", (rank, i)), ("b", (o, rank))):
                t = fetch(peft_key(m, li, which), want)
                dst = tree[m][which] if li is None else tree[m][which][row]
                dst[...] = t.T
        if m == lora_lib.QKV:  # split B into q, k, v columns (lora.LINEAR)
            cuts = np.cumsum(list(lora_lib.qkv_widths(cfg).values()))[:-1]
            b = tree[m].pop("b")
            tree[m].update(
                zip(lora_lib.QKV_B, map(np.ascontiguousarray, np.split(b, cuts, axis=-1)))
            )
    experts = [m for m in targets if m in lora_lib.EXPERT]
    if experts:
        tree.update(_experts_from_peft(fetch, cfg, rank, experts, gate_up_rank or rank, where))
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


def _experts_from_peft(
    fetch, cfg: QwenConfig, rank: int, experts, gate_up_rank: int, where: str
) -> dict:
    """The expert modules of from_peft: {module: {"a": [Lm, E, I, k], "b": [Lm, E, k, O]}},
    k each module's own rank (see from_peft)."""
    e, d, f = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    ids = moe_layer_ids(cfg)
    gate_up = [m for m in ("expert_gate", "expert_up") if m in experts]
    if len(gate_up) == 1:
        raise InputError(
            f"{where}: PEFT's fused gate_up holds the experts' gate and up "
            f"together; target both, not only {gate_up[0]}"
        )
    nested = bool(gate_up) and "expert_down" in experts

    def read(param, k, i, o):
        pairs = [
            unpack_experts(
                fetch(expert_key(li, param, "a", nested), (k * e, i)),
                fetch(expert_key(li, param, "b", nested), (o, k * e)),
                e,
            )
            for li in ids
        ]
        return np.stack([p[0] for p in pairs]), np.stack([p[1] for p in pairs])

    out = {}
    if gate_up:
        k = gate_up_rank
        a_LxExDxk, b_LxExkx2F = read(GATE_UP, k, d, 2 * f)
        h = k // 2
        if (
            k == 2 * rank
            and not np.any(b_LxExkx2F[:, :, :h, f:])
            and not np.any(b_LxExkx2F[:, :, h:, :f])
        ):
            out["expert_gate"] = {"a": a_LxExDxk[..., :h], "b": b_LxExkx2F[:, :, :h, :f]}
            out["expert_up"] = {"a": a_LxExDxk[..., h:], "b": b_LxExkx2F[:, :, h:, f:]}
        else:  # peft's own form: one A for gate and up, kept tied (fused_gate_up)
            out["expert_gate"] = {"a": a_LxExDxk, "b": b_LxExkx2F[..., :f]}
            out["expert_up"] = {"b": b_LxExkx2F[..., f:]}
    if "expert_down" in experts:
        a, b = read(DOWN, rank, f, d)
        out["expert_down"] = {"a": a, "b": b}
    return {m: {k: np.ascontiguousarray(x) for k, x in ab.items()} for m, ab in out.items()}


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


def _config(info, target_modules) -> dict:
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": info.rank,
        "lora_alpha": info.alpha,
        "target_modules": list(target_modules),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "layers_to_transform": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "init_lora_weights": True,
        "base_model_name_or_path": None,
        "inference_mode": True,
    }


def _write(path, cfg: QwenConfig, config: dict, weights: dict) -> None:
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    atomic_write(
        os.path.join(path, WEIGHTS_FILE),
        lambda p: save_file(
            {k: np.ascontiguousarray(v, np.float32) for k, v in weights.items()},
            p,
            metadata={"format": "pt", "jcp_base_fingerprint": cfg.fingerprint()},
        ),
    )
    atomic_write(os.path.join(path, CONFIG_FILE), json.dumps(config, indent=2))


def check_export_path(path, what: str) -> str:
    """path as a str where a folder can be written, or InputError naming `what`: not a
    path, a NUL byte, a component longer than the file-name limit, or an existing
    non-folder at the path or above it. Nothing is created."""
    try:
        path = os.fspath(path)
    except TypeError:
        raise InputError(f"{what} must be a path, got {type(path).__name__}") from None
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    if not path or "\0" in path:
        raise InputError(f"{what} {path!r} is empty or holds a NUL byte")
    for part in path.split(os.sep):
        if len(os.fsencode(part)) > 255:
            raise InputError(f"{what}: the name {part[:20]!r}... is longer than 255 bytes")
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        where = "" if probe == os.path.abspath(path) else f" (at {probe!r})"
        raise InputError(f"{what} {path!r} exists and is not a folder{where}")
    return path


def write_folder(path, cfg: QwenConfig, info, tree: dict) -> None:
    """A PEFT LoRA folder (adapter_config.json + adapter_model.safetensors) of an adapter
    tree; `info` has rank, alpha and targets.

    Expert modules (either parameterisation) are written as peft's target_parameters on
    the fused experts (experts_to_peft); with gate and up both targeted, gate_up is at rank
    2r and alpha 2·alpha through rank_pattern / alpha_pattern (same scale, exact), which
    peft 0.21 honours for target_parameters.
    """
    experts = [m for m in info.targets if m in lora_lib.EXPERT]
    config = _config(info, [m for m in info.targets if m not in lora_lib.EXPERT])
    if experts:
        gate_up = [m for m in ("expert_gate", "expert_up") if m in experts]
        config["target_parameters"] = ([GATE_UP] if gate_up else []) + (
            [DOWN] if "expert_down" in experts else []
        )
        if len(gate_up) == 2 and info.expert_lora != "fused_gate_up":
            config["rank_pattern"] = {GATE_UP_PATTERN: 2 * info.rank}
            config["alpha_pattern"] = {GATE_UP_PATTERN: 2 * info.alpha}
    _write(path, cfg, config, to_peft(tree, info.rank, info.targets, cfg.num_layers, cfg=cfg))


def write_vllm_folder(path, cfg: QwenConfig, info, tree: dict) -> None:
    """A LoRA folder in the per-expert 2-D layout vLLM loads for Qwen3-MoE (to_vllm):
    target_modules name the experts' gate_proj, up_proj, down_proj (plus the attention and
    lm_head targets), one rank and alpha, no target_parameters. peft on transformers 5
    reads it too (it fuses the experts as write_folder does). jcp does not read it back."""
    modules = [m for m in info.targets if m not in lora_lib.EXPERT]
    if set(info.targets) & set(lora_lib.EXPERT):
        modules += [VLLM_EXPERT[m] for m in lora_lib.EXPERT]
    _write(path, cfg, _config(info, modules), to_vllm(tree, info.rank, info.targets, cfg))


def _read_config(cfg_path: str) -> dict:
    try:
        with open(cfg_path, encoding="utf-8") as f:
            pc = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(f"{cfg_path} is not valid JSON ({e})") from None
    if not isinstance(pc, dict):
        raise InputError(f"{cfg_path} must hold a JSON object, got {type(pc).__name__}")
    return pc


def read_folder(path, cfg: QwenConfig, max_rank: int, is_base_head=None):
    """Read a PEFT LoRA folder -> (rank, alpha, targets, adapter tree at that rank);
    is_base_head as in from_peft.

    Refuses (InputError) what jcp cannot represent exactly: per-module rank or alpha
    patterns, biases, modules_to_save, DoRA, unknown target modules, missing, misshapen or
    unused tensors, malformed files. use_rslora is honoured by folding √r into alpha.
    On a MoE model the experts come from target_parameters (GATE_UP and / or DOWN, any
    other is refused, as are the dense MLP modules) and are read per expert (from_peft);
    rank_pattern / alpha_pattern may set the fused gate_up's rank and alpha only, at the
    adapter's scale (_gate_up_rank). The rank is r unless gate and up need more.
    """
    cfg_path, w_path = _folder_files(path)
    pc = _read_config(cfg_path)
    _refuse_options(pc, cfg_path, cfg.is_moe)
    rank, alpha, file_alpha = _rank_and_alpha(pc, cfg_path, max_rank)
    targets, gate_up_rank = _targets(pc, cfg, cfg_path, rank, file_alpha)
    tree = _read_tensors(w_path, cfg, rank, targets, is_base_head, gate_up_rank)
    full, alpha = _whole_rank(tree, rank, alpha, max_rank, cfg_path)
    return full, alpha, targets, tree


def _folder_files(path) -> tuple[str, str]:
    """(config path, weights path) of a PEFT folder; InputError unless both exist."""
    path = os.fspath(path)
    cfg_path = os.path.join(path, CONFIG_FILE)
    w_path = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(cfg_path) or not os.path.isfile(w_path):
        raise InputError(f"{path} is not a PEFT folder: it needs {CONFIG_FILE} and {WEIGHTS_FILE}")
    return cfg_path, w_path


def _refuse_options(pc: dict, cfg_path: str, moe: bool) -> None:
    """InputError for every adapter_config option that changes what the tensors mean."""
    if pc.get("peft_type", "LORA") != "LORA":
        raise InputError(f"{cfg_path}: peft_type {pc.get('peft_type')!r} is not LORA")
    for key in ("rank_pattern", "alpha_pattern"):
        if pc.get(key) and not moe:
            raise InputError(f"{cfg_path}: {key} is not supported (one rank and alpha per adapter)")
    # Each of these changes what the tensors mean (a bias on lora_B, a transposed layout,
    # other layers or parameters); read as plain LoRA they would give silently wrong results.
    for key in (
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
    ):
        if pc.get(key) and not (moe and key == "target_parameters"):
            raise InputError(f"{cfg_path}: {key} is not supported")
    if pc.get("bias", "none") != "none":
        raise InputError(f"{cfg_path}: bias {pc.get('bias')!r} is not supported")
    if pc.get("use_dora"):
        raise InputError(f"{cfg_path}: DoRA is not supported")


def _rank_and_alpha(pc: dict, cfg_path: str, max_rank: int) -> tuple[int, float, float]:
    """(r, alpha with rsLoRA's √r folded in, lora_alpha as the file has it)."""
    rank = pc.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise InputError(f"{cfg_path}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise InputError(f"{cfg_path}: rank {rank} exceeds max_rank {max_rank} of this Trainer")
    alpha = pc.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise InputError(f"{cfg_path}: lora_alpha must be a finite number, got {alpha!r}")
    file_alpha = alpha
    alpha = float(alpha)
    if pc.get("use_rslora"):
        alpha = alpha * math.sqrt(rank)  # rsLoRA scales by alpha/√r = (alpha·√r)/r
    return rank, alpha, file_alpha


def _targets(pc: dict, cfg: QwenConfig, cfg_path: str, rank: int, file_alpha):
    """(jcp target modules, the fused gate_up's rank or None) of target_modules and, on a
    MoE model, target_parameters."""
    moe = cfg.is_moe
    targets = pc.get("target_modules")
    if isinstance(targets, str):
        raise InputError(
            f"{cfg_path}: target_modules as a pattern ({targets!r}) is not "
            "supported; list the modules"
        )
    params = _target_parameters(pc.get("target_parameters"), cfg_path) if moe else []
    if params and targets is None:
        targets = []
    if (
        not isinstance(targets, list)
        or not (targets or params)
        or not all(isinstance(t, str) and t in PEFT_MODULES for t in targets)
    ):
        raise InputError(
            f"{cfg_path}: target_modules {targets!r} must be a non-empty list, a "
            f"subset of {list(PEFT_MODULES)}"
        )
    if not moe:
        try:
            return lora_lib.resolve_targets(targets, cfg), None
        except ValueError as e:
            raise InputError(f"{cfg_path}: {e}") from None
    dense_mlp = sorted(set(targets) & set(lora_lib.MLP))
    if dense_mlp:
        raise InputError(
            f"{cfg_path}: target_modules {dense_mlp} are dense MLP modules, which jcp does "
            "not adapt on a mixture-of-experts model; its experts are read from "
            f"target_parameters {[GATE_UP, DOWN]} (per-expert 2-D adapters, as vLLM and "
            "transformers 4 name them, are not read)"
        )
    gate_up_rank = _gate_up_rank(pc, cfg, cfg_path, rank, file_alpha, targets, params)
    experts = (("expert_gate", "expert_up") if GATE_UP in params else ()) + (
        ("expert_down",) if DOWN in params else ()
    )
    return lora_lib.resolve_targets(list(targets) + list(experts), cfg), gate_up_rank


def _read_tensors(
    w_path: str, cfg: QwenConfig, rank: int, targets, is_base_head, gate_up_rank
) -> dict:
    """The adapter tree of the safetensors file (from_peft); InputError naming the file."""
    try:
        f = SafetensorsFile(w_path)
    except ValueError as e:
        raise InputError(str(e)) from None
    tensors = {n: (lambda n: lambda: f.tensor(n))(n) for n in f.header}
    try:
        return from_peft(tensors, cfg, rank, targets, w_path, is_base_head, gate_up_rank)
    except ValueError as e:
        if isinstance(e, InputError):
            raise
        raise InputError(str(e)) from None


def _whole_rank(tree: dict, rank: int, alpha: float, max_rank: int, cfg_path: str):
    """(the tree's rank, alpha at it): r, unless a fused gate_up that is not jcp's
    block-diagonal form makes gate and up each keep its whole rank — every other module
    then zero-padded to it, alpha keeping alpha / rank."""
    full = tree_rank(tree)
    if full == rank:
        return full, alpha
    if full > max_rank:
        raise InputError(
            f"{cfg_path}: the experts' gate and up take rank {full} each "
            f"(the fused gate_up's, not jcp's block-diagonal form), which "
            f"exceeds max_rank {max_rank} of this Trainer"
        )
    return full, alpha * full / rank


def _target_parameters(names, cfg_path: str) -> list[str]:
    """A MoE folder's target_parameters -> the fused expert parameters it names (GATE_UP,
    DOWN); InputError for anything else."""
    if names is None or names == []:
        return []
    if not isinstance(names, list) or not all(
        isinstance(n, str) and n in _PARAM_NAMES for n in names
    ):
        raise InputError(
            f"{cfg_path}: target_parameters {names!r} is not supported; jcp "
            f"reads the experts of every MoE layer, {[GATE_UP, DOWN]}"
        )
    return sorted({_PARAM_NAMES[n] for n in names})


def _gate_up_rank(
    pc: dict, cfg: QwenConfig, cfg_path: str, rank: int, alpha, modules, params
) -> int | None:
    """The fused gate_up's rank under rank_pattern / alpha_pattern (None: not targeted).

    Patterns resolve as peft resolves them (the first key whose regex matches the whole
    name or a dotted suffix of it; module names as in the base model, "model.layers.1.
    self_attn.q_proj", parameters as "model.layers.1.mlp.experts.gate_up_proj"). Every
    target but gate_up must keep the adapter's r and alpha; gate_up may take any rank k
    whose scale equals the adapter's (alpha_k / k, or / √k under rsLoRA), the same in
    every layer — jcp's own export is k = 2r, alpha 2·alpha.
    """
    patterns = {}
    for key in ("rank_pattern", "alpha_pattern"):
        p = pc.get(key) or {}
        if not isinstance(p, dict):
            raise InputError(f"{cfg_path}: {key} must be an object, got {p!r}")
        patterns[key] = p

    def resolve(name):
        out = []
        for key, default in (("rank_pattern", rank), ("alpha_pattern", alpha)):
            for p, value in patterns[key].items():
                try:
                    hit = re.match(rf"(.*\.)?({p})$", name)
                except re.error as e:
                    raise InputError(
                        f"{cfg_path}: {key} key {p!r} is not a regular expression ({e})"
                    ) from None
                if hit:
                    out.append(value)
                    break
            else:
                out.append(default)
        return tuple(out)

    ids = moe_layer_ids(cfg)
    names = (
        [
            peft_key(m, i, "a").removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            for m in modules
            if m in lora_lib.ATTN + lora_lib.LINEAR
            for i in lora_lib.module_layer_ids(cfg, m)
        ]
        + (["lm_head"] if lora_lib.HEAD in modules else [])
        + [f"model.layers.{i}.{DOWN}" for i in ids if DOWN in params]
    )
    for name in names:
        if resolve(name) != (rank, alpha):
            raise InputError(
                f"{cfg_path}: rank_pattern / alpha_pattern give {name} rank and "
                f"alpha {resolve(name)}, not the adapter's ({rank}, {alpha}); jcp "
                f"holds one rank and alpha per adapter (a pattern may set only "
                f"{GATE_UP}, at the adapter's scale)"
            )
    if GATE_UP not in params:
        return None
    got = {resolve(f"model.layers.{i}.{GATE_UP}") for i in ids}
    if len(got) > 1:
        raise InputError(
            f"{cfg_path}: rank_pattern / alpha_pattern give {GATE_UP} different "
            f"ranks or alphas in different layers {sorted(got)}"
        )
    ((k, a),) = got
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise InputError(
            f"{cfg_path}: rank_pattern gives {GATE_UP} rank {k!r}, not a positive integer"
        )
    if isinstance(a, bool) or not isinstance(a, (int, float)) or not math.isfinite(a):
        raise InputError(
            f"{cfg_path}: alpha_pattern gives {GATE_UP} alpha {a!r}, not a finite number"
        )
    norm = math.sqrt if pc.get("use_rslora") else float
    if not math.isclose(a / norm(k), alpha / norm(rank), rel_tol=1e-9):
        raise InputError(
            f"{cfg_path}: {GATE_UP} at rank {k}, alpha {a} has another scale "
            f"than the adapter's (rank {rank}, alpha {alpha}); jcp holds one "
            "scale per adapter"
        )
    return k
