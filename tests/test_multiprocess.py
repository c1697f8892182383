"""2 processes × 4 fake CPU devices give what 1 process × 8 devices gives; the training
step's outputs summed in its gradient's all-reduce (what makes a multi-process step cheaper)
are the same bits as summed in the forward pass; the step summed on the host (what a
multi-process CPU job runs) gives what the all-reduce gives."""

import dataclasses
import os
import re
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest
from helpers import mp_case

import jcp
from jcp import host_sum, train_step
from jcp.program_store import StoredPrograms

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
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                os.path.join(HERE, "helpers", "mp_worker.py"),
                str(i),
                port,
                str(tmp_path),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    # The one-process run meanwhile (the children mostly start and compile: ~10 s of wall
    # not spent waiting).
    try:
        single = mp_case.run(str(tmp_path / "single_ckpt"))
    except BaseException:
        for q in procs:
            q.kill()
        raise
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

    multi = [dict(np.load(tmp_path / f"result_{i}.npz")) for i in range(2)]
    # Two processes sum the gradient on each host (host_sum.HostSummedStep), one process
    # in its all-reduce.
    assert [bool(r.pop("sums_on_host")) for r in [single] + multi] == [False, True, True]
    assert sorted(multi[0]) == sorted(single) == sorted(multi[1])
    assert any(k.startswith("grad_") and np.abs(v).max() > 0 for k, v in single.items())
    for k, v in single.items():
        # Every process holds complete outputs, and they are the same on both.
        np.testing.assert_array_equal(multi[0][k], multi[1][k], err_msg=k)
        scale = max(float(np.abs(v).max()), 1e-30)
        np.testing.assert_allclose(multi[0][k], v, rtol=1e-5, atol=1e-6 * scale, err_msg=k)


def _all_reduce_operands(hlo: str) -> int:
    """Arrays summed by the all-reduces of a compiled program whose device groups have more
    than one device (a tuple all-reduce counts each operand: XLA:CPU runs each as its own
    collective)."""
    n = 0
    for line in hlo.splitlines():
        m = re.search(r"= (.*?) all-reduce(?:-start)?\(.*?replica_groups=(\S+)", line)
        if m and not re.match(r"\{\{\d+\}[,}]", m.group(2)):
            n += len(re.findall(r"\b[a-z]+\d*\[", m.group(1)))
    return n


