"""The worker: the one thread that owns the Trainer and runs the scheduler's passes.

Owns every Trainer call, the running sampling engine (jcp.sample.engine.Engine) and the
map from models / sampler weights to adapter slots. Every asample of every tenant is
admitted into the one running engine batch (a sample whose prompt + max_tokens exceed the
engine's rows runs beside it, Trainer.sample, whose cache may split over cp).

Interleaving policy: each turn of the loop runs at most one training pass (a fused
forward / forward_backward, or one model operation) and then one engine step (at most
`prefill_tokens` of newly admitted prompts, then up to `chunk` decode steps of every live
sequence). So a training pass waits for at most one engine step, and running sequences
wait for at most one training pass between decode chunks; neither starves.

Sampler weights: save_weights_for_sampler without a name makes an in-memory snapshot (a
device copy of the model's slot into a free slot, no disk); with a name it writes the PEFT
folder, and a sampler of that folder loads it afresh (a cached load of an older save under
the same name is retired). Snapshot and loaded sampler slots are an LRU cache: when a slot
is needed, the least recently used one that no running sequence reads is freed (a sampler
whose snapshot was freed fails clearly and asks for a new save).

A fused pass is one Trainer.forward / forward_backward over the datums of all its requests
(adapters per datum); if that call refuses the batch (InputError: nothing was changed), each
request is rerun alone so that only the bad one fails. Results go back through `complete`,
as ("proto", bytes) / ("json", dict) / ("error", message, category). This is the owner
side of the server: the HTTP modules never import it or jax.
"""

from __future__ import annotations

import logging
import threading
import traceback
from collections import OrderedDict

import numpy as np

import jcp
from jcp.errors import InputError
from jcp.sample.engine import Engine as SampleEngine
from jcp.server import wire
from jcp.server.scheduler import Scheduler, Work
from jcp.server.state import ModelRecord, NotFound, StateStore

log = logging.getLogger("jcp.serve")

# Tinker does not expose alpha; its LoRA uses a fixed alpha of 32.
LORA_ALPHA = 32.0
# The sampling engine's KV cache: rows per sequence, and at most this many bytes per device.
SAMPLE_ROWS = 256
SAMPLE_SLOTS = 512
SAMPLE_CACHE_BYTES = 1 << 30
REFUSED_LOSSES = {
    "stable_reinforce": "stable_reinforce needs sampling-time stability records, which this "
                        "server does not keep",
    "custom": "server-side custom losses are not supported; forward_backward_custom works "
              "client-side (through cross_entropy)",
}


