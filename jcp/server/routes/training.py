"""The training routes of jcp-serve: models, forward(_backward), optim_step, saves, loads,
custom losses.

Each handler authenticates, parses and validates what can be checked without the model,
and enqueues a scheduler.Work for the worker; it answers with a future ({request_id}) at
once. A request that fails before it is queued (unknown model, undecodable body) still
gets a future, completed with the error (AppContext.failed), so the SDK raises
RequestFailedError for that request only. A large body is decoded off the event loop
(asgi.off_loop). No jax, no worker.
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from jcp.server import edge, wire
from jcp.server.asgi import PROTO, off_loop
from jcp.server.context import AppContext, context, takes
from jcp.server.edge import Refused
from jcp.server.state import LimitReached, NotFound, age_recipients

router = APIRouter()


@router.post("/api/v1/create_model", **takes(edge.CreateModel))
async def create_model(request: Request):
    c = context(request)
    who, body, req = await c.parsed(request, edge.CreateModel, "create_model")
    c.store.check_session(req.session_id, who)
    mid = c.store.model_id(req.session_id, req.model_seq_id)
    if mid in c.store.models:
        return c.failed(
            who,
            f"model_seq_id {req.model_seq_id} of session "
            f"{req.session_id!r} is already used by model {mid!r}",
            model_id=mid,
        )
    rank = req.lora_config.rank if req.lora_config is not None else None
    if rank is None or not 1 <= rank <= c.served.max_rank:
        return c.failed(
            who,
            f"lora_config.rank {rank!r} must be an integer in [1, "
            f"{c.served.max_rank}] (--max-rank)",
            model_id=mid,
        )
    try:
        c.store.check_room(who, new_run=True)
    except LimitReached as e:
        return c.failed(who, str(e), model_id=mid)
    return c.enqueue(who, "create_model", mid, None, req.model_dump(exclude_none=True))


@router.post("/api/v1/get_info", **takes(edge.ModelRef))
async def get_info(request: Request):
    c = context(request)
    who, body = c.owner(request), await c.body_json(request)
    rec = c.store.model(edge.parse(edge.ModelRef, body, "get_info").model_id, who)
    return {
        "type": "get_info",
        "model_id": rec.model_id,
        "is_lora": True,
        "lora_rank": rec.rank,
        "model_name": rec.base_model,
        "model_data": {
            "arch": "qwen",
            "model_name": rec.base_model,
            "tokenizer_id": c.served.tokenizer_id,
        },
    }


@router.post("/api/v1/forward_backward", **takes(None, PROTO))
async def forward_backward(request: Request):
    c = context(request)
    return await forward_backward_body(
        c, c.owner(request), await c.body_bytes(request), request.headers
    )


async def forward_backward_body(c: AppContext, who: str, raw: bytes, headers) -> dict:
    """forward_backward from its body's bytes and headers (a mapping with lower-case
    names): the FastAPI route's and HotRoutes' handler. Decoded off the event loop when
    large (asgi.off_loop); a zstd body may decompress to the bound whatever its size on
    the wire."""
    zstd = headers.get("content-encoding", "").lower() == "zstd"
    size = c.limits.body_bytes if zstd else len(raw)
    return await off_loop(size, _forward_backward, c, who, raw, zstd)


def _forward_backward(c: AppContext, who: str, raw: bytes, zstd: bool) -> dict:
    """forward_backward's decoding, checks and enqueue (on the loop or in a thread)."""
    if zstd:
        raw = edge.decompress(raw, c.limits.body_bytes)
    try:
        head = wire.decode_forward_backward_head(raw)
    except wire.WireError as e:
        return c.failed(who, str(e))
    try:
        c.store.model(head.model_id, who)
        c.check_seq(head.model_id, head.seq_id)
    except (NotFound, Refused) as e:
        return c.failed(who, str(e))
    try:
        req = wire.decode_forward_backward(head, c.limits.datums)
    except wire.WireError as e:
        return c.failed(who, str(e), model_id=head.model_id, seq_id=head.seq_id)
    kind = "forward" if req.forward_only else "forward_backward"
    key = (req.loss_fn, tuple(sorted((req.loss_fn_config or {}).items())))
    return c.enqueue(who, kind, req.model_id, req.seq_id, req, loss_key=key)


def model_op(kind: str, schema: type[edge.ModelRef]):
    """The handler (app context, tenant, JSON body) of a request on one model that the
    worker runs in the model's order: HotRoutes answers these (app.py)."""

    def handler(c: AppContext, who: str, body: dict) -> dict:
        try:
            req = edge.parse(schema, body, kind)
            c.store.model(req.model_id, who)
            c.check_seq(req.model_id, req.seq_id)
        except (Refused, NotFound) as e:
            return c.failed(who, str(e), *c.owned_slot(who, body))
        return c.enqueue(who, kind, req.model_id, req.seq_id, req.model_dump(exclude_none=True))

    handler.__name__ = kind
    return handler


# path -> (handler, body schema): one optim_step per tenant and step, answered before
# FastAPI (app.py) like the sampling hot path.
MODEL_OPS = {
    f"/api/v1/{kind}": (model_op(kind, schema), schema)
    for kind, schema in (
        ("optim_step", edge.OptimStep),
        ("save_weights", edge.SaveWeights),
        ("save_weights_for_sampler", edge.SaveWeights),
        ("unload_model", edge.ModelRef),
    )
}


@router.post("/api/v1/save_weights_external", **takes(edge.SaveWeightsExternal))
async def save_weights_external(request: Request):
    c = context(request)
    who, body = c.owner(request), await c.body_json(request)
    try:
        req = await c.parse(request, edge.SaveWeightsExternal, body, "save_weights_external")
        c.store.model(req.model_id, who)
        c.check_seq(req.model_id, req.seq_id)
        if req.age_encryption_recipients is not None:
            age_recipients(req.age_encryption_recipients)
    except (Refused, NotFound, ValueError) as e:
        return c.failed(who, str(e), *c.owned_slot(who, body))
    return c.enqueue(
        who,
        "save_weights_external",
        req.model_id,
        req.seq_id,
        req.model_dump(exclude_none=True),
    )


@router.post("/api/v1/load_weights", **takes(edge.LoadWeights))
async def load_weights(request: Request):
    c = context(request)
    who, body = c.owner(request), await c.body_json(request)
    try:
        req = await c.parse(request, edge.LoadWeights, body, "load_weights")
        c.store.resolve(req.path, who, "weights")
        if req.session_id is not None:
            c.store.check_session(req.session_id, who)
            mid = c.store.model_id(req.session_id, req.model_seq_id)
            c.store.check_room(who, new_run=True)
            return c.enqueue(who, "load_weights", mid, None, req.model_dump(exclude_none=True))
        if req.model_id is None:
            raise Refused(422, "load_weights: needs model_id or session_id")
        c.store.model(req.model_id, who)
        c.check_seq(req.model_id, req.seq_id)
    except (Refused, NotFound, LimitReached) as e:
        return c.failed(who, str(e), *c.owned_slot(who, body))
    return c.enqueue(
        who, "load_weights", req.model_id, req.seq_id, req.model_dump(exclude_none=True)
    )


@router.post("/api/v1/create_custom_loss", **takes(edge.CreateCustomLoss))
async def create_custom_loss(request: Request):
    c = context(request)
    who, body, req = await c.parsed(request, edge.CreateCustomLoss, "create_custom_loss")
    c.store.check_session(req.session_id, who)
    return c.enqueue(who, "create_custom_loss", None, None, req.model_dump(exclude_none=True))
