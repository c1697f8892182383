"""Host malloc settings that let XLA:CPU reuse its temporary memory between calls.

Owns one process-wide setting of glibc's malloc, made once when jcp is imported (before
JAX starts its CPU client and its threads). It must never run on anything but Linux with
glibc, and never fail an import: where it cannot apply, it does nothing.

Why: an XLA:CPU program takes all its temporaries as one block per call (407 MiB for the
8 × 512 training step of benchmarks/throughput.py's model). glibc serves a block that
large with a fresh mmap and unmaps it when the call ends, so every call first-touches
every page again: ~99,000 page faults per step, 0.15–0.2 CPU s of kernel time (of a
~1.1 CPU s step), and the forward pass's GEMMs, which touch those pages first, ran at
less than half the speed of the backward's. (torch's activations are many blocks under
glibc's 32 MiB mmap threshold, which the heap keeps.) The setting: every thread
allocates from the main heap (M_ARENA_MAX 1: another thread's arena cannot hold a block
over 64 MiB and maps it), blocks under 2 GiB come from that heap rather than mmap
(M_MMAP_THRESHOLD: 2^31 - 1 bytes, the largest value mallopt takes), and memory freed at
the top of the heap stays there (M_TRIM_THRESHOLD -1: never trimmed), so the next call
reuses pages already touched. Not trimmed at all rather than up to 2 GiB: the 1 × 16,384-
token step's temporaries are over 1 GiB, and with a 1 GiB bound it took ~386,000 page
faults per step (with 2 GiB none, and 1.24-1.27x its tokens/s at the same peak RSS); a
multi-LoRA pass over 256 adapters (benchmarks/multi_lora.py, 1.4 GiB of temporaries)
alternated with another program took ~565,000 page faults in most of its calls under a
2 GiB bound (the two programs' freed blocks together past it: 5.3-5.9 s a call against
4.5-4.7 s without faults), and none once the heap is never trimmed (4.4-4.6 s).
Blocks of 2 GiB and more are mapped and unmapped as before.

One heap only where one CPU device is configured (XLA_FLAGS'
--xla_force_host_platform_device_count, JAX_NUM_CPU_DEVICES or jax_num_cpu_devices, as set
when jcp is imported): with several devices each runs on its own threads, and one arena's
lock cost more than the faults it saves — the 8-device step of
benchmarks/serve_multiprocess.py (tiny model, one process) took 0.174 CPU s of XLA threads
per step with it, 0.115 without, 0.111 with the two thresholds alone. There only the
thresholds are set (they keep blocks the main thread frees).

Cost: the process holds the heap it has freed rather than returning it to the system (its
resident memory stays at the peak of its heap), and since a call's block may be taken
before the previous call's is freed, the heap can come to hold two or three of them: peak
RSS of throughput.py's jcp side 1.0–1.6 GiB over runs, 1.1 without. JCP_HOST_MALLOC=0 in the environment turns it off
(benchmarks/host_memory.py measures both ways in one process).
"""

from __future__ import annotations

import ctypes
import os
import re
import sys

# glibc <malloc.h>
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8
KEEP_BYTES = (1 << 31) - 1  # mallopt's int: its largest value (the mmap threshold)
NEVER_TRIM = -1  # M_TRIM_THRESHOLD -1: glibc never trims the heap
ENV = "JCP_HOST_MALLOC"


def cpu_devices_configured() -> int:
    """CPU devices the process asks JAX for, as configured now (1 where nothing says)."""
    counts = [1]
    jax = sys.modules.get("jax")
    if jax is not None:
        counts.append(getattr(jax.config, "jax_num_cpu_devices", -1))
    env = os.environ.get("JAX_NUM_CPU_DEVICES", "")
    counts += [int(env)] if env.strip().isdigit() else []
    counts += [
        int(n)
        for n in re.findall(
            r"--xla_force_host_platform_device_count=(\d+)", os.environ.get("XLA_FLAGS", "")
        )
    ]
    return max(counts)


def _mallopt():
    """glibc's mallopt(param, value) -> 1 on success, or None where there is no glibc."""
    try:
        libc = ctypes.CDLL(None)
        if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
            return None  # not glibc (musl has no mallopt settings to speak of)
        mallopt = libc.mallopt
        mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
        return mallopt
    except (OSError, AttributeError):
        return None


def keep_freed_memory(one_heap: bool) -> bool:
    """Apply the setting (see the module docstring), M_ARENA_MAX 1 only with `one_heap`;
    True if glibc accepted all of it."""
    if os.environ.get(ENV, "1") == "0" or not sys.platform.startswith("linux"):
        return False
    mallopt = _mallopt()
    if mallopt is None:
        return False
    return all(
        [
            mallopt(_M_ARENA_MAX, 1) == 1 if one_heap else True,
            mallopt(_M_MMAP_THRESHOLD, KEEP_BYTES) == 1,
            mallopt(_M_TRIM_THRESHOLD, NEVER_TRIM) == 1,
        ]
    )


def devices_configured() -> None:
    """Re-check after devices are configured (jcp.cli.setup_devices, once jcp is imported):
    where several CPU devices now run, lift the one-heap limit back to glibc's default (8
    arenas per core), before JAX's threads start and take their arenas."""
    global ONE_HEAP
    if ONE_HEAP and APPLIED and cpu_devices_configured() > 1:
        ONE_HEAP = _mallopt()(_M_ARENA_MAX, 8 * (os.cpu_count() or 1)) != 1


ONE_HEAP = cpu_devices_configured() == 1
APPLIED = keep_freed_memory(ONE_HEAP)