class Engine:
    def __init__(self, trainer, store: StateStore, scheduler: Scheduler, model_name: str,
                 complete, tokenizer_id: str | None = None, sample_slots: int | None = None,
                 sample_rows: int | None = None, chunk: int = 8):
        self.tr, self.store, self.sched = trainer, store, scheduler
        self.model_name, self.tokenizer_id = model_name, tokenizer_id
        self.token_cap = int(trainer.token_cap)
        self.max_rank = int(trainer.max_rank)
        self._complete = complete
        # tinker path (snapshots) or PEFT folder (named saves) -> slot, least recent first.
        self._sampler_slots: OrderedDict[str, int] = OrderedDict()
        self._retired: set[int] = set()  # sampler slots to free once no sequence reads them
        sampler = trainer.make_sampler()
        groups = sampler.dp * sampler.cp
        rows = sample_rows or min(self.token_cap, SAMPLE_ROWS)
        if sample_slots is None:
            fit = SAMPLE_CACHE_BYTES // (rows * sampler.row_bytes) * groups
            sample_slots = max(groups, min(SAMPLE_SLOTS, fit) // groups * groups)
        self.sampling = SampleEngine(sampler, slots=sample_slots, max_len=rows, chunk=chunk)
        self._thread = threading.Thread(target=self._loop, name="jcp-serve-worker", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.sched.close()
        self._thread.join(timeout=60)

    # ------------------------------------------------------------------ loop

    def _loop(self) -> None:
        while (got := self.sched.next_work(block=self.sampling.idle)) is not None:
            group, samples = got
            for w in samples:
                self._admit_sample(w)
            if group:
                self._run_pass(group)
            if not self.sampling.idle:
                try:
                    self.sampling.step()
                except Exception as e:  # noqa: BLE001 — the engine's requests fail, not the server
                    for rid in list(self.sampling.requests):
                        self.sampling.cancel(rid)
                    log.error("sampling step failed: %s", e)
            self._sweep_retired()

    def _run_pass(self, group: list[Work]) -> None:
        try:
            if group[0].kind in ("forward", "forward_backward"):
                self._fwd(group)
            else:
                w = group[0]
                self._complete(w.request_id, getattr(self, "_" + w.kind)(w))
        except Exception as e:  # noqa: BLE001 — one request's failure is only its own
            for w in group:
                self._complete(w.request_id, _error(e))

    # ------------------------------------------------------------------ slots

    def _in_use(self) -> set[int]:
        """Slots some queued or running sequence of the sampling engine reads."""
        return {r.adapter for r in self.sampling.requests.values()}

    def _free_slot(self, why: str) -> None:
        """Make room by dropping the least recently used sampler weights that no running
        sequence reads (never a training model)."""
        self._sweep_retired()
        if len(self.tr.adapters) < self.tr.max_adapters:
            return
        busy = self._in_use()
        for key, slot in self._sampler_slots.items():
            if slot not in busy:
                del self._sampler_slots[key]
                self.tr.delete_adapter(slot)
                return
        raise InputError(f"all {self.tr.max_adapters} adapter slots hold training models or "
                         f"sampler weights in use; cannot {why} (unload a model or raise "
                         "--max-adapters)")

    def _sweep_retired(self) -> None:
        if self._retired:
            for slot in self._retired - self._in_use():
                self.tr.delete_adapter(slot)
                self._retired.discard(slot)

    def _snapshot(self, slot: int) -> int:
        """A device copy of `slot` in a free slot (no disk) -> the copy's slot."""
        self._free_slot("snapshot sampler weights")
        st = self.tr.state
        dst = st.free_slot()
        st.install(dst, self.tr.adapters[slot], st.export(slot).weights)
        return dst

    def _slot(self, w: Work) -> int:
        rec = self.store.model(w.model_id, w.owner)
        return rec.slot

    # ------------------------------------------------------------------ requests

    def _create_model(self, w: Work) -> tuple:
        p = w.payload
        lora = p.get("lora_config") or {}
        if p.get("base_model") != self.model_name:
            raise InputError(f"base_model {p.get('base_model')!r} is not served here; this "
                             f"server serves {self.model_name!r}")
        targets = [g for g, on in (("attn", lora.get("train_attn", True)),
                                   ("mlp", lora.get("train_mlp", True)),
                                   ("unembed", lora.get("train_unembed", True))) if on]
        if not targets:
            raise InputError("at least one of train_attn, train_mlp, train_unembed must be true")
        self._free_slot("create a model")
        slot = self.tr.create_adapter(rank=lora.get("rank", 32), alpha=LORA_ALPHA,
                                      seed=lora.get("seed"), targets=targets)
        self.store.add_model(ModelRecord(w.model_id, w.owner, self.model_name,
                                         self.tr.adapters[slot].rank, slot))
        return ("json", {"model_id": w.model_id, "type": "create_model"})

    def _fwd(self, group: list[Work]) -> None:
        """One fused Trainer call; on refusal, each request alone."""
        self.sched.note_pass(group)
        try:
            outs = self._run_fwd(group)
        except Exception as e:  # noqa: BLE001
            if len(group) == 1:
                self._complete(group[0].request_id, _error(e))
                return
            for w in group:
                try:
                    self.sched.note_pass([w])
                    out = self._run_fwd([w])[0]
                except Exception as e1:  # noqa: BLE001
                    out = _error(e1)
                self._complete(w.request_id, out)
            return
        for w, out in zip(group, outs):
            self._complete(w.request_id, out)

    def _run_fwd(self, group: list[Work]) -> list[tuple]:
        data, adapters, losses, configs, spans = [], [], [], {}, []
        for w in group:
            req: wire.FwdBwdRequest = w.payload
            if req.loss_fn in REFUSED_LOSSES:
                raise InputError(REFUSED_LOSSES[req.loss_fn])
            slot = self._slot(w)
            start = len(data)
            for tokens, inputs in req.data:
                data.append(jcp.Datum(model_input=tokens, loss_fn_inputs=inputs))
                adapters.append(slot)
                losses.append(req.loss_fn)
            configs[req.loss_fn] = req.loss_fn_config
            spans.append((start, len(data)))
        if not data:
            raise InputError("forward_backward needs at least one datum")
        if len(configs) == 1:
            config = next(iter(configs.values()))
            loss_fn = losses[0]
        else:
            config = {k: v for k, v in configs.items() if v}
            loss_fn = losses
        run = self.tr.forward if group[0].kind == "forward" else self.tr.forward_backward
        out = run(data, loss_fn=loss_fn, loss_fn_config=config or None, adapters=adapters)
        results = []
        for a, b in spans:
            per = out.loss_fn_outputs[a:b]
            metrics = {"loss:sum": float(sum(np.float64(d["loss:sum"]) for d in per))}
            if len(group) == 1:
                metrics = {k: float(v) for k, v in out.metrics.items()}
            body = wire.encode_forward_backward_output(
                [{"logprobs": d["logprobs"]} for d in per], metrics)
            results.append(("proto", body))
        return results

    def _optim_step(self, w: Work) -> tuple:
        p = w.payload.get("adam_params") or w.payload.get("optim_params")
        if not isinstance(p, dict) or (p.get("type") not in (None, "adam")):
            raise InputError("optim_step: only adam_params are supported")
        fields = ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")
        adam = jcp.AdamParams(**{k: p[k] for k in fields if k in p})
        metrics = self.tr.optim_step(self._slot(w), adam)
        return ("json", {"metrics": {k: float(v) for k, v in metrics.items()
                                     if isinstance(v, (int, float))}})

    def _save_weights(self, w: Work) -> tuple:
        path, folder = self.store.new_path(w.model_id, "weights", w.payload.get("path"))
        self.tr.save_state(self._slot(w), folder)
        return ("json", {"path": path, "type": "save_weights"})

    def _load_weights(self, w: Work) -> tuple:
        p = w.payload
        folder, base = self.store.resolve(p.get("path"), w.owner, "weights")
        with_opt = bool(p.get("optimizer"))
        if p.get("session_id") is not None:  # a new model, created by the load
            self._free_slot("load a checkpoint into a new model")
            slot = self.tr.load_state(folder, None, with_optimizer=with_opt)
            self.store.add_model(ModelRecord(w.model_id, w.owner, self.model_name,
                                             self.tr.adapters[slot].rank, slot))
        else:
            self.tr.load_state(folder, self._slot(w), with_optimizer=with_opt)
        return ("json", {"path": p.get("path"), "model_id": w.model_id, "type": "load_weights"})

    def _save_weights_for_sampler(self, w: Work) -> tuple:
        name = w.payload.get("path")
        path, folder = self.store.new_path(w.model_id, "sampler_weights", name)
        out = {"path": path, "type": "save_weights_for_sampler"}
        if name is None:  # an in-memory snapshot of the slot
            self._sampler_slots[path] = self._snapshot(self._slot(w))
            out["sampling_session_id"] = self.store.add_sampler(w.owner, self.model_name, path,
                                                                None)
            return ("json", out)
        self.tr.export_peft(self._slot(w), folder)
        old = self._sampler_slots.pop(folder, None)
        if old is not None:  # an older save under this name: samplers load the new one
            self._retired.add(old)
        return ("json", out)

    def _unload_model(self, w: Work) -> tuple:
        rec = self.store.model(w.model_id, w.owner)
        self.tr.delete_adapter(rec.slot)
        self.store.drop_model(w.model_id)
        self.sched.forget(w.model_id)
        return ("json", {"model_id": w.model_id, "type": "unload_model"})

    def _sampler_adapter(self, rec) -> int | None:
        """The slot a sampling session reads (None: the base model)."""
        if rec.model_path is None:
            return None
        key = rec.folder if rec.folder is not None else rec.model_path
        slot = self._sampler_slots.get(key)
        if slot is None:
            if rec.folder is None:
                raise InputError(f"the in-memory sampler weights {rec.model_path} were freed "
                                 "to make room; save_weights_for_sampler again")
            self._free_slot("load sampler weights")
            slot = self.tr.load_peft(rec.folder)
            self._sampler_slots[key] = slot
        self._sampler_slots.move_to_end(key)
        return slot

    def _admit_sample(self, w: Work) -> None:
        """Admit one asample into the running engine (or run it beside, if too long)."""
        try:
            rec = self.store.sampler(w.payload["sampling_session_id"], w.owner)
            args: wire.SampleArgs = w.payload["args"]
            adapter = self._sampler_adapter(rec)
            sp = jcp.SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                    top_k=args.top_k, top_p=args.top_p, stop=args.stop,
                                    seed=args.seed)
            if len(args.prompt) - 1 + args.max_tokens > self.sampling.max_len:
                res = self.tr.sample([args.prompt], sp, adapters=adapter,
                                     num_samples=args.num_samples,
                                     prompt_logprobs=args.prompt_logprobs)[0]
                self._complete(w.request_id, _encode_sample(res))
                return

            def done(rid, outcome, request_id=w.request_id):
                self._complete(request_id, _error(outcome) if isinstance(outcome, Exception)
                               else _encode_sample(outcome))

            self.sampling.submit(args.prompt, sp, adapter, args.num_samples,
                                 args.prompt_logprobs, callback=done)
        except Exception as e:  # noqa: BLE001
            self._complete(w.request_id, _error(e))


def _encode_sample(res) -> tuple:
    return ("proto", wire.encode_sample_response(res.sequences, res.prompt_logprobs))


def _error(e: Exception) -> tuple:
    if isinstance(e, (InputError, wire.WireError, NotFound, ValueError)):
        return ("error", str(e), "user")
    log.error("request failed: %s", "".join(traceback.format_exception(e)))
    return ("error", f"{type(e).__name__}: {e}", "server")
