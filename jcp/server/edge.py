"""What the HTTP edge accepts: the size limits and the typed JSON request bodies.

Owns every bound a client can push against before its request reaches the worker (body
bytes before and after zstd, datums per forward_backward, samples and tokens per sample
request, futures kept per tenant) and the strict schema of each JSON route, written after
the SDK's own pydantic types (tinker/types/*_request.py): wrong types are refused naming
the field, never coerced ("false" is not a bool, "1" is not an int). Every integer is
bounded (int64 at most, tighter where the field says so), every number finite, and a list
stops at its first bad item (pydantic otherwise builds one error per item: a 5 MB body of
bad tokens cost 1.3 GB). Unknown fields are ignored, as newer SDKs add some. It must never
import jax or touch the worker.
"""

from __future__ import annotations

import dataclasses
import io
import json
import reprlib
from typing import Annotated, Any, Literal

import zstandard
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictFloat,
    StrictInt,
    ValidationError,
    field_validator,
)

from jcp.sample.params import MAX_TOPK

MiB = 1 << 20
INT32_MAX = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class Limits:
    """Per-request and per-tenant bounds (jcp-serve --max-* flags).

    body_bytes: an HTTP body, and a zstd body once decompressed (the SDK chunks a
    forward_backward at 5 MB of data). datums: per forward / forward_backward request (the
    SDK chunks at 1024). num_samples: per sample request; its response holds up to
    num_samples × max_context_length tokens and logprobs (8 bytes each). futures: request
    results kept per tenant, pending ones never evicted (the SDK keeps up to 2000 sample
    requests in flight).
    """

    body_bytes: int = 32 * MiB
    datums: int = 1024
    num_samples: int = 128
    futures: int = 4096

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"Limits.{f.name} must be an integer ≥ 1, got {v!r}")


