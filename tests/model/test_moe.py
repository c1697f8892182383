"""Qwen3-MoE (jcp.model.moe, model.moe_mlp, hf loading): exact against transformers'
Qwen3MoeForCausalLM at every mesh, experts split over tp; the grouped matmul against
jax.lax.ragged_dot; empty experts; an attention adapter trains alike on two meshes.

The reference is a tiny random Qwen3MoeForCausalLM built in code (8 experts, top 2, layer 0
dense via mlp_only_layers, random non-unit norms), eager experts on CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.torch
from helpers import model_harness as MH
from helpers import moe_harness as MoE

import jcp
from jcp import hf as hf_lib
from jcp import model as model_lib
from jcp.model import moe as moe_lib

# tp = 4 must divide the kv heads and the experts.
EXPERTS, TOP_K, FE = MoE.EXPERTS, MoE.TOP_K, MoE.FE


@functools.cache
def saved(norm_topk_prob: bool, tmp):
    hm = MoE.hf_moe(norm_topk_prob)
    path = MH.save(hm, f"{tmp}/moe_{norm_topk_prob}")
    return hm, path


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return str(tmp_path_factory.mktemp("moe"))


def materialise(tree):
    return jax.tree.map(np.asarray, tree, is_leaf=lambda x: isinstance(x, hf_lib.LazyTensor))


# ----------------------------------------------------------------------------------------
# Config and loading


def test_config_from_hf_and_validation(tmp):
    _, path = saved(True, tmp)
    cfg = jcp.QwenConfig.from_hf(path)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (
        EXPERTS,
        TOP_K,
        FE,
    )
    assert cfg.norm_topk_prob and cfg.qk_norm and cfg.mlp_only_layers == (0,)
    assert cfg.moe_layers == (False, True, True)
    assert jcp.QwenConfig.tiny_moe().is_moe and not jcp.QwenConfig.tiny().is_moe
    assert jcp.QwenConfig.tiny_moe(decoder_sparse_step=2, mlp_only_layers=()).moe_layers == (
        False,
        True,
        False,
    )
    for bad, match in (
        (dict(num_experts_per_tok=9), "num_experts_per_tok"),
        (dict(mlp_only_layers=(3,)), "mlp_only_layers"),
        (dict(decoder_sparse_step=0), "decoder_sparse_step"),
        (dict(moe_intermediate_size=0), "moe_intermediate_size"),
    ):
        with pytest.raises(ValueError, match=match):
            jcp.QwenConfig.tiny_moe(**bad)
    with pytest.raises(ValueError, match="tp=4 does not divide num_experts=6"):
        jcp.QwenConfig.tiny_moe(num_kv_heads=4, num_experts=6).check_mesh(4)
    # Dense configs keep their fingerprint; MoE fields shape a MoE one.
    assert (
        jcp.QwenConfig.tiny_moe().fingerprint()
        != jcp.QwenConfig.tiny_moe(norm_topk_prob=False).fingerprint()
    )


def tensor_names(folder: str) -> set[str]:
    """The tensor names of a folder's safetensors files (read with safetensors itself)."""
    import glob

    from safetensors import safe_open

    names: set[str] = set()
    for f in glob.glob(f"{folder}/*.safetensors"):
        with safe_open(f, "np") as st:
            names |= set(st.keys())
    return names


def test_fused_and_per_expert_checkpoints_load_alike(tmp):
    hm, path = saved(True, tmp)
    fused = f"{tmp}/fused"
    import os

    os.makedirs(fused)
    # transformers' in-memory (fused) names, as transformers 5 holds them.
    sd = {k: v.contiguous() for k, v in hm.state_dict().items()}
    safetensors.torch.save_file(sd, f"{fused}/model.safetensors")
    with open(f"{path}/config.json") as f, open(f"{fused}/config.json", "w") as g:
        g.write(f.read())
    names_saved, names_fused = tensor_names(path), tensor_names(fused)
    assert "model.layers.1.mlp.experts.gate_up_proj" in names_fused
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in names_saved
    assert names_saved != names_fused
    cfg, a = jcp.load_hf(path)
    _, b = jcp.load_hf(fused)
    a, b = materialise(a), materialise(b)
    assert MH.tree_max_abs_diff(a, b) == 0.0
    up = hm.model.layers[2].mlp.experts.gate_up_proj.detach().numpy()[5, FE:, :].T
    np.testing.assert_array_equal(a["moe_mlp"]["expert_up"][1, 5], up)
    # A device's block of experts reads only those experts.
    _, lazy = jcp.load_hf(path)
    block = lazy["moe_mlp"]["expert_down"][0:2, 4:6, 8:16, :]
    np.testing.assert_array_equal(block, a["moe_mlp"]["expert_down"][0:2, 4:6, 8:16, :])
    model_lib.check_shapes(cfg, a)


