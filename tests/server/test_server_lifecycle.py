"""jcp-serve's model lifecycle and Tinker-surface details, driven by the real SDK (0.38).

A server with only two adapter slots: more models than slots train and sample in turn
(idle ones move to host memory and come back bit for bit), sessions that finish or stop
heartbeating release their models (checkpoints stay loadable), a reused model_seq_id or a
failed create leaves no trace. Also: provenance spans accepted for every loss, optim_step
metrics that do not collide with client loops' own keys.
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
from safetensors.numpy import load_file  # noqa: E402
from tinker import types  # noqa: E402
from tinker.types.provenance_spans import PromptProvenanceSpan, SampledProvenanceSpan  # noqa: E402

import jcp  # noqa: E402
from jcp.server.service import Server  # noqa: E402

MODEL = "jcp-tiny"
KEYS = {"tml-alice": "alice", "tml-bob": "bob"}
RANK = 4
ADAM = types.AdamParams(learning_rate=1e-2, weight_decay=0.01)
JADAM = jcp.AdamParams(learning_rate=1e-2, weight_decay=0.01)
VOCAB = jcp.QwenConfig.tiny().vocab_size


@pytest.fixture(scope="module")
def env():
    tr = jcp.Trainer(
        jcp.QwenConfig.tiny(),
        jcp.make_mesh(1, 1, 1),
        max_adapters=2,
        max_rank=RANK,
        attn_block=16,
        logprob_chunk=16,
    )
    with serving(tr, MODEL, KEYS, "jcp-serve-life-") as state:
        yield state


def data(seed: int, n: int = 20):
    rng = np.random.default_rng(seed)
    toks = rng.integers(0, VOCAB, n + 1).tolist()
    w = rng.uniform(0.2, 1.0, n).astype(np.float32).tolist()
    inputs = {"target_tokens": toks[1:], "weights": w}
    return (
        types.Datum(model_input=types.ModelInput.from_ints(toks[:-1]), loss_fn_inputs=inputs),
        jcp.Datum(model_input=toks[:-1], loss_fn_inputs=inputs),
    )


def post(env, route, body, key="tml-alice"):
    return httpx.post(
        f"{env['srv'].url}/api/v1/{route}", json=body, headers={"X-API-Key": key}, timeout=60
    )


def result(env, fut, key="tml-alice"):
    return post(env, "retrieve_future", {"request_id": fut["request_id"]}, key).json()


def wait_until(cond, what, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def test_more_models_than_slots_train_as_alone(env):
    """Three models on two slots, each taking turns (a forward_backward whose gradient is
    still accumulated when the model is pushed out, then its optim_step, then sampling):
    every model ends with exactly the weights it gets when trained alone."""
    tr, srv = env["tr"], env["srv"]
    seeds = (11, 12, 13)
    ref = {}
    for s in seeds:  # alone, in-process, while the server is idle
        a = tr.create_adapter(rank=RANK, alpha=32.0, seed=s)
        for step in range(2):
            tr.forward_backward([data(s * 10 + step)[1]], "cross_entropy", adapters=a)
            tr.optim_step(a, JADAM)
        ref[s] = tr.adapter_weights(a)
        tr.delete_adapter(a)
    assert not np.array_equal(ref[11][next(iter(ref[11]))], ref[12][next(iter(ref[12]))])

    scs = [client(env) for _ in seeds]
    tcs = [
        sc.create_lora_training_client(base_model=MODEL, rank=RANK, seed=s).result()
        for sc, s in zip(scs, seeds)
    ]
    offloads = srv.worker.offloads
    for step in range(2):
        for tc, s in zip(tcs, seeds):
            tc.forward_backward([data(s * 10 + step)[0]], "cross_entropy").result()
        for tc in tcs:
            tc.optim_step(ADAM).result()
        for tc in tcs:
            sc = tc.save_weights_and_get_sampling_client()
            out = (
                sc.result()
                .sample(
                    types.ModelInput.from_ints([1, 2, 3]),
                    1,
                    types.SamplingParams(max_tokens=3, seed=1),
                )
                .result()
            )
            assert len(out.sequences[0].tokens) == 3
    assert srv.worker.offloads > offloads and srv.worker.restores > 0
    for tc, s in zip(tcs, seeds):
        path = tc.save_weights_for_sampler(f"final-{s}").result().path
        folder, _ = srv.store.resolve(path, "alice", "sampler_weights")
        got = load_file(os.path.join(folder, "adapter_model.safetensors"))
        assert got.keys() == ref[s].keys()
        for k in got:
            np.testing.assert_array_equal(got[k], ref[s][k], err_msg=k)
    env["three"] = scs, tcs


def test_finished_session_releases_its_models(env):
    """close() (POST sessions/{id}/finish) unloads the session's models and frees its
    unnamed sampler snapshots; its named checkpoints stay loadable from another session."""
    srv = env["srv"]
    scs, tcs = env.pop("three")
    ckpt = tcs[0].save_state("keep").result().path
    run_dir = os.path.join(srv.store.state_dir, "runs", tcs[0].model_id, "sampler_weights")
    # Unnamed sampler weights are in-memory snapshots (slots in the same LRU cache as
    # the training models), never folders.
    assert not any(n.startswith("ephemeral-") for n in os.listdir(run_dir))
    for sc in scs:
        sc.close("success").result()
    wait_until(lambda: not any(tc.model_id in srv.store.models for tc in tcs), "unload")
    assert {n for n in os.listdir(run_dir)} == {"final-11"}
    # A snapshot's slot is retired with its model and freed once no running sequence
    # reads it (the worker's next sweep): a loaded machine may see the model gone first.
    wait_until(lambda: not env["tr"].adapters, "the slots freed")
    # A finished session refuses new work with 410 (which stops the SDK's heartbeats).
    sid = tcs[0].model_id.split(":train:")[0]
    assert post(env, "session_heartbeat", {"session_id": sid}).status_code == 410
    again = client(env).create_training_client_from_state_with_optimizer(ckpt).result()
    assert again.forward([data(1)[0]], "cross_entropy").result().metrics["loss:sum"] > 0
    env["again"] = again


def test_expired_session_releases_its_models(env):
    srv = env["srv"]
    sid = post(env, "create_session", {})
    sid = sid.json()["session_id"]
    fut = post(
        env,
        "create_model",
        {"session_id": sid, "model_seq_id": 0, "base_model": MODEL, "lora_config": {"rank": 2}},
    ).json()
    mid = result(env, fut)["model_id"]
    assert mid in srv.store.models
    alive = env["again"].model_id.split(":train:")[0]

    def expired():  # meanwhile the other session heartbeats faster than the timeout
        assert post(env, "session_heartbeat", {"session_id": alive}).status_code == 200
        return mid not in srv.store.models

    old = srv.worker.session_timeout_s
    srv.worker.session_timeout_s = 1.0
    try:
        wait_until(expired, "expiry")
    finally:
        srv.worker.session_timeout_s = old
    assert post(env, "session_heartbeat", {"session_id": sid}).status_code == 410
    assert env["again"].model_id in srv.store.models


def test_reused_model_seq_id_and_failed_create_leave_no_trace(env):
    srv, tr = env["srv"], env["tr"]
    sid = post(env, "create_session", {}).json()["session_id"]
    body = {
        "session_id": sid,
        "model_seq_id": 0,
        "base_model": MODEL,
        "lora_config": {"rank": 2},
        "user_metadata": {"renderer_name": "qwen3"},
    }
    mid = result(env, post(env, "create_model", body).json())["model_id"]
    slots = dict(tr.adapters)
    again = result(env, post(env, "create_model", body).json())
    assert again["category"] == "user" and "already used" in again["error"]
    assert dict(tr.adapters) == slots and srv.store.models[mid].slot in slots
    runs = set(os.listdir(os.path.join(srv.store.state_dir, "runs")))
    for bad in (
        {**body, "model_seq_id": 1, "base_model": "other"},
        {
            **body,
            "model_seq_id": 2,
            "lora_config": {
                "rank": 2,
                "train_attn": False,
                "train_mlp": False,
                "train_unembed": False,
            },
        },
    ):
        out = result(env, post(env, "create_model", bad).json())
        assert out["category"] == "user", out
    assert post(env, "create_model", {**body, "model_seq_id": "x"}).status_code == 422
    assert (
        post(env, "create_model", {**body, "model_seq_id": 3, "user_metadata": [1]}).status_code
        == 422
    )
    assert set(os.listdir(os.path.join(srv.store.state_dir, "runs"))) == runs
    assert dict(tr.adapters) == slots and set(srv.store.models) >= {mid}
    assert not any(m.startswith(f"{sid}:train:") and m != mid for m in srv.store.models)
    post(env, f"sessions/{sid}/finish", {})
    wait_until(lambda: mid not in srv.store.models, "unload")


def test_provenance_spans_are_accepted_and_ignored(env):
    """The cookbook's RL data carries provenance spans; every loss accepts them, they do
    not change the result, and malformed spans are refused naming the datum."""
    tc = env["again"]
    n = 12
    rng = np.random.default_rng(5)
    toks = rng.integers(0, VOCAB, n + 1).tolist()
    inputs = {
        "target_tokens": toks[1:],
        "advantages": rng.normal(size=n).tolist(),
        "logprobs": (-np.log(VOCAB) + 0.1 * rng.normal(size=n)).tolist(),
    }
    plain = types.Datum(model_input=types.ModelInput.from_ints(toks[:-1]), loss_fn_inputs=inputs)
    spans = [
        PromptProvenanceSpan(sequence_id="seq-a", offset=0, length=5),
        SampledProvenanceSpan(sequence_id="seq-a", offset=0, length=n - 5),
    ]
    tagged = plain.with_provenance(model_input=spans, loss_fn_inputs=spans)
    for loss in ("importance_sampling", "ppo"):
        a, b = (tc.forward([d], loss).result() for d in (plain, tagged))
        assert a.metrics["loss:sum"] == b.metrics["loss:sum"] != 0
        np.testing.assert_array_equal(
            a.loss_fn_outputs[0]["logprobs"].to_numpy(), b.loss_fn_outputs[0]["logprobs"].to_numpy()
        )
    ce = types.Datum(
        model_input=plain.model_input,
        loss_fn_inputs={"target_tokens": toks[1:], "weights": [1.0] * n},
        model_input_spans=spans,
        loss_fn_input_spans=spans,
    )
    assert tc.forward([ce], "cross_entropy").result().metrics["loss:sum"] > 0
    short = [SampledProvenanceSpan(sequence_id="seq-a", offset=0, length=n - 1)]
    bad = types.Datum(
        model_input=plain.model_input,
        loss_fn_inputs=inputs,
        model_input_spans=spans,
        loss_fn_input_spans=short,
    )
    with pytest.raises(Exception, match=r"datum 0: loss_fn_input_spans cover 11 positions"):
        tc.forward([bad], "importance_sampling").result()
    with pytest.raises(Exception, match="stable_reinforce is not served"):
        tc.forward_backward([tagged], "stable_reinforce").result()
    # record_stability_info on a sampling client is accepted (it records nothing).
    sc = tc.save_weights_and_get_sampling_client(record_stability_info=True).result()
    assert (
        sc.sample(types.ModelInput.from_ints([1, 2]), 1, types.SamplingParams(max_tokens=2))
        .result()
        .sequences
    )


def test_optim_metrics_do_not_collide_with_client_keys(env):
    tc = env["again"]
    tc.forward_backward([data(3)[0]], "cross_entropy").result()
    m = tc.optim_step(ADAM).result().metrics
    assert set(m) == {"grad_norm:mean", "adam_step:max"} and m["grad_norm:mean"] > 0
    assert m["adam_step:max"] >= 1


def test_rest_routes_and_tenants(env):
    """The RestClient surface the cookbook uses: runs (with the user_metadata sent at
    create), checkpoints, weights_info, copy, TTL, delete — and bob sees none of alice's."""
    sc = client(env)
    tc = sc.create_lora_training_client(
        base_model=MODEL, rank=RANK, seed=4, user_metadata={"renderer_name": "qwen3"}
    ).result()
    first = tc.save_state("r1").result().path
    second = tc.save_weights_for_sampler("s1", ttl_seconds=3600).result().path
    rc = tinker.RestClient(base_url=env["srv"].url, api_key="tml-alice")
    run = rc.get_training_run(tc.model_id).result()
    assert run.user_metadata == {"renderer_name": "qwen3"} and run.lora_rank == RANK
    assert run.base_model == MODEL and run.last_checkpoint.tinker_path == first
    assert run.last_sampler_checkpoint.tinker_path == second
    assert run.last_sampler_checkpoint.expires_at is not None
    assert tc.model_id in [
        r.training_run_id for r in rc.list_training_runs(limit=100).result().training_runs
    ]
    ckpts = rc.list_checkpoints(tc.model_id).result().checkpoints
    assert {c.tinker_path: c.checkpoint_type for c in ckpts} == {
        first: "training",
        second: "sampler",
    }
    assert all(c.size_bytes > 0 for c in ckpts)
    info = rc.get_weights_info_by_tinker_path(first).result()
    assert (info.base_model, info.lora_rank, info.train_mlp) == (MODEL, RANK, True)

    bob = tinker.RestClient(base_url=env["srv"].url, api_key="tml-bob")
    assert tc.model_id not in [
        r.training_run_id for r in bob.list_training_runs().result().training_runs
    ]
    for call in (
        lambda: bob.get_training_run(tc.model_id).result(),
        lambda: bob.list_checkpoints(tc.model_id).result(),
        lambda: bob.get_weights_info_by_tinker_path(first).result(),
        lambda: bob.delete_checkpoint_from_tinker_path(first).result(),
        lambda: bob.set_checkpoint_ttl_from_tinker_path(first, 5).result(),
    ):
        with pytest.raises(Exception):  # noqa: B017 — the SDK's error class varies by status
            call()

    copy = rc.copy_weights(first, "archive").result()
    assert copy.startswith("tinker://copy-") and copy.endswith("/weights/r1")
    loaded = client(env).create_training_client_from_state(copy).result()
    assert loaded.get_info().lora_rank == RANK

    rc.set_checkpoint_ttl_from_tinker_path(second, 1).result()
    folder = srv_folder(env, second)
    wait_until(lambda: not os.path.exists(folder), "TTL expiry", timeout=20)
    rc.delete_checkpoint_from_tinker_path(first).result()
    assert [c.tinker_path for c in rc.list_checkpoints(tc.model_id).result().checkpoints] == []
    with pytest.raises(Exception, match="not found"):
        client(env).create_training_client_from_state(first).result()
    env["rest"] = sc, tc, rc


