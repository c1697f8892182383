"""The Trainer against torch + transformers + peft, with the same weights.

Evidence:
1. load_peft of folders that peft's save_pretrained wrote (one plain adapter on every
   module and lm_head, one rsLoRA adapter on a subset) reproduces their tensors exactly;
2. one batch mixing both adapters, on a (2,2,2) mesh, gives the per-datum log-probs of the
   PeftModels run one datum at a time, the cross_entropy and ppo losses computed in torch
   from those log-probs (docs/design.md's formulas), and torch autograd's gradients w.r.t.
   every lora_A / lora_B (fp64 reference, fp32 jcp: rel ~1e-4);
3. export_peft after an optim_step loads with peft.PeftModel.from_pretrained and gives the
   log-probs jcp computes; load_peft of the export gives back identical weights.
"""

from __future__ import annotations

import copy
import types

import numpy as np
import peft
import pytest
import torch
from helpers import hf_models
from helpers import trainer_harness as H
from helpers.hf_models import tiny_hf
from safetensors.numpy import load_file

import jcp

MESH = (2, 2, 2)
V, D, F, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 128, 64, 96, 2, 4, 2, 24
LENGTHS = (23, 1, 40, 9, 17, 2)
ASSIGN = (0, 1, 0, 1, 1, 0)  # which of the two adapters each datum uses
ALL_TARGETS = [
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "lm_head",
]
ADAPTERS = (
    dict(r=4, lora_alpha=8, target_modules=ALL_TARGETS, use_rslora=False, seed=1),
    dict(
        r=8,
        lora_alpha=12,
        target_modules=["q_proj", "v_proj", "down_proj", "lm_head"],
        use_rslora=True,
        seed=2,
    ),
)
PPO = {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}
# fp32 against an fp64 reference; measured errors are ~1e-6 (log-probs) and ~1e-6 of the
# largest gradient, so these leave a wide margin and still catch any real mismatch.
LP_ATOL = 2e-5
GRAD_RTOL, GRAD_ATOL = 1e-4, 2e-5  # atol times the adapter's largest gradient


def hf_model(seed=0):
    """A tiny random Qwen3ForCausalLM (untied, head_dim ≠ D / heads, non-unit norms)."""
    return tiny_hf(
        "qwen3",
        seed=seed,
        vocab_size=V,
        hidden_size=D,
        intermediate_size=F,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
    )


def peft_model(hm, spec):
    """hm in peft's LoRA of one ADAPTERS spec, B randomised."""
    return hf_models.peft_model(
        hm,
        spec["seed"],
        r=spec["r"],
        lora_alpha=spec["lora_alpha"],
        target_modules=spec["target_modules"],
        use_rslora=spec["use_rslora"],
    )


def design_key(peft_param_name: str) -> str:
    """peft's parameter name -> the docs/design.md key (drop the adapter name "default")."""
    return peft_param_name.replace(".default.", ".")


def lora_params(pm) -> dict[str, torch.nn.Parameter]:
    return {design_key(n): p for n, p in pm.named_parameters() if "lora_" in n}


def torch_logprobs(pm, tokens, targets):
    """log p(target_i | tokens ≤ i) of one datum run alone: [N], differentiable, fp64 model."""
    logits = pm(input_ids=torch.tensor(np.asarray(tokens))[None]).logits[0]
    lp = torch.log_softmax(logits.double(), -1)
    return lp[torch.arange(len(tokens)), torch.tensor(np.asarray(targets))]


def torch_token_loss(loss_fn, lp, d: jcp.Datum):
    """docs/design.md's token losses, in torch."""
    x = {
        k: torch.tensor(np.asarray(v, np.float64))
        for k, v in d.loss_fn_inputs.items()
        if k != "target_tokens"
    }
    if loss_fn == "cross_entropy":
        return -x["weights"] * lp
    if loss_fn == "ppo":
        r = torch.exp(lp - x["logprobs"])
        a = x["advantages"]
        clipped = torch.clamp(r, PPO["clip_low_threshold"], PPO["clip_high_threshold"]) * a
        return -torch.minimum(r * a, clipped)
    raise ValueError(loss_fn)


