"""PEFT files of LoRA on the experts of Qwen3-MoE (jcp.peft) against peft 0.21 on
transformers 5's Qwen3MoeForCausalLM, whose experts are two fused 3-D parameters.

Evidence:
(a) read_folder of folders peft's save_pretrained wrote (attention + target_parameters,
    random non-zero A and B; plain, rsLoRA, and gate_up at rank 2r through rank_pattern)
    gives trees whose per-expert deltas equal peft's get_delta_weight, and whose expert MLP
    run in NumPy from the unmerged factors equals peft's experts forward;
(b) write_folder of random jcp trees (per-expert and shared-outer) loads with
    PeftModel.from_pretrained: peft's merged weights are base + scale·(A_e B_e)ᵀ computed
    here from the tree, and its logits are those of the base with those deltas merged by
    hand;
(c) write_folder -> read_folder keeps rank, alpha and every factor exactly (shared-outer
    comes back per expert, the shared factor repeated), for several target sets;
(d) write_vllm_folder's per-expert keys hold the per-expert factors, and peft's own
    per-expert -> fused conversion reads that folder to the same merged weights; what peft
    then saves reads back at rank r with the same factors;
(e) refusals name the file and the field or tensor.

References are computed in fp64 from the factors (no jcp code); fp32 peft agrees to ~1e-7.
"""

from __future__ import annotations

import copy
import json
import re

import numpy as np
import peft
import pytest
import torch
from helpers import hf_models
from helpers.hf_models import tiny_hf
from safetensors.numpy import load_file, save_file

import jcp
from jcp import lora as lora_lib
from jcp import peft as peft_lib
from jcp.adapter_state import AdapterInfo

V, D, F_DENSE, FE, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 64, 16, 24, 12, 3, 2, 1, 8
EXPERTS, TOP_K = 4, 2
R, ALPHA = 3, 6.0  # r ≠ E and F ≠ D, so a wrong interleave or orientation cannot pass
MOE_IDS = (1, 2)  # layer 0 dense (mlp_only_layers)
ATOL = 1e-6  # fp32 peft against the fp64 reference; deltas are O(0.1)
LOGIT_ATOL = (
    5e-5  # two fp32 evaluations (peft unmerged vs merged by hand) of one model; 2.2e-5 seen
)
GATE_UP, DOWN = "mlp.experts.gate_up_proj", "mlp.experts.down_proj"
EXPERT_PARAMS = [GATE_UP, DOWN]
ALL_TARGETS = ("q_proj", "v_proj", "o_proj", "expert_gate", "expert_up", "expert_down", "lm_head")

# peft 0.21 warns that the gate_up rank / alpha pattern "did not match any targeted
# module": its check looks at module names only, while the pattern is applied to the
# parameter (the tests assert the rank 2r it gives).
pytestmark = pytest.mark.filterwarnings(
    "ignore:The following (rank|alpha)_pattern keys did not match:RuntimeWarning"
)


@pytest.fixture(scope="module")
def hm():
    return tiny_hf(
        "qwen3_moe",
        seed=0,
        weight_std=0.1,
        vocab_size=V,
        hidden_size=D,
        intermediate_size=F_DENSE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        moe_intermediate_size=FE,
        norm_topk_prob=True,
        mlp_only_layers=[0],
        max_position_embeddings=256,
    )


@pytest.fixture(scope="module")
def cfg(hm):
    c = jcp.QwenConfig.from_hf(hm.config.to_dict())
    assert c.moe_layers == (False, True, True) and c.num_experts == EXPERTS
    assert [i for i, m in enumerate(c.moe_layers) if m] == list(MOE_IDS)
    return c


# ----------------------------------------------------------------------------------------
# Helpers (independent of jcp.peft)


def peft_model(hm, seed, **lora_kw):
    """hm in peft's LoRA (LoraConfig(**lora_kw)) with every lora_A / lora_B random."""
    return hf_models.peft_model(hm, seed, std=0.3, factors="lora_", **lora_kw)


