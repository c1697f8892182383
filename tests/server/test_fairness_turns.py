"""The worker's turn when a tenant's pass spans several micro-batches (issue 36,
fairness), host only: a stub Trainer call, the real Passes and Scheduler.

The first turn of such a pass validated and packed the whole call (O(its datums) on the
host: ~30 ms for 64 × 1,023 tokens) and then ran its first micro-batch, so another
tenant's small request waited for both. The first turn now only prepares the call; its
micro-batches run one per later turn, and the results are those of the one call. Also the
worker's count of whole sample bursts (Bursts) and its GC freeze.
"""

from __future__ import annotations

from types import SimpleNamespace

from jcp.server import scheduler, worker
from jcp.server.passes import Passes
from jcp.server.scheduler import Scheduler, Work
from jcp.server.worker import Worker


class _Steps:
    """A Trainer call of `passes` micro-batches (jcp.trainer.Steps' face)."""

    def __init__(self, passes: int):
        self.passes, self.ran, self.output = passes, 0, None

    def step(self, settle: bool = False) -> bool:
        self.ran += 1
        if self.ran == self.passes:
            self.output = "the call's output"
        return self.ran == self.passes


class _Worker(Passes):
    def __init__(self, passes: int):
        self._init_passes()
        self.sched, self.leader = Scheduler(pass_tokens=64), None
        self.tr = SimpleNamespace(cfg=SimpleNamespace(is_moe=False))
        self.sampling = SimpleNamespace(idle=True)
        self.steps, self.completed = _Steps(passes), []

    def _start_fwd(self, group):
        return self.steps, [(0, 1)]

    def _fwd_results(self, group, out, spans):
        return [("proto", out)]

    def _complete(self, rid, out):
        self.completed.append((rid, out))


def _work(owner: str) -> Work:
    return Work("r1", "forward", "m1", 1, SimpleNamespace(loss_fn="cross_entropy"), owner)


def test_a_split_pass_first_turn_prepares_only():
    w = _Worker(passes=3)
    w.start_pass([_work("alice")])
    assert w.steps.ran == 0 and "alice" in w.splits  # prepared, no micro-batch yet
    assert w.sched.splitting()
    for turn in range(3):
        assert not w.completed
        w.advance_pass("alice")
        assert w.steps.ran == turn + 1
    assert w.completed == [("r1", ("proto", "the call's output"))]
    assert not w.splits and not w.sched.splitting()


def test_a_pass_of_one_micro_batch_runs_whole_in_its_turn():
    w = _Worker(passes=1)
    w.start_pass([_work("alice")])
    assert w.steps.ran == 1 and w.completed and not w.splits


class _Turn(Worker):
    """A Worker holding only what its turn after a pass reads (the scheduler, the engine's
    state and steps), as _Worker holds only what Passes reads."""

    def __init__(self, light_next: frozenset | None, idle: bool = False):
        self.sched, self.sampling = Scheduler(), SimpleNamespace(idle=idle)
        self._unlogged, self.admitted, self.steps = [], [], []
        self._admit_sample = self.admitted.append
        self._light_next = lambda: light_next
        self.engine_step = lambda hurry, decode: self.steps.append(
            (hurry, decode, self.sched.light_work.allows("alice"))
        )
        self.after_pass = self._light_after_pass


def _sample(owner: str) -> Work:
    return Work(f"s-{owner}", "sample", None, None, None, owner)


def test_a_light_sample_that_came_during_a_pass_steps_before_the_turns_engine_step():
    """bob's sample arrived while alice's micro-batch ran: it used to wait for the turn's
    engine step (alice's rows: the steps alternate) and then its own at the next turn.
    Now it is admitted after the pass and, the engine's next step being his, stepped
    before the turn's engine step."""
    t = _Turn(light_next=frozenset({"bob"}))
    t.sched.submit(_sample("bob"))
    t.after_pass()
    # (the event loop gave way to bob's step: alice's turns waited for it)
    assert [w.owner for w in t.admitted] == ["bob"] and t.steps == [(True, True, False)]
    assert t.sched.light_work.allows("alice")  # and got them after
    assert t.sched.samples_queued() == 0
    # Not a light tenant's next step (one tenant alone, say): admitted, no extra step.
    t = _Turn(light_next=None)
    t.sched.submit(_sample("alice"))
    t.after_pass()
    assert len(t.admitted) == 1 and t.steps == []
    # An idle engine gathers a burst at the next turn, as before; a held scheduler keeps
    # its samples queued.
    bob = frozenset({"bob"})
    for t, held in ((_Turn(light_next=bob, idle=True), False), (_Turn(light_next=bob), True)):
        if held:
            t.sched.hold()
        t.sched.submit(_sample("bob"))
        t.after_pass()
        assert t.admitted == [] and t.steps == [] and t.sched.samples_queued() == 1