# ----------------------------------------------------------------------------------------
# Parity with transformers


# cp = 2 with and without tp: (2,2,2) and the unnormalised router's (1,2,2); (1,2,1) and
# (1,2,2) with the normalised one (~1.8 CPU s each) added no axis.
PARITY = [
    ((1, 1, 1), True),
    ((1, 1, 4), True),
    ((2, 2, 2), True),
    ((1, 1, 1), False),
    ((1, 2, 2), False),
]


@pytest.mark.parametrize("mesh_shape,norm_topk_prob", PARITY)
def test_logprobs_match_transformers(tmp, mesh_shape, norm_topk_prob):
    hm, path = saved(norm_topk_prob, tmp)
    cfg, base = jcp.load_hf(path)
    assert cfg.norm_topk_prob == norm_topk_prob and cfg.moe_layers == (False, True, True)
    seqs, targets, _ = MH.random_data([37, 64, 20], seed=3)
    got = MH.logprobs(cfg, base, mesh_shape, seqs, targets)
    want = MH.reference_logprobs(hm, seqs, targets)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, atol=2e-4, rtol=0)


def test_norm_topk_prob_changes_the_output(tmp):
    """The parity above would pass for a router that ignores norm_topk_prob only if it made
    no difference; it does."""
    hm_t, _ = saved(True, tmp)
    hm_f, _ = saved(False, tmp)
    seqs, targets, _ = MH.random_data([20], seed=3)
    a = MH.reference_logprobs(hm_t, seqs, targets)[0]
    b = MH.reference_logprobs(hm_f, seqs, targets)[0]
    assert np.max(np.abs(a - b)) > 1e-2


# ----------------------------------------------------------------------------------------
# The grouped matmul and empty experts


def test_grouped_matmul_matches_ragged_dot_with_empty_groups():
    rng = np.random.default_rng(0)
    sizes = jnp.asarray([0, 70, 0, 3, 0], jnp.int32)  # 73 rows in groups, 27 in none
    x = jnp.asarray(rng.standard_normal((100, 16)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((5, 16, 8)), jnp.float32)
    got = jax.jit(moe_lib.grouped_matmul)(x, w, sizes)  # one program (op by op: ~70)
    want = jax.lax.ragged_dot(x, w, sizes)
    assert jax.default_backend() == "cpu"  # so the tiled path, not ragged_dot, ran
    assert float(jnp.max(jnp.abs(want[73:]))) == 0.0
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    f = lambda x, w: jnp.sum(jnp.sin(moe_lib.grouped_matmul(x, w, sizes)))  # noqa: E731
    gg = jax.jit(jax.grad(f, (0, 1)))(x, w)
    gw = jax.grad(lambda x, w: jnp.sum(jnp.sin(jax.lax.ragged_dot(x, w, sizes))), (0, 1))(x, w)
    for a, b in zip(gg, gw):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=0)


def test_expert_without_tokens_gives_no_nan_and_zero_gradient():
    """Experts 2 and 5 of 8 receive no token; this rank holds experts 4..7."""
    rng = np.random.default_rng(1)
    s, d, f = 12, 16, 8
    experts = rng.choice(np.array([0, 1, 3, 4, 6, 7]), size=(s, 2))
    experts[:, 1] = np.where(experts[:, 1] == experts[:, 0], (experts[:, 0] + 1) % 8, experts[:, 1])
    experts = np.where(experts == 5, 6, np.where(experts == 2, 3, experts))
    assert not np.isin([2, 5], experts).any()
    x = jnp.asarray(rng.standard_normal((s, d)), jnp.float32)
    wts = jnp.asarray(rng.uniform(0.1, 1.0, (s, 2)), jnp.float32)
    gate, up = (jnp.asarray(rng.standard_normal((4, d, f)), jnp.float32) for _ in range(2))
    down = jnp.asarray(rng.standard_normal((4, f, d)), jnp.float32)

    # Each function and gradient one program (op by op: ~200 small compiles, ~2 CPU s more).
    @jax.jit
    def run(x, gate, up, down):
        return moe_lib.experts(
            x, wts, jnp.asarray(experts, jnp.int32), moe_lib.ExpertWeights(gate, up, down), 4
        )

    @jax.jit
    def reference(x, gate, up, down):
        y = jnp.zeros_like(x)
        for k in range(2):
            for e in range(4):
                sel = (experts[:, k] == 4 + e)[:, None]
                h = jax.nn.silu(x @ gate[e]) * (x @ up[e]) @ down[e]
                y = y + jnp.where(sel, h * wts[:, k : k + 1], 0)
        return y

    out = run(x, gate, up, down)
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_allclose(out, reference(x, gate, up, down), atol=1e-4, rtol=1e-5)
    loss = lambda f: lambda *a: jnp.sum(f(*a) ** 2)
    g = jax.jit(jax.grad(loss(run), (0, 1, 2, 3)))(x, gate, up, down)
    r = jax.jit(jax.grad(loss(reference), (0, 1, 2, 3)))(x, gate, up, down)
    assert all(np.isfinite(np.asarray(a)).all() for a in g)
    # Local expert 1 (global 5) got no row: its weights get exactly zero gradient.
    assert all(float(jnp.max(jnp.abs(a[1]))) == 0.0 for a in g[1:])
    for a, b in zip(g, r):
        np.testing.assert_allclose(a, b, atol=2e-3, rtol=1e-4)

    # Every token routed to experts of other ranks (0..3): zeros here, no NaN, no gradient.
    elsewhere = jnp.asarray(experts % 4, jnp.int32)
    assert int(jnp.max(elsewhere)) < 4
    far = jax.jit(
        lambda x, gate, up, down: moe_lib.experts(
            x, wts, elsewhere, moe_lib.ExpertWeights(gate, up, down), 4
        )
    )
    assert float(jnp.max(jnp.abs(far(x, gate, up, down)))) == 0.0
    g = jax.jit(jax.grad(loss(lambda *a: far(*a) + a[0]), (0, 1, 2, 3)))(x, gate, up, down)
    np.testing.assert_array_equal(g[0], 2 * x)
    assert all(float(jnp.max(jnp.abs(a))) == 0.0 for a in g[1:])


