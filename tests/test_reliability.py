"""No NaN ever reaches an adapter; validation is exact in float32; every refusal is one
InputError naming the argument, with the Trainer's state bit-identical afterwards.

1. An overflow table: for each loss, sampling log-probs and advantages at the edges of
   float32, alone and mixed with ordinary datums. A call either succeeds with finite
   outputs and a finite accumulated gradient, or is refused with the state unchanged; an
   optim_step after it never leaves a non-finite weight or moment.
2. Known cases of that table with their exact outcome (an importance ratio that overflows
   is refused naming the datum; PPO's clipped branch gives a finite loss and an exactly
   zero gradient; a vector a datum carries for no loss of its own changes nothing).
3. optim_step with a non-finite gradient or update applies nothing and says why.
4. AdamParams and loss_fn_config at the float32 edges; malformed API arguments.
5. load_peft refuses foreign tensors and malformed files, naming the file.
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest
from helpers import trainer_harness as H

import jcp

N = 16
MESH = (1, 1, 1)
LOSSES = H.LOSS_NAMES + ("gspo",)
# Sampling log-probs and advantages at the edges of float32 (and ordinary ones): -100 is
# past exp's float32 range (a ratio e^~93), -1e30 far past it.
# 1e38 (near float32's largest) stands for every huge positive advantage.
LOGPROBS = (-1.0, -100.0, -1e30, 1e30)
ADVANTAGES = (1.0, -1.0, 0.0, -1e30, 1e38)


def rl(lp, adv, seed=0):
    rng = np.random.default_rng(seed)
    return jcp.Datum(
        rng.integers(0, H.CFG.vocab_size, N),
        {
            "target_tokens": rng.integers(0, H.CFG.vocab_size, N),
            "advantages": np.full(N, adv),
            "logprobs": np.full(N, lp),  # float64: cast by jcp
            "sequence_ratio_mask": np.ones(N),
        },
    )


def ce(seed=1, **extra):
    rng = np.random.default_rng(seed)
    inputs = {
        "target_tokens": rng.integers(0, H.CFG.vocab_size, N),
        "weights": np.ones(N, np.float32),
    }
    inputs.update(extra)
    return jcp.Datum(rng.integers(0, H.CFG.vocab_size, N), inputs)


def ordinary(seed=2):
    return rl(-np.log(H.CFG.vocab_size), 0.5, seed)


def _finite_tree(d: dict) -> bool:
    return all(np.all(np.isfinite(v)) for v in d.values())


def _all_finite_state(tr) -> bool:
    return all(np.all(np.isfinite(x)) for x in jax.tree.leaves(jax.device_get(tr.state.tables())))


@pytest.fixture
def tr():
    trainer = H.trainer(MESH)
    with H.borrowed(trainer):
        yield trainer


def _adapter(tr):
    """An adapter with non-zero B, so every LoRA tensor gets a gradient."""
    a = tr.create_adapter(rank=4, alpha=8.0, seed=3)
    tr.forward_backward([ce(seed=9)], "cross_entropy", adapters=a)
    tr.optim_step(a, jcp.AdamParams(learning_rate=1e-2))
    return a


# ----------------------------------------------------------------------------------------
# 1. The overflow table


@pytest.mark.parametrize("loss_fn", LOSSES)
def test_overflow_table_never_puts_nan_in_an_adapter(tr, loss_fn):
    a = _adapter(tr)
    outcomes = {"accepted": 0, "refused": 0}
    for lp in LOGPROBS:
        for adv in ADVANTAGES:
            edge = rl(lp, adv)
            if loss_fn == "cross_entropy":  # cross_entropy reads weights; give it the edge too
                edge = ce(
                    seed=0,
                    logprobs=np.full(N, lp, np.float32),
                    advantages=np.full(N, adv, np.float32),
                )
                edge.loss_fn_inputs["weights"] = np.full(N, min(abs(adv), 1e30), np.float32)
            for batch, losses in (
                ([edge], loss_fn),
                ([edge, ce(), ordinary()], [loss_fn, "cross_entropy", "importance_sampling"]),
            ):
                case = f"{loss_fn} lp={lp} adv={adv} batch of {len(batch)}"
                before = H.snapshot(tr)
                try:
                    fwd = tr.forward(batch, losses, adapters=a)
                except jcp.InputError as e:
                    assert "datum 0" in str(e) or "loss:sum" in str(e), (case, str(e))
                    H.assert_same_state(before, H.snapshot(tr))
                    # An infinite loss is refused by forward_backward too, changing nothing.
                    with pytest.raises(jcp.InputError):
                        tr.forward_backward(batch, losses, adapters=a)
                    H.assert_same_state(before, H.snapshot(tr))
                    outcomes["refused"] += 1
                    continue
                assert np.isfinite(fwd.metrics["loss:sum"]), case
                assert all(
                    np.all(np.isfinite(o["elementwise_loss"])) for o in fwd.loss_fn_outputs
                ), case
                # A finite loss has a finite gradient.
                out = tr.forward_backward(batch, losses, adapters=a)
                assert np.isfinite(out.metrics["loss:sum"]), case
                assert _finite_tree(tr.gradients(a)), case
                try:
                    m = tr.optim_step(a, jcp.AdamParams(learning_rate=1e-3))
                    assert np.isfinite(m["grad_norm"]), case
                except jcp.InputError as e:
                    assert "nothing was applied" in str(e), (case, str(e))
                assert _all_finite_state(tr), case
                outcomes["accepted"] += 1
    # The table exercises both outcomes for the ratio losses (it is not vacuous).
    assert outcomes["accepted"] > 0
    if loss_fn != "cross_entropy":
        assert outcomes["refused"] > 0, outcomes


# ----------------------------------------------------------------------------------------
# 2. Known cases


def test_importance_ratio_overflow_is_refused_naming_the_datum(tr):
    a = _adapter(tr)
    before = H.snapshot(tr)
    with pytest.raises(jcp.InputError, match=r"^datum 1: .*importance ratio .* overflows float32"):
        tr.forward_backward([ordinary(), rl(-100.0, 1.0)], "importance_sampling", adapters=a)
    H.assert_same_state(before, H.snapshot(tr))


def test_ppo_clipped_branch_is_finite_with_zero_gradient(tr):
    """r = exp(lp + 100) overflows, A > 0: the clipped term hi·A wins; its gradient is 0."""
    a = _adapter(tr)
    hi = 1.2
    out = tr.forward_backward([rl(-100.0, 1.0)], "ppo", adapters=a)
    np.testing.assert_array_equal(
        out.loss_fn_outputs[0]["elementwise_loss"], np.full(N, -hi, np.float32)
    )
    assert out.metrics["clipped_tokens:sum"] == N
    assert all(not np.any(g) for g in tr.gradients(a).values())


def test_gspo_sequence_ratio_overflow_is_refused_naming_the_datum(tr):
    """exp(mean log-ratio) overflows; A < 0 takes the unclipped (infinite) term: refused,
    naming the datum and the sequence ratio. With A > 0 the clipped term is finite and its
    gradient exactly 0."""
    a = _adapter(tr)
    before = H.snapshot(tr)
    with pytest.raises(jcp.InputError, match=r"^datum 1: .*sequence ratio .* overflows float32"):
        tr.forward_backward([ordinary(), rl(-100.0, -1.0)], "gspo", adapters=a)
    H.assert_same_state(before, H.snapshot(tr))
    out = tr.forward_backward([rl(-100.0, 1.0)], "gspo", adapters=a)
    np.testing.assert_array_equal(
        out.loss_fn_outputs[0]["elementwise_loss"], np.full(N, -1.2, np.float32)
    )
    assert out.metrics["clipped_tokens:sum"] == N
    assert all(not np.any(g) for g in tr.gradients(a).values())


@pytest.mark.parametrize("loss_fn", ["importance_sampling", "ppo", "cispo", "gspo"])
def test_zero_advantage_gives_exact_zeros(tr, loss_fn):
    a = _adapter(tr)
    out = tr.forward_backward([rl(-100.0, 0.0)], loss_fn, adapters=a)
    assert not np.any(out.loss_fn_outputs[0]["elementwise_loss"])
    assert all(not np.any(g) for g in tr.gradients(a).values())


def test_a_vector_carried_for_no_loss_changes_nothing(tr):
    """A cross_entropy datum with an extra logprobs of −100 in a mixed batch: outputs and
    gradient are exactly those without the extra field."""
    a = _adapter(tr)
    plain = [ce(), ordinary()]
    extra = [
        ce(logprobs=np.full(N, -100.0, np.float32), advantages=np.full(N, 1e30, np.float32)),
        ordinary(),
    ]
    assert "logprobs" in extra[0].loss_fn_inputs and "logprobs" not in plain[0].loss_fn_inputs
    losses = ["cross_entropy", "importance_sampling"]
    got = tr.forward_backward(extra, losses, adapters=a)
    g_extra = tr.gradients(a)
    tr.optim_step(a, jcp.AdamParams(learning_rate=0.0))  # clears the accumulator only
    want = tr.forward_backward(plain, losses, adapters=a)
    g_plain = tr.gradients(a)
    assert got.metrics == want.metrics
    for k in g_plain:
        np.testing.assert_array_equal(g_extra[k], g_plain[k], err_msg=k)
    assert H.max_abs(g_plain) > 0


def test_refused_micro_batch_rolls_back_the_earlier_ones(tr):
    """With max_tokens_per_device small the call runs as several micro-batches; a refusal in
    the last one restores the accumulators the earlier ones had added to."""
    small = jcp.Trainer(H.CFG, jcp.make_mesh(*MESH), max_tokens_per_device=N, **H.TRAINER_KW)
    a = _adapter(small)
    small.forward_backward([ordinary(5)], "importance_sampling", adapters=a)  # non-zero acc
    before = H.snapshot(small)
    assert H.max_abs(before["grads"][a]) > 0
    data = [ordinary(6), ordinary(7), rl(-100.0, 1.0)]
    with pytest.raises(jcp.InputError, match="^datum 2: "):
        small.forward_backward(data, "importance_sampling", adapters=a)
    H.assert_same_state(before, H.snapshot(small))


def test_micro_batches_in_flight_are_bounded(tr, monkeypatch):
    """A call of many micro-batches waits for the oldest before dispatching past
    MAX_IN_FLIGHT (dozens queued at once aborted XLA:CPU), with the same results."""
    small = jcp.Trainer(H.CFG, jcp.make_mesh(*MESH), max_tokens_per_device=N, **H.TRAINER_KW)
    a = small.create_adapter(rank=4, alpha=8.0, seed=3)
    data = [ce(seed=s) for s in range(7)]
    free = small.forward(data, "cross_entropy", adapters=a)
    waits = []
    real = jax.block_until_ready
    monkeypatch.setattr(jax, "block_until_ready", lambda x: (waits.append(1), real(x))[1])
    monkeypatch.setattr(small, "MAX_IN_FLIGHT", 2)
    bounded = small.forward(data, "cross_entropy", adapters=a)
    assert len(waits) == len(data) - 2  # one micro-batch per datum at this budget
    for x, y in zip(free.loss_fn_outputs, bounded.loss_fn_outputs):
        np.testing.assert_array_equal(x["logprobs"], y["logprobs"])


@pytest.mark.parametrize("export", ["export_peft", "export_vllm"])
def test_export_onto_a_file_is_an_input_error(tr, tmp_path, export):
    a = tr.create_adapter(rank=2, alpha=4.0, seed=1)
    f = tmp_path / "file"
    f.write_text("keep")
    for path, pattern in (
        (f, "exists and is not a folder"),
        (f / "sub", "not a folder"),
        (str(tmp_path / "x\0y"), "NUL"),
        (str(tmp_path / ("n" * 300)), "longer than 255"),
    ):
        with pytest.raises(jcp.InputError, match=f"^{export}: path.*{pattern}"):
            getattr(tr, export)(a, path)
    assert f.read_text() == "keep" and sorted(os.listdir(tmp_path)) == ["file"]


# ----------------------------------------------------------------------------------------
# 3. optim_step applies nothing non-finite


def _nan_gradient(tr, a):
    with tr.state.accumulating([a]) as accumulate:
        accumulate(lambda g: (jax.tree.map(lambda x: x.at[a].set(np.nan), g), None))


@pytest.mark.parametrize("cause", ["gradient", "update"])
def test_optim_step_with_non_finite_result_changes_nothing(tr, cause):
    a = _adapter(tr)
    other = tr.create_adapter(rank=2, seed=4)
    tr.forward_backward([ce(), ce(seed=3)], "cross_entropy", adapters=[a, other])
    if cause == "gradient":
        _nan_gradient(tr, a)
        adam, pattern = jcp.AdamParams(learning_rate=1e-3), "gradient is not finite"
    else:  # finite settings whose product overflows: lr·wd·w = inf
        adam = jcp.AdamParams(learning_rate=3e38, weight_decay=1e30)
        pattern = "update is not finite"
    before = H.snapshot(tr)
    with pytest.raises(jcp.InputError, match=f"^adapter {a}: .*{pattern}"):
        tr.optim_step(a, adam)
    after = H.snapshot(tr)
    # Weights, moments, count of `a` and everything of `other` bit-identical; only a's
    # accumulator was cleared.
    for k, w in before["weights"][a].items():
        np.testing.assert_array_equal(after["weights"][a][k], w, err_msg=k)
    assert all(not np.any(g) for g in after["grads"][a].values())
    for part in ("mu", "nu"):
        for x, y in zip(
            jax.tree.leaves(getattr(before["opt"], part)),
            jax.tree.leaves(getattr(after["opt"], part)),
        ):
            np.testing.assert_array_equal(x, y)
    np.testing.assert_array_equal(before["opt"].count, after["opt"].count)
    for k, g in before["grads"][other].items():
        np.testing.assert_array_equal(after["grads"][other][k], g, err_msg=k)
    assert H.max_abs(before["grads"][other]) > 0
    # The adapter still trains afterwards.
    tr.forward_backward([ce()], "cross_entropy", adapters=a)
    assert tr.optim_step(a, jcp.AdamParams(learning_rate=1e-3))["step"] == 2


# ----------------------------------------------------------------------------------------
# 4. Settings at the float32 edges, malformed arguments


@pytest.mark.parametrize(
    "field, value, pattern",
    [
        ("learning_rate", 1e39, "learning_rate .*overflows float32"),
        ("learning_rate", 10**400, "learning_rate .*overflows float32"),
        ("weight_decay", -(10**400), "weight_decay .*overflows float32"),
        ("learning_rate", float("inf"), "learning_rate must be finite"),
        ("learning_rate", "x", "learning_rate must be a number"),
        ("weight_decay", 1e39, "weight_decay .*overflows float32"),
        ("grad_clip_norm", -1e39, "grad_clip_norm .*overflows float32"),
        ("beta1", 0.99999999, "beta1 must be < 1 in float32"),
        ("beta2", 0.99999999, "beta2 must be < 1 in float32"),
        ("beta2", 1.0, "beta2 must be < 1"),
        ("eps", 1e-45, "eps must be ≥ 1.175e-38"),
        ("eps", 1e-39, "eps must be ≥ 1.175e-38"),
        ("eps", 0.0, "eps must be ≥"),
        ("beta1", -0.1, "beta1 must be ≥ 0"),
    ],
)
def test_adam_params_refused_in_float32(tr, field, value, pattern):
    a = _adapter(tr)
    tr.forward_backward([ce()], "cross_entropy", adapters=a)
    before = H.snapshot(tr)
    with pytest.raises(jcp.InputError, match=f"^AdamParams.{pattern}"):
        tr.optim_step(a, jcp.AdamParams(**{field: value}))
    H.assert_same_state(before, H.snapshot(tr))


@pytest.mark.parametrize(
    "loss_fn, config, pattern",
    [
        ("ppo", {"clip_high_threshold": 1e39}, "clip_high_threshold .*overflows float32"),
        ("ppo", {"clip_high_threshold": 10**400}, "clip_high_threshold .*overflows float32"),
        ("dro", {"beta": 1e39}, "beta .*overflows float32"),
        ("dro", {"beta": -1.0}, "beta must be ≥ 0"),
        ("cispo", {"clip_low_threshold": -1.0}, "clip_low_threshold must be ≥ 0"),
        ("ppo", {"clip_low_threshold": 2.0}, "exceeds clip_high_threshold"),
        ("ppo", {"clip": 1.0}, "not a setting of ppo"),
        ("cross_entropy", {"cross_entropy": 5}, "for cross_entropy must be a dict"),
        ("ppo", {"ppo": "x"}, "for ppo must be a dict"),
        ("ppo", [1, 2], "loss_fn_config must be a dict"),
    ],
)
def test_loss_fn_config_refused(tr, loss_fn, config, pattern):
    a = _adapter(tr)
    datum = ce() if loss_fn == "cross_entropy" else ordinary()
    before = H.snapshot(tr)
    with pytest.raises(jcp.InputError, match=pattern):
        tr.forward_backward([datum], loss_fn, config, adapters=a)
    H.assert_same_state(before, H.snapshot(tr))


@pytest.mark.parametrize(
    "call, pattern",
    [
        (
            lambda tr, a: tr.forward_backward([ce()], [["cross_entropy"]], adapters=a),
            r"datum 0: unknown loss_fn \['cross_entropy'\]",
        ),
        (lambda tr, a: tr.forward_backward([ce()], 5, adapters=a), "loss_fn must be"),
        (lambda tr, a: tr.create_adapter(targets=5), "LoRA targets must be a list"),
        (
            lambda tr, a: tr.create_adapter(targets=[["q_proj"]]),
            r"unknown LoRA target \['q_proj'\]",
        ),
        (lambda tr, a: tr.create_adapter(seed=-1), "seed must be a non-negative integer"),
        (lambda tr, a: tr.create_adapter(seed="x"), "seed must be a non-negative integer"),
        (lambda tr, a: tr.create_adapter(alpha=1e39), "alpha = 1e\\+39 overflows float32"),
        (lambda tr, a: tr.create_adapter(alpha=10**400), "alpha = 1000.* overflows float32"),
        (
            lambda tr, a: tr.sample(
                [[1, 2]], jcp.SamplingParams(max_tokens=2, temperature=10**400)
            ),
            "temperature = 1000.* overflows float32",
        ),
        (
            lambda tr, a: tr.forward_backward(
                [
                    jcp.Datum(
                        np.arange(N) + 0j, {"target_tokens": np.arange(N), "weights": np.ones(N)}
                    )
                ],
                "cross_entropy",
                adapters=a,
            ),
            "datum 0: model_input must hold integer token ids",
        ),
        (
            lambda tr, a: tr.forward_backward(
                [ce(weights=np.ones(N) + 1j)], "cross_entropy", adapters=a
            ),
            "datum 0: loss_fn_inputs.weights is not a vector of numbers",
        ),
        (
            lambda tr, a: tr.forward_backward(
                [ce(weights=np.full(N, 1e39))], "cross_entropy", adapters=a
            ),
            r"datum 0: loss_fn_inputs.weights\[0\] = 1e\+39 overflows float32",
        ),
        (
            lambda tr, a: tr.forward_backward([rl(-1.0, 1e39)], "ppo", adapters=a),
            r"datum 0: loss_fn_inputs.advantages\[0\] = 1e\+39 overflows float32",
        ),
    ],
    ids=[
        "loss_fn-nested",
        "loss_fn-int",
        "targets-int",
        "targets-nested",
        "seed-negative",
        "seed-str",
        "alpha-overflow",
        "alpha-int-overflow",
        "temperature-int-overflow",
        "complex-tokens",
        "complex-weights",
        "weights-overflow",
        "advantages-overflow",
    ],
)
def test_malformed_arguments_are_input_errors(tr, call, pattern):
    a = _adapter(tr)
    before = H.snapshot(tr)
    with pytest.raises(jcp.InputError, match=pattern):
        call(tr, a)
    H.assert_same_state(before, H.snapshot(tr))


# ----------------------------------------------------------------------------------------
# 5. load_peft refuses what it would not read exactly


def _peft_folder(tmp_path, name="ok", extra_tensors=None, config=None):
    rank, targets = 2, ("q_proj", "v_proj")
    w = H.random_peft_weights(H.CFG, rank, targets, seed=0)
    w.update(extra_tensors or {})
    path = H.write_peft(str(tmp_path / name), rank, 4.0, targets, w)
    if config is not None:
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            f.write(config)
    return path


def test_clean_peft_folder_loads(tr, tmp_path):
    a = tr.load_peft(_peft_folder(tmp_path))
    assert tr.adapters[a].targets == ("q_proj", "v_proj")


@pytest.mark.parametrize(
    "key",
    [
        "base_model.model.model.layers.{L}.self_attn.q_proj.lora_A.weight",  # past the depth
        "base_model.model.model.layers.0.mlp.up_proj.lora_A.weight",  # outside target_modules
        "junk",
    ],
    ids=["layer-past-depth", "module-not-targeted", "junk-key"],
)
def test_load_peft_refuses_unused_tensors(tr, tmp_path, key):
    key = key.format(L=H.CFG.num_layers)
    path = _peft_folder(tmp_path, extra_tensors={key: np.zeros((2, H.CFG.hidden_size), np.float32)})
    before = H.snapshot(tr)
    with pytest.raises(jcp.InputError, match=f"adapter_model.safetensors: tensor {key} .*not used"):
        tr.load_peft(path)
    H.assert_same_state(before, H.snapshot(tr))


@pytest.mark.parametrize(
    "damage, pattern",
    [
        ("garbage", "is not a safetensors file"),
        ("truncated", "is truncated or corrupt"),
        ("bad-header", "is not a safetensors file"),
    ],
)
def test_load_peft_refuses_malformed_safetensors(tr, tmp_path, damage, pattern):
    path = _peft_folder(tmp_path)
    f = os.path.join(path, "adapter_model.safetensors")
    data = open(f, "rb").read()
    if damage == "garbage":
        data = b"not a safetensors!"
    elif damage == "truncated":
        data = data[: len(data) // 2]
    else:
        n = int.from_bytes(data[:8], "little")
        data = data[:8] + b"{" * n + data[8 + n :]
    open(f, "wb").write(data)
    before = H.snapshot(tr)
    with pytest.raises(jcp.InputError, match=f"{f} {pattern}"):
        tr.load_peft(path)
    H.assert_same_state(before, H.snapshot(tr))


@pytest.mark.parametrize(
    "config, pattern",
    [
        ("{not json", "adapter_config.json is not valid JSON"),
        ("[1, 2]", "adapter_config.json must hold a JSON object"),
        (
            json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": 5}),
            "target_modules 5 must be a non-empty list",
        ),
        (
            json.dumps(
                {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": [["q_proj"]]}
            ),
            "must be a non-empty list",
        ),
    ],
    ids=["not-json", "json-list", "targets-int", "targets-nested"],
)
def test_load_peft_refuses_malformed_config(tr, tmp_path, config, pattern):
    path = _peft_folder(tmp_path, config=config)
    with pytest.raises(jcp.InputError, match=pattern):
        tr.load_peft(path)
    assert dict(tr.adapters) == {}
