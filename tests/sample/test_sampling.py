"""Trainer.sample / compute_logprobs against Hugging Face generate, tr.forward and itself.

Evidence:
1. greedy tokens equal transformers' generate(do_sample=False) — its PeftModel for the
   adapter, the plain model for adapters=None — for prompts of several lengths mixing
   both in one call, on tiny random Qwen3 (meshes (1,1,1), (1,2,2), (2,2,2)) and
   Qwen2 ((1,1,1), (2,2,2)); stops at the EOS ids of generation_config.json;
2. sampled log-probs (T = 1) and prompt log-probs equal tr.forward on the same tokens, at
   cp = 1 and cp = 2; compute_logprobs equals them too;
3. one call mixing adapters equals one call per adapter; seeds reproduce, samples differ;
   stop tokens and max_tokens end sequences with "stop" / "length";
4. top-k = 1 and temperature → 0 equal greedy; top-k / top-p draws stay in exactly the
   kept set (on a fixed distribution, many draws); the decode draw with its rows split
   over tp equals every tp rank drawing every row;
5. every bad input is refused with InputError and the adapter tables bit-identical;
6. the cp-split cache (cache_mode="split") gives HF's greedy tokens and the "batch" cache's
   log-probs at cp = 2 and 4 (dp = 1 and 2), its sampled log-probs equal tr.forward, and
   the automatic choice splits exactly when the "batch" cache is too big and splitting
   shrinks it.
7. prefill follows the Trainer's cp_attention: forced "ring" runs ring attention (ppermute
   in its program) and gives the gathered prefill's tokens and log-probs at cp = 2 and 4.

Trainers (and their compiled programs) are shared per (arch, mesh) in a module fixture;
every call uses max_tokens ≤ 16 and prompts < 48 tokens, so one cache bucket serves all.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers import hf_models
from helpers import model_harness as MH

import jcp
from jcp import sample as sample_lib

PROMPTS = ([3, 17, 42, 8, 99, 1, 64, 30, 2, 77, 12], [50], [6, 7, 120, 33, 4], [11, 90])
MAX_TOKENS = 12
LP_ATOL = 2e-4
ALL_TARGETS = [
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "lm_head",
]


def peft_model(hm, seed, r=4, alpha=8):
    """hm in peft's LoRA of every target, B randomised."""
    return hf_models.peft_model(hm, seed, r=r, lora_alpha=alpha, target_modules=ALL_TARGETS)


@functools.cache
def _world(arch, root):
    """(HF model, PEFT models, base folder, adapter folders) of one architecture."""
    hm = MH.hf_model(arch, tied=False, seed=11)
    pms, folders = [], []
    for k in range(2):
        pm = peft_model(hm, seed=20 + k, r=4 + 4 * k, alpha=8 + 4 * k)
        folder = f"{root}/{arch}/adapter{k}"
        pm.save_pretrained(folder)
        pms.append(pm)
        folders.append(folder)
    # EOS ids: a token the adapter's greedy continuation of prompt 0 reaches mid-way (so
    # some sequence really stops early), and one more.
    with torch.no_grad():
        ids = torch.tensor([PROMPTS[0]])
        free = (
            pms[0]
            .generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=MAX_TOKENS,
                eos_token_id=None,
                pad_token_id=0,
            )[0, len(PROMPTS[0]) :]
            .tolist()
        )
    eos = (free[MAX_TOKENS // 2], MH.V - 1 if free[MAX_TOKENS // 2] != MH.V - 1 else 0)
    hm.generation_config.eos_token_id = list(eos)
    hm.generation_config.pad_token_id = 0
    base = f"{root}/{arch}/base"
    MH.save(hm, base)
    return hm, pms, base, folders, eos


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("sampling"))


@functools.cache
def _trainer(arch, mesh_shape, root):
    _, _, base, folders, eos = _world(arch, root)
    cfg, params = jcp.load_hf(base)
    assert cfg.eos_token_ids == eos
    tr = jcp.Trainer(
        cfg, jcp.make_mesh(*mesh_shape), base_params=params, max_adapters=3, max_rank=8
    )
    ids = [tr.load_peft(f) for f in folders]
    return tr, ids


@functools.cache
def _hf_greedy(arch, root, which):
    """HF generate(do_sample=False) of every prompt, one at a time: which = None (base) or
    the PEFT adapter index."""
    hm, pms, _, _, eos = _world(arch, root)
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
                eos_token_id=list(eos),
                pad_token_id=0,
            )
            out.append(g[0, len(p) :].numpy().astype(np.int32))
    return out


