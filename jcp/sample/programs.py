"""The compiled sampling programs: prefill and decode.

Owns the two jitted device programs and their arguments (decode's rows and loop, which
the engine's paged decode shares, live in decode_loop.py; DecodeRows and decode_hidden
are re-exported here). Arguments are registered
dataclasses with a `specs()` (as train_step.Batch), so the shard_map specs cannot drift
from the arguments; what selects a program variant is one frozen, hashable value
(PrefillModes / DecodeModes). Both programs run the one decoder (model.hidden_states)
with an attention strategy from kv_cache, the LoRA routing of jcp/lora.py and the
log-prob code of jcp/losses.py; they must never write a second decoder, never copy
adapter weights per token, and never change adapter state (sampling only reads).

Shapes: see the legend in jcp/mesh.py; B = rows of the decode batch (on this device
inside shard_map), T = cache rows per sequence, N = out tokens per row (bucketed), A =
active adapters, NS = stop-table width.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jcp import delta_rule as delta_rule_lib
from jcp import lora as lora_lib
from jcp import losses as losses_lib
from jcp import model as model_lib
from jcp import train_step
from jcp.config import QwenConfig
from jcp.mesh import CP, SPECS
from jcp.program_cache import shared
from jcp.sample import kv_cache
from jcp.sample.decode_loop import (  # noqa: F401 — DecodeRows, decode_hidden: re-exported
    DecodeRows,
    StepModel,
    decode_hidden,
    decode_loop,
    decode_out_specs,
)

# The largest per-device layer weights the decode loop copies out of their stacks.
SLICE_LAYERS_MAX_BYTES = 256 << 20


def _register(cls):
    jax.tree_util.register_dataclass(
        cls, data_fields=[f.name for f in dataclasses.fields(cls)], meta_fields=[]
    )
    return cls


@_register
@dataclasses.dataclass(frozen=True)
class PrefillArgs:
    """Packed prefill streams (batch.pack of prompt[:-1] → prompt[1:]) as global arrays:
    tokens, segment, position, targets [DP, CP, S] (or [DP, CP, S, K]: column 0 the next
    prompt token, the others requested targets, −1 padded), spans [DP, CP, A, 2], active
    [A]; for prompt draws (PrefillModes.alt) each token's temperature [DP, CP, S] (0:
    greedy) and raw threefry key [DP, CP, S, 2], else None."""

    tokens: jax.Array
    segment: jax.Array
    position: jax.Array
    targets: jax.Array
    spans: jax.Array
    active: jax.Array
    temperature: jax.Array | None = None
    keys: jax.Array | None = None

    @staticmethod
    def specs(draws: bool = False) -> PrefillArgs:
        s = SPECS.stream_DPxCPxS
        return PrefillArgs(
            s,
            s,
            s,
            s,
            SPECS.spans_DPxCPxAx2,
            SPECS.replicated,
            s if draws else None,
            s if draws else None,
        )


@dataclasses.dataclass(frozen=True)
class PrefillModes:
    """layout: kv_cache.LAYOUTS name the prefill fills, or None (no cache: log-probs only);
    with_logprobs: also return the streams' target log-probs; topk / alt (bucketed, 0:
    none): also each token's top-k log-probs / alt draws (losses.prompt_stats; then the
    log-probs come back as a dict, see make_prefill); pieces: a hybrid model's static
    bound on pieces per stream (delta_rule.pieces; layout.stream_pieces), 0 otherwise."""

    layout: str | None
    with_logprobs: bool
    topk: int = 0
    alt: int = 0
    pieces: int = 0

    @property
    def stats(self) -> bool:
        return bool(self.topk or self.alt)


@dataclasses.dataclass(frozen=True)
class DecodeModes:
    """layout: kv_cache.LAYOUTS name; out_len: most steps of the call (bucketed: the
    outputs' width; rows.steps bounds the loop at run time); slice_layers: take the layers
    out of their stacks once before the loop (see make_decode); window: (rows, cache rows)
    — decode only the first `rows` sequences of each device's cache over its first `cache
    rows` rows (the engine's live slots and lengths, bucketed), writing them back in place;
    None: the whole cache. topk (bucketed, 0: none): also return each step's top-k
    log-probs (draws.sample_tokens) for the rows with want_topk. The draw kind (greedy,
    drawn, truncated) is no mode: draws.sample_tokens picks it per call at run time."""

    layout: str
    out_len: int
    slice_layers: bool = True
    window: tuple[int, int] | None = None
    topk: int = 0


@shared
def make_prefill(cfg: QwenConfig, mesh, step_cfg: train_step.StepConfig):
    """jit(prefill)(lora, params, slot_meta, args: PrefillArgs, source, old, rec_source,
    *, modes) -> (KV [L, B, T, K, H] or None, log-probs [DP, CP, S] (or [DP, CP, S, K] for
    2-D targets) replicated or None; with modes.topk / modes.alt a dict of replicated
    [DP, CP, S, …] arrays, the keys of losses.prompt_stats).

    The packed streams through the decoder with training's CP attention
    (train_step.training_attend: gathered K/V or the ring, by step_cfg.cp_attention and
    the stream's size) and each token's adapter (active < 0: none). With a cache layout
    (modes.layout), every layer's K/V is moved into the cache in the same program
    (kv_cache.fill): row (b, t) ← flat stream row source[b, t] ([B, T] int32, sharded like
    the cache positions; −1 keeps `old`'s row, or zero when old is None). `old` is
    donated. layout None: no cache (source and old None).

    A hybrid model (Gated DeltaNet layers) runs them as training does (delta_rule.CPMix
    over the cp pieces, exact), L above counts its full-attention layers, and with a cache
    layout each piece's final recurrent state is handed out and moved into the cache's
    per-sequence rows (kv_cache.fill_recurrent): row b ← flat piece rec_source[b] ([B]
    int32 in the layout's sequence specs, −1 keeps old.rec's row).
    """
    hybrid = cfg.is_hybrid
    kernel = step_cfg.lora_impl == "cpu"  # the grouped LoRA products (Routing.kernel)

    @functools.partial(jax.jit, static_argnames=("modes",), donate_argnames=("old",))
    def prefill(
        lora,
        params,
        slot_meta,
        args: PrefillArgs,
        source,
        old,
        rec_source=None,
        *,
        modes: PrefillModes,
    ):
        lora_active = lora_lib.take_for_forward(
            lora, slot_meta.page_GK, jnp.maximum(args.active, 0), kernel
        )
        lay = None if modes.layout is None else kv_cache.LAYOUTS[modes.layout]

        def shard(lora_active, params, slot_meta, a: PrefillArgs, source, old, rec_source):
            one = lambda x: x[0, 0]  # noqa: E731  (this device's [S] row)
            route = slot_meta.routing(
                a.active, one(a.spans), s_len=a.tokens.shape[-1], kernel=kernel
            )
            lora_active, route = lora_lib.route_for_forward(lora_active, slot_meta.page_GK, route)
            run = _prefill_pass(cfg, step_cfg, a, modes.pieces, hand_out=lay is not None)
            h_SxD, kv, _ = model_lib.hidden_states(
                cfg, params, one(a.tokens), one(a.position), run, lora_active, route
            )
            kv = None if lay is None else _fill_cache(kv, lay, source, old, rec_source)
            lp = None
            if modes.with_logprobs:
                factors = model_lib.unembed_factors(params, h_SxD, lora_active, route)
                lp = _prompt_logprobs(factors, a, modes, step_cfg.logprob_chunk)
            return kv, lp

        kv_spec = None if lay is None else lay.kv_specs(hybrid)
        in_specs = (
            lora_lib.slot_specs_active(cfg, lora_active),
            model_lib.param_specs(cfg),
            SPECS.slot_G,
            PrefillArgs.specs(args.keys is not None),
            None if lay is None else lay.position_BxT,
            None if old is None else kv_spec,
            None if rec_source is None else lay.seqs_B,
        )
        out_specs = (kv_spec, _logprob_specs(modes))
        return jax.shard_map(shard, mesh=mesh, in_specs=in_specs, out_specs=out_specs)(
            lora_active, params, slot_meta, args, source, old, rec_source
        )

    return prefill


def _prefill_pass(cfg: QwenConfig, step_cfg, a: PrefillArgs, pieces: int, hand_out: bool):
    """How prefill runs the layers (model.decoder.Pass): training's CP attention
    (train_step.training_attend) writing the K/V out (kv_cache.prefill_attend); a hybrid
    model's Gated DeltaNet layers as training runs them (delta_rule.cp_mix over at most
    `pieces` pieces), handing each piece's final state out when a cache is filled."""
    segment_S, position_S = a.segment[0, 0], a.position[0, 0]
    attend = kv_cache.prefill_attend(
        train_step.training_attend(cfg, step_cfg, segment_S, position_S)
    )
    mix = (
        delta_rule_lib.cp_mix(segment_S, position_S, pieces, CP, hand_out=hand_out)
        if cfg.is_hybrid
        else None
    )
    return model_lib.decoder.Pass(attend, mix=mix)


def _fill_cache(kv, lay: kv_cache.Layout, source, old, rec_source):
    """Every layer's K/V moved into the cache (kv_cache.fill: row (b, t) ← stream row
    source[b, t], −1 keeps old's row or zero) and, for a hybrid model (kv a HybridState),
    each piece's final recurrent state into the cache's per-sequence rows
    (kv_cache.fill_recurrent: row b ← piece rec_source[b])."""
    if not isinstance(kv, model_lib.HybridState):
        return kv_cache.fill(kv, source, lay, old)
    cache = kv_cache.fill(kv.full, source, lay, old)
    return cache._replace(
        rec=kv_cache.fill_recurrent(kv.linear, rec_source, None if old is None else old.rec, lay)
    )


def _prompt_logprobs(factors, a: PrefillArgs, modes: PrefillModes, chunk: int):
    """The streams' target log-probs [DP, CP, S] (or [DP, CP, S, K]) gathered and
    replicated, zero at padding; with modes.topk / modes.alt a dict of such arrays, the
    keys of losses.prompt_stats."""
    one = lambda x: x[0, 0]  # noqa: E731  (this device's [S] row)
    real_S = one(a.segment) >= 0
    real = lambda v: real_S.reshape((-1,) + (1,) * (v.ndim - 1))  # noqa: E731  (over v's rows)
    if not modes.stats:
        lp_S = losses_lib.target_logprobs(factors, one(a.targets), chunk)
        return losses_lib.gather_stream(jnp.where(real(lp_S), lp_S, 0.0))
    stats = losses_lib.prompt_stats(
        factors,
        one(a.targets).reshape(one(a.tokens).shape[0], -1),
        chunk,
        topk=modes.topk,
        alt=modes.alt,
        temperature_S=None if a.temperature is None else one(a.temperature),
        keys_Sx2=None if a.keys is None else one(a.keys),
        position_S=one(a.position),
    )
    return {
        k: losses_lib.gather_stream(jnp.where(real(v), v, jnp.zeros((), v.dtype)))
        for k, v in stats.items()
    }


def _logprob_specs(modes: PrefillModes):
    """prefill's out_specs for its log-probs: none, one replicated array, or a dict of
    them (the keys of losses.prompt_stats asked for)."""
    if not modes.with_logprobs:
        return None
    if not modes.stats:
        return P()
    keys = ("lp",) + ("topk_ids", "topk_lp") * bool(modes.topk)
    return {k: P() for k in keys + ("alt_ids", "alt_lp") * bool(modes.alt)}


@shared
def make_decode(cfg: QwenConfig, mesh, lora_impl: str = "xla"):
    """jit(decode)(lora, params, slot_meta, cache, rows: DecodeRows, active, *, modes) ->
    (tokens [B, N] (−1 where a row drew nothing), log-probs [B, N], both replicated; the
    final cache, less the rows of the steps that ended a sequence — nothing reads those);
    with modes.topk, (tokens, log-probs, top-k ids [B, N, k], top-k log-probs [B, N, k],
    cache). lora_impl: training's (Sampler.step_cfg); "cpu" runs the grouped LoRA
    products through jcp.lora_cpu's kernels (Routing.kernel).

    decode_loop: one lax.while_loop of at most modes.out_len steps; each step runs every
    row's newest token through the decoder (decode_attend over its cache — merged over cp
    under layout "split" — LoRA routed by each row's own adapter index), draws the next
    token with the row's own parameters, writes the step's K/V rows (kv_cache.step_rows:
    from base on, by the row's own count), and stops when no row is live. A row ends at a
    stop token of its own or its own max_tokens. cache: kv_cache.Cache in the layout's
    specs, donated and returned, so the loop updates it in place. modes.slice_layers: take every layer's
    weights out of the stacked arrays once, before the loop, and run the layers unrolled
    on them (model.layer_slices), instead of a lax.scan that slices them per layer and
    step (the Sampler slices iff the per-device layer weights are at most
    SLICE_LAYERS_MAX_BYTES). A hybrid model's cache carries each row's recurrent state
    (cache.rec); its Gated DeltaNet layers take one recurrent step per row
    (delta_rule.StepMix; a row at position 0 starts from zeros) and live rows keep the new
    state.
    """
    hybrid = cfg.is_hybrid

    @functools.partial(jax.jit, static_argnames=("modes",), donate_argnames=("cache",))
    def decode(lora, params, slot_meta, cache, rows: DecodeRows, active, *, modes: DecodeModes):
        lay = kv_cache.LAYOUTS[modes.layout]
        # Gathered once, outside the loop: the A active slots, layers leading (or the
        # per-layer modules' pages read in place by the kernels: reads_in_place).
        kernel = lora_impl == "cpu"
        lora_active = lora_lib.take_for_forward(
            lora, slot_meta.page_GK, jnp.maximum(active, 0), kernel
        )

        def shard(lora_active, params, slot_meta, full, r: DecodeRows, active):
            cache = window_of(full, modes.window)
            route = slot_meta.routing(active, None, r.index, kernel=kernel)
            lora_active, route = lora_lib.route_for_forward(lora_active, slot_meta.page_GK, route)
            model = StepModel.of(cfg, params, lora_active, route, modes)

            def run(tok_B, pos_B, cache):
                attend = kv_cache.decode_attend(pos_B, cache.position, lay.row_axes)
                kv = kv_cache.KV(cache.k, cache.v)
                return model.hidden(tok_B, pos_B, attend, kv, cache.rec if hybrid else None)

            write = _CacheWrite(lay, r.base, hybrid)
            cache, outs = decode_loop(model, r, cache, modes, lay.seq_axes, run, write)
            if modes.window is not None:
                cache = jax.tree.map(
                    lambda f, c: jax.lax.dynamic_update_slice(f, c, (0,) * f.ndim), full, cache
                )
            return (*outs, cache)

        in_specs = (
            lora_lib.slot_specs_active(cfg, lora_active),
            model_lib.param_specs(cfg),
            SPECS.slot_G,
            lay.cache_specs(hybrid),
            DecodeRows.specs(lay),
            SPECS.replicated,
        )
        return jax.shard_map(
            shard,
            mesh=mesh,
            in_specs=in_specs,
            out_specs=decode_out_specs(modes, lay.cache_specs(hybrid)),
        )(lora_active, params, slot_meta, cache, rows, active)

    return decode


def window_of(cache: kv_cache.Cache, window: tuple[int, int] | None) -> kv_cache.Cache:
    """The first `rows` sequences of this device's cache over its first `cache rows` rows
    (DecodeModes.window; None: the whole cache)."""
    if window is None:
        return cache
    w_b, w_t = window
    return kv_cache.Cache(
        cache.k[:, :w_b, :w_t],
        cache.v[:, :w_b, :w_t],
        cache.position[:w_b, :w_t],
        None if cache.rec is None else jax.tree.map(lambda x: x[:, :w_b], cache.rec),
    )


@dataclasses.dataclass(frozen=True, eq=False)  # holds traced arrays: by identity
class _CacheWrite:
    """make_decode's `write` (decode_loop): the step's K/V into each live row's next cache
    row (kv_cache.step_rows from base_B on), a hybrid's new recurrent states kept for the
    live rows."""

    lay: kv_cache.Layout
    base_B: jax.Array
    hybrid: bool

    def __call__(self, cache, new, pos_B, done_B, count_B, live_B):
        t_len = cache.position.shape[1]
        # A finished sequence needs no more rows. Skipping them also makes the write depend
        # on this step's draw, hence on every layer's reads of the cache (the last layer's
        # feed nothing else): only then does XLA order the reads before the in-place write
        # instead of copying the whole cache twice per step.
        rows_B = jnp.where(done_B, t_len, kv_cache.step_rows(count_B, self.base_B, self.lay, t_len))
        if self.hybrid:
            cache = cache._replace(rec=kv_cache.keep_recurrent(cache.rec, new.linear, live_B))
            new = new.full
        return kv_cache.write_rows(cache, new, rows_B, pos_B)
