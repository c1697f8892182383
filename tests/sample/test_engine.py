"""The continuous-batching engine (jcp.sample.engine) against HF generate + PEFT, forward,
and the same request served alone.

Evidence:
1. greedy tokens equal transformers' generate(do_sample=False) (its PeftModel for each of
   two adapters, the plain model for none) for requests that arrive at different steps,
   mixing adapters and greedy with sampled rows, at meshes (1,1,1) (the server tests) and
   (2,2,2);
2. every request — greedy or drawn with its own temperature / top-k / top-p / seed,
   stop set and max_tokens — equals Trainer.sample of that request alone (tokens exactly,
   log-probs fp32): batch mates and arrival step change nothing;
3. sampled log-probs (T = 1) and prompt log-probs equal tr.forward; submit_logprobs equals
   compute_logprobs;
4. a full engine makes admission wait (nothing dropped or corrupted); a cancelled request
   fails and its batch mates finish unchanged; an adapter changed mid-flight fails its
   requests clearly while others finish; bad input is refused with nothing queued.

One Trainer and one Engine per mesh (cached); tiny Qwen3; prompts < 16 tokens,
max_tokens ≤ 10, so one cache shape serves every call.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import gc
import math

import numpy as np
import peft
import pytest
import torch
from helpers import model_harness as MH

import jcp
from jcp.sample import warmup as warmup_lib
from jcp.sample.engine import Engine, EngineError, page_keys
from jcp.sample.params import STOP_WIDTH
from jcp.sample.requests import Request, Seq
from jcp.sample.runner import EngineDevice

PROMPTS = ([3, 17, 42, 8, 99, 1, 64, 30, 2, 77, 12], [50], [6, 7, 120, 33, 4], [11, 90])
MAX_TOKENS = 10
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
GREEDY = jcp.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, stop=[])
LP_ATOL = 2e-4


@functools.cache
def _world(root):
    hm = MH.hf_model("qwen3", tied=False, seed=11)
    pms, folders = [], []
    for k in range(2):
        cfg = peft.LoraConfig(
            r=4 + 4 * k,
            lora_alpha=8 + 4 * k,
            target_modules=TARGETS,
            lora_dropout=0.0,
            bias="none",
            task_type="CAUSAL_LM",
        )
        pm = peft.get_peft_model(copy.deepcopy(hm), cfg)
        g = torch.Generator().manual_seed(30 + k)
        with torch.no_grad():
            for name, p in pm.named_parameters():
                if "lora_B" in name:
                    p.copy_(0.05 * torch.randn(p.shape, generator=g))
        folder = f"{root}/adapter{k}"
        pm.eval().save_pretrained(folder)
        pms.append(pm)
        folders.append(folder)
    base = f"{root}/base"
    MH.save(hm, base)
    return hm, pms, base, folders


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("engine"))


@functools.cache
def _setup(mesh_shape, root):
    _, _, base, folders = _world(root)
    cfg, params = jcp.load_hf(base)
    tr = jcp.Trainer(
        cfg, jcp.make_mesh(*mesh_shape), base_params=params, max_adapters=3, max_rank=8
    )
    ids = [tr.load_peft(f) for f in folders]
    # max_chunk = chunk: every step decodes 4 tokens, so requests really join mid-flight.
    eng = Engine(tr.make_sampler(), slots=8, max_len=32, chunk=4, max_chunk=4)
    return tr, ids, eng


@functools.cache
def _hf_greedy(root, which):
    hm, pms, _, _ = _world(root)
    model = hm if which is None else pms[which]
    out = []
    with torch.no_grad():
        for p in PROMPTS:
            ids = torch.tensor([p])
            g = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=MAX_TOKENS,
                eos_token_id=None,
                pad_token_id=0,
            )
            out.append(g[0, len(p) :].numpy().astype(np.int32))
    return out


def _alone(tr, prompt, sp, adapter, n=1):
    return tr.sample([prompt], sp, adapters=adapter, num_samples=n)[0]


def _same(got, want, what):
    assert len(got.sequences) == len(want.sequences), what
    for j, (x, y) in enumerate(zip(got.sequences, want.sequences)):
        np.testing.assert_array_equal(x.tokens, y.tokens, err_msg=f"{what} sample {j}")
        np.testing.assert_allclose(
            x.logprobs, y.logprobs, atol=1e-5, rtol=0, err_msg=f"{what} sample {j}"
        )
        assert x.stop_reason == y.stop_reason, what


# Every axis at once: (1,2,2) and (2,2,1) here each compiled the engine (~8 CPU s apiece).
@pytest.mark.parametrize("mesh_shape", [(2, 2, 2)])  # (1,1,1): the server tests
def test_greedy_matches_hf_for_requests_arriving_at_different_steps(mesh_shape, root):
    tr, (a, b), eng = _setup(mesh_shape, root)
    assert (tr.dp, tr.cp, tr.tp) == mesh_shape
    want = {None: _hf_greedy(root, None), a: _hf_greedy(root, 0), b: _hf_greedy(root, 1)}
    # The adapters change what is generated, so mixing them is a real test.
    assert not np.array_equal(want[a][0], want[None][0])
    assert not np.array_equal(want[a][0], want[b][0])
    drawn = jcp.SamplingParams(
        max_tokens=7, temperature=0.8, top_k=20, top_p=0.9, seed=3, stop=[5, 9]
    )
    waves = [[(0, a), (1, None)], [(2, b), (3, a)], [(0, b), (2, None)]]
    rids, extra = [], None
    for w, wave in enumerate(waves):
        rids += [(eng.submit(PROMPTS[i], GREEDY, ad), i, ad) for i, ad in wave]
        if w == 1:  # a drawn request joins mid-flight with its own params
            extra = eng.submit(PROMPTS[2], drawn, b, num_samples=2)
        eng.step()
        assert eng.live > 0
    eng.run()
    for rid, i, ad in rids:
        (seq,) = eng.result(rid).sequences
        np.testing.assert_array_equal(seq.tokens, want[ad][i], err_msg=f"prompt {i} {ad}")
    _same(eng.result(extra), _alone(tr, PROMPTS[2], drawn, b, 2), "drawn request")
    assert eng.idle and eng.live == 0


def test_every_request_equals_itself_alone(root):
    """Per-row params, seeds, stops and max_tokens: results do not depend on batch mates."""
    tr, (a, b), eng = _setup((1, 1, 1), root)
    cases = [
        (PROMPTS[0], jcp.SamplingParams(max_tokens=9, temperature=1.0, seed=1, stop=[]), a, 3),
        (PROMPTS[1], jcp.SamplingParams(max_tokens=4, temperature=0.0, stop=[]), None, 1),
        (
            PROMPTS[2],
            jcp.SamplingParams(max_tokens=8, temperature=0.7, top_k=3, seed=2, stop=[]),
            b,
            2,
        ),
        (PROMPTS[3], jcp.SamplingParams(max_tokens=10, temperature=1.3, top_p=0.8, seed=4), a, 1),
    ]
    alone = [_alone(tr, p, sp, ad, n) for p, sp, ad, n in cases]
    # A stop set that really ends a sequence early: the first token the request draws.
    first = int(alone[0].sequences[0].tokens[2])
    stop_sp = jcp.SamplingParams(max_tokens=9, temperature=1.0, seed=1, stop=[first])
    cases.append((PROMPTS[0], stop_sp, a, 3))
    alone.append(_alone(tr, PROMPTS[0], stop_sp, a, 3))
    assert alone[-1].sequences[0].stop_reason == "stop"
    assert len(alone[-1].sequences[0].tokens) == 3
    assert len(alone[1].sequences[0].tokens) == 4
    rids = []
    for p, sp, ad, n in cases:  # one request joins per step
        rids.append(eng.submit(p, sp, ad, num_samples=n))
        eng.step()
    eng.run()
    for k, (rid, want) in enumerate(zip(rids, alone)):
        _same(eng.result(rid), want, f"case {k}")
    # A different seed really changes the draws.
    other = _alone(tr, PROMPTS[0], jcp.SamplingParams(max_tokens=9, seed=7, stop=[]), a)
    assert not np.array_equal(other.sequences[0].tokens, alone[0].sequences[0].tokens)


def _forward_logprobs(tr, prompt, tokens, adapter):
    full = np.concatenate([prompt, tokens]).astype(np.int32)
    d = jcp.Datum(
        model_input=full[:-1],
        loss_fn_inputs={"target_tokens": full[1:], "weights": np.zeros(len(full) - 1, np.float32)},
    )
    return tr.forward([d], adapters=adapter).loss_fn_outputs[0]["logprobs"]


def test_logprobs_equal_forward(root):
    tr, (a, b), eng = _setup((1, 2, 2), root)
    sp = jcp.SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=5, stop=[])
    rids = [
        eng.submit(PROMPTS[i], sp, ad, num_samples=2, prompt_logprobs=True)
        for i, ad in ((0, a), (2, b))
    ]
    lp_rids = [eng.submit_logprobs(PROMPTS[i], ad) for i, ad in ((0, a), (3, None))]
    eng.run()
    for rid, i, ad in zip(rids, (0, 2), (a, b)):
        r = eng.result(rid)
        p = np.asarray(PROMPTS[i])
        assert np.isnan(r.prompt_logprobs[0])
        for seq in r.sequences:
            lp = _forward_logprobs(tr, p, seq.tokens, ad)
            np.testing.assert_allclose(seq.logprobs, lp[len(p) - 1 :], atol=LP_ATOL, rtol=0)
            np.testing.assert_allclose(
                r.prompt_logprobs[1:], lp[: len(p) - 1], atol=LP_ATOL, rtol=0
            )
    want = tr.compute_logprobs([PROMPTS[0], PROMPTS[3]], adapters=[a, None])
    for rid, w in zip(lp_rids, want):
        np.testing.assert_array_equal(eng.result(rid), w)


def test_full_engine_makes_admission_wait(root):
    tr, (a, _), _ = _setup((1, 1, 1), root)
    eng = Engine(tr.make_sampler(), slots=4, max_len=32, chunk=4)
    sp = jcp.SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=9, stop=[])
    first = eng.submit(PROMPTS[0], sp, a, num_samples=3)
    second = eng.submit(PROMPTS[2], sp, None, num_samples=3)
    eng.step()
    assert eng.live == 3 and len(eng.waiting) == 1  # 3 + 3 > 4 slots: the second waits
    eng.run()
    _same(eng.result(first), _alone(tr, PROMPTS[0], sp, a, 3), "first")
    _same(eng.result(second), _alone(tr, PROMPTS[2], sp, None, 3), "second")


def test_an_ended_request_is_freed_without_the_cycle_collector(root):
    """A finished request's samples point back at it; the engine drops them when it ends,
    so reference counting frees it: a full run of the cycle collector pauses a serving
    process's threads for milliseconds (jcp/server/collector.py)."""
    tr, (a, _), eng = _setup((1, 1, 1), root)
    sp = jcp.SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=9, stop=[])
    gc.collect()
    gc.disable()
    try:
        rids = [eng.submit(PROMPTS[0], sp, a, num_samples=2), eng.submit(PROMPTS[1], sp, None)]
        eng.run()
        outs = [eng.result(r) for r in rids]
        left = [o for o in gc.get_objects() if isinstance(o, (Request, Seq))]
    finally:
        gc.enable()
    assert [len(o.sequences) for o in outs] == [2, 1]
    assert not left, f"{len(left)} requests and samples wait for the cycle collector"


