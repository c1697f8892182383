"""jcp's C++ kernels for XLA:CPU: one shared library built from every kernel source
(jcp/attention/cpu_flash.cc, the "cpu" attention; jcp/lora_cpu.cc, the grouped LoRA
products), compiled on first use with the system C++ compiler, cached by a hash of the
sources, flags, compiler, jax version and CPU, verified before every load, and registered
through the XLA FFI.

Owns the build, the cache and the registration; the modules that call the kernels
(jcp.attention.cpu, jcp.lora_cpu) own their targets' use. It must never load a cached
file it has not verified (a truncated .so kills the process with SIGBUS on load; another
user's file would run as ours), and never make a caller fail where the kernels cannot
build: `available()` says whether they can, `load()` why not.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import os
import pathlib
import platform
import shutil
import subprocess
import warnings

import jax
import jax.numpy as jnp

from jcp.files import atomic_write, private
from jcp.mesh import vary_all

_HERE = pathlib.Path(__file__).parent
SOURCES = (_HERE / "attention" / "cpu_flash.cc", _HERE / "lora_cpu.cc")
HEADERS = (_HERE / "cpu_parallel.h",)  # included by the sources (part of the cache key)
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno", "-w")
# FFI target name -> the handler symbol the library exports.
TARGETS = {
    "jcp_cpu_flash_forward": "JcpCpuFlashForward",
    "jcp_cpu_flash_backward": "JcpCpuFlashBackward",
    "jcp_cpu_lora_a_forward": "JcpCpuLoraAForward",
    "jcp_cpu_lora_b_forward": "JcpCpuLoraBForward",
    "jcp_cpu_lora_a_backward": "JcpCpuLoraABackward",
    "jcp_cpu_lora_b_backward": "JcpCpuLoraBBackward",
    "jcp_cpu_lora_a_backward_into": "JcpCpuLoraABackwardInto",
    "jcp_cpu_lora_b_backward_into": "JcpCpuLoraBBackwardInto",
}


class Unavailable(RuntimeError):
    """The kernels cannot be built or loaded here (no compiler, or it failed)."""


class NoCompiler(Unavailable):
    """No C++ compiler: the expected case on a machine without one (no warning)."""


def _compiler() -> str:
    cxx = os.environ.get("CXX", "g++")
    path = shutil.which(cxx) or (None if "CXX" in os.environ else shutil.which("c++"))
    if path is None:
        raise NoCompiler(
            f"jcp's CPU kernels (attn_impl 'cpu', lora_impl 'cpu') compile on first use: "
            f"building them needs a C++ compiler, none found ({cxx!r} / 'c++' not on PATH, "
            f"or set CXX); use attn_impl 'blockwise' and lora_impl 'xla'"
        )
    return path


def _cache_dir() -> pathlib.Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "jcp"


def _cpu_identity() -> str:
    """This CPU's model and instruction-set flags: -march=native code built on one machine
    may not run on another, and a cache under a home directory may be shared by a
    cluster's hosts."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags", "Features"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor() or platform.machine()


def _digest_path(lib: pathlib.Path) -> pathlib.Path:
    return lib.with_name(lib.name + ".sha256")


def refusal(lib: pathlib.Path) -> str:
    """Why the cached `lib` must not be loaded (a truncated or altered file, a foreign
    owner, a loose mode, no recorded hash), '' when it may: it and the SHA-256 recorded
    beside it at build time are ours, writable by no one else, and the file's hash is the
    recorded one."""
    digest = _digest_path(lib)
    try:
        why = private(lib) or private(digest)
        if why:
            return why
        if hashlib.sha256(lib.read_bytes()).hexdigest() != digest.read_text().strip():
            return f"{lib} does not match the hash recorded at its build"
    except FileNotFoundError as e:
        return f"{e.filename} is missing"
    except (OSError, UnicodeDecodeError) as e:
        return f"{lib} or its hash cannot be read ({e})"
    return ""