def _tables(tr):
    return jax.tree.map(lambda x: np.asarray(jax.device_get(x)), tr.state.tables())


GREEDY = jcp.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
# cp = 2 without tp: test_logprobs_equal_forward and the cache tests below at (1,2,1); a
# greedy case there (~2.3 CPU s) added no axis to (1,2,2)'s and (2,2,2)'s.
CASES = [("qwen3", m) for m in ((1, 1, 1), (1, 2, 2), (2, 2, 2))] + [
    ("qwen2", m) for m in ((1, 1, 1), (2, 2, 2))
]


@pytest.mark.parametrize("arch,mesh_shape", CASES)
def test_greedy_matches_hf_generate(arch, mesh_shape, root):
    tr, (a, _) = _trainer(arch, mesh_shape, root)
    assert (tr.dp, tr.cp, tr.tp) == mesh_shape
    EOS = tr.cfg.eos_token_ids
    want_adapter, want_base = _hf_greedy(arch, root, 0), _hf_greedy(arch, root, None)
    # The adapter changes what is generated, so mixing it with the base model is a real test.
    assert any(not np.array_equal(x, y) for x, y in zip(want_adapter, want_base))
    assert any(x[-1] in EOS for x in want_adapter + want_base)  # some sequence stops early
    adapters = [a, None, a, None, None, a, a, None]
    prompts = list(PROMPTS) + list(PROMPTS)
    res = tr.sample(prompts, GREEDY, adapters=adapters)
    for i, (r, ad) in enumerate(zip(res, adapters)):
        want = (want_base if ad is None else want_adapter)[i % len(PROMPTS)]
        (seq,) = r.sequences
        np.testing.assert_array_equal(seq.tokens, want, err_msg=f"prompt {i} adapter {ad}")
        assert seq.stop_reason == ("stop" if want[-1] in EOS else "length")
        assert len(seq.tokens) == MAX_TOKENS or seq.stop_reason == "stop"
        assert r.prompt_logprobs is None


def _forward_logprobs(tr, prompt, tokens, adapter):
    """tr.forward's log-probs of prompt[1:] + tokens (positions 1 … of the full sequence)."""
    full = np.concatenate([prompt, tokens]).astype(np.int32)
    d = jcp.Datum(
        full[:-1], {"target_tokens": full[1:], "weights": np.zeros(len(full) - 1, np.float32)}
    )
    return tr.forward([d], adapters=adapter).loss_fn_outputs[0]["logprobs"]


