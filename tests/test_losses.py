"""The Tinker losses and the chunked vocab-parallel log-prob path.

Three layers of evidence:
1. closed forms: each loss's value and d/d(lp) at hand-derived points (ratios 0.5, 1, 5;
   advantages ±1);
2. an independent NumPy reference (full-logit log-softmax, the formulas of DESIGN's table,
   analytic gradients checked by finite differences) for the dp = cp = tp = 1 run;
3. mesh independence: 13 of the 21 other (dp, cp, tp) with dp·cp·tp ≤ 8 (every cp and tp,
   dp 1, 2, 3 and 8, and each pair of axes together) give the dp = cp = tp = 1 numbers,
   with complete per-datum outputs on every device.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import loss_harness as H

from jcp import losses
from jcp import mesh as mesh_lib

RTOL = 1e-5


def assert_rel(actual, desired, rtol=RTOL, err_msg=""):
    """Relative closeness measured against the largest reference entry (fp32: rel 1e-5)."""
    desired = np.asarray(desired, np.float64)
    scale = max(float(np.max(np.abs(desired), initial=0.0)), 1e-30)
    np.testing.assert_allclose(
        np.asarray(actual, np.float64), desired, rtol=rtol, atol=rtol * scale, err_msg=err_msg
    )


# ----------------------------------------------------------------------------------------
# 1. Closed forms of each token loss


def token_inputs(n, weights=0.0, advantages=0.0, logprobs=0.0, sequence_ratio_mask=1.0):
    full = lambda v: jnp.broadcast_to(jnp.asarray(v, jnp.float32), (n,))
    return losses.TokenInputs(
        full(weights), full(advantages), full(logprobs), full(sequence_ratio_mask)
    )


def value_and_dlp(name, lp, x, cfg):
    """Token losses and d(Σ token loss)/d lp, i.e. each token's own derivative."""
    fn = losses.LOSSES[name]
    tok, clipped = fn(lp, x, cfg)
    d_lp = jax.grad(lambda lp_: jnp.sum(fn(lp_, x, cfg)[0]))(lp)
    return np.asarray(tok, np.float64), np.asarray(d_lp, np.float64), np.asarray(clipped)


S_LP = -1.3  # sampling log-prob of every table row
RATIOS = (0.5, 1.0, 5.0)
TABLE_POINTS = [(r, a) for r in RATIOS for a in (1.0, -1.0)]


def table_lp():
    r = np.array([p[0] for p in TABLE_POINTS])
    a = np.array([p[1] for p in TABLE_POINTS])
    lp = np.log(r) + S_LP  # so that exp(lp − s) = r
    return r, a, lp