def wrappers(pm, layer):
    """{parameter name: peft ParamWrapper} on the experts of a model layer."""
    out, mod = {}, pm.base_model.model.model.layers[layer].mlp.experts
    while hasattr(mod, "parameter_name"):
        out[mod.parameter_name] = mod
        mod = mod.base_layer
    return out


def random_tree(cfg, rank, targets, mode, seed):
    shapes = lora_lib.adapter_shapes(cfg, rank, targets, mode)
    rng = np.random.default_rng(seed)
    return {
        m: {k: rng.normal(0.0, 0.3, s).astype(np.float32) for k, s in ks.items()}
        for m, ks in shapes.items()
    }


def factors(tree, m, lm, e):
    """Expert e's (A [I, r], B [r, O]) of MoE layer lm, either parameterisation, fp64."""
    ab = tree[m]
    if set(ab) == {"b"}:  # fused_gate_up: expert_up's A is expert_gate's
        ab = {**ab, "a": tree["expert_gate"]["a"]}
    a = ab["a"][lm, e] if "a" in ab else ab["a_shared"][lm]
    b = ab["b"][lm, e] if "b" in ab else ab["b_shared"][lm]
    return np.asarray(a, np.float64), np.asarray(b, np.float64)


def expert_deltas(tree, scale, lm):
    """torch-layout deltas of MoE layer lm: gate_up [E, 2F, D] (gate rows first), down
    [E, D, F]; zero for untargeted modules."""
    gu, dn = np.zeros((EXPERTS, 2 * FE, D)), np.zeros((EXPERTS, D, FE))
    for e in range(EXPERTS):
        for m, dst in (
            ("expert_gate", gu[e, :FE]),
            ("expert_up", gu[e, FE:]),
            ("expert_down", dn[e]),
        ):
            if m in tree:
                a, b = factors(tree, m, lm, e)
                dst[...] = scale * (a @ b).T
    return gu, dn


def expert_mlp(x, gate_up, down, lora, scale):
    """down(silu(gate(x)) · up(x)) of one expert in fp64, LoRA unmerged:
    lora {module: (A [I, r], B [r, O])}."""

    def lin(m, w, h):
        y = h @ w.T
        if m in lora:
            a, b = lora[m]
            y = y + scale * (h @ a) @ b
        return y

    g = lin("expert_gate", gate_up[:FE], x)
    u = lin("expert_up", gate_up[FE:], x)
    return lin("expert_down", down, g / (1.0 + np.exp(-g)) * u)


def t64(x):
    return x.detach().double().numpy()


def read(path, cfg, max_rank=16):
    return peft_lib.read_folder(path, cfg, max_rank)


# ----------------------------------------------------------------------------------------
# (a) peft's own folders -> jcp


PEFT_SPECS = {
    "plain": dict(r=R, lora_alpha=ALPHA),
    "rslora": dict(r=R, lora_alpha=ALPHA, use_rslora=True),
    # gate_up at rank 2r, B not block-diagonal: gate and up keep rank 2r each.
    "fused_2r": dict(
        r=R,
        lora_alpha=ALPHA,
        rank_pattern={r".*\.gate_up_proj": 2 * R},
        alpha_pattern={r".*\.gate_up_proj": 2 * ALPHA},
    ),
}


