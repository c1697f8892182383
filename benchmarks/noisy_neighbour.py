"""A victim tenant's latency on jcp-serve, alone and beside a hostile neighbour.

One jcp-serve (a child process: tiny model, one CPU device, 127.0.0.1, two API keys) and an
asyncio driver (httpx for bob, aiohttp for alice; raw Tinker routes) with two tenants:

- bob, the victim: small requests at a steady rate (--rate per second, alternating a
  forward of one 16-token datum on his model and a 4-token sample of an 8-token prompt),
  each timed from its POST to its result (retrieve_future).
- alice, the neighbour, the worst load the bounds allow, all at once: big samples
  (--max-num-samples sequences to the end of the context), a burst of small samples up to
  her futures, forward passes (--neighbour-backward: forward_backward passes) of
  --max-datums datums of the longest sequences that fit the body bound, and a stream of
  hostile bodies the edge must refuse (a sparse
  target_prompt_logprobs naming a huge shape, a list of 200,000 bad tokens, JSON nested
  10,000 deep, a zstd bomb, out-of-window seq_ids).

First bob alone for --seconds, then bob beside alice for --seconds (after an untimed
spell of --settle s beside her, so that what her load compiles is compiled); prints bob's
p50 / p99 per phase and kind and their ratio (goal: p99 under the neighbour within 1.5× of alone), and
how many of alice's requests ran or were refused. Bounded: a victim request counts at most
--timeout s; alice's queued work is cancelled at the end and what still runs gets --drain
s; then the server is stopped.

On a deployment the clients run on other machines. Here both drivers run on this process's
first CPU and the server on the others from its start (cpus_apart; XLA sizes its compute
pool from that; --shared-cores leaves them all on every CPU), so neither driver takes a
core from the server, and the server has the same cores in both phases: sharing the two
cores of the 2-core host, alone the server had the core the drivers left idle and beside
her it did not, and her driver took the server's cores (bob's p99 ratio 1.38-1.78 sharing,
1.25-1.36 apart: benchmarks/RESULTS.md, "Noisy neighbour"). alice's driver also runs at
nice --neighbour-nice (19), and jcp-serve runs its compute at nice 10 on a CPU host
(--compute-nice, so that its event loop gets a core): sharing the cores, a driver at nice
0 took bob's compute's core whenever she sent a burst.

The untimed spell lasts --settle s (240): shapes the neighbour's load reaches only late
(her long samples' table rungs, row buckets; the server runs with --no-warmup) would
otherwise compile in the timed phase, each stalling the worker for seconds — a compile
cost, not a scheduling one (docs/serving.md, "Fairness across tenants"); with 10 s,
bob's p99 beside her read 5-10 s from those compiles alone, and since each decode
program holds every draw kind (longer compiles), 60 s no longer covers them either
(2026-12-05, load ~7: bob's p99 beside her 37 s, 578×, every timed request behind a
compile).

--rounds N repeats the pair of phases N times, alone then beside her (the untimed spell
before the first; 15 s of it before each later one; each later alone phase only once the
server is idle, her cancelled work's tail done: wait_idle), and reports the p99 of all of
them pooled as well as each round's: the p99 of one phase of 480 requests is its fifth
slowest, and identical runs read ratios ±0.3 apart (benchmarks/RESULTS.md, "Noisy
neighbour"); alternating the phases also spreads a slow spell of the host over both.

    python benchmarks/noisy_neighbour.py [--seconds 20] [--rate 4] [--settle 240] [--warmup 5]
        [--rounds 1] [--neighbour-nice 19] [--neighbour-backward] [--turn-spans N]
        [--shared-cores] [--smoke]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
import tinker_http
from common import on_cores
from tinker_http import PROTO, Tenant, cpu_s, fb_body, stop_server

KEYS = {"tml-victim": "bob", "tml-hostile": "alice"}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=20.0, help="length of each phase")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="pairs of phases (alone, then beside her), their requests pooled",
    )
    p.add_argument("--rate", type=float, default=4.0, help="victim requests per second")
    p.add_argument("--max-num-samples", type=int, default=64)
    p.add_argument("--max-datums", type=int, default=64)
    p.add_argument("--max-body-bytes", type=int, default=4 << 20)
    p.add_argument("--context", type=int, default=1024, help="max_context_length")
    p.add_argument(
        "--timeout",
        type=float,
        default=120.0,
        help="a victim request still waiting after this long counts as this long",
    )
    p.add_argument(
        "--drain",
        type=float,
        default=30.0,
        help="how long the neighbour's running work may finish after its phase",
    )
    p.add_argument("--sample-slots", type=int, default=128)
    p.add_argument(
        "--warmup",
        type=float,
        default=None,
        help="seconds of bob alone at his rate, untimed, once his two first requests have "
        "compiled his shapes, before the first phase (default 5, --smoke: 0): a fresh "
        "server's first requests ran 80-95 ms, 3 of them in the first 5 s of the first "
        "alone phase",
    )
    p.add_argument(
        "--settle",
        type=float,
        default=None,
        help="seconds of the untimed spell beside the neighbour (default 240, --smoke: "
        "--seconds): so that the shapes her load reaches late (her long samples' table "
        "rungs, row buckets) compile before bob is timed",
    )
    p.add_argument(
        "--neighbour",
        type=lambda s: s.split(","),
        default=["samples", "burst", "forwards", "refused"],
        help="what the neighbour sends, of samples,burst,forwards,refused",
    )
    p.add_argument(
        "--neighbour-backward",
        action="store_true",
        help="the neighbour's big passes are forward_backward (default: forward only): "
        "each micro-batch is then about three times as long, and the server runs it in "
        "turns (docs/serving.md, 'Fairness across tenants')",
    )
    p.add_argument(
        "--turn-spans",
        type=int,
        default=None,
        help="jcp-serve's --turn-spans (default: the server's): the layer spans of her "
        "forward_backward micro-batches in turns",
    )
    p.add_argument(
        "--neighbour-nice",
        type=int,
        default=19,
        help="the niceness of alice's driver process (default 19; 0: as the server's "
        "event loop): her client shares this host's cores (bob's driver's, and with "
        "--shared-cores the server's) only because the benchmark runs on one machine",
    )
    p.add_argument(
        "--shared-cores",
        action="store_true",
        help="leave the drivers and the server on the same CPUs (default: the drivers on "
        "one CPU, the server on the others, as on a deployment, where clients run on "
        "other machines: cpus_apart)",
    )
    p.add_argument(
        "--json",
        metavar="FILE",
        help="write every victim request (phase, kind, time.monotonic() at its POST, "
        "seconds) and the summary to FILE",
    )
    p.add_argument(
        "--server-log",
        dest="server_log_to",
        metavar="FILE",
        help="copy the server's log to FILE at the end (the run's folder is removed)",
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help="a few seconds, small neighbour (tests/test_benchmarks.py)",
    )
    a = p.parse_args(argv)
    if a.smoke:
        a.seconds, a.rate, a.max_num_samples, a.max_datums = 2.0, 5.0, 4, 4
        a.context, a.sample_slots = 256, 16
    if a.settle is None:
        a.settle = a.seconds if a.smoke else 240.0
    if a.warmup is None:
        a.warmup = 0.0 if a.smoke else 5.0
    return a


# ---------------------------------------------------------------------- the server


def start_server(a, folder: str, cores: set | None) -> tuple[subprocess.Popen, str]:
    """jcp-serve in a child process with this benchmark's bounds, on `cores` when given ->
    (process, base URL)."""
    flags = [
        "--max-num-samples",
        str(a.max_num_samples),
        "--max-datums",
        str(a.max_datums),
        "--max-body-bytes",
        str(a.max_body_bytes),
        "--max-futures",
        "512",
        "--max-tokens-per-device",
        str(a.context),
        "--sample-slots",
        str(a.sample_slots),
        "--no-warmup",
    ]  # the driver's warm-up compiles the shapes it sends
    if a.turn_spans is not None:
        flags += ["--turn-spans", str(a.turn_spans)]
    return tinker_http.start_server(folder, KEYS, flags, cores=cores)


# ---------------------------------------------------------------------- requests


async def setup(t: Tenant, name: str) -> dict:
    """A session, a rank-4 model and a sampling session on the base model."""
    sid = (await t.post("create_session", {})).json()["session_id"]
    model = await t.call(
        "create_model",
        {"session_id": sid, "model_seq_id": 0, "base_model": name, "lora_config": {"rank": 4}},
    )
    samp = (await t.post("create_sampling_session", {"session_id": sid, "base_model": name})).json()
    return {
        "session": sid,
        "model": model["model_id"],
        "seq": 0,
        "base_model": name,
        "sampler": samp["sampling_session_id"],
    }


def sample(sampler: str, prompt: list[int], n: int, max_tokens: int) -> dict:
    return {
        "sampling_session_id": sampler,
        "num_samples": n,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": prompt}]},
        "sampling_params": {"max_tokens": max_tokens, "temperature": 1.0},
    }


# ---------------------------------------------------------------------- the two tenants


async def victim(t: Tenant, st: dict, a, vocab: int, seconds: float) -> list[tuple]:
    """bob's steady stream: one request every 1/rate s, each timed to its result."""
    lat, tasks = [], []  # (kind, seconds, time.monotonic() at its POST)
    rng = np.random.default_rng(1)

    async def one(k: int):
        import httpx

        kind = "forward" if k % 2 else "sample"
        at, t0 = time.monotonic(), time.perf_counter()
        try:
            await asyncio.wait_for(send(k), a.timeout)
        except TimeoutError:  # counted at the bound: p99 then reads ≥ --timeout
            pass
        except httpx.TransportError:
            # A connection the server dropped (a keep-alive closed as it was reused, under
            # load): not timed, counted apart.
            kind = "dropped " + kind
        lat.append((kind, time.perf_counter() - t0, at))

    async def send(k: int):
        if k % 2:
            st["seq"] += 1
            out = await t.call(
                "forward_backward",
                content=fb_body(st["model"], st["seq"], 1, 16, vocab, k),
                **{"Content-Type": PROTO},
            )
        else:
            out = await t.call(
                "asample", sample(st["sampler"], rng.integers(0, vocab, 8).tolist(), 1, 4)
            )
        assert "proto" in out, out  # the victim's requests are all good ones

    start, k = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        tasks.append(asyncio.create_task(one(k)))
        k += 1
        await asyncio.sleep(max(0.0, start + k / a.rate - time.perf_counter()))
    await asyncio.gather(*tasks)
    return lat