def same_file(name: str, a: bytes, b: bytes) -> bool:
    """Equal files; safetensors by their tensors (two writes may order the header apart)."""
    if not name.endswith(".safetensors"):
        return a == b
    from safetensors.numpy import load

    x, y = load(a), load(b)
    return x.keys() == y.keys() and len(x) > 0 and all(np.array_equal(x[k], y[k]) for k in x)


def srv_folder(env, path):
    run, kind, name = path[len("tinker://") :].split("/")
    return os.path.join(env["srv"].store.state_dir, "runs", run, kind, name)


def test_external_weights_download(env, monkeypatch):
    """save_weights_external + external_weights_urls: the files (age-encrypted to the
    client's X25519 key when asked) are served by jcp-serve under expiring per-file
    tokens; the plain export equals the sampler export of the same weights."""
    import urllib.error
    import urllib.request

    import pyrage

    from jcp.server.routes import runs as run_routes

    sc, tc, rc = env["rest"]
    plain = tc.save_weights_external("plain").result().path
    ref = srv_folder(env, tc.save_weights_for_sampler("ref").result().path)
    urls = rc.get_external_weights_urls(plain).result()
    assert (
        set(urls.urls)
        == set(os.listdir(ref))
        == {"adapter_config.json", "adapter_model.safetensors"}
    )
    for name, url in urls.urls.items():
        with urllib.request.urlopen(url) as r, open(os.path.join(ref, name), "rb") as f:
            assert same_file(name, r.read(), f.read()), name
    other = next(iter(urls.urls.values())).rsplit("/", 1)[0] + "/not-this-file"
    with pytest.raises(urllib.error.HTTPError):
        urllib.request.urlopen(other)

    key = pyrage.x25519.Identity.generate()
    enc = tc.save_weights_external("enc", age_encryption_recipients=[str(key.to_public())])
    enc_urls = rc.get_external_weights_urls(enc.result().path).result().urls
    assert set(enc_urls) == {"adapter_config.json.age", "adapter_model.safetensors.age"}
    for name, url in enc_urls.items():
        with urllib.request.urlopen(url) as r:
            data = r.read()
        with open(os.path.join(ref, name[:-4]), "rb") as f:
            clear = f.read()
        assert data[:20] != clear[:20] and same_file(name[:-4], pyrage.decrypt(data, [key]), clear)
    with pytest.raises(Exception, match="age_encryption_recipients"):
        tc.save_weights_external("bad", age_encryption_recipients=["age1nope"]).result()
    bob = tinker.RestClient(base_url=env["srv"].url, api_key="tml-bob")
    with pytest.raises(Exception):  # noqa: B017 — the SDK's error class varies by status
        bob.get_external_weights_urls(plain).result()

    monkeypatch.setattr(run_routes, "URL_TTL_S", 0.5)
    short = rc.get_external_weights_urls(plain).result().urls
    time.sleep(1.0)
    with pytest.raises(urllib.error.HTTPError):
        urllib.request.urlopen(next(iter(short.values())))


