"""Where the suite's time goes, per test: a pytest plugin (not loaded by default).

    JCP_TIMING_OUT=/tmp/t PYTHONPATH=.:tests/helpers \
        python -m pytest -q -n 2 --dist loadfile -p timing_plugin

appends one JSON line per test to /tmp/t.<worker>.jsonl: wall seconds, CPU seconds of the
test process and of its waited-for children (jcp-train, jcp-serve, the 2-process jobs),
and every XLA compile (module name, wall s, CPU s, whether the persistent cache had it).

    python tests/helpers/timing_plugin.py /tmp/t.*.jsonl > tests/durations.json

sums them per module into the table that orders the modules (tests/conftest.py): CPU
seconds of the test process and its children, or the wall time where a module mostly
waits on its child processes (more wall than CPU).
"""

import json
import os
import resource
import time

import pytest

_COMPILES: list = []
_HITS = [0]
_INSTALLED = [False]


def _install():
    from jax._src import compiler, monitoring
    from jax._src.lib.mlir import ir

    compile_or_get_cached = compiler.compile_or_get_cached

    def timed(backend, computation, *args, **kwargs):
        name = ir.StringAttr(computation.operation.attributes["sym_name"]).value
        hits, t, c = _HITS[0], time.perf_counter(), time.process_time()
        try:
            return compile_or_get_cached(backend, computation, *args, **kwargs)
        finally:
            _COMPILES.append(
                (
                    name,
                    round(time.perf_counter() - t, 3),
                    round(time.process_time() - c, 3),
                    _HITS[0] > hits,
                )
            )

    compiler.compile_or_get_cached = timed

    def count_hits(event, **kwargs):
        if event == "/jax/compilation_cache/cache_hits":
            _HITS[0] += 1

    monitoring.register_event_listener(count_hits)
    _INSTALLED[0] = True


def _cpu():
    me, kids = (resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not _INSTALLED[0]:
        _install()
    _COMPILES.clear()
    t, (me, kids) = time.perf_counter(), _cpu()
    yield
    me2, kids2 = _cpu()
    out = os.environ.get("JCP_TIMING_OUT")
    if out:
        rec = {
            "id": item.nodeid,
            "wall": round(time.perf_counter() - t, 2),
            "cpu": round(me2 - me, 2),
            "child_cpu": round(kids2 - kids, 2),
            "compiles": list(_COMPILES),
        }
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        with open(f"{out}.{worker}.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")


def module_seconds(lines) -> dict[str, float]:
    """{test module path relative to tests/: seconds} from the plugin's JSON lines: per
    module the larger of its wall time and its CPU seconds (test process + children)."""
    wall: dict[str, float] = {}
    cpu: dict[str, float] = {}
    for line in lines:
        rec = json.loads(line)
        path = rec["id"].split("::")[0]
        path = path[len("tests/") :] if path.startswith("tests/") else path
        wall[path] = wall.get(path, 0.0) + rec["wall"]
        cpu[path] = cpu.get(path, 0.0) + rec["cpu"] + rec["child_cpu"]
    return {m: round(max(wall[m], cpu[m]), 1) for m in sorted(wall)}


if __name__ == "__main__":
    import sys

    lines = [ln for name in sys.argv[1:] for ln in open(name) if ln.strip()]
    print(json.dumps(module_seconds(lines), indent=1, sort_keys=True))
