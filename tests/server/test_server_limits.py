"""jcp-serve under hostile input: every field typed at the edge, every body and table bounded,
the worker outliving any failure, and one tenant never hurting another.

One server for the module (tiny model, one device, small Limits so each bound is reached in
a few requests); alice attacks with raw HTTP, and after every attack bob's SDK request still
completes and /healthz tells the truth. Each test can fail on a server without the bound.
"""

from __future__ import annotations

import os
import tempfile
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

os.environ.setdefault("TINKER_TELEMETRY", "0")
tinker = pytest.importorskip("tinker")
httpx = pytest.importorskip("httpx")
zstandard = pytest.importorskip("zstandard")
from tinker import types  # noqa: E402
from tinker.proto import tinker_public_pb2 as pb  # noqa: E402

import jcp  # noqa: E402
from jcp.server import scheduler as scheduler_lib  # noqa: E402
from jcp.server.edge import Limits  # noqa: E402
from jcp.server.service import Server  # noqa: E402

MODEL = "jcp-tiny"
KEYS = {"tml-alice": "alice", "tml-bob": "bob"}
LIMITS = Limits(body_bytes=64 << 10, datums=4, num_samples=4, futures=8)
VOCAB = jcp.QwenConfig.tiny().vocab_size


@pytest.fixture(scope="module")
def env():
    tr = jcp.Trainer(
        jcp.QwenConfig.tiny(),
        jcp.make_mesh(1, 1, 1),
        max_adapters=8,
        max_rank=8,
        attn_block=16,
        logprob_chunk=16,
    )
    state = {"tr": tr, "dir": tempfile.mkdtemp(prefix="jcp-serve-limits-")}
    srv = state["srv"] = Server(tr, MODEL, state["dir"], KEYS, limits=LIMITS).start()
    sc = tinker.ServiceClient(base_url=srv.url, api_key="tml-bob")
    state["sdk"] = [sc]
    state["bob"] = sc.create_lora_training_client(base_model=MODEL, rank=4, seed=1).result()
    state["alice_session"] = post(state, "create_session", {}).json()["session_id"]
    yield state
    for c in state["sdk"]:
        if c._session_holder is not None:
            c._session_holder.close()
    srv.stop()


# ---------------------------------------------------------------------- helpers


def post(env, route, body=None, key="tml-alice", **kw):
    if body is not None and "content" not in kw:
        kw["json"] = body
    return httpx.post(
        f"{env['srv'].url}/api/v1/{route}",
        headers={"X-API-Key": key, **kw.pop("headers", {})},
        timeout=60,
        **kw,
    )


def result(env, answer, key="tml-alice", timeout=60.0) -> dict:
    """retrieve_future until done -> the JSON result ({"error", "category"} on failure)."""
    assert answer.status_code == 200, answer.text
    rid = answer.json()["request_id"]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = post(env, "retrieve_future", {"request_id": rid}, key=key)
        if r.status_code != 408:
            assert r.status_code == 200, r.text
            return (
                r.json()
                if r.headers["content-type"].startswith("application/json")
                else {"proto": r.content}
            )
    raise AssertionError(f"{rid} did not complete in {timeout} s")


def refused(env, answer, field: str, key="tml-alice"):
    """A 4xx naming `field`, or a future failed with category "user" naming it."""
    if answer.status_code != 200:
        assert 400 <= answer.status_code < 500, (answer.status_code, answer.text)
        assert field in answer.json()["detail"], answer.text
        return
    out = result(env, answer, key)
    assert out.get("category") == "user" and field in out["error"], out


def new_model(env, seq: int, rank: int = 4) -> str:
    r = post(
        env,
        "create_model",
        {
            "session_id": env["alice_session"],
            "model_seq_id": seq,
            "base_model": MODEL,
            "lora_config": {"rank": rank},
        },
    )
    out = result(env, r)
    assert out.get("type") == "create_model", out
    return out["model_id"]