def test_dot_names_and_failed_saves_on_every_route(env, monkeypatch):
    """A checkpoint name `.` or `..` is not found on every route (DELETE …/weights/%2e%2e
    deleted the caller's whole run; external_weights/.. handed out URLs for owner.json);
    a save that fails (a full disk) is not listed and never the run's last checkpoint."""
    import errno

    sc = client(env)
    tc = sc.create_lora_training_client(base_model=MODEL, rank=RANK, seed=5).result()
    run, good = tc.model_id, tc.save_state("good").result().path
    rc = tinker.RestClient(base_url=env["srv"].url, api_key="tml-alice")
    url, key = (
        f"{env['srv'].url}/api/v1/training_runs/{run}/checkpoints",
        {"X-API-Key": "tml-alice"},
    )
    for kind in ("weights", "sampler_weights", "external_weights"):
        for name in ("%2e%2e", "%2e", ".%2e"):
            answers = [
                httpx.delete(f"{url}/{kind}/{name}", headers=key),
                httpx.put(f"{url}/{kind}/{name}/ttl", json={"ttl_seconds": 60}, headers=key),
                httpx.get(f"{url}/{kind}/{name}/external_weights_urls", headers=key),
            ]
            assert [a.status_code for a in answers] == [404] * 3, [a.text for a in answers]
            assert not any("owner.json" in a.text for a in answers)
    for kind in ("weights", "sampler_weights"):
        for route, field in (("weights_info", "tinker_path"), ("copy_weights", "source_path")):
            assert post(env, route, {field: f"tinker://{run}/{kind}/.."}).status_code == 404
    for call in (
        lambda: sc.create_training_client_from_state(f"tinker://{run}/weights/.."),
        lambda: sc.create_sampling_client(f"tinker://{run}/sampler_weights/.."),
        lambda: tc.save_state(".."),
        lambda: tc.save_weights_for_sampler("."),
    ):
        with pytest.raises(Exception, match=r"not found|not '\.' or '\.\.'"):
            call().result()

    def full_disk(slot, folder):  # the writer's first file lands, then the disk is full
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "CURRENT"), "w") as f:
            f.write("v-1")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(env["tr"], "save_state", full_disk)
    with pytest.raises(tinker.RequestFailedError, match="No space left"):
        tc.save_state("full").result()
    assert [c.tinker_path for c in rc.list_checkpoints(run).result().checkpoints] == [good]
    assert rc.get_training_run(run).result().last_checkpoint.tinker_path == good
    assert not os.path.exists(srv_folder(env, f"tinker://{run}/weights/full"))