def json_body(body: dict) -> tuple[bytes, dict]:
    return json.dumps(body).encode(), {"Content-Type": "application/json"}


def hostile_bodies(st: dict) -> list[tuple[str, bytes, dict]]:
    """(route, body, headers): bodies the edge must refuse, each encoded once."""
    import zstandard

    c = zstandard.ZstdCompressor().compressobj()
    bomb = b"".join(c.compress(bytes(1 << 20)) for _ in range(256)) + c.flush()
    bad = sample(st["sampler"], [1, 2], 1, 2)
    return [
        (
            "asample",
            *json_body(
                {
                    **bad,
                    "target_prompt_logprobs": {
                        "data": [1],
                        "dtype": "int64",
                        "shape": [1, 10**11],
                        "sparse_crow_indices": [0, 1],
                        "sparse_col_indices": [0],
                    },
                }
            ),
        ),
        ("asample", *json_body({**bad, "prompt": {"chunks": [{"tokens": ["a"] * 200_000}]}})),
        (
            "optim_step",
            b'{"model_id": ' + b"[" * 10_000 + b"]" * 10_000 + b"}",
            {"Content-Type": "application/json"},
        ),
        ("forward_backward", bomb, {"Content-Type": PROTO, "Content-Encoding": "zstd"}),
        (
            "save_weights_external",
            *json_body({"model_id": st["model"], "path": "x", "seq_id": 2**70}),
        ),
        ("save_weights", *json_body({"model_id": st["model"], "seq_id": st["seq"] + 10**6})),
    ]


