"""The ASGI app: Tinker SDK 0.38 routes under /api/v1.

Handlers authenticate, parse, validate what can be checked without the model, and enqueue
a scheduler.Work; they answer with a future ({request_id}) at once and never wait for the
worker. `retrieve_future` long-polls a future for up to POLL_S (below the SDK's 45 s) and
then answers 408, which the SDK retries. A request that fails before it is queued (unknown
model, undecodable body) still gets a future, completed with the error, so the SDK raises
RequestFailedError for that request only. REST routes (training runs, checkpoints, TTLs,
weights info, copies, external-weights download URLs with expiring per-file tokens, kept
per tenant, cancel_future, retrieve_futures) answer from the state store, or wait for the
worker when they touch folders a load might be reading; SDK 0.39's checkpoint search and
external-weights uploads are checkpoint_api's. It must never import jax or the worker.

The sampling hot path — POST asample and retrieve_future, hundreds at once per RL step —
is answered by `HotRoutes`, a plain ASGI layer in front of the FastAPI app: FastAPI's
middleware, routing, dependency solving and response serialization cost more CPU than
these two handlers themselves, and on a CPU host that CPU is taken from the engine.
Every other request goes through FastAPI.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import json
import logging
import os
import secrets
import threading
import time
import uuid
from collections import OrderedDict

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response

from jcp.server import checkpoint_api, edge, openai_api, redact, wire
from jcp.server import text as text_lib
from jcp.server.edge import Limits, Refused
from jcp.server.scheduler import Scheduler, Work
from jcp.server.state import (
    AuthError,
    LimitReached,
    NotFound,
    SessionEnded,
    StateStore,
    age_recipients,
)

POLL_S = 20.0
URL_TTL_S = 15 * 60
# Bounds of each tenant's download tokens and of each sampling session's completion log.
MAX_URL_TOKENS = 4096
KEEP_COMPLETIONS = 20_000
PROTO = "application/x-protobuf"
# Exceptions a handler may raise -> HTTP status; the body is {"detail": message}.
STATUS = ((AuthError, 401), (NotFound, 404), (SessionEnded, 410))
log = logging.getLogger("jcp.serve")


@dataclasses.dataclass(frozen=True)
class ServedModel:
    name: str
    max_context_length: int
    max_rank: int
    tokenizer_id: str | None
    # The adapter files an external-weights upload may hold (None: uploads are refused).
    peft: checkpoint_api.PeftLayout | None = None


class _Entry:
    __slots__ = ("owner", "event", "result", "extra", "group")

    def __init__(self, owner: str, extra: dict, group: str | None = None):
        self.owner, self.extra, self.group = owner, extra, group
        self.event = asyncio.Event()
        self.result = None


class FutureTable:
    """request id -> its eventual result; completed from any thread.

    Bounded per tenant (`per_tenant` entries): a tenant's new request evicts that tenant's
    oldest completed result, never a pending one and never another tenant's; with all of
    its entries pending it is refused (429, which the SDK retries after a pause)."""

    def __init__(self, per_tenant: int = Limits.futures):
        self.per_tenant = per_tenant
        self._entries: dict[str, _Entry] = {}
        self._pending: dict[str, set[str]] = {}  # owner -> pending ids
        self._done: dict[str, OrderedDict[str, None]] = {}  # owner -> completed ids, oldest first
        self._lock = threading.Lock()
        self.loop: asyncio.AbstractEventLoop | None = None
        # (owner, group) -> completions [(cursor, request id, "finished" | "failed")], for
        # retrieve_futures; a group is a sampling session.
        self._logs: dict[tuple, list] = {}
        self._cursor = 0

    def new(self, owner: str, group: str | None = None, **extra) -> str:
        rid = f"req-{uuid.uuid4().hex}"
        with self._lock:
            pending = self._pending.setdefault(owner, set())
            done = self._done.setdefault(owner, OrderedDict())
            if len(pending) + len(done) >= self.per_tenant:
                if not done:
                    raise Refused(
                        429,
                        f"{len(pending)} requests of this tenant are pending "
                        f"(--max-futures {self.per_tenant}); retry when some "
                        "complete",
                    )
                del self._entries[done.popitem(last=False)[0]]
            self._entries[rid] = _Entry(owner, extra, group)
            pending.add(rid)
        return rid

    def get(self, rid: str, owner: str) -> _Entry:
        with self._lock:
            e = self._entries.get(rid)
        if e is None or e.owner != owner:
            raise NotFound(f"request {rid!r} not found")
        return e

    def count(self, owner: str) -> int:
        with self._lock:
            return len(self._pending.get(owner, ())) + len(self._done.get(owner, ()))

    def complete(self, rid: str, result: tuple) -> None:
        with self._lock:
            e = self._entries.get(rid)
            if e is None or rid not in self._pending[e.owner]:
                return
            self._pending[e.owner].discard(rid)
            self._done[e.owner][rid] = None

        def done():
            e.result = result
            e.event.set()
            if e.group is not None:
                self._cursor += 1
                log = self._logs.setdefault((e.owner, e.group), [])
                log.append(
                    (
                        self._cursor,
                        rid,
                        "failed" if result[0] == "error" else "finished",
                        len(result[1]) if result[0] == "proto" else None,
                    )
                )
                del log[:-KEEP_COMPLETIONS]

        if self.loop is not None:
            self.loop.call_soon_threadsafe(done)

    def forget(self, rid: str, owner: str) -> None:
        """Drop a completed request's entry (an OpenAI route read its result); a pending one
        stays."""
        with self._lock:
            if self._done.get(owner, {}).pop(rid, 0) is None:
                del self._entries[rid]

    def fail_pending(self, message: str) -> None:
        """Complete every pending request with `message` (category "server")."""
        with self._lock:
            pending = [rid for ids in self._pending.values() for rid in ids]
        for rid in pending:
            self.complete(rid, ("error", message, "server"))

    def forget_groups(self, owner: str, groups: list[str]) -> None:
        """Drop the completion logs of sampling sessions the store forgot (any thread)."""

        def forget():
            for g in groups:
                self._logs.pop((owner, g), None)

        if self.loop is not None:
            self.loop.call_soon_threadsafe(forget)
        else:
            forget()

    def completions(self, owner: str, group: str, after: int) -> tuple[list[dict], int]:
        """Completions of a group after cursor `after` -> (FutureCompletion dicts, cursor).
        Runs on the event loop (like `done`), so no lock is needed."""
        log = self._logs.get((owner, group), [])
        new = [c for c in log if c[0] > after]
        out = [
            {
                "state": st,
                "request_id": rid,
                **({"response_payload_uncompressed_size": n} if st == "finished" else {}),
            }
            for _, rid, st, n in new
        ]
        return out, (new[-1][0] if new else after)


class UrlTokens:
    """Download-URL tokens -> (tenant, run, checkpoint id, file, expiry), at most
    `per_tenant` per tenant: a tenant's new token drops that tenant's expired tokens, then
    its oldest — never another tenant's. Used on the event loop only."""

    def __init__(self, per_tenant: int = MAX_URL_TOKENS):
        self.per_tenant = per_tenant
        self._tenant: dict[str, str] = {}  # token -> tenant
        self._mine: dict[str, OrderedDict[str, tuple]] = {}  # tenant -> tokens, oldest first

    def new(self, owner: str, run: str, ckpt: str, file: str, expires: float) -> str:
        tok = secrets.token_urlsafe(32)
        mine = self._mine.setdefault(owner, OrderedDict())
        mine[tok] = (owner, run, ckpt, file, expires)
        self._tenant[tok] = owner
        now = time.time()
        while mine and (len(mine) > self.per_tenant or next(iter(mine.values()))[4] < now):
            del self._tenant[mine.popitem(last=False)[0]]
        return tok

    def get(self, token: str) -> tuple | None:
        owner = self._tenant.get(token)
        return None if owner is None else self._mine[owner].get(token)


