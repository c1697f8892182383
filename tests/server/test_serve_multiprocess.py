"""jcp-serve as a 2-process jax.distributed job (4 CPU devices each, gloo) answers the same SDK
session as one process × 8 devices, and a lost follower fails the job cleanly.

One test, since each job costs a start and its compiles on every process: the SDK session of
helpers/mp_serve.py (two tenants: fused forward_backward, optim_step, save / load with and
without a new model, forward, a server-side custom loss shared with the follower and a step
on it, a named PEFT sampler save and an in-memory snapshot, seeded sampling with prompt
log-probs) runs against both jobs at once, both with two adapter slots for three training
models, so models are offloaded to host memory and restored on every process; then the follower of the
2-process job stops answering in the middle of a save, is killed, and the job must report it
(client error, /healthz 503, new work refused) with the checkpoint being overwritten still
whole; a server restarted on its state folder loads it. That server is one process (its
programs the single job's, from that job's compilation cache): the 2-process job's loads
are the session's, and a restarted 2-process job cost ~7 CPU s more.
"""

from __future__ import annotations

import concurrent.futures
import glob
import os
import time

import numpy as np
import pytest

os.environ.setdefault("TINKER_TELEMETRY", "0")
tinker = pytest.importorskip("tinker")
httpx = pytest.importorskip("httpx")

from helpers import mp_serve  # noqa: E402

# --follower-timeout of the 2-process job: the lost follower is seen this long after its
# last heartbeat (the test waits it out); a slow follower's acknowledgement may come
# replica.ACK_FACTOR times later, so a compile behind under load is no failure.
TIMEOUT = 8
SLOTS = ("--max-adapters", "2")  # fewer than the session's models: offload -> restore


def assert_same(a, b, key):
    if isinstance(a, str) or (isinstance(a, list) and a and isinstance(a[0], list)):
        assert a == b, key
    elif isinstance(a, list):
        assert len(a) == len(b), key
        for x, y in zip(a, b):
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6, err_msg=key)
    else:
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=key)