def test_outputs_summed_with_the_gradient_are_the_forward_sums():
    """train_step's folded forward_backward (the loss and per-datum outputs summed over dp and
    cp in the gradient's all-reduce) against the same step summing them in the forward pass:
    one all-reduce fewer, bit-identical losses, log-probs, clipped counts and gradients.
    mp_case's step (2, 2, 2, ppo with clipped tokens, two adapters), so its program is the
    one test_two_processes_match_one compiled in this process."""
    rng = np.random.default_rng(0)
    data = [
        jcp.Datum(
            rng.integers(0, mp_case.CFG.vocab_size, n),
            {
                "target_tokens": rng.integers(0, mp_case.CFG.vocab_size, n),
                "advantages": rng.normal(size=n),
                "logprobs": -rng.uniform(1, 6, n),
            },
        )
        for n in (37, 1, 20, 64, 5)
    ]
    tr = jcp.Trainer(
        mp_case.CFG, jcp.make_mesh(2, 2, 2), max_rank=8, attn_block=16, logprob_chunk=16
    )
    runs = []
    for fold in (True, False):
        tr.programs.fb_steps = {
            r: StoredPrograms(
                train_step.make_forward_backward(
                    tr.cfg, tr.mesh, dataclasses.replace(tr.step_cfg, remat=r), fold=fold
                ),
                "forward_backward",
                (tr.cfg, r, fold),
                tr.mesh,
            )
            for r in tr.programs.fb_steps
        }
        tr.programs.compiled.clear()
        a, b = tr.create_adapter(rank=4, seed=1), tr.create_adapter(rank=8, seed=2)
        out = tr.forward_backward(data, "ppo", adapters=[a, b, a, b, a])
        (program,) = tr.forward_backward_programs.values()
        runs.append(
            (out, tr.gradients(a), tr.gradients(b), _all_reduce_operands(program.as_text()))
        )
    (folded, fa, fb, f_ops), (ref, ra, rb, r_ops) = runs
    assert f_ops == r_ops - 1, (f_ops, r_ops)
    assert ref.metrics["clipped_tokens:sum"] > 0
    assert ref.metrics == folded.metrics
    for x, y in zip(folded.loss_fn_outputs, ref.loss_fn_outputs):
        assert x.keys() == y.keys()
        for k in x:
            np.testing.assert_array_equal(x[k], y[k], err_msg=k)
    for got, want in ((fa, ra), (fb, rb)):
        assert any(np.abs(v).max() > 0 for v in want.values())
        for k in want:
            np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_sums_on_host_match_the_all_reduce():
    """host_sum.HostSummedStep (the gradient and outputs of each device summed on the host,
    then over processes) against the one-program forward_backward and forward, in one
    process over 8 devices: the same outputs and gradients up to the order of float32 sums, and no
    all-reduce over dp or cp in its model program. It is chosen only for multi-process CPU
    meshes with tp = 1."""
    assert not host_sum.sums_on_host(jcp.make_mesh(8, 1, 1))  # one process
    rng = np.random.default_rng(1)
    data = [
        jcp.Datum(
            rng.integers(0, mp_case.CFG.vocab_size, n),
            {
                "target_tokens": rng.integers(0, mp_case.CFG.vocab_size, n),
                "advantages": rng.normal(size=n),
                "logprobs": -rng.uniform(1, 6, n),
            },
        )
        for n in (37, 1, 20, 64, 5)
    ]
    runs = []
    for on_host in (False, True):
        tr = jcp.Trainer(
            mp_case.CFG, jcp.make_mesh(4, 2, 1), max_rank=8, attn_block=16, logprob_chunk=16
        )
        tr.sums_on_host = on_host
        a, b = tr.create_adapter(rank=4, seed=1), tr.create_adapter(rank=8, seed=2)
        tr.forward_backward(data, "ppo", adapters=[a, b, a, b, a])
        tr.optim_step(a, jcp.AdamParams(learning_rate=1e-2))
        out = tr.forward_backward(data, "ppo", adapters=[a, b, a, b, a])
        (program,) = tr.forward_backward_programs.values()
        fwd = tr.forward(data, "ppo", adapters=[b, a, b, a, b])
        # A refused call (a loss not finite in float32) leaves the accumulators as they were.
        kept = tr.gradients(a)
        bad = jcp.Datum(
            data[0].model_input, {**data[0].loss_fn_inputs, "advantages": np.full(37, 1e38)}
        )
        with pytest.raises(jcp.InputError, match="datum 0"):
            tr.forward_backward([bad] + data[1:], "ppo", adapters=[a, b, a, b, a])
        for k, v in tr.gradients(a).items():
            np.testing.assert_array_equal(v, kept[k], err_msg=k)
        # forward took the host sum's programs exactly where they were asked for.
        assert (tr.programs.host_step.forward_partials._cache_size() > 0) == on_host
        runs.append((out, tr.gradients(a), tr.gradients(b), program, fwd))
    (ref, ra, rb, one, ref_fwd), (got, ga, gb, two, got_fwd) = runs
    assert isinstance(two, host_sum.HostSummedProgram) and not isinstance(
        one, host_sum.HostSummedProgram
    )
    assert _all_reduce_operands(one.as_text()) > 0
    assert _all_reduce_operands(two.partials.as_text()) == 0
    assert ref.metrics["clipped_tokens:sum"] > 0
    assert ref.metrics["clipped_tokens:sum"] == got.metrics["clipped_tokens:sum"]
    np.testing.assert_allclose(got.metrics["loss:sum"], ref.metrics["loss:sum"], rtol=1e-6)
    for x, y in zip(
        got.loss_fn_outputs + got_fwd.loss_fn_outputs, ref.loss_fn_outputs + ref_fwd.loss_fn_outputs
    ):
        assert x.keys() == y.keys()
        for k in x:
            np.testing.assert_allclose(x[k], y[k], rtol=1e-5, atol=1e-6, err_msg=k)
    assert ref_fwd.metrics["clipped_tokens:sum"] == got_fwd.metrics["clipped_tokens:sum"]
    np.testing.assert_allclose(got_fwd.metrics["loss:sum"], ref_fwd.metrics["loss:sum"], rtol=1e-6)
    # The second pass ran on weights that one AdamW step moved from gradients which already
    # differed by the sums' order: up to 1.5e-6 of the largest entry measured.
    for g, want in ((ga, ra), (gb, rb)):
        assert any(np.abs(v).max() > 0 for v in want.values())
        for k in want:
            scale = max(float(np.abs(want[k]).max()), 1e-30)
            np.testing.assert_allclose(g[k], want[k], rtol=1e-5, atol=4e-6 * scale, err_msg=k)
