"""One process of the two-process test (run by tests/test_multiprocess.py, not by pytest).

argv: process_id port out_dir. 4 fake CPU devices per process, gloo collectives.
"""

import os
import sys

pid, port, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4 " + os.environ.get(
    "JCP_TEST_CHILD_XLA_FLAGS", ""
)
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=pid)

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
import mp_case  # noqa: E402

assert jax.process_count() == 2 and jax.device_count() == 8 and jax.local_device_count() == 4
result = mp_case.run(os.path.join(out, "ckpt"))
np.savez(os.path.join(out, f"result_{pid}.npz"), **result)
jax.distributed.shutdown()
