"""The continuous-batching sampling engine: a persistent decode batch that requests join
and leave between steps.

Owns the requests' lifecycle — submit, the waiting queues, step, result — and what ties
its parts together: the settings (engine_config.py: EngineConfig, EngineSizes), the
admission policy over the host page pool (admission.py over pages.py: rows, pages, prefix
cache, decode length), the device side (runner.py: the Runner it shares with the
Sampler, and its EngineDevice: paged KV cache and program calls, over the host arrays of
engine_rows.py) and the warm-up (warmup.py). Long form: docs/engine.md. A step (`step`) is: fail
what must fail (cancelled requests, sequences whose adapter changed), admit waiting
requests while decode rows and pages last, prefill one chunk of every admitted prompt
(at most `prefill_tokens` prompt tokens per step over all prompts: a long prompt is split
over steps, and running sequences decode between its chunks), run every compute_logprobs
request waiting (one prefill, no cache), then decode every live sequence for up to
`decode_len` steps in one device loop (while a light tenant's few rows sit beside
another's many, only one of the two sets: admission.py's "Light steps"). Every row carries
its own adapter (routed by index, lora.Routing.index_S: a row costs its adapter's rank,
not the slot table), temperature, top-k, top-p, seed stream, stop set and max_tokens.

Results equal Trainer.sample of the same request alone (one prompt, the same seed), token
for token, whatever else is in the batch: a sequence's draws depend on its own key and
token count only (draws.sample_tokens), and attention reads only its own pages.

Admission (admission.py's module docstring: "Decode chunks", "Memory") places each
request's samples on devices with free decode rows and pages, reserving its worst case;
the prefix cache (pages.py's: "Prefix cache") lets a prompt take the cached pages of an
earlier one with the same adapter, salt and leading tokens.

Programs: every dynamic dimension of the engine's device programs is bucketed to a few
values (the ladders: engine_config.py's module docstring, "Programs"). `program_keys`
holds the static signature of every program the engine has run (`programs()` counts
them); `warmup` compiles the bounded set up front.

Hybrid models (Qwen3.5): every decode slot also holds one recurrent-state row on its
device (paged.Pool.rec), taken at admission and freed when the sequence ends; no prefix
cache (a state is not recoverable from K/V pages). Long sequences (long_len > max_len) run
like any other, on the table rungs above max_len / page, their pages on one device; one
longer than a device's pages (seq_cap) is refused. Adapters: a sequence records its slot's
version (AdapterState.version) at admission; a request whose adapter changes before it
ends fails (EngineError), never mixing old and new weights. Each at length:
docs/engine.md.

It must never change adapter state, and never run a device program outside `step`.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Collection, Sequence

import numpy as np

from jcp.errors import InputError
from jcp.sample import requests as requests_lib
from jcp.sample import warmup as warmup_lib
from jcp.sample.admission import Admission
from jcp.sample.engine_config import EngineConfig, EngineSizes
from jcp.sample.pages import PagePool, page_keys  # noqa: F401 — page_keys: re-exported
from jcp.sample.params import (
    BASE,
    STOP_WIDTH,
    PromptFields,
    PromptStatsCall,
    SampleResult,
    check_fields,
    check_prompts,
    prompt_results,
)
from jcp.sample.requests import Request, SubmitOptions
from jcp.sample.runner import EngineDevice
from jcp.sample.sampler import Sampler


class EngineError(RuntimeError):
    """A request the engine could not finish (cancelled, adapter changed, device failure)."""


class Engine:
    """Continuous batching over a Sampler's model and adapter table.

    sampler: the Sampler (Trainer.make_sampler()), whose Runner the engine shares; config:
    an EngineConfig, or its fields as keywords (Engine(sampler, slots=64, max_len=256,
    chunk=8, …): EngineConfig documents each); adapter_version: slot -> version counter
    (the AdapterState's by default). The resolved sizes (EngineSizes: slots, max_len,
    chunk, max_chunk, prefill_tokens, page, n_pages, seq_cap — the most positions of a
    sequence that also fit one device's pages — …) are attributes too.

    Use: rid = engine.submit(prompt, params, adapter, num_samples); engine.step() until
    engine.finished(rid); engine.result(rid) -> SampleResult (raises EngineError /
    InputError for a failed request). engine.run() steps until idle; engine.sample(...)
    does submit + run + results for a list of prompts.
    """

    def __init__(
        self,
        sampler: Sampler,
        config: EngineConfig | None = None,
        *,
        adapter_version: Callable[[int], int] | None = None,
        **knobs,
    ):
        if config is None:
            config = EngineConfig(**knobs)
        elif knobs:
            raise TypeError(f"Engine: pass config or keywords, not both ({sorted(knobs)})")
        self.s, self.config = sampler, config
        self.sizes = s = EngineSizes.of(
            config,
            sampler.dp * sampler.cp,
            sampler.limits.max_tokens_per_device * sampler.dp,
            sampler.cfg.is_hybrid,
        )
        # The resolved sizes callers read (jcp-serve, tests, benchmarks).
        self.slots, self.max_len, self.chunk, self.max_chunk = (
            s.slots,
            s.max_len,
            s.chunk,
            s.max_chunk,
        )
        self.prefill_tokens, self.page, self.long_len, self.seq_cap = (
            s.prefill_tokens,
            s.page,
            s.long_len,
            s.seq_cap,
        )
        self.n_pages, self.max_pages, self.long_pages = s.n_pages, s.max_pages, s.long_pages
        self.groups, self.b_local, self.hybrid, self.prefix_cache = (
            s.groups,
            s.b_local,
            s.hybrid,
            s.prefix_cache,
        )
        self.version = adapter_version or sampler.state.version
        self.admission = Admission(s)
        # The device side: the Sampler's runner (shared programs) and this engine's pages.
        self.runner = sampler.runner
        self.device = EngineDevice(self.runner, s)
        self.waiting: deque[Request] = deque()
        self.logprob_waiting: deque[Request] = deque()
        self.requests: dict[int, Request] = {}
        self.outcomes: dict[int, SampleResult | list | Exception] = {}
        self._ended: list[int] = []
        self.callbacks: dict[int, Callable] = {}
        self._ids = itertools.count()
        self.steps = 0
        self.peak_live = 0  # the most sequences one decode call has held
        self.peak_pages = 0  # the most pages held on one device
        self.prefilled = 0  # prompt positions run through extend (cache hits skip theirs)

    # ------------------------------------------------------------------ requests

    def submit(
        self,
        prompt,
        sampling_params,
        adapter=None,
        num_samples: int = 1,
        prompt_logprobs: bool = False,
        *positional,
        options: SubmitOptions | None = None,
        **keywords,
    ) -> int:
        """Queue one prompt's num_samples sequences -> request id. Refused (InputError)
        before anything is queued: as Trainer.sample, and when the prompt plus max_tokens
        exceed max_len, num_samples exceeds the slots, or the request could never fit
        the pages (Admission.check_fits). The rest — callback=, fields=, salt=, watch=,
        tenant= — as keywords or options=: SubmitOptions (requests.py) documents each."""
        opts = SubmitOptions.of(options, positional, keywords)
        c = self.s.check([prompt], sampling_params, adapter, num_samples)
        if not isinstance(prompt_logprobs, (bool, np.bool_)):
            raise InputError(f"prompt_logprobs must be a bool, got {prompt_logprobs!r}")
        n = len(c.prompts[0])
        fields = check_fields(opts.fields, n, self.s.cfg.vocab_size, bool(prompt_logprobs))
        self.admission.check_fits(n - 1, c.max_tokens, c.num_samples)
        params = dict(
            max_tokens=c.max_tokens,
            temperature=c.temperature,
            top_k=c.top_k,
            top_p=c.top_p,
            stop=c.stop,
            seed=c.seed,
        )
        req = Request(
            next(self._ids),
            c.prompts[0],
            c.adapters[0],
            self._version(c.adapters[0]),
            params,
            c.num_samples,
            bool(prompt_logprobs),
            fields=fields,
            salt=opts.salt_bytes,
            watch=opts.watch,
            tenant=opts.tenant or "",
        )
        self._queue(req, opts.callback)
        self.waiting.append(req)
        return req.rid

    def submit_logprobs(
        self,
        prompt,
        adapter=None,
        callback: Callable | None = None,
        prompt_logprobs_last_n: int | None = None,
    ) -> int:
        """Queue a compute_logprobs request -> request id; its result is float32
        [len(prompt)] (NaN at 0, and before the last prompt_logprobs_last_n positions), as
        Trainer.compute_logprobs."""
        (p,) = check_prompts([prompt], self.s.cfg.vocab_size)
        (a,) = self.s.check_adapters(adapter, 1)
        if len(p) > self.s.limits.token_cap:
            raise InputError(
                f"prompt has {len(p)} tokens, over the cap of "
                f"{self.s.limits.token_cap} tokens per sequence"
            )
        fields = check_fields(
            PromptFields(prompt_logprobs_last_n=prompt_logprobs_last_n),
            len(p),
            self.s.cfg.vocab_size,
            True,
        )
        req = Request(
            next(self._ids), p, a, self._version(a), {}, 0, True, logprobs_only=True, fields=fields
        )
        self._queue(req, callback)
        self.logprob_waiting.append(req)
        return req.rid

    def _queue(self, req: Request, callback) -> None:
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
        return sum(self.admission.rows_used)

    @property
    def pool(self) -> PagePool:
        """The host side of the paged cache (pages.PagePool)."""
        return self.admission.pool

    @property
    def free_rows(self) -> list[list[int]]:
        """Per device, the free recurrent-state rows (a hybrid model)."""
        return self.admission.free_rows

    @property
    def prefilling(self) -> list:
        """Request groups whose prompt is not all cached yet (admission.Group)."""
        return self.admission.prefilling

    def programs(self) -> int:
        """How many distinct device programs the engine has run."""
        return len(self.program_keys)

    @property
    def program_keys(self) -> set[tuple]:
        """The static signature of every program the engine has run (EngineDevice)."""
        return self.device.program_keys

    def kv_bytes(self, pages: int = 1) -> int:
        """Bytes of `pages` pages on one device (K and V of every full-attention layer)."""
        return pages * self.page * (self.runner.row_bytes - 4)

    def state_bytes(self) -> int:
        """Bytes of one sequence's recurrent-state row on one device (a hybrid model: conv
        window and delta-rule state of every Gated DeltaNet layer, fp32; 0 otherwise).
        Every decode slot holds one: slots / (dp·cp) rows per device."""
        return self.runner.state_bytes

    def _version(self, adapter: int) -> int:
        return -1 if adapter == BASE else int(self.version(adapter))

    # ------------------------------------------------------------------ ending

    def _end(self, req: Request, outcome) -> None:
        self.admission.remove(req)
        self.requests.pop(req.rid, None)
        for q in (self.waiting, self.logprob_waiting):
            if req in q:
                q.remove(req)
        self._ended.append(req.rid)
        req.release()
        cb = self.callbacks.pop(req.rid, None)
        if cb is not None:  # the callback owns the outcome: nothing is kept for result()
            cb(req.rid, outcome)
        else:
            self.outcomes[req.rid] = outcome

    def _lost(self, e: Exception) -> None:
        """The device pages were donated to a program that failed: every request holding
        pages fails, and the pool starts empty."""
        self.device.lose()
        for req in list(self.requests.values()):
            if req.seqs:
                self._end(req, EngineError(f"the engine's cache was lost: {e}"))
        self.admission.reset()

    # ------------------------------------------------------------------ the step

    def step(
        self, hurry: bool = False, decode: bool = True, tenants: Collection[str] = ()
    ) -> list[int]:
        """One engine step (see the module docstring) -> ids of the requests it ended.
        hurry: work outside the engine waits for this step to end (a server's queued
        requests), so decode only `chunk` steps (admission.py's module docstring, "Decode
        chunks").
        decode=False: a prefill-only step (admit, one prefill chunk, compute_logprobs; no
        decode step), e.g. to prefill a burst's first arrivals while the rest still arrive
        so that all decode together; it changes no result (a sequence's first token is
        drawn by its first decode step, from its own key and count). tenants: the tenants
        sharing the engine now besides those with requests in it, for their shares of rows
        and pages (admission.py's module docstring, "Tenants")."""
        self._ended = []
        self._fail_stale()
        active = self._admit(tenants)
        # Light steps (admission.py's module docstring): while a light tenant's few rows
        # sit beside another's many, steps alternate between the two sets' rows.
        serve = self.admission.step_tenants()
        if self.prefilling:
            self._prefill(serve)
        self._logprobs()
        live = self.admission.serving(serve)
        if live and decode:
            n_steps = self.admission.decode_len(hurry, bool(self.waiting), serve, active)
            self._decode(n_steps, live)
        self.peak_pages = max([self.peak_pages] + [self.pool.used(g) for g in range(self.groups)])
        self.steps += 1
        return self._ended

    def light_next(self, tenants: Collection[str] = ()) -> frozenset | None:
        """Admit what waits (as a step would first) -> the light tenants whose rows alone
        the next step serves (admission.py's module docstring, "Light steps": a step the
        size of a few rows, which a caller may run before its other work), or None when
        the next step is not such a step."""
        self._admit(tenants)
        serve = self.admission.step_tenants(commit=False)
        return serve if serve is not None and serve == self.admission.split() else None

    def run(self, max_steps: int | None = None) -> None:
        """Step until no request is left (or max_steps)."""
        n = 0
        while not self.idle and (max_steps is None or n < max_steps):
            self.step()
            n += 1

    def sample(
        self,
        prompts,
        sampling_params,
        adapters=None,
        num_samples: int = 1,
        prompt_logprobs: bool = False,
    ) -> list[SampleResult]:
        """Trainer.sample's contract through the engine (every prompt its own request)."""
        per = self.s.check_adapters(adapters, len(check_prompts(prompts, self.s.cfg.vocab_size)))
        rids = [
            self.submit(p, sampling_params, None if a == BASE else a, num_samples, prompt_logprobs)
            for p, a in zip(prompts, per)
        ]
        self.run()
        return [self.result(r) for r in rids]

    def _fail_stale(self) -> None:
        for req in list(self.requests.values()):
            if req.cancelled:
                self._end(req, EngineError(f"request {req.rid} was cancelled"))
            elif self._version(req.adapter) != req.version:
                self._end(
                    req,
                    EngineError(
                        f"adapter {req.adapter} changed (or was deleted) while request {req.rid} "
                        "was sampling from it; its sequences were dropped, none mixes weights"
                    ),
                )

    # ------------------------------------------------------------------ admission

    def _admit(self, tenants: Collection[str]) -> set[str]:
        """Admit what waits -> the tenants using the engine."""
        # Round robin over tenants, first come, first served within one (a request that
        # does not fit holds back its tenant's later ones: no starvation of its large
        # requests), each within its share while several use the engine
        # (Admission.admit_fair).
        active = {r.tenant for r in self.requests.values()} | set(tenants)
        admitted = self.admission.admit_fair(self.waiting, len(active))
        stats = [req for req in admitted if req.fields.prompt_stats]
        if stats:
            self._prompt_stats(stats)
        return active

    def _prompt_stats(self, reqs: list[Request]) -> None:
        """The SDK prompt fields of newly admitted requests: one cache-less prefill."""
        prompts, fields = [r.prompt for r in reqs], [r.fields for r in reqs]
        call = PromptStatsCall.of(
            prompts,
            fields,
            [r.params["temperature"] for r in reqs],
            [r.params["seed"] for r in reqs],
            [0] * len(reqs),
        )
        try:
            outs = self.device.prompt_outputs(prompts, [r.adapter for r in reqs], fields, call)
        except Exception as e:  # noqa: BLE001 — these requests fail, nothing else
            for r in reqs:
                self._end(r, e)
            return
        for r, out in zip(reqs, outs):
            r.prompt_out = prompt_results(out, len(r.prompt), r.fields, r.prompt_logprobs)

    # ------------------------------------------------------------------ prefill

    def _prefill(self, tenants: Collection[str] | None = None) -> None:
        """One chunk of every prefilling prompt (FIFO, within the prefill_tokens budget;
        tenants: only theirs)."""
        work = self.admission.prefill_work(tenants)
        if not work:
            return
        for group, c in work:
            self.admission.grow(group.seqs[0], group.filled + c)
        rows, modes, active, at = self.device.extend_batch(work)
        try:
            lp = self.device.extend(rows, modes, active)
        except Exception as e:  # noqa: BLE001 — the pages were donated: all fail
            self._lost(e)
            return
        copies = []
        for group, c in work:
            req, i, f = group.seqs[0].req, at[id(group)], group.filled
            if req.plp is not None:
                req.plp[f + 1 : f + c + 1] = lp[i, :c]
            group.filled = f + c
            self.prefilled += c
            if group.filled >= req.n:
                self.admission.end_prefill(group, copies)
        try:
            self.device.run_copies(copies)
        except Exception as e:  # noqa: BLE001
            self._lost(e)

    def _logprobs(self) -> None:
        if not self.logprob_waiting:
            return
        reqs = list(self.logprob_waiting)
        self.logprob_waiting.clear()
        try:
            out = self.device.prompt_logprobs([r.prompt for r in reqs], [r.adapter for r in reqs])
        except Exception as e:  # noqa: BLE001
            for r in reqs:
                self._end(r, e)
            return
        for r, lp in zip(reqs, out):
            last_n = r.fields.prompt_logprobs_last_n
            if last_n is not None:
                lp[: len(lp) - last_n] = np.nan
            self._end(r, lp)

    # ------------------------------------------------------------------ decode

    def decode_len(self, hurry: bool = False) -> int:
        """Decode steps of this step's device call (Admission.decode_len; module
        docstring, "Decode chunks")."""
        return self.admission.decode_len(hurry, bool(self.waiting))

    def _decode(self, n_steps: int, live: list) -> None:
        for seq in live:
            req = seq.req
            end = req.n + req.params["max_tokens"]
            self.admission.grow(seq, min(req.n + len(seq.tokens) + n_steps, end))
        table, rows, modes, active, slot, at = self.device.decode_batch(live, n_steps)
        self.peak_live = max(self.peak_live, len(live))
        try:
            out_tok, out_lp, *out_tk = self.device.decode(table, rows, modes, active, slot)
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
            n, k = got[i], req.fields.topk_sample_logprobs
            part = (out_tk[0][i][:n, :k], out_tk[1][i][:n, :k]) if k else None
            if seq.add(tok_rows[i][:n], lp_rows[i][:n], part):
                self.admission.release(seq)
                if all(x.done for x in req.seqs):
                    ended.append(req)
        self.admission.decoding = [x for x in self.admission.decoding if not x.done]
        for req in ended:
            self._end(req, requests_lib.result(req))

    # ------------------------------------------------------------------ warm-up

    def warmup(
        self,
        active: Sequence[int] = (1,),
        draws: Sequence[str] = ("greedy", "drawn"),
        prompt_logprobs: Sequence[bool] = (False,),
        compute_logprobs: bool = False,
        stop_width: Sequence[int] = (STOP_WIDTH,),
        topk: Sequence[int] = (0,),
        prompt_stats: Sequence[tuple[int, int, int]] = (),
    ) -> int:
        """Compile, up front, the programs the engine can run for these buckets -> how many
        it ran (program_keys then holds them): the bounded set of engine_config.py's
        module docstring, "Programs", as warmup.warmup lists it per argument. Runs each
        program on padding (no request; every write is dropped; each decode loop body a
        few steps per draw branch; an extend only if cheap: warmup.WARM_RUN_FLOPS), so
        later requests of those shapes compile nothing and run as fast as the steady
        ones. Only on an idle engine."""
        if not self.idle:
            raise RuntimeError("Engine.warmup runs on an idle engine only")
        return warmup_lib.warmup(
            self.device,
            active,
            draws,
            prompt_logprobs,
            compute_logprobs,
            stop_width,
            topk,
            prompt_stats,
        )
