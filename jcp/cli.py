"""The command-line pieces `jcp-train` and `jcp-serve` share: the argument parser that
turns usage errors into CliError, the --mesh parser, device setup, and the model + mesh
the flags name.

Owns nothing either program does alone. Like both programs, it is a place that parses
strings; a bad value ends in CliError naming the flag, never a traceback. It imports JAX
and jcp only inside functions, so that a mistyped flag fails before JAX loads.
"""

from __future__ import annotations

import argparse
import importlib.util
import os


class CliError(Exception):
    """A user error: printed as one line, exit status 2."""


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors raise CliError instead of exiting."""

    def error(self, message):
        raise CliError(message)


def parse_mesh(text: str) -> tuple[int, int, int]:
    """--mesh "dp,cp,tp" -> (dp, cp, tp), three positive integers; CliError otherwise."""
    try:
        mesh = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise CliError(f"--mesh must be dp,cp,tp integers, got {text!r}") from None
    if len(mesh) != 3 or min(mesh) < 1:
        raise CliError(f"--mesh must be three positive integers dp,cp,tp, got {mesh}")
    return mesh


# ----------------------------------------------------------------------------------------
# Devices


def _has_accelerator() -> bool:
    plugins = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin", "libtpu")
    return any(importlib.util.find_spec(p) for p in plugins)


def setup_devices(args, recoverable: bool = False) -> None:
    """Start jax.distributed when asked, and give a CPU-only machine 8 fake devices.

    recoverable: the job outlives a process that dies (jax_enable_recoverability), so that
    the survivors can report it instead of being aborted by the coordination service
    (jcp-serve). Must run before anything touches a JAX backend.
    """
    import jax

    from jcp import host_memory

    addr = args.coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS")
    nproc = args.num_processes or _env_int("JAX_NUM_PROCESSES")
    pid = args.process_id if args.process_id is not None else _env_int("JAX_PROCESS_ID")
    accel = _has_accelerator() and os.environ.get("JAX_PLATFORMS", "") in ("", "cuda", "gpu",
                                                                            "tpu", "rocm")
    if not accel and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        jax.config.update("jax_num_cpu_devices", 8 // (nproc or 1) or 1)
    host_memory.devices_configured()
    if addr or (nproc and nproc > 1):
        if not accel:
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        if recoverable:
            jax.config.update("jax_enable_recoverability", True)
        jax.distributed.initialize(coordinator_address=addr, num_processes=nproc,
                                   process_id=pid)


def _env_int(name):
    v = os.environ.get(name)
    if v is None:
        return None
    try:
        return int(v)
    except ValueError:
        raise CliError(f"{name} must be an integer, got {v!r}") from None


def load_model_and_mesh(args):
    """(config, base parameters, mesh) from --hf-model (or the tiny random model) and
    --mesh (default 2,2,2 on 8 devices, else 1,<devices>,1); CliError naming the flag."""
    import jax

    import jcp

    if args.hf_model:
        try:
            cfg, base = jcp.load_hf(args.hf_model)
        except (ValueError, OSError) as e:
            raise CliError(f"--hf-model {args.hf_model}: {e}") from None
    else:
        moe = getattr(args, "moe", False)
        cfg, base = (jcp.QwenConfig.tiny_moe() if moe else jcp.QwenConfig.tiny()), None
    n_dev = jax.device_count()
    mesh_shape = args.mesh or ((2, 2, 2) if n_dev == 8 else (1, n_dev, 1))
    try:
        mesh = jcp.make_mesh(*mesh_shape)
        cfg.check_mesh(mesh_shape[2])
    except ValueError as e:
        raise CliError(f"--mesh {','.join(map(str, mesh_shape))}: {e}") from None
    return cfg, base, mesh
