"""OpenAI-compatible routes on jcp-serve: GET /v1/models, POST /v1/completions and
POST /v1/chat/completions, on the same app, port and API keys as the Tinker routes.

Owns the routes (a module-level FastAPI router over the AppContext, jcp.server.context),
the choice of weights (`model`: the base model's name, or a `tinker://` path of the
caller's: named sampler weights, an in-memory sampler snapshot, a training checkpoint —
another tenant's is "not found") and each request's life: its prompts queued, awaited,
cancelled when the client goes. The request bodies are jcp.server.openai_params's, the
response shapes (streamed as server-sent events or not) jcp.server.openai_format's.

One engine for both protocols: each prompt becomes one scheduler.Work of kind "sample",
the same Work a Tinker asample becomes, so it joins the one running engine batch with
every tenant's samples (its adapter per row, its tenant's prefix-cache partition) under
the same bounds (--max-num-samples for n, --max-body-bytes, the context length, the
tenant's futures). Its payload names its weights by a SamplerRecord built here and asks
for the SampleResult itself (Worker._admit_sample). Text comes from jcp.server.text: the
prompt and chat template in, the completion's text out; string stops and a stream's feed
ride on the request's StopWatch, which the engine calls after every decode call — a
sequence that meets a stop string ends at that step, its rows freed. A client that
disconnects cancels its requests (queued ones at once, running ones at the worker's next
step boundary, as cancel_future does).

Where OpenAI and vLLM's OpenAI-compatible server differ, vLLM's behaviour is followed
(top_k as an extension, echo with prompt log-probs, max_tokens 0 with echo, string stops
cut where they start, the stop token kept in the token count). It must never import jax
or the worker.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time

import numpy as np
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response

from jcp.server import edge, redact, wire
from jcp.server.asgi import off_loop
from jcp.server.context import AppContext, context
from jcp.server.edge import Refused
from jcp.server.openai_format import (
    Call,
    EventStream,
    Job,
    StreamFormat,
    finish,
    sse,
    top_rows,
    usage,
    whole,
)
from jcp.server.openai_params import ApiError, Params, bad, chat_prompt, parse_params, prompts_of
from jcp.server.scheduler import Work
from jcp.server.state import AuthError, LimitReached, NotFound, SamplerRecord
from jcp.server.text import SeqText, StopWatch, Text

log = logging.getLogger("jcp.serve")
JSON = "application/json"
router = APIRouter()
# Tasks that forget the futures of cancelled requests (held until they are done).
_pending: set[asyncio.Task] = set()


def mount(app: FastAPI) -> None:
    """Add the /v1 routes to `app` (jcp.server.app.create_app calls this); /v1/models
    lists the models as created now."""
    app.state.openai_started = int(time.time())
    app.include_router(router)


def owner(c: AppContext, request: Request) -> str:
    auth = request.headers.get("authorization", "")
    key = auth[7:].strip() if auth[:7].lower() == "bearer " else request.headers.get("x-api-key")
    try:
        return c.store.owner_of_key(key or None)
    except AuthError:
        raise ApiError(
            401,
            "invalid or missing API key (Authorization: Bearer <key>)",
            None,
            "invalid_api_key",
        ) from None


def route(fn):
    """Refusals in OpenAI's error shape."""

    @functools.wraps(fn)
    async def handler(request: Request):
        state_dir = context(request).store.state_dir
        try:
            return await fn(request)
        except ApiError as e:
            return e.response(state_dir)
        except (Refused, LimitReached) as e:
            status = 400 if e.status == 422 else e.status
            return ApiError(status, str(e)).response(state_dir)
        except NotFound as e:
            return ApiError(404, str(e), "model", "model_not_found").response(state_dir)

    return handler


