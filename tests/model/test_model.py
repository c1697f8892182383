"""The Qwen2/Qwen3 decoder under a (dp, cp, tp) mesh against Hugging Face transformers.

Evidence:
1. per-datum log-probs equal Qwen2ForCausalLM / Qwen3ForCausalLM (tied and untied) at
   every mesh, loaded through jcp.load_hf from a save_pretrained folder (fp32, atol 2e-4);
2. a datum packed with others gets the log-probs it gets alone;
3. the gradient of a scalar loss w.r.t. every base parameter, taken outside the
   shard_map'd model + losses.shard_loss, is the same at cp = 2, 4 as at cp = 1, and the
   cp = 1 gradient is torch autograd's;
4. a rank that holds only padding, and one-token datums, give finite, correct results;
5. the compiled backward holds no [S, T]-sized array (memory linear in the tokens).
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from helpers import model_harness as MH

import jcp
from jcp import mesh as mesh_lib

ATOL = 2e-4
LENGTHS = (37, 1, 20, 64)  # a one-token datum; lengths not multiples of 2·cp
VARIANTS = (("qwen3", False), ("qwen3", True), ("qwen2", False), ("qwen2", True))


@functools.cache
def _variant(arch, tied, tmp_root):
    """(hf model, cfg, lazy base params) for one architecture, through load_hf."""
    hm = MH.hf_model(arch, tied, seed=1 + len(arch) + 2 * tied)
    path = MH.save(hm, f"{tmp_root}/{arch}_{'tied' if tied else 'untied'}")
    cfg, base = jcp.load_hf(path)
    return hm, cfg, base


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("hf_models"))


@pytest.fixture(scope="module")
def data():
    return MH.random_data(LENGTHS, seed=0)


def _check_variant_loaded(cfg, arch, tied):
    assert cfg.tie_word_embeddings == tied
    assert cfg.qk_norm == (arch == "qwen3")
    assert cfg.attention_bias == (arch == "qwen2")
    assert cfg.head_dim == MH.HEAD_DIM != cfg.hidden_size // cfg.num_heads


# ----------------------------------------------------------------------------------------
# 1. Log-prob parity with transformers


@pytest.mark.parametrize("mesh_shape", MH.MESHES, ids=lambda m: "dp{}cp{}tp{}".format(*m))
@pytest.mark.parametrize("arch,tied", VARIANTS, ids=lambda v: str(v))
def test_logprobs_match_transformers(arch, tied, mesh_shape, tmp_root, data):
    hm, cfg, base = _variant(arch, tied, tmp_root)
    _check_variant_loaded(cfg, arch, tied)
    seqs, targets, _ = data
    ref = MH.reference_logprobs(hm, seqs, targets)
    # The reference is far from a uniform model, so a broken model cannot pass by accident.
    assert max(np.max(np.abs(r + np.log(MH.V))) for r in ref) > 0.1
    assert dict(MH.mesh(mesh_shape).shape) == dict(zip(mesh_lib.AXES, mesh_shape))

    ours = MH.logprobs(cfg, base, mesh_shape, seqs, targets)
    for i, (o, r) in enumerate(zip(ours, ref)):
        assert o.shape == r.shape
        np.testing.assert_allclose(o, r, rtol=0, atol=ATOL, err_msg=f"datum {i}")


def test_dense_attention_matches_transformers(tmp_root, data):
    """The dense reference attention gives the same log-probs as blockwise (cp = tp = 2)."""
    hm, cfg, base = _variant("qwen2", False, tmp_root)
    seqs, targets, _ = data
    ref = MH.reference_logprobs(hm, seqs, targets)
    ours = MH.logprobs(cfg, base, (1, 2, 2), seqs, targets, impl="dense")
    for i, (o, r) in enumerate(zip(ours, ref)):
        np.testing.assert_allclose(o, r, rtol=0, atol=ATOL, err_msg=f"datum {i}")


# ----------------------------------------------------------------------------------------
# 2. Packing isolation


@pytest.mark.parametrize(
    "mesh_shape", [(1, 1, 1), (1, 4, 1), (2, 2, 2)], ids=lambda m: "dp{}cp{}tp{}".format(*m)
)
def test_packed_datum_equals_alone(mesh_shape, tmp_root):
    _, cfg, base = _variant("qwen3", False, tmp_root)
    seqs, targets, _ = MH.random_data((45, 30, 9, 27), seed=3)
    alone_pb = MH.pack(cfg, mesh_shape, seqs[:1], targets[:1])
    packed_pb = MH.pack(cfg, mesh_shape, seqs, targets)
    # The datum really shares its stream with others (same dp shard, other segments) in
    # the packed batch, and the streams differ from the lone one.
    (p0,) = [p for p in packed_pb.placements if p.index == 0]
    shard_segs = set(np.unique(packed_pb.segment[p0.shard])) - {-1}
    assert len(shard_segs) > 1
    assert packed_pb.tokens.shape != alone_pb.tokens.shape or not np.array_equal(
        packed_pb.segment, alone_pb.segment
    )

    alone = MH.logprobs(cfg, base, mesh_shape, seqs[:1], targets[:1])[0]
    packed = MH.logprobs(cfg, base, mesh_shape, seqs, targets)
    np.testing.assert_allclose(packed[0], alone, rtol=0, atol=2e-5)
    # Every other datum is likewise unaffected by its neighbours.
    for i in range(1, len(seqs)):
        single = MH.logprobs(cfg, base, mesh_shape, seqs[i : i + 1], targets[i : i + 1])[0]
        np.testing.assert_allclose(packed[i], single, rtol=0, atol=2e-5, err_msg=f"datum {i}")


# ----------------------------------------------------------------------------------------
# 3. Gradients through the whole model: cp-independent and equal to torch autograd

# Each variant at cp = 1 and two other meshes; together they cover cp = 2, 4, tp and dp.
GRAD_MESHES = {("qwen3", False): ((1, 2, 1), (2, 2, 2)), ("qwen2", True): ((1, 4, 1), (1, 2, 2))}
GRAD_VARIANTS = tuple(GRAD_MESHES)
GRAD_RTOL = 2e-4  # relative to each parameter's largest gradient entry


def _assert_tree_close(actual, desired, rtol, what, allow_zero=False):
    """Leaf by leaf, |a − d| ≤ rtol · max|d|; a zero reference leaf must be matched exactly."""
    flat_a = jax.tree_util.tree_leaves_with_path(actual)
    flat_d = jax.tree.leaves(desired)
    assert len(flat_a) == len(flat_d)
    for (path, a), d in zip(flat_a, flat_d):
        d = np.asarray(d, np.float64)
        scale = float(np.max(np.abs(d)))
        assert scale > 0 or allow_zero, f"{what}: zero gradient at {jax.tree_util.keystr(path)}"
        assert np.all(np.isfinite(a)), f"{what}: non-finite at {jax.tree_util.keystr(path)}"
        np.testing.assert_allclose(
            np.asarray(a, np.float64),
            d,
            rtol=0,
            atol=rtol * scale,
            err_msg=f"{what}: {jax.tree_util.keystr(path)}",
        )


@functools.cache
def _grads(arch, tied, tmp_root, mesh_shape):
    _, cfg, base = _variant(arch, tied, tmp_root)
    seqs, targets, weights = MH.random_data((29, 1, 50, 16), seed=7)
    return MH.loss_and_grads(cfg, base, mesh_shape, seqs, targets, weights)


@pytest.mark.parametrize("arch,tied", GRAD_VARIANTS, ids=lambda v: str(v))
def test_grad_cp1_matches_torch(arch, tied, tmp_root):
    hm, cfg, _ = _variant(arch, tied, tmp_root)
    seqs, targets, weights = MH.random_data((29, 1, 50, 16), seed=7)
    ref, ref_loss = MH.reference_grads(hm, cfg, seqs, targets, weights)
    loss, g, _ = _grads(arch, tied, tmp_root, (1, 1, 1))
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    _assert_tree_close(g, ref, GRAD_RTOL, "cp=1 vs torch")


@pytest.mark.parametrize(
    "arch,tied,mesh_shape",
    [(a, t, m) for (a, t), ms in GRAD_MESHES.items() for m in ms],
    ids=lambda v: str(v),
)
def test_grad_cp_matches_cp1(arch, tied, mesh_shape, tmp_root):
    loss1, g1, pb1 = _grads(arch, tied, tmp_root, (1, 1, 1))
    loss_k, g_k, pb_k = _grads(arch, tied, tmp_root, mesh_shape)
    # The two runs really used different layouts: cp streams, zigzag-cut.
    assert pb1.tokens.shape[1] == 1 and pb_k.tokens.shape[1] == mesh_shape[1] > 1
    assert pb_k.tokens.shape[2] < pb1.tokens.shape[2]
    assert not np.array_equal(pb_k.position[0, 0], pb1.position[0, 0, : pb_k.tokens.shape[2]])
    np.testing.assert_allclose(loss_k, loss1, rtol=1e-5)
    _assert_tree_close(g_k, g1, GRAD_RTOL, f"mesh {mesh_shape} vs cp=1")


# ----------------------------------------------------------------------------------------
# 4. Padding-only ranks and one-token datums


def test_padding_only_ranks_and_one_token_datum(tmp_root):
    """One one-token datum at cp = 4: ranks 1–3 hold only padding."""
    hm, cfg, base = _variant("qwen2", True, tmp_root)
    seqs, targets, weights = MH.random_data((1,), seed=11)
    pb = MH.pack(cfg, (1, 4, 1), seqs, targets, weights)
    real_per_rank = (pb.segment[0] >= 0).sum(-1)
    assert real_per_rank.tolist() == [1, 0, 0, 0]

    ref = MH.reference_logprobs(hm, seqs, targets)
    (ours,) = MH.logprobs(cfg, base, (1, 4, 1), seqs, targets)
    np.testing.assert_allclose(ours, ref[0], rtol=0, atol=ATOL)

    loss1, g1, _ = MH.loss_and_grads(cfg, base, (1, 1, 1), seqs, targets, weights)
    loss4, g4, _ = MH.loss_and_grads(cfg, base, (1, 4, 1), seqs, targets, weights)
    for x in jax.tree.leaves(g4):
        assert np.all(np.isfinite(x))
    np.testing.assert_allclose(loss4, loss1, rtol=1e-5)
    # With one key per query, q and k get no gradient; those leaves must be exactly zero.
    _assert_tree_close(g4, g1, GRAD_RTOL, "one-token datum, cp=4 vs cp=1", allow_zero=True)


# ----------------------------------------------------------------------------------------
# 5. No [S, T] array per device, forward or backward


@pytest.mark.parametrize(
    "mesh_shape", [(1, 1, 1), (1, 2, 1)], ids=lambda m: "dp{}cp{}tp{}".format(*m)
)
def test_backward_memory_is_linear_in_tokens(mesh_shape, tmp_root):
    """The compiled gradient (remat on, layers under lax.scan) holds no [S, T] array.

    Under the layers' scan, JAX's partial evaluation can split the attention loop nest and
    stack per-block masks as [nq, nk, …, Bq, Bk] residuals (O(S·T) bytes); this guards
    against it: doubling the tokens must not quadruple the temp memory.
    """
    _, cfg, _ = _variant("qwen3", False, tmp_root)
    cp = mesh_shape[1]
    temps = {}
    for s_len in (1024, 2048):
        compiled = MH.compiled_grad(cfg, mesh_shape, s_len, attn_block=128, chunk=128)
        temps[s_len] = compiled.memory_analysis().temp_size_in_bytes
        (n, shape), *_ = MH.largest_hlo_arrays(compiled)
        assert n < s_len * cp * s_len / 4, f"S={s_len}: an array {shape} of {n} elements"
    assert temps[2048] < 2.5 * temps[1024], temps
    # And far below one fp32 [H, S, T] score array.
    assert temps[2048] < 2048 * cp * 2048 * cfg.num_heads * 4 / 3, temps


def test_bf16_layer_scan_holds_no_f32_weight_stack():
    """scan_layers on XLA:CPU: the compiled forward + backward of a bf16 layer scan holds
    no f32 copy of a whole [L, …] weight stack (a plain lax.scan over the same weights
    does: XLA:CPU's float normalization slices an f32 conversion of the stack, hoisted out
    of the loop), with the same values and gradients (also w.r.t. the weights)."""
    import jax.numpy as jnp

    from jcp.model import decoder

    layers, d = 3, 24
    rng = np.random.default_rng(0)
    w = {
        "w": jnp.asarray(rng.standard_normal((layers, d, d)) / 5, jnp.bfloat16),
        "n": jnp.asarray(1 + rng.standard_normal((layers, d)) / 5, jnp.bfloat16),
    }
    lora = jnp.asarray(rng.standard_normal((layers, d)), jnp.float32)
    h0 = jnp.asarray(rng.standard_normal((5, d)), jnp.bfloat16)

    def body(h, xs):
        layer, b = xs
        return jnp.tanh(h @ layer["w"] * layer["n"] + b.astype(h.dtype)), None

    def loss(scan, w, lora, h0):
        return scan(w, lora, h0).astype(jnp.float32).sum()

    ours = lambda w, lora, h0: decoder.scan_layers(body, h0, w, (lora,), True)[0]  # noqa: E731
    plain = lambda w, lora, h0: jax.lax.scan(  # noqa: E731
        jax.checkpoint(body), h0, (w, lora)
    )[0]

    def grad_of(f, argnums):
        return jax.jit(jax.value_and_grad(functools.partial(loss, f), argnums=argnums))

    # As jcp trains: the weights frozen, gradients w.r.t. the adapter and the input. The
    # plain scan's temporaries hold the f32 stack (and more); ours do not.
    temp = {
        n: grad_of(f, (1, 2)).lower(w, lora, h0).compile().memory_analysis().temp_size_in_bytes
        for n, f in (("ours", ours), ("plain", plain))
    }
    assert temp["plain"] - temp["ours"] >= layers * d * d * 4, temp
    grads = {n: grad_of(f, (0, 1, 2)) for n, f in (("ours", ours), ("plain", plain))}
    (v1, g1), (v2, g2) = (g(w, lora, h0) for g in grads.values())
    assert float(v1) == float(v2) and np.isfinite(float(v1))
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        assert np.abs(np.asarray(a, np.float32)).max() > 0
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_hybrid_model_refuses_unrolled_layer_slices():
    """A hybrid model's layers are not a uniform stack, so layer_slices' unrolled path would
    run its Gated DeltaNet layers as dense attention: refused before any computation."""
    from jcp import model as model_lib

    cfg = jcp.QwenConfig.tiny_qwen3_5()
    params = model_lib.random_params(cfg)
    slices = model_lib.layer_slices(cfg, params)
    tokens = np.zeros(4, np.int32)
    with pytest.raises(NotImplementedError, match="hybrid"):
        model_lib.hidden_states(
            cfg, params, tokens, np.arange(4), model_lib.Pass(None, layers=slices)
        )
