"""Token log-probs (chunked, vocab-parallel), the Tinker losses, and per-datum outputs.

Everything here runs per shard inside the one shard_map. It must never build an array of
[tokens, vocab] (forward or backward), never average a loss (Tinker losses are sums), and
never let the per-datum outputs reach the gradient.

Legend: S tokens on this shard; D hidden; V vocab (V/tp locally); R low-rank width; B
datum slots of the micro-batch; DP, CP mesh axis sizes.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jcp.batch import InputError, check_loss_fn, finite_number
from jcp.mesh import BATCH_AXES, CP, DP, TP, block_size, vary, varying_axes

DEFAULT_CHUNK = 1024


# ----------------------------------------------------------------------------------------
# Vocab-parallel target log-probs


def _chunk_logits(lefts, rights, i, chunk):
    """fp32 logits [chunk, V/tp] of token chunk i: Σ left[chunk] @ right."""
    out = None
    for left, right in zip(lefts, rights):
        part = jax.lax.dynamic_slice_in_dim(left, i * chunk, chunk, axis=0)
        y = jnp.einsum("sd,dv->sv", part, right, preferred_element_type=jnp.float32)
        out = y if out is None else out + y
    return out


def _local_targets(targets_S, v_local):
    """Targets as indices into this tp rank's vocab slice, and whether they fall in it."""
    local = targets_S - jax.lax.axis_index(TP) * v_local
    inside = (local >= 0) & (local < v_local)
    return jnp.where(inside, local, 0), inside


def _lp_fwd_impl(lefts, rights, targets_S, chunk):
    s_len = targets_S.shape[0]
    v_local = rights[0].shape[1]
    n_chunks = s_len // chunk
    tgt_S, inside_S = _local_targets(targets_S, v_local)

    def body(_, i):
        logits = _chunk_logits(lefts, rights, i, chunk)
        m = jax.lax.pmax(jnp.max(logits, axis=-1), TP)
        se = jax.lax.psum(jnp.sum(jnp.exp(logits - m[:, None]), axis=-1), TP)
        lse = m + jnp.log(se)
        t = jax.lax.dynamic_slice_in_dim(tgt_S, i * chunk, chunk)
        ins = jax.lax.dynamic_slice_in_dim(inside_S, i * chunk, chunk)
        picked = jnp.take_along_axis(logits, t[:, None], axis=-1)[:, 0]
        picked = jax.lax.psum(jnp.where(ins, picked, 0.0), TP)
        return None, (picked - lse, lse)

    _, (lp, lse) = jax.lax.scan(body, None, jnp.arange(n_chunks))
    return lp.reshape(s_len), lse.reshape(s_len)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _target_logprobs(lefts, rights, targets_S, chunk, right_grads):
    return _lp_fwd_impl(lefts, rights, targets_S, chunk)[0]


def _lp_fwd(lefts, rights, targets_S, chunk, right_grads):
    lp, lse = _lp_fwd_impl(lefts, rights, targets_S, chunk)
    return lp, (lefts, rights, targets_S, lse)


