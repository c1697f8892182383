"""The HTTP event loop before the compute on a CPU host: the other threads' nice value.

On a CPU host the event loop (every tenant's requests read, parsed and answered) shares
the cores with the compute: XLA's threads and the worker's. While one tenant keeps the
cores busy, the loop is one runnable thread among several and waits for a core, and so
does every other tenant's request (beside a hostile neighbour on 2 cores: stalls of 50-90
ms, half of them the loop waiting for a core, not working). So jcp-serve raises the nice
value of every thread but the loop's (`lower_others`, `--compute-nice`, default
COMPUTE_NICE on a CPU backend): the loop then runs when it has work, and the compute gets
the cores the rest of the time — its throughput is unchanged while nothing else wants
them. Threads started later inherit their creator's value: the worker's and XLA's the
raised one, the loop's its own, except the threads that parse large bodies off the loop
(asgi.off_loop), which take the compute's value as they start (`as_compute`): a
neighbour's multi-MiB bodies parsed at the loop's value took the core from a light
tenant's step (benchmarks/RESULTS.md, "Large bodies parsed at the compute's priority").

Linux only (a thread's nice value is its own there); an unprivileged process may raise
its own threads' values, never lower them, so this cannot be undone in the process.

The loop, the worker and the loop's thread pool (large bodies parsed off the loop) also
share the GIL: a thread that wants it while another runs Python waits for the
interpreter's switch interval, 5 ms by default, at each handoff — a request read, a
future answered, the worker's dispatch after each device call. jcp-serve sets it to
SWITCH_INTERVAL_S on every backend (`favour_loop`). Beside a hostile neighbour on 2 cores,
traced per request, the victim's samples waited on the loop (read to queued, result to
answer) p99 4.9 and 6.8 ms against 10.1 and 8.2, and the neighbour's micro-batches (each
needs the GIL between its device calls) took 15.1 ms at the median against 18.8
(benchmarks/RESULTS.md, "The GIL's switch interval").
"""

from __future__ import annotations

import os
import sys
import threading

COMPUTE_NICE = 10
SWITCH_INTERVAL_S = 0.0005
_compute_nice = 0  # favour_loop's value, for threads the loop starts later (as_compute)


def favour_loop(nice: int) -> int:
    """The serving process's settings for its event loop: the GIL's switch interval
    SWITCH_INTERVAL_S, and every other thread at nice value `nice` (lower_others), as are
    the threads that parse large bodies, started later by the loop (as_compute) -> how
    many threads were set."""
    global _compute_nice
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    _compute_nice = max(nice, 0)
    return lower_others(nice)


def as_compute() -> None:
    """Give the calling thread favour_loop's compute nice value (nothing before favour_loop
    ran, or at 0): the initializer of the threads that parse large bodies off the loop
    (asgi.off_loop). Such a parse is bulk work that grows with its body, like a pass; at
    the loop's value it took ~90 % of a shared core from the compute (a light tenant's
    step among it) while it ran."""
    if _compute_nice > 0 and sys.platform.startswith("linux"):
        tid = threading.get_native_id()
        if os.getpriority(os.PRIO_PROCESS, tid) < _compute_nice:
            os.setpriority(os.PRIO_PROCESS, tid, _compute_nice)


def lower_others(nice: int) -> int:
    """Set every other thread of this process to nice value `nice` (when higher than its
    own) -> how many were set; 0 off Linux or when `nice` ≤ 0."""
    if nice <= 0 or not sys.platform.startswith("linux"):
        return 0
    me, n = threading.get_native_id(), 0
    for name in os.listdir("/proc/self/task"):
        tid = int(name)
        if tid == me:
            continue
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) < nice:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
                n += 1
        except OSError:  # the thread ended meanwhile
            continue
    return n