def torch_reference(models, data, assign, loss_fn):
    """Per-datum (logprobs, elementwise_loss), and the gradient of the summed loss w.r.t.
    every LoRA tensor of each model (DESIGN keys)."""
    for pm in models:
        pm.zero_grad()
    outs, total = [], 0.0
    for d, k in zip(data, assign):
        lp = torch_logprobs(models[k], d.model_input, d.loss_fn_inputs["target_tokens"])
        el = torch_token_loss(loss_fn, lp, d)
        total = total + el.sum()
        outs.append((lp.detach().numpy(), el.detach().numpy()))
    total.backward()
    grads = [
        {k: p.grad.detach().double().numpy().copy() for k, p in lora_params(pm).items()}
        for pm in models
    ]
    return outs, grads, float(total.detach())


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("peft_world")
    hm = hf_model(seed=3)
    hm.save_pretrained(root / "base", safe_serialization=True)
    cfg, base = jcp.load_hf(str(root / "base"))
    models, folders = [], []
    for i, spec in enumerate(ADAPTERS):
        pm = peft_model(hm, spec)
        pm.save_pretrained(root / f"adapter{i}")
        folders.append(str(root / f"adapter{i}"))
        models.append(copy.deepcopy(pm).double())  # the reference runs in fp64
    rng = np.random.default_rng(7)
    data = []
    for n in LENGTHS:
        data.append(
            jcp.Datum(
                rng.integers(0, V, n),
                {
                    "target_tokens": rng.integers(0, V, n),
                    "weights": rng.uniform(0.0, 1.5, n).astype(np.float32),
                    "advantages": rng.normal(size=n).astype(np.float32),
                    "logprobs": np.zeros(n, np.float32),
                },
            )
        )
    # Sampling log-probs near the model's own, so PPO's ratio straddles its clip range.
    base64 = copy.deepcopy(hm).double()
    with torch.no_grad():
        for d, k in zip(data, ASSIGN):
            lp = torch_logprobs(models[k], d.model_input, d.loss_fn_inputs["target_tokens"])
            # The adapters matter: they move the log-probs far beyond the tolerance.
            plain = torch_logprobs(base64, d.model_input, d.loss_fn_inputs["target_tokens"])
            assert float(torch.max(torch.abs(lp - plain))) > 100 * LP_ATOL
            d.loss_fn_inputs["logprobs"] = (lp.numpy() + 0.1 * rng.normal(size=len(lp))).astype(
                np.float32
            )
    tr = jcp.Trainer(cfg, jcp.make_mesh(*MESH), base_params=base, **H.TRAINER_KW)
    return types.SimpleNamespace(
        hm=hm, cfg=cfg, models=models, folders=folders, data=data, tr=tr, root=root
    )


def _load(world):
    return [world.tr.load_peft(f) for f in world.folders]


def _compare(out, grads, ref_outs, ref_grads, ref_total, what):
    for i, (o, (lp, el)) in enumerate(zip(out.loss_fn_outputs, ref_outs)):
        np.testing.assert_allclose(
            o["logprobs"], lp, rtol=0, atol=LP_ATOL, err_msg=f"{what}: datum {i} logprobs"
        )
        el_scale = max(1.0, float(np.max(np.abs(el))))
        np.testing.assert_allclose(
            o["elementwise_loss"],
            el,
            rtol=1e-4,
            atol=LP_ATOL * el_scale,
            err_msg=f"{what}: datum {i} elementwise_loss",
        )
        assert o["loss:sum"] == pytest.approx(float(el.sum()), rel=1e-4, abs=LP_ATOL * len(el))
    assert out.metrics["loss:sum"] == pytest.approx(ref_total, rel=1e-4, abs=1e-3)
    for k, (g, want) in enumerate(zip(grads, ref_grads)):
        H.assert_grads_close(g, want, GRAD_RTOL, GRAD_ATOL, f"{what}: adapter {k}")