def _lp_bwd(chunk, right_grads, res, g_S):
    lefts, rights, targets_S, lse_S = res
    s_len = targets_S.shape[0]
    v_local = rights[0].shape[1]
    tgt_S, inside_S = _local_targets(targets_S, v_local)
    # Frozen factors (the base unembedding) get no gradient work at all.
    d_rights0 = tuple(vary(jnp.zeros(r.shape if want else (), jnp.float32), varying_axes(r))
                      for r, want in zip(rights, right_grads))

    def body(d_rights, i):
        logits = _chunk_logits(lefts, rights, i, chunk)
        lse = jax.lax.dynamic_slice_in_dim(lse_S, i * chunk, chunk)
        g = jax.lax.dynamic_slice_in_dim(g_S, i * chunk, chunk)
        t = jax.lax.dynamic_slice_in_dim(tgt_S, i * chunk, chunk)
        ins = jax.lax.dynamic_slice_in_dim(inside_S, i * chunk, chunk)
        # d lp / d logits = onehot(target) − softmax; the one-hot part is a scatter of g, so
        # no [chunk, V] index or mask array is built.
        d_logits = -g[:, None] * jnp.exp(logits - lse[:, None])
        d_logits = d_logits.at[jnp.arange(chunk), t].add(jnp.where(ins, g, 0.0))
        d_lefts = []
        new_d_rights = []
        for left, right, dr, want in zip(lefts, rights, d_rights, right_grads):
            part = jax.lax.dynamic_slice_in_dim(left, i * chunk, chunk, axis=0)
            dl = jnp.einsum("sv,dv->sd", d_logits, right.astype(jnp.float32))
            d_lefts.append(jax.lax.psum(dl, TP))  # sum over the vocab shards
            if want:
                dr = dr + jnp.einsum("sd,sv->dv", part.astype(jnp.float32), d_logits)
            new_d_rights.append(dr)
        return tuple(new_d_rights), tuple(d_lefts)

    d_rights, d_lefts = jax.lax.scan(body, d_rights0, jnp.arange(s_len // chunk))
    d_lefts = tuple(
        dl.reshape(left.shape).astype(left.dtype) for dl, left in zip(d_lefts, lefts)
    )
    d_rights = tuple(dr.astype(r.dtype) if want else jnp.zeros_like(r)
                     for dr, r, want in zip(d_rights, rights, right_grads))
    targets_ct = np.zeros(targets_S.shape, dtype=jax.dtypes.float0)
    return d_lefts, d_rights, targets_ct


_target_logprobs.defvjp(_lp_fwd, _lp_bwd)


def target_logprobs(lefts, rights, targets_S, chunk: int = DEFAULT_CHUNK, right_grads=None):
    """log p(target) [S] for logits = Σ_i lefts[i] @ rights[i], vocab split over "tp".

    lefts[i]: [S, D_i], the same on every tp rank; rights[i]: [D_i, V/tp], this rank's
    vocab slice (rank t holds vocab rows t·V/tp …). The softmax pieces are combined with
    pmax / psum over "tp". Tokens are processed `chunk` at a time under a custom VJP that
    keeps only the log-sum-exp [S] and recomputes each chunk's logits in the backward pass,
    so no [S, V] array ever exists. right_grads[i] = False skips the gradient of a frozen
    rights[i] (its cotangent is zero).
    """
    lefts, rights = tuple(lefts), tuple(rights)
    chunk = block_size(targets_S.shape[0], chunk)
    # The batch axes vary across devices; weights replicated over them must be marked
    # varying before the custom VJP so that their cotangents are summed by the transpose
    # of this cast (outside), not inside the rule.
    rights = tuple(vary(r, BATCH_AXES) for r in rights)
    lefts = tuple(vary(x, BATCH_AXES) for x in lefts)
    right_grads = (True,) * len(rights) if right_grads is None else tuple(right_grads)
    return _target_logprobs(lefts, rights, targets_S, chunk, right_grads)


# ----------------------------------------------------------------------------------------
# Tinker losses: one signature, token losses (summed by the caller, never averaged)


@dataclasses.dataclass(frozen=True)
class TokenInputs:
    """Client vectors on this shard, each [S] float32 (zeros where a loss does not use one)."""

    weights: jax.Array
    advantages: jax.Array
    logprobs: jax.Array


def cross_entropy(lp, x: TokenInputs, cfg):
    """−w·lp."""
    return -x.weights * lp, jnp.zeros(lp.shape, bool)


def importance_sampling(lp, x: TokenInputs, cfg):
    """−r·A with r = exp(lp − s)."""
    r = jnp.exp(lp - x.logprobs)
    return -r * x.advantages, jnp.zeros(lp.shape, bool)


def ppo(lp, x: TokenInputs, cfg):
    """−min(r·A, clip(r, lo, hi)·A). Clipped: tokens where the clipped term wins (zero grad)."""
    r = jnp.exp(lp - x.logprobs)
    lo, hi = cfg["clip_low_threshold"], cfg["clip_high_threshold"]
    unclipped = r * x.advantages
    clipped = jnp.clip(r, lo, hi) * x.advantages
    return -jnp.minimum(unclipped, clipped), clipped < unclipped


def cispo(lp, x: TokenInputs, cfg):
    """−sg(clip(r, lo, hi))·lp·A. Clipped: tokens whose ratio lies outside [lo, hi]."""
    r = jnp.exp(lp - x.logprobs)
    lo, hi = cfg["clip_low_threshold"], cfg["clip_high_threshold"]
    w = jax.lax.stop_gradient(jnp.clip(r, lo, hi))
    return -w * lp * x.advantages, (r < lo) | (r > hi)


def dro(lp, x: TokenInputs, cfg):
    """−(lp·A − ½·β·(lp − s)²)."""
    d = lp - x.logprobs
    return -(lp * x.advantages - 0.5 * cfg["beta"] * d * d), jnp.zeros(lp.shape, bool)


LOSSES = {
    "cross_entropy": cross_entropy,
    "importance_sampling": importance_sampling,
    "ppo": ppo,
    "cispo": cispo,
    "dro": dro,
}

CONFIG_DEFAULTS = {
    "cross_entropy": {},
    "importance_sampling": {},
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "cispo": {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0},
    "dro": {"beta": 0.05},
}

CLIPPING_LOSSES = ("ppo", "cispo")


def resolve_config(loss_fn: str, loss_fn_config) -> dict[str, float]:
    """Defaults overlaid with the caller's loss_fn_config; InputError on unknown keys or values."""
    check_loss_fn(loss_fn)
    cfg = dict(CONFIG_DEFAULTS[loss_fn])
    for key, value in (loss_fn_config or {}).items():
        if key not in cfg:
            raise InputError(
                f"loss_fn_config.{key} is not a setting of {loss_fn}; expected {sorted(cfg)}"
            )
        cfg[key] = finite_number(value, f"loss_fn_config.{key}")
    if "clip_low_threshold" in cfg and cfg["clip_low_threshold"] > cfg["clip_high_threshold"]:
        raise InputError(
            f"loss_fn_config: clip_low_threshold {cfg['clip_low_threshold']} exceeds "
            f"clip_high_threshold {cfg['clip_high_threshold']}"
        )
    if cfg.get("beta", 0.0) < 0:
        raise InputError(f"loss_fn_config.beta must be ≥ 0, got {cfg['beta']}")
    return cfg


# ----------------------------------------------------------------------------------------
# The per-shard loss path


@dataclasses.dataclass(frozen=True)
class ShardOutputs:
    """Per-datum outputs, identical on every device.

    logprobs / elementwise_loss: [DP, CP, S] streams (the host un-zigzags them);
    datum_loss: [B] per-datum loss sums; clipped: number of clipped real tokens.
    """

    logprobs: jax.Array
    elementwise_loss: jax.Array
    datum_loss: jax.Array
    clipped: jax.Array


jax.tree_util.register_dataclass(
    ShardOutputs, data_fields=["logprobs", "elementwise_loss", "datum_loss", "clipped"],
    meta_fields=[])


def _gather_stream(x_S):
    """All-gather: [S] on each (dp, cp) device -> [DP, CP, S], the same on every device."""
    # A psum of each device's row placed in a zero grid: unlike all_gather, its result is
    # typed replicated, so it can leave the shard_map with out_specs P().
    grid = jnp.zeros((jax.lax.axis_size(DP), jax.lax.axis_size(CP)) + x_S.shape, x_S.dtype)
    grid = grid.at[jax.lax.axis_index(DP), jax.lax.axis_index(CP)].set(x_S)
    return jax.lax.psum(grid, BATCH_AXES)


def token_losses(lp_S, inputs: TokenInputs, loss_fn, cfg, loss_id_S=None):
    """(token loss [S], clipped [S]) for one loss, or per token for several.

    loss_fn: a name with cfg its settings; or a tuple of names with cfg {name: settings}
    and loss_id_S the index of each token's loss in that tuple.
    """
    if isinstance(loss_fn, str):
        return LOSSES[loss_fn](lp_S, inputs, cfg)
    tok_loss_S = jnp.zeros(lp_S.shape, lp_S.dtype)
    clipped_S = jnp.zeros(lp_S.shape, bool)
    for k, name in enumerate(loss_fn):
        here = loss_id_S == k
        l, c = LOSSES[name](lp_S, inputs, cfg[name])
        tok_loss_S = jnp.where(here, l, tok_loss_S)
        clipped_S = clipped_S | (here & c)
    return tok_loss_S, clipped_S


def shard_loss(lefts, rights, targets_S, segment_S, inputs: TokenInputs, loss_fn,
               cfg, num_slots: int, chunk: int = DEFAULT_CHUNK, right_grads=None,
               loss_id_S=None):
    """Loss of this shard's tokens and the complete per-datum outputs.

    loss_fn / cfg / loss_id_S as in token_losses (one loss, or one per token).
    Returns (loss, outputs): loss is the local-shard token sum psum'd over (dp, cp), so it
    is replicated and `jax.grad` of it taken outside the shard_map is the CP = 1 gradient;
    outputs (ShardOutputs) are built under stop_gradient and gathered so every device holds
    every datum's vectors.
    """
    lp_S = target_logprobs(lefts, rights, targets_S, chunk, right_grads)
    real_S = segment_S >= 0
    tok_loss_S, clipped_S = token_losses(lp_S, inputs, loss_fn, cfg, loss_id_S)
    tok_loss_S = jnp.where(real_S, tok_loss_S, 0.0)
    loss = jax.lax.psum(jnp.sum(tok_loss_S), BATCH_AXES)

    lp_out = jax.lax.stop_gradient(jnp.where(real_S, lp_S, 0.0))
    el_out = jax.lax.stop_gradient(tok_loss_S)
    datum_loss = jax.ops.segment_sum(el_out, jnp.where(real_S, segment_S, num_slots),
                                     num_segments=num_slots + 1)[:num_slots]
    outputs = ShardOutputs(
        logprobs=_gather_stream(lp_out),
        elementwise_loss=_gather_stream(el_out),
        datum_loss=jax.lax.psum(datum_loss, BATCH_AXES),
        clipped=jax.lax.psum(jnp.sum(clipped_S & real_S, dtype=jnp.int32), BATCH_AXES),
    )
    return loss, outputs