def create_app(
    store: StateStore,
    sched: Scheduler,
    futures: FutureTable,
    served: ServedModel,
    limits: Limits = Limits(),  # noqa: B008 — frozen, built once
    alive=lambda: True,
    failure=lambda: None,
) -> HotRoutes:
    """alive() -> whether the worker can serve (/healthz reports it); failure() -> why a
    multi-process job cannot (a follower died or stopped answering): /healthz says so and
    every new request is refused with it (503)."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        futures.loop = asyncio.get_running_loop()
        yield

    app = FastAPI(title="jcp-serve", docs_url=None, redoc_url=None, lifespan=lifespan)

    def owner(request: Request) -> str:
        return store.owner_of_key(request.headers.get("x-api-key"))

    # 410 (SessionEnded) is what stops the SDK's heartbeat loop for a session.
    def answer(status: int):
        async def handler(request, exc):
            return JSONResponse(
                {"detail": redact.client_message(str(exc), store.state_dir)}, status_code=status
            )

        return handler

    for exc_type, status in STATUS:
        app.exception_handler(exc_type)(answer(status))

    @app.exception_handler(Refused)
    @app.exception_handler(LimitReached)
    async def _refused(request, exc):
        return JSONResponse(
            {"detail": redact.client_message(str(exc), store.state_dir)}, status_code=exc.status
        )

    store.on_forget_samplers = futures.forget_groups
    # The model's tokenizer and chat template (--hf-model): the OpenAI routes' text, and
    # the Tinker SamplingParams.stop strings. None: token ids only.
    try:
        text = text_lib.Text.load(served.tokenizer_id)
    except Exception as e:  # noqa: BLE001 — a broken tokenizer disables text, not the server
        log.error(
            "the tokenizer in %s could not be loaded (%s); text routes are off",
            served.tokenizer_id,
            e,
        )
        text = None

    def check_seq(model_id: str, seq: int | None) -> None:
        """Refuse a seq_id the model's queue could never reach: more than --max-futures past
        the one it waits for (a tenant has no more requests outstanding). Queued, it would
        become the model's last seq_id and every later request would wait out the gap
        timeout."""
        expected = sched.next_seq(model_id)
        if seq is not None and seq > expected + limits.futures:
            raise Refused(
                422,
                f"seq_id {seq} is more than {limits.futures} (--max-futures) "
                f"past this model's next seq_id {expected}",
            )

    def owned_slot(who: str, body: dict) -> tuple[str | None, int | None]:
        """(model_id, seq_id) of a body whose model `who` owns and whose seq_id is valid,
        else (None, None): what a refusal needs to keep its place in the model's order."""
        mid, seq = body.get("model_id"), body.get("seq_id")
        if (
            not isinstance(mid, str)
            or not isinstance(seq, int)
            or isinstance(seq, bool)
            or not 0 <= seq <= edge.INT32_MAX
        ):
            return None, None
        try:
            store.model(mid, who)
            check_seq(mid, seq)
        except (NotFound, Refused):
            return None, None
        return mid, seq

    def failed(
        who: str, message: str, model_id: str | None = None, seq_id: int | None = None, **extra
    ) -> dict:
        """A future completed with `message` (category "user"). With the model and seq_id
        known it is completed by the worker in the model's order, so the model's next
        request never waits for a seq_id that was refused here."""
        rid = futures.new(who, **extra)
        if model_id is not None and seq_id is not None:
            sched.submit(
                Work(
                    request_id=rid,
                    kind="refused",
                    model_id=model_id,
                    seq_id=seq_id,
                    payload=message,
                    owner=who,
                )
            )
        else:
            futures.complete(rid, ("error", message, "user"))
        return {"request_id": rid, **extra}

    def enqueue(
        who: str, kind: str, model_id, seq_id, payload, loss_key=None, group=None, **extra
    ) -> dict:
        down = failure()
        if down is not None:
            raise Refused(503, down)
        rid = futures.new(who, group, **extra)
        sched.submit(
            Work(
                request_id=rid,
                kind=kind,
                model_id=model_id,
                seq_id=seq_id,
                payload=payload,
                owner=who,
                loss_key=loss_key,
            )
        )
        out = {"request_id": rid, **extra}
        if model_id is not None:
            out["model_id"] = model_id
        return out

    def takes(model: type | None, content: str = JSON) -> dict:
        """Route kwargs that declare its body in the OpenAPI schema (/openapi.json, which
        the fuzz tests generate requests from); the handler still parses the body itself
        (edge.parse: refusals name the field; SDK calls fail as futures)."""
        schema = (
            edge.json_schema(model) if model is not None else {"type": "string", "format": "binary"}
        )
        return {
            "openapi_extra": {
                "requestBody": {"required": True, "content": {content: {"schema": schema}}}
            }
        }

    async def body_bytes(request: Request) -> bytes:
        return await read_body(
            request.headers.get("content-length", ""), request.stream(), limits.body_bytes
        )

    async def body_json(request: Request) -> dict:
        return edge.parse_json(await body_bytes(request))

    # ------------------------------------------------------------------ service

    # GET and POST, registered apart: one api_route gives both one OpenAPI operation id.
    @app.get("/api/v1/healthz")
    @app.post("/api/v1/healthz", operation_id="healthz_post")
    async def healthz():
        if not alive():
            return JSONResponse(
                {
                    "status": "unhealthy",
                    "detail": failure()
                    or "the worker thread is not running; no request will be served",
                },
                status_code=503,
            )
        return {"status": "ok"}

    @app.post("/api/v1/client/config")
    async def client_config(request: Request):
        owner(request)
        # zstd request bodies: the SDK compresses fwd/bwd payloads when we ask.
        # custom_loss_server_side: create_custom_loss uploads the traced loss, and
        # forward_backward_custom runs it here in one pass (engine._create_custom_loss).
        return {
            "pjwt_auth_enabled": False,
            "proto_compress_fwdbwd": True,
            "custom_loss_server_side": True,
        }

    @app.post("/api/v1/client/dynamic_config")
    async def dynamic_config(request: Request):
        owner(request)
        # The SDK then sends cancel_future for a sample future it abandons (cancel or
        # timeout), and the engine frees its slots at the next step boundary.
        return {"sample_cancel_enabled": True}

    @app.post("/api/v1/telemetry")
    async def telemetry():
        return {"status": "accepted"}

    @app.get("/api/v1/get_server_capabilities")
    async def capabilities(request: Request):
        owner(request)
        return {
            "supported_models": [
                {
                    "model_name": served.name,
                    "max_context_length": served.max_context_length,
                    "trainable": True,
                    "sampleable": True,
                }
            ]
        }

    @app.post("/api/v1/create_session", **takes(edge.CreateSession))
    async def create_session(request: Request):
        who = owner(request)
        edge.parse(edge.CreateSession, await body_json(request), "create_session")
        return {"type": "create_session", "session_id": store.new_session(who)}

    @app.post("/api/v1/session_heartbeat", **takes(edge.SessionRef))
    async def heartbeat(request: Request):
        who, body = owner(request), await body_json(request)
        store.check_session(edge.parse(edge.SessionRef, body, "session_heartbeat").session_id, who)
        return {"type": "session_heartbeat"}

    @app.post("/api/v1/sessions/{session_id}/finish")
    async def finish(session_id: str, request: Request):
        """The session's models are unloaded after their queued work (their checkpoints
        stay loadable); finishing twice is harmless."""
        who = owner(request)
        try:
            store.check_session(session_id, who)
        except SessionEnded:
            return {}
        store.end_session(session_id)
        enqueue(who, "end_session", None, None, {"session_id": session_id})
        return {}

    # ------------------------------------------------------------------ training

    @app.post("/api/v1/create_model", **takes(edge.CreateModel))
    async def create_model(request: Request):
        who, body = owner(request), await body_json(request)
        req = edge.parse(edge.CreateModel, body, "create_model")
        store.check_session(req.session_id, who)
        mid = store.model_id(req.session_id, req.model_seq_id)
        if mid in store.models:
            return failed(
                who,
                f"model_seq_id {req.model_seq_id} of session "
                f"{req.session_id!r} is already used by model {mid!r}",
                model_id=mid,
            )
        rank = req.lora_config.rank if req.lora_config is not None else None
        if rank is None or not 1 <= rank <= served.max_rank:
            return failed(
                who,
                f"lora_config.rank {rank!r} must be an integer in [1, "
                f"{served.max_rank}] (--max-rank)",
                model_id=mid,
            )
        try:
            store.check_room(who, new_run=True)
        except LimitReached as e:
            return failed(who, str(e), model_id=mid)
        return enqueue(who, "create_model", mid, None, req.model_dump(exclude_none=True))

    @app.post("/api/v1/get_info", **takes(edge.ModelRef))
    async def get_info(request: Request):
        who, body = owner(request), await body_json(request)
        rec = store.model(edge.parse(edge.ModelRef, body, "get_info").model_id, who)
        return {
            "type": "get_info",
            "model_id": rec.model_id,
            "is_lora": True,
            "lora_rank": rec.rank,
            "model_name": rec.base_model,
            "model_data": {
                "arch": "qwen",
                "model_name": rec.base_model,
                "tokenizer_id": served.tokenizer_id,
            },
        }

    @app.post("/api/v1/forward_backward", **takes(None, PROTO))
    async def forward_backward(request: Request):
        who = owner(request)
        raw = await body_bytes(request)
        if request.headers.get("content-encoding", "").lower() == "zstd":
            raw = edge.decompress(raw, limits.body_bytes)
        try:
            head = wire.decode_forward_backward_head(raw)
        except wire.WireError as e:
            return failed(who, str(e))
        try:
            store.model(head.model_id, who)
            check_seq(head.model_id, head.seq_id)
        except (NotFound, Refused) as e:
            return failed(who, str(e))
        try:
            req = wire.decode_forward_backward(head, limits.datums)
        except wire.WireError as e:
            return failed(who, str(e), model_id=head.model_id, seq_id=head.seq_id)
        kind = "forward" if req.forward_only else "forward_backward"
        key = (req.loss_fn, tuple(sorted((req.loss_fn_config or {}).items())))
        return enqueue(who, kind, req.model_id, req.seq_id, req, loss_key=key)

    def model_op(kind: str, schema: type[edge.ModelRef]):
        async def handler(request: Request):
            who, body = owner(request), await body_json(request)
            try:
                req = edge.parse(schema, body, kind)
                store.model(req.model_id, who)
                check_seq(req.model_id, req.seq_id)
            except (Refused, NotFound) as e:
                return failed(who, str(e), *owned_slot(who, body))
            return enqueue(who, kind, req.model_id, req.seq_id, req.model_dump(exclude_none=True))

        handler.__name__ = kind
        return handler

    for kind, schema in (
        ("optim_step", edge.OptimStep),
        ("save_weights", edge.SaveWeights),
        ("save_weights_for_sampler", edge.SaveWeights),
        ("unload_model", edge.ModelRef),
    ):
        app.post(f"/api/v1/{kind}", **takes(schema))(model_op(kind, schema))

    @app.post("/api/v1/save_weights_external", **takes(edge.SaveWeightsExternal))
    async def save_weights_external(request: Request):
        who, body = owner(request), await body_json(request)
        try:
            req = edge.parse(edge.SaveWeightsExternal, body, "save_weights_external")
            store.model(req.model_id, who)
            check_seq(req.model_id, req.seq_id)
            if req.age_encryption_recipients is not None:
                age_recipients(req.age_encryption_recipients)
        except (Refused, NotFound, ValueError) as e:
            return failed(who, str(e), *owned_slot(who, body))
        return enqueue(
            who,
            "save_weights_external",
            req.model_id,
            req.seq_id,
            req.model_dump(exclude_none=True),
        )

    @app.post("/api/v1/load_weights", **takes(edge.LoadWeights))
    async def load_weights(request: Request):
        who, body = owner(request), await body_json(request)
        try:
            req = edge.parse(edge.LoadWeights, body, "load_weights")
            store.resolve(req.path, who, "weights")
            if req.session_id is not None:
                store.check_session(req.session_id, who)
                mid = store.model_id(req.session_id, req.model_seq_id)
                store.check_room(who, new_run=True)
                return enqueue(who, "load_weights", mid, None, req.model_dump(exclude_none=True))
            if req.model_id is None:
                raise Refused(422, "load_weights: needs model_id or session_id")
            store.model(req.model_id, who)
            check_seq(req.model_id, req.seq_id)
        except (Refused, NotFound, LimitReached) as e:
            return failed(who, str(e), *owned_slot(who, body))
        return enqueue(
            who, "load_weights", req.model_id, req.seq_id, req.model_dump(exclude_none=True)
        )

    @app.post("/api/v1/create_custom_loss", **takes(edge.CreateCustomLoss))
    async def create_custom_loss(request: Request):
        who, body = owner(request), await body_json(request)
        req = edge.parse(edge.CreateCustomLoss, body, "create_custom_loss")
        store.check_session(req.session_id, who)
        return enqueue(who, "create_custom_loss", None, None, req.model_dump(exclude_none=True))

    # ------------------------------------------------------------------ sampling

    @app.post("/api/v1/create_sampling_session", **takes(edge.CreateSamplingSession))
    async def create_sampling_session(request: Request):
        who, body = owner(request), await body_json(request)
        req = edge.parse(edge.CreateSamplingSession, body, "create_sampling_session")
        store.check_session(req.session_id, who)
        if req.model_path:
            # Named sampler weights, or an uploaded (or exported) PEFT folder: the worker
            # loads either with load_peft.
            kind = (
                "external_weights"
                if req.model_path.split("/")[3:4] == ["external_weights"]
                else "sampler_weights"
            )
            folder, base = store.resolve(req.model_path, who, kind)
        else:
            folder, base = None, req.base_model
            if base != served.name:
                raise NotFound(f"base model {base!r} not found; this server serves {served.name!r}")
        return {
            "type": "create_sampling_session",
            "sampling_session_id": store.add_sampler(
                who, base or served.name, req.model_path, folder, req.session_id
            ),
        }

    @app.get("/api/v1/samplers/{sampler_id}")
    async def get_sampler(sampler_id: str, request: Request):
        rec = store.sampler(sampler_id, owner(request))
        return {
            "sampler_id": rec.sampler_id,
            "base_model": rec.base_model,
            "model_path": rec.model_path,
        }

    def asample(who: str, body: dict) -> dict:
        """POST asample (HotRoutes)."""
        n = body.get("num_samples", 1)
        # The failed future still answers one id per sample the client asked for, but
        # never more than the bound (the ids are built here, on the event loop).
        n = (
            n
            if isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= limits.num_samples
            else 1
        )
        try:
            req = edge.parse(edge.Sample, body, "asample")
            if req.num_samples > limits.num_samples:
                raise Refused(
                    422,
                    f"asample: num_samples {req.num_samples} exceeds "
                    f"{limits.num_samples} (--max-num-samples)",
                )
            length = sum(len(c.tokens) for c in req.prompt.chunks)
            cap = served.max_context_length
            if length + req.sampling_params.max_tokens > cap:
                raise Refused(
                    422,
                    f"asample: {length} prompt tokens + sampling_params."
                    f"max_tokens {req.sampling_params.max_tokens} exceed the "
                    f"max_context_length of {cap} tokens",
                )
            store.sampler(req.sampling_session_id, who)
            args = wire.decode_sample(body)
            watch = None
            if args.stop_strings:  # text stops, through the model's tokenizer
                if text is None:
                    raise Refused(
                        422,
                        "asample: sampling_params.stop: string stops need the "
                        "model's tokenizer (serve --hf-model with a "
                        "tokenizer.json); pass token ids",
                    )
                watch = text_lib.StopWatch(text, args.stop_strings)
        except (Refused, wire.WireError, NotFound) as e:
            return failed(who, str(e), sample_sequence_ids=sequence_ids(n))
        return enqueue(
            who,
            "sample",
            None,
            None,
            {
                "sampling_session_id": req.sampling_session_id,
                "args": args,
                **({"watch": watch} if watch is not None else {}),
            },
            group=req.sampling_session_id,
            sample_sequence_ids=sequence_ids(n),
        )

    # ------------------------------------------------------------------ REST: runs, checkpoints

    async def run_now(who: str, kind: str, payload: dict):
        """Queue unordered work for the worker and wait for its result (REST routes that
        answer directly, not with a future)."""
        rid = enqueue(who, kind, None, None, payload)["request_id"]
        entry = futures.get(rid, who)
        await entry.event.wait()
        kind, *rest = entry.result
        if kind == "error":
            raise Refused(422, rest[0])
        return rest[0]

    @app.get("/api/v1/training_runs")
    async def training_runs(request: Request, limit: int = 20, offset: int = 0):
        if not (1 <= limit <= 1000 and offset >= 0):
            raise Refused(422, "limit must be in [1, 1000] and offset ≥ 0")
        return store.training_runs(owner(request), offset, limit)

    @app.get("/api/v1/training_runs/{run}")
    async def training_run(run: str, request: Request):
        return store.training_run(run, owner(request))

    @app.get("/api/v1/training_runs/{run}/checkpoints")
    async def checkpoints(run: str, request: Request):
        return store.checkpoints(run, owner(request))

    @app.delete("/api/v1/training_runs/{run}/checkpoints/{kind}/{name}")
    async def delete_checkpoint(run: str, kind: str, name: str, request: Request):
        who = owner(request)
        folder = store.checkpoint_folder(run, f"{kind}/{name}", who)
        await run_now(who, "delete_checkpoint", {"folder": folder})
        return Response(status_code=200)

    @app.put("/api/v1/training_runs/{run}/checkpoints/{kind}/{name}/ttl", **takes(edge.SetTtl))
    async def set_ttl(run: str, kind: str, name: str, request: Request):
        who, body = owner(request), await body_json(request)
        seconds = edge.parse(edge.SetTtl, body, "set_ttl").ttl_seconds
        store.set_ttl(run, f"{kind}/{name}", who, seconds)
        return Response(status_code=200)

    def checkpoint(path, who: str) -> tuple[list[str], str]:
        """tinker://<run>/<kind>/<name> of a checkpoint `who` owns -> ([run, kind, name],
        its folder); NotFound otherwise."""
        parts = path[len("tinker://") :].split("/") if isinstance(path, str) else []
        if len(parts) != 3:
            raise NotFound(f"path {path!r} not found")
        return parts, store.checkpoint_folder(parts[0], f"{parts[1]}/{parts[2]}", who)

    @app.post("/api/v1/weights_info", **takes(edge.WeightsInfo))
    async def weights_info(request: Request):
        who, body = owner(request), await body_json(request)
        path = edge.parse(edge.WeightsInfo, body, "weights_info").tinker_path
        parts, _ = checkpoint(path, who)
        run = store.training_run(parts[0], who)
        info = store.run_info(path, who) if parts[1] == "weights" else {}
        return {
            "base_model": run["base_model"],
            "is_lora": True,
            "lora_rank": run["lora_rank"],
            "optimizer_config": {"type": "adamw"},
            **{k: info.get(k) for k in ("train_unembed", "train_mlp", "train_attn")},
        }

    @app.post("/api/v1/copy_weights", **takes(edge.CopyWeights))
    async def copy_weights(request: Request):
        who, body = owner(request), await body_json(request)
        req = edge.parse(edge.CopyWeights, body, "copy_weights")
        parts, folder = checkpoint(req.source_path, who)
        if req.session_id is not None:
            store.check_session(req.session_id, who)
            if req.model_seq_id is None:
                raise Refused(
                    422, "copy_weights: model_seq_id must be a non-negative integer with session_id"
                )
            dest = store.model_id(req.session_id, req.model_seq_id)
        else:
            dest = f"copy-{uuid.uuid4().hex[:16]}"
        info = store.run_info(f"tinker://{parts[0]}/weights/x", who, must_exist=False)
        store.check_room(who, new_run=True, save=True)
        return await run_now(
            who,
            "copy_weights",
            {
                "folder": folder,
                "kind": parts[1],
                "dest_run": dest,
                "run_info": {**info, "lora_rank": store.training_run(parts[0], who)["lora_rank"]},
                "ttl_seconds": req.ttl_seconds,
            },
        )

    # ------------------------------------------------------------------ REST: downloads
    # Every file of an external-weights checkpoint gets its own URL token: random,
    # expiring after URL_TTL_S, bound to the tenant and the checkpoint that issued it (a
    # token whose checkpoint is deleted, expired or no longer the tenant's is refused).

    tokens = UrlTokens()

    @app.get("/api/v1/training_runs/{run}/checkpoints/{kind}/{name}/external_weights_urls")
    async def external_weights_urls(run: str, kind: str, name: str, request: Request):
        who = owner(request)
        if kind != "external_weights":
            raise NotFound(f"checkpoint {kind}/{name!r} is not external weights")
        folder = store.checkpoint_folder(run, f"{kind}/{name}", who)
        expires = time.time() + URL_TTL_S
        base = str(request.base_url).rstrip("/")
        urls = {}
        for f in sorted(os.listdir(folder)):
            tok = tokens.new(who, run, f"{kind}/{name}", f, expires)
            urls[f] = f"{base}/api/v1/external_weights/{tok}/{f}"
        return {
            "urls": urls,
            "expires": datetime.datetime.fromtimestamp(expires, datetime.UTC).isoformat(),
        }

    @app.get("/api/v1/external_weights/{token}/{file}")
    async def download(token: str, file: str):
        rec = tokens.get(token)
        if rec is None or rec[4] < time.time() or rec[3] != file:
            raise NotFound("download URL unknown or expired; request new URLs")
        who, run, ckpt, f, _ = rec
        folder = store.checkpoint_folder(run, ckpt, who)
        return FileResponse(os.path.join(folder, f), filename=f)

    # ------------------------------------------------------------------ futures

    @app.post("/api/v1/cancel_future", **takes(edge.RequestRef))
    async def cancel_future(request: Request):
        """Cancel a request: a queued one at once; a sample already in the sampling engine
        at the engine's next step boundary (its slots freed, other sequences unaffected);
        any other request already running completes normally."""
        who, body = owner(request), await body_json(request)
        rid = edge.parse(edge.RequestRef, body, "cancel_future").request_id
        futures.get(rid, who)
        if sched.cancel(rid):
            futures.complete(rid, ("error", "cancelled by the client", "user"))
        else:
            sched.cancel_running(rid)
        return Response(status_code=200)

    @app.post("/api/v1/retrieve_futures", **takes(edge.RetrieveFutures))
    async def retrieve_futures(request: Request):
        """Completions of a sampling session's requests after `prev_cursor`, long-polled
        up to `timeout` (POLL_S at most); payloads are then read with retrieve_future."""
        who, body = owner(request), await body_json(request)
        req = edge.parse(edge.RetrieveFutures, body, "retrieve_futures")
        sid, after, wait = req.target.sampling_session_id, req.prev_cursor, req.timeout
        store.sampler(sid, who)
        deadline = time.monotonic() + min(POLL_S, POLL_S if wait is None else wait)
        while True:
            done, cursor = futures.completions(who, sid, after)
            if done or time.monotonic() >= deadline:
                return {"completions": done, "cursor": cursor}
            await asyncio.sleep(0.02)

    # ------------------------------------------------------------------ futures (one)

    async def retrieve_future(who: str, body: dict) -> tuple[int, str, bytes] | dict:
        """POST retrieve_future (HotRoutes): the result once the future completes, or 408
        (try again) after POLL_S."""
        rid = edge.parse(edge.RequestRef, body, "retrieve_future").request_id
        entry = futures.get(rid, who)
        if not entry.event.is_set():
            try:  # a timer, no task: hundreds of these wait at once in an RL step
                async with asyncio.timeout(POLL_S):
                    await entry.event.wait()
            except TimeoutError:
                return (
                    408,
                    JSON,
                    json_bytes({"type": "try_again", "request_id": rid, "queue_state": "active"}),
                )
        kind, *rest = entry.result
        if kind == "proto":
            return 200, PROTO, rest[0]
        if kind == "json":
            return rest[0]
        return {"error": rest[0], "category": rest[1]}

    openai_api.mount(app, store, sched, futures, served, limits, text, body_json, failure)
    checkpoint_api.mount(app, store, served, owner, body_json, takes)
    hot = {
        "/api/v1/asample": (asample, edge.Sample),
        "/api/v1/retrieve_future": (retrieve_future, edge.RequestRef),
    }
    for path, (handler, model) in hot.items():
        # HotRoutes answers these first; FastAPI's copy puts them in the schema (and
        # serves them where `app` is mounted alone).
        app.post(path, **takes(model))(fastapi_route(handler, owner, body_json))
    return HotRoutes(app, store, limits, {path: h for path, (h, _) in hot.items()})


