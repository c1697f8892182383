"""The engine's host policy with NumPy alone (no program compiled, no device array): the
page pool and prefix keys (jcp.sample.pages), the engine's sizes and buckets
(jcp.sample.engine_config), and admission — place, fork, grow, release, prefix hits,
recurrent-state rows and the decode length (jcp.sample.admission) — on plain records."""

from __future__ import annotations

import numpy as np
import pytest

from jcp.sample.admission import Admission, Request
from jcp.sample.engine_config import EngineConfig, EngineSizes, rungs
from jcp.sample.pages import PagePool, page_keys


def _sizes(groups=1, hybrid=False, **kw) -> EngineSizes:
    kw = {
        "slots": 4 * groups,
        "max_len": 32,
        "chunk": 4,
        "max_chunk": 16,
        "page_size": 4,
        "prefill_tokens": 16,
        **kw,
    }
    return EngineSizes.of(EngineConfig(**kw), groups, 1024, hybrid)


def _req(
    prompt, max_tokens=4, num_samples=1, adapter=-1, rid=0, salt=b"", prompt_logprobs=False
) -> Request:
    return Request(
        rid,
        np.asarray(prompt, np.int32),
        adapter,
        -1 if adapter < 0 else 0,
        {"max_tokens": max_tokens, "seed": 1, "stop": ()},
        num_samples,
        prompt_logprobs,
        salt=salt,
    )


# ---------------------------------------------------------------------- pages


def test_pool_takes_free_pages_then_evicts_the_least_recently_used_cached_page():
    pool = PagePool(groups=1, pages=3)
    a, b, c = pool.alloc(0), pool.alloc(0), pool.alloc(0)
    assert (a, b, c) == (0, 1, 2) and pool.used(0) == 3 and pool.available(0) == 0
    pool.register(0, b"ka", a, None)
    pool.register(0, b"kb", b, np.ones(4, np.float32))
    pool.release(0, b)  # cached: to the LRU, not the free list
    pool.release(0, a)
    pool.release(0, c)  # not cached: free again
    assert pool.used(0) == 0 and list(pool.lru[0]) == [b, a] and list(pool.free[0]) == [c]
    assert pool.available(0) == 3
    assert pool.alloc(0) == c  # the free list first
    assert pool.alloc(0) == b  # then the least recently released cached page, forgotten
    assert b"kb" not in pool.index[0] and b not in pool.logprobs[0]
    assert pool.lookup(0, [b"ka"], need_logprobs=False) == [a]


def test_pool_reference_counts_and_prefix_lookup():
    pool = PagePool(groups=2, pages=4)
    p = pool.alloc(1)
    pool.register(1, b"k0", p, None)
    pool.take(1, p)  # a second holder
    assert pool.ref[1][p] == 2 and pool.used(1) == 1
    pool.release(1, p)
    assert pool.ref[1][p] == 1 and not pool.lru[1]
    pool.release(1, p)
    assert list(pool.lru[1]) == [p] and pool.used(1) == 0
    pool.take(1, p)  # a hit takes it back out of the LRU
    assert not pool.lru[1] and pool.used(1) == 1
    q = pool.alloc(1)
    pool.register(1, b"k1", q, None)
    assert pool.lookup(1, [b"k0", b"k1", b"k2"], False) == [p, q]
    assert pool.lookup(1, [b"k1"], False) == [q] and pool.lookup(0, [b"k0"], False) == []
    assert pool.lookup(1, [b"k0"], need_logprobs=True) == []  # stored without log-probs
    pool.register(1, b"k0", p, np.zeros(4, np.float32))  # the same page: log-probs added
    assert pool.lookup(1, [b"k0"], need_logprobs=True) == [p]
    pool.reserved[1] += 2
    assert pool.available(1) == 4 - 2 - 2


def test_page_keys_chain_over_full_pages_and_partition_by_salt():
    prompt = np.arange(14)  # 13 prefilled positions: 3 full pages of 4
    keys = page_keys(prompt, -1, -1, 4)
    assert len(keys) == 3 and len(set(keys)) == 3
    assert keys == page_keys(prompt, -1, -1, 4, b"")
    assert page_keys(np.arange(10), -1, -1, 4) == keys[:2]  # a prefix shares its keys
    other = np.array(prompt)
    other[0] = 99
    assert set(page_keys(other, -1, -1, 4)).isdisjoint(keys)  # chained: page 0 changes all
    assert set(page_keys(prompt, 0, 1, 4)).isdisjoint(keys)  # adapter and version
    salted = page_keys(prompt, -1, -1, 4, b"alice")
    assert set(salted).isdisjoint(keys) and set(salted).isdisjoint(
        page_keys(prompt, -1, -1, 4, b"bob")
    )


