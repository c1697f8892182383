"""LoRA on the experts of a Qwen3-MoE model (jcp.model.moe, model.moe_mlp, lora's expert slots).

The reference is transformers' Qwen3MoeForCausalLM in float64 with every LoRA factor merged
into its weights by hand (W + scale·(A @ B)ᵀ, per expert) through torch.func.functional_call,
so torch autograd gives the factors' gradients independently of jcp's grouped, routed
computation. All three parameterisations (per-expert, shared-outer, fused gate_up) share one batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers import model_harness as MH
from helpers import moe_harness as TM
from helpers.moe_harness import ALPHA, MOE_LAYERS, RANK, install, merged, model, random_adapter

import jcp
from jcp import lora as lora_lib
from jcp.model import moe as moe_lib

# peft warns that the gate_up rank / alpha pattern of an exported adapter "did not match
# any targeted module": it checks module names only, and does apply it to the parameter.
pytestmark = pytest.mark.filterwarnings(
    "ignore:The following (rank|alpha)_pattern keys did not match:RuntimeWarning"
)


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return str(tmp_path_factory.mktemp("moe_lora"))


def reference(hm, trees, data_adapters, seqs, targets, weights):
    """(log-probs per datum, loss −Σ w·lp, d loss / d factor per adapter) in float64."""
    hm64 = hm.double()
    params64 = {n: p.detach() for n, p in hm64.named_parameters()}
    leaves = {
        (id(tree), m, k): torch.tensor(x, dtype=torch.float64, requires_grad=True)
        for tree in trees
        for m, ab in tree.items()
        for k, x in ab.items()
    }
    lps, total = [], 0.0
    for s, t, w, k in zip(seqs, targets, weights, data_adapters):
        over = merged(params64, trees[k], ALPHA / RANK, leaves)
        logits = torch.func.functional_call(
            hm64, {**params64, **over}, (torch.tensor(np.asarray(s))[None],)
        ).logits[0]
        lp = torch.log_softmax(logits, -1)[torch.arange(len(s)), torch.tensor(np.asarray(t))]
        total = total - (torch.tensor(np.asarray(w, np.float64)) * lp).sum()
        lps.append(lp.detach().numpy())
    total.backward()
    grads = [
        {m: {k: leaves[(id(tree), m, k)].grad.numpy() for k in ab} for m, ab in tree.items()}
        for tree in trees
    ]
    hm.float()
    return lps, float(total.detach()), grads


def test_expert_lora_matches_torch(tmp):
    """Each parameterisation 3 times in one batch at (2,1,4): 9 adapters, more than
    DENSE_MAX_ADAPTERS (the experts' (expert, adapter) tiles, moe._grouped_lora, and the
    other modules' grouped products), experts split over tp = 4. The masked products of
    fewer adapters equal the grouped ones (test_grouped_expert_lora_equals_masked) and
    peft's one adapter (test_peft_expert_adapter_matches_peft); a second case of 3 adapters
    here (~12 CPU s) added no mesh axis or product."""
    mesh_shape = (2, 1, 4)
    hm, path = model(tmp)
    cfg, base = jcp.load_hf(path)
    assert cfg.moe_layers == (False, True, True) and cfg.is_moe
    modes = ("shared_outer", "per_expert", "fused_gate_up") * 3
    trees = [random_adapter(cfg, m, i + 1) for i, m in enumerate(modes)]
    assert "a_shared" in trees[0]["expert_gate"] and "a_shared" not in trees[1]["expert_gate"]
    assert set(trees[2]["expert_up"]) == {"b"}  # tied to expert_gate's A
    assert len(modes) > lora_lib.DENSE_MAX_ADAPTERS
    seqs, targets, weights = MH.random_data([9, 14, 6, 11, 8, 13, 7, 10, 12], seed=6)
    data_adapters = list(range(len(modes)))
    want_lp, want_loss, want_g = reference(hm, trees, data_adapters, seqs, targets, weights)

    tr = jcp.Trainer(
        cfg,
        jcp.make_mesh(*mesh_shape),
        base_params=base,
        max_adapters=len(modes),
        max_rank=8,
        seed=0,
    )
    assert (tr.dp, tr.cp, tr.tp) == mesh_shape
    ids = [install(tr, tree, m) for tree, m in zip(trees, modes)]
    assert [tr.adapters[i].expert_lora for i in ids] == list(modes)
    data = [
        jcp.Datum(s, {"target_tokens": t, "weights": w}) for s, t, w in zip(seqs, targets, weights)
    ]
    out = tr.forward_backward(data, "cross_entropy", adapters=[ids[k] for k in data_adapters])
    for o, want in zip(out.loss_fn_outputs, want_lp):
        got = o["logprobs"]
        np.testing.assert_allclose(got, want, atol=2e-4, rtol=0)
    np.testing.assert_allclose(out.metrics["loss:sum"], want_loss, rtol=2e-5)
    for i, want in zip(ids, want_g):
        got = tr.state.read(i, "grads")
        assert set(got) == set(want) and all(set(got[m]) == set(want[m]) for m in got)
        scale = max(float(np.max(np.abs(x))) for ab in want.values() for x in ab.values())
        for m in want:
            for k in want[m]:
                assert float(np.max(np.abs(want[m][k]))) > 1e-4 * scale, (m, k)  # exercised
                np.testing.assert_allclose(
                    got[m][k],
                    want[m][k],
                    atol=2e-5 * scale,
                    rtol=1e-3,
                    err_msg=f"adapter {i} {m}.{k}",
                )


def test_optim_step_isolates_adapters_and_keeps_unused_factors_zero(tmp):
    _, path = model(tmp)
    cfg, base = jcp.load_hf(path)
    tr = jcp.Trainer(
        cfg, jcp.make_mesh(1, 2, 2), base_params=base, max_adapters=3, max_rank=8, seed=0
    )
    modes = ("shared_outer", "per_expert", "fused_gate_up")
    ids = [install(tr, random_adapter(cfg, m, 10 + i), m) for i, m in enumerate(modes)]
    seqs, targets, weights = MH.random_data([20, 31, 12], seed=6)
    data = [
        jcp.Datum(s, {"target_tokens": t, "weights": w}) for s, t, w in zip(seqs, targets, weights)
    ]
    tr.forward_backward(data, "cross_entropy", adapters=ids)
    before = jax.tree.map(np.asarray, tr.state.tables())
    tr.optim_step(ids[0], jcp.AdamParams(learning_rate=1e-2, weight_decay=0.1))
    after = jax.tree.map(np.asarray, tr.state.tables())
    for m in lora_lib.EXPERT:
        for k in before["weights"][m]:
            for name in ("weights", "mu", "nu"):
                # The other slots are bit-identical; the stepped one moved.
                for i in ids[1:]:
                    np.testing.assert_array_equal(after[name][m][k][i], before[name][m][k][i])
            used = k in lora_lib.expert_keys(m, "shared_outer")
            changed = not np.array_equal(
                after["weights"][m][k][ids[0]], before["weights"][m][k][ids[0]]
            )
            assert changed == used, (m, k)
            if not used:  # the per-expert hidden-side factor of a shared-outer slot
                assert not np.any(after["weights"][m][k][ids[0]])
                assert not np.any(after["mu"][m][k][ids[0]])
    # A fused_gate_up slot: expert_up's own A is never used (it reads expert_gate's) and
    # stays exactly zero through a step; its used factors move.
    tr.optim_step(ids[2], jcp.AdamParams(learning_rate=1e-2, weight_decay=0.1))
    last = jax.tree.map(np.asarray, tr.state.tables())
    for m in lora_lib.EXPERT:
        for k in last["weights"][m]:
            used = k in lora_lib.expert_keys(m, "fused_gate_up")
            w = last["weights"][m][k][ids[2]]
            assert (not np.array_equal(w, after["weights"][m][k][ids[2]])) == used, (m, k)
            if not used:
                assert not np.any(w) and not np.any(last["mu"][m][k][ids[2]]), (m, k)


def test_experts_unit_reference_empty_expert_and_all_elsewhere():
    """moe.experts with two adapters (one shared-outer, one per-expert) against a per-token
    NumPy-style loop; local expert 1 gets no row (zero gradient for its factors, no NaN);
    with every token routed to other ranks' experts, nothing and no gradient here."""
    rng = np.random.default_rng(3)
    s, d, f, e, r, k = 12, 16, 8, 4, 3, 2
    experts = np.stack([rng.choice([4, 6, 7], s), rng.choice([0, 2, 3], s)], 1)
    assert not np.isin(5, experts).any()
    x = jnp.asarray(rng.standard_normal((s, d)), jnp.float32)
    wts = jnp.asarray(rng.uniform(0.1, 1.0, (s, k)), jnp.float32)
    w = [
        jnp.asarray(0.3 * rng.standard_normal(sh), jnp.float32)
        for sh in ((e, d, f), (e, d, f), (e, f, d))
    ]

    def factors(shared):
        n = lambda *sh: jnp.asarray(0.3 * rng.standard_normal(sh), jnp.float32)  # noqa: E731
        return {
            "expert_gate": {"a": n(2, e, d, r), "a_shared": n(2, d, r), "b": n(2, e, r, f)},
            "expert_up": {"a": n(2, e, d, r), "a_shared": n(2, d, r), "b": n(2, e, r, f)},
            "expert_down": {"a": n(2, e, f, r), "b": n(2, e, r, d), "b_shared": n(2, r, d)},
        }

    lora = factors(None)
    route = lora_lib.Routing(
        active_A=jnp.asarray([0, 1]),
        spans_Ax2=jnp.asarray([[0, 5], [5, 12]]),
        scale_A=jnp.asarray([2.0, 0.5]),
        shared_A=jnp.asarray([1.0, 0.0]),
    )
    token_adapter = np.asarray([0] * 5 + [1] * 7)
    # On the host: the reference's Python branches read them while it is traced (jitted).
    scale_A, shared_A = np.asarray(route.scale_A), np.asarray(route.shared_A)

    @jax.jit  # one program (op by op it took twice the CPU time)
    def run(x, lora, experts=experts):
        return moe_lib.experts(
            x, wts, jnp.asarray(experts, jnp.int32), moe_lib.ExpertWeights(*w), 4, lora, route
        )

    @jax.jit  # one program too (op by op: ~180 small compiles, ~3 CPU s more)
    def reference(x, lora):
        y = jnp.zeros_like(x)
        for t in range(s):
            a = token_adapter[t]
            sc, shared = float(scale_A[a]), bool(shared_A[a])
            for c in range(k):
                ge = int(experts[t, c]) - 4
                if not 0 <= ge < e:
                    continue
                fa = lambda m, key: (
                    lora[m][key + "_shared"][a]
                    if shared  # noqa: E731
                    else lora[m][key][a, ge]
                )
                g = (
                    x[t] @ w[0][ge]
                    + sc * (x[t] @ fa("expert_gate", "a")) @ lora["expert_gate"]["b"][a, ge]
                )
                u = (
                    x[t] @ w[1][ge]
                    + sc * (x[t] @ fa("expert_up", "a")) @ lora["expert_up"]["b"][a, ge]
                )
                z = jax.nn.silu(g) * u
                o = z @ w[2][ge] + sc * (z @ lora["expert_down"]["a"][a, ge]) @ fa(
                    "expert_down", "b"
                )
                y = y.at[t].add(wts[t, c] * o)
        return y

    np.testing.assert_allclose(run(x, lora), reference(x, lora), atol=1e-4, rtol=1e-4)
    loss = lambda fn: lambda x, lo: jnp.sum(jnp.sin(fn(x, lo)))  # noqa: E731
    g = jax.jit(jax.grad(loss(run), (0, 1)))(x, lora)
    want = jax.jit(jax.grad(loss(reference), (0, 1)))(x, lora)
    assert all(np.isfinite(np.asarray(v)).all() for v in jax.tree.leaves(g))
    np.testing.assert_allclose(g[0], want[0], atol=1e-4, rtol=1e-4)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g[1]), jax.tree.leaves(want[1])):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4, err_msg=str(path))
    # Each mode trains only its own factors: adapter 0 (shared-outer) no per-expert
    # hidden-side factor, adapter 1 (per-expert) no shared one.
    for m, key in (("expert_gate", "a"), ("expert_up", "a"), ("expert_down", "b")):
        assert float(jnp.max(jnp.abs(g[1][m][key][0]))) == 0.0
        assert float(jnp.max(jnp.abs(g[1][m][key][1]))) > 0.0
    for m, key in (
        ("expert_gate", "a_shared"),
        ("expert_up", "a_shared"),
        ("expert_down", "b_shared"),
    ):
        assert float(jnp.max(jnp.abs(g[1][m][key][1]))) == 0.0
        assert float(jnp.max(jnp.abs(g[1][m][key][0]))) > 0.0
    # Local expert 1 (global 5) received no row: its per-expert factors get no gradient.
    for m in lora_lib.EXPERT:
        for key in ("a", "b"):
            assert float(jnp.max(jnp.abs(g[1][m][key][:, 1]))) == 0.0
    # Every token's experts on other ranks: zeros, and no gradient for anything here.
    elsewhere = experts % 4
    far = lambda x, lo: run(x, lo, elsewhere)  # noqa: E731
    assert float(jnp.max(jnp.abs(far(x, lora)))) == 0.0
    g = jax.jit(jax.grad(loss(lambda x, lo: far(x, lo) + x), (0, 1)))(x, lora)
    np.testing.assert_allclose(g[0], jnp.cos(x), rtol=1e-6)
    assert all(float(jnp.max(jnp.abs(v))) == 0.0 for v in jax.tree.leaves(g[1]))