def test_decode_chunks_grow_while_nothing_waits(root):
    """Decode chunk policy (Engine.decode_len; chunk 4, max_chunk 16: rungs 16, 4): a
    request alone decodes all its 10 tokens in one step; with hurry (work waiting outside)
    4 per step; while a request waits for rows, steps of the largest rung no live row ends
    before (4, 4, then 4 more where the rows end at 10), and the waiting one, admitted
    alone, again all at once. Every result equals the request served alone."""
    tr, (a, b), _ = _setup((1, 1, 1), root)
    eng = Engine(tr.make_sampler(), slots=4, max_len=32, chunk=4, max_chunk=16)
    sp = lambda n, seed: jcp.SamplingParams(
        max_tokens=n,
        temperature=1.0,
        seed=seed,  # noqa: E731
        stop=[],
    )
    counts = lambda rid: [len(t) for t in eng.requests[rid].tokens]  # noqa: E731
    got = {}
    r1 = eng.submit(PROMPTS[0], sp(10, 1), a, num_samples=2)
    eng.step()
    assert eng.finished(r1)
    got[r1] = (PROMPTS[0], sp(10, 1), a, 2)
    r2 = eng.submit(PROMPTS[2], sp(10, 2), None, num_samples=2)
    eng.step(hurry=True)
    assert counts(r2) == [4, 4]
    eng.step()
    assert eng.finished(r2)
    got[r2] = (PROMPTS[2], sp(10, 2), None, 2)
    r3 = eng.submit(PROMPTS[0], sp(10, 3), b, num_samples=3)
    r4 = eng.submit(PROMPTS[3], sp(9, 4), a, num_samples=3)
    seen = []
    while not eng.finished(r3):
        eng.step()
        assert len(eng.waiting) == 1  # 3 + 3 rows > 4 slots: r4 waits
        seen.append(counts(r3)[0] if not eng.finished(r3) else 10)
    assert seen == [4, 8, 10]
    eng.step()  # r4 admitted, alone: all 9 tokens in this step
    assert eng.finished(r4)
    got[r3], got[r4] = (PROMPTS[0], sp(10, 3), b, 3), (PROMPTS[3], sp(9, 4), a, 3)
    for rid, (p, spr, ad, n) in got.items():
        _same(eng.result(rid), _alone(tr, p, spr, ad, n), f"request {rid}")