async def hostile(url: str, st: dict, a, vocab: int, ctx: int, stop) -> dict:
    """alice's worst legal load until `stop` (a multiprocessing Event) is set; then her
    queued work is cancelled and what already runs is waited for. -> counts."""
    rids: set[str] = set()  # her futures not yet answered (cancelled at the end)
    counts = collections.Counter()
    prompt = list(range(1, 9))
    length = max(16, min(ctx - 1, a.max_body_bytes // (a.max_datums * 20)))
    # Encoded once: the driver's own CPU must not be what slows anyone. A forward's seq_id
    # goes in front of its body (protobuf merges: the prefix's seq_id stands).
    big_fb = fb_body("", 0, a.max_datums, length, vocab, 0, forward_only=not a.neighbour_backward)

    def big_sample(max_tokens: int) -> list:  # [(body, headers), max_tokens]
        return [json_body(sample(st["sampler"], prompt, a.max_num_samples, max_tokens)), max_tokens]

    big = big_sample(ctx - len(prompt))
    small = json_body(sample(st["sampler"], prompt, 1, 16))
    # aiohttp: her driver shares the host's cores with the server and the victim, and
    # httpx took ~0.65 of a core for her load (aiohttp a fraction: tinker_http.AioClient).
    client = tinker_http.AioClient(url, 1024)
    try:
        t = Tenant(client, "tml-hostile")
        from tinker.proto import tinker_public_pb2 as pb

        async def submit(route, content, headers):
            r = await t.post(route, content=content, **headers)
            if r.status_code == 200 and "request_id" in r.json():
                rids.add(r.json()["request_id"])
            return r

        async def result(answer):
            out = await t.result(answer)
            if answer.status_code == 200:
                rids.discard(answer.json().get("request_id"))
            return out

        def count(what: str, out: dict) -> None:
            counts[
                what if "proto" in out else f"{what} failed: {str(out.get('error', out))[:70]}"
            ] += 1

        async def big_samples():
            # The longest the engine admits at this many samples: from the context's end,
            # halved while refused for pages.
            while True:
                out = await result(await submit("asample", *big[0]))
                if "proto" in out or big[1] <= 16 or "pages" not in str(out.get("error")):
                    break
                big[:] = big_sample(big[1] // 2)
            count("big samples", out)
            while True:
                count("big samples", await result(await submit("asample", *big[0])))

        async def futures_burst():
            while True:
                answers = await asyncio.gather(*(submit("asample", *small) for _ in range(256)))
                for out in await asyncio.gather(*(result(r) for r in answers)):
                    count("burst samples", out)

        async def big_forwards():
            while True:
                st["seq"] += 1
                head = pb.ForwardBackwardRequest(model_id=st["model"], seq_id=st["seq"])
                count(
                    "big forwards",
                    await result(
                        await submit(
                            "forward_backward",
                            head.SerializeToString() + big_fb,
                            {"Content-Type": PROTO},
                        )
                    ),
                )

        async def refused():
            bodies = hostile_bodies(st)
            while True:
                for route, body, headers in bodies:
                    r = await t.post(route, content=body, **headers)
                    ok = r.status_code != 200 or "error" in await t.result(r)
                    counts["hostile bodies refused" if ok else "hostile bodies ACCEPTED"] += 1
                await asyncio.sleep(0.05)

        parts = {
            "samples": (big_samples, big_samples),
            "burst": (futures_burst,),
            "forwards": (big_forwards,),
            "refused": (refused,),
        }
        tasks = [asyncio.create_task(f()) for name in a.neighbour for f in parts[name]]
        while not stop.is_set():
            await asyncio.sleep(0.05)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        # A few at a time: thousands of cancels at once would be a burst of their own.
        gate = asyncio.Semaphore(32)

        async def cancel(r):
            async with gate:
                await t.post("cancel_future", {"request_id": r})

        await asyncio.gather(*(cancel(r) for r in rids))
        # What was already running may finish, for at most --drain seconds.
        waits = [asyncio.create_task(t.wait(r)) for r in rids]
        _, running = await asyncio.wait(waits, timeout=a.drain) if waits else ((), ())
        for w in running:
            w.cancel()
        if running:
            counts["still running at the end"] = len(running)
    finally:
        await client.aclose()
    return dict(counts)


def hostile_process(url: str, st: dict, a, vocab: int, ctx: int, stop, out) -> None:
    """alice in her own process (the victim's timings share no event loop or GIL with
    her driver), at nice a.neighbour_nice: hostile() -> (its counts, her model's next
    seq_id) on `out`."""
    os.nice(a.neighbour_nice)
    counts = asyncio.run(hostile(url, st, a, vocab, ctx, stop))
    out.put((counts, st["seq"]))


class Neighbour:
    """alice's process for one phase: `with Neighbour(...) as n:` … then n.counts, and
    n.seq: the last seq_id her process used on her model (the next phase goes on from
    it)."""

    def __init__(self, url: str, st: dict, a, vocab: int, ctx: int):
        import multiprocessing

        mp = multiprocessing.get_context("spawn")
        self.stop, self.out = mp.Event(), mp.Queue()
        self.proc = mp.Process(
            target=hostile_process, args=(url, st, a, vocab, ctx, self.stop, self.out)
        )
        self.counts: dict = {}
        self.seq = st["seq"]

    def __enter__(self):
        self.proc.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.counts, self.seq = self.out.get(timeout=900)
        self.proc.join(60)


# ---------------------------------------------------------------------- the run


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs) * 1e3, q))