@pytest.mark.parametrize(
    "mesh_shape,cache_mode", [((1, 1, 1), None), ((1, 2, 1), None), ((1, 2, 1), "split")]
)
def test_logprobs_equal_forward(mesh_shape, cache_mode, root):
    tr, (a, b) = _trainer("qwen3", mesh_shape, root)
    sp = jcp.SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=5)
    res = tr.sample(
        PROMPTS,
        sp,
        adapters=[a, b, None, a],
        num_samples=2,
        prompt_logprobs=True,
        cache_mode=cache_mode,
    )
    assert tr.sampler.last_plan.mode == (cache_mode or "batch")
    plain = tr.compute_logprobs(PROMPTS, adapters=[a, b, None, a])
    for i, (p, r, ad) in enumerate(zip(PROMPTS, res, [a, b, None, a])):
        assert len(r.sequences) == 2
        assert np.isnan(r.prompt_logprobs[0]) and r.prompt_logprobs.shape == (len(p),)
        np.testing.assert_array_equal(plain[i], r.prompt_logprobs)
        for seq in r.sequences:
            if ad is None:  # the base model: an adapter of zero scale in forward's terms
                continue
            lp = _forward_logprobs(tr, np.asarray(p), seq.tokens, ad)
            np.testing.assert_allclose(
                seq.logprobs,
                lp[len(p) - 1 :],
                atol=LP_ATOL,
                rtol=0,
                err_msg=f"prompt {i}: sampled log-probs",
            )
            np.testing.assert_allclose(
                r.prompt_logprobs[1:],
                lp[: len(p) - 1],
                atol=LP_ATOL,
                rtol=0,
                err_msg=f"prompt {i}: prompt log-probs",
            )
    # The base model's log-probs are the HF model's.
    hm = _world("qwen3", root)[0]
    with torch.no_grad():
        seq = res[2].sequences[0]
        full = torch.tensor(np.concatenate([PROMPTS[2], seq.tokens]))[None]
        ref = torch.log_softmax(hm(full).logits[0].double(), -1)
        ref = ref[torch.arange(full.shape[1] - 1), full[0, 1:]].numpy()
    np.testing.assert_allclose(seq.logprobs, ref[len(PROMPTS[2]) - 1 :], atol=LP_ATOL, rtol=0)
    np.testing.assert_allclose(
        res[2].prompt_logprobs[1:], ref[: len(PROMPTS[2]) - 1], atol=LP_ATOL, rtol=0
    )


@pytest.mark.parametrize("mesh_shape", [(2, 2, 2), (1, 4, 1)])
def test_split_cache_equals_batch_cache_and_hf_generate(mesh_shape, root):
    tr, (a, _) = _trainer("qwen3", mesh_shape, root)
    adapters = [a, None, a, None, None, a]
    prompts = list(PROMPTS) + list(PROMPTS[:2])
    res, plans = {}, {}
    for mode in ("batch", "split"):
        res[mode] = tr.sample(prompts, GREEDY, adapters=adapters, cache_mode=mode)
        plans[mode] = tr.sampler.last_plan
    # The two calls really used different layouts: "split" holds a sequence's rows over
    # cp (fewer per device, the decode batch spread over dp only).
    assert (plans["batch"].mode, plans["split"].mode) == ("batch", "split")
    assert plans["split"].t_local < plans["batch"].t_local
    want_adapter, want_base = _hf_greedy("qwen3", root, 0), _hf_greedy("qwen3", root, None)
    for i, ad in enumerate(adapters):
        want = (want_base if ad is None else want_adapter)[i % len(PROMPTS)]
        got_b, got_s = res["batch"][i].sequences[0], res["split"][i].sequences[0]
        np.testing.assert_array_equal(got_s.tokens, want, err_msg=f"prompt {i} adapter {ad}")
        np.testing.assert_array_equal(got_b.tokens, want, err_msg=f"prompt {i} adapter {ad}")
        assert got_s.stop_reason == got_b.stop_reason
        np.testing.assert_allclose(got_s.logprobs, got_b.logprobs, atol=1e-5, rtol=0)
    # Prompts of one token only: nothing to prefill, the cache starts empty.
    ones = [[p[0]] for p in PROMPTS]
    one_b = tr.sample(ones, GREEDY, adapters=a, cache_mode="batch")
    one_s = tr.sample(ones, GREEDY, adapters=a, cache_mode="split")
    for x, y in zip(one_b, one_s):
        np.testing.assert_array_equal(x.sequences[0].tokens, y.sequences[0].tokens)
        np.testing.assert_allclose(
            x.sequences[0].logprobs, y.sequences[0].logprobs, atol=1e-5, rtol=0
        )


