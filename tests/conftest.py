"""8 fake CPU devices for every test; set once, before jax is imported anywhere.

Also: every compiled XLA:CPU program keeps memory maps of its code (about 11 each), and the
kernel allows a process vm.max_map_count = 65,530 of them. A whole session of cached
Trainers and jitted helpers went past that, and LLVM then segfaulted while compiling. So
after each test module, the tests' own caches (every module under tests/) are emptied and JAX's compilation caches
cleared: each module starts from nothing compiled (it compiles its own programs anyway).

Compiling dominates the suite's time on CI's 2 cores, so the tests compile differently from
a user's run in ways that change no program's meaning:
- LLVM at -O0 (`--xla_backend_optimization_level=0`): measured on a Trainer's
  forward_backward at (1,2,1), 10.3 instead of 16.6 CPU s per compile; values differ from
  the default level's in the last bits only (≤ 1.7e-6 of the largest magnitude; every
  in-process comparison runs both sides at -O0); the tiny models' run time does not
  notice.
- XLA:CPU's older fusion code generators (`--xla_cpu_use_fusion_emitters=false`) and LLVM
  code generation in one piece (`--xla_cpu_parallel_codegen_split_count=1`): compiling
  the tiny Qwen3 / Qwen3.5 forward_backward at (1,2,2) 3.5 -> 1.3 / 14.6 -> 5.3 CPU s, their
  sampling programs 3.0 -> 0.9 / 7.1 -> 1.9; the log-probs, gradients and sampled tokens
  of dense, Qwen3.5 and MoE models (152 arrays) bit-identical to the new emitters', and
  the programs run no slower.
  Child processes (jcp-train, jcp-serve, the two-process and the killed-save tests)
  choose their own device count and take the same flags from JCP_TEST_CHILD_XLA_FLAGS (a
  jcp-train --moe run of 3 steps at -O0: 73.5 -> 50.5 CPU s, the same losses to the
  printed digits).
  JCP_TEST_XLA_OPT=default compiles the in-process tests and the children as users do.
- JAX's persistent compilation cache in a fresh folder per session (removed at exit), for
  programs that took ≥ 0.2 s to compile (at ≥ 1 s a full run hit it 12 times, while 484
  compiles of 0.2-1 s took 236 CPU s, many of them the same programs again: each module's
  Trainers install, step and sample alike): the same program built again (a new Trainer, a
  module after the caches below were cleared, the jcp-train child processes, which inherit
  the folder through the environment) is loaded instead of compiled. JCP_TEST_COMPILE_CACHE=0
  turns it off.

Measured for the suite's time and not taken (2026-12-07; full runs read 718-785 s with no
change at all, so a gain under ~40 s does not show in one run): timed per compile (as
tests/helpers/timing_plugin.py does), the in-process tests' tracing, lowering and XLA
compiling took 200, 165 and 558 s of their 1,464 (4,872 programs; a program compiled again
after a module's caches were cleared: 939 of them, 18 s); the cores were busy 94 % of the
run. Not taken:
`-n 3` (760 s against 756, the cores busy 99.5 %), keeping JAX's caches across modules
until the process's memory maps passed 30,000 (785 s), XLA:CPU flags (without expensive
LLVM passes, copy insertion without region analysis, the old runtime, the default
scheduler), no tracebacks in MLIR locations, and the layer loop rolled on CPU
(model_loss.CPU_UNROLL_LAYERS = 0): each within the noise of module runs.

And the two workers of `-n 2 --dist loadfile` get the modules longest first
(tests/durations.json). xdist's own order is by number of tests, which handed out the few-test but long
modules (the 2-process jobs, the benchmark smoke) last, so one worker was still in them
(their child processes contending with it) after the other had run dry. Each worker takes
the next module when its current one is nearly done, so longest-first ends the two
workers within about one short module of each other.
"""

import atexit
import gc
import json
import os
import shutil
import sys
import tempfile

