"""jcp-serve as a 2-process jax.distributed job against one process, on the same 8 CPU devices.

Two servers run side by side (the launcher of tests/helpers/mp_serve.py: subprocesses,
127.0.0.1, tiny model, the --mesh under test): one process × 8 fake CPU devices, and two
processes × 4 (gloo), where process 0 sends each of its worker's calls to the follower
before making it (jcp/server/replica.py). One training step = the SDK's forward_backward of
8 × 512 tokens (cross_entropy) + optim_step, submitted back to back and both awaited, on a
rank-8 model. After --warmup steps on each, the two alternate for --rounds rounds of
--steps steps (so a change of machine load hits both); the headline is the median over
rounds of (multi-process median step) / (single-process median step). Goal: ≤ 1.15.

The same step run directly on the Trainer (no server: 2 processes of jax.distributed
against 1, `--direct-steps` timed steps each after the warm-up) gives the part of that
ratio the devices' collectives cost; the server's own share is the quotient of the two.
The 2-process run also counts the collectives one step executes (its compiled
forward_backward and optim_step, XLA's HLO after optimisation, each while loop's body
times its trip count), by the devices each one joins: "local" (one process's devices —
XLA:CPU with gloo still sends these over TCP), "cross" (devices of both processes), and
"trivial" (groups of one device: no communication).

Where the 2-process step's extra time goes (--parts): the same Trainer step, pinned like
the job, as "independent" (2 separate 1-process jobs of 4 devices, 4 datums each, no
jax.distributed: the compute of one process's share alone) and "local" (the 2-process job,
each process training its own 4-device mesh on 4 datums: the step's all-reduce stays within
a process but runs over gloo, as every collective of a multi-process CPU client does),
against the job itself.

CPU seconds per step are counted for both comparisons, every process and every thread,
and split by thread name (/proc/<pid>/task/*/stat): XLA's compute pool (tf_XLAEigen), the
main thread, and the threads left unnamed ("python": the server's Python threads, and
gloo's TCP event loop, which carries every collective of a multi-process CPU job); the
2-process server's also by process (process 0 also serves HTTP and sends each call's op).

By default every process may run on every core (on one machine the two processes' pools
then share its cores). --pin gives each process of a 2-process job its own half of the
cores (sched_setaffinity before it starts; XLA sizes its compute pool from that, at least
one thread per device), one host each as a multi-host deployment runs, against the
1-process job on all of them.

Each mesh of --mesh (default: 8,1,1, the CPU recommendation, and 2,2,2) is measured alone.
First, a probe times one psum of 4 KB per device over 4 devices of one process and over 2
devices of two processes, in 1 process and in 2 (gloo).

    python benchmarks/serve_multiprocess.py [--mesh 8,1,1 --mesh 2,2,2] [--steps 5]
                                           [--rounds 3] [--warmup 2] [--direct-steps 10]
                                           [--pin] [--parts]
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import statistics
import sys
import tempfile
import time

from common import on_cores  # benchmarks/ is sys.path[0]

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests", "helpers"))

DATUMS, TOKENS, RANK = 8, 512, 8
# What the processes of a direct (no server) run are: one jax.distributed job on one mesh
# of every device; separate 1-process jobs ("independent"); or one jax.distributed job whose
# processes each train on a mesh of their own devices ("local").
PARTS = ("job", "independent", "local")
# The programs of one training step: forward_backward, or its two programs where the
# Trainer sums on the host (host_sum.HostSummedStep), and optim_step.
PROGRAMS = ("forward_backward", "partials", "_finish", "optim_step")


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5, help="timed steps per round")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--direct-steps",
        type=int,
        default=10,
        help="timed Trainer steps of the no-server comparison (0: skip it)",
    )
    p.add_argument("--mesh", action="append", help="dp,cp,tp (repeatable; default 8,1,1 and 2,2,2)")
    p.add_argument(
        "--pin",
        action="store_true",
        help="run each process of the 2-process jobs on its own half of the cores "
        "(one host each, as deployed); the 1-process jobs use all of them",
    )
    p.add_argument(
        "--parts",
        action="store_true",
        help="also time the Trainer step as 2 independent 1-process jobs and as "
        "2 processes each on its own mesh (where the 2-process step's time goes)",
    )
    p.add_argument("--worker", nargs=3, type=int, help=argparse.SUPPRESS)  # pid nproc port
    p.add_argument(
        "--part", choices=PARTS, default="job", help=argparse.SUPPRESS
    )  # worker: what its processes run
    p.add_argument("--dump", help=argparse.SUPPRESS)  # the worker's XLA dump folder
    p.add_argument("--psum", action="store_true", help=argparse.SUPPRESS)  # worker: latency
    args = p.parse_args(argv)
    args.mesh = args.mesh or ["8,1,1", "2,2,2"]
    return args


# ----------------------------------------------------------------------------------------
# Collectives of a compiled program (XLA's HLO text after optimisation)

COLLECTIVES = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "collective-permute",
    "all-to-all",
    "collective-broadcast",
    "ragged-all-to-all",
)
_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
}
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%[\w.\-]+ = (.*?) ([a-z][a-z\-]*)\((.*)$")
_SHAPE = re.compile(r"\b(" + "|".join(_BYTES) + r")\[([\d,]*)\]")
_HEAD = re.compile(r"^(ENTRY\s+)?%([\w.\-]+) .*\{\s*$")


def _groups(rest: str) -> list[list[int]] | None:
    """The device groups of one collective (replica_groups, either spelling, or a
    collective-permute's source_target_pairs); None if it names none (all devices)."""
    m = re.search(r"(?:replica_groups|source_target_pairs)=\{(\{[\d,{}]*\})\}", rest)
    if m:
        return [
            [int(x) for x in g.split(",") if x] for g in re.findall(r"\{([\d,]*)\}", m.group(1))
        ]
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", rest)
    if m:
        import numpy as np

        ids = np.arange(int(np.prod([int(x) for x in m.group(3).split(",")])))
        ids = ids.reshape([int(x) for x in m.group(3).split(",")])
        if m.group(4):
            ids = ids.transpose([int(x) for x in m.group(4).split(",")])
        return ids.reshape(int(m.group(1)), int(m.group(2))).tolist()
    return None


def collectives(hlo: str, process_of) -> list[tuple[str, int, str]]:
    """Every collective one run of the program executes: (op, bytes per device, kind).

    Walks from the entry computation through calls, conditionals and while loops (a body
    counts its known trip count times). kind: "trivial" (every group is one device),
    "local" (each group within one process: process_of(logical device id)), or "cross".
    """
    comps, name, entry = {}, None, None
    for line in hlo.splitlines():
        head = _HEAD.match(line)
        if head and name is None:
            name, comps[head.group(2)] = head.group(2), []
            entry = name if head.group(1) else entry
        elif line.startswith("}"):
            name = None
        elif name is not None:
            comps[name].append(line)
    out = []

    def walk(comp: str, times: int) -> None:
        for line in comps.get(comp, ()):
            m = _INSTR.match(line)
            if not m:
                continue
            shape, op, rest = m.groups()
            base = op.removesuffix("-start")
            if base in COLLECTIVES:
                nbytes = sum(_BYTES[t] * _count(dims) for t, dims in _SHAPE.findall(shape))
                groups = _groups(rest)
                if groups is not None and all(len(g) == 1 for g in groups):
                    kind = "trivial"
                elif groups is not None and all(
                    len({process_of(i) for i in g}) == 1 for g in groups
                ):
                    kind = "local"
                else:
                    kind = "cross"
                out.extend([(base, nbytes, kind)] * times)
            if op == "while":
                trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', rest)
                walk(
                    re.search(r"body=%([\w.\-]+)", rest).group(1),
                    times * (int(trips.group(1)) if trips else 1),
                )
                continue
            for key in ("calls", "true_computation", "false_computation"):
                called = re.search(key + r"=%([\w.\-]+)", rest)
                if called:
                    walk(called.group(1), times)
            branches = re.search(r"branch_computations=\{([^}]*)\}", rest)
            for called in re.findall(r"%([\w.\-]+)", branches.group(1) if branches else ""):
                walk(called, times)

    walk(entry, 1)
    return out


def _count(dims: str) -> int:
    n = 1
    for d in dims.split(","):
        n *= int(d) if d else 1
    return n


def summarize(ops) -> dict:
    """{kind: {"count": n, "bytes": b}} of collectives(...)'s list."""
    out = collections.defaultdict(lambda: {"count": 0, "bytes": 0})
    for _, nbytes, kind in ops:
        out[kind]["count"] += 1
        out[kind]["bytes"] += nbytes
    return {k: dict(out[k]) for k in ("local", "cross", "trivial")}


def step_collectives(dump: str, mesh) -> dict:
    """The collectives of one training step (PROGRAMS) from an XLA
    dump folder, devices mapped to processes through the mesh (logical id = position in
    mesh.devices)."""
    procs = [d.process_index for d in mesh.devices.flat]
    ops, found = [], []
    for prog in PROGRAMS:
        files = sorted(glob.glob(os.path.join(dump, f"*jit_{prog}.*after_optimizations.txt")))
        if files:
            found.append(prog)
            with open(files[-1]) as f:  # the last compiled: the one the timed steps ran
                ops += collectives(f.read(), procs.__getitem__)
    if "optim_step" not in found or not {"forward_backward", "partials"} & set(found):
        raise RuntimeError(f"no compiled training step in {dump} (found {found})")
    return summarize(ops)


def thread_cpu(pid: int | str = "self") -> dict[str, float]:
    """CPU seconds (user + system) so far of a process's live threads (default: this
    one's), summed by thread name (digits dropped: a pool's threads count together; "main"
    is the main thread; "python": threads left unnamed, gloo's TCP loop among them), from
    /proc (Linux)."""
    tick = os.sysconf("SC_CLK_TCK")
    main = str(os.getpid() if pid == "self" else pid)
    out = collections.Counter()
    for stat in glob.glob(f"/proc/{pid}/task/*/stat"):
        try:
            with open(stat) as f:
                s = f.read()
        except OSError:  # the thread ended
            continue
        name = re.sub(r"[\d_\-]+$", "", s[s.index("(") + 1 : s.rindex(")")]) or "?"
        if stat.split("/")[4] == main:
            name = "main"
        fields = s[s.rindex(")") + 2 :].split()
        out[name] += (int(fields[11]) + int(fields[12])) / tick
    return dict(out)


def _batch(rng):
    toks = [rng.integers(0, 512, TOKENS + 1) for _ in range(DATUMS)]
    return toks


def worker(
    pid: int,
    nproc: int,
    port: int,
    warmup: int,
    steps: int,
    mesh: str,
    dump: str | None,
    part: str = "job",
) -> None:
    """One process of the no-server comparison: jcp-serve's Trainer, the benchmark's step;
    with `dump` (XLA's dump folder), process 0 also prints the step's collectives. part
    (PARTS): "job", the whole batch on `mesh` over every process's devices; "independent"
    (a 1-process job of 8 / nproc devices, set by direct) and "local" (a process of the
    jax.distributed job on its own devices), each on its 1 / nproc of the batch with `mesh`'s
    dp cut to its devices."""
    from jcp.cli import setup_devices

    job = part != "independent" and nproc > 1
    setup_devices(
        argparse.Namespace(
            coordinator_address=f"127.0.0.1:{port}" if job else None,
            num_processes=nproc if job else None,
            process_id=pid if job else None,
        )
    )
    import jax
    import numpy as np

    import jcp

    shape = tuple(map(int, mesh.split(",")))
    datums, devices = DATUMS, None
    if part != "job":
        shape, datums = (shape[0] // nproc,) + shape[1:], DATUMS // nproc
        devices = jax.local_devices()
    tr = jcp.Trainer(
        jcp.QwenConfig.tiny(), jcp.make_mesh(*shape, devices=devices), max_adapters=8, max_rank=RANK
    )
    a = tr.create_adapter(rank=RANK, alpha=32.0, seed=0)
    data = [
        jcp.Datum(t[:-1], {"target_tokens": t[1:], "weights": np.ones(TOKENS, np.float32)})
        for t in _batch(np.random.default_rng(0))
    ][:datums]
    times = []
    for i in range(warmup + steps):
        if i == warmup:
            cpu, threads = time.process_time(), thread_cpu()
        t = time.perf_counter()
        tr.forward_backward(data, "cross_entropy", adapters=[a] * datums)
        tr.optim_step(a, jcp.AdamParams(learning_rate=1e-4))
        times.append(time.perf_counter() - t)
    # CPU seconds per step of this process, all its threads (XLA's and the host's).
    print(f"cpu_s {(time.process_time() - cpu) / steps}", flush=True)
    now = thread_cpu()
    print(
        "threads "
        + json.dumps(
            {
                k: round((v - threads.get(k, 0)) / steps, 4)
                for k, v in now.items()
                if v - threads.get(k, 0) > 0
            }
        ),
        flush=True,
    )
    if pid == 0 or part == "independent":
        print(f"median_s {statistics.median(times[warmup:])}", flush=True)
        if dump:
            print(f"collectives {json.dumps(step_collectives(dump, tr.mesh))}", flush=True)


def psum_worker(pid: int, nproc: int, port: int) -> None:
    """Process `pid` of the psum latency probe: the median time of one jitted psum of 4 KB
    per device over each axis of a (2, 4) mesh of the 8 devices ("outer" splits the
    processes, "inner" the devices of one process)."""
    from jcp.cli import setup_devices

    setup_devices(
        argparse.Namespace(
            coordinator_address=f"127.0.0.1:{port}" if nproc > 1 else None,
            num_processes=nproc,
            process_id=pid,
        )
    )
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((2, 4), ("outer", "inner"))
    spec = P(("outer", "inner"))
    x = jax.device_put(np.ones((8, 1024), np.float32), NamedSharding(mesh, spec))
    for axis in ("inner", "outer"):
        f = jax.jit(
            jax.shard_map(lambda a: jax.lax.psum(a, axis), mesh=mesh, in_specs=spec, out_specs=spec)
        )
        f(x).block_until_ready()
        times = []
        for _ in range(30):
            t = time.perf_counter()
            f(x).block_until_ready()
            times.append(time.perf_counter() - t)
        if pid == 0:
            print(f"psum_{axis}_s {statistics.median(times)}", flush=True)


def psum_latency(nproc: int) -> dict:
    """{axis: median s} of psum_worker over `nproc` processes."""
    import subprocess

    import mp_serve

    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    port = str(mp_serve.free_port())
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                os.path.abspath(__file__),
                "--psum",
                "--worker",
                str(i),
                str(nproc),
                port,
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for i in range(nproc)
    ]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    found = {
        ln.split()[0][5:-2]: float(ln.split()[1])
        for ln in outs[0].splitlines()
        if ln.startswith("psum_")
    }
    if set(found) != {"inner", "outer"}:
        raise RuntimeError(f"psum probe of {nproc} processes failed: {outs}")
    return found


def direct(
    nproc: int,
    warmup: int,
    steps: int,
    mesh: str,
    count: bool = False,
    pin: bool = False,
    part: str = "job",
) -> tuple[float, dict | None, float, dict]:
    """(median Trainer step (s) of `nproc` processes × 8 / nproc devices on `mesh` (the
    slowest process's, for independent jobs), the step's collectives if `count`, CPU
    seconds per step of all processes together, and the same by thread name). pin: each
    process on its own share of this machine's cores (cpu_shares). part: see worker."""
    import subprocess

    import mp_serve

    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    dump = tempfile.mkdtemp(prefix="jcp-bench-hlo-") if count else None
    if part == "independent":
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={8 // nproc}"
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--warmup",
        str(warmup),
        "--direct-steps",
        str(steps),
        "--mesh",
        mesh,
        "--part",
        part,
        "--worker",
    ]
    port = str(mp_serve.free_port())
    procs = []
    for i in range(nproc):
        if dump:
            env["XLA_FLAGS"] = (
                f"--xla_dump_to={dump}/p{i} --xla_dump_hlo_as_text "
                "--xla_dump_hlo_module_re=" + "|".join(PROGRAMS)
            )
        args = cmd + [str(i), str(nproc), port] + (["--dump", f"{dump}/p{i}"] if dump else [])
        # Started on its share of the cores (XLA sizes its compute pool from the affinity
        # a process starts with, at least one thread per device), without a preexec_fn.
        with on_cores(cpu_shares(nproc)[i] if pin else None):
            procs.append(
                subprocess.Popen(
                    args,
                    env=dict(env),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL,
                    text=True,
                )
            )
    outs = [p.communicate(timeout=1800)[0] for p in procs]
    found = {
        ln.split(" ", 1)[0]: ln.split(" ", 1)[1]
        for ln in outs[0].splitlines()
        if ln.startswith(("median_s ", "collectives "))
    }
    medians = [
        float(ln.split()[1])
        for out in outs
        for ln in out.splitlines()
        if ln.startswith("median_s ")
    ]
    if medians:
        found["median_s"] = str(max(medians))
    cpu = [
        float(ln.split()[1]) for out in outs for ln in out.splitlines() if ln.startswith("cpu_s ")
    ]
    if "median_s" not in found or (count and "collectives" not in found) or len(cpu) != nproc:
        raise RuntimeError(f"direct run of {nproc} processes failed: {outs}")
    threads = collections.Counter()
    for out in outs:
        for ln in out.splitlines():
            if ln.startswith("threads "):
                threads.update(json.loads(ln.split(" ", 1)[1]))
    return (
        float(found["median_s"]),
        json.loads(found.get("collectives", "null")),
        sum(cpu),
        dict(threads),
    )


def parts(args, mesh: str, single, job) -> dict:
    """The 2-process Trainer step taken apart (see the module docstring): the "independent"
    and "local" runs next to the 1-process and the 2-process job's ((median s, CPU s per
    step, by thread) each), printed; {name: (median s, CPU s per step)}."""
    rows = {"1 process x 8 devices": single}
    for part, label in (
        ("independent", "2 independent 1-process jobs x 4 devices"),
        ("local", "2 processes x 4, each on its own mesh (gloo within it)"),
    ):
        med, _, cpu, th = direct(2, args.warmup, args.direct_steps, mesh, pin=args.pin, part=part)
        rows[label] = (med, cpu, th)
    rows["2 processes x 4 devices (the job)"] = job
    print(
        "where the 2-process Trainer step's time goes (median ms of the slowest process; "
        "CPU s per step, every process: total, and XLA's pool / the rest):"
    )
    for label, (med, cpu, th) in rows.items():
        xla = th.get("tf_XLAEigen", 0)
        print(f"  {label}: {med * 1e3:.0f} ms; {cpu:.3f} ({xla:.3f} / {cpu - xla:.3f})")
    return {label: (med, cpu) for label, (med, cpu, _) in rows.items()}


def cpu_shares(nproc: int) -> list[set[int]]:
    """This machine's cores (the ones this process may use) split into `nproc` equal
    shares, one per process of a job: one host each, as a multi-host deployment has."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < nproc:
        raise RuntimeError(f"--pin needs a core per process: {len(cores)} for {nproc}")
    k = len(cores) // nproc
    return [set(cores[i * k : (i + 1) * k]) for i in range(nproc)]


def main(argv=None) -> dict:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.worker and args.psum:
        psum_worker(*args.worker)
        return {}
    if args.worker:
        worker(*args.worker, args.warmup, args.direct_steps, args.mesh[-1], args.dump, args.part)
        return {}
    import numpy as np
    from tinker import types

    data = []
    for toks in _batch(np.random.default_rng(0)):
        toks = toks.tolist()
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(toks[:-1]),
                loss_fn_inputs={"target_tokens": toks[1:], "weights": [1.0] * TOKENS},
            )
        )
    print(
        "2-process jobs: "
        + (
            ", ".join(
                f"process {i} pinned to cores {sorted(c)}" for i, c in enumerate(cpu_shares(2))
            )
            if args.pin
            else "not pinned (every process on every core)"
        )
        + f"; 1-process jobs on cores {sorted(os.sched_getaffinity(0))}",
        flush=True,
    )
    res = {"psum": {n: psum_latency(n) for n in (1, 2)}}
    print(
        "one psum of 4 KB per device over a (2, 4) mesh, median ms: 1 process: "
        f"{res['psum'][1]['inner'] * 1e3:.2f} (4 devices), {res['psum'][1]['outer'] * 1e3:.2f}"
        f" (2 devices); 2 processes (gloo): {res['psum'][2]['inner'] * 1e3:.2f} (4 devices "
        f"of one process), {res['psum'][2]['outer'] * 1e3:.2f} (2 devices, one per process)"
    )
    for mesh in args.mesh:
        print(f"\n== mesh {mesh} (dp,cp,tp)", flush=True)
        out = res[mesh] = served(args, data, mesh) if args.rounds else {}
        if args.direct_steps:
            one, _, cpu1, th1 = direct(1, args.warmup, args.direct_steps, mesh)
            two, counts, cpu2, th2 = direct(
                2, args.warmup, args.direct_steps, mesh, count=True, pin=args.pin
            )
            out.update(
                direct_single_s=one,
                direct_multi_s=two,
                collectives=counts,
                cpu_single_s=cpu1,
                cpu_multi_s=cpu2,
                threads_single=th1,
                threads_multi=th2,
            )
            print(
                "collectives per step (forward_backward + optim_step), count / bytes per "
                "device: "
                + ", ".join(f"{k} {v['count']} / {v['bytes']:,}" for k, v in counts.items())
            )
            print(
                f"Trainer step without a server: 1 process {one * 1e3:.0f} ms, 2 processes "
                f"{two * 1e3:.0f} ms: {two / one:.3f}x; CPU seconds per step (every "
                f"process, every thread): {cpu1:.2f} vs {cpu2:.2f} ({cpu2 / cpu1:.3f}x)"
            )
            print(
                "  by thread (CPU s per step, all processes; 'python': unnamed threads, "
                "gloo's TCP loop among them): "
                + "; ".join(
                    f"{name} {th1.get(name, 0):.3f} vs {th2.get(name, 0):.3f}"
                    for name in sorted(set(th1) | set(th2))
                )
            )
            if "ratio" in out:
                print(f"the server's own share: {out['ratio'] / (two / one):.3f}x")
            if args.parts:
                out["parts"] = parts(args, mesh, (one, cpu1, th1), (two, cpu2, th2))
    print("\nsummary (goal <= 1.15):")
    for mesh in args.mesh:
        out = res[mesh]
        c = out.get("collectives") or {}
        print(
            f"  mesh {mesh}: server {out.get('ratio', float('nan')):.3f}x, Trainer "
            f"{out.get('direct_multi_s', float('nan')) / out.get('direct_single_s', 1):.3f}x"
            + (
                f", collectives per step: {c['cross']['count']} cross-process "
                f"({c['cross']['bytes']:,} B), {c['local']['count']} within a process "
                f"({c['local']['bytes']:,} B)"
                if c
                else ""
            )
        )
    return res


def served(args, data, mesh: str) -> dict:
    """The headline: median over rounds of the two servers' median step ratio."""
    import mp_serve
    import tinker
    from tinker import types

    adam = types.AdamParams(learning_rate=1e-4)
    jobs = {
        "single": mp_serve.Job(1, tempfile.mkdtemp(prefix="jcp-bench-1-"), "--mesh", mesh),
        "multi": mp_serve.Job(
            2,
            tempfile.mkdtemp(prefix="jcp-bench-2-"),
            "--mesh",
            mesh,
            follower_timeout=120,
            cpus=cpu_shares(2) if args.pin else None,
        ),
    }
    clients = []
    try:
        models = {}
        for name, job in jobs.items():
            job.wait_ready()
            sc = tinker.ServiceClient(base_url=job.url, api_key="tml-alice")
            clients.append(sc)
            models[name] = sc.create_lora_training_client(
                base_model=mp_serve.MODEL, rank=RANK, seed=0
            ).result()

        def step(tc) -> float:
            t = time.perf_counter()
            fb, op = tc.forward_backward(data, "cross_entropy"), tc.optim_step(adam)
            fb.result()
            op.result()
            return time.perf_counter() - t

        for tc in models.values():
            for _ in range(args.warmup):
                step(tc)
        ratios, rows = [], []
        cpu = {name: collections.Counter() for name in models}
        client = {name: 0.0 for name in models}  # this process's (the SDK client's)
        per_proc = [collections.Counter() for _ in jobs["multi"].procs]  # multi, by process
        for r in range(args.rounds):
            med = {}
            for name, tc in models.items():
                procs = jobs[name].procs
                before = [collections.Counter(thread_cpu(p.pid)) for p in procs]
                mine = time.process_time()
                med[name] = statistics.median(step(tc) for _ in range(args.steps))
                client[name] += (time.process_time() - mine) / (args.steps * args.rounds)
                for i, p in enumerate(procs):
                    used = {
                        k: v / (args.steps * args.rounds)
                        for k, v in (collections.Counter(thread_cpu(p.pid)) - before[i]).items()
                    }
                    cpu[name].update(used)
                    if name == "multi":
                        per_proc[i].update(used)
            ratios.append(med["multi"] / med["single"])
            rows.append(med)
            print(
                f"round {r}: single {med['single'] * 1e3:.0f} ms/step  multi "
                f"{med['multi'] * 1e3:.0f} ms/step  ratio {ratios[-1]:.3f}",
                flush=True,
            )
        ratio = statistics.median(ratios)
        print(
            "server CPU s per step (every process, by thread; single vs multi): "
            + "; ".join(
                f"{k} {cpu['single'].get(k, 0):.3f} vs {cpu['multi'].get(k, 0):.3f}"
                for k in sorted(set(cpu["single"]) | set(cpu["multi"]))
                if max(cpu["single"].get(k, 0), cpu["multi"].get(k, 0)) >= 0.001
            )
        )
        print(
            f"  total {sum(cpu['single'].values()):.3f} vs {sum(cpu['multi'].values()):.3f}"
            f"; the SDK client (this process, on every core) {client['single']:.3f} vs "
            f"{client['multi']:.3f}"
        )
        for i, c in enumerate(per_proc):
            print(
                f"  multi, process {i}: {sum(c.values()):.3f} ("
                + "; ".join(f"{k} {v:.3f}" for k, v in sorted(c.items()) if v >= 0.001)
                + ")"
            )
    finally:
        mp_serve.close(clients)
        for job in jobs.values():
            job.stop()
    print(
        f"server step, 2 processes x 4 devices / 1 process x 8 devices "
        f"(forward_backward + optim_step, {DATUMS} x {TOKENS}): {ratio:.3f}x (goal <= 1.15)"
    )
    return {
        "ratio": ratio,
        "rounds": rows,
        "cpu": {k: dict(v) for k, v in cpu.items()},
        "cpu_by_process": [dict(c) for c in per_proc],
    }


if __name__ == "__main__":
    main()
