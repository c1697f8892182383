"""Qwen3.5 (hybrid Gated DeltaNet + gated full attention): config, loading, and log-probs
equal to transformers' Qwen3_5ForCausalLM at several meshes.

The reference is a tiny random Qwen3_5ForCausalLM built here (both layer kinds, v heads >
k heads, partial rotary, non-zero RMSNorm offsets, float32, transformers' torch fallbacks),
saved with save_pretrained and read back by jcp.load_hf. Datums are packed ragged: borders
inside and at kernel blocks, a one-token datum, and at cp = 4 ranks holding padding only.
"""

import copy
import functools

import jax
import numpy as np
import pytest
import torch
from helpers import model_harness as mh
from helpers.hf_models import peft_model
from transformers import Qwen3_5ForCausalLM
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

import jcp
from jcp import model as model_lib

LENGTHS = (37, 1, 20, 64)


@functools.cache
def _reference():
    """(HF model, its folder's jcp config, jcp base params as NumPy)."""
    hm, path = _saved()
    cfg, base = jcp.load_hf(path)
    return hm, cfg, jax.tree.map(np.asarray, base)


@functools.cache
def _saved():
    """(the tiny random HF Qwen3_5ForCausalLM, the folder it is saved in)."""
    torch.manual_seed(0)
    hc = Qwen3_5TextConfig(
        vocab_size=mh.V,
        hidden_size=mh.D,
        intermediate_size=mh.F,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        tie_word_embeddings=False,
        max_position_embeddings=1024,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [1, 1, 0],
        },
    )
    hm = Qwen3_5ForCausalLM(hc)
    with torch.no_grad():
        for name, p in hm.named_parameters():
            if "norm" in name:  # offsets ≠ 0 (gated norm: a plain weight around 1)
                p.copy_(0.3 * torch.randn_like(p) + (1.0 if "linear_attn.norm" in name else 0.0))
            elif "A_log" in name or "dt_bias" in name:
                p.copy_(0.5 * torch.randn_like(p))
            elif "conv1d" in name:
                p.copy_(0.3 * torch.randn_like(p))
            else:
                p.copy_(0.05 * torch.randn_like(p))
    hm = hm.eval().float()
    import tempfile

    return hm, mh.save(hm, tempfile.mkdtemp(prefix="jcp_qwen3_5_"))


def test_config_from_hf_reads_the_hybrid_fields():
    _, cfg, base = _reference()
    assert cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert cfg.attn_output_gate and cfg.rotary_dim == 4 and cfg.qk_norm
    assert (cfg.linear_num_key_heads, cfg.linear_num_value_heads) == (2, 4)
    model_lib.check_shapes(cfg, base)
    assert base["linear_attn"]["in_proj_q"].shape == (3, mh.D, 32)
    assert base["full_attn"]["q_proj"].shape == (1, mh.D, 2 * 4 * 16)
    with pytest.raises(ValueError, match="linear_num_value_heads"):
        jcp.QwenConfig.tiny_qwen3_5(linear_num_value_heads=3)
    with pytest.raises(ValueError, match="tp=4 does not divide linear_num_key_heads"):
        jcp.QwenConfig.tiny_qwen3_5(linear_num_key_heads=2, num_kv_heads=4, num_heads=4).check_mesh(
            4
        )
    assert jcp.QwenConfig.tiny().fingerprint() != jcp.QwenConfig.tiny_qwen3_5().fingerprint()


# (2,2,2) and (1,8,1) hung before delta_rule.unit_lower_inverse replaced solve_triangular
# (its XLA:CPU kernel deadlocked the 8-thread intra-op pool with 8 devices). cp = 2 is
# (1,2,2)'s and (2,2,2)'s, ranks of padding only (1,8,1)'s; (1,2,1) and (1,4,1) added no
# axis (~2.5 CPU s each; the delta rule at cp = 4 is test_delta_rule's).
@pytest.mark.parametrize("mesh_shape", [(1, 1, 1), (1, 8, 1), (2, 2, 2), (1, 2, 2)])
def test_logprobs_equal_transformers(mesh_shape):
    hm, cfg, base = _reference()
    seqs, targets, _ = mh.random_data(LENGTHS)
    ref = mh.reference_logprobs(hm, seqs, targets)
    got = mh.logprobs(cfg, base, mesh_shape, seqs, targets)
    for g, r in zip(got, ref):
        np.testing.assert_allclose(g, r, atol=2e-4)