@pytest.mark.parametrize("spec", list(PEFT_SPECS))
def test_read_folder_matches_peft_deltas_and_forward(hm, cfg, tmp_path, spec):
    kw = PEFT_SPECS[spec]
    pm = peft_model(
        hm, seed=1, target_modules=["q_proj", "o_proj"], target_parameters=EXPERT_PARAMS, **kw
    )
    pm.save_pretrained(tmp_path / spec)
    saved = load_file(str(tmp_path / spec / "adapter_model.safetensors"))
    # peft's names and shapes: gate_up inner (base_layer), down outer; rows (expert, rank).
    k_gu = 2 * R if spec == "fused_2r" else R
    assert saved["base_model.model.model.layers.1.mlp.experts.base_layer.lora_A.weight"].shape == (
        k_gu * EXPERTS,
        D,
    )
    assert saved["base_model.model.model.layers.1.mlp.experts.base_layer.lora_B.weight"].shape == (
        2 * FE,
        k_gu * EXPERTS,
    )
    assert saved["base_model.model.model.layers.2.mlp.experts.lora_A.weight"].shape == (
        R * EXPERTS,
        FE,
    )
    assert not any("layers.0.mlp" in k for k in saved)

    rank, alpha, targets, tree = read(tmp_path / spec, cfg)
    assert targets == ("q_proj", "o_proj", "expert_gate", "expert_up", "expert_down")
    # peft's one A of the fused gate_up stays one parameter (tied), not two copies
    assert lora_lib.tree_expert_lora(tree) == "fused_gate_up"
    assert set(tree["expert_up"]) == {"b"} and set(tree["expert_gate"]) == {"a", "b"}
    scale = pm.base_model.model.model.layers[1].self_attn.q_proj.scaling["default"]
    assert alpha / rank == pytest.approx(scale, rel=1e-12)
    if spec == "fused_2r":
        assert rank == 2 * R and alpha == 2 * ALPHA
        # The attention and down factors are zero-padded from r to 2r.
        assert not np.any(tree["q_proj"]["a"][..., R:]) and not np.any(
            tree["expert_down"]["b"][:, :, R:]
        )
    else:
        assert rank == R

    for lm, i in enumerate(MOE_IDS):
        w = wrappers(pm, i)
        assert set(w) == {"gate_up_proj", "down_proj"}
        assert w["gate_up_proj"].scaling["default"] == pytest.approx(scale)
        gu, dn = expert_deltas(tree, alpha / rank, lm)
        assert np.max(np.abs(gu)) > 0.1 and np.max(np.abs(dn)) > 0.1
        np.testing.assert_allclose(
            t64(w["gate_up_proj"].get_delta_weight("default")),
            gu,
            rtol=1e-5,
            atol=ATOL,
            err_msg=f"layer {i} gate_up",
        )
        np.testing.assert_allclose(
            t64(w["down_proj"].get_delta_weight("default")),
            dn,
            rtol=1e-5,
            atol=ATOL,
            err_msg=f"layer {i} down",
        )
        # The expert MLP from the unmerged factors equals peft's experts forward.
        base = hm.model.layers[i].mlp.experts
        x = np.random.default_rng(i).normal(size=(5, D))
        for e in range(EXPERTS):
            with torch.no_grad():
                got = pm.base_model.model.model.layers[i].mlp.experts(
                    torch.tensor(x, dtype=torch.float32), torch.full((5, 1), e), torch.ones(5, 1)
                )
            lora = {m: factors(tree, m, lm, e) for m in lora_lib.EXPERT}
            want = expert_mlp(
                x, t64(base.gate_up_proj[e]), t64(base.down_proj[e]), lora, alpha / rank
            )
            plain = expert_mlp(x, t64(base.gate_up_proj[e]), t64(base.down_proj[e]), {}, 0.0)
            assert np.max(np.abs(want - plain)) > 1e-2
            np.testing.assert_allclose(
                t64(got), want, rtol=1e-5, atol=1e-5, err_msg=f"layer {i} expert {e}"
            )
    q = pm.base_model.model.model.layers[2].self_attn.q_proj
    a, b = tree["q_proj"]["a"][2].astype(np.float64), tree["q_proj"]["b"][2].astype(np.float64)
    np.testing.assert_allclose(
        t64(q.get_delta_weight("default")), alpha / rank * (a @ b).T, rtol=1e-5, atol=ATOL
    )


# ----------------------------------------------------------------------------------------
# (b) jcp -> peft


