"""The continuous-batching sampling engine: a persistent decode batch that requests join
and leave between steps.

Owns the engine's host state — the waiting queue, which request holds which decode slot,
each sequence's tokens, log-probs and parameters — and the persistent KV cache of its
slots. A step (`step`) is: fail what must fail (cancelled requests, sequences whose
adapter changed), admit waiting requests into free slots and prefill them (at most
`prefill_tokens` prompt tokens per step, so a burst of long prompts never stalls the
running sequences for more than one bounded prefill), run every compute_logprobs request
waiting (one prefill, no cache), then decode every live slot for up to `chunk` steps in
one device loop. Every row carries its own adapter (routed by index, lora.Routing.index_S:
a row costs its adapter's rank, not the slot table), temperature, top-k, top-p, seed
stream, stop set and max_tokens; the num_samples of one prompt share one prefill.

Results equal Trainer.sample of the same request alone (one prompt, the same seed), token
for token, whatever else is in the batch: a sequence's draws depend on its own key and
token count only (draws.sample_tokens), and masks read only its own cache rows.

The cache is slot rows in the "batch" layout (kv_cache.LAYOUTS): slots over (dp, cp),
each slot `max_len` rows on one device; a slot's rows hold exactly its sequence's tokens
(row t = position t; rows past its length are masked by position −1), so the cache holds
slots × max_len rows whatever the sequences' lengths. Long single prompts whose cache
should be split over cp run beside the engine (Sampler.sample, cache_mode "split").

Programs: every dynamic dimension of the engine's device programs is bucketed to a few
values, so that after a short warm-up a stream of requests of any prompt lengths,
num_samples and max_tokens compiles nothing new (compiling a program costs tens of
seconds on CPU, hundreds of engine steps). Prefill streams: powers of two from
`min_stream` (pow2(max_len) / 4, ≥ 16) to a device's rows; decode windows
(layout.ladder, steps of 4 down from the whole cache): live rows per device b_local,
b_local / 4, … ≥ 8, cache rows max_len, max_len / 4, … ≥ 64 (e.g. 512 slots per device:
512, 128, 32, 8 rows; 256 rows: 256, 64); active adapters: powers of two
(batch.active_bucket); draw kinds: greedy / drawn / drawn and filtered. `program_keys`
holds the static signature of every program the engine has run (`programs()` counts
them).

Adapters: a sequence records its adapter slot's version (AdapterState.version) at
admission; if the slot changes (optimizer step, load, delete) before the sequence ends,
the request fails with a clear error — never a mix of old and new weights.

It must never change adapter state, and never run a device program outside `step`.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import deque
from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import NamedSharding

from jcp import batch as batch_lib
from jcp import mesh as mesh_lib
from jcp.adapter_state import host, replicate
from jcp.errors import InputError
from jcp.sample import kv_cache
from jcp.sample import layout as layout_lib
from jcp.sample import programs
from jcp.sample.params import (BASE, SampledSequence, SampleResult, check_prompts, is_int,
                               sequence_keys)
from jcp.sample.sampler import Sampler


# The smallest decode window: live rows per device, cache rows (module docstring,
# "Programs"). Decode reads every weight once per step whatever the rows, so a few more
# rows cost little while each window compiled costs tens of seconds.
WINDOW_FLOOR = (8, 64)


class EngineError(RuntimeError):
    """A request the engine could not finish (cancelled, adapter changed, device failure)."""


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
    slots: list = dataclasses.field(default_factory=list)
    tokens: list = dataclasses.field(default_factory=list)    # per sample: list[int]
    lps: list = dataclasses.field(default_factory=list)       # per sample: list[float]
    done: list = dataclasses.field(default_factory=list)      # per sample: bool
    plp: np.ndarray | None = None
    cancelled: bool = False
    keys: np.ndarray | None = None  # uint32 [num_samples, 2], made once at admission


class Engine:
    """Continuous batching over a Sampler's model and adapter table.

    sampler: the Sampler (Trainer.make_sampler()); slots: decode rows (a multiple of
    dp·cp); max_len: cache rows per slot (prompt − 1 + max_tokens must fit); chunk: decode
    steps per device call (requests join and leave between calls); prefill_tokens: most
    prompt tokens admitted per step (None: max_tokens_per_device · dp); adapter_version:
    slot -> version counter (the AdapterState's by default).

    Use: rid = engine.submit(prompt, params, adapter, num_samples); engine.step() until
    engine.finished(rid); engine.result(rid) -> SampleResult (raises EngineError /
    InputError for a failed request). engine.run() steps until idle; engine.sample(...)
    does submit + run + results for a list of prompts.
    """

    def __init__(self, sampler: Sampler, slots: int = 64, max_len: int = 256, chunk: int = 8,
                 prefill_tokens: int | None = None,
                 adapter_version: Callable[[int], int] | None = None):
        groups = sampler.dp * sampler.cp
        for name, v in (("slots", slots), ("max_len", max_len), ("chunk", chunk)):
            if not is_int(v) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if slots % groups:
            raise ValueError(f"slots ({slots}) must be a multiple of dp·cp = {groups}")
        self.s, self.slots, self.max_len, self.chunk = sampler, slots, max_len, chunk
        self.prefill_tokens = (prefill_tokens if prefill_tokens is not None
                               else sampler.limits.max_tokens_per_device * sampler.dp)
        self.version = adapter_version or sampler.state.version
        self.lay = kv_cache.LAYOUTS["batch"]
        self.b_local = slots // groups
        self.row_position = np.full((slots, max_len), -1, np.int32)
        self.owner = [None] * slots               # slot -> (request, sample index)
        self.waiting: deque[_Request] = deque()
        self.logprob_waiting: deque[_Request] = deque()
        self.requests: dict[int, _Request] = {}
        self.outcomes: dict[int, SampleResult | list | Exception] = {}
        self.callbacks: dict[int, Callable] = {}
        self._ids = itertools.count()
        self.cache = None
        # Bucket floors (module docstring, "Programs").
        self.min_stream = max(16, mesh_lib.pow2_at_least(max_len) // 4)
        self.program_keys: set[tuple] = set()
        self.steps = 0
        self.peak_live = 0  # the most sequences one decode call has held

    # ------------------------------------------------------------------ requests

    def submit(self, prompt, sampling_params, adapter=None, num_samples: int = 1,
               prompt_logprobs: bool = False, callback: Callable | None = None) -> int:
        """Queue one prompt's num_samples sequences -> request id. Refused (InputError)
        before anything is queued: as Trainer.sample, and when the prompt plus max_tokens
        exceed max_len or num_samples exceeds the slots. callback(rid, outcome) runs when
        the request ends (outcome: SampleResult or the exception)."""
        c = self.s.check([prompt], sampling_params, adapter, num_samples)
        if not isinstance(prompt_logprobs, (bool, np.bool_)):
            raise InputError(f"prompt_logprobs must be a bool, got {prompt_logprobs!r}")
        n = len(c.prompts[0])
        if n - 1 + c.max_tokens > self.max_len:
            raise InputError(f"prompt of {n} tokens + max_tokens {c.max_tokens} exceed the "
                             f"engine's {self.max_len} cache rows per sequence")
        if c.num_samples > self.slots:
            raise InputError(f"num_samples {c.num_samples} exceeds the engine's "
                             f"{self.slots} slots")
        params = dict(max_tokens=c.max_tokens, temperature=c.temperature, top_k=c.top_k,
                      top_p=c.top_p, stop=c.stop, seed=c.seed)
        req = _Request(next(self._ids), c.prompts[0], c.adapters[0],
                       self._version(c.adapters[0]), params, c.num_samples,
                       bool(prompt_logprobs))
        self._queue(req, callback)
        self.waiting.append(req)
        return req.rid

    def submit_logprobs(self, prompt, adapter=None, callback: Callable | None = None) -> int:
        """Queue a compute_logprobs request -> request id; its result is float32
        [len(prompt)] (NaN at 0), as Trainer.compute_logprobs."""
        (p,) = check_prompts([prompt], self.s.cfg.vocab_size)
        (a,) = self.s.check_adapters(adapter, 1)
        if len(p) > self.s.limits.token_cap:
            raise InputError(f"prompt has {len(p)} tokens, over the cap of "
                             f"{self.s.limits.token_cap} tokens per sequence")
        req = _Request(next(self._ids), p, a, self._version(a), {}, 0, True, logprobs_only=True)
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
        """Slots holding a sequence."""
        return sum(o is not None for o in self.owner)

    def programs(self) -> int:
        """How many distinct device programs (prefill and decode signatures) the engine
        has run."""
        return len(self.program_keys)

    def _version(self, adapter: int) -> int:
        return -1 if adapter == BASE else int(self.version(adapter))

    def _end(self, req: _Request, outcome) -> None:
        for s in req.slots:
            if self.owner[s] is not None and self.owner[s][0] is req:
                self.owner[s] = None
                self.row_position[s] = -1
        self.requests.pop(req.rid, None)
        for q in (self.waiting, self.logprob_waiting):
            if req in q:
                q.remove(req)
        self.outcomes[req.rid] = outcome
        cb = self.callbacks.pop(req.rid, None)
        if cb is not None:
            cb(req.rid, outcome)

    # ------------------------------------------------------------------ the step

    def step(self) -> list[int]:
        """One engine step (see the module docstring) -> ids of the requests it ended."""
        before = set(self.outcomes)
        self._fail_stale()
        self._admit()
        self._logprobs()
        if self.live:
            self._decode()
        self.steps += 1
        return [r for r in self.outcomes if r not in before]

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

    def _admit(self) -> None:
        # Lowest local row first, devices in turn: the live slots stay a small window of
        # every device's rows (decode runs over that window only).
        free = sorted((s for s in range(self.slots) if self.owner[s] is None),
                      key=lambda s: (s % self.b_local, s // self.b_local))
        admitted, budget = [], self.prefill_tokens
        # First come, first served: a request that does not fit waits, and so does
        # everything behind it (no starvation of large requests).
        while self.waiting and self.waiting[0].num_samples <= len(free):
            req = self.waiting[0]
            if admitted and len(req.prompt) > budget:
                break
            self.waiting.popleft()
            budget -= len(req.prompt)
            req.slots = [free.pop(0) for _ in range(req.num_samples)]
            req.tokens = [[] for _ in req.slots]
            req.lps = [[] for _ in req.slots]
            req.done = [False] * len(req.slots)
            req.keys = sequence_keys(req.params["seed"], 0, req.num_samples)
            admitted.append(req)
        if not admitted:
            return
        try:
            self._prefill(admitted)
        except Exception as e:  # noqa: BLE001 — the admitted requests fail, nothing else
            self.cache = None  # donated: rebuild
            for req in admitted:
                self._end(req, e)
            for req in list(self.requests.values()):
                if req.slots:
                    self._end(req, EngineError(f"the engine's cache was lost: {e}"))

    def _prefill(self, admitted: list[_Request]) -> None:
        s = self.s
        if self.cache is None:
            shape = (s.cfg.num_layers, self.slots, self.max_len, s.cfg.num_kv_heads,
                     s.cfg.head_dim)
            self.cache = kv_cache.KV(*(s.zeros(shape, self.lay.kv_LxBxTxKxH)
                                       for _ in range(2)))
        prompts = [r.prompt for r in admitted]
        adapters = [r.adapter for r in admitted]
        row_of = [r.slots for r in admitted]
        for r in admitted:
            n = len(r.prompt) - 1
            self.row_position[r.slots] = -1
            self.row_position[r.slots, :n] = np.arange(n)
        call = layout_lib.CallLayout(row_of, self.row_position, None, None,
                                     s.dp * s.cp, self.b_local, self.max_len, False)
        which, packed = s.packed(prompts, adapters, self.min_stream)
        want_lp = any(r.prompt_logprobs for r in admitted)
        lps = []
        for pb in packed:
            source = layout_lib.prefill_source(call, pb.placements, which,
                                               pb.tokens.shape[-1], s.cp)
            self.program_keys.add(("prefill", "batch", pb.tokens.shape, pb.spans.shape,
                                   want_lp))
            kv, lp = s.run_prefill(pb, source, kv_cache.KV(*self.cache), layout="batch",
                                   with_logprobs=want_lp)
            self._keep(kv.k, kv.v)
            del kv
            lps.append(lp)
        plp = s.prompt_logprobs(prompts, adapters, lps, self.min_stream) if want_lp else None
        for i, r in enumerate(admitted):
            r.plp = plp[i] if (plp is not None and r.prompt_logprobs) else None
            for j, slot in enumerate(r.slots):
                self.owner[slot] = (r, j)

    def _keep(self, k, v) -> None:
        """Hold a program's output cache under the one sharding the engine made it with (a
        relabel, no copy): XLA may report an equivalent sharding with another spec (e.g.
        P() on one device), and a different input sharding would compile the next program
        anew."""
        sharding = NamedSharding(self.s.mesh, self.lay.kv_LxBxTxKxH)
        self.cache = kv_cache.KV(jax.device_put(k, sharding), jax.device_put(v, sharding))

    def _logprobs(self) -> None:
        if not self.logprob_waiting:
            return
        reqs = list(self.logprob_waiting)
        self.logprob_waiting.clear()
        prompts, adapters = [r.prompt for r in reqs], [r.adapter for r in reqs]
        try:
            for pb in self.s.packed(prompts, adapters, self.min_stream)[1]:
                self.program_keys.add(("prefill", None, pb.tokens.shape, pb.spans.shape, True))
            out = self.s.prompt_logprobs(prompts, adapters, None, self.min_stream)
        except Exception as e:  # noqa: BLE001
            for r in reqs:
                self._end(r, e)
            return
        for r, lp in zip(reqs, out):
            self._end(r, lp)

    def _decode(self) -> None:
        s = self.s
        live = [x for x, own in enumerate(self.owner) if own is not None
                and not own[0].done[own[1]]]
        if not live:
            return
        groups = s.dp * s.cp
        # The window decoded: the first w_b rows of each device, cache rows [0, w_t), each
        # bucketed (module docstring, "Programs").
        w_b = layout_lib.ladder(max(x % self.b_local for x in live) + 1, self.b_local,
                                WINDOW_FLOOR[0])
        need = max(len(self.owner[x][0].prompt) - 1 + len(self.owner[x][0].tokens[self.owner[x][1]])
                   for x in live) + self.chunk
        w_t = layout_lib.ladder(min(need, self.max_len), self.max_len, WINDOW_FLOOR[1])
        b = groups * w_b
        at = {x: (x // self.b_local) * w_b + x % self.b_local for x in live}
        token = np.zeros(b, np.int32)
        position = np.zeros(b, np.int32)
        base = np.zeros(b, np.int32)
        done = np.ones(b, bool)
        count = np.zeros(b, np.int32)
        max_tokens = np.ones(b, np.int32)
        temperature = np.zeros(b, np.float32)
        top_k = np.full(b, -1, np.int32)
        top_p = np.ones(b, np.float32)
        keys = np.zeros((b, 2), np.uint32)
        adapter = np.full(b, layout_lib.PADDING, np.int64)
        stops = [()] * b
        for slot in live:
            req, j = self.owner[slot]
            i = at[slot]
            p = req.params
            n = len(req.prompt) - 1
            c = len(req.tokens[j])
            token[i] = req.tokens[j][-1] if c else req.prompt[-1]
            position[i], base[i], count[i], done[i] = n + c, n, c, False
            max_tokens[i], temperature[i] = p["max_tokens"], p["temperature"]
            top_k[i], top_p[i] = p["top_k"], p["top_p"]
            keys[i] = req.keys[j]
            adapter[i], stops[i] = req.adapter, p["stop"]
        rows_live = [at[x] for x in live]
        self.peak_live = max(self.peak_live, len(live))
        n_active = len({int(adapter[x]) for x in rows_live})
        a_len = batch_lib.active_bucket(n_active, s.limits.max_adapters + 1)
        active, index = layout_lib.active_index(adapter, a_len, BASE)
        greedy = bool(np.all(temperature[rows_live] == 0.0))
        filtered = bool(np.any((temperature[rows_live] > 0)
                               & ((top_k[rows_live] > 0) | (top_p[rows_live] < 1.0))))
        rows = programs.DecodeRows(token, position, base, done, count, index, max_tokens,
                                   temperature, top_k, top_p, keys,
                                   layout_lib.stop_table(stops))
        rows = jax.tree.map(s.put, rows, programs.DecodeRows.specs(self.lay))
        cache = kv_cache.Cache(self.cache.k, self.cache.v,
                               s.put(self.row_position, self.lay.position_BxT))
        modes = programs.DecodeModes("batch", self.chunk, greedy, filtered, s.slice_layers,
                                     window=(w_b, w_t))
        self.program_keys.add(("decode", modes, a_len, rows.stop.shape))
        try:
            out_tok, out_lp, cache = s.decode(s.state.weights, s.params, s.state.meta, cache,
                                              rows, replicate(s.mesh, active), modes=modes)
            out_tok, out_lp = host(out_tok), host(out_lp)
        except Exception as e:  # noqa: BLE001 — the cache was donated: every live request fails
            self.cache = None
            for req in {id(r): r for r in (self.owner[x][0] for x in live)}.values():
                self._end(req, EngineError(f"decode failed: {e}"))
            return
        self._keep(cache.k, cache.v)
        del cache
        ended = []
        for slot in live:
            req, j = self.owner[slot]
            i = at[slot]
            got = out_tok[i] >= 0
            req.tokens[j].extend(int(t) for t in out_tok[i][got])
            req.lps[j].extend(float(x) for x in out_lp[i][got])
            c = len(req.tokens[j])
            n = len(req.prompt) - 1
            if c >= req.params["max_tokens"] or (c and req.tokens[j][-1] in req.params["stop"]):
                req.done[j] = True
                self.owner[slot] = None
                self.row_position[slot] = -1
                if all(req.done):
                    ended.append(req)
            else:
                self.row_position[slot, :n + c] = np.arange(n + c)
        for req in ended:
            stops = set(req.params["stop"])
            seqs = [SampledSequence(np.array(t, np.int32), np.array(lp, np.float32),
                                    "stop" if t and t[-1] in stops else "length")
                    for t, lp in zip(req.tokens, req.lps)]
            self._end(req, SampleResult(seqs, req.plp))
