"""The "cpu" attention implementation (jcp.attention.cpu: fused C++ kernels via the XLA FFI).

Evidence:
1. forward and backward equal the dense reference and the blockwise kernel, values and
   d(q, k, v), on packed ragged datums in the zigzag layout (non-monotone positions), GQA
   with M = 1, 2, 4, one rank's queries against every rank's keys, streams that are not a
   whole number of tiles, and with tiles skipped, masked and fully visible all present;
   the lse equals the dense log-sum-exp (−inf for a row that sees no key);
2. padding rows and a fully masked real row give exact zeros (values and gradients), never
   NaN; padding contents never reach a real token; bf16 runs (converted to fp32);
3. through attention.cp_attention (all-gather) and attention.ring_attention inside a
   shard_map at cp = 2, and through the Trainer (gather and ring);
4. the build: cached by hash, "auto" resolution, and a clear refusal without a compiler;
   a cached file that is truncated, altered, another user's or writable by others is
   rebuilt, a cache folder writable by others refused ("auto" falls back with a warning),
   and the process lives.

Legend: CP mesh axis size; S rows of one rank's stream; Q query heads; K kv heads; H head
dim.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import kernel_checks as KC
from helpers import trainer_harness as TH

import jcp
from jcp import attention, cpu_kernels
from jcp.attention import cpu

H, random_qkv, zigzag_layout = KC.H, KC.random_qkv, KC.zigzag_layout

pytestmark = pytest.mark.skipif(
    not cpu.available(), reason="no C++ compiler: 'cpu' attention unavailable"
)

TILE = 64  # the kernels' tile rows (cpu_flash.cc BQ = BK)


def _cpu(q, k, v, seg_q, pos_q, seg_k, pos_k):
    return cpu.flash_attention(q, k, v, seg_q, pos_q, seg_k, pos_k)


def _dense(q, k, v, seg_q, pos_q, seg_k, pos_k):
    s_len, q_heads, _ = q.shape
    kv_heads = k.shape[1]
    out = attention.blockwise.dense(
        q.reshape(s_len, kv_heads, q_heads // kv_heads, H), k, v, seg_q, pos_q, seg_k, pos_k
    )
    return out.reshape(q.shape)


def _blockwise(q, k, v, seg_q, pos_q, seg_k, pos_k):
    s_len, q_heads, _ = q.shape
    t_len, kv_heads, _ = k.shape
    out = attention.blockwise.flash(
        q.reshape(s_len, kv_heads, q_heads // kv_heads, H),
        k,
        v,
        seg_q,
        pos_q,
        seg_k,
        pos_k,
        attention.tile(s_len, 32),
        attention.tile(t_len, 32),
    )
    return out.reshape(q.shape)


IMPLS = {"cpu": _cpu, "dense": _dense, "blockwise": _blockwise}


@functools.cache
def value_and_grads(impl):
    """jit of (q, k, v, seg_q, pos_q, seg_k, pos_k, cot) -> (out, d/d(q, k, v) of Σ out·cot)."""

    def run(q, k, v, seg_q, pos_q, seg_k, pos_k, cot):
        out, vjp = jax.vjp(
            lambda q, k, v: IMPLS[impl](q, k, v, seg_q, pos_q, seg_k, pos_k), q, k, v
        )
        return out, vjp(cot.astype(out.dtype))

    return jax.jit(run)


def run(impl, *args):
    out, grads = value_and_grads(impl)(*args)
    return np.asarray(out, np.float32), tuple(np.asarray(g, np.float32) for g in grads)


def _has_kernel(fn, *args) -> bool:
    return cpu.FWD_TARGET in str(jax.jit(fn).lower(*args).as_text())


# ----------------------------------------------------------------------------------------
# 1. cpu vs dense vs blockwise


# (lengths, cp of the zigzag layout, S per rank, Q, K, queries): "all" = every rank's rows
# as queries (S = T), "rank0" = rank 0's rows against every rank's keys (as cp_attention
# sees them). "ragged": 300 rows (cp = 1: positions monotone), not a whole number of
# 64-row tiles.
CASES = {
    "gqa2-zigzag": ((300, 1, 93, 9, 1, 90), 2, 256, 4, 2, "all"),
    "gqa4-rank0": ((1100, 1, 33, 9), 4, 320, 4, 1, "rank0"),
    "mha-ragged": ((170, 1, 70), 1, 300, 2, 2, "all"),
}


def case_args(name, seed=0, dtype=np.float32):
    lengths, cp, s_len, q_heads, kv_heads, queries = CASES[name]
    seg, pos = zigzag_layout(lengths, cp, s_len)
    seg_k, pos_k = seg.reshape(-1), pos.reshape(-1)
    seg_q, pos_q = (seg[0], pos[0]) if queries == "rank0" else (seg_k, pos_k)
    q, k, v, cot = random_qkv(seg_q.shape[0], seg_k.shape[0], q_heads, kv_heads, seed, dtype)
    return q, k, v, seg_q, pos_q, seg_k, pos_k, cot


def _kinds_of_64_tiles(seg_q, pos_q, seg_k, pos_k):
    """The tile kinds the kernels see (tiling.block_kinds over streams padded to 64)."""

    def pad(seg, pos):
        n = -len(seg) % TILE
        return np.concatenate([seg, np.full(n, -1, np.int32)]), np.concatenate(
            [pos, np.zeros(n, np.int32)]
        )

    kinds, _ = attention.tiling.block_kinds(*pad(seg_q, pos_q), *pad(seg_k, pos_k), TILE, TILE)
    return set(np.unique(np.asarray(kinds)).tolist())


@pytest.mark.parametrize("name", CASES)
def test_cpu_matches_dense_and_blockwise(name):
    args = case_args(name, seed=len(name))
    q, k, v, seg_q, pos_q, seg_k, pos_k, cot = args
    # The implementations really differ: only the cpu one calls the C++ kernels.
    assert _has_kernel(value_and_grads("cpu"), *args)
    assert not _has_kernel(value_and_grads("blockwise"), *args)
    # Positions are not monotone in the stream (zigzag, cp > 1), and every kind of tile
    # occurs: skipped, masked and fully visible.
    assert np.any(np.diff(pos_k[seg_k == 0]) < 0) == (CASES[name][1] > 1)
    assert _kinds_of_64_tiles(seg_q, pos_q, seg_k, pos_k) == {0, 1, 2}

    KC.assert_kernel_matches_references(
        run("cpu", *args), run("dense", *args), run("blockwise", *args)
    )


def _dense_lse(q, k, seg_q, pos_q, seg_k, pos_k):
    """[Q, S] float64 log Σ_visible exp(q·k/√H), −inf where a row sees nothing."""
    per_kv = q.shape[1] // k.shape[1]
    s = np.einsum(
        "sqh,tqh->qst", q.astype(np.float64), np.repeat(k, per_kv, axis=1).astype(np.float64)
    ) / np.sqrt(H)
    vis = np.asarray(attention.tiling.visible(seg_q, pos_q, seg_k, pos_k))
    s = np.where(vis[None], s, -np.inf)
    m = s.max(-1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        return (
            np.where(np.isfinite(m), m, 0)
            + np.log(np.exp(s - np.where(np.isfinite(m), m, 0)).sum(-1, keepdims=True))
        )[..., 0]


def test_lse_and_a_fully_masked_row():
    """The forward's lse is the dense log-sum-exp; a real query whose datum has no key in
    this stream (segment 7: no key carries it) sees nothing: out 0, lse −inf, gradients 0,
    as blockwise gives."""
    q, k, v, seg_q, pos_q, seg_k, pos_k, cot = case_args("gqa4-rank0", seed=5)
    seg_q = seg_q.copy()
    lonely = np.flatnonzero(seg_q == 0)[:3]
    seg_q[lonely] = 7
    assert not np.any(seg_k == 7)
    out, lse = cpu.kernel_forward(q, k, v, seg_q, pos_q, seg_k, pos_k, jnp.float32)
    lse_d = _dense_lse(q, k, seg_q, pos_q, seg_k, pos_k)
    sees = np.isfinite(lse_d)
    assert not sees[:, lonely].any() and sees.any()
    assert np.all(np.asarray(lse)[~sees] == -np.inf)
    np.testing.assert_allclose(np.asarray(lse)[sees], lse_d[sees], rtol=0, atol=1e-5)
    args = (q, k, v, seg_q, pos_q, seg_k, pos_k, cot)
    out_c, g_c = run("cpu", *args)
    out_b, g_b = run("blockwise", *args)
    assert np.all(out_c[lonely] == 0.0) and np.all(g_c[0][lonely] == 0.0)
    np.testing.assert_allclose(out_c, out_b, rtol=0, atol=1e-5 * np.abs(out_b).max())
    for which, a, b in zip("qkv", g_c, g_b):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * np.abs(b).max(), err_msg=which)


# ----------------------------------------------------------------------------------------
# 2. Padding and bf16


def test_padding_exact_zeros_and_contents_never_leak():
    seg, pos = zigzag_layout((1, 3, 1, 90), 4, 64)
    seg_t, pos_t = seg.reshape(-1), pos.reshape(-1)
    real = seg_t >= 0
    assert not real.all() and not (seg[3] >= 0).all()
    q, k, v, cot = random_qkv(256, 256, 4, 2, seed=9)
    args = (q, k, v, seg_t, pos_t, seg_t, pos_t, cot)
    KC.assert_padding_exact(run, "cpu", args, real)


def test_bfloat16_runs_in_fp32():
    args32 = case_args("gqa2-zigzag", seed=3)
    args16 = tuple(jnp.asarray(a, jnp.bfloat16) if i < 3 else a for i, a in enumerate(args32))
    assert value_and_grads("cpu")(*args16)[0].dtype == jnp.bfloat16
    out_c, g_c = run("cpu", *args16)
    out_d, g_d = run("dense", *args32)
    np.testing.assert_allclose(out_c, out_d, rtol=0, atol=3e-2 * np.abs(out_d).max())
    for which, a, d in zip("qkv", g_c, g_d):
        np.testing.assert_allclose(a, d, rtol=0, atol=3e-2 * np.abs(d).max(), err_msg=which)


# ----------------------------------------------------------------------------------------
# 3. Inside shard_map: cp_attention (all-gather), the ring, and the Trainer


@functools.cache
def sharded(impl, path):
    """KC.sharded at this file's block."""
    return KC.sharded(impl, path, 32)


