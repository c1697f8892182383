"""The gated delta rule and causal conv of Gated DeltaNet (jcp/delta_rule/).

References: transformers' torch_chunk_gated_delta_rule / torch_recurrent_gated_delta_rule
(forward fp32, gradients fp64 through torch autograd), each datum run alone from zero state
(the recurrent form and a NumPy conv), and cp = 1 for cp > 1 (forward and gradients).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.sharding import PartitionSpec as P
from transformers.models.qwen3_5.modeling_qwen3_5 import (
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)

from jcp import delta_rule as dr
from jcp import mesh as mesh_lib

HK, H, DK, DV, C, KC = 2, 4, 8, 6, 10, 4  # v heads > k heads


def _inputs(n, seed, dtype=np.float32):
    rng = np.random.default_rng(seed)
    d = dict(
        q=rng.standard_normal((n, HK, DK)),
        k=rng.standard_normal((n, HK, DK)),
        v=rng.standard_normal((n, H, DV)),
        g=-np.abs(rng.standard_normal((n, H))) * 0.7,
        b=1 / (1 + np.exp(-rng.standard_normal((n, H)))),
        x=rng.standard_normal((n, C)),
        s0=rng.standard_normal((H, DK, DV)),
    )
    return {k: v.astype(dtype) for k, v in d.items()}


def _torch(x):
    return torch.tensor(np.asarray(x))[None]


def test_chunked_equals_recurrent_equals_transformers():
    d = _inputs(37, 0)
    q, k = np.asarray(dr.l2norm(d["q"])), np.asarray(dr.l2norm(d["k"]))
    args = (q, k, d["v"], d["g"], d["b"])
    ref_o, ref_s = torch_chunk_gated_delta_rule(
        *map(_torch, args), chunk_size=8, initial_state=_torch(d["s0"]), output_final_state=True
    )
    rec_o, rec_s = torch_recurrent_gated_delta_rule(
        *map(_torch, args), initial_state=_torch(d["s0"]), output_final_state=True
    )
    ref_o, ref_s = ref_o[0].numpy(), ref_s[0].numpy()
    assert np.abs(ref_o).max() > 0.1 and np.abs(ref_s).max() > 0.1
    np.testing.assert_allclose(rec_o[0].numpy(), ref_o, atol=2e-6)
    o, s = dr.recurrent(*args, d["s0"])
    np.testing.assert_allclose(o, ref_o, atol=2e-6)
    np.testing.assert_allclose(s, ref_s, atol=2e-6)
    for chunk in (4, 16):  # 37 tokens: a ragged last block both times
        o, s = dr.chunked(*args, init_PxHxDkxDv=d["s0"][None], chunk=chunk)
        np.testing.assert_allclose(o, ref_o, atol=2e-6)
        np.testing.assert_allclose(s, ref_s, atol=2e-6)


def test_chunked_pieces_start_from_their_own_states():
    """Pieces beginning inside a block, at a block border, and one token long."""
    d = _inputs(40, 1)
    q, k = np.asarray(dr.l2norm(d["q"])), np.asarray(dr.l2norm(d["k"]))
    cuts = [0, 13, 16, 17, 40]  # 13: inside a block of 8; 16: at a border; 16..17: one token
    start = np.zeros(40, bool)
    start[cuts[:-1]] = True
    piece = (np.cumsum(start) - 1).astype(np.int32)
    inits = np.random.default_rng(2).standard_normal((4, H, DK, DV)).astype(np.float32)
    ends = np.array(cuts[1:]) - 1
    # one program (op by op: ~170 small compiles, ~2 CPU s more)
    o, states = jax.jit(lambda *x: dr.chunked(*x, start, piece, inits, chunk=8, ends_P=ends))(
        q, k, d["v"], d["g"], d["b"]
    )
    whole, _ = dr.recurrent(q, k, d["v"], d["g"], d["b"])
    assert np.abs(np.asarray(o) - np.asarray(whole)).max() > 0.1  # the pieces really reset
    for p, (a, b) in enumerate(zip(cuts[:-1], cuts[1:])):
        ro, rs = dr.recurrent(q[a:b], k[a:b], d["v"][a:b], d["g"][a:b], d["b"][a:b], inits[p])
        np.testing.assert_allclose(o[a:b], ro, atol=2e-6)
        np.testing.assert_allclose(states[p], rs, atol=2e-6)


def test_pallas_block_factors_equal_the_reference_in_interpret_mode():
    """delta_rule.pallas.block_factors (Pallas, interpret mode on CPU) inside the chunked
    rule: outputs and states equal the recurrent form per piece (pieces inside a block, at
    a border, one token long), and gradients equal the XLA path's."""
    from jcp.delta_rule import pallas as dp

    d = _inputs(40, 1)
    q, k = np.asarray(dr.l2norm(d["q"])), np.asarray(dr.l2norm(d["k"]))
    cuts = [0, 13, 16, 17, 40]
    start = np.zeros(40, bool)
    start[cuts[:-1]] = True
    piece = (np.cumsum(start) - 1).astype(np.int32)
    inits = np.random.default_rng(2).standard_normal((4, H, DK, DV)).astype(np.float32)

    def run(factors, q, k, v, g, b):
        return dr.chunked(
            q,
            k,
            v,
            g,
            b,
            start,
            piece,
            inits,
            chunk=8,
            factors=factors,
            ends_P=np.array(cuts[1:]) - 1,
        )

    args = (q, k, d["v"], d["g"], d["b"])
    o, states = jax.jit(functools.partial(run, dp.block_factors))(*args)
    for p, (a, b) in enumerate(zip(cuts[:-1], cuts[1:])):
        ro, rs = dr.recurrent(*(x[a:b] for x in args), inits[p])
        np.testing.assert_allclose(o[a:b], ro, atol=2e-6)
        np.testing.assert_allclose(states[p], rs, atol=2e-6)

    def loss(factors, *x):
        o, s = run(factors, *x)
        return jnp.sum(o**2) + jnp.sum(s**2)

    # one program each (the XLA path's op by op: ~200 small compiles)
    want = jax.jit(jax.grad(functools.partial(loss, None), argnums=range(5)))(*args)
    got = jax.jit(jax.grad(functools.partial(loss, dp.block_factors), argnums=range(5)))(*args)
    assert max(float(jnp.abs(w).max()) for w in want) > 1e-2
    for w, g in zip(want, got):
        np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-4)


