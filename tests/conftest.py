"""8 fake CPU devices for every test; set once, before jax is imported anywhere.

Also: every compiled XLA:CPU program keeps memory maps of its code (about 11 each), and the
kernel allows a process vm.max_map_count = 65,530 of them. A whole session of cached
Trainers and jitted helpers went past that, and LLVM then segfaulted while compiling. So
after each test module, the tests' own caches (tests/ and tests/helpers/) are emptied and JAX's compilation caches
cleared: each module starts from nothing compiled (it compiles its own programs anyway).
"""

import gc
import os
import sys

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

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