def fb_body(
    model_id: str, seq_id: int, n: int = 1, forward_only: bool = True, bad_dtype: bool = False
) -> bytes:
    """A ForwardBackwardRequest built with the SDK's own protobuf classes."""
    msg = pb.ForwardBackwardRequest(
        model_id=model_id, seq_id=seq_id, loss_fn="cross_entropy", forward_only=forward_only
    )
    rng = np.random.default_rng(seq_id)
    for _ in range(n):
        toks = rng.integers(0, VOCAB, 9)
        d = msg.data.add()
        d.model_input.add().encoded_text.tokens = toks[:-1].astype(np.int32).tobytes()
        t = d.loss_fn_inputs["target_tokens"]
        t.dense, t.dtype, t.shape[:] = toks[1:].astype(np.int64).tobytes(), pb.DTYPE_INT64, [8]
        w = d.loss_fn_inputs["weights"]
        w.dense, w.dtype, w.shape[:] = np.ones(8, np.float32).tobytes(), pb.DTYPE_FLOAT32, [8]
        if bad_dtype:
            w.dtype = pb.DTYPE_BFLOAT16
    return msg.SerializeToString()


def next_seq(env, mid: str) -> int:
    """The model's next seq_id (its protobuf requests are ordered; the first is 1)."""
    seqs = env.setdefault("seq", {})
    seqs[mid] = seqs.get(mid, 0) + 1
    return seqs[mid]


def post_fb(env, body: bytes, **headers):
    return post(
        env,
        "forward_backward",
        content=body,
        headers={"Content-Type": "application/x-protobuf", **headers},
    )


def assert_others_served(env):
    """bob's SDK request completes and /healthz says ok."""
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3, 4]),
        loss_fn_inputs={"target_tokens": [2, 3, 4, 5], "weights": [1.0] * 4},
    )
    out = env["bob"].forward([datum], "cross_entropy").result(timeout=60)
    assert np.isfinite(out.metrics["loss:sum"])
    h = httpx.get(env["srv"].url + "/api/v1/healthz")
    assert (h.status_code, h.json()) == (200, {"status": "ok"})
    assert env["srv"].worker.alive()


# ---------------------------------------------------------------------- items 1, 7


def test_non_integer_seq_id_is_refused_and_the_worker_lives(env, monkeypatch):
    monkeypatch.setattr(scheduler_lib, "GAP_TIMEOUT_S", 0.5)
    mid = new_model(env, 0)
    r = post(
        env,
        "optim_step",
        {"model_id": mid, "seq_id": "abc", "adam_params": {"learning_rate": 1e-3}},
    )
    refused(env, r, "seq_id")
    # Past the scheduler's gap timeout: where "abc" reached the queue, the worker died here.
    time.sleep(scheduler_lib.GAP_TIMEOUT_S + 0.5)
    assert_others_served(env)
    out = result(
        env, post(env, "optim_step", {"model_id": mid, "adam_params": {"learning_rate": 1e-3}})
    )
    assert "metrics" in out, out


def test_a_scheduler_failure_fails_one_request_and_the_worker_goes_on(env, monkeypatch):
    sched = env["srv"].scheduler
    mid = new_model(env, 1)
    real, calls = sched.pick, []

    def once():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected policy bug")
        return real()

    monkeypatch.setattr(sched, "pick", once)
    out = result(env, post(env, "save_weights", {"model_id": mid}))
    assert out.get("category") == "server" and "scheduler" in out["error"], out
    assert calls
    assert_others_served(env)


