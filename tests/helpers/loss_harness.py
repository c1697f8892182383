"""Drive the per-shard loss path (jcp.losses.shard_loss) inside jax.shard_map, and an
independent NumPy reference of the same numbers.

Hidden states and the unembedding are random: this isolates mesh/zigzag/packing/loss from
the model. Hidden states are defined per datum in original order and cut into the packed
[DP, CP, S, D] layout with `to_stream`, the same cut the model's activations would have.

Legend: DP, CP, TP mesh axis sizes; S tokens of one device's stream; D hidden; V vocab;
N tokens of one datum; B datum slots.
"""

from __future__ import annotations

import copy
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

import jcp
from jcp import batch as batch_lib
from jcp import losses
from jcp import mesh as mesh_lib

V, D = 64, 16
CHUNK = 8  # log-prob token chunk: small so every stream spans several chunks
LOSS_NAMES = tuple(losses.LOSSES)
# Overrides that change which tokens are clipped / how much the penalty weighs.
OVERRIDES = {
    "ppo": {"clip_low_threshold": 0.9, "clip_high_threshold": 1.05},
    "cispo": {"clip_low_threshold": 0.7, "clip_high_threshold": 1.1},
    "dro": {"beta": 0.5},
    "gspo": {"clip_low_threshold": 0.97, "clip_high_threshold": 1.01},
}

# Every (dp, cp, tp) with dp·cp·tp ≤ 8, cp ∈ {1, 2, 4, 8}, tp ∈ {1, 2}.
ALL_MESHES = tuple(
    (dp, cp, tp) for cp in (1, 2, 4, 8) for tp in (1, 2) for dp in range(1, 9) if dp * cp * tp <= 8
)
REFERENCE_MESH = (1, 1, 1)


def configs(overrides=None) -> dict[str, dict[str, float]]:
    """Resolved loss_fn_config of every loss: defaults overlaid with overrides[name]."""
    return {name: losses.resolve_config(name, (overrides or {}).get(name)) for name in LOSS_NAMES}


# ----------------------------------------------------------------------------------------
# Cases


@dataclasses.dataclass
class Case:
    """Client datums (numpy, all four float fields) plus per-datum hidden states."""

    name: str
    data: list[jcp.Datum]
    hidden: list[np.ndarray]  # [N_i, D] float32, original order
    unembed_DxV: np.ndarray
    snapshot: list[dict[str, np.ndarray]]  # deep copies of the client's vectors

    def assert_unchanged(self):
        """The client's arrays are exactly what they were when the case was built."""
        for i, (d, snap) in enumerate(zip(self.data, self.snapshot)):
            np.testing.assert_array_equal(d.model_input, snap["model_input"], err_msg=f"datum {i}")
            for k, v in d.loss_fn_inputs.items():
                np.testing.assert_array_equal(v, snap[k], err_msg=f"datum {i} {k}")
                assert v.dtype == snap[k].dtype


def np_logprobs(h_NxD, w_DxV, targets_N):
    """float64 log p(target) via a NumPy log-softmax over the full logits."""
    logits = h_NxD.astype(np.float64) @ w_DxV.astype(np.float64)
    m = logits.max(axis=-1, keepdims=True)
    logp = logits - m - np.log(np.exp(logits - m).sum(axis=-1, keepdims=True))
    return logp[np.arange(len(targets_N)), targets_N], np.exp(logp)