@pytest.mark.parametrize("mode", lora_lib.EXPERT_LORA)
def test_write_folder_loads_in_peft_with_the_trees_weights(hm, cfg, tmp_path, mode):
    tree = random_tree(cfg, R, ALL_TARGETS, mode, seed=2)
    assert lora_lib.tree_expert_lora(tree) == mode
    peft_lib.write_folder(tmp_path / "x", cfg, AdapterInfo(R, ALPHA, ALL_TARGETS, mode), tree)
    with open(tmp_path / "x" / "adapter_config.json") as f:
        pc = json.load(f)
    assert pc["target_modules"] == ["q_proj", "v_proj", "o_proj", "lm_head"]
    assert pc["target_parameters"] == EXPERT_PARAMS
    # gate and up with their own A: one LoRA at 2r (block-diagonal B); sharing A: at r
    k_gu = R if mode == "fused_gate_up" else 2 * R
    if mode == "fused_gate_up":
        assert not pc["rank_pattern"] and not pc["alpha_pattern"]
    else:
        assert pc["rank_pattern"] == {r".*\.gate_up_proj": 2 * R}
        assert pc["alpha_pattern"] == {r".*\.gate_up_proj": 2 * ALPHA}

    pm = peft.PeftModel.from_pretrained(copy.deepcopy(hm), tmp_path / "x").eval()
    scale = ALPHA / R
    for i in MOE_IDS:
        w = wrappers(pm, i)
        # peft honoured the rank pattern: gate_up at k, down at r, both at alpha / r.
        assert w["gate_up_proj"].r["default"] == k_gu and w["down_proj"].r["default"] == R
        assert w["gate_up_proj"].scaling["default"] == pytest.approx(scale)
        assert w["down_proj"].scaling["default"] == pytest.approx(scale)

    tokens = torch.tensor(np.random.default_rng(3).integers(0, V, (2, 11)))
    with torch.no_grad():
        got = t64(pm(input_ids=tokens).logits)
        merged = copy.deepcopy(pm).merge_and_unload()
        by_hand = copy.deepcopy(hm)
        for lm, i in enumerate(MOE_IDS):
            gu, dn = expert_deltas(tree, scale, lm)
            for name, delta in (("gate_up_proj", gu), ("down_proj", dn)):
                base = getattr(hm.model.layers[i].mlp.experts, name)
                np.testing.assert_allclose(
                    t64(getattr(merged.model.layers[i].mlp.experts, name)),
                    t64(base) + delta,
                    rtol=0,
                    atol=ATOL,
                    err_msg=f"layer {i} {name}",
                )
                getattr(by_hand.model.layers[i].mlp.experts, name).add_(
                    torch.tensor(delta, dtype=torch.float32)
                )
        for i in range(LAYERS):
            for m in ("q_proj", "v_proj", "o_proj"):
                a, b = (tree[m][k][i].astype(np.float64) for k in ("a", "b"))
                getattr(by_hand.model.layers[i].self_attn, m).weight.add_(
                    torch.tensor(scale * (a @ b).T, dtype=torch.float32)
                )
        a, b = (tree["lm_head"][k].astype(np.float64) for k in ("a", "b"))
        by_hand.lm_head.weight.add_(torch.tensor(scale * (a @ b).T, dtype=torch.float32))
        want = t64(by_hand(input_ids=tokens).logits)
        plain = t64(hm(input_ids=tokens).logits)
    assert np.max(np.abs(want - plain)) > 100 * LOGIT_ATOL
    np.testing.assert_allclose(got, want, rtol=0, atol=LOGIT_ATOL)


# ----------------------------------------------------------------------------------------
# (c) round trips


ROUND_TRIPS = {
    "all": ALL_TARGETS,
    "down_only": ("k_proj", "expert_down"),  # a lone parameter: …experts.lora_A
    "gate_up_only": ("expert_gate", "expert_up"),
}


