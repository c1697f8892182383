"""The model + loss of one device's stream, inside the training shard_map: embed →
hidden_states (CP attention, the training strategy) → unembed_factors → losses.shard_loss,
and a MoE model's router statistics and auxiliary loss.

Owns StepConfig (the static settings of the compiled steps), the training attention
strategy (training_attend) and whether the layer loop unrolls (unroll_layers). It must
never differentiate base weights (save the unembedding where a test asks: LossOptions) and
never sum anything over dp or cp but the statistics MoE routing needs; jcp/train_step.py
owns the shard_map, the gradient and the jitted steps around it.

Shapes: see the legend in jcp/mesh.py.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jcp import attention as attention_lib
from jcp import delta_rule as delta_rule_lib
from jcp import losses as losses_lib
from jcp import model as model_lib
from jcp.config import QwenConfig
from jcp.errors import float32_number
from jcp.mesh import BATCH_AXES, CP, TP
from jcp.model import moe as moe_lib

LORA_IMPLEMENTATIONS = ("xla", "cpu")


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """Static settings of the compiled steps, each validated here and only here (Trainer
    builds one before anything else; ValueError naming the setting)."""

    # True / False: recompute each layer in the backward pass or not; "auto" is the
    # Trainer's (it compiles the step with each as the compiled memory requires); the
    # steps themselves recompute only for True.
    remat: bool | str = True
    attn_impl: str = "blockwise"
    # The grouped LoRA products over the slot tables' pages: "xla" or "cpu" (TrainerOptions).
    lora_impl: str = "xla"
    attn_block: int = 128
    logprob_chunk: int = 1024
    # How queries reach the other cp ranks' keys: "gather", "ring", or "auto" (see
    # attention.choose_cp_attention).
    cp_attention: str = "auto"
    # MoE only: the weight of the router auxiliary loss added to the differentiated loss
    # (model_loss); 0 adds nothing and compiles nothing for it. Kept as its float32 value.
    router_aux_loss_coef: float = 0.0

    def __post_init__(self):
        if not (self.remat is True or self.remat is False or self.remat == "auto"):
            raise ValueError(f"remat must be True, False or 'auto', got {self.remat!r}")
        if self.attn_impl not in attention_lib.IMPLEMENTATIONS:
            raise ValueError(
                f"attn_impl must be one of {attention_lib.IMPLEMENTATIONS}, got {self.attn_impl!r}"
            )
        if self.lora_impl not in LORA_IMPLEMENTATIONS:
            raise ValueError(
                f"lora_impl must be one of {LORA_IMPLEMENTATIONS} (or 'auto' for the "
                f"Trainer), got {self.lora_impl!r}"
            )
        if self.cp_attention not in attention_lib.CP_ATTENTION:
            raise ValueError(
                f"cp_attention must be one of {attention_lib.CP_ATTENTION}, got "
                f"{self.cp_attention!r}"
            )
        coef = float32_number(self.router_aux_loss_coef, "router_aux_loss_coef")
        if coef < 0:
            raise ValueError(f"router_aux_loss_coef must be ≥ 0, got {coef}")
        object.__setattr__(self, "router_aux_loss_coef", coef)
        for name in ("attn_block", "logprob_chunk"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.cp_attention == "ring" and self.attn_impl == "dense":
            raise ValueError(
                f"cp_attention='ring' needs attn_impl one of "
                f"{attention_lib.RING_IMPLEMENTATIONS}, got 'dense'"
            )


@dataclasses.dataclass(frozen=True)
class Stream:
    """This device's rows of a micro-batch, inside the shard_map: tokens_S, segment_S
    (−1: padding), position_S, targets_S ([S], or [S, K] scored targets), inputs (the
    client vectors, losses.TokenInputs), loss_id_S (each token's index into
    LossOptions.loss_fn when that is a tuple; None: one loss) and call_tokens (int32 [],
    replicated: the real tokens of the whole call; None: this micro-batch is the call)."""

    tokens_S: jax.Array
    segment_S: jax.Array
    position_S: jax.Array
    targets_S: jax.Array
    inputs: losses_lib.TokenInputs
    loss_id_S: jax.Array | None = None
    call_tokens: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class LossOptions:
    """The static options of model_loss: loss_fn, num_slots, keep_token_logprobs and summed
    as in losses.shard_loss (LossPlan); base_unembed_grad: differentiate the base
    unembedding too (training never does: it is frozen; tests of base gradients do)."""

    loss_fn: str | tuple[str, ...]
    num_slots: int
    base_unembed_grad: bool = False
    keep_token_logprobs: bool = False
    summed: bool = True


def model_loss(
    cfg: QwenConfig,
    step_cfg: StepConfig,
    params,
    lora,
    route,
    stream: Stream,
    loss_cfg,
    opts: LossOptions,
    after=None,
):
    """Model + loss of this device's stream, inside the shard_map: (loss, ShardOutputs);
    opts.summed=False (dense models only): (this shard's loss, its output parts), as
    losses.shard_loss(summed=False).

    embed → hidden_states (CP attention, the training strategy) → unembed_factors →
    losses.shard_loss. lora: the active adapters (take_active) or None for the base model
    alone, routed by `route`; loss_cfg: the losses' settings, as in losses.shard_loss.

    MoE models: outputs.expert_counts [Lm, E] counts every MoE layer's assignments of the
    real tokens of all (dp, cp) shards (psum over dp and cp only: every tp rank routes the
    same tokens alike). With step_cfg.router_aux_loss_coef = c > 0 the loss gains
    c · w · moe.load_balancing_loss over this micro-batch's real tokens (f and P global
    over dp and cp), w = its real tokens / stream.call_tokens (the call's; None: this
    micro-batch is the whole call) — so a call split into several micro-batches gets the
    token-weighted mean of theirs; outputs.router_aux_loss holds that term's value.

    after (dense models): (split, h [S, D]): the layers from split on, h what layers [0,
    split) left; split = L: h the final hidden states (layer_span's), the head and the
    loss alone.
    """
    segment_S, position_S = stream.segment_S, stream.position_S
    real_S = segment_S >= 0
    if after is not None:  # the layers from `split` on, from an earlier program's h
        split, h_SxD = after
        if split < cfg.num_layers:  # else h_SxD is the final hidden states: the head's alone
            run = _dense_pass(cfg, step_cfg, stream)
            h_SxD = model_lib.hidden_span(
                cfg, params, h_SxD, position_S, run, lora, route, start=split, stop=cfg.num_layers
            )
        return _loss_of(cfg, step_cfg, params, lora, route, stream, loss_cfg, opts, h_SxD)
    # Gated DeltaNet layers (hybrid models): a stream holds at most two pieces (zigzag
    # chunks) of each of its num_slots datums, and one padding piece.
    mix = (
        delta_rule_lib.cp_mix(segment_S, position_S, 2 * opts.num_slots + 1, CP)
        if cfg.is_hybrid
        else None
    )
    run = dataclasses.replace(_dense_pass(cfg, step_cfg, stream), mix=mix, count_S=real_S)
    h_SxD, _, stats = model_lib.hidden_states(
        cfg, params, stream.tokens_S, position_S, run, lora, route
    )
    loss, outputs = _loss_of(cfg, step_cfg, params, lora, route, stream, loss_cfg, opts, h_SxD)
    if stats is None:
        return loss, outputs
    if not opts.summed:
        raise ValueError("model_loss(summed=False) is for dense models")
    return _with_router_stats(cfg, step_cfg, stats, real_S, stream.call_tokens, loss, outputs)


def layer_span(
    cfg: QwenConfig, step_cfg: StepConfig, params, lora, route, stream: Stream, start, stop, h=None
):
    """A dense model's layers [start, stop) of this device's stream, inside the shard_map:
    the hidden states [S, D] that the next span, or model_loss(after=(stop, them)), goes
    on from (stop the last layer: the final hidden states, after the final norm, which
    the head takes); h: the hidden states the layers before start left (None: start is 0,
    the stream's tokens)."""
    run = _dense_pass(cfg, step_cfg, stream)
    x = stream.tokens_S if h is None else h
    return model_lib.hidden_span(
        cfg, params, x, stream.position_S, run, lora, route, start=start, stop=stop
    )


def _dense_pass(cfg: QwenConfig, step_cfg: StepConfig, stream: Stream):
    """How a dense model's layers run in training: model_loss's Pass without a hybrid
    model's mixing or a MoE model's routing records."""
    return model_lib.decoder.Pass(
        training_attend(cfg, step_cfg, stream.segment_S, stream.position_S),
        remat=step_cfg.remat is True,
        unroll=unroll_layers(cfg, step_cfg),
    )


def _loss_of(cfg, step_cfg, params, lora, route, stream: Stream, loss_cfg, opts, h_SxD):
    """unembed_factors → losses.shard_loss of the final hidden states (model_loss)."""
    factors = model_lib.unembed_factors(params, h_SxD, lora, route)
    plan = losses_lib.LossPlan(
        opts.loss_fn,
        opts.num_slots,
        chunk=step_cfg.logprob_chunk,
        right_grads=(opts.base_unembed_grad,) + (True,) * (len(factors.rights) - 1),
        keep_token_logprobs=opts.keep_token_logprobs,
        summed=opts.summed,
    )
    return losses_lib.shard_loss(
        factors,
        stream.targets_S,
        stream.segment_S,
        stream.inputs,
        loss_cfg,
        plan,
        stream.loss_id_S,
    )


def _with_router_stats(
    cfg: QwenConfig, step_cfg: StepConfig, stats, real_S, call_tokens, loss, outputs
):
    """(loss, outputs) of a MoE model: the expert counts summed over (dp, cp) in outputs and,
    with router_aux_loss_coef > 0, the router auxiliary term added to the loss (model_loss)."""
    counts_LxE = jax.lax.psum(stats.counts, BATCH_AXES)
    outputs = dataclasses.replace(outputs, expert_counts=counts_LxE)
    if not step_cfg.router_aux_loss_coef:
        return loss, outputs
    tokens = jax.lax.psum(jnp.sum(real_S, dtype=jnp.int32), BATCH_AXES)
    weight = step_cfg.router_aux_loss_coef * (
        1.0 if call_tokens is None else tokens / jnp.maximum(call_tokens, 1)
    )
    aux = weight * moe_lib.load_balancing_loss(
        counts_LxE, jax.lax.psum(stats.prob_sum, BATCH_AXES), tokens, cfg.num_experts_per_tok
    )
    outputs = dataclasses.replace(outputs, router_aux_loss=jax.lax.stop_gradient(aux))
    return loss + aux.astype(loss.dtype), outputs


# Training unrolls the layer loop on XLA:CPU up to this many layers (unroll_layers).
CPU_UNROLL_LAYERS = 8


def unroll_layers(cfg: QwenConfig, step_cfg: StepConfig) -> bool:
    """Whether the training step unrolls its layer loop (model.scan_layers): on XLA:CPU with
    ≤ CPU_UNROLL_LAYERS layers, when the layers are not recomputed. A rolled loop slices
    every weight stack per layer and copies every saved activation into an [L, …] stack,
    ~10 % of the CPU step of throughput.py's 4-layer model (a hybrid model's runs of
    layers too: 12-15 % of qwen3_5.py's 16k step); unrolled, compile time grows
    ∝ L, which is why deep models keep the loop (on accelerators those copies are cheap next
    to the layers' work). A recomputing step (remat: chosen where memory requires it) keeps
    the loop, whose liveness is one layer's: unrolled, XLA:CPU's schedule of the
    recomputation held ~30 % more temporaries (tests/model/test_model.py's memory bound)."""
    return (
        jax.default_backend() == "cpu"
        and cfg.num_layers <= CPU_UNROLL_LAYERS
        and step_cfg.remat is not True
    )


def training_attend(cfg: QwenConfig, step_cfg: StepConfig, segment_S, position_S):
    """The attention strategy of training (inside the shard_map): ring_attend or cp_attend,
    as attention.choose_cp_attention picks for this stream's shape ("dense" always gathers)."""
    cp, tp = jax.lax.axis_size(CP), jax.lax.axis_size(TP)
    choice = "gather" if step_cfg.attn_impl == "dense" else step_cfg.cp_attention
    how = attention_lib.choose_cp_attention(
        choice,
        cp,
        segment_S.shape[0],
        cfg.num_kv_heads // tp,
        cfg.head_dim,
        jnp.dtype(cfg.dtype).itemsize,
    )
    if how == "ring":
        return attention_lib.ring_attend(
            segment_S, position_S, block=step_cfg.attn_block, implementation=step_cfg.attn_impl
        )
    return attention_lib.cp_attend(
        segment_S, position_S, implementation=step_cfg.attn_impl, block=step_cfg.attn_block
    )
