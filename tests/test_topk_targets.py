"""2-D target_tokens [N, K] (several scored targets per position, e.g. a teacher's top-k).

1. losses.shard_loss with 2-D targets against a NumPy float64 reference (full-logit
   log-softmax; the analytic gradient −Σ_k w_k·(onehot(t_k) − softmax) w.r.t. the logits),
   vocab split over tp = 2 and chunked, with −1 pads and repeated targets in a row.
2. Trainer.forward_backward with 2-D cross_entropy on a (2, 2, 2) mesh equals the sum of
   K one-column calls (log-probs, loss, gradients); padding targets contribute nothing;
   validation names the datum and field.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import trainer_harness as TH

import jcp
from jcp import losses
from jcp import mesh as mesh_lib

V, D, N, K, CHUNK = 64, 16, 24, 5, 8


def case(seed=0):
    rng = np.random.default_rng(seed)
    h = rng.normal(size=(N, D)).astype(np.float32)
    w = (0.5 * rng.normal(size=(D, V))).astype(np.float32)
    t = rng.integers(0, V, (N, K)).astype(np.int32)
    t[::4, -1] = -1  # padding targets
    t[1::5, 1] = t[1::5, 0]  # a repeated target in a row
    wt = rng.uniform(0.1, 1.0, (N, K)).astype(np.float32)
    return h, w, t, wt


def np_reference(h, w, t, wt):
    logits = h.astype(np.float64) @ w.astype(np.float64)
    lse = np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1)) + logits.max(1)
    lsm = logits - lse[:, None]
    valid = t >= 0
    lp = np.where(valid, np.take_along_axis(lsm, np.where(valid, t, 0), 1), 0.0)
    loss = -np.sum(wt * lp)
    g = np.where(valid, -wt, 0.0)  # d loss / d lp
    d_logits = np.exp(lsm) * (-g.sum(1))[:, None]
    for k in range(t.shape[1]):
        np.add.at(d_logits, (np.arange(len(t))[valid[:, k]], t[valid[:, k], k]), g[valid[:, k], k])
    return lp, loss, d_logits @ w.T.astype(np.float64), h.T.astype(np.float64) @ d_logits


@functools.cache
def shard_step(tp: int):
    mesh = jcp.make_mesh(1, 1, tp)
    sp = mesh_lib.SPECS

    def inner(h, w, t, seg, wt):
        x = losses.TokenInputs(wt[0, 0], jnp.zeros(N), jnp.zeros(N))
        plan = losses.LossPlan("cross_entropy", 8, chunk=CHUNK)
        return losses.shard_loss(
            losses.Unembedding((h[0, 0],), (w,)), t[0, 0], seg[0, 0], x, {}, plan
        )

    def run(h, w, t, seg, wt):
        return jax.shard_map(
            inner,
            mesh=mesh,
            in_specs=(
                sp.stream_DPxCPxSxD,
                sp.unembed_DxV,
                sp.stream_DPxCPxS,
                sp.stream_DPxCPxS,
                sp.stream_DPxCPxS,
            ),
            out_specs=(sp.replicated, sp.replicated),
        )(h, w, t, seg, wt)

    return jax.jit(jax.value_and_grad(run, argnums=(0, 1), has_aux=True))


@pytest.mark.parametrize("tp", [1, 2])
def test_two_d_cross_entropy_matches_numpy(tp):
    h, w, t, wt = case()
    (loss, out), (dh, dw) = shard_step(tp)(
        h[None, None], w, t[None, None], np.zeros((1, 1, N), np.int32), wt[None, None]
    )
    lp_ref, loss_ref, dh_ref, dw_ref = np_reference(h, w, t, wt)
    lp = np.asarray(out.logprobs)[0, 0]
    assert lp.shape == (N, K) and np.all(lp[t < 0] == 0) and np.all(lp[t >= 0] < 0)
    np.testing.assert_allclose(lp, lp_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(float(loss), loss_ref, rtol=1e-5)
    np.testing.assert_allclose(
        np.asarray(out.elementwise_loss)[0, 0], -np.sum(wt * lp_ref, 1), rtol=1e-5, atol=1e-5
    )
    np.testing.assert_allclose(
        np.asarray(dh)[0, 0], dh_ref, rtol=1e-4, atol=1e-5 * np.abs(dh_ref).max()
    )
    np.testing.assert_allclose(np.asarray(dw), dw_ref, rtol=1e-4, atol=1e-5 * np.abs(dw_ref).max())


# ----------------------------------------------------------------------------------------
# Through the Trainer


@functools.cache
def trainer():
    return jcp.Trainer(TH.CFG, jcp.make_mesh(2, 2, 2), **TH.TRAINER_KW)


def topk_data(lengths=(21, 6, 33), k=3, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for n in lengths:
        t = rng.integers(0, TH.CFG.vocab_size, (n, k))
        t[::3, -1] = -1
        out.append(
            (
                rng.integers(0, TH.CFG.vocab_size, n),
                t,
                rng.uniform(0.1, 1.0, (n, k)).astype(np.float32),
            )
        )
    return out


def test_trainer_two_d_equals_sum_of_columns_and_pads_add_nothing():
    tr = trainer()
    rows = topk_data()
    a = tr.create_adapter(rank=4, alpha=8.0, seed=7)
    b = tr.create_adapter(rank=4, alpha=8.0, seed=7)
    try:
        two_d = [
            jcp.Datum(x, {"target_tokens": t, "weights": np.where(t < 0, 9.0, w)})
            for x, t, w in rows
        ]  # a pad's weight must not matter
        out = tr.forward_backward(two_d, "cross_entropy", adapters=a)
        total = 0.0
        for k in range(rows[0][1].shape[1]):
            cols = [
                jcp.Datum(
                    x,
                    {
                        "target_tokens": np.where(t[:, k] < 0, 0, t[:, k]),
                        "weights": np.where(t[:, k] < 0, 0.0, w[:, k]),
                    },
                )
                for x, t, w in rows
            ]
            ref = tr.forward_backward(cols, "cross_entropy", adapters=b)
            total += ref.metrics["loss:sum"]
            for o, r, (_, t, _) in zip(out.loss_fn_outputs, ref.loss_fn_outputs, rows):
                assert o["logprobs"].shape == t.shape
                keep = t[:, k] >= 0
                np.testing.assert_allclose(
                    o["logprobs"][keep, k], r["logprobs"][keep], rtol=1e-5, atol=1e-6
                )
                assert np.all(o["logprobs"][~keep, k] == 0)
        np.testing.assert_allclose(out.metrics["loss:sum"], total, rtol=1e-5)
        ga, gb = tr.gradients(a), tr.gradients(b)
        assert any(np.abs(g).max() > 0 for g in ga.values())
        for key in ga:
            np.testing.assert_allclose(ga[key], gb[key], rtol=1e-4, atol=1e-6, err_msg=key)
    finally:
        tr.delete_adapter(a)
        tr.delete_adapter(b)


def test_two_d_validation_names_datum_and_field():
    tr = trainer()
    a = tr.create_adapter(rank=4, alpha=8.0, seed=7)
    try:
        ((x, t, w),) = topk_data(lengths=(8,))
        before = tr.gradients(a)
        bad = {
            r"weights has shape \[8, 2\], expected \[8, 3\]": {
                "target_tokens": t,
                "weights": w[:, :2],
            },
            r"target_tokens\[0, 1\] = -2 is outside": {
                "target_tokens": np.where(np.arange(3) == 1, -2, t),
                "weights": w,
            },
        }
        for msg, inputs in bad.items():
            data = [
                jcp.Datum(x, {"target_tokens": t[:, 0], "weights": w[:, 0]}),
                jcp.Datum(x, inputs),
            ]
            with pytest.raises(jcp.InputError, match="datum 1: loss_fn_inputs." + msg):
                tr.forward_backward(data, "cross_entropy", adapters=a)
        adv = np.ones(8, np.float32)
        with pytest.raises(
            jcp.InputError, match="datum 0: loss_fn_inputs.target_tokens must be 1-D"
        ):
            tr.forward_backward(
                [jcp.Datum(x, {"target_tokens": t, "logprobs": adv, "advantages": adv})],
                "ppo",
                adapters=a,
            )
        after = tr.gradients(a)
        assert all(np.array_equal(before[k], after[k]) for k in before)
    finally:
        tr.delete_adapter(a)


def test_custom_loss_refusals_in_process():
    """The in-process custom-loss API refuses before any device work, state unchanged."""
    tr = trainer()
    a = tr.create_adapter(rank=4, alpha=8.0, seed=7)
    try:
        ((x, t, w),) = topk_data(lengths=(8,))
        loss = jcp.CustomLoss.from_function(
            lambda logprobs, weights: (-(weights * logprobs).sum(), {}),
            {"logprobs": 2, "weights": 2},
        )
        before = tr.gradients(a)
        with pytest.raises(jcp.InputError, match="'custom' takes a jcp.custom_loss.CustomLoss"):
            tr.forward_backward(
                [jcp.Datum(x, {"target_tokens": t, "weights": w})], "custom", adapters=a
            )
        with pytest.raises(jcp.InputError, match="a custom loss takes no settings"):
            tr.forward_backward(
                [jcp.Datum(x, {"target_tokens": t, "weights": w})],
                loss,
                loss_fn_config={"beta": 1.0},
                adapters=a,
            )
        with pytest.raises(
            jcp.InputError,
            match="datum 0: loss_fn_inputs.target_tokens has rank 1, but custom loss",
        ):
            tr.forward_backward(
                [jcp.Datum(x, {"target_tokens": t[:, 0], "weights": w})], loss, adapters=a
            )
        with pytest.raises(jcp.InputError, match="datum 0: loss_fn_inputs.weights is missing"):
            tr.forward_backward([jcp.Datum(x, {"target_tokens": t})], loss, adapters=a)
        after = tr.gradients(a)
        assert all(np.array_equal(before[k], after[k]) for k in before)
    finally:
        tr.delete_adapter(a)