# ----------------------------------------------------------------------------------------
# Training: LoRA on every projection (gated q_proj, Gated DeltaNet's in_proj_qkv / in_proj_z
# / out_proj, MLP, lm_head) through the Trainer, against peft and cp = 1

TARGETS = [
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "in_proj_qkv",
    "in_proj_z",
    "out_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "lm_head",
]


@functools.cache
def _peft_world():
    """(peft model in fp64, its folder, data) on the reference Qwen3.5; every lora_B
    random so each factor has a gradient."""
    import tempfile

    hm, _, _ = _reference()
    pm = peft_model(hm, 1, r=4, lora_alpha=8, target_modules=TARGETS)
    folder = tempfile.mkdtemp(prefix="jcp_qwen3_5_peft_")
    pm.save_pretrained(folder)
    seqs, targets, weights = mh.random_data(LENGTHS, seed=4)
    data = [
        jcp.Datum(s, {"target_tokens": t, "weights": w}) for s, t, w in zip(seqs, targets, weights)
    ]
    return pm.double().eval(), folder, data


def _torch_grads(pm, data):
    pm.zero_grad()
    total = 0.0
    for d in data:
        logits = pm(torch.tensor(np.asarray(d.model_input))[None]).logits[0]
        lp = torch.log_softmax(logits.double(), -1)[
            torch.arange(len(d.model_input)),
            torch.tensor(np.asarray(d.loss_fn_inputs["target_tokens"])),
        ]
        total = (
            total - (torch.tensor(np.asarray(d.loss_fn_inputs["weights"], np.float64)) * lp).sum()
        )
    total.backward()
    return {
        n.replace(".default.", "."): p.grad.numpy().copy()
        for n, p in pm.named_parameters()
        if "lora_" in n
    }


@functools.cache
def _trainer(mesh_shape):
    _, cfg, base = _reference()
    return jcp.Trainer(
        cfg, jcp.make_mesh(*mesh_shape), base_params=base, max_adapters=2, max_rank=4
    )


def _jcp_grads(mesh_shape, folder, data):
    tr = _trainer(mesh_shape)
    a = tr.load_peft(folder)
    try:
        out = tr.forward_backward(data, "cross_entropy", adapters=a)
        return out, tr.gradients(a)
    finally:
        tr.delete_adapter(a)


def test_lora_gradients_equal_peft():
    """Every target's gradient at (1,2,2) = peft's fp64 gradient on the HF model, and its
    log-probs = transformers': the tp split of in_proj_qkv's B (q, k, v columns of each
    rank's heads) and of the gated q_proj's B must match the base weights' for this to hold.
    (A second Trainer at (1,1,1) compared with this one cost ~7 CPU s; a wrong split is an
    O(1) error against peft's, far outside its tolerance.)"""
    pm, folder, data = _peft_world()
    want = _torch_grads(pm, data)
    out, got = _jcp_grads((1, 2, 2), folder, data)
    assert got.keys() == want.keys()
    for key in (
        "layers.0.linear_attn.in_proj_qkv.lora_B",
        "layers.3.self_attn.q_proj.lora_A",
        "layers.2.linear_attn.out_proj.lora_A",
        "layers.1.linear_attn.in_proj_z",
    ):
        assert any(key in k for k in want), key
    scale = max(float(np.abs(v).max()) for v in want.values())
    assert scale > 1e-3
    for k in want:
        assert np.abs(want[k]).max() > 1e-4 * scale, k  # every factor is really exercised
        np.testing.assert_allclose(got[k], want[k], atol=1e-4 * scale, rtol=1e-3, err_msg=k)
    ref = mh.reference_logprobs(
        pm, [d.model_input for d in data], [d.loss_fn_inputs["target_tokens"] for d in data]
    )
    for o, r in zip(out.loss_fn_outputs, ref):
        np.testing.assert_allclose(o["logprobs"], r, atol=2e-4)


