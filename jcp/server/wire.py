"""Tinker SDK 0.38 wire formats: the protobuf forward_backward request, the protobuf
ForwardBackwardOutput and SampleResponse, and the JSON ModelInput / SamplingParams.

Owns the translation between bytes / JSON on the wire and plain NumPy on the host. The
message classes are built from the SDK's own schema (jcp/server/proto_schema.py), in a private
descriptor pool so they never clash with an installed SDK. Every malformed field raises
WireError naming it. It must never import jax or touch the Trainer.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from google.protobuf import descriptor_pool, message_factory

from jcp.sample.params import MAX_TOPK
from jcp.server.proto_schema import SERIALIZED


class WireError(ValueError):
    """A request the server cannot decode; reported to that request's client only."""


_POOL = descriptor_pool.DescriptorPool()
_POOL.AddSerializedFile(SERIALIZED)


def _msg(name: str):
    return message_factory.GetMessageClass(_POOL.FindMessageTypeByName(f"tinker_public.{name}"))


ForwardBackwardRequestPb = _msg("ForwardBackwardRequest")
ForwardBackwardOutputPb = _msg("ForwardBackwardOutput")
SampleResponsePb = _msg("SampleResponse")
_DTYPE = {v.name: v.number for v in _POOL.FindEnumTypeByName("tinker_public.DType").values}
_STOP = {v.name: v.number for v in _POOL.FindEnumTypeByName("tinker_public.StopReason").values}
_NUMPY = {
    _DTYPE["DTYPE_FLOAT32"]: np.float32,
    _DTYPE["DTYPE_INT64"]: np.int64,
    _DTYPE["DTYPE_INT32"]: np.int32,
}


@dataclasses.dataclass
class FwdBwdRequest:
    """A decoded forward_backward request: datums as (tokens int32 [N], {name: array [N]})."""

    model_id: str
    seq_id: int
    loss_fn: str
    loss_fn_config: dict[str, float] | None
    forward_only: bool
    data: list[tuple[np.ndarray, dict[str, np.ndarray]]]


def _tensor(t, what: str) -> np.ndarray:
    if t.WhichOneof("encoding") != "dense":
        raise WireError(
            f"{what}: only dense tensors are supported (got "
            f"{t.WhichOneof('encoding') or 'no data'})"
        )
    dt = _NUMPY.get(t.dtype)
    if dt is None:
        raise WireError(f"{what}: unsupported dtype {t.dtype}")
    if len(t.dense) % np.dtype(dt).itemsize:
        raise WireError(f"{what}: {len(t.dense)} bytes is not a whole number of {dt.__name__}")
    n, shape = len(t.dense) // np.dtype(dt).itemsize, tuple(t.shape)
    if len(shape) > 2:
        raise WireError(f"{what}: must be 1-D or 2-D, got shape {list(shape)}")
    # Exact Python ints: np.prod wraps ([2**32, 2**32] would match 0 values).
    if any(d < 0 for d in shape) or (shape and math.prod(shape) != n):
        raise WireError(f"{what}: shape {list(shape)} does not match {n} values")
    arr = np.frombuffer(t.dense, dt).copy()
    # No shape: 1-D (the SDK sends a scalar's shape [] the same way; the custom loss that
    # declares the input rank 0 reshapes it).
    return arr.reshape(shape) if len(shape) == 2 else arr


def tokens_of_chunks(chunks, what: str) -> np.ndarray:
    """Token ids of a ModelInput's chunks, from protobuf Chunks or JSON dicts (int32 ids).
    One array for all chunks: an array per chunk would cost ~100 bytes for each 2-byte
    empty chunk of the body."""
    ints, raws = [], []
    for i, ch in enumerate(chunks):
        if isinstance(ch, dict):
            if ch.get("type", "encoded_text") != "encoded_text" or "tokens" not in ch:
                raise WireError(
                    f"{what}.chunks[{i}]: only encoded_text chunks are supported "
                    f"(got {ch.get('type')!r})"
                )
            toks = ch["tokens"]
            if not isinstance(toks, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= 2**31 - 1 for t in toks
            ):
                raise WireError(
                    f"{what}.chunks[{i}].tokens must be a list of token ids "
                    "(integers in [0, 2**31))"
                )
            ints.extend(toks)
        else:
            kind = ch.WhichOneof("chunk") if ch.DESCRIPTOR.oneofs else None
            if kind != "encoded_text":
                raise WireError(
                    f"{what}.chunks[{i}]: only encoded_text chunks are supported (got {kind})"
                )
            raw = ch.encoded_text.tokens
            if len(raw) % 4:
                raise WireError(f"{what}.chunks[{i}]: token bytes are not int32")
            raws.append(raw)
    if raws:
        return np.frombuffer(b"".join(raws), np.int32).astype(np.int64)
    return np.asarray(ints, np.int64)


