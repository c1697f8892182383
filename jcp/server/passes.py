"""The worker's training passes: fused forward / forward_backward over several requests.

A fused pass is one Trainer.forward / forward_backward over the datums of all its requests
(adapters per datum); if that call refuses the batch (InputError: nothing was changed), each
request is rerun alone so that only the bad one fails. A pass of several Trainer
micro-batches runs one micro-batch per turn (jcp.trainer.Steps, `advance_pass`), other
tenants' passes between them; its first turn only validates and packs it (`start_pass`).
`Passes` is one part of `jcp.server.worker.Worker`; results go back through its
`_complete`.
"""

from __future__ import annotations

import logging
import traceback

import numpy as np

import jcp
from jcp.errors import InputError
from jcp.server import wire
from jcp.server.scheduler import Work
from jcp.server.state import NotFound

log = logging.getLogger("jcp.serve")

REFUSED_LOSSES = {
    "stable_reinforce": "stable_reinforce is not served: its objective is not published (provenance "
    "spans and record_stability_info are accepted and ignored; use "
    "importance_sampling, ppo, cispo, dro or gspo)",
}


class Passes:
    """The Worker's fused forward / forward_backward passes, split over turns."""

    def _init_passes(self) -> None:
        # tenant -> (group, jcp.trainer.Steps, each request's datum span) of its pass
        # running over turns (Scheduler.split).
        self.splits: dict[str, tuple] = {}

    def start_pass(self, group: list[Work], split: bool = True) -> None:
        """One fused Trainer call; on refusal, each request alone. split: a call of several
        micro-batches runs one per turn (`advance_pass`), other tenants' passes between."""
        if len(group) > 1 and (
            self.tr.cfg.is_moe or any(w.payload.loss_fn == "custom" for w in group)
        ):
            # MoE load metrics and the router auxiliary loss are batch-level figures, and a
            # custom loss's metrics are per request: a fused pass could not report each
            # request's own, so each runs alone.
            for w in group:
                self.start_pass([w], split=False)
            return
        self.sched.note_pass(group)
        try:
            steps, spans = self._start_fwd(group)
            # A multi-process job's Trainer is a proxy that runs whole calls only.
            if split and steps.passes > 1 and self.leader is None:
                # This turn validated and packed the whole call (O(its datums) on the
                # host); its first micro-batch runs at the tenant's next turn, so that
                # another's small request waits for one of the two, not both.
                self.splits[group[0].owner] = (group, steps, spans)
                self.sched.split(group)
                return
            while not steps.step():
                pass
            outs = self._fwd_results(group, steps.output, spans)
        except Exception as e:  # noqa: BLE001
            self._fwd_failed(group, e)
            return
        for w, out in zip(group, outs):
            self._complete(w.request_id, out)

    def advance_pass(self, tenant: str) -> None:
        """One micro-batch of the tenant's split pass; completes its requests after the
        last."""
        group, steps, spans = self.splits[tenant]
        try:
            # Other work waiting: let this micro-batch finish before it runs, so that it
            # waits for one micro-batch, not MAX_IN_FLIGHT; and run a micro-batch in
            # turns where it can (Steps.turns: a forward_backward's forward pass of each
            # layer span, then the backward pass of each, --turn-spans; a forward's first
            # half of the layers, then the rest and the loss), so that it waits for one
            # turn. Alone, the micro-batches run whole, back to back (turns cost a pass
            # 6-11 %: benchmarks/pass_turns.py).
            settle = self.contended()
            steps.turns = settle
            if not steps.step(settle=settle):
                return
            outs = self._fwd_results(group, steps.output, spans)
        except Exception as e:  # noqa: BLE001 — the call rolled its accumulation back
            self._end_split(tenant)
            self._fwd_failed(group, e)
            return
        self._end_split(tenant)
        for w, out in zip(group, outs):
            self._complete(w.request_id, out)

    def contended(self) -> bool:
        """Whether other work waits for the worker while a split pass runs: a queued
        request, a running sample, or another split pass."""
        return self.sched.pending() > 0 or not self.sampling.idle or len(self.splits) > 1

    def _end_split(self, tenant: str) -> None:
        self.sched.finish(self.splits.pop(tenant)[0])

    def _fwd_failed(self, group: list[Work], e: Exception) -> None:
        """A Trainer call refused or failed (nothing accumulated): alone, the request
        fails; fused, each request is rerun alone so that only the bad one fails."""
        if len(group) == 1:
            self._complete(group[0].request_id, error_result(e))
            return
        for w in group:
            try:
                self.sched.note_pass([w])
                steps, spans = self._start_fwd([w])
                while not steps.step():
                    pass
                out = self._fwd_results([w], steps.output, spans)[0]
            except Exception as e1:  # noqa: BLE001
                out = error_result(e1)
            self._complete(w.request_id, out)

    def _start_fwd(self, group: list[Work]) -> tuple:
        """(the group's Trainer call as jcp.trainer.Steps, each request's datum span);
        refused here, before any device work."""
        data, adapters, losses, configs, spans = [], [], [], {}, []
        keep = frozenset(w.model_id for w in group)
        for w in group:
            req: wire.FwdBwdRequest = w.payload
            if req.loss_fn in REFUSED_LOSSES:
                raise InputError(REFUSED_LOSSES[req.loss_fn])
            slot = self._slot(w, keep)
            start = len(data)
            for tokens, inputs in req.data:
                data.append(jcp.Datum(model_input=tokens, loss_fn_inputs=inputs))
                adapters.append(slot)
                losses.append(req.loss_fn)
            configs[req.loss_fn] = req.loss_fn_config
            spans.append((start, len(data)))
        if not data:
            raise InputError("forward_backward needs at least one datum")
        if losses[0] == "custom":  # start_pass runs a custom request alone
            loss_fn, config = self._custom_loss(group[0], configs["custom"]), None
            data = [_custom_datum(d, loss_fn) for d in data]
        elif len(configs) == 1:
            config = next(iter(configs.values()))
            loss_fn = losses[0]
        else:
            config = {k: v for k, v in configs.items() if v}
            loss_fn = losses
        if self.leader is not None:  # the proxy runs whole calls: one step
            run = self.tr.forward if group[0].kind == "forward" else self.tr.forward_backward
            return _Whole(run, data, loss_fn, config or None, adapters), spans
        start = (
            self.tr.forward_steps if group[0].kind == "forward" else self.tr.forward_backward_steps
        )
        return start(data, loss_fn=loss_fn, loss_fn_config=config or None, adapters=adapters), spans

    def _fwd_results(self, group: list[Work], out, spans: list[tuple]) -> list[tuple]:
        """Each request's result from the call's output."""
        results = []
        for a, b in spans:
            per = out.loss_fn_outputs[a:b]
            # A request's metrics from its own datums: what it would get alone.
            metrics = {"loss:sum": float(sum(np.float64(d["loss:sum"]) for d in per))}
            if any("clipped_tokens:sum" in d for d in per):
                metrics["clipped_tokens:sum"] = float(
                    sum(d.get("clipped_tokens:sum", 0) for d in per)
                )
            if len(group) == 1:
                metrics = {k: float(v) for k, v in out.metrics.items()}
            body = wire.encode_forward_backward_output(
                [{"logprobs": d["logprobs"]} for d in per], metrics
            )
            results.append(("proto", body))
        return results