def test_peft_round_trip(tmp_path):
    """load_peft then export_peft: peft reads the folder back onto the HF model, each
    tensor equal to the original's, and its log-probs equal jcp's forward."""
    import peft
    from safetensors.numpy import load_file

    pm, folder, data = _peft_world()
    tr, _ = _sampling_trainer((1, 1, 1))  # the sampling tests' Trainer: no Trainer of its own
    a = tr.load_peft(folder)
    try:
        tr.export_peft(a, tmp_path)
        out = tr.forward(data[:2], "cross_entropy", adapters=a)
    finally:
        tr.delete_adapter(a)
    src = load_file(f"{folder}/adapter_model.safetensors")
    back = load_file(f"{tmp_path}/adapter_model.safetensors")
    src = {k: v for k, v in src.items() if "lora_" in k}  # peft also saves the base lm_head
    assert back.keys() == src.keys() and any("in_proj_qkv" in k for k in src)
    for k in src:
        np.testing.assert_array_equal(back[k], src[k], err_msg=k)
    hm, _, _ = _reference()
    reread = peft.PeftModel.from_pretrained(copy.deepcopy(hm), tmp_path).double().eval()
    for d, got in zip(data[:2], out.loss_fn_outputs):
        lp = mh.reference_logprobs(reread, [d.model_input], [d.loss_fn_inputs["target_tokens"]])
        np.testing.assert_allclose(got["logprobs"], lp[0], atol=2e-4)


def test_lora_targets_on_a_hybrid_model():
    _, cfg, _ = _reference()
    from jcp import lora as lora_lib

    assert lora_lib.resolve_targets(None, cfg) == tuple(
        m for m in lora_lib.ALL_MODULES if m in TARGETS
    )
    assert lora_lib.resolve_targets(["linear_attn"], cfg) == (
        "in_proj_qkv",
        "in_proj_z",
        "out_proj",
    )
    with pytest.raises(ValueError, match="no linear-attention layers"):
        lora_lib.resolve_targets(["in_proj_qkv"], jcp.QwenConfig.tiny())
    assert "in_proj_qkv" not in lora_lib.resolve_targets(None, jcp.QwenConfig.tiny())


# Sampling: prompt lengths cover a one-token prompt (no prefill: the state starts from
# zeros), prompts inside one kernel block and across blocks (64).
SAMPLE_PROMPTS = ([5], [3, 9, 14, 2, 7], list(range(1, 71)), [11, 4, 8, 20, 6, 1, 13, 2, 9])
SAMPLE_TOKENS = 6


@functools.cache
def _hf_greedy():
    hm = _reference()[0]
    out = []
    with torch.no_grad():
        for p in SAMPLE_PROMPTS:
            ids = torch.tensor([p])
            g = hm.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=SAMPLE_TOKENS,
                min_new_tokens=SAMPLE_TOKENS,
                pad_token_id=0,
            )
            out.append(g[0, len(p) :].numpy().astype(np.int32))
    return out


@functools.cache
def _sampling_trainer(mesh_shape):
    """(Trainer, an adapter with PEFT's initialisation: B = 0, the base model's outputs).
    Room for the engine tests' two peft adapters too (one Trainer: one compile set), or
    test_peft_round_trip's one before them."""
    _, cfg, base = _reference()
    tr = jcp.Trainer(
        cfg,
        jcp.make_mesh(*mesh_shape),
        base_params=base,
        max_adapters=3,
        max_rank=4,
        attn_block=16,
        logprob_chunk=16,
    )
    return tr, tr.create_adapter(rank=2, seed=0)


def _no_stop(n=SAMPLE_TOKENS, **kw):
    return jcp.SamplingParams(max_tokens=n, stop=[], **kw)