def test_cancel_and_retrieve_futures(env):
    srv = env["srv"]
    sid = post(env, "create_session", {}).json()["session_id"]
    samp = post(
        env,
        "create_sampling_session",
        {"session_id": sid, "base_model": MODEL, "sampling_session_seq_id": 0},
    ).json()
    ssid = samp["sampling_session_id"]
    body = {
        "sampling_session_id": ssid,
        "num_samples": 1,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
        "sampling_params": {"max_tokens": 2, "seed": 1},
    }
    srv.scheduler.hold()
    try:
        keep, drop = post(env, "asample", body).json(), post(env, "asample", body).json()
        assert post(env, "cancel_future", {"request_id": drop["request_id"]}).status_code == 200
        assert (
            post(env, "cancel_future", {"request_id": drop["request_id"]}, "tml-bob").status_code
            == 404
        )
    finally:
        srv.scheduler.release()
    assert "cancelled" in result(env, drop)["error"]
    poll = post(
        env,
        "retrieve_futures",
        {
            "target": {"type": "sampling_session", "sampling_session_id": ssid},
            "prev_cursor": 0,
            "timeout": 10,
        },
    ).json()
    states = {c["request_id"]: c["state"] for c in poll["completions"]}
    if keep["request_id"] not in states:  # the cancel completed first; poll once more
        poll = post(
            env,
            "retrieve_futures",
            {"target": {"sampling_session_id": ssid}, "prev_cursor": poll["cursor"], "timeout": 10},
        ).json()
        states.update({c["request_id"]: c["state"] for c in poll["completions"]})
    assert states == {drop["request_id"]: "failed", keep["request_id"]: "finished"}
    assert (
        post(
            env, "retrieve_futures", {"target": {"sampling_session_id": ssid}}, "tml-bob"
        ).status_code
        == 404
    )
    post(env, f"sessions/{sid}/finish", {})


