"""Time to steady state of jcp-serve: each step of a multi-tenant SDK flow against the steady
step, and the time to the first step of a cold and a warm-cache restart.

jcp-serve runs as a subprocess (the tiny model, its default flags plus --serve-args, on
127.0.0.1, a free port, a fresh --state-dir and compilation cache), with jax_log_compiles
on so that every XLA compile it makes is counted. --tenants SDK training clients (rank 8)
each run --steps
steps of forward_backward (--datums datums × --tokens tokens, cross_entropy) + optim_step,
submitted back to back and both awaited (the SDK's pattern), all tenants in threads
released together; then one sampling round: --prompts prompts × --num-samples samples ×
--max-tokens tokens of the base model, spread over the tenants, sent at once. Each step
prints its training and sampling wall time, their ratio to the steady figure (the median
of the last half of the steps) and the compiles the server made meanwhile. Goal (issue
37): every step within 1.3× of steady, with the default flags.

Restart (--restart, on by default): the flow's server runs on an empty compilation cache
folder (--compilation-cache), and is then restarted on it; each start's time from the
process's start to the end of its first training step (start-up, warm-up, the first step)
is printed, cold and warm, and the restarted server runs the flow's steps too (their own
table: a restart's first steps must be as steady as a cold start's). Goal: warm ≤ 20% of
cold.

    python benchmarks/steady_state.py [--steps 8] [--tenants 4] [--datums 4] [--tokens 256]
                                      [--serve-args "--no-warmup"] [--no-restart]

Every wait is bounded (--timeout seconds per server start and per step).
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

RANK = 8


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--tenants", type=int, default=4)
    p.add_argument("--datums", type=int, default=4, help="datums per tenant per step")
    p.add_argument("--tokens", type=int, default=256, help="tokens per datum")
    p.add_argument("--prompts", type=int, default=16, help="prompts per sampling round")
    p.add_argument("--num-samples", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--serve-args", default="", help="extra jcp-serve flags (one string)")
    p.add_argument(
        "--restart",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time a cold and a warm-cache start to the first step",
    )
    p.add_argument("--verbose", action="store_true", help="name the programs each step compiled")
    p.add_argument("--keep-log", default=None, help="copy the first server's log to this file")
    p.add_argument(
        "--timeout",
        type=float,
        default=3600.0,
        help="seconds allowed for a server start, and for each step",
    )
    return p.parse_args(argv)


class Serve:
    """One jcp-serve subprocess; its output (compile log included) in a file."""

    def __init__(
        self, extra: list[str], cache: str | None, timeout: float, keep_log: str | None = None
    ):
        self.t0, self.keep_log = time.monotonic(), keep_log
        self.dir = tempfile.mkdtemp(prefix="jcp-steady-")
        self.log_path = os.path.join(self.dir, "serve.log")
        env = dict(os.environ, TINKER_TELEMETRY="0", JAX_LOG_COMPILES="1")
        # The benchmark's own environment must not choose the server's cache.
        env.pop("JAX_COMPILATION_CACHE_DIR", None)
        cmd = [
            sys.executable,
            "-m",
            "jcp.serve",
            "--port",
            "0",
            "--max-rank",
            str(RANK),
            "--state-dir",
            os.path.join(self.dir, "state"),
            *extra,
        ]
        if cache:
            cmd += ["--compilation-cache", cache]
        with open(self.log_path, "w") as out:
            self.proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
        self.url = self._wait_url(timeout)

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def compiles(self) -> list[str]:
        """The programs XLA compiled (or loaded from the persistent cache) so far."""
        return re.findall(r"Finished XLA compilation of (\S+)", self.log())

    def cache_hits(self) -> int:
        return len(re.findall(r"Persistent compilation cache hit", self.log()))

    def store_loads(self) -> int:
        """Programs the warm-up loaded from jcp's program store (untraced, uncompiled)."""
        m = re.search(r"\((\d+) loaded from the program store\)", self.log())
        return int(m.group(1)) if m else 0

    def compile_seconds(self) -> str:
        """The compiles (or persistent-cache loads) so far by program: "name count × mean s
        = total s", largest total first (JAX's own figure per program, wall seconds: they
        grow with the machine's load)."""
        found = re.findall(r"Finished XLA compilation of (\S+) in ([0-9.]+) sec", self.log())
        by: dict[str, list[float]] = {}
        for name, sec in found:
            by.setdefault(name, []).append(float(sec))
        rows = sorted(by.items(), key=lambda kv: -sum(kv[1]))
        return "; ".join(
            f"{n} {len(v)} × {sum(v) / len(v):.1f} s = {sum(v):.0f} s" for n, v in rows
        )

    def traces(self) -> list[str]:
        """The functions JAX traced (a jit cache miss: new shapes, static arguments or
        argument shardings; a compile follows unless the lowering was compiled before)."""
        return re.findall(r"Finished tracing (\S+) for jit", self.log())

    def warmup_line(self) -> str:
        m = re.search(r"jcp-serve: warm-up compiled .*", self.log())
        return m.group(0) if m else "jcp-serve: no warm-up line"

    def maps(self) -> int | None:
        """The server process's memory maps now (XLA:CPU keeps 300-450 per program; a
        process may hold vm.max_map_count), None where /proc cannot tell."""
        try:
            with open(f"/proc/{self.proc.pid}/maps") as f:
                return sum(1 for _ in f)
        except OSError:
            return None

    def _wait_url(self, timeout: float) -> str:
        import httpx

        deadline = time.monotonic() + timeout
        url = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"jcp-serve exited {self.proc.returncode}:\n{self.log()[-4000:]}"
                )
            m = url or re.search(r"jcp-serve: (http://\S+)", self.log())
            url = url or (m.group(1) if m else None)
            if url:
                try:
                    if httpx.get(url + "/api/v1/healthz", timeout=2).status_code == 200:
                        return url
                except httpx.HTTPError:
                    pass
            time.sleep(0.2)
        log = self.log()[-4000:]
        self.stop()
        raise RuntimeError(f"jcp-serve did not start in {timeout:.0f} s:\n{log}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.keep_log:
            shutil.copyfile(self.log_path, self.keep_log)
        shutil.rmtree(self.dir, ignore_errors=True)


class Flow:
    """The tenants' clients on one server, and the flow's two parts."""

    def __init__(self, url: str, args):
        import numpy as np
        import tinker
        from tinker import types

        self.args, self.types = args, types
        sc = tinker.ServiceClient(base_url=url, api_key="tml-steady")
        self.clients = [
            sc.create_lora_training_client(base_model="jcp-tiny", rank=RANK, seed=i).result()
            for i in range(args.tenants)
        ]
        self.sampler = sc.create_sampling_client(base_model="jcp-tiny").result()
        rng = np.random.default_rng(0)
        vocab = 512  # the tiny model's vocabulary

        def datum():
            t = rng.integers(0, vocab, args.tokens + 1).tolist()
            return types.Datum(
                model_input=types.ModelInput.from_ints(t[:-1]),
                loss_fn_inputs={"target_tokens": t[1:], "weights": [1.0] * args.tokens},
            )

        self.data = [[datum() for _ in range(args.datums)] for _ in self.clients]
        self.prompts = [
            types.ModelInput.from_ints(rng.integers(0, vocab, 8 + i % 8).tolist())
            for i in range(args.prompts)
        ]
        self.adam = types.AdamParams(learning_rate=1e-4)
        self.sp = types.SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=1, stop=[])

    def train(self, timeout: float) -> float:
        """One step of every tenant, released together -> wall seconds."""
        go = threading.Barrier(len(self.clients) + 1)
        errors = []

        def run(c, d):
            try:
                go.wait()
                fb, opt = c.forward_backward(d, "cross_entropy"), c.optim_step(self.adam)
                fb.result(timeout=timeout)
                opt.result(timeout=timeout)
            except Exception as e:  # noqa: BLE001 — reported by the caller
                errors.append(e)

        threads = [
            threading.Thread(target=run, args=cd, daemon=True)
            for cd in zip(self.clients, self.data)
        ]
        for t in threads:
            t.start()
        go.wait()
        t0 = time.perf_counter()
        for t in threads:
            t.join(timeout)
        if errors or any(t.is_alive() for t in threads):
            raise RuntimeError(f"a training step failed or timed out: {errors[:1]}")
        return time.perf_counter() - t0

    def sample(self, timeout: float) -> float:
        t0 = time.perf_counter()
        futs = [self.sampler.sample(p, self.args.num_samples, self.sp) for p in self.prompts]
        for f in futs:
            f.result(timeout=timeout)
        return time.perf_counter() - t0


