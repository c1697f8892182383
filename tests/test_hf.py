"""Hugging Face configs and safetensors checkpoints (jcp.hf, QwenConfig.from_hf).

Every refusal of the loader has a test that provokes it from a real save_pretrained
folder; index-sharded and bfloat16 checkpoints load to the same weights as the fp32
single-file one (bf16: exactly the bf16-rounded weights).
"""

from __future__ import annotations

import json
import os
import shutil

import jax
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
import torch
import transformers
from helpers import model_harness as MH

import jcp
from jcp import hf as hf_lib

# ----------------------------------------------------------------------------------------
# Configs


def _qwen3_config(**overrides):
    kw = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=80,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        rope_theta=123456.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        max_position_embeddings=2048,
    )
    kw.update(overrides)
    return transformers.Qwen3Config(**kw)


def test_from_hf_dict_and_path(tmp_path):
    hcfg = _qwen3_config()
    d = hcfg.to_dict()
    # transformers writes the rope_parameters form; no top-level rope_theta.
    assert "rope_theta" not in d and d["rope_parameters"]["rope_theta"] == 123456.0
    hcfg.save_pretrained(tmp_path)
    want = jcp.QwenConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=80,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        head_dim=24,
        rope_theta=123456.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        qk_norm=True,
        attention_bias=False,
        max_position_embeddings=2048,
    )
    assert want.head_dim != want.hidden_size // want.num_heads
    for source in (d, tmp_path, str(tmp_path), tmp_path / "config.json"):
        assert jcp.QwenConfig.from_hf(source) == want, source


def test_from_hf_legacy_and_defaults():
    """Top-level rope_theta, no head_dim (→ hidden / heads), no kv heads (→ heads), Qwen2."""
    d = {
        "architectures": ["Qwen2ForCausalLM"],
        "vocab_size": 100,
        "hidden_size": 48,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 6,
        "rope_theta": 5000.0,
        "tie_word_embeddings": False,
    }
    cfg = jcp.QwenConfig.from_hf(d)
    assert (cfg.head_dim, cfg.num_kv_heads, cfg.rope_theta) == (8, 6, 5000.0)
    assert cfg.attention_bias and not cfg.qk_norm and not cfg.tie_word_embeddings
    # model_type alone identifies the architecture when "architectures" is absent.
    d3 = {k: v for k, v in d.items() if k != "architectures"} | {"model_type": "qwen3"}
    cfg3 = jcp.QwenConfig.from_hf(d3)
    assert cfg3.qk_norm and not cfg3.attention_bias


def test_from_hf_refusals(tmp_path):
    base = _qwen3_config().to_dict()
    cases = {
        "unsupported architecture": base | {"architectures": ["LlamaForCausalLM"]},
        "yarn": base | {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}},
        "linear": base | {"rope_scaling": {"type": "linear", "factor": 2.0}},
        "dynamic": base
        | {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}, "rope_theta": 1e6},
        "sliding": base | {"use_sliding_window": True, "sliding_window": 128},
        "o_proj": base | {"attention_bias": True},
        "rope_theta": {k: v for k, v in base.items() if k != "rope_parameters"},
        "num_attention_heads": {k: v for k, v in base.items() if k != "num_attention_heads"},
        "intermediate_size": {k: v for k, v in base.items() if k != "intermediate_size"},
    }
    assert jcp.QwenConfig.from_hf(base).rope_theta == 123456.0  # the unaltered one loads
    for match, d in cases.items():
        with pytest.raises(ValueError, match=match):
            jcp.QwenConfig.from_hf(d)
    with pytest.raises(ValueError, match="no Hugging Face config"):
        jcp.QwenConfig.from_hf(tmp_path)


def test_check_mesh_refuses_indivisible_tp():
    cfg = jcp.QwenConfig.tiny(num_heads=8, num_kv_heads=2, intermediate_size=128, vocab_size=512)
    cfg.check_mesh(1)
    cfg.check_mesh(2)
    with pytest.raises(ValueError, match=r"tp=4 does not divide num_kv_heads=2"):
        cfg.check_mesh(4)
    with pytest.raises(ValueError, match=r"tp=3 does not divide"):
        cfg.check_mesh(3)
    with pytest.raises(ValueError, match=r"vocab_size"):
        jcp.QwenConfig.tiny(num_kv_heads=4, vocab_size=510).check_mesh(4)