def test_top_k_ties_go_to_the_lower_expert_on_every_mesh(tmp):
    """Experts 1 and 6 get identical router columns, so their probabilities tie exactly.
    jcp breaks a tie at the top-k boundary toward the lower expert index (lax.top_k's
    rule), on one device and with the two experts on different tp ranks. torch.topk's tie
    order is unspecified (on CPU it picks the higher index on some rows), so the reference
    is transformers with its router's top-k taken by a stable sort — the same rule."""
    hm = TM.hf_moe(True, seed=2)
    with torch.no_grad():
        for li in MOE_LAYERS:
            gate = hm.model.layers[li].mlp.gate.weight  # [E, D]
            gate[6] = gate[1]
    path = MH.save(hm, f"{tmp}/ties")
    cfg, base = jcp.load_hf(path)
    seqs, targets, _ = MH.random_data([40, 33], seed=8)
    straddling = []

    def stable_top_k(router, args, out):
        logits = out[0]
        probs = torch.softmax(logits, dtype=torch.float, dim=-1)
        assert torch.equal(logits[:, 1], logits[:, 6])
        # Ties really straddle the boundary: exactly top_k − 1 experts above the pair.
        straddling.append(int(((probs > probs[:, 1:2]).sum(-1) == TM.TOP_K - 1).sum()))
        order = torch.sort(probs, dim=-1, descending=True, stable=True).indices
        idx = order[:, : TM.TOP_K]
        top = torch.gather(probs, 1, idx)
        top = top / top.sum(-1, keepdim=True)  # norm_topk_prob
        return logits, top.to(logits.dtype), idx

    hooks = [hm.model.layers[li].mlp.gate.register_forward_hook(stable_top_k) for li in MOE_LAYERS]
    want = MH.reference_logprobs(hm, seqs, targets)
    for h in hooks:
        h.remove()
    assert sum(straddling) > 0
    for mesh_shape in ((1, 1, 1), (1, 1, 4)):
        got = MH.logprobs(cfg, base, mesh_shape, seqs, targets)
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, atol=2e-4, rtol=0)


