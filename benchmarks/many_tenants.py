"""Many tenants on one jcp-serve: what a fused pass over N tenants' models costs against
one model doing the same work.

One jcp-serve (a child process: tiny model, one CPU device, the default --max-adapters,
--adapter-memory and warm-up) and an asyncio driver (aiohttp or httpx, raw Tinker routes; one SDK
client per tenant would cost more than the server): N tenants, each its own API key,
session and rank-8 model, each send one forward_backward of one datum of --length tokens,
all at once, so the server fuses them (jcp/server/scheduler.py: passes of as many models
as the token budget and the adapter memory hold); then each its optim_step. The baseline:
one tenant sends the same N datums on one model in one request. Rounds alternate (--warm
untimed ones first: they compile), best of --rounds; prints the forward_backward seconds and
their ratio (goal, issue 33: fused ≤ 1.3× one model), and the N optim_steps apart (one
each, which one model does not pay). In one more round of the N tenants, tenant N + 1 creates its
model while the passes run: that round's time against the others, and the create's
latency (a slot's copy: the create must not wait for the passes, nor delay them beyond
its copy).

    python benchmarks/many_tenants.py [--tenants 1024] [--length 256] [--warm 2] [--rounds 2]
                                      [--client aiohttp|httpx] [--no-warmup]
    python benchmarks/many_tenants.py --in-process [--tenants 1024]   # no server
    python benchmarks/many_tenants.py --smoke
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time

import numpy as np
import tinker_http
from tinker_http import PROTO, Tenant, cpu_s, fb_body


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tenants", type=int, default=1024)
    p.add_argument("--length", type=int, default=256, help="tokens per datum")
    p.add_argument("--rounds", type=int, default=2, help="timed rounds of each kind")
    p.add_argument(
        "--warm",
        type=int,
        default=2,
        help="untimed rounds first (with --no-warmup they compile: a fused pass's grouping "
        "of tenants varies with arrival, and each new (rows, adapters) shape compiles once)",
    )
    p.add_argument(
        "--no-warmup",
        action="store_true",
        help="start jcp-serve with --no-warmup: the rounds compile each pass shape they meet "
        "(on this machine ~8 programs of 7-25 s for 256 tenants, through the third round)",
    )
    p.add_argument("--concurrency", type=int, default=64, help="HTTP requests in flight")
    p.add_argument(
        "--client",
        choices=("aiohttp", "httpx"),
        default="aiohttp",
        help="the driver's HTTP client (it shares the server's cores: aiohttp costs less CPU)",
    )
    p.add_argument(
        "--in-process",
        action="store_true",
        help="no server: one Trainer's forward_backward over the N datums on N adapters "
        "against one adapter, and N optim_steps (the pass's own cost, without HTTP and "
        "scheduling)",
    )
    p.add_argument("--smoke", action="store_true", help="8 tenants of 16 tokens, one round")
    a = p.parse_args(argv)
    if a.smoke:
        a.tenants, a.length, a.rounds, a.warm, a.no_warmup = 8, 16, 1, 1, True
    return a


async def gather(n: int, make, limit: int) -> list:
    """make(i) for i < n, at most `limit` in flight."""
    sem = asyncio.Semaphore(limit)

    async def one(i):
        async with sem:
            return await make(i)

    return await asyncio.gather(*(one(i) for i in range(n)))


async def new_model(t: Tenant, seed: int) -> dict:
    sid = (await t.post("create_session", {})).json()["session_id"]
    out = await t.call(
        "create_model",
        {
            "session_id": sid,
            "model_seq_id": 0,
            "base_model": "jcp-tiny",
            "lora_config": {"rank": 8, "seed": seed},
        },
    )
    if "model_id" not in out:  # {"error": …} or {"refused": status}
        raise RuntimeError(f"create_model failed: {out}")
    return {"model": out["model_id"], "seq": 0}


async def train_round(tenants, models, bodies, limit: int, server: int) -> tuple[float, ...]:
    """One forward_backward per (tenant, model, body) at once, then one optim_step each ->
    (seconds to the last forward_backward's result, then to the last optim_step's, and the
    CPU seconds the server process and this driver used over the forward_backwards)."""

    async def fb(i):
        st = models[i]
        st["seq"] += 1
        body = bodies[i](st["model"], st["seq"])
        out = await tenants[i].call("forward_backward", content=body, **{"Content-Type": PROTO})
        if "refused" in out or "error" in out:
            raise RuntimeError(f"forward_backward failed: {str(out)[:300]}")

    async def step(i):
        st = models[i]
        st["seq"] += 1
        out = await tenants[i].call(
            "optim_step",
            {
                "model_id": st["model"],
                "seq_id": st["seq"],
                "adam_params": {"learning_rate": 1e-4},
            },
        )
        if "refused" in out or "error" in out:
            raise RuntimeError(f"optim_step failed: {str(out)[:300]}")

    t0, c0, d0 = time.perf_counter(), cpu_s(server), time.process_time()
    await gather(len(models), fb, limit)
    t1, c1, d1 = time.perf_counter(), cpu_s(server), time.process_time()
    await gather(len(models), step, limit)
    return t1 - t0, time.perf_counter() - t1, c1 - c0, d1 - d0


async def drive(a, url: str, keys: list[str], server: int) -> dict:
    import httpx

    vocab = 512  # jcp.QwenConfig.tiny()
    n = a.tenants
    if a.client == "aiohttp":
        client = tinker_http.AioClient(url, a.concurrency)
    else:
        client = httpx.AsyncClient(
            base_url=url, timeout=600, limits=httpx.Limits(max_connections=a.concurrency)
        )
    try:
        tenants = [Tenant(client, k) for k in keys]
        t0 = time.perf_counter()
        models = await gather(n + 1, lambda i: new_model(tenants[i], i), a.concurrency)
        create_s = time.perf_counter() - t0
        print(f"created {n + 1} models in {create_s:.1f} s", flush=True)
        many = [lambda m, s, i=i: fb_body(m, s, 1, a.length, vocab, i, False) for i in range(n)]
        one = [lambda m, s: fb_body(m, s, n, a.length, vocab, 0, False)]
        fused, alone = [], []
        for r in range(a.warm + a.rounds):
            f = await train_round(tenants[:n], models[:n], many, a.concurrency, server)
            s = await train_round(tenants[n:], models[n:], one, a.concurrency, server)
            print(
                f"round {r}: {n} tenants {f[0]:.2f} + {f[1]:.2f} s (forward_backward + "
                f"optim_step; CPU s server {f[2]:.2f}, driver {f[3]:.2f}), one model "
                f"{s[0]:.2f} + {s[1]:.2f} s (server {s[2]:.2f}, driver {s[3]:.2f}); "
                f"load {os.getloadavg()[0]:.1f}",
                flush=True,
            )
            if r >= a.warm:
                fused.append(f)
                alone.append(s)

        # Tenant n + 1 creates its model while the n tenants' round runs.
        late = Tenant(client, keys[n + 1])
        round_task = asyncio.create_task(
            train_round(tenants[:n], models[:n], many, a.concurrency, server)
        )
        await asyncio.sleep(0.05)
        c0 = time.perf_counter()
        await new_model(late, n + 1)
        late_create_s = time.perf_counter() - c0
        during = await round_task
    finally:
        await client.aclose()
    best_f, best_s = min(fused), min(alone)
    return {
        "tenants": n,
        "length": a.length,
        "create_all_s": create_s,
        "fused_s": best_f[0],
        "one_model_s": best_s[0],
        "ratio": best_f[0] / best_s[0],
        # The server's own cost: on one host the driver's HTTP work takes cores from it.
        "server_cpu_ratio": best_f[2] / best_s[2],
        "server_cpu_s": (best_f[2], best_s[2]),
        "driver_cpu_s": (best_f[3], best_s[3]),
        "optim_steps_s": min(f[1] for f in fused),
        "round_with_create_s": during[0],
        "round_s": [f[0] for f in fused],
        "late_create_s": late_create_s,
    }


def in_process(a) -> dict:
    """The fused pass without the server: N adapters' one datum each in one Trainer call
    (micro-batches of one device's --max-tokens rows) against one adapter's N datums."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jcp

    cfg = jcp.QwenConfig.tiny()
    n = a.tenants
    tr = jcp.Trainer(
        cfg, jcp.make_mesh(1, 1, 1), max_adapters=n + 1, max_rank=8, max_tokens_per_device=4096
    )
    ids = [tr.create_adapter(rank=8, seed=i) for i in range(n)]
    rng = np.random.default_rng(0)
    data = []
    for _ in range(n):
        toks = rng.integers(0, cfg.vocab_size, a.length + 1)
        data.append(
            jcp.Datum(
                model_input=toks[:-1],
                loss_fn_inputs={
                    "target_tokens": toks[1:],
                    "weights": np.ones(a.length, np.float32),
                },
            )
        )
    runs = {"fused": ids, "one": [ids[0]] * n}
    best = {k: float("inf") for k in runs}
    for r in range(a.warm + a.rounds):
        for k, owners in runs.items():
            t0 = time.perf_counter()
            tr.forward_backward(data, "cross_entropy", adapters=owners)
            dt = time.perf_counter() - t0
            print(f"round {r}: {k} {dt:.2f} s", flush=True)
            if r >= a.warm:
                best[k] = min(best[k], dt)
    t0 = time.perf_counter()
    for k in ids:
        tr.optim_step(k, jcp.AdamParams(learning_rate=1e-4))
    steps = time.perf_counter() - t0
    return {
        "tenants": n,
        "length": a.length,
        "fused_s": best["fused"],
        "one_model_s": best["one"],
        "ratio": best["fused"] / best["one"],
        "optim_steps_s": steps,
        "pages": tr.state.num_pages,
    }


def main(argv=None) -> dict:
    a = parse_args(argv)
    if a.in_process:
        res = in_process(a)
        print(
            f"in process: {res['tenants']} adapters x 1 datum of {res['length']} tokens "
            f"{res['fused_s']:.2f} s, one adapter {res['one_model_s']:.2f} s, ratio "
            f"{res['ratio']:.2f}; {res['tenants']} optim_steps {res['optim_steps_s']:.2f} s"
        )
        print("RESULT " + json.dumps(res))
        return res
    keys = [f"tml-{i:05d}" for i in range(a.tenants + 2)]
    folder = tempfile.mkdtemp(prefix="jcp-many-tenants-")
    # The driver sends no heartbeats: sessions must outlive the run.
    flags = ["--session-timeout", "86400", "--max-datums", str(max(a.tenants, 64))]
    flags += ["--max-body-bytes", str(max(64 << 20, 16 * a.tenants * a.length))]
    flags += ["--no-warmup"] if a.no_warmup else []
    # The default warm-up compiles every pass length's program (~150 programs: minutes on 2 cores).
    proc, url = tinker_http.start_server(folder, {k: k[4:] for k in keys}, flags, wait_s=1800)
    try:
        res = asyncio.run(drive(a, url, keys, proc.pid))
    finally:
        tinker_http.stop_server(proc)
        with open(os.path.join(folder, "server.log")) as f:
            lines = f.read().splitlines()
    res["server_log_tail"] = lines[-3:]
    print(
        f"{res['tenants']} tenants x 1 datum of {res['length']} tokens, fused "
        f"forward_backward: {res['fused_s']:.2f} s; one model, the same datums: "
        f"{res['one_model_s']:.2f} s; ratio {res['ratio']:.2f} (goal <= 1.3); the server's "
        f"CPU s {res['server_cpu_s'][0]:.2f} vs {res['server_cpu_s'][1]:.2f}: "
        f"{res['server_cpu_ratio']:.2f}, the driver's {res['driver_cpu_s'][0]:.2f} vs "
        f"{res['driver_cpu_s'][1]:.2f}; then {res['tenants']} optim_steps "
        f"{res['optim_steps_s']:.2f} s"
    )
    print(
        f"created {res['tenants'] + 1} models in {res['create_all_s']:.1f} s; a round with "
        f"a create in it {res['round_with_create_s']:.2f} s, the create "
        f"{res['late_create_s'] * 1000:.0f} ms"
    )
    print("RESULT " + json.dumps({k: v for k, v in res.items() if k != "server_log_tail"}))
    return res


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    sys.exit(0 if main() else 1)