def decode_forward_backward_head(body: bytes):
    """Parse a ForwardBackwardRequest -> the message (model_id and seq_id readable, datums
    not yet checked)."""
    msg = ForwardBackwardRequestPb()
    try:
        msg.ParseFromString(body)
    except Exception as e:  # noqa: BLE001 — any parse failure is the client's
        raise WireError(f"forward_backward: not a ForwardBackwardRequest protobuf ({e})") from None
    if msg.seq_id < 0:
        raise WireError(f"forward_backward: seq_id {msg.seq_id} must be ≥ 0")
    return msg


def decode_forward_backward(msg, max_datums: int) -> FwdBwdRequest:
    """A parsed request's datums and loss settings; WireError naming the datum and field,
    or the bound on datums per request."""
    if len(msg.data) > max_datums:
        raise WireError(
            f"forward_backward: {len(msg.data)} datums exceed {max_datums} per "
            "request (--max-datums); split the batch"
        )
    config: dict[str, float | str] = {}
    for k, v in msg.loss_fn_config_v2.items():
        if k == "loss_id" and v.WhichOneof("value") == "text" and msg.loss_fn == "custom":
            config[k] = v.text[:128]  # the handle of a server-side custom loss
            continue
        if v.WhichOneof("value") != "number":
            raise WireError(f"loss_fn_config[{k!r}]: only numbers are supported")
        config[k] = v.number
    if not config:
        config = dict(msg.loss_fn_config.items())
    data = []
    for i, d in enumerate(msg.data):
        tokens = tokens_of_chunks(d.model_input, f"datum {i}: model_input")
        inputs = {
            k: _tensor(t, f"datum {i}: loss_fn_inputs[{k!r}]") for k, t in d.loss_fn_inputs.items()
        }
        _check_provenance(d, i, len(tokens), inputs)
        data.append((tokens, inputs))
    return FwdBwdRequest(
        model_id=msg.model_id,
        seq_id=msg.seq_id,
        loss_fn=msg.loss_fn,
        loss_fn_config=config or None,
        forward_only=msg.forward_only,
        data=data,
    )


def _check_provenance(d, i: int, n_inputs: int, inputs: dict[str, np.ndarray]) -> None:
    """Provenance spans (tinker/types/provenance_spans.py) are metadata: accepted for every
    loss and ignored in the math, but they must be well formed — both lists or neither,
    each span one of prompt_tokens / sampled_tokens with a non-empty sequence_id, offset
    >= 0, length >= 0, and the runs tiling their field exactly (model_input_spans the input
    tokens, loss_fn_input_spans target_tokens)."""
    fields = (
        ("model_input_spans", d.model_input_spans, n_inputs),
        (
            "loss_fn_input_spans",
            d.loss_fn_input_spans,
            len(inputs["target_tokens"]) if "target_tokens" in inputs else n_inputs,
        ),
    )
    if bool(len(d.model_input_spans)) != bool(len(d.loss_fn_input_spans)):
        raise WireError(
            f"datum {i}: provenance comes as a pair: model_input_spans and "
            "loss_fn_input_spans must both be set or both be empty"
        )
    for name, spans, want in fields:
        if not len(spans):
            continue
        total = 0
        for j, span in enumerate(spans):
            kind = span.WhichOneof("span")
            if kind is None:
                raise WireError(
                    f"datum {i}: {name}[{j}] is neither prompt_tokens nor sampled_tokens"
                )
            run = getattr(span, kind)
            if not run.sequence_id:
                raise WireError(f"datum {i}: {name}[{j}].sequence_id must be non-empty")
            if run.offset < 0 or run.length < 0:
                raise WireError(
                    f"datum {i}: {name}[{j}]: offset and length must be >= 0 "
                    f"(got offset {run.offset}, length {run.length})"
                )
            total += run.length
        if total != want:
            raise WireError(
                f"datum {i}: {name} cover {total} positions but the field has "
                f"{want}; the runs must tile it exactly"
            )


