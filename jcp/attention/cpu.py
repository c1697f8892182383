"""The "cpu" attention implementation: fused flash-attention kernels in C++ for XLA:CPU.

Owns the build of cpu_flash.cc (compiled on first use with the system C++ compiler, cached
by a hash of source, flags, compiler and jax version, verified before every load,
registered through the XLA FFI),
and the two strategies on its forward (out, lse) and backward (dq, dk, dv) kernels:
`flash_attention` (the all-gather path, custom VJP) and `ring_attention` (one kernel call
per cp ring step, partials merged by their log-sum-exp, tiling.merge_partials). It
applies exactly jcp's mask (attention.tiling.visible) with GQA and skips the tiles the
mask empties, as tiling.block_kinds classifies them. It must never materialise an
[S, T] array, never be chosen where it cannot build (`available()` says why), and never
load a cached file it has not verified (a truncated .so kills the process with SIGBUS on
load; another user's file would run as ours).

Why a kernel and not XLA: at 8k tokens on one core XLA's blockwise kernel spends 62 % of
its time in GEMMs, 13 % in softmax passes over whole score tiles and 17 % in per-tile
overhead (slices, conds, accumulation copies), and XLA:CPU uses a second thread only
inside large ops. Here a tile's scores stay in L1 between the product, the exp and the
next product; the forward splits (head, query tile) items, and the backward query heads,
over XLA's intra-op thread pool.

dtypes: the kernels are fp32; other inputs are converted to fp32 around the call (the
results are cast back), so bf16 costs two conversions but runs.

Layouts: q, out, dq [S, Q, H]; k, v, dk, dv [T, K, H]; lse and delta [Q, S] fp32, −inf
lse where a row sees nothing (its out and gradients 0). Head dims: HEAD_DIMS.
"""

from __future__ import annotations

import ctypes
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

from jcp.attention.tiling import (
    delta_QxS,
    kernel_ring_bwd,
    kernel_ring_fwd,
    no_grads,
    saved_out_lse,
)
from jcp.files import atomic_write, private
from jcp.mesh import CP, vary_all

SOURCE = pathlib.Path(__file__).with_name("cpu_flash.cc")
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno", "-w")
HEAD_DIMS = (16, 32, 64, 96, 128, 256)  # the instantiations in cpu_flash.cc
FWD_TARGET, BWD_TARGET = "jcp_cpu_flash_forward", "jcp_cpu_flash_backward"


class Unavailable(RuntimeError):
    """The kernels cannot be built or loaded here (no compiler, or it failed)."""


class NoCompiler(Unavailable):
    """No C++ compiler: the expected case on a machine without one (no warning)."""