@pytest.mark.parametrize(
    "route,body,field",
    [
        ("create_model", {"session_id": ["x"], "base_model": MODEL}, "session_id"),
        (
            "create_model",
            {"session_id": "S", "base_model": MODEL, "lora_config": [4]},
            "lora_config",
        ),
        (
            "create_model",
            {"session_id": "S", "base_model": MODEL, "lora_config": {"rank": 4, "train_mlp": "no"}},
            "train_mlp",
        ),
        ("get_info", {"model_id": {"a": 1}}, "model_id"),
        ("optim_step", {"model_id": ["m"], "adam_params": {}}, "model_id"),
        (
            "optim_step",
            {"model_id": "M", "adam_params": {"learning_rate": 10**400}},
            "learning_rate",
        ),
        ("optim_step", {"model_id": "M", "seq_id": True, "adam_params": {}}, "seq_id"),
        ("save_weights", {"model_id": "M", "path": 7}, "path"),
        (
            "load_weights",
            {"model_id": "M", "path": "tinker://x/weights/y", "optimizer": "false"},
            "optimizer",
        ),
        (
            "asample",
            {
                "sampling_session_id": "X",
                "prompt": {"chunks": [[1, 2]]},
                "sampling_params": {"max_tokens": 2},
            },
            "chunks",
        ),
        (
            "asample",
            {
                "sampling_session_id": "X",
                "prompt": {"chunks": [{"tokens": [1]}]},
                "sampling_params": {"max_tokens": 2, "stop": 5},
            },
            "stop",
        ),
        (
            "asample",
            {
                "sampling_session_id": "X",
                "prompt": {"chunks": [{"tokens": [10**30]}]},
                "sampling_params": {"max_tokens": 2},
            },
            "tokens",
        ),
        (
            "asample",
            {
                "sampling_session_id": "X",
                "prompt": {"chunks": [{"tokens": [1]}]},
                "sampling_params": {"max_tokens": "2"},
            },
            "max_tokens",
        ),
        ("retrieve_future", {"request_id": 5}, "request_id"),
        ("session_heartbeat", {"session_id": None}, "session_id"),
    ],
)
def test_wrong_field_types_are_the_clients_fault(env, route, body, field):
    if "m0" not in env:
        env["m0"] = new_model(env, 2)
    fill = {"S": env["alice_session"], "M": env["m0"]}
    body = {k: fill.get(v, v) if isinstance(v, str) else v for k, v in body.items()}
    refused(env, post(env, route, body), field)


def test_hot_routes_answer_as_fastapi_routes(env, monkeypatch):
    """asample, retrieve_future, forward_backward and the model operations are answered
    before FastAPI (app.HotRoutes): each failure gets the status, content type and body
    that a FastAPI route (cancel_future, which reads the same tables) gives it."""

    def answer(route, **kw):
        r = post(env, route, **kw)
        return r.status_code, r.headers["content-type"], r.text

    hot = ("asample", "retrieve_future", "forward_backward", "optim_step", "save_weights")
    app = env["srv"].app
    assert {f"/api/v1/{r}" for r in hot} <= {*app.routes, *app.raw}
    for route in hot:
        assert answer(route, body={}, key="tml-mallory") == answer(
            "cancel_future", body={}, key="tml-mallory"
        )
        big = {"content": bytes(LIMITS.body_bytes + 1)}
        assert answer(route, **big) == answer("cancel_future", **big)
        r = httpx.get(f"{env['srv'].url}/api/v1/{route}")
        assert r.status_code == 405 and r.headers["allow"] == "POST", r.text
    unknown = {"request_id": "req-nope"}
    status = [answer(route, body=unknown)[0] for route in ("retrieve_future", "cancel_future")]
    assert status == [404, 404]

    def broken(*a, **kw):
        raise RuntimeError("a bug")

    monkeypatch.setattr(env["srv"].futures, "get", broken)
    got = [answer(route, body=unknown) for route in ("retrieve_future", "cancel_future")]
    assert got[0] == got[1] and got[0][0] == 500, got
    monkeypatch.undo()
    assert_others_served(env)


