"""The grouped multi-LoRA products (lora.Tiles, low_rank_input, expand, delta): each row is
multiplied by its own adapter's factors only.

The plan is checked row by row against the routing it comes from (no mesh; each routing
and product one jitted program: op by op they compiled some hundred small programs a case,
~14 CPU s over the module); the products against the masked dense product over all A adapters that they replaced (every
row times the stacked [I, A·R], masked), values and gradients in fp32; a plan that sends a
boundary row to its neighbour's factors is shown to fail the row-by-row reference.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jcp import lora as lora_lib
from jcp import lora_grouped

I, O, R = 12, 10, 4
META = lora_lib.SlotMeta(
    scale_G=jnp.asarray([0.5, 1.0, 2.0, 3.0, 0.25, 4.0, 1.5, 0.75, 6.0]), shared_G=jnp.zeros(9)
)


def routing(active, spans=None, index=None, **kw):
    """META.routing(active, spans, index, **kw) as one program."""
    return jax.jit(lambda a, s, i: META.routing(a, s, i, **kw))(active, spans, index)


def plan(active, spans, s_len, tile):
    """The grouped routing of spans with tiles of `tile` rows (lora.plan_spans)."""

    def f(active, spans):
        route = META.routing(active, spans, s_len=s_len, grouped=True)
        tiles = lora_lib.plan_spans(spans, active >= 0, route.scale_A, s_len, tile)
        return dataclasses.replace(route, tiles=tiles)

    return jax.jit(f)(active, spans)


def spans_layout(s_len, lengths, base=(), seed=0):
    """Spans of consecutive segments of `lengths` (0: an empty adapter) from row 0, padding
    after; active slots a permutation (not the rows' order), entries in `base` the base
    model (-1)."""
    rng = np.random.default_rng(seed)
    edges = np.concatenate([[0], np.cumsum(lengths)])
    assert edges[-1] <= s_len
    spans = np.stack([edges[:-1], edges[1:]], 1)
    spans[np.asarray(lengths) == 0] = 0  # packing leaves an absent adapter at [0, 0)
    active = rng.permutation(len(META.scale_G))[: len(lengths)]
    active[list(base)] = -1
    return jnp.asarray(active, jnp.int32), jnp.asarray(spans, jnp.int32)


def row_adapter(route, s_len):
    """Each stream row's active adapter (-1: none), from the routing itself."""
    mask = np.asarray(route.mask_SxA(s_len)) & (np.asarray(route.scale_A) != 0)[None, :]
    return np.where(mask.any(1), mask.argmax(1), -1)


def kept_by(t: lora_lib.Tiles):
    """[(place q, adapter)] of every (tile, row) the plan keeps."""
    n, tile = t.keep_NxT.shape
    out = [(int(i) * tile + int(j), int(t.pick_N[i])) for i, j in zip(*np.nonzero(t.keep_NxT))]
    out += [
        (int(t.tile_E[e]) * tile + int(j), int(t.pick_E[e]))
        for e, j in zip(*np.nonzero(t.keep_ExT))
    ]
    return out


def check_plan(route, s_len):
    t = route.tiles
    want = row_adapter(route, s_len)
    order = np.arange(s_len) if t.order_Q is None else np.asarray(t.order_Q)
    got = kept_by(t)
    assert sorted(q for q, _ in got) == sorted(np.nonzero(want[order] >= 0)[0].tolist())
    for q, a in got:  # each row kept once, by its own adapter
        assert want[order[q]] == a
    assert np.all(np.diff(np.asarray(t.rank_N)) >= 0) and np.all(np.diff(np.asarray(t.rank_E)) >= 0)
    np.testing.assert_array_equal(np.asarray(t.rank_of_A)[np.asarray(t.pick_N)], t.rank_N)
    np.testing.assert_array_equal(np.asarray(t.rank_of_A)[np.asarray(t.pick_E)], t.rank_E)
    assert int(t.count_E) <= route.active_A.shape[0] - 1
    assert not np.asarray(t.keep_ExT)[int(t.count_E) :].any()  # the loop skips those
    w = np.where(want >= 0, np.asarray(route.scale_A)[np.maximum(want, 0)], 0.0)
    np.testing.assert_array_equal(np.asarray(t.weight_Q), w[order])
    if t.place_S is not None:
        np.testing.assert_array_equal(order[np.asarray(t.place_S)], np.arange(s_len))


LAYOUTS = {  # s_len, segment lengths, base-model entries, tile (None: tile_rows)
    "one": (64, [50], (), None),
    "uneven": (64, [13, 0, 37, 6], (), 8),
    "base and empty": (64, [5, 9, 0, 1, 30, 2], (1,), 8),
    "tiny segments": (32, [1, 1, 1, 3, 1, 2, 1, 1], (), 16),
    "aligned": (64, [16, 16, 32], (), 16),
    "one row a tile": (16, [3, 5, 8], (), 1),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_plan_keeps_every_row_once_by_its_own_adapter(name):
    s_len, lengths, base, tile = LAYOUTS[name]
    active, spans = spans_layout(s_len, lengths, base)
    if tile is None:
        route = routing(active, spans, s_len=s_len, grouped=True)
    else:
        route = plan(active, spans, s_len, tile)
    check_plan(route, s_len)


@pytest.mark.parametrize("seed", range(4))
def test_plan_of_rows_in_any_order(seed):
    rng = np.random.default_rng(seed)
    s_len, n_a = (24, 5) if seed % 2 else (64, 3)
    active = jnp.asarray(np.r_[rng.permutation(8)[: n_a - 1], -1], jnp.int32)
    index = jnp.asarray(rng.integers(0, n_a, s_len), jnp.int32)
    check_plan(routing(active, None, index, grouped=True), s_len)


def test_routing_groups_more_than_dense_max_adapters():
    for n_a in (1, lora_lib.DENSE_MAX_ADAPTERS, lora_lib.DENSE_MAX_ADAPTERS + 1):
        active, spans = spans_layout(64, [8] * n_a)
        assert (META.routing(active, spans, s_len=64).tiles is None) == (
            n_a <= lora_lib.DENSE_MAX_ADAPTERS
        )


def test_tile_rows():
    assert lora_lib.tile_rows(4096, 1) == 4096 and lora_lib.tile_rows(6144, 1) == 2048
    assert [lora_lib.tile_rows(4096, a) for a in (4, 16, 64, 256)] == [1024, 256, 64, 16]
    assert lora_lib.tile_rows(1536, 4) == 256  # a power of two dividing S, ≤ 384
    assert lora_lib.tile_rows(256, 64) == 4 and lora_lib.tile_rows(8, 8) == 1


def test_extra_chunk():
    assert [lora_grouped.extra_chunk(n) for n in (3, 8, 31, 32, 33, 255)] == [3, 8, 8, 8, 32, 32]


def dense_delta(x, a, b, route):
    """The product the tiles replaced: every row times all A adapters, masked."""
    w_SxA = jnp.where(route.mask_SxA(x.shape[0]), route.scale_A[None, :], 0.0)
    u_SxAxR = jnp.einsum("si,air->sar", x, a) * w_SxA[:, :, None]
    return jnp.einsum("sar,aro->so", u_SxAxR, b)


def factors(n_a, seed=0):
    rng = np.random.default_rng(seed)
    return (
        jnp.asarray(rng.standard_normal((n_a, I, R)), jnp.float32),
        jnp.asarray(rng.standard_normal((n_a, R, O)), jnp.float32),
    )


ROUTES = {  # A = 1, 3, 8: uneven segments, an empty adapter, base-model rows, padding
    1: lambda: spans_layout(64, [45]),
    3: lambda: spans_layout(64, [21, 0, 30], ()),
    8: lambda: spans_layout(128, [7, 30, 0, 1, 19, 40, 3, 20], (2, 6)),
}


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "dense"])
@pytest.mark.parametrize("by", ["spans", "rows"])
@pytest.mark.parametrize("n_a", sorted(ROUTES))
def test_grouped_equals_masked_dense(monkeypatch, n_a, by, grouped, chunk=None):
    """lora.delta / head_lora, grouped (Tiles) or dense (no Tiles: SlotMeta.routing's
    choice up to DENSE_MAX_ADAPTERS), against the reference: values and gradients. Tiles
    of 8 rows, so that adapters start inside them at these small S (tile_rows picks 1–2)."""
    monkeypatch.setattr(lora_grouped, "tile_rows", lambda s_len, n_active: 8)
    active, spans = ROUTES[n_a]()
    s_len = 64 if n_a < 8 else 128
    if by == "spans":
        route = routing(active, spans, s_len=s_len, grouped=grouped)
    else:  # the same rows' adapters, shuffled, routed one by one (a decode batch)
        own = row_adapter(routing(active, spans, s_len=s_len), s_len)
        own = np.where(
            own < 0,
            int(np.argmax(np.asarray(active) < 0)) if (np.asarray(active) < 0).any() else 0,
            own,
        )
        index = jnp.asarray(np.random.default_rng(n_a).permutation(own), jnp.int32)
        route = routing(active, None, index, grouped=grouped)
    t = route.tiles
    assert (t is not None) == grouped
    if grouped and n_a > 1:  # tiles of several rows, and adapters starting inside them
        assert t.keep_NxT.shape[1] > 1 and bool(t.keep_ExT.any())
    if chunk is not None:  # the extras in several steps of their loop
        assert int(t.count_E) > chunk
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((s_len, I)), jnp.float32)
    ct = jnp.asarray(rng.standard_normal((s_len, O)), jnp.float32)
    a, b = factors(n_a)

    def loss(fn):
        return jax.jit(
            jax.value_and_grad(lambda *z: jnp.vdot(fn(*z, route), ct), argnums=(0, 1, 2))
        )

    got, want = loss(lora_lib.delta)(x, a, b), loss(dense_delta)(x, a, b)
    assert float(jnp.abs(want[1][1]).max()) > 0  # some adapter really has rows
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * float(jnp.abs(w).max()))
    if grouped:  # the unembedding's: chunk by chunk, chunks crossing adapters' rows
        check_head(x, a, b, route, ct, want[0])