def encode_forward_backward_output(
    per_datum: list[dict[str, np.ndarray]], metrics: dict[str, float]
) -> bytes:
    """ForwardBackwardOutput: batched ArrayRecords (float32 fields per datum), one per run
    of consecutive datums whose fields share trailing shapes (logprobs [N, K] of 2-D
    targets: the SDK reads each record's trailing_shape)."""
    out = ForwardBackwardOutputPb(loss_fn_output_type="ArrayRecord")
    names = sorted(per_datum[0]) if per_datum else []
    runs: list[list[dict]] = []
    for d in per_datum:
        trailing = [np.shape(d[n])[1:] for n in names]
        if not runs or trailing != [np.shape(runs[-1][0][n])[1:] for n in names]:
            runs.append([])
        runs[-1].append(d)
    for run in runs:
        rec = out.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=len(run))
        for name in names:
            arrays = [np.ascontiguousarray(d[name], np.float32) for d in run]
            offsets = np.cumsum([0] + [a.nbytes for a in arrays]).astype(np.int64)
            bt = rec.fields[name]
            bt.data = b"".join(a.tobytes() for a in arrays)
            bt.offsets = offsets.tobytes()
            bt.dtype = _DTYPE["DTYPE_FLOAT32"]
            bt.trailing_shape.extend(arrays[0].shape[1:])
    for k, v in metrics.items():
        out.metrics[k] = float(v)
    return out.SerializeToString()


# The SDK's filler of a top-k cell that holds nothing (tinker/types/topk_logprobs.py): a
# row whose first cell is (0, MASK_LOGPROB) reads as None.
MASK_LOGPROB = -99999.0


def _topk(msg, topk) -> None:
    """Fill a TopkLogprobs message from token_ids / logprobs [n, k] (ids −1: nothing)."""
    ids, lps = np.asarray(topk.token_ids), np.asarray(topk.logprobs, np.float32)
    empty = ids < 0
    msg.token_ids = np.where(empty, 0, ids).astype(np.int32).tobytes()
    msg.logprobs = np.where(empty, MASK_LOGPROB, lps).astype(np.float32).tobytes()
    msg.length, msg.k = ids.shape


def _dense(msg, arr: np.ndarray, dtype: str) -> None:
    msg.dense = np.ascontiguousarray(
        arr, {"DTYPE_FLOAT32": np.float32, "DTYPE_INT64": np.int64}[dtype]
    ).tobytes()
    msg.dtype = _DTYPE[dtype]
    msg.shape.extend(arr.shape)