def test_chunked_gradients_equal_torch_fp64():
    d = _inputs(21, 3, np.float64)
    cot = np.random.default_rng(4).standard_normal((21, H, DV))
    names = ("q", "k", "v", "g", "b", "s0")

    def torch_grads():
        ts = {n: torch.tensor(d[n], requires_grad=True) for n in names}
        q = ts["q"] * torch.rsqrt((ts["q"] ** 2).sum(-1, keepdim=True) + 1e-6)
        k = ts["k"] * torch.rsqrt((ts["k"] ** 2).sum(-1, keepdim=True) + 1e-6)
        o, s = torch_chunk_gated_delta_rule(
            q[None],
            k[None],
            ts["v"][None],
            ts["g"][None],
            ts["b"][None],
            chunk_size=8,
            initial_state=ts["s0"][None],
            output_final_state=True,
        )
        (o[0].double() * torch.tensor(cot)).sum().add(s.double().sum()).backward()
        return {n: ts[n].grad.numpy() for n in names}

    with jax.enable_x64(True):

        def loss(ins):
            o, s = dr.chunked(
                dr.l2norm(ins["q"]).astype(jnp.float64),
                dr.l2norm(ins["k"]).astype(jnp.float64),
                ins["v"],
                ins["g"],
                ins["b"],
                init_PxHxDkxDv=ins["s0"][None],
                chunk=4,
            )
            return jnp.sum(o * cot) + jnp.sum(s)

        got = jax.jit(jax.grad(loss))({n: jnp.asarray(d[n]) for n in names})
        assert got["q"].dtype == jnp.float64
    # torch computes in fp32 inside the kernel (it casts); compare at fp32 tolerances.
    want = torch_grads()
    for n in names:
        assert np.abs(want[n]).max() > 1e-3, n
        np.testing.assert_allclose(np.asarray(got[n]), want[n], atol=5e-5, rtol=1e-4, err_msg=n)