def _prefill_jaxprs(tr, call):
    """(result of call(), the jaxpr text of every prefill program it ran)."""
    sampler = tr.sampler
    jitted, seen = sampler.prefill, []

    def spy(*args, **kwargs):
        traced = functools.partial(jitted.jitted, **kwargs)  # program_store.StoredPrograms' jit
        seen.append(str(jax.make_jaxpr(traced)(*args)))
        return jitted(*args, **kwargs)

    sampler.prefill = spy
    try:
        return call(), seen
    finally:
        sampler.prefill = jitted


@pytest.mark.parametrize("mesh_shape,cache_mode", [((1, 2, 1), None), ((1, 4, 1), "split")])
def test_ring_prefill_equals_gather_prefill(mesh_shape, cache_mode, root):
    """Trainer(cp_attention="ring") prefills over the ring, like training: same tokens and
    log-probs as the gathered prefill ("auto" gathers at this size)."""
    tr_auto, (a, b) = _trainer("qwen3", mesh_shape, root)
    _, _, base, folders, _ = _world("qwen3", root)
    cfg, params = jcp.load_hf(base)
    tr_ring = jcp.Trainer(
        cfg,
        jcp.make_mesh(*mesh_shape),
        base_params=params,
        max_adapters=3,
        max_rank=8,
        cp_attention="ring",
    )
    assert [tr_ring.load_peft(f) for f in folders] == [a, b]
    adapters = [a, None, b, a]
    res, jaxprs = {}, {}
    for name, tr in (("auto", tr_auto), ("ring", tr_ring)):
        res[name], jaxprs[name] = _prefill_jaxprs(
            tr,
            lambda tr=tr: tr.sample(
                PROMPTS, GREEDY, adapters=adapters, prompt_logprobs=True, cache_mode=cache_mode
            ),
        )
    # The ring really ran (K/V passed with ppermute) and the automatic choice gathered.
    assert jaxprs["ring"] and all("ppermute" in j for j in jaxprs["ring"])
    assert jaxprs["auto"] and not any("ppermute" in j for j in jaxprs["auto"])
    for i, (x, y) in enumerate(zip(res["auto"], res["ring"])):
        sx, sy = x.sequences[0], y.sequences[0]
        np.testing.assert_array_equal(sy.tokens, sx.tokens, err_msg=f"prompt {i}")
        np.testing.assert_allclose(sy.logprobs, sx.logprobs, atol=1e-5, rtol=0)
        np.testing.assert_allclose(y.prompt_logprobs, x.prompt_logprobs, atol=1e-5, rtol=0)
    lp = tr_ring.compute_logprobs(PROMPTS, adapters=adapters)
    for x, y in zip(lp, res["auto"]):
        np.testing.assert_allclose(x, y.prompt_logprobs, atol=1e-5, rtol=0)


def test_automatic_cache_mode(monkeypatch, root):
    """ "split" iff cp > 1, the "batch" cache is over the threshold and splitting shrinks it."""
    tr2, _ = _trainer("qwen3", (1, 2, 1), root)
    tr1, _ = _trainer("qwen3", (1, 1, 1), root)
    long = tr2.sampler.plan([3000], 16)  # one long sequence: "batch" idles a device
    assert long.mode == "batch"  # far below the default threshold
    # Per-device cache of "split" at cp = 2: half of "batch" (goal ≤ 1.2 / cp).
    assert long.split_bytes <= 1.2 / 2 * long.batch_bytes
    many = tr2.sampler.plan([100] * 64, 16)  # many short: splitting saves nothing
    assert many.split_bytes >= many.batch_bytes
    monkeypatch.setattr(
        sample_lib.layout, "SPLIT_ABOVE_BYTES", min(long.batch_bytes, many.batch_bytes) - 1
    )
    assert tr2.sampler.plan([3000], 16).mode == "split"
    assert tr2.sampler.plan([100] * 64, 16).mode == "batch"
    assert tr1.sampler.plan([3000], 16).mode == "batch"  # cp = 1: nothing to split over
    assert tr2.sampler.plan([3000], 16, cache_mode="batch").mode == "batch"
    assert tr2.sampler.plan([5], 4, cache_mode="split").mode == "split"


