"""Several Tinker losses in one pass equal one pass per loss."""

import numpy as np
import pytest

import jcp

CFG = jcp.QwenConfig.tiny()


def _datum(rng, n):
    return jcp.Datum(
        rng.integers(0, CFG.vocab_size, n),
        {
            "target_tokens": rng.integers(0, CFG.vocab_size, n),
            "weights": rng.uniform(size=n),
            "advantages": rng.normal(size=n),
            "logprobs": -rng.uniform(1, 6, n),
        },
    )


@pytest.fixture(scope="module")
def trainer():
    tr = jcp.Trainer(CFG, jcp.make_mesh(1, 2, 2), max_rank=8, attn_block=16, logprob_chunk=16)
    a = tr.create_adapter(rank=4, seed=1)
    b = tr.create_adapter(rank=8, seed=2)
    rng = np.random.default_rng(3)
    warm = [_datum(rng, 12) for _ in range(2)]
    tr.forward_backward(warm, "cross_entropy", adapters=[a, b])
    tr.optim_step(a, jcp.AdamParams(learning_rate=1e-2))  # B ≠ 0, so A gets gradients too
    tr.optim_step(b, jcp.AdamParams(learning_rate=1e-2))
    return tr, a, b


def test_mixed_pass_equals_separate_passes(trainer):
    tr, a, b = trainer
    rng = np.random.default_rng(0)
    data = [_datum(rng, n) for n in (17, 1, 30, 8)]
    losses = ["cross_entropy", "ppo", "cispo", "ppo"]
    adapters = [a, b, a, b]
    cfg = {"ppo": {"clip_low_threshold": 0.9}, "cispo": {"clip_high_threshold": 2.0}}
    assert len(set(losses)) > 1

    mixed = tr.forward_backward(data, losses, cfg, adapters)
    g_mixed = {x: tr.gradients(x) for x in (a, b)}
    tr.optim_step(a, jcp.AdamParams(learning_rate=0.0))  # zero the accumulators only
    tr.optim_step(b, jcp.AdamParams(learning_rate=0.0))

    separate = {}
    total, clipped = 0.0, 0
    for name in sorted(set(losses)):
        idx = [i for i, l in enumerate(losses) if l == name]
        out = tr.forward_backward(
            [data[i] for i in idx], name, cfg.get(name), [adapters[i] for i in idx]
        )
        total += out.metrics["loss:sum"]
        clipped += out.metrics.get("clipped_tokens:sum", 0)
        separate.update({i: o for i, o in zip(idx, out.loss_fn_outputs)})
    for i, o in enumerate(mixed.loss_fn_outputs):
        np.testing.assert_allclose(o["logprobs"], separate[i]["logprobs"], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(
            o["elementwise_loss"], separate[i]["elementwise_loss"], rtol=1e-5, atol=1e-6
        )
    assert mixed.metrics["loss:sum"] == pytest.approx(total, rel=1e-5)
    assert mixed.metrics["clipped_tokens:sum"] == clipped > 0
    for x in (a, b):
        for k, v in tr.gradients(x).items():
            np.testing.assert_allclose(
                g_mixed[x][k], v, rtol=1e-4, atol=1e-5 * max(np.abs(v).max(), 1e-30)
            )
        assert any(np.abs(v).max() > 0 for v in g_mixed[x].values())


def test_mixed_config_must_name_losses(trainer):
    tr, a, _ = trainer
    rng = np.random.default_rng(1)
    data = [_datum(rng, 5), _datum(rng, 6)]
    before = tr.gradients(a)
    with pytest.raises(jcp.InputError, match="keys must be loss names"):
        tr.forward_backward(data, ["ppo", "cispo"], {"clip_low_threshold": 0.5}, a)
    with pytest.raises(jcp.InputError, match="datum 1: unknown loss_fn"):
        tr.forward_backward(data, ["ppo", "nope"], None, a)
    with pytest.raises(jcp.InputError, match="one name per datum"):
        tr.forward_backward(data, ["ppo"], None, a)
    bad = [data[0], jcp.Datum([1, 2], {"target_tokens": [1, 2], "weights": [1.0, 1.0]})]
    with pytest.raises(jcp.InputError, match="datum 1: loss_fn_inputs.advantages is missing"):
        tr.forward_backward(bad, ["cross_entropy", "ppo"], None, a)
    for k, v in tr.gradients(a).items():
        np.testing.assert_array_equal(v, before[k])
