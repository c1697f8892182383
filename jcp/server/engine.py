"""The worker: the one thread that owns the Trainer and runs the scheduler's passes.

Owns every Trainer call, the map from models / sampler folders to adapter slots, and the
sessions' custom losses (create_custom_loss: the uploaded graph rebuilt as a
jcp.CustomLoss, kept per session; a custom forward_backward runs as its own Trainer call). A
fused pass is one Trainer.forward / forward_backward over the datums of all its requests
(adapters per datum); if that call refuses the batch (InputError: nothing was changed), each
request is rerun alone so that only the bad one fails. Results go back through `complete`,
as ("proto", bytes) / ("json", dict) / ("error", message, category). This is the owner
side of the server: the HTTP modules never import it or jax.
"""

from __future__ import annotations

import logging
import threading
import traceback
import uuid
from collections import OrderedDict

import numpy as np

import jcp
from jcp.errors import InputError
from jcp.server import wire
from jcp.server.scheduler import Scheduler, Work
from jcp.server.state import ModelRecord, NotFound, StateStore

log = logging.getLogger("jcp.serve")

# Tinker does not expose alpha; its LoRA uses a fixed alpha of 32.
LORA_ALPHA = 32.0
REFUSED_LOSSES = {
    "stable_reinforce": "stable_reinforce needs sampling-time stability records, which this "
                        "server does not keep",
}
# Custom losses a session may hold (create_custom_loss), and in all.
MAX_CUSTOM_LOSSES_PER_SESSION = 64
MAX_CUSTOM_LOSSES = 4096


