"""The adapter tables paged by rank (jcp/adapter_state.py): a slot costs what its rank
costs, the page count follows a memory budget, and where an adapter's pages lie changes
no value.

Evidence:
1. gather_pages / scatter_pages against NumPy: a row joins its pages along the rank axis in
   page order, a missing page (index ≥ P) reads zeros and is never written;
2. a budget of five pages holds adapters of rank 4, 16 and 8 (1 + 2 + 1 pages) and refuses
   a second rank 16 before any device work (state bit-identical); freed pages serve a
   rank-16 adapter across a gap, and it reads back exactly what was installed;
3. training on out-of-order pages across gaps (a small budget, fillers created and
   deleted around the loads) is bit-identical to training the same slots on pages in
   slot order: forward_backward outputs and gradients, optim_step metrics and the weights
   after it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import trainer_harness as H

import jcp
from jcp import adapter_state
from jcp import lora as lora_lib
from jcp.adapter_state import AdapterInfo

RANK16 = ("q_proj", "v_proj", "down_proj", "lm_head")


def test_gather_and_scatter_pages_match_numpy():
    rng = np.random.default_rng(0)
    a = rng.normal(size=(5, 2, 3, 2)).astype(np.float32)  # [P, L, I, r]
    b = rng.normal(size=(5, 2, 2, 4)).astype(np.float32)  # [P, L, r, O]
    pages = np.array([[3, 0], [5, 1]], np.int32)  # row 1: page 1 then no page
    ga = np.asarray(lora_lib.gather_pages("a", jnp.asarray(a), pages))
    gb = np.asarray(lora_lib.gather_pages("b", jnp.asarray(b), pages))
    assert ga.shape == (2, 2, 3, 4) and gb.shape == (2, 2, 4, 4)
    np.testing.assert_array_equal(ga[0], np.concatenate([a[3], a[0]], axis=-1))
    np.testing.assert_array_equal(ga[1], np.concatenate([np.zeros_like(a[0]), a[1]], axis=-1))
    np.testing.assert_array_equal(gb[0], np.concatenate([b[3], b[0]], axis=-2))

    va = rng.normal(size=ga.shape).astype(np.float32)
    out = np.asarray(lora_lib.scatter_pages("a", jnp.asarray(a), pages, va, add=True))
    want = a.copy()
    want[3] += va[0, ..., :2]
    want[0] += va[0, ..., 2:]
    want[1] += va[1, ..., 2:]  # va[1]'s first half had no page: dropped
    np.testing.assert_array_equal(out, want)
    put = np.asarray(lora_lib.scatter_pages("a", jnp.asarray(a), pages[:1], va[:1], add=False))
    want = a.copy()
    want[3], want[0] = va[0, ..., :2], va[0, ..., 2:]
    np.testing.assert_array_equal(put, want)


@pytest.fixture(scope="module")
def folder16(tmp_path_factory):
    w = H.random_peft_weights(H.CFG, 16, RANK16, seed=21)
    return H.write_peft(str(tmp_path_factory.mktemp("r16") / "a"), 16, 32.0, RANK16, w)


def _budget_trainer(pages: int):
    page = adapter_state.page_bytes(H.CFG, jcp.make_mesh(1, 1, 1), 8)
    return jcp.Trainer(
        H.CFG,
        jcp.make_mesh(1, 1, 1),
        max_adapters=8,
        max_rank=16,
        adapter_memory=pages * page + page // 2,
        attn_block=16,
        logprob_chunk=16,
    )


def test_budget_holds_ranks_not_slots(folder16):
    tr = _budget_trainer(5)
    st = tr.state
    assert (st.page_rank, st.pages_per_slot, st.num_pages) == (8, 2, 5)
    a4 = tr.create_adapter(rank=4, seed=1)
    a16 = tr.load_peft(folder16)
    a8 = tr.create_adapter(rank=8, seed=2)
    assert st.free_pages == 1 and st.room(8) and not st.room(16)
    pages = np.asarray(st.meta.page_GK)
    assert [int((pages[s] < 5).sum()) for s in (a4, a16, a8)] == [1, 2, 1]

    before = H.snapshot(tr)
    with pytest.raises(jcp.InputError, match="adapter memory is full: an adapter of rank 16"):
        tr.create_adapter(rank=16, seed=3)
    with pytest.raises(jcp.InputError, match="adapter memory is full"):
        tr.load_peft(folder16)
    H.assert_same_state(before, H.snapshot(tr))
    assert st.free_pages == 1

    tr.delete_adapter(a4)
    tr.delete_adapter(a8)
    info = AdapterInfo(rank=16, alpha=16.0, targets=("q_proj", "o_proj"))
    rng = np.random.default_rng(4)
    weights = {
        m: {k: rng.normal(size=s.shape).astype(np.float32) for k, s in ks.items()}
        for m, ks in st.layout(info).items()
    }
    slot = st.free_slot()
    st.install(slot, info, weights)
    row = np.asarray(st.meta.page_GK)[slot]
    assert row.tolist() == [0, 3], "a rank-16 slot across the gap its neighbours left"
    got = st.read(slot)
    for m, ab in weights.items():
        for k, v in ab.items():
            np.testing.assert_array_equal(got[m][k], v, err_msg=f"{m}.{k}")
    assert st.free_pages == 1 and H.max_abs(tr.adapter_weights(a16)) > 0


def _train(tr, ids, data):
    assign = [ids[n] for n in ("p", "s", "q", "r", "s", "p", "q")]
    fb = tr.forward_backward(data, "importance_sampling", adapters=assign)
    grads = {n: tr.gradients(a) for n, a in ids.items()}
    steps = {
        n: tr.optim_step(a, jcp.AdamParams(learning_rate=1e-2, weight_decay=0.1))
        for n, a in ids.items()
    }
    return fb, grads, steps, {n: tr.adapter_weights(a) for n, a in ids.items()}


def test_fragmented_pages_train_like_contiguous_rows(tmp_path, folder16):
    folders = H.adapter_folders(str(tmp_path))
    data = H.random_data(H.LENGTHS, seed=3)
    mesh = jcp.make_mesh(1, 1, 1)  # tp-sharded pages: test_lora_grouped's 12 adapters at (1,2,2)
    kw = dict(max_rank=16, attn_block=16, logprob_chunk=16)
    plain = jcp.Trainer(H.CFG, mesh, max_adapters=4, **kw)
    page = adapter_state.page_bytes(H.CFG, mesh, 8)
    assert page == plain.state.page_bytes
    paged = jcp.Trainer(H.CFG, mesh, max_adapters=16, adapter_memory=9 * page, **kw)

    ids_plain = {**H.load_adapters(plain, folders), "s": plain.load_peft(folder16)}
    # The same slots, other pages: fillers in high slots take the low pages first and
    # leave between the loads, so the rank-16 adapter gets pages across a gap.
    st = paged.state

    def filler(slot, rank):
        info = AdapterInfo(rank=rank, alpha=8.0, targets=("q_proj",))
        zeros = {
            m: {k: np.zeros(x.shape, np.float32) for k, x in ks.items()}
            for m, ks in st.layout(info).items()
        }
        st.install(slot, info, zeros)

    filler(15, 8), filler(14, 8), filler(13, 16)  # pages 0, 1, (2, 3)
    p = paged.load_peft(folders["p"])  # page 4
    paged.delete_adapter(14)
    q = paged.load_peft(folders["q"])  # page 1
    r = paged.load_peft(folders["r"])  # page 5
    paged.delete_adapter(13)
    paged.delete_adapter(15)
    ids_paged = {"p": p, "q": q, "r": r, "s": paged.load_peft(folder16)}  # pages 0, 2
    assert ids_paged == ids_plain
    rows = np.asarray(st.meta.page_GK)
    plain_rows = np.asarray(plain.state.meta.page_GK)
    got_rows = [rows[ids_paged[n]].tolist() for n in "pqrs"]
    assert got_rows != [plain_rows[ids_plain[n]].tolist() for n in "pqrs"]
    assert got_rows == [[4, 9], [1, 9], [5, 9], [0, 2]]

    want, got = _train(plain, ids_plain, data), _train(paged, ids_paged, data)
    for i, (w, g) in enumerate(zip(want[0].loss_fn_outputs, got[0].loss_fn_outputs)):
        for k in w:
            np.testing.assert_array_equal(np.asarray(w[k]), np.asarray(g[k]), err_msg=f"{i} {k}")
    for part in (1, 3):
        for n in "pqrs":
            for k, v in want[part][n].items():
                np.testing.assert_array_equal(v, got[part][n][k], err_msg=f"{part} {n} {k}")
    assert want[2] == got[2]
    assert H.max_abs(want[1]["s"]) > 0


def test_optim_step_writes_its_pages_in_place():
    """An AdamW step reads and writes the stepped slot's pages only: XLA's memory analysis
    of the compiled step holds no copy of a table (with a constant-zero write of the
    accumulator it copied every table, a step costing O(all pages))."""
    import jax

    from jcp import optim
    from jcp.mesh import replicate

    cfg, mesh = H.CFG, jcp.make_mesh(1, 1, 1)
    st = adapter_state.AdapterState(cfg, mesh, 256, 8)
    t = st.tables()
    table_bytes = sum(x.nbytes for x in jax.tree.leaves(t["grads"]))
    assert t["grads"]["q_proj"]["a"].shape[0] == 256
    step = optim.make_optim_step(mesh).lower(
        t["weights"],
        t["grads"],
        optim.OptState(mu=t["mu"], nu=t["nu"], count=t["count"]),
        *(
            replicate(mesh, x)
            for x in (
                np.int32(3),
                np.append(np.asarray(t["pages"])[3], 256).astype(np.int32),  # as step() does
                np.asarray([1e-3, 0.9, 0.95, 1e-8, 0.0, 1.0], np.float32),
            )
        ),
    )
    temp = step.compile().memory_analysis().temp_size_in_bytes
    assert temp < table_bytes / 8, (temp, table_bytes)


def test_offload_restore_and_snapshots_keep_every_adapter_exact():
    """Three adapters taking turns on two slots — offloaded with their gradients, restored,
    copied as snapshots that are deleted at once, as jcp-serve's sampler snapshots are —
    end bit for bit as each trained alone. Host page lists rewritten while a program that
    read them was still in flight (AdapterState.reset passed a view of its row) made this
    come out wrong about one run in two (weights off by up to 2e10)."""
    import jcp

    cfg = jcp.QwenConfig.tiny()
    mk = lambda: jcp.Trainer(cfg, jcp.make_mesh(1, 1, 1), max_adapters=2, max_rank=4)  # noqa: E731
    rng = np.random.default_rng(0)
    datum = {
        s: [
            jcp.Datum(
                rng.integers(0, cfg.vocab_size, 12),
                {"target_tokens": rng.integers(0, cfg.vocab_size, 12), "weights": np.ones(12)},
            )
            for _ in range(2)
        ]
        for s in (1, 2, 3)
    }
    adam = jcp.AdamParams(learning_rate=1e-2)
    tr = mk()
    ref = {}
    for s in datum:
        a = tr.create_adapter(rank=4, alpha=8.0, seed=s)
        for d in datum[s]:
            tr.forward_backward([d], "cross_entropy", adapters=a)
            tr.optim_step(a, adam)
        ref[s] = tr.adapter_weights(a)
        tr.delete_adapter(a)
    resident, saved, offloads = {}, {}, []

    def make_room(keep):
        if len(tr.adapters) >= 2:
            victim = next(v for v in resident if v != keep)
            saved[victim] = tr.offload_adapter(resident.pop(victim))
            offloads.append(victim)

    def slot(s):
        if s not in resident:
            make_room(s)
            resident[s] = (
                tr.restore_adapter(saved.pop(s))
                if s in saved
                else tr.create_adapter(rank=4, alpha=8.0, seed=s)
            )
        return resident[s]

    for step in range(2):
        for s in datum:
            tr.forward_backward([datum[s][step]], "cross_entropy", adapters=slot(s))
        for s in datum:
            tr.optim_step(slot(s), adam)
        for s in datum:
            a = slot(s)
            make_room(s)
            tr.delete_adapter(tr.copy_adapter(a))
    # Not the alone run again: every adapter was offloaded with a gradient or moments.
    assert set(offloads) == set(datum) and len(offloads) > len(datum)
    for s in datum:
        got = tr.adapter_weights(slot(s))
        assert got.keys() == ref[s].keys()
        for k in got:
            np.testing.assert_array_equal(got[k], ref[s][k], err_msg=f"{s} {k}")


def test_slot_writes_compile_per_leaf_and_page_count_and_free_pages_stay_zero(tmp_path):
    """An adapter's factors are written, copied and read one table leaf at a time
    (AdapterState.install / copy / read, adapter_tables.write_pages / copy_pages /
    read_pages), host arrays padded to whole pages: once an adapter of each page count has
    been installed, offloaded, restored and copied, adapters of any other rank and target
    set — created, installed with their moments and gradient, offloaded and restored,
    copied as a sampler snapshot, saved as a checkpoint and loaded back — trace and compile
    nothing (the whole-slot programs compiled per rank and target set, orbax's
    replica-parallel writes a slice per array shape, and a load padded the checkpoint's
    device arrays in a program per rank: a stall for every tenant whenever one chose a new
    rank or target set; at tp = 2, so that shards have replicas). install
    writes only the factors it is given, so it relies on free pages being zero: narrow
    adapters placed on the pages wide ones trained and freed read zero in every module
    they do not target and beyond their rank, in all four tables."""
    cfg = jcp.QwenConfig.tiny()
    tr = jcp.Trainer(cfg, jcp.make_mesh(1, 1, 2), max_adapters=6, max_rank=16)
    assert (tr.state.page_rank, tr.state.pages_per_slot) == (8, 2)
    data = H.random_data((12, 9), seed=3)
    wide = [tr.create_adapter(rank=r, seed=r) for r in (16, 8)]  # 2 pages, then 1
    tr.forward_backward(data, "cross_entropy", adapters=wide)
    for a in wide:
        tr.optim_step(a, jcp.AdamParams(learning_rate=1e-2))
    tr.forward_backward(data, "cross_entropy", adapters=wide)  # gradients left in the pages
    wide = [tr.restore_adapter(tr.offload_adapter(a)) for a in wide]
    wide += [tr.copy_adapter(a) for a in wide]
    used = {int(p) for p in np.asarray(tr.state.meta.page_GK)[wide].ravel()}
    for a in wide:
        tr.delete_adapter(a)

    rng = np.random.default_rng(0)
    kinds = ((3, ["attn"]), (12, ["mlp"]), (5, ["unembed"]), (1, ["q_proj", "down_proj"]))
    info = AdapterInfo(rank=7, alpha=3.0, targets=lora_lib.resolve_targets(["mlp"]))
    given = {
        name: {
            m: {ab: rng.normal(size=s.shape).astype(np.float32) for ab, s in ks.items()}
            for m, ks in tr.state.layout(info).items()
        }
        for name in ("weights", "mu", "nu", "grads")
    }

    def slot_writes():
        out = {k: tr.create_adapter(rank=r, targets=t, seed=k) for k, (r, t) in enumerate(kinds)}
        tr.delete_adapter(out.pop(0))
        tr.state.install(0, info, given["weights"], given["mu"], given["nu"], 4, given["grads"])
        out["copy"] = tr.copy_adapter(out[1])
        return out

    slots, events = H.traces_and_compiles(slot_writes)
    assert events == [], events
    saved, events = H.traces_and_compiles(lambda: tr.offload_adapter(0))
    assert events == [], events
    slots["restored"], events = H.traces_and_compiles(lambda: tr.restore_adapter(saved))
    assert events == [], events
    exported, events = H.traces_and_compiles(lambda: tr.state.export(slots["restored"]))
    assert events == [], events
    _, events = H.traces_and_compiles(lambda: tr.save_state(slots["restored"], tmp_path / "c"))
    assert events == [], events
    loaded, events = H.traces_and_compiles(lambda: tr.load_state(tmp_path / "c"))
    assert events == [], events
    for name in ("weights", "mu", "nu"):
        got = tr.state.read(loaded, name)
        for m, ab in given[name].items():
            for k, v in ab.items():
                np.testing.assert_array_equal(got[m][k], v, err_msg=f"load {name} {m} {k}")
    tr.delete_adapter(loaded)
    assert int(exported.count) == 4
    for name in ("weights", "mu", "nu"):
        for m, ab in given[name].items():
            for k, v in ab.items():
                x = getattr(exported, name)[m][k]
                assert x.sharding == tr.state.layout(info)[m][k].sharding, (m, k)
                np.testing.assert_array_equal(np.asarray(x), v, err_msg=f"export {name} {m} {k}")
    # What was given reads back exactly; the copy holds its source's weights, fresh state.
    restored = slots["restored"]
    assert int(tr.state.tables()["count"][restored]) == 4
    for name in ("weights", "mu", "nu", "grads"):
        got = tr.state.read(restored, name)
        for m, ab in given[name].items():
            for k, v in ab.items():
                np.testing.assert_array_equal(got[m][k], v, err_msg=f"{name} {m} {k}")
    copied, source = tr.state.read(slots["copy"]), tr.state.read(slots[1])
    assert any(v.any() for ab in source.values() for v in ab.values())  # A (B is 0)
    for m, ab in source.items():
        for k, v in ab.items():
            np.testing.assert_array_equal(copied[m][k], v, err_msg=f"copy {m} {k}")
    # Every slot's rows hold zeros beyond its own targets and rank, on pages wide ones used.
    pages_GK = np.asarray(tr.state.meta.page_GK)
    assert used & {int(p) for p in pages_GK[list(slots.values())].ravel()}
    owners = {k: (kinds[k if k != "copy" else 1]) for k in slots if k != "restored"}
    owners = {k: (r, lora_lib.resolve_targets(t)) for k, (r, t) in owners.items()}
    owners["restored"] = (info.rank, info.targets)
    for name in ("weights", "grads", "mu", "nu"):
        rows = H.by_slot(jax.tree.map(np.asarray, tr.state.tables()[name]), pages_GK)
        for key, s in slots.items():
            rank, targets = owners[key]
            for m, ab in rows.items():
                for which, x in ab.items():
                    if m not in targets or (name != "weights" and key != "restored"):
                        assert not x[s].any(), (name, key, m, which)
                    ax = x[s].ndim - 1 if which.startswith("a") else x[s].ndim - 2
                    beyond = np.take(x[s], np.arange(rank, x[s].shape[ax]), axis=ax)
                    assert not beyond.any(), (name, key, m, which)