# ---------------------------------------------------------------------- config and sizes


def test_config_is_validated_and_sizes_resolve_the_defaults():
    for bad in (
        {"slots": 0},
        {"chunk": 2.5},
        {"page_size": -1},
        {"pages": 0},
        {"max_chunk": 0},
        {"long_len": True},
        {"prefill_tokens": 0},
    ):
        with pytest.raises(ValueError, match=f"{next(iter(bad))} must be a positive integer"):
            EngineConfig(**bad)
    with pytest.raises(ValueError, match="multiple of dp·cp = 4"):
        EngineSizes.of(EngineConfig(slots=6), 4, 64, False)
    s = EngineSizes.of(
        EngineConfig(slots=8, max_len=32, chunk=4, page_size=4, long_len=64), 2, 96, hybrid=True
    )
    assert (s.b_local, s.max_pages, s.long_pages, s.n_pages, s.seq_cap) == (4, 8, 16, 32, 64)
    assert (s.max_chunk, s.prefill_tokens, s.prefill_rows, s.chunk_top) == (16, 96, 4, 32)
    assert s.min_stream == 16 and s.hybrid and not s.prefix_cache
    assert s.table_rungs() == [8, 16] and [s.table_width(n) for n in (1, 8, 9)] == [8, 8, 16]
    wide = EngineSizes.of(EngineConfig(max_len=256, page_size=4), 1, 96, False)
    assert wide.table_rungs() == [64, 16] and wide.table_width(17) == 64
    assert s.decode_rungs() == [16, 4] and rungs(512, 8) == [512, 128, 32, 8]
    assert s.pages_per_seq(13, 4) == 5
    small = EngineSizes.of(
        EngineConfig(max_len=32, page_size=4, pages=12, long_len=64), 1, 96, False
    )
    assert small.seq_cap == 48 and small.prefix_cache


# ---------------------------------------------------------------------- admission


def test_admit_reserves_the_worst_case_and_fork_shares_full_pages():
    """3 samples of a 14-token prompt (13 prefilled: 3 full pages + 1 partial) with
    max_tokens 4: the leader reserves its 3 full pages and 2 own, each other sample 2 own;
    the fork shares the full pages and copies the partial one."""
    adm = Admission(_sizes())
    req = _req(range(14), max_tokens=4, num_samples=3)
    assert adm.admit(req) and len(req.seqs) == 3 and req.keys.shape == (3, 2)
    assert [x.reserve for x in req.seqs] == [5, 2, 2] and adm.pool.reserved[0] == 9
    assert adm.rows_used == [3] and adm.prefilling == req.groups
    assert adm.prefill_work() == [(req.groups[0], 13)]
    lead = req.seqs[0]
    adm.grow(lead, 13)
    assert len(lead.pages) == 4 and lead.reserve == 1 and adm.pool.reserved[0] == 5
    copies = []
    adm.end_prefill(req.groups[0], copies)
    assert not adm.prefilling and adm.decoding == req.seqs
    for seq in req.seqs[1:]:
        assert seq.pages[:3] == lead.pages[:3] and seq.pages[3] != lead.pages[3]
    assert copies == [(0, lead.pages[3], x.pages[3], "page") for x in req.seqs[1:]]
    assert adm.pool.used(0) == 6 and adm.pool.ref[0][lead.pages[0]] == 3
    adm.remove(req)
    assert adm.pool.used(0) == 0 and adm.pool.reserved[0] == 0 and adm.rows_used == [0]
    assert not adm.decoding and all(x.done for x in req.seqs)


def test_place_prefers_one_device_then_spreads_then_waits():
    adm = Admission(_sizes(groups=2))  # 4 rows and 64 pages per device
    big = _req(range(5), num_samples=3)
    assert adm.place(big, []) == [(0, 3, [])]
    assert adm.admit(big) and adm.rows_used == [3, 0]
    spread = _req(range(5), num_samples=5, rid=1)  # no device has 5 rows: spread
    assert adm.place(spread, []) == [(1, 4, []), (0, 1, [])]
    assert adm.admit(spread) and adm.rows_used == [4, 4] and len(spread.groups) == 2
    last = _req(range(5), rid=2)  # no row left: it waits, nothing taken
    assert adm.place(last, []) is None and not adm.admit(last) and not last.seqs
    few = Admission(_sizes(groups=2, pages=4))  # pages, not rows, bound the second request
    assert few.admit(_req(range(9), max_tokens=8))  # 4 pages on device 0
    assert few.place(_req(range(9), max_tokens=8, num_samples=2), []) is None
    assert few.place(_req(range(9), max_tokens=8), []) == [(1, 1, [])]


