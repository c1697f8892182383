"""jcp-serve driven by the real Tinker SDK (0.38) against a server on 127.0.0.1.

One Trainer on the (1, 2, 2) mesh of fake CPU devices backs the module's server; the
in-process references run on that same Trainer (same base, same compiled steps) while the
server is idle. Every comparison first checks that the two sides are different objects
(different slots / models), and every test can fail.
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

os.environ.setdefault("TINKER_TELEMETRY", "0")
tinker = pytest.importorskip("tinker")
httpx = pytest.importorskip("httpx")
from helpers.server_harness import client, serving  # noqa: E402
from tinker import types  # noqa: E402

import jcp  # noqa: E402
from jcp.server.service import Server  # noqa: E402

MODEL = "jcp-tiny"
KEYS = {"tml-alice": "alice", "tml-bob": "bob"}
RANK, SEED = 4, 3
RTOL, ATOL = 1e-5, 1e-6


@pytest.fixture(scope="module")
def env():
    tr = jcp.Trainer(
        jcp.QwenConfig.tiny(),
        jcp.make_mesh(1, 2, 2),
        max_adapters=8,
        max_rank=8,
        attn_block=16,
        logprob_chunk=16,
    )
    with serving(tr, MODEL, KEYS, "jcp-serve-test-") as state:
        yield state


def datum(seed: int, n: int = 24):
    rng = np.random.default_rng(seed)
    toks = rng.integers(0, jcp.QwenConfig.tiny().vocab_size, n + 1).tolist()
    w = rng.uniform(0.2, 1.0, n).astype(np.float32).tolist()
    return (
        types.Datum(
            model_input=types.ModelInput.from_ints(toks[:-1]),
            loss_fn_inputs={"target_tokens": toks[1:], "weights": w},
        ),
        jcp.Datum(model_input=toks[:-1], loss_fn_inputs={"target_tokens": toks[1:], "weights": w}),
    )


def slot(env, tc) -> int:
    return env["srv"].store.models[tc.model_id].slot


def weights(env, tc) -> dict:
    return env["tr"].adapter_weights(slot(env, tc))


def assert_tree_close(a: dict, b: dict, **kw):
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_allclose(a[k], b[k], err_msg=k, **kw)


def unload(env, tc, key="tml-alice"):
    """POST unload_model (the SDK 0.38 has no call for it) and wait for the result."""
    h = {"X-API-Key": key}
    f = httpx.post(
        env["srv"].url + "/api/v1/unload_model", json={"model_id": tc.model_id}, headers=h
    ).json()
    r = httpx.post(
        env["srv"].url + "/api/v1/retrieve_future",
        json={"request_id": f["request_id"]},
        headers=h,
        timeout=60,
    )
    assert r.json() == {"model_id": tc.model_id, "type": "unload_model"}


ADAM = types.AdamParams(learning_rate=1e-2, weight_decay=0.01, grad_clip_norm=50.0)
JADAM = jcp.AdamParams(learning_rate=1e-2, weight_decay=0.01, grad_clip_norm=50.0)


def test_schema_is_the_sdks():
    from google.protobuf import descriptor_pb2
    from tinker.proto import tinker_public_pb2

    from jcp.server import proto_schema

    ours, sdk = descriptor_pb2.FileDescriptorProto(), descriptor_pb2.FileDescriptorProto()
    ours.ParseFromString(proto_schema.SERIALIZED)
    sdk.ParseFromString(tinker_public_pb2.DESCRIPTOR.serialized_pb)
    assert ours == sdk


def test_capabilities_and_info(env):
    caps = client(env).get_server_capabilities()
    assert [(m.model_name, m.max_context_length) for m in caps.supported_models] == [
        (MODEL, env["tr"].token_cap)
    ]
    assert httpx.get(env["srv"].url + "/api/v1/healthz").json() == {"status": "ok"}
    r = httpx.post(
        env["srv"].url + "/api/v1/create_session", json={}, headers={"X-API-Key": "tml-mallory"}
    )
    assert r.status_code == 401


def test_train_matches_trainer_and_forward_keeps_grads(env):
    tr = env["tr"]
    tc = client(env).create_lora_training_client(base_model=MODEL, rank=RANK, seed=SEED).result()
    info = tc.get_info()
    assert info.lora_rank == RANK and info.model_data.model_name == MODEL
    local = tr.create_adapter(rank=RANK, alpha=32.0, seed=SEED)
    assert local != slot(env, tc)
    assert_tree_close(weights(env, tc), tr.adapter_weights(local), rtol=0, atol=0)
    pairs = [datum(1), datum(2, 17)]
    sdk_data, jcp_data = [p[0] for p in pairs], [p[1] for p in pairs]

    out = tc.forward_backward(sdk_data, "cross_entropy").result()
    ref = tr.forward_backward(jcp_data, "cross_entropy", adapters=local)
    np.testing.assert_allclose(out.metrics["loss:sum"], ref.metrics["loss:sum"], rtol=RTOL)
    for o, r in zip(out.loss_fn_outputs, ref.loss_fn_outputs):
        np.testing.assert_allclose(o["logprobs"].to_numpy(), r["logprobs"], rtol=RTOL, atol=ATOL)
    grads = tr.gradients(slot(env, tc))
    assert any(np.abs(g).max() > 0 for g in grads.values())
    assert_tree_close(grads, tr.gradients(local), rtol=RTOL, atol=ATOL)

    fwd = tc.forward(sdk_data, "cross_entropy").result()
    np.testing.assert_allclose(fwd.metrics["loss:sum"], out.metrics["loss:sum"], rtol=RTOL)
    assert_tree_close(tr.gradients(slot(env, tc)), grads, rtol=0, atol=0)

    tc.optim_step(ADAM).result()
    tr.optim_step(local, JADAM)
    assert_tree_close(weights(env, tc), tr.adapter_weights(local), rtol=RTOL, atol=ATOL)
    tr.delete_adapter(local)

    losses = [out.metrics["loss:sum"]]
    for _ in range(3):
        fb = tc.forward_backward(sdk_data, "cross_entropy")
        tc.optim_step(ADAM).result()
        losses.append(fb.result().metrics["loss:sum"])
    assert losses[-1] < losses[0] - 1.0, losses
    env["trained"] = tc


def test_gspo_matches_trainer(env):
    """gspo through the SDK (sequence_ratio_mask on the wire, clip keys overridden) gives
    the in-process Trainer's losses, clipped count and gradient; the datums are cut over
    cp = 2, so the sequence mean spans both ranks."""
    tr = env["tr"]
    tc = (
        client(env).create_lora_training_client(base_model=MODEL, rank=RANK, seed=SEED + 1).result()
    )
    local = tr.create_adapter(rank=RANK, alpha=32.0, seed=SEED + 1)
    assert local != slot(env, tc)
    sdk_data, jcp_data = [], []
    lp_now = tr.forward(
        [datum(s, n)[1] for s, n in ((7, 24), (8, 19))], "cross_entropy", adapters=local
    ).loss_fn_outputs
    for (s, n), out in zip(((7, 24), (8, 19)), lp_now):
        rng = np.random.default_rng(s)
        d = datum(s, n)[1]
        inputs = {
            "target_tokens": d.loss_fn_inputs["target_tokens"],
            "advantages": rng.normal(size=n).astype(np.float32).tolist(),
            "logprobs": (out["logprobs"] + 0.2 * rng.normal(size=n)).astype(np.float32).tolist(),
            "sequence_ratio_mask": (rng.random(n) < 0.7).astype(np.float32).tolist(),
        }
        sdk_data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(d.model_input), loss_fn_inputs=inputs
            )
        )
        jcp_data.append(jcp.Datum(model_input=d.model_input, loss_fn_inputs=inputs))
    cfg = {"clip_low_threshold": 0.95, "clip_high_threshold": 1.02}
    out = tc.forward_backward(sdk_data, "gspo", cfg).result()
    ref = tr.forward_backward(jcp_data, "gspo", cfg, adapters=local)
    assert ref.metrics["loss:sum"] != 0
    np.testing.assert_allclose(out.metrics["loss:sum"], ref.metrics["loss:sum"], rtol=RTOL)
    assert out.metrics["clipped_tokens:sum"] == ref.metrics["clipped_tokens:sum"]
    for o, r in zip(out.loss_fn_outputs, ref.loss_fn_outputs):
        np.testing.assert_allclose(o["logprobs"].to_numpy(), r["logprobs"], rtol=RTOL, atol=ATOL)
    grads = tr.gradients(slot(env, tc))
    assert any(np.abs(g).max() > 0 for g in grads.values())
    assert_tree_close(grads, tr.gradients(local), rtol=RTOL, atol=ATOL)
    tr.delete_adapter(local)
    unload(env, tc)


def test_save_then_sample(env):
    tr, tc = env["tr"], env["trained"]
    sc = tc.save_weights_and_get_sampling_client().result()
    prompt = [3, 1, 4, 1, 5]
    sp = types.SamplingParams(max_tokens=6, seed=7, temperature=1.0)
    res = sc.sample(
        types.ModelInput.from_ints(prompt), 2, sp, include_prompt_logprobs=True
    ).result()
    ref = tr.sample(
        [prompt],
        jcp.SamplingParams(max_tokens=6, seed=7),
        adapters=slot(env, tc),
        num_samples=2,
        prompt_logprobs=True,
    )[0]
    assert len(res.sequences) == 2 and all(s.sequence_id for s in res.sequences)
    for s, r in zip(res.sequences, ref.sequences):
        assert list(s.tokens) == r.tokens.tolist() and s.stop_reason == r.stop_reason
        np.testing.assert_allclose(s.logprobs, r.logprobs, rtol=RTOL, atol=ATOL)
    base = tr.sample([prompt], jcp.SamplingParams(max_tokens=6, seed=7), num_samples=2)[0]
    assert any(
        s.tokens.tolist() != r.tokens.tolist() for s, r in zip(base.sequences, ref.sequences)
    )
    lp = sc.compute_logprobs(types.ModelInput.from_ints(prompt)).result()
    assert lp[0] is None
    np.testing.assert_allclose(lp[1:], ref.prompt_logprobs[1:], rtol=RTOL, atol=ATOL)
    named = tc.save_weights_for_sampler("s1").result().path
    assert named.startswith("tinker://") and named.endswith("/sampler_weights/s1")
    sc2 = client(env).create_sampling_client(model_path=named).result()
    res2 = sc2.sample(types.ModelInput.from_ints(prompt), 2, sp).result()
    assert [list(s.tokens) for s in res2.sequences] == [list(s.tokens) for s in res.sequences]
    env["sampler_path"] = named


def test_save_load_with_optimizer_continues_exactly(env):
    tc = env["trained"]
    data = [datum(1)[0]]
    path = tc.save_state("ck").result().path
    env["ckpt"] = path
    env["ckpt_weights"] = weights(env, tc)
    for _ in range(2):
        tc.forward_backward(data, "cross_entropy")
        tc.optim_step(ADAM).result()
    sc = client(env)
    with_opt = sc.create_training_client_from_state_with_optimizer(path).result()
    no_opt = sc.create_training_client_from_state(path).result()
    assert len({tc.model_id, with_opt.model_id, no_opt.model_id}) == 3
    for c in (with_opt, no_opt):
        for _ in range(2):
            c.forward_backward(data, "cross_entropy")
            c.optim_step(ADAM).result()
    assert_tree_close(weights(env, with_opt), weights(env, tc), rtol=0, atol=0)
    diff = max(
        float(np.abs(weights(env, no_opt)[k] - weights(env, tc)[k]).max()) for k in weights(env, tc)
    )
    assert diff > 1e-6
    unload(env, with_opt)
    unload(env, no_opt)


def test_two_clients_are_fused_and_match_sequential(env):
    sched = env["srv"].scheduler
    sc = client(env)
    a, b, a2, b2 = (
        sc.create_lora_training_client(base_model=MODEL, rank=RANK, seed=s).result()
        for s in (11, 12, 11, 12)
    )
    da, db = [datum(5)[0]], [datum(6, 20)[0]]
    before = sched.counters.fused_passes
    sched.hold()
    try:
        fa, fb = a.forward_backward(da, "cross_entropy"), b.forward_backward(db, "cross_entropy")
        oa, ob = a.optim_step(ADAM), b.optim_step(ADAM)
        deadline = time.monotonic() + 30
        while sched.pending() < 4 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert sched.pending() == 4
    finally:
        sched.release()
    ra, rb = fa.result(), fb.result()
    oa.result(), ob.result()
    assert sched.counters.fused_passes == before + 1
    # the same work, one client after the other
    ra2 = a2.forward_backward(da, "cross_entropy").result()
    a2.optim_step(ADAM).result()
    rb2 = b2.forward_backward(db, "cross_entropy").result()
    b2.optim_step(ADAM).result()
    assert sched.counters.fused_passes == before + 1
    for r, r2 in ((ra, ra2), (rb, rb2)):
        np.testing.assert_allclose(r.metrics["loss:sum"], r2.metrics["loss:sum"], rtol=RTOL)
        np.testing.assert_allclose(
            r.loss_fn_outputs[0]["logprobs"].to_numpy(),
            r2.loss_fn_outputs[0]["logprobs"].to_numpy(),
            rtol=RTOL,
            atol=ATOL,
        )
    assert_tree_close(weights(env, a), weights(env, a2), rtol=RTOL, atol=ATOL)
    assert_tree_close(weights(env, b), weights(env, b2), rtol=RTOL, atol=ATOL)
    env["fusion_pair"] = (a, b)
    for c in (a2, b2):
        unload(env, c)


def test_bad_datum_fails_only_its_request(env):
    sched = env["srv"].scheduler
    a, b = env["fusion_pair"]
    vocab = jcp.QwenConfig.tiny().vocab_size
    bad = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, vocab + 5]),
        loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1.0] * 3},
    )
    wa, wb = weights(env, a), weights(env, b)
    good = [datum(6, 20)[0]]
    ref = b.forward(good, "cross_entropy").result()
    sched.hold()
    try:
        fa, fb = a.forward([bad], "cross_entropy"), b.forward(good, "cross_entropy")
        deadline = time.monotonic() + 30
        while sched.pending() < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        sched.release()
    with pytest.raises(tinker.RequestFailedError, match=str(vocab + 5)) as ei:
        fa.result()
    assert ei.value.category == types.RequestErrorCategory.User
    np.testing.assert_allclose(fb.result().metrics["loss:sum"], ref.metrics["loss:sum"], rtol=RTOL)
    assert_tree_close(weights(env, a), wa, rtol=0, atol=0)
    assert_tree_close(weights(env, b), wb, rtol=0, atol=0)
    unload(env, a)
    unload(env, b)


def test_unknown_model_and_other_tenant(env):
    url, alice = env["srv"].url, {"X-API-Key": "tml-alice"}
    from jcp.server import wire

    body = wire.ForwardBackwardRequestPb(
        model_id="nope:train:0", seq_id=1, loss_fn="cross_entropy"
    ).SerializeToString()
    f = httpx.post(
        url + "/api/v1/forward_backward",
        content=body,
        headers={**alice, "Content-Type": "application/x-protobuf"},
    ).json()
    r = httpx.post(
        url + "/api/v1/retrieve_future", json={"request_id": f["request_id"]}, headers=alice
    ).json()
    assert r["category"] == "user" and "not found" in r["error"]

    bob = client(env, "tml-bob")
    tc = env["trained"]
    h = {"X-API-Key": "tml-bob"}
    assert (
        httpx.post(url + "/api/v1/get_info", json={"model_id": tc.model_id}, headers=h).status_code
        == 404
    )
    assert (
        httpx.post(
            url + "/api/v1/get_info", json={"model_id": tc.model_id}, headers=alice
        ).status_code
        == 200
    )
    with pytest.raises(Exception, match="not found"):
        bob.create_training_client_from_state(env["ckpt"]).result()
    with pytest.raises(Exception, match="not found"):
        bob.create_sampling_client(model_path=env["sampler_path"]).result()
    # the server keeps serving alice
    assert tc.forward([datum(1)[0]], "cross_entropy").result().metrics["loss:sum"] > 0


def test_restart_keeps_checkpoints(env):
    tr = env["tr"]
    env["srv"].stop()
    for a in list(tr.adapters):  # a fresh process would hold no adapters
        tr.delete_adapter(a)
    env["srv"] = Server(tr, MODEL, env["dir"], KEYS).start()
    loaded = client(env).create_training_client_from_state(env["ckpt"]).result()
    assert env["srv"].store.models.keys() == {loaded.model_id}
    assert_tree_close(weights(env, loaded), env["ckpt_weights"], rtol=0, atol=0)
    out = loaded.forward([datum(1)[0]], "cross_entropy").result()
    assert np.isfinite(out.metrics["loss:sum"])