# cp = 1 adds no axis (a (1,1,1) case took ~5 CPU s); the engine's hybrid decode at
# (1,1,1) is test_qwen3_5_moe's.
@pytest.mark.parametrize("mesh_shape,cache_mode", [((1, 2, 2), "batch"), ((1, 2, 2), "split")])
def test_greedy_sampling_equals_hf_generate(mesh_shape, cache_mode):
    """Recurrent states beside the KV cache: prefill (over the cp pieces) hands each prompt's
    final conv window and delta-rule state to its decode rows — both samples of a prompt
    copy one — and decode continues them by the recurrent form."""
    tr, _ = _sampling_trainer(mesh_shape)
    want = _hf_greedy()
    assert len({tuple(w) for w in want}) > 1
    res = tr.sample(
        list(SAMPLE_PROMPTS), _no_stop(temperature=0.0), num_samples=2, cache_mode=cache_mode
    )
    assert tr.sampler.last_plan.mode == (cache_mode or "batch")
    for i, (r, w) in enumerate(zip(res, want)):
        for seq in r.sequences:
            np.testing.assert_array_equal(seq.tokens, w, err_msg=f"prompt {i}")


def test_sampled_logprobs_equal_forward_and_transformers():
    tr, a = _sampling_trainer((1, 2, 2))
    res = tr.sample(
        list(SAMPLE_PROMPTS),
        _no_stop(temperature=1.0, seed=3),
        num_samples=2,
        prompt_logprobs=True,
        adapters=a,
    )
    hm = _reference()[0]
    seqs = [
        np.concatenate([p, s.tokens]).astype(np.int32)
        for p, r in zip(SAMPLE_PROMPTS, res)
        for s in r.sequences
    ]
    assert len({tuple(x) for x in seqs}) == len(seqs)  # the draws differ
    ref = mh.reference_logprobs(hm, [x[:-1] for x in seqs], [x[1:] for x in seqs])
    data = [
        jcp.Datum(x[:-1], {"target_tokens": x[1:], "weights": np.zeros(len(x) - 1, np.float32)})
        for x in seqs
    ]
    fwd = [o["logprobs"] for o in tr.forward(data, adapters=a).loss_fn_outputs]
    plain = tr.compute_logprobs([list(p) for p in SAMPLE_PROMPTS], adapters=a)
    k = 0
    for p, r, pl in zip(SAMPLE_PROMPTS, res, plain):
        n = len(p)
        np.testing.assert_allclose(pl[1:], ref[k][: n - 1], atol=2e-4)
        np.testing.assert_array_equal(r.prompt_logprobs, pl)
        for s in r.sequences:
            np.testing.assert_allclose(s.logprobs, fwd[k][n - 1 :], atol=2e-5)
            np.testing.assert_allclose(s.logprobs, ref[k][n - 1 :], atol=2e-4)
            k += 1


# ----------------------------------------------------------------------------------------
# The paged engine: a recurrent-state row per sequence beside the full layers' pages

ENGINE = dict(slots=8, max_len=80, chunk=4, page_size=8, prefill_tokens=32)


@functools.cache
def _engine_adapters():
    """Two peft adapters on the reference model (every target, B random): (peft models,
    their folders)."""
    import tempfile

    hm = _reference()[0]
    pms, folders = [], []
    for k in range(2):
        pm = peft_model(hm, 20 + k, std=0.2, r=4, lora_alpha=8 + 8 * k, target_modules=TARGETS)
        folder = tempfile.mkdtemp(prefix=f"jcp_qwen3_5_engine{k}_")
        pm.save_pretrained(folder)
        pms.append(pm)
        folders.append(folder)
    return pms, folders


@functools.cache
def _hf_engine_greedy(which, i):
    """HF generate (greedy) of SAMPLE_PROMPTS[i] by the base model (which None) or peft
    adapter `which`."""
    model = _reference()[0] if which is None else _engine_adapters()[0][which]
    ids = torch.tensor([SAMPLE_PROMPTS[i]])
    with torch.no_grad():
        g = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=SAMPLE_TOKENS,
            min_new_tokens=SAMPLE_TOKENS,
            pad_token_id=0,
        )
    return g[0, ids.shape[1] :].numpy().astype(np.int32)


