"""The ASGI app: Tinker SDK 0.38 routes under /api/v1, the OpenAI routes under /v1.

`create_app` assembles it: the AppContext (jcp.server.context) on `app.state.jcp`, the
exception handlers (STATUS, Refused; bodies {"detail": message}, server paths redacted),
the routers of jcp/server/routes/ (service, training, sampling, runs and checkpoints,
futures), the OpenAI routes (openai_api), SDK 0.39's checkpoint search and
external-weights uploads (checkpoint_api), and `HotRoutes` (jcp.server.asgi) in front of
it for asample and retrieve_future.

Handlers authenticate, parse, validate what can be checked without the model, and enqueue
a scheduler.Work; they answer with a future ({request_id}) at once and never wait for the
worker (REST routes that touch folders a load might be reading wait for it). It must
never import jax or the worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from jcp.server import checkpoint_api, edge, openai_api, redact
from jcp.server import text as text_lib
from jcp.server.asgi import STATUS, HotRoutes, fastapi_route
from jcp.server.context import AppContext, ServedModel, takes
from jcp.server.edge import Limits, Refused
from jcp.server.future_table import FutureTable, UrlTokens
from jcp.server.routes import futures as futures_routes
from jcp.server.routes import runs, sampling, service, training
from jcp.server.scheduler import Scheduler
from jcp.server.state import LimitReached, StateStore

__all__ = ["FutureTable", "ServedModel", "UrlTokens", "create_app"]
log = logging.getLogger("jcp.serve")


def load_text(tokenizer_id: str | None) -> text_lib.Text | None:
    """The model's tokenizer and chat template (--hf-model): the OpenAI routes' text, and
    the Tinker SamplingParams.stop strings. None: token ids only (also when it is broken:
    that disables text, not the server)."""
    try:
        return text_lib.Text.load(tokenizer_id)
    except Exception as e:  # noqa: BLE001
        log.error(
            "the tokenizer in %s could not be loaded (%s); text routes are off", tokenizer_id, e
        )
        return None


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
    ctx = AppContext(
        store, sched, futures, served, limits, load_text(served.tokenizer_id), alive, failure
    )
    app.state.jcp = ctx

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
    for module in (service, training, sampling, runs, futures_routes):
        app.include_router(module.router)
    openai_api.mount(app)
    checkpoint_api.mount(app)
    hot = {
        "/api/v1/asample": (sampling.asample, edge.Sample),
        "/api/v1/retrieve_future": (futures_routes.retrieve_future, edge.RequestRef),
        **training.MODEL_OPS,
    }
    for path, (handler, model) in hot.items():
        # HotRoutes answers these first; FastAPI's copy puts them in the schema (and
        # serves them where `app` is mounted alone).
        app.post(path, **takes(model))(fastapi_route(handler))
    # forward_backward's FastAPI route is training.router's (a protobuf body).
    raw = {"/api/v1/forward_backward": training.forward_backward_body}
    return HotRoutes(app, {path: h for path, (h, _) in hot.items()}, raw)