def _small_sample(owner: str, k: int = 0, max_tokens: int = 4) -> Work:
    payload = SimpleNamespace(num_samples=1, prompt=[1] * 8, max_tokens=max_tokens)
    return Work(f"s-{owner}-{k}", "sample", None, None, payload, owner)


def test_light_first_puts_the_light_tenants_samples_first_each_in_order():
    bob = [_small_sample("bob", k) for k in range(scheduler.LIGHT_QUEUED)]
    alice = [_small_sample("alice", k) for k in range(scheduler.LIGHT_QUEUED + 1)]  # a burst
    carol = [_small_sample("carol", max_tokens=scheduler.LIGHT_PASS_TOKENS)]  # one long one
    taken = [alice[0], bob[0], carol[0], *alice[1:], bob[1]]
    first, rest = scheduler.light_first(taken)
    assert first == bob
    assert rest == [alice[0], carol[0], *alice[1:]]
    assert scheduler.light_first(alice[:1]) == (alice[:1], [])  # one small sample is light


class _OrderTurn(_Turn):
    """A _Turn that notes the order of its admissions (by owner) and engine steps
    ("step"); the engine's next step is bob's alone while his admitted sample waits for
    one."""

    def __init__(self):
        super().__init__(light_next=None)
        self.order, self.unstepped = [], set()
        self._admit_sample = self.admit
        self.engine_step = self.step
        self._light_next = lambda: frozenset({"bob"}) if "bob" in self.unstepped else None
        self.admit_taken = self._admit_taken

    def admit(self, w):
        self.order.append(w.owner)
        self.unstepped.add(w.owner)

    def step(self, hurry, decode):
        self.order.append("step")
        self.unstepped.clear()


def test_a_light_sample_taken_with_a_burst_steps_before_the_burst_is_admitted():
    """bob's sample taken together with alice's burst (after a pass of hers, or at the
    turn's start): each admission is ~0.1 ms of Python on the worker under load, and his
    step waited for all of hers (12-19 ms for 256). His are now admitted first and, the
    engine's next step being his, stepped before hers are admitted; hers then step as
    before."""
    for start in (True, False):  # taken at the turn's start, or after the pass
        t = _OrderTurn()
        for k in range(8):
            t.sched.submit(_small_sample("alice", k))
        t.sched.submit(_small_sample("bob"))
        if start:
            t.admit_taken(t.sched.take_samples())
        else:
            t.after_pass()
        assert t.order == ["bob", "step"] + ["alice"] * 8, t.order
    # Alone, a light tenant's samples are admitted with no step of their own.
    t = _OrderTurn()
    t.sched.submit(_small_sample("bob"))
    t.admit_taken(t.sched.take_samples())
    assert t.order == ["bob"]


class _PassTurn(_Turn):
    """A _Turn whose pass only notes whether the event loop's turns were open to bob and
    to alice while it ran."""

    def __init__(self):
        super().__init__(light_next=None)
        self.splits, self.seen = {}, []

    def _run_pass(self, group):
        self.seen.append(
            (self.sched.light_work.allows("bob"), self.sched.light_work.allows("alice"))
        )

    def run(self, kind, tokens, owner="bob"):
        """One pass of `owner`'s, as the worker's turn runs it -> what it saw."""
        group = [Work("r", kind, "m", 0, None, owner, tokens=tokens)]
        with self._giving_way(group):
            self._run_pass(group)
        assert self.sched.light_work.allows("alice")  # given back once the pass ends
        return self.seen.pop()


def test_the_event_loop_gives_way_to_small_passes_only():
    """While the worker runs a small forward / forward_backward (at most
    LIGHT_PASS_TOKENS tokens, not split over turns), the event loop's turns go to its
    tenants only (LightWork); a large pass, a split one, and a model operation leave the
    turns to every tenant."""
    t = _PassTurn()
    assert t.run("forward", 16) == (True, False)
    assert t.run("forward_backward", scheduler.LIGHT_PASS_TOKENS) == (True, False)
    assert t.run("forward", scheduler.LIGHT_PASS_TOKENS + 1) == (True, True)
    assert t.run("optim_step", None) == (True, True)
    t.splits = {"bob": None}  # bob's pass runs over turns
    assert t.run("forward", 16) == (True, True)


def _small_fwd(owner: str, seq: int, tokens: int = 16) -> Work:
    return Work(
        f"{owner}-{seq}", "forward", f"m-{owner}", seq, None, owner, ("ce", ()), tokens=tokens
    )