def test_most_samples_bounds_what_could_ever_be_placed():
    """A request of more samples than most_samples could never be placed, even on an empty
    engine (Engine.submit refuses it instead of letting it wait at the head for ever)."""
    adm = Admission(_sizes(groups=2, pages=8))  # 4 rows and 8 pages of 4 per device
    # 9 prefilled positions (2 full pages) + 8 new: 3 own pages each -> 2 per device.
    assert adm.most_samples(9, 8) == 4
    assert adm.place(_req(range(10), max_tokens=8, num_samples=4), []) is not None
    assert adm.place(_req(range(10), max_tokens=8, num_samples=5), []) is None
    assert adm.most_samples(3, 1) == 8  # rows bound it: one page per sample
    assert adm.most_samples(40, 1) == 0  # the prompt alone fills a device


def test_prefix_hit_takes_cached_pages_within_its_salt():
    adm = Admission(_sizes())
    first = _req(range(14), salt=b"a")
    assert adm.admit(first)
    (group,) = first.groups
    adm.grow(group.seqs[0], 13)
    group.filled = 13
    adm.end_prefill(group, [])
    cached = group.seqs[0].pages[:3]
    adm.remove(first)
    assert sorted(adm.pool.lru[0]) == sorted(cached) and adm.pool.used(0) == 0
    other = _req(range(14), salt=b"b", rid=1)
    assert adm.admit(other) and other.groups[0].filled == 0 and adm.pool.hits == 0
    again = _req(range(14), salt=b"a", rid=2, num_samples=2)
    assert adm.admit(again) and again.groups[0].filled == 12 and adm.pool.hits == 3
    assert adm.pool.lookups == 9 and not adm.pool.lru[0]
    assert [x.reserve for x in again.seqs] == [1 + 1, 1 + 1]  # the partial page + own


def test_hybrid_sequences_take_the_lowest_free_state_row():
    adm = Admission(_sizes(hybrid=True))
    a, b = _req(range(6), num_samples=2), _req(range(6), rid=1)
    assert adm.admit(a) and adm.admit(b)
    assert [x.row for x in a.seqs + b.seqs] == [0, 1, 2]
    adm.remove(a)
    assert sorted(adm.free_rows[0]) == [0, 1, 3]
    c = _req(range(6), rid=2)
    assert adm.admit(c) and c.seqs[0].row == 0
    d = _req(range(6), rid=3, num_samples=2)  # 5 prefilled positions: 1 full page
    assert adm.admit(d) and [x.row for x in d.seqs] == [1, 3] and adm.rows_used == [4]
    lead, other = d.seqs
    adm.grow(lead, 5)
    copies = []
    adm.fork(d.groups[0], copies)
    assert other.pages[0] == lead.pages[0]
    assert copies == [(0, lead.pages[1], other.pages[1], "page"), (0, 1, 3, "row")]
    adm.reset()
    assert adm.free_rows == [[0, 1, 2, 3]] and adm.pool.used(0) == 0


def test_decode_len_follows_the_waiting_work_and_the_rows_left():
    adm = Admission(_sizes(groups=1, slots=16))  # chunk 4, max_chunk 16: rungs 16, 4
    assert adm.decode_len() == 4  # nothing decodes
    reqs = [_req(range(3), max_tokens=t, rid=i) for i, t in enumerate((40, 40))]
    for r in reqs:
        assert adm.admit(r)
        adm.end_prefill(r.groups[0], [])
    assert adm.decode_len() == 16  # nothing waits: the largest rung
    assert adm.decode_len(hurry=True) == 4
    assert adm.decode_len(waiting=True) == 16  # no row ends before 16
    short = _req(range(3), max_tokens=6, rid=9)
    assert adm.admit(short)
    adm.end_prefill(short.groups[0], [])
    assert adm.decode_len(waiting=True) == 4  # the short row ends before 16
    assert adm.decode_len() == 16  # 3 rows and 2 rows share the smallest rows bucket
    late = _req(range(40), max_tokens=4, rid=10)
    assert adm.admit(late) and adm.decode_len() == 4  # a prompt prefills: chunk
    adm.grow(late.seqs[0], 39)
    adm.end_prefill(late.groups[0], [])
    assert adm.decode_len() == 16
    for x in reqs[0].seqs + reqs[1].seqs + short.seqs:
        x.tokens = [0] * (x.req.params["max_tokens"] - 3)
    assert adm.decode_len() == 4  # every row ends by 4: the least rung covering them


