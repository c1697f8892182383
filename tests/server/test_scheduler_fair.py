"""Scheduler fairness across tenants (no jax, no timing): passes go round robin over
tenants, a pass of several micro-batches runs one per turn (split / finish) with other
tenants' passes between, other tenants join a pass only within pass_tokens, and every
tenant's and model's requests keep their order. A stub worker plays jcp-serve's: a pass
of more than PASS tokens is split into ⌈tokens / PASS⌉ micro-batches, one per turn.
"""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace

from jcp.server.scheduler import Scheduler, Work

PASS = 1024
_ids = itertools.count()


def fwd(owner: str, model: str, seq: int, tokens: int, kind: str = "forward_backward") -> Work:
    data = [(list(range(tokens)), {})]
    return Work(
        request_id=f"{owner}-{next(_ids)}",
        kind=kind,
        model_id=model,
        seq_id=seq,
        payload=SimpleNamespace(data=data),
        owner=owner,
        loss_key=("cross_entropy", ()),
    )


def op(owner: str, model: str, seq: int, kind: str = "optim_step") -> Work:
    return Work(f"{owner}-{next(_ids)}", kind, model, seq, {}, owner)


class StubWorker:
    """Takes passes as jcp-serve's worker does; `log` holds one entry per turn:
    (tenant, request ids of the pass, micro-batch index or None for a whole pass)."""

    def __init__(self, sched: Scheduler):
        self.sched, self.log, self.done = sched, [], []
        self.splits: dict[str, tuple] = {}  # tenant -> (group, micro-batches, done so far)

    def turn(self) -> bool:
        group, _ = self.sched.next_work(block=False)
        if not group:
            return False
        ids, tenant = [w.request_id for w in group], group[0].owner
        if tenant in self.splits and group is self.splits[tenant][0]:
            g, n, k = self.splits[tenant]
            self.log.append((tenant, ids, k))
            if k + 1 == n:
                del self.splits[tenant]
                self.sched.finish(g)
                self.done += ids
            else:
                self.splits[tenant] = (g, n, k + 1)
            return True
        tokens = sum(w.tokens or 0 for w in group)
        if tokens > PASS:
            self.splits[tenant] = (group, math.ceil(tokens / PASS), 1)
            self.sched.split(group)
            self.log.append((tenant, ids, 0))
        else:
            self.log.append((tenant, ids, None))
            self.done += ids
        return True

    def drain(self, most: int = 1000) -> None:
        for _ in range(most):
            if not self.turn():
                return
        raise AssertionError("the scheduler never ran dry")


def test_a_small_request_waits_for_at_most_one_micro_batch_of_a_big_neighbour():
    sched = Scheduler(pass_tokens=PASS)
    # alice's queue full of big work on two models: forwards of 8 micro-batches each.
    for seq in range(1, 6):
        sched.submit(fwd("alice", "a1", seq, 8 * PASS, "forward"))
        sched.submit(fwd("alice", "a2", seq, 8 * PASS, "forward"))
    worker = StubWorker(sched)
    worker.turn()
    assert "alice" in worker.splits  # alice's first pass runs over turns
    small = fwd("bob", "b", 1, 16, "forward")
    sched.submit(small)
    worker.turn()  # at most one more of alice's micro-batches ...
    if small.request_id not in worker.done:
        worker.turn()
    assert small.request_id in worker.done  # ... and bob's request has run
    owner, ids, k = worker.log[-1]
    assert owner == "bob" and ids == [small.request_id] and k is None
    # alice's pass then goes on where it was; bob never joined a pass of hers.
    worker.drain()
    assert [e for e in worker.log if "bob" in str(e[1])] == [("bob", [small.request_id], None)]