def test_fused_requests_report_their_own_metrics(env):
    """Two models' ppo forwards fused into one Trainer call return, per request, the
    metrics (loss:sum and clipped_tokens:sum) and log-probs each gets alone."""
    srv = env["srv"]
    sched = srv.scheduler
    tcs = [
        client(env).create_lora_training_client(base_model=MODEL, rank=RANK, seed=s).result()
        for s in (21, 22)
    ]
    reqs = []
    for i, tc in enumerate(tcs):
        plain = [data(40 + 2 * i + k, 16 + 3 * k)[0] for k in range(2)]
        lps = tc.forward(plain, "cross_entropy").result().loss_fn_outputs
        rng = np.random.default_rng(i)
        reqs.append(
            [
                types.Datum(
                    model_input=d.model_input,
                    loss_fn_inputs={
                        "target_tokens": d.loss_fn_inputs["target_tokens"],
                        "logprobs": (
                            o["logprobs"].to_numpy()
                            + 0.3 * rng.normal(size=len(o["logprobs"].to_numpy()))
                        ).astype(np.float32),
                        "advantages": rng.normal(size=len(o["logprobs"].to_numpy())).astype(
                            np.float32
                        ),
                    },
                )
                for d, o in zip(plain, lps)
            ]
        )
    before = sched.counters.fused_passes
    sched.hold()
    try:
        futs = [tc.forward(r, "ppo") for tc, r in zip(tcs, reqs)]
        wait_until(lambda: sched.pending() == 2, "both requests queued")
    finally:
        sched.release()
    fused = [f.result() for f in futs]
    assert sched.counters.fused_passes == before + 1
    alone = [tc.forward(r, "ppo").result() for tc, r in zip(tcs, reqs)]
    assert sched.counters.fused_passes == before + 1
    assert fused[0].metrics["clipped_tokens:sum"] != fused[1].metrics["clipped_tokens:sum"]
    for f, a in zip(fused, alone):
        assert f.metrics.keys() == a.metrics.keys() == {"loss:sum", "clipped_tokens:sum"}
        assert f.metrics["clipped_tokens:sum"] == a.metrics["clipped_tokens:sum"] > 0
        np.testing.assert_allclose(f.metrics["loss:sum"], a.metrics["loss:sum"], rtol=1e-5)
        for x, y in zip(f.loss_fn_outputs, a.loss_fn_outputs):
            np.testing.assert_allclose(
                x["logprobs"].to_numpy(), y["logprobs"].to_numpy(), rtol=1e-5, atol=1e-6
            )


