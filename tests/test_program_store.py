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
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

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


def test_other_fingerprints_are_kept_and_unstable_keys_never_stored(tmp_path):
    """Another jcp version's programs stay (the bound deletes them once unused, not a
    sweep: two versions sharing a folder keep each other's); a key naming an object's
    address is compiled and held in memory only."""
    folder = tmp_path / "programs"
    folder.mkdir(mode=0o700)
    other = folder / ("0" * 16 + "-scaled-x" + program_store.SUFFIX)
    other.write_bytes(b"old")
    assert not program_store.fingerprint().startswith("0" * 16)
    program_store.use(str(folder))
    try:
        mesh = make_mesh(1, 1, 1)
        unstable = StoredPrograms(_scaled(2.0), "scaled", (object(),), mesh)  # repr: an address
        unstable(jnp.arange(4.0), power=2)
        assert unstable.compiled_count == 1 and os.listdir(folder) == [other.name]
    finally:
        program_store.use(None)


def test_the_folder_keeps_the_programs_used_last_within_its_bound(store):
    mesh = make_mesh(1, 1, 1)
    x = jnp.arange(4.0)
    paths = []
    for age, power in enumerate((1, 2)):  # written first = used longest ago
        before = set(os.listdir(store))
        StoredPrograms(_scaled(2.0), "scaled", (2.0,), mesh)(x, power=power)
        (name,) = set(os.listdir(store)) - before
        paths.append(os.path.join(store, name))
        os.utime(paths[-1], (1e9 + age, 1e9 + age))
    sizes = [os.path.getsize(p) for p in paths]
    program_store.use(store, max_bytes=sizes[0] + sizes[1] + sizes[1] // 2)
    again = StoredPrograms(_scaled(2.0), "scaled", (2.0,), mesh)
    again.program(x, power=1)  # loads the first: now the one used last
    assert again.loaded == 1
    StoredPrograms(_scaled(2.0), "scaled", (2.0,), mesh)(x, power=3)  # over the bound
    kept = sorted(os.path.join(store, n) for n in os.listdir(store))
    assert len(kept) == 2 and paths[0] in kept and paths[1] not in kept


def test_one_placement_in_two_spellings_is_one_program(store):
    """PartitionSpec(), PartitionSpec(None) and a split over an axis of size 1 place an
    array alike (what a program's outputs came back as, and what the warm-up's inputs
    were): one program for all; a different placement is another."""
    mesh = make_mesh(1, 2, 2)
    x = np.arange(8.0, dtype=np.float32)
    long, short, dp, split = (
        jax.device_put(x, NamedSharding(mesh, spec)) for spec in (P(None), P(), P("dp"), P("tp"))
    )
    assert len({long.sharding, short.sharding, dp.sharding}) == 3
    programs = StoredPrograms(_scaled(2.0), "scaled", (2.0,), mesh)
    for arg in (long, short, dp):
        np.testing.assert_array_equal(np.asarray(programs(arg, power=2)), 2.0 * x**2)
    assert len(programs) == 1 and programs.compiled_count == 1
    assert len(os.listdir(store)) == 1
    np.testing.assert_array_equal(np.asarray(programs(split, power=2)), 2.0 * x**2)
    assert len(programs) == 2


def _tanh_sum(factor):
    @functools.partial(jax.jit, static_argnames=("power",))
    def f(x, *, power):
        return jnp.tanh(factor * x**power).sum()

    return f


def test_a_program_from_jax_cache_is_not_stored(store, retrace):
    """XLA:CPU cannot serialize again an executable it loaded from JAX's persistent cache:
    the copy loads, then fails at its first run ("Function … not found"). A program that
    JAX's cache handed back is run, not stored; the next one compiled is stored."""
    if not jax.config.jax_compilation_cache_dir:
        pytest.skip("JAX's persistent compilation cache is off (JCP_TEST_COMPILE_CACHE=0)")
    mesh = make_mesh(1, 1, 1)
    x = jnp.arange(4.0) / 3
    at = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    try:
        factor = float(np.random.default_rng().integers(2, 1 << 20))  # a new program
        want = float(_tanh_sum(factor)(x, power=3))  # now in JAX's cache
        jax.clear_caches()
        first = StoredPrograms(_tanh_sum(factor), "tanh_sum", (factor,), mesh)
        assert float(first(x, power=3)) == want and first.compiled_count == 1
        assert os.listdir(store) == []  # it came from JAX's cache
        again = StoredPrograms(_tanh_sum(factor), "tanh_sum", (factor,), mesh)
        assert float(again(x, power=3)) == want and again.loaded == 0
        fresh = StoredPrograms(_tanh_sum(factor), "tanh_sum", (factor,), mesh)
        assert float(fresh(x, power=2)) == float(jnp.tanh(factor * x**2).sum())
        assert len(os.listdir(store)) == 1  # compiled here: stored
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", at)


def test_a_negative_bound_is_refused_and_changes_nothing(store):
    with pytest.raises(ValueError, match="max_bytes -1 is negative"):
        program_store.use(store + "-other", max_bytes=-1)
    assert program_store.folder() == store and not os.path.exists(store + "-other")


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
    # jcp-serve's order: the engine's warm-up, then training, then a sample.
    eng = Engine(tr.make_sampler(), slots=4, max_len=32, chunk=4, prefill_tokens=16)
    eng.warmup(active=(1,))
    warm = sum(len(p) for p in eng.s.paged)
    tr.forward_backward(data, "cross_entropy", adapters=a)
    tr.optim_step(a, jcp.AdamParams(learning_rate=1e-2))
    rid = eng.submit([1, 2, 3], jcp.SamplingParams(max_tokens=4, temperature=0.0), a)
    eng.run()
    stored = [*tr.programs.fb_steps.values(), tr.state.optim_programs, *eng.s.paged]
    print(json.dumps({
        "after_warmup": sum(len(p) for p in eng.s.paged) - warm,
        "loaded": sum(p.loaded for p in stored),
        "compiled": sum(p.compiled_count for p in stored),
        "tokens": [int(t) for t in eng.result(rid).sequences[0].tokens],
        "logprobs": tr.forward(data, "cross_entropy", adapters=a).loss_fn_outputs[0]
        ["logprobs"].tolist(),
    }))
    """
)


def test_a_restarted_process_loads_every_program(tmp_path):
    """Two processes (different hash seeds: keys must not depend on the process) warm an
    engine up, train, step and sample alike; the second compiles none of the stored
    programs, and in neither does the sample need a program the warm-up did not prepare."""
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
    assert cold["after_warmup"] == 0 and warm["after_warmup"] == 0, runs
    assert cold["loaded"] == 0 and cold["compiled"] >= 4, cold
    assert warm["compiled"] == 0 and warm["loaded"] == cold["compiled"], warm
    assert warm["tokens"] == cold["tokens"] and len(cold["tokens"]) == 4
    np.testing.assert_array_equal(warm["logprobs"], cold["logprobs"])
