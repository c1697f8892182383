"""jcp.program_store: compiled programs kept on disk and loaded by a restart without
tracing, under keys that change with everything the program is built from."""

import functools
import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import trainer_harness as H

from jcp import make_mesh, program_store
from jcp.program_store import StoredPrograms

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


@pytest.fixture
def store(tmp_path):
    folder = program_store.use(str(tmp_path / "programs"))
    yield folder
    program_store.use(None)


def _scaled(factor):
    """A jitted program of a static argument (`power`) and a constant of its builder."""

    @functools.partial(jax.jit, static_argnames=("power",))
    def f(x, *, power):
        return factor * x**power

    return f


def test_a_new_process_state_loads_without_tracing(store, retrace):
    mesh = make_mesh(1, 1, 1)
    x = jnp.arange(4.0)
    first = StoredPrograms(_scaled(2.0), "scaled", (2.0,), mesh)
    want = np.asarray(first(x, power=3))
    assert (first.compiled_count, first.loaded) == (1, 0)
    assert len(os.listdir(store)) == 1
    jax.clear_caches()
    again = StoredPrograms(_scaled(2.0), "scaled", (2.0,), mesh)
    got, traced = H.traces_and_compiles(lambda: np.asarray(again(x, power=3)))
    assert (again.compiled_count, again.loaded) == (0, 1) and traced == []
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize(
    "change",
    ["static", "shape", "dtype", "parts", "name"],
)
def test_anything_a_program_is_built_from_makes_another_key(store, change):
    mesh = make_mesh(1, 1, 1)
    x = jnp.arange(4.0)
    StoredPrograms(_scaled(2.0), "scaled", (2.0,), mesh)(x, power=3)
    factor, name, power = 2.0, "scaled", 3
    if change == "static":
        power = 2
    elif change == "shape":
        x = jnp.arange(5.0)
    elif change == "dtype":
        x = jnp.arange(4, dtype=jnp.int32)
    elif change == "parts":
        factor = 3.0
    else:
        name = "other"
    other = StoredPrograms(_scaled(factor), name, (factor,), mesh)
    got = np.asarray(other(x, power=power))
    assert (other.compiled_count, other.loaded) == (1, 0)
    np.testing.assert_allclose(got, factor * np.asarray(x) ** power)
    assert len(os.listdir(store)) == 2


def test_a_damaged_file_is_compiled_again(store):
    mesh = make_mesh(1, 1, 1)
    x = jnp.arange(4.0)
    StoredPrograms(_scaled(2.0), "scaled", (2.0,), mesh)(x, power=3)
    (name,) = os.listdir(store)
    path = os.path.join(store, name)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    again = StoredPrograms(_scaled(2.0), "scaled", (2.0,), mesh)
    np.testing.assert_array_equal(np.asarray(again(x, power=3)), 2.0 * np.arange(4.0) ** 3)
    assert (again.compiled_count, again.loaded) == (1, 0)
    assert os.path.getsize(path) > 0 and program_store.MAGIC == open(path, "rb").read(8)


def test_other_fingerprints_are_swept_and_unstable_keys_never_stored(tmp_path):
    folder = tmp_path / "programs"
    folder.mkdir(mode=0o700)
    stale = folder / ("0" * 16 + "-scaled-x" + program_store.SUFFIX)
    stale.write_bytes(b"old")
    assert not program_store.fingerprint().startswith("0" * 16)
    program_store.use(str(folder))
    try:
        mesh = make_mesh(1, 1, 1)
        unstable = StoredPrograms(_scaled(2.0), "scaled", (object(),), mesh)  # repr: an address
        unstable(jnp.arange(4.0), power=2)
        assert unstable.compiled_count == 1 and os.listdir(folder) == []
    finally:
        program_store.use(None)


def test_a_folder_others_may_write_is_refused(tmp_path):
    folder = tmp_path / "programs"
    folder.mkdir()
    os.chmod(folder, 0o777)
    with pytest.raises(ValueError, match="writable by group or others"):
        program_store.use(str(folder))
    assert program_store.folder() is None


CHILD = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import jcp
    from jcp import program_store
    from jcp.sample.engine import Engine

    program_store.use(sys.argv[1])
    cfg = jcp.QwenConfig.tiny(num_layers=1)
    tr = jcp.Trainer(cfg, jcp.make_mesh(1, 2, 1), max_adapters=2, max_rank=4, remat=False)
    a = tr.create_adapter(rank=4, seed=1)
    rng = np.random.default_rng(0)
    data = [jcp.Datum(rng.integers(0, cfg.vocab_size, 12),
                      {"target_tokens": rng.integers(0, cfg.vocab_size, 12),
                       "weights": np.ones(12)})]
    tr.forward_backward(data, "cross_entropy", adapters=a)
    tr.optim_step(a, jcp.AdamParams(learning_rate=1e-2))
    eng = Engine(tr.make_sampler(), slots=4, max_len=32, chunk=4, prefill_tokens=16)
    eng.warmup(active=(1,))
    rid = eng.submit([1, 2, 3], jcp.SamplingParams(max_tokens=4, temperature=0.0), a)
    eng.run()
    stored = [*tr.programs.fb_steps.values(), tr.state.optim_programs, *eng.s.paged]
    print(json.dumps({
        "loaded": sum(p.loaded for p in stored),
        "compiled": sum(p.compiled_count for p in stored),
        "tokens": [int(t) for t in eng.result(rid).sequences[0].tokens],
        "logprobs": tr.forward(data, "cross_entropy", adapters=a).loss_fn_outputs[0]
        ["logprobs"].tolist(),
    }))
    """
)


def test_a_restarted_process_loads_every_program(tmp_path):
    """Two processes (different hash seeds: keys must not depend on the process) train,
    step and sample alike; the second compiles none of the stored programs."""
    folder = str(tmp_path / "programs")
    runs = []
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": ROOT}
        env["XLA_FLAGS"] = (
            env.get("JCP_TEST_CHILD_XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
        )
        out = subprocess.run(
            [sys.executable, "-c", CHILD, folder],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    cold, warm = runs
    assert cold["loaded"] == 0 and cold["compiled"] >= 4, cold
    assert warm["compiled"] == 0 and warm["loaded"] == cold["compiled"], warm
    assert warm["tokens"] == cold["tokens"] and len(cold["tokens"]) == 4
    np.testing.assert_array_equal(warm["logprobs"], cold["logprobs"])