# tp = 4 over the experts is test_expert_lora_matches_torch's (2,1,4); a (1,1,4) case here
# (~6 CPU s) added no axis.
PEFT_MESHES = ((1, 1, 1), (1, 2, 2))


@pytest.fixture(scope="module")
def peft_folder(tmp):
    """A peft adapter on attention and the experts' fused parameters (random nonzero A and
    B), saved by peft; its fp64 log-probs, loss and gradients by parameter name."""
    import peft

    hm = TM.hf_moe(True, seed=3)
    base_path = MH.save(hm, f"{tmp}/peft_base")  # before peft wraps hm's modules in place
    pm = peft.get_peft_model(
        hm,
        peft.LoraConfig(
            r=RANK,
            lora_alpha=ALPHA,
            lora_dropout=0.0,
            bias="none",
            task_type="CAUSAL_LM",
            target_modules=list(lora_lib.ATTN),
            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        ),
    )
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    pm.save_pretrained(f"{tmp}/peft_experts")
    seqs, targets, weights = MH.random_data([29, 44], seed=9)
    lps, total, grads = MH.peft_fp64_reference(pm, seqs, targets, weights)
    assert any("experts.base_layer.lora_A" in n for n in grads)  # gate_up really targeted
    return {
        "path": f"{tmp}/peft_experts",
        "base": base_path,
        "data": (seqs, targets, weights),
        "lps": lps,
        "loss": total,
        "grads": grads,
    }


