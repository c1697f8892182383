"""The worker: the one thread that owns the Trainer and runs the scheduler's passes.

Owns every Trainer call, the running sampling engine (jcp.sample.engine.Engine), the map
from models / sampler weights to adapter slots, and the sessions' custom losses
(create_custom_loss: the uploaded graph rebuilt as a jcp.CustomLoss, kept per session; a
custom forward_backward runs as its own Trainer call). Every asample of every tenant is
admitted into the one running engine batch, long ones too: the engine's cache is sized by
its rows per sequence, but a sequence may be as long as the token cap (its prompt
prefilled over steps, its tokens decoded a chunk per step, like any other), so no sample
holds the worker for more than one engine step. Only a sample whose KV cache exceeds a
whole device's pages (Engine.seq_cap) runs beside it, Trainer.sample, its cache split
over cp. Hybrid Qwen3.5 models too go through the engine.

Interleaving policy: each turn of the loop runs at most one training pass (a fused
forward / forward_backward, or one model operation; a pass of several Trainer
micro-batches runs one micro-batch per turn, jcp.trainer.Steps, with the same results,
while the scheduler hands the other tenants' passes out between them: Scheduler,
"Fairness") and then one engine step (at most
`prefill_tokens` of newly admitted prompts, then decode steps of every live sequence:
`chunk` of them while any request is queued and in the first step after a gather —
Engine.step(hurry=True), unless recent bursts came whole (ADMIT_CALM_BURSTS) —, else up
to `max_chunk`, Engine.decode_len; ADMIT_* below for the gathering and its prefill-only
steps, which other work ends once the running one is over). So a training pass queued
while nothing else was waits for at most one engine step of max_chunk decode steps
(during a gather, which it ends: one prefill-only step and one hurried step), and
running sequences wait for at most one training pass (micro-batch) between decode
chunks; neither starves. Samples are admitted round robin over tenants, each within its
share of rows and pages while several sample (Admission.admit_fair; a tenant counts for
TENANT_WINDOW_S after its last sample arrived), and then every step is a short one
(`chunk` decode steps), so one tenant's request waits for one chunk of another's rows.
A sample the client cancels after admission (cancel_future -> Scheduler.cancel_running)
is cancelled in the engine at the start of the next turn and ends at that step
boundary, its slots freed; so does a split pass of one request, its accumulation undone.

Sampler weights: save_weights_for_sampler without a name makes an in-memory snapshot (a
device copy of the model's slot into a free slot, no disk); with a name it writes the PEFT
folder, and a sampler of that folder loads it afresh (a cached load of an older save under
the same name is retired). Snapshot and loaded sampler slots share the slot cache with the
training models (Engine, "Eviction"): loaded named weights go first, snapshots only after
every idle training model (a sampler whose snapshot was freed fails clearly and asks for a
new save).

A fused pass is one Trainer.forward / forward_backward over the datums of all its requests
(adapters per datum); if that call refuses the batch (InputError: nothing was changed), each
request is rerun alone so that only the bad one fails. Results go back through `complete`,
as ("proto", bytes) / ("json", dict) / ("error", message, category). This is the owner
side of the server: the HTTP modules never import it or jax.

In a multi-process job (`leader`, jcp/server/replica.py) this worker runs on process 0 and
its Trainer and sampling engine are proxies: each call on them runs on every process, in
the order made here; everything else here (the store, slots, losses, scheduling) is
decided on process 0 alone.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import threading
import time
import traceback
import uuid
from collections import Counter, OrderedDict

import numpy as np
import pyrage

import jcp
from jcp import lora as lora_lib
from jcp.errors import InputError
from jcp.sample.engine import Engine as SampleEngine
from jcp.server import redact, wire
from jcp.server.scheduler import Scheduler, Work
from jcp.server.state import ModelRecord, NotFound, StateStore, age_recipients

log = logging.getLogger("jcp.serve")

# Samples reaching an idle engine are gathered into one decode batch: a lone sample waits
# ADMIT_GAP_S for company; once a second one has come, a burst is arriving (an RL step's
# prompt groups, sent at once) and the worker takes every sample that comes within
# ADMIT_GAP_SCALE × the largest gap between the burst's arrivals so far (at least
# ADMIT_GAP_S, at most ADMIT_BURST_GAP_S) of the one before, for at most ADMIT_WINDOW_S.
# While it gathers, it admits the arrivals and, on an accelerator, prefills them in
# prefill-only steps (Engine.step(decode=False)) once ADMIT_PREFILL_MIN are waiting (each
# step has a fixed cost), so when the burst ends only the last arrivals' prefill is left
# and the whole batch decodes together. On a CPU host the prefill-only steps take the
# cores from the HTTP thread (and local clients) that are still taking the burst: on 2
# cores they cost the server 0.02–0.17 CPU s more per 128 × 8 × 32 burst than one
# prefill of the whole burst in its first step (benchmarks/engine.py --admission all), so
# there the burst is only gathered (ADMIT_PREFILL None: by platform). Decoding the first
# arrivals while the rest still arrive costs more than it saves on CPU hosts: the later
# ones join a batch whose early rows end first, in a fixed-shape device loop, and the
# mid-burst steps pad to the next rows bucket (benchmarks/engine.py; 128 requests × 8 ×
# 32 admitted 16 + 49 + 63 took 1.2-1.4× the CPU seconds of all at once, 16 + 112
# 1.0-1.1×). The first decode step after a gather is short (Engine.step(hurry=True)), so
# that stragglers — a gap longer than the gather waited, or still arriving at the
# window's end — join one chunk later, not after a whole long step; but once the last
# ADMIT_CALM_BURSTS gathered bursts had no stragglers (no sample joined them while they
# ran), a burst that ended at a quiet gap decodes in one step to its end (prefill +
# max_tokens, one decode call less). Measured (benchmarks/engine.py --admission
# server,hurry): one step saves ~2 % of the engine's CPU seconds of a 128 × 8 × 32 burst
# that came whole, but a burst that split (54 + 74 requests, arrival gaps of 10-30 ms
# under load) and ran each part to its end cost up to 1.5× the decode work of the hurried
# policy (1.40 vs 1.14 XLA CPU s per round, median of 9, load ~8): so one step only where
# bursts have been coming whole (so, against the hurried policy, two runs at load 5-6:
# 1.26 / 1.27 vs 1.30 / 1.33 server CPU s per round, one engine step vs two). ADMIT_HURRY:
# every first step short.
ADMIT_HURRY = False
ADMIT_CALM_BURSTS = 2
ADMIT_GAP_S = 0.01
ADMIT_GAP_SCALE: float | None = 4.0  # None: every later gap is ADMIT_BURST_GAP_S
# False: no prefill-only steps (the burst prefills in its first step); None: on an
# accelerator only.
ADMIT_PREFILL: bool | None = None
ADMIT_PREFILL_MIN = 16  # requests admitted and not yet prefilled that make one worth its cost
ADMIT_BURST_GAP_S = 0.03
ADMIT_WINDOW_S = 0.5
# A tenant shares the sampling engine's rows and pages (Admission.admit_fair) while its
# samples run and for this long after its last one arrived, so that one whose short
# requests come and go keeps its share between them.
TENANT_WINDOW_S = 10.0
# How often the worker looks for checkpoints whose TTL has passed.
EXPIRY_SCAN_S = 5.0
# Tinker does not expose alpha; its LoRA uses a fixed alpha of 32.
LORA_ALPHA = 32.0
# The sampling engine's KV cache: rows per sequence, and at most this many bytes per device.
SAMPLE_ROWS = 256
SAMPLE_SLOTS = 512
SAMPLE_CACHE_BYTES = 1 << 30
REFUSED_LOSSES = {
    "stable_reinforce": "stable_reinforce is not served: its objective is not published (provenance "
    "spans and record_stability_info are accepted and ignored; use "
    "importance_sampling, ppo, cispo, dro or gspo)",
}
# Custom losses a session and a tenant may hold (create_custom_loss). A tenant at its cap
# is refused (4xx) until its sessions end: no handle is ever evicted, so a loss_id a client
# holds stays valid for its session's life, and one tenant's creates never touch another's.
MAX_CUSTOM_LOSSES_PER_SESSION = 64
MAX_CUSTOM_LOSSES_PER_TENANT = 256


class Engine:
    """The worker over `trainer`.

    Adapter slots are a cache: a training model is resident (in a slot) or offloaded (its
    whole state — weights, accumulated gradient, AdamW moments, step count — in host
    memory, Trainer.offload_adapter), and restored, bit for bit, on its next request. So
    `--max-adapters` bounds resident slots, and `max_offload_bytes` bounds the host memory
    of offloaded models. A model lives as long as its session: a finished or expired
    session's models are unloaded once their queued work is done (checkpoints stay).

    Eviction: when a slot is needed and none is free, the first of these leaves its slot —
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

    def __init__(
        self,
        trainer,
        store: StateStore,
        scheduler: Scheduler,
        model_name: str,
        complete,
        tokenizer_id: str | None = None,
        max_offload_bytes: int = 16 << 30,
        session_timeout_s: float = 180.0,
        sample_slots: int | None = None,
        sample_rows: int | None = None,
        chunk: int = 8,
        prefill_tokens: int | None = None,
        leader=None,
    ):
        self.tr, self.store, self.sched = trainer, store, scheduler
        self.model_name, self.tokenizer_id = model_name, tokenizer_id
        self.token_cap = int(trainer.token_cap)
        self.max_rank = int(trainer.max_rank)
        self.max_offload_bytes = int(max_offload_bytes)
        self.session_timeout_s = float(session_timeout_s)
        # A failure's message names the tenant's tinker:// objects, never server files.
        self._complete = lambda rid, result: complete(
            rid, redact.client_result(result, store.state_dir)
        )
        # tinker path (snapshots) or PEFT folder (named saves) -> slot, least recent first.
        self._sampler_slots: OrderedDict[str, int] = OrderedDict()
        self._sampler_owner: dict[str, str] = {}  # the same keys -> the tenant they serve
        self._retired: set[int] = set()  # sampler slots to free once no sequence reads them
        # Prefill-only steps while a burst arrives (ADMIT_PREFILL None): off on a CPU host.
        self.accelerator = trainer.mesh.devices.flat[0].platform != "cpu"
        sampler = trainer.make_sampler()
        groups = sampler.dp * sampler.cp
        rows = sample_rows or min(self.token_cap, SAMPLE_ROWS)
        if sample_slots is None:
            # A hybrid model's slots each hold a recurrent-state row too.
            per_slot = rows * sampler.row_bytes + sampler.state_bytes
            fit = SAMPLE_CACHE_BYTES // per_slot * groups
            sample_slots = max(groups, min(SAMPLE_SLOTS, fit) // groups * groups)
        engine_kw = dict(
            slots=sample_slots,
            max_len=rows,
            chunk=chunk,
            prefill_tokens=prefill_tokens,
            long_len=self.token_cap,
        )
        self.sampling = SampleEngine(sampler, **engine_kw)
        # A multi-process job (jcp/server/replica.py): every Trainer and sampling-engine
        # call below also runs, in the same order, on every other process.
        self.leader = leader
        if leader is not None:
            self.tr, self.sampling = leader.wrap(trainer, self.sampling, engine_kw)
        # Other tenants' requests join a pass only within one Trainer micro-batch
        # (Scheduler.pass_tokens), and a pass of several micro-batches runs one per turn
        # (`_splits`), other tenants' passes between them.
        scheduler.pass_tokens = trainer.max_tokens_per_device * trainer.dp * trainer.cp
        # tenant -> (group, jcp.trainer.Steps, each request's datum span) of its pass
        # running over turns (Scheduler.split).
        self._splits: dict[str, tuple] = {}
        self._running: dict[str, int] = {}  # request id -> engine request id (admitted)
        self._sampled: dict[str, float] = {}  # tenant -> its last sample (TENANT_WINDOW_S)
        self._cancelled: set[str] = set()  # admitted request ids their clients cancelled
        # Admitted requests a client streams (an OpenAI stream): while any runs, engine
        # steps are `chunk` decode steps (hurried), so its tokens go out as they come
        # instead of once a long step ends.
        self._streaming: set[str] = set()
        self._unlogged: list[Work] = []  # samples admitted since the last step's log
        self._resident: OrderedDict[str, int] = OrderedDict()  # model id -> slot, LRU first
        self._offloaded: dict[str, object] = {}  # model id -> HostSlot
        self._closing: set[str] = set()  # models of ended sessions, unloaded when idle
        self.offloads = self.restores = 0
        self.prefill_steps = 0  # prefill-only engine steps run while gathering a burst
        # Gathered bursts in a row that no sample joined while they ran (ADMIT_CALM_BURSTS),
        # and whether one joined the last one (None: none ran since the last count).
        self._calm, self._joined = 0, None
        self.busy_s: Counter[str] = Counter()  # worker seconds per request kind
        self._next_expiry_scan = 0.0
        # loss_id -> (owner, session id, jcp.custom_loss.CustomLoss), oldest first.
        self._custom_losses: OrderedDict[str, tuple] = OrderedDict()
        self._thread = threading.Thread(target=self._loop, name="jcp-serve-worker", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def alive(self) -> bool:
        return self._thread.is_alive() and self.failure() is None

    def failure(self) -> str | None:
        """Why a multi-process job can serve nothing more (None: it can)."""
        return self.leader.failure if self.leader is not None else None

    def stop(self) -> None:
        self.sched.close()
        # A failed job's worker may be blocked in a collective that never completes.
        self._thread.join(timeout=60 if self.failure() is None else 1)
        if self.leader is not None:
            self.leader.stop()

    # ------------------------------------------------------------------ loop

    def _loop(self) -> None:
        while True:
            try:
                got = self.sched.next_work(block=self.sampling.idle, timeout=1.0)
            except Exception:  # noqa: BLE001 — the worker must outlive any one failure
                log.exception("worker: next_work failed")
                time.sleep(0.5)
                continue
            if got is None:
                return
            group, samples = got
            arriving = False
            if samples and not group and self.sampling.idle:
                # A burst of concurrent samples (an RL step's prompt groups) reaches an
                # idle engine over some ms: gather it whole, so that it decodes as one
                # batch, and admit and prefill the arrivals so far in prefill-only steps
                # while the rest arrive (ADMIT_* above). Its first decode step is short
                # (hurry), so that stragglers join one chunk later, unless recent bursts
                # came whole (no sample joined them): then one that ended at a quiet gap
                # decodes in one step to its end (Engine.decode_len).
                if self._joined is not None:  # the last gathered burst ran: came it whole?
                    self._calm = 0 if self._joined else self._calm + 1
                self._admit_arrivals(samples)
                _, arriving = self.sched.gather_samples(
                    ADMIT_GAP_S,
                    ADMIT_WINDOW_S,
                    ADMIT_BURST_GAP_S,
                    each=self._admit_arrivals,
                    scale=ADMIT_GAP_SCALE,
                    taken=samples,
                )
                arriving = arriving or ADMIT_HURRY or self._calm < ADMIT_CALM_BURSTS
                self._joined = None if self.sampling.idle else False
            else:
                for w in samples:
                    self._admit_sample(w)
                self._unlogged += samples
            self._cancel_running()
            if group:
                self._run_pass(group)
            if not self.sampling.idle:
                busy = self.sched.pending() > 0 or bool(self._splits)
                self._step(arriving or busy or bool(self._streaming), True)
                if self._joined is False and self.sched.samples_queued():
                    self._joined = True  # samples came while the gathered burst ran
            self._unlogged = []
            try:
                self._sweep_retired()
                self._reap()
            except Exception as e:  # noqa: BLE001 — never let cleanup stop the worker
                log.error("unloading ended sessions failed: %s", e)

    def _admit_arrivals(self, samples: list[Work]) -> None:
        """Admit samples of a burst still arriving and prefill them (no decode yet)."""
        for w in samples:
            self._admit_sample(w)
        self._unlogged += samples
        prefill = self.accelerator if ADMIT_PREFILL is None else ADMIT_PREFILL
        if prefill and (
            len(self.sampling.waiting) + len(self.sampling.prefilling) >= ADMIT_PREFILL_MIN
        ):
            self._step(False, False)
            self.prefill_steps += 1

    def _step(self, hurry: bool, decode: bool) -> None:
        """One engine step (Engine.step); a failed one fails the engine's requests."""
        t0 = time.monotonic()
        try:
            now = time.monotonic()
            for t in [t for t, at in self._sampled.items() if now - at > TENANT_WINDOW_S]:
                del self._sampled[t]
            # Several tenants: short steps (`chunk` decode steps), so that one tenant's
            # request waits for one chunk of another's rows, not max_chunk.
            tenants = tuple(sorted(self._sampled))
            several = len(set(tenants) | {r.tenant for r in self.sampling.requests.values()}) > 1
            ended = self.sampling.step(hurry=hurry or several, decode=decode, tenants=tenants)
        except Exception as e:  # noqa: BLE001 — the engine's requests fail, not the server
            ended = []
            for rid in list(self.sampling.requests):
                self.sampling.cancel(rid)
            log.error("sampling step failed: %s", e)
        t1 = time.monotonic()
        self.busy_s["sample"] += t1 - t0
        if log.isEnabledFor(logging.DEBUG):  # benchmarks/engine.py reads these
            log.debug(
                "sampling step",
                extra={
                    "step": dict(
                        t0=t0,
                        t1=t1,
                        admitted=len(self._unlogged),
                        hurry=hurry,
                        decode=decode,
                        arrived=[w.arrived_at for w in self._unlogged],
                        live=self.sampling.live,
                        ended=len(ended),
                        waiting=len(self.sampling.waiting),
                    )
                },
            )
        self._unlogged = []

    def _run_pass(self, group: list[Work]) -> None:
        t0 = time.perf_counter()
        try:
            if group is self._splits.get(group[0].owner, (None,))[0]:
                self._advance(group[0].owner)
            elif group[0].failure is not None:
                self._complete(group[0].request_id, ("error", group[0].failure, "server"))
            elif group[0].kind in ("forward", "forward_backward"):
                self._fwd(group)
            else:
                w = group[0]
                self._complete(w.request_id, getattr(self, "_" + w.kind)(w))
        except Exception as e:  # noqa: BLE001 — one request's failure is only its own
            for w in group:
                try:
                    self._complete(w.request_id, _error(e))
                except Exception:  # noqa: BLE001
                    log.exception("worker: could not complete %s", w.request_id)
        self.busy_s[group[0].kind] += time.perf_counter() - t0

    # ------------------------------------------------------------------ slots

    def _in_use(self) -> set[int]:
        """Slots some queued or running sequence of the sampling engine reads."""
        return {r.adapter for r in self.sampling.requests.values()}

    def _free_slot(
        self, why: str, keep: frozenset = frozenset(), restoring: str | None = None
    ) -> None:
        """Make one slot free: evict the first of `_victims` (Engine docstring, "Eviction")
        that host memory admits. restoring: the offloaded model the slot is for; its host
        copy goes when it is restored, so offloading a victim into that room is a swap,
        never refused for lack of room."""
        self._sweep_retired()
        if len(self.tr.adapters) < self.tr.max_adapters:
            return
        # The models of passes running over turns stay in their slots.
        keep = keep | {w.model_id for g, _, _ in self._splits.values() for w in g}
        used = self.offloaded_bytes()
        if restoring is not None:
            used -= self._offloaded[restoring].nbytes
        full = False
        for kind, key in self._victims(keep):
            if kind == "model":
                if (
                    used + self._nbytes(self.tr.adapters[self._resident[key]])
                    > self.max_offload_bytes
                ):
                    full = True
                    continue
                slot = self._resident.pop(key)
                self._offloaded[key] = self.tr.offload_adapter(slot)
                self.offloads += 1
                self._set_slot(key, None)
            else:
                self._sampler_owner.pop(key, None)
                self.tr.delete_adapter(self._sampler_slots.pop(key))
            return
        if full:
            raise InputError(
                f"cannot {why}: every adapter slot is in use and host memory "
                f"for offloaded models is full ({used} of "
                f"{self.max_offload_bytes} bytes, --max-offload-gb); finish "
                "sessions you no longer need"
            )
        raise InputError(
            f"all {self.tr.max_adapters} adapter slots are in use by this "
            f"pass or by running samples; cannot {why} (raise --max-adapters)"
        )

    def offloaded_bytes(self) -> int:
        """Host memory the offloaded models hold (at most max_offload_bytes)."""
        return sum(h.nbytes for h in list(self._offloaded.values()))

    def _victims(self, keep: frozenset) -> list[tuple[str, str]]:
        """What may leave its slot, in eviction order (Engine docstring, "Eviction"):
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
            "snapshot sampler weights", frozenset(m for m, s in self._resident.items() if s == slot)
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
        self._free_slot("restore an offloaded model", keep | {mid}, restoring=mid)
        slot = self.tr.restore_adapter(saved)
        del self._offloaded[mid]
        self.restores += 1
        self._adopt(mid, slot)
        return slot

    def _adopt(self, model_id: str, slot: int) -> None:
        self._resident[model_id] = slot
        self._resident.move_to_end(model_id)
        self._set_slot(model_id, slot)

    # ------------------------------------------------------------------ lifecycle

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

    # ------------------------------------------------------------------ requests

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
        self._free_slot("create a model")
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

    def _fwd(self, group: list[Work], split: bool = True) -> None:
        """One fused Trainer call; on refusal, each request alone. split: a call of several
        micro-batches runs one per turn (`_advance`), other tenants' passes between."""
        if len(group) > 1 and (
            self.tr.cfg.is_moe or any(w.payload.loss_fn == "custom" for w in group)
        ):
            # MoE load metrics and the router auxiliary loss are batch-level figures, and a
            # custom loss's metrics are per request: a fused pass could not report each
            # request's own, so each runs alone.
            for w in group:
                self._fwd([w], split=False)
            return
        self.sched.note_pass(group)
        try:
            steps, spans = self._start_fwd(group)
            # A multi-process job's Trainer is a proxy that runs whole calls only.
            if split and steps.passes > 1 and self.leader is None:
                self._splits[group[0].owner] = (group, steps, spans)
                self.sched.split(group)
                self._advance(group[0].owner)
                return
            while not steps.step():
                pass
            outs = self._fwd_results(group, steps.output, spans)
        except Exception as e:  # noqa: BLE001
            self._fwd_failed(group, e)
            return
        for w, out in zip(group, outs):
            self._complete(w.request_id, out)

    def _advance(self, tenant: str) -> None:
        """One micro-batch of the tenant's split pass; completes its requests after the
        last."""
        group, steps, spans = self._splits[tenant]
        try:
            # Other work waiting: let this micro-batch finish before it runs, so that it
            # waits for one micro-batch, not MAX_IN_FLIGHT.
            settle = self.sched.pending() > 0 or not self.sampling.idle or len(self._splits) > 1
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

    def _end_split(self, tenant: str) -> None:
        self.sched.finish(self._splits.pop(tenant)[0])

    def _fwd_failed(self, group: list[Work], e: Exception) -> None:
        """A Trainer call refused or failed (nothing accumulated): alone, the request
        fails; fused, each request is rerun alone so that only the bad one fails."""
        if len(group) == 1:
            self._complete(group[0].request_id, _error(e))
            return
        for w in group:
            try:
                self.sched.note_pass([w])
                steps, spans = self._start_fwd([w])
                while not steps.step():
                    pass
                out = self._fwd_results([w], steps.output, spans)[0]
            except Exception as e1:  # noqa: BLE001
                out = _error(e1)
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
        if losses[0] == "custom":  # _fwd runs a custom request alone
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

            def done(rid, outcome, request_id=w.request_id):
                self._running.pop(request_id, None)
                self._streaming.discard(request_id)
                if request_id in self._cancelled:
                    self._cancelled.discard(request_id)
                    self._complete(request_id, ("error", "cancelled by the client", "user"))
                    return
                self._complete(
                    request_id,
                    _error(outcome)
                    if isinstance(outcome, Exception)
                    else _encode_sample(outcome, target, p.get("raw")),
                )

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
                callback=done,
                fields=fields,
                salt=w.owner,
                watch=watch,
                tenant=w.owner,
            )
            self._running[w.request_id] = rid
            if p.get("stream"):
                self._streaming.add(w.request_id)
        except Exception as e:  # noqa: BLE001
            self._complete(w.request_id, _error(e))

    def _cancel_running(self) -> None:
        """Cancel the engine requests whose clients cancelled them (cancel_future after
        admission): they end at this step boundary, their slots freed; others run on."""
        for request_id in self.sched.take_cancels():
            split = [t for t, (g, _, _) in self._splits.items() if len(g) == 1]
            split = [t for t in split if self._splits[t][0][0].request_id == request_id]
            if split:
                # A split pass of this one request: it ends here, its accumulation undone.
                self._splits[split[0]][1].close()
                self._end_split(split[0])
                self._complete(request_id, ("error", "cancelled by the client", "user"))
                continue
            rid = self._running.get(request_id)
            if rid is not None:
                self._cancelled.add(request_id)
                self.sampling.cancel(rid)


class _Whole:
    """A whole Trainer call with jcp.trainer.Steps' face (a multi-process job's proxy)."""

    passes = 1

    def __init__(self, run, *args):
        self._run, self._args, self.output = run, args, None

    def step(self, settle: bool = False) -> bool:
        data, loss_fn, config, adapters = self._args
        self.output = self._run(data, loss_fn=loss_fn, loss_fn_config=config, adapters=adapters)
        return True


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


def _custom_datum(d: jcp.Datum, loss: jcp.CustomLoss) -> jcp.Datum:
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
