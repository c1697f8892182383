"""The Pallas paged decode kernel (jcp.attention.paged) against the engine's gather path.

Evidence (Pallas interpret mode on CPU; no GPU ran any of this):
1. values equal the gather path (sample.paged.paged_decode_attend, kv_cache.decode_attend
   over each row's gathered pages) to fp32 rounding, in fp32 and bf16, on random page
   tables with rows of different lengths (a row at position 0 that sees only its own key,
   one with one cached position, last pages partly filled, table entries past a row's
   length missing (−1) or pointing at stale pages, a hole (−1) inside a row), prefix pages
   shared by several rows, GQA (M = 1, 2, 4), several loop steps of pages per row, and a
   layer other than the first of a stacked pool (the layer offset of the flattened pool);
2. lowered for "cuda" on this CPU host (the Pallas Triton lowering, as
   test_pallas_attention does), the engine's decode step — the layer stack over the
   whole pool — holds the kernel once per layer and no gather of K/V, no per-layer
   slice of the pool, no gathered [B, W·T, K, H] copy; the gather path's does (A vs B);
3. an engine whose Trainer has attn_impl "pallas" draws the default path's greedy tokens;
4. the Gated DeltaNet kernel (delta_rule.pallas) lowers for "cuda" through Triton.

Legend: B rows, Q / K query / kv heads, H head dim, L layers, P pages per layer, T
positions per page, W table entries per row.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jcp
from jcp import mesh as mesh_lib
from jcp import model
from jcp.attention import paged as paged_kernel
from jcp.sample import kv_cache, paged
from jcp.sample.decode_loop import StepModel


def _case(rng, dtype, q_heads, kv_heads, page, head_dim=16, layers=2, n_pages=23, width=7):
    """A stacked pool [L, P, T, K, H], a step's q / new K/V, and a table [B, W] whose rows
    exercise the cases of the module docstring."""

    def normal(*shape):
        return jnp.asarray(rng.normal(size=shape), dtype)

    k_pool, v_pool = (normal(layers, n_pages, page, kv_heads, head_dim) for _ in range(2))
    position = np.array([0, 1, page, page + 1, 3 * page - 1, width * page, 2 * page + 3], np.int32)
    table = np.full((len(position), width), -1, np.int32)
    for b, pos in enumerate(position):
        n = -(-pos // page)
        table[b, :n] = rng.choice(n_pages, n, replace=False)
    table[2:, 0] = 5  # a prefix page shared by rows 2 …
    table[3:5, 1] = 11  # … and a second one by rows 3, 4
    table[4, 2:] = rng.choice(n_pages, width - 2)  # stale pages past the row's length
    table[6, 1] = -1  # a hole: positions without a page are not seen
    b, q_dim = len(position), (q_heads, head_dim)
    q, k_new, v_new = (
        normal(b, *q_dim),
        normal(b, kv_heads, head_dim),
        normal(b, kv_heads, head_dim),
    )
    return k_pool, v_pool, jnp.asarray(table), jnp.asarray(position), q, k_new, v_new


def _gather_path(k_pool, v_pool, table, position, q, k_new, v_new, layer):
    attend = paged.paged_decode_attend(table, position, k_pool.shape[2])
    return attend(q, k_new, v_new, kv_cache.KV(k_pool[layer], v_pool[layer]))[0]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(
    "q_heads,kv_heads,page,block_keys", [(4, 2, 4, 8), (4, 4, 8, 64), (8, 2, 16, 64)]
)
def test_kernel_equals_gather_path(dtype, q_heads, kv_heads, page, block_keys):
    rng = np.random.default_rng(q_heads + page)
    k_pool, v_pool, table, position, q, k_new, v_new = _case(rng, dtype, q_heads, kv_heads, page)
    layer = 1
    want = _gather_path(k_pool, v_pool, table, position, q, k_new, v_new, layer)
    n_pages = k_pool.shape[1]
    flat = [x.reshape((-1,) + x.shape[2:]) for x in (k_pool, v_pool)]
    got = paged_kernel.paged_decode(
        q,
        k_new,
        v_new,
        *flat,
        jnp.where(table >= 0, layer * n_pages + table, -1),
        position,
        block_keys=block_keys,
    )
    assert got.dtype == want.dtype == dtype and got.shape == q.shape
    if dtype == jnp.float32:
        np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-5)
    else:  # the same fp32 values, each rounded once to bf16: at most one bf16 step apart
        np.testing.assert_allclose(
            np.asarray(got, np.float32), np.asarray(want, np.float32), atol=1e-6, rtol=2**-7
        )
    # The stale pages past row 4's length and the hole in row 6 change nothing; the row at
    # position 0 is its own value.
    np.testing.assert_array_equal(
        np.asarray(got[0], np.float32),
        np.repeat(np.asarray(v_new[0], np.float32), q_heads // kv_heads, axis=0),
    )


def test_strategy_reads_the_layer_it_is_given():
    """pallas_decode_attend (the engine's strategy: the layer index as the layer stack's
    state) equals the gather path on every layer of the stacked pool."""
    rng = np.random.default_rng(0)
    k_pool, v_pool, table, position, q, k_new, v_new = _case(rng, jnp.float32, 4, 2, 4, layers=3)
    attend = paged.pallas_decode_attend(table, position, k_pool, v_pool)
    outs = []
    for layer in paged.layer_indices(k_pool):
        out, new = attend(q, k_new, v_new, kv_cache.KV(layer, layer))
        assert new.k is k_new and new.v is v_new
        np.testing.assert_allclose(
            out,
            _gather_path(k_pool, v_pool, table, position, q, k_new, v_new, int(layer)),
            atol=2e-6,
            rtol=1e-5,
        )
        outs.append(out)
    assert not np.allclose(outs[0], outs[1])  # the layers really differ


# ----------------------------------------------------------------------------------------
# The Triton lowering: no gathered K/V


def _lowered_decode_step(monkeypatch, in_place: bool) -> str:
    """The engine's decode step (StepModel.hidden over the layer stack, as
    paged.make_decode runs it) for Qwen3-8B's heads (32 / 8 × 128, bf16), lowered for
    "cuda" as StableHLO text. Pool: L = 2 layers of P = 37 pages of T = 16 positions;
    B = 24 rows of W = 5 table entries."""
    monkeypatch.setattr(paged_kernel, "interpret_mode", lambda: False)
    cfg = jcp.QwenConfig.tiny()
    cfg = dataclasses.replace(cfg, num_heads=32, num_kv_heads=8, head_dim=128, dtype="bfloat16")
    sd = jax.ShapeDtypeStruct
    params = jax.tree.map(
        lambda s: sd(s, jnp.bfloat16),
        model.param_shapes(cfg),
        is_leaf=lambda x: isinstance(x, tuple),
    )
    pool = sd((cfg.num_layers, 37, 16, 8, 128), jnp.bfloat16)
    rows, table = sd((24,), jnp.int32), sd((24, 5), jnp.int32)

    def step(params, k_pool, v_pool, table, tok, pos):
        if in_place:
            attend = paged.pallas_decode_attend(table, pos, k_pool, v_pool)
            k = v = paged.layer_indices(k_pool)
        else:
            attend = paged.paged_decode_attend(table, pos, k_pool.shape[2])
            k, v = k_pool, v_pool
        h, new = StepModel(cfg, params, None, None).hidden(tok, pos, attend, kv_cache.KV(k, v))
        total = jnp.sum(h.astype(jnp.float32)) + jnp.sum(new.k.astype(jnp.float32))
        return jax.lax.psum(total, mesh_lib.AXES)

    f = jax.shard_map(
        step,
        mesh=jcp.make_mesh(1, 1, 1),
        in_specs=(
            model.param_specs(cfg),
            paged.POOL_SPEC,
            paged.POOL_SPEC,
            paged.TABLE_SPEC,
            paged.ROWS_SPEC,
            paged.ROWS_SPEC,
        ),
        out_specs=P(),
    )
    return (
        jax.jit(f)
        .trace(params, pool, pool, table, rows, rows)
        .lower(lowering_platforms=("cuda",))
        .as_text()
    )


def test_lowered_decode_reads_pages_in_place(monkeypatch):
    layer_pool, gathered = "tensor<37x16x8x128xbf16>", "tensor<24x80x8x128xbf16>"
    text = _lowered_decode_step(monkeypatch, in_place=False)
    # A vs B: the gather path's program holds K/V gathers, per-layer pools and the copy.
    assert any("gather" in line and "x8x128xbf16>" in line for line in text.splitlines())
    assert layer_pool in text and gathered in text
    assert "jcp_paged_decode" not in text

    text = _lowered_decode_step(monkeypatch, in_place=True)
    assert "jcp_paged_decode" in text
    kv_gathers = [line for line in text.splitlines() if "gather" in line and "x8x128xbf16>" in line]
    assert kv_gathers == []
    assert layer_pool not in text and gathered not in text
    # the whole pool flattened into the kernel's operand (a reshape: a view, no copy)
    assert "tensor<74x16x8x128xbf16>" in text


# ----------------------------------------------------------------------------------------
# Through the engine


def test_engine_decode_through_pallas_equals_default(monkeypatch):
    """Two Trainers alike but for attn_impl: the Sampler hands "pallas" to the paged decode
    program (the kernel is traced), and the greedy tokens are the default path's."""
    from jcp.sample.engine import Engine

    traced = []
    kernel = paged_kernel.paged_decode
    monkeypatch.setattr(
        paged_kernel, "paged_decode", lambda *a, **k: traced.append(1) or kernel(*a, **k)
    )
    cfg, mesh = jcp.QwenConfig.tiny(), jcp.make_mesh(1, 1, 1)
    prompts = [[3, 17, 42, 8, 99, 1, 64, 30, 2, 77, 12, 5, 6, 7, 8, 9, 10, 11], [50], [6, 7, 120]]
    sp = jcp.SamplingParams(max_tokens=6, temperature=0.0, stop=[])
    tokens, first = {}, None
    for impl in ("blockwise", "pallas"):
        sampler = jcp.Trainer(cfg, mesh, attn_impl=impl, seed=3).make_sampler()
        assert sampler.step_cfg.attn_impl == impl
        if first is None:
            first = sampler.paged
        else:  # the same extend and copy programs (compiled once); decode the Sampler's own
            sampler.runner.paged = sampler.paged._replace(extend=first.extend, copy=first.copy)
        res = Engine(sampler, slots=4, max_len=32, chunk=4, max_chunk=4).sample(prompts, sp)
        tokens[impl] = [s.tokens.tolist() for r in res for s in r.sequences]
        assert bool(traced) == (impl == "pallas")
    assert [len(t) for t in tokens["pallas"]] == [6] * 3
    assert tokens["pallas"] == tokens["blockwise"]


# ----------------------------------------------------------------------------------------
# Gated DeltaNet


def test_delta_rule_kernel_lowers_through_triton():
    from jcp.delta_rule import pallas as delta_pallas

    sd = jax.ShapeDtypeStruct
    n, ck, heads, dk = 4, 64, 8, 128
    qk = sd((n, ck, heads, dk), jnp.bfloat16)
    vec = sd((n, ck, heads), jnp.float32)
    text = (
        jax.jit(lambda *a: delta_pallas.block_factors(*a, interpret=False))
        .trace(qk, qk, vec, vec, sd((n, ck), jnp.bool_))
        .lower(lowering_platforms=("cuda",))
        .as_text()
    )
    assert re.findall(r'name = "(\w+)"', text).count("delta_rule_block_factors") == 1
