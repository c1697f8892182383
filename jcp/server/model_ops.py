"""The worker's model operations: one handler per request kind that is not a pass or a sample.

Owns create_model, session ends (their models unloaded once idle, expired sessions and
checkpoints swept: `_reap`), load / save / export / copy / delete of checkpoints, sampler weights
(in-memory snapshots and named saves), optim_step, unload_model and the sessions' custom
losses (create_custom_loss: the uploaded graph rebuilt as a jcp.CustomLoss, kept per
session). `ModelOps` is one part of `jcp.server.worker.Worker`: each handler takes one
Work and returns its result (("json", dict), ...) or raises; the Worker's handler table
names them. Slots come from `jcp.server.slots.SlotCache`.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
import uuid
from collections import OrderedDict

import pyrage

import jcp
from jcp.errors import InputError
from jcp.server.scheduler import Work
from jcp.server.state import ModelRecord, age_recipients

log = logging.getLogger("jcp.serve")

# Tinker does not expose alpha; its LoRA uses a fixed alpha of 32.
LORA_ALPHA = 32.0
# Custom losses a session and a tenant may hold (create_custom_loss). A tenant at its cap
# is refused (4xx) until its sessions end: no handle is ever evicted, so a loss_id a client
# holds stays valid for its session's life, and one tenant's creates never touch another's.
MAX_CUSTOM_LOSSES_PER_SESSION = 64
MAX_CUSTOM_LOSSES_PER_TENANT = 256
# How often the worker looks for checkpoints whose TTL has passed.
EXPIRY_SCAN_S = 5.0


class ModelOps:
    """The Worker's handlers of model operations (each on the worker thread, in order)."""

    def _init_model_ops(self) -> None:
        # loss_id -> (owner, session id, jcp.custom_loss.CustomLoss), oldest first.
        self._custom_losses: OrderedDict[str, tuple] = OrderedDict()
        self._closing: set[str] = set()  # models of ended sessions, unloaded when idle
        self._next_expiry_scan = 0.0

    def _create_model(self, w: Work) -> tuple:
        p = w.payload
        lora = p.get("lora_config") or {}
        if p.get("base_model") != self.model_name:
            raise InputError(
                f"base_model {p.get('base_model')!r} is not served here; this "
                f"server serves {self.model_name!r}"
            )
        flags = {k: bool(lora.get(k, True)) for k in ("train_attn", "train_mlp", "train_unembed")}
        # train_mlp means the experts on a MoE model, as Tinker trains them.
        mlp = "experts" if self.tr.cfg.is_moe else "mlp"
        # train_attn covers both mixers of a hybrid (Qwen3.5) model: the full-attention
        # projections and Gated DeltaNet's (lora.LINEAR).
        attn = ("attn", "linear_attn") if self.tr.cfg.is_hybrid else ("attn",)
        targets = [
            g
            for gs, k in (
                (attn, "train_attn"),
                ((mlp,), "train_mlp"),
                (("unembed",), "train_unembed"),
            )
            if flags[k]
            for g in gs
        ]
        if not targets:
            raise InputError("at least one of train_attn, train_mlp, train_unembed must be true")
        self._check_new_model(w)
        self._free_slot("create a model", rank=lora.get("rank", 32))
        slot = self.tr.create_adapter(
            rank=lora.get("rank", 32), alpha=LORA_ALPHA, seed=lora.get("seed"), targets=targets
        )
        self._register(w, slot, {**flags, "user_metadata": p.get("user_metadata")})
        return ("json", {"model_id": w.model_id, "type": "create_model"})

    def _check_new_model(self, w: Work) -> None:
        if w.model_id in self.store.models:
            raise InputError(
                f"model {w.model_id!r} already exists (its model_seq_id is "
                "already used in this session)"
            )

    def _register(self, w: Work, slot: int, run_info: dict) -> None:
        """Record a model just put in `slot`; if that fails, free the slot (a create that
        fails leaves no trace)."""
        sid = w.model_id.split(":train:")[0]
        try:
            self.store.add_model(
                ModelRecord(
                    w.model_id, w.owner, self.model_name, self.tr.adapters[slot].rank, slot, sid
                ),
                run_info,
            )
        except BaseException:
            self.tr.delete_adapter(slot)
            raise
        self._adopt(w.model_id, slot)

    def _refused(self, w: Work) -> tuple:
        """A request refused at the edge, answered in its model's seq_id order."""
        raise InputError(w.payload)

    def _create_custom_loss(self, w: Work) -> tuple:
        """Rebuild an uploaded CustomLossGraph from jcp's allowed operations (InputError
        naming the node otherwise) and keep it for the session -> {loss_id}."""
        p = w.payload
        session = p.get("session_id")
        held = [s for owner, s, _ in self._custom_losses.values() if owner == w.owner]
        if held.count(session) >= MAX_CUSTOM_LOSSES_PER_SESSION:
            raise InputError(
                f"this session already holds {held.count(session)} custom losses "
                f"(at most {MAX_CUSTOM_LOSSES_PER_SESSION})"
            )
        if len(held) >= MAX_CUSTOM_LOSSES_PER_TENANT:
            raise InputError(
                f"your sessions already hold {len(held)} custom losses (at most "
                f"{MAX_CUSTOM_LOSSES_PER_TENANT}); a session's are released when "
                "it ends"
            )
        loss = jcp.CustomLoss.from_graph(
            p.get("graph"), p.get("inputs"), str(p.get("name") or "custom")
        )
        loss_id = f"loss-{uuid.uuid4().hex}"
        if self.leader is not None:  # the followers rebuild it from the same graph
            self.leader.share(
                loss, "custom_loss", p.get("graph"), p.get("inputs"), str(p.get("name") or "custom")
            )
        self._custom_losses[loss_id] = (w.owner, session, loss)
        return ("json", {"loss_id": loss_id, "type": "create_custom_loss"})

    def _forget_loss(self, loss_id: str) -> None:
        loss = self._custom_losses.pop(loss_id)[2]
        if self.leader is not None:
            self.leader.discard(loss)

    def custom_loss_ids(self, owner: str | None = None) -> list[str]:
        """The loss_ids of every session's custom losses (or `owner`'s), oldest first."""
        return [k for k, (o, _, _) in self._custom_losses.items() if owner in (None, o)]

    def _custom_loss(self, w: Work, config) -> jcp.CustomLoss:
        """The custom loss a forward_backward names, if its model's session created it."""
        loss_id = (config or {}).get("loss_id")
        entry = self._custom_losses.get(loss_id) if isinstance(loss_id, str) else None
        session = w.model_id.rsplit(":train:", 1)[0] if w.model_id else None
        if entry is None or entry[0] != w.owner or entry[1] != session:
            raise InputError(
                f"custom loss {loss_id!r} not found in this model's session "
                "(create it with create_custom_loss in the same session)"
            )
        return entry[2]

    def _optim_step(self, w: Work) -> tuple:
        p = w.payload.get("adam_params") or w.payload.get("optim_params")
        if not isinstance(p, dict) or (p.get("type") not in (None, "adam")):
            raise InputError("optim_step: only adam_params are supported")
        fields = ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")
        adam = jcp.AdamParams(**{k: p[k] for k in fields if k in p})
        m = self.tr.optim_step(self._slot(w), adam)
        # Client loops merge these into their own log rows (the cookbook's
        # `metrics.update(optim_result.metrics)`), so no key may be one they log themselves
        # (`step`, `learning_rate`): Tinker-style `name:reduction` keys only.
        return (
            "json",
            {
                "metrics": {
                    "grad_norm:mean": float(m["grad_norm"]),
                    "adam_step:max": float(m["step"]),
                }
            },
        )

    def _save_weights(self, w: Work) -> tuple:
        with self._saving(w, w.model_id, "weights", w.payload.get("path")) as (path, folder):
            self.tr.save_state(self._slot(w), folder)
        old = self._sampler_slots.pop(folder, None)  # an OpenAI route sampled the old save
        self._sampler_owner.pop(folder, None)
        if old is not None:
            self._retired.add(old)
        return ("json", {"path": path, "type": "save_weights"})

    def _saving(self, w: Work, run: str, kind: str, name, **kw):
        """store.saving with the request's TTL and user metadata: the checkpoint is
        recorded only once written, and a failed save leaves no new folder."""
        p = w.payload
        return self.store.saving(
            w.owner, run, kind, name, p.get("ttl_seconds"), p.get("user_metadata"), **kw
        )

    def _save_weights_external(self, w: Work) -> tuple:
        """The adapter as a PEFT folder for download (GET …/external_weights_urls); with
        age_encryption_recipients every file is age-encrypted to them (`<file>.age`)."""
        p = w.payload
        with self._saving(w, w.model_id, "external_weights", p.get("path")) as (path, folder):
            tmp = f"{folder}.tmp-{uuid.uuid4().hex[:8]}"
            try:
                self.tr.export_peft(self._slot(w), tmp)
                if p.get("age_encryption_recipients"):
                    recipients = age_recipients(p["age_encryption_recipients"])
                    for name in os.listdir(tmp):
                        f = os.path.join(tmp, name)
                        with open(f, "rb") as src:
                            data = pyrage.encrypt(src.read(), recipients)
                        with open(f + ".age", "wb") as dst:
                            dst.write(data)
                        os.remove(f)
                if os.path.isdir(folder):
                    shutil.rmtree(folder)
                os.replace(tmp, folder)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        size = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))
        return ("json", {"path": path, "size_bytes": size, "type": "save_weights_external"})

    def _delete_checkpoint(self, w: Work) -> tuple:
        self._delete_folder(w.payload["folder"])
        return ("json", {})

    def _delete_folder(self, folder: str) -> None:
        slot = self._sampler_slots.pop(folder, None)
        self._sampler_owner.pop(folder, None)
        if slot is not None:
            self.tr.delete_adapter(slot)
        self.store.delete_folder(folder)

    def _copy_weights(self, w: Work) -> tuple:
        """A checkpoint into a new run of the same owner (files hard-linked, not copied)."""
        p = w.payload
        src, kind, run_info = p["folder"], p["kind"], p["run_info"]
        dest_run = p["dest_run"]
        with self._saving(
            w,
            dest_run,
            kind,
            os.path.basename(src),
            new_run={"base_model": self.model_name, **run_info},
        ) as (path, folder):
            shutil.copytree(src, folder, copy_function=os.link, dirs_exist_ok=True)
        return ("json", {"tinker_path": path})

    def _load_weights(self, w: Work) -> tuple:
        p = w.payload
        folder, base = self.store.resolve(p.get("path"), w.owner, "weights")
        with_opt = p["optimizer"]  # a strict bool (edge.LoadWeights)
        if p.get("session_id") is not None:  # a new model, created by the load
            self._check_new_model(w)
            self._free_slot("load a checkpoint into a new model")
            slot = self.tr.load_state(folder, None, with_optimizer=with_opt)
            info = self.store.run_info(p.get("path"), w.owner)
            if p.get("user_metadata") is not None:  # the new run's own, else its source's
                info["user_metadata"] = p["user_metadata"]
            self._register(w, slot, info)
        else:
            rec = self.store.model(w.model_id, w.owner)
            slot = self.tr.load_state(folder, self._slot(w), with_optimizer=with_opt)
            # The checkpoint's rank replaces the model's: get_info must say so.
            rec.rank = self.tr.adapters[slot].rank
        return ("json", {"path": p.get("path"), "model_id": w.model_id, "type": "load_weights"})

    def _save_weights_for_sampler(self, w: Work) -> tuple:
        name = w.payload.get("path")
        path, folder = self.store.new_path(w.model_id, "sampler_weights", name)
        out = {"path": path, "type": "save_weights_for_sampler"}
        if name is None:  # an in-memory snapshot of the slot
            self._sampler_slots[path] = self._snapshot(self._slot(w))
            self._sampler_owner[path] = w.owner
            out["sampling_session_id"] = self.store.add_sampler(
                w.owner, self.model_name, path, None
            )
            return ("json", out)
        with self._saving(w, w.model_id, "sampler_weights", name):
            self.tr.export_peft(self._slot(w), folder)
        old = self._sampler_slots.pop(folder, None)
        self._sampler_owner.pop(folder, None)
        if old is not None:  # an older save under this name: samplers load the new one
            self._retired.add(old)
        return ("json", out)

    def _unload_model(self, w: Work) -> tuple:
        self.store.model(w.model_id, w.owner)
        self._drop(w.model_id)
        return ("json", {"model_id": w.model_id, "type": "unload_model"})

    # ------------------------------------------------------------ session lifecycle

    def _end_session(self, w: Work) -> tuple:
        self._session_ended(w.payload["session_id"])
        return ("json", {})

    def _session_ended(self, sid: str) -> None:
        """A finished or expired session: its models unload once idle (`_reap`) and its
        custom losses are forgotten."""
        self._closing.update(self.store.end_session(sid))
        for loss_id in [k for k, (_, s, _) in self._custom_losses.items() if s == sid]:
            self._forget_loss(loss_id)

    def _reap(self) -> None:
        """Unload the models of ended sessions whose queued work is done; end sessions
        whose heartbeats stopped."""
        for sid in self.store.expired_sessions(self.session_timeout_s):
            log.info("session %s expired (no heartbeat for %.0f s)", sid, self.session_timeout_s)
            self._session_ended(sid)
        for mid in sorted(self._closing):
            if self.sched.pending_for(mid):
                continue
            self._closing.discard(mid)
            self._drop(mid)
        if time.monotonic() >= self._next_expiry_scan:
            self._next_expiry_scan = time.monotonic() + EXPIRY_SCAN_S
            for folder in self.store.expired_folders():
                log.info("checkpoint %s expired (TTL)", folder)
                self._delete_folder(folder)