# ----------------------------------------------------------------------------------------
# Checkpoints


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A Qwen2 (biases, untied) checkpoint: (hf model, folder)."""
    hm = MH.hf_model("qwen2", tied=False, seed=4)
    return hm, MH.save(hm, tmp_path_factory.mktemp("qwen2") / "fp32")


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _materialise(base):
    return jax.tree.map(np.asarray, base)


def _torch_params(hm, cfg, dtype=torch.float32):
    tensors = {n: p.detach().to(dtype).float().numpy() for n, p in hm.named_parameters()}
    return _materialise(hf_lib.hf_params(cfg, {n: (lambda t=t: t) for n, t in tensors.items()}))


def test_load_matches_torch_weights(saved):
    hm, path = saved
    cfg, base = jcp.load_hf(path)
    loaded = _materialise(base)
    want = _torch_params(hm, cfg)
    assert loaded["layers"]["q_proj"].shape == (cfg.num_layers, cfg.hidden_size, cfg.q_dim)
    np.testing.assert_array_equal(
        loaded["layers"]["q_proj"][1], hm.model.layers[1].self_attn.q_proj.weight.detach().numpy().T
    )
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(want)):
        np.testing.assert_array_equal(a, b)
    # Slices are read lazily in jcp's layout.
    lazy = base["layers"]["k_proj"]
    np.testing.assert_array_equal(lazy[1:, 3:9, 8:], loaded["layers"]["k_proj"][1:, 3:9, 8:])


def test_unknown_architecture(saved, tmp_path):
    path = _copy(saved[1], tmp_path / "llama")
    with open(path / "config.json") as f:
        d = json.load(f)
    d["architectures"] = ["LlamaForCausalLM"]
    with open(path / "config.json", "w") as f:
        json.dump(d, f)
    with pytest.raises(ValueError, match="unsupported architecture.*LlamaForCausalLM"):
        jcp.load_hf(path)


def test_missing_tensor(saved, tmp_path):
    path = _copy(saved[1], tmp_path / "missing")
    tensors = safetensors.numpy.load_file(path / "model.safetensors")
    name = "model.layers.1.self_attn.v_proj.bias"
    assert name in tensors
    del tensors[name]
    safetensors.numpy.save_file(tensors, path / "model.safetensors")
    with pytest.raises(ValueError, match=f"missing tensor {name}"):
        jcp.load_hf(path)


def test_unexpected_tensor(saved, tmp_path):
    """A tensor the config does not describe (here Qwen3's o_proj bias) is refused, not
    silently ignored."""
    path = _copy(saved[1], tmp_path / "extra")
    tensors = safetensors.numpy.load_file(path / "model.safetensors")
    name = "model.layers.0.self_attn.o_proj.bias"
    assert name not in tensors
    tensors[name] = np.ones(MH.D, np.float32)
    safetensors.numpy.save_file(tensors, path / "model.safetensors")
    with pytest.raises(ValueError, match=f"checkpoint has tensor {name}"):
        jcp.load_hf(path)


def test_shape_mismatch_config_vs_tensor(saved, tmp_path):
    path = _copy(saved[1], tmp_path / "config_shape")
    with open(path / "config.json") as f:
        d = json.load(f)
    d["intermediate_size"] += 16
    with open(path / "config.json", "w") as f:
        json.dump(d, f)
    with pytest.raises(
        ValueError,
        match=r"gate_proj.weight has shape \(96, 64\), expected "
        r"\(112, 64\)",
    ):
        jcp.load_hf(path)


def test_shape_mismatch_tensor(saved, tmp_path):
    path = _copy(saved[1], tmp_path / "tensor_shape")
    tensors = safetensors.numpy.load_file(path / "model.safetensors")
    tensors["model.norm.weight"] = np.ones(MH.D + 2, np.float32)
    safetensors.numpy.save_file(tensors, path / "model.safetensors")
    with pytest.raises(ValueError, match=r"model.norm.weight has shape \(66,\)"):
        jcp.load_hf(path)


def test_not_a_checkpoint(saved, tmp_path):
    with pytest.raises(ValueError, match="not a Hugging Face model folder"):
        jcp.load_hf(tmp_path / "nowhere")
    path = tmp_path / "no_weights"
    path.mkdir()
    shutil.copy(os.path.join(saved[1], "config.json"), path / "config.json")
    with pytest.raises(ValueError, match="no .safetensors files"):
        jcp.load_hf(path)


def test_index_sharded_checkpoint(saved, tmp_path):
    hm, single = saved
    sharded = MH.save(hm, tmp_path / "sharded", max_shard_size="40KB")
    files = sorted(f for f in os.listdir(sharded) if f.endswith(".safetensors"))
    # The two folders really differ: an index and several shards against one file.
    assert os.path.isfile(os.path.join(sharded, "model.safetensors.index.json"))
    assert not os.path.isfile(os.path.join(single, "model.safetensors.index.json"))
    assert len(files) > 2
    cfg_s, base_s = jcp.load_hf(sharded)
    cfg_1, base_1 = jcp.load_hf(single)
    assert cfg_s == cfg_1
    for a, b in zip(jax.tree.leaves(_materialise(base_s)), jax.tree.leaves(_materialise(base_1))):
        np.testing.assert_array_equal(a, b)

    # An index naming a shard that is not there is refused.
    os.remove(os.path.join(sharded, files[-1]))
    with pytest.raises(ValueError, match=f"{files[-1]} named in the index is missing"):
        jcp.load_hf(sharded)


def test_bf16_checkpoint(saved, tmp_path):
    hm, single = saved
    hm16 = MH.hf_model("qwen2", tied=False, seed=4).to(torch.bfloat16)
    path = MH.save(hm16, tmp_path / "bf16")
    header = hf_lib.SafetensorsFile(os.path.join(path, "model.safetensors")).header
    assert {v["dtype"] for v in header.values()} == {"BF16"}

    cfg16, base16 = jcp.load_hf(path)
    cfg32, base32 = jcp.load_hf(single)
    assert cfg16 == cfg32
    w16, w32 = _materialise(base16), _materialise(base32)
    assert all(x.dtype == np.float32 for x in jax.tree.leaves(w16))
    # Exactly the fp32 weights rounded to bfloat16, which do differ from fp32.
    assert MH.tree_max_abs_diff(w16, w32) > 0
    rounded = jax.tree.map(lambda x: x.astype(ml_dtypes.bfloat16).astype(np.float32), w32)
    for a, b in zip(jax.tree.leaves(w16), jax.tree.leaves(rounded)):
        np.testing.assert_array_equal(a, b)

    seqs, targets, _ = MH.random_data((30, 11), seed=2)
    ref = MH.reference_logprobs(hm, seqs, targets)
    lp16 = MH.logprobs(cfg16, base16, (1, 2, 2), seqs, targets)
    for o, r in zip(lp16, ref):
        assert np.abs(o - r).max() > 1e-5
        np.testing.assert_allclose(o, r, rtol=0, atol=0.05)
