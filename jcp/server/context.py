"""What every route of jcp-serve shares: the app context and the steps of a handler.

Owns `AppContext` (the state store, scheduler, futures, served model, edge limits,
tokenizer text and worker health that the routes read, kept on the FastAPI app as
`app.state.jcp`; `context(request)` returns it) with the steps common to handlers:
the tenant of a request, the JSON body under --max-body-bytes, the seq_id check, a
request queued for the worker (`enqueue`) or refused as a completed future (`failed`), and
`takes` (a route's body in the OpenAPI schema). Never imports jax or the worker.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from fastapi import Request

from jcp.server import edge
from jcp.server import text as text_lib
from jcp.server.asgi import JSON, off_loop, read_body
from jcp.server.edge import Limits, Refused
from jcp.server.future_table import FutureTable, UrlTokens
from jcp.server.scheduler import Scheduler, Work
from jcp.server.state import NotFound, StateStore


@dataclasses.dataclass(frozen=True)
class ServedModel:
    name: str
    max_context_length: int
    max_rank: int
    tokenizer_id: str | None
    # The adapter files an external-weights upload may hold (None: uploads are refused).
    peft: object | None = None  # a checkpoint_api.PeftLayout


@dataclasses.dataclass
class AppContext:
    """The server's state as the routes see it. alive() -> whether the worker can serve;
    failure() -> why a multi-process job cannot (every new request is then refused, 503).
    text: the model's tokenizer and chat template (None: token ids only)."""

    store: StateStore
    sched: Scheduler
    futures: FutureTable
    served: ServedModel
    limits: Limits
    text: text_lib.Text | None
    alive: Callable[[], bool]
    failure: Callable[[], str | None]
    tokens: UrlTokens = dataclasses.field(default_factory=UrlTokens)

    def owner(self, request: Request) -> str:
        return self.store.owner_of_key(request.headers.get("x-api-key"))

    async def body_bytes(self, request: Request) -> bytes:
        return await read_body(
            request.headers.get("content-length", ""), request.stream(), self.limits.body_bytes
        )

    async def body_json(self, request: Request) -> dict:
        """The JSON body (off the event loop when large: asgi.off_loop); its size is kept
        for `parse`."""
        raw = await self.body_bytes(request)
        request.state.body_size = len(raw)
        return await off_loop(len(raw), edge.parse_json, raw)

    async def parse(self, request: Request, model: type, body: dict, name: str):
        """edge.parse(model, body, name) of the body that body_json read: off the event
        loop when that body was large (a client names the sizes of its lists and maps)."""
        size = getattr(request.state, "body_size", 0)
        return await off_loop(size, edge.parse, model, body, name)

    async def parsed(self, request: Request, model: type, name: str) -> tuple[str, dict, object]:
        """(the caller's tenant, the JSON body, the body parsed as `model` for route `name`):
        a JSON route's first steps, refusals naming the field (edge.parse); off the event
        loop when the body is large."""
        who, raw = self.owner(request), await self.body_bytes(request)
        body, req = await off_loop(len(raw), _json_as, raw, model, name)
        return who, body, req

    def check_seq(self, model_id: str, seq: int | None) -> None:
        """Refuse a seq_id the model's queue could never reach: more than --max-futures past
        the one it waits for (a tenant has no more requests outstanding). Queued, it would
        become the model's last seq_id and every later request would wait out the gap
        timeout."""
        expected = self.sched.next_seq(model_id)
        if seq is not None and seq > expected + self.limits.futures:
            raise Refused(
                422,
                f"seq_id {seq} is more than {self.limits.futures} (--max-futures) "
                f"past this model's next seq_id {expected}",
            )

    def owned_slot(self, who: str, body: dict) -> tuple[str | None, int | None]:
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
            self.store.model(mid, who)
            self.check_seq(mid, seq)
        except (NotFound, Refused):
            return None, None
        return mid, seq

    def failed(
        self,
        who: str,
        message: str,
        model_id: str | None = None,
        seq_id: int | None = None,
        **extra,
    ) -> dict:
        """A future completed with `message` (category "user"). With the model and seq_id
        known it is completed by the worker in the model's order, so the model's next
        request never waits for a seq_id that was refused here."""
        rid = self.futures.new(who, **extra)
        if model_id is not None and seq_id is not None:
            self.sched.submit(
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
            self.futures.complete(rid, ("error", message, "user"))
        return {"request_id": rid, **extra}

    def enqueue(
        self, who: str, kind: str, model_id, seq_id, payload, loss_key=None, group=None, **extra
    ) -> dict:
        """Queue a Work for the worker -> {request_id, …extra, model_id}: its future."""
        down = self.failure()
        if down is not None:
            raise Refused(503, down)
        rid = self.futures.new(who, group, **extra)
        self.sched.submit(
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

    async def run_now(self, who: str, kind: str, payload: dict):
        """Queue unordered work for the worker and wait for its result (REST routes that
        answer directly, not with a future)."""
        rid = self.enqueue(who, kind, None, None, payload)["request_id"]
        entry = self.futures.get(rid, who)
        await entry.event.wait()
        kind, *rest = entry.result
        if kind == "error":
            raise Refused(422, rest[0])
        return rest[0]


def _json_as(raw: bytes, model: type, name: str) -> tuple[dict, object]:
    body = edge.parse_json(raw)
    return body, edge.parse(model, body, name)


def context(request: Request) -> AppContext:
    """The AppContext of the app serving `request`."""
    return request.app.state.jcp


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
