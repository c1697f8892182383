"""jcp/server/replica.py's Leader and follower over an in-memory key-value store (the
coordination service's client API): which calls return before the followers' answers, and
that a follower which disagrees, or raises where process 0 is stuck, fails the job in
bounded time. The 2-process jobs themselves: test_serve_multiprocess.py."""

from __future__ import annotations

import threading
import time

import pytest

from jcp.server import replica

TIMEOUT_S = 1.0


class Store:
    """The subset of jax.distributed's client that replica uses, in memory."""

    def __init__(self):
        self.kv: dict[str, object] = {}
        self.cond = threading.Condition()
        self.closed = False

    def key_value_set(self, key, value, allow_overwrite=False):
        with self.cond:
            if key in self.kv and not allow_overwrite:
                raise RuntimeError(f"ALREADY_EXISTS: {key}")
            self.kv[key] = value
            self.cond.notify_all()

    key_value_set_bytes = key_value_set

    def blocking_key_value_get(self, key, timeout_ms):
        with self.cond:
            if not self.cond.wait_for(lambda: key in self.kv or self.closed, timeout_ms / 1e3):
                raise RuntimeError(f"DEADLINE_EXCEEDED: {key}")
            if self.closed:
                raise RuntimeError("UNAVAILABLE: closed")
            return self.kv[key]

    blocking_key_value_get_bytes = blocking_key_value_get

    def key_value_try_get(self, key):
        with self.cond:
            if key not in self.kv:
                raise RuntimeError(f"NOT_FOUND: {key}")
            return self.kv[key]

    def key_value_delete(self, key):
        with self.cond:
            for k in [k for k in self.kv if k == key or k.startswith(key + "/")]:
                del self.kv[k]

    def close(self):
        with self.cond:
            self.closed = True
            self.cond.notify_all()


class FakeTrainer:
    """forward_backward(x) -> 2x and save_state(x) -> x, each after `gate` opens; raises
    where `raising` says."""

    def __init__(self):
        self.gate = threading.Event()
        self.gate.set()
        self.raising: set[str] = set()
        self.calls: list[str] = []

    def _run(self, name, value):
        self.gate.wait()
        self.calls.append(name)
        if name in self.raising:
            raise ValueError(f"{name} refused")
        return value

    def forward_backward(self, x):
        return self._run("forward_backward", 2 * x)

    def save_state(self, x):
        return self._run("save_state", x)


@pytest.fixture
def job():
    store, mine, theirs, failures = Store(), FakeTrainer(), FakeTrainer(), []
    follower = threading.Thread(
        target=replica.follow, args=(theirs,), kwargs=dict(client=store, process_id=1), daemon=True
    )
    follower.start()
    leader = replica.Leader([1], TIMEOUT_S, on_failure=failures.append, client=store)
    yield leader, mine, theirs, failures
    leader.stop_heartbeat()
    store.close()
    follower.join(timeout=15)
    assert not follower.is_alive()


def _in_thread(fn, *args):
    out = {}

    def run():
        try:
            out["value"] = fn(*args)
        except Exception as e:  # noqa: BLE001
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def test_hot_path_calls_return_before_the_followers_answer(job):
    leader, mine, theirs, failures = job
    assert ("trainer", "forward_backward") in replica.DEFERRED
    assert ("trainer", "save_state") not in replica.DEFERRED
    theirs.gate.clear()  # the follower is slow to finish each call
    # A save is answered only once the follower has made it too ...
    t, out = _in_thread(leader.call, "trainer", mine, "save_state", 1)
    t.join(timeout=1.0)
    assert t.is_alive() and theirs.calls == []
    theirs.gate.set()
    t.join(timeout=10)
    assert out == {"value": 1} and theirs.calls == ["save_state"]
    # ... a forward_backward as soon as process 0 has made it, and the next one too: it
    # waits only for the answers to the calls before it.
    theirs.gate.clear()
    assert leader.call("trainer", mine, "forward_backward", 3) == 6
    assert theirs.calls == ["save_state"] and leader.unacknowledged == 1
    t, out = _in_thread(leader.call, "trainer", mine, "forward_backward", 5)
    t.join(timeout=1.0)
    assert t.is_alive() and mine.calls == ["save_state", "forward_backward", "forward_backward"]
    theirs.gate.set()
    t.join(timeout=10)
    assert out == {"value": 10} and leader.unacknowledged == 1
    # The next call reads its acknowledgement first.
    theirs.gate.set()
    assert leader.call("trainer", mine, "save_state", 4) == 4
    assert theirs.calls == ["save_state", "forward_backward", "forward_backward", "save_state"]
    assert not leader.unacknowledged and failures == [] and leader.failure is None


@pytest.mark.parametrize("then", ["save_state", "forward_backward"])
def test_a_follower_disagreeing_on_a_returned_call_fails_the_next(job, then):
    """The next call fails: a save before it runs on process 0; a hot-path call (which
    reads the earlier answers after it ran) before its result is returned."""
    leader, mine, theirs, failures = job
    theirs.raising.add("forward_backward")
    assert leader.call("trainer", mine, "forward_backward", 3) == 6
    with pytest.raises(replica.JobFailed, match="process 1 disagreed on forward_backward"):
        leader.call("trainer", mine, then, 4)
    assert mine.calls == ["forward_backward"] + (
        ["forward_backward"] if then == "forward_backward" else []
    )
    assert len(failures) == 1 and "restarted" in failures[0]


def test_the_watcher_reads_a_returned_calls_answer_when_no_call_follows(job):
    leader, mine, theirs, failures = job
    theirs.raising.add("forward_backward")
    assert leader.call("trainer", mine, "forward_backward", 3) == 6
    deadline = time.monotonic() + 10 * replica.HEARTBEAT_S
    while not failures and time.monotonic() < deadline:
        time.sleep(0.05)
    assert failures and "disagreed on forward_backward" in failures[0]
    with pytest.raises(replica.JobFailed):
        leader.call("trainer", mine, "forward_backward", 1)


def test_a_follower_raising_where_process_0_is_stuck_fails_the_job(job):
    leader, mine, theirs, failures = job
    theirs.raising.add("forward_backward")
    mine.gate.clear()  # process 0 never finishes (a collective the follower never joins)
    t0 = time.monotonic()
    t, out = _in_thread(leader.call, "trainer", mine, "forward_backward", 3)
    deadline = t0 + TIMEOUT_S + 10 * replica.HEARTBEAT_S
    while not failures and time.monotonic() < deadline:
        time.sleep(0.05)
    assert failures and "process 1 raised in forward_backward" in failures[0]
    assert time.monotonic() - t0 >= TIMEOUT_S
    mine.gate.set()
    t.join(timeout=10)
