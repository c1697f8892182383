"""The future routes of jcp-serve: cancel_future, retrieve_futures and retrieve_future.

retrieve_future long-polls a future for up to POLL_S (below the SDK's 45 s) and then
answers 408, which the SDK retries; it is a hot route (jcp.server.asgi.HotRoutes calls it
directly). retrieve_futures long-polls a sampling session's completion log. No jax, no
worker.
"""

from __future__ import annotations

import asyncio
import time

from fastapi import APIRouter, Request
from fastapi.responses import Response

from jcp.server import edge
from jcp.server.asgi import JSON, PROTO, json_bytes
from jcp.server.context import AppContext, context, takes

POLL_S = 20.0


router = APIRouter()


@router.post("/api/v1/cancel_future", **takes(edge.RequestRef))
async def cancel_future(request: Request):
    """Cancel a request: a queued one at once; a sample already in the sampling engine
    at the engine's next step boundary (its slots freed, other sequences unaffected);
    any other request already running completes normally."""
    c = context(request)
    who, body = c.owner(request), await c.body_json(request)
    rid = edge.parse(edge.RequestRef, body, "cancel_future").request_id
    c.futures.get(rid, who)
    if c.sched.cancel(rid):
        c.futures.complete(rid, ("error", "cancelled by the client", "user"))
    else:
        c.sched.cancel_running(rid)
    return Response(status_code=200)


@router.post("/api/v1/retrieve_futures", **takes(edge.RetrieveFutures))
async def retrieve_futures(request: Request):
    """Completions of a sampling session's requests after `prev_cursor`, long-polled
    up to `timeout` (POLL_S at most); payloads are then read with retrieve_future."""
    c = context(request)
    who, body, req = await c.parsed(request, edge.RetrieveFutures, "retrieve_futures")
    sid, after, wait = req.target.sampling_session_id, req.prev_cursor, req.timeout
    c.store.sampler(sid, who)
    deadline = time.monotonic() + min(POLL_S, POLL_S if wait is None else wait)
    while True:
        done, cursor = c.futures.completions(who, sid, after)
        if done or time.monotonic() >= deadline:
            return {"completions": done, "cursor": cursor}
        await asyncio.sleep(0.02)


async def retrieve_future(c: AppContext, who: str, body: dict) -> tuple[int, str, bytes] | dict:
    """POST retrieve_future (HotRoutes): the result once the future completes, or 408
    (try again) after POLL_S."""
    rid = edge.parse(edge.RequestRef, body, "retrieve_future").request_id
    entry = c.futures.get(rid, who)
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
