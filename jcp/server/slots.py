"""The worker's adapter-slot cache: which models and sampler weights hold the Trainer's slots.

Owns the map from training models (resident in a slot, or offloaded to host memory) and
sampler weights (in-memory snapshots, loaded named saves) to adapter slots, eviction when a
slot is needed and none is free, offload / restore, and the slots retired until no running
sequence reads them. `SlotCache` is one part of `jcp.server.worker.Worker` (which owns the
state it reads: `tr`, `store`, `sched`, `sampling`, `leader`, `splits`); it never runs
a request itself.
"""

from __future__ import annotations

import os
from collections import Counter, OrderedDict

import numpy as np

from jcp import lora as lora_lib
from jcp.errors import InputError
from jcp.server.scheduler import Work
from jcp.server.state import NotFound


class SlotCache:
    """Adapter slots as a cache (the Worker's slot bookkeeping).

    A training model is resident (in a slot) or offloaded (its whole state — weights,
    accumulated gradient, AdamW moments, step count — in host memory,
    Trainer.offload_adapter), and restored, bit for bit, on its next request. So
    `--max-adapters` bounds resident slots, `--adapter-memory` the device memory they
    take (a slot costs what its rank costs: jcp/adapter_state.py), and
    `max_offload_bytes` the host memory of offloaded models. A model lives as long as its session: a finished or expired
    session's models are unloaded once their queued work is done (checkpoints stay).

    Eviction: when a slot is needed and none is free, or its rank's pages are not, the
    first of these leaves its slot (and the next, until the new one fits) —
    by class, and within a class the tenant holding the most slots first (so a tenant
    evicts another's only while that one holds at least as many), least recently used
    first: (0) named sampler weights no running sequence reads (reloaded from their
    folder when next used); (1) idle training models (nothing queued) outside the current
    pass, offloaded; (2) other training models outside the pass, offloaded; (3) in-memory
    sampler snapshots no running sequence reads and no sampling session names; (4)
    snapshots a sampling session names (their sampler then fails and asks for a new
    save). A model is offloaded only if host memory has room for it, counting the room a
    restore frees: a restore swaps the model with its victim, so it is never refused for
    room when a victim of no more bytes (rank, targets) holds a slot outside the pass.
    """

    def _init_slots(self) -> None:
        # tinker path (snapshots) or PEFT folder (named saves) -> slot, least recent first.
        self._sampler_slots: OrderedDict[str, int] = OrderedDict()
        self._sampler_owner: dict[str, str] = {}  # the same keys -> the tenant they serve
        self._retired: set[int] = set()  # sampler slots to free once no sequence reads them
        self._resident: OrderedDict[str, int] = OrderedDict()  # model id -> slot, LRU first
        self._offloaded: dict[str, object] = {}  # model id -> HostSlot
        self.offloads = self.restores = 0

    def _in_use(self) -> set[int]:
        """Slots some queued or running sequence of the sampling engine reads."""
        return {r.adapter for r in self.sampling.requests.values()}

    def _free_slot(
        self,
        why: str,
        keep: frozenset = frozenset(),
        restoring: str | None = None,
        rank: int | None = None,
    ) -> None:
        """Make room for one adapter of `rank` (None: max_rank, for weights whose rank is
        read later) — a free slot and its pages of adapter memory (AdapterState.room):
        evict the first of `_victims` (SlotCache docstring, "Eviction") that host memory
        admits, and the next, until it fits. restoring: the offloaded model the room is
        for; its host copy goes when it is restored, so offloading a victim into that room
        is a swap, never refused for lack of room."""
        self._sweep_retired()
        rank = self.tr.max_rank if rank is None else rank
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 < rank <= self.tr.max_rank:
            return  # the create refuses it, with its own message; nothing is evicted for it
        if self.tr.state.room(rank):
            return
        # The models of passes running over turns stay in their slots.
        keep = keep | {w.model_id for g, _, _ in self.splits.values() for w in g}
        used = self.offloaded_bytes()
        if restoring is not None:
            used -= self._offloaded[restoring].nbytes
        full = False
        for kind, key in self._victims(keep):
            if kind == "model":
                nbytes = self._nbytes(self.tr.adapters[self._resident[key]])
                if used + nbytes > self.max_offload_bytes:
                    full = True
                    continue
                slot = self._resident.pop(key)
                self._offloaded[key] = self.tr.offload_adapter(slot)
                used += nbytes
                self.offloads += 1
                self._set_slot(key, None)
            else:
                self._sampler_owner.pop(key, None)
                self.tr.delete_adapter(self._sampler_slots.pop(key))
            if self.tr.state.room(rank):
                return
        if full:
            raise InputError(
                f"cannot {why}: adapter slots and memory are in use and host memory "
                f"for offloaded models is full ({used} of "
                f"{self.max_offload_bytes} bytes, --max-offload-gb); finish "
                "sessions you no longer need"
            )
        st = self.tr.state
        raise InputError(
            f"no room for an adapter of rank {rank}: {len(st.infos)} of {st.max_adapters} "
            f"adapter slots and {st.num_pages - st.free_pages} of {st.num_pages} pages of "
            "adapter memory are held by this pass or by running samples; cannot "
            f"{why} (raise --max-adapters or --adapter-memory)"
        )

    def _pass_room(self):
        """Scheduler.pass_room: admit(model_id) while the models of one pass fit on the
        device together — in the slots and pages of adapter memory beside those that
        cannot leave (sampler weights running sequences read, the models of passes
        running over turns)."""
        st = self.tr.state
        split = {w.model_id for g, _, _ in self.splits.values() for w in g}
        pinned = (self._in_use() | {self._resident.get(m) for m in split}) & set(st.infos)
        room = {
            "pages": st.num_pages - sum(st.pages_for(st.infos[s].rank) for s in pinned),
            "slots": st.max_adapters - len(pinned),
        }

        def admit(model_id: str) -> bool:
            rec = self.store.models.get(model_id)
            need = st.pages_for(rec.rank) if rec is not None else 1
            if need > room["pages"] or room["slots"] < 1:
                return False
            room["pages"] -= need
            room["slots"] -= 1
            return True

        return admit

    def offloaded_bytes(self) -> int:
        """Host memory the offloaded models hold (at most max_offload_bytes)."""
        return sum(h.nbytes for h in list(self._offloaded.values()))

    def _victims(self, keep: frozenset) -> list[tuple[str, str]]:
        """What may leave its slot, in eviction order (SlotCache docstring, "Eviction"):
        ("sampler", key) for sampler weights no running sequence reads, ("model", id) for
        training models not in `keep`; by class, then the tenant holding the most slots
        first, then least recently used first."""
        busy = self._in_use()
        owner = {
            ("model", m): getattr(self.store.models.get(m), "owner", None) for m in self._resident
        }
        owner.update({("sampler", k): self._sampler_owner.get(k) for k in self._sampler_slots})
        held = Counter(owner.values())
        named = {r.model_path for r in list(self.store.samplers.values())}

        def order(item: tuple[str, str]) -> tuple[int, int]:
            kind, key = item
            if kind == "model":
                rank = 2 if self.sched.pending_for(key) else 1
            elif not key.startswith("tinker://"):  # named weights: reloaded from the folder
                rank = 0
            else:  # an in-memory snapshot: gone for good once freed
                rank = 4 if key in named else 3
            return rank, -held[owner[item]]

        # Both tables are least recently used first, and sorted() keeps that order.
        return sorted(
            [("model", m) for m in self._resident if m not in keep]
            + [("sampler", k) for k, s in self._sampler_slots.items() if s not in busy],
            key=order,
        )

    def _sweep_retired(self) -> None:
        if self._retired:
            for slot in self._retired - self._in_use():
                self.tr.delete_adapter(slot)
                self._retired.discard(slot)

    def _snapshot(self, slot: int) -> int:
        """A device copy of `slot` in a free slot (no disk) -> the copy's slot."""
        self._free_slot(
            "snapshot sampler weights",
            frozenset(m for m, s in self._resident.items() if s == slot),
            rank=self.tr.adapters[slot].rank,
        )
        return self.tr.copy_adapter(slot)

    def _nbytes(self, info) -> int:
        """Host bytes of an offloaded adapter (4 float32 trees at its rank)."""
        shapes = lora_lib.adapter_shapes(self.tr.cfg, info.rank, info.targets, info.expert_lora)
        return 16 * sum(int(np.prod(sh)) for ks in shapes.values() for sh in ks.values())

    def _set_slot(self, model_id: str, slot: int | None) -> None:
        rec = self.store.models.get(model_id)
        if rec is not None:
            rec.slot = slot

    def _slot(self, w: Work, keep: frozenset = frozenset()) -> int:
        """The model's slot, restoring it from host memory if it was offloaded."""
        self.store.model(w.model_id, w.owner)
        mid = w.model_id
        if mid in self._resident:
            self._resident.move_to_end(mid)
            return self._resident[mid]
        saved = self._offloaded.get(mid)
        if saved is None:
            raise NotFound(f"model {mid!r} not found")
        self._free_slot(
            "restore an offloaded model", keep | {mid}, restoring=mid, rank=saved.info.rank
        )
        slot = self.tr.restore_adapter(saved)
        del self._offloaded[mid]
        self.restores += 1
        self._adopt(mid, slot)
        return slot

    def _adopt(self, model_id: str, slot: int) -> None:
        self._resident[model_id] = slot
        self._resident.move_to_end(model_id)
        self._set_slot(model_id, slot)

    def _drop(self, model_id: str) -> None:
        """Forget a model: its slot or host copy, its record, its seq_id history and its
        unnamed sampler weights on disk (named checkpoints stay)."""
        slot = self._resident.pop(model_id, None)
        if slot is not None:
            self.tr.delete_adapter(slot)
        saved = self._offloaded.pop(model_id, None)
        if saved is not None and self.leader is not None:
            self.leader.discard(saved)  # the followers' host copies too
        snapshots = [k for k in self._sampler_slots if k.startswith(f"tinker://{model_id}/")]
        for key in snapshots + self.store.drop_model(model_id):
            s = self._sampler_slots.pop(key, None)
            self._sampler_owner.pop(key, None)
            if s is not None:  # freed once no running sequence reads it
                self._retired.add(s)
        self._sweep_retired()
        self.sched.forget(model_id)

    def _sampler_adapter(self, rec) -> int | None:
        """The slot a sampling session reads (None: the base model). A training
        checkpoint's folder (…/weights/<name>, named by an OpenAI route) loads its weights
        only, and is cached like named sampler weights."""
        if rec.model_path is None:
            return None
        key = rec.folder if rec.folder is not None else rec.model_path
        if self._sampler_owner.get(key, rec.owner) != rec.owner:
            raise NotFound(f"model {rec.model_path!r} not found")
        slot = self._sampler_slots.get(key)
        if slot is None:
            if rec.folder is None:
                raise InputError(
                    f"the in-memory sampler weights {rec.model_path} were freed "
                    "to make room; save_weights_for_sampler again"
                )
            self._free_slot("load sampler weights")
            if os.path.basename(os.path.dirname(rec.folder)) == "weights":
                slot = self.tr.load_state(rec.folder, None, with_optimizer=False)
            else:
                slot = self.tr.load_peft(rec.folder)
            self._sampler_slots[key] = slot
            self._sampler_owner[key] = rec.owner
        self._sampler_slots.move_to_end(key)
        return slot
