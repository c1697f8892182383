"""The host-side layout of a sampling call (jcp.sample.layout), with NumPy alone: decode
rows, prefilled cache positions, prefill sources, adapter indices, stop tables, plans."""

from __future__ import annotations

import numpy as np
import pytest

from jcp import batch as batch_lib
from jcp.errors import InputError
from jcp.sample import layout as L


def test_call_layout_worked_example():
    """The docstring's example: dp·cp = 2, b_local = 2, prompts of 3 and 2 tokens."""
    p = L.Plan("batch", b_local=2, t_local=4, out_len=16, batch_bytes=0, split_bytes=0)
    lay = L.call_layout([3, 2], adapters=[1, 0], num_samples=1, p=p, dp=1, cp=2)
    assert lay.row_of.tolist() == [[2], [0]]
    assert lay.base.tolist() == [1, 0, 2, 0]
    assert lay.row_position.tolist() == [[0, -1, -1, -1], [-1] * 4, [0, 1, -1, -1], [-1] * 4]
    assert lay.adapter.tolist() == [0, L.PADDING, 1, L.PADDING]


def test_samples_share_a_prefill_and_rows_deal_round_robin():
    p = L.plan([5, 3], max_tokens=4, num_samples=3, dp=2, cp=1, row_bytes=10)
    assert (p.mode, p.b_local, p.t_local) == ("batch", 4, 64)
    lay = L.call_layout([5, 3], [7, 7], 3, p, dp=2, cp=1)
    rows = sorted(lay.row_of.reshape(-1).tolist())
    assert len(set(rows)) == 6 and rows == [0, 1, 2, 4, 5, 6]  # 3 per device of 2
    packed = batch_lib.pack(
        [
            batch_lib.CheckedDatum(np.arange(4), np.arange(1, 5), {}),
            batch_lib.CheckedDatum(np.arange(2), np.arange(1, 3), {}),
        ],
        [7, 7],
        2,
        1,
        8,
        4,
    )
    (pb,) = packed
    src = L.prefill_source(lay, pb.placements, [0, 1], pb.tokens.shape[-1], cp=1)
    for i, n in ((0, 4), (1, 2)):
        pl = next(x for x in pb.placements if x.index == i)
        for r in lay.row_of[i]:  # every sample's rows take the same stream rows
            want = pl.shard * pb.tokens.shape[-1] + pl.offset + np.arange(n)
            assert src[r, :n].tolist() == want.tolist()
            assert (src[r, n:] == -1).all()
            assert lay.row_position[r, :n].tolist() == list(range(n))


def test_split_layout_rows_follow_the_zigzag():
    p = L.plan([9], max_tokens=4, num_samples=1, dp=1, cp=2, row_bytes=1, cache_mode="split")
    lay = L.call_layout([9], [0], 1, p, dp=1, cp=2)
    (r,) = lay.row_of[0]
    # 8 prefill tokens over cp = 2: chunks of 2, rank 0 holds [0, 1, 6, 7], rank 1 [2..5].
    assert lay.row_position[r, :4].tolist() == [0, 1, 6, 7]
    assert lay.row_position[r, p.t_local : p.t_local + 4].tolist() == [2, 3, 4, 5]
    assert lay.base[r] == 4


def test_active_index_and_stop_table():
    ad = np.array([3, L.PADDING, 1, 3, -1], np.int64)
    active, index = L.active_index(ad, 4, -1)
    assert active.tolist() == [-1, 1, 3, -1]
    assert index.tolist() == [2, 0, 1, 2, 0]
    with pytest.raises(ValueError):
        L.active_index(ad, 2, -1)
    t = L.stop_table([(5,), (), (1, 2, 3)])
    assert t.shape == (3, 8) and t[2, :4].tolist() == [1, 2, 3, -1] and (t[1] == -1).all()


def test_plan_refuses_unknown_mode_and_splits_only_when_it_pays():
    with pytest.raises(InputError, match="cache_mode"):
        L.plan([3], 4, 1, 1, 2, 10, cache_mode="paged")
    big = 1 << 20
    assert L.plan([3000], 16, 1, 1, 2, big).mode == "split"
    assert L.plan([100] * 64, 16, 1, 1, 2, big).mode == "batch"
    assert L.plan([3000], 16, 1, 1, 1, big).mode == "batch"


def test_ladder_rungs_step_down_by_four_to_the_floor():
    # The engine's decode windows: few values, each the least rung that holds n.
    assert {L.ladder(n, 512, 8) for n in range(1, 513)} == {512, 128, 32, 8}
    assert [L.ladder(n, 512, 8) for n in (8, 9, 32, 33, 128, 129)] == [8, 32, 32, 128, 128, 512]
    assert {L.ladder(n, 256, 64) for n in range(1, 257)} == {256, 64}
    assert {L.ladder(n, 200, 64) for n in range(1, 201)} == {200, 64}
    assert L.ladder(1, 6, 8) == 6  # a floor above the whole cache: the whole cache
