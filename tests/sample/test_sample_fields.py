"""The SDK 0.38 sampling fields (jcp.PromptFields) in the engine and Trainer.sample.

Evidence (tiny Qwen3, an adapter that also adapts lm_head; the reference is forward's own
log_softmax of every vocabulary id, taken as 2-D target_tokens [N, V] — NumPy then sorts
it):
1. topk_prompt_logprobs, target_prompt_logprobs (sparse, −1 cells), prompt_alt_tokens_k
   and topk_sample_logprobs through the engine equal a NumPy top-k / pick of forward's
   log_softmax at meshes (1,1,1) and (1,2,2) (tp = 2: per-shard top-k merged); the
   sampled tokens' own log-probs sit in their top-k rows; prompt_logprobs_last_n gives
   the tail of the full prompt log-probs and hides the rest (and the top-k rows there);
   greedy prompt draws are the argmax; Trainer.sample (static sampler) returns the same
   fields as the engine; compute_logprobs honours last_n;
2. bad values are refused with an InputError naming the field, before anything is queued.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import trainer_harness as TH

import jcp
from jcp.sample.engine import Engine

V = TH.CFG.vocab_size
PROMPT = np.random.default_rng(5).integers(0, V, 13).tolist()
TARGETS = np.full((12, 3), -1, np.int64)
TARGETS[2, 0], TARGETS[5], TARGETS[11, 1] = 5, [7, 8, 9], 100
FIELDS = jcp.PromptFields(
    topk_prompt_logprobs=5,
    topk_sample_logprobs=3,
    target_prompt_logprobs=TARGETS,
    prompt_alt_tokens_k=3,
)
DRAWN = jcp.SamplingParams(max_tokens=6, temperature=1.0, seed=3, stop=[])
GREEDY = jcp.SamplingParams(max_tokens=2, temperature=0.0, stop=[])
ATOL = 2e-5


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return TH.adapter_folders(str(tmp_path_factory.mktemp("fields")))


def _log_softmax(tr, seqs, adapter) -> list[np.ndarray]:
    """forward's log_softmax [len(seq) − 1, V] of each sequence (one call): row i is the
    distribution of seq[i + 1]."""
    data = [
        jcp.Datum(
            x[:-1],
            {
                "target_tokens": np.tile(np.arange(V), (len(x) - 1, 1)),
                "weights": np.ones((len(x) - 1, V), np.float32),
            },
        )
        for x in seqs
    ]
    out = tr.forward(data, adapters=adapter).loss_fn_outputs
    return [np.asarray(o["logprobs"], np.float64).reshape(len(x) - 1, V) for o, x in zip(out, seqs)]


def _top(lsm, k):
    order = np.argsort(-lsm, axis=1, kind="stable")[:, :k]
    s = np.sort(lsm, axis=1)[:, ::-1]
    assert np.all(s[:, k - 1] - s[:, k] > 1e-4)  # no tie at the cut: the order is defined
    return order, np.take_along_axis(lsm, order, 1)


def _check_sampled(res, lsms):
    for s, lsm in zip(res.sequences, lsms):
        lsm = lsm[len(PROMPT) - 1 :]
        ids, lps = _top(lsm, 3)
        np.testing.assert_array_equal(s.topk_logprobs.token_ids, ids)
        np.testing.assert_allclose(s.topk_logprobs.logprobs, lps, atol=ATOL)
        np.testing.assert_allclose(s.logprobs, lsm[np.arange(len(s.tokens)), s.tokens], atol=ATOL)


@pytest.mark.parametrize("mesh", [(1, 1, 1), (1, 2, 2)])
def test_fields_equal_numpy_of_forward(mesh, folders):
    tr = TH.trainer(mesh)
    with TH.borrowed(tr):
        a = TH.load_adapters(tr, folders, ("p",))["p"]
        eng = Engine(tr.make_sampler(), slots=4 * tr.dp * tr.cp, max_len=32, chunk=4)
        rid = eng.submit(PROMPT, DRAWN, a, num_samples=2, prompt_logprobs=True, fields=FIELDS)
        tail = eng.submit(
            PROMPT,
            GREEDY,
            a,
            prompt_logprobs=True,
            fields=jcp.PromptFields(
                topk_prompt_logprobs=2, prompt_logprobs_last_n=4, prompt_alt_tokens_k=2
            ),
        )
        eng.run()
        res, res_tail = eng.result(rid), eng.result(tail)
        lsm, *lsm_seqs = _log_softmax(
            tr, [PROMPT] + [PROMPT + s.tokens.tolist() for s in res.sequences], a
        )

        np.testing.assert_allclose(
            res.prompt_logprobs[1:], lsm[np.arange(12), PROMPT[1:]], atol=ATOL
        )
        tk = res.topk_prompt_logprobs
        ids, lps = _top(lsm, 5)
        assert tk.token_ids.shape == (13, 5)
        assert np.all(tk.token_ids[0] == -1) and np.all(np.isnan(tk.logprobs[0]))
        np.testing.assert_array_equal(tk.token_ids[1:], ids)
        np.testing.assert_allclose(tk.logprobs[1:], lps, atol=ATOL)
        want = np.where(TARGETS >= 0, np.take_along_axis(lsm, np.maximum(TARGETS, 0), 1), 0)
        np.testing.assert_allclose(res.target_prompt_logprobs, want, atol=ATOL)
        assert np.count_nonzero(res.target_prompt_logprobs) == np.count_nonzero(TARGETS >= 0)
        alt = res.prompt_alt_tokens
        assert alt.token_ids.shape == (12, 3)
        np.testing.assert_allclose(
            alt.logprobs, np.take_along_axis(lsm, alt.token_ids, 1), atol=ATOL
        )  # T = 1: the logits' own log-probs
        assert len(np.unique(alt.token_ids)) > 12  # independent draws, not one token
        _check_sampled(res, lsm_seqs)

        # last_n: the tail of the full prompt log-probs, nothing before it.
        lp = res_tail.prompt_logprobs
        assert np.all(np.isnan(lp[:9]))
        np.testing.assert_allclose(lp[9:], res.prompt_logprobs[9:], atol=ATOL)
        tk2 = res_tail.topk_prompt_logprobs
        assert np.all(tk2.token_ids[:9] == -1)
        np.testing.assert_array_equal(tk2.token_ids[9:], ids[8:, :2])
        # Greedy prompt draws are the argmax (last_n does not apply to them).
        np.testing.assert_array_equal(
            res_tail.prompt_alt_tokens.token_ids, np.repeat(ids[:, :1], 2, axis=1)
        )

        if mesh == (1, 1, 1):
            # The static sampler (Trainer.sample) returns the same fields.
            ref = tr.sample([PROMPT], DRAWN, a, num_samples=2, prompt_logprobs=True, fields=FIELDS)[
                0
            ]
            for s, r in zip(res.sequences, ref.sequences):
                np.testing.assert_array_equal(s.tokens, r.tokens)
                np.testing.assert_array_equal(s.topk_logprobs.token_ids, r.topk_logprobs.token_ids)
                np.testing.assert_allclose(
                    s.topk_logprobs.logprobs, r.topk_logprobs.logprobs, atol=ATOL
                )
            np.testing.assert_array_equal(
                res.topk_prompt_logprobs.token_ids, ref.topk_prompt_logprobs.token_ids
            )
            np.testing.assert_array_equal(
                res.prompt_alt_tokens.token_ids, ref.prompt_alt_tokens.token_ids
            )
            np.testing.assert_allclose(
                res.target_prompt_logprobs, ref.target_prompt_logprobs, atol=ATOL
            )
            # compute_logprobs with last_n.
            got = tr.compute_logprobs([PROMPT], a, prompt_logprobs_last_n=3)[0]
            assert np.all(np.isnan(got[:10]))
            np.testing.assert_allclose(got[10:], res.prompt_logprobs[10:], atol=ATOL)


@pytest.mark.parametrize(
    "fields, prompt_logprobs, match",
    [
        (jcp.PromptFields(topk_prompt_logprobs=-1), False, "topk_prompt_logprobs"),
        (jcp.PromptFields(topk_sample_logprobs=65), False, "topk_sample_logprobs"),
        (jcp.PromptFields(prompt_alt_tokens_k=1.5), False, "prompt_alt_tokens_k"),
        (jcp.PromptFields(prompt_logprobs_last_n=13), True, "prompt_logprobs_last_n"),
        (jcp.PromptFields(prompt_logprobs_last_n=2), False, "prompt_logprobs_last_n"),
        (
            jcp.PromptFields(target_prompt_logprobs=np.zeros((13, 2), np.int64)),
            False,
            r"target_prompt_logprobs must have shape \[len\(prompt\) − 1 = 12",
        ),
        (jcp.PromptFields(target_prompt_logprobs=np.full((12, 2), -1)), False, "names no token"),
        (
            jcp.PromptFields(target_prompt_logprobs=np.full((12, 2), V)),
            False,
            r"target_prompt_logprobs\[0\]\[0\]",
        ),
        (jcp.PromptFields(target_prompt_logprobs=np.zeros((12, 65), np.int64)), False, "K = 65"),
    ],
)
def test_bad_fields_are_refused_before_queueing(fields, prompt_logprobs, match):
    tr = TH.trainer((1, 1, 1))
    eng = Engine(tr.make_sampler(), slots=4, max_len=32, chunk=4)
    with pytest.raises(jcp.InputError, match=match):
        eng.submit(PROMPT, GREEDY, None, prompt_logprobs=prompt_logprobs, fields=fields)
    assert eng.idle and not eng.waiting
    with pytest.raises(jcp.InputError, match=match):
        tr.sample([PROMPT], GREEDY, prompt_logprobs=prompt_logprobs, fields=fields)


def test_prompt_draws_follow_the_tempered_distribution():
    """losses.prompt_stats at tp = 2 (vocab 8, 4 per rank) on one repeated distribution:
    the top-4 equals NumPy's; 64 tokens × 64 draws at T = 1 and at T = 0.5 match
    softmax(logits / T) (every category within 5 σ of its expected count), their log-probs
    are log_softmax(logits / T) of the drawn ids, and T = 0 draws the argmax."""
    import jax

    from jcp import losses
    from jcp import mesh as mesh_lib

    s_len, d, v, k_alt = 192, 4, 8, 64
    rng = np.random.default_rng(0)
    w = rng.normal(size=(d, v)).astype(np.float32)
    h = np.tile(rng.normal(size=(1, d)).astype(np.float32), (s_len, 1))
    temp = np.repeat(np.array([1.0, 0.5, 0.0], np.float32), s_len // 3)
    keys = rng.integers(0, 2**32, (s_len, 2), dtype=np.uint32)
    mesh = jcp.make_mesh(1, 1, 2)
    sp = mesh_lib.SPECS

    def inner(h, w, t, temp, keys, pos):
        out = losses.prompt_stats(
            losses.Unembedding((h[0, 0],), (w,)),
            t[0, 0][:, None],
            16,
            topk=4,
            alt=k_alt,
            temperature_S=temp[0, 0],
            keys_Sx2=keys[0, 0],
            position_S=pos[0, 0],
        )
        return {k_: losses.gather_stream(x) for k_, x in out.items()}

    specs = ("lp", "topk_ids", "topk_lp", "alt_ids", "alt_lp")
    run = jax.jit(
        jax.shard_map(
            inner,
            mesh=mesh,
            in_specs=(
                sp.stream_DPxCPxSxD,
                sp.unembed_DxV,
                sp.stream_DPxCPxS,
                sp.stream_DPxCPxS,
                sp.stream_DPxCPxS,
                sp.stream_DPxCPxS,
            ),
            out_specs={k_: sp.replicated for k_ in specs},
        )
    )
    b = lambda x: x[None, None]  # noqa: E731
    out = {
        k_: np.asarray(x)[0, 0]
        for k_, x in run(
            b(h),
            w,
            b(np.zeros(s_len, np.int32)),
            b(temp),
            b(keys),
            b(np.arange(s_len, dtype=np.int32)),
        ).items()
    }
    logits = h[0].astype(np.float64) @ w.astype(np.float64)

    def lsm(x):
        return x - np.log(np.sum(np.exp(x - x.max()))) - x.max()

    order = np.argsort(-logits)[:4]
    np.testing.assert_array_equal(out["topk_ids"], np.tile(order, (s_len, 1)))
    np.testing.assert_allclose(out["topk_lp"], np.tile(lsm(logits)[order], (s_len, 1)), atol=1e-5)
    for t, rows in ((1.0, slice(0, 64)), (0.5, slice(64, 128))):
        p = np.exp(lsm(logits / t))
        ids = out["alt_ids"][rows].ravel()
        np.testing.assert_allclose(out["alt_lp"][rows].ravel(), lsm(logits / t)[ids], atol=1e-5)
        n = ids.size
        count = np.bincount(ids, minlength=v)
        assert np.all(np.abs(count - n * p) <= 5 * np.sqrt(n * p * (1 - p)) + 1), (t, count, n * p)
    assert np.all(out["alt_ids"][128:] == order[0])
    np.testing.assert_allclose(out["alt_lp"][128:], lsm(logits)[order[0]], atol=1e-5)
