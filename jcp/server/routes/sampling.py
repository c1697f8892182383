"""The sampling routes of jcp-serve: sampling sessions and asample.

POST asample is a hot route (jcp.server.asgi.HotRoutes calls `asample` directly; the
FastAPI copy puts it in the schema): it parses and bounds the body and enqueues one Work
of kind "sample" (text stops through the model's tokenizer: text.StopWatch). No jax, no
worker.
"""

from __future__ import annotations

import uuid

from fastapi import APIRouter, Request

from jcp.server import edge, wire
from jcp.server import text as text_lib
from jcp.server.context import AppContext, context, takes
from jcp.server.edge import Refused
from jcp.server.state import NotFound

router = APIRouter()


@router.post("/api/v1/create_sampling_session", **takes(edge.CreateSamplingSession))
async def create_sampling_session(request: Request):
    c = context(request)
    who, body, req = await c.parsed(request, edge.CreateSamplingSession, "create_sampling_session")
    c.store.check_session(req.session_id, who)
    if req.model_path:
        # Named sampler weights, or an uploaded (or exported) PEFT folder: the worker
        # loads either with load_peft.
        kind = (
            "external_weights"
            if req.model_path.split("/")[3:4] == ["external_weights"]
            else "sampler_weights"
        )
        folder, base = c.store.resolve(req.model_path, who, kind)
    else:
        folder, base = None, req.base_model
        if base != c.served.name:
            raise NotFound(f"base model {base!r} not found; this server serves {c.served.name!r}")
    return {
        "type": "create_sampling_session",
        "sampling_session_id": c.store.add_sampler(
            who, base or c.served.name, req.model_path, folder, req.session_id
        ),
    }


@router.get("/api/v1/samplers/{sampler_id}")
async def get_sampler(sampler_id: str, request: Request):
    c = context(request)
    rec = c.store.sampler(sampler_id, c.owner(request))
    return {
        "sampler_id": rec.sampler_id,
        "base_model": rec.base_model,
        "model_path": rec.model_path,
    }


def asample(c: AppContext, who: str, body: dict) -> dict:
    """POST asample (HotRoutes)."""
    n = body.get("num_samples", 1)
    # The failed future still answers one id per sample the client asked for, but
    # never more than the bound (the ids are built here, on the event loop).
    n = (
        n
        if isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= c.limits.num_samples
        else 1
    )
    try:
        req = edge.parse(edge.Sample, body, "asample")
        if req.num_samples > c.limits.num_samples:
            raise Refused(
                422,
                f"asample: num_samples {req.num_samples} exceeds "
                f"{c.limits.num_samples} (--max-num-samples)",
            )
        length = sum(len(c.tokens) for c in req.prompt.chunks)
        cap = c.served.max_context_length
        if length + req.sampling_params.max_tokens > cap:
            raise Refused(
                422,
                f"asample: {length} prompt tokens + sampling_params."
                f"max_tokens {req.sampling_params.max_tokens} exceed the "
                f"max_context_length of {cap} tokens",
            )
        c.store.sampler(req.sampling_session_id, who)
        args = wire.decode_sample(body)
        watch = None
        if args.stop_strings:  # text stops, through the model's tokenizer
            if c.text is None:
                raise Refused(
                    422,
                    "asample: sampling_params.stop: string stops need the "
                    "model's tokenizer (serve --hf-model with a "
                    "tokenizer.json); pass token ids",
                )
            watch = text_lib.StopWatch(c.text, args.stop_strings)
    except (Refused, wire.WireError, NotFound) as e:
        return c.failed(who, str(e), sample_sequence_ids=sequence_ids(n))
    return c.enqueue(
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


def sequence_ids(n: int) -> list[str]:
    """n new sample sequence ids (one random draw for all: they need be unique only)."""
    base = uuid.uuid4().hex
    return [f"seq-{base}-{k}" for k in range(n)]