def log_size(a) -> int:
    return os.path.getsize(a.server_log)


def compiles_since(a, at: int) -> tuple[int, float, list[str]]:
    """(programs, seconds, their names) the server compiled since its log was `at` bytes
    long (JAX_LOG_COMPILES: a compile stalls the worker, whoever's shape it is)."""
    with open(a.server_log, errors="replace") as f:
        f.seek(at)
        found = re.findall(r"Finished XLA compilation of (.*) in ([0-9.]+) sec", f.read())
    return len(found), sum(float(secs) for _, secs in found), [name for name, _ in found]


class Usage:
    """CPU seconds of the server and the drivers, and the 1-minute load average, over one
    timed phase: on a shared 2-core host the neighbour's driver and other work take cores
    from the server (and the victim's own driver waits for one too)."""

    def __init__(self, pids: dict):
        self.pids = pids
        self.cpu0 = {k: cpu_s(p) for k, p in pids.items()}
        self.load0 = os.getloadavg()[0]

    def end(self) -> dict:
        return {
            "cpu_s": {k: round(cpu_s(p) - self.cpu0[k], 2) for k, p in self.pids.items()},
            "load": (self.load0, os.getloadavg()[0]),
        }


def cpus_apart() -> tuple[set, set] | None:
    """This process's CPUs split for the drivers and the server -> (the first one, the
    others); None with fewer than two."""
    cpus = sorted(os.sched_getaffinity(0))
    return ({cpus[0]}, set(cpus[1:])) if len(cpus) > 1 else None


