"""The "pallas" attention implementation (jcp.attention.pallas) in Pallas interpret mode.

Evidence:
1. the fused kernels (forward, dQ, dK/dV) equal the dense reference and the blockwise
   kernel, values and d(q, k, v), on packed ragged datums in the zigzag layout
   (non-monotone positions), GQA with M = 1, 2, 4, queries of one rank against every
   rank's keys, and with blocks skipped, masked and fully visible all present;
2. padding rows and padding-only blocks give exact zeros (values and gradients), never
   NaN; a one-token datum's output is its own value row; padding contents never reach a
   real token;
3. through attention.cp_attention (all-gather) and attention.ring_attention inside a
   shard_map at cp = 2, and through the Trainer (StepConfig, the layer scan with remat);
4. every kernel lowers to Triton IR (lowered for "cuda" on this CPU host: flash, ring,
   the model's layer scan); what the Triton path refuses; the plan.

Legend: CP mesh axis size; S rows of one rank's stream; Q query heads; K kv heads; H head
dim.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import kernel_checks as KC
from jax.sharding import PartitionSpec as P

import jcp
from jcp import attention, model
from jcp import mesh as mesh_lib
from jcp.attention import pallas as pa

H = KC.H
BLOCK = 16
random_qkv, zigzag_layout = KC.random_qkv, KC.zigzag_layout


# Small tiles, so every stream spans several blocks: all sides BLOCK, or of unequal sides
# (every kernel's plan is then a different table, and dK/dV's query tiles differ from dQ's).
EVEN = pa.Tiles(*(BLOCK,) * 6)
UNEVEN = pa.Tiles(
    fwd_q=2 * BLOCK, fwd_k=BLOCK, dq_q=BLOCK, dq_k=2 * BLOCK, dkv_q=BLOCK, dkv_k=2 * BLOCK
)


def _pallas(q, k, v, seg_q, pos_q, seg_k, pos_k, tiles=EVEN):
    return pa.flash_attention(q, k, v, seg_q, pos_q, seg_k, pos_k, 2 * BLOCK, tiles)


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
        attention.tile(s_len, BLOCK),
        attention.tile(t_len, BLOCK),
    )
    return out.reshape(q.shape)


IMPLS = {"pallas": _pallas, "dense": _dense, "blockwise": _blockwise}


@functools.cache
def value_and_grads(impl, tiles=None):
    """jit of (q, k, v, seg_q, pos_q, seg_k, pos_k, cot) -> (out, d/d(q, k, v) of Σ out·cot)."""
    f = IMPLS[impl] if tiles is None else functools.partial(IMPLS[impl], tiles=tiles)

    def run(q, k, v, seg_q, pos_q, seg_k, pos_k, cot):
        out, vjp = jax.vjp(lambda q, k, v: f(q, k, v, seg_q, pos_q, seg_k, pos_k), q, k, v)
        return out, vjp(cot.astype(out.dtype))

    return jax.jit(run)


def run(impl, *args, tiles=None):
    out, grads = value_and_grads(impl, tiles)(*args)
    return np.asarray(out, np.float32), tuple(np.asarray(g, np.float32) for g in grads)


def _has_pallas_call(fn, *args) -> bool:
    return "pallas_call" in str(jax.make_jaxpr(fn)(*args))


# ----------------------------------------------------------------------------------------
# 1. Pallas vs dense vs blockwise


# (lengths, cp of the zigzag layout, S per rank, Q, K, queries, tiles): "all" = every
# rank's rows as queries (S = T), "rank0" = rank 0's rows against every rank's keys (as
# cp_attention sees them).
CASES = {
    "gqa2-zigzag": ((100, 1, 23, 9, 1, 30), 2, 96, 4, 2, "all", EVEN),
    "gqa4-rank0": ((150, 1, 33, 9), 4, 64, 4, 1, "rank0", EVEN),
    "mha-uneven-tiles": ((100,), 2, 64, 2, 2, "all", UNEVEN),
}


def case_args(name, seed=0, dtype=np.float32):
    lengths, cp, s_len, q_heads, kv_heads, queries, _ = CASES[name]
    seg, pos = zigzag_layout(lengths, cp, s_len)
    seg_k, pos_k = seg.reshape(-1), pos.reshape(-1)
    seg_q, pos_q = (seg[0], pos[0]) if queries == "rank0" else (seg_k, pos_k)
    q, k, v, cot = random_qkv(seg_q.shape[0], seg_k.shape[0], q_heads, kv_heads, seed, dtype)
    return q, k, v, seg_q, pos_q, seg_k, pos_k, cot


@pytest.mark.parametrize("name", CASES)
def test_pallas_matches_dense_and_blockwise(name):
    args = case_args(name, seed=len(name))
    q, k, v, seg_q, pos_q, seg_k, pos_k, cot = args
    tiles = CASES[name][-1]
    # The implementations really differ: only the pallas one runs a pallas_call.
    assert _has_pallas_call(value_and_grads("pallas", tiles), *args)
    assert not _has_pallas_call(value_and_grads("dense"), *args)
    assert not _has_pallas_call(value_and_grads("blockwise"), *args)
    # Positions are not monotone in the stream (zigzag), and every kind of block occurs in
    # every kernel's tiling: skipped, masked and fully visible.
    assert np.any(np.diff(pos_k[seg_k == 0]) < 0)
    for side in ("fwd", "dq", "dkv"):
        bq = pa.tile_rows(seg_q.shape[0], getattr(tiles, side + "_q"), 2 * BLOCK, True)
        bk = pa.tile_rows(seg_k.shape[0], getattr(tiles, side + "_k"), 2 * BLOCK, True)
        assert seg_q.shape[0] // bq > 1 and seg_k.shape[0] // bk > 1
        kinds, _ = attention.tiling.block_kinds(seg_q, pos_q, seg_k, pos_k, bq, bk)
        assert set(np.unique(np.asarray(kinds)).tolist()) == {0, 1, 2}, side

    KC.assert_kernel_matches_references(
        run("pallas", *args, tiles=tiles), run("dense", *args), run("blockwise", *args)
    )


def test_bfloat16_close_to_fp32_dense():
    """bf16 inputs (the GPU dtype): p and the gradients' operands are cast to bf16 for the
    matmuls, accumulation stays fp32."""
    args32 = case_args("gqa2-zigzag", seed=3)
    args16 = tuple(jnp.asarray(a, jnp.bfloat16) if i < 3 else a for i, a in enumerate(args32))
    out_p, g_p = run("pallas", *args16)
    out_d, g_d = run("dense", *args32)
    assert value_and_grads("pallas")(*args16)[0].dtype == jnp.bfloat16
    np.testing.assert_allclose(out_p, out_d, rtol=0, atol=3e-2 * np.abs(out_d).max())
    for which, a, d in zip("qkv", g_p, g_d):
        np.testing.assert_allclose(a, d, rtol=0, atol=3e-2 * np.abs(d).max(), err_msg=which)


# ----------------------------------------------------------------------------------------
# 2. Padding and one-token datums


def test_padding_exact_zeros_and_one_token_datums():
    # cp = 4, three datums (1, 3, 1 tokens): rank 3 and most of every rank are padding, so
    # whole query and key blocks hold only padding (their plans are empty).
    seg, pos = zigzag_layout((1, 3, 1), 4, 32)
    seg_t, pos_t = seg.reshape(-1), pos.reshape(-1)
    assert not (seg[3] >= 0).any()
    real = seg_t >= 0
    q, k, v, cot = random_qkv(128, 128, 4, 2, seed=9)
    args = (q, k, v, seg_t, pos_t, seg_t, pos_t, cot)
    out, _ = KC.assert_padding_exact(run, "pallas", args, real)
    # A one-token datum attends only to itself: its output is its own value row.
    for slot in (0, 2):
        (r,) = np.flatnonzero(seg_t == slot)
        np.testing.assert_allclose(out[r], np.repeat(v[r], 2, axis=0), rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------------------
# 3. Inside shard_map: cp_attention (all-gather), the ring, and the Trainer

ROWS = KC.ROWS  # the per-cp-rank layout of seg / pos


def sharded(impl, path):
    """KC.sharded at this file's block."""
    return KC.sharded(impl, path, BLOCK)


