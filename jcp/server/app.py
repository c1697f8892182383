"""The ASGI app: Tinker SDK 0.38 routes under /api/v1.

Handlers authenticate, parse, validate what can be checked without the model, and enqueue
a scheduler.Work; they answer with a future ({request_id}) at once and never wait for the
worker. `retrieve_future` long-polls a future for up to POLL_S (below the SDK's 45 s) and
then answers 408, which the SDK retries. A request that fails before it is queued (unknown
model, undecodable body) still gets a future, completed with the error, so the SDK raises
RequestFailedError for that request only. REST routes (training runs, checkpoints, TTLs,
weights info, copies, external-weights download URLs with expiring per-file tokens,
cancel_future, retrieve_futures) answer from the state store, or wait for the worker when
they touch folders a load might be reading. It must never import jax or the worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import os
import secrets
import threading
import time
import uuid
from collections import OrderedDict

import zstandard
from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response

from jcp.server import wire
from jcp.server.scheduler import Scheduler, Work
from jcp.server.state import AuthError, NotFound, SessionEnded, StateStore, age_recipients

POLL_S = 20.0
MAX_TTL_S = 10 * 365 * 24 * 3600
URL_TTL_S = 15 * 60
KEEP_RESULTS = 20_000
PROTO = "application/x-protobuf"


@dataclasses.dataclass(frozen=True)
class ServedModel:
    name: str
    max_context_length: int
    max_rank: int
    tokenizer_id: str | None


class _Entry:
    __slots__ = ("owner", "event", "result", "extra", "group")

    def __init__(self, owner: str, extra: dict, group: str | None = None):
        self.owner, self.extra, self.group = owner, extra, group
        self.event = asyncio.Event()
        self.result = None


class FutureTable:
    """request id -> its eventual result; completed from any thread."""

    def __init__(self):
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._lock = threading.Lock()
        self.loop: asyncio.AbstractEventLoop | None = None
        # (owner, group) -> completions [(cursor, request id, "finished" | "failed")], for
        # retrieve_futures; a group is a sampling session.
        self._logs: dict[tuple, list] = {}
        self._cursor = 0

    def new(self, owner: str, group: str | None = None, **extra) -> str:
        rid = f"req-{uuid.uuid4().hex}"
        with self._lock:
            self._entries[rid] = _Entry(owner, extra, group)
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
            if e.group is not None:
                self._cursor += 1
                log = self._logs.setdefault((e.owner, e.group), [])
                log.append((self._cursor, rid, "failed" if result[0] == "error" else "finished",
                            len(result[1]) if result[0] == "proto" else None))
                del log[:-KEEP_RESULTS]
        if self.loop is not None:
            self.loop.call_soon_threadsafe(done)

    def completions(self, owner: str, group: str, after: int) -> tuple[list[dict], int]:
        """Completions of a group after cursor `after` -> (FutureCompletion dicts, cursor).
        Runs on the event loop (like `done`), so no lock is needed."""
        log = self._logs.get((owner, group), [])
        new = [c for c in log if c[0] > after]
        out = [{"state": st, "request_id": rid,
                **({"response_payload_uncompressed_size": n} if st == "finished" else {})}
               for _, rid, st, n in new]
        return out, (new[-1][0] if new else after)


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

    @app.exception_handler(SessionEnded)
    async def _ended(request, exc):
        # 410 is what stops the SDK's heartbeat loop for a session.
        return JSONResponse({"detail": str(exc)}, status_code=410)

    def failed(who: str, message: str, **extra) -> dict:
        rid = futures.new(who, **extra)
        futures.complete(rid, ("error", message, "user"))
        return {"request_id": rid, **extra}

    def enqueue(who: str, kind: str, model_id, seq_id, payload, loss_key=None, group=None,
                **extra) -> dict:
        rid = futures.new(who, group, **extra)
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
        return {"pjwt_auth_enabled": False, "proto_compress_fwdbwd": True}

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

    @app.post("/api/v1/create_model")
    async def create_model(request: Request):
        who, body = owner(request), await body_json(request)
        store.check_session(body.get("session_id"), who)
        seq = body.get("model_seq_id", 0)
        if isinstance(seq, bool) or not isinstance(seq, int) or seq < 0:
            raise _BadRequest(f"model_seq_id must be a non-negative integer, got {seq!r}")
        mid = store.model_id(body["session_id"], seq)
        if mid in store.models:
            return failed(who, f"model_seq_id {seq} of session {body['session_id']!r} is "
                               f"already used by model {mid!r}", model_id=mid)
        meta = body.get("user_metadata")
        if meta is not None and not (isinstance(meta, dict) and len(meta) <= 64 and all(
                isinstance(k, str) and len(k) <= 256 and len(str(v)) <= 4096
                for k, v in meta.items())):
            raise _BadRequest("user_metadata must be an object of at most 64 string keys "
                              "(values up to 4096 characters)")
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

    @app.post("/api/v1/save_weights_external")
    async def save_weights_external(request: Request):
        who, body = owner(request), await body_json(request)
        try:
            store.model(body.get("model_id"), who)
            if not isinstance(body.get("path"), str):
                raise ValueError("save_weights_external: path (a name) is required")
            ttl(body.get("ttl_seconds"))
            if body.get("age_encryption_recipients") is not None:
                age_recipients(body["age_encryption_recipients"])
        except (NotFound, ValueError) as e:
            return failed(who, str(e))
        return enqueue(who, "save_weights_external", body["model_id"], body.get("seq_id"), body)

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
                       group=sid, sample_sequence_ids=ids)

    # ------------------------------------------------------------------ REST: runs, checkpoints

    def ttl(v):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)
                              or not 1 <= v <= MAX_TTL_S):
            raise ValueError(f"ttl_seconds must be an integer in [1, {MAX_TTL_S}] or null, "
                             f"got {v!r}")
        return v

    async def run_now(who: str, kind: str, payload: dict):
        """Queue unordered work for the worker and wait for its result (REST routes that
        answer directly, not with a future)."""
        rid = enqueue(who, kind, None, None, payload)["request_id"]
        entry = futures.get(rid, who)
        await entry.event.wait()
        kind, *rest = entry.result
        if kind == "error":
            raise _BadRequest(rest[0])
        return rest[0]

    @app.get("/api/v1/training_runs")
    async def training_runs(request: Request, limit: int = 20, offset: int = 0):
        if not (1 <= limit <= 1000 and offset >= 0):
            raise _BadRequest("limit must be in [1, 1000] and offset ≥ 0")
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

    @app.put("/api/v1/training_runs/{run}/checkpoints/{kind}/{name}/ttl")
    async def set_ttl(run: str, kind: str, name: str, request: Request):
        who, body = owner(request), await body_json(request)
        try:
            seconds = ttl(body.get("ttl_seconds"))
        except ValueError as e:
            raise _BadRequest(str(e)) from None
        store.set_ttl(run, f"{kind}/{name}", who, seconds)
        return Response(status_code=200)

    @app.post("/api/v1/weights_info")
    async def weights_info(request: Request):
        who, body = owner(request), await body_json(request)
        path = body.get("tinker_path")
        parts = path[len("tinker://"):].split("/") if isinstance(path, str) else []
        if len(parts) != 3:
            raise NotFound(f"path {path!r} not found")
        store.checkpoint_folder(parts[0], f"{parts[1]}/{parts[2]}", who)
        run = store.training_run(parts[0], who)
        info = store.run_info(path, who) if parts[1] == "weights" else {}
        return {"base_model": run["base_model"], "is_lora": True,
                "lora_rank": run["lora_rank"], "optimizer_config": {"type": "adamw"},
                **{k: info.get(k) for k in ("train_unembed", "train_mlp", "train_attn")}}

    @app.post("/api/v1/copy_weights")
    async def copy_weights(request: Request):
        who, body = owner(request), await body_json(request)
        path = body.get("source_path")
        parts = path[len("tinker://"):].split("/") if isinstance(path, str) else []
        if len(parts) != 3:
            raise NotFound(f"path {path!r} not found")
        folder = store.checkpoint_folder(parts[0], f"{parts[1]}/{parts[2]}", who)
        try:
            ttl(body.get("ttl_seconds"))
        except ValueError as e:
            raise _BadRequest(str(e)) from None
        if body.get("session_id") is not None:
            store.check_session(body["session_id"], who)
            seq = body.get("model_seq_id")
            if isinstance(seq, bool) or not isinstance(seq, int) or seq < 0:
                raise _BadRequest("copy_weights: model_seq_id must be a non-negative integer "
                                  "with session_id")
            dest = store.model_id(body["session_id"], seq)
        else:
            dest = f"copy-{uuid.uuid4().hex[:16]}"
        info = store.run_info(f"tinker://{parts[0]}/weights/x", who, must_exist=False)
        return await run_now(who, "copy_weights", {
            "folder": folder, "kind": parts[1], "dest_run": dest,
            "run_info": {**info, "lora_rank": store.training_run(parts[0], who)["lora_rank"]},
            "ttl_seconds": body.get("ttl_seconds")})

    # ------------------------------------------------------------------ REST: downloads
    # Every file of an external-weights checkpoint gets its own URL token: random,
    # expiring after URL_TTL_S, bound to the tenant and the checkpoint that issued it (a
    # token whose checkpoint is deleted, expired or no longer the tenant's is refused).

    tokens: OrderedDict[str, tuple] = OrderedDict()

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
            tok = secrets.token_urlsafe(32)
            tokens[tok] = (who, run, f"{kind}/{name}", f, expires)
            urls[f] = f"{base}/api/v1/external_weights/{tok}/{f}"
        now = time.time()
        while tokens and (len(tokens) > KEEP_RESULTS or next(iter(tokens.values()))[4] < now):
            tokens.popitem(last=False)
        return {"urls": urls, "expires": datetime.datetime.fromtimestamp(
            expires, datetime.timezone.utc).isoformat()}

    @app.get("/api/v1/external_weights/{token}/{file}")
    async def download(token: str, file: str):
        rec = tokens.get(token)
        if rec is None or rec[4] < time.time() or rec[3] != file:
            raise NotFound("download URL unknown or expired; request new URLs")
        who, run, ckpt, f, _ = rec
        folder = store.checkpoint_folder(run, ckpt, who)
        return FileResponse(os.path.join(folder, f), filename=f)

    # ------------------------------------------------------------------ futures

    @app.post("/api/v1/cancel_future")
    async def cancel_future(request: Request):
        """Cancel a request still queued (one already running completes normally)."""
        who, body = owner(request), await body_json(request)
        rid = body.get("request_id")
        futures.get(rid, who)
        if sched.cancel(rid):
            futures.complete(rid, ("error", "cancelled by the client", "user"))
        return Response(status_code=200)

    @app.post("/api/v1/retrieve_futures")
    async def retrieve_futures(request: Request):
        """Completions of a sampling session's requests after `prev_cursor`, long-polled
        up to `timeout` (POLL_S at most); payloads are then read with retrieve_future."""
        who, body = owner(request), await body_json(request)
        target = body.get("target")
        if not isinstance(target, dict) or target.get("type", "sampling_session") != \
                "sampling_session" or not isinstance(target.get("sampling_session_id"), str):
            raise _BadRequest("target must be {type: sampling_session, sampling_session_id}")
        sid = target["sampling_session_id"]
        store.sampler(sid, who)
        after, wait = body.get("prev_cursor", 0), body.get("timeout")
        if isinstance(after, bool) or not isinstance(after, int) or not (
                wait is None or isinstance(wait, (int, float)) and wait >= 0):
            raise _BadRequest("prev_cursor must be an integer and timeout a number ≥ 0")
        deadline = time.monotonic() + min(POLL_S, POLL_S if wait is None else wait)
        while True:
            done, cursor = futures.completions(who, sid, after)
            if done or time.monotonic() >= deadline:
                return {"completions": done, "cursor": cursor}
            await asyncio.sleep(0.02)

    # ------------------------------------------------------------------ futures (one)

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