def affinities(pid: int) -> list:
    """The CPUs of each of process `pid`'s threads, as the kernel reports them."""
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            out.append(sorted(os.sched_getaffinity(int(tid))))
    return out


def wait_idle(pid: int, busy: float = 0.1, quiet_s: float = 2.0, bound_s: float = 300.0) -> float:
    """Wait until process `pid` has used under `busy` of a core for `quiet_s` s in a row
    (at most `bound_s` s) -> the seconds waited. Before an alone phase after a neighbour
    round: her cancelled work may still run after her driver stops (samples already
    admitted, passes already taken), and bob's requests beside it would be timed in her
    tail, his forwards fused into shapes that then compile in the alone phase."""
    t0 = last = time.monotonic()
    used, quiet = cpu_s(pid), 0.0
    while quiet < quiet_s and time.monotonic() - t0 < bound_s:
        time.sleep(0.5)
        now, c = time.monotonic(), cpu_s(pid)
        quiet = quiet + now - last if (c - used) / (now - last) < busy else 0.0
        last, used = now, c
    return time.monotonic() - t0


def _plus(x: tuple, y: tuple) -> tuple:
    return tuple(p + q for p, q in zip(x, y))


def _merged(into: dict | None, use: dict) -> dict:
    """Usage.end() of several phases: CPU seconds summed, the load average of the first
    phase's start and the last one's end."""
    if into is None:
        return use
    cpu = {k: round(into["cpu_s"].get(k, 0.0) + v, 2) for k, v in use["cpu_s"].items()}
    return {"cpu_s": cpu, "load": (into["load"][0], use["load"][1])}