def test_mixed_adapters_equal_one_call_per_adapter(root):
    tr, (a, b) = _trainer("qwen3", (1, 2, 2), root)
    adapters = [b, a, None, b]
    mixed = tr.sample(PROMPTS, GREEDY, adapters=adapters)
    singles = [tr.sample([p], GREEDY, adapters=ad)[0] for p, ad in zip(PROMPTS, adapters)]
    # The adapters really differ from each other on these prompts.
    other = tr.sample(PROMPTS, GREEDY, adapters=[a, b, a, a])
    assert any(
        not np.array_equal(x.sequences[0].tokens, y.sequences[0].tokens)
        for x, y in zip(mixed, other)
    )
    for i, (m, s) in enumerate(zip(mixed, singles)):
        np.testing.assert_array_equal(
            m.sequences[0].tokens, s.sequences[0].tokens, err_msg=f"prompt {i}"
        )
        np.testing.assert_allclose(
            m.sequences[0].logprobs, s.sequences[0].logprobs, atol=1e-5, rtol=0
        )


def test_seeds_reproduce_and_samples_differ(root):
    tr, (a, _) = _trainer("qwen3", (1, 2, 2), root)
    sp = lambda seed: jcp.SamplingParams(max_tokens=MAX_TOKENS, seed=seed, stop=[])  # noqa: E731
    one = tr.sample(PROMPTS[:2], sp(1), adapters=a, num_samples=3)
    again = tr.sample(PROMPTS[:2], sp(1), adapters=a, num_samples=3)
    other = tr.sample(PROMPTS[:2], sp(2), adapters=a, num_samples=3)
    fresh = [tr.sample(PROMPTS[:2], sp(None), adapters=a, num_samples=3) for _ in range(2)]
    toks = lambda res: [s.tokens.tolist() for r in res for s in r.sequences]  # noqa: E731
    assert toks(one) == toks(again)
    assert toks(one) != toks(other)
    assert toks(fresh[0]) != toks(fresh[1])
    for r in one:  # the num_samples sequences of one prompt differ
        assert len({tuple(s.tokens) for s in r.sequences}) == 3
        assert all(len(s.tokens) == MAX_TOKENS and s.stop_reason == "length" for s in r.sequences)


def test_stop_tokens_and_max_tokens(root):
    tr, (a, _) = _trainer("qwen3", (1, 2, 1), root)
    free = tr.sample(
        PROMPTS, jcp.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, stop=[]), adapters=a
    )
    assert all(
        len(r.sequences[0].tokens) == MAX_TOKENS and r.sequences[0].stop_reason == "length"
        for r in free
    )
    toks = free[0].sequences[0].tokens
    stop_tok = int(toks[3])
    first = int(np.flatnonzero(toks == stop_tok)[0])
    res = tr.sample(
        PROMPTS,
        jcp.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, stop=[stop_tok]),
        adapters=a,
    )
    seq = res[0].sequences[0]
    np.testing.assert_array_equal(seq.tokens, toks[: first + 1])
    assert seq.stop_reason == "stop"
    for r, f in zip(res, free):  # the others stop at their own first stop token, if any
        hit = np.flatnonzero(f.sequences[0].tokens == stop_tok)
        n = hit[0] + 1 if hit.size else MAX_TOKENS
        np.testing.assert_array_equal(r.sequences[0].tokens, f.sequences[0].tokens[:n])
    short = tr.sample(
        PROMPTS, jcp.SamplingParams(max_tokens=3, temperature=0.0, stop=[]), adapters=a
    )
    for r, f in zip(short, free):
        np.testing.assert_array_equal(r.sequences[0].tokens, f.sequences[0].tokens[:3])
        assert r.sequences[0].stop_reason == "length"


