"""A heavy step's prefill while a light tenant waits (issue 36, fairness), host only.

The light steps (jcp.sample.admission, "Light steps") shortened the decode of a step that
leaves a light tenant out to a quarter chunk, but its prefill still took the whole
prefill_tokens budget (1,024 prompt tokens of alice's burst on jcp-serve's defaults), so
bob's next request still waited for that. Such a step now prefills prefill_tokens /
LIGHT_STEP_RATIO; bob's own step and a tenant alone prefill as before. The chunking
changes no result (tests/server/test_server_sampling.py compares a prompt prefilled so with the
same request served alone).
"""

from __future__ import annotations

from collections import deque

import numpy as np

from jcp.sample.admission import LIGHT_STEP_RATIO, Admission, Request
from jcp.sample.engine_config import EngineConfig, EngineSizes

PREFILL = 32


def _admission() -> Admission:
    config = EngineConfig(
        slots=32, max_len=128, chunk=4, max_chunk=16, page_size=4, prefill_tokens=PREFILL
    )
    return Admission(EngineSizes.of(config, 1, 1024, False))


def _req(tenant: str, rid: int, prompt_len: int, num_samples: int = 1) -> Request:
    req = Request(
        rid,
        np.arange(prompt_len, dtype=np.int32),
        -1,
        -1,
        {"max_tokens": 4, "seed": 1, "stop": ()},
        num_samples,
        False,
    )
    req.tenant = tenant
    return req


def _prefilled(adm: Admission, tenants=None) -> int:
    return sum(c for _, c in adm.prefill_work(tenants))


def test_a_step_that_leaves_a_light_tenant_out_prefills_a_quarter_budget():
    adm = _admission()
    # alice's long prompt (100 positions to prefill) alone: the whole budget, as before.
    assert [r.rid for r in adm.admit_fair(deque([_req("alice", 0, 101, 17)]), 1)] == [0]
    assert adm.users == 1 and _prefilled(adm) == PREFILL
    # bob uses the engine too but holds no rows (between his requests): a quarter.
    assert adm.admit_fair(deque(), 2) == [] and adm.users == 2
    assert _prefilled(adm) == PREFILL // LIGHT_STEP_RATIO
    # bob's request is admitted: his own step prefills his prompt in full, alice's step
    # (which leaves him out) a quarter; a step serving both is bounded too while ...
    bob = _req("bob", 1, 9)
    assert adm.admit_fair(deque([bob]), 2) == [bob]
    assert adm.split() == {"bob"}
    assert _prefilled(adm, {"bob"}) == 8
    assert _prefilled(adm, {"alice"}) == PREFILL // LIGHT_STEP_RATIO
    assert _prefilled(adm, None) == PREFILL  # ... no one is left out: in full
    # bob's request ends and his window passes: alice alone, the whole budget again.
    adm.remove(bob)
    assert adm.admit_fair(deque(), 1) == [] and _prefilled(adm, {"alice"}) == PREFILL


def test_leaves_light_is_light_beside_by_count():
    """The prefill bound and the quarter decode chunk use one predicate: a light tenant
    (fewer rows than an equal split, or none) left out of the step."""
    adm = _admission()
    adm.admit_fair(deque([_req("alice", 0, 5, 17), _req("bob", 1, 5)]), 2)
    for tenants in (None, {"alice"}, {"bob"}, {"alice", "bob"}):
        for active in ({"alice"}, {"alice", "bob"}, {"alice", "bob", "carol"}):
            users = len(active | {"alice", "bob"})
            assert adm.light_beside(tenants, active) == adm.leaves_light(tenants, users)
    assert adm.leaves_light({"alice"}, 2) and not adm.leaves_light({"bob"}, 2)
    assert not adm.leaves_light(None, 2) and adm.leaves_light(None, 3)