# ----------------------------------------------------------------------------------------
# Context parallelism: packed ragged datums in the zigzag layout

LENGTHS = (13, 1, 7, 16, 2)  # borders inside and at kernel blocks, a one-token datum


def _layout(lengths, cp, s_len):
    """[cp, S] segment and position of `lengths` packed in the zigzag layout (padding −1)."""
    seg = np.full((cp, s_len), -1, np.int32)
    pos = np.zeros((cp, s_len), np.int32)
    off = 0
    for b, n in enumerate(lengths):
        idx = mesh_lib.zigzag_indices(n, cp)
        w = idx.shape[1]
        seg[:, off : off + w] = np.where(idx >= 0, b, -1)
        pos[:, off : off + w] = np.maximum(idx, 0)
        off += w
    return seg, pos


@functools.cache
def _cp_program(cp, chunk, datums):
    mesh = mesh_lib.make_mesh(1, cp, 1)

    def shard(seg, pos, q, k, v, g, b, x, w):
        seg, pos, q, k, v, g, b, x = (a[0, 0] for a in (seg, pos, q, k, v, g, b, x))
        pcs = dr.pieces(seg, pos, 2 * datums + 1, mesh_lib.CP)
        o = dr.gated_delta_rule(dr.l2norm(q), dr.l2norm(k), v, g, b, seg, pcs, chunk)
        return o[None, None], dr.causal_conv(x, w, pcs)[None, None]

    spec = P(mesh_lib.DP, mesh_lib.CP)
    return jax.shard_map(shard, mesh=mesh, in_specs=(spec,) * 8 + (P(),), out_specs=(spec, spec))


def _run_cp(lengths, cp, s_len, chunk, data, w, cot):
    """(outputs, gradients) per datum in original order, from the cp-way program."""
    seg, pos = _layout(lengths, cp, s_len)
    names = "qkvgbx"
    ins = {}
    for n in names:
        arr = np.zeros((cp, s_len) + data[0][n].shape[1:], np.float32)
        for b in range(len(lengths)):
            m = seg == b
            arr[m] = data[b][n][pos[m]]
        ins[n] = arr[None]
    cot_o = np.zeros((cp, s_len, H, DV), np.float32)
    cot_y = np.zeros((cp, s_len, C), np.float32)
    for b in range(len(lengths)):
        m = seg == b
        cot_o[m], cot_y[m] = cot[b][0][pos[m]], cot[b][1][pos[m]]
    program = _cp_program(cp, chunk, len(lengths))

    def loss(ins, w):
        o, y = program(seg[None], pos[None], *(ins[n] for n in names), w)
        return jnp.sum(o[0] * cot_o) + jnp.sum(y[0] * cot_y), (o, y)

    (_, (o, y)), (g_ins, g_w) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
        ins, w
    )
    out = []
    for b in range(len(lengths)):
        m = seg == b
        order = np.argsort(pos[m])
        pick = lambda a: np.asarray(a)[0][m][order]
        out.append({"o": pick(o), "y": pick(y), **{f"d{n}": pick(g_ins[n]) for n in names}})
    return out, np.asarray(g_w)