def test_load_peft_reads_peft_folders_exactly(world):
    tr = world.tr
    with H.borrowed(tr):
        ids = _load(world)
        for a, spec, folder in zip(ids, ADAPTERS, world.folders):
            info = tr.adapters[a]
            assert info.rank == spec["r"]
            assert set(info.targets) == set(spec["target_modules"])
            scale = spec["lora_alpha"] / (np.sqrt(spec["r"]) if spec["use_rslora"] else spec["r"])
            assert info.scale == pytest.approx(scale)
            saved = {
                k: v
                for k, v in load_file(f"{folder}/adapter_model.safetensors").items()
                if "lora_" in k
            }
            got = tr.adapter_weights(a)
            assert got.keys() == saved.keys()
            for k in saved:
                np.testing.assert_array_equal(got[k], saved[k], err_msg=k)
            assert all(np.any(v != 0) for k, v in got.items() if "lora_B" in k)


@pytest.mark.parametrize("loss_fn", ["cross_entropy", "ppo"])
def test_forward_backward_matches_torch_peft(world, loss_fn):
    tr = world.tr
    assert (tr.dp, tr.cp, tr.tp) == MESH
    cfg = PPO if loss_fn == "ppo" else None
    ref_outs, ref_grads, ref_total = torch_reference(world.models, world.data, ASSIGN, loss_fn)
    with H.borrowed(tr):
        ids = _load(world)
        out = tr.forward_backward(world.data, loss_fn, cfg, adapters=[ids[k] for k in ASSIGN])
        grads = [tr.gradients(a) for a in ids]
    if loss_fn == "ppo":
        # Some tokens, not all, are clipped (their gradient is zero in both).
        assert 0 < out.metrics["clipped_tokens:sum"] < sum(LENGTHS)
    _compare(out, grads, ref_outs, ref_grads, ref_total, loss_fn)


def test_call_of_subset_targets_computes_only_those(world):
    """A call whose adapters target a subset of the slot table's modules (adapter 1 alone:
    q, v, down, lm_head) runs a program of those modules only (train_step.used_modules)
    and still matches torch + peft."""
    tr = world.tr
    ref_outs, ref_grads, ref_total = torch_reference(
        world.models[1:], world.data, (0,) * len(world.data), "cross_entropy"
    )
    with H.borrowed(tr):
        ids = _load(world)
        out = tr.forward_backward(world.data, "cross_entropy", adapters=ids[1])
        grads = [tr.gradients(ids[1])]
    keys = [k for k in tr.remat_decisions if set(k[-1]) == set(ADAPTERS[1]["target_modules"])]
    assert keys, list(tr.remat_decisions)
    _compare(out, grads, ref_outs, ref_grads, ref_total, "adapter 1 alone")


