"""The request queue and the policy that groups requests into worker passes.

Owns ordering, fairness and fusion, nothing else: each model's requests run in seq_id
order (a request waits until its model's previous seq_id has been taken); a pass is either
one request, or every ready forward (or every ready forward_backward) request of every model
whose loss settings agree, fused into one multi-LoRA Trainer call. optim_step,
load_weights, save_* and unload_model are therefore barriers for their own model only:
they head its queue and nothing of that model behind them can join a fused pass. Samples
are not passes: they have no model order, and the worker takes every queued sample at
each turn (`next_work`) and admits it into the running sampling engine, so one decode
batch serves all tenants. A request refused at the edge whose model and seq_id are known is
queued as kind "refused", so that it still takes its seq_id. If the policy itself ever
raises, the oldest queued request is handed out failed (`failure`) instead, so the worker
goes on. It must never import jax or touch the Trainer; HTTP handlers only call `submit`.

Fairness across tenants (Work.owner; docs/serving.md, "Fairness"): passes go round robin
over the tenants with ready work — the tenant served least recently first, ties to the
oldest head —, a tenant's own pass being its oldest ready request and, if that is a
forward or forward_backward, all its other ready ones of that kind (so one tenant alone
is scheduled exactly as first come, first served with full fusion). Other tenants'
ready requests of the kind join that pass only while it stays within `pass_tokens`
tokens (one Trainer micro-batch): a small request rides along a small pass, never behind
a large one. A pass also holds no more models than the device keeps resident at once
(`pass_room`); the others wait for a later pass. A pass the worker runs over several turns (`split`: a Trainer call of
several micro-batches, one per turn) comes back as its tenant's pass at each of that
tenant's turns until `finish`, and while it runs nothing else of its tenant or of its
models is taken: so another tenant's request waits for at most one micro-batch of it (or
one unsplittable operation), and each tenant's and each model's requests keep their
order.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

log = logging.getLogger("jcp.serve")

FUSABLE = ("forward", "forward_backward")
# A model's next seq_id that never arrives (a client that died mid-call) stops blocking
# its later requests after this long.
GAP_TIMEOUT_S = 10.0


# The worker's light work (LightWork): a forward / forward_backward pass of at most this
# many tokens, or a light engine step; the event loop gives way to it for at most
# HOLD_MAX_S.
LIGHT_PASS_TOKENS = 1024
HOLD_MAX_S = 0.05
# A tenant with more than this many requests queued, or a pass split over turns, is
# heavy: while a light tenant's small request waits for the worker, the event loop holds
# the heavy tenants' turns (LightWork).
LIGHT_QUEUED = 2


class LightWork:
    """Light work on the worker, running or waiting for it, which the event loop gives way
    to (asgi.Turns).

    On a CPU host the event loop and the compute share the cores. While the worker runs a
    light tenant's few-millisecond step or small pass, another tenant's burst of requests
    (an RL step's hundreds of samples and answers) kept the loop busy on one core, so the
    light step's threads ran on the other, its length that of her burst. While
    `running(tenants)` lasts, the loop's turns go only to those tenants' requests.

    And while a light tenant's small request waits for the worker (`wait`, from the
    scheduler's submit until the worker takes it: `taken`), what delays it is the unit
    the worker runs meanwhile — a heavy tenant's micro-batch —, and the loop's work for
    that tenant took the cores from that unit (traced beside a noisy neighbour: up to 31
    ms of the loop's CPU during her 49-ms micro-batch). So the loop then holds the turns
    of the heavy tenants (`heavy(who)`, the scheduler's: many requests queued, or a pass
    split over turns) while any waiter is not heavy itself; the others' turns go on.

    The held handlers and answers wait until the light work ends, and at most HOLD_MAX_S
    (from when it began to run, or from when the waiters went from none to some; then the
    hold lapses until none wait). The worker and the scheduler write, the event loop reads:
    each state a tuple replaced whole."""

    def __init__(self, heavy: Callable[[str], bool] | None = None):
        self._state: tuple[frozenset, float] | None = None
        self._heavy = heavy
        self._waiting: dict[str, int] = {}  # tenant -> its requests waiting (scheduler's lock)
        self._wait_state: tuple[frozenset, float] | None = None

    @contextlib.contextmanager
    def running(self, tenants):
        self._state = (frozenset(tenants), time.monotonic() + HOLD_MAX_S)
        try:
            yield
        finally:
            self._state = None

    def wait(self, who: str) -> None:
        """`who`'s light request waits for the worker (called under the scheduler's lock)."""
        self._waiting[who] = self._waiting.get(who, 0) + 1
        self._publish()

    def taken(self, who: str) -> None:
        """One of `who`'s waiting light requests was taken (or cancelled)."""
        _count_down(self._waiting, who)
        self._publish()

    def _publish(self) -> None:
        if not self._waiting:
            self._wait_state = None
            return
        until = self._wait_state[1] if self._wait_state else time.monotonic() + HOLD_MAX_S
        self._wait_state = (frozenset(self._waiting), until)

    def allows(self, who: str) -> bool:
        """Whether `who`'s request may take its turn on the loop now."""
        now = time.monotonic()
        run, wait = self._state, self._wait_state
        if run is not None and now <= run[1] and who not in run[0]:
            return False
        if wait is not None and now <= wait[1] and self._heavy is not None and self._heavy(who):
            # held while a waiter is light now (a tenant heavy since is nobody's reason)
            return all(self._heavy(t) for t in wait[0])
        return True


@dataclasses.dataclass
class Work:
    """One queued request. seq_id None: unordered (create_model, samples)."""

    request_id: str
    kind: str
    model_id: str | None
    seq_id: int | None
    payload: Any
    owner: str
    loss_key: tuple | None = None  # (loss_fn, sorted config items) for fusable kinds
    arrival: int = 0
    arrived_at: float = 0.0
    failure: str | None = None  # set when the scheduler could not place it
    # Tokens of a forward / forward_backward (its pass budget, Scheduler.pass_tokens); None:
    # counted from payload.data at submit.
    tokens: int | None = None
    light: bool = False  # it made its tenant a light waiter (LightWork.wait) at submit


def light_sized(works: Sequence[Work]) -> bool:
    """Whether `works` are light work's size (LightWork): forward / forward_backward
    requests of at most LIGHT_PASS_TOKENS tokens in all (a pass), or one sample whose
    sequences hold at most that many (num_samples × (prompt + max_tokens))."""
    if all(w.kind in FUSABLE for w in works):
        return all(w.tokens is not None for w in works) and (
            sum(w.tokens for w in works) <= LIGHT_PASS_TOKENS
        )
    if len(works) != 1 or works[0].kind != "sample":
        return False
    p = works[0].payload
    try:
        return p.num_samples * (len(p.prompt) + p.max_tokens) <= LIGHT_PASS_TOKENS
    except (AttributeError, TypeError):  # another payload (the OpenAI routes'): not light
        return False


def light_first(samples: Sequence[Work]) -> tuple[list[Work], list[Work]]:
    """Samples taken together -> (the light tenants', the others'), each in order: a
    light tenant's are at most LIGHT_QUEUED, each of light work's size (light_sized), as
    Scheduler.submit counts a tenant light."""
    by: dict[str, list[Work]] = {}
    for w in samples:
        by.setdefault(w.owner, []).append(w)
    light = {
        who
        for who, ws in by.items()
        if len(ws) <= LIGHT_QUEUED and all(light_sized([w]) for w in ws)
    }
    return [w for w in samples if w.owner in light], [w for w in samples if w.owner not in light]


def _count_down(counts: dict, key) -> None:
    """counts[key] one less, the key dropped at zero."""
    n = counts.get(key, 0) - 1
    if n > 0:
        counts[key] = n
    else:
        counts.pop(key, None)


def _tokens(w: Work) -> int:
    """A fusable request's tokens; one that cannot be counted never fits beside others."""
    try:
        return sum(len(d[0]) for d in w.payload.data)
    except Exception:  # noqa: BLE001 — a payload the worker will refuse
        return 1 << 62


@dataclasses.dataclass
class Counters:
    passes: int = 0  # worker passes of any kind
    fwd_passes: int = 0  # Trainer forward / forward_backward calls
    fused_passes: int = 0  # of those, passes holding more than one model
    fused_requests: int = 0  # requests that ran inside a fused pass


class Scheduler:
    """pass_tokens: the most tokens a pass may hold for other tenants' requests to join it
    (the module docstring, "Fairness"); 0: passes never mix tenants; None: no bound (every
    ready request of the kind joins, as for a single tenant). jcp-serve's worker sets it
    to one Trainer micro-batch.

    pass_room: None (no bound), or a callable () -> admit, called once per fused pass,
    where admit(model_id) -> bool says whether one more model fits beside those admitted
    before it (the worker: its adapter slots and memory, so that a pass never holds more
    models than the device can keep resident at once); the pass's first model is always
    taken, and a model that does not fit waits for a later pass."""

    def __init__(self, pass_tokens: int | None = 0, pass_room: Callable | None = None):
        self.pass_tokens = pass_tokens
        self.pass_room = pass_room
        self._cv = threading.Condition()
        self._queues: dict[str, list[Work]] = {}  # model id -> its pending work
        self._samples: list[Work] = []
        self._unordered: list[Work] = []  # model-less work (create_model)
        self._last_seq: dict[str, int] = {}  # model id -> last seq_id taken
        self._arrivals = itertools.count()
        self._held = 0
        self._cancels: list[str] = []  # taken request ids to cancel (worker)
        self._closed = False
        self.counters = Counters()
        self._turns = itertools.count()
        self._served: dict[str, int] = {}  # tenant -> its last turn (round robin)
        self._split: dict[str, list[Work]] = {}  # tenant -> its pass running over turns
        self._queued: dict[str, int] = {}  # tenant -> its requests queued
        # What the event loop gives way to (asgi.Turns).
        self.light_work = LightWork(heavy=self.heavy)

    # ------------------------------------------------------------------ producer side

    def submit(self, work: Work) -> None:
        seq = work.seq_id
        if seq is not None and (not isinstance(seq, int) or isinstance(seq, bool) or seq < 0):
            raise ValueError(f"seq_id must be an integer ≥ 0 or None, got {seq!r}")
        with self._cv:
            work.arrival, work.arrived_at = next(self._arrivals), time.monotonic()
            if work.kind in FUSABLE and work.tokens is None:
                work.tokens = _tokens(work)
            if work.kind == "sample":
                self._samples.append(work)
            elif work.model_id is None:
                self._unordered.append(work)
            else:
                q = self._queues.setdefault(work.model_id, [])
                q.append(work)
                q.sort(key=lambda w: (w.seq_id if w.seq_id is not None else -1, w.arrival))
            self._queued[work.owner] = self._queued.get(work.owner, 0) + 1
            if not self.heavy(work.owner) and light_sized([work]):
                work.light = True
                self.light_work.wait(work.owner)
            self._cv.notify_all()

    def heavy(self, who: str) -> bool:
        """Whether `who` has more than LIGHT_QUEUED requests queued or a pass split over
        turns (read by the event loop without the lock: two dict reads)."""
        return self._queued.get(who, 0) > LIGHT_QUEUED or who in self._split

    def _taken(self, works: Sequence[Work]) -> None:
        """Count `works` as no longer queued (taken by the worker, cancelled or failed)."""
        for w in works:
            _count_down(self._queued, w.owner)
            if w.light:
                w.light = False
                self.light_work.taken(w.owner)

    def _take_samples(self) -> list[Work]:
        out, self._samples = self._samples, []
        self._taken(out)
        return out

    def pending(self) -> int:
        with self._cv:
            return len(self._samples) + len(self._unordered) + sum(map(len, self._queues.values()))

    def samples_queued(self) -> int:
        """How many sample requests wait for the worker."""
        with self._cv:
            return len(self._samples)

    def take_samples(self) -> list[Work]:
        """Every queued sample, taken (the worker admits them between a pass and its
        engine step); none while held."""
        with self._cv:
            if self._held:
                return []
            return self._take_samples()

    def hold(self) -> None:
        """Stop handing out passes (requests still queue) until `release`. For tests and
        benchmarks that need several clients' requests queued together."""
        with self._cv:
            self._held += 1

    def release(self) -> None:
        with self._cv:
            self._held -= 1
            self._cv.notify_all()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()

    @property
    def closed(self) -> bool:
        return self._closed

    def next_seq(self, model_id: str) -> int:
        """The seq_id the model's queue waits for: one past the last it handed out."""
        with self._cv:
            return self._last_seq.get(model_id, 0) + 1

    def pending_for(self, model_id: str) -> int:
        """How many requests of the model are queued or in a pass still running over
        turns (split)."""
        with self._cv:
            running = sum(w.model_id == model_id for g in self._split.values() for w in g)
            return len(self._queues.get(model_id) or []) + running

    def split(self, group: list[Work]) -> None:
        """The worker runs `group` (a pass it was handed) over several turns: it comes
        back as its tenant's pass at each of that tenant's turns until `finish(group)`;
        meanwhile nothing else of its tenant or its models is handed out."""
        with self._cv:
            self._split[group[0].owner] = group

    def finish(self, group: list[Work]) -> None:
        """A split pass is over (its requests completed or failed)."""
        with self._cv:
            if self._split.get(group[0].owner) is group:
                del self._split[group[0].owner]
            self._cv.notify_all()

    def splitting(self) -> bool:
        """Whether a split pass is running (the worker then has more to do)."""
        with self._cv:
            return bool(self._split)

    def cancel(self, request_id: str) -> bool:
        """Remove a request that no pass has taken yet -> whether it was still queued. A
        cancelled ordered request counts as taken, so its model's later ones still run."""
        with self._cv:
            for w in self._samples:
                if w.request_id == request_id:
                    self._samples.remove(w)
                    self._taken([w])
                    return True
            for w in self._unordered + [w for q in self._queues.values() for w in q]:
                if w.request_id == request_id:
                    self._remove([w])
                    self._cv.notify_all()
                    return True
        return False

    def cancel_running(self, request_id: str) -> None:
        """Ask the worker to cancel a request it already took (a sample in the engine): it
        ends at the worker's next step boundary (take_cancels)."""
        with self._cv:
            self._cancels.append(request_id)
            self._cv.notify_all()

    def take_cancels(self) -> list[str]:
        """The request ids cancel_running asked for since the last call (worker side)."""
        with self._cv:
            out, self._cancels = self._cancels, []
            return out

    def forget(self, model_id: str) -> None:
        """Drop a model's seq_id history (after unload)."""
        with self._cv:
            self._last_seq.pop(model_id, None)

    # ------------------------------------------------------------------ worker side

    def gather_samples(
        self,
        gap: float,
        window: float,
        burst_gap: float | None = None,
        each: Callable[[list[Work]], None] | None = None,
        scale: float | None = None,
        taken: Sequence[Work] = (),
    ) -> tuple[list[Work], bool]:
        """The samples that arrive from now on while each comes soon after the one before —
        the first within `gap` seconds, every later one within `burst_gap` (default gap:
        once a second request has come, a burst is arriving) —, for at most `window`
        seconds (the worker admits a burst of concurrent requests into one engine step);
        stops early when other work arrives. scale: a burst's gap is then
        min(burst_gap, max(gap, scale × the largest gap between its arrivals so far)),
        counting `taken` (samples of the burst taken before) — a burst whose requests
        come 3 ms apart ends 12 ms after its last, not burst_gap. each: called (outside
        the lock) with every batch of newly arrived samples as they come (the worker
        admits and prefills them while the rest arrive); a gap counts from when it
        returns. A gather batches one tenant's burst: a sample of a second tenant (among
        `taken` or the arrivals) ends it at once, reported as still arriving, so that
        his request is not held until her burst has all come (up to `window`; the
        engine then steps his rows apart from hers: Admission, "Light steps").
        -> (samples, whether they were still arriving when the window ended)."""
        end = time.monotonic() + window
        out: list[Work] = []
        owners = {w.owner for w in taken}
        if len(owners) > 1:
            return out, True
        arriving = False
        while True:
            new: list[Work] = []
            with self._cv:
                if not self._samples:
                    wait = self._gap(gap, burst_gap, scale, taken, out)
                    left = end - time.monotonic()
                    if left <= 0:
                        arriving = bool(out)
                        break
                    self._cv.wait(min(wait, left))
                    if self._closed or self._unordered or self._queues or self._split:
                        break  # samples queued now go with the next pass (next_work)
                    if not self._samples:  # a quiet gap, or the window's end
                        arriving = bool(out) and left <= wait
                        break
                new = self._take_samples()
            out += new
            if each is not None:
                each(new)
            owners |= {w.owner for w in new}
            if len(owners) > 1:  # another tenant's sample: not held for this burst
                arriving = True
                break
        if each is None:
            with self._cv:
                out += self._take_samples()
        return out, arriving

    @staticmethod
    def _gap(
        gap: float,
        burst_gap: float | None,
        scale: float | None,
        taken: Sequence[Work],
        out: list[Work],
    ) -> float:
        """How long gather_samples waits for the next sample (its docstring)."""
        if burst_gap is None or not out and len(taken) < 2:
            return gap
        t = sorted(w.arrived_at for w in list(taken) + out)
        if scale is None or len(t) < 2:
            return burst_gap
        return min(burst_gap, max(gap, scale * max(b - a for a, b in zip(t, t[1:]))))

    def next_work(
        self, block: bool = True, timeout: float | None = None
    ) -> tuple[list[Work], list[Work]] | None:
        """(a pass — one request or a fused group, possibly empty —, every queued sample),
        or None once closed. block: wait until either exists (at most `timeout` seconds,
        then ([], [])); else return at once."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while True:
                if self._closed:
                    return None
                group, samples = [], []
                # Nothing queued, nothing to pick (the worker also wakes just to reap).
                if not self._held and (
                    self._samples or self._unordered or self._queues or self._split
                ):
                    try:
                        group = self.pick() or []
                    except Exception:  # noqa: BLE001 — a policy bug must not stop the worker
                        log.exception(
                            "scheduler: could not pick a pass; failing the oldest queued request"
                        )
                        group = self._fail_oldest() or []
                    samples = self._take_samples()
                    if group and group is not self._split.get(group[0].owner):
                        self.counters.passes += 1
                if group or samples or not block:
                    return group, samples
                wait = 0.5 if deadline is None else min(0.5, deadline - time.monotonic())
                if wait <= 0:
                    return [], []
                self._cv.wait(wait)

    def small_ready(self, but: str) -> bool:
        """Whether a tenant other than `but`, with no pass running over turns, has a ready
        forward / forward_backward of at most `pass_tokens` tokens (one micro-batch) at
        the head of a model's queue: the worker then runs it before its engine step
        (worker.py, "Interleaving policy")."""
        with self._cv:
            if not self.pass_tokens:
                return False
            now = time.monotonic()
            for m, q in self._queues.items():
                w = q[0]
                if w.owner == but or w.owner in self._split or w.kind not in FUSABLE:
                    continue
                if any(w.model_id == x.model_id for g in self._split.values() for x in g):
                    continue
                run = self._ready_run(m, now)
                if run and run[0].tokens <= self.pass_tokens:
                    return True
            return False

    def _ready_run(self, model_id: str, now: float) -> list[Work]:
        """The model's queued requests that may run now, in order: a run of consecutive
        seq_ids starting right after the last one taken."""
        q = self._queues.get(model_id) or []
        run, last = [], self._last_seq.get(model_id, 0)
        for w in q:
            if w.seq_id is None:
                if run:
                    break
                return [w]
            if w.seq_id != last + 1 and not (not run and now - w.arrived_at > GAP_TIMEOUT_S):
                break
            run.append(w)
            last = w.seq_id
        return run

    def pick(self) -> list[Work] | None:
        """The next pass (the module docstring, "Fairness")."""
        now = time.monotonic()
        busy = {w.model_id for g in self._split.values() for w in g}
        runs = {
            m: r
            for m in self._queues
            if m not in busy and self._queues[m][0].owner not in self._split
            if (r := self._ready_run(m, now))
        }
        heads: dict[str, Work] = {}  # tenant -> its oldest ready request
        for w in [r[0] for r in runs.values()] + self._unordered:
            if w.owner not in self._split and (
                w.owner not in heads or w.arrival < heads[w.owner].arrival
            ):
                heads[w.owner] = w
        first_of = {**heads, **{t: g[0] for t, g in self._split.items()}}
        if not first_of:
            return None
        tenant = min(first_of, key=lambda t: (self._served.get(t, -1), first_of[t].arrival))
        self._served[tenant] = next(self._turns)
        if tenant in self._split:
            return self._split[tenant]
        first = heads[tenant]
        if first.kind not in FUSABLE:
            self._remove([first])
            return [first]
        group, settings, tokens = [], {}, 0
        ordered = sorted(runs.values(), key=lambda r: r[0].arrival)
        admit = self.pass_room() if self.pass_room is not None else None
        if admit is not None and first.model_id is not None and not admit(first.model_id):
            admit = lambda model_id: model_id == first.model_id  # noqa: E731 — it runs alone
        for own in (True, False):
            for run in ordered:
                if (run[0].owner == tenant) != own:
                    continue
                if admit is not None and run[0].model_id != first.model_id:
                    if not admit(run[0].model_id):
                        continue
                for w in run:
                    if w.kind != first.kind:
                        break
                    loss, cfg = w.loss_key
                    if settings.get(loss, cfg) != cfg:
                        break
                    if not own and self.pass_tokens is not None:
                        if tokens + w.tokens > self.pass_tokens:
                            break
                    settings[loss] = cfg
                    group.append(w)
                    tokens += w.tokens
        self._remove(group)
        return group

    def _fail_oldest(self) -> list[Work] | None:
        queued = self._samples + self._unordered + [w for q in self._queues.values() for w in q]
        if not queued:
            return None
        w = min(queued, key=lambda w: w.arrival)
        if w in self._samples:
            self._samples.remove(w)
        elif w in self._unordered:
            self._unordered.remove(w)
        else:
            q = self._queues[w.model_id]
            q.remove(w)
            if not q:
                del self._queues[w.model_id]
        self._taken([w])
        w.failure = "the server's scheduler failed on this request"
        return [w]

    def _remove(self, works: list[Work]) -> None:
        self._taken(works)
        for w in works:
            if w.model_id is None:
                self._unordered.remove(w)
                continue
            q = self._queues[w.model_id]
            q.remove(w)
            if not q:
                del self._queues[w.model_id]
            if w.seq_id is not None:
                self._last_seq[w.model_id] = max(self._last_seq.get(w.model_id, 0), w.seq_id)

    def note_pass(self, group: list[Work]) -> None:
        """Count a Trainer forward / forward_backward call over `group`."""
        with self._cv:
            self.counters.fwd_passes += 1
            if len({w.model_id for w in group}) > 1:
                self.counters.fused_passes += 1
                self.counters.fused_requests += len(group)