@pytest.mark.parametrize("mesh_shape", PEFT_MESHES)
def test_peft_expert_adapter_matches_peft(peft_folder, mesh_shape, tmp_path):
    cfg, base = jcp.load_hf(peft_folder["base"])
    tr = jcp.Trainer(
        cfg, jcp.make_mesh(*mesh_shape), base_params=base, max_adapters=2, max_rank=8, seed=0
    )
    a = tr.load_peft(peft_folder["path"])
    info = tr.adapters[a]
    # peft's parameterisation: gate and up share the fused gate_up's one A per expert
    assert info.expert_lora == "fused_gate_up" and info.rank == RANK
    assert set(lora_lib.EXPERT) <= set(info.targets)
    seqs, targets, weights = peft_folder["data"]
    data = [
        jcp.Datum(s, {"target_tokens": t, "weights": w}) for s, t, w in zip(seqs, targets, weights)
    ]
    out = tr.forward_backward(data, "cross_entropy", adapters=a)
    for o, want in zip(out.loss_fn_outputs, peft_folder["lps"]):
        np.testing.assert_allclose(o["logprobs"], want, atol=2e-4, rtol=0)
    np.testing.assert_allclose(out.metrics["loss:sum"], peft_folder["loss"], rtol=2e-5)
    # peft's keys and shapes exactly: gate_up lora_A [r·E, D], not 2r·E rows
    want, got = peft_folder["grads"], tr.gradients(a)
    assert {k: v.shape for k, v in got.items()} == {k: v.shape for k, v in want.items()}
    gate_up_a = (
        f"base_model.model.model.layers.{MOE_LAYERS[0]}.mlp.experts.base_layer.lora_A.weight"
    )
    assert got[gate_up_a].shape == (RANK * TM.EXPERTS, MH.D)
    scale = max(float(np.max(np.abs(g))) for g in want.values())
    for k in want:
        np.testing.assert_allclose(got[k], want[k], atol=2e-5 * scale, rtol=1e-3, err_msg=k)
    if mesh_shape == PEFT_MESHES[-1]:
        # Export -> peft -> the same log-probs.
        import peft

        tr.export_peft(a, tmp_path / "out")
        hm = transformers_model(peft_folder["base"])
        pm = peft.PeftModel.from_pretrained(hm, str(tmp_path / "out")).eval()
        for s, t, want in zip(seqs, targets, peft_folder["lps"]):
            with torch.no_grad():
                logits = pm(torch.tensor(np.asarray(s))[None]).logits[0].double()
            lp = torch.log_softmax(logits, -1)[torch.arange(len(s)), torch.tensor(np.asarray(t))]
            np.testing.assert_allclose(lp.numpy(), want, atol=2e-4, rtol=0)


