"""Trainer construction: clear errors for meshes and settings it cannot run, tuned defaults."""

import pytest

import jcp


def test_kv_heads_must_divide_tp():
    cfg = jcp.QwenConfig.tiny()  # 2 kv heads
    with pytest.raises(ValueError, match="tp=4 does not divide num_kv_heads=2"):
        jcp.Trainer(cfg, jcp.make_mesh(1, 1, 4))


@pytest.mark.parametrize("kw, pattern", [
    (dict(attn_impl="flash"), "attn_impl"),
    (dict(attn_block=0), "attn_block"),
    (dict(logprob_chunk=True), "logprob_chunk"),
    (dict(max_adapters=0), "max_adapters"),
    (dict(max_rank=2.5), "max_rank"),
    (dict(max_tokens_per_device=1), "max_tokens_per_device"),
])
def test_bad_settings(kw, pattern):
    with pytest.raises(ValueError, match=pattern):
        jcp.Trainer(jcp.QwenConfig.tiny(), jcp.make_mesh(1, 1, 1), **kw)


@pytest.mark.parametrize("vocab, tp", [(512, 1), (151936, 1), (151936, 2)])
def test_default_logprob_chunk_bounds_the_logits(vocab, tp):
    cfg = jcp.QwenConfig.tiny(vocab_size=vocab)
    tr = jcp.Trainer(cfg, jcp.make_mesh(1, 1, tp), base_params=None)
    chunk = tr.step_cfg.logprob_chunk
    assert chunk & (chunk - 1) == 0 and 16 <= chunk <= 1024
    assert chunk * (vocab // tp) * 4 <= 256 * 2**20 or chunk == 16
    assert chunk == 1024 or 2 * chunk * (vocab // tp) * 4 > 256 * 2**20  # the largest such


def test_token_cap_follows_max_tokens_per_device():
    cfg = jcp.QwenConfig.tiny()
    a = jcp.Trainer(cfg, jcp.make_mesh(1, 2, 1), max_tokens_per_device=101)
    b = jcp.Trainer(cfg, jcp.make_mesh(1, 2, 1))
    assert a.token_cap == 100 * 2  # floor to even, times cp
    assert b.token_cap == cfg.max_position_embeddings
