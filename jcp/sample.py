"""Sampling with the Trainer's own base weights and adapter slots: prefill, decode, draws.

Owns SamplingParams and the sampled results, the validation of sampling calls, the layout
of a call (which prompt is prefilled where, which device decodes which sequence, which
cache layout — Plan) and the compiled programs: prefill (the packed zigzag path with CP
attention, writing the KV cache in the same program through kv_cache.prefill_attend and
kv_cache.fill), decode (one lax.while_loop over a batch of sequences that mixes adapters,
kv_cache.decode_attend) and the token draw on vocab-parallel logits. It reuses the one
decoder (model.hidden_states), LoRA routing and log-prob code; it must never write a
second decoder, never copy adapter weights per token, and never change any state
(adapters, accumulators, optimizer) — sampling only reads.

Cache layouts (kv_cache.LAYOUTS), chosen per call by size (choose_cache_mode) or by the
caller's cache_mode: "batch" spreads the decode batch over (dp, cp) — cp ranks act as
extra data parallelism — each sequence's cache on one device, no cross-device attention
in decode; "split" keeps each sequence's cache split over cp along the sequence (the
rows each rank prefilled, new tokens round robin), merging the ranks' partial attention
by log-sum-exp, so per-device cache memory is ∝ tokens / cp for long prompts.

Shapes: see the legend in jcp/mesh.py; B = sequences of the decode batch (on this device
inside shard_map), T = cache rows per sequence, N = out tokens per sequence (bucketed).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jcp import batch as batch_lib
from jcp import kv_cache
from jcp import lora as lora_lib
from jcp import losses as losses_lib
from jcp import mesh as mesh_lib
from jcp import model as model_lib
from jcp import train_step
from jcp.adapter_state import host, replicate
from jcp.config import QwenConfig
from jcp.errors import InputError, float32_number
from jcp.mesh import SPECS, TP, vary

# Temperatures below this are treated as this: logits / T stays finite in float32, and the
# draw is then the greedy token except for exact ties.
MIN_TEMPERATURE = 1e-6
BASE = -1  # adapter key of "no adapter" (the base model alone)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample (Tinker's SamplingParams, token stops only).

    max_tokens: most new tokens per sequence (≥ 1). temperature: 0 = greedy; otherwise
    logits / T (values below 1e-6 act as 1e-6). top_k: keep the k most likely tokens (−1 =
    all). top_p: then keep the smallest set of most likely tokens whose probability
    reaches top_p (1 = all). stop: token ids that end a sequence (the stop token is
    included in the result); None = the model's EOS ids (QwenConfig.eos_token_ids, from
    config.json / generation_config.json); [] = never stop early. seed: makes the call
    reproducible (each sequence of each prompt gets its own stream from it); None =
    fresh entropy.

    Returned log-probs are log_softmax(logits / T) of the sampled token, before top-k /
    top-p truncation (T = 1 for greedy), so at T = 1 they are the Trainer's own
    log-probs of those tokens.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    stop: Sequence[int] | None = None
    seed: int | None = None


@dataclasses.dataclass
class SampledSequence:
    """One completion: tokens int32 [n] (a stop token that ended it included), logprobs
    float32 [n] (see SamplingParams), stop_reason "stop" | "length"."""

    tokens: np.ndarray
    logprobs: np.ndarray
    stop_reason: str


@dataclasses.dataclass
class SampleResult:
    """The num_samples sequences of one prompt; prompt_logprobs float32 [len(prompt)]
    (NaN at 0) when asked for, else None."""

    sequences: list[SampledSequence]
    prompt_logprobs: np.ndarray | None = None


@dataclasses.dataclass(frozen=True)
class _Checked:
    """A validated sampling call."""

    prompts: list[np.ndarray]
    adapters: list[int]  # per prompt; BASE = none
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    stop: tuple[int, ...]
    seed: int
    num_samples: int


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def check_prompts(prompts, vocab_size: int, what: str = "prompts") -> list[np.ndarray]:
    """A list of non-empty token vectors inside the vocabulary -> int32 copies."""
    if isinstance(prompts, (str, bytes, np.ndarray)) or not isinstance(prompts, Sequence):
        raise InputError(f"{what} must be a list of token sequences")
    if len(prompts) == 0:
        raise InputError(f"{what} is empty: pass at least one prompt")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, (str, bytes)):
            raise InputError(f"{what}[{i}] must be a sequence of token ids, got a string")
        try:
            arr = np.array(p, copy=True)
        except Exception as e:  # ragged and the like
            raise InputError(f"{what}[{i}] is not a vector of token ids ({e})") from None
        if arr.ndim != 1:
            raise InputError(f"{what}[{i}] must be 1-D, got shape {arr.shape}")
        if arr.size == 0:
            raise InputError(f"{what}[{i}] is empty")
        if not np.issubdtype(arr.dtype, np.integer):
            if arr.dtype.kind != "f" or not np.all(np.isfinite(arr)) \
                    or np.any(arr != np.round(arr)):
                raise InputError(f"{what}[{i}] must hold integer token ids, got {arr.dtype}")
        bad = np.flatnonzero((arr < 0) | (arr >= vocab_size))
        if bad.size:
            j = int(bad[0])
            raise InputError(f"{what}[{i}][{j}] = {arr[j]} is outside the vocabulary "
                             f"[0, {vocab_size})")
        out.append(arr.astype(np.int32))
    return out


def check_params(sp, vocab_size: int, eos: tuple[int, ...]) -> dict:
    """SamplingParams -> checked values (float32 for the floats); InputError names the field."""
    if not isinstance(sp, SamplingParams):
        raise InputError(f"sampling_params must be jcp.SamplingParams, got {type(sp).__name__}")
    if not _is_int(sp.max_tokens) or sp.max_tokens < 1:
        raise InputError(f"SamplingParams.max_tokens must be an integer ≥ 1, got "
                         f"{sp.max_tokens!r}")
    temperature = float32_number(sp.temperature, "SamplingParams.temperature")
    if temperature < 0:
        raise InputError(f"SamplingParams.temperature must be ≥ 0, got {sp.temperature}")
    if not _is_int(sp.top_k) or not (sp.top_k == -1 or sp.top_k >= 1):
        raise InputError(f"SamplingParams.top_k must be −1 (no limit) or an integer ≥ 1, got "
                         f"{sp.top_k!r}")
    top_p = float32_number(sp.top_p, "SamplingParams.top_p")
    if not 0.0 < top_p <= 1.0:
        raise InputError(f"SamplingParams.top_p must lie in (0, 1], got {sp.top_p}")
    if sp.stop is None:
        stop = tuple(eos)
    else:
        if isinstance(sp.stop, (str, bytes)) or not isinstance(sp.stop, (Sequence, np.ndarray)):
            raise InputError(f"SamplingParams.stop must be a list of token ids or None, got "
                             f"{sp.stop!r}")
        for j, t in enumerate(sp.stop):
            if not _is_int(t) or not 0 <= t < vocab_size:
                raise InputError(f"SamplingParams.stop[{j}] = {t!r} is not a token id in "
                                 f"[0, {vocab_size})")
        stop = tuple(int(t) for t in sp.stop)
    if sp.seed is None:
        seed = int(np.random.SeedSequence().entropy % (1 << 63))
    elif not _is_int(sp.seed) or not 0 <= sp.seed < 1 << 63:
        raise InputError(f"SamplingParams.seed must be an integer in [0, 2^63) or None, got "
                         f"{sp.seed!r}")
    else:
        seed = int(sp.seed)
    return dict(max_tokens=int(sp.max_tokens), temperature=temperature,
                top_k=int(min(sp.top_k, vocab_size)) if sp.top_k > 0 else -1,
                top_p=top_p, stop=stop, seed=seed)


def sequence_keys(seed: int, prompt: int, num_samples: int) -> np.ndarray:
    """Raw threefry keys uint32 [num_samples, 2] of one prompt's sequences: a pure function
    of (seed, prompt index, sample index), so a draw never depends on the batch around it."""
    return np.stack([np.random.SeedSequence([seed, prompt, j]).generate_state(2, np.uint32)
                     for j in range(num_samples)])


# ----------------------------------------------------------------------------------------
# Token draws on full-vocabulary logits


def nucleus_mask(x_BxV, top_k, top_p):
    """[B, V] bool: the tokens top-k then top-p keep (by rank, so exactly k survive top-k).

    top-p keeps a token iff the probability (renormalised over the top-k survivors) of
    the tokens ranked strictly above it is < top_p: the smallest set reaching top_p.
    """
    b, v = x_BxV.shape
    order_BxV = jnp.argsort(-x_BxV, axis=-1, stable=True)
    sorted_BxV = jnp.take_along_axis(x_BxV, order_BxV, axis=-1)
    rank_V = jnp.arange(v)
    in_k = rank_V[None, :] < jnp.where(top_k > 0, top_k, v)
    p_BxV = jax.nn.softmax(jnp.where(in_k, sorted_BxV, -jnp.inf), axis=-1)
    before = jnp.cumsum(p_BxV, axis=-1) - p_BxV
    keep_sorted = in_k & ((top_p >= 1.0) | (before < top_p))
    return jnp.zeros((b, v), bool).at[jnp.arange(b)[:, None], order_BxV].set(keep_sorted)


def sample_tokens(logits_BxV, keys_Bx2, step, temperature, top_k, top_p, *, greedy: bool,
                  filtered: bool):
    """(token int32 [B], log-prob float32 [B]) of one decode step.

    greedy: argmax (the first, as torch), log-prob log_softmax(logits). Else x = logits / T;
    log-prob log_softmax(x) of the drawn token (before truncation); with `filtered` the
    draw is restricted to nucleus_mask(x, top_k, top_p). The draw is Gumbel-max with key
    fold_in(key_b, step): a sequence's draws depend on its key and step only.
    """
    logits_BxV = logits_BxV.astype(jnp.float32)
    if greedy:
        tok_B = jnp.argmax(logits_BxV, axis=-1)
        logp_BxV = jax.nn.log_softmax(logits_BxV, axis=-1)
    else:
        x_BxV = logits_BxV / jnp.maximum(temperature, MIN_TEMPERATURE)
        logp_BxV = jax.nn.log_softmax(x_BxV, axis=-1)
        if filtered:
            x_BxV = jnp.where(nucleus_mask(x_BxV, top_k, top_p), x_BxV, -jnp.inf)

        def draw(key_2, row_V):
            key = jax.random.fold_in(jax.random.wrap_key_data(key_2, impl="threefry2x32"), step)
            return jnp.argmax(row_V + jax.random.gumbel(key, row_V.shape, jnp.float32))

        tok_B = jax.vmap(draw)(keys_Bx2, x_BxV)
    lp_B = jnp.take_along_axis(logp_BxV, tok_B[:, None], axis=-1)[:, 0]
    return tok_B.astype(jnp.int32), lp_B


def _gather_vocab(x_BxVloc):
    """[B, V/tp] on each tp rank -> [B, V] on all: a psum of each rank's slice placed in a
    zero grid (typed replicated over tp, unlike all_gather), vocab order rank-major."""
    tp = jax.lax.axis_size(TP)
    grid = jnp.zeros((tp,) + x_BxVloc.shape, x_BxVloc.dtype)
    grid = grid.at[jax.lax.axis_index(TP)].set(x_BxVloc)
    b, v_loc = x_BxVloc.shape
    return jnp.moveaxis(jax.lax.psum(grid, TP), 0, 1).reshape(b, tp * v_loc)


def _gather_batch(x_BxN, axes):
    """[B, …] on each device along `axes` -> [n·B, …] on all (device-major over axes in
    order, n = their total size), replicated over them."""
    grid = jnp.zeros((jax.lax.axis_size(axes),) + x_BxN.shape, x_BxN.dtype)
    grid = grid.at[jax.lax.axis_index(axes)].set(x_BxN)
    return jax.lax.psum(grid, axes).reshape((-1,) + x_BxN.shape[1:])


# ----------------------------------------------------------------------------------------
# The compiled programs


def make_prefill(cfg: QwenConfig, mesh, step_cfg: train_step.StepConfig):
    """jit(prefill)(lora, params, slot_meta, tokens, segment, position, targets, spans, active,
    source, old, *, layout, with_logprobs) -> (KV [L, B, T, K, H] or None, log-probs
    [DP, CP, S] replicated or None).

    The packed streams (batch.pack of prompt[:-1] with targets prompt[1:]) through the
    decoder with training's CP attention (train_step.training_attend: gathered K/V or the
    ring, by step_cfg.cp_attention and the stream's size) and each token's adapter
    (active < 0: none). With a cache
    layout name ("batch" / "split", kv_cache.LAYOUTS), every layer's K/V is moved into the
    cache in the same program (kv_cache.fill): row (b, t) ← flat stream row source[b, t]
    ([B, T] int32, sharded like the cache positions; −1 keeps `old`'s row, or zero when old
    is None — the first micro-batch of a call creates the cache). `old` is donated.
    layout None: no cache (source and old None).
    """
    stream = SPECS.stream_DPxCPxS

    @functools.partial(jax.jit, static_argnames=("layout", "with_logprobs"),
                       donate_argnames=("old",))
    def prefill(lora, params, slot_meta, tokens, segment, position, targets, spans, active,
                source, old, *, layout, with_logprobs):
        lora_active = lora_lib.take_active(lora, jnp.maximum(active, 0))
        lay = None if layout is None else kv_cache.LAYOUTS[layout]

        def shard(lora_active, params, slot_meta, tokens, segment, position, targets, spans,
                  active, source, old):
            one = lambda x: x[0, 0]  # noqa: E731  (this device's [S] row)
            route = slot_meta.routing(active, one(spans))
            attend = kv_cache.prefill_attend(
                train_step.training_attend(cfg, step_cfg, one(segment), one(position)))
            h_SxD, kv, _ = model_lib.hidden_states(cfg, params, one(tokens), one(position), attend,
                                                lora_active, route, remat=False)
            kv = None if lay is None else kv_cache.fill(kv, source, lay, old)
            lp = None
            if with_logprobs:
                lefts, rights = model_lib.unembed_factors(params, h_SxD, lora_active, route)
                lp_S = losses_lib.target_logprobs(lefts, rights, one(targets),
                                                  step_cfg.logprob_chunk)
                lp = losses_lib.gather_stream(jnp.where(one(segment) >= 0, lp_S, 0.0))
            return kv, lp

        kv_spec = None if lay is None else kv_cache.KV(lay.kv_LxBxTxKxH, lay.kv_LxBxTxKxH)
        in_specs = (lora_lib.slot_specs_active(cfg, lora_active), model_lib.param_specs(cfg),
                    SPECS.slot_G,
                    stream, stream, stream, stream, SPECS.spans_DPxCPxAx2, SPECS.replicated,
                    None if lay is None else lay.position_BxT,
                    None if old is None else kv_spec)
        out_specs = (kv_spec, P() if with_logprobs else None)
        return jax.shard_map(shard, mesh=mesh, in_specs=in_specs, out_specs=out_specs)(
            lora_active, params, slot_meta, tokens, segment, position, targets, spans, active,
            source, old)

    return prefill


# The largest per-device layer weights the decode loop copies out of their stacks.
SLICE_LAYERS_MAX_BYTES = 256 << 20


def make_decode(cfg: QwenConfig, mesh):
    """jit(decode)(lora, params, slot_meta, cache, token_B, position_B, base_B, done_B,
    keys_Bx2, spans, active, stop, max_tokens, temperature, top_k, top_p, *, layout,
    out_len, greedy, filtered, slice_layers) -> (tokens [B, N] (−1 after a sequence
    ended), log-probs [B, N], both replicated; the final cache, less the rows of the steps
    that ended a sequence — nothing reads those).

    One lax.while_loop: each step runs every sequence's newest token through the decoder
    (decode_attend over its cache — merged over cp under layout "split" — LoRA routed by
    the sequences' adapter spans), draws the next token, writes the step's K/V rows
    (kv_cache.step_rows: from base_B on, round robin over the rows' ranks), and stops when
    every sequence has met a stop token or max_tokens. cache: kv_cache.Cache in the
    layout's specs, donated and returned, so the loop updates it in place (one cache in
    memory, not two). slice_layers: take every layer's weights out of the stacked arrays
    once, before the loop, and run the layers unrolled on them (model.layer_slices),
    instead of a lax.scan that slices them per layer and step (the Sampler slices iff
    the per-device layer weights are at most SLICE_LAYERS_MAX_BYTES).
    """

    @functools.partial(jax.jit, static_argnames=("layout", "out_len", "greedy", "filtered",
                                                 "slice_layers"),
                       donate_argnames=("cache",))
    def decode(lora, params, slot_meta, cache, token_B, position_B, base_B, done_B, keys_Bx2,
               spans, active, stop, max_tokens, temperature, top_k, top_p, *, layout,
               out_len, greedy, filtered, slice_layers=True):
        lay = kv_cache.LAYOUTS[layout]
        # Gathered once, outside the loop: the A active slots, layers leading.
        lora_active = lora_lib.take_active(lora, jnp.maximum(active, 0))

        def shard(lora_active, params, slot_meta, cache, token_B, position_B, base_B, done_B,
                  keys_Bx2, spans, active, stop, max_tokens, temperature, top_k, top_p):
            route = slot_meta.routing(active, spans[0, 0])
            b, t_len = cache.position.shape
            # The A factors enter the loop as [I, A, R] and are viewed back as [A, I, R]
            # inside it (_swap_a_factors): XLA folds that view into low_rank_input's own
            # transpose to [I, A·R], so no step copies them (XLA:CPU hoists no loop
            # invariants; this cost 1.2× the decode time at A = 4 on the tiny model).
            lora_outside = _swap_a_factors(lora_active)
            layers_outside = (model_lib.layer_slices(cfg, params, lora_outside)
                              if slice_layers else None)

            def body(carry):
                i, tok_B, pos_B, done_B, cache, out_tok, out_lp = carry
                lora_active = _swap_a_factors(lora_outside)
                layers = (None if layers_outside is None else
                          tuple((w, _swap_a_factors(lo)) for w, lo in layers_outside))
                attend = kv_cache.decode_attend(pos_B, cache.position, lay.row_axes)
                h_BxD, new, _ = model_lib.hidden_states(
                    cfg, params, tok_B, pos_B, attend, lora_active, route,
                    attn_state=kv_cache.KV(cache.k, cache.v), remat=False, layers=layers)
                lefts, rights = model_lib.unembed_factors(params, h_BxD, lora_active, route)
                logits = sum(jnp.einsum("bd,dv->bv", l, r, preferred_element_type=jnp.float32)
                             for l, r in zip(lefts, rights))
                nxt_B, lp_B = sample_tokens(_gather_vocab(logits), keys_Bx2, i, temperature,
                                            top_k, top_p, greedy=greedy, filtered=filtered)
                live_B = ~done_B
                out_tok = out_tok.at[:, i].set(jnp.where(live_B, nxt_B, -1))
                out_lp = out_lp.at[:, i].set(jnp.where(live_B, lp_B, 0.0))
                done_B = done_B | jnp.isin(nxt_B, stop) | (i + 1 >= max_tokens)
                # A finished sequence needs no more rows. Skipping them also makes the write
                # depend on this step's draw, hence on every layer's reads of the cache (the
                # last layer's feed nothing else): only then does XLA order the reads before
                # the in-place write instead of copying the whole cache twice per step.
                rows_B = jnp.where(done_B, t_len, kv_cache.step_rows(i, base_B, lay, t_len))
                cache = kv_cache.write_rows(cache, new, rows_B, pos_B)
                return i + 1, nxt_B, pos_B + 1, done_B, cache, out_tok, out_lp

            def cond(carry):
                i, done_B = carry[0], carry[3]
                left = jax.lax.psum(jnp.sum(~done_B, dtype=jnp.int32), lay.seq_axes)
                return (i < max_tokens) & (left > 0)

            out_tok = vary(jnp.full((b, out_len), -1, jnp.int32), lay.seq_axes)
            out_lp = vary(jnp.zeros((b, out_len), jnp.float32), lay.seq_axes)
            carry = (jnp.int32(0), token_B, position_B, done_B, cache, out_tok, out_lp)
            _, _, _, _, cache, out_tok, out_lp = jax.lax.while_loop(cond, body, carry)
            return (_gather_batch(out_tok, lay.seq_axes), _gather_batch(out_lp, lay.seq_axes),
                    cache)

        rep, seqs = SPECS.replicated, lay.seqs_B
        in_specs = (lora_lib.slot_specs_active(cfg, lora_active), model_lib.param_specs(cfg),
                    SPECS.slot_G,
                    lay.specs, seqs, seqs, seqs, seqs, lay.seqs_Bx2, lay.spans,
                    rep, rep, rep, rep, rep, rep)
        return jax.shard_map(shard, mesh=mesh, in_specs=in_specs,
                             out_specs=(P(), P(), lay.specs))(
            lora_active, params, slot_meta, cache, token_B, position_B, base_B, done_B,
            keys_Bx2, spans, active, stop, max_tokens, temperature, top_k, top_p)

    return decode


def _swap_a_factors(lora):
    """The A factors of the dense LoRA modules with their adapter and input axes swapped:
    [.., A, I, R] <-> [.., I, A, R] (an involution; other factors unchanged). None: None."""
    if lora is None:
        return None
    dense = lora_lib.LAYER_MODULES + (lora_lib.HEAD,)
    return {m: {k: jnp.swapaxes(x, -3, -2) if m in dense and k == "a" else x
                for k, x in ab.items()} if ab is not None else ab
            for m, ab in lora.items()}


def _pow2(n: int, minimum: int = 1) -> int:
    return max(minimum, 1 << max(0, math.ceil(math.log2(max(n, 1)))))


# ----------------------------------------------------------------------------------------
# Cache layout of one call


CACHE_MODES = ("batch", "split")
# Auto choice: the cp-split cache when the per-device cache of mode "batch" would exceed
# this and splitting makes it smaller. Below it, "batch" decodes faster (no collective per
# layer and step, no work repeated over cp).
SPLIT_ABOVE_BYTES = 1 << 30


def choose_cache_mode(requested: str | None, cp: int, batch_bytes: int,
                      split_bytes: int) -> str:
    """The cache layout of a call: `requested` when given; else "split" iff cp > 1, the
    per-device cache of "batch" exceeds SPLIT_ABOVE_BYTES and "split"'s is smaller."""
    if requested is not None:
        return requested
    if cp > 1 and batch_bytes > SPLIT_ABOVE_BYTES and split_bytes < batch_bytes:
        return "split"
    return "batch"


@dataclasses.dataclass(frozen=True)
class Plan:
    """The cache layout of one sample call, decided on the host before any device work.

    mode: "batch" | "split" (kv_cache.LAYOUTS); b_local: sequences per device along the
    layout's sequence axes; t_local: cache rows per sequence per device (a sequence has
    t_local rows under "batch", CP·t_local under "split"); out_len: bucketed max_tokens;
    batch_bytes / split_bytes: per-device cache bytes (K, V and row positions) of either
    layout, the figures choose_cache_mode compared.
    """

    mode: str
    b_local: int
    t_local: int
    out_len: int
    batch_bytes: int
    split_bytes: int

    @property
    def cache_bytes(self) -> int:
        return self.batch_bytes if self.mode == "batch" else self.split_bytes


# ----------------------------------------------------------------------------------------
# The sampler: validation, layout, dispatch


class Sampler:
    """Sampling over a Trainer's base weights and adapter table (read only).

    Built by the Trainer (Trainer.sample / compute_logprobs call it); `check_adapter` is the
    Trainer's adapter-id check. Programs compiled: one prefill per (stream length, active
    adapters, cache layout and shape) bucket, one decode per (layout, batch, cache length,
    out length) bucket and draw kind (greedy / plain / top-k-top-p). `last_plan` is the
    Plan of the latest sample call.
    """

    def __init__(self, trainer):
        self.tr = trainer
        cfg, mesh = trainer.cfg, trainer.mesh
        self.cfg, self.mesh = cfg, mesh
        self._prefill = make_prefill(cfg, mesh, trainer.step_cfg)
        self._decode = make_decode(cfg, mesh)
        self.last_plan: Plan | None = None
        # Slicing the layers out of the stacks before the decode loop holds a second copy
        # of the layer weights for the call (measured: 26.7 vs 14.1 MiB of temporaries at
        # hidden 512, 18 MiB of layer weights) for 1.93× faster steps on CPU (XLA:CPU
        # slices the stacks anew each step). Worth it only while that copy is small.
        layer_bytes = sum(x.addressable_data(0).nbytes for k, t in trainer.params.items()
                          if isinstance(t, dict) for x in jax.tree.leaves(t))
        self.slice_layers = layer_bytes <= SLICE_LAYERS_MAX_BYTES

    # ------------------------------------------------------------------ validation

    def _check_adapters(self, adapters, n: int) -> list[int]:
        if adapters is None:
            return [BASE] * n
        if _is_int(adapters):
            return [self.tr._check_adapter(adapters)] * n
        if isinstance(adapters, (str, bytes)) or not isinstance(adapters, Sequence):
            raise InputError(f"adapters must be None, an adapter id, or one entry (id or None) "
                             f"per prompt, got {adapters!r}")
        if len(adapters) != n:
            raise InputError(f"adapters has {len(adapters)} entries for {n} prompts")
        return [BASE if a is None else self.tr._check_adapter(a, f"adapters[{i}]")
                for i, a in enumerate(adapters)]

    def check(self, prompts, sampling_params, adapters, num_samples) -> _Checked:
        """Every refusal of a sampling call (InputError naming the argument), no device work."""
        prompts = check_prompts(prompts, self.cfg.vocab_size)
        per_prompt = self._check_adapters(adapters, len(prompts))
        p = check_params(sampling_params, self.cfg.vocab_size, self.cfg.eos_token_ids)
        if not _is_int(num_samples) or num_samples < 1:
            raise InputError(f"num_samples must be an integer ≥ 1, got {num_samples!r}")
        cap = self.tr.token_cap
        for i, x in enumerate(prompts):
            if len(x) + p["max_tokens"] > cap:
                raise InputError(f"prompts[{i}]: {len(x)} prompt tokens + max_tokens "
                                 f"{p['max_tokens']} exceed the token cap of {cap} tokens per "
                                 "sequence (raise max_tokens_per_device or cp)")
        return _Checked(prompts, per_prompt, num_samples=int(num_samples), **p)

    # ------------------------------------------------------------------ layout

    def plan(self, prompt_lengths: Sequence[int], max_tokens: int, num_samples: int = 1,
             cache_mode: str | None = None) -> Plan:
        """The cache layout a call with these prompt lengths would use (host only).

        "batch": b_local = pow2(⌈sequences / (dp·cp)⌉), t_local = pow2(longest − 1 +
        max_tokens, ≥ 64). "split": b_local = pow2(⌈sequences / dp⌉), t_local = pow2(2C +
        ⌈max_tokens / cp⌉, ≥ 16) with 2C the zigzag rows per rank of the longest prompt's
        prefill. cache_mode None: choose_cache_mode.
        """
        if cache_mode is not None and cache_mode not in CACHE_MODES:
            raise InputError(f"cache_mode must be None (automatic), \"batch\" or \"split\", "
                             f"got {cache_mode!r}")
        cfg, tr = self.cfg, self.tr
        n_seq = len(prompt_lengths) * num_samples
        longest = max(prompt_lengths)
        b_batch = _pow2(-(-n_seq // (tr.dp * tr.cp)))
        t_batch = _pow2(longest - 1 + max_tokens, 64)
        b_split = _pow2(-(-n_seq // tr.dp))
        t_split = _pow2(2 * mesh_lib.zigzag_chunk(max(longest - 1, 1), tr.cp)
                        + -(-max_tokens // tr.cp), 16)
        row_bytes = (2 * cfg.num_layers * (cfg.num_kv_heads // tr.tp) * cfg.head_dim
                     * jnp.dtype(cfg.dtype).itemsize + 4)
        batch_bytes = b_batch * t_batch * row_bytes
        split_bytes = b_split * t_split * row_bytes
        mode = choose_cache_mode(cache_mode, tr.cp, batch_bytes, split_bytes)
        b_local, t_local = (b_batch, t_batch) if mode == "batch" else (b_split, t_split)
        return Plan(mode, b_local, t_local, _pow2(max_tokens, 16), batch_bytes, split_bytes)

    # ------------------------------------------------------------------ prefill

    def _put(self, x, spec):
        return jax.make_array_from_callback(x.shape, NamedSharding(self.mesh, spec),
                                            lambda idx: x[idx])

    def _packed(self, prompts, adapters) -> tuple[list[int], list[batch_lib.PackedBatch]]:
        """(prompt index of each prefill datum, packed micro-batches) of prompt[:-1] →
        prompt[1:] for every prompt longer than one token. Streams are padded on to a power
        of two (at most a device's rows): sampling's prefill also varies with the cache
        shape, so coarser stream buckets keep the number of programs down."""
        which = [i for i, x in enumerate(prompts) if len(x) > 1]
        if not which:
            return which, []
        data = [batch_lib.CheckedDatum(prompts[i][:-1], prompts[i][1:], {}) for i in which]
        cap = self.tr.max_tokens_per_device
        packed = batch_lib.pack(data, [adapters[i] for i in which], self.tr.dp, self.tr.cp,
                                cap, self.tr.max_adapters + 1)
        return which, [_pad_streams(pb, min(_pow2(pb.tokens.shape[-1]), cap))
                       for pb in packed]

    def _zeros(self, shape, spec):
        """A zero array in the model's dtype, each device making only its own slice."""
        sharding = NamedSharding(self.mesh, spec)
        local = sharding.shard_shape(shape)
        return jax.make_array_from_callback(
            shape, sharding, lambda idx: np.zeros(local, jnp.dtype(self.cfg.dtype)))

    def _run_prefill(self, pb, source=None, old=None, *, layout=None, with_logprobs):
        s = SPECS.stream_DPxCPxS
        if source is not None:
            source = self._put(source, kv_cache.LAYOUTS[layout].position_BxT)
        return self._prefill(
            self.tr.state.weights, self.tr.params, self.tr.state.meta,
            self._put(pb.tokens, s), self._put(pb.segment, s), self._put(pb.position, s),
            self._put(pb.targets, s), self._put(pb.spans, SPECS.spans_DPxCPxAx2),
            replicate(self.mesh, pb.active), source, old, layout=layout,
            with_logprobs=with_logprobs)

    def compute_logprobs(self, prompts, adapters=None) -> list[np.ndarray]:
        """log p(prompt[t] | prompt[:t]) float32 [len(prompt)] per prompt, NaN at 0."""
        prompts = check_prompts(prompts, self.cfg.vocab_size)
        per_prompt = self._check_adapters(adapters, len(prompts))
        for i, x in enumerate(prompts):
            if len(x) > self.tr.token_cap:
                raise InputError(f"prompts[{i}] has {len(x)} tokens, over the cap of "
                                 f"{self.tr.token_cap} tokens per sequence")
        return self._prompt_logprobs(prompts, per_prompt, None)

    def _prompt_logprobs(self, prompts, adapters, packed_results) -> list[np.ndarray]:
        which, packed = self._packed(prompts, adapters)
        if packed_results is None:
            packed_results = [self._run_prefill(pb, with_logprobs=True)[1] for pb in packed]
        out = [np.full(len(x), np.nan, np.float32) for x in prompts]
        for pb, lp in zip(packed, packed_results):
            for j, vec in batch_lib.unpack(host(lp), pb).items():
                out[which[j]][1:] = vec
        return out

    # ------------------------------------------------------------------ sample

    def sample(self, prompts, sampling_params, adapters=None, num_samples=1,
               prompt_logprobs=False, cache_mode=None) -> list[SampleResult]:
        c = self.check(prompts, sampling_params, adapters, num_samples)
        if not isinstance(prompt_logprobs, (bool, np.bool_)):
            raise InputError(f"prompt_logprobs must be a bool, got {prompt_logprobs!r}")
        plan = self.plan([len(x) for x in c.prompts], c.max_tokens, c.num_samples, cache_mode)
        tr = self.tr
        lay = kv_cache.LAYOUTS[plan.mode]
        split = plan.mode == "split"
        n_groups = tr.dp if split else tr.dp * tr.cp  # devices along the sequence axes
        b_local, t_local = plan.b_local, plan.t_local
        b_total = b_local * n_groups
        t_total = t_local * (tr.cp if split else 1)

        # Decode layout: sequences sorted by adapter, dealt round-robin over the devices
        # along the sequence axes, so each device's rows stay sorted by adapter
        # (contiguous LoRA spans).
        seqs = sorted(((c.adapters[i], i, j) for i in range(len(c.prompts))
                       for j in range(c.num_samples)))
        row_of = {(i, j): (k % n_groups) * b_local + k // n_groups
                  for k, (_, i, j) in enumerate(seqs)}

        # Cache rows of the prefilled positions: the true position of every row (−1 empty)
        # and where decode's rows start (base). "batch": row t holds position t; "split":
        # rank r's first rows hold its zigzag chunks of the prompt.
        row_position = np.full((b_total, t_total), -1, np.int32)
        base = np.zeros(b_total, np.int32)
        for i, x in enumerate(c.prompts):
            n = len(x) - 1
            rows = [row_of[(i, j)] for j in range(c.num_samples)]
            if n == 0:
                continue
            if split:
                idx = mesh_lib.zigzag_indices(n, tr.cp)  # [cp, 2C]
                cols = np.arange(tr.cp)[:, None] * t_local + np.arange(idx.shape[1])
                row_position[np.ix_(rows, cols.reshape(-1))] = idx.reshape(-1)
                base[rows] = idx.shape[1]
            else:
                row_position[rows, :n] = np.arange(n)
                base[rows] = n

        # Prefill every prompt once, for all its num_samples sequences, straight into the
        # cache.
        which, packed = self._packed(c.prompts, c.adapters)
        kv, lps = None, []
        for pb in packed:
            source = np.full((b_total, t_total), -1, np.int32)
            s_len = pb.tokens.shape[-1]
            for p in pb.placements:
                i = which[p.index]
                idx = mesh_lib.zigzag_indices(p.n, tr.cp)  # [cp, 2C] positions
                r, q = np.nonzero(idx >= 0)
                rows = [row_of[(i, j)] for j in range(c.num_samples)]
                if split:  # rank r keeps its own rows: flat row d·S + s of its cp slice
                    source[np.ix_(rows, r * t_local + q)] = p.shard * s_len + p.offset + q
                else:
                    source[np.ix_(rows, idx[r, q])] = ((p.shard * tr.cp + r) * s_len
                                                       + p.offset + q)
            kv, lp = self._run_prefill(pb, source, kv, layout=plan.mode,
                                       with_logprobs=bool(prompt_logprobs))
            lps.append(lp)
        if kv is None:  # every prompt is one token: nothing to prefill
            shape = (self.cfg.num_layers, b_total, t_total, self.cfg.num_kv_heads,
                     self.cfg.head_dim)
            kv = kv_cache.KV(*(self._zeros(shape, lay.kv_LxBxTxKxH) for _ in range(2)))
        cache = kv_cache.Cache(kv.k, kv.v, self._put(row_position, lay.position_BxT))

        # Per-sequence start state, keys and adapter spans.
        token = np.zeros(b_total, np.int32)
        position = np.zeros(b_total, np.int32)
        done = np.ones(b_total, bool)
        keys = np.zeros((b_total, 2), np.uint32)
        adapter_row = np.full(b_total, np.iinfo(np.int32).min, np.int64)  # padding: none
        for i, x in enumerate(c.prompts):
            k = sequence_keys(c.seed, i, c.num_samples)
            for j in range(c.num_samples):
                r = row_of[(i, j)]
                token[r], position[r], done[r], keys[r] = x[-1], len(x) - 1, False, k[j]
                adapter_row[r] = c.adapters[i]
        active_list = sorted(set(c.adapters))
        a_len = batch_lib.active_bucket(len(active_list), tr.max_adapters + 1)
        active = np.array(active_list + [BASE] * (a_len - len(active_list)), np.int32)
        spans = np.zeros((tr.dp, 1 if split else tr.cp, a_len, 2), np.int32)
        for g in range(n_groups):
            rows = adapter_row[g * b_local:(g + 1) * b_local]
            for a_i, a in enumerate(active_list):
                hit = np.flatnonzero(rows == a)
                if hit.size:
                    spans[np.unravel_index(g, spans.shape[:2]) + (a_i,)] = (hit[0],
                                                                           hit[-1] + 1)
        stop = np.full(_pow2(len(c.stop), 8), -1, np.int32)
        stop[:len(c.stop)] = c.stop
        greedy = c.temperature == 0.0
        filtered = not greedy and (c.top_k > 0 or c.top_p < 1.0)
        rep = lambda x: replicate(self.mesh, np.asarray(x))  # noqa: E731
        self.last_plan = plan
        out_tok, out_lp, _ = self._decode(
            tr.state.weights, tr.params, tr.state.meta, cache,
            self._put(token, lay.seqs_B), self._put(position, lay.seqs_B),
            self._put(base, lay.seqs_B), self._put(done, lay.seqs_B),
            self._put(keys, lay.seqs_Bx2), self._put(spans, lay.spans), rep(active),
            rep(stop), rep(np.int32(c.max_tokens)), rep(np.float32(c.temperature)),
            rep(np.int32(c.top_k)), rep(np.float32(c.top_p)),
            layout=plan.mode, out_len=plan.out_len, greedy=greedy, filtered=filtered,
            slice_layers=self.slice_layers)
        plp = (self._prompt_logprobs(c.prompts, c.adapters, lps) if prompt_logprobs
               else None)
        out_tok, out_lp = host(out_tok), host(out_lp)

        stops = set(c.stop)
        results = []
        for i in range(len(c.prompts)):
            sequences = []
            for j in range(c.num_samples):
                r = row_of[(i, j)]
                n = int(np.sum(out_tok[r] >= 0))
                toks = out_tok[r, :n].astype(np.int32)
                reason = "stop" if n and int(toks[-1]) in stops else "length"
                sequences.append(SampledSequence(toks, out_lp[r, :n].astype(np.float32),
                                                 reason))
            results.append(SampleResult(sequences, None if plp is None else plp[i]))
        return results


def _pad_streams(pb: batch_lib.PackedBatch, s_len: int) -> batch_lib.PackedBatch:
    """pb with its [DP, CP, S] streams right-padded to s_len rows (segment −1: padding)."""
    pad = s_len - pb.tokens.shape[-1]
    if pad <= 0:
        return pb

    def grow(x, value=0):
        return np.pad(x, ((0, 0), (0, 0), (0, pad)), constant_values=value)

    return dataclasses.replace(
        pb, tokens=grow(pb.tokens), targets=grow(pb.targets), segment=grow(pb.segment, -1),
        position=grow(pb.position), loss_id=grow(pb.loss_id),
        floats={k: grow(v) for k, v in pb.floats.items()})