def encode_sample_response(res, target_layout: TargetIds | None = None) -> bytes:
    """A SampleResult (jcp.sample.params) as the SDK's SampleResponse: sequences (tokens,
    log-probs, stop reason, top-k), prompt log-probs (NaN = none), top-k prompt log-probs,
    target_prompt_logprobs (in the request's layout, target_layout: dense or CSR) and
    prompt_alt_tokens."""
    out = SampleResponsePb()
    for s in res.sequences:
        seq = out.sequences.add(
            stop_reason=_STOP[
                "STOP_REASON_LENGTH" if s.stop_reason == "length" else "STOP_REASON_STOP"
            ],
            tokens=np.asarray(s.tokens, np.int32).tobytes(),
            logprobs=np.asarray(s.logprobs, np.float32).tobytes(),
        )
        if getattr(s, "topk_logprobs", None) is not None:
            _topk(seq.topk_sampled_logprobs, s.topk_logprobs)
    if res.prompt_logprobs is not None:
        out.prompt_logprobs = np.asarray(res.prompt_logprobs, np.float32).tobytes()
    if getattr(res, "topk_prompt_logprobs", None) is not None:
        _topk(out.topk_prompt_logprobs, res.topk_prompt_logprobs)
    t = getattr(res, "target_prompt_logprobs", None)
    if t is not None:
        if target_layout is not None and target_layout.crow is not None:
            csr = out.target_prompt_logprobs.sparse_csr
            rows = np.repeat(np.arange(len(target_layout.crow) - 1), np.diff(target_layout.crow))
            csr.values = np.asarray(t, np.float32)[rows, target_layout.col].tobytes()
            csr.crow_indices = target_layout.crow.astype(np.int64).tobytes()
            csr.col_indices = target_layout.col.astype(np.int64).tobytes()
            out.target_prompt_logprobs.dtype = _DTYPE["DTYPE_FLOAT32"]
            out.target_prompt_logprobs.shape.extend(np.shape(t))
        else:
            _dense(out.target_prompt_logprobs, np.asarray(t), "DTYPE_FLOAT32")
    alt = getattr(res, "prompt_alt_tokens", None)
    if alt is not None:
        _dense(out.prompt_alt_tokens.tokens, np.asarray(alt.token_ids), "DTYPE_INT64")
        _dense(out.prompt_alt_tokens.logprobs, np.asarray(alt.logprobs), "DTYPE_FLOAT32")
    return out.SerializeToString()


def _int64(xs: list, what: str) -> np.ndarray:
    """A JSON list of integers -> int64 [len(xs)]; WireError past int64."""
    try:
        return np.asarray(xs, np.int64).reshape(len(xs))
    except (TypeError, ValueError, OverflowError):
        raise WireError(f"{what} must be a list of int64 integers") from None


@dataclasses.dataclass(frozen=True)
class TargetIds:
    """A decoded target_prompt_logprobs: ids int64 [rows, K] (−1 = none) and, when it came
    as sparse CSR, its crow / col indices (the response uses the same layout)."""

    ids: np.ndarray
    crow: np.ndarray | None = None
    col: np.ndarray | None = None


def decode_target_ids(td, rows: int) -> TargetIds:
    """The SDK's TensorData JSON of target_prompt_logprobs (int64, 2-D, dense or CSR with
    −1 for unlisted cells) of a prompt of rows + 1 tokens -> TargetIds; WireError naming
    what is malformed. The shape is the client's word: it must be [rows, K ≤ MAX_TOPK] and
    the data and CSR indices must fill exactly it before anything is allocated from it (a
    300-byte CSR body of shape [1, 10**11] asked for 800 GB)."""
    what = "target_prompt_logprobs"
    if not isinstance(td, dict):
        raise WireError(f"{what} must be a TensorData object")
    if td.get("dtype") != "int64":
        raise WireError(f"{what} must be an int64 tensor of token ids, got {td.get('dtype')!r}")
    shape, data = td.get("shape"), td.get("data")
    if not (
        isinstance(shape, list)
        and len(shape) == 2
        and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in shape)
    ):
        raise WireError(f"{what}.shape must be 2-D, [len(prompt) - 1, K], got {shape!r}")
    if shape[0] != rows or not 1 <= shape[1] <= MAX_TOPK:
        raise WireError(
            f"{what}.shape must be [len(prompt) - 1 = {rows}, K] with 1 ≤ K ≤ "
            f"{MAX_TOPK}, got {shape!r}"
        )
    if not isinstance(data, list) or not all(
        isinstance(x, int) and not isinstance(x, bool) for x in data
    ):
        raise WireError(f"{what}.data must be a list of integers")
    crow, col = td.get("sparse_crow_indices"), td.get("sparse_col_indices")
    if crow is None and col is None:
        if len(data) != shape[0] * shape[1]:
            raise WireError(f"{what}: {len(data)} values do not fill shape {shape}")
        return TargetIds(_int64(data, f"{what}.data").reshape(shape))
    if crow is None or col is None:
        raise WireError(f"{what}: sparse_crow_indices and sparse_col_indices come together")
    if not (
        isinstance(crow, list)
        and isinstance(col, list)
        and len(crow) == shape[0] + 1
        and len(col) == len(data)
    ):
        raise WireError(
            f"{what}: malformed CSR (crow_indices must hold len(prompt) = "
            f"{shape[0] + 1} entries and col_indices one per value, {len(data)})"
        )
    values = _int64(data, f"{what}.data")
    crow = _int64(crow, f"{what}.sparse_crow_indices")
    col = _int64(col, f"{what}.sparse_col_indices")
    if (
        crow[0] != 0
        or np.any(np.diff(crow) < 0)
        or crow[-1] != len(col)
        or np.any((col < 0) | (col >= shape[1]))
    ):
        raise WireError(
            f"{what}: malformed CSR (crow_indices {len(crow)} entries, "
            f"col_indices {len(col)}, values {values.size}, shape {shape})"
        )
    # [rows, K]: bounded by the prompt the body carries and MAX_TOPK, checked above.
    ids = np.full(shape, -1, np.int64)
    ids[np.repeat(np.arange(shape[0]), np.diff(crow)), col] = values
    return TargetIds(ids, crow, col)