def test_peft_expert_adapter_trains_as_peft_does(peft_folder, tmp_path):
    """Two AdamW steps of the imported adapter equal torch's AdamW on the peft model (fp64),
    parameter by parameter under peft's names, and the export is still at rank r."""
    import peft

    cfg, base = jcp.load_hf(peft_folder["base"])
    # The Trainer of test_peft_expert_adapter_matches_peft at (1,1,1): the same data's
    # forward_backward is then loaded from the tests' compilation cache, not compiled.
    tr = jcp.Trainer(
        cfg, jcp.make_mesh(1, 1, 1), base_params=base, max_adapters=2, max_rank=8, seed=0
    )
    a = tr.load_peft(peft_folder["path"])
    seqs, targets, weights = peft_folder["data"]
    data = [
        jcp.Datum(s, {"target_tokens": t, "weights": w}) for s, t, w in zip(seqs, targets, weights)
    ]
    # eps well above float32's gradient noise, so Adam's sign-like first step cannot
    # amplify it; weight decay on, no clipping
    hp = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-3, weight_decay=0.1)
    adam = jcp.AdamParams(
        learning_rate=hp["lr"],
        beta1=0.9,
        beta2=0.95,
        eps=hp["eps"],
        weight_decay=hp["weight_decay"],
        grad_clip_norm=0.0,
    )

    pm = peft.PeftModel.from_pretrained(
        transformers_model(peft_folder["base"]), peft_folder["path"], is_trainable=True
    ).double()
    params = {n.replace(".default", ""): p for n, p in pm.named_parameters() if p.requires_grad}
    opt = torch.optim.AdamW(list(params.values()), **hp)
    start = {k: v.detach().numpy().copy() for k, v in params.items()}
    assert {k: v.shape for k, v in tr.adapter_weights(a).items()} == {
        k: v.shape for k, v in start.items()
    }
    for _ in range(2):
        tr.forward_backward(data, "cross_entropy", adapters=a)
        tr.optim_step(a, adam)
        opt.zero_grad()
        total = 0.0
        for s, t, w in zip(seqs, targets, weights):
            logits = pm(torch.tensor(np.asarray(s))[None]).logits[0]
            lp = torch.log_softmax(logits, -1)[torch.arange(len(s)), torch.tensor(np.asarray(t))]
            total = total - (torch.tensor(np.asarray(w, np.float64)) * lp).sum()
        total.backward()
        opt.step()
    got = tr.adapter_weights(a)
    moved = max(float(np.max(np.abs(p.detach().numpy() - start[k]))) for k, p in params.items())
    assert moved > 1e-3  # the two steps really moved the weights (20x the tolerance)
    for k, p in params.items():
        np.testing.assert_allclose(got[k], p.detach().numpy(), atol=5e-5, rtol=0, err_msg=k)

    tr.export_peft(a, tmp_path / "trained")
    with open(tmp_path / "trained" / "adapter_config.json") as f:
        pc = __import__("json").load(f)
    assert pc["r"] == RANK and not pc["rank_pattern"]
    back = peft.PeftModel.from_pretrained(
        transformers_model(peft_folder["base"]), str(tmp_path / "trained")
    )
    for n, p in back.named_parameters():
        if "lora_" in n:
            k = n.replace(".default", "")
            np.testing.assert_array_equal(p.detach().numpy(), got[k], err_msg=k)
    # a checkpoint keeps the tie
    tr.save_state(a, tmp_path / "ck")
    tr.delete_adapter(a)
    b = tr.load_state(tmp_path / "ck")
    assert tr.adapters[b].expert_lora == "fused_gate_up"
    for k, v in tr.adapter_weights(b).items():
        np.testing.assert_array_equal(v, got[k], err_msg=k)


