"""The continuous-batching sampling engine: a persistent decode batch that requests join
and leave between steps.

Owns the engine's host state — the waiting queue, each sequence's tokens, log-probs,
parameters and page table, the page pool's free list, reference counts and prefix cache
(PagePool) — and the paged KV cache on the devices (paged.py). A step (`step`) is: fail
what must fail (cancelled requests, sequences whose adapter changed), admit waiting
requests while decode rows and pages last, prefill one chunk of every admitted prompt
(at most `prefill_tokens` prompt tokens per step over all prompts: a long prompt is split
over steps, and running sequences decode between its chunks), run every compute_logprobs
request waiting (one prefill, no cache), then decode every live sequence for up to
`decode_len` steps in one device loop. Every row carries its own adapter (routed by index,
lora.Routing.index_S: a row costs its adapter's rank, not the slot table), temperature,
top-k, top-p, seed stream, stop set and max_tokens.

Decode chunks (`decode_len`): a step's device loop runs `chunk` decode steps while other
work waits — a prompt still prefilling, or step(hurry=True) from a caller whose queue
holds requests (jcp-serve) —, so a newcomer's first token waits for at most one such
chunk; when a request waits for rows or pages, the largest rung no live row's max_tokens
ends before (it may join as soon as rows free); when nothing waits, the least rung by which
every live row's max_tokens has ended, so a batch with nothing else to do decodes to its
end in one call — unless rows of different ages share it and the rows left once the
shortest end fit a smaller rows bucket: then the step ends there too (the device loop has
a fixed shape and computes ended rows until its last row ends; 118 requests × 8 × 32 with
10 more joining 8 tokens later: 1.25× → 1.04–1.12× the CPU seconds of all 128 at once).
Rungs: max_chunk (default 4 · chunk), max_chunk / 4, … ≥ chunk; the loop stops early
once every row has ended (stop tokens). Bound: a request arriving during a long chunk
waits for at most max_chunk decode steps of the running batch, then its own prefill. The
chunk length changes no result (draws depend on a sequence's key and token count only).

Results equal Trainer.sample of the same request alone (one prompt, the same seed), token
for token, whatever else is in the batch: a sequence's draws depend on its own key and
token count only (draws.sample_tokens), and attention reads only its own pages.

Memory (paged.py): each device holds `pages` pages of `page_size` positions. A sequence's
positions 0, 1, … live in the pages its table lists, so it holds ⌈real length / page⌉
pages, not max_len rows. The num_samples of one prompt on one device share the prompt's
full pages read-only; its partial last page is copied once per further sample when
prefill ends (copy on write at the fork). Admission reserves a request's worst case
(prompt pages + ⌈(prompt + max_tokens) / page⌉ per sample, less shared pages) so a running
sequence never runs out of pages, but pages are taken only as the sequence grows, and a
sequence that stops early gives back its pages and reservation. A request that does not
fit waits (first come, first served); one that could never fit is refused at submit.

Prefix cache: every full page of a prefilled prompt is registered under a hash chained
over (adapter slot, its version, the previous page's hash, the page's tokens); a later
prompt with the same adapter and leading pages on the same device takes those pages
(reference counted) and prefills only the rest. Pages no sequence holds stay cached and
are evicted least recently used when a page is needed. A hit gives the same tokens and
log-probs as a miss (the K/V of a position depend on the tokens up to it only).

Hybrid models (Qwen3.5: Gated DeltaNet + gated full attention): the pages hold the full
layers' K/V; every decode slot also has one recurrent-state row on its device (conv window
and delta-rule state per linear layer, paged.Pool.rec). A sequence takes its device's
lowest free row at admission and frees it when it ends; chunked prefill carries the
leader's state across the prompt's chunks, the fork copies the prompt's final state into
every further sample's row, and decode steps each row's state. No prefix cache: a state
is not recoverable from K/V pages (and one per cached page boundary would cost ~100× the
page), so prefix_cache is off for hybrids and every prompt prefills all its positions.

Programs: every dynamic dimension of the engine's device programs is bucketed to a few
values (layout.ladder rungs, steps of 4 from the top unless said): decode rows per device
(b_local, b_local / 2, … ≥ 8), table pages (max_len / page, … ≥ 64 / page), prefill rows per
device (min(64, b_local), ÷ 4, … ≥ 4), prefill chunk (pow2(prefill_tokens) capped at
max_len, ÷ 4, … ≥ 16), decode steps per call (max_chunk, ÷ 4, … ≥ chunk), active adapters (powers of two), draw kinds, page copies (rows rungs). `program_keys`
holds the static signature of every program the engine has run (`programs()` counts
them); `program_space()` bounds them.

Adapters: a sequence records its adapter slot's version (AdapterState.version) at
admission; if the slot changes (optimizer step, load, delete) before the sequence ends,
the request fails with a clear error — never a mix of old and new weights (and a changed
adapter's version keys no prefix-cache page).

Long single prompts whose cache should be split over cp run beside the engine
(Sampler.sample, cache_mode "split").

It must never change adapter state, and never run a device program outside `step`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import heapq
import itertools
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding

from jcp import batch as batch_lib
from jcp import mesh as mesh_lib
from jcp.adapter_state import host, replicate
from jcp.errors import InputError
from jcp.sample import layout as layout_lib
from jcp.sample import paged
from jcp.sample import programs
from jcp.sample.params import (BASE, NO_FIELDS, PromptFields, SampledSequence, SampleResult,
                               TopK, check_fields, check_prompts, is_int, k_bucket,
                               sequence_keys)
from jcp.sample.sampler import PromptStatsCall, Sampler, prompt_results


# The smallest decode window: live rows per device, cache positions (module docstring,
# "Programs"). Decode reads every weight once per step whatever the rows, so a few more
# rows cost little while each window compiled costs tens of seconds.
WINDOW_FLOOR = (8, 64)
PREFILL_ROWS = (64, 4)   # prefill rows per device: the most per step, the smallest rung
MIN_CHUNK = 16           # the smallest prefill chunk bucket
# Decode rows per device step down by 2 (b_local, b_local / 2, … ≥ 8): a decode call's
# time grows with its rows on CPU, and ÷ 4 rungs ran up to 4× padding (257 sequences on
# 2 devices decoded 512 rows each: 1.03 s instead of ~0.3 s).
DECODE_ROWS_STEP = 2


class EngineError(RuntimeError):
    """A request the engine could not finish (cancelled, adapter changed, device failure)."""


class PagePool:
    """The host side of the paged cache: per device, a free list, reference counts,
    reservations and the prefix cache (hash -> page, LRU of unreferenced cached pages).

    available(g): pages device g can still promise (free + evictable − reserved).
    """

    def __init__(self, groups: int, pages: int):
        self.pages = pages
        self.free = [deque(range(pages)) for _ in range(groups)]
        # Python lists, not an array: a step takes and releases thousands of pages one by
        # one, and a NumPy scalar update costs several times a list's.
        self.ref = [[0] * pages for _ in range(groups)]
        self.held = [0] * groups  # pages with ref > 0, per device
        self.reserved = [0] * groups
        self.index: list[dict[bytes, int]] = [{} for _ in range(groups)]
        self.key_of: list[dict[int, bytes]] = [{} for _ in range(groups)]
        self.logprobs: list[dict[int, np.ndarray]] = [{} for _ in range(groups)]
        self.lru: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(groups)]
        self.hits = self.lookups = 0  # pages found / pages looked up

    def available(self, g: int) -> int:
        return len(self.free[g]) + len(self.lru[g]) - self.reserved[g]

    def used(self, g: int) -> int:
        """Pages some sequence holds on device g."""
        return self.held[g]

    def alloc(self, g: int) -> int:
        """A fresh page (from the free list, else the least recently used cached page)."""
        if self.free[g]:
            p = self.free[g].popleft()
        else:
            p, _ = self.lru[g].popitem(last=False)
            del self.index[g][self.key_of[g].pop(p)]
            self.logprobs[g].pop(p, None)
        self.ref[g][p] = 1
        self.held[g] += 1
        return p

    def take(self, g: int, p: int) -> None:
        ref = self.ref[g]
        if ref[p] == 0:
            self.lru[g].pop(p)
            self.held[g] += 1
        ref[p] += 1

    def release(self, g: int, p: int) -> None:
        ref = self.ref[g]
        ref[p] -= 1
        if ref[p] == 0:
            self.held[g] -= 1
            if p in self.key_of[g]:
                self.lru[g][p] = None
            else:
                self.free[g].append(p)

    def lookup(self, g: int, keys: list[bytes], need_logprobs: bool) -> list[int]:
        """The pages of the longest cached prefix of `keys` on device g (with prompt
        log-probs stored, if need_logprobs)."""
        out = []
        for k in keys:
            p = self.index[g].get(k)
            if p is None or (need_logprobs and p not in self.logprobs[g]):
                break
            out.append(p)
        return out

    def register(self, g: int, key: bytes, p: int, logprobs: np.ndarray | None) -> None:
        if key in self.index[g] or p in self.key_of[g]:
            if logprobs is not None and self.index[g].get(key) == p:
                self.logprobs[g][p] = logprobs
            return
        self.index[g][key] = p
        self.key_of[g][p] = key
        if logprobs is not None:
            self.logprobs[g][p] = logprobs


def page_keys(prompt: np.ndarray, adapter: int, version: int, page: int) -> list[bytes]:
    """The chained hash of every full page of prompt[:-1] (the prefilled positions)."""
    h = np.array([adapter, version], np.int64).tobytes()
    out = []
    for i in range((len(prompt) - 1) // page):
        h = hashlib.blake2b(h + np.asarray(prompt[i * page:(i + 1) * page], np.int64).tobytes(),
                            digest_size=16).digest()
        out.append(h)
    return out


@dataclasses.dataclass(eq=False)
class _Seq:
    req: _Request
    j: int                      # sample index
    g: int                      # device (along the sequence axes)
    pages: list = dataclasses.field(default_factory=list)
    reserve: int = 0            # pages it may still take
    tokens: list = dataclasses.field(default_factory=list)
    lps: list = dataclasses.field(default_factory=list)
    done: bool = False
    decoding: bool = False      # forked (prefill over), decodes
    row: int | None = None      # its recurrent-state row on device g (a hybrid model)
    topk: list = dataclasses.field(default_factory=list)  # [(ids, lps)] per decode call


@dataclasses.dataclass(eq=False)
class _Group:
    """A request's samples on one device, sharing one prefill (the leader's pages)."""

    seqs: list
    filled: int = 0             # prompt positions cached so far


@dataclasses.dataclass(eq=False)
class _Request:
    rid: int
    prompt: np.ndarray
    adapter: int                # slot or BASE
    version: int                # the adapter slot's version at submission
    params: dict                # check_params output
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


class Engine:
    """Continuous batching over a Sampler's model and adapter table.

    sampler: the Sampler (Trainer.make_sampler()); slots: most sequences decoding at once
    (a multiple of dp·cp; slots / (dp·cp) per device); max_len: most positions per
    sequence (prompt − 1 + max_tokens must fit); chunk: decode steps per device call
    (requests join and leave between calls); prefill_tokens: most prompt tokens prefilled
    per step (None: max_tokens_per_device · dp); page_size: positions per page; pages:
    pages per device (None: what slots × max_len rows would take); prefix_cache: reuse
    cached prompt pages; adapter_version: slot -> version counter (the AdapterState's by
    default).

    Use: rid = engine.submit(prompt, params, adapter, num_samples); engine.step() until
    engine.finished(rid); engine.result(rid) -> SampleResult (raises EngineError /
    InputError for a failed request). engine.run() steps until idle; engine.sample(...)
    does submit + run + results for a list of prompts.
    """

    def __init__(self, sampler: Sampler, slots: int = 64, max_len: int = 256, chunk: int = 8,
                 prefill_tokens: int | None = None, max_chunk: int | None = None,
                 adapter_version: Callable[[int], int] | None = None, page_size: int = 16,
                 pages: int | None = None, prefix_cache: bool = True):
        groups = sampler.dp * sampler.cp
        max_chunk = 4 * chunk if max_chunk is None else max_chunk
        for name, v in (("slots", slots), ("max_len", max_len), ("chunk", chunk),
                        ("page_size", page_size), ("max_chunk", max_chunk)):
            if not is_int(v) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if slots % groups:
            raise ValueError(f"slots ({slots}) must be a multiple of dp·cp = {groups}")
        self.s, self.slots, self.max_len, self.chunk = sampler, slots, max_len, chunk
        self.max_chunk = max(chunk, max_chunk)
        self.prefill_tokens = (prefill_tokens if prefill_tokens is not None
                               else sampler.limits.max_tokens_per_device * sampler.dp)
        self.version = adapter_version or sampler.state.version
        self.groups = groups
        self.b_local = slots // groups
        # Prompts prefilled per device and step (each is a request's group of samples).
        self.prefill_rows = min(PREFILL_ROWS[0], self.b_local)
        self.page = page_size
        self.max_pages = -(-max_len // page_size)   # table entries of the longest sequence
        self.n_pages = pages if pages is not None else self.b_local * self.max_pages
        if not is_int(self.n_pages) or self.n_pages < 1:
            raise ValueError(f"pages must be a positive integer, got {pages!r}")
        # A hybrid (Gated DeltaNet) model's sequences each hold a recurrent-state row beside
        # their pages (module docstring, "Hybrid models"); its prompts are not prefix
        # cached: a state is not recoverable from K/V pages.
        self.hybrid = sampler.cfg.is_hybrid
        self.prefix_cache = bool(prefix_cache) and not self.hybrid
        self.pool = PagePool(groups, self.n_pages)
        self.free_rows = self._all_rows()          # per device: free state rows
        self.cache: paged.Pool | None = None       # the device pages
        self.rows_used = [0] * groups              # sequences holding a decode row
        self.waiting: deque[_Request] = deque()
        self.logprob_waiting: deque[_Request] = deque()
        self.prefilling: list[_Group] = []         # groups whose prompt is not all cached
        self.decoding: list[_Seq] = []
        self.requests: dict[int, _Request] = {}
        self.outcomes: dict[int, SampleResult | list | Exception] = {}
        self._ended: list[int] = []
        self.callbacks: dict[int, Callable] = {}
        self._ids = itertools.count()
        top = max(MIN_CHUNK, min(mesh_lib.pow2_at_least(self.prefill_tokens),
                                 mesh_lib.pow2_at_least(max_len)))
        self.chunk_top = top                       # the largest prefill chunk bucket
        # compute_logprobs requests run the Sampler's packed prefill.
        self.min_stream = max(16, mesh_lib.pow2_at_least(max_len) // 4)
        self.program_keys: set[tuple] = set()
        self.steps = 0
        self.peak_live = 0  # the most sequences one decode call has held
        self.peak_pages = 0  # the most pages held on one device
        self.prefilled = 0  # prompt positions run through extend (cache hits skip theirs)

    # ------------------------------------------------------------------ requests

    def submit(self, prompt, sampling_params, adapter=None, num_samples: int = 1,
               prompt_logprobs: bool = False, callback: Callable | None = None,
               fields: PromptFields | None = None) -> int:
        """Queue one prompt's num_samples sequences -> request id. Refused (InputError)
        before anything is queued: as Trainer.sample, and when the prompt plus max_tokens
        exceed max_len, num_samples exceeds the slots, or the request could never fit
        the pages. callback(rid, outcome) runs when the request ends (outcome:
        SampleResult or the exception; then result() has nothing to return). fields: the
        SDK 0.38 top-k / target / prompt-draw / last_n fields (params.PromptFields); the
        prompt-side ones run one cache-less prefill of the prompt at admission
        (Sampler.prompt_outputs), beside the chunked prefill that fills its pages."""
        c = self.s.check([prompt], sampling_params, adapter, num_samples)
        if not isinstance(prompt_logprobs, (bool, np.bool_)):
            raise InputError(f"prompt_logprobs must be a bool, got {prompt_logprobs!r}")
        n = len(c.prompts[0])
        fields = check_fields(fields, n, self.s.cfg.vocab_size, bool(prompt_logprobs))
        if n - 1 + c.max_tokens > self.max_len:
            raise InputError(f"prompt of {n} tokens + max_tokens {c.max_tokens} exceed the "
                             f"engine's {self.max_len} cache rows per sequence")
        if c.num_samples > self.slots:
            raise InputError(f"num_samples {c.num_samples} exceeds the engine's "
                             f"{self.slots} slots")
        if self._pages_per_seq(n - 1, c.max_tokens) > self.n_pages:
            raise InputError(f"prompt of {n} tokens + max_tokens {c.max_tokens} need more "
                             f"than the engine's {self.n_pages} pages per device")
        params = dict(max_tokens=c.max_tokens, temperature=c.temperature, top_k=c.top_k,
                      top_p=c.top_p, stop=c.stop, seed=c.seed)
        req = _Request(next(self._ids), c.prompts[0], c.adapters[0],
                       self._version(c.adapters[0]), params, c.num_samples,
                       bool(prompt_logprobs), fields=fields)
        self._queue(req, callback)
        self.waiting.append(req)
        return req.rid

    def submit_logprobs(self, prompt, adapter=None, callback: Callable | None = None,
                        prompt_logprobs_last_n: int | None = None) -> int:
        """Queue a compute_logprobs request -> request id; its result is float32
        [len(prompt)] (NaN at 0, and before the last prompt_logprobs_last_n positions), as
        Trainer.compute_logprobs."""
        (p,) = check_prompts([prompt], self.s.cfg.vocab_size)
        (a,) = self.s.check_adapters(adapter, 1)
        if len(p) > self.s.limits.token_cap:
            raise InputError(f"prompt has {len(p)} tokens, over the cap of "
                             f"{self.s.limits.token_cap} tokens per sequence")
        fields = check_fields(PromptFields(prompt_logprobs_last_n=prompt_logprobs_last_n),
                              len(p), self.s.cfg.vocab_size, True)
        req = _Request(next(self._ids), p, a, self._version(a), {}, 0, True, logprobs_only=True,
                       fields=fields)
        self._queue(req, callback)
        self.logprob_waiting.append(req)
        return req.rid

    def _queue(self, req: _Request, callback) -> None:
        self.requests[req.rid] = req
        if callback is not None:
            self.callbacks[req.rid] = callback

    def cancel(self, rid: int) -> None:
        """End a request at the next step boundary (its result: EngineError)."""
        if rid in self.requests:
            self.requests[rid].cancelled = True

    def finished(self, rid: int) -> bool:
        return rid in self.outcomes

    def result(self, rid: int):
        """The outcome of a finished request (SampleResult, or log-probs for
        submit_logprobs); raises its exception if it failed. Forgets it."""
        out = self.outcomes.pop(rid)
        if isinstance(out, Exception):
            raise out
        return out

    @property
    def idle(self) -> bool:
        return not self.requests

    @property
    def live(self) -> int:
        """Sequences holding a decode row."""
        return sum(self.rows_used)

    def programs(self) -> int:
        """How many distinct device programs the engine has run."""
        return len(self.program_keys)

    def kv_bytes(self, pages: int = 1) -> int:
        """Bytes of `pages` pages on one device (K and V of every full-attention layer)."""
        return pages * self.page * (self.s.row_bytes - 4)

    def state_bytes(self) -> int:
        """Bytes of one sequence's recurrent-state row on one device (a hybrid model: conv
        window and delta-rule state of every Gated DeltaNet layer, fp32; 0 otherwise).
        Every decode slot holds one: slots / (dp·cp) rows per device."""
        return self.s.state_bytes

    def _version(self, adapter: int) -> int:
        return -1 if adapter == BASE else int(self.version(adapter))

    def _pages_per_seq(self, n: int, max_tokens: int) -> int:
        return -(-(n + max_tokens) // self.page)

    # ------------------------------------------------------------------ ending

    def _release(self, seq: _Seq) -> None:
        """Give back a sequence's pages, reservation, decode row and state row."""
        for p in seq.pages:
            self.pool.release(seq.g, p)
        seq.pages = []
        self.pool.reserved[seq.g] -= seq.reserve
        seq.reserve = 0
        if not seq.done:
            seq.done = True
            self.rows_used[seq.g] -= 1
            if seq.row is not None:
                heapq.heappush(self.free_rows[seq.g], seq.row)
                seq.row = None

    def _end(self, req: _Request, outcome) -> None:
        for seq in req.seqs:
            self._release(seq)
        self.prefilling = [gr for gr in self.prefilling if gr.seqs[0].req is not req]
        self.decoding = [x for x in self.decoding if x.req is not req]
        self.requests.pop(req.rid, None)
        for q in (self.waiting, self.logprob_waiting):
            if req in q:
                q.remove(req)
        self._ended.append(req.rid)
        cb = self.callbacks.pop(req.rid, None)
        if cb is not None:  # the callback owns the outcome: nothing is kept for result()
            cb(req.rid, outcome)
        else:
            self.outcomes[req.rid] = outcome

    def _lost(self, e: Exception) -> None:
        """The device pages were donated to a program that failed: every request holding
        pages fails, and the pool starts empty."""
        self.cache = None
        for req in list(self.requests.values()):
            if req.seqs:
                self._end(req, EngineError(f"the engine's cache was lost: {e}"))
        self.pool = PagePool(self.groups, self.n_pages)
        self.free_rows = self._all_rows()

    # ------------------------------------------------------------------ the step

    def step(self, hurry: bool = False, decode: bool = True) -> list[int]:
        """One engine step (see the module docstring) -> ids of the requests it ended.
        hurry: work outside the engine waits for this step to end (a server's queued
        requests), so decode only `chunk` steps (module docstring, "Decode chunks").
        decode=False: a prefill-only step (admit, one prefill chunk, compute_logprobs; no
        decode step), e.g. to prefill a burst's first arrivals while the rest still arrive
        so that all decode together; it changes no result (a sequence's first token is
        drawn by its first decode step, from its own key and count)."""
        self._ended = []
        self._fail_stale()
        self._admit()
        if self.prefilling:
            self._prefill()
        self._logprobs()
        if self.decoding and decode:
            self._decode(self.decode_len(hurry))
        self.peak_pages = max([self.peak_pages] + [self.pool.used(g)
                                                   for g in range(self.groups)])
        self.steps += 1
        return self._ended

    def run(self, max_steps: int | None = None) -> None:
        """Step until no request is left (or max_steps)."""
        n = 0
        while not self.idle and (max_steps is None or n < max_steps):
            self.step()
            n += 1

    def sample(self, prompts, sampling_params, adapters=None, num_samples: int = 1,
               prompt_logprobs: bool = False) -> list[SampleResult]:
        """Trainer.sample's contract through the engine (every prompt its own request)."""
        per = self.s.check_adapters(adapters, len(check_prompts(prompts,
                                                                self.s.cfg.vocab_size)))
        rids = [self.submit(p, sampling_params, None if a == BASE else a, num_samples,
                            prompt_logprobs) for p, a in zip(prompts, per)]
        self.run()
        return [self.result(r) for r in rids]

    def _fail_stale(self) -> None:
        for req in list(self.requests.values()):
            if req.cancelled:
                self._end(req, EngineError(f"request {req.rid} was cancelled"))
            elif self._version(req.adapter) != req.version:
                self._end(req, EngineError(
                    f"adapter {req.adapter} changed (or was deleted) while request {req.rid} "
                    "was sampling from it; its sequences were dropped, none mixes weights"))

    # ------------------------------------------------------------------ admission

    def _admit(self) -> None:
        # First come, first served: a request that does not fit waits, and so does
        # everything behind it (no starvation of large requests).
        stats = []
        while self.waiting:
            req = self.waiting[0]
            keys = (page_keys(req.prompt, req.adapter, req.version, self.page)
                    if self.prefix_cache else [])
            plan = self._place(req, keys)
            if plan is None:
                break
            self.waiting.popleft()
            req.keys = sequence_keys(req.params["seed"], 0, req.num_samples)
            req.plp = np.full(len(req.prompt), np.nan, np.float32) if req.extend_logprobs \
                else None
            if req.fields.prompt_stats:
                stats.append(req)
            j = 0
            for g, k, hits in plan:
                group = _Group([])
                for _ in range(k):
                    seq = _Seq(req, j, g)
                    j += 1
                    group.seqs.append(seq)
                    req.seqs.append(seq)
                self._start_group(req, group, g, hits, keys)
                req.groups.append(group)
        if stats:
            self._prompt_stats(stats)

    def _prompt_stats(self, reqs: list[_Request]) -> None:
        """The SDK prompt fields of newly admitted requests: one cache-less prefill."""
        s = self.s
        prompts, adapters = [r.prompt for r in reqs], [r.adapter for r in reqs]
        fields = [r.fields for r in reqs]
        call = PromptStatsCall.of(prompts, fields, [r.params["temperature"] for r in reqs],
                                  [r.params["seed"] for r in reqs], [0] * len(reqs))
        try:
            for pb in s.packed(prompts, adapters, self.min_stream, fields)[1]:
                self.program_keys.add(("prefill", None, pb.tokens.shape, pb.targets.shape,
                                       pb.spans.shape, True,
                                       (call.topk, call.alt) if call else (0, 0)))
            outs = s.prompt_outputs(prompts, adapters, None, self.min_stream, fields, call)
        except Exception as e:  # noqa: BLE001 — these requests fail, nothing else
            for r in reqs:
                self._end(r, e)
            return
        for r, out in zip(reqs, outs):
            r.prompt_out = prompt_results(out, len(r.prompt), r.fields, r.prompt_logprobs)

    def _need(self, req: _Request, g: int, k: int, hits: list[int]) -> int:
        """Pages device g must promise for k samples of req sharing a prefill that takes
        `hits` cached pages."""
        full = req.n // self.page
        own = self._pages_per_seq(req.n, req.params["max_tokens"]) - full
        cached_idle = sum(1 for p in hits if self.pool.ref[g][p] == 0)
        return (full - len(hits)) + cached_idle + k * own

    def _place(self, req: _Request, keys) -> list[tuple[int, int, list[int]]] | None:
        """[(device, samples, cached pages)] for req, or None if it must wait: all samples
        on one device when one fits them (the device with the longest cached prefix
        first), else spread over devices."""
        hits = {g: self.pool.lookup(g, keys, req.extend_logprobs) if keys else []
                for g in range(self.groups)}
        order = sorted(range(self.groups),
                       key=lambda g: (-len(hits[g]), -self.pool.available(g), g))
        rows = lambda g: self.b_local - self.rows_used[g]  # noqa: E731
        fits = lambda g, k: (rows(g) >= k and  # noqa: E731
                             self._need(req, g, k, hits[g]) <= self.pool.available(g))
        for g in order:
            if fits(g, req.num_samples):
                return [(g, req.num_samples, hits[g])]
        plan, left = [], req.num_samples
        for g in order:
            k = min(left, rows(g))
            while k and not fits(g, k):
                k -= 1
            if k:
                plan.append((g, k, hits[g]))
                left -= k
            if not left:
                return plan
        return None

    def _start_group(self, req: _Request, group: _Group, g: int, hits: list[int],
                     keys) -> None:
        full = req.n // self.page
        own = self._pages_per_seq(req.n, req.params["max_tokens"]) - full
        lead = group.seqs[0]
        self.pool.lookups += len(keys)
        self.pool.hits += len(hits)
        for p in hits:
            self.pool.take(g, p)
        lead.pages = list(hits)
        lead.reserve = (full - len(hits)) + own
        for seq in group.seqs[1:]:
            seq.reserve = own
        self.pool.reserved[g] += sum(s.reserve for s in group.seqs)
        self.rows_used[g] += len(group.seqs)
        if self.hybrid:
            for seq in group.seqs:
                seq.row = heapq.heappop(self.free_rows[g])  # the lowest free row
        group.filled = len(hits) * self.page
        if req.plp is not None:
            for i, p in enumerate(hits):
                req.plp[i * self.page + 1:(i + 1) * self.page + 1] = self.pool.logprobs[g][p]
        if group.filled >= req.n:
            self._fork(group, [])
        else:
            self.prefilling.append(group)

    def _grow(self, seq: _Seq, positions: int) -> None:
        """Give seq pages for its first `positions` positions (from its reservation)."""
        while len(seq.pages) * self.page < positions:
            seq.pages.append(self.pool.alloc(seq.g))
            seq.reserve -= 1
            self.pool.reserved[seq.g] -= 1

    def _fork(self, group: _Group, copies: list) -> None:
        """Prefill over: every further sample takes the prompt's full pages (shared) and a
        copy of its partial last page (appended to copies as (device, src, dst, "page")) —
        and, for a hybrid model, a copy of the prompt's final recurrent state into its own
        state row ((device, src, dst, "row"))."""
        req, lead = group.seqs[0].req, group.seqs[0]
        full = req.n // self.page
        for seq in group.seqs[1:]:
            for p in lead.pages[:full]:
                self.pool.take(seq.g, p)
            seq.pages = list(lead.pages[:full])
            if req.n % self.page:
                self._grow(seq, req.n)
                copies.append((seq.g, lead.pages[full], seq.pages[full], "page"))
            if self.hybrid:
                copies.append((seq.g, lead.row, seq.row, "row"))
        for seq in group.seqs:
            seq.decoding = True
            self.decoding.append(seq)

    # ------------------------------------------------------------------ device arrays

    def _all_rows(self) -> list[list[int]]:
        """Every device's state rows, all free (heaps)."""
        return [list(range(self.b_local)) for _ in range(self.groups)]

    def _ensure_cache(self) -> None:
        if self.cache is None:
            c = self.s.cfg
            shape = (self.s.kv_layers, self.groups * self.n_pages, self.page, c.num_kv_heads,
                     c.head_dim)
            rec = None
            if self.hybrid:  # one state row per decode slot (Sampler.empty_cache's shapes)
                rec = self.s.empty_cache(self.slots, 1, paged.LAYOUT).rec
            self.cache = paged.Pool(*(self.s.zeros(shape, paged.POOL_SPEC) for _ in range(2)),
                                    rec)

    def _keep(self, pool) -> None:
        """Hold a program's output pages under the one sharding the engine made them with
        (a relabel, no copy): XLA may report an equivalent sharding with another spec, and a
        different input sharding would compile the next program anew."""
        self.cache = jax.tree.map(
            lambda x, spec: jax.device_put(x, NamedSharding(self.s.mesh, spec)), pool,
            paged.pool_specs(self.hybrid))

    def _rows(self, per_device: list[list], width: int):
        """Row index of each item when every device's items fill its first rows of a
        [groups · width] batch."""
        return {id(x): g * width + i for g, items in enumerate(per_device)
                for i, x in enumerate(items)}

    def _table(self, seqs, at, b: int, m: int) -> np.ndarray:
        table = np.full((b, m), -1, np.int32)
        for seq in seqs:
            table[at[id(seq)], :len(seq.pages)] = seq.pages[:m]
        return table

    def _active(self, adapter_B, rows_live):
        n_active = len({int(adapter_B[x]) for x in rows_live})
        a_len = batch_lib.active_bucket(n_active, self.s.limits.max_adapters + 1)
        active, index = layout_lib.active_index(adapter_B, a_len, BASE)
        return a_len, active, index

    def _copy(self, copies) -> None:
        """Run the page and state-row copies of this step's forks (one program call)."""
        if not copies:
            return
        per = {kind: [[c for c in copies if c[0] == g and c[3] == kind]
                      for g in range(self.groups)] for kind in ("page", "row")}
        n = layout_lib.ladder(max(len(x) for k in per.values() for x in k), self.b_local,
                              WINDOW_FLOOR[0])
        out = {}
        for kind, none in (("page", self.n_pages), ("row", self.b_local)):
            src = np.zeros(self.groups * n, np.int32)
            dst = np.full(self.groups * n, none, np.int32)
            for g, items in enumerate(per[kind]):
                for i, (_, a, b, _) in enumerate(items):
                    src[g * n + i], dst[g * n + i] = a, b
            out[kind] = (src, dst)
        self._run_copy(*out["page"], *out["row"])

    def _run_copy(self, src: np.ndarray, dst: np.ndarray, rec_src: np.ndarray,
                  rec_dst: np.ndarray) -> None:
        s = self.s
        self.program_keys.add(("copy", len(src) // self.groups))
        self._ensure_cache()
        out = s.paged.copy(self.cache, *(s.put(x, paged.ROWS_SPEC)
                                         for x in (src, dst, rec_src, rec_dst)))
        self._keep(out)

    # ------------------------------------------------------------------ prefill

    def _prefill(self) -> None:
        """One chunk of every prefilling prompt (FIFO, within the prefill_tokens budget)."""
        budget = self.prefill_tokens
        per = [[] for _ in range(self.groups)]
        work = []
        for group in self.prefilling:
            lead = group.seqs[0]
            if budget <= 0:
                break
            if len(per[lead.g]) >= self.prefill_rows:
                continue
            c = min(lead.req.n - group.filled, budget, self.chunk_top)
            budget -= c
            per[lead.g].append(group)
            work.append((group, c))
        if not work:
            return
        e_b = layout_lib.ladder(max(len(x) for x in per), self.prefill_rows, PREFILL_ROWS[1])
        c_len = layout_lib.ladder(max(c for _, c in work), self.chunk_top, MIN_CHUNK)
        for group, c in work:
            self._grow(group.seqs[0], group.filled + c)
        m = layout_lib.ladder(max(len(g.seqs[0].pages) for g, _ in work), self.max_pages,
                              max(1, WINDOW_FLOOR[1] // self.page))
        b = self.groups * e_b
        at = self._rows(per, e_b)
        tokens = np.zeros((b, c_len), np.int32)
        targets = np.zeros((b, c_len), np.int32)
        valid = np.zeros((b, c_len), bool)
        start = np.zeros(b, np.int32)
        slot = np.full(b, self.b_local, np.int32)
        adapter = np.full(b, layout_lib.PADDING, np.int64)
        for group, c in work:
            req, i, f = group.seqs[0].req, at[id(group)], group.filled
            tokens[i, :c] = req.prompt[f:f + c]
            targets[i, :c] = req.prompt[f + 1:f + c + 1]
            valid[i, :c] = True
            start[i] = f
            adapter[i] = req.adapter
            if self.hybrid:
                slot[i] = group.seqs[0].row
        at_seq = {id(g.seqs[0]): at[id(g)] for g, _ in work}
        table = self._table([g.seqs[0] for g, _ in work], at_seq, b, m)
        a_len, active, index = self._active(adapter, [at[id(g)] for g, _ in work])
        want_lp = any(g.seqs[0].req.plp is not None for g, _ in work)
        rows = paged.ExtendRows(tokens, targets, valid, start, index, table, slot)
        try:
            lp = self._run_extend(rows, paged.ExtendModes(want_lp, self.s.slice_layers), active)
        except Exception as e:  # noqa: BLE001 — the pages were donated: all fail
            self._lost(e)
            return
        copies, done = [], []
        for group, c in work:
            req, i, f = group.seqs[0].req, at[id(group)], group.filled
            if req.plp is not None:
                req.plp[f + 1:f + c + 1] = lp[i, :c]
            group.filled = f + c
            self.prefilled += c
            if group.filled >= req.n:
                done.append(group)
                self._register(group)
                self._fork(group, copies)
        self.prefilling = [g for g in self.prefilling if g not in done]
        try:
            self._copy(copies)
        except Exception as e:  # noqa: BLE001
            self._lost(e)

    def _run_extend(self, rows: paged.ExtendRows, modes: paged.ExtendModes,
                    active: np.ndarray) -> np.ndarray | None:
        """One extend call over the engine's pages (kept, donated) -> host log-probs."""
        s = self.s
        self.program_keys.add(("extend",) + rows.tokens.shape + (rows.table.shape[1],
                                                                 len(active), modes))
        rows = jax.tree.map(s.put, rows, paged.ExtendRows.specs())
        self._ensure_cache()
        pool, lp = s.paged.extend(s.state.weights, s.params, s.state.meta, self.cache, rows,
                                  replicate(s.mesh, active), modes=modes)
        self._keep(pool)
        del pool
        return host(lp) if modes.with_logprobs else None

    def _register(self, group: _Group) -> None:
        """The group's full prompt pages into the prefix cache."""
        if not self.prefix_cache:
            return
        lead = group.seqs[0]
        req = lead.req
        keys = page_keys(req.prompt, req.adapter, req.version, self.page)
        for i, key in enumerate(keys):
            lp = (None if req.plp is None
                  else req.plp[i * self.page + 1:(i + 1) * self.page + 1].copy())
            self.pool.register(lead.g, key, lead.pages[i], lp)

    def _logprobs(self) -> None:
        if not self.logprob_waiting:
            return
        reqs = list(self.logprob_waiting)
        self.logprob_waiting.clear()
        prompts, adapters = [r.prompt for r in reqs], [r.adapter for r in reqs]
        try:
            for pb in self.s.packed(prompts, adapters, self.min_stream)[1]:
                self.program_keys.add(("prefill", None, pb.tokens.shape, pb.targets.shape,
                                       pb.spans.shape, True, (0, 0)))
            out = self.s.prompt_logprobs(prompts, adapters, None, self.min_stream)
        except Exception as e:  # noqa: BLE001
            for r in reqs:
                self._end(r, e)
            return
        for r, lp in zip(reqs, out):
            last_n = r.fields.prompt_logprobs_last_n
            if last_n is not None:
                lp[:len(lp) - last_n] = np.nan
            self._end(r, lp)

    # ------------------------------------------------------------------ decode

    def decode_len(self, hurry: bool = False) -> int:
        """Decode steps of this step's device call (module docstring, "Decode chunks"):
        `chunk` while other work waits (hurry, or a prompt still prefilling); else, if a
        request waits for rows or pages, the largest rung that no live row's max_tokens
        ends before (a row may end there and free its row); else, if the rows left once the
        shortest have ended fit a smaller rows bucket, that same rung (the batch shrinks
        there: a fixed-shape device loop computes ended rows until its last row ends, so
        rows that joined later would otherwise keep the early ones' rows running); else the
        least rung by which every live row's max_tokens has ended. Rungs: max_chunk,
        max_chunk / 4, … ≥ chunk (layout.ladder); the device loop stops early once every
        row has ended."""
        if hurry or self.prefilling or not self.decoding:
            return self.chunk
        left = [seq.req.params["max_tokens"] - len(seq.tokens) for seq in self.decoding]
        before_shortest = max([r for r in _rungs(self.max_chunk, self.chunk) if r <= min(left)]
                              or [self.chunk])
        if self.waiting:
            return before_shortest
        if min(left) < max(left):
            every, rest = [0] * self.groups, [0] * self.groups
            for seq, n in zip(self.decoding, left):
                every[seq.g] += 1
                rest[seq.g] += n > min(left)
            if self._rows_bucket(max(rest)) < self._rows_bucket(max(every)):
                return before_shortest
        return layout_lib.ladder(min(max(left), self.max_chunk), self.max_chunk, self.chunk)

    def _rows_bucket(self, n: int) -> int:
        """Decode rows per device of a call whose fullest device holds n live rows."""
        return layout_lib.ladder(n, self.b_local, WINDOW_FLOOR[0], DECODE_ROWS_STEP)

    def _decode(self, n_steps: int) -> None:
        s = self.s
        live = self.decoding
        per = [[] for _ in range(self.groups)]
        for seq in live:
            per[seq.g].append(seq)
        # The batch: each device's live sequences in its first w_b rows, their tables
        # m pages wide, each bucketed (module docstring, "Programs").
        w_b = self._rows_bucket(max(len(x) for x in per))
        for seq in live:
            req = seq.req
            end = req.n + req.params["max_tokens"]
            self._grow(seq, min(req.n + len(seq.tokens) + n_steps, end))
        m = layout_lib.ladder(max(len(x.pages) for x in live), self.max_pages,
                              max(1, WINDOW_FLOOR[1] // self.page))
        b = self.groups * w_b
        at = self._rows(per, w_b)
        token = np.zeros(b, np.int32)
        position = np.zeros(b, np.int32)
        done = np.ones(b, bool)
        count = np.zeros(b, np.int32)
        max_tokens = np.ones(b, np.int32)
        temperature = np.zeros(b, np.float32)
        top_k = np.full(b, -1, np.int32)
        top_p = np.ones(b, np.float32)
        keys = np.zeros((b, 2), np.uint32)
        slot = np.full(b, self.b_local, np.int32)
        adapter = np.full(b, layout_lib.PADDING, np.int64)
        stops = [()] * b
        for seq in live:
            req, i, p = seq.req, at[id(seq)], seq.req.params
            if self.hybrid:
                slot[i] = seq.row
            c = len(seq.tokens)
            token[i] = seq.tokens[-1] if c else req.prompt[-1]
            position[i], count[i], done[i] = req.n + c, c, False
            max_tokens[i], temperature[i] = p["max_tokens"], p["temperature"]
            top_k[i], top_p[i] = p["top_k"], p["top_p"]
            keys[i] = req.keys[seq.j]
            adapter[i], stops[i] = req.adapter, p["stop"]
        rows_live = [at[id(x)] for x in live]
        self.peak_live = max(self.peak_live, len(live))
        a_len, active, index = self._active(adapter, rows_live)
        greedy = bool(np.all(temperature[rows_live] == 0.0))
        filtered = bool(np.any((temperature[rows_live] > 0)
                               & ((top_k[rows_live] > 0) | (top_p[rows_live] < 1.0))))
        rows = programs.DecodeRows(token, position, np.zeros(b, np.int32), done, count, index,
                                   max_tokens, temperature, top_k, top_p, keys,
                                   layout_lib.stop_table(stops))
        table = self._table(live, at, b, m)
        topk = k_bucket(max(x.req.fields.topk_sample_logprobs for x in live))
        modes = paged.PagedDecodeModes(n_steps, greedy, filtered, s.slice_layers, topk,
                                       rows.stop.shape[1])
        try:
            out_tok, out_lp, *out_tk = self._run_decode(table, rows, modes, active, slot)
        except Exception as e:  # noqa: BLE001 — the pages were donated: every request fails
            self._lost(e)
            return
        ended = []
        # A row's tokens this call are a prefix of its outputs (−1 once it ended); every
        # row to Python ints / floats at once, in C.
        got = np.count_nonzero(out_tok >= 0, axis=1).tolist()
        tok_rows, lp_rows = out_tok.tolist(), out_lp.tolist()
        for seq in live:
            req, i = seq.req, at[id(seq)]
            n = got[i]
            seq.tokens += tok_rows[i][:n]
            seq.lps += lp_rows[i][:n]
            k = req.fields.topk_sample_logprobs
            if k:
                seq.topk.append((out_tk[0][i][:n, :k], out_tk[1][i][:n, :k]))
            c = len(seq.tokens)
            if c >= req.params["max_tokens"] or (c and seq.tokens[-1] in req.params["stop"]):
                self._release(seq)
                if all(x.done for x in req.seqs):
                    ended.append(req)
        self.decoding = [x for x in self.decoding if not x.done]
        for req in ended:
            stops = set(req.params["stop"])
            k = req.fields.topk_sample_logprobs
            seqs = [SampledSequence(np.array(x.tokens, np.int32), np.array(x.lps, np.float32),
                                    "stop" if x.tokens and x.tokens[-1] in stops else "length",
                                    _stack_topk(x.topk, k) if k else None)
                    for x in req.seqs]
            if req.plp is not None:
                req.prompt_out = prompt_results({"lp": req.plp}, len(req.prompt), req.fields,
                                                True)
            self._end(req, SampleResult(seqs, **req.prompt_out))

    def _run_decode(self, table, rows: programs.DecodeRows, modes: paged.PagedDecodeModes,
                    active: np.ndarray, slot: np.ndarray | None = None) -> list[np.ndarray]:
        """One decode call over the engine's pages (kept, donated) -> its host outputs
        (tokens, log-probs[, top-k ids, top-k log-probs]). slot: each row's state row."""
        s = self.s
        self.program_keys.add(("decode", len(rows.token), table.shape[1], len(active), modes))
        ints, floats = paged.pack_rows(rows, table, slot)
        self._ensure_cache()
        *out, pool = s.paged.decode(s.state.weights, s.params, s.state.meta, self.cache,
                                    s.put(ints, paged.TABLE_SPEC), s.put(floats, paged.TABLE_SPEC),
                                    replicate(s.mesh, active), modes=modes)
        self._keep(pool)
        del pool
        return [host(x) for x in out]


    # ------------------------------------------------------------------ warm-up

    def warmup(self, active: Sequence[int] = (1,), draws: Sequence[str] = ("greedy", "drawn"),
               prompt_logprobs: Sequence[bool] = (False,), compute_logprobs: bool = False,
               stop_width: Sequence[int] = (8,), topk: Sequence[int] = (0,),
               prompt_stats: Sequence[tuple[int, int, int]] = ()) -> int:
        """Compile, up front, the programs the engine can run for these buckets -> how many
        it ran (program_keys then holds them). The bounded set (module docstring,
        "Programs"): every prefill (extend) rows × chunk × table-pages rung × active-adapter
        bucket × prompt_logprobs, every decode rows × table-pages rung × active bucket ×
        draw kind ("greedy", "drawn", "filtered": some row top-k / top-p) × stop-table
        width × topk_sample_logprobs bucket × decode-chunk rung, every page-copy rung, and
        the cache-less prefill's stream buckets (min_stream … max(max_len,
        prefill_tokens), doubling) × active bucket for compute_logprobs (if
        compute_logprobs) and for each prompt_stats entry (topk_prompt_logprobs,
        target_prompt_logprobs width, prompt_alt_tokens_k) of the SDK prompt fields (each
        bucketed by params.k_bucket; a request's fields take the widest of those admitted
        with it). active: distinct adapters (the base model counts as one) per step. Runs each program once on
        padding (no request; every write is dropped), so later requests of those shapes
        compile nothing. Only on an idle engine."""
        if not self.idle:
            raise RuntimeError("Engine.warmup runs on an idle engine only")
        kinds = {"greedy": (True, False), "drawn": (False, False), "filtered": (False, True)}
        for d in draws:
            if d not in kinds:
                raise ValueError(f"draws: {d!r} is not one of {sorted(kinds)}")
        s, groups = self.s, self.groups
        a_lens = sorted({batch_lib.active_bucket(a, s.limits.max_adapters + 1) for a in active})
        before = set(self.program_keys)
        pages = _rungs(self.max_pages, max(1, WINDOW_FLOOR[1] // self.page))

        def padding(b, a):
            return layout_lib.active_index(np.full(b, layout_lib.PADDING), a, BASE)

        for e_b in _rungs(self.prefill_rows, PREFILL_ROWS[1]):
            b = groups * e_b
            for c in _rungs(self.chunk_top, MIN_CHUNK):
                z = np.zeros((b, c), np.int32)
                for m in pages:
                    for a in a_lens:
                        act, index = padding(b, a)
                        rows = paged.ExtendRows(z, z, np.zeros((b, c), bool),
                                                np.zeros(b, np.int32), index,
                                                np.full((b, m), -1, np.int32),
                                                np.full(b, self.b_local, np.int32))
                        for lp in prompt_logprobs:
                            self._run_extend(rows, paged.ExtendModes(bool(lp), s.slice_layers),
                                             act)
        # The cache-less prefills: compute_logprobs (no stats) and the SDK prompt fields.
        variants = ([(0, 0, 0)] if compute_logprobs else []) + [
            tuple(k_bucket(int(k)) for k in v) for v in prompt_stats]
        cap, x = s.limits.max_tokens_per_device, self.min_stream
        while variants:
            for a, (k, width, alt) in itertools.product(a_lens, dict.fromkeys(variants)):
                pb = _padding_batch(s.dp, s.cp, min(x, cap), a, width)
                call = (PromptStatsCall(k, alt, np.zeros(1, np.float32),
                                        np.zeros((1, 2), np.uint32), (0,)) if k or alt else None)
                self.program_keys.add(("prefill", None, pb.tokens.shape, pb.targets.shape,
                                       pb.spans.shape, True, (k, alt)))
                jax.tree.map(host, s.run_prefill(pb, with_logprobs=True, stats=call)[1])
            if x >= cap or x >= mesh_lib.pow2_at_least(max(self.max_len, self.prefill_tokens)):
                break
            x *= 2
        for w_b in _rungs(self.b_local, WINDOW_FLOOR[0], DECODE_ROWS_STEP):
            b = groups * w_b
            z = np.zeros(b, np.int32)
            for m in pages:
                for a in a_lens:
                    act, index = padding(b, a)
                    for d in draws:
                        for ns in stop_width:
                            rows = programs.DecodeRows(
                                z, z, z, np.ones(b, bool), z, index, np.ones(b, np.int32),
                                np.zeros(b, np.float32), np.full(b, -1, np.int32),
                                np.ones(b, np.float32), np.zeros((b, 2), np.uint32),
                                layout_lib.stop_table([()] * b, ns))
                            for k, n in itertools.product(
                                    topk, _rungs(self.max_chunk, self.chunk)):
                                modes = paged.PagedDecodeModes(n, *kinds[d], s.slice_layers,
                                                               k_bucket(k), rows.stop.shape[1])
                                self._run_decode(np.full((b, m), -1, np.int32), rows, modes,
                                                 act, np.full(b, self.b_local, np.int32))
        for n in _rungs(self.b_local, WINDOW_FLOOR[0]):
            z = np.zeros(groups * n, np.int32)
            self._run_copy(z, np.full(groups * n, self.n_pages, np.int32), z,
                           np.full(groups * n, self.b_local, np.int32))
        return len(self.program_keys - before)


def _rungs(full: int, floor: int, step: int = 4) -> list[int]:
    """Every value layout.ladder(n, full, floor, step) takes."""
    out = [full]
    while out[-1] > floor:
        out.append(max(floor, -(-out[-1] // step)))
    return out


def _padding_batch(dp: int, cp: int, length: int, active: int,
                   target_width: int = 0) -> batch_lib.PackedBatch:
    """A packed prefill batch of `length` rows per stream that holds only padding, with
    `active` adapter entries and, if target_width, [.., 1 + target_width] targets (for
    Engine.warmup)."""
    z = np.zeros((dp, cp, length), np.int32)
    targets = np.zeros(z.shape + (1 + target_width,), np.int32) if target_width else z
    return batch_lib.PackedBatch(
        tokens=z, targets=targets, segment=np.full((dp, cp, length), -1, np.int32), position=z,
        loss_id=z, floats={}, spans=np.zeros((dp, cp, active, 2), np.int32),
        active=np.full(active, BASE, np.int32), num_slots=8, placements=())


def _stack_topk(parts, k: int) -> TopK:
    ids = [p[0] for p in parts] or [np.zeros((0, k), np.int32)]
    lps = [p[1] for p in parts] or [np.zeros((0, k), np.float32)]
    return TopK(np.concatenate(ids).astype(np.int32), np.concatenate(lps).astype(np.float32))