@dataclasses.dataclass(frozen=True)
class SampleArgs:
    """A decoded asample request (JSON)."""

    prompt: np.ndarray
    num_samples: int
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    stop: tuple[int, ...] | None
    seed: int | None
    prompt_logprobs: bool
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    prompt_alt_tokens_k: int = 0
    prompt_logprobs_last_n: int | None = None
    target_prompt_logprobs: TargetIds | None = None
    stop_strings: tuple[str, ...] = ()  # text stops (stop then None: the model's EOS ids)


def decode_sample(body: dict) -> SampleArgs:
    prompt = body.get("prompt")
    if not isinstance(prompt, dict) or not isinstance(prompt.get("chunks"), list):
        raise WireError("prompt must be a ModelInput {chunks: [...]}")
    tokens = tokens_of_chunks(prompt["chunks"], "prompt")
    sp = body.get("sampling_params") or {}
    if not isinstance(sp, dict):
        raise WireError("sampling_params must be an object")
    ks = {}
    for key in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k"):
        k = body.get(key) or 0
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise WireError(f"{key} must be an integer ≥ 0, got {k!r}")
        ks[key] = k
    last_n = body.get("prompt_logprobs_last_n")
    if last_n is not None and (isinstance(last_n, bool) or not isinstance(last_n, int)):
        raise WireError(f"prompt_logprobs_last_n must be an integer or null, got {last_n!r}")
    target = body.get("target_prompt_logprobs")
    target = None if target is None else decode_target_ids(target, len(tokens) - 1)
    stop, strings = sp.get("stop"), ()
    if isinstance(stop, str) or (
        isinstance(stop, list) and stop and all(isinstance(s, str) for s in stop)
    ):
        # Text stops end a sequence through the tokenizer (jcp.server.text.StopWatch);
        # the model's EOS ids stop it too, as vLLM does.
        strings, stop = ((stop,) if isinstance(stop, str) else tuple(stop)), None
        if any(not s for s in strings):
            raise WireError("sampling_params.stop: an empty string is not a stop sequence")
    elif stop is not None:
        if isinstance(stop, list) and any(isinstance(s, str) for s in stop):
            raise WireError(
                "sampling_params.stop: a list of all strings or all token ids, not both"
            )
        stop = tuple(stop)
    max_tokens = sp.get("max_tokens")
    if max_tokens is None:
        raise WireError("sampling_params.max_tokens is required")
    return SampleArgs(
        prompt=tokens,
        num_samples=body.get("num_samples", 1),
        max_tokens=max_tokens,
        temperature=sp.get("temperature", 1.0),
        top_k=sp.get("top_k", -1),
        top_p=sp.get("top_p", 1.0),
        stop=stop,
        seed=sp.get("seed"),
        prompt_logprobs=bool(body.get("prompt_logprobs")),
        prompt_logprobs_last_n=last_n,
        target_prompt_logprobs=target,
        stop_strings=strings,
        **ks,
    )