# (ratio, advantage) -> (token loss, d/d lp, clipped) with the default config, derived by
# hand from DESIGN's table; lp = log(r) + S_LP.
L05, L1, L5 = math.log(0.5) + S_LP, S_LP, math.log(5.0) + S_LP
EXPECTED = {
    # −r·A; d/dlp = −r·A
    "importance_sampling": {
        (0.5, 1.0): (-0.5, -0.5, False),
        (0.5, -1.0): (0.5, 0.5, False),
        (1.0, 1.0): (-1.0, -1.0, False),
        (1.0, -1.0): (1.0, 1.0, False),
        (5.0, 1.0): (-5.0, -5.0, False),
        (5.0, -1.0): (5.0, 5.0, False),
    },
    # −min(r·A, clip(r, 0.8, 1.2)·A): where the clipped term is the min, the gradient is 0.
    "ppo": {
        (0.5, 1.0): (-0.5, -0.5, False),  # min(0.5, 0.8) = r·A
        (0.5, -1.0): (0.8, 0.0, True),  # min(−0.5, −0.8) = clipped
        (1.0, 1.0): (-1.0, -1.0, False),
        (1.0, -1.0): (1.0, 1.0, False),
        (5.0, 1.0): (-1.2, 0.0, True),  # min(5, 1.2) = clipped
        (5.0, -1.0): (5.0, 5.0, False),  # min(−5, −1.2) = r·A
    },
    # −sg(clip(r, 0, 4))·lp·A; the clipped ratio is a constant, d/dlp = −clip(r)·A.
    "cispo": {
        (0.5, 1.0): (-0.5 * L05, -0.5, False),
        (0.5, -1.0): (0.5 * L05, 0.5, False),
        (1.0, 1.0): (-L1, -1.0, False),
        (1.0, -1.0): (L1, 1.0, False),
        (5.0, 1.0): (-4.0 * L5, -4.0, True),
        (5.0, -1.0): (4.0 * L5, 4.0, True),
    },
    # −(lp·A − ½·β·(lp − s)²), β = 0.05, lp − s = log r; d/dlp = −(A − β·log r)
    "dro": {
        (r, a): (-(lp_ * a - 0.025 * math.log(r) ** 2), -(a - 0.05 * math.log(r)), False)
        for (r, a), lp_ in zip(TABLE_POINTS, [L05, L05, L1, L1, L5, L5])
    },
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_ratio_table_default_config(name):
    r, a, lp = table_lp()
    x = token_inputs(len(r), advantages=a, logprobs=S_LP)
    tok, d_lp, clipped = value_and_dlp(
        name, jnp.asarray(lp, jnp.float32), x, losses.resolve_config(name, None)
    )
    want = np.array([EXPECTED[name][p] for p in TABLE_POINTS], dtype=object)
    np.testing.assert_allclose(tok, want[:, 0].astype(float), rtol=2e-6, atol=1e-6)
    np.testing.assert_allclose(d_lp, want[:, 1].astype(float), rtol=2e-6, atol=1e-6)
    np.testing.assert_array_equal(clipped, want[:, 2].astype(bool))


def test_ratio_table_overridden_clips():
    """Overridden thresholds move which tokens clip: PPO [0.4, 6] clips nothing at r = 5;
    CISPO [0.6, 2] clips r = 0.5 up to 0.6 and r = 5 down to 2."""
    r, a, lp = table_lp()
    x = token_inputs(len(r), advantages=a, logprobs=S_LP)
    lp = jnp.asarray(lp, jnp.float32)

    cfg = losses.resolve_config("ppo", {"clip_low_threshold": 0.4, "clip_high_threshold": 6})
    tok, d_lp, clipped = value_and_dlp("ppo", lp, x, cfg)
    np.testing.assert_allclose(tok, -r * a, rtol=2e-6)
    np.testing.assert_allclose(d_lp, -r * a, rtol=2e-6)
    assert not clipped.any()

    cfg = losses.resolve_config("cispo", {"clip_low_threshold": 0.6, "clip_high_threshold": 2})
    c = np.array([0.6, 0.6, 1.0, 1.0, 2.0, 2.0])
    tok, d_lp, clipped = value_and_dlp("cispo", lp, x, cfg)
    np.testing.assert_allclose(tok, -c * np.asarray(lp, np.float64) * a, rtol=2e-6)
    np.testing.assert_allclose(d_lp, -c * a, rtol=2e-6)
    np.testing.assert_array_equal(clipped, [True, True, False, False, True, True])

    cfg = losses.resolve_config("dro", {"beta": 2})
    tok, d_lp, _ = value_and_dlp("dro", lp, x, cfg)
    lr = np.log(r)
    np.testing.assert_allclose(tok, -(np.asarray(lp, np.float64) * a - lr**2), rtol=2e-6)
    np.testing.assert_allclose(d_lp, -(a - 2 * lr), rtol=2e-6, atol=1e-6)


def test_cross_entropy_closed_form():
    lp = np.array([-0.1, -2.0, -7.5, -3.0])
    w = np.array([1.0, 0.5, -1.0, 5.0])
    tok, d_lp, clipped = value_and_dlp(
        "cross_entropy", jnp.asarray(lp, jnp.float32), token_inputs(4, weights=w), {}
    )
    np.testing.assert_allclose(tok, [0.1, 1.0, -7.5, 15.0], rtol=2e-6)
    np.testing.assert_allclose(d_lp, [-1.0, -0.5, 1.0, -5.0], rtol=2e-6)
    assert not clipped.any()


def test_gspo_closed_form():
    """One datum (the whole vector): log-ratios [log 2, log 8, 5] with mask [1, 0.5, 0]
    give s = exp(mean(log 2, log 8)) = 4 (the unmasked 5 is left out; 0.5 counts like 1);
    every token's ratio is 4 and its gradient is s·(its own d lp) where unclipped."""
    s_lp = -2.0
    lp = jnp.asarray(np.log([2.0, 8.0, math.exp(5.0)]) + s_lp, jnp.float32)
    x = token_inputs(
        3, advantages=[1.0, -1.0, -1.0], logprobs=s_lp, sequence_ratio_mask=[1.0, 0.5, 0.0]
    )
    tok, d_lp, clipped = value_and_dlp("gspo", lp, x, losses.resolve_config("gspo", None))
    # A > 0, s = 4 > 1.2: the clipped term −1.2 wins, zero gradient; A < 0: −4·(−1).
    np.testing.assert_allclose(tok, [-1.2, 4.0, 4.0], rtol=2e-6)
    np.testing.assert_allclose(d_lp, [0.0, 4.0, 4.0], rtol=2e-6)
    np.testing.assert_array_equal(clipped, [True, False, False])
    cfg = losses.resolve_config("gspo", {"clip_low_threshold": 0.5, "clip_high_threshold": 5})
    tok, d_lp, clipped = value_and_dlp("gspo", lp, x, cfg)
    np.testing.assert_allclose(tok, [-4.0, 4.0, 4.0], rtol=2e-6)
    np.testing.assert_allclose(d_lp, [-4.0, 4.0, 4.0], rtol=2e-6)
    assert not clipped.any()
    # No token in the mask: s = 1, and the token ratios are 1 (not PPO's per-token ratios).
    x0 = token_inputs(3, advantages=[1.0, -1.0, -1.0], logprobs=s_lp, sequence_ratio_mask=0.0)
    tok, d_lp, _ = value_and_dlp("gspo", lp, x0, cfg)
    np.testing.assert_allclose(tok, [-1.0, 1.0, 1.0], rtol=2e-6)
    np.testing.assert_allclose(d_lp, [-1.0, 1.0, 1.0], rtol=2e-6)


def test_gspo_finite_loss_has_finite_gradient():
    """A sequence ratio that overflows float32 on clipped tokens (A > 0) gives the finite
    clipped loss and an exact zero gradient, never inf·0; where it is taken (A < 0) the
    loss is infinite, which the Trainer refuses by datum."""
    lp = jnp.asarray([-0.1, -0.2], jnp.float32)
    x = token_inputs(2, advantages=[1.0, 0.0], logprobs=-200.0)  # log s ≈ 200
    tok, d_lp, clipped = value_and_dlp("gspo", lp, x, losses.resolve_config("gspo", None))
    np.testing.assert_array_equal(tok, [np.float32(-1.2), 0.0])
    np.testing.assert_array_equal(d_lp, 0.0)
    assert clipped.tolist() == [True, False]
    x = token_inputs(2, advantages=[-1.0, 0.0], logprobs=-200.0)
    tok, _, _ = value_and_dlp("gspo", lp, x, losses.resolve_config("gspo", None))
    assert tok[0] == np.inf and tok[1] == 0.0


def test_token_losses_gspo_mixed_with_another_loss():
    """With several losses in one stream, GSPO's sequence mean sees only its own datum's
    tokens: the other loss's tokens (A, s, mask of their own) change nothing."""
    lp = jnp.asarray([-1.0, -2.0, -0.5, -3.0], jnp.float32)
    x = token_inputs(
        4,
        advantages=[1.0, -1.0, 1.0, 1.0],
        logprobs=[-1.5, -1.0, -9.0, -9.0],
        sequence_ratio_mask=[1.0, 1.0, 1.0, 1.0],
    )
    loss_id = jnp.asarray([0, 0, 1, 1])
    cfg = {"gspo": losses.resolve_config("gspo", None), "ppo": losses.resolve_config("ppo", None)}
    tok, _ = losses.token_losses(lp, x, ("gspo", "ppo"), cfg, loss_id)
    alone, _ = losses.LOSSES["gspo"](
        lp[:2], token_inputs(2, advantages=[1.0, -1.0], logprobs=[-1.5, -1.0]), cfg["gspo"]
    )
    np.testing.assert_allclose(np.asarray(tok[:2]), np.asarray(alone), rtol=1e-6)
    # Had the ppo tokens entered the mean, the gspo tokens' losses would differ.
    polluted, _ = losses.LOSSES["gspo"](lp, x, cfg["gspo"])
    assert not np.allclose(np.asarray(polluted[:2]), np.asarray(alone), rtol=1e-3)


@pytest.mark.parametrize("name", sorted(losses.LOSSES))
def test_zero_weight_or_advantage_gives_exact_zero(name):
    """w = 0 (cross_entropy) or A = 0 (the rest; DRO with β = 0): loss and gradient are
    exactly zero, at ratios far from 1 too."""
    lp = jnp.asarray([-0.2, -3.0, -9.0, -1.0], jnp.float32)
    s = jnp.asarray([-1.0, -1.0, -2.0, -8.0], jnp.float32)  # ratios e^0.8 … e^7
    x = losses.TokenInputs(jnp.zeros(4), jnp.zeros(4), s, jnp.ones(4))
    cfg = losses.resolve_config(name, {"beta": 0.0} if name == "dro" else None)
    tok, d_lp, _ = value_and_dlp(name, lp, x, cfg)
    np.testing.assert_array_equal(tok, 0.0)
    np.testing.assert_array_equal(d_lp, 0.0)
    # The same tokens with a non-zero weight/advantage do produce a loss and a gradient.
    x1 = losses.TokenInputs(jnp.ones(4), jnp.ones(4), s, jnp.ones(4))
    tok1, d_lp1, _ = value_and_dlp(name, lp, x1, cfg)
    assert np.all(tok1 != 0) and np.any(d_lp1 != 0)


def test_block_size():
    for n in (1, 2, 3, 8, 12, 24, 48, 96, 1536, 4096):
        for maximum in (1, 8, 1024):
            b = mesh_lib.block_size(n, maximum)
            assert b <= maximum and n % b == 0 and b & (b - 1) == 0
            assert 2 * b > maximum or n % (2 * b) != 0  # the largest such power of two


# ----------------------------------------------------------------------------------------
# 2. The dp = cp = tp = 1 run against NumPy


@functools.cache
def case(name):
    """Cases shared by every test (built once; the client's arrays are checked afterwards)."""
    if name == "ragged":  # odd lengths, a 1-token datum, datums longer than a 2cp chunk / CHUNK
        return H.make_case(name, [5, 1, 13, 8, 3, 17], seed=1)
    if name == "tiny":  # one 1-token datum: whole ranks (and dp shards) hold only padding
        return H.make_case(name, [1], seed=2)
    if name == "zeros":  # the ragged lengths, datums 1 and 2 with w = A = 0
        return H.make_case(name, [5, 1, 13, 8, 3, 17], seed=3, zero=(1, 2))
    if name == "all_zero":
        return H.make_case(name, [5, 1, 13, 8, 3, 17], seed=4, zero=range(6))
    raise KeyError(name)


OVERRIDE_SETS = {"default": None, "override": H.OVERRIDES}


@functools.cache
def reference_run(case_name, override_set):
    return H.run_case(case(case_name), H.REFERENCE_MESH, OVERRIDE_SETS[override_set])


@pytest.mark.parametrize("override_set", sorted(OVERRIDE_SETS))
@pytest.mark.parametrize("case_name", ["ragged", "tiny"])
def test_reference_mesh_matches_numpy(case_name, override_set):
    c = case(case_name)
    run = reference_run(case_name, override_set)
    cfgs = H.configs(OVERRIDE_SETS[override_set])
    for name in H.LOSS_NAMES:
        got, want = run.results[name], H.np_reference(c, name, cfgs[name])
        msg = f"{name} ({override_set})"
        for i in range(len(c.data)):
            np.testing.assert_allclose(
                got.logprobs[i],
                want["logprobs"][i],
                rtol=0,
                atol=2e-6,
                err_msg=f"{msg} logprobs datum {i}",
            )
            assert_rel(got.elementwise[i], want["elementwise"][i], err_msg=f"{msg} datum {i}")
            assert_rel(got.d_hidden[i], want["d_hidden"][i], err_msg=f"{msg} d_hidden {i}")
        assert_rel(got.datum_loss, want["datum_loss"], err_msg=f"{msg} datum_loss")
        assert_rel(got.loss, want["loss"], err_msg=f"{msg} loss")
        assert_rel(got.d_unembed, want["d_unembed"], err_msg=f"{msg} d_unembed")
        assert got.clipped == want["clipped"], msg
    c.assert_unchanged()


def test_config_overrides_change_the_numbers():
    """The overridden run really used other settings (else the override tests prove little)."""
    a, b = reference_run("ragged", "default"), reference_run("ragged", "override")
    for name in ("ppo", "cispo", "dro", "gspo"):
        assert a.results[name].loss != b.results[name].loss, name
    assert a.results["ppo"].clipped != b.results["ppo"].clipped
    assert a.results["gspo"].clipped < b.results["gspo"].clipped
    assert a.results["cispo"].clipped == 0 < b.results["cispo"].clipped
    # The ragged case has clipped and unclipped PPO tokens with the defaults.
    assert 0 < a.results["ppo"].clipped < sum(len(d.model_input) for d in case("ragged").data)


@pytest.mark.parametrize("name", sorted(losses.LOSSES))
def test_numpy_gradient_matches_finite_differences(name):
    """The NumPy reference's analytic gradients (used above) agree with central differences
    of its loss, for d/d hidden and d/d unembedding (CISPO's clipped ratio held fixed, as
    its stop_gradient says)."""
    c = case("ragged")
    cfg = H.configs(H.OVERRIDES)[name]
    ref = H.np_reference(c, name, cfg)
    hidden = [h.astype(np.float64) for h in c.hidden]
    w = c.unembed_DxV.astype(np.float64)
    base = (hidden, w)
    rng = np.random.default_rng(0)
    eps = 1e-6
    for _ in range(6):
        i = int(rng.integers(len(hidden)))
        t, k = int(rng.integers(len(hidden[i]))), int(rng.integers(H.D))
        plus = [h.copy() for h in hidden]
        minus = [h.copy() for h in hidden]
        plus[i][t, k] += eps
        minus[i][t, k] -= eps
        fd = H.np_total_loss(c, name, cfg, plus, w, base) - H.np_total_loss(
            c, name, cfg, minus, w, base
        )
        np.testing.assert_allclose(fd / (2 * eps), ref["d_hidden"][i][t, k], rtol=1e-5, atol=1e-7)
    for _ in range(4):
        k, v = int(rng.integers(H.D)), int(rng.integers(H.V))
        wp, wm = w.copy(), w.copy()
        wp[k, v] += eps
        wm[k, v] -= eps
        fd = H.np_total_loss(c, name, cfg, hidden, wp, base) - H.np_total_loss(
            c, name, cfg, hidden, wm, base
        )
        np.testing.assert_allclose(fd / (2 * eps), ref["d_unembed"][k, v], rtol=1e-5, atol=1e-7)


# ----------------------------------------------------------------------------------------
# 3. Every mesh gives the dp = cp = tp = 1 numbers


# Of the 21 other meshes of ≤ 8 devices, those whose axes no kept one covers are left out
# (dp 4 to 7 alone, dp 2 and 4 beside cp = 2 or tp = 2: each was ~2.4 CPU s): every cp
# (1, 2, 4, 8) and tp (1, 2), dp 1, 2, 3 (datums that do not split evenly) and 8, dp with
# cp, dp with tp, cp with tp and all three stay.
OTHER_MESHES = [
    (2, 1, 1),
    (3, 1, 1),
    (8, 1, 1),
    (1, 1, 2),
    (3, 1, 2),
    (1, 2, 1),
    (3, 2, 1),
    (1, 2, 2),
    (2, 2, 2),
    (1, 4, 1),
    (2, 4, 1),
    (1, 4, 2),
    (1, 8, 1),
]


def assert_really_different(run, ref):
    assert dict(run.mesh.shape) != dict(ref.mesh.shape)
    assert run.mesh.devices.size == math.prod(run.mesh_shape)
    assert dict(run.mesh.shape) == dict(zip(("dp", "cp", "tp"), run.mesh_shape))
    if run.mesh_shape[:2] != ref.mesh_shape[:2]:
        assert run.packed.tokens.shape != ref.packed.tokens.shape


def test_mesh_list_is_complete():
    assert len(H.ALL_MESHES) == 22 and len(set(H.ALL_MESHES)) == 22
    assert {m[1] for m in H.ALL_MESHES} == {1, 2, 4, 8} and {m[2] for m in H.ALL_MESHES} == {1, 2}
    assert (8, 1, 1) in H.ALL_MESHES and (1, 4, 2) in H.ALL_MESHES and (1, 8, 1) in H.ALL_MESHES
    assert set(OTHER_MESHES) < set(H.ALL_MESHES) and H.REFERENCE_MESH not in OTHER_MESHES
    assert {m[1] for m in OTHER_MESHES} == {1, 2, 4, 8} and {m[2] for m in OTHER_MESHES} == {1, 2}
    assert {m[0] for m in OTHER_MESHES} == {1, 2, 3, 8}
    assert all(
        any(a > 1 and b > 1 for a, b in pairs)
        for pairs in (
            [(m[0], m[1]) for m in OTHER_MESHES],
            [(m[0], m[2]) for m in OTHER_MESHES],
            [(m[1], m[2]) for m in OTHER_MESHES],
        )
    )


@pytest.mark.parametrize("case_name", ["ragged", "tiny"])
@pytest.mark.parametrize("mesh_shape", OTHER_MESHES, ids=lambda m: "dp{}-cp{}-tp{}".format(*m))
def test_mesh_matches_reference(mesh_shape, case_name):
    c = case(case_name)
    dp, cp, _ = mesh_shape
    for override_set in sorted(OVERRIDE_SETS):
        ref = reference_run(case_name, override_set)
        run = H.run_case(c, mesh_shape, OVERRIDE_SETS[override_set])
        assert_really_different(run, ref)
        pb = run.packed
        if case_name == "tiny" and dp * cp > 1:
            # One token: every (dp, cp) stream but one is padding only.
            empty = (pb.segment < 0).all(axis=-1)
            assert empty.sum() == dp * cp - 1
        if case_name == "ragged":
            assert pb.tokens.shape[-1] >= 2 * H.CHUNK  # streams span several log-prob chunks
        if case_name == "ragged" and cp > 1:
            # The 1-token datum leaves ranks with none of its tokens.
            p = next(p for p in pb.placements if p.n == 1)
            assert (pb.segment[p.shard, 1:, p.offset : p.offset + p.rows] < 0).all()
        for name in H.LOSS_NAMES:
            got, want = run.results[name], ref.results[name]
            msg = f"{name} ({override_set}) on dp={dp} cp={cp} tp={mesh_shape[2]}"
            for i in range(len(c.data)):
                np.testing.assert_allclose(
                    got.logprobs[i],
                    want.logprobs[i],
                    rtol=0,
                    atol=1e-6,
                    err_msg=f"{msg}: logprobs of datum {i}",
                )
                assert_rel(
                    got.elementwise[i],
                    want.elementwise[i],
                    err_msg=f"{msg}: elementwise_loss of datum {i}",
                )
            assert_rel(got.datum_loss, want.datum_loss, err_msg=f"{msg}: datum losses")
            assert_rel(got.loss, want.loss, err_msg=f"{msg}: loss")
            assert got.clipped == want.clipped, msg
            # d loss / d hidden is the zigzag cut of the CP = 1 gradient; rows holding no
            # token (noise-filled hidden states) get exactly zero.
            want_dh = H.to_stream(want.d_hidden, pb, cp)
            assert got.d_hidden_stream.shape == want_dh.shape
            assert_rel(got.d_hidden_stream, want_dh, err_msg=f"{msg}: d hidden")
            np.testing.assert_array_equal(
                got.d_hidden_stream[pb.segment < 0], 0.0, err_msg=f"{msg}: d hidden on padding"
            )
            assert_rel(got.d_unembed, want.d_unembed, err_msg=f"{msg}: d unembedding")
    c.assert_unchanged()


ZERO_MESHES = [(1, 1, 1), (1, 2, 1), (2, 2, 2), (1, 8, 1), (4, 1, 2), (2, 4, 1)]
ZERO_OVERRIDES = {"dro": {"beta": 0.0}}  # DRO's penalty does not vanish with A = 0


@pytest.mark.parametrize("mesh_shape", ZERO_MESHES, ids=lambda m: "dp{}-cp{}-tp{}".format(*m))
def test_zero_weight_datums_give_exact_zero_through_the_mesh(mesh_shape):
    """Datums with w = A = 0 have loss exactly 0 and hidden-state gradient exactly 0; the
    other datums do not. A batch that is all zeros has zero loss and zero gradients."""
    _, cp, _ = mesh_shape
    c = case("zeros")
    run = H.run_case(c, mesh_shape, ZERO_OVERRIDES)
    zero = {1, 2}
    for name in H.LOSS_NAMES:
        got = run.results[name]
        for i in range(len(c.data)):
            if i in zero:
                np.testing.assert_array_equal(got.elementwise[i], 0.0, err_msg=f"{name} {i}")
                assert got.datum_loss[i] == 0.0, (name, i)
                np.testing.assert_array_equal(got.d_hidden[i], 0.0, err_msg=f"{name} {i}")
            else:
                assert got.datum_loss[i] != 0.0, (name, i)
                assert np.any(got.d_hidden[i] != 0.0), (name, i)

    c = case("all_zero")
    run = H.run_case(c, mesh_shape, ZERO_OVERRIDES)
    for name in H.LOSS_NAMES:
        got = run.results[name]
        assert got.loss == 0.0, name
        np.testing.assert_array_equal(got.datum_loss, 0.0)
        np.testing.assert_array_equal(got.d_hidden_stream, 0.0)
        np.testing.assert_array_equal(got.d_unembed, 0.0)
        assert np.all(np.concatenate(got.logprobs) < 0)  # the log-probs are still reported
    # With its default β, DRO's penalty term is not zero at A = 0.
    assert H.run_case(c, mesh_shape).results["dro"].loss > 0
