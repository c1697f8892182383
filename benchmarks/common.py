"""What several benchmark scripts share (benchmarks/ is sys.path[0] when one runs)."""

from __future__ import annotations

import os


def fake_cpu_devices(mesh: tuple[int, int, int]) -> None:
    """Ask XLA for dp·cp·tp fake CPU devices (unless XLA_FLAGS already sets a count) and
    keep the Tinker SDK's telemetry off. Call before anything imports jax."""
    n_dev = mesh[0] * mesh[1] * mesh[2]
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    if n_dev > 1 and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + f" --xla_force_host_platform_device_count={n_dev}")


def mesh_arg(text: str) -> tuple[int, int, int]:
    """argparse type of --mesh: "dp,cp,tp" -> (dp, cp, tp)."""
    return tuple(int(x) for x in text.split(","))
