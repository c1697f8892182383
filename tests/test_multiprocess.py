"""2 processes × 4 fake CPU devices give what 1 process × 8 devices gives."""

import os
import socket
import subprocess
import sys

import jax
import numpy as np

from helpers import mp_case

HERE = os.path.dirname(__file__)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_match_one(tmp_path):
    assert jax.process_count() == 1 and jax.device_count() == 8
    port = str(_free_port())
    env = dict(os.environ)
    env["XLA_FLAGS"] = os.environ.get("JCP_TEST_CHILD_XLA_FLAGS", "")
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "helpers", "mp_worker.py"), str(i), port,
                               str(tmp_path)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(2)]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=600)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-4000:]

    single = mp_case.run(str(tmp_path / "single_ckpt"))
    multi = [dict(np.load(tmp_path / f"result_{i}.npz")) for i in range(2)]
    assert sorted(multi[0]) == sorted(single) == sorted(multi[1])
    assert any(k.startswith("grad_") and np.abs(v).max() > 0 for k, v in single.items())
    for k, v in single.items():
        # Every process holds complete outputs, and they are the same on both.
        np.testing.assert_array_equal(multi[0][k], multi[1][k], err_msg=k)
        scale = max(float(np.abs(v).max()), 1e-30)
        np.testing.assert_allclose(multi[0][k], v, rtol=1e-5, atol=1e-6 * scale, err_msg=k)
