"""The OpenAI request bodies of jcp-serve: what is served, and what is refused naming the field.

Owns `ApiError` (OpenAI's error shape {"error": {message, type, param, code}}), the
fields these routes do not do (UNSUPPORTED: refused with any value that asks for
something), `Params` (what one request asks of each prompt, `parse_params`) and the
prompts: /v1/completions' `prompts_of`, /v1/chat/completions' `chat_prompt` (the chat
template). Where OpenAI and vLLM differ, vLLM is followed. Never jax or the worker.
"""

from __future__ import annotations

import dataclasses
import math

from fastapi.responses import JSONResponse

from jcp.server import redact
from jcp.server.edge import MAX_STOP_CHARS, MAX_STOPS, Limits
from jcp.server.text import Text, TextError

# top_logprobs / logprobs per position: vLLM's default max_logprobs (OpenAI's chat: 20).
MAX_LOGPROBS = 20
# Completions' max_tokens when none is given (OpenAI's legacy default); chat's default is
# the context left after the prompt (vLLM).
DEFAULT_MAX_TOKENS = 16
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
