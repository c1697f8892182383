"""The decode loop both decoders run inside their shard_map: the static sampler's
(programs.make_decode, over a cache of slot rows) and the engine's (paged.make_decode,
over pages).

Owns the rows a decode call starts from (DecodeRows, with their shard_map specs), the
model every step runs (StepModel: weights, active adapters and their routing, the layer
slices taken once before the loop) and the loop itself (decode_loop: draw, record, end
rows, write the step's K/V through the caller's `write`), in named steps. The caller
passes in how a step reads its store (`run`) and writes it (`write`); it must never
know whether the store is a cache or a page pool, and never change adapter state.

Shapes: see the legend in jcp/mesh.py; B = rows of the decode batch (on this device
inside shard_map), N = out tokens per row (bucketed), NS = stop-table width.
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
from jcp import model as model_lib
from jcp.config import QwenConfig
from jcp.mesh import vary
from jcp.sample import draws, kv_cache


@jax.tree_util.register_dataclass
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


def decode_out_specs(modes, store_spec) -> tuple:
    """A decode program's out_specs: tokens and log-probs (and the top-k pair with
    modes.topk) replicated, then the store (cache or pool) in its own specs."""
    return (P(), P()) + (P(), P()) * bool(modes.topk) + (store_spec,)


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