async def drive(a, url: str) -> dict:
    import httpx

    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        bob, alice = Tenant(client, "tml-victim"), Tenant(client, "tml-hostile")
        caps = (
            await bob.client.get("/api/v1/get_server_capabilities", headers={"X-API-Key": bob.key})
        ).json()
        name = caps["supported_models"][0]["model_name"]
        ctx = caps["supported_models"][0]["max_context_length"]
        import jcp

        vocab = jcp.QwenConfig.tiny().vocab_size
        b, h = await setup(bob, name), await setup(alice, name)
        await victim(bob, b, a, vocab, 2 / a.rate)  # compiles bob's shapes, untimed
        # Then a spell at his rate, untimed: a fresh server's first requests are slow.
        await victim(bob, b, a, vocab, a.warmup)
        pids = {"server": a.server_pid, "victim's driver": os.getpid()}
        out = {"alone": [], "beside": [], "rounds": []}
        compiles = {"alone": (0, 0.0, []), "beside": (0, 0.0, [])}
        usage, counts, idle = {}, collections.Counter(), []
        for r in range(a.rounds):
            if r:  # her last round's tail ends first (wait_idle)
                idle.append(await asyncio.to_thread(wait_idle, a.server_pid))
            at, used = log_size(a), Usage(pids)
            alone = await victim(bob, b, a, vocab, a.seconds)
            compiles["alone"] = _plus(compiles["alone"], compiles_since(a, at))
            usage["alone"] = _merged(usage.get("alone"), used.end())
            with Neighbour(url, h, a, vocab, ctx) as n:
                # Untimed first: whatever alice's load compiles (bob's forwards fused with
                # hers too) is compiled before bob is timed beside her; in a later round,
                # her load reaches its steady state again (a seq_id her last round's
                # driver took but never sent holds her forwards for GAP_TIMEOUT_S).
                await victim(bob, b, a, vocab, a.settle if r == 0 else min(a.settle, 15.0))
                at, beside_at = log_size(a), time.monotonic()
                used = Usage({**pids, "neighbour's driver": n.proc.pid})
                beside = await victim(bob, b, a, vocab, a.seconds)
                compiles["beside"] = _plus(compiles["beside"], compiles_since(a, at))
                usage["beside"] = _merged(usage.get("beside"), used.end())
            counts.update(n.counts)
            h["seq"] = n.seq  # her next round's requests go on in order
            out["alone"] += alone
            out["beside"] += beside
            out["rounds"].append({"alone": alone, "beside": beside, "beside_at": beside_at})
        health = await bob.client.get("/api/v1/healthz")
        return {
            **out,
            "beside_at": out["rounds"][0]["beside_at"],
            "compiles": compiles,
            "usage": usage,
            "counts": dict(counts),
            "idle_waits": idle,
            "ctx": ctx,
            "healthy": health.status_code == 200,
        }


