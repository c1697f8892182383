"""Server-side custom losses through the real Tinker SDK (0.38): create_custom_loss uploads
the traced graph, forward_backward_custom runs it in one server-side pass — and it gives
what the SDK's own client-side two-pass path gives on the same data and weights.

For each loss of the zoo (tests/helpers/custom_zoo.py: sequence-mean importance sampling, a
clipped ratio with a KL penalty, a DPO-style pair loss inside one datum, top-k distillation
on 2-D targets, metrics), two models of the same seed train on one server: one with the
uploaded handle (loss_id set: server-side), one with the same handle with loss_id None
(the SDK runs it client-side: a forward, torch autograd, a cross_entropy pass with
weights = −dC/dlogprobs). Loss, per-datum log-probs, metrics and gradients by PEFT key
must agree; the datums also carry an input the loss does not read, which both paths ignore.
The module's server runs on the mesh in MESHES; refusals leave nothing changed.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time

import numpy as np
import pytest

os.environ.setdefault("TINKER_TELEMETRY", "0")
tinker = pytest.importorskip("tinker")
httpx = pytest.importorskip("httpx")
torch = pytest.importorskip("torch")
from helpers.custom_zoo import ZOO, encoded, zoo_inputs  # noqa: E402
from tinker import types  # noqa: E402

import jcp  # noqa: E402
from jcp.server import model_ops  # noqa: E402
from jcp.server.service import Server  # noqa: E402

MODEL = "jcp-tiny"
KEYS = {"tml-alice": "alice", "tml-bob": "bob"}
RANK = 4
RTOL, ATOL = 2e-5, 1e-6
VOCAB = jcp.QwenConfig.tiny().vocab_size
# (2,2,2) splits each datum over cp as (1,4,1) did, beside dp and tp; (1,4,1), ~15 CPU s,
# added no axis of its own.
MESHES = [(1, 1, 1), (2, 2, 2)]


@pytest.fixture(scope="module", params=MESHES, ids=lambda m: "x".join(map(str, m)))
def env(request):
    tr = jcp.Trainer(
        jcp.QwenConfig.tiny(),
        jcp.make_mesh(*request.param),
        max_adapters=8,
        max_rank=8,
        attn_block=16,
        logprob_chunk=16,
    )
    state = {"tr": tr, "dir": tempfile.mkdtemp(prefix="jcp-custom-test-"), "clients": []}
    state["srv"] = Server(tr, MODEL, state["dir"], KEYS).start()
    sc = tinker.ServiceClient(base_url=state["srv"].url, api_key="tml-alice")
    state["clients"].append(sc)
    state["sc"] = sc
    yield state
    for c in state["clients"]:
        if c._session_holder is not None:
            c._session_holder.close()
    state["srv"].stop()


def tensor(x) -> types.TensorData:
    x = np.asarray(x)
    dtype = "int64" if x.dtype.kind in "iu" else "float32"
    return types.TensorData(data=x.reshape(-1).tolist(), dtype=dtype, shape=list(x.shape))


def zoo_data(name: str, lengths=(13, 24, 7), k=4) -> list[types.Datum]:
    """Datums carrying every input of a zoo loss (2-D targets for the top-k one, with −1
    pads in the last datum), and one it does not read (old_logprobs, as RL data carries)."""
    out = []
    for j, n in enumerate(lengths):
        rng = np.random.default_rng(100 + j)
        toks = rng.integers(0, VOCAB, n)
        _, values = zoo_inputs(name, n=n, k=k, seed=j)
        if name == "topk_distill":
            targets = np.stack([rng.permutation(VOCAB)[:k] for _ in range(n)])
            if j == len(lengths) - 1:
                targets[::3, -1] = -1
        else:
            targets = rng.integers(0, VOCAB, n)
            values["sampling_logprobs"] = values["sampling_logprobs"] - 2.0  # near the model
            values["ref_logprobs"] = values["ref_logprobs"] - 2.0
        fn, ranks = ZOO[name]
        inputs = {"target_tokens": tensor(targets)}
        inputs.update({k_: tensor(values[k_]) for k_ in ranks if k_ != "logprobs"})
        inputs["old_logprobs"] = tensor(np.zeros((n, 2), np.float32))
        out.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(toks.tolist()), loss_fn_inputs=inputs
            )
        )
    return out


def grads(env, tc) -> dict:
    return env["tr"].gradients(env["srv"].store.models[tc.model_id].slot)


@pytest.mark.parametrize("name", sorted(ZOO))
def test_server_side_equals_the_sdks_client_side_path(env, name):
    # Each loss on one mesh: clipped_kl at (1,1,1) (test_custom_loss has it on others), the
    # rest at (2,2,2), every axis (at (1,1,1) too they took ~7 CPU s more).
    if name == "odd_ops" or ((env["tr"].dp * env["tr"].cp > 1) == (name == "clipped_kl")):
        pytest.skip("covered on the other meshes / by test_custom_loss (keeps CI short)")
    sc = env["sc"]
    fn, ranks = ZOO[name]
    handle = sc.create_custom_loss(fn, ranks).result()
    assert handle.loss_id is not None  # the server said custom_loss_server_side
    local = dataclasses.replace(handle, loss_id=None)  # the SDK's client-side path
    server_tc = sc.create_lora_training_client(base_model=MODEL, rank=RANK, seed=5).result()
    client_tc = sc.create_lora_training_client(base_model=MODEL, rank=RANK, seed=5).result()
    data = zoo_data(name)

    a = server_tc.forward_backward_custom(data, handle).result()
    b = client_tc.forward_backward_custom(data, local).result()
    assert "surrogate_loss:sum" in b.metrics and "surrogate_loss:sum" not in a.metrics
    np.testing.assert_allclose(a.metrics["loss:sum"], b.metrics["loss:sum"], rtol=RTOL)
    keys = {k for k in b.metrics if k.startswith("custom/")}
    assert keys and keys == {k for k in a.metrics if k.startswith("custom/")} or not keys
    for k in keys:
        np.testing.assert_allclose(a.metrics[k], b.metrics[k], rtol=RTOL, atol=ATOL, err_msg=k)
    for x, y in zip(a.loss_fn_outputs, b.loss_fn_outputs, strict=True):
        lx, ly = x["logprobs"].to_numpy(), y["logprobs"].to_numpy()
        assert lx.shape == ly.shape == tuple(y["logprobs"].shape)
        np.testing.assert_allclose(lx, ly, rtol=RTOL, atol=ATOL)
    ga, gb = grads(env, server_tc), grads(env, client_tc)
    assert server_tc.model_id != client_tc.model_id and ga.keys() == gb.keys()
    assert max(np.abs(g).max() for g in gb.values()) > 0
    scale = max(np.abs(g).max() for g in gb.values())
    for k in ga:
        np.testing.assert_allclose(ga[k], gb[k], rtol=1e-4, atol=1e-5 * scale, err_msg=k)
    if name == "topk_distill":
        assert a.loss_fn_outputs[0]["logprobs"].to_numpy().ndim == 2
    for tc in (server_tc, client_tc):  # free the slots for the next loss
        assert _post(env, "/api/v1/unload_model", {"model_id": tc.model_id})["model_id"] == (
            tc.model_id
        )


# ----------------------------------------------------------------------------------------
# Refusals: each a user error, nothing changed


def _post(env, route, body, key="tml-alice"):
    h = {"X-API-Key": key}
    f = httpx.post(env["srv"].url + route, json=body, headers=h).json()
    r = httpx.post(
        env["srv"].url + "/api/v1/retrieve_future",
        json={"request_id": f["request_id"]},
        headers=h,
        timeout=120,
    )
    return r.json()


def test_refusals_change_nothing(env):
    if env["tr"].dp * env["tr"].cp * env["tr"].tp != 1:
        pytest.skip("refusals happen before any device work: one mesh shows them")
    sc, worker = env["sc"], env["srv"].worker
    held = worker.custom_loss_ids()

    def lgamma_loss(logprobs):
        return torch.lgamma(-logprobs).sum(), {}

    with pytest.raises(tinker.RequestFailedError, match="'torch.lgamma' is not an allowed"):
        sc.create_custom_loss(lgamma_loss, {"logprobs": 1}).result()

    def device_loss(logprobs):
        return torch.zeros_like(logprobs, device=logprobs.device).sum() + logprobs.sum(), {}

    with pytest.raises(tinker.RequestFailedError, match="reads attribute 'device'"):
        sc.create_custom_loss(device_loss, {"logprobs": 1}).result()

    session = sc.holder.get_session_id()
    graph, inputs = encoded(lambda logprobs: (logprobs.sum(), {}), {"logprobs": 1})
    chain = [
        {
            "op": "call_function",
            "name": f"n{j}",
            "target": "operator.neg",
            "args": [{"ref": "logprobs" if j == 0 else f"n{j - 1}"}],
            "kwargs": {},
        }
        for j in range(600)
    ]
    deep = {"nodes": graph["nodes"][:1] + chain + graph["nodes"][1:]}
    r = _post(
        env,
        "/api/v1/create_custom_loss",
        {
            "session_id": session,
            "custom_loss_seq_id": 99,
            "name": "deep",
            "inputs": inputs,
            "graph": deep,
        },
    )
    assert r["category"] == "user" and "deeper than" in r["error"]
    assert worker.custom_loss_ids() == held

    # A handle of this session, used by a model of another session (same tenant, and
    # another tenant): refused, that model's gradient untouched.
    def masked_sum(logprobs, sampling_logprobs, advantages, mask):
        return -(logprobs * mask).sum() * advantages, {}

    handle = sc.create_custom_loss(masked_sum, ZOO["seq_mean_is"][1]).result()
    data = zoo_data("seq_mean_is", lengths=(9,))
    for key in ("tml-alice", "tml-bob"):
        other = tinker.ServiceClient(base_url=env["srv"].url, api_key=key)
        env["clients"].append(other)
        tc = other.create_lora_training_client(base_model=MODEL, rank=RANK, seed=1).result()
        before = grads(env, tc)
        with pytest.raises(tinker.RequestFailedError, match="not found in this model's session"):
            tc.forward_backward(data, "custom", {"loss_id": handle.loss_id}).result()
        after = grads(env, tc)
        assert all(np.array_equal(before[k], after[k]) for k in before)

    # A rank mismatch the SDK's own check would catch, sent past it: the server refuses
    # naming the datum and field, and nothing accumulates.
    tc = sc.create_lora_training_client(base_model=MODEL, rank=RANK, seed=1).result()
    bad = zoo_data("seq_mean_is", lengths=(9,))
    bad[0].loss_fn_inputs["mask"] = tensor(np.ones((9, 2), np.float32))
    with pytest.raises(
        tinker.RequestFailedError, match="datum 0: loss_fn_inputs.mask has rank 2, but custom loss"
    ):
        tc.forward_backward(bad, "custom", {"loss_id": handle.loss_id}).result()
    assert all(not np.any(g) for g in grads(env, tc).values())


def test_custom_losses_are_capped_per_tenant(env, monkeypatch):
    """A tenant at its cap (MAX_CUSTOM_LOSSES_PER_TENANT) is refused, naming the cap; no
    other tenant's handle is evicted (a global table used to evict the oldest, anyone's)."""
    if env["tr"].dp * env["tr"].cp * env["tr"].tp != 1:
        pytest.skip("the table is host-side: one mesh shows it")
    worker = env["srv"].worker
    bob = tinker.ServiceClient(base_url=env["srv"].url, api_key="tml-bob")
    env["clients"].append(bob)

    def scaled(c):  # a session uploads one handle per distinct traced loss
        def total(logprobs):
            return logprobs.sum() * c, {}

        return total

    bobs = bob.create_custom_loss(scaled(1.0), {"logprobs": 1}).result().loss_id
    cap = len(worker.custom_loss_ids("alice")) + 2
    monkeypatch.setattr(model_ops, "MAX_CUSTOM_LOSSES_PER_TENANT", cap)
    for c in (1.5, 2.5):
        env["sc"].create_custom_loss(scaled(c), {"logprobs": 1}).result()
    held = worker.custom_loss_ids()
    with pytest.raises(
        tinker.RequestFailedError, match=f"hold {cap} custom losses \\(at most {cap}\\)"
    ):
        env["sc"].create_custom_loss(scaled(3.5), {"logprobs": 1}).result()
    assert worker.custom_loss_ids() == held and bobs in held
    assert len(worker.custom_loss_ids("alice")) == cap
    bob.create_custom_loss(scaled(2.0), {"logprobs": 1}).result()  # bob's own cap is his
    assert len(worker.custom_loss_ids("bob")) == 2


def test_a_finished_sessions_custom_losses_are_released(env):
    """close() forgets the session's custom losses (they are bounded per session, but a
    finished session must not keep holding them)."""
    sc = tinker.ServiceClient(base_url=env["srv"].url, api_key="tml-alice")

    def total(logprobs):
        return logprobs.sum(), {}

    handle = sc.create_custom_loss(total, {"logprobs": 1}).result()
    worker = env["srv"].worker
    assert handle.loss_id in worker.custom_loss_ids()
    sc.close("success").result()
    deadline = time.monotonic() + 30
    while handle.loss_id in worker.custom_loss_ids() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert handle.loss_id not in worker.custom_loss_ids()
