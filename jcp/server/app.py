"""The ASGI app: Tinker SDK 0.38 routes under /api/v1.

Handlers authenticate, parse, validate what can be checked without the model, and enqueue
a scheduler.Work; they answer with a future ({request_id}) at once and never wait for the
worker. `retrieve_future` long-polls a future for up to POLL_S (below the SDK's 45 s) and
then answers 408, which the SDK retries. A request that fails before it is queued (unknown
model, undecodable body) still gets a future, completed with the error, so the SDK raises
RequestFailedError for that request only. It must never import jax or the worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import uuid
from collections import OrderedDict

import zstandard
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from jcp.server import wire
from jcp.server.scheduler import Scheduler, Work
from jcp.server.state import AuthError, NotFound, StateStore

POLL_S = 20.0
KEEP_RESULTS = 20_000
PROTO = "application/x-protobuf"


@dataclasses.dataclass(frozen=True)
class ServedModel:
    name: str
    max_context_length: int
    max_rank: int
    tokenizer_id: str | None


class _Entry:
    __slots__ = ("owner", "event", "result", "extra")

    def __init__(self, owner: str, extra: dict):
        self.owner, self.extra = owner, extra
        self.event = asyncio.Event()
        self.result = None


class FutureTable:
    """request id -> its eventual result; completed from any thread."""

    def __init__(self):
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._lock = threading.Lock()
        self.loop: asyncio.AbstractEventLoop | None = None

    def new(self, owner: str, **extra) -> str:
        rid = f"req-{uuid.uuid4().hex}"
        with self._lock:
            self._entries[rid] = _Entry(owner, extra)
            while len(self._entries) > KEEP_RESULTS:
                self._entries.popitem(last=False)
        return rid

    def get(self, rid: str, owner: str) -> _Entry:
        with self._lock:
            e = self._entries.get(rid)
        if e is None or e.owner != owner:
            raise NotFound(f"request {rid!r} not found")
        return e

    def complete(self, rid: str, result: tuple) -> None:
        with self._lock:
            e = self._entries.get(rid)
        if e is None:
            return

        def done():
            e.result = result
            e.event.set()
        if self.loop is not None:
            self.loop.call_soon_threadsafe(done)


def create_app(store: StateStore, sched: Scheduler, futures: FutureTable,
               served: ServedModel) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app):
        futures.loop = asyncio.get_running_loop()
        yield

    app = FastAPI(title="jcp-serve", docs_url=None, redoc_url=None, lifespan=lifespan)

    def owner(request: Request) -> str:
        return store.owner_of_key(request.headers.get("x-api-key"))

    @app.exception_handler(AuthError)
    async def _auth(request, exc):
        return JSONResponse({"detail": str(exc)}, status_code=401)

    @app.exception_handler(NotFound)
    async def _missing(request, exc):
        return JSONResponse({"detail": str(exc)}, status_code=404)

    def failed(who: str, message: str, **extra) -> dict:
        rid = futures.new(who, **extra)
        futures.complete(rid, ("error", message, "user"))
        return {"request_id": rid, **extra}

    def enqueue(who: str, kind: str, model_id, seq_id, payload, loss_key=None,
                **extra) -> dict:
        rid = futures.new(who, **extra)
        sched.submit(Work(request_id=rid, kind=kind, model_id=model_id, seq_id=seq_id,
                          payload=payload, owner=who, loss_key=loss_key))
        out = {"request_id": rid, **extra}
        if model_id is not None:
            out["model_id"] = model_id
        return out

    async def body_json(request: Request) -> dict:
        try:
            body = await request.json()
        except ValueError:
            body = None
        if not isinstance(body, dict):
            raise _BadRequest("request body must be a JSON object")
        return body

    @app.exception_handler(_BadRequest)
    async def _bad(request, exc):
        return JSONResponse({"detail": str(exc)}, status_code=422)

    # ------------------------------------------------------------------ service

    @app.api_route("/api/v1/healthz", methods=["GET", "POST"])
    async def healthz():
        return {"status": "ok"}

    @app.post("/api/v1/client/config")
    async def client_config(request: Request):
        owner(request)
        # zstd request bodies: the SDK compresses fwd/bwd payloads when we ask.
        # custom_loss_server_side: create_custom_loss uploads the traced loss, and
        # forward_backward_custom runs it here in one pass (engine._create_custom_loss).
        return {"pjwt_auth_enabled": False, "proto_compress_fwdbwd": True,
                "custom_loss_server_side": True}

    @app.post("/api/v1/client/dynamic_config")
    async def dynamic_config(request: Request):
        owner(request)
        return {}

    @app.post("/api/v1/telemetry")
    async def telemetry():
        return {"status": "accepted"}

    @app.get("/api/v1/get_server_capabilities")
    async def capabilities(request: Request):
        owner(request)
        return {"supported_models": [{"model_name": served.name,
                                      "max_context_length": served.max_context_length,
                                      "trainable": True, "sampleable": True}]}

    @app.post("/api/v1/create_session")
    async def create_session(request: Request):
        who = owner(request)
        await body_json(request)
        return {"type": "create_session", "session_id": store.new_session(who)}

    @app.post("/api/v1/session_heartbeat")
    async def heartbeat(request: Request):
        store.check_session((await body_json(request)).get("session_id"), owner(request))
        return {"type": "session_heartbeat"}

    @app.post("/api/v1/sessions/{session_id}/finish")
    async def finish(session_id: str, request: Request):
        store.check_session(session_id, owner(request))
        return {}

    # ------------------------------------------------------------------ training

    @app.post("/api/v1/create_model")
    async def create_model(request: Request):
        who, body = owner(request), await body_json(request)
        store.check_session(body.get("session_id"), who)
        mid = store.model_id(body["session_id"], body.get("model_seq_id", 0))
        lora = body.get("lora_config") or {}
        rank = lora.get("rank")
        if not isinstance(rank, int) or not 1 <= rank <= served.max_rank:
            return failed(who, f"lora rank {rank!r} must be an integer in [1, "
                               f"{served.max_rank}] (--max-rank)", model_id=mid)
        return enqueue(who, "create_model", mid, None, body)

    @app.post("/api/v1/get_info")
    async def get_info(request: Request):
        who, body = owner(request), await body_json(request)
        rec = store.model(body.get("model_id"), who)
        return {"type": "get_info", "model_id": rec.model_id, "is_lora": True,
                "lora_rank": rec.rank, "model_name": rec.base_model,
                "model_data": {"arch": "qwen", "model_name": rec.base_model,
                               "tokenizer_id": served.tokenizer_id}}

    @app.post("/api/v1/forward_backward")
    async def forward_backward(request: Request):
        who = owner(request)
        raw = await request.body()
        try:
            if request.headers.get("content-encoding", "").lower() == "zstd":
                raw = zstandard.ZstdDecompressor().decompressobj().decompress(raw)
            req = wire.decode_forward_backward(raw)
            store.model(req.model_id, who)
        except (wire.WireError, zstandard.ZstdError, NotFound) as e:
            return failed(who, str(e))
        kind = "forward" if req.forward_only else "forward_backward"
        key = (req.loss_fn, tuple(sorted((req.loss_fn_config or {}).items())))
        return enqueue(who, kind, req.model_id, req.seq_id, req, loss_key=key)

    def model_op(kind: str):
        async def handler(request: Request):
            who, body = owner(request), await body_json(request)
            mid = body.get("model_id")
            try:
                store.model(mid, who)
            except NotFound as e:
                return failed(who, str(e))
            return enqueue(who, kind, mid, body.get("seq_id"), body)
        handler.__name__ = kind
        return handler

    for kind in ("optim_step", "save_weights", "save_weights_for_sampler", "unload_model"):
        app.post(f"/api/v1/{kind}")(model_op(kind))

    @app.post("/api/v1/load_weights")
    async def load_weights(request: Request):
        who, body = owner(request), await body_json(request)
        try:
            store.resolve(body.get("path"), who, "weights")
            if body.get("session_id") is not None:
                store.check_session(body["session_id"], who)
                mid = store.model_id(body["session_id"], body.get("model_seq_id", 0))
                return enqueue(who, "load_weights", mid, None, body)
            store.model(body.get("model_id"), who)
        except NotFound as e:
            return failed(who, str(e))
        return enqueue(who, "load_weights", body["model_id"], body.get("seq_id"), body)

    @app.post("/api/v1/create_custom_loss")
    async def create_custom_loss(request: Request):
        who, body = owner(request), await body_json(request)
        store.check_session(body.get("session_id"), who)
        return enqueue(who, "create_custom_loss", None, None, body)

    # ------------------------------------------------------------------ sampling

    @app.post("/api/v1/create_sampling_session")
    async def create_sampling_session(request: Request):
        who, body = owner(request), await body_json(request)
        store.check_session(body.get("session_id"), who)
        path = body.get("model_path")
        if path:
            folder, base = store.resolve(path, who, "sampler_weights")
        else:
            folder, base = None, body.get("base_model")
            if base != served.name:
                raise NotFound(f"base model {base!r} not found; this server serves "
                               f"{served.name!r}")
        return {"type": "create_sampling_session",
                "sampling_session_id": store.add_sampler(who, base or served.name, path,
                                                         folder)}

    @app.get("/api/v1/samplers/{sampler_id}")
    async def get_sampler(sampler_id: str, request: Request):
        rec = store.sampler(sampler_id, owner(request))
        return {"sampler_id": rec.sampler_id, "base_model": rec.base_model,
                "model_path": rec.model_path}

    @app.post("/api/v1/asample")
    async def asample(request: Request):
        who, body = owner(request), await body_json(request)
        n = body.get("num_samples", 1)
        n = n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else 1
        try:
            sid = body.get("sampling_session_id")
            if sid is None:
                raise wire.WireError("sampling_session_id is required")
            store.sampler(sid, who)
            args = wire.decode_sample(body)
        except (wire.WireError, NotFound) as e:
            return failed(who, str(e), sample_sequence_ids=[f"seq-{uuid.uuid4().hex}"
                                                             for _ in range(n)])
        ids = [f"seq-{uuid.uuid4().hex}" for _ in range(n)]
        return enqueue(who, "sample", None, None, {"sampling_session_id": sid, "args": args},
                       sample_sequence_ids=ids)

    # ------------------------------------------------------------------ futures

    @app.post("/api/v1/retrieve_future")
    async def retrieve_future(request: Request):
        who, body = owner(request), await body_json(request)
        entry = futures.get(body.get("request_id"), who)
        try:
            await asyncio.wait_for(asyncio.shield(entry.event.wait()), POLL_S)
        except asyncio.TimeoutError:
            return JSONResponse({"type": "try_again", "request_id": body.get("request_id"),
                                 "queue_state": "active"}, status_code=408)
        kind, *rest = entry.result
        if kind == "proto":
            return Response(content=rest[0], media_type=PROTO)
        if kind == "json":
            return rest[0]
        return {"error": rest[0], "category": rest[1]}

    return app


class _BadRequest(ValueError):
    pass