# ----------------------------------------------------------------------------------------
# Training an attention adapter


def test_attention_adapter_trains_alike_on_two_meshes(tmp_path):
    cfg = jcp.QwenConfig.tiny_moe(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        moe_intermediate_size=16,
    )
    base = model_lib.random_params(cfg, seed=0)
    base["moe_mlp"]["router"] = base["moe_mlp"]["router"] * 15.0  # decisive routing
    seqs, targets, weights = MH.random_data([23, 40], seed=5)
    data = [
        jcp.Datum(s, {"target_tokens": t, "weights": w}) for s, t, w in zip(seqs, targets, weights)
    ]
    meshes = ((1, 1, 1), (1, 2, 2))
    assert meshes[0] != meshes[1] and meshes[1][2] > 1  # experts really split over tp
    trainers = [
        jcp.Trainer(cfg, jcp.make_mesh(*m), base_params=base, max_adapters=2, max_rank=4, seed=0)
        for m in meshes
    ]
    assert [t.mesh.shape["tp"] for t in trainers] == [1, 2]
    # Train on the first mesh. A MoE model's default targets add the experts
    # (tests/model/test_moe_lora.py); this adapter is attention + lm_head only.
    tr = trainers[0]
    default = tr.create_adapter(rank=4, alpha=8.0)
    assert tr.adapters[default].targets == (
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "expert_gate",
        "expert_up",
        "expert_down",
        "lm_head",
    )
    tr.delete_adapter(default)
    a = tr.create_adapter(rank=4, alpha=8.0, seed=1, targets=["attn", "unembed"])
    assert tr.adapters[a].targets == ("q_proj", "k_proj", "v_proj", "o_proj", "lm_head")
    assert tr.adapters[a].expert_lora is None
    losses = []
    for _ in range(3):
        losses.append(tr.forward_backward(data, "cross_entropy", adapters=a).metrics["loss:sum"])
        tr.optim_step(a, jcp.AdamParams(learning_rate=1e-2))
    assert losses[2] < losses[1] < losses[0]
    tr.export_peft(a, tmp_path / "trained")
    # The trained adapter (A and B nonzero) gives the same loss and gradients on both meshes.
    results = []
    for t in trainers:
        b = t.load_peft(tmp_path / "trained")
        out = t.forward_backward(data, "cross_entropy", adapters=b)
        results.append((out.metrics["loss:sum"], t.gradients(b)))
    (l0, g0), (l1, g1) = results
    np.testing.assert_allclose(l1, l0, rtol=1e-5)
    assert set(g0) == set(g1) and any("q_proj.lora_A" in k for k in g0)
    assert not any("mlp" in k for k in g0)
    scale = MH.tree_max_abs(g0)
    assert min(float(np.max(np.abs(g))) for g in g0.values()) > 1e-3 * scale
    for k in g0:
        np.testing.assert_allclose(g1[k], g0[k], atol=1e-5 * scale, rtol=1e-4, err_msg=k)
    # MLP targets are refused on a MoE model, with nothing allocated.
    before = dict(tr.adapters)
    for targets in ("mlp", ["q_proj", "down_proj"]):
        with pytest.raises(jcp.InputError, match="mixture-of-experts"):
            tr.create_adapter(rank=2, targets=targets)
    assert tr.adapters == before
