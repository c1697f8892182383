"""jcp-serve's sampling path through the real Tinker SDK (0.38): every asample of every
tenant joins the one running engine batch; sampler weights as in-memory snapshots.

Evidence:
1. many concurrent requests from two tenants (one on an in-memory snapshot of a trained
   adapter, one on the base model; greedy and drawn, different seeds, num_samples) are
   decoded together (the engine held several requests' sequences at once, prefilled in
   prefill-only steps as they arrived) and each equals the same request served alone
   in-process (tokens exactly, log-probs fp32);
2. save_weights_and_get_sampling_client writes nothing to disk; a named save writes the
   PEFT folder, and a sampling client created after a re-save under the same name
   samples the new weights (not a cached older load);
3. the SDK 0.38 fields (topk_prompt_logprobs, topk_sample_logprobs, sparse
   target_prompt_logprobs, prompt_alt_tokens_k, prompt_logprobs_last_n) reach the SDK's
   SampleResponse equal to Trainer.sample with the same PromptFields (the sparse target
   layout comes back sparse; rows before last_n are None); a bad value fails that request
   naming the field;
4. cancelling an SDK sample future whose request is already decoding in the engine ends
   it at a step boundary (its slots freed) while a request beside it runs on and equals
   the same request served alone;
5. a gathered burst's first step is short (hurry) after a burst a straggler joined, and
   the burst is one engine step once the last bursts came whole (ADMIT_CALM_BURSTS);
   results equal alone either way.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import time

import numpy as np
import pytest

os.environ.setdefault("TINKER_TELEMETRY", "0")
tinker = pytest.importorskip("tinker")
from helpers.server_harness import client, serving  # noqa: E402
from tinker import types  # noqa: E402

import jcp  # noqa: E402

MODEL = "jcp-tiny"
KEYS = {"tml-alice": "alice", "tml-bob": "bob"}
ADAM = types.AdamParams(learning_rate=2e-2)


@pytest.fixture(scope="module")
def env():
    tr = jcp.Trainer(
        jcp.QwenConfig.tiny(),
        jcp.make_mesh(1, 2, 1),
        max_adapters=6,
        max_rank=8,
        attn_block=16,
        logprob_chunk=16,
    )
    with serving(
        tr,
        MODEL,
        KEYS,
        "jcp-serve-sampling-",
        sample_slots=16,
        sample_max_len=256,
        sample_chunk=8,
        prefill_tokens=512,
    ) as state:
        eng = state["srv"].worker.sampling
        assert (eng.slots, eng.max_len, eng.chunk, eng.prefill_tokens) == (16, 256, 8, 512)
        yield state


def test_engine_size_flags():
    from jcp.cli import CliError
    from jcp.serve import parse_args

    args = parse_args(
        [
            "--sample-slots",
            "64",
            "--sample-max-len",
            "512",
            "--sample-chunk",
            "4",
            "--prefill-tokens",
            "2048",
            "--warmup",
        ]
    )
    assert (
        args.sample_slots,
        args.sample_max_len,
        args.sample_chunk,
        args.prefill_tokens,
        args.warmup,
    ) == (64, 512, 4, 2048, True)
    assert parse_args([]).sample_slots is None and parse_args([]).warmup
    assert not parse_args(["--no-warmup"]).warmup
    for flag in ("--sample-slots", "--sample-max-len", "--sample-chunk", "--prefill-tokens"):
        with pytest.raises(CliError, match=flag):
            parse_args([flag, "0"])


def _train(tc, seed):
    rng = np.random.default_rng(seed)
    toks = rng.integers(0, jcp.QwenConfig.tiny().vocab_size, 17).tolist()
    d = types.Datum(
        model_input=types.ModelInput.from_ints(toks[:-1]),
        loss_fn_inputs={"target_tokens": toks[1:], "weights": [1.0] * 16},
    )
    tc.forward_backward([d], "cross_entropy").result()
    tc.optim_step(ADAM).result()


def _slot(env, tc):
    return env["srv"].store.models[tc.model_id].slot


def _sampler_folders(env):
    out = []
    for root, dirs, _ in os.walk(env["dir"]):
        if os.path.basename(root) == "sampler_weights":
            out += dirs
    return sorted(out)


def test_concurrent_tenants_each_equal_alone(env, monkeypatch):
    # Every arrival of the burst is prefilled in a prefill-only step as it comes (the
    # server's default, on an accelerator, waits for ADMIT_PREFILL_MIN of them): results
    # must not change.
    monkeypatch.setattr("jcp.server.worker.ADMIT_PREFILL", True)
    monkeypatch.setattr("jcp.server.worker.ADMIT_PREFILL_MIN", 1)
    tr = env["tr"]
    tc = (
        client(env, "tml-alice")
        .create_lora_training_client(base_model=MODEL, rank=4, seed=1)
        .result()
    )
    _train(tc, 0)
    before = _sampler_folders(env)
    sc_a = tc.save_weights_and_get_sampling_client().result()
    assert _sampler_folders(env) == before  # an in-memory snapshot: nothing on disk
    sc_b = client(env, "tml-bob").create_sampling_client(base_model=MODEL).result()
    rng = np.random.default_rng(3)
    reqs = []
    for k in range(12):
        prompt = rng.integers(0, 256, int(rng.integers(2, 12))).tolist()
        sp = dict(
            max_tokens=int(rng.integers(3, 12)),
            temperature=0.0 if k % 3 == 0 else 0.9,
            seed=100 + k,
            stop=[],
        )
        reqs.append((k % 2, prompt, sp, 1 + k % 3))
    sampling = env["srv"].worker.sampling
    peak, prefill_steps = sampling.peak_live, env["srv"].worker.prefill_steps
    with cf.ThreadPoolExecutor(len(reqs)) as pool:  # all in flight together
        futs = [
            pool.submit(
                lambda r: (
                    (sc_a, sc_b)[r[0]]
                    .sample(types.ModelInput.from_ints(r[1]), r[3], types.SamplingParams(**r[2]))
                    .result()
                ),
                r,
            )
            for r in reqs
        ]
        got = [f.result() for f in futs]
    assert sampling.peak_live > max(peak, 3)  # several requests decoded in one batch
    assert env["srv"].worker.prefill_steps > prefill_steps  # prefilled while arriving
    slot = _slot(env, tc)
    differ = 0
    for (tenant, prompt, sp, n), res in zip(reqs, got):
        ref = tr.sample(
            [prompt],
            jcp.SamplingParams(**sp),
            adapters=slot if tenant == 0 else None,
            num_samples=n,
        )[0]
        assert len(res.sequences) == n
        for s, r in zip(res.sequences, ref.sequences):
            assert list(s.tokens) == r.tokens.tolist()
            np.testing.assert_allclose(s.logprobs, r.logprobs, rtol=1e-5, atol=1e-6)
        if tenant == 0:
            base = tr.sample([prompt], jcp.SamplingParams(**sp), num_samples=n)[0]
            differ += any(
                b.tokens.tolist() != r.tokens.tolist()
                for b, r in zip(base.sequences, ref.sequences)
            )
    assert differ  # the snapshot really is not the base model


def test_a_burst_decodes_in_one_step_once_bursts_come_whole(env, monkeypatch):
    """A gathered burst's first engine step is short (hurry: stragglers join one chunk
    later) after a burst that a straggler joined; once the last ADMIT_CALM_BURSTS bursts
    came whole, a gathered burst decodes prefill + all its tokens in one step. Each
    result equals the request served alone."""
    import logging

    # The burst is gathered whole however slowly its requests arrive on a loaded machine.
    for name, value in (
        ("ADMIT_GAP_S", 2.0),
        ("ADMIT_BURST_GAP_S", 2.0),
        ("ADMIT_GAP_SCALE", None),
        ("ADMIT_WINDOW_S", 30.0),
        ("ADMIT_PREFILL", False),
        ("ADMIT_HURRY", False),
        ("ADMIT_CALM_BURSTS", 1),
        # Only this burst's tenant counts as sampling: a tenant of an earlier test still
        # inside its window would make the steps light / heavy alternations (docs/serving.md,
        # "Fairness across tenants") — a quick run of the module left one there.
        ("TENANT_WINDOW_S", 0.0),
    ):
        monkeypatch.setattr(f"jcp.server.worker.{name}", value)
    steps = []

    class Steps(logging.Handler):
        def emit(self, record):
            if hasattr(record, "step"):
                steps.append(record.step)

    log, handler = logging.getLogger("jcp.serve"), Steps()
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    sc = client(env, "tml-bob").create_sampling_client(base_model=MODEL).result()
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 256, int(rng.integers(2, 12))).tolist() for _ in range(4)]
    sp = dict(max_tokens=16, temperature=0.9, seed=7, stop=[])
    worker, sched = env["srv"].worker, env["srv"].scheduler
    step = worker.engine_step
    late = []

    def straggler(hurry, decode):  # a sample that comes while the burst's first step runs
        late.append(
            sc.sample(types.ModelInput.from_ints(prompts[0]), 1, types.SamplingParams(**sp))
        )
        _until(lambda: sched.samples_queued() > 0, "the straggler to queue")
        monkeypatch.setattr(worker, "engine_step", step)
        step(hurry, decode)

    def burst():
        del steps[:]
        with cf.ThreadPoolExecutor(len(prompts)) as pool:
            futs = [
                pool.submit(
                    lambda p: sc.sample(
                        types.ModelInput.from_ints(p), 2, types.SamplingParams(**sp)
                    ).result(),
                    p,
                )
                for p in prompts
            ]
            return [f.result() for f in futs], [(st["hurry"], st["ended"]) for st in steps]

    try:
        # A short first step, so that the straggler joins this burst (after a whole one
        # it would find the engine idle and be gathered as a burst of its own).
        monkeypatch.setattr("jcp.server.worker.ADMIT_HURRY", True)
        monkeypatch.setattr(worker, "engine_step", straggler)
        burst()
        late[0].result()
        monkeypatch.setattr("jcp.server.worker.ADMIT_HURRY", False)
        joined, joined_steps = burst()  # after a burst a straggler joined: hurried
        whole, whole_steps = burst()  # after one that came whole: one step
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    assert joined_steps == [(True, 0), (False, 4)]
    assert whole_steps == [(False, 4)]
    for p, a, b in zip(prompts, joined, whole):
        ref = env["tr"].sample([p], jcp.SamplingParams(**sp), num_samples=2)[0]
        for res in (a, b):
            for s, r in zip(res.sequences, ref.sequences):
                assert list(s.tokens) == r.tokens.tolist()
                np.testing.assert_allclose(s.logprobs, r.logprobs, rtol=1e-5, atol=1e-6)


def test_resave_under_the_same_name_is_sampled(env):
    tr = env["tr"]
    tc = (
        client(env, "tml-alice")
        .create_lora_training_client(base_model=MODEL, rank=4, seed=2)
        .result()
    )
    _train(tc, 1)
    prompt = types.ModelInput.from_ints([5, 9, 2, 7])
    greedy = types.SamplingParams(max_tokens=8, temperature=0.0, stop=[])
    path = tc.save_weights_for_sampler("again").result().path
    assert "again" in _sampler_folders(env)
    first = client(env, "tml-alice").create_sampling_client(model_path=path).result()
    old = list(first.sample(prompt, 1, greedy).result().sequences[0].tokens)
    for s in range(3):
        _train(tc, 10 + s)
    assert tc.save_weights_for_sampler("again").result().path == path
    second = client(env, "tml-alice").create_sampling_client(model_path=path).result()
    new = list(second.sample(prompt, 1, greedy).result().sequences[0].tokens)
    want = (
        tr.sample(
            [[5, 9, 2, 7]],
            jcp.SamplingParams(max_tokens=8, temperature=0.0, stop=[]),
            adapters=_slot(env, tc),
        )[0]
        .sequences[0]
        .tokens.tolist()
    )
    assert new == want
    assert new != old


def test_sdk_fields_equal_in_process(env):
    torch = pytest.importorskip("torch")
    tr = env["tr"]
    sc = client(env, "tml-bob").create_sampling_client(base_model=MODEL).result()
    prompt = [(7 * i + 3) % 256 for i in range(13)]
    ids = torch.full((12, 2), -1, dtype=torch.int64)
    ids[3, 0], ids[11, 0], ids[11, 1] = 7, 1, 200
    target = types.TensorData.from_torch_sparse(ids, pad_value=-1)
    assert target.sparse_crow_indices is not None  # sent sparse
    sp = dict(max_tokens=5, temperature=1.0, seed=7, stop=[])
    res = sc.sample(
        types.ModelInput.from_ints(prompt),
        2,
        types.SamplingParams(**sp),
        include_prompt_logprobs=True,
        topk_prompt_logprobs=4,
        topk_sample_logprobs=2,
        target_prompt_logprobs=target,
        prompt_alt_tokens_k=2,
        prompt_logprobs_last_n=5,
    ).result()
    fields = jcp.PromptFields(
        topk_prompt_logprobs=4,
        topk_sample_logprobs=2,
        prompt_logprobs_last_n=5,
        target_prompt_logprobs=ids.numpy(),
        prompt_alt_tokens_k=2,
    )
    ref = tr.sample(
        [prompt], jcp.SamplingParams(**sp), num_samples=2, prompt_logprobs=True, fields=fields
    )[0]
    assert res.prompt_logprobs[:8] == [None] * 8
    np.testing.assert_allclose(res.prompt_logprobs[8:], ref.prompt_logprobs[8:], atol=1e-5)
    assert res.topk_prompt_logprobs[:8] == [None] * 8
    for p in range(8, 13):
        got = res.topk_prompt_logprobs[p]
        assert [t for t, _ in got] == ref.topk_prompt_logprobs.token_ids[p].tolist()
        np.testing.assert_allclose(
            [x for _, x in got], ref.topk_prompt_logprobs.logprobs[p], atol=1e-5
        )
    t = res.target_prompt_logprobs
    assert t.sparse_crow_indices == target.sparse_crow_indices  # the request's layout
    assert t.sparse_col_indices == target.sparse_col_indices
    np.testing.assert_allclose(t.to_numpy(), ref.target_prompt_logprobs, atol=1e-5)
    assert np.count_nonzero(t.to_numpy()) == 3
    np.testing.assert_array_equal(
        res.prompt_alt_tokens.tokens.to_numpy(), ref.prompt_alt_tokens.token_ids
    )
    np.testing.assert_allclose(
        res.prompt_alt_tokens.logprobs.to_numpy(), ref.prompt_alt_tokens.logprobs, atol=1e-5
    )
    for s, r in zip(res.sequences, ref.sequences):
        assert list(s.tokens) == r.tokens.tolist()
        assert [
            [t for t, _ in row] for row in s.topk_logprobs
        ] == r.topk_logprobs.token_ids.tolist()
    with pytest.raises(Exception, match="topk_prompt_logprobs"):
        sc.sample(
            types.ModelInput.from_ints(prompt),
            1,
            types.SamplingParams(**sp),
            topk_prompt_logprobs=10_000,
        ).result()


def _until(cond, what, timeout=120.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


POLL = "/api/v1/retrieve_future"


def test_cancel_of_an_admitted_sample_frees_its_slots(env):
    tr = env["tr"]
    sampling = env["srv"].worker.sampling
    cancelled, polled = [], set()
    real_cancel = sampling.cancel
    sampling.cancel = lambda rid: (cancelled.append(rid), real_cancel(rid))[1]
    # The SDK sends cancel_future only from inside its polling loop: a cancel that lands
    # before the loop's first step (the SDK's thread behind the server's under load) ends
    # the future without one. So the victim is cancelled once both futures are polled.
    routes = env["srv"].app.routes
    real_poll = routes[POLL]
    routes[POLL] = lambda c, who, body: (
        polled.add(body.get("request_id")),
        real_poll(c, who, body),
    )[1]
    try:
        sc = client(env, "tml-bob").create_sampling_client(base_model=MODEL).result()
        endless = types.SamplingParams(max_tokens=250, temperature=0.0, stop=[])
        other_sp = dict(max_tokens=48, temperature=0.9, seed=5, stop=[])
        victim = sc.sample(types.ModelInput.from_ints([1, 2, 3]), 3, endless)
        other = sc.sample(
            types.ModelInput.from_ints([4, 5, 6, 7]), 2, types.SamplingParams(**other_sp)
        )
        _until(lambda: sampling.live == 5, "both requests decoding in the engine")
        _until(lambda: len(polled) >= 2, "the SDK polling both futures")
        victim.future().cancel()
        _until(lambda: cancelled, "the SDK's cancel_future reached the engine")
        _until(lambda: cancelled[0] not in sampling.requests, "the victim ended")
        assert sampling.live <= 2  # the victim's three slots were freed
        got = other.result()
        assert len(cancelled) == 1
    finally:
        sampling.cancel, routes[POLL] = real_cancel, real_poll
    ref = tr.sample([[4, 5, 6, 7]], jcp.SamplingParams(**other_sp), num_samples=2)[0]
    for s, r in zip(got.sequences, ref.sequences):
        assert list(s.tokens) == r.tokens.tolist()
        np.testing.assert_allclose(s.logprobs, r.logprobs, rtol=1e-5, atol=1e-6)


def test_long_sample_runs_in_engine_steps_between_other_work(env):
    """A sample longer than the engine's rows per sequence (8 − 1 + 280 > 256) runs inside
    the engine, a decode chunk per step (it used to run whole, beside the engine, on the
    worker): bob's forward, queued with it, is served while alice's sample still decodes.
    (Long sequences equal Trainer.sample alone: test_engine.py.)"""
    srv = env["srv"]
    sampling, sched = srv.worker.sampling, srv.scheduler
    assert sampling.max_len == 256 and sampling.seq_cap >= 287
    sc = client(env, "tml-alice").create_sampling_client(base_model=MODEL).result()
    tb = (
        client(env, "tml-bob")
        .create_lora_training_client(base_model=MODEL, rank=4, seed=9)
        .result()
    )
    toks = list(range(30, 47))
    d = types.Datum(
        model_input=types.ModelInput.from_ints(toks[:-1]),
        loss_fn_inputs={"target_tokens": toks[1:], "weights": [1.0] * 16},
    )
    prompt, sp = list(range(1, 9)), dict(max_tokens=280, temperature=0.0, stop=[])
    steps = sampling.steps
    sched.hold()
    try:
        long = sc.sample(types.ModelInput.from_ints(prompt), 1, types.SamplingParams(**sp))
        short = tb.forward([d], "cross_entropy")
        _until(lambda: sched.pending() == 2, "both requests queued")
    finally:
        sched.release()
    assert short.result().metrics["loss:sum"] > 0
    assert not sampling.idle  # bob was served between the long sample's engine steps
    assert len(long.result().sequences[0].tokens) == 280
    assert sampling.steps - steps >= 280 // sampling.max_chunk


def test_stop_lists_are_bounded_at_the_edge(env):
    """A stop list the engine's one compiled stop width cannot hold (more than STOP_WIDTH
    ids, or text stops of more than MAX_STOP_CHARS) is refused at the edge — asample's
    refusals are failed futures of the "user" category, which the SDK raises without
    retrying — naming the field, with nothing queued; STOP_WIDTH ids are served."""
    from jcp.sample.params import STOP_WIDTH
    from jcp.server.edge import MAX_STOP_CHARS, MAX_STOPS

    assert MAX_STOPS == STOP_WIDTH
    srv = env["srv"]
    sc = client(env, "tml-bob").create_sampling_client(base_model=MODEL).result()
    prompt = types.ModelInput.from_ints([1, 2, 3])
    queued = srv.scheduler.counters.passes, srv.worker.sampling.steps
    for stop, why in (
        (list(range(MAX_STOPS + 1)), "at most 16 stop sequences"),
        (["x"] * (MAX_STOPS + 1), "at most 16 stop sequences"),
        ("x" * (MAX_STOP_CHARS + 1), "at most 256 characters"),
    ):
        with pytest.raises(tinker.RequestFailedError, match=f"stop: .*{why}"):
            sc.sample(prompt, 1, types.SamplingParams(max_tokens=2, stop=stop)).result()
    assert (srv.scheduler.counters.passes, srv.worker.sampling.steps) == queued
    out = sc.sample(
        prompt,
        1,
        types.SamplingParams(max_tokens=2, seed=1, stop=list(range(100, 100 + STOP_WIDTH))),
    ).result()
    assert len(out.sequences[0].tokens) >= 1


def test_a_heavy_prompt_beside_a_light_tenant_prefills_in_quarters_as_alone(env, monkeypatch):
    """While bob uses the engine (his sample done, still inside TENANT_WINDOW_S), a step
    serving only alice leaves him out: it prefills prefill_tokens / LIGHT_STEP_RATIO (512:
    128) of her 200-token prompt, not all of it, so his next request waits for a quarter
    of her prefill (issue 36, fairness). Her samples equal the request served alone."""
    from jcp.sample.admission import LIGHT_STEP_RATIO, Admission

    monkeypatch.setattr("jcp.server.worker.TENANT_WINDOW_S", 60.0)
    chunks = []
    real = Admission.prefill_work

    def prefill_work(self, tenants=None):
        work = real(self, tenants)
        chunks.extend((gr.seqs[0].req.tenant, c) for gr, c in work)
        return work

    monkeypatch.setattr(Admission, "prefill_work", prefill_work)
    sampling = env["srv"].worker.sampling
    quarter = sampling.prefill_tokens // LIGHT_STEP_RATIO
    bob = client(env, "tml-bob").create_sampling_client(base_model=MODEL).result()
    bob.sample(
        types.ModelInput.from_ints([1, 2, 3]), 1, types.SamplingParams(max_tokens=2)
    ).result()
    alice = client(env, "tml-alice").create_sampling_client(base_model=MODEL).result()
    prompt = np.random.default_rng(11).integers(0, 256, 201).tolist()
    sp = dict(max_tokens=6, temperature=0.9, seed=21, stop=[])
    got = alice.sample(types.ModelInput.from_ints(prompt), 2, types.SamplingParams(**sp)).result()
    hers = [c for t, c in chunks if t == "alice"]
    assert sum(hers) == 200 and max(hers) == quarter < 200, hers
    ref = env["tr"].sample([prompt], jcp.SamplingParams(**sp), num_samples=2)[0]
    for s, r in zip(got.sequences, ref.sequences):
        assert list(s.tokens) == r.tokens.tolist()
        np.testing.assert_allclose(s.logprobs, r.logprobs, rtol=1e-5, atol=1e-6)