def make_case(name: str, lengths, seed: int = 0, zero=()) -> Case:
    """Random datums of the given lengths; datums listed in `zero` get w = A = 0.

    The sampling log-probs are the true log-probs plus noise, so ratios straddle the PPO
    and CISPO clip ranges on both sides. sequence_ratio_mask holds 0, 1 and 0.5 (≠ 0
    counts); a 1-token datum's mask is 0, so GSPO's empty-mask rule (s = 1) is exercised.
    """
    rng = np.random.default_rng(seed)
    w_DxV = (0.5 * rng.normal(size=(D, V))).astype(np.float32)
    data, hidden, snapshot = [], [], []
    for i, n in enumerate(lengths):
        h = rng.normal(size=(n, D)).astype(np.float32)
        tokens = rng.integers(0, V, n)  # int64: validation makes its own int32 copy
        targets = rng.integers(0, V, n)
        lp, _ = np_logprobs(h, w_DxV, targets)
        inputs = {
            "target_tokens": targets,
            "weights": rng.normal(size=n),  # float64: validation casts a copy
            "advantages": rng.normal(size=n).astype(np.float32),
            "logprobs": lp + 0.3 * rng.normal(size=n),
            # Its own generator: the other vectors stay those of the cases before GSPO.
            "sequence_ratio_mask": (
                np.random.default_rng([seed, i]).choice([0.0, 1.0, 1.0, 0.5], size=n)
                if n > 1
                else np.zeros(n)
            ),
        }
        if i in zero:
            inputs["weights"] = np.zeros(n)
            inputs["advantages"] = np.zeros(n, np.float32)
        data.append(jcp.Datum(model_input=tokens, loss_fn_inputs=inputs))
        hidden.append(h)
        snapshot.append(
            {"model_input": tokens.copy(), **{k: copy.deepcopy(v) for k, v in inputs.items()}}
        )
    return Case(name, data, hidden, w_DxV, snapshot)


# ----------------------------------------------------------------------------------------
# The shard_map loss path


def to_stream(per_datum, pb: batch_lib.PackedBatch, cp: int, fill=None, seed: int = 0):
    """Per-datum [N, ...] arrays in original order -> [DP, CP, S, ...] in pb's zigzag layout.

    Rows that hold no token get zeros, or random values when `fill == "noise"` (the loss
    must not see them).
    """
    trailing = per_datum[0].shape[1:]
    dp, _, s_len = pb.tokens.shape
    shape = (dp, cp, s_len) + trailing
    if fill == "noise":
        out = np.random.default_rng(seed).normal(size=shape).astype(per_datum[0].dtype)
    else:
        out = np.zeros(shape, per_datum[0].dtype)
    for p in pb.placements:
        idx = mesh_lib.zigzag_indices(p.n, cp)
        rows = out[p.shard, :, p.offset : p.offset + p.rows]
        rows[idx >= 0] = per_datum[p.index][idx[idx >= 0]]
    return out


def from_stream(stream, pb: batch_lib.PackedBatch) -> list[np.ndarray]:
    """[DP, CP, S, ...] -> per-datum [N, ...] in the caller's order (via batch.unpack)."""
    got = batch_lib.unpack(np.asarray(stream), pb)
    return [got[i] for i in range(len(got))]


@functools.cache
def mesh_of(dp: int, cp: int, tp: int):
    return jcp.make_mesh(dp=dp, cp=cp, tp=tp)


@functools.cache
def step_fn(dp: int, cp: int, tp: int, num_slots: int):
    """Jitted: every loss's (loss, ShardOutputs, d loss/d hidden, d loss/d unembedding).

    The loss_fn_config values are traced inputs, so default and overridden configs share
    one compiled program per (mesh, stream length).
    """
    mesh = mesh_of(dp, cp, tp)
    sp = mesh_lib.SPECS

    def one_loss(name, h, w, targets, segment, wts, adv, slp, srm, cfg):
        def inner(h, w, targets, segment, wts, adv, slp, srm, cfg):
            x = losses.TokenInputs(wts[0, 0], adv[0, 0], slp[0, 0], srm[0, 0])
            plan = losses.LossPlan(name, num_slots, chunk=CHUNK)
            return losses.shard_loss(
                losses.Unembedding((h[0, 0],), (w,)), targets[0, 0], segment[0, 0], x, cfg, plan
            )

        return jax.shard_map(
            inner,
            mesh=mesh,
            in_specs=(sp.stream_DPxCPxSxD, sp.unembed_DxV)
            + (sp.stream_DPxCPxS,) * 6
            + (sp.replicated,),
            out_specs=(sp.replicated, sp.replicated),
        )(h, w, targets, segment, wts, adv, slp, srm, cfg)

    def step(h, w, targets, segment, wts, adv, slp, srm, cfgs):
        out = {}
        for name in LOSS_NAMES:
            f = functools.partial(one_loss, name)
            (loss, outs), (dh, dw) = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(
                h, w, targets, segment, wts, adv, slp, srm, cfgs[name]
            )
            out[name] = (loss, outs, dh, dw)
        return out

    return jax.jit(step)


