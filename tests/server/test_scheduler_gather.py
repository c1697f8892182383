"""Scheduler.gather_samples, the burst admission of jcp-serve's worker (no jax): samples
arriving close together are taken together (the first within `gap`, later ones within
`burst_gap`, or scale × the burst's largest gap so far); the window's end is reported when
they are still arriving; other work stops it; `each` is handed every batch of arrivals as
it comes (the worker prefills them while the rest arrive); a second tenant's sample ends
it."""

from __future__ import annotations

import threading
import time

from jcp.server.scheduler import Scheduler, Work


def _sample(i: int) -> Work:
    return Work(f"s{i}", "sample", None, None, None, "owner")


def _feed(sched: Scheduler, stop: threading.Event, every: float, n: int = 10**6):
    sent = []

    def run():
        for i in range(n):
            if stop.is_set():
                return
            time.sleep(every)
            sched.submit(_sample(i))
            sent.append(i)

    t = threading.Thread(target=run)
    t.start()
    return t, sent


def test_a_burst_is_taken_until_a_quiet_gap():
    sched, stop = Scheduler(), threading.Event()
    t, sent = _feed(sched, stop, 0.002, n=5)
    got, arriving = sched.gather_samples(gap=0.5, window=10.0)
    t.join()
    assert [w.request_id for w in got] == [f"s{i}" for i in range(5)]
    assert not arriving  # it ended on the quiet gap, not the window


def test_the_window_ends_a_burst_still_arriving_and_nothing_is_lost():
    sched, stop = Scheduler(), threading.Event()
    t, sent = _feed(sched, stop, 0.001)
    got, arriving = sched.gather_samples(gap=1.0, window=0.1)
    stop.set()
    t.join()
    assert arriving and got
    rest = sched.next_work(block=False)[1]
    assert sorted(w.request_id for w in got + rest) == sorted(f"s{i}" for i in sent)


def test_other_work_ends_the_gathering():
    sched = Scheduler()

    def later():
        time.sleep(0.05)
        sched.submit(Work("m", "create_model", None, None, None, "owner"))

    t = threading.Thread(target=later)
    t.start()
    t0 = time.monotonic()
    got, arriving = sched.gather_samples(gap=5.0, window=10.0)
    t.join()
    assert time.monotonic() - t0 < 4.0 and got == [] and not arriving


def test_a_burst_waits_the_longer_burst_gap_a_lone_sample_only_the_gap():
    """Once a sample has come within `gap`, later ones may come up to `burst_gap` apart
    (an RL step's requests reach a loaded server unevenly); with no burst_gap the same
    arrivals split at the first gap longer than `gap`. With nothing arriving the wait is
    `gap`, not `burst_gap`."""

    def gathered(burst_gap):
        sched, stop = Scheduler(), threading.Event()
        sched.submit(_sample(99))  # the first, taken after `gap`
        t, sent = _feed(sched, stop, 0.3, n=3)
        got, arriving = sched.gather_samples(gap=0.1, window=30.0, burst_gap=burst_gap)
        stop.set()
        t.join()
        return sorted(w.request_id for w in got), arriving

    assert gathered(1.0) == (["s0", "s1", "s2", "s99"], False)
    assert gathered(None) == (["s99"], False)
    sched = Scheduler()
    t0 = time.monotonic()
    assert sched.gather_samples(gap=0.05, window=30.0, burst_gap=20.0) == ([], False)
    assert time.monotonic() - t0 < 10.0


def test_each_batch_is_handed_over_as_it_arrives_and_none_is_lost():
    """each (the worker admitting and prefilling the arrivals so far): every sample is
    passed exactly once, in arrival order, while the burst still arrives; samples that
    arrive while `each` runs are taken next (the gap counts from its return)."""
    sched, stop = Scheduler(), threading.Event()
    batches = []

    def each(new):
        batches.append([w.request_id for w in new])
        time.sleep(0.03)  # longer than the arrivals' spacing: the next batch holds several

    t, sent = _feed(sched, stop, 0.005, n=20)
    got, arriving = sched.gather_samples(gap=0.5, window=10.0, burst_gap=0.2, each=each)
    t.join()
    assert [w.request_id for w in got] == [f"s{i}" for i in range(20)]
    assert sum(batches, []) == [f"s{i}" for i in range(20)]
    assert len(batches) > 1 and max(len(b) for b in batches) > 1
    assert not arriving and sched.next_work(block=False)[1] == []


def test_scaled_gap_ends_a_burst_sooner_than_the_burst_gap():
    """scale: a burst whose samples come ~10 ms apart ends scale × that after its last
    (here ≤ 0.13 s), so a sample 0.4 s later is left for the next turn; with no scale the
    full burst_gap (2 s) takes it too. `taken` (samples the worker took before) counts."""

    def gathered(scale):
        sched = Scheduler()
        first = _sample(99)
        sched.submit(first)
        taken = sched.next_work(block=False)[1]

        def feed():
            for i in range(5):
                time.sleep(0.01)
                sched.submit(_sample(i))
            time.sleep(0.4)
            sched.submit(_sample(5))

        t = threading.Thread(target=feed)
        t.start()
        got, _ = sched.gather_samples(
            gap=0.02, window=30.0, burst_gap=2.0, scale=scale, taken=taken
        )
        t.join()
        return [w.request_id for w in got]

    t0 = time.monotonic()
    assert gathered(None) == [f"s{i}" for i in range(6)]
    assert gathered(3.0) == [f"s{i}" for i in range(5)]
    assert time.monotonic() - t0 < 8.0


def test_another_tenants_sample_ends_the_gathering():
    """alice's burst trickling in (her requests slow to arrive: the server's HTTP side is
    busy) held bob's lone sample, admitted among them, until the window ended (0.5 s on
    jcp-serve; bob's p99 beside her: 255 ms of one request waiting so). A gather batches
    one tenant's burst: bob's sample ends it, reported as still arriving (the worker's
    next step is short, so that alice's stragglers join one chunk later)."""
    sched, stop = Scheduler(), threading.Event()
    t, sent = _feed(sched, stop, 0.002, n=2000)
    try:
        time.sleep(0.02)
        threading.Timer(
            0.05, lambda: sched.submit(Work("b", "sample", None, None, None, "bob"))
        ).start()
        t0 = time.monotonic()
        got, arriving = sched.gather_samples(gap=0.5, window=10.0, burst_gap=0.5)
        took = time.monotonic() - t0
    finally:
        stop.set()
        t.join()
    assert "b" in [w.request_id for w in got] and arriving
    assert took < 1.0, took  # not the window (10 s), nor alice's whole burst (4 s)
    # Samples of two tenants already taken: no gathering at all.
    both = [_sample(0), Work("b2", "sample", None, None, None, "bob")]
    sched.submit(Work("late", "sample", None, None, None, "owner"))
    assert sched.gather_samples(gap=0.5, window=10.0, taken=both) == ([], True)
    assert [w.request_id for w in sched.next_work(block=False)[1]][-1] == "late"