def test_decode_len_shrinks_the_batch_when_the_rows_left_fit_a_smaller_bucket():
    adm = Admission(_sizes(groups=1, slots=32))  # rows buckets 32, 16, 8
    reqs = [_req(range(3), max_tokens=5 if i < 8 else 40, rid=i) for i in range(16)]
    for r in reqs:
        assert adm.admit(r)
        adm.end_prefill(r.groups[0], [])
    assert adm.sizes.rows_bucket(16) == 16 and adm.sizes.rows_bucket(8) == 8
    assert adm.decode_len() == 4  # 8 rows end by 5: stop before, at the largest rung ≤ 5
    for r in reqs[:8]:
        adm.remove(r)
    assert adm.decode_len() == 16


# ---------------------------------------------------------------------- tenants


def _tenant_req(tenant, rid, prompt_len=5, max_tokens=4, num_samples=1) -> Request:
    req = _req(range(prompt_len), max_tokens=max_tokens, num_samples=num_samples, rid=rid)
    req.tenant = tenant
    return req


def test_admission_goes_round_robin_over_tenants_in_order_within_each():
    """alice's burst queued first does not go first: tenants alternate, and each tenant's
    requests are admitted in the order they came."""
    from collections import deque

    adm = Admission(_sizes(slots=8))
    waiting = deque([_tenant_req("alice", i) for i in range(6)])
    waiting += [_tenant_req("bob", 10 + i) for i in range(2)]
    got = adm.admit_fair(waiting, active=1)
    assert [r.rid for r in got] == [0, 10, 1, 11, 2, 3, 4, 5] and not waiting


def test_one_tenants_head_that_does_not_fit_holds_back_only_that_tenant():
    from collections import deque

    adm = Admission(_sizes(slots=4))
    assert adm.admit(_tenant_req("alice", 0, num_samples=3))
    # alice's next needs 2 rows (1 left): it and her later ones wait; bob's goes in.
    waiting = deque([_tenant_req("alice", 1, num_samples=2), _tenant_req("alice", 2)])
    waiting.append(_tenant_req("bob", 3))
    assert [r.rid for r in adm.admit_fair(waiting, active=1)] == [3]
    assert [r.rid for r in waiting] == [1, 2]


def test_a_tenant_holds_at_most_its_share_while_others_use_the_engine():
    from collections import deque

    adm = Admission(_sizes(slots=8))
    waiting = deque([_tenant_req("alice", i) for i in range(8)])
    # Two tenants share the engine: alice takes 4 of the 8 rows, the rest are bob's.
    assert len(adm.admit_fair(waiting, active=2)) == 4 and adm.held("alice")[0] == 4
    waiting += [_tenant_req("bob", 20 + i) for i in range(5)]
    assert [r.rid for r in adm.admit_fair(waiting, active=2)] == [20, 21, 22, 23]
    # A tenant holding nothing may take more than its share (nothing starves) ...
    big = deque([_tenant_req("carol", 30, num_samples=5), _tenant_req("carol", 31)])
    fresh = Admission(_sizes(slots=8))
    assert [r.rid for r in fresh.admit_fair(big, active=2)] == [30] and len(big) == 1
    # ... but once over its share, it waits while another tenant is active; alone it may
    # take everything, as first come, first served.
    assert fresh.admit_fair(big, active=2) == []
    assert [r.rid for r in fresh.admit_fair(big, active=1)] == [31]
    # The pages count too: a share is half the pages.
    tight = Admission(_sizes(slots=8, max_len=32, pages=8))
    pages = deque([_tenant_req("dan", 40, prompt_len=14, max_tokens=2)])  # 4 pages
    pages.append(_tenant_req("dan", 41, prompt_len=5, max_tokens=2))  # 2 more
    assert [r.rid for r in tight.admit_fair(pages, active=2)] == [40] and len(pages) == 1
    assert [r.rid for r in tight.admit_fair(pages, active=1)] == [41]


# ---------------------------------------------------------------------- light steps


def _split_batch(light_rows=1, heavy_rows=17, slots=32):
    """alice holds heavy_rows rows (one request), bob light_rows (one request each)."""
    adm = Admission(_sizes(slots=slots))
    assert adm.admit(_tenant_req("alice", 0, num_samples=heavy_rows))
    for i in range(light_rows):
        assert adm.admit(_tenant_req("bob", 10 + i))
    return adm


