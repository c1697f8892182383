"""The ASGI layer of jcp-serve: JSON bodies and answers, and the hot routes in front of FastAPI.

The hot paths — POST asample and retrieve_future (hundreds at once per RL step),
forward_backward and the per-model operations (optim_step, saves, unload: one per tenant
and step, a thousand at once with a thousand tenants) — are answered by `HotRoutes`, a
plain ASGI layer in front of the FastAPI app: FastAPI's middleware, routing, dependency
solving and response serialization cost more CPU than these handlers themselves, and on a
CPU host that CPU is taken from the passes and the engine. Every other request goes
through FastAPI. Also owns the status of each exception a
handler may raise (STATUS), `read_body` (the --max-body-bytes bound), `off_loop` (where a
body is parsed) and `json_bytes`. Never imports jax or the worker.

The event loop's own work is shared fairly between tenants (`Turns`): each request waits
for its tenant's turn before its handler runs and again before a long-polled answer is
sent, and turns go round robin over the tenants that wait. One tenant's burst of hundreds
of requests (an RL step's samples, arriving together and completing together) no longer
queues another tenant's request behind all of them on the loop: it waits for one of them.

Bodies over OFF_LOOP_BYTES are parsed, validated and enqueued in a thread (`off_loop`),
not on the event loop: one tenant's multi-MiB forward_backward or sample body (JSON or
protobuf decoding, a datum or token loop in Python) no longer holds up every other
tenant's small request behind it. Only what is O(1) per body or bounded before it runs
stays on the loop: the tenant, reading the body under --max-body-bytes (413 before
anything is decoded) and the answer. The parsing code is the same in either place, so
its checks (every size bounded before it is allocated from) and messages are too. The
parsing threads (PARSERS) run at the compute's nice value on a CPU host
(jcp/server/priority.py), so that a tenant's large bodies share the cores with the
passes as the passes do, not before them.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextvars
import dataclasses
import json
import logging
import weakref
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from jcp.server import edge, priority, redact
from jcp.server.edge import Refused
from jcp.server.state import AuthError, NotFound, SessionEnded

PROTO = "application/x-protobuf"
# Exceptions a handler may raise -> HTTP status; the body is {"detail": message}.
STATUS = ((AuthError, 401), (NotFound, 404), (SessionEnded, 410))
log = logging.getLogger("jcp.serve")
JSON = "application/json"
# A body up to this many bytes is parsed on the event loop (a thread hop costs more than
# parsing it: ~0.1 ms); a larger one in a thread of PARSERS (`off_loop`).
OFF_LOOP_BYTES = 64 << 10
# The threads that parse large bodies, at the compute's nice value (priority.as_compute),
# not the loop's: started lazily, shared by every app of the process.
PARSERS = concurrent.futures.ThreadPoolExecutor(
    thread_name_prefix="jcp-parse", initializer=priority.as_compute
)
# While the worker's light work (scheduler.LightWork) keeps every waiting tenant out,
# Turns looks again after this long.
HOLD_POLL_S = 0.002


class Turns:
    """Round-robin turns on the event loop across tenants: `await turns.wait(who)` returns
    when it is this waiter's turn. The loop runs what it has ready first in, first out, so
    a tenant's request that came behind another's burst would run after all of it; here
    every waiter yields once and the turns go to the waiting tenants in rotation, one
    waiter each (a tenant joins the rotation at its end), one turn per pass of the loop.
    The turn is not a lock: the waiter runs until its next await, and the next turn is
    given after it (`_Rotation.give` is scheduled behind the woken waiter). A lone request pays
    one pass of the loop (~10 µs). Each event loop has its own rotation (tests run the app
    on more than one), forgotten with the loop.

    light_work (scheduler.LightWork): while the worker runs a light tenant's step or small
    pass, only that tenant's waiters get turns, and while a light tenant's small request
    waits for the worker, the heavy tenants' waiters get none; those held keep their place
    and get their turns once it ends (the rotation looks again every HOLD_POLL_S)."""

    def __init__(self, light_work=None):
        self._loops: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.light_work = light_work

    async def wait(self, who: str) -> None:
        loop = asyncio.get_running_loop()
        r = self._loops.get(loop)
        if r is None:
            r = self._loops[loop] = _Rotation(light_work=self.light_work)
        fut = loop.create_future()
        q = r.waiting.get(who)
        if q is None:
            q = r.waiting[who] = collections.deque()
            r.order.append(who)
        q.append(fut)
        if not r.giving:
            r.giving = True
            loop.call_soon(r.give, loop)
        await fut

    def waiting(self) -> int:
        """Waiters on the running loop's rotation."""
        r = self._loops.get(asyncio.get_running_loop())
        return 0 if r is None else sum(map(len, r.waiting.values()))