@functools.cache
def _engine(mesh_shape):
    """(Trainer, [adapter ids of the two peft folders], Engine) over the reference model
    (the static sampling tests' Trainer)."""
    from jcp.sample.engine import Engine

    tr = _sampling_trainer(mesh_shape)[0]
    ids = [tr.load_peft(f) for f in _engine_adapters()[1]]
    return tr, ids, Engine(tr.make_sampler(), **ENGINE)


@pytest.mark.parametrize("mesh_shape", [(1, 2, 2)])  # one mesh, with cp and tp: keeps CI short
def test_engine_greedy_equals_hf_generate(mesh_shape):
    """Requests arriving at different steps with different adapters (or none): every
    sequence = HF generate (+ peft). Covered: a one-token prompt (no prefill: the state
    starts from zeros), the 70-token prompt prefilled over 3 engine steps (32 prompt tokens
    per step: its recurrent state carried across chunks) while others decode, 2 samples of
    one prompt (the prompt's final state copied into each sample's row), and state rows of
    finished sequences taken again by later ones."""
    tr, (a, b), eng = _engine(mesh_shape)
    assert (tr.dp, tr.cp, tr.tp) == mesh_shape and eng.hybrid
    assert not np.array_equal(_hf_engine_greedy(0, 2), _hf_engine_greedy(None, 2))
    assert not np.array_equal(_hf_engine_greedy(0, 3), _hf_engine_greedy(1, 3))
    adapter = {None: None, a: 0, b: 1}
    waves = [
        [(2, a, 1), (0, None, 1)],
        [(1, b, 1), (3, a, 2)],
        [],
        [(3, b, 1), (0, a, 1)],
        [(2, None, 1)],
    ]
    rids, rows_seen = [], set()
    for wave in waves:
        rids += [
            (eng.submit(SAMPLE_PROMPTS[i], _no_stop(temperature=0.0), ad, n), i, ad)
            for i, ad, n in wave
        ]
        eng.step()
        rows_seen |= {
            (x.g, x.row) for r in eng.requests.values() for x in r.seqs if x.row is not None
        }
    assert eng.live > 0
    eng.run()
    assert eng.idle and eng.live == 0 and all(len(f) == eng.b_local for f in eng.free_rows)
    assert len(rows_seen) < sum(n for wave in waves for _, _, n in wave)  # rows reused
    for rid, i, ad in rids:
        res = eng.result(rid)
        for seq in res.sequences:
            np.testing.assert_array_equal(
                seq.tokens, _hf_engine_greedy(adapter[ad], i), err_msg=f"prompt {i} adapter {ad}"
            )


def test_engine_drawn_logprobs_equal_forward_and_one_prefill():
    """A drawn request (T = 1, 3 samples) on the 70-token prompt, prefilled in 3 chunks:
    its log-probs = forward; tokens and log-probs = Trainer.sample of it alone (the
    prompt prefilled in one program); prompt log-probs = compute_logprobs. The prefix
    cache is off for a hybrid model (a recurrent state is not recoverable from K/V
    pages): the same request again prefills every position and gives the same result."""
    tr, (a, _), eng = _engine((1, 2, 2))
    prompt = SAMPLE_PROMPTS[2]
    sp = _no_stop(temperature=1.0, seed=7)
    assert not eng.prefix_cache
    before = eng.prefilled
    rid = eng.submit(prompt, sp, a, num_samples=3, prompt_logprobs=True)
    req, filled = eng.requests[rid], []
    while not eng.finished(rid):
        eng.step()
        filled.append(req.groups[0].filled)
    assert filled[:3] == [32, 64, 69]
    got = eng.result(rid)
    seqs = [np.concatenate([prompt, x.tokens]).astype(np.int32) for x in got.sequences]
    assert len({tuple(x) for x in seqs}) == 3  # the draws differ
    data = [
        jcp.Datum(x[:-1], {"target_tokens": x[1:], "weights": np.zeros(len(x) - 1, np.float32)})
        for x in seqs
    ]
    fwd = [o["logprobs"] for o in tr.forward(data, adapters=a).loss_fn_outputs]
    n = len(prompt)
    for x, f in zip(got.sequences, fwd):
        np.testing.assert_allclose(x.logprobs, f[n - 1 :], atol=2e-5)
    alone = tr.sample([prompt], sp, adapters=a, num_samples=3, prompt_logprobs=True)[0]
    for x, y in zip(got.sequences, alone.sequences):
        np.testing.assert_array_equal(x.tokens, y.tokens)
        np.testing.assert_allclose(x.logprobs, y.logprobs, atol=2e-5, rtol=0)
    # Prefilled in three chunks vs one: the delta rule's sums run in another order (fp32
    # rounding, ~2e-6 relative at |log p| ~ 5); forward's bound above.
    np.testing.assert_allclose(got.prompt_logprobs, alone.prompt_logprobs, atol=2e-5, rtol=0)
    np.testing.assert_allclose(
        got.prompt_logprobs[1:], tr.compute_logprobs([prompt], adapters=a)[0][1:], atol=2e-5
    )
    assert eng.prefilled - before == n - 1
    rid = eng.submit(prompt, sp, a, num_samples=3, prompt_logprobs=True)
    eng.run()
    again = eng.result(rid)
    assert eng.prefilled - before == 2 * (n - 1) and eng.pool.hits == 0
    for x, y in zip(again.sequences, got.sequences):
        np.testing.assert_array_equal(x.tokens, y.tokens)
        np.testing.assert_array_equal(x.logprobs, y.logprobs)