def test_snapshots_outlast_idle_training_models(env):
    """bob's in-memory sampler snapshot keeps its slot while alice's models need slots and
    idle training models can be offloaded instead (his own included: he holds the most
    slots); his sampling client still samples."""
    srv = env["srv"]
    tb = (
        client(env, "tml-bob")
        .create_lora_training_client(base_model=MODEL, rank=RANK, seed=31)
        .result()
    )
    sb = tb.save_weights_and_get_sampling_client().result()
    tas = [
        client(env).create_lora_training_client(base_model=MODEL, rank=RANK, seed=s).result()
        for s in (32, 33)
    ]
    for ta in tas:
        assert ta.forward([data(5)[0]], "cross_entropy").result().metrics["loss:sum"] > 0
    assert srv.store.models[tb.model_id].slot is None  # offloaded, the snapshot was not
    out = sb.sample(
        types.ModelInput.from_ints([1, 2, 3]), 1, types.SamplingParams(max_tokens=2, seed=1)
    ).result()
    assert len(out.sequences[0].tokens) == 2
    env["swap"] = tb, tas


def test_restore_swaps_when_host_memory_is_full(env):
    """Host memory for offloaded models exactly full and the other slot held by alice:
    bob's offloaded model still comes back — swapped with alice's idle model into the
    host memory its restore frees — and so does hers after it."""
    srv = env["srv"]
    tb, (ta0, ta1) = env.pop("swap")
    assert srv.store.models[ta1.model_id].slot is not None
    assert srv.store.models[tb.model_id].slot is None
    used, old = srv.worker.offloaded_bytes(), srv.worker.max_offload_bytes
    srv.worker.max_offload_bytes = used
    try:
        restores = srv.worker.restores
        assert tb.forward([data(6)[0]], "cross_entropy").result().metrics["loss:sum"] > 0
        assert srv.store.models[ta1.model_id].slot is None  # alice's idle model swapped out
        assert ta0.forward([data(7)[0]], "cross_entropy").result().metrics["loss:sum"] > 0
        assert srv.worker.restores == restores + 2
        assert srv.worker.offloaded_bytes() == used
    finally:
        srv.worker.max_offload_bytes = old