@pytest.mark.parametrize("mode", lora_lib.EXPERT_LORA)
@pytest.mark.parametrize("which", list(ROUND_TRIPS))
def test_round_trip_keeps_rank_and_factors(cfg, tmp_path, mode, which):
    targets = ROUND_TRIPS[which]
    for fresh in (False, True):  # random B, and PEFT's initialisation (B = 0)
        tree = (
            lora_lib.init_adapter(cfg, R, targets, 4, mode)
            if fresh
            else random_tree(cfg, R, targets, mode, seed=4)
        )
        path = tmp_path / f"{which}_{fresh}"
        peft_lib.write_folder(path, cfg, AdapterInfo(R, ALPHA, targets, mode), tree)
        saved = load_file(str(path / "adapter_model.safetensors"))
        inner = "base_model.model.model.layers.1.mlp.experts.base_layer.lora_A.weight"
        assert (inner in saved) == (which == "all")
        rank, alpha, got_targets, got = read(path, cfg)
        assert (rank, alpha, got_targets) == (R, ALPHA, targets)
        back = "fused_gate_up" if mode == "fused_gate_up" else "per_expert"
        assert lora_lib.tree_expert_lora(got) == (
            back if set(targets) & {"expert_up"} else "per_expert"
        )
        assert got.keys() == tree.keys()
        for m in targets:
            assert set(got[m]) == set(lora_lib.expert_keys(m, back))
            for lm in range(len(MOE_IDS)) if m in lora_lib.EXPERT else [None]:
                for e in range(EXPERTS) if m in lora_lib.EXPERT else [None]:
                    if m in lora_lib.EXPERT:
                        want = factors(tree, m, lm, e)
                        have = tuple(np.asarray(x, np.float32) for x in factors(got, m, lm, e))
                    else:
                        want, have = (tree[m]["a"], tree[m]["b"]), (got[m]["a"], got[m]["b"])
                    for w, h in zip(want, have):
                        assert h.dtype == np.float32
                        np.testing.assert_array_equal(h, w, err_msg=f"{m} {lm} {e}")


def test_one_of_gate_and_up_comes_back_as_both(cfg, tmp_path):
    """PEFT's gate_up adapts gate and up together: a gate-only adapter is written at rank r
    with up's half of B zero, and reads back as gate + an up whose B is zero."""
    tree = random_tree(cfg, R, ("expert_gate",), "per_expert", seed=5)
    peft_lib.write_folder(
        tmp_path / "g", cfg, AdapterInfo(R, ALPHA, ("expert_gate",), "per_expert"), tree
    )
    with open(tmp_path / "g" / "adapter_config.json") as f:
        pc = json.load(f)
    assert pc["target_parameters"] == [GATE_UP] and pc["rank_pattern"] == {}
    rank, alpha, targets, got = read(tmp_path / "g", cfg)
    assert (rank, alpha, targets) == (R, ALPHA, ("expert_gate", "expert_up"))
    np.testing.assert_array_equal(got["expert_gate"]["a"], tree["expert_gate"]["a"])
    np.testing.assert_array_equal(got["expert_gate"]["b"], tree["expert_gate"]["b"])
    assert np.any(tree["expert_gate"]["b"]) and not np.any(got["expert_up"]["b"])


# ----------------------------------------------------------------------------------------
# (d) the vLLM layout


