"""What jcp/host_memory.py saves: throughput.py's jcp step (8 × 512, one CPU device) in one
process, its temporaries kept between calls or mapped afresh, alternated step by step.

Both halves run with jcp's malloc setting (every thread on glibc's main heap); between
steps only the mmap threshold and trim threshold change: 2 GiB and never trimmed (the
setting: the step's 407 MiB of temporaries stay in the heap) or 32 MiB / 128 KiB (glibc's largest dynamic
threshold and its default trim: they are mapped and unmapped each call, as without the
setting). One process and alternated steps, so both halves see the same load. Prints
median wall, process CPU s and minor page faults per step of each.

    python benchmarks/host_memory.py [--pairs 8]

Measured on the shared 2-core machine at load ≈ 5 (8 pairs): kept 1.357 s wall, 1.189
CPU s, 4 faults per step; mapped afresh 1.575 s, 1.353 CPU s, 100,458 faults.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import resource
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import throughput as T  # noqa: E402  (the workload)

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, default=8)
    args = p.parse_args(argv)
    from jcp import host_memory

    if not host_memory.APPLIED:
        raise SystemExit(
            "jcp's malloc setting is not applied here (not glibc, or "
            f"{host_memory.ENV}=0): nothing to compare"
        )
    libc = ctypes.CDLL(None)
    wl = argparse.Namespace(
        datums=T.DATUMS,
        tokens=T.TOKENS,
        cp=1,
        slots=1,
        remat="auto",
        attn_block=0,
        cp_attention="auto",
    )
    _, step = T.jcp_step(wl)
    step()
    step()

    def keep(on: bool):
        libc.mallopt(_M_MMAP_THRESHOLD, host_memory.KEEP_BYTES if on else 32 << 20)
        libc.mallopt(_M_TRIM_THRESHOLD, host_memory.NEVER_TRIM if on else 128 << 10)

    runs = {"kept": [], "mapped afresh": []}
    for _ in range(args.pairs):
        for name in runs:
            keep(name == "kept")
            step()  # the heap settles into the setting
            r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            c0, t0 = time.process_time(), time.perf_counter()
            step()
            runs[name].append(
                (
                    time.perf_counter() - t0,
                    time.process_time() - c0,
                    resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0,
                )
            )
    keep(True)
    out = {}
    print(
        f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}; "
        f"{args.pairs} pairs, medians per step"
    )
    for name, r in runs.items():
        wall, cpu, faults = (statistics.median(x[i] for x in r) for i in range(3))
        out[name] = dict(wall_s=wall, cpu_s=cpu, minor_faults=faults)
        print(f"  {name:<14} wall {wall:.3f} s  CPU {cpu:.3f} s  minor faults {faults:,.0f}")
    return out


if __name__ == "__main__":
    main()