@dataclasses.dataclass
class LossResult:
    """One loss on one mesh, back on the host; per-datum vectors in original order."""

    loss: float
    logprobs: list[np.ndarray]
    elementwise: list[np.ndarray]
    datum_loss: np.ndarray  # [num datums], caller's order
    clipped: int
    d_hidden_stream: np.ndarray  # [DP, CP, S, D] as the mesh returned it
    d_hidden: list[np.ndarray]  # per datum [N, D]
    d_unembed: np.ndarray


@dataclasses.dataclass
class Run:
    mesh_shape: tuple[int, int, int]
    mesh: jax.sharding.Mesh
    packed: batch_lib.PackedBatch
    results: dict[str, LossResult]


def replicated_value(x, n_devices: int) -> np.ndarray:
    """x's value after checking every addressable shard holds the same full array."""
    shards = x.addressable_shards
    assert len(shards) == n_devices, (len(shards), n_devices)
    first = np.asarray(shards[0].data)
    assert first.shape == x.shape
    for s in shards[1:]:
        np.testing.assert_array_equal(np.asarray(s.data), first, err_msg=f"device {s.device}")
    return first


def run_case(case: Case, mesh_shape, overrides=None, noise_padding: bool = True) -> Run:
    """Validate, pack (one micro-batch, one adapter) and run every loss on the mesh.

    overrides: {loss name: loss_fn_config} on top of the defaults.
    """
    dp, cp, tp = mesh_shape
    checked = batch_lib.validate(case.data, "dro", V, 10**6)  # dro needs every float field
    (pb,) = batch_lib.pack(checked, [0] * len(checked), dp, cp, max_rows=4096, max_adapters=4)
    h = to_stream(case.hidden, pb, cp, fill="noise" if noise_padding else None, seed=dp * 100 + cp)
    host_args = (
        h,
        case.unembed_DxV,
        pb.targets,
        pb.segment,
        pb.floats["weights"],
        pb.floats["advantages"],
        pb.floats["logprobs"],
        pb.floats["sequence_ratio_mask"],
    )
    before = [a.copy() for a in host_args]
    cfgs = jax.tree.map(jnp.float32, configs(overrides))  # traced: no recompile per config
    res = step_fn(dp, cp, tp, pb.num_slots)(*host_args, cfgs)
    for a, b in zip(host_args, before):
        np.testing.assert_array_equal(a, b)
    n_dev = dp * cp * tp
    slots = [
        int(pb.segment[p.shard, 0, p.offset]) for p in sorted(pb.placements, key=lambda p: p.index)
    ]
    results = {}
    for name, (loss, outs, dh, dw) in res.items():
        dh = np.asarray(dh)
        datum_loss = replicated_value(outs.datum_loss, n_dev)
        unused = np.setdiff1d(np.arange(pb.num_slots), slots)
        np.testing.assert_array_equal(datum_loss[unused], 0.0, err_msg=f"{name}: empty slots")
        results[name] = LossResult(
            loss=float(replicated_value(loss, n_dev)),
            logprobs=from_stream(replicated_value(outs.logprobs, n_dev), pb),
            elementwise=from_stream(replicated_value(outs.elementwise_loss, n_dev), pb),
            datum_loss=datum_loss[slots],
            clipped=int(replicated_value(outs.clipped, n_dev).sum()),
            d_hidden_stream=dh,
            d_hidden=from_stream(dh, pb),
            d_unembed=np.asarray(dw),
        )
    return Run(mesh_shape, mesh_of(dp, cp, tp), pb, results)


# ----------------------------------------------------------------------------------------
# Independent NumPy reference (float64)