@pytest.mark.parametrize(
    "lengths,cp,s_len,chunk",
    [
        (LENGTHS, 2, 32, 4),
        ((3, 1, 2), 4, 8, 2),  # rank 3 holds only padding
    ],
)
def test_cp_equals_cp1_and_each_datum_alone(lengths, cp, s_len, chunk):
    data = [_inputs(n, 10 + i) for i, n in enumerate(lengths)]
    rng = np.random.default_rng(5)
    w = rng.standard_normal((KC, C)).astype(np.float32)
    cot = [
        (
            rng.standard_normal((n, H, DV)).astype(np.float32),
            rng.standard_normal((n, C)).astype(np.float32),
        )
        for n in lengths
    ]
    seg, _ = _layout(lengths, cp, s_len)
    assert (seg[cp - 1] < 0).sum() > 0 and (seg >= 0).sum() == sum(lengths)
    one, gw1 = _run_cp(lengths, 1, 64, 8, data, w, cot)
    many, gw = _run_cp(lengths, cp, s_len, chunk, data, w, cot)
    for b, d in enumerate(data):
        ro, _ = dr.recurrent(dr.l2norm(d["q"]), dr.l2norm(d["k"]), d["v"], d["g"], d["b"])
        xp = np.concatenate([np.zeros((KC - 1, C), np.float32), d["x"]])
        ry = jax.nn.silu(sum(xp[j : j + len(d["x"])] * w[j] for j in range(KC)))
        np.testing.assert_allclose(one[b]["o"], ro, atol=2e-6)
        np.testing.assert_allclose(one[b]["y"], ry, atol=2e-6)
        for key in one[b]:
            if lengths[b] > 1:
                assert np.abs(one[b][key]).max() > 1e-3, (b, key)
            np.testing.assert_allclose(many[b][key], one[b][key], atol=2e-5, err_msg=f"{b} {key}")
    assert np.abs(gw1).max() > 1e-2
    np.testing.assert_allclose(gw, gw1, atol=2e-5)


def test_one_rank_runs_the_kernel_once_and_composes_nothing():
    """At cp = 1 every piece starts its datum, so the rule's pass 1 and both compositions
    (the delta rule's transitions, the conv's halos) are skipped: one block scan, where
    cp = 2 runs four (pass 1, its composition, pass 2, the halos'). Their values are
    test_cp_equals_cp1_and_each_datum_alone's (cp = 1 against each datum alone)."""
    lengths, s_len = (5, 3), 8
    data = [_inputs(n, i) for i, n in enumerate(lengths)]
    w = np.ones((KC, C), np.float32)
    counts = {}
    for cp in (1, 2):
        seg, pos = _layout(lengths, cp, s_len * 2 // cp)
        ins = [np.zeros((1, cp, seg.shape[1]) + data[0][n].shape[1:], np.float32) for n in "qkvgbx"]
        jaxpr = jax.make_jaxpr(_cp_program(cp, 4, len(lengths)))(seg[None], pos[None], *ins, w)
        counts[cp] = str(jaxpr).count(" scan[")  # nested jaxprs included
    assert counts == {1: 1, 2: 4}, counts


def test_cp_exchange_memory_keeps_a_few_copies_of_the_piece_table():
    """grad of the cp program at cp = 8 with many piece slots (P = 33, so the [cp·P, H, Dk,
    Dk + Dv] table of exchanged transitions dominates a rank's 16 tokens): XLA's temp stays
    a few tables, not 2·cp (composing by Jacobi passes over the table kept one per pass,
    which grew as cp² — 0.43 of cp = 1 at cp = 8 for one 16k Qwen3.5 datum)."""
    cp, s_len, p = 8, 16, 33
    program = _cp_program(cp, 4, (p - 1) // 2)
    sd = lambda *shape: jax.ShapeDtypeStruct((1, cp, s_len) + shape, jnp.float32)  # noqa: E731
    i32 = jax.ShapeDtypeStruct((1, cp, s_len), jnp.int32)
    args = (
        i32,
        i32,
        sd(HK, DK),
        sd(HK, DK),
        sd(H, DV),
        sd(H),
        sd(H),
        sd(C),
        jax.ShapeDtypeStruct((KC, C), jnp.float32),
    )

    def loss(*xs):
        o, y = program(*xs)
        return jnp.sum(o * o) + jnp.sum(y * y)

    compiled = jax.jit(jax.grad(loss, argnums=tuple(range(2, 9)))).lower(*args).compile()
    table = cp * p * H * DK * (DK + DV) * 4
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp > table  # the table is there (the bound below means something)
    assert temp < 8 * table, (temp, table)  # 4.9 tables; Jacobi passes: 20