def _compiler() -> str:
    cxx = os.environ.get("CXX", "g++")
    path = shutil.which(cxx) or (None if "CXX" in os.environ else shutil.which("c++"))
    if path is None:
        raise NoCompiler(
            f"attention implementation 'cpu' compiles cpu_flash.cc on first use "
            f"and needs a C++ compiler: none found ({cxx!r} / 'c++' not on PATH, "
            f"or set CXX); use attn_impl 'blockwise'"
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
    """The compiled kernels: one .so per hash of the source, flags, compiler version, jax
    version and CPU (model and flags: -march=native), (re)built now unless a cached one
    has no `refusal`. The .so and its recorded hash are each written to a temporary name
    and renamed (files.atomic_write), so no process loads a partial file; a reader that
    meets a new .so beside an old hash rebuilds. Unavailable when the cache folder is not
    ours alone (anyone who may write it could swap the file between check and load)."""
    cxx = _compiler()
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    include = jax.ffi.include_dir()
    key = hashlib.sha256(
        "\0".join(
            [
                SOURCE.read_text(),
                " ".join(FLAGS),
                version,
                jax.__version__,
                include,
                _cpu_identity(),
            ]
        ).encode()
    )
    lib = _cache_dir() / f"cpu_flash-{key.hexdigest()[:20]}.so"
    lib.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    why = private(lib.parent)
    if why:
        raise Unavailable(
            f"attention implementation 'cpu' will not use its kernel cache: "
            f"{why} (fix it, or set XDG_CACHE_HOME)"
        )
    if not refusal(lib):
        return lib
    digest = ""

    def build(tmp):
        nonlocal digest
        done = subprocess.run(
            [cxx, *FLAGS, f"-I{include}", str(SOURCE), "-o", tmp], capture_output=True, text=True
        )
        if done.returncode:
            raise Unavailable(
                f"attention implementation 'cpu': {cxx} failed to build "
                f"{SOURCE.name}:\n{done.stderr[-4000:]}"
            )
        os.chmod(tmp, 0o700)  # the linker's mode follows the umask, maybe group-writable
        digest = hashlib.sha256(pathlib.Path(tmp).read_bytes()).hexdigest()

    atomic_write(lib, build)
    atomic_write(_digest_path(lib), digest + "\n")
    return lib


@functools.cache
def _load() -> str:
    """Builds, loads and registers the kernels once per process; '' on success, else why
    not. A failure other than a missing compiler (a build that failed, a cache folder
    refused) is also a warning: "auto" then falls back to blockwise, which is slower."""
    try:
        lib = ctypes.CDLL(str(library_path()))
    except (Unavailable, OSError) as e:
        if not isinstance(e, NoCompiler):
            warnings.warn(f"{e}; attn_impl 'auto' uses 'blockwise'", RuntimeWarning, stacklevel=2)
        return str(e)
    jax.ffi.register_ffi_target(
        FWD_TARGET, jax.ffi.pycapsule(lib.JcpCpuFlashForward), platform="cpu"
    )
    jax.ffi.register_ffi_target(
        BWD_TARGET, jax.ffi.pycapsule(lib.JcpCpuFlashBackward), platform="cpu"
    )
    return ""


def available() -> bool:
    """True iff the kernels build and load here (the first call builds them)."""
    return not _load()


def require(head_dim: int) -> None:
    """Refuses what the kernels cannot run: no build, a non-CPU backend, a head dim not
    instantiated."""
    if jax.default_backend() != "cpu":
        raise ValueError(
            f"attention implementation 'cpu' runs on CPU, not on "
            f"{jax.default_backend()!r}; use 'blockwise' or 'pallas'"
        )
    if head_dim not in HEAD_DIMS:
        raise ValueError(
            f"attention implementation 'cpu' supports head dims {HEAD_DIMS}, "
            f"got {head_dim}; use 'blockwise'"
        )
    why = _load()
    if why:
        raise Unavailable(why)


def supports(head_dim: int) -> bool:
    """Whether require(head_dim) passes (what attn_impl 'auto' asks)."""
    return jax.default_backend() == "cpu" and head_dim in HEAD_DIMS and available()


def _f32(*xs):
    return [x.astype(jnp.float32) for x in xs]


def _i32(*xs):
    return [x.astype(jnp.int32) for x in xs]


def _ffi(name, out_shapes, *args):
    """The kernel `name` on args (cast to vary alike inside a shard_map), its fp32 outputs
    varying as the inputs do."""
    args = [vary_all(a, *args) for a in args]
    # ffi_call types its results invariant (a result ShapeDtypeStruct with varying axes
    # would need the manual mesh's sharding too); pvary is free in the forward, and these
    # calls are never differentiated (the VJPs are written out).
    outs = jax.ffi.ffi_call(
        name, [jax.ShapeDtypeStruct(s, jnp.float32) for s in out_shapes], vmap_method="sequential"
    )(*args)
    return [vary_all(o, *args) for o in outs]


def kernel_forward(q_SxQxH, k_TxKxH, v_TxKxH, seg_q, pos_q, seg_k, pos_k, out_dtype):
    """(out [S, Q, H] in out_dtype, lse [Q, S] fp32, −inf where a row sees nothing)."""
    require(q_SxQxH.shape[-1])
    s_len, q_heads, _ = q_SxQxH.shape
    out, lse = _ffi(
        FWD_TARGET,
        [q_SxQxH.shape, (q_heads, s_len)],
        *_f32(q_SxQxH, k_TxKxH, v_TxKxH),
        *_i32(seg_q, pos_q, seg_k, pos_k),
    )
    return out.astype(out_dtype), lse


def kernel_backward(
    q_SxQxH, k_TxKxH, v_TxKxH, seg_q, pos_q, seg_k, pos_k, do_SxQxH, lse_QxS, delta_QxS
):
    """fp32 (dq [S, Q, H], dk, dv [T, K, H]) of the attention whose (global) lse and
    delta = Σ_h do·out are given: over one key stream of several, the gradients add."""
    require(q_SxQxH.shape[-1])
    return _ffi(
        BWD_TARGET,
        [q_SxQxH.shape, k_TxKxH.shape, k_TxKxH.shape],
        *_f32(q_SxQxH, k_TxKxH, v_TxKxH, do_SxQxH, lse_QxS, delta_QxS),
        *_i32(seg_q, pos_q, seg_k, pos_k),
    )


# ----------------------------------------------------------------------------------------
# The all-gather path


@jax.custom_vjp
def flash_attention(q_SxQxH, k_TxKxH, v_TxKxH, seg_q, pos_q, seg_k, pos_k):
    """Attention of queries q [S, Q, H] (seg_q, pos_q [S]) over keys and values k, v
    [T, K, H] (seg_k, pos_k [T]) under jcp's mask. Returns out [S, Q, H] in q's dtype
    (0 for a query that sees nothing)."""
    return _flash_fwd(q_SxQxH, k_TxKxH, v_TxKxH, seg_q, pos_q, seg_k, pos_k)[0]


def _flash_fwd(q, k, v, seg_q, pos_q, seg_k, pos_k):
    out, lse = saved_out_lse(*kernel_forward(q, k, v, seg_q, pos_q, seg_k, pos_k, q.dtype))
    return out, (q, k, v, seg_q, pos_q, seg_k, pos_k, out, lse)


def _flash_bwd(res, d_out):
    q, k, v, seg_q, pos_q, seg_k, pos_k, out, lse = res
    dq, dk, dv = kernel_backward(
        q, k, v, seg_q, pos_q, seg_k, pos_k, d_out, lse, delta_QxS(d_out, out)
    )
    return (
        dq.astype(q.dtype),
        dk.astype(k.dtype),
        dv.astype(v.dtype),
        *no_grads(seg_q, pos_q, seg_k, pos_k),
    )


flash_attention.defvjp(_flash_fwd, _flash_bwd)


# ----------------------------------------------------------------------------------------
# The ring (as attention.pallas's: one kernel call per step, partials merged by lse)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _ring(q, k, v, seg, pos, cp):
    return _ring_fwd(q, k, v, seg, pos, cp)[0]


def _ring_fwd(q, k, v, seg, pos, cp):
    return kernel_ring_fwd(lambda *a: kernel_forward(*a, jnp.float32), q, k, v, seg, pos, cp)


def _ring_bwd(cp, res, d_out):
    return kernel_ring_bwd(kernel_backward, cp, res, d_out)


_ring.defvjp(_ring_fwd, _ring_bwd)


def ring_attention(q_SxQxH, k_SxKxH, v_SxKxH, segment_S, position_S):
    """attention.ring_attention with these kernels: same arguments, mask and result; runs
    inside shard_map over "cp"; per-device memory O(S)."""
    return _ring(q_SxQxH, k_SxKxH, v_SxKxH, segment_S, position_S, jax.lax.axis_size(CP))
