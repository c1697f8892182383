"""Qwen3.5-MoE (hybrid Gated DeltaNet + gated attention, a routed-expert MLP with a gated
shared expert in every layer): config parsing, load_hf, and a peft adapter on the new
projections and the fused experts, against transformers' Qwen3_5MoeForCausalLM + peft in
fp64 at two meshes (log-probs, loss and every LoRA gradient under peft's names)."""

import functools
import tempfile

import numpy as np
import pytest
import torch
from helpers import model_harness as mh
from helpers.hf_models import peft_model
from transformers import Qwen3_5MoeForCausalLM
from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig

import jcp

LENGTHS = (37, 1, 20)
MODULES = ["q_proj", "o_proj", "in_proj_qkv", "in_proj_z", "out_proj", "lm_head"]
EXPERT_PARAMS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


@functools.cache
def _world():
    """(base folder, peft folder, data, peft fp64 log-probs, loss, gradients by name)."""
    torch.manual_seed(0)
    hc = Qwen3_5MoeTextConfig(
        vocab_size=mh.V,
        hidden_size=mh.D,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        moe_intermediate_size=24,
        shared_expert_intermediate_size=40,
        num_experts=4,
        num_experts_per_tok=2,
        tie_word_embeddings=False,
        experts_implementation="eager",
        layer_types=["linear_attention", "full_attention"],
        max_position_embeddings=1024,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [1, 1, 0],
        },
    )
    hm = Qwen3_5MoeForCausalLM(hc)
    with torch.no_grad():
        for name, p in hm.named_parameters():
            if "norm" in name:
                p.copy_(0.3 * torch.randn_like(p) + (1.0 if "linear_attn.norm" in name else 0.0))
            elif "A_log" in name or "dt_bias" in name or "conv1d" in name:
                p.copy_(0.3 * torch.randn_like(p))
            else:
                p.copy_(0.1 * torch.randn_like(p))
    hm = hm.eval().float()
    base = mh.save(hm, tempfile.mkdtemp(prefix="jcp_qwen3_5_moe_"))
    pm = peft_model(
        hm,
        2,
        std=0.2,
        factors="lora_",
        r=3,
        lora_alpha=6,
        target_modules=MODULES,
        target_parameters=EXPERT_PARAMS,
    )
    folder = tempfile.mkdtemp(prefix="jcp_qwen3_5_moe_peft_")
    pm.save_pretrained(folder)
    seqs, targets, weights = mh.random_data(LENGTHS, seed=5)
    lps, total, grads = mh.peft_fp64_reference(pm, seqs, targets, weights)
    data = [
        jcp.Datum(s, {"target_tokens": t, "weights": w}) for s, t, w in zip(seqs, targets, weights)
    ]
    return base, folder, data, lps, total, grads


def test_config_reads_qwen3_5_moe():
    base, *_ = _world()
    cfg = jcp.QwenConfig.from_hf(base)
    assert cfg.is_hybrid and cfg.moe_layers == (True, True) and cfg.norm_topk_prob
    assert (
        cfg.num_experts,
        cfg.num_experts_per_tok,
        cfg.moe_intermediate_size,
        cfg.shared_expert_intermediate_size,
    ) == (4, 2, 24, 40)
    tiny = jcp.QwenConfig.tiny_qwen3_5_moe()
    assert tiny.is_hybrid and all(tiny.moe_layers) and tiny.shared_expert_intermediate_size
    with pytest.raises(ValueError, match="MoE MLPs in every layer"):
        jcp.QwenConfig.tiny_qwen3_5_moe(mlp_only_layers=(0,))
    with pytest.raises(ValueError, match="shared_expert_intermediate_size=45"):
        jcp.QwenConfig.tiny_qwen3_5_moe(shared_expert_intermediate_size=45).check_mesh(2)


@pytest.mark.parametrize("mesh_shape", [(1, 2, 2)])  # cp and tp; (1,1,1) adds no axis
def test_logprobs_and_lora_gradients_equal_peft(mesh_shape):
    base, folder, data, lps, loss, want = _world()
    cfg, params = jcp.load_hf(base)
    tr = jcp.Trainer(
        cfg, jcp.make_mesh(*mesh_shape), base_params=params, max_adapters=1, max_rank=4
    )
    a = tr.load_peft(folder)
    assert tr.adapters[a].expert_lora == "fused_gate_up"
    out = tr.forward_backward(data, "cross_entropy", adapters=a)
    for o, w in zip(out.loss_fn_outputs, lps):
        np.testing.assert_allclose(o["logprobs"], w, atol=2e-4, rtol=0)
    np.testing.assert_allclose(out.metrics["loss:sum"], loss, rtol=2e-5)
    got = tr.gradients(a)
    assert {k: v.shape for k, v in got.items()} == {k: v.shape for k, v in want.items()}
    assert any("in_proj_qkv" in k for k in want) and any("experts" in k for k in want)
    scale = max(float(np.abs(g).max()) for g in want.values())
    for k in want:
        assert np.abs(want[k]).max() > 1e-4 * scale, k
        np.testing.assert_allclose(got[k], want[k], atol=2e-5 * scale, rtol=1e-3, err_msg=k)


def test_engine_greedy_equals_hf_generate():
    """The MoE hybrid through the paged engine: greedy with the peft adapter and without
    (requests at different steps, a prompt prefilled over 2 chunks, 2 samples of one
    prompt, a one-token prompt) = HF generate + peft."""
    import peft

    from jcp.sample.engine import Engine

    base, folder, *_ = _world()
    cfg, params = jcp.load_hf(base)
    tr = jcp.Trainer(cfg, jcp.make_mesh(1, 1, 1), base_params=params, max_adapters=1, max_rank=3)
    a = tr.load_peft(folder)
    eng = Engine(tr.make_sampler(), slots=4, max_len=48, chunk=4, page_size=8, prefill_tokens=16)
    hm = Qwen3_5MoeForCausalLM.from_pretrained(base, experts_implementation="eager").eval()
    pm = peft.PeftModel.from_pretrained(hm, folder).eval()
    prompts = [list(range(3, 33)), [7], [11, 4, 8, 20, 6]]
    n_new = 6

    def hf(model, p):
        ids = torch.tensor([p])
        with torch.no_grad():
            g = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=n_new,
                min_new_tokens=n_new,
                pad_token_id=0,
            )
        return g[0, len(p) :].numpy()

    greedy = jcp.SamplingParams(max_tokens=n_new, temperature=0.0, stop=[])
    waves = [[(0, a, 1)], [(1, None, 1), (2, a, 2)], [(0, None, 1)]]
    rids = []
    for wave in waves:
        rids += [(eng.submit(prompts[i], greedy, ad, n), i, ad) for i, ad, n in wave]
        eng.step()
    eng.run()
    want = {}
    with pm.disable_adapter():
        for i in (0, 1):
            want[i, None] = hf(pm, prompts[i])
    for i in (0, 2):
        want[i, a] = hf(pm, prompts[i])
    assert not np.array_equal(want[0, a], want[0, None])
    for rid, i, ad in rids:
        for seq in eng.result(rid).sequences:
            np.testing.assert_array_equal(seq.tokens, want[i, ad], err_msg=f"{i} {ad}")