def test_two_processes_serve_as_one_and_fail_cleanly(tmp_path):
    cache = str(tmp_path / "xla-cache")
    single = mp_serve.Job(1, str(tmp_path / "single"), *SLOTS, cache=cache)
    multi = mp_serve.Job(2, str(tmp_path / "multi"), *SLOTS, follower_timeout=TIMEOUT)
    t0 = time.monotonic()
    clients, again = [], None
    try:
        single.wait_ready()
        multi.wait_ready()
        # Process 0 serves with the loop favoured (jcp/server/priority.py).
        assert "the GIL's switch interval 0.5 ms" in single.log(0), single.log(0)
        print(f"ready {time.monotonic() - t0:.0f} s")
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            ref_f = pool.submit(mp_serve.session, single.url, clients)
            got_f = pool.submit(mp_serve.session, multi.url, clients)
            ref, got = ref_f.result(), got_f.result()
        print(f"sessions {time.monotonic() - t0:.0f} s")

        # The session did something: training moved the model, loads restored it, the
        # tenants' sampled tokens differ.
        assert not np.allclose(ref["a_fwd"][0], ref["a_fwd2"][0], atol=1e-4)
        np.testing.assert_allclose(ref["a_reloaded"][0], ref["a_fwd"][0], rtol=1e-6)
        assert ref["a_tokens"] != ref["b_tokens"]
        # The custom loss is each datum's weighted mean log-prob (negated; the metric is
        # their mean over the 2 datums), not the token sum; its step moved the model.
        assert not np.isclose(ref["a_custom_loss"], ref["a_fb_loss"])
        assert ref["a_custom_loss"] == pytest.approx(-2 * ref["a_custom_metric"], rel=1e-5)
        assert not np.allclose(ref["a_custom_fwd"][0], ref["a_reloaded"][0], atol=1e-4)
        for key in ref:
            if key == "trained" or key.endswith("_ckpt"):
                continue
            assert_same(got[key], ref[key], key)
        files = {
            name: mp_serve.checkpoint_files(job.state_dir)
            for name, job in (("single", single), ("multi", multi))
        }
        assert files["single"].keys() == files["multi"].keys() and files["single"]
        for f, arrays in files["single"].items():
            assert arrays.keys() == files["multi"][f].keys()
            assert any(np.abs(v).max() > 0 for v in arrays.values())
            for k, v in arrays.items():
                np.testing.assert_allclose(
                    files["multi"][f][k], v, rtol=1e-5, atol=1e-6, err_msg=f"{f}:{k}"
                )
        single.stop()

        # ---------------------------------------------- the follower is lost mid-save
        ta = got["trained"]
        data = [mp_serve.datum(1), mp_serve.datum(2, 17)]
        last = ta.save_state("a2").result().path
        kept = mp_serve.logprobs(ta.forward(data, "cross_entropy").result())
        ta.forward_backward(data, "cross_entropy")
        ta.optim_step(tinker.types.AdamParams(learning_rate=1e-2)).result()
        follower = multi.procs[1]
        follower.send_signal(19)  # SIGSTOP: it stops answering ...
        lost = time.monotonic()
        pending = ta.save_state("a2")  # ... while process 0 overwrites the checkpoint
        time.sleep(2)
        follower.kill()  # ... and then dies
        with pytest.raises(tinker.RequestFailedError, match="process 1 stopped answering"):
            pending.result(timeout=120)
        assert time.monotonic() - lost < TIMEOUT + 20
        health = httpx.get(multi.url + "/api/v1/healthz", timeout=10)
        assert health.status_code == 503 and "process 1" in health.json()["detail"]
        refused = httpx.post(
            multi.url + "/api/v1/optim_step",
            timeout=10,
            headers={"x-api-key": "tml-alice"},
            json={"model_id": ta.model_id, "seq_id": 1000, "adam_params": {"learning_rate": 0.01}},
        )
        assert refused.status_code == 503 and "restarted" in refused.json()["detail"]
        mp_serve.close(clients)
        clients.clear()
        assert multi.stop()[0] is not None  # process 0 exits (it does not hang)
        leftovers = [
            f
            for f in glob.glob(os.path.join(multi.state_dir, "**"), recursive=True)
            if "tmp" in os.path.basename(f)
        ]
        assert not leftovers, leftovers

        # ---------------------------------------------- a server restarted on its state
        print(f"failed {time.monotonic() - t0:.0f} s")
        again = mp_serve.Job(1, multi.state_dir, *SLOTS, cache=cache).wait_ready()
        print(f"restarted {time.monotonic() - t0:.0f} s")
        sc = tinker.ServiceClient(base_url=again.url, api_key="tml-alice")
        clients.append(sc)
        loaded = sc.create_training_client_from_state(last).result()
        now = mp_serve.logprobs(loaded.forward(data, "cross_entropy").result())
        for x, y in zip(now, kept):
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)
        print(f"loaded {time.monotonic() - t0:.0f} s")
    finally:
        mp_serve.close(clients)
        for job in (single, multi, again):
            if job is not None:
                job.stop()


def test_multiprocess_flags_parse():
    from jcp.cli import CliError
    from jcp.serve import parse_args

    args = parse_args(
        [
            "--coordinator-address",
            "h:1",
            "--num-processes",
            "2",
            "--process-id",
            "1",
            "--follower-timeout",
            "5",
        ]
    )
    assert (
        args.coordinator_address,
        args.num_processes,
        args.process_id,
        args.follower_timeout,
    ) == ("h:1", 2, 1, 5.0)
    assert parse_args([]).follower_timeout == 60.0 and parse_args([]).num_processes is None
    for bad in ("0", "-1", "nan"):
        with pytest.raises(CliError, match="--follower-timeout"):
            parse_args(["--follower-timeout", bad])