def test_a_light_tenants_rows_step_apart_from_a_heavy_tenants_light_first():
    """bob's one row beside alice's 17 (rows buckets 32, 16, 8: together 32 rows, bob alone
    8 ≤ 32 / 4): the steps alternate, bob's rows alone first, then alice's alone — each
    step prefills and decodes only its tenants' groups and rows."""
    adm = _split_batch()
    assert adm.rows_by_tenant() == {"alice": [17], "bob": [1]}
    assert adm.split() == {"bob"}
    assert adm.step_tenants(commit=False) == {"bob"}  # a peek changes nothing
    assert adm.step_tenants() == {"bob"}
    bob = [gr for gr in adm.prefilling if gr.seqs[0].req.tenant == "bob"]
    assert [gr for gr, _ in adm.prefill_work({"bob"})] == bob
    assert [gr.seqs[0].req.tenant for gr, _ in adm.prefill_work({"alice"})] == ["alice"]
    for gr, c in adm.prefill_work():
        adm.grow(gr.seqs[0], c)
        gr.filled = c
        adm.end_prefill(gr, [])
    assert {x.req.tenant for x in adm.serving({"bob"})} == {"bob"}
    assert len(adm.serving({"alice"})) == 17 and len(adm.serving(None)) == 18
    assert adm.step_tenants() == {"alice"}
    assert adm.step_tenants() == {"bob"}
    # bob's rows end: alice alone again, every row in every step; bob's next request
    # goes first again.
    for x in adm.serving({"bob"}):
        adm.release(x)
    adm.decoding = [x for x in adm.decoding if not x.done]
    assert adm.split() is None and adm.step_tenants() is None
    assert adm.admit(_tenant_req("bob", 20))
    assert adm.step_tenants() == {"bob"}


def test_decode_len_of_a_light_step_follows_its_own_rows():
    """A step serving bob alone: his rows' max_tokens set the decode length, not alice's,
    and alice's prompt still prefilling does not shorten it."""
    adm = Admission(_sizes(slots=32))
    assert adm.admit(_tenant_req("alice", 0, prompt_len=14, num_samples=17, max_tokens=16))
    bob = _tenant_req("bob", 1, max_tokens=16)
    assert adm.admit(bob)
    gr = bob.groups[0]
    adm.grow(gr.seqs[0], bob.n)
    gr.filled = bob.n
    adm.end_prefill(gr, [])
    assert adm.prefilling and adm.decode_len() == 4  # alice prefills: chunk for all
    assert adm.decode_len(tenants={"bob"}) == 16  # bob's step: to his end


def test_the_batch_splits_only_where_the_light_step_is_much_smaller():
    """No split for one tenant, for tenants of equal rows, or where the light tenants'
    rows bucket is over a quarter of the whole batch's (bob 6 of 17 rows: 8 vs 32 rows
    splits; bob 10 beside alice 12: 16 vs 32 does not; a 16-slot engine never splits)."""
    assert _split_batch(light_rows=0).split() is None
    assert _split_batch(light_rows=6, heavy_rows=11).split() == {"bob"}
    assert _split_batch(light_rows=10, heavy_rows=12).split() is None
    assert _split_batch(light_rows=4, heavy_rows=4).split() is None
    assert _split_batch(light_rows=1, heavy_rows=12, slots=16).split() is None


def test_steps_that_leave_out_a_light_tenant_are_a_quarter_chunk():
    """While bob (light: one row, or none between his requests) is left out of a step,
    the step decodes chunk / 4 steps (chunk 4: 1), so his next request waits for that;
    his own step, or alice alone, decodes as before."""
    adm = _split_batch(heavy_rows=17, light_rows=1)
    for gr, c in adm.prefill_work():
        adm.grow(gr.seqs[0], c)
        gr.filled = c
        adm.end_prefill(gr, [])
    both = {"alice", "bob"}
    assert adm.decode_len(tenants={"alice"}) == 4  # no active tenants named: as before
    assert adm.decode_len(tenants={"alice"}, active=both) == 1
    assert adm.decode_len(tenants={"bob"}, active=both) == 4
    assert adm.decode_len(active={"alice"}) == 4  # one tenant alone
    for x in adm.serving({"bob"}):
        adm.release(x)
    adm.decoding = [x for x in adm.decoding if not x.done]
    assert adm.light_beside(None, both) and adm.decode_len(active=both) == 1
    assert not adm.light_beside(None, {"alice"})
