"""8 fake CPU devices for every test; set once, before jax is imported anywhere.

Also: every compiled XLA:CPU program keeps memory maps of its code (about 11 each), and the
kernel allows a process vm.max_map_count = 65,530 of them. A whole session of cached
Trainers and jitted helpers went past that, and LLVM then segfaulted while compiling. So
after each test module, the tests' own caches (tests/ and tests/helpers/) are emptied and JAX's compilation caches
cleared: each module starts from nothing compiled (it compiles its own programs anyway).

Compiling dominates the suite's time on CI's 2 cores, so the tests compile differently from
a user's run in two ways that change no program's meaning:
- LLVM at -O0 (`--xla_backend_optimization_level=0`): measured on a Trainer's
  forward_backward at (1,2,1), 10.3 instead of 16.6 CPU s per compile; values differ from
  the default level's in the last bits only (≤ 1.7e-6 of the largest magnitude; every
  in-process comparison runs both sides at -O0); the tiny models' run time does not
  notice. Child processes (jcp-train, jcp-serve, the two-process and the killed-save
  tests) choose their own device count and take the same level from
  JCP_TEST_CHILD_XLA_FLAGS (a jcp-train --moe run of 3 steps: 73.5 -> 50.5 CPU s, the
  same losses to the printed digits).
  JCP_TEST_XLA_OPT=default compiles the in-process tests and the children as users do.
- JAX's persistent compilation cache in a fresh folder per session (removed at exit), for
  programs that took ≥ 1 s to compile: the same program built again (a new Trainer, a
  module after the caches below were cleared, the jcp-train child processes, which inherit
  the folder through the environment) is loaded instead of compiled. JCP_TEST_COMPILE_CACHE=0
  turns it off.
"""

import atexit
import gc
import os
import shutil
import sys
import tempfile

_OPT = ("" if os.environ.get("JCP_TEST_XLA_OPT") == "default"
        else " --xla_backend_optimization_level=0")
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8" + _OPT
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# What child processes (which choose their own device count) add to their XLA_FLAGS.
os.environ["JCP_TEST_CHILD_XLA_FLAGS"] = _OPT.strip()
if (os.environ.get("JCP_TEST_COMPILE_CACHE", "1") == "1"
        and "JAX_COMPILATION_CACHE_DIR" not in os.environ):
    _CACHE = tempfile.mkdtemp(prefix="jcp-test-xla-cache-")
    atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = os.environ.get(
        "JCP_TEST_CACHE_MIN_SECS", "1")
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "-1"

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_enable_x64", False)

TESTS = os.path.dirname(os.path.abspath(__file__))
HELPERS = os.path.join(TESTS, "helpers")


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    yield
    for module in list(sys.modules.values()):
        folder = os.path.dirname(os.path.abspath(getattr(module, "__file__", None) or "/"))
        if folder not in (TESTS, HELPERS):
            continue
        for value in list(vars(module).values()):
            if callable(getattr(value, "cache_clear", None)):
                value.cache_clear()
    jax.clear_caches()
    gc.collect()