def test_export_peft_round_trips_through_peft(world, tmp_path):
    tr = world.tr
    with H.borrowed(tr):
        ids = _load(world)
        adapters = [ids[k] for k in ASSIGN]
        tr.forward_backward(world.data, "cross_entropy", adapters=adapters)
        before = [tr.adapter_weights(a) for a in ids]
        for a in ids:
            tr.optim_step(a, jcp.AdamParams(learning_rate=1e-2, weight_decay=0.1))
        after = [tr.adapter_weights(a) for a in ids]
        for b, w in zip(before, after):
            assert all(np.any(w[k] != b[k]) for k in w)  # the export is of trained weights
        out = tr.forward_backward(world.data, "cross_entropy", adapters=adapters)

        exported = []
        for i, a in enumerate(ids):
            path = tmp_path / f"export{i}"
            tr.export_peft(a, path)
            exported.append(path)
            # peft reads the folder as it reads its own.
            pm = peft.PeftModel.from_pretrained(copy.deepcopy(world.hm), path).double().eval()
            assert pm.peft_config["default"].r == ADAPTERS[i]["r"]
            params = lora_params(pm)
            assert params.keys() == after[i].keys()
            for k, p in params.items():
                np.testing.assert_array_equal(p.detach().float().numpy(), after[i][k], err_msg=k)
            with torch.no_grad():
                for j, (d, k) in enumerate(zip(world.data, ASSIGN)):
                    if k != i:
                        continue
                    lp = torch_logprobs(pm, d.model_input, d.loss_fn_inputs["target_tokens"])
                    np.testing.assert_allclose(
                        out.loss_fn_outputs[j]["logprobs"],
                        lp.numpy(),
                        rtol=0,
                        atol=LP_ATOL,
                        err_msg=f"adapter {i} datum {j}",
                    )
                    # The trained adapter really moved the log-probs away from the loaded one.
                    old = torch_logprobs(
                        world.models[i], d.model_input, d.loss_fn_inputs["target_tokens"]
                    ).numpy()
                    if len(old) > 1:
                        assert np.max(np.abs(old - lp.numpy())) > 10 * LP_ATOL

        # load_peft of the export gives back the very same adapter.
        for i, path in enumerate(exported):
            b = tr.load_peft(path)
            assert tr.adapters[b].rank == tr.adapters[ids[i]].rank
            assert tr.adapters[b].targets == tr.adapters[ids[i]].targets
            assert tr.adapters[b].scale == pytest.approx(tr.adapters[ids[i]].scale, rel=1e-6)
            again = tr.adapter_weights(b)
            assert again.keys() == after[i].keys()
            for k in again:
                np.testing.assert_array_equal(again[k], after[i][k], err_msg=k)
            tr.delete_adapter(b)


@pytest.mark.parametrize(
    "extra,pattern",
    [
        (dict(lora_bias=True), "lora_bias"),
        (dict(fan_in_fan_out=True), "fan_in_fan_out"),
        (dict(use_dora=True), "DoRA"),
        (dict(bias="all"), "bias"),
        (dict(rank_pattern={"q_proj": 2}), "rank_pattern"),
        (dict(layers_to_transform=[0]), "layers_to_transform"),
        (dict(target_modules=["q_proj", "embed_tokens"]), "target_modules"),
        (dict(r=H.MAX_RANK + 1), "max_rank"),
        (dict(r=True), "r must be a positive integer"),
        (dict(lora_alpha=None), "lora_alpha must be a finite number"),
    ],
    ids=lambda e: next(iter(e)) if isinstance(e, dict) else "",
)
def test_load_peft_refuses_what_it_cannot_represent(world, tmp_path, extra, pattern):
    tr = world.tr
    with H.borrowed(tr):
        _load(world)
        rank = extra.get("r", 4)
        rank = 1 if rank is True else rank
        targets = [
            t for t in extra.get("target_modules", ["q_proj", "v_proj"]) if t != "embed_tokens"
        ]
        weights = H.random_peft_weights(world.cfg, rank, targets, seed=0)
        path = H.write_peft(
            str(tmp_path / "bad"),
            rank,
            8.0,
            targets,
            weights,
            **{k: v for k, v in extra.items() if k != "r" or v is True},
        )
        before = H.snapshot(tr)
        with pytest.raises(jcp.InputError, match=pattern):
            tr.load_peft(path)
        H.assert_same_state(before, H.snapshot(tr))


def test_load_peft_refuses_peft_lora_bias(world, tmp_path):
    """peft itself writes lora_B biases with lora_bias=True; jcp has no place for them."""
    spec = dict(ADAPTERS[0])
    cfg = peft.LoraConfig(
        r=spec["r"],
        lora_alpha=spec["lora_alpha"],
        target_modules=["q_proj"],
        lora_bias=True,
        lora_dropout=0.0,
        task_type="CAUSAL_LM",
    )
    pm = peft.get_peft_model(copy.deepcopy(world.hm), cfg)
    pm.save_pretrained(tmp_path / "biased")
    assert any(
        k.endswith("lora_B.bias")
        for k in load_file(str(tmp_path / "biased" / "adapter_model.safetensors"))
    )
    before = H.snapshot(world.tr)
    with pytest.raises(jcp.InputError, match="lora_bias"):
        world.tr.load_peft(tmp_path / "biased")
    H.assert_same_state(before, H.snapshot(world.tr))