def check_head(x, a, b, route, ct, want_value):
    """lora.head_lora's logits and gradients, chunk by chunk (4 chunks), equal the masked
    dense product and its gradients row by row."""
    s_len, c = x.shape[0], x.shape[0] // 4
    head = lora_lib.head_lora(x, a, b, route)
    y = jnp.concatenate([head.logits(i * c, c) for i in range(4)])
    ref = dense_delta(x, a, b, route)
    assert float(jnp.abs(ref).max()) > 0
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5 * float(jnp.abs(ref).max()))
    np.testing.assert_allclose(jnp.vdot(y, ct), want_value, rtol=1e-5)
    d_b, d_u = jnp.zeros(b.shape, jnp.float32), []
    for i in range(4):
        du, d_b = head.grads_into(i * c, c, ct[i * c : (i + 1) * c], d_b)
        d_u.append(du)
    own = row_adapter(route, s_len)
    b_own = jnp.asarray(b)[np.maximum(own, 0)] * (own >= 0)[:, None, None]
    du_ref = jnp.einsum("so,sro->sr", ct, b_own)
    u_ref = head.u_SxR * (own >= 0)[:, None]
    db_ref = (
        jnp.zeros(b.shape)
        .at[np.maximum(own, 0)]
        .add(jnp.einsum("sr,so->sro", u_ref, ct) * (own >= 0)[:, None, None])
    )
    np.testing.assert_allclose(jnp.concatenate(d_u), du_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(d_b, db_ref, rtol=1e-5, atol=1e-5 * float(jnp.abs(db_ref).max()))


def test_a_row_in_its_neighbours_tile_fails_the_reference():
    """Segment boundaries inside tiles, every adapter's factors distinct: delta equals the
    row-by-row product x_q · A_k · s_k · B_k; the same plan with one extra tile's adapter
    swapped for the one leading that tile (the neighbour) does not."""
    s_len, tile = 32, 8
    active, spans = spans_layout(s_len, [5, 6, 13, 3], ())
    route = plan(active, spans, s_len, tile)
    a, b = factors(4, seed=3)
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((s_len, I)), jnp.float32)
    own = row_adapter(route, s_len)
    scale = np.asarray(route.scale_A)
    ref = np.stack(
        [
            np.asarray(x[q]) @ np.asarray(a[k]) * scale[k] @ np.asarray(b[k])
            if k >= 0
            else np.zeros(O, np.float32)
            for q, k in enumerate(own)
        ]
    )
    np.testing.assert_allclose(lora_lib.delta(x, a, b, route), ref, rtol=1e-5, atol=1e-5)
    t = route.tiles
    assert bool(t.keep_ExT.any())
    wrong = dataclasses.replace(t, pick_E=t.pick_N[t.tile_E])
    bad = lora_lib.delta(x, a, b, dataclasses.replace(route, tiles=wrong))
    with pytest.raises(AssertionError):
        np.testing.assert_allclose(bad, ref, rtol=1e-5, atol=1e-5)