JSON = "application/json"


def json_bytes(obj) -> bytes:
    """A JSON body as FastAPI writes one (compact, UTF-8, no NaN)."""
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


def fastapi_route(handler, owner, body_json):
    """A HotRoutes handler (tenant, JSON body) -> dict | (status, type, bytes) as a FastAPI
    route."""

    async def route(request: Request):
        out = handler(owner(request), await body_json(request))
        if asyncio.iscoroutine(out):
            out = await out
        if isinstance(out, tuple):
            return Response(out[2], status_code=out[0], media_type=out[1])
        return Response(json_bytes(out), media_type=JSON)

    route.__name__ = handler.__name__
    return route


def sequence_ids(n: int) -> list[str]:
    """n new sample sequence ids (one random draw for all: they need be unique only)."""
    base = uuid.uuid4().hex
    return [f"seq-{base}-{k}" for k in range(n)]


async def read_body(length: str, chunks, limit: int) -> bytes:
    """A request body from its content-length header and its chunks (an async iterator),
    refused (413) once over `limit` bytes (--max-body-bytes)."""
    if length.isdigit() and int(length) > limit:
        raise Refused(413, f"body: {length} bytes exceed {limit} (--max-body-bytes)")
    parts, size = [], 0
    async for c in chunks:
        size += len(c)
        if size > limit:
            raise Refused(413, f"body: more than {limit} bytes (--max-body-bytes)")
        parts.append(c)
    return b"".join(parts)


