"""The experts of a Qwen3-MoE adapter in files: peft's fused 3-D parameters (gate_up_proj,
down_proj through `target_parameters`, lora_A rows ordered (expert, rank), lora_B columns
(rank, expert): pack_experts) and vLLM's per-expert 2-D keys (vllm_key), to and from jcp's
expert factors (per_expert, shared_outer, fused_gate_up). See jcp/peft/__init__.py for the
layouts.

Shapes: see the legend in jcp/mesh.py; F is the expert width (moe_intermediate_size).
"""

from __future__ import annotations

import numpy as np

from jcp import lora as lora_lib
from jcp.config import QwenConfig
from jcp.errors import InputError

# peft's target_parameters for the fused experts, and the rank_pattern / alpha_pattern key
# its own per-expert -> fused conversion uses for gate_up.
GATE_UP, DOWN = "mlp.experts.gate_up_proj", "mlp.experts.down_proj"
GATE_UP_PATTERN = r".*\.gate_up_proj"

# vLLM's per-expert module names.
VLLM_EXPERT = {"expert_gate": "gate_proj", "expert_up": "up_proj", "expert_down": "down_proj"}


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


def experts_from_peft(
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
