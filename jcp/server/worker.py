"""The worker: the one thread that owns the Trainer and runs the scheduler's passes.

Owns every Trainer call, the running sampling engine (jcp.sample.engine.Engine), the loop
below and its handler table (request kind -> method). Its parts live by owner: the
adapter-slot cache (jcp/server/slots.py: `SlotCache`, eviction, offload / restore), the
model operations and custom losses (jcp/server/model_ops.py: `ModelOps`), the fused
training passes (jcp/server/passes.py: `Passes`) and a sample's admission and result
(jcp/server/samples.py: `Samples`). Every asample of every tenant is
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
Light work first: while a light tenant's few rows sit beside another's many, the engine
steps them apart (Admission, "Light steps"), and a light step runs before the turn's
pass, not after it — and so does one whose sample came while the pass ran, before the
turn's engine step (`_light_after_pass`), and samples taken together are admitted the
light tenants' first, their step before the others' admission (`_admit_taken`); after a
turn of a split pass (its preparation, or one micro-batch: Passes), another tenant's
ready pass of at most one micro-batch (Scheduler.small_ready) runs before the engine step
(the engine step skipped for at most one turn in a row), so a small request waits for one
heavy unit, not a micro-batch and an engine step. While a light step or a small pass
(LIGHT_PASS_TOKENS) runs, the event loop gives way to it: its turns go to that work's
tenants only (scheduler.LightWork, asgi.Turns); and while a light tenant's small request
waits for the worker, the loop holds the heavy tenants' turns.
A sample the client cancels after admission (cancel_future -> Scheduler.cancel_running)
is cancelled in the engine at the start of the next turn and ends at that step
boundary, its slots freed; so does a split pass of one request, its accumulation undone.

Sampler weights: save_weights_for_sampler without a name makes an in-memory snapshot (a
device copy of the model's slot into a free slot, no disk); with a name it writes the PEFT
folder, and a sampler of that folder loads it afresh (a cached load of an older save under
the same name is retired). Snapshot and loaded sampler slots share the slot cache with the
training models (SlotCache, "Eviction"): loaded named weights go first, snapshots only
after every idle training model (a sampler whose snapshot was freed fails clearly and asks
for a new save).

Results go back through `complete`, as ("proto", bytes) / ("json", dict) / ("error",
message, category). This is the owner side of the server: the HTTP modules never import
it or jax.

In a multi-process job (`leader`, jcp/server/replica.py) this worker runs on process 0 and
its Trainer and sampling engine are proxies: each call on them runs on every process, in
the order made here; everything else here (the store, slots, losses, scheduling) is
decided on process 0 alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable

from jcp.sample.engine import Engine as SampleEngine
from jcp.server import redact
from jcp.server import scheduler as scheduler_lib
from jcp.server.collector import Freezer
from jcp.server.model_ops import ModelOps
from jcp.server.passes import Passes, error_result
from jcp.server.samples import Samples
from jcp.server.scheduler import Scheduler, Work
from jcp.server.slots import SlotCache
from jcp.server.state import StateStore

log = logging.getLogger("jcp.serve")

# Samples reaching an idle engine are gathered into one decode batch: a lone sample waits
# ADMIT_GAP_S for company; once a second one has come, a burst is arriving (an RL step's
# prompt groups, sent at once) and the worker takes every sample that comes within
# ADMIT_GAP_SCALE × the largest gap between the burst's arrivals so far (at least
# ADMIT_GAP_S, at most ADMIT_BURST_GAP_S) of the one before, for at most ADMIT_WINDOW_S
# — one tenant's burst: a second tenant's sample ends the gathering (Scheduler.gather_samples).
# While it gathers, it admits the arrivals and, on an accelerator, prefills them in
# prefill-only steps (Engine.step(decode=False)) once ADMIT_PREFILL_MIN are waiting; on a
# CPU host those steps would take the cores from the HTTP thread still taking the burst.
# Decoding the first arrivals while the rest arrive costs more than it saves. The first
# decode step after a gather is short (hurry), so that stragglers join one chunk later,
# unless the last ADMIT_CALM_BURSTS gathered bursts came whole (`Bursts`; a new server
# counts as calm): then a burst that ended at a quiet gap decodes in one step to its end.
# ADMIT_HURRY: every first step short.
# Measured: benchmarks/RESULTS.md, "Sampling engine" (benchmarks/engine.py --admission).
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
# The sampling engine's KV cache: rows per sequence, and at most this many bytes per device.
SAMPLE_ROWS = 256
SAMPLE_SLOTS = 512
SAMPLE_CACHE_BYTES = 1 << 30


class Bursts:
    """Whether the samples' bursts come whole: the last ADMIT_CALM_BURSTS gathered bursts
    ran without a sample joining them. A new server counts as calm, so that its first
    bursts decode at the speed of the later ones (benchmarks/steady_state.py: the first
    two rounds had taken 1.2-2.0× a steady one); one that a straggler joins makes the next
    ones hurried until ADMIT_CALM_BURSTS came whole again."""

    def __init__(self):
        self.calm = ADMIT_CALM_BURSTS  # gathered bursts in a row that no sample joined
        self._joined: bool | None = None  # the running burst's (None: none runs)

    def gathered(self) -> bool:
        """A burst is gathered: the last one's count is settled -> whether bursts are calm."""
        if self._joined is not None:
            self.calm = 0 if self._joined else self.calm + 1
            self._joined = None
        return self.calm >= ADMIT_CALM_BURSTS

    def running(self, running: bool) -> None:
        """The gathered burst runs (or ended in its first step: it counts for nothing)."""
        self._joined = False if running else None

    def joined(self) -> None:
        """Samples came while the gathered burst ran."""
        if self._joined is False:
            self._joined = True