def test_top_k1_and_cold_temperature_equal_greedy(root):
    tr, (a, _) = _trainer("qwen3", (1, 2, 1), root)
    greedy = tr.sample(PROMPTS, GREEDY, adapters=a)
    top1 = tr.sample(
        PROMPTS, jcp.SamplingParams(max_tokens=MAX_TOKENS, top_k=1, seed=3), adapters=a
    )
    cold = tr.sample(
        PROMPTS, jcp.SamplingParams(max_tokens=MAX_TOKENS, temperature=1e-7, seed=3), adapters=a
    )
    warm = tr.sample(PROMPTS, jcp.SamplingParams(max_tokens=MAX_TOKENS, seed=3), adapters=a)
    assert any(
        not np.array_equal(g.sequences[0].tokens, w.sequences[0].tokens)
        for g, w in zip(greedy, warm)
    )
    for g, t, c in zip(greedy, top1, cold):
        np.testing.assert_array_equal(t.sequences[0].tokens, g.sequences[0].tokens)
        np.testing.assert_allclose(
            t.sequences[0].logprobs, g.sequences[0].logprobs, atol=1e-6, rtol=0
        )  # both log_softmax at T = 1
        np.testing.assert_array_equal(c.sequences[0].tokens, g.sequences[0].tokens)


