"""jcp-serve as a multi-process JAX job: process 0 leads, every other process follows.

Every process of a `jax.distributed` job holds the same Trainer over the global mesh, and a
device program runs only when every process calls it, in the same order, with the same
arguments. Process 0 serves HTTP and owns the scheduler, the state store and every decision
of the worker (jcp/server/worker.py). Each call that worker makes on the Trainer or on the
sampling engine is one `Op` (target, method, arguments: which datums and slots, which loss
and its parameters, which folder to save or load, which seed) — the host-side plan of one
step of a pass, decided once on process 0. `Leader` sends it to the followers before process
0 makes the call itself; each follower (`follow`) makes the same call on its own copies and
acknowledges it with "ok" or its error. Process 0 reads every follower's acknowledgement of a
call before it returns the next one's result, so the processes never drift apart by more
than a call, and an outcome that differs (one raised, another did not) fails the job instead
of diverging. A call that writes or reads files, or hands an object over, runs on process 0
only once every earlier call is acknowledged, and returns once it is acknowledged itself.
The calls of the training and sampling hot path (DEFERRED: forward, forward_backward,
optim_step, an engine step) do not wait: process 0 sends the op, makes the call, reads the
earlier calls' acknowledgements (which came meanwhile) and returns; its own acknowledgement
is read after the next call (or by the watcher when none comes). So neither the op's way to
a follower nor a follower's answer is on a request's path (they cost a forward_backward +
optim_step step of 8 × 512 tokens ~4 ms; benchmarks/serve_multiprocess.py). A follower that
disagrees on such a call fails the job before the next call's result is returned.

Channel: jcp/server/op_channel.py (the coordination service's key-value store).

Failure: each follower sets a heartbeat key every HEARTBEAT_S from a thread of its own; a
watcher thread on process 0 declares the job failed when a follower's heartbeat stops for
`timeout_s` (it died or stopped answering), as does an acknowledgement that does not come
within ACK_FACTOR × `timeout_s` of process 0 finishing the call (a call returns once
dispatched, so a follower may be a compile behind), or one that disagrees — also while
process 0 is still in the call: a follower that raised where process 0 went on into a
collective (which will never complete) is seen `timeout_s` after its answer. A failed job runs
`on_failure` (jcp-serve: /healthz answers 503 with the reason, pending requests fail,
new ones are refused) within about `timeout_s`, even while process 0's worker is blocked in
a collective that will never complete (jax.distributed is started with recoverability on,
so the coordination service does not abort process 0 when a follower dies). The job must
then be restarted as a whole; it resumes from --state-dir. Followers exit when process 0
stops (a "stop" op) or disappears (the store is unreachable).

Files: only process 0 writes under --state-dir, except the followers' own shards of an
orbax checkpoint (Trainer.save_state is a multi-process save); `export_peft` runs on a
follower as the same device read without the write. Followers read checkpoints and PEFT
folders they load (orbax restore, load_peft) from the same path, so --state-dir must be a
filesystem every host sees, as orbax's multi-process checkpoints need anyway.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import threading
import time

import numpy as np

from jcp import peft as peft_lib
from jcp.custom_loss import CustomLoss
from jcp.sample.engine import Engine as SampleEngine
from jcp.sample.params import SamplingParams
from jcp.server import op_channel
from jcp.server.op_channel import PREFIX, Op, Ref, receive_op, send_op, timed_out

log = logging.getLogger("jcp.serve")

DELETE_EVERY = 64  # finished calls' keys are deleted together, every this many calls
DELETE_BYTES = 8 << 20  # or once the kept ops hold this many bytes
HEARTBEAT_S = 0.5
POLL_MS = 500
ACK_FACTOR = 10  # a call's acknowledgement may come this many heartbeat timeouts late
# (target, method) of the calls whose acknowledgements are read after they return.
DEFERRED = frozenset(
    {
        ("trainer", "forward"),
        ("trainer", "forward_backward"),
        ("trainer", "optim_step"),
        ("sampling", "step"),
    }
)
# Objects a call returns that a later call passes back (the follower keeps its own), and
# the calls that use such an object up.
KEPT_RESULTS = frozenset({"offload_adapter"})
CONSUMING = frozenset({"restore_adapter"})


class JobFailed(RuntimeError):
    """A process of the job died, stopped answering or disagreed: no call can run."""


class Leader:
    """Process 0's side: `call` sends an op, runs it here, then waits for every follower's
    acknowledgement. `wrap` gives the worker proxies of its Trainer and sampling engine whose
    methods go through `call`. `on_failure(message)` runs once, from the thread that saw the
    failure."""

    def __init__(
        self,
        followers,
        timeout_s: float = 60.0,
        on_failure=None,
        client=None,
        ack_timeout_s: float | None = None,
    ):
        self.c = client or op_channel.client()
        self.followers = list(followers)
        self.timeout_s = float(timeout_s)
        # Calls return once dispatched (JAX runs them asynchronously), so a follower may
        # finish a call a whole compile later than process 0: its acknowledgement gets
        # longer than its heartbeat (which shows it alive).
        self.ack_timeout_s = float(ack_timeout_s or ACK_FACTOR * self.timeout_s)
        self.on_failure = on_failure
        self.failure: str | None = None
        self.ops = 0
        self._kept_bytes = 0  # bytes of finished calls' ops not deleted yet
        self._kept_calls = 0
        self._lock = threading.Lock()
        self._kept: dict[int, tuple[int, object]] = {}  # id(obj) -> (op n, obj)
        # Calls returned before their acknowledgements were read: (n, method, error, when
        # process 0 finished it); and the call process 0 is in: (n, method).
        self._pending: list[tuple[int, str, Exception | None, float]] = []
        self._running: tuple[int, str] | None = None
        self._stopped = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="jcp-serve-watch", daemon=True)
        self._watcher.start()

    # ------------------------------------------------------------------ proxies

    def wrap(self, trainer, sampling, engine_kw: dict):
        """(trainer proxy, sampling engine proxy); the followers build their sampling engine
        from `engine_kw` as `sampling` was built here."""
        self._send_only(Op("init_sampling", kwargs=dict(engine_kw)))
        return _Proxy(self, "trainer", trainer), _Proxy(self, "sampling", sampling)

    def share(self, obj, kind: str, *recipe) -> None:
        """Have every follower build its own `obj` from `recipe` (kind "custom_loss":
        CustomLoss.from_graph's arguments) and keep it: a call given `obj` here is given
        theirs there, until `discard(obj)`."""
        with self._lock:
            n = self._next(Op("share", kind, recipe))
            self._acks(n, f"share {kind}", None)
            self._kept[id(obj)] = (n, obj)

    def discard(self, obj) -> None:
        """Forget a kept object (an offloaded model dropped without being restored, a
        custom loss of an ended session)."""
        kept = self._kept.pop(id(obj), None)
        if kept is not None:
            self._send_only(Op("discard", args=(kept[0],)))

    # ------------------------------------------------------------------ calls

    def call(self, target: str, obj, method: str, *args, **kwargs):
        args, kwargs = self._plan(method, args, kwargs)
        sent = {k: v for k, v in kwargs.items() if k != "callback"}
        deferred = (target, method) in DEFERRED
        with self._lock:
            n = self._next(
                Op(
                    target,
                    method,
                    tuple(self._ref(a) for a in args),
                    {k: self._ref(v) for k, v in sent.items()},
                ),
                settle=not deferred,
            )
            self._running = (n, method)
            try:
                out, err = getattr(obj, method)(*args, **kwargs), None
            except Exception as e:  # noqa: BLE001 — raised after the followers answered
                out, err = None, e
            finally:
                self._running = None
            if deferred:
                # The earlier calls' answers came while this one ran; this one's is read
                # after the next call (or by the watcher).
                self._settle()
                self._pending.append((n, method, err, time.monotonic()))
            else:
                self._acks(n, method, err)
            if method in CONSUMING:
                for a in args:
                    self._kept.pop(id(a), None)
            if err is None and method in KEPT_RESULTS:
                self._kept[id(out)] = (n, out)
        if err is not None:
            raise err
        return out

    def _plan(self, method: str, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """What every process runs: a sampling seed left to chance is drawn here, once (a
        completion callback stays on process 0); an export's path is checked here first (a
        follower reads the weights without writing, so it could not refuse the path)."""
        args = tuple(_seeded(a) for a in args)
        kwargs = {k: _seeded(v) for k, v in kwargs.items()}
        if method in ("export_peft", "export_vllm"):
            path = args[1] if len(args) > 1 else kwargs["path"]
            peft_lib.check_export_path(path, f"{method}: path")
        return args, kwargs

    def _ref(self, x):
        kept = self._kept.get(id(x))
        return Ref(kept[0]) if kept is not None and kept[1] is x else x

    def _check(self) -> None:
        if self.failure is not None:
            raise JobFailed(self.failure)

    def _send_only(self, op: Op) -> None:
        with self._lock:
            self._acks(self._next(op), op.target, None)

    def _next(self, op: Op, settle: bool = True) -> int:
        """Send `op` as the next call -> its number; then, with `settle`, read every earlier
        call's acknowledgement (the op goes first: a follower still finishing the call
        before finds it as soon as it has answered that one)."""
        self._check()
        if self._kept_calls >= DELETE_EVERY or self._kept_bytes >= DELETE_BYTES:
            # With no op out and every acknowledgement read, the finished calls' keys go
            # as two whole directories.
            self._settle()
            self.c.key_value_delete(f"{PREFIX}/op")
            self.c.key_value_delete(f"{PREFIX}/ack")
            self._kept_calls = self._kept_bytes = 0
        self.ops += 1
        self._send(self.ops, op)
        if settle:
            self._settle()
        return self.ops

    def _send(self, n: int, op: Op) -> None:
        self._kept_bytes += send_op(self.c, n, op)

    def _settle(self) -> None:
        """Read the acknowledgements of the calls that returned without them (DEFERRED)."""
        while self._pending:
            n, what, err, done = self._pending[0]
            self._acks(n, what, err, done)
            self._pending.pop(0)

    def _acks(self, n: int, what: str, err: Exception | None, done: float | None = None) -> None:
        """Wait for every follower's acknowledgement of call n (process 0 finished it at
        `done`, default now); JobFailed unless each came in time and agrees with `err`."""
        deadline = (time.monotonic() if done is None else done) + self.ack_timeout_s
        for pid in self.followers:
            key = f"{PREFIX}/ack/{n}/{pid}"
            while True:
                self._check()
                try:
                    status = self.c.blocking_key_value_get(key, POLL_MS)
                    break
                except Exception as e:  # noqa: BLE001 — the store's errors are one type
                    if not timed_out(e):
                        self.fail(f"the coordination service failed: {e}")
                    elif time.monotonic() > deadline:
                        self.fail(
                            f"process {pid} did not finish {what} (call {n}) within "
                            f"{self.ack_timeout_s:.0f} s of process 0"
                        )
            self._agree(pid, n, what, status, err)
        self._kept_calls += 1

    def _agree(self, pid: int, n: int, what: str, status: str, err: Exception | None) -> None:
        if (status == "ok") != (err is None):
            mine = "ok" if err is None else f"{type(err).__name__}: {err}"
            self.fail(
                f"process {pid} disagreed on {what} (call {n}): it answered "
                f"{status!r}, process 0 {mine!r}"
            )

    def fail(self, message: str) -> None:
        """Declare the job failed (once) and raise JobFailed."""
        first = False
        if self.failure is None:
            self.failure, first = (
                (
                    f"{message}; this multi-process job must be restarted "
                    "(it resumes from --state-dir)"
                ),
                True,
            )
            log.error("jcp-serve job failed: %s", self.failure)
        if first and self.on_failure is not None:
            try:
                self.on_failure(self.failure)
            except Exception:  # noqa: BLE001
                log.exception("on_failure")
        raise JobFailed(self.failure)

    # ------------------------------------------------------------------ liveness

    def _watch(self) -> None:
        seen = {pid: (None, time.monotonic()) for pid in self.followers}
        raised: dict[tuple[int, int], float] = {}  # (call, pid) -> when seen failing
        while not self._stopped.wait(HEARTBEAT_S) and self.failure is None:
            now = time.monotonic()
            try:
                for pid in self.followers:
                    beat = self._try_get(f"{PREFIX}/alive/{pid}")
                    if beat is None or beat != seen[pid][0]:  # not started yet, or alive
                        seen[pid] = (beat, now)
                    elif now - seen[pid][1] > self.timeout_s:
                        self.fail(
                            f"process {pid} stopped answering (no heartbeat for "
                            f"{self.timeout_s:.0f} s)"
                        )
                self._watch_calls(now, raised)
            except JobFailed:
                return

    def _watch_calls(self, now: float, raised: dict) -> None:
        """Fail the job on a returned call's acknowledgement that disagrees or is late
        (DEFERRED, with no next call to read it), and on a follower that raised in the call
        process 0 is still in after `timeout_s`."""
        for entry in list(self._pending):
            n, what, err, done = entry
            for pid in self.followers:
                status = self._try_get(f"{PREFIX}/ack/{n}/{pid}")
                if entry not in self._pending:  # read (and maybe deleted) by the call
                    return
                if status is not None:
                    self._agree(pid, n, what, status, err)
                elif now - done > self.ack_timeout_s:
                    self.fail(
                        f"process {pid} did not finish {what} (call {n}) within "
                        f"{self.ack_timeout_s:.0f} s of process 0"
                    )
        running = self._running
        for key in [k for k in raised if running is None or k[0] != running[0]]:
            del raised[key]
        if running is None:
            return
        n, what = running
        for pid in self.followers:
            status = self._try_get(f"{PREFIX}/ack/{n}/{pid}")
            if status is None or status == "ok":
                continue
            first = raised.setdefault((n, pid), now)
            if now - first > self.timeout_s and self._running == running:
                self.fail(
                    f"process {pid} raised in {what} (call {n}): {status!r}, and "
                    f"process 0 has not finished it {self.timeout_s:.0f} s later"
                )

    def _try_get(self, key: str) -> str | None:
        try:
            return self.c.key_value_try_get(key)
        except Exception:  # noqa: BLE001 — not set (yet)
            return None

    @property
    def unacknowledged(self) -> int:
        """Calls made whose followers' acknowledgements are not read yet (deferred)."""
        return len(self._pending)

    def stop_heartbeat(self) -> None:
        """Stop this process's heartbeat without a word to the followers (they are left to
        their own timeout: a follower told to stop exits its process)."""
        self._stopped.set()

    def stop(self) -> None:
        """Tell the followers to exit (unless the job already failed)."""
        if self.failure is None:
            try:
                self._send_only(Op("stop"))
            except JobFailed:
                pass
        self._stopped.set()


