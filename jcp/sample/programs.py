"""The compiled sampling programs: prefill and decode.

Owns the two jitted device programs and their arguments. Arguments are registered
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
import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jcp import delta_rule as delta_rule_lib
from jcp import logprobs as logprobs_lib
from jcp import lora as lora_lib
from jcp import losses as losses_lib
from jcp import model as model_lib
from jcp import train_step
from jcp.config import QwenConfig
from jcp.mesh import CP, SPECS, vary
from jcp.sample import draws, kv_cache

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


@_register
@dataclasses.dataclass(frozen=True)
class DecodeRows:
    """Per-row state and parameters of a decode batch (global arrays, [B] unless noted).

    token: the newest token (not yet in the cache); position: its position; base: the
    first decode row of the sequence's cache; done: the row decodes nothing; count:
    tokens the sequence has drawn so far (seeds its draws; its rows go to base + count);
    index: the row's adapter as an index into the call's active [A]; max_tokens,
    temperature, top_k (≤ 0: all), top_p: the sequence's SamplingParams; want_topk: the
    row wants its steps' top-k log-probs (DecodeModes.topk wide); steps: the call's most
    decode steps (the same in every row, ≤ DecodeModes.out_len: a run-time bound, so calls
    of different lengths share one program); keys [B, 2]: raw threefry keys; stop [B, NS]:
    stop token ids, −1 padded.
    """

    token: jax.Array
    position: jax.Array
    base: jax.Array
    done: jax.Array
    count: jax.Array
    index: jax.Array
    max_tokens: jax.Array
    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    want_topk: jax.Array
    steps: jax.Array
    keys: jax.Array
    stop: jax.Array

    @staticmethod
    def specs(layout: kv_cache.Layout) -> DecodeRows:
        b, b2 = layout.seqs_B, layout.seqs_Bx2
        return DecodeRows(b, b, b, b, b, b, b, b, b, b, b, b, b2, b2)


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
        lora_active = lora_lib.take_active(lora, slot_meta.page_GK, jnp.maximum(args.active, 0))
        lay = None if modes.layout is None else kv_cache.LAYOUTS[modes.layout]

        def shard(lora_active, params, slot_meta, a: PrefillArgs, source, old, rec_source):
            one = lambda x: x[0, 0]  # noqa: E731  (this device's [S] row)
            route = slot_meta.routing(a.active, one(a.spans), s_len=a.tokens.shape[-1])
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


def make_decode(cfg: QwenConfig, mesh):
    """jit(decode)(lora, params, slot_meta, cache, rows: DecodeRows, active, *, modes) ->
    (tokens [B, N] (−1 where a row drew nothing), log-probs [B, N], both replicated; the
    final cache, less the rows of the steps that ended a sequence — nothing reads those);
    with modes.topk, (tokens, log-probs, top-k ids [B, N, k], top-k log-probs [B, N, k],
    cache).

    decode_loop: one lax.while_loop of at most modes.out_len steps; each step runs every
    row's newest token through the decoder (decode_attend over its cache — merged over cp
    under layout "split" — LoRA routed by each row's own adapter index), draws the next
    token with the row's own parameters, writes the step's K/V rows (kv_cache.step_rows:
    from base on, by the row's own count), and stops when no row is live. A row ends at a
    stop token of its own or its own max_tokens. cache: kv_cache.Cache in the layout's specs, donated
    and returned, so the loop updates it in place. modes.slice_layers: take every layer's
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
        # Gathered once, outside the loop: the A active slots, layers leading.
        lora_active = lora_lib.take_active(lora, slot_meta.page_GK, jnp.maximum(active, 0))

        def shard(lora_active, params, slot_meta, full, r: DecodeRows, active):
            cache = window_of(full, modes.window)
            model = StepModel.of(
                cfg, params, lora_active, slot_meta.routing(active, None, r.index), modes
            )

            def run(tok_B, pos_B, cache):
                attend = kv_cache.decode_attend(pos_B, cache.position, lay.row_axes)
                kv = kv_cache.KV(cache.k, cache.v)
                return model.hidden(tok_B, pos_B, attend, kv, cache.rec if hybrid else None)

            write = functools.partial(_write_cache_step, lay, r.base, hybrid)
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


def decode_out_specs(modes, store_spec) -> tuple:
    """A decode program's out_specs: tokens and log-probs (and the top-k pair with
    modes.topk) replicated, then the store (cache or pool) in its own specs."""
    return (P(), P()) + (P(), P()) * bool(modes.topk) + (store_spec,)


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


def _write_cache_step(lay, base_B, hybrid: bool, cache, new, pos_B, done_B, count_B, live_B):
    """make_decode's `write` (decode_loop): the step's K/V into each live row's next cache
    row (kv_cache.step_rows from base_B on), a hybrid's new recurrent states kept for the
    live rows."""
    t_len = cache.position.shape[1]
    # A finished sequence needs no more rows. Skipping them also makes the write depend on
    # this step's draw, hence on every layer's reads of the cache (the last layer's feed
    # nothing else): only then does XLA order the reads before the in-place write instead
    # of copying the whole cache twice per step.
    rows_B = jnp.where(done_B, t_len, kv_cache.step_rows(count_B, base_B, lay, t_len))
    if hybrid:
        cache = cache._replace(rec=kv_cache.keep_recurrent(cache.rec, new.linear, live_B))
        new = new.full
    return kv_cache.write_rows(cache, new, rows_B, pos_B)


@dataclasses.dataclass(frozen=True, eq=False)  # holds traced arrays: by identity
class StepModel:
    """The model every step of one shard's decode loop runs, taken once before the loop:
    the base weights (params), the active adapters (lora_active, each row routed to its
    own by `route`) and, with modes.slice_layers, every layer's weights out of their
    stacks (model.layer_slices; None: the layers scanned)."""

    cfg: QwenConfig
    params: Any
    lora_active: Any
    route: lora_lib.Routing
    layers: tuple | None = None

    @staticmethod
    def of(cfg: QwenConfig, params, lora_active, route, modes) -> StepModel:
        # Each step gathers, per module, the factors of its rows' adapters once per tile
        # (lora.Tiles, planned once per call in route): no [A, …] copy of the factors.
        layers = model_lib.layer_slices(cfg, params, lora_active) if modes.slice_layers else None
        return StepModel(cfg, params, lora_active, route, layers)

    def hidden(self, tok_B, pos_B, attend, kv: kv_cache.KV, rec=None):
        """One decode step's hidden states and new per-layer state for B rows at positions
        pos_B: attention through `attend` over the K/V `kv`; `rec` the hybrid's recurrent
        states (a delta-rule step per row, from zeros where pos_B == 0), None for a dense
        model. Returns (h [B, D], new states)."""
        state, mix = kv, None
        if rec is not None:
            state = model_lib.HybridState(state, rec)
            mix = delta_rule_lib.StepMix(pos_B == 0)
        run = model_lib.decoder.Pass(attend, mix=mix, layers=self.layers)
        h_BxD, new, _ = model_lib.hidden_states(
            self.cfg, self.params, tok_B, pos_B, run, self.lora_active, self.route, attn_state=state
        )
        return h_BxD, new

    def logits(self, h_BxD) -> logprobs_lib.Unembedding:
        """The step's unembedding factors (model.unembed_factors), vocab split over tp."""
        return model_lib.unembed_factors(self.params, h_BxD, self.lora_active, self.route)


def decode_hidden(*args):
    """Deprecated: StepModel(cfg, params, lora_active, route, layers).hidden(tok_B, pos_B,
    attend, KV(k, v), rec). Takes the old positional form (cfg, params, tok_B, pos_B,
    attend, k, v, rec, lora_active, route, layers)."""
    warnings.warn(
        "programs.decode_hidden is deprecated: use StepModel(…).hidden", DeprecationWarning, 2
    )
    cfg, params, tok_B, pos_B, attend, k, v, rec, lora_active, route, layers = args
    model = StepModel(cfg, params, lora_active, route, layers)
    return model.hidden(tok_B, pos_B, attend, kv_cache.KV(k, v), rec)


class LoopCarry(NamedTuple):
    """decode_loop's carry: i the step; each row's newest token, its position, whether it
    is done, its drawn count; the store (cache or pool); the outputs filled so far
    (tokens [B, N], log-probs [B, N], the top-k pair [B, N, k] or ())."""

    i: jax.Array
    tok_B: jax.Array
    pos_B: jax.Array
    done_B: jax.Array
    count_B: jax.Array
    store: Any
    out_tok: jax.Array
    out_lp: jax.Array
    out_tk: tuple


def decode_loop(model: StepModel, r: DecodeRows, store, modes, seq_axes, run, write):
    """The decode loop both decoders run inside their shard_map (this module's make_decode
    over slot rows, paged.make_decode over pages) -> (store, (tokens [B, N], log-probs
    [B, N][, top-k ids [B, N, k], top-k log-probs [B, N, k]]) gathered over seq_axes).

    One lax.while_loop of at most modes.out_len steps: run(tok_B, pos_B, store) -> (h [B,
    D], the step's new K/V) puts every row's newest token through the decoder (`model`)
    over the store (run may instead be phases [(limit, run_i), …]: one loop each, in order,
    the loop of phase i running while no live row on any device is at a position > limit
    (None: no bound) — e.g. attention over the first pages only while every row fits in
    them; all devices leave a phase at the same step, since they agree through the loop
    test's psum); the next token is drawn with the row's own parameters (r) and recorded;
    write(store, new, pos_B, done_B, count_B, live_B) -> store keeps the step's K/V (done_B
    already holds the rows this step ended); the loop stops when no row is live. A row ends
    at a stop token of its own or its own max_tokens, and the loop after r.steps steps
    (≤ modes.out_len, the outputs' width; a run-time bound). modes: out_len, topk.
    """
    phases = run if isinstance(run, (list, tuple)) else [(None, run)]
    # Every row holds the call's bound; min keeps the loop within the outputs' width.
    limit_steps = jnp.minimum(r.steps[0], modes.out_len)
    carry = LoopCarry(
        jnp.int32(0), r.token, r.position, r.done, r.count, store,
        *_empty_outputs(r.token.shape[0], modes, seq_axes),
    )  # fmt: skip
    for limit, run_i in phases:
        step = functools.partial(_decode_step, model, r, modes, run_i, write)
        go_on = functools.partial(_go_on, limit, limit_steps, seq_axes)
        carry = jax.lax.while_loop(go_on, step, carry)
    return carry.store, _gathered_outputs(carry, r, modes, seq_axes)


def _empty_outputs(b: int, modes, seq_axes) -> tuple:
    """The loop's outputs before any step: tokens −1 [B, N], log-probs 0 [B, N] and, with
    modes.topk, the top-k ids −1 and log-probs 0 [B, N, k] (else ())."""
    out_tok = vary(jnp.full((b, modes.out_len), -1, jnp.int32), seq_axes)
    out_lp = vary(jnp.zeros((b, modes.out_len), jnp.float32), seq_axes)
    out_tk = ()
    if modes.topk:
        k = modes.topk
        out_tk = (
            vary(jnp.full((b, modes.out_len, k), -1, jnp.int32), seq_axes),
            vary(jnp.zeros((b, modes.out_len, k), jnp.float32), seq_axes),
        )
    return out_tok, out_lp, out_tk


def _decode_step(model: StepModel, r: DecodeRows, modes, run, write, c: LoopCarry) -> LoopCarry:
    """One step of decode_loop: every row's newest token through the decoder, the next
    token drawn and recorded for the live rows, the rows this step ends marked done, the
    step's K/V written."""
    h_BxD, new = run(c.tok_B, c.pos_B, c.store)
    nxt_B, lp_B, *tk = draws.sample_rows_over_tp(
        model.logits(h_BxD).logits(),
        r.keys,
        c.count_B,
        r.temperature,
        r.top_k,
        r.top_p,
        topk=modes.topk,
        want_B=r.want_topk & ~c.done_B,
    )
    live_B = ~c.done_B
    out_tok = c.out_tok.at[:, c.i].set(jnp.where(live_B, nxt_B, -1))
    out_lp = c.out_lp.at[:, c.i].set(jnp.where(live_B, lp_B, 0.0))
    out_tk = c.out_tk
    if tk:
        out_tk = (out_tk[0].at[:, c.i].set(tk[0]), out_tk[1].at[:, c.i].set(tk[1]))
    done_B = c.done_B | jnp.any(nxt_B[:, None] == r.stop, axis=1) | (c.count_B + 1 >= r.max_tokens)
    store = write(c.store, new, c.pos_B, done_B, c.count_B, live_B)
    count_B = c.count_B + live_B.astype(jnp.int32)
    return LoopCarry(c.i + 1, nxt_B, c.pos_B + 1, done_B, count_B, store, out_tok, out_lp, out_tk)


def _go_on(limit, limit_steps, seq_axes, c: LoopCarry):
    """decode_loop's test, the same on every device: steps left, some row live anywhere
    and, in a phase with a position limit, no live row anywhere beyond it."""
    live_B = ~c.done_B
    counts = [jnp.sum(live_B, dtype=jnp.int32)]
    if limit is not None:  # live rows this phase's run cannot attend for
        counts.append(jnp.sum(live_B & (c.pos_B > limit), dtype=jnp.int32))
    counts = jax.lax.psum(jnp.stack(counts), seq_axes)
    ok = (c.i < limit_steps) & (counts[0] > 0)
    return ok & (counts[1] == 0) if limit is not None else ok


def _gathered_outputs(c: LoopCarry, r: DecodeRows, modes, seq_axes) -> tuple:
    """The loop's outputs gathered over seq_axes: (tokens, log-probs[, top-k ids, top-k
    log-probs]); the top-k pair gathered only when a row anywhere wants it (zeros else)."""
    outs = tuple(draws.gather_batch(x, seq_axes) for x in (c.out_tok, c.out_lp))
    if modes.topk:  # gathered only when a row anywhere wants them (the same on every device)
        want = jax.lax.psum(jnp.any(r.want_topk & ~r.done).astype(jnp.int32), seq_axes) > 0
        groups = jax.lax.axis_size(seq_axes)
        b = c.out_tok.shape[0]
        outs += jax.lax.cond(
            want,
            lambda: tuple(draws.gather_batch(x, seq_axes) for x in c.out_tk),
            lambda: tuple(jnp.zeros((groups * b,) + x.shape[1:], x.dtype) for x in c.out_tk),
        )
    return outs