def test_server_failures_name_no_server_files(env):
    """A load that fails inside the server (the checkpoint's array files were cut short:
    the integrity check names a file of the state folder) answers with the checkpoint's
    tinker:// name, never a path of the server's state folder."""
    sc = client(env)
    tc = sc.create_lora_training_client(base_model=MODEL, rank=RANK).result()
    path = tc.save_state("cut").result().path
    cut = [
        os.path.join(d, f)
        for d, _, fs in os.walk(srv_folder(env, path))
        for f in fs
        if os.path.basename(d) == "d"
    ]
    assert cut
    for f in cut:
        with open(f, "r+b") as fh:
            fh.truncate(10)
    with pytest.raises(tinker.RequestFailedError) as refused:
        sc.create_training_client_from_state(path).result()
    said = str(refused.value)
    state = env["srv"].store.state_dir
    assert state not in said and os.path.realpath(state) not in said, said[:500]
    assert "tinker://" in said and len(said) < 2000, said[:500]


def test_error_messages_are_redacted_and_bounded():
    """redact.client_message (host only): state folders become tinker:// names, other
    absolute paths <path>, tinker:// names and relative text stay, the length is capped
    (shutil.Error of a failed copy lists every file: kilobytes of paths)."""
    from jcp.server.redact import MAX_CHARS, client_message

    state = "/srv/jcp-state"
    ckpt = f"{state}/runs/s1:train:0/weights/step-4"
    listed = str(
        [
            (
                f"{ckpt}/state/d/{i:032x}",
                f"{state}/runs/copy-1/weights/step-4/d/{i}",
                "[Errno 18] Invalid cross-device link",
            )
            for i in range(100)
        ]
    )
    said = client_message(listed, state)
    assert len(listed) > 10_000 and len(said) == MAX_CHARS and said.endswith("…")
    assert said.startswith("[('tinker://s1:train:0/weights/step-4', 'tinker://copy-1/weights")
    assert (
        client_message(
            f"{state}/runs/r1/checkpoints.json: bad; {state}-old/x; "
            f"{state}/.tmp-1 and /usr/lib/x.py",
            state,
        )
        == "tinker://r1: bad; <path>; <state> and <path>"
    )
    kept = "tinker://r:train:0/weights/a not found; 3/4 tokens/s; loss / n"
    assert client_message(kept, state) == kept


def test_train_mlp_means_the_experts_on_moe(tmp_path):
    """On a MoE model the SDK's default train_mlp=True trains the experts (as Tinker does);
    train_mlp=False leaves them out."""
    tr = jcp.Trainer(
        jcp.QwenConfig.tiny_moe(), jcp.make_mesh(1, 1, 1), max_adapters=2, max_rank=RANK
    )
    srv = Server(tr, MODEL, str(tmp_path)).start()
    sc = tinker.ServiceClient(base_url=srv.url, api_key="tml-local")
    try:
        on = sc.create_lora_training_client(base_model=MODEL, rank=RANK).result()
        off = sc.create_lora_training_client(base_model=MODEL, rank=RANK, train_mlp=False).result()
        targets = {
            tc: set(tr.adapters[srv.store.models[tc.model_id].slot].targets) for tc in (on, off)
        }
        experts = {"expert_gate", "expert_up", "expert_down"}
        assert experts <= targets[on] and not experts & targets[off]
        assert targets[on] - experts == targets[off] and "q_proj" in targets[off]
    finally:
        sc.close("success").result()
        srv.stop()