def test_backward_keeps_rank_wide_activations_only():
    """What delta's VJP holds for the backward: x and the factors (the model has them
    anyway), the plan, and [S, R] — never [S, A·R]."""
    n_a, s_len = 8, 128
    active, spans = ROUTES[n_a]()
    route = META.routing(active, spans, s_len=s_len, grouped=True)
    a, b = factors(n_a)
    x = jnp.ones((s_len, I), jnp.float32)
    _, vjp = jax.vjp(lambda x, a, b: lora_lib.delta(x, a, b, route), x, a, b)
    floats = [v.shape for v in jax.tree.leaves(vjp) if jnp.issubdtype(v.dtype, jnp.floating)]
    own = {x.shape, a.shape, b.shape}
    assert [s for s in floats if s not in own and np.prod(s) > s_len * R] == [], floats
    assert (s_len, R) in floats


def test_extras_in_several_chunks(monkeypatch):
    monkeypatch.setattr(lora_grouped, "EXTRA_CHUNK", 2)
    test_grouped_equals_masked_dense(monkeypatch, 8, "spans", True, chunk=2)


def _random_adapter(tr, slot, rank, targets, seed):
    """Install an adapter of random A and B (B ≠ 0: every factor has a gradient)."""
    from jcp.adapter_state import AdapterInfo

    info = AdapterInfo(rank=rank, alpha=2.0 * rank, targets=lora_lib.resolve_targets(targets))
    rng = np.random.default_rng(seed)
    weights = {
        m: {k: (0.1 * rng.normal(size=x.shape)).astype(np.float32) for k, x in ks.items()}
        for m, ks in tr.state.layout(info).items()
    }
    tr.state.install(slot, info, weights)
    return slot