def test_prefill_only_steps_change_no_result(root):
    """step(decode=False) (a server prefilling a burst's first arrivals while the rest
    still arrive): it admits and prefills, draws no token, and the requests then decode
    together; every result equals the request served alone."""
    tr, (a, b), _ = _setup((1, 1, 1), root)
    eng = Engine(tr.make_sampler(), slots=8, max_len=32, chunk=4, max_chunk=16)
    cases = [
        (PROMPTS[0], jcp.SamplingParams(max_tokens=9, temperature=1.0, seed=3, stop=[]), a, 3),
        (
            PROMPTS[2],
            jcp.SamplingParams(max_tokens=6, temperature=0.8, top_k=5, seed=4, stop=[]),
            b,
            2,
        ),
        (PROMPTS[3], jcp.SamplingParams(max_tokens=10, temperature=0.0, stop=[]), None, 2),
    ]
    rids = []
    for p, sp, ad, n in cases:  # one arrival per prefill-only step
        rids.append(eng.submit(p, sp, ad, num_samples=n))
        before = eng.prefilled
        assert eng.step(decode=False) == []
        assert eng.prefilled == before + len(p) - 1  # its prompt was prefilled now
        assert not eng.prefilling and eng.live == sum(c[3] for c in cases[: len(rids)])
        assert all(len(t) == 0 for r in rids for t in eng.requests[r].tokens)
    steps = eng.steps
    eng.run()
    assert eng.steps == steps + 1  # all decode together, to their ends, in one step
    for k, (rid, (p, sp, ad, n)) in enumerate(zip(rids, cases)):
        _same(eng.result(rid), _alone(tr, p, sp, ad, n), f"case {k}")


