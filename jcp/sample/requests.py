"""The engine's request records, from submit to result.

Owns what a request asks beside its prompt and sampling parameters (SubmitOptions), its
host record (Request), its samples (Seq: device, pages, drawn tokens; `add` takes one
decode call's tokens and says whether the sequence ends) and their per-device groups
(Group), and the SampleResult of a request whose sequences have all ended (`result`).
Pure host: admission.py places and releases these records, engine.py drives them; it
must never create or read a device array.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable

import numpy as np

from jcp.errors import InputError
from jcp.sample.params import (
    NO_FIELDS,
    PromptFields,
    SampledSequence,
    SampleResult,
    TopK,
    prompt_results,
)


@dataclasses.dataclass(frozen=True)
class SubmitOptions:
    """What Engine.submit takes beside the prompt and its sampling (its keyword
    arguments, or options=). Checked when made (InputError).

    callback: callback(rid, outcome) runs when the request ends (outcome: SampleResult or
    the exception; result() then has nothing to return). fields: the SDK 0.38 top-k /
    target / prompt-draw / last_n fields (params.PromptFields); the prompt-side ones run
    one cache-less prefill of the prompt at admission (Runner.prompt_outputs), beside the
    chunked prefill that fills its pages. salt: the prefix-cache partition of the request
    (pages.py's module docstring, "Prefix cache"): it takes and leaves cached pages only
    under the same salt (jcp-serve: its tenant); None shares the unsalted partition.
    watch(j, tokens, logprobs, topk parts), if given, is called after every decode call
    with each running sequence's tokens so far -> how many of them it keeps when the
    sequence must end there (a text stop sequence, jcp.server.text.StopWatch: it ends at
    that step, stop reason "stop"), or None; it must not raise. tenant: whose request,
    for fair admission across tenants (admission.py's module docstring, "Tenants"; None:
    one shared tenant).
    """

    callback: Callable | None = None
    fields: PromptFields | None = None
    salt: str | bytes | None = None
    watch: Callable | None = None
    tenant: str | None = None

    def __post_init__(self):
        if self.salt is not None and not isinstance(self.salt, (str, bytes)):
            raise InputError(f"salt must be a str, bytes or None, got {type(self.salt).__name__}")

    @property
    def salt_bytes(self) -> bytes:
        """The salt as page_keys takes it (b"": the unsalted partition)."""
        return self.salt.encode() if isinstance(self.salt, str) else self.salt or b""

    @staticmethod
    def of(options: SubmitOptions | None, positional: tuple, keywords: dict) -> SubmitOptions:
        """Engine.submit's options from options= or from its keywords (SubmitOptions' field
        names; an unknown name is a TypeError) — or, deprecated, positionally after
        prompt_logprobs in the field order (callback, fields, salt, watch, tenant)."""
        names = [f.name for f in dataclasses.fields(SubmitOptions)]
        unknown = sorted(set(keywords) - set(names))
        if unknown:
            raise TypeError(f"submit() got unexpected keyword arguments {unknown}")
        if positional:
            if len(positional) > len(names):
                raise TypeError(f"submit() takes at most {5 + len(names)} positional arguments")
            warnings.warn(
                f"Engine.submit's {', '.join(names[: len(positional)])} as positional "
                "arguments are deprecated: pass them as keywords",
                DeprecationWarning,
                stacklevel=3,
            )
            twice = set(names[: len(positional)]) & set(keywords)
            if twice:
                raise TypeError(f"submit() got multiple values for {sorted(twice)}")
            keywords = dict(zip(names, positional)) | keywords
        if options is None:
            return SubmitOptions(**keywords)
        if keywords:
            raise TypeError(f"submit: pass options= or keywords, not both ({sorted(keywords)})")
        return options


@dataclasses.dataclass(eq=False)
class Request:
    """One submitted prompt (its samples, or a compute_logprobs request) on the host."""

    rid: int
    prompt: np.ndarray
    adapter: int  # slot or BASE
    version: int  # the adapter slot's version at submission
    params: dict  # check_params output
    num_samples: int
    prompt_logprobs: bool
    logprobs_only: bool = False
    seqs: list = dataclasses.field(default_factory=list)
    groups: list = dataclasses.field(default_factory=list)
    plp: np.ndarray | None = None
    cancelled: bool = False
    keys: np.ndarray | None = None  # uint32 [num_samples, 2], made once at admission
    fields: PromptFields = NO_FIELDS
    prompt_out: dict = dataclasses.field(default_factory=dict)  # SampleResult prompt fields
    salt: bytes = b""  # its prefix-cache partition (page_keys)
    tenant: str = ""  # whose request (Admission.admit_fair)
    watch: Callable | None = None  # submit(watch=…): where a sequence ends (text stops)

    @property
    def extend_logprobs(self) -> bool:
        """Prompt log-probs come from the chunked prefill (else, with the SDK prompt
        fields, from one cache-less prefill at admission)."""
        return self.prompt_logprobs and not self.fields.prompt_stats

    @property
    def n(self) -> int:
        """Prefilled positions (prompt[:-1])."""
        return len(self.prompt) - 1

    @property
    def tokens(self) -> list[list[int]]:
        """The tokens drawn so far, per sample (empty before admission)."""
        return [x.tokens for x in self.seqs]

    def release(self) -> None:
        """Forget its samples once it ended (Engine._end): each points back at it
        (Seq.req), and that cycle would be left for a full run of Python's cyclic
        collector, which then pauses a serving process's threads for milliseconds. Its
        groups stay (how far each prefilled), without their samples."""
        for group in self.groups:
            group.seqs = []
        self.seqs = []


@dataclasses.dataclass(eq=False)
class Seq:
    """One sample of a request: its device, pages, reservation and drawn tokens."""

    req: Request
    j: int  # sample index
    g: int  # device (along the sequence axes)
    pages: list = dataclasses.field(default_factory=list)
    reserve: int = 0  # pages it may still take
    tokens: list = dataclasses.field(default_factory=list)
    lps: list = dataclasses.field(default_factory=list)
    done: bool = False
    decoding: bool = False  # forked (prefill over), decodes
    row: int | None = None  # its recurrent-state row on device g (a hybrid model)
    topk: list = dataclasses.field(default_factory=list)  # [(ids, lps)] per decode call
    cut: bool = False  # ended by its request's watch (a text stop sequence)

    def add(self, tokens: list, lps: list, topk_part=None) -> bool:
        """One decode call's tokens and log-probs (and top-k (ids, log-probs) [n, k], or
        None) appended; the request's watch may cut them -> whether the sequence ends
        here: cut, at max_tokens, or at a stop token."""
        self.tokens += tokens
        self.lps += lps
        if topk_part is not None:
            self.topk.append(topk_part)
        req = self.req
        if req.watch is not None and tokens:
            keep = req.watch(self.j, self.tokens, self.lps, self.topk)
            if keep is not None:
                del self.tokens[keep:], self.lps[keep:]
                self.cut = True
        c = len(self.tokens)
        return (
            self.cut
            or c >= req.params["max_tokens"]
            or bool(c and self.tokens[-1] in req.params["stop"])
        )


@dataclasses.dataclass(eq=False)
class Group:
    """A request's samples on one device, sharing one prefill (the leader's pages)."""

    seqs: list
    filled: int = 0  # prompt positions cached so far


def result(req: Request) -> SampleResult:
    """The SampleResult of a request whose sequences have all ended."""
    stops = set(req.params["stop"])
    k = req.fields.topk_sample_logprobs
    seqs = [
        SampledSequence(
            np.array(x.tokens, np.int32),
            np.array(x.lps, np.float32),
            "stop" if x.cut or x.tokens and x.tokens[-1] in stops else "length",
            stack_topk(x.topk, k, len(x.tokens)) if k else None,
        )
        for x in req.seqs
    ]
    if req.plp is not None:
        req.prompt_out = prompt_results({"lp": req.plp}, len(req.prompt), req.fields, True)
    return SampleResult(seqs, **req.prompt_out)


def stack_topk(parts, k: int, n: int | None = None) -> TopK:
    """The per-call top-k parts of a sequence as one TopK (its first n rows)."""
    ids = [p[0] for p in parts] or [np.zeros((0, k), np.int32)]
    lps = [p[1] for p in parts] or [np.zeros((0, k), np.float32)]
    return TopK(
        np.concatenate(ids)[:n].astype(np.int32), np.concatenate(lps)[:n].astype(np.float32)
    )
