"""The Tinker losses and per-datum outputs.

The device side (the loss functions, token_losses, shard_loss and the per-datum gathers)
runs per shard inside the one shard_map, on the log-probs of jcp/logprobs.py (chunked,
vocab-parallel; target_logprobs, and prompt_stats re-exported here). It must never build an
array of [tokens, vocab] (forward or backward), never average a loss (Tinker losses are
sums), and never let the per-datum outputs reach the gradient.

The one loss table (LOSSES) registers each Tinker loss: its function, the loss_fn_inputs
it reads, its loss_fn_config settings and defaults, and whether it clips. Adding a loss is
one entry there. The host side of the table (check_loss_fn, resolve_config,
check_finite_outputs) validates names, settings and outputs on the host, before (or
after) any device work, and touches no device. Custom losses (CUSTOM, jcp.custom_loss)
are per datum, not token sums: their tokens add 0 here and train_step adds the datums'
losses outside the shard_map. Targets may be [S] or [S, K] (several scored targets per
token; −1 pads).

Shapes: see the legend in jcp/mesh.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jcp.errors import InputError, float32_number
from jcp.logprobs import DEFAULT_CHUNK, target_logprobs
from jcp.logprobs import Unembedding as Unembedding  # re-exported: jcp.losses.Unembedding
from jcp.logprobs import prompt_stats as prompt_stats  # re-exported: jcp.losses.prompt_stats
from jcp.mesh import BATCH_AXES, CP, DP, psum_flat

# ----------------------------------------------------------------------------------------
# Tinker losses: one signature, token losses (summed by the caller, never averaged)


def _whole_vector_sum(v_S):
    """datum_sum when the vector is one datum held whole (a loss called outside shard_loss)."""
    return jnp.broadcast_to(jnp.sum(v_S), v_S.shape)


@dataclasses.dataclass(frozen=True)
class TokenInputs:
    """Client vectors on this shard, each [S] float32 (zeros where a loss does not use one;
    sequence_ratio_mask may be None where no loss of the step reads it), and datum_sum.

    datum_sum(v_S) -> [S]: for each token, the sum of v over every token of its datum on
    every (dp, cp) rank — the one way a loss sees per-datum statistics (GSPO's sequence
    ratio), whatever the mesh. shard_loss supplies it; its result is a constant of the
    gradient (stop_gradient), and padding tokens get 0. The default treats the whole
    vector as one datum, for a loss called directly on one datum's tokens.
    """

    weights: jax.Array
    advantages: jax.Array
    logprobs: jax.Array
    sequence_ratio_mask: jax.Array | None = None
    datum_sum: Callable = _whole_vector_sum


# Every loss is written so that a finite loss has a finite gradient: a ratio r = exp(lp − s)
# enters only where its term is taken (elsewhere the log-ratio is replaced by 0 *before*
# the exp), so a branch that is not taken contributes an exact zero, never inf·0 = NaN.
# A term that does overflow gives an infinite loss, which the Trainer refuses by datum.


def _ratio(lp, s, take):
    """exp(lp − s) where `take`, 1 elsewhere, with an exact zero gradient elsewhere."""
    return jnp.exp(jnp.where(take, lp - s, 0.0))


def cross_entropy(lp, x: TokenInputs, cfg):
    """−w·lp."""
    return -x.weights * lp, jnp.zeros(lp.shape, bool)


def importance_sampling(lp, x: TokenInputs, cfg):
    """−r·A with r = exp(lp − s); tokens with A = 0 contribute exactly 0."""
    r = _ratio(lp, x.logprobs, x.advantages != 0)
    return -r * x.advantages, jnp.zeros(lp.shape, bool)


def _clipped_objective(log_r, a, cfg):
    """−min(r·A, clip(r, lo, hi)·A) for r = exp(log_r), differentiated through log_r.

    The unclipped term wins iff A > 0 and r ≤ hi, or A < 0 and r ≥ lo; the clipped term is
    then constant in lp (gradient exactly 0), and A = 0 gives exactly 0. Clipped: tokens
    where the clipped term wins.
    """
    lo, hi = cfg["clip_low_threshold"], cfg["clip_high_threshold"]
    r_value = jnp.exp(jax.lax.stop_gradient(log_r))
    unclipped = ((a > 0) & (r_value <= hi)) | ((a < 0) & (r_value >= lo))
    r = jnp.exp(jnp.where(unclipped, log_r, 0.0))  # as _ratio: exp only where taken
    clipped_term = jnp.where(a != 0, jnp.clip(r_value, lo, hi), 0.0) * a
    return -jnp.where(unclipped, r * a, clipped_term), (a != 0) & ~unclipped


def ppo(lp, x: TokenInputs, cfg):
    """−min(r·A, clip(r, lo, hi)·A), r = exp(lp − s). Clipped: tokens where the clipped
    term wins (zero gradient)."""
    return _clipped_objective(lp - x.logprobs, x.advantages, cfg)


def gspo(lp, x: TokenInputs, cfg):
    """GSPO-token: PPO's objective with the token ratio sg(s)·exp(lp − sg(lp)), where
    s = exp(mean of (lp − logprobs) over the datum's tokens with sequence_ratio_mask ≠ 0)
    (s = 1 when the datum has no such token). The mean spans the datum's tokens on every
    rank (x.datum_sum); its value is the same on each of them.

    The log of the token ratio is (lp − sg(lp)) + log s, exactly log s in value, so the
    ratio is computed once, never as sg(s)·(something) that could be inf·0.
    """
    if x.sequence_ratio_mask is None:
        raise ValueError("gspo reads TokenInputs.sequence_ratio_mask; it is None")
    mask = x.sequence_ratio_mask != 0
    lp_value = jax.lax.stop_gradient(lp)
    total = x.datum_sum(jnp.where(mask, lp_value - x.logprobs, 0.0))
    count = x.datum_sum(mask.astype(jnp.float32))
    log_s = jnp.where(count > 0, total / jnp.maximum(count, 1.0), 0.0)
    return _clipped_objective((lp - lp_value) + log_s, x.advantages, cfg)


def cispo(lp, x: TokenInputs, cfg):
    """−sg(clip(r, lo, hi))·lp·A. Clipped: tokens whose ratio lies outside [lo, hi]."""
    r = jnp.exp(jax.lax.stop_gradient(lp) - x.logprobs)
    lo, hi = cfg["clip_low_threshold"], cfg["clip_high_threshold"]
    return -jnp.clip(r, lo, hi) * lp * x.advantages, (r < lo) | (r > hi)


def dro(lp, x: TokenInputs, cfg):
    """−(lp·A − ½·β·(lp − s)²)."""
    d = lp - x.logprobs
    return -(lp * x.advantages - 0.5 * cfg["beta"] * d * d), jnp.zeros(lp.shape, bool)


@dataclasses.dataclass(frozen=True)
class LossSpec:
    """One Tinker loss: fn(lp, TokenInputs, settings) -> (token loss, clipped); the
    loss_fn_inputs it reads besides target_tokens; its settings with their defaults;
    whether it reports clipped_tokens. A loss that needs per-datum statistics takes them
    from TokenInputs.datum_sum, which is exact under any mesh."""

    fn: Callable
    inputs: tuple[str, ...]
    config: Mapping[str, float] = dataclasses.field(default_factory=dict)
    clips: bool = False

    def __call__(self, lp, x: TokenInputs, cfg):
        return self.fn(lp, x, cfg)


LOSSES: dict[str, LossSpec] = {
    "cross_entropy": LossSpec(cross_entropy, ("weights",)),
    "importance_sampling": LossSpec(importance_sampling, ("advantages", "logprobs")),
    "ppo": LossSpec(
        ppo,
        ("advantages", "logprobs"),
        {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
        clips=True,
    ),
    "cispo": LossSpec(
        cispo,
        ("advantages", "logprobs"),
        {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0},
        clips=True,
    ),
    "dro": LossSpec(dro, ("advantages", "logprobs"), {"beta": 0.05}),
    # Tinker documents the clip keys of gspo but not their defaults: PPO's are used.
    "gspo": LossSpec(
        gspo,
        ("advantages", "logprobs", "sequence_ratio_mask"),
        {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
        clips=True,
    ),
}

# A client-defined per-datum loss (jcp.custom_loss.CustomLoss): not in LOSSES, because its
# loss is not a token sum; datums carry it as their loss name and train_step adds it.
CUSTOM = "custom"

# The per-token float vectors any loss reads, in a fixed order (packed as streams).
FLOAT_INPUTS = tuple(dict.fromkeys(f for spec in LOSSES.values() for f in spec.inputs))


def check_loss_fn(loss_fn, what: str = "loss_fn") -> str:
    """A registered loss name, or InputError naming `what`."""
    if loss_fn == CUSTOM:
        raise InputError(
            f"{what} 'custom' takes a jcp.custom_loss.CustomLoss (pass the "
            "object as loss_fn), not the name"
        )
    if not isinstance(loss_fn, str) or loss_fn not in LOSSES:
        raise InputError(
            f"unknown {what} {loss_fn!r}; expected one of {sorted(LOSSES)}"
            if what == "loss_fn"
            else f"{what}: unknown loss_fn {loss_fn!r}; expected one of {sorted(LOSSES)}"
        )
    return loss_fn


def resolve_config(loss_fn: str, loss_fn_config) -> dict[str, float]:
    """Defaults overlaid with the caller's loss_fn_config (float32-checked); InputError on
    unknown keys or values."""
    check_loss_fn(loss_fn)
    if loss_fn_config is not None and not isinstance(loss_fn_config, Mapping):
        raise InputError(
            f"loss_fn_config for {loss_fn} must be a dict of settings, got {loss_fn_config!r}"
        )
    cfg = dict(LOSSES[loss_fn].config)
    for key, value in (loss_fn_config or {}).items():
        if key not in cfg:
            raise InputError(
                f"loss_fn_config.{key} is not a setting of {loss_fn}; expected {sorted(cfg)}"
            )
        cfg[key] = float32_number(value, f"loss_fn_config.{key}")
    if "clip_low_threshold" in cfg and cfg["clip_low_threshold"] > cfg["clip_high_threshold"]:
        raise InputError(
            f"loss_fn_config: clip_low_threshold {cfg['clip_low_threshold']} exceeds "
            f"clip_high_threshold {cfg['clip_high_threshold']}"
        )
    for key in ("clip_low_threshold", "beta"):
        if cfg.get(key, 0.0) < 0:
            raise InputError(f"loss_fn_config.{key} must be ≥ 0, got {cfg[key]}")
    return cfg


def check_finite_outputs(i: int, datum, out: dict) -> None:
    """InputError naming datum i (and the token and cause) when its loss is not finite in
    float32; `datum` is its CheckedDatum, `out` its loss_fn_outputs entry."""
    el = out["elementwise_loss"]
    if np.isfinite(out["loss:sum"]) and np.all(np.isfinite(el)):
        return
    bad = np.flatnonzero(~np.isfinite(el))
    if not bad.size:
        raise InputError(
            f"datum {i}: its {datum.loss_fn} loss sums to {out['loss:sum']} "
            "(overflows float32); split the datum or scale its inputs"
        )
    j = int(bad[0])
    why = "check loss_fn_inputs.advantages / weights"
    if datum.loss_fn == "gspo":
        why = (
            "the sequence ratio exp(mean of (logprob − loss_fn_inputs.logprobs) over "
            "sequence_ratio_mask) overflows float32; check loss_fn_inputs.logprobs"
        )
    elif "logprobs" in datum.floats:
        log_ratio = float(out["logprobs"][j]) - float(datum.floats["logprobs"][j])
        if log_ratio > np.log(np.finfo(np.float32).max):
            why = (
                f"the importance ratio exp(logprob − loss_fn_inputs.logprobs) = "
                f"exp({log_ratio:.4g}) overflows float32; loss_fn_inputs.logprobs[{j}] = "
                f"{datum.floats['logprobs'][j]:.4g} is far below the model's "
                f"{out['logprobs'][j]:.4g}"
            )
        elif datum.loss_fn == "dro":
            why = "the squared log-ratio term overflows float32; check loss_fn_inputs.logprobs"
    raise InputError(f"datum {i}: its {datum.loss_fn} loss is {el[j]} at token {j}: {why}")


# ----------------------------------------------------------------------------------------
# The per-shard loss path


@dataclasses.dataclass(frozen=True)
class ShardOutputs:
    """Per-datum outputs, identical on every device.

    logprobs / elementwise_loss: [DP, CP, S] streams (the host un-zigzags them);
    datum_loss: [B] per-datum loss sums; clipped: [B] per-datum numbers of clipped real
    tokens (so a fused call can report each request's count).
    MoE models only (train_step.model_loss adds them; None otherwise): expert_counts, int32
    [Lm, E], each MoE layer's (token, choice) assignments per expert over the real tokens
    of every (dp, cp) shard; router_aux_loss, float32 [], the router auxiliary term that
    was added to the loss (only when enabled).
    Custom losses only (train_step): token_logprobs, this shard's differentiable log-probs
    (inside the shard_map; taken out before it returns); custom_loss [n], the custom
    datums' losses; custom_metrics {key: [n]}, their metrics.
    """

    logprobs: jax.Array
    elementwise_loss: jax.Array
    datum_loss: jax.Array
    clipped: jax.Array
    expert_counts: jax.Array | None = None
    router_aux_loss: jax.Array | None = None
    token_logprobs: jax.Array | None = None
    custom_loss: jax.Array | None = None
    custom_metrics: dict | None = None


jax.tree_util.register_dataclass(
    ShardOutputs,
    data_fields=[
        "logprobs",
        "elementwise_loss",
        "datum_loss",
        "clipped",
        "expert_counts",
        "router_aux_loss",
        "token_logprobs",
        "custom_loss",
        "custom_metrics",
    ],
    meta_fields=[],
)


def gather_stream(x_S):
    """All-gather a per-token vector: [S] on each (dp, cp) device -> [DP, CP, S], the same
    on every device (and typed replicated, so it may leave the shard_map with out_specs
    P()). Inside shard_map. batch.unpack turns the result into per-datum vectors; used
    for the per-datum outputs of training and for sampling's prompt log-probs.
    """
    # A psum of each device's row placed in a zero grid: unlike all_gather, its result is
    # typed replicated, so it can leave the shard_map with out_specs P().
    return jax.lax.psum(stream_grid(x_S), BATCH_AXES)


def stream_grid(x_S):
    """This device's row [S] placed in a zero grid [DP, CP, S] (gather_stream before its
    psum)."""
    grid = jnp.zeros((jax.lax.axis_size(DP), jax.lax.axis_size(CP)) + x_S.shape, x_S.dtype)
    return grid.at[jax.lax.axis_index(DP), jax.lax.axis_index(CP)].set(x_S)


def datum_sum(segment_S, num_slots: int):
    """The TokenInputs.datum_sum of this shard (inside shard_map): v_S -> [S], each token's
    datum total of v over every (dp, cp) rank, a constant of the gradient; padding gets 0.

    A segment_sum into the num_slots datum slots (padding into a spare one), a psum over
    (dp, cp) — each datum's tokens are spread over the cp ranks of one dp shard, other
    ranks add zeros — then each token reads its slot. E.g. cp = 2, one datum of 3 tokens
    [a, b, c] held as rank 0: [a, ·], rank 1: [b, c]: every real token gets a + b + c.
    """
    real_S = segment_S >= 0
    slot_S = jnp.where(real_S, segment_S, num_slots)

    def total(v_S):
        v_S = jnp.where(real_S, jax.lax.stop_gradient(v_S), 0.0)
        per_B = jax.ops.segment_sum(v_S, slot_S, num_segments=num_slots + 1)
        per_B = jax.lax.psum(per_B, BATCH_AXES)
        return jnp.where(real_S, per_B[slot_S], 0.0)

    return total


def token_losses(lp_S, inputs: TokenInputs, loss_fn, cfg, loss_id_S=None):
    """(token loss [S], clipped [S]) for one loss, or per token for several.

    loss_fn: a name with cfg its settings; or a tuple of names with cfg {name: settings}
    and loss_id_S the index of each token's loss in that tuple. With several, each loss
    sees neutral inputs (A = 0, s = lp, w = 0) on the other losses' tokens, so a vector a
    datum carries for no loss of its own can never reach the result or its gradient.
    Tokens of a custom loss (CUSTOM) get 0 here: that loss is per datum, taken outside the
    shard_map (train_step.custom_terms).
    """
    if isinstance(loss_fn, str):
        if loss_fn == CUSTOM:
            return jnp.zeros(lp_S.shape, lp_S.dtype), jnp.zeros(lp_S.shape, bool)
        return LOSSES[loss_fn](lp_S, inputs, cfg)
    tok_loss_S = jnp.zeros(lp_S.shape, lp_S.dtype)
    clipped_S = jnp.zeros(lp_S.shape, bool)
    lp_value = jax.lax.stop_gradient(lp_S)
    for k, name in enumerate(loss_fn):
        if name == CUSTOM:
            continue
        here = loss_id_S == k
        mask = inputs.sequence_ratio_mask
        mine = dataclasses.replace(
            inputs,
            weights=jnp.where(here, inputs.weights, 0.0),
            advantages=jnp.where(here, inputs.advantages, 0.0),
            logprobs=jnp.where(here, inputs.logprobs, lp_value),
            sequence_ratio_mask=None if mask is None else jnp.where(here, mask, 0.0),
        )
        l, c = LOSSES[name](lp_S, mine, cfg[name])
        tok_loss_S = jnp.where(here, l, tok_loss_S)
        clipped_S = clipped_S | (here & c)
    return tok_loss_S, clipped_S


@dataclasses.dataclass(frozen=True)
class LossPlan:
    """The static options of shard_loss: loss_fn (a name, or a tuple of names picked per
    token by loss_id_S, as in token_losses), num_slots (the datum slots of the stream),
    chunk (tokens per log-prob chunk), right_grads (target_logprobs'), keep_token_logprobs
    and summed (see shard_loss)."""

    loss_fn: str | tuple[str, ...]
    num_slots: int
    chunk: int = DEFAULT_CHUNK
    right_grads: tuple[bool, ...] | None = None
    keep_token_logprobs: bool = False
    summed: bool = True


def shard_loss(
    factors,
    targets_S,
    segment_S,
    inputs: TokenInputs,
    cfg,
    plan: LossPlan,
    loss_id_S=None,
):
    """Loss of this shard's tokens (logits of factors, a logprobs.Unembedding) and the
    complete per-datum outputs.

    plan.loss_fn / cfg / loss_id_S as in token_losses (one loss, or one per token).
    Returns (loss, outputs): loss is the local-shard token sum psum'd over (dp, cp), so it
    is replicated and `jax.grad` of it taken outside the shard_map is the CP = 1 gradient;
    outputs (ShardOutputs) are built under stop_gradient and gathered so every device holds
    every datum's vectors.

    2-D targets [S, K] (padding −1): log-probs [S, K], zero (and no gradient) at padding
    targets; the batch holds only cross_entropy (token loss Σ_k −w_k·lp_k, weights [S, K])
    and custom datums. plan.keep_token_logprobs: also return this shard's log-probs, not
    gathered and still differentiable, as outputs.token_logprobs (for a custom loss).

    plan.summed=False: no sum over (dp, cp) here; returns (this shard's loss, OUTPUT_PARTS of
    this shard: its loss again (no gradient), the log-prob and token-loss grids, the
    datum losses and clipped counts as float32), and the caller sums the parts and makes
    ShardOutputs of them (shard_outputs) — train_step folds that sum into the gradient's
    all-reduce.
    """
    num_slots = plan.num_slots
    lp_S = target_logprobs(factors, targets_S, plan.chunk, plan.right_grads)
    real_S = segment_S >= 0
    inputs = dataclasses.replace(inputs, datum_sum=datum_sum(segment_S, num_slots))
    if lp_S.ndim == 2:
        lp_S = jnp.where(real_S[:, None] & (targets_S >= 0), lp_S, 0.0)
        tok_loss_S = jnp.sum(-inputs.weights * lp_S, axis=-1)
        clipped_S = jnp.zeros(real_S.shape, bool)
    else:
        tok_loss_S, clipped_S = token_losses(lp_S, inputs, plan.loss_fn, cfg, loss_id_S)
    tok_loss_S = jnp.where(real_S, tok_loss_S, 0.0)

    real = real_S if lp_S.ndim == 1 else real_S[:, None]
    lp_out = jax.lax.stop_gradient(jnp.where(real, lp_S, 0.0))
    el_out = jax.lax.stop_gradient(tok_loss_S)
    slot_S = jnp.where(real_S, segment_S, num_slots)
    datum_loss = jax.ops.segment_sum(el_out, slot_S, num_segments=num_slots + 1)[:num_slots]
    clipped = jax.ops.segment_sum(
        (clipped_S & real_S).astype(jnp.int32), slot_S, num_segments=num_slots + 1
    )[:num_slots]
    # The loss and every output summed over (dp, cp) as one vector (psum_flat: one
    # all-reduce, not one per array); the clipped counts as float32 (exact below 2^24
    # tokens a datum) to join it.
    loss = jnp.sum(tok_loss_S)
    parts = (
        jax.lax.stop_gradient(loss),
        stream_grid(lp_out),
        stream_grid(el_out),
        datum_loss,
        clipped.astype(jnp.float32),
    )
    if not plan.summed:
        return loss, parts
    loss, *sums = psum_flat((loss,) + parts[1:], BATCH_AXES)
    _, outputs = shard_outputs((loss, *sums))
    if plan.keep_token_logprobs:
        outputs = dataclasses.replace(outputs, token_logprobs=jnp.where(real, lp_S, 0.0))
    return loss, outputs


# What shard_loss(plan.summed=False) returns as its parts, in order.
OUTPUT_PARTS = ("loss", "logprobs", "elementwise_loss", "datum_loss", "clipped")


def shard_outputs(sums) -> tuple[jax.Array, ShardOutputs]:
    """(loss, ShardOutputs) of shard_loss's OUTPUT_PARTS summed over (dp, cp)."""
    loss, lp, el, datum_loss, clipped = sums
    return loss, ShardOutputs(
        logprobs=lp, elementwise_loss=el, datum_loss=datum_loss, clipped=clipped.astype(jnp.int32)
    )