class _Proxy:
    """An object whose methods run on every process (Leader.call); plain attributes are
    read here."""

    def __init__(self, leader: Leader, target: str, obj):
        self._leader, self._target, self._obj = leader, target, obj

    def __getattr__(self, name):
        value = getattr(self._obj, name)
        if not callable(value):
            return value
        return functools.partial(self._leader.call, self._target, self._obj, name)

    def discard(self, obj) -> None:
        self._leader.discard(obj)


def _seeded(x):
    if isinstance(x, SamplingParams) and x.seed is None:
        return dataclasses.replace(x, seed=int(np.random.SeedSequence().entropy % (1 << 63)))
    return x


# ---------------------------------------------------------------------- followers


def follow(trainer, client=None, process_id: int | None = None) -> int:
    """A follower's loop: run every op process 0 sends on `trainer` (and the sampling
    engine it asks for) until told to stop (the process exits 0) or process 0 is gone
    (-> 1)."""
    import jax

    c = client or op_channel.client()
    pid = jax.process_index() if process_id is None else process_id
    stop = threading.Event()

    def beat():
        k = 0
        while not stop.wait(HEARTBEAT_S):
            k += 1
            try:
                c.key_value_set(f"{PREFIX}/alive/{pid}", str(k), allow_overwrite=True)
            except Exception:  # noqa: BLE001 — process 0 is gone; the loop sees it too
                return

    threading.Thread(target=beat, name="jcp-serve-heartbeat", daemon=True).start()
    objs: dict[str, object] = {"trainer": trainer}
    kept: dict[int, object] = {}
    n = 0
    try:
        while True:
            n += 1
            op = receive_op(c, n)
            if op is None:
                log.error("process %d: process 0 is gone; exiting", pid)
                return 1
            status = "ok"
            try:
                out = _run(op, objs, kept, trainer)
                if op.method in KEPT_RESULTS or op.target == "share":
                    kept[n] = out
            except Exception as e:  # noqa: BLE001 — reported to process 0, which decides
                status = f"{type(e).__name__}: {e}"
            c.key_value_set(f"{PREFIX}/ack/{n}/{pid}", status)
            if op.target == "stop":
                # Leave now: a normal exit's jax.distributed shutdown would race process 0
                # tearing the coordination service down (and abort this process).
                logging.shutdown()
                os._exit(0)
    finally:
        stop.set()


