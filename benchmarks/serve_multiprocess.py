"""jcp-serve as a 2-process jax.distributed job against one process, on the same 8 CPU devices.

Two servers run side by side (the launcher of tests/helpers/mp_serve.py: subprocesses,
127.0.0.1, tiny model, --mesh 2,2,2): one process × 8 fake CPU devices, and two processes ×
4 (gloo), where process 0 sends each of its worker's calls to the follower before making it
(jcp/server/replica.py). One training step = the SDK's forward_backward of 8 × 512 tokens
(cross_entropy) + optim_step, submitted back to back and both awaited, on a rank-8 model.
After --warmup steps on each, the two alternate for --rounds rounds of --steps steps (so a
change of machine load hits both); the headline is the median over rounds of
(multi-process median step) / (single-process median step). Goal: ≤ 1.15.

    python benchmarks/serve_multiprocess.py [--steps 5] [--rounds 3] [--warmup 2]
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
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    import numpy as np
    import tinker
    from tinker import types

    import mp_serve

    rng = np.random.default_rng(0)
    data = []
    for _ in range(DATUMS):
        toks = rng.integers(0, 512, TOKENS + 1).tolist()
        data.append(types.Datum(model_input=types.ModelInput.from_ints(toks[:-1]),
                                loss_fn_inputs={"target_tokens": toks[1:]}))
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
        print(f"\nper-request overhead, 2 processes x 4 devices / 1 process x 8 devices "
              f"(forward_backward + optim_step, {DATUMS} x {TOKENS}): {ratio:.3f}x "
              f"(goal <= 1.15)")
        return {"ratio": ratio, "rounds": rows}
    finally:
        mp_serve.close(clients)
        for job in jobs.values():
            job.stop()


if __name__ == "__main__":
    main()