def test_engine_warmup_covers_a_hybrid_model(monkeypatch):
    """Engine.warmup on a hybrid model runs its program set (prefill rows 8 / 4 × chunk 16
    × 4 table pages, decode rows 8 × 4 pages — 16 or 4 steps a call, one program —, one
    copy rung) on padding, and then requests of random lengths and sample counts compile
    nothing; a warm-up after them leaves their pages and state rows bit for bit."""
    from jcp.sample.engine import Engine

    tr, (a, _), _ = _engine((1, 1, 1))
    eng = Engine(tr.make_sampler(), slots=8, max_len=32, chunk=4, page_size=8, prefill_tokens=16)
    p = eng.s.paged
    compiled = lambda: len(p.extend) + len(p.decode) + len(p.copy)  # noqa: E731
    assert eng.warmup(active=(1,)) == 2 + 1 + 1
    assert eng.idle and all(len(f) == eng.b_local for f in eng.free_rows)
    warm, before = set(eng.program_keys), compiled()
    eng.program_keys.clear()
    rng = np.random.default_rng(1)
    rids = []
    for _ in range(2):
        for _ in range(2):
            n = int(rng.integers(2, 25))
            rids.append(
                eng.submit(
                    rng.integers(0, mh.V, n).tolist(),
                    _no_stop(n=int(rng.integers(1, 32 - n)), temperature=0.0),
                    a,
                    num_samples=int(rng.integers(1, 4)),
                )
            )
        eng.step()
    eng.run()
    assert all(eng.result(r).sequences for r in rids)
    assert {k[0] for k in eng.program_keys} == {"extend", "decode", "copy"}
    assert eng.program_keys <= warm, eng.program_keys - warm
    assert compiled() == before
    # A warm-up runs live rows through each decode loop (its body, every branch), yet
    # writes nothing: the pages and state rows the requests left are bit for bit as they
    # were, and later requests sample as before.
    held = jax.tree.map(np.asarray, eng.device.cache)
    assert any(np.any(x != 0) for x in jax.tree.leaves(held))  # the requests wrote
    dev, calls = eng.device, []
    decode = dev.decode

    def spy_decode(table, rows, modes, active, slot=None):
        calls.append((table.shape[1], rows))
        return decode(table, rows, modes, active, slot)

    monkeypatch.setattr(dev, "decode", spy_decode)
    eng.warmup(active=(1,))
    # Every decode call runs live rows several steps (the loop body, not only its test),
    # from each phase's first position, all greedy and mixed (drawn, top-k, top-k
    # log-probs).
    page = eng.device.sizes.page
    runs = {}
    for m, rows in calls:
        assert not rows.done.any() and rows.steps.min() >= 2 and rows.max_tokens.min() >= 2
        drawn = bool(np.any((rows.temperature > 0) & (rows.top_k > 0) & rows.want_topk))
        assert drawn or not np.any(rows.temperature > 0)
        runs.setdefault(m, set()).add((int(rows.position.min()), drawn))
    for m, seen in runs.items():
        starts = {0} | ({-(-m // 2) * page} if m > 1 else set())
        assert seen == {(p, d) for p in starts for d in (False, True)}, (m, seen)
    assert any(m > 1 for m in runs)
    for a_, b_ in zip(jax.tree.leaves(held), jax.tree.leaves(eng.device.cache)):
        np.testing.assert_array_equal(a_, np.asarray(b_))
    assert compiled() == before


def test_load_hf_reads_the_text_model_of_an_image_text_checkpoint(tmp_path):
    """A Qwen3_5ForConditionalGeneration folder (nested text_config, weights under
    model.language_model., a vision tower beside them) loads as its text model: the same
    config and weights as the Qwen3_5ForCausalLM it was built from, whose log-probs equal
    transformers' (test_logprobs_equal_transformers); the vision tower is not read."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    hm, cfg, base = _reference()
    vision = dict(
        depth=1,
        hidden_size=32,
        intermediate_size=32,
        num_heads=2,
        patch_size=4,
        out_hidden_size=mh.D,
        num_position_embeddings=16,
    )
    vc = Qwen3_5Config(
        text_config=hm.config.to_dict(), vision_config=vision, tie_word_embeddings=False
    )
    vm = Qwen3_5ForConditionalGeneration(vc).eval()
    missing, unexpected = vm.model.language_model.load_state_dict(
        hm.model.state_dict(), strict=True
    )
    assert not missing and not unexpected
    with torch.no_grad():
        vm.lm_head.weight.copy_(hm.lm_head.weight)
        ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
        np.testing.assert_allclose(vm(ids).logits.numpy(), hm(ids).logits.numpy(), atol=1e-5)
    path = mh.save(vm, tmp_path / "vlm")
    import json

    saved = json.load(open(tmp_path / "vlm" / "config.json"))
    assert saved["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    assert "text_config" in saved
    cfg2, base2 = jcp.load_hf(path)
    assert cfg2 == cfg
    flat, flat2 = jax.tree_util.tree_leaves_with_path(base), jax.tree.leaves(base2)
    assert len(flat) == len(flat2)
    for (key, x), y in zip(flat, flat2):
        np.testing.assert_array_equal(np.asarray(y), x, err_msg=jax.tree_util.keystr(key))


# ----------------------------------------------------------------------------------------
# jcp-train and jcp-serve on a Qwen3.5 folder


def test_jcp_train_runs_on_a_qwen3_5_folder(tmp_path):
    """jcp-train --hf-model <Qwen3.5 folder>: two steps of two sft adapters from a data
    file at mesh (1,1,1) (the hybrid model's meshes are the Trainer tests' above; (1,2,2)
    here compiled for ~4 CPU s more); every adapter's loss falls (the default run's rl adapter samples,
    which a hybrid model cannot yet: the data file makes the run sft only). Its main() in
    this process: test_cli runs the real program; a fresh one here cost ~3 CPU s more."""
    import json

    from jcp.train import main

    _, path = _saved()
    rng = np.random.default_rng(0)
    lines = []
    for i in range(4):
        toks = rng.integers(0, mh.V, 30 + 7 * i).tolist()
        lines.append(
            {
                "model_input": toks,
                "adapter": "ab"[i % 2],
                "loss_fn_inputs": {"target_tokens": toks[1:] + [0], "weights": [1.0] * len(toks)},
            }
        )
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    out = tmp_path / "run"
    argv = ["--hf-model", path, "--out", str(out), "--steps", "2", "--data", str(data)]
    argv += ["--batch-size", "2", "--lr", "1e-2", "--no-progress", "--save-every", "2"]
    assert main([*argv, "--mesh", "1,1,1"]) == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    for name in "ab":
        loss = [r["loss:sum"] / r["tokens:sum"] for r in rows if r["adapter"] == name]
        assert len(loss) == 2 and loss[-1] < loss[0], (name, loss)


def test_jcp_serve_trains_a_qwen3_5_model():
    """The tinker SDK against jcp-serve over a Qwen3.5 Trainer: forward_backward and
    optim_step equal the Trainer's own on an adapter of the same seed (every target, the
    Gated DeltaNet projections included); a sample of the trained weights (in-memory
    snapshot), decoded by the server's paged engine, equals Trainer.sample."""
    pytest.importorskip("tinker")
    from helpers.server_harness import client, serving
    from tinker import types

    _, cfg, _ = _reference()
    tr = _trainer((1, 2, 2))
    pairs = []
    # Lengths that pack like test_lora_gradients_equal_peft's data on this cached
    # Trainer (64 rows per device): its forward_backward program serves here too (~5 CPU s).
    for seed, n in ((1, 60), (2, 50)):
        rng = np.random.default_rng(seed)
        toks = rng.integers(0, cfg.vocab_size, n + 1).tolist()
        w = rng.uniform(0.2, 1.0, n).astype(np.float32).tolist()
        pairs.append(
            (
                types.Datum(
                    model_input=types.ModelInput.from_ints(toks[:-1]),
                    loss_fn_inputs={"target_tokens": toks[1:], "weights": w},
                ),
                jcp.Datum(toks[:-1], {"target_tokens": toks[1:], "weights": w}),
            )
        )
    sdk_data, jcp_data = [p[0] for p in pairs], [p[1] for p in pairs]
    adam = dict(learning_rate=1e-2, weight_decay=0.01, grad_clip_norm=50.0)
    with serving(tr, "qwen3_5-tiny", {"tml-alice": "alice"}, "jcp-serve-q35-") as env:
        tc = (
            client(env)
            .create_lora_training_client(base_model="qwen3_5-tiny", rank=4, seed=3)
            .result()
        )
        slot = env["srv"].store.models[tc.model_id].slot
        local = tr.create_adapter(rank=4, alpha=32.0, seed=3)
        assert "in_proj_qkv" in tr.adapters[slot].targets
        try:
            out = tc.forward_backward(sdk_data, "cross_entropy").result()
            ref = tr.forward_backward(jcp_data, "cross_entropy", adapters=local)
            np.testing.assert_allclose(out.metrics["loss:sum"], ref.metrics["loss:sum"], rtol=1e-5)
            tc.optim_step(types.AdamParams(**adam)).result()
            tr.optim_step(local, jcp.AdamParams(**adam))
            got, want = tr.adapter_weights(slot), tr.adapter_weights(local)
            assert got.keys() == want.keys()
            moved = [k for k in want if "lora_B" in k and np.abs(want[k]).max() > 0]
            assert any("in_proj_qkv" in k for k in moved)
            for k in want:
                np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)
            tr.delete_adapter(local)  # room for the sampler snapshot
            # Sampling the trained weights goes through the server's paged engine.
            sampling = env["srv"].worker.sampling
            assert sampling.peak_live == 0
            sc = tc.save_weights_and_get_sampling_client().result()
            prompt = list(SAMPLE_PROMPTS[3])
            res = sc.sample(
                types.ModelInput.from_ints(prompt),
                2,
                types.SamplingParams(max_tokens=SAMPLE_TOKENS, temperature=1.0, seed=11, stop=[]),
            ).result()
            assert sampling.peak_live == 2  # both samples decoded in the engine's batch
            ref = tr.sample(
                [prompt], _no_stop(temperature=1.0, seed=11), adapters=slot, num_samples=2
            )[0]
            assert len(res.sequences) == 2
            assert res.sequences[0].tokens != res.sequences[1].tokens
            for x, y in zip(res.sequences, ref.sequences):
                assert list(x.tokens) == y.tokens.tolist()
                np.testing.assert_allclose(x.logprobs, y.logprobs, rtol=1e-5, atol=1e-6)
        finally:
            for a in list(tr.adapters):  # the cached Trainer's slots (snapshot too) freed
                tr.delete_adapter(a)
