"""OpenAI-compatible routes on jcp-serve: GET /v1/models, POST /v1/completions and
POST /v1/chat/completions, on the same app, port and API keys as the Tinker routes.

Owns the OpenAI request bodies (what is served, what is refused naming the field, in
OpenAI's error shape {"error": {message, type, param, code}}), the choice of weights
(`model`: the base model's name, or a `tinker://` path of the caller's: named sampler
weights, an in-memory sampler snapshot, a training checkpoint — another tenant's is "not
found"), and the OpenAI response shapes, streamed as server-sent events or not.

One engine for both protocols: each prompt becomes one scheduler.Work of kind "sample",
the same Work a Tinker asample becomes, so it joins the one running engine batch with
every tenant's samples (its adapter per row, its tenant's prefix-cache partition) under
the same bounds (--max-num-samples for n, --max-body-bytes, the context length, the
tenant's futures). Its payload names its weights by a SamplerRecord built here and asks
for the SampleResult itself (engine._admit_sample). Text comes from jcp.server.text: the
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
import contextlib
import dataclasses
import functools
import json
import logging
import math
import time
import uuid

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from jcp.server import edge, redact, wire
from jcp.server.edge import MAX_STOP_CHARS, MAX_STOPS, Limits, Refused
from jcp.server.scheduler import Scheduler, Work
from jcp.server.state import AuthError, LimitReached, NotFound, SamplerRecord, StateStore
from jcp.server.text import SeqText, StopWatch, Text, TextError

log = logging.getLogger("jcp.serve")

# top_logprobs / logprobs per position: vLLM's default max_logprobs (OpenAI's chat: 20).
MAX_LOGPROBS = 20
# Completions' max_tokens when none is given (OpenAI's legacy default); chat's default is
# the context left after the prompt (vLLM).
DEFAULT_MAX_TOKENS = 16
JSON = "application/json"
# A log-prob JSON cannot hold (-inf) is written as vLLM writes it.
MIN_LOGPROB = -9999.0
# Fields that ask for what these routes do not do, with the value that asks for nothing
# (a predicate): sent with any other value they are refused, naming the field.
_NONE = lambda v: v is None
_FALSE = lambda v: v is None or v is False
_EMPTY = lambda v: v is None or v == [] or v == {} or v == ""
_ZERO = lambda v: v is None or v == 0
UNSUPPORTED = {
    "tools": ("tools are not supported", _EMPTY),
    "tool_choice": ("tools are not supported", lambda v: v in (None, "none", "auto")),
    "functions": ("functions are not supported", _EMPTY),
    "function_call": ("functions are not supported", lambda v: v in (None, "none", "auto")),
    "response_format": (
        "response_format (structured output) is not supported",
        lambda v: v is None or v == {"type": "text"},
    ),
    "audio": ("audio is not supported", _NONE),
    "modalities": ("only text output is supported", lambda v: v in (None, ["text"])),
    "prediction": ("predicted outputs are not supported", _NONE),
    "web_search_options": ("web search is not supported", _NONE),
    "reasoning_effort": ("reasoning_effort is not supported", _NONE),
    "logit_bias": ("logit_bias is not supported", _EMPTY),
    "presence_penalty": ("presence_penalty is not supported", _ZERO),
    "frequency_penalty": ("frequency_penalty is not supported", _ZERO),
    "repetition_penalty": ("repetition_penalty is not supported", lambda v: v in (None, 1)),
    "min_p": ("min_p is not supported", _ZERO),
    "min_tokens": ("min_tokens is not supported", _ZERO),
    "suffix": ("suffix (insertion) is not supported", _EMPTY),
    "use_beam_search": ("beam search is not supported", _FALSE),
    "stop_token_ids": ("stop_token_ids are not supported; use stop strings", _EMPTY),
    "ignore_eos": ("ignore_eos is not supported", _FALSE),
    "include_stop_str_in_output": ("include_stop_str_in_output is not supported", _FALSE),
    "skip_special_tokens": (
        "skip_special_tokens: only true is supported",
        lambda v: v is None or v is True,
    ),
    "prompt_logprobs": ("prompt_logprobs: use echo with logprobs", _NONE),
    "truncate_prompt_tokens": ("truncate_prompt_tokens is not supported", _NONE),
    "guided_json": ("guided decoding is not supported", _NONE),
    "guided_regex": ("guided decoding is not supported", _NONE),
    "guided_choice": ("guided decoding is not supported", _NONE),
    "guided_grammar": ("guided decoding is not supported", _NONE),
    "structured_outputs": ("structured outputs are not supported", _NONE),
    "prompt_embeds": ("prompt_embeds are not supported", _NONE),
    "documents": ("documents are not supported", _NONE),
    "continue_final_message": ("continue_final_message is not supported", _FALSE),
    "return_tokens_as_token_ids": ("return_tokens_as_token_ids is not supported", _FALSE),
}


class ApiError(Exception):
    """A request refused: HTTP `status` and OpenAI's error fields."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str | None = None,
    ):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code
        self.kind = kind or ("server_error" if status >= 500 else "invalid_request_error")

    def response(self, state_dir: str) -> JSONResponse:
        return JSONResponse(
            {
                "error": {
                    "message": redact.client_message(str(self), state_dir),
                    "type": self.kind,
                    "param": self.param,
                    "code": self.code,
                }
            },
            status_code=self.status,
        )


