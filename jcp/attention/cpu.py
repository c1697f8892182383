"""The "cpu" attention implementation: fused flash-attention kernels in C++ for XLA:CPU.

Owns the build of cpu_flash.cc (compiled on first use with the system C++ compiler, cached
by a hash of source, flags, compiler and jax version, registered through the XLA FFI),
and the two strategies on its forward (out, lse) and backward (dq, dk, dv) kernels:
`flash_attention` (the all-gather path, custom VJP) and `ring_attention` (one kernel call
per cp ring step, partials merged by their log-sum-exp, tiling.merge_partials). It
applies exactly jcp's mask (attention.tiling.visible) with GQA and skips the tiles the
mask empties, as tiling.block_kinds classifies them. It must never materialise an
[S, T] array and never be chosen where it cannot build (`available()` says why).

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
import tempfile

import jax
import jax.numpy as jnp

from jcp.attention.tiling import (delta_QxS, kernel_ring_bwd, kernel_ring_fwd, no_grads,
                                  saved_out_lse)
from jcp.mesh import CP, vary_all

SOURCE = pathlib.Path(__file__).with_name("cpu_flash.cc")
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno",
         "-w")
HEAD_DIMS = (16, 32, 64, 96, 128, 256)  # the instantiations in cpu_flash.cc
_FWD, _BWD = "jcp_cpu_flash_forward", "jcp_cpu_flash_backward"


class Unavailable(RuntimeError):
    """The kernels cannot be built or loaded here (no compiler, or it failed)."""


def _compiler() -> str:
    cxx = os.environ.get("CXX", "g++")
    path = shutil.which(cxx) or (None if "CXX" in os.environ else shutil.which("c++"))
    if path is None:
        raise Unavailable(f"attention implementation 'cpu' compiles cpu_flash.cc on first use "
                          f"and needs a C++ compiler: none found ({cxx!r} / 'c++' not on PATH, "
                          f"or set CXX); use attn_impl 'blockwise'")
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


def library_path() -> pathlib.Path:
    """The compiled kernels (built now if not cached): one .so per hash of the source,
    flags, compiler version, jax version and CPU (model and flags: -march=native); written
    to a temporary name and renamed, so concurrent processes never load a partial file."""
    cxx = _compiler()
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    include = jax.ffi.include_dir()
    key = hashlib.sha256("\0".join(
        [SOURCE.read_text(), " ".join(FLAGS), version, jax.__version__, include,
         _cpu_identity()]).encode())
    lib = _cache_dir() / f"cpu_flash-{key.hexdigest()[:20]}.so"
    if lib.exists():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib.parent)
    os.close(fd)
    try:
        done = subprocess.run([cxx, *FLAGS, f"-I{include}", str(SOURCE), "-o", tmp],
                              capture_output=True, text=True)
        if done.returncode:
            raise Unavailable(f"attention implementation 'cpu': {cxx} failed to build "
                              f"{SOURCE.name}:\n{done.stderr[-4000:]}")
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


@functools.cache
def _load() -> str:
    """Builds, loads and registers the kernels once per process; '' on success, else why not."""
    try:
        lib = ctypes.CDLL(str(library_path()))
    except (Unavailable, OSError) as e:
        return str(e)
    jax.ffi.register_ffi_target(_FWD, jax.ffi.pycapsule(lib.JcpCpuFlashForward), platform="cpu")
    jax.ffi.register_ffi_target(_BWD, jax.ffi.pycapsule(lib.JcpCpuFlashBackward), platform="cpu")
    return ""


def available() -> bool:
    """True iff the kernels build and load here (the first call builds them)."""
    return not _load()


def require(head_dim: int) -> None:
    """Refuses what the kernels cannot run: no build, a non-CPU backend, a head dim not
    instantiated."""
    if jax.default_backend() != "cpu":
        raise ValueError(f"attention implementation 'cpu' runs on CPU, not on "
                         f"{jax.default_backend()!r}; use 'blockwise' or 'pallas'")
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"attention implementation 'cpu' supports head dims {HEAD_DIMS}, "
                         f"got {head_dim}; use 'blockwise'")
    why = _load()
    if why:
        raise Unavailable(why)


def supports(head_dim: int) -> bool:
    """Whether require(head_dim) passes (what attn_impl 'auto' asks)."""
    return (jax.default_backend() == "cpu" and head_dim in HEAD_DIMS and available())


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
    outs = jax.ffi.ffi_call(name, [jax.ShapeDtypeStruct(s, jnp.float32) for s in out_shapes],
                            vmap_method="sequential")(*args)
    return [vary_all(o, *args) for o in outs]


def _forward(q_SxQxH, k_TxKxH, v_TxKxH, seg_q, pos_q, seg_k, pos_k, out_dtype):
    """(out [S, Q, H] in out_dtype, lse [Q, S] fp32, −inf where a row sees nothing)."""
    require(q_SxQxH.shape[-1])
    s_len, q_heads, _ = q_SxQxH.shape
    out, lse = _ffi(_FWD, [q_SxQxH.shape, (q_heads, s_len)],
                    *_f32(q_SxQxH, k_TxKxH, v_TxKxH), *_i32(seg_q, pos_q, seg_k, pos_k))
    return out.astype(out_dtype), lse


def _backward(q_SxQxH, k_TxKxH, v_TxKxH, seg_q, pos_q, seg_k, pos_k, do_SxQxH, lse_QxS,
              delta_QxS):
    """fp32 (dq [S, Q, H], dk, dv [T, K, H]) of the attention whose (global) lse and
    delta = Σ_h do·out are given: over one key stream of several, the gradients add."""
    require(q_SxQxH.shape[-1])
    return _ffi(_BWD, [q_SxQxH.shape, k_TxKxH.shape, k_TxKxH.shape],
                *_f32(q_SxQxH, k_TxKxH, v_TxKxH, do_SxQxH, lse_QxS, delta_QxS),
                *_i32(seg_q, pos_q, seg_k, pos_k))


# ----------------------------------------------------------------------------------------
# The all-gather path


@jax.custom_vjp
def flash_attention(q_SxQxH, k_TxKxH, v_TxKxH, seg_q, pos_q, seg_k, pos_k):
    """Attention of queries q [S, Q, H] (seg_q, pos_q [S]) over keys and values k, v
    [T, K, H] (seg_k, pos_k [T]) under jcp's mask. Returns out [S, Q, H] in q's dtype
    (0 for a query that sees nothing)."""
    return _flash_fwd(q_SxQxH, k_TxKxH, v_TxKxH, seg_q, pos_q, seg_k, pos_k)[0]


def _flash_fwd(q, k, v, seg_q, pos_q, seg_k, pos_k):
    out, lse = saved_out_lse(*_forward(q, k, v, seg_q, pos_q, seg_k, pos_k, q.dtype))
    return out, (q, k, v, seg_q, pos_q, seg_k, pos_k, out, lse)


def _flash_bwd(res, d_out):
    q, k, v, seg_q, pos_q, seg_k, pos_k, out, lse = res
    dq, dk, dv = _backward(q, k, v, seg_q, pos_q, seg_k, pos_k, d_out, lse,
                           delta_QxS(d_out, out))
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype),
            *no_grads(seg_q, pos_q, seg_k, pos_k))


flash_attention.defvjp(_flash_fwd, _flash_bwd)


# ----------------------------------------------------------------------------------------
# The ring (as attention.pallas's: one kernel call per step, partials merged by lse)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _ring(q, k, v, seg, pos, cp):
    return _ring_fwd(q, k, v, seg, pos, cp)[0]


def _ring_fwd(q, k, v, seg, pos, cp):
    return kernel_ring_fwd(lambda *a: _forward(*a, jnp.float32), q, k, v, seg, pos, cp)


def _ring_bwd(cp, res, d_out):
    return kernel_ring_bwd(_backward, cp, res, d_out)


_ring.defvjp(_ring_fwd, _ring_bwd)


def ring_attention(q_SxQxH, k_SxKxH, v_SxKxH, segment_S, position_S):
    """attention.ring_attention with these kernels: same arguments, mask and result; runs
    inside shard_map over "cp"; per-device memory O(S)."""
    return _ring(q_SxQxH, k_SxKxH, v_SxKxH, segment_S, position_S, jax.lax.axis_size(CP))