@dataclasses.dataclass
class _Rotation:
    """One event loop's turns: tenant -> its waiters in order, the tenants in rotation,
    and whether a `give` is scheduled."""

    waiting: dict = dataclasses.field(default_factory=dict)
    order: collections.deque = dataclasses.field(default_factory=collections.deque)
    giving: bool = False
    light_work: Any = None  # scheduler.LightWork, or None

    def give(self, loop) -> None:
        """The next tenant's first live waiter its turn (one the worker's light work
        allows), and the next `give` scheduled behind it; while the light work keeps every
        waiter out, scheduled again HOLD_POLL_S later; none scheduled once no one waits."""
        held = 0  # tenants passed over for the light work, at the back of the rotation
        while len(self.order) > held:
            who = self.order.popleft()
            q = self.waiting[who]
            while q and q[0].done():  # a waiter cancelled (its client left) takes no turn
                q.popleft()
            if not q:
                del self.waiting[who]
                continue
            if self.light_work is not None and not self.light_work.allows(who):
                self.order.append(who)
                held += 1
                continue
            q.popleft().set_result(None)
            if q:
                self.order.append(who)
            else:
                del self.waiting[who]
            loop.call_soon(self.give, loop)
            return
        if held:
            loop.call_later(HOLD_POLL_S, self.give, loop)
            return
        self.giving = False


async def off_loop(size: int, fn, *args):
    """fn(*args) for a body of `size` bytes: on the event loop when it is at most
    OFF_LOOP_BYTES, else in a thread of PARSERS (in the caller's context, as
    asyncio.to_thread), so that the loop serves other requests meanwhile. fn must be safe
    to run off the loop: the state store, scheduler and futures it may reach are locked
    (FutureTable completes through the loop)."""
    if size <= OFF_LOOP_BYTES:
        return fn(*args)
    ctx = contextvars.copy_context()
    return await asyncio.get_running_loop().run_in_executor(PARSERS, ctx.run, fn, *args)


def call_json(handler, ctx, who: str, raw: bytes):
    """handler(ctx, who, the JSON body of raw): a hot-path handler's parse and call, one
    unit for off_loop (an async handler's coroutine is only made here; its caller awaits
    it on the loop)."""
    return handler(ctx, who, edge.parse_json(raw))


def json_bytes(obj) -> bytes:
    """A JSON body as FastAPI writes one (compact, UTF-8, no NaN)."""
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


def fastapi_route(handler):
    """A HotRoutes handler (app context, tenant, JSON body) -> dict | (status, type, bytes)
    as a FastAPI route."""

    async def route(request: Request):
        c = request.app.state.jcp
        who, raw = c.owner(request), await c.body_bytes(request)
        out = await off_loop(len(raw), call_json, handler, c, who, raw)
        if asyncio.iscoroutine(out):
            out = await out
        if isinstance(out, tuple):
            return Response(out[2], status_code=out[0], media_type=out[1])
        return Response(json_bytes(out), media_type=JSON)

    route.__name__ = handler.__name__
    return route


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
    """The server's ASGI app: POST to a hot path is answered here, everything else by the
    FastAPI `app` (whose `state.jcp` is the context). `routes`: path -> handler(app
    context, tenant, JSON body), sync or async, parsed off the loop when large; `raw`: path
    -> async handler(app context, tenant, body bytes, headers with lower-case names) for
    other bodies (forward_backward's protobuf). A handler returns a dict, answered as JSON,
    or (status, content type, bytes). Errors are answered as FastAPI's handlers answer
    them (STATUS, Refused; 500 for anything else)."""

    def __init__(self, app: FastAPI, routes: dict, raw: dict | None = None):
        self.app, self.routes, self.raw = app, routes, raw or {}
        self.ctx = app.state.jcp
        self.store, self.limits = self.ctx.store, self.ctx.limits
        self.turns = Turns(self.ctx.sched.light_work)

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path") if scope["type"] == "http" else None
        handler, raw_handler = self.routes.get(path), self.raw.get(path)
        if handler is None and raw_handler is None:
            if path is not None:
                await self.turns.wait(self.tenant_of(scope))
            return await self.app(scope, receive, send)
        if scope["method"] != "POST":
            return await self.answer(
                send, 405, JSON, json_bytes({"detail": "Method Not Allowed"}), [(b"allow", b"POST")]
            )
        # ASGI gives header names in lower case.
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        try:
            who = self.store.owner_of_key(headers.get("x-api-key") or None)
            raw = await read_body(
                headers.get("content-length", ""), self.chunks(receive), self.limits.body_bytes
            )
            await self.turns.wait(who)
            if raw_handler is not None:
                out = await raw_handler(self.ctx, who, raw, headers)
            else:
                out = await off_loop(len(raw), call_json, handler, self.ctx, who, raw)
            if asyncio.iscoroutine(out):
                out = await out  # a long poll: its answer waits for another turn
                await self.turns.wait(who)
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

    def tenant_of(self, scope) -> str:
        """The tenant of a request FastAPI answers (its turn's queue): its API key's
        owner; every request with no valid key shares one queue (FastAPI refuses them)."""
        key = next((v for k, v in scope.get("headers", ()) if k == b"x-api-key"), b"")
        try:
            return self.store.owner_of_key(key.decode("latin-1") or None)
        except AuthError:
            return ""

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