def test_decode_step_ends_where_the_batch_shrinks(root):
    """Rows of different ages (later arrivals, longer max_tokens): a step ends where the
    shortest rows end when the rows left then fit a smaller rows bucket (12 rows: 16 per
    device; 2 rows: 8), so the 10 short rows are not computed until the 2 long ones end;
    a lone pair decodes to its end at once. Each result = the request served alone."""
    tr, (a, _), _ = _setup((1, 1, 1), root)
    eng = Engine(tr.make_sampler(), slots=16, max_len=32, chunk=4, max_chunk=16)
    sp = lambda n, seed: jcp.SamplingParams(
        max_tokens=n,
        temperature=1.0,
        seed=seed,  # noqa: E731
        stop=[],
    )
    short = eng.submit(PROMPTS[0], sp(4, 1), a, num_samples=10)
    long = eng.submit(PROMPTS[2], sp(10, 2), None, num_samples=2)
    assert eng.step() == [short]  # 4 decode steps: the 10 short rows end, the batch shrinks
    assert [len(t) for t in eng.requests[long].tokens] == [4, 4]
    assert eng.step() == [long]  # 2 rows, one bucket: the 6 left at once
    _same(eng.result(short), _alone(tr, PROMPTS[0], sp(4, 1), a, 10), "short")
    _same(eng.result(long), _alone(tr, PROMPTS[2], sp(10, 2), None, 2), "long")