def bad(param: str, message: str, code: str | None = None) -> ApiError:
    return ApiError(400, f"{param}: {message}", param, code)


# ---------------------------------------------------------------------- request fields


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int(body: dict, name: str, lo: int, hi: int, default):
    v = body.get(name)
    if v is None:
        return default
    if not _is_int(v) or not lo <= v <= hi:
        raise bad(name, f"must be an integer in [{lo}, {hi}], got {v!r}")
    return v


def _num(body: dict, name: str, lo: float, hi: float, default: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    if (
        isinstance(v, bool)
        or not isinstance(v, (int, float))
        or not math.isfinite(v)
        or not lo <= v <= hi
    ):
        raise bad(name, f"must be a number in [{lo}, {hi}], got {v!r}")
    return float(v)


def _bool(body: dict, name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(name, f"must be a boolean, got {v!r}")
    return v


@dataclasses.dataclass(frozen=True)
class Params:
    """What one OpenAI request asks of each of its prompts."""

    n: int
    max_tokens: int | None  # None: the route's default
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    logprobs: int | None  # top alternatives per position; None: no log-probs
    echo: bool
    stream: bool
    include_usage: bool


def parse_params(body: dict, chat: bool, limits: Limits) -> Params:
    for name, (why, fine) in UNSUPPORTED.items():
        if name in body and not fine(body[name]):
            raise ApiError(400, f"{name}: {why} by jcp-serve", name, "unsupported_parameter")
    n = _int(body, "n", 1, limits.num_samples, 1)
    best_of = body.get("best_of")
    if best_of is not None and best_of not in (1, n):
        raise ApiError(
            400, "best_of: only best_of = n is supported", "best_of", "unsupported_parameter"
        )
    if chat:
        max_tokens = _int(body, "max_completion_tokens", 1, wire_int_max(), None)
        if max_tokens is None:
            max_tokens = _int(body, "max_tokens", 1, wire_int_max(), None)
        want = _bool(body, "logprobs", False)
        top = _int(body, "top_logprobs", 0, MAX_LOGPROBS, None)
        if top is not None and not want:
            raise bad("top_logprobs", "needs logprobs: true")
        logprobs = (top or 0) if want else None
        if _bool(body, "echo", False):
            raise ApiError(
                400, "echo: not supported on chat completions", "echo", "unsupported_parameter"
            )
        echo = False
    else:
        max_tokens = _int(body, "max_tokens", 0, wire_int_max(), DEFAULT_MAX_TOKENS)
        logprobs = _int(body, "logprobs", 0, MAX_LOGPROBS, None)
        echo = _bool(body, "echo", False)
        if max_tokens == 0 and not echo:
            raise bad("max_tokens", "must be ≥ 1 (0 only with echo)")
    stream = _bool(body, "stream", False)
    opts = body.get("stream_options")
    if opts is not None and (not isinstance(opts, dict) or not stream):
        raise bad("stream_options", "an object, with stream: true")
    include_usage = bool(opts and opts.get("include_usage"))
    if stream and echo and logprobs is not None:
        raise ApiError(
            400,
            "echo: prompt log-probs are not streamed; use stream: false",
            "echo",
            "unsupported_parameter",
        )
    top_k = _int(body, "top_k", -1, wire_int_max(), -1)
    seed = body.get("seed")
    if seed is not None and (not _is_int(seed) or not 0 <= seed < 1 << 63):
        raise bad("seed", f"must be an integer in [0, 2^63), got {seed!r}")
    stop = body.get("stop")
    stops = (
        (stop,)
        if isinstance(stop, str)
        else tuple(stop)
        if isinstance(stop, list)
        else ()
        if stop is None
        else None
    )
    if stops is None or not all(isinstance(s, str) and s for s in stops):
        raise bad("stop", "must be a non-empty string or a list of them")
    if len(stops) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in stops):
        raise bad(
            "stop", f"at most {MAX_STOPS} stop strings of at most {MAX_STOP_CHARS} characters"
        )
    return Params(
        n=n,
        max_tokens=max_tokens,
        temperature=_num(body, "temperature", 0.0, 1e6, 1.0),
        top_p=_num(body, "top_p", 1e-9, 1.0, 1.0),
        top_k=-1 if top_k == 0 else top_k,
        seed=seed,
        stop=stops,
        logprobs=logprobs,
        echo=echo,
        stream=stream,
        include_usage=include_usage,
    )


def wire_int_max() -> int:
    return 2**31 - 1


def prompts_of(body: dict, text: Text, limits: Limits) -> list[tuple[list[int], str | None]]:
    """/v1/completions' prompt -> [(token ids, the prompt string or None)]."""
    p = body.get("prompt")
    if isinstance(p, str):
        items = [p]
    elif isinstance(p, list) and p and all(_is_int(t) for t in p):
        items = [p]
    elif isinstance(p, list) and p and all(isinstance(x, str) for x in p):
        items = p
    elif (
        isinstance(p, list)
        and p
        and all(isinstance(x, list) and x and all(_is_int(t) for t in x) for x in p)
    ):
        items = p
    else:
        raise bad(
            "prompt",
            "must be a string, a list of strings, a list of token ids or a "
            "list of such lists (none empty)",
        )
    if len(items) > limits.num_samples:
        raise bad("prompt", f"at most {limits.num_samples} prompts per request (--max-num-samples)")
    out = []
    for i, x in enumerate(items):
        if isinstance(x, str):
            ids = text.encode(x)
            if not ids:
                raise bad("prompt", f"prompt {i} is empty")
            out.append((ids, x))
        else:
            if any(t < 0 or t > wire_int_max() for t in x):
                raise bad("prompt", f"prompt {i} holds a token id outside [0, 2^31)")
            out.append((list(x), None))
    return out


def chat_prompt(body: dict, text: Text) -> list[int]:
    """/v1/chat/completions' messages -> the prompt's token ids (the chat template)."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages", "must be a non-empty list of messages")
    out = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(where, "must be an object {role, content}")
        role = m.get("role")
        if role in ("tool", "function") or m.get("tool_calls") or m.get("function_call"):
            raise ApiError(
                400,
                f"{where}: tool messages and tool calls are not supported",
                where,
                "unsupported_parameter",
            )
        if role not in ("system", "developer", "user", "assistant"):
            raise bad(
                f"{where}.role", f"must be system, developer, user or assistant, got {role!r}"
            )
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text" or not isinstance(part.get("text"), str):
                    raise ApiError(
                        400,
                        f"{where}.content[{j}]: only text parts are supported"
                        f" (got type {kind!r}: images, audio and files are not)",
                        f"{where}.content[{j}].type",
                        "unsupported_parameter",
                    )
                parts.append(part["text"])
            content = "\n".join(parts)
        elif content is None and role == "assistant":
            content = ""
        elif not isinstance(content, str):
            raise bad(f"{where}.content", "must be a string or a list of text parts")
        out.append({"role": "system" if role == "developer" else role, "content": content})
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict) or {
        "messages",
        "tools",
        "documents",
        "add_generation_prompt",
    } & set(kwargs):
        raise bad(
            "chat_template_kwargs",
            "must be an object of template variables (not "
            "messages, tools, documents, add_generation_prompt)",
        )
    add = _bool(body, "add_generation_prompt", True)
    try:
        ids = text.chat_tokens(out, add, **kwargs)
    except TextError as e:
        raise bad("messages", str(e)) from None
    if not ids:
        raise bad("messages", "the chat template rendered an empty prompt")
    return ids


# ---------------------------------------------------------------------- the routes


@dataclasses.dataclass
class Job:
    """One prompt's engine request: its future, prompt, choices and (streamed) progress."""

    rid: str
    entry: object  # its FutureTable entry (held: read after completion)
    prompt: list[int]
    prompt_text: str | None
    first: int  # index of its first choice
    seqs: list  # SeqText per choice
    sent: list  # per choice: [tokens streamed, characters streamed]
    result: object = None  # the SampleResult once done


def mount(
    app: FastAPI,
    store: StateStore,
    sched: Scheduler,
    futures,
    served,
    limits: Limits,
    text: Text | None,
    body_json,
    failure=lambda: None,
) -> None:
    """Add the /v1 routes to `app` (jcp.server.app.create_app calls this). served: the
    app's ServedModel; body_json(request) -> the JSON body under --max-body-bytes."""
    started = int(time.time())
    pending: set[asyncio.Task] = set()  # forgetting the futures of cancelled requests

    def owner(request: Request) -> str:
        auth = request.headers.get("authorization", "")
        key = (
            auth[7:].strip() if auth[:7].lower() == "bearer " else request.headers.get("x-api-key")
        )
        try:
            return store.owner_of_key(key or None)
        except AuthError:
            raise ApiError(
                401,
                "invalid or missing API key (Authorization: Bearer <key>)",
                None,
                "invalid_api_key",
            ) from None

    def route(fn):
        @functools.wraps(fn)
        async def handler(request: Request):
            try:
                return await fn(request)
            except ApiError as e:
                return e.response(store.state_dir)
            except (Refused, LimitReached) as e:
                status = 400 if e.status == 422 else e.status
                return ApiError(status, str(e)).response(store.state_dir)
            except NotFound as e:
                return ApiError(404, str(e), "model", "model_not_found").response(store.state_dir)

        return handler

    def weights(model, who: str) -> SamplerRecord:
        """The weights `model` names for `who` (NotFound -> 404 for anything else)."""
        if model == served.name:
            return SamplerRecord("openai", who, served.name, None, None)
        if not isinstance(model, str) or not model.startswith("tinker://"):
            raise NotFound(
                f"model {str(model)[:300]!r} not found; this server serves "
                f"{served.name!r} and your tinker:// checkpoints (GET /v1/models)"
            )
        parts = model[len("tinker://") :].split("/")
        if len(parts) == 3 and parts[1] == "sampler_weights":
            for rec in list(store.samplers.values()):  # an in-memory snapshot of the caller's
                if rec.model_path == model and rec.owner == who and rec.folder is None:
                    return SamplerRecord("openai", who, rec.base_model, model, None)
        kind = (
            parts[1]
            if len(parts) == 3 and parts[1] in ("weights", "external_weights")
            else "sampler_weights"
        )
        folder, base = store.resolve(model, who, kind)
        return SamplerRecord("openai", who, base or served.name, model, folder)

    def needs_text() -> Text:
        if text is None:
            raise ApiError(
                400,
                f"model {served.name!r} has no tokenizer (serve --hf-model "
                "with a tokenizer.json): the OpenAI text routes need one; "
                "the Tinker routes take token ids",
                "model",
                "no_tokenizer",
            )
        return text

    @app.get("/v1/models")
    @route
    async def models(request: Request):
        who = owner(request)
        data = [
            {
                "id": served.name,
                "object": "model",
                "created": started,
                "owned_by": "jcp",
                "root": served.name,
                "parent": None,
                "max_model_len": served.max_context_length,
            }
        ]
        for run in store.training_runs(who, 0, 1000)["training_runs"]:
            for c in store.checkpoints(run["training_run_id"], who)["checkpoints"]:
                if c["checkpoint_type"] in ("training", "sampler"):
                    data.append(
                        {
                            "id": c["tinker_path"],
                            "object": "model",
                            "created": started,
                            "owned_by": who,
                            "root": served.name,
                            "parent": run.get("base_model") or served.name,
                            "max_model_len": served.max_context_length,
                        }
                    )
        seen = {d["id"] for d in data}
        for rec in list(store.samplers.values()):
            if (
                rec.owner == who
                and rec.folder is None
                and rec.model_path is not None
                and rec.model_path not in seen
            ):
                seen.add(rec.model_path)
                data.append(
                    {
                        "id": rec.model_path,
                        "object": "model",
                        "created": started,
                        "owned_by": who,
                        "root": served.name,
                        "parent": rec.base_model,
                        "max_model_len": served.max_context_length,
                    }
                )
        return {"object": "list", "data": data}

    # ------------------------------------------------------------------ submission

    def submit(
        who: str, rec: SamplerRecord, prompt: list[int], prm: Params, max_tokens: int, on_tokens
    ) -> str:
        """Queue one prompt as a sample Work -> its future's id."""
        down = failure()
        if down is not None:
            raise ApiError(503, down)
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
            watch = StopWatch(text, prm.stop, on_tokens)
        rid = futures.new(who)
        sched.submit(
            Work(
                request_id=rid,
                kind="sample",
                model_id=None,
                seq_id=None,
                payload={
                    "sampler": rec,
                    "args": args,
                    "watch": watch,
                    "raw": True,
                    "stream": on_tokens is not None,
                },
                owner=who,
            )
        )
        return rid

    def cancel(job: Job, who: str) -> None:
        """The client went away: a queued request ends now, a running one at the worker's
        next step boundary (its rows freed); its future is forgotten once completed."""
        if sched.cancel(job.rid):
            futures.complete(job.rid, ("error", "cancelled by the client", "user"))
        else:
            sched.cancel_running(job.rid)

        async def forget():
            await job.entry.event.wait()
            futures.forget(job.rid, who)

        task = asyncio.get_running_loop().create_task(forget())
        pending.add(task)
        task.add_done_callback(pending.discard)

    def outcome(job: Job, who: str):
        """A completed job's SampleResult (its future is forgotten); ApiError for a
        failure."""
        entry = job.entry
        futures.forget(job.rid, who)
        kind, *rest = entry.result
        if kind == "result":
            return rest[0]
        status = 500 if kind != "error" or rest[1] == "server" else 400
        raise ApiError(status, rest[0] if kind == "error" else f"unexpected result {kind}")

    async def prepare(request: Request, chat: bool):
        who = owner(request)
        body = await body_json(request)
        wrong = edge.type_error(edge.ChatCompletion if chat else edge.Completion, body)
        if wrong is not None:
            raise bad(*wrong)
        model = body["model"]
        rec = weights(model, who)
        txt = needs_text()
        prm = parse_params(body, chat, limits)
        if chat:
            prompts = [(chat_prompt(body, txt), None)]
        else:
            prompts = prompts_of(body, txt, limits)
        if prm.n * len(prompts) > limits.num_samples:
            raise bad(
                "n",
                f"n × prompts = {prm.n * len(prompts)} exceeds "
                f"{limits.num_samples} (--max-num-samples)",
            )
        cap = served.max_context_length
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
        return who, model, rec, txt, prm, plans

    async def disconnected(receive) -> None:
        """Returns once the client has gone (the body was read before)."""
        while (await receive())["type"] != "http.disconnect":
            pass

    # ------------------------------------------------------------------ responses

    def logprob(x) -> float | None:
        x = float(x)
        return None if math.isnan(x) else max(x, MIN_LOGPROB)

    def completion_logprobs(txt: Text, tokens, lps, top, offset: int = 0) -> dict:
        """OpenAI's completions logprobs of `tokens` (top: per token a list of (id, lp) or
        None); text_offset counts from `offset`, token texts end to end (as vLLM)."""
        strs = [txt.token_str(t) for t in tokens]
        offs, at = [], offset
        for s in strs:
            offs.append(at)
            at += len(s)
        return {
            "tokens": strs,
            "token_logprobs": [logprob(x) for x in lps],
            "top_logprobs": None
            if top is None
            else [
                None if row is None else {txt.token_str(i): logprob(v) for i, v in row}
                for row in top
            ],
            "text_offset": offs,
        }

    def chat_logprobs(txt: Text, tokens, lps, top) -> dict:
        def entry(t, lp):
            s = txt.token_str(t)
            return {"token": s, "logprob": logprob(lp), "bytes": list(s.encode("utf-8"))}

        return {
            "content": [
                {
                    **entry(t, lp),
                    "top_logprobs": [] if top is None else [entry(i, v) for i, v in top[k]],
                }
                for k, (t, lp) in enumerate(zip(tokens, lps))
            ],
            "refusal": None,
        }

    def top_rows(tk, k: int, lo: int = 0, hi: int | None = None):
        """The top-k (id, lp) rows of a TopK (positions lo:hi), None where undefined."""
        if tk is None or k <= 0:
            return None
        ids, lps = np.asarray(tk.token_ids)[lo:hi, :k], np.asarray(tk.logprobs)[lo:hi, :k]
        return [
            None if r[0] < 0 else [(int(i), float(v)) for i, v in zip(r, lv)]
            for r, lv in zip(ids.tolist(), lps.tolist())
        ]

    def finish(job: Job, j: int, prm: Params) -> tuple[list[int], list[float], object, str]:
        """A finished choice: (tokens, log-probs, top-k TopK, finish reason); its SeqText
        has taken every token."""
        s = job.result.sequences[j]
        seq = job.seqs[j]
        if prm.max_tokens == 0:  # echo only: the one drawn token is not part of the answer
            seq.text, seq.ended = "", True
            return [], [], None, "length"
        toks = [int(t) for t in s.tokens]
        if not prm.stop and not seq.tokens:  # nothing streamed, no stops: one decode
            seq.tokens, seq.text, seq.ended = toks, text.decode(toks), True
        for t in toks[len(seq.tokens) :]:
            if seq.push(t):
                break
        seq.finish()
        keep = len(seq.tokens) if seq.stopped else len(toks)
        reason = "stop" if seq.stopped or s.stop_reason == "stop" else "length"
        return toks[:keep], [float(x) for x in s.logprobs[:keep]], s.topk_logprobs, reason

    def usage(jobs: list[Job], completion: int) -> dict:
        prompt = sum(len(j.prompt) for j in jobs)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }

    def whole(jobs: list[Job], prm: Params, txt: Text, model: str, chat: bool) -> dict:
        choices, n_out = [], 0
        for job in jobs:
            for j in range(prm.n):
                toks, lps, tk, reason = finish(job, j, prm)
                n_out += len(toks)
                body = job.seqs[j].text
                lp = None
                if chat:
                    if prm.logprobs is not None:
                        lp = chat_logprobs(txt, toks, lps, top_rows(tk, prm.logprobs, 0, len(toks)))
                    choices.append(
                        {
                            "index": job.first + j,
                            "message": {"role": "assistant", "content": body, "tool_calls": []},
                            "logprobs": lp,
                            "finish_reason": reason,
                        }
                    )
                    continue
                if prm.echo:
                    head = (
                        job.prompt_text
                        if job.prompt_text is not None
                        else txt.decode(job.prompt, skip_special_tokens=False)
                    )
                    body = head + body
                if prm.logprobs is not None:
                    k, top = prm.logprobs, top_rows(tk, prm.logprobs, 0, len(toks))
                    if prm.echo:
                        r = job.result
                        plp = r.prompt_logprobs
                        ptop = top_rows(r.topk_prompt_logprobs, k) if k else None
                        toks_all = job.prompt + toks
                        lps_all = [float("nan")] + [float(x) for x in plp[1:]] + lps
                        top_all = None if not k else ptop + (top or [])
                        lp = completion_logprobs(txt, toks_all, lps_all, top_all)
                    else:
                        lp = completion_logprobs(txt, toks, lps, top)
                choices.append(
                    {"index": job.first + j, "text": body, "logprobs": lp, "finish_reason": reason}
                )
        kind = "chat.completion" if chat else "text_completion"
        return {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "object": kind,
            "created": int(time.time()),
            "model": model,
            "choices": choices,
            "usage": usage(jobs, n_out),
            "system_fingerprint": None,
        }

    # ------------------------------------------------------------------ handlers

    async def serve(request: Request, chat: bool):
        who, model, rec, txt, prm, plans = await prepare(request, chat)
        loop = asyncio.get_running_loop()
        feed: asyncio.Queue = asyncio.Queue()
        jobs: list[Job] = []
        try:
            for i, (ids, s, want) in enumerate(plans):
                on_tokens = None
                if prm.stream and prm.max_tokens != 0:

                    def on_tokens(j, toks, lps, rows, i=i):  # the worker thread
                        loop.call_soon_threadsafe(
                            feed.put_nowait, ("tokens", i, j, toks, lps, rows)
                        )

                rid = submit(who, rec, ids, prm, want, on_tokens)
                jobs.append(
                    Job(
                        rid,
                        futures.get(rid, who),
                        ids,
                        s,
                        i * prm.n,
                        [SeqText(txt, prm.stop) for _ in range(prm.n)],
                        [[0, 0] for _ in range(prm.n)],
                    )
                )
        except BaseException:
            for job in jobs:
                cancel(job, who)
            raise
        if prm.stream:
            return EventStream(
                stream(jobs, feed, prm, txt, model, chat, who),
                lambda: [cancel(j, who) for j in jobs if j.result is None],
            )
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
                            cancel(job, who)
                    return Response(status_code=499)
        finally:
            gone.cancel()
            for w in waits:
                w.cancel()
        errors = []
        for job in jobs:
            try:
                job.result = outcome(job, who)
            except ApiError as e:
                errors.append(e)
        if errors:
            raise errors[0]
        return whole(jobs, prm, txt, model, chat)

    async def stream(
        jobs: list[Job],
        feed: asyncio.Queue,
        prm: Params,
        txt: Text,
        model: str,
        chat: bool,
        who: str,
    ):
        """The server-sent events of a streamed request (each `data: {json}`), ending with
        the usage chunk (stream_options.include_usage) and `data: [DONE]`."""
        cid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created, kind = int(time.time()), "chat.completion.chunk" if chat else "text_completion"

        def chunk(choices, **extra) -> bytes:
            return sse(
                {
                    "id": cid,
                    "object": kind,
                    "created": created,
                    "model": model,
                    "choices": choices,
                    **extra,
                }
            )

        def choice(index: int, piece: str | None, lp=None, reason=None, role=False) -> dict:
            if chat:
                delta = {} if piece is None else {"content": piece}
                if role:
                    delta = {"role": "assistant", **delta}
                return {"index": index, "delta": delta, "logprobs": lp, "finish_reason": reason}
            return {"index": index, "text": piece or "", "logprobs": lp, "finish_reason": reason}

        def lps_of(toks, lps, top):
            if prm.logprobs is None or not toks:
                return None
            if chat:
                return chat_logprobs(txt, toks, lps, top)
            return completion_logprobs(txt, toks, lps, top)

        def step(job: Job, j: int, toks, lps, top, reason=None) -> bytes | None:
            """Text the choice may send now (and its tokens' log-probs), as one chunk."""
            seq, sent = job.seqs[j], job.sent[j]
            piece = seq.text[sent[1] : seq.ready]
            sent[1] += len(piece)
            lp = lps_of(toks, lps, top)
            if not piece and lp is None and reason is None:
                return None
            return chunk([choice(job.first + j, piece, lp, reason)])

        for job in jobs:  # the first chunk of every choice: its role (chat) or echo
            for j in range(prm.n):
                if chat:
                    yield chunk([choice(job.first + j, "", role=True)])
                elif prm.echo:
                    head = (
                        job.prompt_text
                        if job.prompt_text is not None
                        else txt.decode(job.prompt, skip_special_tokens=False)
                    )
                    yield chunk([choice(job.first + j, head)])
        loop = asyncio.get_running_loop()

        async def done(i: int, job: Job):
            await job.entry.event.wait()
            feed.put_nowait(("done", i))

        waits = [loop.create_task(done(i, job)) for i, job in enumerate(jobs)]
        try:
            async for out in events(jobs, feed, prm, chunk, step, who):
                yield out
        finally:
            for w in waits:
                w.cancel()

    async def events(jobs: list[Job], feed: asyncio.Queue, prm: Params, chunk, step, who: str):
        """The chunks of a stream after its first ones: tokens as the engine's decode calls
        feed them, each job's end (its result's last tokens, finish reasons), the usage."""
        n_out, left = 0, len(jobs)
        while left:
            item = await feed.get()
            if item[0] == "tokens":
                _, i, j, toks, lps, rows = item
                job = jobs[i]
                seq, sent = job.seqs[j], job.sent[j]
                if seq.ended:
                    continue
                start = len(seq.tokens)
                for t in toks:
                    if seq.push(t):
                        break
                take = len(seq.tokens) - start
                sent[0] += take
                top = None
                if rows is not None and prm.logprobs:
                    top = [
                        [(int(a), float(b)) for a, b in zip(r[: prm.logprobs], v[: prm.logprobs])]
                        for r, v in zip(rows[0][:take].tolist(), rows[1][:take].tolist())
                    ]
                out = step(job, j, toks[:take], lps[:take], top)
                if out is not None:
                    yield out
                continue
            job = jobs[item[1]]
            left -= 1
            try:
                job.result = outcome(job, who)
            except ApiError as e:
                yield sse(
                    {
                        "error": {
                            "message": redact.client_message(str(e), store.state_dir),
                            "type": e.kind,
                            "param": e.param,
                            "code": e.code,
                        }
                    }
                )
                for other in jobs:
                    if other.result is None and other is not job:
                        cancel(other, who)
                yield b"data: [DONE]\n\n"
                return
            for j in range(prm.n):
                streamed = job.sent[j][0]
                toks, lps, tk, reason = finish(job, j, prm)
                n_out += len(toks)
                top = top_rows(tk, prm.logprobs or 0, streamed, len(toks))
                yield step(job, j, toks[streamed:], lps[streamed:], top, reason)
        if prm.include_usage:
            yield chunk([], usage=usage(jobs, n_out))
        yield b"data: [DONE]\n\n"

    # The bodies in the OpenAPI schema (what the fuzz tests generate requests from).
    def takes(model) -> dict:
        schema = edge.json_schema(model)
        return {
            "openapi_extra": {
                "requestBody": {"required": True, "content": {JSON: {"schema": schema}}}
            }
        }

    @app.post("/v1/completions", **takes(edge.Completion))
    @route
    async def completions(request: Request):
        return await serve(request, chat=False)

    @app.post("/v1/chat/completions", **takes(edge.ChatCompletion))
    @route
    async def chat_completions(request: Request):
        return await serve(request, chat=True)


