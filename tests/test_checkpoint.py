"""orbax adapter state: mesh-independent save/load, atomicity, refusals.

Trainers are the cached ones of trainer_harness (one per mesh for this module), borrowed:
every slot a test allocates is freed after it; only the refusal test builds Trainers of
other settings.
"""

import contextlib
import os

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from helpers import trainer_harness as H

import jcp

CFG = H.CFG
ADAM = jcp.AdamParams(learning_rate=1e-2, weight_decay=0.1, grad_clip_norm=5.0)


def _data(seed=0, lens=(23, 1, 40, 9)):
    rng = np.random.default_rng(seed)
    return [
        jcp.Datum(
            rng.integers(0, CFG.vocab_size, n),
            {
                "target_tokens": rng.integers(0, CFG.vocab_size, n),
                "advantages": rng.normal(size=n),
                "logprobs": -rng.uniform(1, 6, n),
            },
        )
        for n in lens
    ]


@pytest.fixture
def trainer():
    """trainer(dp, cp, tp): the cached Trainer of that mesh (max_rank 8, blocks and chunks
    of 16), borrowed for this test."""
    with contextlib.ExitStack() as stack:
        yield lambda *mesh: stack.enter_context(H.borrowed(H.trainer(mesh)))


def _slot_state(tr, a):
    t = jax.device_get(tr.state.tables())
    one = lambda tree: jax.tree.map(lambda x: x[a], tree)  # noqa: E731
    return {
        "mu": one(t["mu"]),
        "nu": one(t["nu"]),
        "grads": one(t["grads"]),
        "count": int(t["count"][a]),
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """An adapter trained two steps under mesh (1, 2, 2), then saved; plus what the next
    forward / forward_backward / optim_step give there."""
    path = str(tmp_path_factory.mktemp("ck") / "b")
    with H.borrowed(H.trainer((1, 2, 2))) as tr:
        return _train_and_save(tr, path)


def _train_and_save(tr, path):
    a = tr.create_adapter(rank=4, alpha=8.0)
    b = tr.create_adapter(rank=6, alpha=12.0, targets=["attn", "unembed"])
    data = _data()
    for _ in range(2):
        tr.forward_backward(data, "ppo", adapters=[a, b, a, b])
        tr.optim_step(a, ADAM)
        tr.optim_step(b, ADAM)
    tr.save_state(b, path)
    saved_w = tr.adapter_weights(b)
    saved_opt = _slot_state(tr, b)
    nxt = tr.forward(data, "ppo", adapters=b)
    tr.forward_backward(data, "ppo", adapters=b)
    g = tr.gradients(b)
    m = tr.optim_step(b, ADAM)
    after = tr.adapter_weights(b)
    return dict(
        path=path,
        weights=saved_w,
        opt=saved_opt,
        forward=nxt,
        grads=g,
        metrics=m,
        after=after,
        data=data,
        mesh=tr.mesh,
    )


def test_save_122_load_241(trainer, saved):
    tr = trainer(2, 4, 1)
    assert tr.mesh.shape != saved["mesh"].shape
    b = tr.load_state(saved["path"])
    w = tr.adapter_weights(b)
    assert sorted(w) == sorted(saved["weights"])
    for k in w:
        np.testing.assert_array_equal(w[k], saved["weights"][k])
    # Moments and step count restored (rank 6 of max_rank 8; untargeted modules zero).
    opt = _slot_state(tr, b)
    assert opt["count"] == saved["opt"]["count"] == 2
    for which in ("mu", "nu"):
        for m in opt[which]:
            for ab in ("a", "b"):
                np.testing.assert_array_equal(opt[which][m][ab], saved["opt"][which][m][ab])
    out = tr.forward(saved["data"], "ppo", adapters=b)
    for x, y in zip(out.loss_fn_outputs, saved["forward"].loss_fn_outputs):
        np.testing.assert_allclose(x["logprobs"], y["logprobs"], rtol=1e-5, atol=1e-6)
    tr.forward_backward(saved["data"], "ppo", adapters=b)
    for k, v in tr.gradients(b).items():
        np.testing.assert_allclose(v, saved["grads"][k], rtol=1e-4, atol=1e-6 * np.abs(v).max())
    m = tr.optim_step(b, ADAM)
    assert m["step"] == saved["metrics"]["step"] == 3
    for k, v in tr.adapter_weights(b).items():
        np.testing.assert_allclose(v, saved["after"][k], rtol=1e-4, atol=1e-6)


def test_weights_only(trainer, saved):
    tr = trainer(1, 1, 1)
    b = tr.load_state(saved["path"], with_optimizer=False)
    for k, v in tr.adapter_weights(b).items():
        np.testing.assert_array_equal(v, saved["weights"][k])
    opt = _slot_state(tr, b)
    assert opt["count"] == 0
    for part in ("mu", "nu", "grads"):
        assert all(not np.any(opt[part][m][ab]) for m in opt[part] for ab in ("a", "b")), part
    # …while the checkpoint itself holds moments: with_optimizer=True brings them back.
    c = tr.load_state(saved["path"])
    full = _slot_state(tr, c)
    assert full["count"] > 0
    assert any(np.any(full["nu"][m][ab]) for m in full["nu"] for ab in ("a", "b"))


def test_load_into_existing_slot(trainer, saved):
    tr = trainer(1, 2, 1)
    a = tr.create_adapter(rank=2)
    other = tr.create_adapter(rank=3)
    before = tr.adapter_weights(other)
    got = tr.load_state(saved["path"], adapter=a)
    assert got == a
    assert tr.adapters[a].rank == 6
    loaded = tr.adapter_weights(a)
    assert loaded.keys() == saved["weights"].keys()
    for k, v in saved["weights"].items():
        np.testing.assert_array_equal(loaded[k], v)
    for k, v in tr.adapter_weights(other).items():
        np.testing.assert_array_equal(v, before[k])


def _assert_previous_loads(tr, path, saved):
    c = tr.load_state(path)
    assert tr.adapters[c].rank == 6
    for k, v in tr.adapter_weights(c).items():
        np.testing.assert_array_equal(v, saved["weights"][k])


def test_interrupted_save_keeps_previous(trainer, saved, tmp_path, monkeypatch):
    import shutil

    path = str(tmp_path / "ck")
    shutil.copytree(saved["path"], path)
    tr = trainer(1, 2, 1)
    a = tr.create_adapter(rank=8, seed=5)

    real = ocp.Checkpointer.save

    def crash(self, directory, *args, **kwargs):
        real(self, directory, *args, **kwargs)  # everything written to the staging folder…
        raise KeyboardInterrupt("simulated crash before the checkpoint is moved into place")

    monkeypatch.setattr(ocp.Checkpointer, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        tr.save_state(a, path)
    monkeypatch.undo()
    _assert_previous_loads(tr, path, saved)


def test_interrupt_inside_orbax_keeps_previous(trainer, saved, tmp_path, monkeypatch):
    """Interrupt orbax itself mid-write (the JSON item fails after the arrays are written)."""
    import shutil

    path = str(tmp_path / "ck")
    shutil.copytree(saved["path"], path)
    tr = trainer(1, 1, 1)
    a = tr.create_adapter(rank=8, seed=5)

    def boom(*a, **k):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(ocp.JsonCheckpointHandler, "save", boom)
    monkeypatch.setattr(ocp.JsonCheckpointHandler, "async_save", boom, raising=False)
    with pytest.raises(OSError, match="disk full"):
        tr.save_state(a, path)
    monkeypatch.undo()
    _assert_previous_loads(tr, path, saved)


def test_save_replaces_existing(trainer, saved, tmp_path):
    tr = trainer(1, 1, 1)
    a = tr.create_adapter(rank=3, seed=9)
    path = str(tmp_path / "ck")
    tr.save_state(a, path)
    b = tr.create_adapter(rank=5, seed=10)
    tr.save_state(b, path)
    assert sorted(os.listdir(tmp_path)) == ["ck"]
    c = tr.load_state(path)
    assert tr.adapters[c].rank == 5
    for k, v in tr.adapter_weights(c).items():
        np.testing.assert_array_equal(v, tr.adapter_weights(b)[k])


def _snapshot(tr):
    return jax.device_get(tr.state.tables()), dict(tr.adapters)


def _assert_same(a, b):
    jax.tree.map(np.testing.assert_array_equal, a[0], b[0])
    assert a[1] == b[1]


@pytest.mark.parametrize(
    "cfg, max_rank, pattern",
    [
        (jcp.QwenConfig.tiny(rms_norm_eps=1e-5), 8, "different base model"),
        (CFG, 4, "max_rank"),
    ],
    ids=["base_mismatch", "rank_over_max"],
)
def test_load_refused_state_untouched(saved, cfg, max_rank, pattern):
    assert (cfg, max_rank) != (CFG, 8)  # differs from the saving trainer
    tr = jcp.Trainer(cfg, jcp.make_mesh(1, 1, 1), max_rank=max_rank)  # other settings: fresh
    tr.create_adapter(rank=2)
    before = _snapshot(tr)
    with pytest.raises(jcp.InputError, match=pattern):
        tr.load_state(saved["path"])
    _assert_same(before, _snapshot(tr))


def test_not_a_checkpoint(trainer, tmp_path):
    tr = trainer(1, 1, 1)
    with pytest.raises(jcp.InputError, match="no adapter checkpoint"):
        tr.load_state(str(tmp_path / "missing"))
    (tmp_path / "junk").mkdir()
    with pytest.raises(jcp.InputError, match="not a jcp adapter checkpoint"):
        tr.load_state(str(tmp_path / "junk"))
    assert tr.adapters == {}