def transformers_model(path):
    import transformers

    return transformers.Qwen3MoeForCausalLM.from_pretrained(
        path, experts_implementation="eager", dtype=torch.float32
    ).eval()


# ----------------------------------------------------------------------------------------
# Sampling a MoE model


@pytest.mark.parametrize("mesh_shape", [(1, 2, 2)])
def test_sampling_a_moe_model(tmp, mesh_shape):
    """Greedy tokens of the base MoE model equal transformers' generate; sampled and prompt
    log-probs with expert adapters of both kinds (mixed in one call) equal forward's."""
    hm, path = model(tmp)
    cfg, base = jcp.load_hf(path)
    tr = jcp.Trainer(
        cfg, jcp.make_mesh(*mesh_shape), base_params=base, max_adapters=3, max_rank=8, seed=0
    )
    ids = [
        install(tr, random_adapter(cfg, "shared_outer", 21), "shared_outer"),
        install(tr, random_adapter(cfg, "per_expert", 22), "per_expert"),
    ]
    prompts = [np.arange(5, 17), np.asarray([3, 99, 42]), np.arange(60, 90)]
    greedy = jcp.SamplingParams(max_tokens=8, temperature=0.0, stop=[])
    got = tr.sample(prompts, greedy)
    for p, r in zip(prompts, got):
        with torch.no_grad():
            ids_t = torch.tensor(p)[None]
            want = hm.generate(
                input_ids=ids_t,
                attention_mask=torch.ones_like(ids_t),
                do_sample=False,
                max_new_tokens=8,
                min_new_tokens=8,
                pad_token_id=0,
            )[0, len(p) :].numpy()
        np.testing.assert_array_equal(r.sequences[0].tokens, want)
    adapters = [ids[0], ids[1], ids[0]]
    sp = jcp.SamplingParams(max_tokens=8, temperature=1.0, seed=3, stop=[])
    res = tr.sample(prompts, sp, adapters=adapters, prompt_logprobs=True)
    assert any(
        not np.array_equal(r.sequences[0].tokens, g.sequences[0].tokens) for r, g in zip(res, got)
    )
    for p, r, a in zip(prompts, res, adapters):
        seq = r.sequences[0]
        full = np.concatenate([p, seq.tokens]).astype(np.int32)
        d = jcp.Datum(
            full[:-1], {"target_tokens": full[1:], "weights": np.zeros(len(full) - 1, np.float32)}
        )
        lp = tr.forward([d], adapters=a).loss_fn_outputs[0]["logprobs"]
        np.testing.assert_allclose(seq.logprobs, lp[len(p) - 1 :], atol=2e-4, rtol=0)
        np.testing.assert_allclose(r.prompt_logprobs[1:], lp[: len(p) - 1], atol=2e-4, rtol=0)


