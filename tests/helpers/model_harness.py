"""Drive the whole decoder inside jax.shard_map (jcp.train_step.model_loss: jcp.model +
jcp.losses.shard_loss, the body the training step runs), and build the independent
reference: a tiny Hugging Face Qwen2/Qwen3 made in code.

The reference models get random non-unit norm weights and non-zero Qwen2 biases, so a
dropped norm or bias shows in the log-probs. Compiled functions are cached per (config,
mesh, attention implementation, datum slots) so the many parametrized tests share them.

Legend: DP, CP, TP mesh axis sizes; S tokens of one device's stream; N tokens of a datum;
V vocab; D hidden.
"""

from __future__ import annotations

import functools
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax.sharding import PartitionSpec as P

import jcp
from helpers.hf_models import tiny_hf
from jcp import batch as batch_lib
from jcp import hf as hf_lib
from jcp import losses, train_step
from jcp import mesh as mesh_lib
from jcp import model as model_lib

V, D, F, LAYERS = 128, 64, 96, 2
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 24  # head_dim ≠ D / HEADS on purpose
ATTN_BLOCK = 16  # attention block: small so streams span several q and k blocks
CHUNK = 16  # log-prob token chunk: likewise
STREAM_TOKENS = 256  # tokens per dp row over all cp ranks, after padding
MESHES = ((1, 1, 1), (1, 2, 1), (1, 4, 1), (1, 2, 2), (2, 2, 2))
LOSS_FN = "cross_entropy"


# ----------------------------------------------------------------------------------------
# The Hugging Face reference


def hf_model(arch: str, tied: bool, seed: int = 0, attention_bias: bool | None = None):
    """A tiny random Qwen2ForCausalLM / Qwen3ForCausalLM of this harness's sizes
    (hf_models.tiny_hf)."""
    extra = {} if attention_bias is None or arch != "qwen3" else {"attention_bias": attention_bias}
    return tiny_hf(
        arch,
        seed=seed,
        vocab_size=V,
        hidden_size=D,
        intermediate_size=F,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        tie_word_embeddings=tied,
        **extra,
    )


def save(hm, path, **kwargs) -> str:
    """save_pretrained as safetensors; returns the folder."""
    os.makedirs(path, exist_ok=True)
    hm.save_pretrained(path, safe_serialization=True, **kwargs)
    return os.fspath(path)


def reference_logprobs(hm, seqs, targets) -> list[np.ndarray]:
    """log p(target_i | tokens ≤ i) of each datum run alone through the HF model: [N] fp64."""
    out = []
    with torch.no_grad():
        for s, t in zip(seqs, targets):
            logits = hm(torch.tensor(np.asarray(s))[None]).logits[0].double()
            lp = torch.log_softmax(logits, -1)[torch.arange(len(s)), torch.tensor(np.asarray(t))]
            out.append(lp.numpy())
    return out


def reference_grads(hm, cfg, seqs, targets, weights) -> dict:
    """d(−Σ w·lp)/d(base params) by torch autograd, in jcp's tree layout (NumPy)."""
    hm.zero_grad()
    total = 0.0
    for s, t, w in zip(seqs, targets, weights):
        logits = hm(torch.tensor(np.asarray(s))[None]).logits[0]
        lp = torch.log_softmax(logits, -1)[torch.arange(len(s)), torch.tensor(np.asarray(t))]
        total = total - (torch.tensor(np.asarray(w, np.float32)) * lp).sum()
    total.backward()
    grads = {n: p.grad.detach().numpy().copy() for n, p in hm.named_parameters()}
    hm.zero_grad()
    # hf_params maps HF names and layouts to jcp's tree; reuse it on the gradients.
    tree = hf_lib.hf_params(cfg, {n: (lambda g=g: g) for n, g in grads.items()})
    return jax.tree.map(np.asarray, tree), float(total.detach())


# ----------------------------------------------------------------------------------------
# Data


def random_data(lengths, seed=0):
    """(tokens, targets, weights) per datum; weights random in [0.5, 1.5)."""
    rng = np.random.default_rng(seed)
    seqs = [rng.integers(0, V, n) for n in lengths]
    targets = [rng.integers(0, V, n) for n in lengths]
    weights = [rng.uniform(0.5, 1.5, n).astype(np.float32) for n in lengths]
    return seqs, targets, weights