def sse(obj) -> bytes:
    return (
        b"data: "
        + json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()
        + b"\n\n"
    )


class EventStream(Response):
    """A server-sent event stream from an async iterator of byte chunks; when the client
    disconnects (uvicorn's send then drops data silently, so the request's receive is
    watched), the iterator is closed and `on_disconnect()` runs."""

    media_type = "text/event-stream"

    def __init__(self, chunks, on_disconnect):
        super().__init__(
            media_type=self.media_type,
            headers={"cache-control": "no-cache", "x-accel-buffering": "no"},
        )
        self.raw_headers = [(k, v) for k, v in self.raw_headers if k != b"content-length"]
        self.chunks, self.on_disconnect = chunks, on_disconnect

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        loop = asyncio.get_running_loop()
        gone = loop.create_task(_gone(receive))
        try:
            while True:
                nxt = loop.create_task(anext(self.chunks))
                await asyncio.wait([nxt, gone], return_when=asyncio.FIRST_COMPLETED)
                if not nxt.done():  # the client left while the stream waited
                    nxt.cancel()
                    break
                try:
                    data = nxt.result()
                except StopAsyncIteration:
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                    return
                if gone.done():
                    break
                await send({"type": "http.response.body", "body": data, "more_body": True})
        finally:
            gone.cancel()
            with contextlib.suppress(BaseException):
                await self.chunks.aclose()
        self.on_disconnect()


async def _gone(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
