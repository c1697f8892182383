"""What the HTTP edge accepts: the size limits and the typed JSON request bodies.

Owns every bound a client can push against before its request reaches the worker (body
bytes before and after zstd, datums per forward_backward, samples and tokens per sample
request, futures kept per tenant) and the strict schema of each JSON route, written after
the SDK's own pydantic types (tinker/types/*_request.py): wrong types are refused naming
the field, never coerced ("false" is not a bool, "1" is not an int). Unknown fields are
ignored, as newer SDKs add some. It must never import jax or touch the worker.
"""

from __future__ import annotations

import dataclasses
import io
import json
from typing import Annotated, Any, Literal

import zstandard
from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt, ValidationError

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

SeqId = Annotated[StrictInt, Field(ge=0, le=INT32_MAX)]
Number = StrictFloat | StrictInt
TokenId = Annotated[StrictInt, Field(ge=0, le=INT32_MAX)]
Seed = Annotated[StrictInt, Field(ge=0, le=2**64 - 1)]


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", protected_namespaces=())


class SessionRef(_Body):
    session_id: str


class ModelRef(_Body):
    model_id: str
    seq_id: SeqId | None = None


class LoraConfig(_Body):
    rank: StrictInt
    seed: Seed | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class CreateModel(_Body):
    session_id: str
    model_seq_id: SeqId = 0
    base_model: str
    lora_config: LoraConfig | None = None
    user_metadata: dict[str, Any] | None = None


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
    ttl_seconds: Annotated[StrictInt, Field(ge=1, le=10 * 365 * 24 * 3600)] | None = None
    user_metadata: dict[str, Any] | None = None


class LoadWeights(_Body):
    path: str
    optimizer: bool
    model_id: str | None = None
    seq_id: SeqId | None = None
    session_id: str | None = None
    model_seq_id: SeqId = 0
    user_metadata: dict[str, Any] | None = None


class CreateSamplingSession(_Body):
    session_id: str
    model_path: str | None = None
    base_model: str | None = None


class EncodedText(_Body):
    type: Literal["encoded_text"] = "encoded_text"
    tokens: list[TokenId]


class ModelInput(_Body):
    chunks: list[EncodedText]


class SamplingParams(_Body):
    max_tokens: Annotated[StrictInt, Field(ge=1, le=INT32_MAX)]
    seed: Seed | None = None
    stop: str | list[str] | list[TokenId] | None = None
    temperature: Number = 1.0
    top_k: Annotated[StrictInt, Field(ge=-1, le=INT32_MAX)] = -1
    top_p: Number = 1.0


class Sample(_Body):
    sampling_session_id: str
    num_samples: Annotated[StrictInt, Field(ge=1)] = 1
    prompt: ModelInput
    sampling_params: SamplingParams
    prompt_logprobs: bool | None = None
    topk_prompt_logprobs: StrictInt = 0
    topk_sample_logprobs: StrictInt = 0
    prompt_alt_tokens_k: StrictInt = 0
    target_prompt_logprobs: dict | None = None
    prompt_logprobs_last_n: StrictInt | None = None


class RequestRef(_Body):
    request_id: str


def parse(model: type[_Body], body: dict, what: str) -> _Body:
    """body -> model, or Refused(422) naming the first bad field."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        field = ".".join(str(p) for p in err["loc"]) or "body"
        got = repr(err.get("input"))
        got = got if len(got) <= 60 else got[:57] + "..."
        raise Refused(422, f"{what}: {field}: {err['msg']} (got {got})") from None