def np_token_loss(name, lp, w, a, s, m, cfg, lp_sg=None):
    """(token loss, d loss / d lp, clipped) of one datum, written from the Tinker formulas.

    m: sequence_ratio_mask. lp_sg: the log-probs at which stop_gradient terms (CISPO's
    clipped ratio, GSPO's sequence ratio) are taken; default lp. Finite differences pass
    the unperturbed lp here.
    """
    lp0 = lp if lp_sg is None else lp_sg
    r = np.exp(lp - s)
    if name == "gspo":
        lo, hi = cfg["clip_low_threshold"], cfg["clip_high_threshold"]
        on = m != 0
        log_s = (lp0 - s)[on].mean() if on.any() else 0.0
        r = np.exp(log_s) * np.exp(lp - lp0)  # sg(s)·exp(lp − sg(lp))
        unclipped, clipped = r * a, np.clip(r, lo, hi) * a
        clip_wins = clipped < unclipped
        return -np.minimum(unclipped, clipped), np.where(clip_wins, 0.0, -r * a), clip_wins
    if name == "cross_entropy":
        return -w * lp, -w, np.zeros(lp.shape, bool)
    if name == "importance_sampling":
        return -r * a, -r * a, np.zeros(lp.shape, bool)
    if name == "ppo":
        lo, hi = cfg["clip_low_threshold"], cfg["clip_high_threshold"]
        unclipped, clipped = r * a, np.clip(r, lo, hi) * a
        clip_wins = clipped < unclipped
        return -np.minimum(unclipped, clipped), np.where(clip_wins, 0.0, -r * a), clip_wins
    if name == "cispo":
        lo, hi = cfg["clip_low_threshold"], cfg["clip_high_threshold"]
        c = np.clip(np.exp((lp if lp_sg is None else lp_sg) - s), lo, hi)
        return -c * lp * a, -c * a, (r < lo) | (r > hi)
    if name == "dro":
        beta = cfg["beta"]
        d = lp - s
        return -(lp * a - 0.5 * beta * d**2), -(a - beta * d), np.zeros(lp.shape, bool)
    raise KeyError(name)


def client_floats(inputs):
    """weights, advantages, logprobs, sequence_ratio_mask as the device sees them
    (float32), in float64."""
    return tuple(
        np.asarray(inputs[k], np.float32).astype(np.float64)
        for k in ("weights", "advantages", "logprobs", "sequence_ratio_mask")
    )


def np_reference(case: Case, name: str, cfg):
    """float64: per-datum lp, token losses, datum losses, clipped count, d/dh, d/dW."""
    w_DxV = case.unembed_DxV.astype(np.float64)
    out = {"logprobs": [], "elementwise": [], "datum_loss": [], "d_hidden": [], "clipped": 0}
    d_w = np.zeros_like(w_DxV)
    for d, h in zip(case.data, case.hidden):
        x = d.loss_fn_inputs
        t = np.asarray(x["target_tokens"])
        lp, probs = np_logprobs(h, w_DxV, t)
        tok, g, clipped = np_token_loss(name, lp, *client_floats(x), cfg)
        onehot = np.zeros_like(probs)
        onehot[np.arange(len(t)), t] = 1.0
        d_logits = g[:, None] * (onehot - probs)  # d lp / d logits = onehot − softmax
        out["logprobs"].append(lp)
        out["elementwise"].append(tok)
        out["datum_loss"].append(tok.sum())
        out["d_hidden"].append(d_logits @ w_DxV.T)
        out["clipped"] += int(clipped.sum())
        d_w += h.astype(np.float64).T @ d_logits
    out["datum_loss"] = np.array(out["datum_loss"])
    out["loss"] = float(out["datum_loss"].sum())
    out["d_unembed"] = d_w
    return out


def np_total_loss(case: Case, name: str, cfg, hidden, unembed, frozen) -> float:
    """Total loss as a plain function of (hidden, unembedding), for finite differences;
    stop_gradient terms are evaluated at frozen = (hidden, unembedding)."""
    total = 0.0
    for d, h, h0 in zip(case.data, hidden, frozen[0]):
        x = d.loss_fn_inputs
        t = np.asarray(x["target_tokens"])
        lp, _ = np_logprobs(h, unembed, t)
        lp0, _ = np_logprobs(h0, frozen[1], t)
        tok, _, _ = np_token_loss(name, lp, *client_floats(x), cfg, lp_sg=lp0)
        total += tok.sum()
    return total
