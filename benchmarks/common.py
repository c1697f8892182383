"""What several benchmark scripts share (benchmarks/ is sys.path[0] when one runs)."""

from __future__ import annotations

import contextlib
import os
import time


def fake_cpu_devices(mesh: tuple[int, int, int]) -> None:
    """Ask XLA for dp·cp·tp fake CPU devices (unless XLA_FLAGS already sets a count) and
    keep the Tinker SDK's telemetry off. Call before anything imports jax."""
    n_dev = mesh[0] * mesh[1] * mesh[2]
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    if n_dev > 1 and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={n_dev}"
        )


@contextlib.contextmanager
def on_cores(cores: set[int] | None):
    """The calling thread on `cores` while the block runs (None: as it is), so that a child
    process started in it runs on them from its start (XLA sizes its compute pool from the
    affinity it starts with) without a preexec_fn, which would fork a process JAX's threads
    run in."""
    before = os.sched_getaffinity(0)
    if cores:
        os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def mesh_arg(text: str) -> tuple[int, int, int]:
    """argparse type of --mesh: "dp,cp,tp" -> (dp, cp, tp)."""
    return tuple(int(x) for x in text.split(","))


def best_time(fn, reps: int = 2) -> float:
    """Seconds of the fastest of `reps` calls of fn, after one call that compiles."""
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def best_times(fns: dict, reps: int = 2) -> dict:
    """{name: (wall s, CPU s)}: the fastest of `reps` rounds of each fn (wall and process
    CPU time, all threads, each its own minimum), after one call of each that compiles.
    The fns run interleaved (a, b, a, b, …), so that a burst of load on the shared machine
    falls on both sides of a ratio alike; CPU seconds are the work itself, whatever
    else runs beside it."""
    for fn in fns.values():
        fn()
    best = {k: (float("inf"), float("inf")) for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            t, c = time.perf_counter(), time.process_time()
            fn()
            w, c = time.perf_counter() - t, time.process_time() - c
            best[k] = (min(best[k][0], w), min(best[k][1], c))
    return best


def sampling_workload(tr, mesh: tuple[int, int, int], r: int, t: int, s: int):
    """The engine benchmarks' workload on Trainer tr: (r random prompts of 4-16 tokens,
    drawn SamplingParams of t tokens without stops, an Engine with a slot for each of the
    r·s sequences, rounded up to the dp·cp device groups)."""
    import numpy as np

    import jcp
    from jcp.sample.engine import Engine

    rng = np.random.default_rng(0)
    prompts = [
        rng.integers(0, tr.cfg.vocab_size, int(rng.integers(4, 17))).tolist() for _ in range(r)
    ]
    sp = jcp.SamplingParams(max_tokens=t, temperature=1.0, seed=1, stop=[])
    groups = mesh[0] * mesh[1]
    return (
        prompts,
        sp,
        Engine(tr.make_sampler(), slots=-(-r * s // groups) * groups, max_len=64, chunk=8),
    )
