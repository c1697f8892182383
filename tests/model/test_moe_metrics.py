"""MoE routing statistics: Tinker's expert-load metrics in forward / forward_backward, and
the opt-in router auxiliary loss (Trainer(router_aux_loss_coef=…)).

The reference is transformers' Qwen3MoeForCausalLM (tests/model/test_moe.py's tiny random model)
in float64 with a random nonzero adapter on attention, the experts and the unembedding
merged into its weights (tests/model/test_moe_lora.py's `merged`). A forward hook on each MoE
layer's router (`mlp.gate`) captures the experts it picked; the metrics are recomputed
from those in NumPy. The auxiliary loss is transformers' load_balancing_loss_func on the
captured router logits of each layer (of all datums together), divided by top_k (see
moe.load_balancing_loss) and summed over layers; torch autograd gives its gradient.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from helpers import model_harness as MH
from helpers import moe_harness as TM
from helpers.packing import micro_batches
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

import jcp
from jcp.model import moe as moe_lib

MESHES = ((1, 1, 1), (1, 2, 2), (2, 1, 2))
LENGTHS = (37, 52, 23, 41)  # odd lengths: zigzag padding at cp = 2
COEF = 10.0  # large: the aux gradient well above float32 noise of the CE one
E_KEYS = (
    "e_frac_with_tokens:mean",
    "e_frac_oversubscribed:mean",
    "e_max_violation:mean",
    "e_max_violation:max",
    "e_min_violation:mean",
)


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return str(tmp_path_factory.mktemp("moe_metrics"))


def numpy_metrics(experts_per_layer, num_experts):
    """Tinker's five figures from each MoE layer's picked experts [tokens, top_k], written
    out independently of moe.load_metrics."""
    with_tokens, over, max_v, min_v = [], [], [], []
    for picked in experts_per_layer:
        load = np.bincount(np.asarray(picked).reshape(-1), minlength=num_experts)
        balance = picked.size / num_experts
        with_tokens.append(np.count_nonzero(load) / num_experts)
        over.append(np.count_nonzero(load > balance) / num_experts)
        max_v.append((load.max() - balance) / balance)
        min_v.append((load.min() - balance) / balance)
    return dict(
        zip(
            E_KEYS,
            (np.mean(with_tokens), np.mean(over), np.mean(max_v), np.max(max_v), np.mean(min_v)),
        )
    )


@functools.cache
def setup(tmp):
    """(hm, cfg, base, adapter tree, data, reference) — reference: picked experts per MoE
    layer [Σ N, top_k], the CE loss and its gradient, the aux loss and its gradient."""
    hm, path = TM.model(tmp)
    cfg, base = jcp.load_hf(path)
    tree = TM.random_adapter(cfg, "shared_outer", 3)
    seqs, targets, weights = MH.random_data(LENGTHS, seed=3)  # no near-tie (see margin)
    data = [
        jcp.Datum(s, {"target_tokens": t, "weights": w}) for s, t, w in zip(seqs, targets, weights)
    ]
    return hm, cfg, base, tree, data, reference(hm, tree, seqs, targets, weights)


def reference(hm, tree, seqs, targets, weights):
    hm64 = hm.double()
    params64 = {n: p.detach() for n, p in hm64.named_parameters()}
    leaves = {
        (id(tree), m, k): torch.tensor(x, dtype=torch.float64, requires_grad=True)
        for m, ab in tree.items()
        for k, x in ab.items()
    }
    over = TM.merged(params64, tree, TM.ALPHA / TM.RANK, leaves)
    picked = {li: [] for li in TM.MOE_LAYERS}
    margins = []

    def capture(li):
        def hook(router, args, out):
            logits, _, idx = out
            probs = torch.softmax(logits.detach(), -1).sort(-1, descending=True).values
            margins.append(float((probs[:, TM.TOP_K - 1] - probs[:, TM.TOP_K]).min()))
            picked[li].append(idx.numpy())

        return hook

    hooks = [
        hm64.model.layers[li].mlp.gate.register_forward_hook(capture(li)) for li in TM.MOE_LAYERS
    ]
    ce, logits_per_layer = 0.0, [[] for _ in TM.MOE_LAYERS]
    for s, t, w in zip(seqs, targets, weights):
        out = torch.func.functional_call(
            hm64,
            {**params64, **over},
            (torch.tensor(np.asarray(s))[None],),
            {"output_router_logits": True},
        )
        lp = torch.log_softmax(out.logits[0], -1)[torch.arange(len(s)), torch.tensor(np.asarray(t))]
        ce = ce - (torch.tensor(np.asarray(w, np.float64)) * lp).sum()
        assert len(out.router_logits) == len(TM.MOE_LAYERS)
        for j, rl in enumerate(out.router_logits):
            logits_per_layer[j].append(rl)
    for h in hooks:
        h.remove()
    # transformers' loss of one layer normalises f by tokens, jcp's by assignments.
    aux = (
        sum(
            load_balancing_loss_func((torch.cat(ls),), TM.EXPERTS, TM.TOP_K)
            for ls in logits_per_layer
        )
        / TM.TOP_K
    )
    keys = list(leaves)
    g_ce = torch.autograd.grad(ce, [leaves[k] for k in keys], retain_graph=True)
    # Factors downstream of the last router (the last layer's experts, lm_head) get none.
    g_aux = torch.autograd.grad(
        aux, [leaves[k] for k in keys], allow_unused=True, materialize_grads=True
    )
    as_tree = lambda gs: {
        m: {k: g.numpy() for (_, mm, k), g in zip(keys, gs) if mm == m} for m in tree
    }
    hm.float()
    return dict(
        picked=[np.concatenate(picked[li]) for li in TM.MOE_LAYERS],
        margin=min(margins),
        ce=float(ce.detach()),
        g_ce=as_tree(g_ce),
        aux=float(aux.detach()),
        g_aux=as_tree(g_aux),
    )


def trainer(cfg, base, tree, mesh_shape, **kw):
    tr = jcp.Trainer(
        cfg, jcp.make_mesh(*mesh_shape), base_params=base, max_adapters=2, max_rank=8, seed=0, **kw
    )
    return tr, TM.install(tr, tree, "shared_outer")


# ----------------------------------------------------------------------------------------
# The load metrics


def test_load_metrics_definitions():
    # Layer 0: balance 2 (8 assignments, 4 experts); layer 1: perfectly balanced.
    got = moe_lib.load_metrics(np.array([[4, 0, 3, 1], [2, 2, 2, 2]]))
    assert set(got) == set(E_KEYS)
    want = {
        "e_frac_with_tokens:mean": (3 / 4 + 1) / 2,
        "e_frac_oversubscribed:mean": (2 / 4 + 0) / 2,
        "e_max_violation:mean": ((4 - 2) / 2 + 0) / 2,
        "e_max_violation:max": 1.0,
        "e_min_violation:mean": ((0 - 2) / 2 + 0) / 2,
    }
    for k in E_KEYS:
        assert got[k] == pytest.approx(want[k], abs=1e-12), k
    assert numpy_metrics(
        [np.array([[0, 0], [0, 2], [2, 3], [2, 0]]), np.arange(8) % 4], 4
    ) == pytest.approx(want)


# cp is the aux-loss test's (2,2,2), whose forward_backward reports these metrics too; a
# (1,2,2) case here (~2.7 CPU s) added no axis.
@pytest.mark.parametrize("mesh_shape,max_tokens", [((1, 1, 1), 64), ((2, 1, 2), None)])
def test_metrics_match_transformers_routing(tmp, mesh_shape, max_tokens):
    """Over the real tokens of the whole call: equal on every mesh, padding excluded, and
    at (1, 1, 1) a call of several micro-batches, whose counts are summed."""
    hm, cfg, base, tree, data, ref = setup(tmp)
    assert ref["margin"] > 1e-4  # no top-k near-tie that float32 rounding could flip
    want = numpy_metrics(ref["picked"], TM.EXPERTS)
    assert ref["picked"][0].shape == (sum(LENGTHS), TM.TOP_K)
    tr, a = trainer(cfg, base, tree, mesh_shape, max_tokens_per_device=max_tokens)
    assert (tr.dp, tr.cp, tr.tp) == mesh_shape
    packed = micro_batches(tr, data, "cross_entropy", a)
    assert all((pb.segment < 0).any() for pb in packed)  # padding is there to exclude
    if max_tokens is not None:
        assert len(packed) > 1
        # Per micro-batch the figures differ: the sum over micro-batches matters.
        first = [p.index for p in packed[0].placements]
        starts = np.cumsum((0,) + LENGTHS)
        part = [
            np.concatenate([p[starts[j] : starts[j + 1]] for j in first]) for p in ref["picked"]
        ]
        assert numpy_metrics(part, TM.EXPERTS) != pytest.approx(want)
    got = tr.forward(data, "cross_entropy", adapters=a).metrics
    assert "router_aux_loss:sum" not in got
    for k in E_KEYS:
        assert got[k] == pytest.approx(want[k], rel=1e-12, abs=1e-12), k


def test_dense_model_has_no_load_metrics_and_coefficient_is_checked():
    cfg = jcp.QwenConfig.tiny()
    tr = jcp.Trainer(cfg, jcp.make_mesh(1, 1, 1), max_adapters=2, max_rank=2)
    seqs, targets, weights = MH.random_data([9, 14], seed=1)
    data = [
        jcp.Datum(s, {"target_tokens": t, "weights": w}) for s, t, w in zip(seqs, targets, weights)
    ]
    out = tr.forward_backward(data, "cross_entropy", adapters=tr.create_adapter(rank=2))
    assert set(out.metrics) == {"loss:sum"}
    with pytest.raises(ValueError, match="mixture-of-experts"):
        jcp.Trainer(cfg, jcp.make_mesh(1, 1, 1), router_aux_loss_coef=0.1)
    moe = jcp.QwenConfig.tiny_moe()
    for bad in (-0.5, float("nan"), float("inf"), True, None):
        with pytest.raises(ValueError, match="router_aux_loss_coef"):
            jcp.Trainer(moe, jcp.make_mesh(1, 1, 1), router_aux_loss_coef=bad)


# ----------------------------------------------------------------------------------------
# The router auxiliary loss


def test_router_aux_loss_gradient_matches_transformers_on_two_meshes(tmp):
    """grad(coef) = grad(0) + coef · d aux / d factors (torch), on (1, 1, 1) and (2, 2, 2)
    (f and P global over dp and cp); loss:sum stays the token sum."""
    hm, cfg, base, tree, data, ref = setup(tmp)
    runs = {}
    for mesh_shape, coef in (((1, 1, 1), 0.0), ((1, 1, 1), COEF), ((2, 2, 2), COEF)):
        tr, a = trainer(cfg, base, tree, mesh_shape, router_aux_loss_coef=coef)
        assert tr.step_cfg.router_aux_loss_coef == coef
        out = tr.forward_backward(data, "cross_entropy", adapters=a)
        runs[mesh_shape, coef] = out.metrics, tr.state.read(a, "grads")
    (m0, g0), (m1, g1), (m2, g2) = runs.values()
    assert "router_aux_loss:sum" not in m0
    want = numpy_metrics(ref["picked"], TM.EXPERTS)
    for m in (m0, m1, m2):  # forward_backward reports the load metrics too
        assert {k: m[k] for k in E_KEYS} == pytest.approx(want, rel=1e-12, abs=1e-12)
    for m in (m1, m2):
        np.testing.assert_allclose(m["router_aux_loss:sum"], COEF * ref["aux"], rtol=1e-5)
        np.testing.assert_allclose(m["loss:sum"], m0["loss:sum"], rtol=1e-6)
    np.testing.assert_allclose(m0["loss:sum"], ref["ce"], rtol=2e-5)
    scale = MH.tree_max_abs(ref["g_aux"]) * COEF
    for m in ref["g_aux"]:
        for k in ref["g_aux"][m]:
            want_d = COEF * ref["g_aux"][m][k]
            if m in ("q_proj", "expert_gate"):  # the aux gradient is really there
                assert float(np.max(np.abs(want_d))) > 0.05 * scale, (m, k)
            if m == "lm_head":  # downstream of every router: none
                assert not np.any(want_d)
            for g in (g1, g2):
                np.testing.assert_allclose(
                    g[m][k] - g0[m][k], want_d, rtol=0, atol=2e-4 * scale, err_msg=f"{m}.{k}"
                )
            np.testing.assert_allclose(
                g2[m][k], g1[m][k], rtol=1e-4, atol=1e-5 * MH.tree_max_abs(g1), err_msg=f"{m}.{k}"
            )
