"""Checks every fused attention kernel (Pallas, C++) must pass, written once: its cp paths
inside shard_map against the dense reference, and a whole Trainer step against blockwise."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import jcp
from helpers import trainer_harness as TH
from jcp import attention
from jcp import mesh as mesh_lib

ROWS, HEADS = P(mesh_lib.CP, None), P(mesh_lib.CP, None, None, None)


def sharded(impl, path, block):
    """jit of (q, k, v, seg, pos, cot) [CP, S, …] -> (out, d/d(q, k, v)) at mesh (1, 2, 1),
    through cp_attention (path "gather") or ring_attention ("ring") with `impl`."""

    def inner(q, k, v, seg, pos):
        if path == "ring":
            out = attention.ring_attention(
                q[0], k[0], v[0], seg[0], pos[0], block=block, implementation=impl
            )
        else:
            out = attention.cp_attention(
                q[0], k[0], v[0], seg[0], pos[0], implementation=impl, block=block
            )
        return out[None]

    f = jax.shard_map(
        inner, mesh=jcp.make_mesh(1, 2, 1), in_specs=(HEADS,) * 3 + (ROWS,) * 2, out_specs=HEADS
    )

    def run(q, k, v, seg, pos, cot):
        out, vjp = jax.vjp(lambda q, k, v: f(q, k, v, seg, pos), q, k, v)
        return out, vjp(cot)

    return jax.jit(run)


def assert_paths_match_dense(run, impl, args, seg):
    """run(impl, path)(*args) -> (out, (dq, dk, dv)) on both cp paths equals dense's, and
    padding rows (seg < 0) get exact zeros in the output and every gradient."""
    out_d, g_d = run("dense", "gather")(*args)
    real = seg >= 0
    for path in ("gather", "ring"):
        out, grads = run(impl, path)(*args)
        np.testing.assert_allclose(
            out, out_d, rtol=0, atol=1e-5 * np.abs(out_d).max(), err_msg=path
        )
        assert np.all(np.asarray(out)[~real] == 0.0), path
        for which, a, d in zip("qkv", grads, g_d):
            np.testing.assert_allclose(
                a, d, rtol=0, atol=1e-5 * np.abs(d).max(), err_msg=f"{path} d{which}"
            )
            assert np.all(np.asarray(a)[~real] == 0.0), f"{path} d{which} at padding"


def assert_padding_exact(run, impl, args, real):
    """run(impl, *args) -> (out, (dq, dk, dv)), args (q, k, v, …): finite, exact zeros at
    padding rows (real False) in the output and every gradient, non-zero gradients at real
    rows, the output equal to dense's, and the padding rows' contents never reaching a real
    row (q, k, v made huge there change no real row's output or gradient by a bit).
    Returns (out, grads) for the caller's own checks."""
    out, grads = run(impl, *args)
    assert np.all(np.isfinite(out)) and all(np.all(np.isfinite(g)) for g in grads)
    assert np.all(out[~real] == 0.0)
    for which, g in zip("qkv", grads):
        assert np.all(g[~real] == 0.0), f"d{which} at padding rows"
        assert np.abs(g[real]).max() > 0, f"d{which} at real rows"
    out_d, _ = run("dense", *args)
    np.testing.assert_allclose(out, out_d, rtol=0, atol=1e-5 * np.abs(out_d).max())
    big = [np.array(x, copy=True) for x in args[:3]]
    for x in big:
        x[~real] = 1e3 * np.sign(x[~real])
    out_big, grads_big = run(impl, *big, *args[3:])
    np.testing.assert_array_equal(out_big[real], out[real])
    for g, gb in zip(grads, grads_big):
        np.testing.assert_array_equal(gb[real], g[real])
    return out, grads


def assert_trainer_matches_blockwise(tmp_path, monkeypatch, module, impl, **trainer_kw):
    """A Trainer.forward_backward at cp = 2 with attn_impl `impl` (whose kernels are
    module.kernel_forward / module.kernel_backward) gives blockwise's log-probs and LoRA gradients;
    first asserts that only the `impl` step traced those kernels."""
    w = TH.random_peft_weights(TH.CFG, 4, TH.ALL, seed=1)
    folder = TH.write_peft(tmp_path / "a", 4, 8.0, TH.ALL, w)
    data = TH.random_data((37, 1, 20), seed=2)
    traced = {"forward": 0, "backward": 0}  # kernel calls traced by each step
    for name in traced:
        f = getattr(module, "kernel_" + name)
        monkeypatch.setattr(
            module,
            "kernel_" + name,
            lambda *a, f=f, name=name: (traced.update({name: traced[name] + 1}), f(*a))[1],
        )
    res, kernels = {}, {}
    for which in (impl, "blockwise"):
        tr = jcp.Trainer(
            TH.CFG,
            jcp.make_mesh(1, 2, 1),
            max_adapters=1,
            max_rank=4,
            logprob_chunk=64,
            attn_impl=which,
            **trainer_kw,
        )
        assert tr.step_cfg.attn_impl == which
        a = tr.load_peft(folder)
        before = dict(traced)
        out = tr.forward_backward(data, "cross_entropy", adapters=a)
        kernels[which] = {k: traced[k] - before[k] for k in traced}
        res[which] = (out, tr.gradients(a))
    # The two steps really differ: only the `impl` one traced the kernels.
    assert min(kernels[impl].values()) > 0 and max(kernels["blockwise"].values()) == 0
    TH.assert_outputs_close(res[impl][0], res["blockwise"][0], 1e-5, 1e-5, impl)
    TH.assert_grads_close(res[impl][1], res["blockwise"][1], 1e-4, 1e-5, impl)


def assert_kernel_matches_references(got, dense, blockwise):
    """A kernel's (out, (dq, dk, dv)) equals dense's and blockwise's to 1e-5 of each
    reference's largest entry; every reference gradient is non-trivial (> 0.1 somewhere)."""
    (out, grads), (out_d, g_d), (out_b, g_b) = got, dense, blockwise
    scale = np.abs(out_d).max()
    np.testing.assert_allclose(out, out_d, rtol=0, atol=1e-5 * scale)
    np.testing.assert_allclose(out, out_b, rtol=0, atol=1e-5 * scale)
    for which, a, d, b in zip("qkv", grads, g_d, g_b):
        assert np.abs(d).max() > 0.1, which
        tol = 1e-5 * np.abs(d).max()
        np.testing.assert_allclose(a, d, rtol=0, atol=tol, err_msg=f"d{which} vs dense")
        np.testing.assert_allclose(a, b, rtol=0, atol=tol, err_msg=f"d{which} vs blockwise")


# Head size of the kernels' random cases.
H = 16


def zigzag_layout(lengths, cp, s_len):
    """(segment, position) [CP, S]: datum d (segment d) split over the cp ranks by
    mesh.zigzag_indices, the datums packed one after another on every rank, then padding
    (segment −1, also inside a datum's last chunks)."""
    seg = np.full((cp, s_len), -1, np.int32)
    pos = np.zeros((cp, s_len), np.int32)
    fill = 0
    for d, n in enumerate(lengths):
        idx = mesh_lib.zigzag_indices(n, cp)  # [CP, 2C]
        w = idx.shape[1]
        seg[:, fill : fill + w] = np.where(idx >= 0, d, -1)
        pos[:, fill : fill + w] = np.maximum(idx, 0)
        fill += w
    assert fill <= s_len, (fill, s_len)
    return seg, pos


def random_qkv(s_len, t_len, q_heads, kv_heads, seed, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return (
        rng.standard_normal((s_len, q_heads, H)).astype(dtype),
        rng.standard_normal((t_len, kv_heads, H)).astype(dtype),
        rng.standard_normal((t_len, kv_heads, H)).astype(dtype),
        rng.standard_normal((s_len, q_heads, H)).astype(np.float32),
    )


def ring_temp_units(implementation, cp, s_len=256, heads=8, head_dim=16, block=64):
    """XLA's temporaries per device of the ring's forward + backward (compiled, not run)
    at mesh (1, cp, 1), S = s_len rows per rank, `heads` query heads and as many kv heads
    (MHA: K/V as wide as q), in units u = S·K·H·4 bytes: one rank's K in fp32."""
    mesh = jcp.make_mesh(1, cp, 1)
    rows = P(mesh_lib.CP)

    def inner(q, k, v, seg, pos, cot):
        out = attention.ring_attention(
            q[0], k[0], v[0], seg[0], pos[0], block=block, implementation=implementation
        )
        return jax.lax.psum(jnp.sum(out * cot[0]), mesh_lib.CP)

    f = jax.shard_map(inner, mesh=mesh, in_specs=(rows,) * 6, out_specs=P())
    sds = lambda shape, dtype=jnp.float32: jax.ShapeDtypeStruct(  # noqa: E731
        shape, dtype, sharding=jax.sharding.NamedSharding(mesh, rows)
    )
    heads_x = sds((cp, s_len, heads, head_dim))
    args = (
        heads_x,
        heads_x,
        heads_x,
        sds((cp, s_len), jnp.int32),
        sds((cp, s_len), jnp.int32),
        heads_x,
    )
    compiled = jax.jit(jax.grad(f, argnums=(0, 1, 2))).lower(*args).compile()
    return compiled.memory_analysis().temp_size_in_bytes / (s_len * heads * head_dim * 4)