def weights(c: AppContext, model, who: str) -> SamplerRecord:
    """The weights `model` names for `who` (NotFound -> 404 for anything else)."""
    served = c.served
    if model == served.name:
        return SamplerRecord("openai", who, served.name, None, None)
    if not isinstance(model, str) or not model.startswith("tinker://"):
        raise NotFound(
            f"model {str(model)[:300]!r} not found; this server serves "
            f"{served.name!r} and your tinker:// checkpoints (GET /v1/models)"
        )
    parts = model[len("tinker://") :].split("/")
    if len(parts) == 3 and parts[1] == "sampler_weights":
        for rec in list(c.store.samplers.values()):  # an in-memory snapshot of the caller's
            if rec.model_path == model and rec.owner == who and rec.folder is None:
                return SamplerRecord("openai", who, rec.base_model, model, None)
    kind = (
        parts[1]
        if len(parts) == 3 and parts[1] in ("weights", "external_weights")
        else "sampler_weights"
    )
    folder, base = c.store.resolve(model, who, kind)
    return SamplerRecord("openai", who, base or served.name, model, folder)


def needs_text(c: AppContext) -> Text:
    if c.text is None:
        raise ApiError(
            400,
            f"model {c.served.name!r} has no tokenizer (serve --hf-model "
            "with a tokenizer.json): the OpenAI text routes need one; "
            "the Tinker routes take token ids",
            "model",
            "no_tokenizer",
        )
    return c.text


def _model_entry(c: AppContext, request: Request, name: str, owned_by: str, parent) -> dict:
    return {
        "id": name,
        "object": "model",
        "created": request.app.state.openai_started,
        "owned_by": owned_by,
        "root": c.served.name,
        "parent": parent,
        "max_model_len": c.served.max_context_length,
    }


@router.get("/v1/models")
@route
async def models(request: Request):
    c = context(request)
    who = owner(c, request)
    data = [_model_entry(c, request, c.served.name, "jcp", None)]
    for run in c.store.training_runs(who, 0, 1000)["training_runs"]:
        for ck in c.store.checkpoints(run["training_run_id"], who)["checkpoints"]:
            if ck["checkpoint_type"] in ("training", "sampler"):
                parent = run.get("base_model") or c.served.name
                data.append(_model_entry(c, request, ck["tinker_path"], who, parent))
    seen = {d["id"] for d in data}
    for rec in list(c.store.samplers.values()):
        if (
            rec.owner == who
            and rec.folder is None
            and rec.model_path is not None
            and rec.model_path not in seen
        ):
            seen.add(rec.model_path)
            data.append(_model_entry(c, request, rec.model_path, who, rec.base_model))
    return {"object": "list", "data": data}


# ---------------------------------------------------------------------- submission


def submit(c: AppContext, call: Call, prompt: list[int], max_tokens: int, on_tokens) -> str:
    """Queue one prompt as a sample Work -> its future's id."""
    down = c.failure()
    if down is not None:
        raise ApiError(503, down)
    prm = call.prm
    k = prm.logprobs or 0
    args = wire.SampleArgs(
        prompt=np.asarray(prompt, np.int32),
        num_samples=prm.n,
        max_tokens=max(1, max_tokens),
        temperature=prm.temperature,
        top_k=prm.top_k,
        top_p=prm.top_p,
        stop=None,
        seed=prm.seed,
        prompt_logprobs=prm.echo and prm.logprobs is not None,
        topk_prompt_logprobs=k if prm.echo else 0,
        topk_sample_logprobs=k,
    )
    watch = None
    if prm.stop or on_tokens is not None:
        watch = StopWatch(c.text, prm.stop, on_tokens)
    rid = c.futures.new(call.who)
    c.sched.submit(
        Work(
            request_id=rid,
            kind="sample",
            model_id=None,
            seq_id=None,
            payload={
                "sampler": call.rec,
                "args": args,
                "watch": watch,
                "raw": True,
                "stream": on_tokens is not None,
            },
            owner=call.who,
        )
    )
    return rid


def cancel(c: AppContext, job: Job, who: str) -> None:
    """The client went away: a queued request ends now, a running one at the worker's
    next step boundary (its rows freed); its future is forgotten once completed."""
    if c.sched.cancel(job.rid):
        c.futures.complete(job.rid, ("error", "cancelled by the client", "user"))
    else:
        c.sched.cancel_running(job.rid)

    async def forget():
        await job.entry.event.wait()
        c.futures.forget(job.rid, who)

    task = asyncio.get_running_loop().create_task(forget())
    _pending.add(task)
    task.add_done_callback(_pending.discard)


