"""jcp-serve's worker is fair across tenants (docs/serving.md, "Fairness across tenants").

A server whose Trainer takes 64 tokens per micro-batch: alice's forward_backward of four
60-token datums is several micro-batches, run one per worker turn (each full-length one in
several: the forward pass of each of its parts, then the backward pass of each); bob's
small forward, queued behind it, runs after the first of them, not after all — and alice's
results and accumulated gradient equal one Trainer call's, bit for bit (FCFS ran her pass
whole). The scheduler's passes are read off its public next_work (recorded, not timed).
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

os.environ.setdefault("TINKER_TELEMETRY", "0")
tinker = pytest.importorskip("tinker")
from helpers.server_harness import client, serving  # noqa: E402
from tinker import types  # noqa: E402

import jcp  # noqa: E402
from jcp import train_step  # noqa: E402

MODEL = "jcp-tiny"
KEYS = {"tml-alice": "alice", "tml-bob": "bob"}
VOCAB = jcp.QwenConfig.tiny().vocab_size


@pytest.fixture(scope="module")
def env():
    tr = jcp.Trainer(
        jcp.QwenConfig.tiny(),
        jcp.make_mesh(1, 1, 1),
        max_adapters=4,
        max_rank=8,
        max_tokens_per_device=64,
        attn_block=16,
        logprob_chunk=16,
    )
    with serving(tr, MODEL, KEYS, "jcp-serve-fair-") as state:
        yield state


def data(seed: int, n: int, length: int) -> list:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        toks = rng.integers(0, VOCAB, length + 1).tolist()
        out.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(toks[:-1]),
                loss_fn_inputs={"target_tokens": toks[1:], "weights": [1.0] * length},
            )
        )
    return out


def wait_until(cond, what, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_a_small_request_runs_between_a_big_requests_micro_batches(env, monkeypatch):
    srv, tr = env["srv"], env["tr"]
    sched = srv.scheduler
    alice = (
        client(env, "tml-alice")
        .create_lora_training_client(base_model=MODEL, rank=4, seed=1)
        .result()
    )
    bob = client(env, "tml-bob").create_lora_training_client(base_model=MODEL, rank=4, seed=2)
    bob = bob.result()
    big, small = data(0, 4, 60), data(1, 1, 8)
    # Compiled before it is watched; bob is now the tenant served last.
    bob.forward(small, "cross_entropy").result()
    turns = []  # (tenant, request kinds) of each pass the worker is handed
    real, calls = sched.next_work, []

    def recorded(*args, **kw):
        calls.append(1)
        got = real(*args, **kw)
        if got and got[0]:
            turns.append((got[0][0].owner, tuple(w.kind for w in got[0])))
        return got

    monkeypatch.setattr(sched, "next_work", recorded)
    # As if other work waited at each of her micro-batches (a sample running, a request
    # queued): each full-length forward_backward micro-batch then runs in two turns.
    monkeypatch.setattr(srv.worker, "contended", lambda: True)
    sched.hold()
    try:
        # The worker waits in next_work at most 1 s at a time: then it calls ours.
        wait_until(lambda: calls, "the worker in the recorded next_work")
        fa = alice.forward_backward(big, "cross_entropy")
        wait_until(lambda: sched.pending() == 1, "alice's request queued")
        fb = bob.forward(small, "cross_entropy")
        wait_until(lambda: sched.pending() == 2, "bob's request queued")
    finally:
        sched.release()
    out_a, out_b = fa.result(timeout=120), fb.result(timeout=120)
    assert np.isfinite(out_b.metrics["loss:sum"])
    # alice's pass is handed out for its preparation, then once per micro-batch, 2n times
    # for each full-length one (the forward pass of each of its n parts — its layer spans,
    # then the head and the loss —, then the backward pass of each: Steps.turns, while
    # other work waits); bob's comes after her first turn.
    assert turns[:2] == [("alice", ("forward_backward",)), ("bob", ("forward",))], turns
    slot = srv.store.models[alice.model_id].slot
    datums = [
        jcp.Datum(d.model_input.to_ints(), {k: v.to_numpy() for k, v in d.loss_fn_inputs.items()})
        for d in big
    ]
    shapes = tr.pass_shapes(datums, adapters=slot)
    full = sum(s_len == tr.max_tokens_per_device for _, s_len, _, _ in shapes)
    assert len(shapes) >= 3 and full >= 2
    n = train_step.turn_parts(tr.cfg, tr.programs.turn_spans)
    assert n == 3  # jcp-serve's default --turn-spans on a model of two layers, and the head
    count = 1 + len(shapes) + (2 * n - 1) * full
    assert turns.count(("alice", ("forward_backward",))) == count, turns
    # One Trainer call on a copy of the slot gives the same outputs and gradient, bit for
    # bit (the server is idle: nothing else runs on the Trainer meanwhile).
    copy = tr.copy_adapter(slot)
    try:
        whole = tr.forward_backward(datums, "cross_entropy", adapters=copy)
        served, alone = tr.gradients(slot), tr.gradients(copy)
    finally:
        tr.delete_adapter(copy)
    for a, b in zip(out_a.loss_fn_outputs, whole.loss_fn_outputs):
        np.testing.assert_array_equal(a["logprobs"].to_numpy(), b["logprobs"])
    assert out_a.metrics["loss:sum"] == whole.metrics["loss:sum"]
    assert any(np.any(g != 0) for g in alone.values())
    for k in alone:
        np.testing.assert_array_equal(served[k], alone[k])
    # Nothing else waiting: her micro-batches run whole, one turn each.
    monkeypatch.setattr(srv.worker, "contended", lambda: False)
    turns.clear()
    alice.forward_backward(big, "cross_entropy").result(timeout=120)
    assert turns.count(("alice", ("forward_backward",))) == 1 + len(shapes), turns
    # A forward in turns too while other work waits (its first half of the layers, then
    # the rest and the loss), the same log-probs as one Trainer forward.
    monkeypatch.setattr(srv.worker, "contended", lambda: True)
    turns.clear()
    out_f = alice.forward(big, "cross_entropy").result(timeout=120)
    assert turns.count(("alice", ("forward",))) == 1 + len(shapes) + full, turns
    whole = tr.forward(datums, "cross_entropy", adapters=slot)
    for a, b in zip(out_f.loss_fn_outputs, whole.loss_fn_outputs):
        np.testing.assert_array_equal(a["logprobs"].to_numpy(), b["logprobs"])