def main(argv=None) -> dict:
    a = parse_args(sys.argv[1:] if argv is None else argv)
    folder = tempfile.mkdtemp(prefix="jcp-noisy-")
    a.server_log = os.path.join(folder, "server.log")
    t0 = time.monotonic()
    cpus = os.sched_getaffinity(0)
    apart = None if a.shared_cores else cpus_apart()
    os.environ["JAX_LOG_COMPILES"] = "1"  # the server's log counts its compiles
    try:
        proc, url = start_server(a, folder, apart and apart[1])
    finally:
        del os.environ["JAX_LOG_COMPILES"]
    a.server_pid = proc.pid
    try:
        # the drivers: this process, and alice's, spawned from it
        with on_cores(apart and apart[0]):
            # As the kernel reports them: (the drivers' CPUs, each server thread's).
            placed = [sorted(os.sched_getaffinity(0)), affinities(proc.pid)]
            print(
                f"the drivers on CPU {sorted(apart[0])}, the server on CPUs {sorted(apart[1])}"
                if apart
                else f"the drivers and the server share CPUs {sorted(cpus)}"
            )
            print(
                f"jcp-serve at {url} (started in {time.monotonic() - t0:.0f} s); phases of "
                f"{a.seconds:g} s, victim at {a.rate:g} requests/s, neighbour's driver at "
                f"nice {a.neighbour_nice}, her big passes "
                + ("forward_backward" if a.neighbour_backward else "forward only")
                + ("" if a.turn_spans is None else f", --turn-spans {a.turn_spans}"),
                flush=True,
            )
            res = asyncio.run(drive(a, url))
    except BaseException:
        print(f"the server's log and state are kept in {folder}", file=sys.stderr)
        raise
    finally:
        stop_server(proc)
    res["server_exit"], res["placed"] = proc.returncode, placed
    if a.server_log_to:  # its compiles by name (JAX_LOG_COMPILES), for instance
        shutil.copyfile(a.server_log, a.server_log_to)
    shutil.rmtree(folder, ignore_errors=True)  # a run that finished leaves nothing behind
    res["state_dir"] = folder
    rows = {}
    for phase in ("alone", "beside"):
        for kind in ("sample", "forward", "all"):
            xs = [s for k, s, _ in res[phase] if kind in (k, "all") and "dropped" not in k]
            rows[phase, kind] = (pct(xs, 50), pct(xs, 99), len(xs))
            print(
                f"victim {phase:>6} {kind:>7}: p50 {rows[phase, kind][0]:8.1f} ms   "
                f"p99 {rows[phase, kind][1]:8.1f} ms   ({len(xs)} requests)"
            )
        n, secs, names = res["compiles"][phase]
        print(
            f"victim {phase:>6}: the server compiled {n} programs ({secs:.1f} s) meanwhile"
            + (": " + ", ".join(names) if names else "")
        )
        use = res["usage"][phase]
        print(
            f"victim {phase:>6}: CPU s "
            + ", ".join(f"{k} {v:.1f}" for k, v in use["cpu_s"].items())
            + f"; load average {use['load'][0]:.2f} -> {use['load'][1]:.2f}"
        )
        dropped = sum("dropped" in k for k, _, _ in res[phase])
        if dropped:
            print(f"victim {phase:>6}: {dropped} requests on a dropped connection (not timed)")
    rows = {phase: rows[phase, "all"] for phase in ("alone", "beside")}
    ratio = rows["beside"][1] / rows["alone"][1]
    print(
        f"p99 beside / alone: {ratio:.2f} (goal ≤ 1.5); p50 ratio "
        f"{rows['beside'][0] / rows['alone'][0]:.2f}"
        + (f" ({a.rounds} rounds pooled)" if a.rounds > 1 else "")
    )
    res["round_ratios"] = [
        pct([s for _, s, _ in r["beside"]], 99) / pct([s for _, s, _ in r["alone"]], 99)
        for r in res["rounds"]
    ]
    if a.rounds > 1:
        print("p99 ratio by round: " + ", ".join(f"{x:.2f}" for x in res["round_ratios"]))
        print(
            "before each later alone phase, the server went idle after: "
            + ", ".join(f"{x:.1f} s" for x in res["idle_waits"])
        )
    print(
        "neighbour: "
        + json.dumps(res["counts"], sort_keys=True)
        + f"; context {res['ctx']}; healthz after: {'ok' if res['healthy'] else 'FAILED'}"
    )
    starts = [r["beside_at"] for r in res["rounds"]]
    slow = sorted(res["beside"], key=lambda r: -r[1])[:5]

    def when(at: float) -> str:  # the round (when several) and the time into its phase
        i = max(j for j, t in enumerate(starts) if t <= at + 1e-9)
        return (f"round {i + 1} " if len(starts) > 1 else "") + f"+{at - starts[i]:.1f} s"

    print(
        "victim beside, slowest: "
        + ", ".join(f"{k} {s * 1e3:.0f} ms at {when(at)}" for k, s, at in slow)
    )
    res["p99_ratio"], res["rows"] = ratio, rows
    if a.json:
        with open(a.json, "w") as f:
            json.dump({**res, "rows": {k: list(v) for k, v in rows.items()}}, f)
    return res


if __name__ == "__main__":
    main()