def outcome(c: AppContext, job: Job, who: str):
    """A completed job's SampleResult (its future is forgotten); ApiError for a
    failure."""
    entry = job.entry
    c.futures.forget(job.rid, who)
    kind, *rest = entry.result
    if kind == "result":
        return rest[0]
    status = 500 if kind != "error" or rest[1] == "server" else 400
    raise ApiError(status, rest[0] if kind == "error" else f"unexpected result {kind}")


def _plans(c: AppContext, prm: Params, prompts: list, chat: bool) -> list:
    """Each prompt as (token ids, its string or None, max_tokens), within the context."""
    cap = c.served.max_context_length
    plans = []
    for ids, s in prompts:
        want = prm.max_tokens if prm.max_tokens is not None else cap - len(ids)
        if len(ids) + max(want, 1) > cap:
            raise ApiError(
                400,
                f"This model's maximum context length is {cap} tokens. "
                f"However, you requested {len(ids) + max(want, 1)} tokens "
                f"({len(ids)} in the {'messages' if chat else 'prompt'}, "
                f"{want} in the completion). Please reduce the length of "
                f"the {'messages' if chat else 'prompt'} or completion.",
                "messages" if chat else "prompt",
                "context_length_exceeded",
            )
        plans.append((ids, s, want))
    return plans


async def prepare(c: AppContext, request: Request, chat: bool) -> Call:
    who = owner(c, request)
    raw = await c.body_bytes(request)
    # Parsed, templated and tokenized off the event loop when large (asgi.off_loop).
    return await off_loop(len(raw), _prepare, c, who, raw, chat)


def _prepare(c: AppContext, who: str, raw: bytes, chat: bool) -> Call:
    body = edge.parse_json(raw)
    wrong = edge.type_error(edge.ChatCompletion if chat else edge.Completion, body)
    if wrong is not None:
        raise bad(*wrong)
    model = body["model"]
    rec = weights(c, model, who)
    txt = needs_text(c)
    prm = parse_params(body, chat, c.limits)
    if chat:
        prompts = [(chat_prompt(body, txt), None)]
    else:
        prompts = prompts_of(body, txt, c.limits)
    if prm.n * len(prompts) > c.limits.num_samples:
        raise bad(
            "n",
            f"n × prompts = {prm.n * len(prompts)} exceeds "
            f"{c.limits.num_samples} (--max-num-samples)",
        )
    return Call(who, model, rec, txt, prm, _plans(c, prm, prompts, chat), chat)


async def disconnected(receive) -> None:
    """Returns once the client has gone (the body was read before)."""
    while (await receive())["type"] != "http.disconnect":
        pass


# ---------------------------------------------------------------------- handlers


def _submit_all(c: AppContext, call: Call, feed: asyncio.Queue) -> list[Job]:
    """Every prompt queued -> its Job; a stream's tokens go to `feed` as they come."""
    loop = asyncio.get_running_loop()
    prm, jobs = call.prm, []
    try:
        for i, (ids, s, want) in enumerate(call.plans):
            on_tokens = None
            if prm.stream and prm.max_tokens != 0:

                def on_tokens(j, toks, lps, rows, i=i):  # the worker thread
                    loop.call_soon_threadsafe(feed.put_nowait, ("tokens", i, j, toks, lps, rows))

            rid = submit(c, call, ids, want, on_tokens)
            jobs.append(
                Job(
                    rid,
                    c.futures.get(rid, call.who),
                    ids,
                    s,
                    i * prm.n,
                    [SeqText(call.txt, prm.stop) for _ in range(prm.n)],
                    [[0, 0] for _ in range(prm.n)],
                )
            )
    except BaseException:
        for job in jobs:
            cancel(c, job, call.who)
        raise
    return jobs


