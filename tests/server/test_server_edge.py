"""The jcp-serve edge, host only (no model, nothing compiled): the app over a real state
store, scheduler and future table, its worker a stub that fails every request it is handed
(category "user") and remembers it.

No size a client names is allocated before it is checked (the critical one: a 300-byte
sparse target_prompt_logprobs asked for shape[0]·shape[1]·8 bytes); every route types its
body (4xx or a failed future of category "user", never 500); seq_ids a model's queue could
never reach are refused, not queued; and a seeded schemathesis run over /openapi.json
(every route, positive and negative cases) and every field of every JSON body set to each
wrong type find no 5xx, no request over its time budget, and the other tenant's control
requests always served.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import tempfile
import threading
import time
import tracemalloc

import numpy as np
import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402
from pydantic import ValidationError  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402
from tinker.proto import tinker_public_pb2 as pb  # noqa: E402

from jcp.server import edge as edge_lib  # noqa: E402
from jcp.server import wire  # noqa: E402
from jcp.server.app import FutureTable, ServedModel, create_app  # noqa: E402
from jcp.server.edge import Limits  # noqa: E402
from jcp.server.routes import futures as future_routes  # noqa: E402
from jcp.server.scheduler import Scheduler  # noqa: E402
from jcp.server.state import ModelRecord, StateStore  # noqa: E402

MODEL = "jcp-tiny"
KEYS = {"tml-alice": "alice", "tml-bob": "bob"}
LIMITS = Limits(body_bytes=1 << 20, futures=64)
CONTEXT = 64


@pytest.fixture(scope="module")
def env():
    store = StateStore(tempfile.mkdtemp(prefix="jcp-edge-"), KEYS)
    sched, futures = Scheduler(), FutureTable(LIMITS.futures)
    hot = create_app(store, sched, futures, ServedModel(MODEL, CONTEXT, 8, None), LIMITS)
    handed = []

    def worker():
        while (got := sched.next_work(timeout=0.1)) is not None:
            for w in got[0] + got[1]:
                handed.append(w)
                futures.complete(w.request_id, ("error", "stub worker", "user"))

    thread = threading.Thread(target=worker, name="stub-worker", daemon=True)
    thread.start()
    state = {"store": store, "sched": sched, "handed": handed, "hot": hot}
    for who in ("alice", "bob"):
        sid = store.new_session(who)
        mid = store.model_id(sid, 0)
        store.add_model(ModelRecord(mid, who, MODEL, 4, session_id=sid))
        state[who] = {
            "session": sid,
            "model": mid,
            "sampler": store.add_sampler(who, MODEL, None, None, sid),
        }
    for kind, name in (("weights", "ck"), ("external_weights", "ex")):
        with store.saving("alice", state["alice"]["model"], kind, name) as (path, folder):
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, "adapter_config.json"), "w") as f:
                f.write("{}")
        state["alice"][kind] = path
    with TestClient(hot, raise_server_exceptions=False) as client:
        state["client"] = client
        yield state
    sched.close()
    thread.join(5)


def post(env, route: str, body=None, key: str = "tml-alice", **kw):
    if body is not None:
        kw["content"] = json.dumps(body)
    return env["client"].post(
        f"/api/v1/{route}",
        headers={"X-API-Key": key, "Content-Type": "application/json", **kw.pop("headers", {})},
        **kw,
    )


def outcome(env, answer, key: str = "tml-alice") -> tuple[int, str]:
    """(HTTP status, detail) of a refusal, or (200, error) of a failed future."""
    if answer.status_code != 200 or "request_id" not in answer.json():
        return answer.status_code, answer.text
    r = post(env, "retrieve_future", {"request_id": answer.json()["request_id"]}, key)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out.get("category") == "user", out
    return 200, out["error"]


def sample_body(env, **fields) -> dict:
    return {
        "sampling_session_id": env["alice"]["sampler"],
        "prompt": {"chunks": [{"tokens": [1, 2]}]},
        "sampling_params": {"max_tokens": 2},
        **fields,
    }


# ---------------------------------------------------------------------- sizes


def sparse_target(shape, col: int = 0) -> dict:
    return {
        "data": [7],
        "dtype": "int64",
        "shape": shape,
        "sparse_crow_indices": [0, 1],
        "sparse_col_indices": [col],
    }


@pytest.mark.parametrize("shape", [[1, 10**7], [1, 2**40], [1, 65], [10**6, 4]])
def test_sparse_target_shape_is_checked_before_anything_is_allocated(env, shape):
    """A CSR target_prompt_logprobs whose shape says [1, 10**7] for a 2-token prompt: the
    old decoder filled a shape[0] × shape[1] int64 array before K ≤ 64 was checked (80 MB
    here; [1, 2**40] raised MemoryError, a 500). Refused naming the shape, allocating
    next to nothing."""
    body = sample_body(env, target_prompt_logprobs=sparse_target(shape, col=shape[1] - 1))
    assert len(json.dumps(body)) < 400
    tracemalloc.start()
    try:
        with pytest.raises(wire.WireError, match=r"target_prompt_logprobs\.shape"):
            wire.decode_sample(body)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak
    # The same body through the route: a failed future naming the field, at once.
    t0 = time.monotonic()
    status, detail = outcome(env, post(env, "asample", body))
    assert (status, "target_prompt_logprobs" in detail) == (200, True), detail
    assert time.monotonic() - t0 < 2


def test_a_sparse_target_of_the_prompts_shape_still_decodes(env):
    ids = wire.decode_sample(sample_body(env, target_prompt_logprobs=sparse_target([1, 4], 3)))
    np.testing.assert_array_equal(ids.target_prompt_logprobs.ids, [[-1, -1, -1, 7]])
    with pytest.raises(wire.WireError, match="malformed CSR"):
        wire.decode_sample(
            sample_body(
                env,
                target_prompt_logprobs={**sparse_target([1, 4]), "sparse_crow_indices": [0, 1, 1]},
            )
        )


@pytest.mark.parametrize("shape", [[2**32, 2**32], [-2, -3], [0, -5]])
def test_a_dense_tensor_shape_must_match_its_bytes_exactly(shape):
    """np.prod wrapped [2**32, 2**32] to 0, which matched an empty tensor; the reshape
    that followed raised ValueError outside WireError (a 500). Negative dims likewise."""
    msg = pb.ForwardBackwardRequest(model_id="m", seq_id=1, loss_fn="cross_entropy")
    d = msg.data.add()
    d.model_input.add().encoded_text.tokens = np.arange(6, dtype=np.int32).tobytes()
    t = d.loss_fn_inputs["target_tokens"]
    n = 6 if shape == [-2, -3] else 0
    t.dense, t.dtype, t.shape[:] = np.zeros(n, np.int64).tobytes(), pb.DTYPE_INT64, shape
    head = wire.decode_forward_backward_head(msg.SerializeToString())
    with pytest.raises(wire.WireError, match="shape"):
        wire.decode_forward_backward(head, 4)


def test_a_list_of_bad_items_is_refused_at_the_first():
    """pydantic builds one error per bad item: 200,000 bad tokens (a 1 MB body) cost
    hundreds of MB of error records and seconds on the event loop. One error now."""
    body = {
        "sampling_session_id": "x",
        "prompt": {"chunks": [{"tokens": ["a"] * 200_000}]},
        "sampling_params": {"max_tokens": 1},
    }
    with pytest.raises(ValidationError) as ei:
        edge_lib.Sample.model_validate(body)
    assert ei.value.error_count() == 1
    with pytest.raises(edge_lib.Refused, match=r"tokens\.0") as ei:
        edge_lib.parse(edge_lib.Sample, body, "asample")
    assert len(str(ei.value)) < 300


@pytest.mark.parametrize(
    "model, field, many",
    [
        ("CreateSession", "user_metadata", {str(i): i for i in range(200_000)}),
        ("CreateSession", "tags", ["t"] * 200_000),
        ("RetrieveFutures", "retrieved_request_ids", ["r"] * 200_000),
        ("ChatCompletion", "chat_template_kwargs", {str(i): i for i in range(200_000)}),
    ],
)
def test_counts_are_refused_before_any_item_is_validated(model, field, many):
    """A 200,000-key user_metadata was validated item by item (685 ms holding the GIL in the
    parse thread) before a check after validation refused it. Counts are now bounded first:
    pydantic's too_long (its length check, made before the items) is the refusal, naming
    the field, and a body within the bound is accepted."""
    cls = getattr(edge_lib, model)
    base = {
        "CreateSession": {},
        "RetrieveFutures": {"target": {"sampling_session_id": "s"}},
        "ChatCompletion": {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    }[model]
    small = dict(list(many.items())[:8]) if isinstance(many, dict) else many[:8]
    assert getattr(cls.model_validate({**base, field: small}), field) == small
    with pytest.raises(ValidationError) as ei:
        cls.model_validate({**base, field: many})
    assert [e["type"] for e in ei.value.errors()] == ["too_long"]
    with pytest.raises(edge_lib.Refused, match=field):
        edge_lib.parse(cls, {**base, field: many}, "route")


# ---------------------------------------------------------------------- the event loop


def fb_request(model: str, seq: int, datums: int, length: int) -> bytes:
    """A protobuf forward request of `datums` datums of `length` tokens."""
    msg = pb.ForwardBackwardRequest(model_id=model, seq_id=seq, loss_fn="cross_entropy")
    for _ in range(datums):
        d = msg.data.add()
        d.model_input.add().encoded_text.tokens = np.arange(length, dtype=np.int32).tobytes()
        t = d.loss_fn_inputs["target_tokens"]
        t.dense, t.dtype, t.shape[:] = np.zeros(length, np.int64).tobytes(), pb.DTYPE_INT64, []
    return msg.SerializeToString()


def test_a_large_body_is_parsed_off_the_event_loop(env, monkeypatch):
    """alice's multi-MiB bodies were decoded on the event loop (JSON, protobuf, the datum
    and token loops): bob's small request waited behind each. A body over OFF_LOOP_BYTES
    is now parsed in a thread: while it parses (held here for 1 s), bob is served; a small
    body is still parsed on the loop; and the refusals are the same words either way."""
    from jcp.server import asgi

    where, gate = [], threading.Event()
    parse_json, decode_head = edge_lib.parse_json, wire.decode_forward_backward_head

    def on_loop() -> bool:
        try:
            asyncio.get_running_loop()
            return True
        except RuntimeError:
            return False

    def slow(raw):
        where.append((len(raw), on_loop()))
        if len(raw) > asgi.OFF_LOOP_BYTES:
            gate.wait(5)  # a long parse (sleeping: the GIL is free for the loop)
        return raw

    monkeypatch.setattr(edge_lib, "parse_json", lambda raw: parse_json(slow(raw)))
    monkeypatch.setattr(wire, "decode_forward_backward_head", lambda raw: decode_head(slow(raw)))
    big_prompt = sample_body(env, prompt={"chunks": [{"tokens": [5] * 40_000}]})
    mid = env["alice"]["model"]
    big_fb = fb_request(mid, env["sched"].next_seq(mid), 64, 400)
    assert min(len(json.dumps(big_prompt)), len(big_fb)) > asgi.OFF_LOOP_BYTES
    for route, kw in (
        ("asample", {"body": big_prompt}),
        (
            "forward_backward",
            {"content": big_fb, "headers": {"Content-Type": "application/x-protobuf"}},
        ),
    ):
        answers = []
        alice = threading.Thread(target=lambda: answers.append(post(env, route, **kw)))
        where.clear()
        alice.start()
        try:
            deadline = time.monotonic() + 5
            while not where and time.monotonic() < deadline:
                time.sleep(0.01)
            t0 = time.monotonic()
            info = post(env, "get_info", {"model_id": env["bob"]["model"]}, "tml-bob")
            took = time.monotonic() - t0
        finally:
            gate.set()
            alice.join(10)
            gate.clear()
        assert info.status_code == 200 and took < 1.0, (route, took)
        assert where[0] == (where[0][0], False), (route, where)  # alice's: in a thread
        assert (small := [w for w in where if w[0] < 1000]) and all(s[1] for s in small), where
        status, detail = outcome(env, answers[0])
        if route == "asample":  # refused as before: the prompt exceeds the context
            assert status == 200 and "max_context_length" in detail, detail
        else:  # queued as before, in the model's order
            assert outcome(env, answers[0]) == (200, "stub worker")


def test_turns_give_way_to_the_workers_light_work(monkeypatch):
    """Host only: while the worker runs bob's light step (LightWork.running), only bob's
    waiters get turns; alice's keep their place and get theirs once it ends — or once it
    has run HOLD_MAX_S, so that a long unit cannot keep the loop from her. Without light
    work running, turns rotate as before (the first waiter first)."""
    from jcp.server import scheduler
    from jcp.server.asgi import Turns

    light = scheduler.LightWork()
    turns = Turns(light)

    async def run(light_for, end_after_s):
        order = []

        async def one(who, i):
            await turns.wait(who)
            order.append((who, i, time.monotonic()))

        with light.running(light_for) if light_for else contextlib.nullcontext():
            tasks = [
                asyncio.create_task(one(w, i))
                for w, i in [("alice", 0), ("alice", 1), ("bob", 0), ("bob", 1)]
            ]
            await asyncio.sleep(end_after_s)
            ended = time.monotonic()
        await asyncio.gather(*tasks)
        return [(w, i) for w, i, _ in order], [t >= ended for w, _, t in order if w == "alice"]

    assert asyncio.run(run(None, 0))[0] == [("alice", 0), ("bob", 0), ("alice", 1), ("bob", 1)]
    order, after_end = asyncio.run(run({"bob"}, 0.02))
    assert order == [("bob", 0), ("bob", 1), ("alice", 0), ("alice", 1)], order
    assert all(after_end)  # alice's turns came once bob's step ended
    monkeypatch.setattr(scheduler, "HOLD_MAX_S", 0.01)
    order, after_end = asyncio.run(run({"bob"}, 0.2))  # a unit that runs past HOLD_MAX_S
    assert order[:2] == [("bob", 0), ("bob", 1)] and not any(after_end), (order, after_end)


def test_turns_go_round_robin_over_the_waiting_tenants():
    """Host only: whatever order the waiters came in, turns rotate over the tenants with
    waiters (one waiter each), a cancelled waiter takes no turn, a lone waiter gets its
    turn, and so does one on a new loop after a loop stopped with a turn still to give;
    two loops at once each give their own waiters turns."""
    from jcp.server.asgi import Turns

    turns = Turns()

    async def main():
        order = []

        async def one(who, i):
            await turns.wait(who)
            order.append((who, i))

        tasks = [asyncio.create_task(one("alice", i)) for i in range(6)]
        tasks += [asyncio.create_task(one("bob", 0)), asyncio.create_task(one("carol", 0))]
        tasks += [asyncio.create_task(one("bob", 1))]
        await asyncio.sleep(0)  # every waiter is queued
        tasks[1].cancel()  # alice's second left before her turn
        await asyncio.gather(*tasks, return_exceptions=True)
        await one("dave", 0)
        assert turns.waiting() == 0
        return order

    order = asyncio.run(main())
    assert order == [
        ("alice", 0),
        ("bob", 0),
        ("carol", 0),
        ("alice", 2),
        ("bob", 1),
        ("alice", 3),
        ("alice", 4),
        ("alice", 5),
        ("dave", 0),
    ], order
    stopped = asyncio.new_event_loop()
    waiter = stopped.create_task(turns.wait("erin"))
    stopped.call_soon(stopped.stop)  # after erin queued, before her turn is given
    stopped.run_forever()
    waiter.cancel()
    stopped.close()
    asyncio.run(asyncio.wait_for(turns.wait("frank"), 5))

    def busy_loop(done):  # two live loops at once: each gives its own waiters turns
        async def many():
            waiters = [asyncio.ensure_future(turns.wait(w)) for w in ["alice", "bob"] * 2000]
            await asyncio.sleep(0)  # every waiter queued
            both.wait(5)  # the other loop's too
            await asyncio.gather(*waiters)

        asyncio.run(asyncio.wait_for(many(), 10))
        done.append(True)

    done, both = [], threading.Barrier(2)
    threads = [threading.Thread(target=busy_loop, args=(done,)) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert done == [True, True]


def test_a_tenants_burst_does_not_queue_another_tenants_request_behind_it(env, monkeypatch):
    """alice's burst of samples reaches the event loop together (an RL step's prompts;
    hundreds of them held bob's request up to 90 ms under a hostile neighbour): bob's
    sample, sent last, is handled second, not after all of hers."""
    import httpx

    order, submit = [], env["sched"].submit
    monkeypatch.setattr(env["sched"], "submit", lambda w: (order.append(w.owner), submit(w)))
    bob = {**sample_body(env), "sampling_session_id": env["bob"]["sampler"]}

    async def main():
        transport = httpx.ASGITransport(app=env["hot"])
        async with httpx.AsyncClient(transport=transport, base_url="http://jcp") as client:

            def send(key, body):
                headers = {"X-API-Key": key, "Content-Type": "application/json"}
                return client.post("/api/v1/asample", content=json.dumps(body), headers=headers)

            burst = [send("tml-alice", sample_body(env)) for _ in range(30)]
            return await asyncio.gather(*burst, send("tml-bob", bob))

    answers = asyncio.run(main())
    assert all(a.status_code == 200 and "request_id" in a.json() for a in answers)
    assert sorted(order) == ["alice"] * 30 + ["bob"], order
    assert order.index("bob") <= 1, order


def test_large_and_small_bodies_are_refused_in_the_same_words(env):
    """The same malformed datum in a small and in a large forward_backward body, and a
    bad token in a small and a large sample: one message each way (the decoding is the
    same code, on the loop or in a thread)."""
    from jcp.server import asgi

    mid = env["alice"]["model"]
    details = []
    for datums in (1, 64):
        msg = pb.ForwardBackwardRequest()
        msg.ParseFromString(fb_request(mid, env["sched"].next_seq(mid), datums, 400))
        msg.data[-1].loss_fn_inputs["target_tokens"].shape[:] = [3, 5]
        raw = msg.SerializeToString()
        r = env["client"].post(
            "/api/v1/forward_backward",
            content=raw,
            headers={"X-API-Key": "tml-alice", "Content-Type": "application/x-protobuf"},
        )
        assert outcome(env, r) == (200, "stub worker")  # its seq_id kept in the model's order
        # The refusal the worker was handed in the model's order: its words.
        rid = r.json()["request_id"]
        (refused,) = [w for w in env["handed"] if w.request_id == rid]
        details.append((len(raw) > asgi.OFF_LOOP_BYTES, refused.kind, refused.payload))
    (small, _, a), (large, kind, b) = details
    assert (small, large, kind) == (False, True, "refused")
    assert a.replace("datum 0", "datum 63") == b and "shape" in b, details
    details = []
    for n in (4, 40_000):
        body = sample_body(env, prompt={"chunks": [{"tokens": [5] * n + [-1]}]})
        details.append(outcome(env, post(env, "asample", body)))
    a, b = details
    assert a[1].replace("4", "40000") == b[1] and "tokens" in b[1], details


# ---------------------------------------------------------------------- types

WRONG_TYPES = [  # route, body (A/S/M: alice's model, session, sampler), field named
    ("save_weights_external", {"model_id": ["M"], "path": "x"}, "model_id"),
    ("save_weights_external", {"model_id": {"a": 1}, "path": "x"}, "model_id"),
    ("create_custom_loss", {"session_id": ["S"], "inputs": [], "graph": {}}, "session_id"),
    ("create_custom_loss", {"session_id": {"a": 1}, "inputs": [], "graph": {}}, "session_id"),
    ("cancel_future", {"request_id": ["r"]}, "request_id"),
    ("cancel_future", {"request_id": {"a": 1}}, "request_id"),
    ("copy_weights", {"source_path": "W", "session_id": ["S"], "model_seq_id": 1}, "session_id"),
    ("copy_weights", {"source_path": "W", "session_id": {"a": 1}, "model_seq_id": 1}, "session_id"),
    ("weights_info", {"tinker_path": ["W"]}, "tinker_path"),
    ("retrieve_futures", {"target": {"sampling_session_id": "P"}, "timeout": "1"}, "timeout"),
    ("create_session", {"tags": "x"}, "tags"),
    (
        "asample",
        {
            "sampling_session_id": "P",
            "prompt": {"chunks": [{"tokens": [1]}]},
            "sampling_params": {"max_tokens": 1, "temperature": float("nan")},
        },
        "temperature",
    ),
    ("optim_step", {"model_id": "M", "adam_params": {"learning_rate": 2**64}}, "learning_rate"),
]


@pytest.mark.parametrize("route,body,field", WRONG_TYPES)
def test_every_wrong_type_is_the_clients_fault(env, route, body, field):
    fill = {
        "M": env["alice"]["model"],
        "S": env["alice"]["session"],
        "P": env["alice"]["sampler"],
        "W": env["alice"]["weights"],
    }

    def filled(x):
        if isinstance(x, dict):
            return {k: filled(v) for k, v in x.items()}
        if isinstance(x, list):
            return [filled(v) for v in x]
        return fill.get(x, x) if isinstance(x, str) else x

    status, detail = outcome(env, post(env, route, filled(body)))
    assert status == 200 or 400 <= status < 500, (status, detail)
    assert field in detail, detail


def test_a_seq_id_the_model_can_never_reach_is_refused_not_queued(env):
    """save_weights_external took seq_id 2**70 into the queue: once past the gap timeout
    it became the model's last seq_id and every later request waited 10 s. Beyond the
    window of --max-futures past the next expected seq_id, every route refuses it (and the
    refusal itself is not queued in the model's order)."""
    store, sched = env["store"], env["sched"]
    mid = store.model_id(env["alice"]["session"], 1)
    store.add_model(ModelRecord(mid, "alice", MODEL, 4, session_id=env["alice"]["session"]))
    handed, nxt = len(env["handed"]), 1  # a new model waits for seq_id 1
    for route, body in (
        ("save_weights_external", {"model_id": mid, "path": "x", "seq_id": 2**70}),
        (
            "save_weights_external",
            {"model_id": mid, "path": "x", "seq_id": nxt + LIMITS.futures + 1},
        ),
        ("optim_step", {"model_id": mid, "seq_id": edge_lib.INT32_MAX}),
        ("save_weights", {"model_id": mid, "seq_id": nxt + LIMITS.futures + 1}),
        (
            "load_weights",
            {
                "model_id": mid,
                "path": env["alice"]["weights"],
                "optimizer": False,
                "seq_id": nxt + 10**6,
            },
        ),
    ):
        status, detail = outcome(env, post(env, route, body))
        assert "seq_id" in detail, (route, detail)
    raw = pb.ForwardBackwardRequest(
        model_id=mid, seq_id=edge_lib.INT32_MAX, loss_fn="cross_entropy"
    ).SerializeToString()
    r = env["client"].post(
        "/api/v1/forward_backward",
        content=raw,
        headers={"X-API-Key": "tml-alice", "Content-Type": "application/x-protobuf"},
    )
    assert "seq_id" in outcome(env, r)[1]
    assert all(
        w.seq_id is None or w.seq_id <= nxt + LIMITS.futures for w in env["handed"][handed:]
    ), [w.seq_id for w in env["handed"][handed:]]
    assert sched.next_seq(mid) == nxt
    # Within the window it is still the client's to order.
    ok = post(env, "save_weights", {"model_id": mid, "seq_id": nxt})
    assert outcome(env, ok) == (200, "stub worker")
    assert sched.next_seq(mid) == nxt + 1


# ---------------------------------------------------------------------- fuzzing


@schemathesis.serializer("application/x-protobuf")
def _protobuf(ctx, value):
    return value if isinstance(value, bytes) else str(value).encode()


def real_ids(env, value):
    """Generated string ids swapped for alice's real ones (wrong types kept), so requests
    get past "not found" to the checks behind it."""
    a = env["alice"]
    names = {
        "session_id": a["session"],
        "model_id": a["model"],
        "sampling_session_id": a["sampler"],
        "tinker_path": a["weights"],
        "source_path": a["weights"],
    }
    if isinstance(value, dict):
        return {
            k: names[k] if k in names and isinstance(v, str) else real_ids(env, v)
            for k, v in value.items()
        }
    return value


REQUEST_BUDGET_S = 3.0  # each fuzzed request's, and bob's control requests after it


def test_fuzz_every_route_from_its_schema(env, monkeypatch):
    """Every operation of /openapi.json, 6 positive and 6 negative cases each (seeded): no
    5xx, each answered within its budget, and bob's control requests (healthz, get_info)
    served after every one."""
    monkeypatch.setattr(future_routes, "POLL_S", 0.2)  # long polls answer 408 quickly
    api = schemathesis.openapi.from_dict(env["client"].get("/openapi.json").json())
    client, bob, seen = env["client"], env["bob"], set()
    ops = [r.ok() for r in api.get_all_operations()]
    assert {"/api/v1/asample", "/api/v1/forward_backward", "/api/v1/copy_weights"} <= {
        op.path for op in ops
    }
    for op, mode in itertools.product(ops, schemathesis.GenerationMode):
        fixed = {"path_parameters": {"run": env["alice"]["model"]}} if "{run}" in op.path else {}

        @settings(
            max_examples=6,
            derandomize=True,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(op.as_strategy(mode, **fixed))
        def one(case):
            kw = case.as_transport_kwargs(base_url="http://testserver")
            kw = {
                k: v
                for k, v in kw.items()
                if k in ("method", "url", "params", "json", "content", "data")
            }
            kw["params"] = real_ids(env, kw.get("params") or {})
            if isinstance(kw.get("json"), dict):
                kw["json"] = real_ids(env, kw["json"])
            if isinstance(kw.get("data"), bytes):
                kw["content"] = kw.pop("data")
            headers = {**(case.headers or {}), "X-API-Key": "tml-alice"}
            if case.media_type:
                headers["Content-Type"] = case.media_type
            t0 = time.monotonic()
            r = client.request(headers=headers, **kw)
            took = time.monotonic() - t0
            assert r.status_code < 500, (kw, r.status_code, r.text[:300])
            # A bound, not a speed: a refused body takes milliseconds (a stub worker, no
            # model), but with the suite's other worker compiling on the two cores one
            # took 2.01 s in a clean CI run (2026-12-07); unbounded work runs far past.
            assert took < REQUEST_BUDGET_S, (kw, took)
            seen.add((op.method, op.path, r.status_code // 100))
            t0 = time.monotonic()
            h = client.get("/api/v1/healthz")
            info = client.post(
                "/api/v1/get_info",
                json={"model_id": bob["model"]},
                headers={"X-API-Key": "tml-bob"},
            )
            assert (h.status_code, info.status_code) == (200, 200), (h.text, info.text)
            # The same budget as the request's own: 1.0 s was once exceeded (1.45 s) with
            # the suite's other worker on the two cores; a starved tenant waits seconds.
            assert time.monotonic() - t0 < REQUEST_BUDGET_S

        try:
            one()
        except Unsatisfiable:  # a negative case of an operation with nothing to get wrong
            assert mode is schemathesis.GenerationMode.NEGATIVE, op.path
    # The run reached past the type checks: some requests were accepted.
    assert {("post", "/api/v1/asample", 2), ("post", "/api/v1/optim_step", 2)} <= seen, seen


WRONG = [[], {}, 1.5, True, None, 2**70, -1, "x"]


def example(schema: dict):
    """A valid value of a JSON schema with every optional property present."""
    if "const" in schema or "enum" in schema:
        return schema.get("const", (schema.get("enum") or [None])[0])
    if "anyOf" in schema:
        return example(next(s for s in schema["anyOf"] if s.get("type") != "null"))
    kind = schema.get("type")
    if kind == "object":
        return {k: example(v) for k, v in schema.get("properties", {}).items()}
    if kind == "array":
        return [example(schema.get("items", {}))]
    if kind == "integer":
        return int(max(schema.get("minimum", 1), 1))
    return {"number": 1.0, "string": "x", "boolean": True}.get(kind, {})


def fields(x, at=()):
    """The paths of every value in a JSON body (a list's first item stands for all)."""
    if isinstance(x, dict):
        for k, v in x.items():
            yield at + (k,)
            yield from fields(v, at + (k,))
    elif isinstance(x, list) and x:
        yield at + (0,)
        yield from fields(x[0], at + (0,))


def replaced(x, at, value):
    if not at:
        return value
    out = list(x) if isinstance(x, list) else dict(x)
    out[at[0]] = replaced(x[at[0]], at[1:], value)
    return out


def test_every_field_of_every_route_refuses_every_wrong_type(env, monkeypatch):
    """Every JSON route's body with every optional field present (from /openapi.json),
    then each field, nested ones too, set to each JSON type in turn and to ints beyond
    int64: never a 5xx (which the SDK retries), each answered at once, bob always served."""
    monkeypatch.setattr(future_routes, "POLL_S", 0.2)
    spec = env["client"].get("/openapi.json").json()
    client, sent = env["client"], 0
    for path, methods in spec["paths"].items():
        for method, op in methods.items():
            schema = (
                op.get("requestBody", {})
                .get("content", {})
                .get("application/json", {})
                .get("schema")
            )
            if schema is None:
                continue
            url = path.format(run=env["alice"]["model"], kind="weights", name="ck")
            body = real_ids(env, example(schema))
            for at in fields(body):
                for value in WRONG:
                    t0 = time.monotonic()
                    r = client.request(
                        method,
                        url,
                        json=replaced(body, at, value),
                        headers={"X-API-Key": "tml-alice"},
                    )
                    assert r.status_code < 500, (path, at, value, r.status_code, r.text)
                    assert time.monotonic() - t0 < 2.0, (path, at, value)
                    sent += 1
            info = client.post(
                "/api/v1/get_info",
                json={"model_id": env["bob"]["model"]},
                headers={"X-API-Key": "tml-bob"},
            )
            assert info.status_code == 200, info.text
    assert sent > 500, sent
