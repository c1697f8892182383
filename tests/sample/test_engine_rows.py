"""The host arrays of the engine's device calls with NumPy alone (jcp.sample.engine_rows):
admission places real requests on two devices, and each call's rows must hold every group
or sequence in its own device's rows, its tokens, positions, pages and parameters there,
and padding (nothing to attend, nothing decoded) everywhere else."""

from __future__ import annotations

import numpy as np

from jcp.sample import engine_rows, layout
from jcp.sample.admission import Admission, Request
from jcp.sample.engine_config import EngineConfig, EngineSizes

BASE = -1


def _sizes() -> EngineSizes:
    """Two devices of 8 decode rows, 4-position pages, 32 prompt positions per step."""
    config = EngineConfig(
        slots=16, max_len=64, chunk=4, max_chunk=16, page_size=4, prefill_tokens=32
    )
    return EngineSizes.of(config, 2, 1024, False)


def _req(rid, prompt, num_samples=1, adapter=BASE, max_tokens=6) -> Request:
    params = {
        "max_tokens": max_tokens,
        "temperature": 0.5 + rid,
        "top_k": 3 + rid,
        "top_p": 0.9,
        "stop": (7,) * rid,
        "seed": rid,
    }
    version = -1 if adapter == BASE else 0
    prompt = np.asarray(prompt, np.int32)
    return Request(rid, prompt, adapter, version, params, num_samples, False)


def _admitted():
    """(admission, requests): three requests over both devices (the first fills most of
    device 0's rows, so the others spread), prompts of 23, 9 and 14 tokens."""
    z = _sizes()
    adm = Admission(z)
    reqs = [
        _req(0, np.arange(23) % 50, num_samples=6, adapter=2),
        _req(1, np.arange(9) + 100, num_samples=3),
        _req(2, np.arange(14) + 200, adapter=5),
    ]
    assert all(adm.admit(r) for r in reqs)
    assert {x.g for r in reqs for x in r.seqs} == {0, 1}  # really two devices
    return adm, reqs


def _active_index(adapter_B, rows_live):
    """Runner.active_index's contract, over a bucket of 4 entries."""
    assert all(adapter_B[i] != layout.PADDING for i in rows_live)
    return layout.active_index(adapter_B, 4, BASE)


def _check_extend(z, work):
    """extend_rows over one step's work: each group's chunk in its device's rows."""
    rows, active, at = engine_rows.extend_rows(work, z, _active_index)
    b, c_len = rows.tokens.shape
    assert b % z.groups == 0 and c_len >= max(c for _, c in work)
    e_b = b // z.groups
    seen = set()
    for group, c in work:
        lead, i, f = group.seqs[0], at[id(group)], group.filled
        assert i // e_b == lead.g and i not in seen
        seen.add(i)
        prompt = lead.req.prompt
        np.testing.assert_array_equal(rows.tokens[i, :c], prompt[f : f + c])
        np.testing.assert_array_equal(rows.targets[i, :c], prompt[f + 1 : f + c + 1])
        assert rows.valid[i].tolist() == [True] * c + [False] * (c_len - c)
        assert rows.start[i] == f and active[rows.index[i]] == lead.req.adapter
        assert rows.table[i, : len(lead.pages)].tolist() == lead.pages
        assert (rows.table[i, len(lead.pages) :] == -1).all()
    for i in set(range(b)) - seen:  # padding: nothing valid, no page
        assert not rows.valid[i].any() and (rows.table[i] == -1).all()
    assert (rows.slot == z.b_local).all()  # no recurrent-state rows (not hybrid)


def _prefill(adm, check=None) -> list:
    """Prefill every prompt, step by step as Engine._prefill does -> the fork copies;
    check(work) sees each step's work (pages grown)."""
    copies = []
    while adm.prefilling:
        work = adm.prefill_work()
        for group, c in work:
            adm.grow(group.seqs[0], group.filled + c)
        if check is not None:
            check(work)
        for group, c in work:
            group.filled += c
            if group.filled >= group.seqs[0].req.n:
                adm.end_prefill(group, copies)
    return copies


def test_extend_rows_put_each_group_in_its_device_rows():
    adm, reqs = _admitted()
    chunks = []

    def check(work):
        _check_extend(adm.sizes, work)
        chunks.append([c for _, c in work])

    _prefill(adm, check)
    # The first step prefills the 22 + 8 positions of the first two prompts and 2 of the
    # third, whose next chunk starts at 2: the rows of a later chunk were checked too.
    assert chunks == [[22, 8, 2], [11]]


def test_decode_rows_and_fork_copies():
    adm, reqs = _admitted()
    z = adm.sizes
    copies = _prefill(adm)
    live = adm.serving(None)
    assert len(live) == 10 and copies

    src, dst, rec_src, rec_dst = engine_rows.copy_rows(copies, z)
    n = len(src) // z.groups
    for g in range(z.groups):
        mine = [(a, b) for d, a, b, kind in copies if d == g and kind == "page"]
        got = list(zip(src[g * n : (g + 1) * n].tolist(), dst[g * n : (g + 1) * n].tolist()))
        assert got[: len(mine)] == mine
        assert all(b == z.n_pages for _, b in got[len(mine) :])  # no copy
    assert (rec_dst == z.b_local).all()  # no state rows to copy

    table, rows, active, slot, at = engine_rows.decode_rows(live, 5, z, _active_index)
    b = len(rows.token)
    w_b = b // z.groups
    assert (rows.steps == 5).all() and (slot == z.b_local).all()
    for seq in live:
        req, i = seq.req, at[id(seq)]
        assert i // w_b == seq.g
        assert rows.token[i] == req.prompt[-1] and rows.position[i] == req.n
        assert not rows.done[i] and rows.count[i] == 0
        assert rows.max_tokens[i] == req.params["max_tokens"]
        assert rows.temperature[i] == np.float32(req.params["temperature"])
        assert rows.top_k[i] == req.params["top_k"]
        np.testing.assert_array_equal(rows.keys[i], req.keys[seq.j])
        assert active[rows.index[i]] == req.adapter
        assert rows.stop[i, : len(req.params["stop"])].tolist() == list(req.params["stop"])
        assert table[i, : len(seq.pages)].tolist() == seq.pages
    padding = set(range(b)) - {at[id(x)] for x in live}
    assert padding and all(rows.done[i] and (table[i] == -1).all() for i in padding)