def library_path() -> pathlib.Path:
    """The compiled kernels: one .so per hash of the sources, flags, compiler version, jax
    version and CPU (model and flags: -march=native), (re)built now unless a cached one
    has no `refusal`. The .so and its recorded hash are each written to a temporary name
    and renamed (files.atomic_write), so no process loads a partial file; a reader that
    meets a new .so beside an old hash rebuilds; builds take a lock file beside the .so,
    so processes that start together build once. Unavailable when the cache folder is not
    ours alone (anyone who may write it could swap the file between check and load)."""
    cxx = _compiler()
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    include = jax.ffi.include_dir()
    key = hashlib.sha256(
        "\0".join(
            [
                *(s.read_text() for s in SOURCES + HEADERS),
                " ".join(FLAGS),
                version,
                jax.__version__,
                include,
                _cpu_identity(),
            ]
        ).encode()
    )
    lib = _cache_dir() / f"cpu_kernels-{key.hexdigest()[:20]}.so"
    lib.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    why = private(lib.parent)
    if why:
        raise Unavailable(
            f"jcp's CPU kernels will not use their cache: {why} (fix it, or set XDG_CACHE_HOME)"
        )
    if not refusal(lib):
        return lib
    # One build at a time per library: processes starting together (test workers, a
    # multi-process job's ranks) wait for the first one's build and load it.
    with open(lib.with_name(lib.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not refusal(lib):
            return lib
        _build(cxx, include, lib)
    return lib


def _build(cxx: str, include: str, lib: pathlib.Path) -> None:
    """Compiles the sources into `lib` and records its hash beside it (each written to a
    temporary name, then renamed)."""
    digest = ""

    def build(tmp):
        nonlocal digest
        done = subprocess.run(
            [cxx, *FLAGS, f"-I{include}", *map(str, SOURCES), "-o", tmp],
            capture_output=True,
            text=True,
        )
        if done.returncode:
            raise Unavailable(
                f"jcp's CPU kernels: {cxx} failed to build them:\n{done.stderr[-4000:]}"
            )
        os.chmod(tmp, 0o700)  # the linker's mode follows the umask, maybe group-writable
        digest = hashlib.sha256(pathlib.Path(tmp).read_bytes()).hexdigest()

    atomic_write(lib, build)
    atomic_write(_digest_path(lib), digest + "\n")


@functools.cache
def _loaded() -> tuple[ctypes.CDLL | None, str]:
    """(the library, '') once built, loaded and registered; (None, why not) else."""
    try:
        lib = ctypes.CDLL(str(library_path()))
    except (Unavailable, OSError) as e:
        if not isinstance(e, NoCompiler):
            warnings.warn(
                f"{e}; attn_impl 'auto' uses 'blockwise' and lora_impl 'auto' uses 'xla'",
                RuntimeWarning,
                stacklevel=3,
            )
        return None, str(e)
    for target, symbol in TARGETS.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    return lib, ""


def load() -> str:
    """Builds, loads and registers the kernels once per process; '' on success, else why
    not. A failure other than a missing compiler (a build that failed, a cache folder
    refused) is also a warning: the "auto" settings then fall back to plain XLA, which is
    slower."""
    return _loaded()[1]


def vector_floats() -> int:
    """Floats in one vector register of the kind the loaded kernels were built for
    (-march=native; jcp/cpu_parallel.h): 16 with AVX-512, else 8; 0 where they are not
    available."""
    lib, why = _loaded()
    return 0 if why else int(lib.JcpCpuVectorFloats())


def available() -> bool:
    """True iff the kernels build and load here (the first call builds them)."""
    return not load()


def call(target, out_shapes, *args):
    """The kernel `target` on args (cast to vary alike inside a shard_map) -> its fp32
    outputs of out_shapes, varying as the inputs do."""
    args = [vary_all(a, *args) for a in args]
    # ffi_call types its results invariant (a result ShapeDtypeStruct with varying axes
    # would need the manual mesh's sharding too); pvary is free in the forward, and these
    # calls are never differentiated (their callers' VJPs are written out).
    outs = jax.ffi.ffi_call(
        target,
        [jax.ShapeDtypeStruct(s, jnp.float32) for s in out_shapes],
        vmap_method="sequential",
    )(*args)
    return [vary_all(o, *args) for o in outs]
