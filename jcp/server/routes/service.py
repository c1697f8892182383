"""The service routes of jcp-serve: health, client configuration, capabilities, sessions.

Module-level FastAPI routes over the AppContext (jcp.server.context); no jax, no worker.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from jcp.server import edge
from jcp.server.context import context, takes
from jcp.server.state import SessionEnded

router = APIRouter()


# GET and POST, registered apart: one api_route gives both one OpenAPI operation id.
@router.get("/api/v1/healthz")
@router.post("/api/v1/healthz", operation_id="healthz_post")
async def healthz(request: Request):
    c = context(request)
    if not c.alive():
        return JSONResponse(
            {
                "status": "unhealthy",
                "detail": c.failure()
                or "the worker thread is not running; no request will be served",
            },
            status_code=503,
        )
    return {"status": "ok"}


@router.post("/api/v1/client/config")
async def client_config(request: Request):
    c = context(request)
    c.owner(request)
    # zstd request bodies: the SDK compresses fwd/bwd payloads when we ask.
    # custom_loss_server_side: create_custom_loss uploads the traced loss, and
    # forward_backward_custom runs it here in one pass (ModelOps._create_custom_loss).
    return {
        "pjwt_auth_enabled": False,
        "proto_compress_fwdbwd": True,
        "custom_loss_server_side": True,
    }


@router.post("/api/v1/client/dynamic_config")
async def dynamic_config(request: Request):
    c = context(request)
    c.owner(request)
    # The SDK then sends cancel_future for a sample future it abandons (cancel or
    # timeout), and the engine frees its slots at the next step boundary.
    return {"sample_cancel_enabled": True}


@router.post("/api/v1/telemetry")
async def telemetry():
    return {"status": "accepted"}


@router.get("/api/v1/get_server_capabilities")
async def capabilities(request: Request):
    c = context(request)
    c.owner(request)
    return {
        "supported_models": [
            {
                "model_name": c.served.name,
                "max_context_length": c.served.max_context_length,
                "trainable": True,
                "sampleable": True,
            }
        ]
    }


@router.post("/api/v1/create_session", **takes(edge.CreateSession))
async def create_session(request: Request):
    c = context(request)
    who, _, _ = await c.parsed(request, edge.CreateSession, "create_session")
    return {"type": "create_session", "session_id": c.store.new_session(who)}


@router.post("/api/v1/session_heartbeat", **takes(edge.SessionRef))
async def heartbeat(request: Request):
    c = context(request)
    who, body = c.owner(request), await c.body_json(request)
    c.store.check_session(edge.parse(edge.SessionRef, body, "session_heartbeat").session_id, who)
    return {"type": "session_heartbeat"}


@router.post("/api/v1/sessions/{session_id}/finish")
async def finish(session_id: str, request: Request):
    """The session's models are unloaded after their queued work (their checkpoints
    stay loadable); finishing twice is harmless."""
    c = context(request)
    who = c.owner(request)
    try:
        c.store.check_session(session_id, who)
    except SessionEnded:
        return {}
    c.store.end_session(session_id)
    c.enqueue(who, "end_session", None, None, {"session_id": session_id})
    return {}