def test_tenants_alternate_turn_by_turn():
    sched = Scheduler(pass_tokens=PASS)
    for seq in range(1, 4):
        sched.submit(fwd("alice", "a", seq, 3 * PASS))
        sched.submit(op("bob", "b", 2 * seq - 1, "save_weights"))
        sched.submit(op("bob", "b", 2 * seq))
    worker = StubWorker(sched)
    worker.drain()
    owners = [o for o, _, _ in worker.log]
    # Each tenant's turn is one micro-batch or one operation, alternately, while both wait.
    assert owners[:12] == ["alice", "bob"] * 6
    assert owners.count("alice") == 9 and owners.count("bob") == 6


def test_each_tenants_and_models_requests_keep_their_order():
    sched = Scheduler(pass_tokens=PASS)
    plan = {
        "alice": [
            fwd("alice", "a", 1, 5 * PASS),
            op("alice", "a", 2),
            fwd("alice", "a", 3, 100),
            op("alice", "a", 4, "save_weights"),
            fwd("alice", "a2", 1, 2 * PASS, "forward"),
        ],
        "bob": [fwd("bob", "b", 1, 32), op("bob", "b", 2), fwd("bob", "b", 3, 2000)],
        "carol": [fwd("carol", "c", 1, 64, "forward"), op("carol", "c", 2)],
    }
    for w in itertools.chain.from_iterable(itertools.zip_longest(*plan.values())):
        if w is not None:
            sched.submit(w)
    worker = StubWorker(sched)
    worker.drain()
    started = [i for _, ids, k in worker.log if k in (None, 0) for i in ids]
    for tenant, works in plan.items():
        ids = [w.request_id for w in works]
        assert [i for i in started if i in ids] == ids, tenant
        assert [i for i in worker.done if i in ids] == ids, tenant
    # While alice's first pass ran over 5 turns, bob and carol were served between them.
    first = [n for n, (_, ids, _) in enumerate(worker.log) if ids == [plan["alice"][0].request_id]]
    between = {worker.log[n][0] for n in range(first[0], first[-1])}
    assert {"bob", "carol"} <= between
    # Nothing of alice ran while her pass was split (her later requests waited for it).
    assert all(worker.log[n][0] != "alice" or n in first for n in range(first[0], first[-1]))


def test_one_tenant_is_served_first_come_first_served_with_full_fusion():
    """A single tenant's passes are what first come, first served gives: every ready
    forward_backward of its models fused into one pass, however large."""
    sched = Scheduler(pass_tokens=PASS)
    works = [
        fwd("alice", "a1", 1, 3 * PASS),
        fwd("alice", "a2", 1, 2 * PASS),
        fwd("alice", "a1", 2, 10),
        op("alice", "a2", 2),
        op("alice", "a1", 3),
    ]
    for w in works:
        sched.submit(w)
    group, _ = sched.next_work(block=False)
    # Model by model (each model's run in seq_id order), the models by their heads' arrival.
    assert [w.request_id for w in group] == [works[i].request_id for i in (0, 2, 1)]
    assert [w.request_id for w in sched.next_work(block=False)[0]] == [works[3].request_id]
    assert [w.request_id for w in sched.next_work(block=False)[0]] == [works[4].request_id]


def test_other_tenants_join_a_pass_only_within_pass_tokens():
    sched = Scheduler(pass_tokens=PASS)
    a, b, c = fwd("alice", "a", 1, 500), fwd("bob", "b", 1, 400), fwd("carol", "c", 1, 200)
    for w in (a, b, c):
        sched.submit(w)
    # alice's turn; bob's fits beside hers, carol's would not (500 + 400 + 200 > PASS).
    assert sched.next_work(block=False)[0] == [a, b]
    assert sched.next_work(block=False)[0] == [c]
    big, small = fwd("alice", "a", 2, 4 * PASS), fwd("bob", "b", 2, 16)
    sched.submit(big)
    sched.submit(small)
    # bob was served before alice's last turn: his small request goes first, alone, and
    # never rides in alice's large pass.
    assert sched.next_work(block=False)[0] == [small]
    assert sched.next_work(block=False)[0] == [big]
    # pass_tokens 0: passes never mix tenants.
    sched = Scheduler(pass_tokens=0)
    for w in (fwd("alice", "a", 1, 5), fwd("bob", "b", 1, 5)):
        sched.submit(w)
    assert len(sched.next_work(block=False)[0]) == 1