def test_a_light_tenants_step_runs_apart_and_changes_no_result(root):
    """bob's one row beside alice's 17 (slots 32: rows buckets 32, 16, 8): the first step
    prefills and decodes bob's row alone (admission.py, "Light steps") and ends his
    request while alice's prompt waits unprefilled; then alice's steps. Each result = the
    request served alone."""
    tr, (a, _), _ = _setup((1, 1, 1), root)
    eng = Engine(tr.make_sampler(), slots=32, max_len=32, chunk=4, max_chunk=4)
    sp = jcp.SamplingParams(max_tokens=4, temperature=1.0, seed=5, stop=[])
    alice = eng.submit(PROMPTS[0], sp, a, num_samples=17, tenant="alice")
    bob = eng.submit(PROMPTS[2], sp, None, tenant="bob")
    assert eng.light_next() and eng.light_next()  # a peek: still bob's step next
    assert eng.step() == [bob]
    assert eng.requests[alice].tokens == [[]] * 17 and eng.prefilled == len(PROMPTS[2]) - 1
    eng.run()
    _same(eng.result(bob), _alone(tr, PROMPTS[2], sp, None), "bob")
    _same(eng.result(alice), _alone(tr, PROMPTS[0], sp, a, 17), "alice")


def test_cancel_and_adapter_change_mid_flight(root):
    tr, _, _ = _setup((1, 1, 1), root)
    c = tr.create_adapter(rank=4, seed=3)
    try:
        eng = Engine(tr.make_sampler(), slots=8, max_len=32, chunk=2, max_chunk=2)
        keep = eng.submit(PROMPTS[0], GREEDY, None)
        gone = eng.submit(PROMPTS[2], GREEDY, None)
        changed = eng.submit(PROMPTS[3], GREEDY, c)
        eng.step()
        assert all(len(t) == 2 for t in eng.requests[keep].tokens)
        eng.cancel(gone)
        d = jcp.Datum(
            model_input=[1, 2, 3],
            loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1.0, 1.0, 1.0]},
        )
        tr.forward_backward([d], adapters=c)
        tr.optim_step(c, jcp.AdamParams(learning_rate=1e-2))
        eng.run()
        with pytest.raises(EngineError, match="cancelled"):
            eng.result(gone)
        with pytest.raises(EngineError, match=f"adapter {c} changed"):
            eng.result(changed)
        _same(eng.result(keep), _alone(tr, PROMPTS[0], GREEDY, None), "kept request")
    finally:
        tr.delete_adapter(c)


@pytest.mark.parametrize(
    "what,kwargs",
    [
        ("too long", dict(prompt=list(range(30)), sampling_params=GREEDY)),
        ("num_samples", dict(prompt=[1, 2], sampling_params=GREEDY, num_samples=9)),
        ("adapter", dict(prompt=[1, 2], sampling_params=GREEDY, adapter=2)),
        ("vocab", dict(prompt=[1, 1000], sampling_params=GREEDY)),
        ("params", dict(prompt=[1, 2], sampling_params=jcp.SamplingParams(top_p=0.0))),
    ],
)
def test_bad_requests_are_refused_with_nothing_queued(what, kwargs, root):
    _, _, eng = _setup((1, 1, 1), root)
    with pytest.raises(jcp.InputError):
        eng.submit(**kwargs)
    assert eng.idle and not eng.waiting


def _compiled(eng):
    p = eng.s.paged
    return len(p.extend) + len(p.decode) + len(p.copy)  # programs held (program_store)


