"""Trainer construction: clear errors for meshes and settings it cannot run, tuned defaults."""

import numpy as np
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
    (dict(remat="sometimes"), "remat"),
    (dict(remat=1), "remat"),
    (dict(remat_budget_bytes=0), "remat_budget_bytes"),
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


def test_remat_auto_decides_from_compiled_memory():
    """remat="auto" compiles the forward_backward without recomputation and keeps it iff
    its compiled memory fits the budget: a budget of exactly that many bytes keeps it, one
    byte less recomputes — and both programs give the same numbers."""
    from helpers import trainer_harness as H

    cfg = jcp.QwenConfig.tiny()
    data = H.random_data((37, 20, 5), seed=1)
    results, decisions = [], []
    need = None
    for budget in (1 << 50, None):
        tr = jcp.Trainer(cfg, jcp.make_mesh(1, 1, 1), max_adapters=1, max_rank=4,
                         attn_block=16, logprob_chunk=16, remat_budget_bytes=budget or need - 1)
        assert tr.remat == "auto"
        a = tr.create_adapter(rank=4, alpha=8.0, seed=3)
        out = tr.forward_backward(data, "cross_entropy", adapters=a)
        (decision,) = tr.remat_decisions.values()
        need = decision["bytes"]
        decisions.append(decision["remat"])
        results.append((out, tr.gradients(a)))
    assert decisions == [False, True]
    _assert_same_training(*results)


def test_cpu_unrolled_layer_loop_equals_rolled(monkeypatch):
    """On XLA:CPU a model of ≤ CPU_UNROLL_LAYERS layers trains with its layer loop unrolled
    (train_step.unroll_layers): none of its layers' projections runs inside a loop, as all
    of the rolled program's do, and the numbers are the same. RoPE's cos / sin are taken
    once for all layers (decoder.rotary), not per layer, nor fused into every q / k element:
    the unrolled program holds one cosine per branch of rotary's cond."""
    from helpers import trainer_harness as H
    from jcp import train_step

    cfg = jcp.QwenConfig.tiny()
    data = H.random_data((37, 20, 5), seed=1)
    results, whiles, cosines = [], [], []
    for limit in (train_step.CPU_UNROLL_LAYERS, 0):
        monkeypatch.setattr(train_step, "CPU_UNROLL_LAYERS", limit)
        tr = jcp.Trainer(cfg, jcp.make_mesh(1, 1, 1), max_adapters=1, max_rank=4,
                         attn_block=16, logprob_chunk=16)
        a = tr.create_adapter(rank=4, alpha=8.0, seed=3)
        out = tr.forward_backward(data, "cross_entropy", adapters=a)
        (program,) = tr.forward_backward_programs.values()
        whiles.append(sum("si,io->so/dot_general" in ln and "while/body" in ln
                          for ln in program.as_text().splitlines()))
        cosines.append(program.as_text().count(" cosine("))
        results.append((out, tr.gradients(a)))
    assert whiles[0] == 0 < whiles[1], whiles
    assert cfg.num_layers > 1 and cosines[0] <= 2, cosines
    _assert_same_training(*results)


def _assert_same_training(a, b):
    """Two (forward_backward output, gradients) pairs carry the same loss, log-probs and
    (non-zero) gradients."""
    (out_a, g_a), (out_b, g_b) = a, b
    assert out_a.metrics["loss:sum"] == pytest.approx(out_b.metrics["loss:sum"], rel=1e-6)
    for x, y in zip(out_a.loss_fn_outputs, out_b.loss_fn_outputs):
        np.testing.assert_allclose(x["logprobs"], y["logprobs"], rtol=1e-6, atol=1e-6)
    assert any(np.abs(v).max() > 0 for v in g_a.values())
    for k in g_a:
        np.testing.assert_allclose(g_a[k], g_b[k], rtol=1e-5,
                                   atol=1e-6 * np.abs(g_a[k]).max(), err_msg=k)