@dataclasses.dataclass(frozen=True)
class WorkerConfig:
    """The worker's settings (jcp-serve's flags of the same names)."""

    model_name: str  # the base_model clients name
    max_offload_bytes: int = 16 << 30  # host memory for offloaded models (--max-offload-gb)
    session_timeout_s: float = 180.0  # no heartbeat for this long ends a session
    sample_slots: int | None = None  # engine sequences (None: what fits SAMPLE_CACHE_BYTES)
    sample_rows: int | None = None  # KV rows per sequence (None: min(token cap, SAMPLE_ROWS))
    chunk: int = 8  # decode steps per hurried engine step
    prefill_tokens: int | None = None  # prompt tokens prefilled per engine step

    def __post_init__(self):
        if self.max_offload_bytes < 0 or self.session_timeout_s < 0:
            raise ValueError("max_offload_bytes and session_timeout_s must be >= 0")


def sampling_engine_kw(trainer, sampler, config: WorkerConfig) -> dict:
    """The sampling engine's settings over `sampler`: rows per sequence, and as many
    sequences as fit SAMPLE_CACHE_BYTES per device (at most SAMPLE_SLOTS) unless given."""
    token_cap = int(trainer.token_cap)
    groups = sampler.dp * sampler.cp
    rows = config.sample_rows or min(token_cap, SAMPLE_ROWS)
    slots = config.sample_slots
    if slots is None:
        # A hybrid model's slots each hold a recurrent-state row too.
        per_slot = rows * sampler.row_bytes + sampler.state_bytes
        fit = SAMPLE_CACHE_BYTES // per_slot * groups
        slots = max(groups, min(SAMPLE_SLOTS, fit) // groups * groups)
    return dict(
        slots=slots,
        max_len=rows,
        chunk=config.chunk,
        prefill_tokens=config.prefill_tokens,
        long_len=token_cap,
    )


class Worker(SlotCache, ModelOps, Passes, Samples):
    """The worker over `trainer`: one thread, the scheduler's work in order (module
    docstring); adapter slots as a cache (SlotCache)."""

    def __init__(
        self,
        trainer,
        store: StateStore,
        scheduler: Scheduler,
        complete,
        config: WorkerConfig,
        leader=None,
    ):
        self.tr, self.store, self.sched = trainer, store, scheduler
        self.model_name = config.model_name
        self.token_cap = int(trainer.token_cap)
        self.max_rank = int(trainer.max_rank)
        self.max_offload_bytes = int(config.max_offload_bytes)
        self.session_timeout_s = float(config.session_timeout_s)
        # A failure's message names the tenant's tinker:// objects, never server files.
        self._complete = lambda rid, result: complete(
            rid, redact.client_result(result, store.state_dir)
        )
        self._init_slots()
        self._init_model_ops()
        self._init_passes()
        # Prefill-only steps while a burst arrives (ADMIT_PREFILL None): off on a CPU host.
        self.accelerator = trainer.mesh.devices.flat[0].platform != "cpu"
        sampler = trainer.make_sampler()
        engine_kw = sampling_engine_kw(trainer, sampler, config)
        self.sampling = SampleEngine(sampler, **engine_kw)
        # A multi-process job (jcp/server/replica.py): every Trainer and sampling-engine
        # call below also runs, in the same order, on every other process.
        self.leader = leader
        if leader is not None:
            self.tr, self.sampling = leader.wrap(trainer, self.sampling, engine_kw)
        # Other tenants' requests join a pass only within one Trainer micro-batch
        # (Scheduler.pass_tokens), and a pass of several micro-batches runs one per turn
        # (`splits`), other tenants' passes between them.
        scheduler.pass_tokens = trainer.max_tokens_per_device * trainer.dp * trainer.cp
        # A pass holds no more models than fit on the device at once (SlotCache._pass_room).
        scheduler.pass_room = self._pass_room

        self._running: dict[str, int] = {}  # request id -> engine request id (admitted)
        self._sampled: dict[str, float] = {}  # tenant -> its last sample (TENANT_WINDOW_S)
        self._cancelled: set[str] = set()  # admitted request ids their clients cancelled
        # Admitted requests a client streams (an OpenAI stream): while any runs, engine
        # steps are `chunk` decode steps (hurried), so its tokens go out as they come
        # instead of once a long step ends.
        self._streaming: set[str] = set()
        self._unlogged: list[Work] = []  # samples admitted since the last step's log
        self.prefill_steps = 0  # prefill-only engine steps run while gathering a burst
        self._bursts = Bursts()  # whether gathered bursts come whole (ADMIT_CALM_BURSTS)
        self._deferred = False  # the last turn ran no engine step (a small pass went first)
        self.busy_s: Counter[str] = Counter()  # worker seconds per request kind
        self._handlers: dict[str, Callable[[Work], tuple]] = {
            "create_model": self._create_model,
            "load_weights": self._load_weights,
            "optim_step": self._optim_step,
            "save_weights": self._save_weights,
            "save_weights_for_sampler": self._save_weights_for_sampler,
            "save_weights_external": self._save_weights_external,
            "copy_weights": self._copy_weights,
            "delete_checkpoint": self._delete_checkpoint,
            "unload_model": self._unload_model,
            "create_custom_loss": self._create_custom_loss,
            "end_session": self._end_session,
            "refused": self._refused,
        }
        self._collector = Freezer()
        self._thread = threading.Thread(target=self._loop, name="jcp-serve-worker", daemon=True)

    def start(self) -> None:
        # What exists before serving (the model, modules, the warm-up's programs), and what
        # a later compile makes, lives as long as the process: frozen out of the cyclic GC
        # (collector.py). `stop` unfreezes it, so a process that serves again collects it.
        self._collector.start()
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
        self._collector.stop()
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
                calm = self._bursts.gathered()
                self._admit_arrivals(samples)
                _, arriving = self.sched.gather_samples(
                    ADMIT_GAP_S,
                    ADMIT_WINDOW_S,
                    ADMIT_BURST_GAP_S,
                    each=self._admit_arrivals,
                    scale=ADMIT_GAP_SCALE,
                    taken=samples,
                )
                arriving = arriving or ADMIT_HURRY or not calm
                self._bursts.running(not self.sampling.idle)
            else:
                self._admit_taken(samples)
            self._cancel_running()
            light = self._light_next() if group else None
            if light:
                # A light tenant's few rows beside another's many: their step (the size of
                # their rows) runs before the pass (Admission, "Light steps").
                self._light_step(light)
            deferred = False
            if group:
                with self._giving_way(group):
                    self._run_pass(group)
                self._light_after_pass()
                # A turn of a split pass ran (its preparation or one micro-batch):
                # another tenant's small ready pass goes next, before the engine step (at
                # most once in a row).
                deferred = (
                    not self._deferred
                    and group[0].owner in self.splits
                    and self.sched.small_ready(group[0].owner)
                )
            self._deferred = deferred
            if not self.sampling.idle and not deferred:
                busy = self.sched.pending() > 0 or bool(self.splits)
                self.engine_step(arriving or busy or bool(self._streaming), True)
                if self.sched.samples_queued():
                    self._bursts.joined()
            self._unlogged = []
            try:
                self._sweep_retired()
                self._reap()
            except Exception as e:  # noqa: BLE001 — never let cleanup stop the worker
                log.error("unloading ended sessions failed: %s", e)
            self._collector.after_turn()

    def _light_after_pass(self) -> None:
        """Samples that came while the pass ran, with the engine running: admitted now, and
        when the engine's next step is a light tenant's, it runs before the turn's engine
        step (the heavy one), so that his request waits for the pass, not also for her
        step (Admission, "Light steps"). Results do not change: a row's draws depend on its
        own key and count."""
        if self.sampling.idle:  # an idle engine gathers a burst (next turn), as before
            return
        late = self.sched.take_samples()
        self._admit_taken(late)
        light = self._light_next() if late else None
        if light:
            self._light_step(light)

    def _admit_taken(self, samples: list[Work]) -> None:
        """Admit samples taken from the scheduler into the running engine: the light
        tenants' first (scheduler.light_first) and, when the engine's next step is theirs
        alone, that step before the others are admitted. A sample's admission is ~0.1 ms
        of Python on the worker under load, so a burst of 256 took 12-19 ms, which a light
        tenant's sample taken with it waited for (traced beside a noisy neighbour)."""
        first, rest = scheduler_lib.light_first(samples)
        for w in first:
            self._admit_sample(w)
        self._unlogged += first
        light = self._light_next() if first and rest else None
        if light:
            self._light_step(light)
        for w in rest:
            self._admit_sample(w)
        self._unlogged += rest

    def _light_step(self, tenants: frozenset) -> None:
        """The light tenants' engine step, the event loop giving way to it (LightWork)."""
        with self.sched.light_work.running(tenants):
            self.engine_step(True, True)

    def _giving_way(self, group: list[Work]):
        """The event loop gives way to a small forward / forward_backward pass (of at most
        LIGHT_PASS_TOKENS tokens, not a split one) while it runs (LightWork)."""
        if group[0].owner in self.splits or not scheduler_lib.light_sized(group):
            return contextlib.nullcontext()
        return self.sched.light_work.running({w.owner for w in group})

    def _admit_arrivals(self, samples: list[Work]) -> None:
        """Admit samples of a burst still arriving and prefill them (no decode yet)."""
        for w in samples:
            self._admit_sample(w)
        self._unlogged += samples
        prefill = self.accelerator if ADMIT_PREFILL is None else ADMIT_PREFILL
        if prefill and (
            len(self.sampling.waiting) + len(self.sampling.prefilling) >= ADMIT_PREFILL_MIN
        ):
            self.engine_step(False, False)
            self.prefill_steps += 1

    def engine_step(self, hurry: bool, decode: bool) -> None:
        """One engine step (Engine.step); a failed one fails the engine's requests."""
        t0 = time.monotonic()
        try:
            # Several tenants: short steps (`chunk` decode steps), so that one tenant's
            # request waits for one chunk of another's rows, not max_chunk.
            tenants = self._tenants()
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

    def _light_next(self) -> frozenset | None:
        """The light tenants the engine's next step serves alone (Engine.light_next), or
        None."""
        if self.sampling.idle:
            return None
        try:
            return self.sampling.light_next(self._tenants())
        except Exception as e:  # noqa: BLE001 — the engine step reports it; the worker goes on
            log.error("sampling admission failed: %s", e)
            return None

    def _tenants(self) -> tuple[str, ...]:
        """The tenants that sampled within TENANT_WINDOW_S (forgetting older ones)."""
        now = time.monotonic()
        for t in [t for t, at in self._sampled.items() if now - at > TENANT_WINDOW_S]:
            del self._sampled[t]
        return tuple(sorted(self._sampled))

    def _run_pass(self, group: list[Work]) -> None:
        t0 = time.perf_counter()
        try:
            if group is self.splits.get(group[0].owner, (None,))[0]:
                self.advance_pass(group[0].owner)
            elif group[0].failure is not None:
                self._complete(group[0].request_id, ("error", group[0].failure, "server"))
            elif group[0].kind in ("forward", "forward_backward"):
                self.start_pass(group)
            else:  # one model operation (ModelOps) or session end, by the handler table
                w = group[0]
                self._complete(w.request_id, self._handlers[w.kind](w))
        except Exception as e:  # noqa: BLE001 — one request's failure is only its own
            for w in group:
                try:
                    self._complete(w.request_id, error_result(e))
                except Exception:  # noqa: BLE001
                    log.exception("worker: could not complete %s", w.request_id)
        self.busy_s[group[0].kind] += time.perf_counter() - t0

    def _cancel_running(self) -> None:
        """Cancel the engine requests whose clients cancelled them (cancel_future after
        admission): they end at this step boundary, their slots freed; others run on."""
        for request_id in self.sched.take_cancels():
            split = [t for t, (g, _, _) in self.splits.items() if len(g) == 1]
            split = [t for t in split if self.splits[t][0][0].request_id == request_id]
            if split:
                # A split pass of this one request: it ends here, its accumulation undone.
                self.splits[split[0]][1].close()
                self._end_split(split[0])
                self._complete(request_id, ("error", "cancelled by the client", "user"))
                continue
            rid = self._running.get(request_id)
            if rid is not None:
                self._cancelled.add(request_id)
                self.sampling.cancel(rid)
