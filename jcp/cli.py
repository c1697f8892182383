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
import math
import os
import re


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
# Typed flags: the `type=` of every numeric and path flag of both programs. A bad value
# ends in the parser's one-line error naming the flag ("argument --port: must be in
# 0..65535, got 99999") before anything is built, instead of a traceback (or a silent
# wrap-around) wherever the value is first used.


def integer(lo: int, hi: int | None = None):
    """The converter of an integer in lo..hi (unbounded above when hi is None)."""

    def convert(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < lo or (hi is not None and value > hi):
            span = f"≥ {lo}" if hi is None else f"in {lo}..{hi}"
            raise argparse.ArgumentTypeError(f"must be {span}, got {value}")
        return value

    return convert


def number(lo: float, *, above: bool = False, hi: float = math.inf):
    """The converter of a finite float ≥ lo (> lo when `above`) and ≤ hi: no nan or inf."""

    def convert(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not (math.isfinite(value) and (value > lo if above else value >= lo) and value <= hi):
            bound = f"{'>' if above else '≥'} {lo:g}" + (f" and ≤ {hi:g}" if hi < math.inf else "")
            raise argparse.ArgumentTypeError(f"must be a finite number {bound}, got {text}")
        return value

    return convert


PORT = integer(0, 65535)  # 0: any free port
COUNT = integer(1)
SEED = integer(0)
POSITIVE = number(0.0, above=True)
GIGABYTES = number(0.0, hi=1e9)  # an exabyte: its bytes fit an int64


_UNITS = {"": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def memory_bytes(text: str) -> int | str:
    """The converter of a memory size: "auto", or bytes as an integer with an optional
    unit KiB / MiB / GiB / TiB ("512MiB")."""
    if text == "auto":
        return text
    m = re.fullmatch(r"(\d+)\s*([A-Za-z]*)", text.strip())
    unit = _UNITS.get(m.group(2).lower()) if m else None
    value = int(m.group(1)) if m else None
    if unit is None or value is None or value < 1:
        raise argparse.ArgumentTypeError(
            f"expected 'auto' or a positive number of bytes (e.g. 536870912 or 512MiB), got {text!r}"
        )
    return value * unit


def address(text: str) -> str:
    """HOST:PORT (a jax.distributed coordinator), port in 1..65535."""
    host, sep, port = text.rpartition(":")
    if not (sep and host and port.isdigit() and 1 <= int(port) <= 65535):
        raise argparse.ArgumentTypeError(
            f"expected HOST:PORT with a port in 1..65535, got {text!r}"
        )
    return text


def folder(text: str) -> str:
    """A folder that exists or can be made: neither a file nor under one."""
    path = os.path.abspath(text) if text else ""
    probe = path
    while probe and not os.path.lexists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    if not text or not os.path.isdir(probe):
        what = "is not a folder" if probe == path else f"is under {probe}, not a folder"
        raise argparse.ArgumentTypeError(f"{text!r} {what}")
    return text


def existing_folder(text: str) -> str:
    if not os.path.isdir(text):
        why = "not a folder" if os.path.exists(text) else "no such folder"
        raise argparse.ArgumentTypeError(f"{text}: {why}")
    return text


def existing_file(text: str) -> str:
    if not os.path.isfile(text):
        why = "not a file" if os.path.exists(text) else "no such file"
        raise argparse.ArgumentTypeError(f"{text}: {why}")
    return text


# ----------------------------------------------------------------------------------------
# Compilation cache

# The persistent cache's bound (JAX evicts the least recently used entries beyond it).
COMPILATION_CACHE_BYTES = 8 << 30


def default_cache_dir() -> str:
    """$XDG_CACHE_HOME/jcp/xla, else ~/.cache/jcp/xla (beside the "cpu" attention kernels)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jcp", "xla")


def add_cache_flags(p, default: str) -> None:
    """--compilation-cache DIR and --no-compilation-cache; `default` says (in the help)
    where the cache goes without them."""
    p.add_argument(
        "--compilation-cache",
        type=folder,
        default=None,
        metavar="DIR",
        help="JAX's persistent compilation cache: a restart loads the programs "
        f"an earlier run compiled (default: {default}; made mode 0700, refused "
        "if another user owns it or others may write it)",
    )
    p.add_argument(
        "--no-compilation-cache",
        action="store_true",
        help="compile every program afresh (no persistent cache)",
    )


def setup_compilation_cache(args, default: str | None = None) -> str | None:
    """Turn JAX's persistent compilation cache on in --compilation-cache, else in
    $JAX_COMPILATION_CACHE_DIR, else in `default` (None: default_cache_dir()), unless
    --no-compilation-cache -> the folder, or None. Every program is cached, however fast
    it compiled, unless the environment says otherwise (a warm restart then compiles
    nothing), and jcp's program store in its folder `jcp-programs` (program_store: a
    restart loads the programs without tracing them). CliError when a folder cannot be
    made or is not this user's alone (see files.private). Before anything compiles."""
    import jax

    from jcp import files, program_store

    if args.no_compilation_cache:
        if args.compilation_cache:
            raise CliError("--compilation-cache and --no-compilation-cache contradict")
        jax.config.update("jax_enable_compilation_cache", False)
        program_store.use(None)
        return None
    path = (
        args.compilation_cache
        or os.environ.get("JAX_COMPILATION_CACHE_DIR")
        or default
        or default_cache_dir()
    )
    path = os.path.abspath(path)
    why = files.private_folder(path)
    if why:
        raise CliError(
            f"compilation cache {path}: {why} (fix it, choose another with "
            "--compilation-cache, or --no-compilation-cache)"
        )
    jax.config.update("jax_compilation_cache_dir", path)
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    if "JAX_COMPILATION_CACHE_MAX_SIZE" not in os.environ:
        jax.config.update("jax_compilation_cache_max_size", COMPILATION_CACHE_BYTES)
    # Beside JAX's cache: the programs a restart loads without tracing them (program_store),
    # under the same bound (JAX's -1: none).
    bound = jax.config.jax_compilation_cache_max_size
    try:
        program_store.use(os.path.join(path, "jcp-programs"), bound if bound >= 0 else None)
    except ValueError as e:
        raise CliError(f"{e} (or run with --no-compilation-cache)") from None
    return path


# ----------------------------------------------------------------------------------------
# Devices


def _has_accelerator() -> bool:
    plugins = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin", "libtpu")
    return any(importlib.util.find_spec(p) for p in plugins)


def setup_devices(args, recoverable: bool = False) -> None:
    """Start jax.distributed when asked, and give a CPU-only machine fake devices: as many
    as its share of --mesh (cpu_devices), else 8 (the default mesh 2,2,2).

    recoverable: the job outlives a process that dies (jax_enable_recoverability), so that
    the survivors can report it instead of being aborted by the coordination service
    (jcp-serve). Must run before anything touches a JAX backend.
    """
    import jax

    from jcp import host_memory

    addr = args.coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS")
    nproc = args.num_processes or env_int("JAX_NUM_PROCESSES")
    pid = args.process_id if args.process_id is not None else env_int("JAX_PROCESS_ID")
    accel = _has_accelerator() and os.environ.get("JAX_PLATFORMS", "") in (
        "",
        "cuda",
        "gpu",
        "tpu",
        "rocm",
    )
    if not accel and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        jax.config.update("jax_num_cpu_devices", cpu_devices(getattr(args, "mesh", None), nproc))
    host_memory.devices_configured()
    if addr or (nproc and nproc > 1):
        if not accel:
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        if recoverable:
            jax.config.update("jax_enable_recoverability", True)
        jax.distributed.initialize(coordinator_address=addr, num_processes=nproc, process_id=pid)


def cpu_devices(mesh: tuple[int, int, int] | None, nproc: int | None) -> int:
    """The fake CPU devices a process of `nproc` creates: its share of `mesh` (dp·cp·tp;
    None: 8, the default mesh's). No more: XLA:CPU runs an intra-op thread per device at
    least, so devices the mesh leaves idle only add threads that contend for the cores (a
    one-core jcp-serve on --mesh 1,1,1 ran 8, and a training micro-batch took 1.2× as
    long: benchmarks/pass_turns.py --cpu-devices 8)."""
    n = math.prod(mesh) if mesh else 8
    return max(1, n // (nproc or 1))


def env_int(name):
    """The integer in environment variable `name`, None when unset; CliError otherwise."""
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


def build_trainer(
    args, *, max_adapters: int, max_rank: int, adapter_memory=None, turn_spans: int = 2
):
    """The Trainer of a command: model and mesh from the flags (load_model_and_mesh), seed
    and --max-tokens-per-device from args, the adapter tables' memory (bytes, "auto" or
    None: Trainer's adapter_memory) and turn_spans (TrainerOptions'); CliError where the
    Trainer refuses them."""
    import jcp

    cfg, base, mesh = load_model_and_mesh(args)
    try:
        return jcp.Trainer(
            cfg,
            mesh,
            base_params=base,
            max_adapters=max_adapters,
            max_rank=max_rank,
            seed=args.seed,
            max_tokens_per_device=args.max_tokens_per_device,
            adapter_memory=adapter_memory,
            turn_spans=turn_spans,
        )
    except ValueError as e:
        raise CliError(str(e)) from None