def test_the_event_loop_holds_heavy_tenants_while_a_light_request_waits(monkeypatch):
    """While a light tenant's small request waits for the worker (LightWork.wait), the
    unit it waits for is a heavy tenant's, whose requests the loop then holds so that the
    unit gets the cores: the loop's turns of heavy tenants (more than LIGHT_QUEUED queued,
    or a pass split over turns) wait until the worker takes the light request, for at most
    HOLD_MAX_S; everyone else's go on. A large request, or one of a heavy tenant, holds
    nobody."""
    from jcp.server import scheduler as sched_lib

    s = Scheduler(pass_tokens=1024)
    lw = s.light_work
    for k in range(1, 5):  # alice: heavy by her queue
        s.submit(_small_fwd("alice", k))
    assert s.heavy("alice") and lw.allows("alice")  # her own requests hold nobody
    s.submit(_small_fwd("bob", 1))
    assert not s.heavy("bob")
    assert (lw.allows("alice"), lw.allows("bob"), lw.allows("carol")) == (False, True, True)
    group, _ = s.next_work(block=False)  # alice's pass, bob's request riding along
    assert "bob" in {w.owner for w in group} and lw.allows("alice")

    # A small sample waits until the worker takes the samples; a cancelled one no longer.
    for k in range(5, 9):
        s.submit(_small_fwd("alice", k))
    small = SimpleNamespace(num_samples=1, prompt=[1] * 8, max_tokens=4)
    s.submit(Work("b-s", "sample", None, None, small, "bob"))
    assert not lw.allows("alice")
    s.take_samples()
    assert lw.allows("alice")
    s.submit(Work("b-s2", "sample", None, None, small, "bob"))
    assert not lw.allows("alice") and s.cancel("b-s2") and lw.allows("alice")

    # A large forward, a large sample, or a tenant with a pass split over turns: nobody
    # held.
    assert s.heavy("alice")
    s.submit(_small_fwd("bob", 2, tokens=sched_lib.LIGHT_PASS_TOKENS + 1))
    big = SimpleNamespace(num_samples=64, prompt=[1] * 8, max_tokens=1000)
    s.submit(Work("b-big", "sample", None, None, big, "bob"))
    assert lw.allows("alice")
    s.split([_small_fwd("dave", 1, tokens=4096)])
    s.submit(_small_fwd("dave", 2))
    assert s.heavy("dave") and lw.allows("alice")

    # The hold lapses after HOLD_MAX_S while light requests keep waiting.
    now = [100.0]
    monkeypatch.setattr(sched_lib.time, "monotonic", lambda: now[0])
    s = Scheduler()
    for k in range(1, 5):
        s.submit(_small_fwd("alice", k))
    s.submit(_small_fwd("carol", 1))
    assert not s.light_work.allows("alice")
    now[0] += sched_lib.HOLD_MAX_S / 2
    s.submit(_small_fwd("dave", 1))  # a second waiter does not extend the hold
    assert not s.light_work.allows("alice")
    now[0] += sched_lib.HOLD_MAX_S
    assert s.light_work.allows("alice")


def test_what_exists_before_serving_is_frozen_out_of_the_cyclic_gc():
    """A full collection stops every thread for as long as it scans the objects that
    survived earlier ones (0.2-0.78 s beside the noisy neighbour, the model and programs
    included): Worker.start freezes what exists before serving, stop unfreezes it."""
    import gc

    from jcp.server.collector import Freezer
    from jcp.server.worker import Worker

    started = []
    w = SimpleNamespace(
        _collector=Freezer(),
        _thread=SimpleNamespace(start=lambda: started.append(1), join=lambda timeout: None),
        sched=Scheduler(),
        failure=lambda: None,
        leader=None,
    )
    gc.unfreeze()
    try:
        Worker.start(w)
        assert started and gc.get_freeze_count() > 0
    finally:
        Worker.stop(w)
    assert gc.get_freeze_count() == 0 and w.sched.closed


def test_a_new_server_counts_its_bursts_calm_until_a_straggler_joins_one(monkeypatch):
    """Bursts (jcp.server.worker): a new server's first gathered bursts decode at full
    speed (calm), not in hurried short steps; a burst that a sample joined while it ran
    makes the next ones hurried until ADMIT_CALM_BURSTS in a row came whole."""
    monkeypatch.setattr(worker, "ADMIT_CALM_BURSTS", 2)
    b = worker.Bursts()
    assert b.gathered()  # the first burst of a new server
    b.running(True)
    assert b.gathered()  # it came whole
    b.running(True)
    b.joined()  # a straggler came while this one ran
    calm = []
    for _ in range(4):
        calm.append(b.gathered())
        b.running(True)
    assert calm == [False, False, True, True]  # whole twice in a row: calm again
    b.running(False)  # a burst that ended in its first step counts for nothing
    b.joined()
    assert b.gathered()