def test_retrieve_future_long_polls_then_answers_try_again(env, monkeypatch):
    monkeypatch.setattr("jcp.server.routes.futures.POLL_S", 0.3)
    mid = env.get("m0") or new_model(env, 2)
    env["srv"].scheduler.hold()
    try:
        f = post(env, "save_weights", {"model_id": mid})
        t0 = time.monotonic()
        r = post(env, "retrieve_future", {"request_id": f.json()["request_id"]})
        waited = time.monotonic() - t0
    finally:
        env["srv"].scheduler.release()
    assert r.status_code == 408 and r.json()["type"] == "try_again" and waited >= 0.3, (
        r.status_code,
        r.text,
        waited,
    )
    assert result(env, f).get("type") == "save_weights"


def test_deep_nesting_and_non_object_bodies_are_4xx(env):
    deep = b'{"model_id": ' + b"[" * 10_000 + b"]" * 10_000 + b"}"
    for route in ("optim_step", "asample", "create_model", "retrieve_future"):
        r = post(env, route, content=deep, headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and "nested" in r.json()["detail"], (route, r.text)
        r = post(env, route, content=b"[1]", headers={"Content-Type": "application/json"})
        assert r.status_code == 422, (route, r.text)
    assert_others_served(env)


# ---------------------------------------------------------------------- item 2


def test_futures_are_bounded_per_tenant_and_never_evict_pending(env):
    srv, futures = env["srv"], env["srv"].futures
    bob_mid = env["bob"].model_id
    bob_answer = post(env, "save_weights", {"model_id": bob_mid}, key="tml-bob")
    mid = env.get("m0") or new_model(env, 3)
    srv.scheduler.hold()
    try:
        pending = [post(env, "save_weights", {"model_id": mid}) for _ in range(3)]
        assert all(p.status_code == 200 for p in pending)
        # Three times the bound of cheap failing requests: they evict alice's own completed
        # results only.
        for _ in range(3 * LIMITS.futures):
            r = post(env, "optim_step", {"model_id": "nope:train:0", "adam_params": {}})
            assert r.status_code == 200
        assert futures.count("alice") == LIMITS.futures
        more = [post(env, "save_weights", {"model_id": mid}) for _ in range(LIMITS.futures - 3)]
        assert all(p.status_code == 200 for p in more)
        full = post(env, "save_weights", {"model_id": mid})
        assert full.status_code == 429 and "--max-futures" in full.json()["detail"]
        # bob is not refused by alice's full table
        r = post(env, "get_info", {"model_id": bob_mid}, key="tml-bob")
        assert r.status_code == 200
    finally:
        srv.scheduler.release()
    for p in pending + more:
        assert result(env, p)["type"] == "save_weights"
    # bob's result, never retrieved until now, survived alice's flood
    assert result(env, bob_answer, key="tml-bob")["type"] == "save_weights"
    assert_others_served(env)


# ---------------------------------------------------------------------- items 3, 4, 5


def test_sample_bounds_are_refused_before_any_allocation(env):
    sid = post(
        env,
        "create_sampling_session",
        {"session_id": env["alice_session"], "sampling_session_seq_id": 0, "base_model": MODEL},
    ).json()["sampling_session_id"]
    base = {
        "sampling_session_id": sid,
        "prompt": {"chunks": [{"tokens": [1, 2, 3]}]},
        "sampling_params": {"max_tokens": 2},
    }
    t0 = time.monotonic()
    r = post(env, "asample", {**base, "num_samples": 3_000_000})
    assert time.monotonic() - t0 < 5
    assert len(r.json()["sample_sequence_ids"]) == 1
    refused(env, r, "--max-num-samples")
    cap = env["tr"].token_cap
    refused(
        env,
        post(env, "asample", {**base, "sampling_params": {"max_tokens": cap}}),
        "max_context_length",
    )
    long = {"chunks": [{"tokens": [1] * (cap + 1)}]}
    refused(env, post(env, "asample", {**base, "prompt": long}), "max_context_length")
    ok = result(env, post(env, "asample", {**base, "num_samples": LIMITS.num_samples}))
    assert "proto" in ok
    # through the SDK: one failed request of category "user", the client still works
    sampler = env["sdk"][0].create_sampling_client(base_model=MODEL).result()
    prompt = types.ModelInput.from_ints([1, 2, 3])
    sp = types.SamplingParams(max_tokens=2, seed=1)
    with pytest.raises(tinker.RequestFailedError, match="--max-num-samples") as ei:
        sampler.sample(prompt, LIMITS.num_samples + 1, sp).result(timeout=60)
    assert ei.value.category == types.RequestErrorCategory.User
    assert len(sampler.sample(prompt, 2, sp).result(timeout=60).sequences) == 2
    assert_others_served(env)


def _bomb(size: int) -> bytes:
    """A zstd frame of `size` zero bytes, compressed in 1 MiB pieces (a few KiB)."""
    c = zstandard.ZstdCompressor().compressobj()
    piece = bytes(1 << 20)
    out = b"".join(c.compress(piece) for _ in range(size >> 20))
    return out + c.flush()


def test_zstd_is_decompressed_with_a_cap_and_truncation_refused(env):
    mid = env.get("m0") or new_model(env, 4)
    bomb = _bomb(256 << 20)
    assert len(bomb) < LIMITS.body_bytes
    r = post_fb(env, bomb, **{"Content-Encoding": "zstd"})
    assert r.status_code == 413 and "--max-body-bytes" in r.json()["detail"], r.text
    good = zstandard.ZstdCompressor().compress(fb_body(mid, next_seq(env, mid)))
    r = post_fb(env, good[:-6], **{"Content-Encoding": "zstd"})
    assert r.status_code == 400 and "truncated" in r.json()["detail"], r.text
    out = result(env, post_fb(env, good, **{"Content-Encoding": "zstd"}))
    assert "proto" in out
    r = post_fb(env, bytes(LIMITS.body_bytes + 1))
    assert r.status_code == 413
    assert_others_served(env)


def test_datums_per_request_are_capped(env):
    mid = env.get("m0") or new_model(env, 5)
    refused(
        env, post_fb(env, fb_body(mid, next_seq(env, mid), n=LIMITS.datums + 1)), "--max-datums"
    )
    assert "proto" in result(env, post_fb(env, fb_body(mid, next_seq(env, mid), n=LIMITS.datums)))
    assert_others_served(env)


# ---------------------------------------------------------------------- item 6


def test_a_refused_request_keeps_its_place_in_the_model_order(env, monkeypatch):
    # Where a refusal left a gap, the next request would wait this long.
    monkeypatch.setattr(scheduler_lib, "GAP_TIMEOUT_S", 120.0)
    mid = new_model(env, 6)
    t0 = time.monotonic()
    refused(env, post_fb(env, fb_body(mid, 1, bad_dtype=True)), "dtype")
    refused(
        env,
        post(env, "optim_step", {"model_id": mid, "seq_id": 2, "adam_params": {"beta1": "x"}}),
        "beta1",
    )
    out = result(env, post(env, "save_weights", {"model_id": mid, "seq_id": 3}), timeout=30)
    assert out.get("type") == "save_weights", out
    assert time.monotonic() - t0 < 30
    assert_others_served(env)


# ---------------------------------------------------------------------- item 8


def test_load_weights_of_another_rank_reports_the_new_rank(env):
    big, small = new_model(env, 7, rank=8), new_model(env, 8, rank=4)
    path = result(env, post(env, "save_weights", {"model_id": small, "path": "r4"}))["path"]
    assert post(env, "get_info", {"model_id": big}).json()["lora_rank"] == 8
    out = result(
        env, post(env, "load_weights", {"model_id": big, "path": path, "optimizer": False})
    )
    assert out.get("type") == "load_weights", out
    assert post(env, "get_info", {"model_id": big}).json()["lora_rank"] == 4
    srv = env["srv"]
    assert env["tr"].adapters[srv.store.models[big].slot].rank == 4
    for m in (big, small):
        assert result(env, post(env, "unload_model", {"model_id": m}))["type"] == "unload_model"


# ---------------------------------------------------------------------- item 9


def test_no_key_is_written_to_the_state_dir(env):
    found = []
    for root, _, files in os.walk(env["dir"]):
        for f in files:
            with open(os.path.join(root, f), "rb") as fh:
                data = fh.read()
            found += [(f, k) for k in KEYS if k.encode() in data]
    assert env["srv"].store.models  # there are runs on disk to look in
    assert not found


def test_key_file_line_without_a_name_is_refused_at_startup(tmp_path, capsys):
    from jcp import serve
    from jcp.server.state import read_api_keys

    good = tmp_path / "good"
    good.write_text("# tenants\nk1 alice\n\nk2 bob  # second\n")
    assert read_api_keys(str(good)) == {"k1": "alice", "k2": "bob"}
    for text in ("k1 alice\nsecret-key-only\n", "k1 alice\nk1 bob\n", "k1 a b\n"):
        bad = tmp_path / "bad"
        bad.write_text(text)
        assert serve.main(["--api-keys", str(bad), "--port", "1"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "bad:" in err and "--api-keys" in err, err
        assert "secret-key-only" not in err


# ---------------------------------------------------------------------- fuzzing (hypothesis)
# Datums and sampling parameters drawn around and past every bound, through the real
# engine: never a 5xx or a "server" failure, the edge answers at once, and bob's control
# requests are served after each. Seeded and bounded (tests/server/test_server_edge.py fuzzes
# every route's schema without a model).


def _ids(lo=-2, hi=VOCAB + 1):
    return st.lists(st.integers(lo, hi), max_size=9)


SAMPLES = st.fixed_dictionaries(
    {
        "prompt": st.fixed_dictionaries(
            {
                "chunks": st.lists(
                    st.fixed_dictionaries({"tokens": _ids(0, VOCAB - 1)}), min_size=1, max_size=2
                )
            }
        ),
        "num_samples": st.sampled_from([1, LIMITS.num_samples, 2, 0, LIMITS.num_samples + 1]),
        "sampling_params": st.fixed_dictionaries(
            {"max_tokens": st.sampled_from([2, 1, 0])},
            optional={
                "temperature": st.sampled_from([1.0, 0.0, 0.7, -1.0, 1e30, "1"]),
                "top_k": st.sampled_from([-1, 0, 1, 5, 10**12]),
                "top_p": st.sampled_from([0.0, 0.5, 1.0, 1.5]),
                "seed": st.sampled_from([None, 0, 2**64 - 1, 2**64, -1]),
                "stop": st.sampled_from([None, [], [1, 2], [10**12], list(range(40)), ["x"]]),
            },
        ),
    },
    optional={
        "prompt_logprobs": st.booleans(),
        "topk_prompt_logprobs": st.sampled_from([0, 2, 65]),
        "prompt_logprobs_last_n": st.sampled_from([None, 1, 10**6]),
        "target_prompt_logprobs": st.sampled_from(
            [
                {
                    "data": [1],
                    "dtype": "int64",
                    "shape": [1, 10**9],
                    "sparse_crow_indices": [0, 1],
                    "sparse_col_indices": [0],
                },
                {"data": [1, -1], "dtype": "int64", "shape": [1, 2]},
            ]
        ),
    },
)


@settings(
    max_examples=10,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)
@given(body=SAMPLES)
@example(
    body={
        "prompt": {"chunks": [{"tokens": [1, 2, 3]}]},
        "num_samples": 2,
        "sampling_params": {"max_tokens": 2, "top_k": 5, "stop": [1, 2]},
    }
)
def test_fuzz_sampling_params_through_the_engine(env, body):
    sid = (
        env.get("fuzz_sampler")
        or post(
            env,
            "create_sampling_session",
            {"session_id": env["alice_session"], "base_model": MODEL},
        ).json()["sampling_session_id"]
    )
    env["fuzz_sampler"] = sid
    fuzz_one(env, "asample", {"sampling_session_id": sid, **body})


@st.composite
def fb_bodies(draw):
    """A ForwardBackwardRequest (no model yet) of 0 to --max-datums + 1 datums, each field
    around or past its bound."""
    msg = pb.ForwardBackwardRequest(
        loss_fn=draw(st.sampled_from(["cross_entropy", "importance_sampling", "nope"])),
        forward_only=True,
    )
    for _ in range(draw(st.sampled_from([1, LIMITS.datums, 0, LIMITS.datums + 1]))):
        toks = draw(_ids())
        d = msg.data.add()
        d.model_input.add().encoded_text.tokens = np.asarray(toks, np.int32).tobytes()
        n = draw(st.sampled_from([len(toks), len(toks) + 1, 0]))
        # valid first: hypothesis draws a list's first items most
        t = d.loss_fn_inputs["target_tokens"]
        t.dense = np.asarray(
            draw(st.lists(st.integers(-2, VOCAB + 1), min_size=n, max_size=n)), np.int64
        ).tobytes()
        t.dtype = pb.DTYPE_INT64
        t.shape[:] = draw(st.sampled_from([[n], [], [n, 1], [2**32, 2**32]]))
        w = d.loss_fn_inputs["weights"]
        w.dense = np.full(
            n, draw(st.sampled_from([1.0, 0.5, np.nan, np.inf])), np.float32
        ).tobytes()
        w.dtype = draw(st.sampled_from([pb.DTYPE_FLOAT32, pb.DTYPE_FLOAT32, pb.DTYPE_BFLOAT16]))
    return msg


@settings(
    max_examples=10,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)
@given(msg=fb_bodies())
@example(msg=pb.ForwardBackwardRequest.FromString(fb_body("", 0, n=2)))
def test_fuzz_datums_through_the_engine(env, msg):
    if "fuzz_model" not in env:
        env["fuzz_model"] = new_model(env, 9)
    msg.model_id, msg.seq_id = env["fuzz_model"], next_seq(env, env["fuzz_model"])
    fuzz_one(env, "forward_backward", msg.SerializeToString())


def fuzz_one(env, route: str, body):
    """Send one fuzzed request as alice: answered (a future or a 4xx) within 1 s; its
    future, if any, done within 60 s, failed only as the client's fault; then bob's
    healthz and get_info answered within 1 s."""
    t0 = time.monotonic()
    r = post(env, route, body) if isinstance(body, dict) else post_fb(env, body)
    assert r.status_code < 500 and time.monotonic() - t0 < 1.0, (r.status_code, r.text)
    if r.status_code == 200:
        out = result(env, r)
        assert "proto" in out or out.get("category") == "user", out
    t0 = time.monotonic()
    h = httpx.get(env["srv"].url + "/api/v1/healthz")
    info = post(env, "get_info", {"model_id": env["bob"].model_id}, key="tml-bob")
    assert (h.status_code, info.status_code) == (200, 200), (h.text, info.text)
    assert time.monotonic() - t0 < 1.0


# ---------------------------------------------------------------------- worker death (last)


def test_healthz_is_unhealthy_when_the_worker_is_gone(env, monkeypatch):
    srv = env["srv"]

    def die(block=True, timeout=None):
        raise SystemExit("injected worker death")

    monkeypatch.setattr(srv.scheduler, "next_work", die)
    # The worker is waiting inside the real next_work: one request brings it back round.
    post(env, "get_info", {"model_id": "x"})
    post(env, "unload_model", {"model_id": env["m0"]})
    deadline = time.monotonic() + 10
    while srv.worker.alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not srv.worker.alive()
    h = httpx.get(srv.url + "/api/v1/healthz")
    assert h.status_code == 503 and h.json()["status"] == "unhealthy"
