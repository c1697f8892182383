"""The continuous-batching engine (jcp.sample.engine) against the static sampler and
through the server. Tiny Qwen3 (jcp.QwenConfig.tiny()), LoRA rank 8, --mesh (default
1,2,2 on fake CPU devices). Every figure is a ratio within one run, after a warm-up that
compiles the programs; the machine is shared, so treat them as rough.

1. Equal batch: R prompts × S samples × T tokens (drawn, stop=[]) through
   Trainer.sample (one static call) and through Engine.sample (same sequences): tokens/s
   of the engine ÷ static (goal ≥ 1.0), and the same ratio of CPU seconds (all threads),
   each the best of --rounds interleaved rounds (common.best_times).
2. Mixed adapters: 8 sequences over 4 adapters vs all on 1 adapter, through the engine:
   time ratio (goal ≤ 1.15), wall and CPU seconds, best of --mix-rounds interleaved
   rounds (a call is ~50 ms: a best of 3 swung 1.08–1.36× on a quiet machine).
3. Time to first token of one request submitted while --busy sequences decode, in engine
   steps and seconds, against one engine step's time.
4. Server: R concurrent SDK asample requests × S samples × T tokens against one
   in-process Trainer.sample over the same R·S sequences: tokens/s ratio (goal ≥ 0.8),
   medians, the in-process call timed between the rounds (so load falls on both).
   The server (in this process, on 127.0.0.1) gets R·S engine slots (equal batch) and
   Engine.warmup before serving; median of 3 rounds (7 per policy with --admission
   all) after two that compile nothing. The
   SDK clients send all R at once (as an RL step does) from a spawned process (--clients
   process, as deployed), or from threads of the server's process (thread; both: each).
   Then where the median round went: when the requests reached the worker, each engine
   step (the worker's DEBUG log), and CPU seconds of the server's process (its XLA
   compute threads, HTTP thread, worker thread and the rest) and the clients' process.
   --admission server|hurry|prefill|gap|old|all, or several comma-separated
   (interleaved rounds, one figure per policy): the worker's burst admission (server: its
   defaults; hurry: the defaults but a short first step after every gather, the policy
   before a gathered burst ran as one step; prefill: prefill-only steps while a burst
   arrives and a burst gap scaled to its gaps; gap: the scaled gap only; old: neither, a
   fixed 30 ms gap; all: old,gap,prefill).
   The bound, in the same run: between the rounds, the same R requests against the same
   server while its engine answers each at admission with a dummy result of S × T tokens
   (no_model: benchmark-only, no model work) — the pure HTTP + SDK round, its CPU seconds
   (server threads, clients), and the ceilings it implies: no overlap t_in / (t_in +
   bare round); perfect overlap, the bare round's CPU on the cores the in-process call
   leaves idle; CPU-bound c_in / (c_in + bare CPU s), for an in-process call that fills
   the cores.
5. KV memory: pages each sequence holds against its real length (paged cache).
6. A burst in cohorts: CPU seconds of the engine for the R·S sequences admitted all at
   once against in cohorts (as requests reach a server: 1/8 then the rest, 1/8 + 3/8 +
   the rest, all but 1/12 then the rest), each cohort but the last one hurried step.

    python benchmarks/engine.py [--mesh 1,2,2] [--r 128] [--s 8] [--t 32] [--busy 256]
                                [--rounds 2] [--mix-rounds 15]
                                [--quick | --skip-server | --only-server]
                                [--clients process|thread|both] [--served-rounds N]
                                [--admission server|hurry|prefill|gap|old|all|A,B,…]
    --quick: 1. and 2. only (the engine-vs-static figures).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import sys
import tempfile
import time

from common import (  # benchmarks/ is sys.path[0]
    best_time,
    best_times,
    fake_cpu_devices,
    mesh_arg,
    sampling_workload,
)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mesh", type=mesh_arg, default="1,2,2")
    p.add_argument("--r", type=int, default=128, help="requests (prompts)")
    p.add_argument("--s", type=int, default=8, help="samples per request")
    p.add_argument("--t", type=int, default=32, help="new tokens per sequence")
    p.add_argument("--busy", type=int, default=256, help="sequences decoding in 3.")
    p.add_argument("--rounds", type=int, default=2, help="timed rounds of 1. (best kept)")
    p.add_argument("--mix-rounds", type=int, default=15, help="timed rounds of 2. (best kept)")
    p.add_argument(
        "--served-rounds",
        type=int,
        default=None,
        help="timed rounds of 4. per policy (median kept; default 3, 7 with several policies)",
    )
    p.add_argument("--quick", action="store_true", help="run 1. and 2. only")
    p.add_argument("--skip-server", action="store_true")
    p.add_argument("--only-server", action="store_true", help="run 4. only")
    p.add_argument(
        "--clients",
        choices=("process", "thread", "both"),
        default="process",
        help="4.: SDK clients in a spawned process (as deployed), in the server's "
        "process (threads), or both",
    )
    p.add_argument(
        "--admission",
        type=admission_arg,
        default="server",
        help="4.: the burst admission policy, or several (comma-separated: "
        "interleaved rounds, one figure each) — server: jcp-serve's defaults; "
        "hurry: the defaults but a short first step after every gather; "
        "prefill: prefill-only steps while a burst arrives and a burst gap "
        "scaled to its gaps; gap: the scaled gap only; old: neither, a fixed "
        "30 ms gap; all: old,gap,prefill",
    )
    args = p.parse_args(argv)
    return args


POLICIES = ("server", "hurry", "prefill", "gap", "old")


def admission_arg(text: str) -> tuple[str, ...]:
    names = ("old", "gap", "prefill") if text == "all" else tuple(text.split(","))
    for n in names:
        if n not in POLICIES:
            raise argparse.ArgumentTypeError(
                f"unknown admission policy {n!r} (one of {', '.join(POLICIES)}, all)"
            )
    return names


DEFAULT_ADMISSION: dict = {}


def set_admission(policy: str) -> None:
    """The jcp-serve worker's burst admission policy (module constants it reads per turn)."""
    import jcp.server.worker as worker

    if not DEFAULT_ADMISSION:
        DEFAULT_ADMISSION.update(
            ADMIT_PREFILL=worker.ADMIT_PREFILL,
            ADMIT_GAP_SCALE=worker.ADMIT_GAP_SCALE,
            ADMIT_HURRY=worker.ADMIT_HURRY,
        )
    for name, value in DEFAULT_ADMISSION.items():
        setattr(worker, name, value)
    if policy == "hurry":
        worker.ADMIT_HURRY = True
    elif policy != "server":
        worker.ADMIT_PREFILL = policy == "prefill"
        worker.ADMIT_GAP_SCALE = 4.0 if policy in ("prefill", "gap") else None


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    fake_cpu_devices(args.mesh)

    import jcp
    from jcp.sample.engine import EngineError

    cfg = jcp.QwenConfig.tiny()
    tr = jcp.Trainer(cfg, jcp.make_mesh(*args.mesh), max_adapters=6, max_rank=8)
    ads = [tr.create_adapter(rank=8, seed=k) for k in range(4)]
    n_seq = args.r * args.s
    prompts, sp, eng = sampling_workload(tr, args.mesh, args.r, args.t, args.s)
    slots = eng.slots

    if not args.only_server:
        # 1. equal batch (interleaved rounds; wall and CPU seconds, each the best)
        t = best_times(
            {
                "static": lambda: tr.sample(prompts, sp, adapters=ads[0], num_samples=args.s),
                "engine": lambda: eng.sample(prompts, sp, adapters=ads[0], num_samples=args.s),
            },
            reps=args.rounds,
        )
        (w_s, c_s), (w_e, c_e) = t["static"], t["engine"]
        print(
            f"1. equal batch {args.r}×{args.s}×{args.t}: static {n_seq * args.t / w_s:.0f} "
            f"tok/s, engine {n_seq * args.t / w_e:.0f} tok/s -> engine/static "
            f"{w_s / w_e:.2f}× (goal ≥ 1.0); CPU s static {c_s:.3f}, engine {c_e:.3f} -> "
            f"{c_s / c_e:.2f}× (best of {args.rounds})",
            flush=True,
        )

        # 2. mixed adapters: a call is ~50 ms, so many interleaved rounds
        eight = prompts[:8]
        t = best_times(
            {
                "one": lambda: eng.sample(eight, sp, adapters=[ads[0]] * 8),
                "mix": lambda: eng.sample(eight, sp, adapters=[ads[k % 4] for k in range(8)]),
            },
            reps=args.mix_rounds,
        )
        (w_1, c_1), (w_4, c_4) = t["one"], t["mix"]
        print(
            f"2. 8 sequences over 4 adapters vs 1: {w_4 / w_1:.2f}× the time "
            f"({w_4 * 1e3:.1f} vs {w_1 * 1e3:.1f} ms), CPU s {c_4 / c_1:.2f}× "
            f"({c_4 * 1e3:.1f} vs {c_1 * 1e3:.1f} ms) (goal ≤ 1.15; best of "
            f"{args.mix_rounds})",
            flush=True,
        )
        if args.quick:
            return 0

        # 3. time to first token while many decode: the busy batch decodes hurried
        # (`chunk` tokens per step, as when requests queue at a server); the newcomer's
        # step runs as the engine chooses (Engine.decode_len).
        long_sp = jcp.SamplingParams(max_tokens=48, temperature=1.0, seed=2, stop=[])

        def newcomer():
            busy = [eng.submit(prompts[k % args.r], long_sp, ads[k % 4]) for k in range(args.busy)]
            eng.step(hurry=True)
            eng.step(hurry=True)
            t_step = best_time(lambda: eng.step(hurry=True), reps=1)
            live = eng.live
            rid = eng.submit(prompts[0], sp, ads[1])

            def first_token():
                req = eng.requests.get(rid)  # None: it ended (all its tokens drawn) in the step
                return req is None or bool(req.tokens and req.tokens[0])

            t0, steps = time.perf_counter(), 0
            while not first_token():
                eng.step()
                steps += 1
            ttft = time.perf_counter() - t0
            for r in busy + [rid]:
                eng.cancel(r)
            eng.run()
            for r in busy + [rid]:
                if eng.finished(r):
                    try:
                        eng.result(r)
                    except EngineError:  # cancelled
                        pass
            return live, steps, ttft, t_step

        newcomer()  # the same scenario once before, so that the timed one compiles nothing
        live, steps, ttft, t_step = newcomer()
        print(
            f"3. first token of a request arriving while {live} sequences decode: "
            f"{steps} engine step(s), {ttft:.3f} s, that step decoding "
            f"{eng.max_chunk} tokens at most (one {eng.chunk}-token step "
            f"{t_step:.3f} s; a request arriving during a long step waits for it too)",
            flush=True,
        )

        # 5. memory: pages held per sequence against its real length
        page_b = eng.kv_bytes(1)
        held = {}
        mem_sp = [
            jcp.SamplingParams(max_tokens=t, temperature=1.0, seed=3, stop=[]) for t in (4, 16, 40)
        ]
        rids = [eng.submit(prompts[k], mem_sp[k % 3], ads[0], num_samples=2) for k in range(6)]
        while not eng.idle:
            eng.step(hurry=True)  # chunk-long steps, to see the pages as sequences grow
            for r in rids:
                req = eng.requests.get(r)
                for x in req.seqs if req else []:
                    held[(r, x.j)] = (len(req.prompt) - 1 + len(x.tokens), len(x.pages))
        real = sum(n for n, _ in held.values())
        pages = sum(p for _, p in held.values())
        print(
            f"5. KV cache: {eng.page}-position pages of {page_b} B; 12 sequences of real length "
            f"{min(n for n, _ in held.values())}-{max(n for n, _ in held.values())} "
            f"(sum {real}) held {pages} table entries = {pages * page_b / real:.0f} B per real "
            f"position (one position = {eng.s.row_bytes - 4} B; prompt pages shared by the 2 "
            f"samples counted twice); a slot-row cache holds {eng.max_len} rows = "
            f"{eng.max_len * (eng.s.row_bytes - 4)} B per sequence; "
            f"peak pages on one device {eng.peak_pages} of {eng.n_pages}; "
            f"{eng.programs()} engine programs run in 1-3, 5",
            flush=True,
        )
        for r in rids:
            eng.result(r)
        cohorts(args, eng, prompts, sp)

    if args.skip_server:
        return 0
    served(args, tr, prompts, sp, slots, n_seq)
    return 0


