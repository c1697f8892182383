"""jcp-serve's cost over the in-process Trainer, and what fusing clients' passes buys.

The tiny model (jcp.QwenConfig.tiny(), the server's default), LoRA rank 8, token-sum
cross_entropy, on --mesh (default 1,1,1: one CPU device, so the figures are the server's
overhead, not fake-device collectives). One Trainer backs both sides; the server runs in
this process (jcp.server.service.Server, 127.0.0.1, a free port) and is driven by the Tinker SDK.

1. Overhead: one training step = forward_backward of 8 × 512 tokens + optim_step (AdamW).
   In-process: tr.forward_backward(...) then tr.optim_step(...) on a local adapter.
   Server: the SDK's tc.forward_backward(...) and tc.optim_step(...) submitted back to
   back, then both results awaited (the SDK's recommended pattern). Both sides alternate
   for --rounds rounds of --steps steps; each round's median step time is printed, and the
   headline is the median over rounds of server / in-process. Goal: ≤ 1.15.
2. Fusion: 4 SDK clients (4 models) each send forward_backward of --fusion-datums × 512
   tokens at once (threads released together). The device passes are counted with the
   scheduler's counters (fwd_passes, fused_passes); aggregate tokens/s = all 4 requests'
   tokens / wall time from the release to the last answer. Against: the same 4 requests
   served one pass each (one client after the other). Each is repeated --rounds times
   (after a warm-up that compiles both shapes); medians are printed.

    python benchmarks/server.py [--mesh 1,1,1] [--steps 5] [--rounds 3] [--fusion-datums 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time

from common import fake_cpu_devices, mesh_arg  # benchmarks/ is sys.path[0]

DATUMS, TOKENS, RANK, SEED = 8, 512, 8, 0


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--mesh", type=mesh_arg, default="1,1,1", help="dp,cp,tp (fake CPU devices as needed)"
    )
    p.add_argument("--steps", type=int, default=5, help="timed steps per round")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--fusion-datums", type=int, default=2, help="datums per client request")
    args = p.parse_args(argv)
    return args


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    fake_cpu_devices(args.mesh)
    import numpy as np
    import tinker
    from tinker import types

    import jcp
    from jcp.server.service import Server

    cfg = jcp.QwenConfig.tiny()
    tr = jcp.Trainer(
        cfg,
        jcp.make_mesh(*args.mesh),
        max_adapters=8,
        max_rank=RANK,
        max_tokens_per_device=DATUMS * TOKENS,
    )
    rng = np.random.default_rng(0)

    def batch(n):
        toks = rng.integers(0, cfg.vocab_size, (n, TOKENS + 1))
        jd = [
            jcp.Datum(
                model_input=t[:-1].tolist(),
                loss_fn_inputs={"target_tokens": t[1:].tolist(), "weights": [1.0] * TOKENS},
            )
            for t in toks
        ]
        sd = [
            types.Datum(
                model_input=types.ModelInput.from_ints(d.model_input),
                loss_fn_inputs=dict(d.loss_fn_inputs),
            )
            for d in jd
        ]
        return jd, sd

    jdata, sdata = batch(DATUMS)
    adam_j = jcp.AdamParams(learning_rate=1e-4)
    adam_s = types.AdamParams(learning_rate=1e-4)

    srv = Server(tr, "jcp-tiny", tempfile.mkdtemp(prefix="jcp-serve-bench-")).start()
    try:
        print(
            f"jcp-serve at {srv.url}; mesh dp,cp,tp = {args.mesh}; tiny model "
            f"(hidden {cfg.hidden_size}, {cfg.num_layers} layers, vocab {cfg.vocab_size}); "
            f"LoRA rank {RANK}",
            flush=True,
        )
        sc = tinker.ServiceClient(base_url=srv.url, api_key="tml-bench")
        tc = sc.create_lora_training_client(base_model="jcp-tiny", rank=RANK, seed=SEED).result()
        local = tr.create_adapter(rank=RANK, alpha=32.0, seed=SEED)

        def step_local():
            tr.forward_backward(jdata, "cross_entropy", adapters=local)
            tr.optim_step(local, adam_j)

        def step_server():
            fb = tc.forward_backward(sdata, "cross_entropy")
            opt = tc.optim_step(adam_s)
            fb.result()
            opt.result()

        def timed(step, n):
            out = []
            for _ in range(n):
                t0 = time.perf_counter()
                step()
                out.append(time.perf_counter() - t0)
            return out

        # ---------------------------------------------------------------- 1. overhead
        print(
            f"\n1. Overhead: forward_backward + optim_step of {DATUMS} × {TOKENS} tokens",
            flush=True,
        )
        for step in (step_local, step_server):
            timed(step, args.warmup)
        rounds = {"in-process": [], "server": []}
        for r in range(args.rounds):
            for name, step in (("in-process", step_local), ("server", step_server)):
                med = statistics.median(timed(step, args.steps))
                rounds[name].append(med)
                print(
                    f"   round {r}: {name:10s} {med * 1e3:8.1f} ms/step  "
                    f"({DATUMS * TOKENS / med:9.0f} tokens/s)",
                    flush=True,
                )
        # Each round times both sides back to back, so a slow spell of a shared machine
        # hits a round's pair together: the headline is the median of the paired ratios.
        ratios = [s_ / i_ for s_, i_ in zip(rounds["server"], rounds["in-process"])]
        ratio = statistics.median(ratios)
        med = {k: statistics.median(v) for k, v in rounds.items()}
        print(f"   per-round server / in-process: {', '.join(f'{r:.3f}' for r in ratios)}")
        print(
            f"   median: in-process {med['in-process'] * 1e3:.1f} ms, server "
            f"{med['server'] * 1e3:.1f} ms/step; server / in-process = {ratio:.3f}× "
            f"(median of the rounds' ratios; goal ≤ 1.15×: "
            f"{'met' if ratio <= 1.15 else 'NOT met'})",
            flush=True,
        )
        tr.delete_adapter(local)

        # ---------------------------------------------------------------- 2. fusion
        k = args.fusion_datums
        print(f"\n2. Fusion: 4 clients, each forward_backward of {k} × {TOKENS} tokens", flush=True)
        clients = [
            sc.create_lora_training_client(
                base_model="jcp-tiny", rank=RANK, seed=SEED + 1 + i
            ).result()
            for i in range(4)
        ]
        data = [batch(k)[1] for _ in clients]
        total_tokens = 4 * k * TOKENS
        sched = srv.scheduler

        def concurrent():
            go = threading.Barrier(5)
            done = [None] * 4

            def run(i):
                go.wait()
                done[i] = clients[i].forward_backward(data[i], "cross_entropy").result()

            threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
            for t in threads:
                t.start()
            c0 = (sched.counters.fwd_passes, sched.counters.fused_passes)
            go.wait()
            t0 = time.perf_counter()
            for t in threads:
                t.join()
            wall = time.perf_counter() - t0
            return wall, (sched.counters.fwd_passes - c0[0], sched.counters.fused_passes - c0[1])

        def one_by_one():
            c0 = (sched.counters.fwd_passes, sched.counters.fused_passes)
            t0 = time.perf_counter()
            for c, d in zip(clients, data):
                c.forward_backward(d, "cross_entropy").result()
            wall = time.perf_counter() - t0
            return wall, (sched.counters.fwd_passes - c0[0], sched.counters.fused_passes - c0[1])

        def held():
            """All four queued before the worker may take any: the fully fused pass."""
            c0 = (sched.counters.fwd_passes, sched.counters.fused_passes)
            sched.hold()
            try:
                futs = [c.forward_backward(d, "cross_entropy") for c, d in zip(clients, data)]
                deadline = time.monotonic() + 60
                while sched.pending() < 4 and time.monotonic() < deadline:
                    time.sleep(0.005)
                t0 = time.perf_counter()
            finally:
                sched.release()
            for f in futs:
                f.result()
            wall = time.perf_counter() - t0
            return wall, (sched.counters.fwd_passes - c0[0], sched.counters.fused_passes - c0[1])

        for f in (held, one_by_one, concurrent):  # warm-up: compile every shape
            f()
            f()
        results = {"concurrent": [], "all queued (held)": [], "one pass each": []}
        for _ in range(args.rounds):
            for name, f in (
                ("concurrent", concurrent),
                ("all queued (held)", held),
                ("one pass each", one_by_one),
            ):
                results[name].append(f())
        base = statistics.median(w for w, _ in results["one pass each"])
        for name, rs in results.items():
            wall = statistics.median(w for w, _ in rs)
            passes = [p for _, p in rs]
            print(
                f"   {name:18s} device passes per round (all, fused) {passes}; "
                f"median {wall * 1e3:7.1f} ms, {total_tokens / wall:9.0f} tokens/s "
                f"({base / wall:.2f}× one pass each)",
                flush=True,
            )
    finally:
        srv.stop()
        print("\nserver stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