def _run(op: Op, objs: dict, kept: dict, trainer):
    if op.target == "stop":
        return None
    if op.target == "init_sampling":
        objs["sampling"] = SampleEngine(trainer.make_sampler(), **op.kwargs)
        return None
    if op.target == "discard":
        kept.pop(op.args[0], None)
        return None
    if op.target == "share":  # op.method == "custom_loss"
        return CustomLoss.from_graph(*op.args)
    if op.target == "sampling" and op.method in ("submit", "submit_logprobs"):
        # Process 0 answers the client; here a finished request is just forgotten (an
        # engine keeps no outcome of a request that has a callback).
        op.kwargs["callback"] = _forget
    take = kept.pop if op.method in CONSUMING else kept.__getitem__
    args = tuple(take(a.n) if isinstance(a, Ref) else a for a in op.args)
    kwargs = {k: take(v.n) if isinstance(v, Ref) else v for k, v in op.kwargs.items()}
    if op.target == "trainer" and op.method in ("export_peft", "export_vllm"):
        # The same device read, no file: only process 0 writes the folder.
        return trainer.adapter_weights(args[0] if args else kwargs["adapter"])
    return getattr(objs[op.target], op.method)(*args, **kwargs)


def _forget(rid, outcome) -> None:
    """A follower's completion callback: nothing to answer."""