class Engine:
    def __init__(self, trainer, store: StateStore, scheduler: Scheduler, model_name: str,
                 complete, tokenizer_id: str | None = None):
        self.tr, self.store, self.sched = trainer, store, scheduler
        self.model_name, self.tokenizer_id = model_name, tokenizer_id
        self.token_cap = int(trainer.token_cap)
        self.max_rank = int(trainer.max_rank)
        self._complete = complete
        self._sampler_slots: OrderedDict[str, int] = OrderedDict()  # PEFT folder -> slot
        # loss_id -> (owner, session id, jcp.custom_loss.CustomLoss), oldest first.
        self._custom_losses: OrderedDict[str, tuple] = OrderedDict()
        self._thread = threading.Thread(target=self._loop, name="jcp-serve-worker", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.sched.close()
        self._thread.join(timeout=60)

    # ------------------------------------------------------------------ loop

    def _loop(self) -> None:
        while (group := self.sched.next_pass()) is not None:
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

    def _free_slot(self, why: str) -> None:
        """Make room by dropping cached sampler weights (never a training model)."""
        if len(self.tr.adapters) < self.tr.max_adapters:
            return
        if not self._sampler_slots:
            raise InputError(f"all {self.tr.max_adapters} adapter slots hold training models; "
                             f"cannot {why} (unload a model or raise --max-adapters)")
        _, slot = self._sampler_slots.popitem(last=False)
        self.tr.delete_adapter(slot)

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

    def _create_custom_loss(self, w: Work) -> tuple:
        """Rebuild an uploaded CustomLossGraph from jcp's allowed operations (InputError
        naming the node otherwise) and keep it for the session -> {loss_id}."""
        p = w.payload
        session = p.get("session_id")
        loss = jcp.CustomLoss.from_graph(p.get("graph"), p.get("inputs"),
                                         str(p.get("name") or "custom"))
        mine = [k for k, (_, s, _) in self._custom_losses.items() if s == session]
        if len(mine) >= MAX_CUSTOM_LOSSES_PER_SESSION:
            raise InputError(f"this session already holds {len(mine)} custom losses (at most "
                             f"{MAX_CUSTOM_LOSSES_PER_SESSION})")
        while len(self._custom_losses) >= MAX_CUSTOM_LOSSES:
            self._custom_losses.popitem(last=False)
        loss_id = f"loss-{uuid.uuid4().hex}"
        self._custom_losses[loss_id] = (w.owner, session, loss)
        return ("json", {"loss_id": loss_id, "type": "create_custom_loss"})

    def custom_loss_ids(self) -> list[str]:
        """The loss_ids of every session's custom losses, oldest first."""
        return list(self._custom_losses)

    def _custom_loss(self, w: Work, config) -> "jcp.CustomLoss":
        """The custom loss a forward_backward names, if its model's session created it."""
        loss_id = (config or {}).get("loss_id")
        entry = self._custom_losses.get(loss_id) if isinstance(loss_id, str) else None
        session = w.model_id.rsplit(":train:", 1)[0] if w.model_id else None
        if entry is None or entry[0] != w.owner or entry[1] != session:
            raise InputError(f"custom loss {loss_id!r} not found in this model's session "
                             "(create it with create_custom_loss in the same session)")
        return entry[2]

    def _fwd(self, group: list[Work]) -> None:
        """One fused Trainer call; on refusal, each request alone."""
        if len(group) > 1 and any(w.payload.loss_fn == "custom" for w in group):
            for w in group:  # a custom loss's metrics are per request: one call each
                self._fwd([w])
            return
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
        if losses[0] == "custom":  # _fwd runs a custom request alone
            loss_fn, config = self._custom_loss(group[0], configs["custom"]), None
            data = [_custom_datum(d, loss_fn) for d in data]
        elif len(configs) == 1:
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
        self.tr.export_peft(self._slot(w), folder)
        out = {"path": path, "type": "save_weights_for_sampler"}
        if name is None:
            out["sampling_session_id"] = self.store.add_sampler(w.owner, self.model_name, path,
                                                                folder)
        return ("json", out)

    def _unload_model(self, w: Work) -> tuple:
        rec = self.store.model(w.model_id, w.owner)
        self.tr.delete_adapter(rec.slot)
        self.store.drop_model(w.model_id)
        self.sched.forget(w.model_id)
        return ("json", {"model_id": w.model_id, "type": "unload_model"})

    def _sample(self, w: Work) -> tuple:
        rec = self.store.sampler(w.payload["sampling_session_id"], w.owner)
        args: wire.SampleArgs = w.payload["args"]
        adapter = None
        if rec.folder is not None:
            adapter = self._sampler_slots.get(rec.folder)
            if adapter is None:
                self._free_slot("load sampler weights")
                adapter = self.tr.load_peft(rec.folder)
                self._sampler_slots[rec.folder] = adapter
            self._sampler_slots.move_to_end(rec.folder)
        sp = jcp.SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_k=args.top_k, top_p=args.top_p, stop=args.stop,
                                seed=args.seed)
        res = self.tr.sample([args.prompt], sp, adapters=adapter, num_samples=args.num_samples,
                             prompt_logprobs=args.prompt_logprobs)[0]
        return ("proto", wire.encode_sample_response(res.sequences, res.prompt_logprobs))


def _custom_datum(d: "jcp.Datum", loss: "jcp.CustomLoss") -> "jcp.Datum":
    """The wire has no shape for a scalar: an input the loss declares rank 0 arrives as
    one value [1]; make it the scalar."""
    inputs = dict(d.loss_fn_inputs)
    for name, rank in loss.inputs[1:]:
        v = inputs.get(name)
        if rank == 0 and isinstance(v, np.ndarray) and v.shape == (1,):
            inputs[name] = v.reshape(())
    return jcp.Datum(model_input=d.model_input, loss_fn_inputs=inputs)


def _error(e: Exception) -> tuple:
    if isinstance(e, (InputError, wire.WireError, NotFound, ValueError)):
        return ("error", str(e), "user")
    log.error("request failed: %s", "".join(traceback.format_exception(e)))
    return ("error", f"{type(e).__name__}: {e}", "server")