def pack(cfg, mesh_shape, seqs, targets, weights=None) -> batch_lib.PackedBatch:
    """One micro-batch, every datum on adapter 0, streams padded to STREAM_TOKENS / cp.

    One stream length per mesh lets every test at that mesh reuse one compiled program.
    """
    dp, cp, _ = mesh_shape
    weights = weights or [np.ones(len(s), np.float32) for s in seqs]
    data = [
        jcp.Datum(s, {"target_tokens": t, "weights": w}) for s, t, w in zip(seqs, targets, weights)
    ]
    checked = batch_lib.validate(data, LOSS_FN, cfg.vocab_size, 10**6)
    (pb,) = batch_lib.pack(checked, [0] * len(checked), dp, cp, 1 << 16, 1)
    return batch_lib.pad_streams(pb, max(STREAM_TOKENS // cp, pb.tokens.shape[-1]))


# ----------------------------------------------------------------------------------------
# The model under shard_map


@functools.cache
def mesh(mesh_shape):
    return jcp.make_mesh(*mesh_shape)


def place(cfg, base, mesh_shape):
    return model_lib.place(base, model_lib.param_specs(cfg), mesh(mesh_shape))


def _sharded_loss(cfg, mesh_shape, impl, num_slots, remat, attn_block=ATTN_BLOCK, chunk=CHUNK):
    """shard_map'd (params, tokens, segment, position, targets, weights) -> (loss, outputs):
    train_step.model_loss on the base model alone (no LoRA), base unembedding differentiated."""
    step_cfg = train_step.StepConfig(
        remat=remat, attn_impl=impl, attn_block=attn_block, logprob_chunk=chunk
    )

    def inner(params, tok, seg, pos, tgt, w):
        tok, seg, pos, tgt, w = (x[0, 0] for x in (tok, seg, pos, tgt, w))
        stream = train_step.Stream(tok, seg, pos, tgt, losses.TokenInputs(w, w, w))
        opts = train_step.LossOptions(LOSS_FN, num_slots, base_unembed_grad=True)
        return train_step.model_loss(cfg, step_cfg, params, None, None, stream, {}, opts)

    return jax.shard_map(
        inner,
        mesh=mesh(mesh_shape),
        in_specs=(model_lib.param_specs(cfg),) + (mesh_lib.SPECS.stream_DPxCPxS,) * 5,
        out_specs=(P(), P()),
    )


@functools.cache
def forward_fn(cfg, mesh_shape, impl="blockwise", num_slots=8):
    return jax.jit(_sharded_loss(cfg, mesh_shape, impl, num_slots, remat=False))


@functools.cache
def grad_fn(cfg, mesh_shape, impl="blockwise", num_slots=8, remat=True):
    """jit(value_and_grad) of the loss w.r.t. the base parameters, taken outside shard_map."""
    f = _sharded_loss(cfg, mesh_shape, impl, num_slots, remat)
    return jax.jit(jax.value_and_grad(lambda p, *xs: f(p, *xs)[0]))


def _args(pb):
    return (pb.tokens, pb.segment, pb.position, pb.targets, pb.floats["weights"])


def logprobs(cfg, base, mesh_shape, seqs, targets, impl="blockwise") -> list[np.ndarray]:
    """Per-datum log-probs [N] (original order) from the sharded model at mesh_shape."""
    pb = pack(cfg, mesh_shape, seqs, targets)
    _, out = forward_fn(cfg, mesh_shape, impl, pb.num_slots)(
        place(cfg, base, mesh_shape), *_args(pb)
    )
    per = batch_lib.unpack(np.asarray(out.logprobs), pb)
    return [per[i] for i in range(len(seqs))]


def loss_and_grads(cfg, base, mesh_shape, seqs, targets, weights, remat=True):
    """(loss, gradient tree as NumPy) of −Σ w·lp w.r.t. the base parameters."""
    pb = pack(cfg, mesh_shape, seqs, targets, weights)
    loss, g = grad_fn(cfg, mesh_shape, "blockwise", pb.num_slots, remat)(
        place(cfg, base, mesh_shape), *_args(pb)
    )
    return float(loss), jax.tree.map(np.asarray, g), pb


def tree_max_abs_diff(a, b) -> float:
    return max(
        jax.tree.leaves(
            jax.tree.map(
                lambda x, y: float(
                    np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)))
                ),
                a,
                b,
            )
        )
    )


def tree_max_abs(a) -> float:
    return max(float(np.max(np.abs(x))) for x in jax.tree.leaves(a))


def compiled_grad(cfg, mesh_shape, s_len, attn_block=ATTN_BLOCK, chunk=CHUNK):
    """The compiled (not run) gradient of the loss w.r.t. the base parameters for streams of
    s_len tokens per device: shapes only, so long streams cost nothing but compile time."""
    m = mesh(mesh_shape)
    dp, cp, _ = mesh_shape
    stream = mesh_lib.SPECS.stream_DPxCPxS

    def abstract(shape, spec, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=jax.sharding.NamedSharding(m, spec))

    params = jax.tree.map(
        lambda s, sp: abstract(s, sp, jnp.float32),
        model_lib.param_shapes(cfg),
        model_lib.param_specs(cfg),
        is_leaf=lambda x: isinstance(x, tuple),
    )
    ints = abstract((dp, cp, s_len), stream, jnp.int32)
    floats = abstract((dp, cp, s_len), stream, jnp.float32)
    f = _sharded_loss(cfg, mesh_shape, "blockwise", 8, True, attn_block, chunk)
    return (
        jax.jit(jax.grad(lambda p, *xs: f(p, *xs)[0]))
        .lower(params, ints, ints, ints, ints, floats)
        .compile()
    )


def largest_hlo_arrays(compiled, top=5) -> list[tuple[int, str]]:
    """(elements, shape) of the largest array shapes in the optimized HLO."""
    found = {}
    for dtype, dims in re.findall(r"\b(f32|bf16|s32|pred|u32)\[([\d,]+)\]", compiled.as_text()):
        n = int(np.prod([int(d) for d in dims.split(",")]))
        found[f"{dtype}[{dims}]"] = n
    return sorted(((n, s) for s, n in found.items()), reverse=True)[:top]


def peft_fp64_reference(pm, seqs, targets, weights):
    """(per-datum log-probs, loss, {parameter name without ".default": gradient}) of the
    peft model pm in fp64: loss = −Σ weights · log p(target), every datum alone."""
    pm = pm.double().eval()
    total, lps = 0.0, []
    for s, t, w in zip(seqs, targets, weights):
        logits = pm(torch.tensor(np.asarray(s))[None]).logits[0]
        lp = torch.log_softmax(logits, -1)[torch.arange(len(s)), torch.tensor(np.asarray(t))]
        total = total - (torch.tensor(np.asarray(w, np.float64)) * lp).sum()
        lps.append(lp.detach().numpy())
    total.backward()
    grads = {
        n.replace(".default", ""): p.grad.numpy()
        for n, p in pm.named_parameters()
        if p.grad is not None
    }
    return lps, float(total.detach()), grads