def test_shared_outer_only_slots_are_leaner_and_equal(tmp):
    """Trainer(expert_lora_modes=("shared_outer",)) holds no per-expert hidden-side factor;
    a shared-outer adapter gives the same loss and gradients as in a table of both kinds;
    a per-expert adapter is refused with the state unchanged."""
    _, path = model(tmp)
    cfg, base = jcp.load_hf(path)
    mesh = jcp.make_mesh(1, 1, 2)
    both = jcp.Trainer(cfg, mesh, base_params=base, max_adapters=2, max_rank=8, seed=0)
    lean = jcp.Trainer(
        cfg,
        mesh,
        base_params=base,
        max_adapters=2,
        max_rank=8,
        seed=0,
        expert_lora_modes=("shared_outer",),
    )
    tables = [t.state.tables()["weights"] for t in (both, lean)]
    assert set(tables[0]["expert_gate"]) == {"a", "a_shared", "b"}
    assert set(tables[1]["expert_gate"]) == {"a_shared", "b"}
    assert set(tables[1]["expert_down"]) == {"a", "b_shared"}
    size = lambda t: sum(x.size for x in jax.tree.leaves(t))  # noqa: E731
    assert size(tables[1]) < 0.7 * size(tables[0])
    tree = random_adapter(cfg, "shared_outer", 31)
    seqs, targets, weights = MH.random_data([25, 14], seed=2)
    data = [
        jcp.Datum(s, {"target_tokens": t, "weights": w}) for s, t, w in zip(seqs, targets, weights)
    ]
    results = []
    for tr in (both, lean):
        a = install(tr, tree, "shared_outer")
        out = tr.forward_backward(data, "cross_entropy", adapters=a)
        results.append((out.metrics["loss:sum"], tr.state.read(a, "grads")))
    assert results[0][0] == pytest.approx(results[1][0], rel=1e-6)
    for m in results[0][1]:
        for k in results[0][1][m]:
            np.testing.assert_allclose(
                results[1][1][m][k], results[0][1][m][k], rtol=1e-5, atol=1e-6, err_msg=f"{m}.{k}"
            )
    before = jax.tree.map(np.asarray, lean.state.tables())
    with pytest.raises(jcp.InputError, match="expert_lora_modes"):
        lean.create_adapter(rank=4, expert_lora="per_expert")
    after = jax.tree.map(np.asarray, lean.state.tables())
    assert jax.tree.all(jax.tree.map(np.array_equal, before, after))
    with pytest.raises(ValueError, match="expert_lora_modes"):
        jcp.Trainer(cfg, mesh, base_params=base, expert_lora_modes=("shared",))
    # An unknown parameterisation and experts on a dense model: refused, nothing allocated.
    infos = dict(both.adapters)
    before = jax.tree.map(np.asarray, both.state.tables())
    with pytest.raises(jcp.InputError, match="expert_lora must be one of"):
        both.create_adapter(rank=4, expert_lora="shared")
    assert dict(both.adapters) == infos
    assert jax.tree.all(
        jax.tree.map(np.array_equal, before, jax.tree.map(np.asarray, both.state.tables()))
    )
    with pytest.raises(ValueError, match="dense model"):
        lora_lib.resolve_targets(["experts"], jcp.QwenConfig.tiny())