class Refused(Exception):
    """A request refused at the edge: HTTP `status`, message naming the field or limit."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


# ---------------------------------------------------------------------- bodies


def decompress(raw: bytes, limit: int) -> bytes:
    """One zstd frame -> its bytes, streamed and stopped at `limit` (Refused 413); a
    truncated frame or trailing bytes are refused (400), never parsed as a partial body."""
    try:
        reader = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(raw))
        out = reader.read(limit + 1)
        while len(out) <= limit and (more := reader.read(limit + 1 - len(out))):
            out += more
    except zstandard.ZstdError as e:
        raise Refused(400, f"body: truncated or malformed zstd frame ({e})") from None
    if len(out) > limit:
        raise Refused(413, f"body: decompresses to more than {limit} bytes (--max-body-bytes)")
    # The reader ends quietly at a truncated frame; a one-shot pass (bounded by `limit`
    # now) says whether the frame really ended and nothing follows it.
    d = zstandard.ZstdDecompressor().decompressobj()
    try:
        d.decompress(raw)
    except zstandard.ZstdError as e:
        raise Refused(400, f"body: truncated or malformed zstd frame ({e})") from None
    if not d.eof:
        raise Refused(400, "body: truncated zstd frame")
    if d.unused_data:
        raise Refused(400, f"body: {len(d.unused_data)} bytes after the zstd frame")
    return out


def parse_json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except RecursionError:
        raise Refused(400, "body: JSON nested too deeply") from None
    except ValueError as e:
        raise Refused(422, f"body: not JSON ({e})") from None
    if not isinstance(body, dict):
        raise Refused(422, "request body must be a JSON object")
    return body


# ---------------------------------------------------------------------- JSON schema

INT64_MAX = 2**63 - 1
MAX_TTL_S = 10 * 365 * 24 * 3600
Int64 = Annotated[StrictInt, Field(ge=-INT64_MAX - 1, le=INT64_MAX)]
SeqId = Annotated[StrictInt, Field(ge=0, le=INT32_MAX)]


def _int64_if_int(v):
    if isinstance(v, int) and not isinstance(v, bool) and not -INT64_MAX - 1 <= v <= INT64_MAX:
        raise ValueError("an integer beyond int64")
    return v


# A finite float; an integer is taken as one (strict floats accept ints) within int64.
Number = Annotated[StrictFloat, Field(allow_inf_nan=False), BeforeValidator(_int64_if_int)]
TokenId = Annotated[StrictInt, Field(ge=0, le=INT32_MAX)]
TopK = Annotated[StrictInt, Field(ge=0, le=MAX_TOPK)]
TtlSeconds = Annotated[StrictInt, Field(ge=1, le=MAX_TTL_S)]


def items(item, max_length: int | None = None):
    """A list of `item`, refused at its first bad item (fail_fast), at most max_length."""
    return Annotated[list[item], Field(fail_fast=True, max_length=max_length)]


# Keys of an object (user_metadata, chat_template_kwargs) and session tags. Counts are
# bounded as Field(max_length=…), which pydantic checks before it validates any item: a
# 200,000-key user_metadata took 685 ms of validation, holding the GIL, before a check
# after validation refused it.
MAX_KEYS = 64


def _small_metadata(meta: dict) -> dict:
    try:
        ok = len(meta) <= MAX_KEYS and all(
            len(k) <= 256 and len(json.dumps(v)) <= 4096 for k, v in meta.items()
        )
    except (RecursionError, ValueError):
        ok = False
    if not ok:
        raise ValueError(
            f"user_metadata must be an object of at most {MAX_KEYS} keys (up to 256 "
            "characters; values up to 4096 as JSON)"
        )
    return meta


# Stored with the run or checkpoint (owner.json, checkpoints.json) and listed back.
Metadata = Annotated[dict[str, Any], Field(max_length=MAX_KEYS), AfterValidator(_small_metadata)]
# Stop lists: the sampling engine's stop tables are one compiled width
# (jcp.sample.params.STOP_WIDTH), so a longer list would compile a new program and stall
# every tenant. Text stops (matched on the decoded text) are bounded the same way.
MAX_STOPS = 16
MAX_STOP_CHARS = 256
Seed = Annotated[StrictInt, Field(ge=0, le=2**64 - 1)]


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", protected_namespaces=())


class SessionRef(_Body):
    session_id: str


class ModelRef(_Body):
    model_id: str
    seq_id: SeqId | None = None


class CreateSession(_Body):
    tags: items(str, MAX_KEYS) = []
    user_metadata: Metadata | None = None
    sdk_version: str | None = None
    project_id: str | None = None
    display_name: str | None = None


class LoraConfig(_Body):
    rank: Int64  # its range (--max-rank) is the app's check
    seed: Seed | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class CreateModel(_Body):
    session_id: str
    model_seq_id: SeqId = 0
    base_model: str
    lora_config: LoraConfig | None = None
    user_metadata: Metadata | None = None


class AdamParams(_Body):
    type: Literal["adam"] | None = None
    learning_rate: Number | None = None
    beta1: Number | None = None
    beta2: Number | None = None
    eps: Number | None = None
    weight_decay: Number | None = None
    grad_clip_norm: Number | None = None


class OptimStep(ModelRef):
    adam_params: AdamParams | None = None
    optim_params: AdamParams | None = None


class SaveWeights(ModelRef):
    path: str | None = None
    ttl_seconds: TtlSeconds | None = None
    user_metadata: Metadata | None = None


class SaveWeightsExternal(ModelRef):
    path: str
    ttl_seconds: TtlSeconds | None = None
    age_encryption_recipients: items(str, 64) | None = None


class LoadWeights(_Body):
    path: str
    optimizer: bool
    model_id: str | None = None
    seq_id: SeqId | None = None
    session_id: str | None = None
    model_seq_id: SeqId = 0
    user_metadata: Metadata | None = None


class WeightsInfo(_Body):
    tinker_path: str


class CopyWeights(_Body):
    source_path: str
    session_id: str | None = None
    model_seq_id: SeqId | None = None
    ttl_seconds: TtlSeconds | None = None
    destination_project_id: str | None = None
    weights_access_token: str | None = None


class SetTtl(_Body):
    ttl_seconds: TtlSeconds | None = None  # None: never expires


class CreateCustomLoss(_Body):
    """The envelope only: the graph and its inputs are checked node by node when the loss
    is built (jcp.CustomLoss.from_graph)."""

    session_id: str
    custom_loss_seq_id: Int64 | None = None
    name: str | None = None
    inputs: items(Any)
    graph: dict[str, Any]


class CreateSamplingSession(_Body):
    session_id: str
    model_path: str | None = None
    base_model: str | None = None


class EncodedText(_Body):
    type: Literal["encoded_text"] = "encoded_text"
    tokens: items(TokenId)


class ModelInput(_Body):
    chunks: items(EncodedText)


class SamplingParams(_Body):
    max_tokens: Annotated[StrictInt, Field(ge=1, le=INT32_MAX)]
    seed: Seed | None = None
    stop: str | list[str] | list[TokenId] | None = None
    temperature: Number = 1.0
    top_k: Annotated[StrictInt, Field(ge=-1, le=INT32_MAX)] = -1
    top_p: Number = 1.0

    @field_validator("stop", mode="before")
    @classmethod
    def _bounded_stop(cls, v):
        """At most MAX_STOPS stop sequences, text ones of at most MAX_STOP_CHARS."""
        items = v if isinstance(v, list) else [v]
        if len(items) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop sequences, got {len(items)}")
        if any(isinstance(x, str) and len(x) > MAX_STOP_CHARS for x in items):
            raise ValueError(f"a stop sequence has at most {MAX_STOP_CHARS} characters")
        return v


class TensorData(_Body):
    """The SDK's TensorData JSON (tinker/types/_pydantic_types/tensor_data.py): values
    flattened; sparse CSR when the crow / col indices are set. Its sizes are the client's
    word only: wire.decode_target_ids checks them against the prompt before it allocates."""

    data: items(Number)
    dtype: Literal["int64", "float32"]
    shape: items(Annotated[StrictInt, Field(ge=0, le=INT64_MAX)], 8) | None = None
    sparse_crow_indices: items(Int64) | None = None
    sparse_col_indices: items(Int64) | None = None


class Sample(_Body):
    sampling_session_id: str
    num_samples: Annotated[StrictInt, Field(ge=1, le=INT32_MAX)] = 1
    prompt: ModelInput
    sampling_params: SamplingParams
    prompt_logprobs: bool | None = None
    topk_prompt_logprobs: TopK = 0
    topk_sample_logprobs: TopK = 0
    prompt_alt_tokens_k: TopK = 0
    target_prompt_logprobs: TensorData | None = None
    prompt_logprobs_last_n: Annotated[StrictInt, Field(ge=1, le=INT32_MAX)] | None = None


class RequestRef(_Body):
    request_id: str


class FuturesTarget(_Body):
    type: Literal["sampling_session"] = "sampling_session"
    sampling_session_id: str
    cloned_sampler_id: Int64 = 0


# More request ids than any tenant's futures table holds (--max-futures' default is far below).
MAX_RETRIEVED = 1 << 16


class RetrieveFutures(_Body):
    target: FuturesTarget
    prev_cursor: Int64 = 0
    timeout: Annotated[Number, Field(ge=0)] | None = None
    retrieved_request_ids: items(str, MAX_RETRIEVED) = []


# ---------------------------------------------------------------------- SDK 0.39 REST
# After tinker 0.39's types/checkpoint_search_request.py and external_weights_upload.py
# (the published reference; the SDK itself is not installable here).


class SearchOwner(_Body):
    """SearchOwner: "own" (the default) | "accessible" | "user" with owner_urns."""

    type: Literal["own", "accessible", "user"] = "own"
    owner_urns: items(str, 10) | None = None


class SearchCursor(_Body):
    """A page's next_cursor, passed back unchanged (the time is an aware ISO datetime;
    the handler parses it: strict pydantic takes no string for a datetime)."""

    last_created_at: Annotated[str, Field(max_length=64)]
    last_checkpoint_uuid: Annotated[str, Field(max_length=1024)]


class SearchCheckpoints(_Body):
    project_ids: items(str, 64) | None = None
    user_metadata: Annotated[dict[str, str], Field(max_length=64)] = {}
    checkpoint_type: Literal["training", "sampler", "external"] | None = None
    owner: SearchOwner = SearchOwner()
    base_models: items(str, 64) | None = None
    # "Page size, 1 to 200"; the reference does not show the default: 50, as the 0.38
    # SessionSearchRequest this request is modelled on.
    limit: Annotated[StrictInt, Field(ge=1, le=200)] = 50
    cursor: SearchCursor | None = None


class UploadStart(_Body):
    base_model: str
    lora_config: LoraConfig
    destination_project_id: str | None = None


class UploadFinish(_Body):
    upload_id: str


# ---------------------------------------------------------------------- OpenAI bodies
# The types of /v1/completions and /v1/chat/completions (jcp.server.openai_api): what the
# OpenAPI schema shows and a wrong type is refused by (in OpenAI's error shape, there).
# Ranges, what a field asks for together with another, and the fields asked for that are
# not served (openai_api.UNSUPPORTED, left to extra="ignore") are openai_api's checks.


class StreamOptions(_Body):
    include_usage: bool | None = None


class _OpenAI(_Body):
    model: str
    max_tokens: Int64 | None = None
    n: Int64 | None = None
    best_of: Int64 | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: Int64 | None = None  # vLLM's extension
    seed: Int64 | None = None
    stop: str | items(str) | None = None
    echo: bool | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None


class Completion(_OpenAI):
    prompt: str | items(str) | items(Int64) | items(items(Int64))
    logprobs: Int64 | None = None  # top alternatives per position


class ChatMessage(_Body):
    role: str
    # A string or content parts ({"type": "text", "text": …}; openai_api refuses others
    # naming the part); an assistant turn's may be null.
    content: str | items(dict[str, Any]) | None = None
    name: str | None = None


class ChatCompletion(_OpenAI):
    messages: items(ChatMessage)
    max_completion_tokens: Int64 | None = None
    logprobs: bool | None = None
    top_logprobs: Int64 | None = None
    add_generation_prompt: bool | None = None
    chat_template_kwargs: Annotated[dict[str, Any], Field(max_length=MAX_KEYS)] | None = None


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def type_error(model: type[_Body], body: dict) -> tuple[str, str] | None:
    """The first wrong type of `body` as (OpenAI's param: `messages[0].content`, message),
    None if every field has its type."""
    try:
        model.model_validate(body)
        return None
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
    param = ""
    for part in err["loc"]:  # up to a union member's tag (`str`, `list[int]`): no field
        if isinstance(part, int):
            param += f"[{part}]"
        elif part.isidentifier() and part not in _TYPE_TAGS:
            param += f".{part}" if param else part
        else:
            break
    return param or "body", f"{err['msg']} (got {_SHORT.repr(err.get('input'))})"


def json_schema(model: type[_Body]) -> dict:
    """model's JSON schema with its $defs inlined (a route's OpenAPI request body: the
    schema schemathesis fuzzes each route from)."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(x):
        if isinstance(x, dict):
            if "$ref" in x:
                return inline(defs[x["$ref"].rsplit("/", 1)[1]])
            return {k: inline(v) for k, v in x.items()}
        return [inline(v) for v in x] if isinstance(x, list) else x

    return inline(schema)


# The offending input as the refusal quotes it: a few items of a list, a few characters of
# a string (repr of the whole input would be as large as the body).
_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxlist, _SHORT.maxdict = 2, 4, 4
_SHORT.maxstring, _SHORT.maxother, _SHORT.maxlong = 40, 40, 40


def parse(model: type[_Body], body: dict, what: str) -> _Body:
    """body -> model, or Refused(422) naming the first bad field."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        field = ".".join(str(p) for p in err["loc"]) or "body"
        got = _SHORT.repr(err.get("input"))
        raise Refused(422, f"{what}: {field}: {err['msg']} (got {got})") from None