class HotRoutes:
    """The server's ASGI app: POST to a hot path (`routes`: path -> handler(tenant, JSON
    body) -> dict, answered as JSON, or (status, content type, bytes); sync or async) is
    answered here, everything else by the FastAPI `app`. Errors are answered as FastAPI's
    handlers answer them (STATUS, Refused; 500 for anything else)."""

    def __init__(self, app: FastAPI, store: StateStore, limits: Limits, routes: dict):
        self.app, self.store, self.limits, self.routes = app, store, limits, routes

    async def __call__(self, scope, receive, send) -> None:
        handler = self.routes.get(scope.get("path")) if scope["type"] == "http" else None
        if handler is None:
            return await self.app(scope, receive, send)
        if scope["method"] != "POST":
            return await self.answer(
                send, 405, JSON, json_bytes({"detail": "Method Not Allowed"}), [(b"allow", b"POST")]
            )
        headers = dict(scope["headers"])
        try:
            who = self.store.owner_of_key(
                (headers.get(b"x-api-key") or b"").decode("latin-1") or None
            )
            body = edge.parse_json(
                await read_body(
                    headers.get(b"content-length", b"").decode("latin-1"),
                    self.chunks(receive),
                    self.limits.body_bytes,
                )
            )
            out = handler(who, body)
            if asyncio.iscoroutine(out):
                out = await out
            status, kind, data = out if isinstance(out, tuple) else (200, JSON, json_bytes(out))
        except Refused as e:
            status, kind, data = e.status, JSON, self.detail(e)
        except Exception as e:  # noqa: BLE001 — answered as FastAPI would, then logged
            status = next((st for t, st in STATUS if isinstance(e, t)), None)
            if status is None:
                log.exception("%s failed", scope["path"])
                return await self.answer(
                    send, 500, "text/plain; charset=utf-8", b"Internal Server Error"
                )
            kind, data = JSON, self.detail(e)
        await self.answer(send, status, kind, data)

    def detail(self, e: Exception) -> bytes:
        return json_bytes({"detail": redact.client_message(str(e), self.store.state_dir)})

    @staticmethod
    async def chunks(receive):
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            yield msg.get("body", b"")
            if not msg.get("more_body", False):
                return

    @staticmethod
    async def answer(send, status: int, kind: str, data: bytes, extra=()) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", kind.encode()),
                    (b"content-length", str(len(data)).encode()),
                    *extra,
                ],
            }
        )
        await send({"type": "http.response.body", "body": data})