def test_top_k_top_p_keep_exactly_the_nucleus():
    """Many draws from one fixed distribution stay inside the kept set and cover it."""
    rng = np.random.default_rng(0)
    v, n = 40, 4000
    logits = (2.0 * rng.standard_normal(v)).astype(np.float32)
    p = np.exp(logits - logits.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    keys = np.stack([np.random.SeedSequence([9, i]).generate_state(2, np.uint32) for i in range(n)])

    @jax.jit
    def draw(top_k, top_p):
        x = jnp.broadcast_to(jnp.asarray(logits), (n, v))
        return sample_lib.sample_tokens(x, keys, 0, 1.0, top_k, top_p)

    def kept(top_k, top_p):
        q = p[order[: top_k if top_k > 0 else v]]
        q = q / q.sum()
        m = int(np.searchsorted(np.cumsum(q), top_p) + 1) if top_p < 1 else len(q)
        return set(order[: min(m, len(q))].tolist())

    everything, lp_all = draw(-1, 1.0)
    assert len(set(np.asarray(everything).tolist())) > 15
    for top_k, top_p in ((-1, 0.6), (5, 1.0), (5, 0.8), (-1, 0.95)):
        want = kept(top_k, top_p)
        assert 1 < len(want) < v
        toks, lps = draw(np.int32(top_k), np.float32(top_p))
        got = set(np.asarray(toks).tolist())
        assert got == want, (top_k, top_p)  # inside the nucleus, and all of it drawn
        # Log-probs are of the untruncated distribution.
        np.testing.assert_allclose(np.asarray(lps), np.log(p[np.asarray(toks)]), atol=1e-5)
    # Frequencies follow the renormalised nucleus.
    toks, _ = draw(np.int32(-1), np.float32(0.6))
    want = sorted(kept(-1, 0.6))
    freq = np.bincount(np.asarray(toks), minlength=v)[want] / n
    np.testing.assert_allclose(freq, p[want] / p[want].sum(), atol=0.04)


def test_rows_split_over_tp_draw_as_every_rank_drawing_every_row():
    """draws.sample_rows_over_tp (each tp rank draws B/tp rows of the all_to_all'd logits)
    gives exactly sample_tokens of the gathered logits, per kind of draw: greedy, drawn
    with a greedy row, truncated (top-k / top-p), with top-k log-probs; B odd falls back."""
    from jax.sharding import PartitionSpec as P

    from jcp import mesh as mesh_lib
    from jcp.sample import draws

    tp, v = 4, 64
    mesh = jcp.make_mesh(1, 1, tp)
    rng = np.random.default_rng(3)
    for b in (8, 7):
        logits = (2.0 * rng.standard_normal((b, v))).astype(np.float32)
        keys = rng.integers(0, 2**32, (b, 2), dtype=np.uint32)
        count = rng.integers(0, 9, b).astype(np.int32)
        temp = np.where(np.arange(b) == 1, 0.0, 0.7 + 0.1 * np.arange(b)).astype(np.float32)
        cold = np.zeros(b, np.float32)
        top_k = np.where(np.arange(b) % 3 == 0, 5, -1).astype(np.int32)
        top_p = np.where(np.arange(b) % 2 == 0, 0.8, 1.0).astype(np.float32)
        no_k, no_p = np.full(b, -1, np.int32), np.ones(b, np.float32)
        for greedy, (t, k, p), kw in (
            (True, (cold, top_k, top_p), {}),
            (False, (temp, no_k, no_p), {}),
            (False, (temp, top_k, top_p), dict(topk=3)),
        ):

            def run(split, x=logits, kw=kw, t=t, k=k, p=p):
                def f(x_loc):
                    args = (keys, count, t, k, p)
                    if split:
                        return draws.sample_rows_over_tp(x_loc, *args, **kw)
                    return draws.sample_tokens(draws.gather_vocab(x_loc), *args, **kw)

                out = jax.jit(
                    jax.shard_map(f, mesh=mesh, in_specs=P(None, mesh_lib.TP), out_specs=P())
                )(x)
                return [np.asarray(o) for o in out]

            split, whole = run(True), run(False)
            for a, w in zip(split, whole):
                np.testing.assert_array_equal(a, w)
            if not greedy:  # the draws are draws: not all the argmax
                assert np.any(split[0] != np.argmax(logits, -1)), kw
            assert np.all((split[0] >= 0) & (split[0] < v))


def test_a_row_draws_the_same_whatever_kinds_share_its_call():
    """One program serves every draw kind (draws.sample_tokens picks greedy / drawn /
    truncated / top-k log-probs at run time per call): each row of a batch that mixes
    greedy, drawn, top-k and top-p rows, some wanting top-k log-probs, gets exactly what it
    gets alone (its batch of one takes another branch: all greedy, or no truncation)."""
    from jcp.sample import draws

    rng = np.random.default_rng(5)
    b, v, k = 12, 96, 4
    logits = (2.0 * rng.standard_normal((b, v))).astype(np.float32)
    keys = rng.integers(0, 2**32, (b, 2), dtype=np.uint32)
    count = rng.integers(0, 9, b).astype(np.int32)
    temp = np.where(np.arange(b) % 4 == 0, 0.0, 0.6 + 0.1 * np.arange(b)).astype(np.float32)
    top_k = np.where(np.arange(b) % 3 == 1, 5, -1).astype(np.int32)
    top_p = np.where(np.arange(b) % 5 == 2, 0.7, 1.0).astype(np.float32)
    want = np.arange(b) % 2 == 0
    assert np.any(temp == 0) and np.any((temp > 0) & (top_k < 0) & (top_p == 1))
    assert np.any((temp > 0) & (top_k > 0)) and np.any((temp > 0) & (top_p < 1))
    draw = jax.jit(functools.partial(draws.sample_tokens, topk=k))
    whole = [np.asarray(x) for x in draw(logits, keys, count, temp, top_k, top_p, want_B=want)]
    for i in range(b):
        s = slice(i, i + 1)
        one = draw(logits[s], keys[s], count[s], temp[s], top_k[s], top_p[s], want_B=want[s])
        np.testing.assert_array_equal(whole[0][i], np.asarray(one[0])[0])
        np.testing.assert_array_equal(whole[1][i], np.asarray(one[1])[0])
        if want[i]:
            np.testing.assert_array_equal(whole[2][i], np.asarray(one[2])[0])
            np.testing.assert_array_equal(whole[3][i], np.asarray(one[3])[0])
        else:  # alone, no top-k is taken
            assert np.all(np.asarray(one[2]) == -1)
    assert np.any(whole[0] != np.argmax(logits, -1))  # some rows really drew


BAD = [
    ("prompts", lambda a: dict(prompts=[[1, 2], []])),
    ("prompts", lambda a: dict(prompts=[[1, 2, MH.V]])),
    ("prompts", lambda a: dict(prompts=[[1, -1]])),
    ("prompts", lambda a: dict(prompts=[])),
    ("prompts", lambda a: dict(prompts="abc")),
    ("max_tokens", lambda a: dict(sp=jcp.SamplingParams(max_tokens=0))),
    ("token cap", lambda a: dict(prompts=[[1] * 1000], sp=jcp.SamplingParams(max_tokens=30))),
    ("temperature", lambda a: dict(sp=jcp.SamplingParams(temperature=-0.5))),
    ("temperature", lambda a: dict(sp=jcp.SamplingParams(temperature=float("nan")))),
    ("temperature", lambda a: dict(sp=jcp.SamplingParams(temperature=float("inf")))),
    ("top_p", lambda a: dict(sp=jcp.SamplingParams(top_p=0.0))),
    ("top_p", lambda a: dict(sp=jcp.SamplingParams(top_p=1.5))),
    ("top_k", lambda a: dict(sp=jcp.SamplingParams(top_k=0))),
    ("top_k", lambda a: dict(sp=jcp.SamplingParams(top_k=-2))),
    ("num_samples", lambda a: dict(num_samples=0)),
    ("stop", lambda a: dict(sp=jcp.SamplingParams(stop=[MH.V]))),
    ("seed", lambda a: dict(sp=jcp.SamplingParams(seed=-1))),
    ("adapter", lambda a: dict(adapters=a + 7)),
    ("adapters", lambda a: dict(adapters=[a, 2])),
    ("adapters", lambda a: dict(adapters=[a])),
    ("sampling_params", lambda a: dict(sp={"max_tokens": 4})),
    ("cache_mode", lambda a: dict(cache_mode="rows")),
]


@pytest.mark.parametrize("what,bad", BAD, ids=[f"{w}-{i}" for i, (w, _) in enumerate(BAD)])
def test_bad_input_is_refused_with_state_unchanged(what, bad, root):
    tr, (a, _) = _trainer("qwen3", (1, 2, 1), root)
    before = _tables(tr)
    call = dict(
        prompts=[[1, 2, 3], [4]],
        sp=jcp.SamplingParams(max_tokens=4),
        adapters=a,
        num_samples=1,
        cache_mode=None,
    )
    call.update(bad(a))
    with pytest.raises(jcp.InputError) as e:
        tr.sample(
            call["prompts"],
            call["sp"],
            adapters=call["adapters"],
            num_samples=call["num_samples"],
            cache_mode=call["cache_mode"],
        )
    assert what.split()[0] in str(e.value) or what == "adapter"
    if what in ("prompts", "adapter", "adapters") and not isinstance(call["adapters"], list):
        with pytest.raises(jcp.InputError):
            tr.compute_logprobs(call["prompts"], adapters=call["adapters"])
    after = _tables(tr)
    jax.tree.map(np.testing.assert_array_equal, before, after)


def test_layers_are_sliced_out_of_the_loop_only_when_small(root, monkeypatch):
    """The decode loop copies the layer weights out of their stacks only below
    SLICE_LAYERS_MAX_BYTES (the copy is a second set of layer weights); both paths give the
    same tokens and log-probs."""
    tr, (a, _) = _trainer("qwen3", (1, 1, 1), root)
    assert tr.sampler.slice_layers
    sp = jcp.SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=2)
    sliced = tr.sample(PROMPTS, sp, adapters=a)
    monkeypatch.setattr(sample_lib.programs, "SLICE_LAYERS_MAX_BYTES", 0)
    monkeypatch.setattr(tr, "sampler", tr.make_sampler())
    assert not tr.sampler.slice_layers
    scanned = tr.sample(PROMPTS, sp, adapters=a)
    for x, y in zip(sliced, scanned):
        np.testing.assert_array_equal(x.sequences[0].tokens, y.sequences[0].tokens)
        np.testing.assert_allclose(
            x.sequences[0].logprobs, y.sequences[0].logprobs, atol=1e-5, rtol=0
        )
