"""jcp-serve's sampling path through the real Tinker SDK (0.38): every asample of every
tenant joins the one running engine batch; sampler weights as in-memory snapshots.

Evidence:
1. many concurrent requests from two tenants (one on an in-memory snapshot of a trained
   adapter, one on the base model; greedy and drawn, different seeds, num_samples) are
   decoded together (the engine held several requests' sequences at once) and each
   equals the same request served alone in-process (tokens exactly, log-probs fp32);
2. save_weights_and_get_sampling_client writes nothing to disk; a named save writes the
   PEFT folder, and a sampling client created after a re-save under the same name
   samples the new weights (not a cached older load).
"""

from __future__ import annotations

import concurrent.futures as cf
import os

import numpy as np
import pytest

os.environ.setdefault("TINKER_TELEMETRY", "0")
tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

import jcp  # noqa: E402
from helpers.server_harness import client, serving  # noqa: E402

MODEL = "jcp-tiny"
KEYS = {"tml-alice": "alice", "tml-bob": "bob"}
ADAM = types.AdamParams(learning_rate=2e-2)


@pytest.fixture(scope="module")
def env():
    tr = jcp.Trainer(jcp.QwenConfig.tiny(), jcp.make_mesh(1, 2, 1), max_adapters=6,
                     max_rank=8, attn_block=16, logprob_chunk=16)
    with serving(tr, MODEL, KEYS, "jcp-serve-sampling-") as state:
        yield state


def _train(tc, seed):
    rng = np.random.default_rng(seed)
    toks = rng.integers(0, jcp.QwenConfig.tiny().vocab_size, 17).tolist()
    d = types.Datum(model_input=types.ModelInput.from_ints(toks[:-1]),
                    loss_fn_inputs={"target_tokens": toks[1:], "weights": [1.0] * 16})
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


def test_concurrent_tenants_each_equal_alone(env):
    tr = env["tr"]
    tc = client(env, "tml-alice").create_lora_training_client(base_model=MODEL, rank=4,
                                                               seed=1).result()
    _train(tc, 0)
    before = _sampler_folders(env)
    sc_a = tc.save_weights_and_get_sampling_client().result()
    assert _sampler_folders(env) == before  # an in-memory snapshot: nothing on disk
    sc_b = client(env, "tml-bob").create_sampling_client(base_model=MODEL).result()
    rng = np.random.default_rng(3)
    reqs = []
    for k in range(12):
        prompt = rng.integers(0, 256, int(rng.integers(2, 12))).tolist()
        sp = dict(max_tokens=int(rng.integers(3, 12)),
                  temperature=0.0 if k % 3 == 0 else 0.9, seed=100 + k, stop=[])
        reqs.append((k % 2, prompt, sp, 1 + k % 3))
    sampling = env["srv"].engine.sampling
    peak = sampling.peak_live
    with cf.ThreadPoolExecutor(len(reqs)) as pool:  # all in flight together
        futs = [pool.submit(lambda r: (sc_a, sc_b)[r[0]].sample(
            types.ModelInput.from_ints(r[1]), r[3], types.SamplingParams(**r[2])).result(), r)
            for r in reqs]
        got = [f.result() for f in futs]
    assert sampling.peak_live > max(peak, 3)  # several requests decoded in one batch
    slot = _slot(env, tc)
    differ = 0
    for (tenant, prompt, sp, n), res in zip(reqs, got):
        ref = tr.sample([prompt], jcp.SamplingParams(**sp),
                        adapters=slot if tenant == 0 else None, num_samples=n)[0]
        assert len(res.sequences) == n
        for s, r in zip(res.sequences, ref.sequences):
            assert list(s.tokens) == r.tokens.tolist()
            np.testing.assert_allclose(s.logprobs, r.logprobs, rtol=1e-5, atol=1e-6)
        if tenant == 0:
            base = tr.sample([prompt], jcp.SamplingParams(**sp), num_samples=n)[0]
            differ += any(b.tokens.tolist() != r.tokens.tolist()
                          for b, r in zip(base.sequences, ref.sequences))
    assert differ  # the snapshot really is not the base model


def test_resave_under_the_same_name_is_sampled(env):
    tr = env["tr"]
    tc = client(env, "tml-alice").create_lora_training_client(base_model=MODEL, rank=4,
                                                               seed=2).result()
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
    want = tr.sample([[5, 9, 2, 7]], jcp.SamplingParams(max_tokens=8, temperature=0.0,
                                                          stop=[]),
                     adapters=_slot(env, tc))[0].sequences[0].tokens.tolist()
    assert new == want
    assert new != old
