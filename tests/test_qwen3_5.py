"""Qwen3.5 (hybrid Gated DeltaNet + gated full attention): config, loading, and log-probs
equal to transformers' Qwen3_5ForCausalLM at several meshes.

The reference is a tiny random Qwen3_5ForCausalLM built here (both layer kinds, v heads >
k heads, partial rotary, non-zero RMSNorm offsets, float32, transformers' torch fallbacks),
saved with save_pretrained and read back by jcp.load_hf. Datums are packed ragged: borders
inside and at kernel blocks, a one-token datum, and at cp = 4 ranks holding padding only.
"""

import functools

import jax
import numpy as np
import pytest
import torch
from transformers import Qwen3_5ForCausalLM
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

import jcp
from helpers import model_harness as mh
from jcp import model as model_lib

LENGTHS = (37, 1, 20, 64)


@functools.lru_cache(maxsize=None)
def _reference():
    """(HF model, its folder's jcp config, jcp base params as NumPy)."""
    torch.manual_seed(0)
    hc = Qwen3_5TextConfig(
        vocab_size=mh.V, hidden_size=mh.D, intermediate_size=mh.F, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=8, linear_conv_kernel_dim=4, tie_word_embeddings=False,
        max_position_embeddings=1024,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.25, "mrope_section": [1, 1, 0]})
    hm = Qwen3_5ForCausalLM(hc)
    with torch.no_grad():
        for name, p in hm.named_parameters():
            if "norm" in name:  # offsets ≠ 0 (gated norm: a plain weight around 1)
                p.copy_(0.3 * torch.randn_like(p) + (1.0 if "linear_attn.norm" in name else 0.0))
            elif "A_log" in name or "dt_bias" in name:
                p.copy_(0.5 * torch.randn_like(p))
            elif "conv1d" in name:
                p.copy_(0.3 * torch.randn_like(p))
            else:
                p.copy_(0.05 * torch.randn_like(p))
    hm = hm.eval().float()
    import tempfile
    path = mh.save(hm, tempfile.mkdtemp(prefix="jcp_qwen3_5_"))
    cfg, base = jcp.load_hf(path)
    return hm, cfg, jax.tree.map(np.asarray, base)


def test_config_from_hf_reads_the_hybrid_fields():
    _, cfg, base = _reference()
    assert cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert cfg.attn_output_gate and cfg.rotary_dim == 4 and cfg.qk_norm
    assert (cfg.linear_num_key_heads, cfg.linear_num_value_heads) == (2, 4)
    model_lib.check_shapes(cfg, base)
    assert base["linear_attn"]["in_proj_q"].shape == (3, mh.D, 32)
    assert base["full_attn"]["q_proj"].shape == (1, mh.D, 2 * 4 * 16)
    with pytest.raises(ValueError, match="linear_num_value_heads"):
        jcp.QwenConfig.tiny_qwen3_5(linear_num_value_heads=3)
    with pytest.raises(ValueError, match="tp=4 does not divide linear_num_key_heads"):
        jcp.QwenConfig.tiny_qwen3_5(linear_num_key_heads=2, num_kv_heads=4,
                                    num_heads=4).check_mesh(4)
    assert jcp.QwenConfig.tiny().fingerprint() != jcp.QwenConfig.tiny_qwen3_5().fingerprint()


@pytest.mark.parametrize("mesh_shape", [(1, 1, 1), (1, 4, 1), (1, 2, 2)])
def test_logprobs_equal_transformers(mesh_shape):
    hm, cfg, base = _reference()
    seqs, targets, _ = mh.random_data(LENGTHS)
    ref = mh.reference_logprobs(hm, seqs, targets)
    got = mh.logprobs(cfg, base, mesh_shape, seqs, targets)
    for g, r in zip(got, ref):
        np.testing.assert_allclose(g, r, atol=2e-4)