def test_varied_requests_after_the_served_warm_up_compile_nothing(root, monkeypatch):
    """Every dynamic dimension is bucketed: after jcp-serve --warmup's set
    (serve.SAMPLING_WARMUP; one active adapter here, to keep it cheap; run on padding — of
    the extends every other one, as if the rest cost more than warmup.WARM_RUN_FLOPS: they
    are compiled, not run) on a small engine, varied requests — greedy, drawn and top-k / top-p rows, stop lists of 0
    to STOP_WIDTH ids (the edge admits no more), with and without prompt log-probs, any
    topk_sample_logprobs and topk_prompt_logprobs up to 4, compute_logprobs, joining at
    different steps, hurried or not; then random prompt lengths, num_samples and
    max_tokens joining a running batch, and alone — compile nothing (counted by jax's
    caches and by the engine's program_keys: no client-chosen width reaches a program
    shape)."""
    from jcp.serve import SAMPLING_WARMUP

    tr, (a, _), _ = _setup((1, 1, 1), root)
    eng = Engine(tr.make_sampler(), slots=8, max_len=64, chunk=4, prefill_tokens=16)
    every = lambda: _compiled(eng) + len(eng.s.prefill)  # noqa: E731
    before = every()
    costs, ran = [], []
    real_flops, real_extend = warmup_lib.flops, EngineDevice.extend
    # Every other extend program counts as costly (compiled, not run).
    monkeypatch.setattr(
        warmup_lib,
        "flops",
        lambda p: (costs.append(real_flops(p)), (0.0, math.inf)[len(costs) % 2])[1],
    )
    monkeypatch.setattr(
        EngineDevice, "extend", lambda self, *a: (ran.append(1), real_extend(self, *a))[1]
    )
    n = eng.warmup(**{**SAMPLING_WARMUP, "active": (1,)})
    monkeypatch.undo()
    assert every() - before == n == len(eng.program_keys)
    extends = [k for k in eng.program_keys if k[0] == "extend"]
    assert len(costs) == len(extends) >= 2 and len(ran) == len(extends) // 2
    assert min(costs) > 0  # XLA's cost analysis gives this backend's programs flops
    warm, compiled = set(eng.program_keys), every()
    eng.program_keys.clear()
    rng = np.random.default_rng(1)
    rids = []
    widths = [0, 1, 9, STOP_WIDTH, 3, 12]
    for step in range(6):
        length = int(rng.integers(2, 20))
        stop = rng.choice(np.arange(64, 128), widths[step], replace=False).tolist()
        sp = jcp.SamplingParams(
            max_tokens=int(rng.integers(1, 30)),
            stop=stop,
            temperature=[0.0, 1.0, 0.8][step % 3],
            seed=step,
            top_k=[-1, -1, 50, 1, -1, 7][step],
            top_p=[1.0, 0.9, 1.0][step % 3],
        )
        fields = jcp.PromptFields(
            topk_sample_logprobs=[0, 3, 64, 17, 1, 0][step],
            topk_prompt_logprobs=[0, 1, 4][step % 3],
        )
        rids.append(
            eng.submit(
                rng.integers(0, 128, length).tolist(),
                sp,
                a,
                num_samples=int(rng.integers(1, 4)),
                prompt_logprobs=bool(step % 3 == 1),
                fields=fields,
            )
        )
        if step % 2:
            rids.append(eng.submit_logprobs(rng.integers(0, 128, length).tolist(), a))
        eng.step(hurry=bool(step % 3 == 2))
    eng.run()
    for rid in rids:
        eng.result(rid)
    drawn = jcp.SamplingParams(max_tokens=1, temperature=1.0, seed=0, stop=[])
    lengths = []

    def submit(length):
        n = int(rng.integers(1, min(24, 65 - length)))
        sp = dataclasses.replace(drawn, max_tokens=n, seed=n)
        samples = int(rng.integers(1, 5))
        lengths.append((eng.submit(rng.integers(0, 128, length).tolist(), sp, a, samples), n))

    for _wave in range(4):  # requests join a running batch
        for _ in range(2):
            submit(int(rng.integers(2, 41)))
        eng.step()
    eng.run()
    for length in rng.integers(2, 41, 3):  # alone
        submit(int(length))
        eng.run()
    for rid, n in lengths:
        assert all(len(x.tokens) == n for x in eng.result(rid).sequences)
    keys = eng.program_keys
    assert {k[0] for k in keys} == {"extend", "decode", "copy", "prefill"}
    assert len(keys) >= 5  # several shapes ran (decode lengths and draw kinds share one)
    assert keys <= warm, keys - warm
    assert every() == compiled