def test_cp_attention_and_ring_in_shard_map():
    seg, pos = zigzag_layout((200, 1, 23, 9, 1), 2, 192)
    rng = np.random.default_rng(4)
    q, cot = (rng.standard_normal((2, 192, 4, H)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((2, 192, 2, H)).astype(np.float32) for _ in range(2))
    args = (q, k, v, seg, pos, cot)
    text = {
        key: jax.jit(sharded(*key)).lower(*args).as_text()
        for key in (("cpu", "gather"), ("cpu", "ring"), ("blockwise", "ring"))
    }
    # The paths really differ: the C++ kernels vs none; all-gather vs collective-permute.
    assert cpu.FWD_TARGET in text["cpu", "gather"] and "all_gather" in text["cpu", "gather"]
    assert cpu.BWD_TARGET in text["cpu", "ring"] and "collective_permute" in text["cpu", "ring"]
    assert "all_gather" not in text["cpu", "ring"]
    assert cpu.FWD_TARGET not in text["blockwise", "ring"]

    KC.assert_paths_match_dense(sharded, "cpu", args, seg)


@pytest.mark.parametrize("cp", (4, 8))
def test_ring_memory_per_rank_with_wide_kv(cp):
    """The C++ kernels' ring holds < 11 u of temporaries per rank at every cp (u = S·K·H·4
    bytes, one rank's K in fp32; 8 kv heads, as many as q heads): the held K/V and the pair
    in flight (4 u), their fp32 gradients held and in flight (4 u), the kernel's dK, dV of
    the held block (2 u), and 1 u for dq, the merged partials and lse. Unrolled ring steps
    held 13.1 u at cp = 4, 23.2 u at cp = 8 (issue 37); the loop holds 9.1 u at both."""
    assert KC.ring_temp_units("cpu", cp) < 11


@pytest.mark.parametrize("cp_attention", ["gather", "ring"])
def test_trainer_cpu_matches_blockwise(tmp_path, monkeypatch, cp_attention):
    """The whole training step — StepConfig accepts "cpu", the layer scan with remat, the
    custom VJP — gives blockwise's log-probs and LoRA gradients, at cp = 2."""
    KC.assert_trainer_matches_blockwise(
        tmp_path, monkeypatch, cpu, "cpu", attn_block=32, cp_attention=cp_attention
    )


# ----------------------------------------------------------------------------------------
# 4. Build, resolution, refusals


def test_build_is_cached_and_auto_resolves():
    lib = cpu.library_path()
    assert lib.exists() and cpu.library_path() == lib  # second call: the cached file
    assert attention.resolve_implementation("auto", "cpu", H, "float32") == "cpu"
    # head dim
    assert attention.resolve_implementation("auto", "cpu", 24, "float32") == "blockwise"
    assert attention.resolve_implementation("auto", "gpu", H, "float32") == "blockwise"
    assert attention.resolve_implementation("pallas", "cpu", H, "float32") == "pallas"
    # The Trainer's default: the C++ kernels on CPU.
    tr = jcp.Trainer(TH.CFG, jcp.make_mesh(1, 1, 1), max_adapters=1, max_rank=4)
    assert TH.CFG.head_dim in cpu.HEAD_DIMS and tr.step_cfg.attn_impl == "cpu"
    with pytest.raises(ValueError, match="attn_impl"):
        jcp.Trainer(TH.CFG, jcp.make_mesh(1, 1, 1), attn_impl="fast")


def test_the_kernels_vectors_are_the_machines_widest_registers():
    """The library is built for this CPU's widest vector registers, as its flags name them:
    16 floats with AVX-512, else 8. With 16-float vectors everywhere, an AVX2 machine ran
    the attention kernels 24× slower (benchmarks/RESULTS.md, "The CPU kernels on AVX2")."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next(line.split(":", 1)[1].split() for line in f if line.startswith("flags"))
    except (OSError, StopIteration):
        pytest.skip("no x86 CPU flags in /proc/cpuinfo")
    assert cpu_kernels.vector_floats() == (16 if "avx512f" in flags else 8)


def test_refuses_without_compiler_or_with_unsupported_head_dim(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-g++"))
    with pytest.raises(cpu.Unavailable, match="needs a C\\+\\+ compiler"):
        cpu.library_path()
    q = jnp.zeros((8, 2, 24), jnp.float32)
    seg = jnp.zeros(8, jnp.int32)
    with pytest.raises(ValueError, match="head dims"):
        cpu.flash_attention(q, q, q, seg, seg, seg, seg)


# The kernel cache. The compiler here is a script that answers --version as the real one
# (so the cache name is the real one) and "builds" by copying the object built once for
# this module: a rebuild costs a copy, not a 6-s compile, and is counted.


@pytest.fixture
def copying_cxx(tmp_path, monkeypatch):
    """(the built object's bytes, the cache folder, the number of builds so far())."""
    real = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")
    good = tmp_path / "good.so"
    shutil.copyfile(cpu.library_path(), good)
    log = tmp_path / "builds"
    log.write_text("")
    script = tmp_path / "cxx"
    script.write_text(f"""#!/bin/sh
[ "$1" = --version ] && exec {real} --version
while [ $# -gt 1 ]; do
  [ "$1" = -o ] && echo built >> {log} && exec cp {good} "$2"
  shift
done
exit 1
""")
    script.chmod(0o755)
    monkeypatch.setenv("CXX", str(script))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return good.read_bytes(), tmp_path / "cache" / "jcp", lambda: len(log.read_text().split())


def _digest(lib):
    return lib.with_name(lib.name + ".sha256")


ROOT = os.geteuid() == 0  # only root can give a file to another user


def test_kernel_cache_rebuilds_what_it_cannot_verify(copying_cxx):
    good, folder, builds = copying_cxx
    lib = cpu.library_path()
    assert builds() == 1 and lib.read_bytes() == good and cpu.refusal(lib) == ""
    assert lib.parent == folder and (folder.stat().st_mode & 0o777) == 0o700
    assert lib.stat().st_mode & 0o022 == 0 == _digest(lib).stat().st_mode & 0o022
    assert cpu.library_path() == lib and builds() == 1  # verified: loaded as it is
    bad = {
        "truncated": (lambda: lib.write_bytes(good[: len(good) // 2]), "hash"),
        "tampered": (
            lambda: lib.write_bytes(good[:5000] + bytes([good[5000] ^ 1]) + good[5001:]),
            "hash",
        ),
        "loose mode": (lambda: lib.chmod(0o722), "writable by group or others"),
        "hash loose": (lambda: _digest(lib).chmod(0o646), "writable by group or others"),
        "hash missing": (lambda: _digest(lib).unlink(), "missing"),
    }
    if ROOT:
        bad["foreign owner"] = (lambda: os.chown(lib, 4242, 4242), "owned by uid 4242")
    for n, (name, (corrupt, why)) in enumerate(bad.items(), start=2):
        corrupt()
        assert why in cpu.refusal(lib), name
        assert cpu.library_path() == lib and builds() == n, name
        assert lib.read_bytes() == good and cpu.refusal(lib) == "", name
    # A folder anyone else may write: its files could be swapped between check and load.
    folder.chmod(0o775)
    with pytest.raises(cpu.Unavailable, match="writable by group or others"):
        cpu.library_path()
    folder.chmod(0o700)
    if ROOT:
        os.chown(folder, 4242, 4242)
        with pytest.raises(cpu.Unavailable, match="owned by uid 4242"):
            cpu.library_path()
    assert builds() == 1 + len(bad)


def test_builds_started_together_build_once(copying_cxx, tmp_path, monkeypatch):
    """Two builds of the same library at once (test workers or a job's ranks starting
    together) build it once: the second waits on the lock beside the library and loads
    the first one's. The compiler here takes a second, so the two overlap."""
    import threading

    good, folder, builds = copying_cxx
    slow = tmp_path / "slow-cxx"
    slow.write_text(f'#!/bin/sh\n[ "$1" = --version ] || sleep 1\nexec {os.environ["CXX"]} "$@"\n')
    slow.chmod(0o755)
    monkeypatch.setenv("CXX", str(slow))
    got = []
    threads = [threading.Thread(target=lambda: got.append(cpu.library_path())) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 2 and got[0] == got[1] and got[0].read_bytes() == good
    assert builds() == 1


@pytest.mark.parametrize("bad, chosen", [("truncated file", "cpu"), ("loose folder", "blockwise")])
def test_bad_kernel_cache_never_kills_the_process(copying_cxx, bad, chosen):
    """A fresh process resolving attn_impl "auto" (what every CPU Trainer does) over a
    truncated cached object (loading it was SIGBUS) rebuilds it and uses it; over a cache
    folder others may write it refuses and falls back to blockwise with a warning."""
    good, folder, builds = copying_cxx
    lib = cpu.library_path()
    if bad == "truncated file":
        lib.write_bytes(good[: len(good) // 2])
    else:
        folder.chmod(0o777)
    p = subprocess.run(
        [
            sys.executable,
            "-c",
            "from jcp import attention; print(attention."
            f"resolve_implementation('auto', 'cpu', {H}, 'float32'))",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, (p.returncode, p.stderr[-2000:])
    assert p.stdout.split() == [chosen]
    if chosen == "blockwise":
        assert "RuntimeWarning" in p.stderr and "writable by group or others" in p.stderr
    else:
        assert lib.read_bytes() == good and builds() == 2