_OPT = (
    ""
    if os.environ.get("JCP_TEST_XLA_OPT") == "default"
    else " --xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
    " --xla_cpu_parallel_codegen_split_count=1"
)
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8" + _OPT
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# What child processes (which choose their own device count) add to their XLA_FLAGS.
os.environ["JCP_TEST_CHILD_XLA_FLAGS"] = _OPT.strip()
# Every temporary file and folder of the session (tests' state folders, the servers'
# and child processes' logs) under one folder, removed at exit: `tempfile` and the children
# (through TMPDIR) both read it, so no run leaves folders behind in the system's /tmp.
_TMP = tempfile.mkdtemp(prefix="jcp-tests-")
atexit.register(shutil.rmtree, _TMP, ignore_errors=True)
os.environ["TMPDIR"] = tempfile.tempdir = _TMP

if (
    os.environ.get("JCP_TEST_COMPILE_CACHE", "1") == "1"
    and "JAX_COMPILATION_CACHE_DIR" not in os.environ
):
    _CACHE = tempfile.mkdtemp(prefix="jcp-test-xla-cache-")
    atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = os.environ.get(
        "JCP_TEST_CACHE_MIN_SECS", "0.2"
    )
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "-1"

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_enable_x64", False)

TESTS = os.path.dirname(os.path.abspath(__file__))


# How long each module's tests take (CPU seconds of the test process and its children, or
# wall seconds where a module mostly waits on its child processes), measured in one
# `-n 2 --dist loadfile` run with tests/helpers/timing_plugin.py, which also writes this
# file (its docstring says how); a module changed since has its measured saving taken off
# by hand until the next such run. Only the order and the slow mark depend on it: modules
# not listed count as 0 and run last, in name order.
with open(os.path.join(TESTS, "durations.json")) as _f:
    MODULE_SECONDS: dict[str, float] = json.load(_f)


def pytest_configure(config):
    # xdist's loadfile scheduler hands out modules in the collection's order with this off.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


# The development loop (`pytest -m "not slow"`) leaves out the modules measured at
# SLOW_SECONDS or more (tests/durations.json): meshes of whole models, servers, child
# processes. At 15 s it keeps ~140 s of modules, about 1.5 minutes on 2 cores (at 25 s it
# kept ~380 s, past the 3 minutes it must stay under). A test may also carry
# @pytest.mark.slow itself.
SLOW_SECONDS = 15.0


def pytest_collection_modifyitems(config, items):
    def seconds(item):
        return MODULE_SECONDS.get(os.path.relpath(str(item.path), TESTS), 0.0)

    for item in items:
        if seconds(item) >= SLOW_SECONDS:
            item.add_marker(pytest.mark.slow)
    items.sort(key=lambda item: -seconds(item))  # stable: a module's tests keep their order


@pytest.fixture(autouse=True)
def _program_store_off():
    """An in-process jcp-train or jcp-serve turns jcp's program store on for the process
    (cli.setup_compilation_cache); it is turned off after the test, so that no later test
    loads a program stored under another test's patched constants."""
    yield
    from jcp import program_store

    program_store.use(None)


@pytest.fixture
def retrace():
    """For a test that patches a module constant read while tracing (a spy on a traced
    function included): JAX's caches are cleared before it, so that its programs are traced
    under the patch, and after it, so that no later test reuses them. Trainers of equal
    settings share their programs (jcp/program_cache.py)."""
    jax.clear_caches()
    yield
    jax.clear_caches()


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    yield
    for module in list(sys.modules.values()):
        folder = os.path.dirname(os.path.abspath(getattr(module, "__file__", None) or "/"))
        if folder != TESTS and not folder.startswith(TESTS + os.sep):
            continue
        for value in list(vars(module).values()):
            if callable(getattr(value, "cache_clear", None)):
                value.cache_clear()
    jax.clear_caches()
    gc.collect()