@pytest.mark.parametrize("by", ["spans", "rows"])
def test_grouped_expert_lora_equals_masked(by):
    """moe.experts over 7 adapters (shared-outer, per-expert and fused gate_up mixed, a
    base-model entry), routed by spans (training) or row by row in any order (decode), some
    experts on another rank: the grouped (expert, adapter) tiles give the masked product's
    output and gradients of x and every factor."""
    rng = np.random.default_rng(5)
    s, d, f, e, k, r, n_a = 40, 8, 6, 4, 2, 3, 7
    meta = lora_lib.SlotMeta(
        scale_G=jnp.asarray(rng.uniform(0.5, 2.0, 9), jnp.float32),
        shared_G=jnp.asarray([1, 0, 0, 1, 0, 1, 0, 0, 1], jnp.float32),
        tied_G=jnp.asarray([0, 1, 0, 0, 1, 0, 0, 0, 0], jnp.float32),
    )
    active = jnp.asarray([3, 1, 0, -1, 5, 2, 4], jnp.int32)
    edges = np.array([0, 5, 9, 15, 20, 26, 31, 37])
    spans = jnp.asarray(np.stack([edges[:-1], edges[1:]], 1), jnp.int32)
    experts = jnp.asarray(np.stack([rng.permutation(6)[:k] for _ in range(s)]), jnp.int32)
    n = lambda *sh: jnp.asarray(0.3 * rng.standard_normal(sh), jnp.float32)  # noqa: E731
    x, wts = n(s, d), jnp.asarray(rng.uniform(0.1, 1.0, (s, k)), jnp.float32)
    w = (n(e, d, f), n(e, d, f), n(e, f, d))
    lora = {
        "expert_gate": {"a": n(n_a, e, d, r), "a_shared": n(n_a, d, r), "b": n(n_a, e, r, f)},
        "expert_up": {"a": n(n_a, e, d, r), "a_shared": n(n_a, d, r), "b": n(n_a, e, r, f)},
        "expert_down": {"a": n(n_a, e, f, r), "b": n(n_a, e, r, d), "b_shared": n(n_a, r, d)},
    }
    if by == "rows":  # each stream row's adapter, shuffled (rows past the spans: entry 3)
        own = np.full(s, 3)
        for j, (a, b) in enumerate(np.asarray(spans)):
            own[a:b] = j
        index = jnp.asarray(rng.permutation(own), jnp.int32)
    ct = n(s, d)

    def run(grouped):
        if by == "rows":
            route = meta.routing(active, None, index, grouped=grouped)
        else:
            route = meta.routing(active, spans, s_len=s, grouped=grouped)
        assert (route.tiles is not None) == grouped

        def loss(x, lora):
            return jnp.vdot(
                moe_lib.experts(x, wts, experts, moe_lib.ExpertWeights(*w), 2, lora, route), ct
            )

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, lora)

    got, want = run(True), run(False)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for (path, g), h in zip(jax.tree_util.tree_leaves_with_path(got[1]), jax.tree.leaves(want[1])):
        assert float(jnp.abs(h).max()) > 0, path  # every factor used by some adapter
        np.testing.assert_allclose(
            g, h, rtol=1e-4, atol=1e-5 * float(jnp.abs(h).max()), err_msg=str(path)
        )
