"""jcp-serve as a 2-process jax.distributed job against one process, on the same 8 CPU devices.

Two servers run side by side (the launcher of tests/helpers/mp_serve.py: subprocesses,
127.0.0.1, tiny model, --mesh 2,2,2): one process × 8 fake CPU devices, and two processes ×
4 (gloo), where process 0 sends each of its worker's calls to the follower before making it
(jcp/server/replica.py). One training step = the SDK's forward_backward of 8 × 512 tokens
(cross_entropy) + optim_step, submitted back to back and both awaited, on a rank-8 model.
After --warmup steps on each, the two alternate for --rounds rounds of --steps steps (so a
change of machine load hits both); the headline is the median over rounds of
(multi-process median step) / (single-process median step). Goal: ≤ 1.15.

The same step run directly on the Trainer (no server: 2 processes of jax.distributed
against 1, `--direct-steps` timed steps each after the warm-up) gives the part of that
ratio the devices' collectives cost (gloo over loopback TCP between the processes against
XLA:CPU's in-process collectives); the server's own share is the quotient of the two.

    python benchmarks/serve_multiprocess.py [--steps 5] [--rounds 3] [--warmup 2]
                                           [--direct-steps 10]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests", "helpers"))

DATUMS, TOKENS, RANK = 8, 512, 8


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5, help="timed steps per round")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--direct-steps", type=int, default=10,
                   help="timed Trainer steps of the no-server comparison (0: skip it)")
    p.add_argument("--worker", nargs=3, type=int, help=argparse.SUPPRESS)  # pid nproc port
    return p.parse_args(argv)


def _batch(rng):
    toks = [rng.integers(0, 512, TOKENS + 1) for _ in range(DATUMS)]
    return toks


def worker(pid: int, nproc: int, port: int, warmup: int, steps: int) -> None:
    """One process of the no-server comparison: jcp-serve's Trainer, the benchmark's step."""
    from jcp.cli import setup_devices

    setup_devices(argparse.Namespace(coordinator_address=f"127.0.0.1:{port}" if nproc > 1
                                     else None, num_processes=nproc, process_id=pid))
    import numpy as np

    import jcp

    tr = jcp.Trainer(jcp.QwenConfig.tiny(), jcp.make_mesh(2, 2, 2), max_adapters=8,
                     max_rank=RANK)
    a = tr.create_adapter(rank=RANK, alpha=32.0, seed=0)
    data = [jcp.Datum(t[:-1], {"target_tokens": t[1:], "weights": np.ones(TOKENS, np.float32)})
            for t in _batch(np.random.default_rng(0))]
    times = []
    for i in range(warmup + steps):
        t = time.perf_counter()
        tr.forward_backward(data, "cross_entropy", adapters=[a] * DATUMS)
        tr.optim_step(a, jcp.AdamParams(learning_rate=1e-4))
        times.append(time.perf_counter() - t)
    if pid == 0:
        print(f"median_s {statistics.median(times[warmup:])}", flush=True)


def direct(nproc: int, warmup: int, steps: int) -> float:
    """Median Trainer step (s) of `nproc` processes × 8 / nproc devices."""
    import subprocess

    import mp_serve

    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    port = str(mp_serve.free_port())
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", str(i),
                               str(nproc), port, "--warmup", str(warmup), "--direct-steps",
                               str(steps)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True) for i in range(nproc)]
    outs = [p.communicate(timeout=1800)[0] for p in procs]
    line = [ln for ln in outs[0].splitlines() if ln.startswith("median_s")]
    if not line:
        raise RuntimeError(f"direct run of {nproc} processes failed: {outs}")
    return float(line[0].split()[1])


def main(argv=None) -> dict:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.worker:
        worker(*args.worker, args.warmup, args.direct_steps)
        return {}
    import numpy as np
    from tinker import types

    data = []
    for toks in _batch(np.random.default_rng(0)):
        toks = toks.tolist()
        data.append(types.Datum(model_input=types.ModelInput.from_ints(toks[:-1]),
                                loss_fn_inputs={"target_tokens": toks[1:],
                                                "weights": [1.0] * TOKENS}))
    out = served(args, data) if args.rounds else {}
    if args.direct_steps:
        one, two = (direct(n, args.warmup, args.direct_steps) for n in (1, 2))
        out.update(direct_single_s=one, direct_multi_s=two)
        print(f"Trainer step without a server: 1 process {one * 1e3:.0f} ms, 2 processes "
              f"{two * 1e3:.0f} ms: {two / one:.3f}x (the devices' collectives)")
        if "ratio" in out:
            print(f"the server's own share: {out['ratio'] / (two / one):.3f}x")
    return out


def served(args, data) -> dict:
    """The headline: median over rounds of the two servers' median step ratio."""
    import tinker
    from tinker import types

    import mp_serve

    adam = types.AdamParams(learning_rate=1e-4)
    jobs = {"single": mp_serve.Job(1, tempfile.mkdtemp(prefix="jcp-bench-1-")),
            "multi": mp_serve.Job(2, tempfile.mkdtemp(prefix="jcp-bench-2-"),
                                  follower_timeout=120)}
    clients = []
    try:
        models = {}
        for name, job in jobs.items():
            job.wait_ready()
            sc = tinker.ServiceClient(base_url=job.url, api_key="tml-alice")
            clients.append(sc)
            models[name] = sc.create_lora_training_client(base_model=mp_serve.MODEL,
                                                          rank=RANK, seed=0).result()

        def step(tc) -> float:
            t = time.perf_counter()
            fb, op = tc.forward_backward(data, "cross_entropy"), tc.optim_step(adam)
            fb.result()
            op.result()
            return time.perf_counter() - t

        for name, tc in models.items():
            for _ in range(args.warmup):
                step(tc)
        ratios, rows = [], []
        for r in range(args.rounds):
            med = {name: statistics.median(step(tc) for _ in range(args.steps))
                   for name, tc in models.items()}
            ratios.append(med["multi"] / med["single"])
            rows.append(med)
            print(f"round {r}: single {med['single'] * 1e3:.0f} ms/step  multi "
                  f"{med['multi'] * 1e3:.0f} ms/step  ratio {ratios[-1]:.3f}", flush=True)
        ratio = statistics.median(ratios)
    finally:
        mp_serve.close(clients)
        for job in jobs.values():
            job.stop()
    print(f"\nserver step, 2 processes x 4 devices / 1 process x 8 devices "
          f"(forward_backward + optim_step, {DATUMS} x {TOKENS}): {ratio:.3f}x (goal <= 1.15)")
    return {"ratio": ratio, "rounds": rows}


if __name__ == "__main__":
    main()