sharded_fn = functools.lru_cache(maxsize=None)(sharded)


def sharded_args(seed=4):
    seg, pos = zigzag_layout((40, 1, 23, 9, 1), 2, 48)
    rng = np.random.default_rng(seed)
    q, cot = (rng.standard_normal((2, 48, 4, H)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((2, 48, 2, H)).astype(np.float32) for _ in range(2))
    return q, k, v, seg, pos, cot


def test_cp_attention_and_ring_in_shard_map():
    args = sharded_args()
    seg = args[3]
    text = {
        key: str(jax.make_jaxpr(sharded_fn(*key))(*args))
        for key in (("pallas", "gather"), ("pallas", "ring"), ("dense", "gather"))
    }
    # The paths really differ: pallas kernels vs none; all-gather vs ppermute (the ring
    # gathers nothing but, in interpret mode, the kernels' inputs: see
    # attention.pallas._interpret_invariant).
    assert "pallas_call" in text["pallas", "gather"] and "all_gather" in text["pallas", "gather"]
    assert "pallas_call" in text["pallas", "ring"] and "ppermute" in text["pallas", "ring"]
    assert "all_gather" not in text["pallas", "ring"]
    assert "pallas_call" not in text["dense", "gather"]

    KC.assert_paths_match_dense(sharded_fn, "pallas", args, seg)


def test_trainer_pallas_matches_blockwise(tmp_path, monkeypatch):
    """The whole training step — StepConfig accepts "pallas", the layer scan with remat
    (attention output and lse saved by name), the custom VJP — gives blockwise's log-probs
    and LoRA gradients, at cp = 2."""
    KC.assert_trainer_matches_blockwise(
        tmp_path, monkeypatch, pa, "pallas", attn_block=BLOCK, cp_attention="gather"
    )


# ----------------------------------------------------------------------------------------
# 4. The Triton path: lowering, refusals, and the plan
#
# No GPU here, but jax lowers for "cuda" on a CPU host, running the Pallas Triton lowering
# (every kernel to Triton IR: supported primitives, power-of-two tiles and loads). PTX
# compilation and the numbers themselves are left to a GPU run.


def _triton_kernels(fn, *args) -> list[str]:
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    return re.findall(r'name = "(jcp_attention_\w+)"', text)


def test_kernels_lower_to_triton(monkeypatch):
    monkeypatch.setattr(pa, "interpret_mode", lambda: False)
    sd = jax.ShapeDtypeStruct
    # Qwen3-8B's heads (32 / 8 × 128) in bf16 over a stream of 1.5 × 256 rows.
    q, kv = sd((384, 32, 128), jnp.bfloat16), sd((384, 8, 128), jnp.bfloat16)
    rows = sd((384,), jnp.int32)

    def flash(q, k, v, seg, pos):
        out, vjp = jax.vjp(
            lambda q, k, v: pa.flash_attention(q, k, v, seg, pos, seg, pos, 512), q, k, v
        )
        return vjp(out)

    assert sorted(_triton_kernels(flash, q, kv, kv, rows, rows)) == [
        "jcp_attention_dkv",
        "jcp_attention_dq",
        "jcp_attention_fwd",
    ]

    # The ring (cp = 2: two steps each way) and the model's layer scan with remat, inside
    # shard_maps that check varying axes, as the training step runs them.
    ring = sharded("pallas", "ring")  # not sharded_fn's: its jit traced in interpret mode
    assert len(_triton_kernels(ring, *sharded_args())) == 6

    cfg = jcp.QwenConfig.tiny()
    params = jax.tree.map(
        lambda s: sd(s, jnp.float32),
        model.param_shapes(cfg),
        is_leaf=lambda x: isinstance(x, tuple),
    )
    seg, pos = zigzag_layout((37, 1, 20), 2, 32)

    def inner(params, tokens, seg, pos):
        attend = attention.cp_attend(seg[0], pos[0], implementation="pallas", block=BLOCK)
        h = model.hidden_states(
            cfg, params, tokens[0], pos[0], model.Pass(attend, remat=True)
        ).h_SxD
        return jax.lax.psum(jnp.sum(h), mesh_lib.CP)

    f = jax.shard_map(
        inner, mesh=jcp.make_mesh(1, 2, 1), in_specs=(P(),) + (ROWS,) * 3, out_specs=P()
    )
    names = _triton_kernels(jax.grad(f), params, seg, seg, pos)
    assert sorted(set(names)) == ["jcp_attention_dkv", "jcp_attention_dq", "jcp_attention_fwd"]


def test_ring_steps_are_one_loop_on_triton(monkeypatch):
    """The Pallas ring's steps are a loop (tiling.ring_fold): lowered for "cuda" at cp = 4
    it holds the kernels of one loop step and of the peeled last step (forward, dQ, dK/dV:
    6), as at cp = 2 — not one set per step, whose K/V blocks XLA then held all at once
    (issue 37, O(CP·S) per rank). Its memory is not measured on CPU: interpret mode
    gathers every device's inputs (pallas._interpret_invariant); the C++ kernels' ring,
    the same tiling.kernel_ring_fwd/bwd, is (test_cpu_attention)."""
    monkeypatch.setattr(pa, "interpret_mode", lambda: False)
    sd = jax.ShapeDtypeStruct

    def kernels(cp):
        def inner(q, k, v, seg, pos):
            return attention.ring_attention(
                q[0], k[0], v[0], seg[0], pos[0], block=BLOCK, implementation="pallas"
            )[None]

        f = jax.shard_map(
            inner,
            mesh=jcp.make_mesh(1, cp, 1),
            in_specs=(KC.HEADS,) * 3 + (ROWS,) * 2,
            out_specs=KC.HEADS,
        )

        def run(q, k, v, seg, pos):
            out, vjp = jax.vjp(lambda q, k, v: f(q, k, v, seg, pos), q, k, v)
            return vjp(out)

        q, kv, rows = (
            sd((cp, 64, 4, H), jnp.float32),
            sd((cp, 64, 2, H), jnp.float32),
            sd((cp, 64), jnp.int32),
        )
        return sorted(_triton_kernels(run, q, kv, kv, rows, rows))

    two = kernels(2)
    assert len(two) == 6 and kernels(4) == two


def test_plan_lists_masked_then_full_blocks():
    kinds = jnp.array([[2, 0, 1, 1], [0, 0, 0, 0], [1, 2, 2, 0]])
    plan = np.asarray(pa.visit_plan(kinds))
    assert plan[0].tolist()[:5] == [2, 1, 2, 3, 0]
    assert plan[1].tolist()[:2] == [0, 0]
    assert plan[2].tolist()[:5] == [1, 2, 0, 1, 2]


def test_triton_path_refuses_what_it_cannot_lower():
    assert pa.interpret_mode()  # on CPU: interpret mode
    with pytest.raises(ValueError, match="power-of-two divisor"):
        pa.tile_rows(24, 128, 512, interpret=False)  # largest power-of-two tile: 8 < 16
    assert pa.tile_rows(24, 128, 512, interpret=True) == 8
    with pytest.raises(ValueError, match="head dim"):
        pa.check_head_dim(96, interpret=False)
    pa.check_head_dim(128, interpret=False)
    x = jnp.zeros((16, 4, H))
    with pytest.raises(ValueError, match="ring attention implementation"):
        attention.ring_attention(
            x,
            x[:, :2],
            x[:, :2],
            jnp.zeros(16, jnp.int32),
            jnp.zeros(16, jnp.int32),
            implementation="dense",
        )


def test_auto_takes_pallas_on_gpus_for_16_bit_models_only():
    """attn_impl="auto" on a GPU: Pallas where it was measured faster (bf16/fp16), blockwise
    for fp32 models; never Pallas on CPU (interpret mode)."""
    import jax.numpy as jnp

    import jcp
    from jcp import attention

    def choose(platform, dtype):
        return attention.resolve_implementation("auto", platform, 32, dtype)

    assert choose("gpu", jnp.bfloat16) == choose("gpu", "float16") == "pallas"
    assert choose("gpu", jnp.float32) == "blockwise"
    assert "pallas" not in (choose("cpu", jnp.bfloat16), choose("cpu", jnp.float32))
    assert attention.resolve_implementation("blockwise", "gpu", 32, jnp.bfloat16) == "blockwise"
    cfg = jcp.QwenConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        dtype="bfloat16",
    )
    with pytest.raises(ValueError, match="attn_impl"):
        jcp.Trainer(cfg, jcp.make_mesh(1, 1, 1), max_adapters=1, max_rank=4, attn_impl="fast")