PAGED = dict(slots=8, max_len=32, chunk=4, max_chunk=4, page_size=4, prefill_tokens=8)


def test_prefix_cache_hit_equals_miss_and_samples_share_prompt_pages(root):
    """A prompt of 13 prefilled positions (3 full pages of 4 and one partial): its 3
    samples share the 3 full pages and each has its own partial page; pages held never
    exceed ⌈real length / page⌉ per sequence; the same prompt again (same adapter) takes
    the 3 cached pages and prefills 1 position — same tokens, log-probs and prompt
    log-probs as the miss; another adapter misses."""
    tr, (a, b), _ = _setup((1, 1, 1), root)
    eng = Engine(tr.make_sampler(), **PAGED)
    prompt = list(range(40, 54))
    sp = jcp.SamplingParams(max_tokens=8, temperature=1.0, seed=4, stop=[])
    rid = eng.submit(prompt, sp, a, num_samples=3, prompt_logprobs=True)
    shared = None
    while not eng.finished(rid):
        eng.step()
        seqs = [x for x in eng.requests[rid].seqs] if rid in eng.requests else []
        for x in seqs:
            written = len(prompt) - 1 + len(x.tokens) + PAGED["chunk"]
            assert len(x.pages) <= -(-written // 4), (len(x.pages), written)
        if seqs and all(x.decoding for x in seqs) and not all(x.done for x in seqs):
            tables = [x.pages for x in seqs]
            shared = tables[0][:3]
            assert all(t[:3] == shared for t in tables)
            tails = [t[3] for t in tables]
            assert len(set(tails)) == 3
            assert eng.pool.used(0) == len({p for t in tables for p in t})
    assert shared is not None
    miss = eng.result(rid)
    assert eng.pool.used(0) == 0 and sorted(eng.pool.lru[0]) == sorted(shared)
    assert eng.prefilled == 13 and eng.pool.hits == 0

    rid = eng.submit(prompt, sp, a, num_samples=3, prompt_logprobs=True)
    eng.run()
    hit = eng.result(rid)
    assert eng.prefilled == 14 and eng.pool.hits == 3  # one position prefilled, 3 pages hit
    _same(hit, miss, "prefix-cache hit vs miss")
    np.testing.assert_allclose(hit.prompt_logprobs, miss.prompt_logprobs, atol=1e-5, rtol=0)
    _same(miss, _alone(tr, prompt, sp, a, 3), "miss vs alone")

    rid = eng.submit(prompt, sp, b, num_samples=1)
    eng.run()
    other = eng.result(rid)
    assert eng.prefilled == 27 and eng.pool.hits == 3  # another adapter: no hit
    assert not np.array_equal(other.sequences[0].tokens, miss.sequences[0].tokens)


def test_prefix_cache_is_partitioned_by_salt(root):
    """jcp-serve salts each request with its tenant: the same base-model prompt under
    another salt misses the cached pages (hit counters, not timing), under the same salt
    hits them; unsalted requests keep the keys (and partition) they had before salts."""
    tr, _, _ = _setup((1, 1, 1), root)
    prompt = list(range(60, 74))  # 13 prefilled positions: 3 full pages of 4
    unsalted = page_keys(np.array(prompt), -1, -1, 4)
    assert unsalted == page_keys(np.array(prompt), -1, -1, 4, b"")
    assert set(unsalted).isdisjoint(page_keys(np.array(prompt), -1, -1, 4, b"alice"))
    eng = Engine(tr.make_sampler(), **PAGED)
    sp = jcp.SamplingParams(max_tokens=2, temperature=0.0, stop=[])

    def run(salt):
        hits, prefilled = eng.pool.hits, eng.prefilled
        rid = eng.submit(prompt, sp, None, salt=salt)
        eng.run()
        return eng.pool.hits - hits, eng.prefilled - prefilled, eng.result(rid)

    first = run("alice")
    assert first[:2] == (0, 13)
    assert run("bob")[:2] == (0, 13)  # alice's pages are cached, but not bob's to take
    assert run(None)[:2] == (0, 13)
    again = run("alice")
    assert again[:2] == (3, 1)
    assert run(b"bob")[:2] == (3, 1) and run(None)[:2] == (3, 1)
    _same(again[2], first[2], "hit vs miss")
    with pytest.raises(jcp.InputError, match="salt"):
        eng.submit(prompt, sp, None, salt=7)
    assert eng.idle


def test_long_prompt_prefills_over_steps_while_others_decode(root):
    """With 8 prompt tokens per step, a 25-position prompt prefills over 4 steps; the
    running request gains `chunk` tokens in every one of them; both equal alone."""
    tr, (a, _), _ = _setup((1, 1, 1), root)
    eng = Engine(tr.make_sampler(), **PAGED)
    run_sp = jcp.SamplingParams(max_tokens=22, temperature=0.0, stop=[])
    long_sp = jcp.SamplingParams(max_tokens=4, temperature=1.0, seed=3, stop=[])
    running = eng.submit(PROMPTS[2], run_sp, a)
    eng.step()
    long_prompt = list(range(100, 126))
    late = eng.submit(long_prompt, long_sp, None, prompt_logprobs=True)
    req = eng.requests[late]
    filled, counts = [], []
    for _ in range(4):
        eng.step()
        filled.append(req.groups[0].filled)
        counts.append(len(eng.requests[running].tokens[0]))
    assert filled == [8, 16, 24, 25]
    assert counts == [8, 12, 16, 20]  # 4 more tokens per step while the long prompt fills
    eng.run()
    _same(eng.result(running), _alone(tr, PROMPTS[2], run_sp, a), "running")
    got = eng.result(late)
    want = tr.sample([long_prompt], long_sp, prompt_logprobs=True)[0]
    _same(got, want, "long prompt")
    np.testing.assert_allclose(got.prompt_logprobs, want.prompt_logprobs, atol=1e-5, rtol=0)


def test_long_sequences_run_in_engine_steps_beside_short_ones(root):
    """long_len above max_len (jcp-serve: the token cap): a sequence longer than max_len
    (10 − 1 + 40 = 49 positions > 32: 13 pages of 4, on the table rung above max_len's 8
    pages) prefills and decodes over many steps beside a short request, each equal to
    Trainer.sample alone; one longer than long_len, or than one device's pages (seq_cap),
    is refused with nothing queued."""
    tr, (a, _), _ = _setup((1, 1, 1), root)
    eng = Engine(tr.make_sampler(), **PAGED, long_len=64)
    assert (eng.max_pages, eng.long_pages, eng.seq_cap) == (8, 16, 64)
    long_prompt = list(range(10, 20))
    long_sp = jcp.SamplingParams(max_tokens=40, temperature=0.9, seed=2, stop=[])
    short_sp = jcp.SamplingParams(max_tokens=6, temperature=0.0, stop=[])
    short = eng.submit(PROMPTS[3], short_sp, a)
    late = eng.submit(long_prompt, long_sp, a)
    steps = 0
    while not eng.idle:
        eng.step()
        steps += 1
    assert steps >= 40 // PAGED["max_chunk"]
    assert {k[2] for k in eng.program_keys if k[0] == "decode"} >= {8, 16}
    _same(eng.result(late), _alone(tr, long_prompt, long_sp, a), "long")
    _same(eng.result(short), _alone(tr, PROMPTS[3], short_sp, a), "short")
    with pytest.raises(jcp.InputError, match="64 positions"):
        eng.submit(long_prompt, jcp.SamplingParams(max_tokens=56), a)
    small = Engine(tr.make_sampler(), **{**PAGED, "pages": 12}, long_len=64)
    assert small.seq_cap == 48
    with pytest.raises(jcp.InputError, match="pages"):
        small.submit(long_prompt, long_sp, a)
    assert eng.idle and small.idle and not small.waiting
