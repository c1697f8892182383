"""jcp-serve's compute threads yield the cores to its HTTP event loop on a CPU host, and
the GIL changes hands sooner (jcp/server/priority.py). Host only, in a child process: a thread's nice value cannot be
lowered again, and this one must not slow the rest of the suite."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

CHILD = r"""
import json, os, threading
from jcp.server.priority import lower_others

def nice():
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

seen, stop = {}, threading.Event()

def compute(name, spawn):
    if spawn:  # a thread started by a lowered thread, after the call
        stop.wait()
        t = threading.Thread(target=lambda: seen.__setitem__("child of compute", nice()))
        t.start(); t.join()
    stop.wait()
    seen[name] = nice()

threads = [threading.Thread(target=compute, args=(f"compute {i}", i == 0)) for i in range(3)]
for t in threads:
    t.start()
n = lower_others(7)
late = threading.Thread(target=lambda: seen.__setitem__("child of loop", nice()))
late.start(); late.join()
stop.set()
for t in threads:
    t.join()
seen["loop"], seen["set"], seen["again"] = nice(), n, lower_others(7)
print(json.dumps(seen))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice: Linux")
def test_every_thread_but_the_loops_gets_the_compute_nice_value():
    out = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60, check=True
    )
    seen = json.loads(out.stdout)
    assert seen["loop"] == 0 and seen["child of loop"] == 0, seen
    assert all(seen[f"compute {i}"] == 7 for i in range(3)), seen
    assert seen["child of compute"] == 7, seen  # XLA's threads started later by the worker
    assert seen["set"] >= 3 and seen["again"] == 0, seen  # threads at the value are left


def test_lower_others_does_nothing_at_zero():
    from jcp.server.priority import lower_others

    assert lower_others(0) == 0


FAVOUR = r"""
import json, sys
from jcp.server.priority import SWITCH_INTERVAL_S, favour_loop

before = sys.getswitchinterval()
favour_loop(0)
print(json.dumps({"before": before, "after": sys.getswitchinterval(), "want": SWITCH_INTERVAL_S}))
"""


def test_favour_loop_shortens_the_gil_switch_interval():
    # In a child: the interval is the interpreter's, and the suite's own must stay.
    out = subprocess.run(
        [sys.executable, "-c", FAVOUR], capture_output=True, text=True, timeout=60, check=True
    )
    seen = json.loads(out.stdout)
    assert seen["before"] > seen["want"], seen  # the default (5 ms) is longer
    assert seen["after"] == pytest.approx(seen["want"]), seen


PARSE = r"""
import asyncio, json, os, threading
from jcp.server import asgi
from jcp.server.priority import favour_loop

def nice():
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

favour_loop(7)

async def main():
    small = await asgi.off_loop(asgi.OFF_LOOP_BYTES, lambda: (nice(), threading.current_thread().name))
    large = await asgi.off_loop(asgi.OFF_LOOP_BYTES + 1, lambda: (nice(), threading.current_thread().name))
    return {"loop": nice(), "small": small, "large": large}

print(json.dumps(asyncio.run(main())))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice: Linux")
def test_large_bodies_are_parsed_at_the_compute_nice_value():
    """The threads the loop starts to parse large bodies (asgi.off_loop) take the compute's
    nice value; the loop keeps its own, and a small body is parsed on it."""
    out = subprocess.run(
        [sys.executable, "-c", PARSE], capture_output=True, text=True, timeout=60, check=True
    )
    seen = json.loads(out.stdout)
    assert seen["loop"] == 0 and seen["small"] == [0, "MainThread"], seen
    assert seen["large"][0] == 7 and seen["large"][1].startswith("jcp-parse"), seen
