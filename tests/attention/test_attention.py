"""Context-parallel attention (jcp.attention) on random q, k, v in the packed zigzag layout.

Evidence:
1. the blockwise kernel (custom VJP, skipped blocks) equals the dense reference and an
   independent NumPy attention, values and gradients, under cp and tp;
2. padding-only ranks and one-token datums: finite outputs, zeros at padding, exactly zero
   gradient at padding rows, padding contents never reach a real token;
3. block skipping: the skip predicate never drops a block that holds a visible pair, and
   with the zigzag layout every cp rank computes the same number of blocks;
4. ring memory: the compiled ring's temporaries per rank stay under a bound ∝ S at every
   cp, with K/V as wide as q.

Legend: CP, TP mesh axis sizes; S rows of one rank's stream; H query heads; K kv heads;
E head dim.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import kernel_checks as KC
from jax.sharding import PartitionSpec as P

import jcp
from jcp import attention
from jcp import batch as batch_lib
from jcp import mesh as mesh_lib

H, K, E = 4, 2, 8
BLOCK = 16
VOCAB = 16


def layout(lengths, cp, s_len=None):
    """Packed (segment, position) [CP, S] of datums of `lengths` on one dp row."""
    data = [
        jcp.Datum(
            np.zeros(n, np.int32), {"target_tokens": np.zeros(n, np.int32), "weights": np.ones(n)}
        )
        for n in lengths
    ]
    checked = batch_lib.validate(data, "cross_entropy", VOCAB, 1 << 30)
    (pb,) = batch_lib.pack(checked, [0] * len(lengths), 1, cp, 1 << 30, 1)
    seg, pos = pb.segment[0], pb.position[0]
    if s_len is not None:
        extra = s_len - seg.shape[1]
        assert extra >= 0
        seg = np.pad(seg, ((0, 0), (0, extra)), constant_values=-1)
        pos = np.pad(pos, ((0, 0), (0, extra)))
    return seg, pos


def random_qkv(cp, s_len, seed, head_dim=E):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((cp, s_len, H, head_dim)).astype(np.float32)
    k = rng.standard_normal((cp, s_len, K, head_dim)).astype(np.float32)
    v = rng.standard_normal((cp, s_len, K, head_dim)).astype(np.float32)
    cot = rng.standard_normal((cp, s_len, H, head_dim)).astype(np.float32)
    return q, k, v, cot


def numpy_attention(q, k, v, seg, pos):
    """Independent reference over the flattened [CP·S] rows, fp64. Padding queries → 0."""
    q, k, v = (np.asarray(x, np.float64).reshape((-1,) + x.shape[2:]) for x in (q, k, v))
    seg, pos = seg.reshape(-1), pos.reshape(-1)
    g = H // K
    out = np.zeros_like(q)
    for i in range(q.shape[0]):
        if seg[i] < 0:
            continue
        keys = np.flatnonzero((seg == seg[i]) & (pos <= pos[i]))
        for h in range(H):
            s = k[keys, h // g] @ q[i, h] / np.sqrt(E)
            p = np.exp(s - s.max())
            out[i, h] = (p / p.sum()) @ v[keys, h // g]
    return out.reshape(seg.shape[0], H, E)


@functools.cache
def attention_fn(mesh_shape, impl):
    """jit of (q, k, v, seg, pos, cot) -> (out, Σ out·cot, d/d(q, k, v)) at mesh_shape."""
    specs_heads = P(mesh_lib.CP, None, mesh_lib.TP, None)
    specs_rows = P(mesh_lib.CP, None)

    def inner(q, k, v, seg, pos):
        if impl == "ring":
            out = attention.ring_attention(q[0], k[0], v[0], seg[0], pos[0], block=BLOCK)
        else:
            out = attention.cp_attention(
                q[0], k[0], v[0], seg[0], pos[0], implementation=impl, block=BLOCK
            )
        return out[None]

    f = jax.shard_map(
        inner,
        mesh=jcp.make_mesh(*mesh_shape),
        in_specs=(specs_heads,) * 3 + (specs_rows,) * 2,
        out_specs=specs_heads,
    )

    def loss(q, k, v, seg, pos, cot):
        out = f(q, k, v, seg, pos)
        return jnp.sum(out * cot), out

    def run(q, k, v, seg, pos, cot):
        (val, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(
            q, k, v, seg, pos, cot
        )
        return out, val, grads

    return jax.jit(run)


def run(mesh_shape, impl, q, k, v, seg, pos, cot):
    out, val, grads = attention_fn(mesh_shape, impl)(q, k, v, seg, pos, cot)
    return np.asarray(out), float(val), tuple(np.asarray(x) for x in grads)


ATTN_MESHES = ((1, 1, 1), (1, 4, 1), (1, 2, 2))


# ----------------------------------------------------------------------------------------
# 1. Blockwise vs dense vs NumPy


@pytest.mark.parametrize("mesh_shape", ATTN_MESHES, ids=lambda m: "dp{}cp{}tp{}".format(*m))
def test_blockwise_matches_dense_and_numpy(mesh_shape):
    cp = mesh_shape[1]
    seg, pos = layout((70, 1, 33, 9, 1, 40), cp, s_len=192 // cp)
    q, k, v, cot = random_qkv(cp, seg.shape[1], seed=cp)
    # The two implementations really differ here: several q and k blocks, some skipped.
    s_len = seg.shape[1]
    bq, bk = attention.tile(s_len, BLOCK), attention.tile(cp * s_len, BLOCK)
    assert s_len // bq > 1 and cp * s_len // bk > 1
    need = attention.blocks_needed(
        attention.block_summary(seg[0], pos[0], bq, xp=np),
        attention.block_summary(seg.reshape(-1), pos.reshape(-1), bk, xp=np),
        xp=np,
    )
    assert 0 < need.sum() < need.size
    # …and the kinds of block occur: skipped, masked, and (where a key block of the gathered
    # stream lies within one datum, at cp = 1) fully visible, computed without the mask.
    kinds, _ = attention.tiling.block_kinds(
        seg[0], pos[0], seg.reshape(-1), pos.reshape(-1), bq, bk
    )
    kinds = set(np.unique(np.asarray(kinds)).tolist())
    assert {0, 1} <= kinds and (cp > 1 or 2 in kinds), kinds

    out_b, val_b, g_b = run(mesh_shape, "blockwise", q, k, v, seg, pos, cot)
    out_d, val_d, g_d = run(mesh_shape, "dense", q, k, v, seg, pos, cot)
    ref = numpy_attention(q, k, v, seg, pos).reshape(out_b.shape)
    np.testing.assert_allclose(out_b, ref, rtol=0, atol=1e-5)
    np.testing.assert_allclose(out_d, ref, rtol=0, atol=1e-5)
    np.testing.assert_allclose(val_b, val_d, rtol=1e-5)
    for name, a, b in zip("qkv", g_b, g_d):
        assert np.abs(b).max() > 0.1, name
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * np.abs(b).max(), err_msg=f"d{name}")


def test_gradients_match_finite_differences():
    """The blockwise kernel's hand-written VJP agrees with central finite differences."""
    mesh_shape = (1, 2, 1)
    seg, pos = layout((12, 5), 2, s_len=16)
    q, k, v, cot = random_qkv(2, 16, seed=5)
    _, _, (dq, dk, dv) = run(mesh_shape, "blockwise", q, k, v, seg, pos, cot)
    rng = np.random.default_rng(0)
    f = lambda q_, k_, v_: run(mesh_shape, "blockwise", q_, k_, v_, seg, pos, cot)[1]
    eps = 1e-2
    for which, g in ((0, dq), (1, dk), (2, dv)):
        for _ in range(3):
            args = [q.copy(), k.copy(), v.copy()]
            idx = tuple(rng.integers(0, n) for n in args[which].shape)
            idx = (idx[0], int(np.flatnonzero(seg[idx[0]] >= 0)[0])) + idx[2:]
            args[which][idx] += eps
            hi = f(*args)
            args[which][idx] -= 2 * eps
            lo = f(*args)
            np.testing.assert_allclose(g[idx], (hi - lo) / (2 * eps), rtol=2e-2, atol=2e-3)