@pytest.mark.parametrize(
    "mesh_shape, n, lora_impl",
    [((1, 2, 2), 8, "xla"), ((1, 1, 1), 6, "cpu"), ((2, 2, 2), 6, "cpu"), ((1, 4, 1), 6, "cpu")],
)
def test_a_fused_pass_over_many_adapters_equals_one_pass_each(
    monkeypatch, retrace, mesh_shape, n, lora_impl
):
    """Through the model at every mesh kind: n adapters of ranks 2 … 16 and three target
    sets (attn; mlp; attn + mlp + unembedding: the others' modules are the base model's) in
    one forward_backward — the grouped products — give each datum the log-probs and each
    adapter the gradients of passes of at most DENSE_MAX_ADAPTERS adapters each (the dense,
    masked products, themselves equal to one adapter at a time:
    test_grouped_equals_masked_dense). Four (rank, targets) kinds, two or more adapters of
    each: 8 at (1,2,2), 6 on the other meshes.
    At (1,2,2) the fused pass — its factors read from the pages, its gradients added in
    place (train_step._paged_value_and_grad) — also equals the gathered path bit for bit
    (lora_impl "xla": the tiles in XLA); on the other meshes the products are
    jcp.lora_cpu's kernels (lora_impl "cpu")."""
    import jcp
    from jcp import train_step

    traced = []  # the gradient paths traced, in order
    for name in ("_paged_value_and_grad", "_folded_value_and_grad"):
        real = getattr(train_step, name)
        spy = lambda *a, name=name, real=real: (traced.append(name), real(*a))[1]  # noqa: E731
        monkeypatch.setattr(train_step, name, spy)

    cfg = jcp.QwenConfig.tiny()
    tr = jcp.Trainer(
        cfg,
        jcp.make_mesh(*mesh_shape),
        max_adapters=n,
        max_rank=16,
        logprob_chunk=16,
        lora_impl=lora_impl,
    )
    assert tr.step_cfg.lora_impl == lora_impl
    attn, mlp, every = ["attn"], ["mlp"], ["attn", "mlp", "unembed"]
    kinds = ((2, attn), (16, mlp), (4, every), (8, every))
    ids = [_random_adapter(tr, k, *kinds[k % len(kinds)], seed=k) for k in range(n)]
    data = [_train_datum(i, 12) for i in range(n)]
    fused = tr.forward_backward(data, "cross_entropy", adapters=ids)
    assert n > lora_lib.DENSE_MAX_ADAPTERS and traced == ["_paged_value_and_grad"]
    grads = {k: tr.gradients(k) for k in ids}
    for k in ids:
        tr.optim_step(k, jcp.AdamParams(learning_rate=0.0))  # zero the accumulators only
    if mesh_shape == (1, 2, 2):  # the same pass the gathered way: the same bits
        monkeypatch.setattr(train_step, "pages_in_place", lambda *a: False)
        tr.programs.compiled.clear()
        for programs in tr.programs.fb_steps.values():
            programs.clear()
        jax.clear_caches()  # so that the step is traced again
        gathered = tr.forward_backward(data, "cross_entropy", adapters=ids)
        assert traced[1:] == ["_folded_value_and_grad"]  # this time the gathered path
        for a, b in zip(fused.loss_fn_outputs, gathered.loss_fn_outputs):
            np.testing.assert_array_equal(a["logprobs"], b["logprobs"])
        for k in ids:
            for name, g in tr.gradients(k).items():
                np.testing.assert_array_equal(grads[k][name], g, err_msg=name)
            tr.optim_step(k, jcp.AdamParams(learning_rate=0.0))
    names = set()
    for group in np.array_split(ids, -(-n // lora_lib.DENSE_MAX_ADAPTERS)):
        assert len(group) <= lora_lib.DENSE_MAX_ADAPTERS
        group = [int(k) for k in group]
        alone = tr.forward_backward([data[k] for k in group], "cross_entropy", adapters=group)
        for k, out in zip(group, alone.loss_fn_outputs):
            np.testing.assert_allclose(
                fused.loss_fn_outputs[k]["logprobs"],
                out["logprobs"],
                rtol=1e-5,
                atol=1e-5,
                err_msg=str(k),
            )
            for name, g in tr.gradients(k).items():
                assert float(np.abs(g).max()) > 0, (k, name)
                np.testing.assert_allclose(
                    grads[k][name], g, rtol=1e-4, atol=1e-5 * float(np.abs(g).max()), err_msg=name
                )
                names.add(name)
            tr.optim_step(k, jcp.AdamParams(learning_rate=0.0))
    assert any("lm_head" in x for x in names) and any("mlp" in x for x in names)


def _train_datum(seed, n):
    import jcp

    rng = np.random.default_rng(100 + seed)
    vocab = jcp.QwenConfig.tiny().vocab_size
    return jcp.Datum(
        rng.integers(0, vocab, n),
        {"target_tokens": rng.integers(0, vocab, n), "weights": rng.uniform(size=n)},
    )


def test_sampling_over_many_adapters_equals_each_alone():
    """Prefill (spans) and decode (rows in any adapter order: the grouped row plan) of one
    Trainer.sample call over 8 adapters and the base model, and the same requests in one
    batch of the serving engine (extend and decode over its paged cache), give every prompt
    the tokens and log-probs it gets sampled alone (one adapter: the dense product). With
    lora_impl "cpu" (the default here) both read the factors from the slot tables' pages in
    place (lora.take_for_forward)."""
    import jcp
    from jcp.sample.engine import Engine

    cfg = jcp.QwenConfig.tiny()
    n = 8
    tr = jcp.Trainer(cfg, jcp.make_mesh(1, 1, 1), max_adapters=n, max_rank=8, logprob_chunk=16)
    targets = (["attn", "unembed"], ["mlp"], ["attn", "mlp", "unembed"])
    ids = [_random_adapter(tr, k, (4, 8)[k % 2], targets[k % 3], seed=50 + k) for k in range(n)]
    rng = np.random.default_rng(7)
    prompts = [
        rng.integers(0, cfg.vocab_size, int(rng.integers(3, 9))).tolist() for _ in range(n + 2)
    ]
    owners = [ids[(3 * i) % n] for i in range(n)] + [None, None]  # not in slot order
    sp = jcp.SamplingParams(max_tokens=6, temperature=0.0)
    together = tr.sample(prompts, sp, adapters=owners)
    assert n > lora_lib.DENSE_MAX_ADAPTERS
    eng = Engine(tr.make_sampler(), slots=len(prompts), max_len=16, chunk=4, max_chunk=4)
    rids = [eng.submit(p, sp, a) for p, a in zip(prompts, owners)]
    eng.run()
    served = [eng.result(r) for r in rids]
    assert lora_lib.reads_in_place(tr.state.meta.page_GK, np.arange(n), kernel=True)
    base = tr.sample([prompts[0]], sp)[0].sequences[0].tokens.tolist()
    for p, a, got, engine in zip(prompts, owners, together, served):
        alone = tr.sample([p], sp, adapters=a)[0].sequences[0]
        for seq in (got.sequences[0], engine.sequences[0]):
            assert seq.tokens.tolist() == alone.tokens.tolist(), a
            np.testing.assert_allclose(seq.logprobs, alone.logprobs, rtol=1e-5, atol=1e-5)
    assert together[0].sequences[0].tokens.tolist() != base  # the adapters do change tokens


def test_a_pass_over_many_adapters_holds_their_factors_one_layer_at_a_time():
    """Peak memory against A (issue 33): a fused forward_backward over 64 adapters reads
    their factors from the pages inside the products and adds their gradients into the
    accumulators in place (train_step._paged_value_and_grad), so its compiled temporaries
    exceed those of a pass over one adapter by less than 3 layers' worth of the 64
    adapters' factors — where the gathered [L, A, …] copy and its stacked gradient took
    2·L = 6 (this pass held 1.54× one adapter's memory at A = 256, the gathered way)."""
    import jcp

    cfg = jcp.QwenConfig.tiny(num_layers=3)
    n = 64
    tr = jcp.Trainer(cfg, jcp.make_mesh(1, 1, 1), max_adapters=n, max_rank=8, remat=False)
    ids = [tr.create_adapter(rank=8, seed=k, targets=["attn", "mlp"]) for k in range(n)]
    data = [_train_datum(i, 8) for i in range(n)]
    temps = {}
    for a in (1, n):
        known = set(tr.forward_backward_programs)
        tr.forward_backward(data, "cross_entropy", adapters=[ids[i * a // n] for i in range(n)])
        (program,) = [p for k, p in tr.forward_backward_programs.items() if k not in known]
        temps[a] = program.memory_analysis().temp_size_in_bytes
    # One page (rank 8) of every module at one layer, for each of the n adapters.
    layer_bytes = n * sum(x[0, 0].nbytes for x in jax.tree.leaves(tr.state.weights))
    # (Read tile by tile, the 64 adapters' pass may hold less than the one adapter's,
    # which takes the gathered path.)
    assert temps[1] > 0 and temps[n] - temps[1] < 3 * layer_bytes, (temps, layer_bytes)