@pytest.mark.parametrize("mode", lora_lib.EXPERT_LORA)
def test_vllm_layout_holds_per_expert_factors(hm, cfg, tmp_path, mode):
    targets = ("q_proj", "o_proj", "expert_gate", "expert_up", "expert_down")
    tree = random_tree(cfg, R, targets, mode, seed=6)
    path = tmp_path / "vllm"
    peft_lib.write_vllm_folder(path, cfg, AdapterInfo(R, ALPHA, targets, mode), tree)
    with open(path / "adapter_config.json") as f:
        pc = json.load(f)
    assert sorted(pc["target_modules"]) == sorted(
        ["q_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    assert (pc["r"], pc["lora_alpha"]) == (R, ALPHA) and "target_parameters" not in pc
    saved = load_file(str(path / "adapter_model.safetensors"))
    want_keys = {
        f"base_model.model.model.layers.{i}.self_attn.{m}.lora_{x}.weight"
        for i in range(LAYERS)
        for m in ("q_proj", "o_proj")
        for x in "AB"
    }
    proj = {"expert_gate": "gate_proj", "expert_up": "up_proj", "expert_down": "down_proj"}
    for lm, i in enumerate(MOE_IDS):
        for e in range(EXPERTS):
            for m, name in proj.items():
                a, b = factors(tree, m, lm, e)
                key = f"base_model.model.model.layers.{i}.mlp.experts.{e}.{name}.lora_"
                want_keys |= {key + "A.weight", key + "B.weight"}
                np.testing.assert_array_equal(saved[key + "A.weight"], a.T.astype(np.float32))
                np.testing.assert_array_equal(saved[key + "B.weight"], b.T.astype(np.float32))
    assert set(saved) == want_keys

    # peft fuses that per-expert layout itself (gate_up at 2r, block-diagonal B) ...
    pm = peft.PeftModel.from_pretrained(copy.deepcopy(hm), path).eval()
    assert wrappers(pm, 1)["gate_up_proj"].r["default"] == 2 * R
    merged = copy.deepcopy(pm).merge_and_unload()
    for lm, i in enumerate(MOE_IDS):
        gu, dn = expert_deltas(tree, ALPHA / R, lm)
        for name, delta in (("gate_up_proj", gu), ("down_proj", dn)):
            base = t64(getattr(hm.model.layers[i].mlp.experts, name))
            np.testing.assert_allclose(
                t64(getattr(merged.model.layers[i].mlp.experts, name)),
                base + delta,
                rtol=0,
                atol=ATOL,
            )
    # ... and what it saves then is read back at rank r, factors unchanged.
    pm.save_pretrained(tmp_path / "fused")
    rank, alpha, got_targets, got = read(tmp_path / "fused", cfg)
    assert (rank, alpha, got_targets) == (R, ALPHA, targets)
    for m in lora_lib.EXPERT:
        for lm in range(len(MOE_IDS)):
            for e in range(EXPERTS):
                a, b = factors(tree, m, lm, e)
                np.testing.assert_array_equal(got[m]["a"][lm, e], a.astype(np.float32))
                np.testing.assert_array_equal(got[m]["b"][lm, e], b.astype(np.float32))


def test_vllm_layout_writes_every_expert_projection(cfg, tmp_path):
    """vLLM packs gate, up and down of every expert: an adapter on down alone gets zero
    gate and up factors (no change to the model), down's own factors as they are."""
    tree = random_tree(cfg, R, ("expert_down",), "shared_outer", seed=10)
    peft_lib.write_vllm_folder(
        tmp_path / "v", cfg, AdapterInfo(R, ALPHA, ("expert_down",), "shared_outer"), tree
    )
    saved = load_file(str(tmp_path / "v" / "adapter_model.safetensors"))
    assert len(saved) == len(MOE_IDS) * EXPERTS * 3 * 2
    for lm, i in enumerate(MOE_IDS):
        for e in range(EXPERTS):
            key = f"base_model.model.model.layers.{i}.mlp.experts.{e}."
            for name, (ai, bo) in (("gate_proj", (D, FE)), ("up_proj", (D, FE))):
                assert saved[key + name + ".lora_A.weight"].shape == (R, ai)
                assert saved[key + name + ".lora_B.weight"].shape == (bo, R)
                assert not np.any(saved[key + name + ".lora_A.weight"])
                assert not np.any(saved[key + name + ".lora_B.weight"])
            a, b = factors(tree, "expert_down", lm, e)
            np.testing.assert_array_equal(saved[key + "down_proj.lora_A.weight"], a.T)
            np.testing.assert_array_equal(saved[key + "down_proj.lora_B.weight"], b.T)


# ----------------------------------------------------------------------------------------
# (e) refusals


def _edit_config(path, **changes):
    with open(path / "adapter_config.json") as f:
        pc = json.load(f)
    pc.update(changes)
    with open(path / "adapter_config.json", "w") as f:
        json.dump(pc, f)


def _edit_tensors(path, edit):
    w = load_file(str(path / "adapter_model.safetensors"))
    edit(w)
    save_file(w, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})


GU_A = "base_model.model.model.layers.1.mlp.experts.base_layer.lora_A.weight"
DOWN_B2 = "base_model.model.model.layers.2.mlp.experts.lora_B.weight"
CONFIG_EDITS = {
    "unknown_parameter": (
        dict(target_parameters=[GATE_UP, "mlp.experts.gate_proj"]),
        r"adapter_config.json: target_parameters .*gate_proj",
    ),
    "one_layer_parameter": (
        dict(target_parameters=["model.layers.1." + GATE_UP, DOWN]),
        r"adapter_config.json: target_parameters",
    ),
    "dense_mlp_only": (
        dict(target_modules=["gate_proj"], target_parameters=[]),
        r"adapter_config.json: target_modules \['gate_proj'\] adapts a dense MLP",
    ),
    "expert_name_as_module": (
        dict(target_modules=["q_proj", "expert_gate"]),
        r"adapter_config.json: target_modules",
    ),
    "pattern_on_attention": (
        dict(rank_pattern={r".*\.gate_up_proj": 2 * R, "q_proj": 2}),
        r"adapter_config.json: rank_pattern / alpha_pattern give "
        r"model\.layers\.0\.self_attn\.q_proj",
    ),
    "gate_up_other_scale": (
        dict(alpha_pattern={r".*\.gate_up_proj": ALPHA}),
        r"adapter_config.json: mlp.experts.gate_up_proj at rank 6, alpha "
        r"6.0 has another scale",
    ),
    "gate_up_rank_mismatch": (
        dict(rank_pattern={}, alpha_pattern={}),
        r"adapter_model.safetensors: tensor .*experts\.base_layer\."
        r"lora_A\.weight has shape \(24, 16\), expected \(12, 16\)",
    ),
}
TENSOR_EDITS = {
    "misshapen": (
        lambda w: w.__setitem__(GU_A, w[GU_A][:-1]),
        r"adapter_model.safetensors: tensor "
        + GU_A.replace(".", r"\.")
        + r" has shape \(23, 16\), expected \(24, 16\)",
    ),
    "missing": (
        lambda w: w.pop(DOWN_B2),
        r"adapter_model.safetensors: tensor " + DOWN_B2.replace(".", r"\.") + " is missing",
    ),
    "dense_layer_expert": (
        lambda w: w.__setitem__(GU_A.replace("layers.1", "layers.0"), w[GU_A]),
        r"adapter_model.safetensors: tensor .*layers\.0\.mlp\.experts.* is "
        r"not used",
    ),
    "non_finite": (
        lambda w: w[DOWN_B2].__setitem__((0, 0), np.nan),
        r"adapter_model.safetensors: tensor "
        + DOWN_B2.replace(".", r"\.")
        + " has non-finite values",
    ),
}


def test_dense_mlp_factors_are_read_only_where_they_change_nothing(cfg, tmp_path):
    """A MoE folder whose target_modules also name the dense MLP (peft 0.22 saves one so
    after reading vLLM's per-expert layout: its gate_proj / up_proj / down_proj wrap the
    dense layers' MLP too, lora_B at its initial zeros) reads as the folder without them;
    a non-zero pair, or half a pair, is refused, naming the tensor."""
    targets = ("q_proj", "expert_gate", "expert_up", "expert_down")
    tree = random_tree(cfg, R, targets, "per_expert", seed=7)
    path = tmp_path / "dense"
    peft_lib.write_folder(path, cfg, AdapterInfo(R, ALPHA, targets, "per_expert"), tree)
    want = read(path, cfg)
    with open(path / "adapter_config.json") as f:
        modules = json.load(f)["target_modules"]
    _edit_config(path, target_modules=modules + ["gate_proj", "up_proj", "down_proj"])
    rng = np.random.default_rng(3)
    dense = [i for i in range(LAYERS) if i not in MOE_IDS]
    assert dense  # the config has a dense layer for peft to wrap
    key = "base_model.model.model.layers.{}.mlp.{}.lora_{}.weight"
    shapes = {"gate_proj": (D, F_DENSE), "up_proj": (D, F_DENSE), "down_proj": (F_DENSE, D)}

    def add(w):
        for i in dense:
            for m, (fan_in, fan_out) in shapes.items():
                w[key.format(i, m, "A")] = rng.normal(size=(R, fan_in)).astype(np.float32)
                w[key.format(i, m, "B")] = np.zeros((fan_out, R), np.float32)

    _edit_tensors(path, add)
    got = read(path, cfg)
    assert got[:3] == want[:3]
    for m in want[3]:
        for k in want[3][m]:
            np.testing.assert_array_equal(got[3][m][k], want[3][m][k])
    b_key = key.format(dense[0], "up_proj", "B")
    _edit_tensors(path, lambda w: w[b_key].__setitem__((0, 0), 0.5))
    with pytest.raises(jcp.InputError, match=re.escape(b_key) + ", not zero, adapts a dense"):
        read(path, cfg)
    _edit_tensors(path, lambda w: w.pop(key.format(dense[0], "down_proj", "A")))
    with pytest.raises(
        jcp.InputError, match=r"layers\.\d+\.mlp\.down_proj\.lora_A\.weight is missing"
    ):
        read(path, cfg)


@pytest.mark.parametrize("case", list(CONFIG_EDITS) + list(TENSOR_EDITS))
def test_read_folder_refuses_what_it_cannot_read_exactly(cfg, tmp_path, case):
    targets = ("q_proj", "expert_gate", "expert_up", "expert_down")
    tree = random_tree(cfg, R, targets, "per_expert", seed=7)
    path = tmp_path / case
    peft_lib.write_folder(path, cfg, AdapterInfo(R, ALPHA, targets, "per_expert"), tree)
    read(path, cfg)  # the folder as written is fine
    if case in CONFIG_EDITS:
        changes, pattern = CONFIG_EDITS[case]
        _edit_config(path, **changes)
    else:
        edit, pattern = TENSOR_EDITS[case]
        _edit_tensors(path, edit)
    with pytest.raises(jcp.InputError, match=pattern):
        read(path, cfg)


def test_dense_model_refuses_target_parameters(tmp_path):
    dense = jcp.QwenConfig.tiny()
    tree = random_tree(dense, R, ("q_proj",), None, seed=8)
    peft_lib.write_folder(tmp_path / "d", dense, AdapterInfo(R, ALPHA, ("q_proj",)), tree)
    with open(tmp_path / "d" / "adapter_config.json") as f:
        assert "target_parameters" not in json.load(f)
    read(tmp_path / "d", dense)
    _edit_config(tmp_path / "d", target_parameters=[GATE_UP])
    with pytest.raises(
        jcp.InputError,
        match=r"adapter_config.json: target_parameters is not "
        r"supported",
    ):
        read(tmp_path / "d", dense)


def test_wider_fused_gate_up_than_max_rank_is_refused(hm, cfg, tmp_path):
    pm = peft_model(
        hm,
        seed=9,
        r=R,
        lora_alpha=ALPHA,
        target_modules=["q_proj"],
        target_parameters=EXPERT_PARAMS,
        **{k: v for k, v in PEFT_SPECS["fused_2r"].items() if k.endswith("pattern")},
    )
    pm.save_pretrained(tmp_path / "w")
    assert read(tmp_path / "w", cfg, max_rank=2 * R)[0] == 2 * R
    with pytest.raises(
        jcp.InputError,
        match=r"adapter_config.json: the experts' gate and up "
        r"take rank 6 each .* exceeds max_rank 5",
    ):
        read(tmp_path / "w", cfg, max_rank=2 * R - 1)