def test_training_compiler_options_change_no_number():
    """train_step.compiler_options (XLA:CPU prefers 512-bit vectors on AVX-512 hosts, for the
    attention kernel's tile passes) leaves the blockwise kernel's values and gradients
    bit-identical to the default compile."""
    from jcp import train_step
    from jcp.attention import blockwise

    opts = train_step.compiler_options(jcp.make_mesh(1, 1, 1))
    if not opts:
        pytest.skip("no AVX-512 on this host: the training programs compile with defaults")
    n, rng = 256, np.random.default_rng(3)
    q = jnp.asarray(rng.standard_normal((n, K, H // K, E), np.float32))
    k, v = (jnp.asarray(rng.standard_normal((n, K, E), np.float32)) for _ in range(2))
    w = jnp.asarray(rng.standard_normal(q.shape, np.float32))
    seg, pos = jnp.zeros(n, jnp.int32), jnp.arange(n, dtype=jnp.int32)
    f = jax.value_and_grad(
        lambda q, k, v: (blockwise.flash(q, k, v, seg, pos, seg, pos, 64, 64) * w).sum(),
        argnums=(0, 1, 2),
    )
    plain = jax.jit(f).lower(q, k, v).compile()
    tuned = jax.jit(f, compiler_options=opts).lower(q, k, v).compile()  # unknown: raises
    (val_a, grads_a), (val_b, grads_b) = plain(q, k, v), tuned(q, k, v)
    assert np.abs(np.asarray(grads_a[0])).max() > 0.1
    np.testing.assert_array_equal(val_b, val_a)
    for a, b in zip(grads_a, grads_b):
        np.testing.assert_array_equal(b, a)


# ----------------------------------------------------------------------------------------
# 2. Padding-only ranks and one-token datums


@pytest.mark.parametrize("impl", attention.IMPLEMENTATIONS)
def test_padding_only_rank_and_one_token_datums(impl):
    mesh_shape = (1, 4, 1)
    seg, pos = layout((1, 3, 1), 4, s_len=48)
    real = seg >= 0
    # Rank 3 holds only padding; ranks 1, 2 hold one token each.
    assert real.sum(-1).tolist() == [3, 1, 1, 0]
    # The C++ kernels ("cpu") are built for head dims of 16 and more.
    q, k, v, cot = random_qkv(4, 48, seed=9, head_dim=16 if impl == "cpu" else E)
    out, _, grads = run(mesh_shape, impl, q, k, v, seg, pos, cot)
    assert np.all(np.isfinite(out)) and all(np.all(np.isfinite(g)) for g in grads)
    assert np.all(out[~real] == 0.0)
    for name, g in zip("qkv", grads):
        assert np.all(g[~real] == 0.0), f"d{name} at padding rows"
        assert np.abs(g[real]).max() > 0, f"d{name} at real rows"
    # A one-token datum attends only to itself: its output is its own value row.
    for slot in np.unique(seg[real]):
        rows = np.argwhere(seg == slot)
        if len(rows) == 1:
            ((r, s),) = rows
            g_ = H // K
            want = np.repeat(v[r, s], g_, axis=0)
            np.testing.assert_allclose(out[r, s], want, rtol=0, atol=1e-6)
    # The padding rows' contents never reach a real token.
    big = [x.copy() for x in (q, k, v)]
    for x in big:
        x[~real] = 1e3 * np.sign(x[~real])
    out_big, _, grads_big = run(mesh_shape, impl, *big, seg, pos, cot)
    np.testing.assert_array_equal(out_big[real], out[real])
    for g, gb in zip(grads, grads_big):
        np.testing.assert_array_equal(gb, g)


def test_unknown_implementation_is_refused():
    x = jnp.zeros((16, H, E))
    with pytest.raises(ValueError, match="implementation"):
        attention.cp_attention(
            x,
            x[:, :K],
            x[:, :K],
            jnp.zeros(16, jnp.int32),
            jnp.zeros(16, jnp.int32),
            implementation="flash3",
        )


# ----------------------------------------------------------------------------------------
# 3. Block skipping and balance


def _dense_visible(seg_q, pos_q, seg_k, pos_k):
    return (
        (seg_q[:, None] == seg_k[None, :])
        & (seg_q[:, None] >= 0)
        & (pos_k[None, :] <= pos_q[:, None])
    )


@pytest.mark.parametrize("cp", (1, 2, 4))
def test_skip_predicate_keeps_every_visible_block(cp):
    seg, pos = layout((100, 1, 37, 64, 5, 2), cp)
    s_len = seg.shape[1]
    bq, bk = attention.tile(s_len, BLOCK), attention.tile(cp * s_len, BLOCK)
    seg_t, pos_t = seg.reshape(-1), pos.reshape(-1)
    k_sum = attention.block_summary(seg_t, pos_t, bk, xp=np)
    skipped = 0
    for r in range(cp):
        need = attention.blocks_needed(
            attention.block_summary(seg[r], pos[r], bq, xp=np), k_sum, xp=np
        )
        vis = _dense_visible(seg[r], pos[r], seg_t, pos_t)
        vis_blocks = vis.reshape(s_len // bq, bq, -1, bk).any(axis=(1, 3))
        assert not np.any(vis_blocks & ~need), f"rank {r} skips a visible block"
        skipped += int((~need).sum())
    assert skipped > 0  # and skipping does happen


def test_block_work_zigzag_balanced_contiguous_not():
    cp, n, block = 4, 8192, 128
    seg_z, pos_z = layout((n,), cp)
    s_len = seg_z.shape[1]
    assert s_len * cp == n
    seg_c = np.zeros((cp, s_len), np.int32)
    pos_c = np.arange(n, dtype=np.int32).reshape(cp, s_len)
    # The two layouts really differ.
    assert not np.array_equal(pos_z, pos_c)
    work_z = attention.block_work(seg_z, pos_z, block)
    work_c = attention.block_work(seg_c, pos_c, block)
    assert work_z.sum() > 0 and work_c.min() > 0
    assert work_z.max() / work_z.min() <= 1.05, work_z
    assert work_c.max() / work_c.min() > 3.0, work_c
    # Causal skipping roughly halves the work of the full [S, T] grid.
    full = (s_len // block) * (cp * s_len // block)
    assert work_z.max() < 0.6 * full


# ----------------------------------------------------------------------------------------
# 4. Ring attention over cp


def _collectives(mesh_shape, impl, *args) -> set[str]:
    text = str(jax.make_jaxpr(attention_fn(mesh_shape, impl))(*args))
    return {c for c in ("ppermute", "all_gather") if c in text}


RING_CASES = (
    (2, (70, 1, 33, 9, 1, 40)),
    (4, (70, 1, 33, 9, 1, 40)),
    (8, (70, 1, 33, 9, 1, 40)),
    (4, (1, 3, 1)),
    (8, (1, 5, 1, 2)),
)


@pytest.mark.parametrize(
    "cp,lengths", RING_CASES, ids=lambda x: f"cp{x}" if isinstance(x, int) else f"n{sum(x)}"
)
def test_ring_matches_gather_and_dense(cp, lengths):
    """Ring = all-gather (blockwise) = dense = NumPy, values and d(q, k, v); padding-only
    ranks and one-token datums give exact zeros at padding, never NaN."""
    mesh_shape = (1, cp, 1)
    seg, pos = layout(lengths, cp, s_len=max(192 // cp, 32))
    real = seg >= 0
    if sum(lengths) < 2 * cp:
        assert not real[-1].any(), "this case needs a rank holding only padding"
    q, k, v, cot = random_qkv(cp, seg.shape[1], seed=cp + len(lengths))
    args = (q, k, v, seg, pos, cot)
    # The paths really differ: the ring passes K/V around, the other path gathers them.
    assert _collectives(mesh_shape, "ring", *args) == {"ppermute"}
    assert "all_gather" in _collectives(mesh_shape, "blockwise", *args)

    out_r, val_r, g_r = run(mesh_shape, "ring", *args)
    out_b, val_b, g_b = run(mesh_shape, "blockwise", *args)
    out_d, val_d, g_d = run(mesh_shape, "dense", *args)
    ref = numpy_attention(q, k, v, seg, pos).reshape(out_r.shape)
    np.testing.assert_allclose(out_r, ref, rtol=0, atol=1e-5)
    np.testing.assert_allclose(out_r, out_b, rtol=0, atol=1e-5)
    np.testing.assert_allclose(val_r, val_d, rtol=1e-5)
    for name, a, b, d in zip("qkv", g_r, g_b, g_d):
        assert np.abs(d).max() > 0.1, name
        np.testing.assert_allclose(a, d, rtol=0, atol=1e-5 * np.abs(d).max(), err_msg=f"d{name}")
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * np.abs(d).max(), err_msg=f"d{name}")
    assert np.all(np.isfinite(out_r)) and all(np.all(np.isfinite(g)) for g in g_r)
    assert np.all(out_r[~real] == 0.0)
    for name, g in zip("qkv", g_r):
        assert np.all(g[~real] == 0.0), f"d{name} at padding rows"
    for slot in np.unique(seg[real]):  # a one-token datum's output is its own value row
        rows = np.argwhere(seg == slot)
        if len(rows) == 1:
            ((r, s),) = rows
            np.testing.assert_allclose(
                out_r[r, s], np.repeat(v[r, s], H // K, axis=0), rtol=0, atol=1e-6
            )


def test_ring_under_tp():
    mesh_shape = (1, 2, 2)
    seg, pos = layout((40, 1, 23), 2, s_len=48)
    args = (*random_qkv(2, 48, seed=3)[:3], seg, pos, random_qkv(2, 48, seed=3)[3])
    out_r, _, g_r = run(mesh_shape, "ring", *args)
    out_d, _, g_d = run(mesh_shape, "dense", *args)
    np.testing.assert_allclose(out_r, out_d, rtol=0, atol=1e-5)
    for a, d in zip(g_r, g_d):
        np.testing.assert_allclose(a, d, rtol=0, atol=1e-5 * np.abs(d).max())


@pytest.mark.parametrize("cp", (2, 4, 8))
def test_ring_steps_balanced_and_skipping(cp):
    """Zigzag: at every ring step every rank computes the same number of blocks (no rank
    waits at a hop), and the skip predicate drops about half the [S, CP·S] grid."""
    n, block = 4096, 64
    seg, pos = layout((n,), cp)
    work = attention.ring_block_work(seg, pos, block)  # [step, rank]
    s_len = seg.shape[1]
    nb = s_len // attention.tile(s_len, block)
    assert work.shape == (cp, cp) and work.min() > 0
    assert np.all(work.max(1) <= 1.05 * work.min(1)), work
    assert work.sum() < 0.6 * cp * cp * nb * nb
    # A contiguous split of the same datum is not balanced per step.
    seg_c = np.zeros((cp, s_len), np.int32)
    pos_c = np.arange(n, dtype=np.int32).reshape(cp, s_len)
    work_c = attention.ring_block_work(seg_c, pos_c, block)
    assert work_c.max() > 1.5 * max(work_c.min(), 1)


@pytest.mark.parametrize("cp", (4, 8))
def test_ring_memory_per_rank_with_wide_kv(cp):
    """The ring's memory per rank is ∝ S = tokens / cp whatever the K/V width: with 8 kv
    heads (as many as q heads) its compiled forward + backward holds < 20 u of
    temporaries (u = S·K·H·4 bytes, one rank's K in fp32) at every cp.

    The bound counts one ring step at the backward's peak: q and d_out in rows, dq and its
    transposed accumulator (4 u; M = 1), the held K/V and the pair in flight (4 u), their
    fp32 gradients held and in flight (4 u), the kernel's block-layout copies of the held
    K, V, Kᵀ, dK, dV (5 u): 17 u, and 3 u for the forward's saved output and the small
    arrays (lse, masks, block tables). Unrolled ring steps, each holding its own copies of
    its block (issue 37), held 22.7 u at cp = 4 and 39 u at cp = 8; the loop holds 17.5 u
    at both (benchmarks/RESULTS.md, "Ring memory")."""
    assert KC.ring_temp_units("blockwise", cp) < 20


def test_auto_choice_by_gathered_bytes():
    small = attention.choose_cp_attention("auto", 4, 1024, 2, 64, 4)
    big = attention.choose_cp_attention("auto", 4, 1 << 16, 2, 64, 4)
    assert (small, big) == ("gather", "ring")
    assert attention.choose_cp_attention("auto", 1, 1 << 20, 8, 128, 4) == "gather"
    assert attention.choose_cp_attention("ring", 2, 16, 1, 8, 4) == "ring"
    with pytest.raises(ValueError, match="cp_attention"):
        attention.choose_cp_attention("allgather", 2, 16, 1, 8, 4)