class _Whole:
    """A whole Trainer call with jcp.trainer.Steps' face (a multi-process job's proxy)."""

    passes = 1

    def __init__(self, run, *args):
        self._run, self._args, self.output = run, args, None

    def step(self, settle: bool = False) -> bool:
        data, loss_fn, config, adapters = self._args
        self.output = self._run(data, loss_fn=loss_fn, loss_fn_config=config, adapters=adapters)
        return True


def _custom_datum(d: jcp.Datum, loss: jcp.CustomLoss) -> jcp.Datum:
    """The wire has no shape for a scalar: an input the loss declares rank 0 arrives as
    one value [1]; make it the scalar."""
    inputs = dict(d.loss_fn_inputs)
    for name, rank in loss.inputs[1:]:
        v = inputs.get(name)
        if rank == 0 and isinstance(v, np.ndarray) and v.shape == (1,):
            inputs[name] = v.reshape(())
    return jcp.Datum(model_input=d.model_input, loss_fn_inputs=inputs)


def error_result(e: Exception) -> tuple:
    """A failed request's result: ("error", message, "user" or "server")."""
    if isinstance(e, (InputError, wire.WireError, NotFound, ValueError)):
        return ("error", str(e), "user")
    log.error("request failed: %s", "".join(traceback.format_exception(e)))
    return ("error", f"{type(e).__name__}: {e}", "server")