async def serve(request: Request, chat: bool):
    c = context(request)
    call = await prepare(c, request, chat)
    who = call.who
    feed: asyncio.Queue = asyncio.Queue()
    jobs = _submit_all(c, call, feed)
    if call.prm.stream:
        return EventStream(
            stream(c, call, jobs, feed),
            lambda: [cancel(c, j, who) for j in jobs if j.result is None],
        )
    loop = asyncio.get_running_loop()
    gone = loop.create_task(disconnected(request.receive))
    waits = [loop.create_task(j.entry.event.wait()) for j in jobs]
    try:
        while not all(w.done() for w in waits):
            await asyncio.wait(
                [gone, *[w for w in waits if not w.done()]], return_when=asyncio.FIRST_COMPLETED
            )
            if gone.done():
                for job in jobs:
                    if not job.entry.event.is_set():
                        cancel(c, job, who)
                return Response(status_code=499)
    finally:
        gone.cancel()
        for w in waits:
            w.cancel()
    errors = []
    for job in jobs:
        try:
            job.result = outcome(c, job, who)
        except ApiError as e:
            errors.append(e)
    if errors:
        raise errors[0]
    return whole(call, jobs)


async def stream(c: AppContext, call: Call, jobs: list[Job], feed: asyncio.Queue):
    """The server-sent events of a streamed request (each `data: {json}`), ending with
    the usage chunk (stream_options.include_usage) and `data: [DONE]`."""
    fmt = StreamFormat(call)
    for out in fmt.first(jobs):
        yield out
    loop = asyncio.get_running_loop()

    async def done(i: int, job: Job):
        await job.entry.event.wait()
        feed.put_nowait(("done", i))

    waits = [loop.create_task(done(i, job)) for i, job in enumerate(jobs)]
    try:
        async for out in events(c, fmt, jobs, feed):
            yield out
    finally:
        for w in waits:
            w.cancel()


def _tokens(fmt: StreamFormat, job: Job, j: int, toks, lps, rows) -> bytes | None:
    """The chunk of the tokens a decode call fed one choice (None: nothing to send)."""
    k = fmt.call.prm.logprobs
    seq, sent = job.seqs[j], job.sent[j]
    if seq.ended:
        return None
    start = len(seq.tokens)
    for t in toks:
        if seq.push(t):
            break
    take = len(seq.tokens) - start
    sent[0] += take
    top = None
    if rows is not None and k:
        top = [
            [(int(a), float(b)) for a, b in zip(r[:k], v[:k])]
            for r, v in zip(rows[0][:take].tolist(), rows[1][:take].tolist())
        ]
    return fmt.step(job, j, toks[:take], lps[:take], top)


async def events(c: AppContext, fmt: StreamFormat, jobs: list[Job], feed: asyncio.Queue):
    """The chunks of a stream after its first ones: tokens as the engine's decode calls
    feed them, each job's end (its result's last tokens, finish reasons), the usage."""
    call, prm = fmt.call, fmt.call.prm
    n_out, left = 0, len(jobs)
    while left:
        item = await feed.get()
        if item[0] == "tokens":
            _, i, j, toks, lps, rows = item
            out = _tokens(fmt, jobs[i], j, toks, lps, rows)
            if out is not None:
                yield out
            continue
        job = jobs[item[1]]
        left -= 1
        try:
            job.result = outcome(c, job, call.who)
        except ApiError as e:
            yield sse(
                {
                    "error": {
                        "message": redact.client_message(str(e), c.store.state_dir),
                        "type": e.kind,
                        "param": e.param,
                        "code": e.code,
                    }
                }
            )
            for other in jobs:
                if other.result is None and other is not job:
                    cancel(c, other, call.who)
            yield b"data: [DONE]\n\n"
            return
        for j in range(prm.n):
            streamed = job.sent[j][0]
            toks, lps, tk, reason = finish(call, job, j)
            n_out += len(toks)
            top = top_rows(tk, prm.logprobs or 0, streamed, len(toks))
            yield fmt.step(job, j, toks[streamed:], lps[streamed:], top, reason)
    if prm.include_usage:
        yield fmt.chunk([], usage=usage(jobs, n_out))
    yield b"data: [DONE]\n\n"


# The bodies in the OpenAPI schema (what the fuzz tests generate requests from).
def takes(model) -> dict:
    schema = edge.json_schema(model)
    return {
        "openapi_extra": {"requestBody": {"required": True, "content": {JSON: {"schema": schema}}}}
    }


@router.post("/v1/completions", **takes(edge.Completion))
@route
async def completions(request: Request):
    return await serve(request, chat=False)


@router.post("/v1/chat/completions", **takes(edge.ChatCompletion))
@route
async def chat_completions(request: Request):
    return await serve(request, chat=True)
