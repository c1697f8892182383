"""The OpenAI response shapes of jcp-serve: completions and chat completions, whole or streamed.

Owns a request's jobs (`Job`: one prompt's engine request and its choices' progress) and
what is made of their SampleResults: log-probs as OpenAI writes them (-inf as vLLM
writes it), finished choices (`finish`: text stops cut where they start), the whole
response (`whole`), a stream's chunks (`StreamFormat`) and the server-sent event
response (`EventStream`). Never jax or the worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import time
import uuid

import numpy as np
from fastapi.responses import Response

from jcp.server.openai_params import Params
from jcp.server.state import SamplerRecord
from jcp.server.text import Text

# A log-prob JSON cannot hold (-inf) is written as vLLM writes it.
MIN_LOGPROB = -9999.0


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


@dataclasses.dataclass(frozen=True)
class Call:
    """One OpenAI request, parsed: who asks, for which weights and text, with which
    Params, and each prompt as (token ids, its string or None, max_tokens)."""

    who: str
    model: str
    rec: SamplerRecord
    txt: Text
    prm: Params
    plans: list
    chat: bool

    def response_id(self) -> str:
        return f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"


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
            None if row is None else {txt.token_str(i): logprob(v) for i, v in row} for row in top
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


def finish(call: Call, job: Job, j: int) -> tuple[list[int], list[float], object, str]:
    """A finished choice: (tokens, log-probs, top-k TopK, finish reason); its SeqText
    has taken every token."""
    prm = call.prm
    s = job.result.sequences[j]
    seq = job.seqs[j]
    if prm.max_tokens == 0:  # echo only: the one drawn token is not part of the answer
        seq.text, seq.ended = "", True
        return [], [], None, "length"
    toks = [int(t) for t in s.tokens]
    if not prm.stop and not seq.tokens:  # nothing streamed, no stops: one decode
        seq.tokens, seq.text, seq.ended = toks, call.txt.decode(toks), True
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


def prompt_head(txt: Text, job: Job) -> str:
    """The prompt as echo writes it."""
    if job.prompt_text is not None:
        return job.prompt_text
    return txt.decode(job.prompt, skip_special_tokens=False)


def _completion_choice(call: Call, job: Job, j: int, toks, lps, tk, reason) -> dict:
    prm, txt = call.prm, call.txt
    body = job.seqs[j].text
    lp = None
    if prm.echo:
        body = prompt_head(txt, job) + body
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
    return {"index": job.first + j, "text": body, "logprobs": lp, "finish_reason": reason}


def _chat_choice(call: Call, job: Job, j: int, toks, lps, tk, reason) -> dict:
    prm = call.prm
    lp = None
    if prm.logprobs is not None:
        lp = chat_logprobs(call.txt, toks, lps, top_rows(tk, prm.logprobs, 0, len(toks)))
    return {
        "index": job.first + j,
        "message": {"role": "assistant", "content": job.seqs[j].text, "tool_calls": []},
        "logprobs": lp,
        "finish_reason": reason,
    }


def whole(call: Call, jobs: list[Job]) -> dict:
    """The response of a request that is not streamed, every job done."""
    choices, n_out = [], 0
    make = _chat_choice if call.chat else _completion_choice
    for job in jobs:
        for j in range(call.prm.n):
            toks, lps, tk, reason = finish(call, job, j)
            n_out += len(toks)
            choices.append(make(call, job, j, toks, lps, tk, reason))
    return {
        "id": call.response_id(),
        "object": "chat.completion" if call.chat else "text_completion",
        "created": int(time.time()),
        "model": call.model,
        "choices": choices,
        "usage": usage(jobs, n_out),
        "system_fingerprint": None,
    }


class StreamFormat:
    """The chunks of one streamed request: one id and creation time for all of them."""

    def __init__(self, call: Call):
        self.call = call
        self.cid = call.response_id()
        self.created = int(time.time())
        self.kind = "chat.completion.chunk" if call.chat else "text_completion"

    def chunk(self, choices, **extra) -> bytes:
        return sse(
            {
                "id": self.cid,
                "object": self.kind,
                "created": self.created,
                "model": self.call.model,
                "choices": choices,
                **extra,
            }
        )

    def choice(self, index: int, piece: str | None, lp=None, reason=None, role=False) -> dict:
        if self.call.chat:
            delta = {} if piece is None else {"content": piece}
            if role:
                delta = {"role": "assistant", **delta}
            return {"index": index, "delta": delta, "logprobs": lp, "finish_reason": reason}
        return {"index": index, "text": piece or "", "logprobs": lp, "finish_reason": reason}

    def lps_of(self, toks, lps, top):
        if self.call.prm.logprobs is None or not toks:
            return None
        if self.call.chat:
            return chat_logprobs(self.call.txt, toks, lps, top)
        return completion_logprobs(self.call.txt, toks, lps, top)

    def step(self, job: Job, j: int, toks, lps, top, reason=None) -> bytes | None:
        """Text the choice may send now (and its tokens' log-probs), as one chunk."""
        seq, sent = job.seqs[j], job.sent[j]
        piece = seq.text[sent[1] : seq.ready]
        sent[1] += len(piece)
        lp = self.lps_of(toks, lps, top)
        if not piece and lp is None and reason is None:
            return None
        return self.chunk([self.choice(job.first + j, piece, lp, reason)])

    def first(self, jobs: list[Job]):
        """The first chunk of every choice: its role (chat) or echo."""
        for job in jobs:
            for j in range(self.call.prm.n):
                if self.call.chat:
                    yield self.chunk([self.choice(job.first + j, "", role=True)])
                elif self.call.prm.echo:
                    yield self.chunk([self.choice(job.first + j, prompt_head(self.call.txt, job))])


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