def test_a_split_pass_keeps_its_models_and_is_counted_as_pending():
    sched = Scheduler(pass_tokens=PASS)
    big, after = fwd("alice", "a", 1, 4 * PASS), op("alice", "a", 2)
    sched.submit(big)
    sched.submit(after)
    group, _ = sched.next_work(block=False)
    sched.split(group)
    assert sched.splitting() and sched.pending_for("a") == 2
    # Only alice has work: her split pass comes back, never her optim_step behind it.
    for _ in range(3):
        assert sched.next_work(block=False)[0] is group
    sched.finish(group)
    assert not sched.splitting()
    assert sched.next_work(block=False)[0] == [after]


def test_a_pass_holds_only_the_models_that_fit_the_device():
    """pass_room bounds the models of one pass (the worker: its adapter slots and pages);
    the first is always taken, a model that does not fit waits for the next pass, and a
    model's requests stay together and in order."""
    sizes = {"m0": 2, "m1": 1, "m2": 2, "m3": 1, "m4": 1}

    def room():
        left = {"pages": 3}

        def admit(model_id):
            if sizes[model_id] > left["pages"]:
                return False
            left["pages"] -= sizes[model_id]
            return True

        return admit

    sched = Scheduler(pass_tokens=None, pass_room=room)
    works = [fwd("alice", m, 1, 10) for m in sizes] + [fwd("alice", "m0", 2, 10)]
    for w in works:
        sched.submit(w)
    passes = []
    while group := sched.next_work(block=False)[0]:
        passes.append([(w.model_id, w.seq_id) for w in group])
    # m0 (2 pages) + m1 (1); m2 + m3; m4. m0's two requests ride together.
    assert passes == [[("m0", 1), ("m0", 2), ("m1", 1)], [("m2", 1), ("m3", 1)], [("m4", 1)]]
    # Without the bound, one pass.
    sched = Scheduler(pass_tokens=None)
    for m in sizes:
        sched.submit(fwd("alice", m, 1, 10))
    assert len(sched.next_work(block=False)[0]) == len(sizes)
    # A first model larger than the room still runs (alone): no starvation.
    sizes["big"] = 9
    sched = Scheduler(pass_tokens=None, pass_room=room)
    sched.submit(fwd("alice", "big", 1, 10))
    sched.submit(fwd("alice", "m1", 1, 10))
    assert [w.model_id for w in sched.next_work(block=False)[0]] == ["big"]


def test_small_ready_names_another_tenants_one_micro_batch_pass():
    """small_ready(tenant): another tenant, with no pass of its own running over turns,
    has a ready forward / forward_backward of at most one micro-batch — the worker runs
    it before its engine step, after one of `tenant`'s micro-batches."""
    sched = Scheduler(pass_tokens=PASS)
    sched.submit(fwd("alice", "a", 1, 4 * PASS))
    big = sched.next_work(block=False)[0]
    sched.split(big)
    assert not sched.small_ready("alice")  # nothing else queued
    sched.submit(fwd("alice", "a2", 1, 16))
    assert not sched.small_ready("alice")  # her own
    sched.submit(fwd("bob", "b", 2, 16))
    assert not sched.small_ready("alice")  # not ready: bob's seq_id 1 has not come
    sched.submit(fwd("carol", "c", 1, 2 * PASS))
    assert not sched.small_ready("alice")  # more than one micro-batch
    sched.submit(op("bob", "b", 1))
    assert not sched.small_ready("alice")  # an optim_step heads bob's queue
    sched.submit(fwd("dan", "d", 1, PASS))
    assert sched.small_ready("alice") and not sched.small_ready("dan")
    assert not Scheduler(pass_tokens=0).small_ready("alice")