def cohorts(args, eng, prompts, sp) -> None:
    """6. A burst admitted in cohorts, as its requests reach a server: CPU seconds of the
    engine (this process) against all R at once. Cohorts but the last take one hurried
    step (chunk tokens), as jcp-serve's worker runs them while requests still queue."""
    r = args.r
    plans = {
        "all at once": [r],
        "1/8, then the rest": [r // 8, r],
        "1/8, 3/8, then the rest": [r // 8, r // 2, r],
        "all but 1/12, the rest a step later": [r - r // 12, r],
    }

    def run(cuts):
        c0, rids, at = time.process_time(), [], 0
        for k, cut in enumerate(cuts):
            rids += [eng.submit(p, sp, None, args.s) for p in prompts[at:cut]]
            at = cut
            eng.step(hurry=k < len(cuts) - 1)
        eng.run()
        for x in rids:
            eng.result(x)
        return time.process_time() - c0

    cpu = {}
    for name, cuts in plans.items():
        run(cuts)  # compiles
        cpu[name] = min(run(cuts) for _ in range(2))
    print(
        "6. a burst in cohorts, CPU s of the engine (× all at once): "
        + "; ".join(f"{name} {c:.2f} ({c / cpu['all at once']:.2f}×)" for name, c in cpu.items()),
        flush=True,
    )


def served(args, tr, prompts, sp, slots: int, n_seq: int) -> None:
    """4. R concurrent SDK requests against one in-process call, clients per --clients."""
    import logging
    import multiprocessing as mp

    import numpy as np

    from jcp.server.service import Server

    # The worker logs each engine step at DEBUG (jcp/server/worker.py): collect them to
    # say where a round's time goes.
    steps: list[dict] = []

    class Steps(logging.Handler):
        def emit(self, record):
            if hasattr(record, "step"):
                steps.append(record.step)

    log = logging.getLogger("jcp.serve")
    log.addHandler(Steps())
    log.setLevel(logging.DEBUG)
    log.propagate = False
    # The server's engine holds the in-process call's R·S sequences at once (equal batch),
    # its programs compiled up front (Engine.warmup, as jcp-serve --warmup).
    srv = Server(tr, "jcp-tiny", tempfile.mkdtemp(), {"tml-k": "k"}, sample_slots=slots)
    t0 = time.perf_counter()
    n_warm = srv.worker.sampling.warmup(active=(1,), draws=("drawn",))
    print(
        f"   server engine: {slots} slots, warm-up compiled {n_warm} programs in "
        f"{time.perf_counter() - t0:.0f} s",
        flush=True,
    )
    srv.start()
    threads = {srv._thread.native_id: "HTTP thread", srv.worker._thread.native_id: "worker"}
    modes = ("process", "thread") if args.clients == "both" else (args.clients,)
    try:
        t_in = None
        for mode in modes:
            if mode == "process":
                # As deployed: the clients are another process (no jax there), so the
                # server's GIL and event loop are its own.
                parent, child = mp.get_context("spawn").Pipe()
                proc = mp.get_context("spawn").Process(
                    target=sdk_clients, args=(srv.url, prompts, args.s, args.t, child), daemon=True
                )
                proc.start()
                round_ = lambda: (parent.send("round"), parent.recv())[1]  # noqa: E731
            else:
                round_ = sdk_clients(srv.url, prompts, args.s, args.t, None)
            # Warm-up until two rounds compile nothing: how concurrent requests arrive
            # decides which prefill / decode buckets a round meets, so one round may not
            # see them all (a compile inside the timed round once made it 0.02×).
            policies = args.admission
            n_prog, warm, quiet = -1, 0, 0
            while quiet < 2 and warm < 8:  # two rounds in a row that compile nothing
                quiet = quiet + 1 if n_prog == srv.worker.sampling.programs() else 0
                n_prog = srv.worker.sampling.programs()
                for policy in policies:
                    set_admission(policy)
                    round_()
                warm += 1
            n_prog = srv.worker.sampling.programs()
            by_policy = {policy: [] for policy in policies}
            bare: list[tuple] = []  # rounds without model work: (wall, server CPU, clients CPU)
            with no_model(srv.worker.sampling):
                round_()  # its first round: the SDK's and server's paths warm
            if t_in is None:
                tr.sample(prompts, sp, num_samples=args.s)  # compiles
                calls = []
            n_rounds = args.served_rounds or (3 if len(policies) == 1 else 7)
            for _ in range(n_rounds):  # interleaved
                for policy in policies:
                    set_admission(policy)
                    del steps[:]
                    c0, th0 = time.process_time(), thread_cpu(threads)
                    c_t0, c_sent, c_t1, c_cpu = round_()
                    th = {k: v - th0.get(k, 0.0) for k, v in thread_cpu(threads).items()}
                    by_policy[policy].append(
                        (
                            c_t1 - c_t0,
                            c_t0,
                            c_sent,
                            c_t1,
                            c_cpu,
                            (time.process_time() - c0, th),
                            list(steps),
                        )
                    )
                if t_in is None:  # the in-process call between rounds: load falls on both
                    c0, t0 = time.process_time(), time.perf_counter()
                    tr.sample(prompts, sp, num_samples=args.s)
                    calls.append((time.perf_counter() - t0, time.process_time() - c0))
                # The same requests answered without model work (the bound below).
                with no_model(srv.worker.sampling):
                    c0, th0 = time.process_time(), thread_cpu(threads)
                    c_t0, _, c_t1, c_cpu = round_()
                    th = {k: v - th0.get(k, 0.0) for k, v in thread_cpu(threads).items()}
                    bare.append((c_t1 - c_t0, time.process_time() - c0, c_cpu, th))
            set_admission("server")
            if mode == "process":
                parent.send(None)
                proc.join(timeout=30)
            if t_in is None:
                calls.sort()
                t_in, c_in = calls[len(calls) // 2]
                print(
                    f"   in-process call: median {t_in:.2f} s of "
                    f"{', '.join(f'{w:.2f}' for w, _ in calls)} s (between the rounds)",
                    flush=True,
                )
            for policy, rounds in by_policy.items():
                rounds.sort(key=lambda r: r[0])
                t_srv, c_t0, c_sent, c_t1, c_cpu, s_cpu, trace = rounds[len(rounds) // 2]
                print(
                    f"4. server {args.r}×{args.s}×{args.t} concurrent SDK requests "
                    f"({policy} admission), clients in "
                    f"{'another process' if mode == 'process' else 'the server process'}: "
                    f"{n_seq * args.t / t_srv:.0f} tok/s vs in-process "
                    f"{n_seq * args.t / t_in:.0f} tok/s -> {t_in / t_srv:.2f}× (goal ≥ 0.8); "
                    f"engine programs {n_prog} after {warm} warm-up round(s), "
                    f"{srv.worker.sampling.programs()} after {len(rounds)} timed rounds "
                    f"(median kept; all: {', '.join(f'{r[0]:.2f}' for r in rounds)} s); "
                    f"CPU s per round, median of all: server "
                    f"{median(r[5][0] for r in rounds):.2f}"
                    f", XLA threads {median(r[5][1].get('XLA threads', 0) for r in rounds):.2f}"
                    f", worker {median(r[5][1].get('worker', 0) for r in rounds):.3f}, clients "
                    f"{median(r[4] for r in rounds):.2f}; engine steps per round "
                    f"{median(sum(st.get('decode', True) for st in r[6]) for r in rounds):.0f}",
                    flush=True,
                )
                arrived = sorted(a for st in trace for a in st["arrived"])
                gaps = sorted(np.diff(arrived))[::-1][:3] if len(arrived) > 1 else []
                pre = [st for st in trace if not st.get("decode", True)]
                line = "; ".join(
                    (
                        [
                            f"{len(pre)} prefill-only steps +{pre[0]['t0'] - c_t0:.2f}.."
                            f"+{pre[-1]['t1'] - c_t0:.2f} ({sum(x['t1'] - x['t0'] for x in pre):.2f}"
                            f" s in all, {sum(x['admitted'] for x in pre)} in)"
                        ]
                        if pre
                        else []
                    )
                    + [
                        f"+{st['t0'] - c_t0:.2f} {st['t1'] - st['t0']:.2f} s"
                        f" ({st['admitted']} in, {st['ended']} ended, {st['live']} live after"
                        f"{', hurried' if st['hurry'] else ''})"
                        for st in trace
                        if st.get("decode", True)
                    ]
                )
                print(
                    f"   the median round ({t_srv:.2f} s): requests sent by "
                    f"+{c_sent - c_t0:.2f} s, "
                    f"reached the worker +{arrived[0] - c_t0:.2f}..+{arrived[-1] - c_t0:.2f} s "
                    f"(largest gaps {', '.join(f'{g * 1e3:.0f}' for g in gaps)} ms); "
                    f"engine steps (start, seconds): {line}; last result at the clients "
                    f"+{t_srv:.2f} s; CPU s: server process {s_cpu[0]:.2f} ("
                    f"{', '.join(f'{k} {v:.2f}' for k, v in s_cpu[1].items())}), clients "
                    f"{c_cpu:.2f}"
                    f"{' (same process)' if mode == 'thread' else ''}; in-process call "
                    f"{t_in:.2f} s, {c_in:.2f} CPU s",
                    flush=True,
                )
            bare.sort(key=lambda r: r[0])
            t_d, s_d, c_d, th_d = bare[len(bare) // 2]
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 2
            # No overlap: the round is the model's time plus the bare round's. Perfect
            # overlap: the bare round's CPU seconds (server + clients) run on the cores the
            # in-process call leaves idle, the rest of them lengthen the round; on a
            # loaded machine the in-process call leaves "idle" what others take, so also
            # the CPU-only form, for an in-process call that fills the cores (as it does
            # on a quiet 2-core host: ~1.9 of 2): c_in / (c_in + bare CPU).
            spare = max(0.0, cores * t_in - c_in)
            if mode == "thread":  # the clients' CPU is in the server process's
                c_d = 0.0
            over = max(0.0, s_d + c_d - spare) / cores
            cpu_ceiling = c_in / (c_in + s_d + c_d)
            ratio = t_in / by_policy[policies[0]][len(by_policy[policies[0]]) // 2][0]
            print(
                f"   bound: the same {args.r} SDK requests answered at admission without "
                f"model work (a dummy result of {args.s}×{args.t} tokens each): median "
                f"{t_d:.2f} s of {', '.join(f'{r[0]:.2f}' for r in bare)} s; CPU s server "
                f"{s_d:.2f} ({', '.join(f'{k} {v:.2f}' for k, v in th_d.items())}), "
                f"clients {c_d:.2f} -> ceiling t_in / (t_in + overhead): no overlap "
                f"{t_in / (t_in + t_d):.2f}×, perfect overlap on {cores} cores "
                f"{t_in / (t_in + over):.2f}× (the in-process call used "
                f"{c_in / t_in:.1f} cores), CPU-bound c_in / (c_in + bare CPU) "
                f"{cpu_ceiling:.2f}× (measured {ratio:.2f}×)",
                flush=True,
            )
    finally:
        srv.stop()


@contextlib.contextmanager
def no_model(eng):
    """Benchmark-only: while inside, the server's sampling engine answers every sample
    request at submit with a dummy result of the size it asked for (num_samples ×
    max_tokens tokens and log-probs), no model work — the round's pure HTTP + SDK cost."""
    import numpy as np

    from jcp.sample.params import SampledSequence, SampleResult

    rng, ids = np.random.default_rng(0), itertools.count(1)

    def submit(
        prompt,
        sampling_params,
        adapter=None,
        num_samples=1,
        prompt_logprobs=False,
        callback=None,
        fields=None,
    ):
        n = sampling_params.max_tokens
        res = SampleResult(
            [
                SampledSequence(
                    rng.integers(0, 1000, n).astype(np.int32),
                    -rng.random(n).astype(np.float32),
                    "length",
                )
                for _ in range(num_samples)
            ]
        )
        rid = -next(ids)
        callback(rid, res)
        return rid

    eng.submit = submit  # an instance attribute over the method
    try:
        yield
    finally:
        del eng.submit


def median(xs) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else float("nan")


def thread_cpu(named: dict) -> dict:
    """CPU seconds so far of this process's threads: those in `named` (native id -> name),
    XLA's compute threads, and the rest (Linux /proc; empty elsewhere)."""
    out: dict = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    tick = os.sysconf("SC_CLK_TCK")
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:  # the thread ended
            continue
        comm, fields = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :]
        name = named.get(int(tid), "XLA threads" if "XLA" in comm else "other")
        user, system = fields.split()[11:13]
        out[name] = out.get(name, 0.0) + (int(user) + int(system)) / tick
    return out


def sdk_clients(url: str, prompts, s: int, t: int, conn):
    """R concurrent SDK sample requests, all sent at once as an RL step does; each round ->
    (start, all sent, all results back, CPU seconds of this process) on time.monotonic.
    conn None: -> the round function, for clients in the calling process; else serve
    rounds over the pipe until it sends None (a spawned client process)."""
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    import tinker
    from tinker import types

    sc = tinker.ServiceClient(base_url=url, api_key="tml-k")
    samp = sc.create_sampling_client(base_model="jcp-tiny").result()
    tsp = types.SamplingParams(max_tokens=t, temperature=1.0, seed=1, stop=[])
    inputs = [types.ModelInput.from_ints(p) for p in prompts]

    def round_():
        c0, t0 = time.process_time(), time.monotonic()
        futs = [samp.sample(x, s, tsp) for x in inputs]
        sent = time.monotonic()
        for f in futs:
            f.result()
        return t0, sent, time.monotonic(), time.process_time() - c0

    if conn is None:
        return round_
    while conn.recv() is not None:
        conn.send(round_())
    return None


if __name__ == "__main__":
    sys.exit(main())
