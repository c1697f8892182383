"""The "cpu" grouped LoRA products (jcp.lora_cpu: jcp/lora_cpu.cc's kernels), each row times
its own adapter's pages read in place.

Evidence:
1. the kernels against a NumPy reference row by row (each row's own adapter's pages joined
   along the rank axis): outputs, the input's gradient and each adapter's gradient of its
   pages, for "a" and "b" factors, pages of rank 8 and 4, rows of no adapter, a page
   outside the table (zeros), an adapter with no rows, rows of one adapter in several runs
   (a decode batch's order); a routing that sends one row to its neighbour's adapter fails
   the same reference;
2. lora_grouped.paged_product through the kernels equals the tiles in XLA (values, the
   input's gradient, the accumulator's pages and the finite flags) inside one jit;
3. TrainerOptions.lora_impl: "auto" resolves to "cpu" on CPU and the fused pass then calls
   the kernels ("xla" does not); "cpu" is refused off CPU and a bad name is refused.
The fused pass through the model at every mesh kind: tests/test_lora_grouped.py
(test_a_fused_pass_over_many_adapters_equals_one_pass_each, lora_impl "cpu").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jcp
from jcp import lora as lora_lib
from jcp import lora_cpu, lora_grouped, trainer_options
from jcp import mesh as mesh_lib

EVERY = mesh_lib.BATCH_AXES + (mesh_lib.TP,)

pytestmark = pytest.mark.skipif(not lora_cpu.available(), reason="no C++ compiler")

I, O, L = 139, 147, 3  # chunks of 128 columns, blocks of 64 and 8, scalar tails: all run
C = 32  # an adapter's rank: K = C / r pages of rank r


def layout(r, seed=0):
    """(table_a [P, L, I, r], table_b [P, L, r, O], page_AK [A, K], row_k [Q]): 5 adapters
    of K = C / r pages (adapter 1 has a page outside the table, adapter 3 no rows), 90
    rows in runs — adapter 2's rows in two runs, rows of no adapter between, adapter 1's
    70 rows more than one work item (32 rows) and one block of a factor gradient (64)."""
    rng = np.random.default_rng(seed)
    k = C // r
    n_a, p = 5, 5 * k + 2
    table_a = rng.normal(size=(p, L, I, r)).astype(np.float32)
    table_b = rng.normal(size=(p, L, r, O)).astype(np.float32)
    page_AK = rng.permutation(p)[: n_a * k].reshape(n_a, k).astype(np.int32)
    page_AK[1, -1] = p + 3  # no page: zeros
    row_k = np.array([0] * 5 + [-1] * 2 + [2] * 4 + [1] * 70 + [2] * 3 + [4] * 3 + [-1] * 3)
    return table_a, table_b, page_AK, row_k.astype(np.int32)


def joined(which, table, page_AK, layer):
    """[A, …slot]: each adapter's pages at `layer` joined along the rank axis (zeros for a
    page outside the table), the NumPy way."""
    p = table.shape[0]
    pages = [
        [table[j, layer] if 0 <= j < p else np.zeros_like(table[0, layer]) for j in row]
        for row in page_AK
    ]
    axis = -1 if which == "a" else -2
    return np.stack([np.concatenate(row, axis=axis) for row in pages])


def reference(which, x, dy, table, page_AK, row_k, layer):
    """(y, dx, dw [A, K, …page]) row by row: y[q] = x[q] @ W[row_k[q]], 0 for no adapter."""
    w = joined(which, table, page_AK, layer)
    n_a, k = page_AK.shape
    y = np.zeros((x.shape[0], w.shape[-1]), np.float64)
    dx = np.zeros_like(x, np.float64)
    dw = np.zeros(w.shape, np.float64)
    for q, a in enumerate(row_k):
        if a >= 0:
            y[q] = x[q] @ w[a]
            dx[q] = dy[q] @ w[a].T
            dw[a] += np.outer(x[q], dy[q])
    r = table.shape[-1] if which == "a" else table.shape[-2]
    if which == "a":  # [A, I, K·r] -> [A, K, I, r]
        dw = dw.reshape(n_a, -1, k, r).transpose(0, 2, 1, 3)
    else:  # [A, K·r, O] -> [A, K, r, O]
        dw = dw.reshape(n_a, k, r, -1)
    return y, dx, dw


@pytest.mark.parametrize("r", lora_cpu.RANKS)
@pytest.mark.parametrize("which", ["a", "b"])
def test_kernels_match_numpy_row_by_row(which, r):
    table_a, table_b, page_AK, row_k = layout(r)
    table = table_a if which == "a" else table_b
    rng = np.random.default_rng(1)
    width_in = I if which == "a" else C
    width_out = C if which == "a" else O
    x = rng.normal(size=(row_k.size, width_in)).astype(np.float32)
    dy = rng.normal(size=(row_k.size, width_out)).astype(np.float32)
    layer = 1

    @jax.jit
    def kernels(x, dy, table, page_AK, row_k):
        y = lora_cpu.forward(which, x, table, layer, page_AK, row_k)
        return (y, *lora_cpu.backward(which, x, dy, table, layer, page_AK, row_k))

    got = kernels(x, dy, table, page_AK, row_k)
    want = reference(which, x, dy, table, page_AK, row_k, layer)
    for name, g, w in zip(("y", "dx", "dw"), got, want):
        assert g.shape == w.shape, name
        np.testing.assert_allclose(np.asarray(g), w, rtol=1e-5, atol=1e-5, err_msg=name)
    assert np.abs(want[2][3]).max() == 0 and np.abs(want[2][2]).max() > 0  # no rows, two runs

    # In place: the gradient added into an accumulator's pages of the layer (the page
    # outside the table dropped), each adapter's finiteness noted — one non-finite input
    # row of adapter 2 clears its flag only.
    acc = rng.normal(size=table.shape).astype(np.float32)

    @jax.jit
    def into(x, dy, table, page_AK, row_k, acc):
        return lora_cpu.backward_into(which, x, dy, table, layer, page_AK, row_k, acc)

    dx, acc_new, ok = into(x, dy, table, page_AK, row_k, acc)
    want_acc = acc.copy()
    for a, row in enumerate(page_AK):
        for kk, p in enumerate(row):
            if p < table.shape[0]:
                want_acc[p, layer] += want[2][a, kk]
    np.testing.assert_allclose(np.asarray(dx), want[1], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(acc_new), want_acc, rtol=1e-5, atol=1e-5)
    assert np.asarray(ok).tolist() == [True] * 5
    bad = (x if which == "a" else dy).copy()
    bad[8, 0] = np.inf  # a row of adapter 2
    args = (bad, dy) if which == "a" else (x, bad)
    ok = into(*args, table, page_AK, row_k, acc)[2]
    assert np.asarray(ok).tolist() == [True, True, False, True, True]

    # A row routed to its neighbour's adapter (the first row of adapter 1's run to
    # adapter 2) fails the reference: the comparison above can tell adapters apart.
    wrong = row_k.copy()
    wrong[11] = 2
    y_wrong = np.asarray(kernels(x, dy, table, page_AK, wrong)[0])
    assert not np.allclose(y_wrong[11], want[0][11], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("which", ["a", "b"])
def test_paged_product_through_the_kernels_equals_the_tiles(which):
    """lora_grouped.paged_product with PageSource.kernel and without (the tiles in XLA):
    the product, the input's gradient, the gradient added into the accumulator's pages
    and the finite flags agree to fp32 rounding; the routing is a plan of spans with
    rows of the base model and an empty adapter."""
    table_a, table_b, page_AK, _ = layout(8, seed=2)
    table = jnp.asarray(table_a if which == "a" else table_b)
    s_len = 32
    spans = jnp.asarray([[0, 5], [5, 14], [14, 14], [14, 20], [20, 29]], jnp.int32)
    lora_A = jnp.asarray([True, True, True, False, True])  # entry 3: the base model
    tiles = lora_lib.plan_spans(spans, lora_A, jnp.full(5, 2.0), s_len, 8)
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(size=(s_len, I if which == "a" else C)), jnp.float32)
    ct = jnp.asarray(rng.normal(size=(s_len, C if which == "a" else O)), jnp.float32)
    factor = lora_lib.PagedFactor(jnp.int32(2), "m", which)

    def run(kernel):
        def shard(x, table, page_AK, tiles):  # as train_step's pass: inside a shard_map
            grad = jax.new_ref(jnp.zeros_like(table))
            finite = jax.new_ref(mesh_lib.vary(jnp.ones(page_AK.shape[0], bool), EVERY))

            def loss(x, probe):
                src = lora_lib.PageSource(
                    {"m": {which: table}}, page_AK, {"m": {which: grad}}, finite, probe, kernel
                )
                y = lora_grouped.paged_product(x, factor, src, tiles)
                return jnp.vdot(y, ct), y

            (_, y), (dx, _) = jax.value_and_grad(loss, (0, 1), has_aux=True)(
                x, jnp.zeros((), jnp.float32)
            )
            return y, dx, jax.ref.freeze(grad), jax.ref.freeze(finite)

        f = jax.shard_map(
            shard, mesh=jcp.make_mesh(1, 1, 1), in_specs=P(), out_specs=P(), check_vma=False
        )
        return jax.jit(f)(x, table, jnp.asarray(page_AK), tiles)

    kernel, tiles_xla = run(True), run(False)
    assert float(jnp.abs(tiles_xla[2]).max()) > 0  # the accumulator got a gradient
    for name, a, b in zip(("y", "dx", "accumulator", "finite"), kernel, tiles_xla):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5, err_msg=name)
    # The two runs really differ: the kernels in one program, none in the other.
    assert "jcp_cpu_lora" in jax.jit(lambda: run(True)).lower().as_text()
    assert "jcp_cpu_lora" not in jax.jit(lambda: run(False)).lower().as_text()


def test_lora_impl_resolution_and_the_fused_pass_calls():
    """lora_impl resolves and is refused as documented ("auto": the kernels on CPU where
    they build, else XLA's tiles); a fused pass of a bf16
    model over 6 adapters calls the kernels with "cpu" and not with "xla", and the two
    give the same log-probs and gradients to bf16 rounding (the kernels run fp32 inside;
    the tiles round each tile's gradient sum to bf16 before the accumulator, the kernels
    after an fp32 sum)."""
    for built, want in ((True, "cpu"), (False, "xla")):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(lora_cpu, "available", lambda built=built: built)
            assert trainer_options.resolve_lora_impl("auto", "cpu") == want
    assert trainer_options.resolve_lora_impl("auto", "gpu") == "xla"
    assert trainer_options.resolve_lora_impl("xla", "cpu") == "xla"
    with pytest.raises(ValueError, match="lora_impl 'cpu' runs on CPU"):
        trainer_options.resolve_lora_impl("cpu", "gpu")
    with pytest.raises(ValueError, match="lora_impl must be one of"):
        jcp.Trainer(jcp.QwenConfig.tiny(), jcp.make_mesh(1, 1, 1), lora_impl="fast")

    cfg = jcp.QwenConfig.tiny(num_layers=1, dtype="bfloat16")
    n = lora_lib.DENSE_MAX_ADAPTERS + 2
    rng = np.random.default_rng(5)
    data = [
        jcp.Datum(
            rng.integers(0, cfg.vocab_size, 10),
            {"target_tokens": rng.integers(0, cfg.vocab_size, 10), "weights": np.ones(10)},
        )
        for _ in range(n)
    ]
    texts, got = {}, {}
    for impl in ("cpu", "xla"):
        tr = jcp.Trainer(cfg, jcp.make_mesh(1, 1, 1), max_adapters=n, max_rank=16, lora_impl=impl)
        ids = [tr.create_adapter(rank=16, seed=k) for k in range(n)]
        out = tr.forward_backward(data, "cross_entropy", adapters=ids)
        (program,) = tr.forward_backward_programs.values()
        texts[tr.step_cfg.lora_impl] = program.as_text()
        lp = np.concatenate([o["logprobs"] for o in out.loss_fn_outputs])
        got[tr.step_cfg.lora_impl] = lp, [tr.gradients(k) for k in ids]
    assert set(texts) == {"cpu", "xla"}
    assert "jcp_cpu_lora_a_backward" in texts["cpu"]
    assert "jcp_cpu_lora" not in texts["xla"]
    np.testing.assert_allclose(got["cpu"][0], got["xla"][0], rtol=1e-2, atol=1e-2)
    for a, b in zip(got["cpu"][1], got["xla"][1]):
        for name in b:
            tol, top = 2.0**-6, float(np.abs(b[name]).max())  # two bf16 roundings apart
            np.testing.assert_allclose(a[name], b[name], rtol=tol, atol=tol * top, err_msg=name)
    assert any(float(np.abs(g).max()) > 0 for g in got["cpu"][1][0].values())