def steady_run(args, extra: list[str], cache: str) -> tuple[float, int]:
    """The flow's steps on a server started cold on `cache` (an empty folder); prints the
    table -> (seconds from the server process's start to the end of its first training
    step, the programs it compiled until then)."""
    srv = Serve(extra, cache, args.timeout, args.keep_log)
    try:
        print(f"{srv.warmup_line()}; server memory maps {srv.maps()}", flush=True)
        print(f"compiles by program: {srv.compile_seconds()}; load {os.getloadavg()}", flush=True)
        return run_steps(srv, args)
    finally:
        srv.stop()


def run_steps(srv, args) -> tuple[float, int]:
    """The flow's steps on a started server, and their table (each step against the median
    of the second half) -> (seconds from the server process's start to the end of its
    first training step, the programs it compiled until then)."""
    flow = Flow(srv.url, args)
    # The driver's own objects (SDK clients, data) out of its cyclic GC: a collection
    # over them stalled a random step by 50-90 ms, which is the driver's, not the
    # server's (measured with gc.callbacks).
    gc.collect()
    gc.freeze()
    rows, first = [], None
    for i in range(args.steps):
        c0, r0 = len(srv.compiles()), len(srv.traces())
        t_train = flow.train(args.timeout)
        first = first or (time.monotonic() - srv.t0, len(srv.compiles()))
        c1, r1 = len(srv.compiles()), len(srv.traces())
        t_sample = flow.sample(args.timeout)
        names, traced = srv.compiles(), srv.traces()
        rows.append((t_train, t_sample, c1 - c0, len(names) - c1))
        if args.verbose:
            print(
                f"step {i + 1}: train compiled {names[c0:c1]}, traced {traced[r0:r1]}; "
                f"sample compiled {names[c1:]}, traced {traced[r1:]}",
                flush=True,
            )
    half = rows[len(rows) // 2 :]
    steady = [statistics.median(r[k] for r in half) for k in (0, 1)]
    print(
        f"\nsteps ({args.tenants} tenants × {args.datums} datums × {args.tokens} tokens "
        f"fb + optim; sampling {args.prompts} × {args.num_samples} × "
        f"{args.max_tokens}); steady = median of steps {len(rows) - len(half) + 1}…"
        f"{len(rows)}: train {steady[0]:.3f} s, sample {steady[1]:.3f} s"
    )
    print(" step   train s  × steady  compiles   sample s  × steady  compiles")
    worst = 0.0
    for i, (tt, ts, ct, cs) in enumerate(rows, 1):
        rt, rs = tt / steady[0], ts / steady[1]
        worst = max(worst, rt, rs)
        print(f" {i:4d}  {tt:8.3f}  {rt:8.2f}  {ct:8d}   {ts:8.3f}  {rs:8.2f}  {cs:8d}")
    print(
        f"worst step / steady: {worst:.2f}× (goal ≤ 1.3×: {'met' if worst <= 1.3 else 'NOT met'})",
        flush=True,
    )
    return first


def first_step(args, extra: list[str], cache: str) -> tuple[float, int, int, int]:
    """The flow's steps on a server restarted on `cache` (their table: a restart's first
    steps must be as steady as a cold start's) -> (seconds from the server process's start
    to the end of the first training step, the programs it compiled or loaded from JAX's
    cache until then, how many programs the persistent cache held and how many were loaded
    from jcp's program store over the whole run)."""
    srv = Serve(extra, cache, args.timeout)
    try:
        print(f"\nrestart: {srv.warmup_line()}", flush=True)
        first, n = run_steps(srv, args)
        print(f"restart: compiles by program: {srv.compile_seconds()}")
        return first, n, srv.cache_hits(), srv.store_loads()
    finally:
        srv.stop()


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    extra = shlex.split(args.serve_args)
    print(
        f"jcp-serve {' '.join(extra) or '(default flags)'}; tiny model; {os.cpu_count()} CPUs",
        flush=True,
    )
    cache = tempfile.mkdtemp(prefix="jcp-steady-cache-")
    try:
        cold, n_cold = steady_run(args, extra, cache)
        if args.restart:
            warm, n_warm, hits, stored = first_step(args, extra, cache)
            print(
                f"\nstart to the end of the first step: cold {cold:.1f} s, restarted on "
                f"its cache {warm:.1f} s = {warm / cold:.2f}× (goal ≤ 0.20: "
                f"{'met' if warm <= 0.2 * cold else 'NOT met'}); programs {n_cold} cold, "
                f"{n_warm} warm through JAX ({hits} from its cache) and {stored} loaded "
                "from jcp's program store",
                flush=True,
            )
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
