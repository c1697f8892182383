"""`Samples` (part of jcp.server.worker.Worker): one asample admitted into the running
sampling engine, or run beside it (Trainer.sample, its cache split over cp) when its KV
cache would exceed a whole device's pages (Engine.seq_cap); its result or error completed
through the worker's `complete`, encoded for its protocol (Tinker's proto, or an OpenAI
route's raw SampleResult), text stops applied (a StopWatch).

When to admit, when to step the engine and what a cancel does are the worker's loop
(jcp/server/worker.py); this module never steps the engine. Like every owner-side module
of the server it is only reached from the worker thread.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jcp
from jcp.server import wire
from jcp.server.passes import error_result
from jcp.server.scheduler import Work


class Samples:
    """The worker's asample admission and completion (module docstring). Reads the
    worker's store, trainer (`tr`), sampling engine, slot cache (`_sampler_adapter`) and
    its request tables (`_sampled`, `_running`, `_streaming`, `_cancelled`)."""

    def _admit_sample(self, w: Work) -> None:
        """Admit one asample into the running engine (or run it beside, if too long).

        An OpenAI route's sample (jcp/server/openai_api.py) is the same Work: its payload
        names its weights by a SamplerRecord built at the edge ("sampler") instead of a
        sampling session, and asks for the SampleResult itself ("raw": completed as
        ("result", SampleResult)). "watch" (jcp.server.text.StopWatch), from either
        protocol: text stop sequences and a stream's feed, called after each decode call."""
        try:
            p = w.payload
            rec = p.get("sampler") or self.store.sampler(p["sampling_session_id"], w.owner)
            args: wire.SampleArgs = p["args"]
            watch = p.get("watch")
            adapter = self._sampler_adapter(rec)
            sp, fields = _sample_call(args)
            target = args.target_prompt_logprobs
            if len(args.prompt) - 1 + args.max_tokens > self.sampling.seq_cap:
                res = self.tr.sample(
                    [args.prompt],
                    sp,
                    adapters=adapter,
                    num_samples=args.num_samples,
                    prompt_logprobs=args.prompt_logprobs,
                    fields=fields,
                )[0]
                if watch is not None:
                    res = _watched(res, watch)
                self._complete(w.request_id, _encode_sample(res, target, p.get("raw")))
                return
            # Salted by tenant: no tenant can hit (or time) another's cached prompt pages.
            # When it came, not when the worker got to it: a slow turn must not make an
            # active tenant look gone.
            self._sampled[w.owner] = max(self._sampled.get(w.owner, 0.0), w.arrived_at)
            rid = self.sampling.submit(
                args.prompt,
                sp,
                adapter,
                args.num_samples,
                args.prompt_logprobs,
                callback=self._sample_done(w.request_id, target, p.get("raw")),
                fields=fields,
                salt=w.owner,
                watch=watch,
                tenant=w.owner,
            )
            self._running[w.request_id] = rid
            if p.get("stream"):
                self._streaming.add(w.request_id)
        except Exception as e:  # noqa: BLE001
            self._complete(w.request_id, error_result(e))

    def _sample_done(self, request_id: str, target, raw) -> Callable:
        """The engine's callback for one admitted request: its result, or its error."""

        def done(rid, outcome):
            self._running.pop(request_id, None)
            self._streaming.discard(request_id)
            if request_id in self._cancelled:
                self._cancelled.discard(request_id)
                self._complete(request_id, ("error", "cancelled by the client", "user"))
                return
            self._complete(
                request_id,
                error_result(outcome)
                if isinstance(outcome, Exception)
                else _encode_sample(outcome, target, raw),
            )

        return done


def _sample_call(args: wire.SampleArgs) -> tuple[jcp.SamplingParams, jcp.PromptFields]:
    """A sample request's SamplingParams and prompt fields, as jcp takes them."""
    sp = jcp.SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        stop=args.stop,
        seed=args.seed,
    )
    target = args.target_prompt_logprobs
    fields = jcp.PromptFields(
        topk_prompt_logprobs=args.topk_prompt_logprobs,
        topk_sample_logprobs=args.topk_sample_logprobs,
        prompt_logprobs_last_n=args.prompt_logprobs_last_n,
        target_prompt_logprobs=None if target is None else target.ids,
        prompt_alt_tokens_k=args.prompt_alt_tokens_k,
    )
    return sp, fields


def _encode_sample(res, target=None, raw: bool = False) -> tuple:
    if raw:  # an OpenAI route formats it (jcp/server/openai_api.py)
        return ("result", res)
    return ("proto", wire.encode_sample_response(res, target))


def _watched(res, watch):
    """A finished SampleResult under a StopWatch (a sample run beside the engine): each
    sequence a text stop ended is cut after the token that completed it."""
    seqs = []
    for j, s in enumerate(res.sequences):
        tk = s.topk_logprobs
        keep = watch(
            j,
            s.tokens.tolist(),
            s.logprobs.tolist(),
            [] if tk is None else [(tk.token_ids, tk.logprobs)],
        )
        if keep is not None:
            s = dataclasses.replace(
                s,
                tokens=s.tokens[:keep],
                logprobs=s.logprobs[:keep],
                stop_reason="stop",
                topk_logprobs=None
                if tk is None
                else dataclasses.replace(
                    tk, token_ids=tk.token_ids[:keep], logprobs=tk.logprobs[:keep]
                ),
            )
        seqs.append(s)
    return dataclasses.replace(res, sequences=seqs)
