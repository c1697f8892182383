"""One engine, two protocols: the same sampling burst through jcp-serve's OpenAI route
(/v1/completions, the `openai` async client) and through the Tinker SDK, and the time to
first streamed token of a request that arrives during a burst.

The tiny Qwen3 of the OpenAI tests (tests/helpers/cookbook_harness.build_numpy: hidden 64,
2 layers, vocab 512, a byte-level BPE tokenizer), mesh --mesh (default 1,1,1), the server
in this process on 127.0.0.1 with an engine slot for each of the R·S sequences (and 8
more); the
clients in a spawned process (as deployed: no jax there, the server's GIL its own).

1. Burst: R requests × S samples × T tokens (random prompts of 4-16 token ids, drawn at
   temperature 1 with a seed, T tokens each: the model's EOS is never drawn), all sent at
   once — R `sample(num_samples=S)` calls of the Tinker SDK, or R `completions.create(n=S,
   max_tokens=T)` of openai.AsyncOpenAI —, wall time from the first send to the last
   answer; tokens/s = R·S·T / wall. Rounds alternate between the two protocols after a
   warm-up that compiles every program both meet; medians of --rounds. Where the server's
   CPU went, per round: its HTTP thread, the worker thread, XLA's compute threads.
2. Time to first token: one streamed /v1/completions request (n=1, T tokens) sent
   --ttft-delay s after a burst (OpenAI, as in 1.) starts, its first text chunk's arrival
   after its send; against the same request alone on an idle server. Medians.

    python benchmarks/openai_burst.py [--r 128] [--s 8] [--t 32] [--rounds 3]
                                      [--mesh 1,1,1] [--ttft-delay 0.05]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

from common import fake_cpu_devices, mesh_arg  # benchmarks/ is sys.path[0]
from engine import thread_cpu

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL, KEY = "tiny-chat", "tml-bench"


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mesh", type=mesh_arg, default="1,1,1")
    p.add_argument("--r", type=int, default=128, help="requests per burst")
    p.add_argument("--s", type=int, default=8, help="samples per request (n)")
    p.add_argument("--t", type=int, default=32, help="tokens per sample")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--ttft-delay",
        type=float,
        default=0.05,
        help="seconds after a burst starts that the streamed request is sent",
    )
    return p.parse_args(argv)


def clients(url: str, prompts, s: int, t: int, delay: float, conn) -> None:
    """The client process: serve rounds over the pipe ("tinker" | "openai" | "ttft" |
    "alone") until it sends None. A round -> (wall s, tokens) or, for ttft / alone, the
    streamed request's time to first token (s)."""
    import asyncio

    os.environ.setdefault("TINKER_TELEMETRY", "0")
    import openai
    import tinker
    from tinker import types

    sc = tinker.ServiceClient(base_url=url, api_key=KEY)
    samp = sc.create_sampling_client(base_model=MODEL).result()
    tsp = types.SamplingParams(max_tokens=t, temperature=1.0, seed=1)
    inputs = [types.ModelInput.from_ints(p) for p in prompts]

    def tinker_round():
        t0 = time.monotonic()
        futs = [samp.sample(x, s, tsp) for x in inputs]
        n = sum(len(q.tokens) for f in futs for q in f.result().sequences)
        return time.monotonic() - t0, n

    async def burst(oai):
        res = await asyncio.gather(
            *[
                oai.completions.create(
                    model=MODEL, prompt=p, n=s, max_tokens=t, temperature=1.0, seed=1
                )
                for p in prompts
            ]
        )
        return sum(r.usage.completion_tokens for r in res)

    async def first_token(oai, after: float) -> float:
        await asyncio.sleep(after)
        t0 = time.monotonic()
        stream = await oai.completions.create(
            model=MODEL, prompt=prompts[0], max_tokens=t, temperature=1.0, seed=2, stream=True
        )
        got = None
        async for ch in stream:
            if got is None and ch.choices and ch.choices[0].text:
                got = time.monotonic() - t0
        return got

    async def openai_round(kind: str):
        oai = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=600)
        try:
            if kind == "alone":
                return await first_token(oai, 0.0)
            t0 = time.monotonic()
            if kind == "ttft":
                n, ttft = await asyncio.gather(burst(oai), first_token(oai, delay))
                return ttft
            n = await burst(oai)
            return time.monotonic() - t0, n
        finally:
            await oai.close()

    while (kind := conn.recv()) is not None:
        conn.send(tinker_round() if kind == "tinker" else asyncio.run(openai_round(kind)))


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    fake_cpu_devices(args.mesh)
    import multiprocessing as mp

    import numpy as np

    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from helpers import cookbook_harness as C

    import jcp
    from jcp.server.service import Server

    folder = C.build_numpy(
        tempfile.mkdtemp(prefix="jcp-openai-bench-"),
        quiet=lambda fast: [i for i in range(len(fast)) if i in fast.added_tokens_decoder],
    )
    cfg, base = jcp.load_hf(folder)
    tr = jcp.Trainer(cfg, jcp.make_mesh(*args.mesh), base_params=base, max_adapters=2, max_rank=8)
    groups = args.mesh[0] * args.mesh[1]
    # Room for the burst and the streamed request beside it (with exactly R·S slots the
    # newcomer would wait for the burst's rows: admission is first come, first served).
    slots = -(-(args.r * args.s + 8) // groups) * groups
    srv = Server(
        tr,
        MODEL,
        tempfile.mkdtemp(prefix="jcp-openai-bench-state-"),
        {KEY: "bench"},
        tokenizer_id=folder,
        sample_slots=slots,
        sample_max_len=64,
    ).start()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(10, 380, int(rng.integers(4, 17))).tolist() for _ in range(args.r)]
    parent, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(
        target=clients, args=(srv.url, prompts, args.s, args.t, args.ttft_delay, child), daemon=True
    )
    proc.start()

    threads = {srv._thread.native_id: "HTTP", srv.worker._thread.native_id: "worker"}
    cpu = {}

    def run(kind):
        before = thread_cpu(threads)
        parent.send(kind)
        out = parent.recv()
        after = thread_cpu(threads)
        cpu.setdefault(kind, []).append({k: after[k] - before.get(k, 0.0) for k in after})
        return out

    try:
        print(
            f"jcp-serve {srv.url}: tiny Qwen3 (hidden {cfg.hidden_size}, {cfg.num_layers} "
            f"layers, vocab {cfg.vocab_size}), mesh {args.mesh}, {slots} engine slots; "
            f"burst {args.r} requests × {args.s} samples × {args.t} tokens",
            flush=True,
        )
        t0 = time.perf_counter()
        n_prog, quiet, warm = -1, 0, 0
        while quiet < 2 and warm < 8:  # two warm-up rounds in a row that compile nothing
            quiet = quiet + 1 if n_prog == srv.worker.sampling.programs() else 0
            n_prog = srv.worker.sampling.programs()
            for kind in ("tinker", "openai", "ttft", "alone"):
                run(kind)
            warm += 1
        print(
            f"   warm-up: {warm} rounds, {n_prog} programs, {time.perf_counter() - t0:.0f} s",
            flush=True,
        )
        got = {k: [] for k in ("tinker", "openai", "ttft", "alone")}
        cpu.clear()
        for _ in range(args.rounds):
            for kind in got:
                got[kind].append(run(kind))
        want = args.r * args.s * args.t
        for kind in ("tinker", "openai"):
            assert all(n == want for _, n in got[kind]), (kind, got[kind])
        rate = {k: statistics.median(want / w for w, _ in got[k]) for k in ("tinker", "openai")}
        wall = {k: statistics.median(w for w, _ in got[k]) for k in ("tinker", "openai")}
        print(
            f"1. burst {args.r}×{args.s}×{args.t}: Tinker SDK {rate['tinker']:.0f} tok/s "
            f"({wall['tinker']:.2f} s), OpenAI /v1/completions {rate['openai']:.0f} tok/s "
            f"({wall['openai']:.2f} s) -> OpenAI/Tinker {rate['openai'] / rate['tinker']:.2f}"
            f"× (medians of {args.rounds})",
            flush=True,
        )
        for kind in ("tinker", "openai"):
            parts = {
                k: statistics.median(c.get(k, 0.0) for c in cpu[kind])
                for k in ("HTTP", "worker", "XLA threads")
            }
            print(
                f"   server CPU s per burst, {kind}: "
                + ", ".join(f"{k} {v:.2f}" for k, v in parts.items()),
                flush=True,
            )
        during, alone = statistics.median(got["ttft"]), statistics.median(got["alone"])
        print(
            f"2. time to first streamed token: {during * 1e3:.0f} ms for a request sent "
            f"{args.ttft_delay * 1e3:.0f} ms into an OpenAI burst, {alone * 1e3:.0f} ms "
            f"alone (medians of {args.rounds}); the burst itself took "
            f"{wall['openai']:.2f} s",
            flush=True,
        )
        programs = srv.worker.sampling.programs()
        print(f"   programs compiled during the timed rounds: {programs - n_prog}", flush=True)
    finally:
        parent.send(None)
        proc.join(timeout=30)
        srv.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
