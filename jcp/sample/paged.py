"""The engine's paged KV cache: a pool of fixed-size pages per device, read through page
tables, and the three device programs over it (extend, decode, copy).

The pool is K and V [L, P, page, K, H] with P = pages over (dp, cp) (the "batch"
layout's sequence axes: every page lives on one device, and a sequence's pages all on the
device that decodes it). A sequence's page table [M] lists, in order, the device-local
pages that hold its positions: position t is row t % page of page table[t // page]
(−1: no page yet). Pages are shared read-only between sequences (the num_samples of a
prompt, prefix-cache hits); the host (admission.py, pages.py) owns the tables, free list
and the reference counts, so memory per sequence is its real length rounded up to a page.

Attention (paged_attention.py, re-exported here): in extend (`paged_attend`) a row's C
new tokens (a prompt chunk) see every cached position < the chunk's start through the
row's table, and each other causally;
decode (`paged_decode_attend`, C = 1) gathers each row's pages and runs the static
sampler's decode attention (kv_cache.decode_attend) on them — or, for attn_impl "pallas"
(`pallas_decode_attend`), one Pallas kernel reads each row's pages in place
(attention.paged). The new K/V are written after the layer stack (`write_pages`), once
per step, so the layer scan never copies the pool.

Programs (each jitted, the pool donated and updated in place):
- extend: chunks of prompts through the decoder, writing their K/V into pages — chunked
  prefill (a long prompt split over engine steps) that also starts from cached pages (a
  prefix-cache hit computes only the rest). Optionally the chunk's target log-probs.
- decode: the engine's decode loop (programs.make_decode's loop, the cache read through
  page tables).
- copy: page contents copied between pages of one device (a prompt's partial last page,
  copied for every further sample: copy on write at the fork), and state rows between
  rows of one device (a hybrid prompt's final state, likewise).

A hybrid model's pool also holds one recurrent-state row per engine sequence slot
(Pool.rec): extend continues a row's state over its chunk (ChunkMix) and writes it back,
decode takes the rows' states out before its loop and puts them back after, copy also
copies state rows (the num_samples of a prompt start from its final state).

Shapes: see jcp/mesh.py; B = rows of the call (b per device inside shard_map), C = new
tokens per row, M = table entries per row, P = pool pages (per device inside shard_map).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jcp import delta_rule
from jcp import lora as lora_lib
from jcp import losses as losses_lib
from jcp import model as model_lib
from jcp.config import QwenConfig
from jcp.mesh import SPECS
from jcp.program_cache import shared
from jcp.sample import draws, kv_cache
from jcp.sample.decode_loop import DecodeRows, StepModel, decode_loop, decode_out_specs
from jcp.sample.paged_attention import (
    layer_indices,
    paged_attend,
    paged_decode_attend,
    pallas_decode_attend,
)

POOL_SPEC = SPECS.cache_LxBxTxKxH  # [L, P, page, K, H]: pages over (dp, cp), heads over tp
ROWS_SPEC = SPECS.seqs_B  # [B]
TABLE_SPEC = SPECS.seqs_Bx2  # [B, M] / [B, C]
LAYOUT = kv_cache.LAYOUTS["batch"]  # the engine's sequences: over (dp, cp)
SEQ_AXES = LAYOUT.seq_axes
REC_SPEC = LAYOUT.rec_specs  # Recurrent [Ll, R, …]: state rows over (dp, cp)


class Programs(NamedTuple):
    """The three programs (make_extend, make_decode, make_copy), each behind a
    program_store.StoredPrograms (Runner.paged)."""

    extend: object
    decode: object
    copy: object


class Pool(NamedTuple):
    """k, v [L, P, page, K, H]: every device's pages (L: the full-attention layers); rec: a
    hybrid model's recurrent-state rows (delta_rule.Recurrent, conv [Ll, R, Kc − 1, C] and
    ssm [Ll, R, H, Dk, Dv] fp32, R rows per device: one per engine sequence slot), None
    for a model without Gated DeltaNet layers."""

    k: jax.Array
    v: jax.Array
    rec: delta_rule.Recurrent | None = None


def pool_specs(hybrid: bool) -> Pool:
    return Pool(POOL_SPEC, POOL_SPEC, REC_SPEC if hybrid else None)


class ChunkMix(NamedTuple):
    """Extend's sequence mixing of Gated DeltaNet layers: each row's C new tokens
    continue that row's recurrent state (a prompt chunk after the chunks before it).

    valid_BxC: real tokens (a row's real tokens come first); fresh_B: the row starts its
    sequence (position 0) — it starts from zeros whatever its state row holds. conv / rule
    take the B rows' incoming states and return the state after each row's last real
    token (a row without one keeps its state). The rule is delta_rule.chunked per row
    (blocks of min(C, 64) tokens), from the row's incoming state."""

    valid_BxC: jax.Array
    fresh_B: jax.Array

    def _start(self, state):
        return jnp.where(self.fresh_B.reshape((-1,) + (1,) * (state.ndim - 1)), 0.0, state)

    def conv(self, x_SxC, w_KxC, window_BxHxC):
        """(SiLU(depthwise causal conv) [B·C, Ch], each row's new window [B, Kc − 1, Ch])."""
        b, c = self.valid_BxC.shape
        kc = w_KxC.shape[0]
        x = x_SxC.astype(jnp.float32).reshape(b, c, -1)
        full = jnp.concatenate([self._start(window_BxHxC), x], axis=1)  # [B, Kc−1+C, Ch]
        w = w_KxC.astype(jnp.float32)
        out = sum(full[:, j : j + c] * w[j] for j in range(kc))
        n_B = jnp.sum(self.valid_BxC, axis=1)
        at = n_B[:, None] + jnp.arange(kc - 1)[None, :]
        window = jnp.take_along_axis(full, at[:, :, None], axis=1)
        return jax.nn.silu(out).astype(x_SxC.dtype).reshape(b * c, -1), window

    def rule(self, q_SxHkxDk, k_SxHkxDk, v_SxHxDv, g_SxH, beta_SxH, s_BxHxDkxDv):
        """(o [B·C, H, Dv] fp32, each row's state after its last real token)."""
        b, c = self.valid_BxC.shape
        rows = lambda x: x.reshape((b, c) + x.shape[1:])  # noqa: E731
        real = self.valid_BxC[:, :, None]
        g = jnp.where(real, rows(g_SxH).astype(jnp.float32), 0.0)
        beta = jnp.where(real, rows(beta_SxH).astype(jnp.float32), 0.0)
        end_B = jnp.maximum(jnp.sum(self.valid_BxC, axis=1) - 1, 0)
        chunk = min(c, delta_rule.DEFAULT_CHUNK)

        def one(q, k, v, g, beta, s0, end):
            o, s = delta_rule.chunked(
                q, k, v, g, beta, init_PxHxDkxDv=s0[None], chunk=chunk, ends_P=end[None]
            )
            return o, s[0]

        o, s = jax.vmap(one)(
            rows(q_SxHkxDk),
            rows(k_SxHkxDk),
            rows(v_SxHxDv),
            g,
            beta,
            self._start(s_BxHxDkxDv),
            end_B,
        )
        return o.reshape((b * c,) + o.shape[2:]), s


def take_rows(rec: delta_rule.Recurrent, slot_B) -> delta_rule.Recurrent:
    """The state rows slot_B [B] of rec [Ll, R, …] (out of range: row 0, unused)."""
    r = rec.conv.shape[1]
    return jax.tree.map(lambda x: jnp.take(x, jnp.clip(slot_B, 0, r - 1), axis=1), rec)


def put_rows(rec: delta_rule.Recurrent, new: delta_rule.Recurrent, slot_B) -> delta_rule.Recurrent:
    """rec with rows slot_B ← new [Ll, B, …] (slots ≥ R dropped: padding rows)."""
    return jax.tree.map(lambda x, n: x.at[:, slot_B].set(n.astype(x.dtype), mode="drop"), rec, new)


def write_pages(pool: Pool, new: kv_cache.KV, page_N, row_N) -> Pool:
    """pool with new [L, N, K, H] token n written to row row_N[n] of page page_N[n]
    (pages ≥ P are dropped: padding, finished rows)."""
    k, v = (
        x.at[:, page_N, row_N].set(n.astype(x.dtype), mode="drop")
        for x, n in zip((pool.k, pool.v), (new.k, new.v))
    )
    return pool._replace(k=k, v=v)


@dataclasses.dataclass(frozen=True)
class ExtendModes:
    """slice_layers: as programs.DecodeModes. Whether a call computes log-probs is no mode
    (ExtendRows.want_lp, at run time)."""

    slice_layers: bool = True


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ExtendRows:
    """tokens, targets int32 [B, C] (targets: the next prompt token, for log-probs);
    valid bool [B, C]; start int32 [B]: position of tokens[:, 0]; index int32 [B]: the
    row's adapter as an index into active; table int32 [B, M]; slot int32 [B]: the row's
    device-local recurrent-state row (a hybrid model; ≥ R: none); want_lp bool [B]: the
    row's request asked for prompt log-probs."""

    tokens: jax.Array
    targets: jax.Array
    valid: jax.Array
    start: jax.Array
    index: jax.Array
    table: jax.Array
    slot: jax.Array
    want_lp: jax.Array

    @staticmethod
    def specs() -> ExtendRows:
        return ExtendRows(
            TABLE_SPEC,
            TABLE_SPEC,
            TABLE_SPEC,
            ROWS_SPEC,
            ROWS_SPEC,
            TABLE_SPEC,
            ROWS_SPEC,
            ROWS_SPEC,
        )


def token_pages(table_BxM, position_BxC, valid_BxC, n_pages: int, page: int):
    """(page, row) int32 [B·C] where each new token's K/V goes (page n_pages: nowhere)."""
    at = jnp.take_along_axis(
        table_BxM, jnp.clip(position_BxC // page, 0, table_BxM.shape[1] - 1), axis=1
    )
    ok = valid_BxC & (at >= 0)
    return (jnp.where(ok, at, n_pages).reshape(-1), (position_BxC % page).reshape(-1))


@shared
def make_extend(cfg: QwenConfig, mesh, logprob_chunk: int, lora_impl: str = "xla"):
    """jit(extend)(lora, params, slot_meta, pool, rows: ExtendRows, active, *, modes) ->
    (pool, log-probs [B, C] replicated). pool is donated. The log-probs (each new token's
    target log-prob) are computed only when some row wants them (rows.want_lp, decided at
    run time: one program with and without); zeros otherwise.

    A hybrid model's Gated DeltaNet layers continue each row's state row (rows.slot) over
    its chunk (ChunkMix; a row at position 0 starts from zeros) and write the state after
    its last real token back to that row. lora_impl: training's (Sampler.step_cfg); "cpu"
    runs the grouped LoRA products through jcp.lora_cpu's kernels (Routing.kernel)."""
    hybrid = cfg.is_hybrid

    @functools.partial(jax.jit, static_argnames=("modes",), donate_argnames=("pool",))
    def extend(lora, params, slot_meta, pool, rows: ExtendRows, active, *, modes: ExtendModes):
        kernel = lora_impl == "cpu"
        lora_active = lora_lib.take_for_forward(
            lora, slot_meta.page_GK, jnp.maximum(active, 0), kernel
        )

        def shard(lora_active, params, slot_meta, pool, r: ExtendRows, active):
            b, c = r.tokens.shape
            position = r.start[:, None] + jnp.arange(c)[None, :]
            route = slot_meta.routing(active, None, jnp.repeat(r.index, c), kernel=kernel)
            lora_active, route = lora_lib.route_for_forward(lora_active, slot_meta.page_GK, route)
            attend = paged_attend(r.table, r.start, r.valid)
            layers = (
                model_lib.layer_slices(cfg, params, lora_active) if modes.slice_layers else None
            )
            state, mix = kv_cache.KV(pool.k, pool.v), None
            if hybrid:
                state = model_lib.HybridState(state, take_rows(pool.rec, r.slot))
                mix = ChunkMix(r.valid, r.start == 0)
            run = model_lib.decoder.Pass(attend, mix=mix, layers=layers)
            h, new, _ = model_lib.hidden_states(
                cfg,
                params,
                r.tokens.reshape(-1),
                position.reshape(-1),
                run,
                lora_active,
                route,
                attn_state=state,
            )
            if hybrid:
                pool = pool._replace(rec=put_rows(pool.rec, new.linear, r.slot))
                new = new.full
            page_N, row_N = token_pages(
                r.table, position, r.valid, pool.k.shape[1], pool.k.shape[2]
            )
            pool = write_pages(pool, new, page_N, row_N)

            def logprobs():
                factors = model_lib.unembed_factors(params, h, lora_active, route)
                lp = losses_lib.target_logprobs(
                    factors, r.targets.reshape(-1), logprob_chunk
                ).reshape(b, c)
                return draws.gather_batch(jnp.where(r.valid, lp, 0.0), SEQ_AXES)

            # The same on every device (its collectives run on all or none).
            want = jax.lax.psum(jnp.any(r.want_lp).astype(jnp.int32), SEQ_AXES) > 0
            groups = jax.lax.axis_size(SEQ_AXES)
            lp = jax.lax.cond(want, logprobs, lambda: jnp.zeros((groups * b, c), jnp.float32))
            return pool, lp

        pool_spec = pool_specs(hybrid)
        in_specs = (
            lora_lib.slot_specs_active(cfg, lora_active),
            model_lib.param_specs(cfg),
            SPECS.slot_G,
            pool_spec,
            ExtendRows.specs(),
            SPECS.replicated,
        )
        out_specs = (pool_spec, P())
        return jax.shard_map(shard, mesh=mesh, in_specs=in_specs, out_specs=out_specs)(
            lora_active, params, slot_meta, pool, rows, active
        )

    return extend


@shared
def make_copy(mesh):
    """jit(copy)(pool, src, dst, rec_src, rec_dst) -> pool with page dst[i] ← page src[i]
    and, for a hybrid model's pool, state row rec_dst[i] ← row rec_src[i] on each device
    (int32 [G·N] device-local pages / rows over (dp, cp); dst ≥ P, rec_dst ≥ R: nothing)."""

    @functools.partial(jax.jit, donate_argnames=("pool",))
    def copy(pool, src, dst, rec_src, rec_dst):
        def shard(pool, src, dst, rec_src, rec_dst):
            k, v = (
                x.at[:, dst].set(jnp.take(x, jnp.maximum(src, 0), axis=1), mode="drop")
                for x in (pool.k, pool.v)
            )
            rec = (
                None
                if pool.rec is None
                else put_rows(pool.rec, take_rows(pool.rec, rec_src), rec_dst)
            )
            return Pool(k, v, rec)

        spec = pool_specs(pool.rec is not None)
        return jax.shard_map(
            shard,
            mesh=mesh,
            in_specs=(spec, ROWS_SPEC, ROWS_SPEC, ROWS_SPEC, ROWS_SPEC),
            out_specs=spec,
        )(pool, src, dst, rec_src, rec_dst)

    return copy


_INT_FIELDS = (
    "token",
    "position",
    "base",
    "done",
    "count",
    "index",
    "max_tokens",
    "top_k",
    "want_topk",
    "steps",
)


def pack_rows(
    rows: DecodeRows, table_BxM: np.ndarray, slot_B: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Host DecodeRows, page table and state rows (slot_B: a hybrid model's recurrent-state
    row per row; None: none) as two arrays, so a decode call moves 2 host arrays to the
    devices instead of 14 (each transfer costs ~ms of host time on CPU): int32
    [B, 10 + 2 + NS + 1 + M] (the int fields, done and want_topk as 0/1, keys' bits, stop
    table, state row, page table) and float32 [B, 2] (temperature, top_p). unpack_rows inverts it
    inside the program."""
    slot_B = np.zeros(len(rows.token), np.int32) if slot_B is None else slot_B
    ints = np.concatenate(
        [
            np.stack([np.asarray(getattr(rows, f)).astype(np.int32) for f in _INT_FIELDS], 1),
            np.ascontiguousarray(rows.keys, np.uint32).view(np.int32),
            rows.stop,
            np.asarray(slot_B, np.int32)[:, None],
            table_BxM,
        ],
        axis=1,
    ).astype(np.int32)
    floats = np.stack([rows.temperature, rows.top_p], 1).astype(np.float32)
    return ints, floats


def unpack_rows(ints, floats, stop_width: int) -> tuple[DecodeRows, jax.Array, jax.Array]:
    """(DecodeRows, table [B, M], state rows [B]) from pack_rows' arrays (traced)."""
    f = {name: ints[:, i] for i, name in enumerate(_INT_FIELDS)}
    f["done"], f["want_topk"] = f["done"] != 0, f["want_topk"] != 0
    n = len(_INT_FIELDS)
    keys = jax.lax.bitcast_convert_type(ints[:, n : n + 2], jnp.uint32)
    stop = ints[:, n + 2 : n + 2 + stop_width]
    slot = ints[:, n + 2 + stop_width]
    return (
        DecodeRows(keys=keys, stop=stop, temperature=floats[:, 0], top_p=floats[:, 1], **f),
        ints[:, n + 3 + stop_width :],
        slot,
    )


# Decode phases by table width (make_decode): the loop attends over the first ⌈M/2⌉ table
# entries while every live row fits in them, then over all M. Each phase is one more copy
# of the loop body to compile (measured, tiny model: 3 phases took a warm-up's compile
# from 18.0 to 27.3 CPU s; 2 phases keep most of the gain, since the first quarter of the
# table serves only a row's first steps).
DECODE_PHASES = 2


def phase_widths(m: int, phases: int) -> list[int]:
    """The table widths of a decode call's phases, ascending, the last m: m, ⌈m/2⌉, ⌈m/4⌉,
    … (at most `phases`, distinct)."""
    widths = [m]
    while len(widths) < phases and widths[-1] > 1:
        widths.append(-(-widths[-1] // 2))
    return sorted(set(widths))


def phase_starts(m: int, page: int, phases: int = DECODE_PHASES) -> list[int]:
    """The first position of each decode-loop phase of a table m pages wide: 0, then the
    bound of each narrower phase (make_decode's limits), where the next takes over."""
    return [0] + [w * page for w in phase_widths(m, phases)[:-1]]


@dataclasses.dataclass(frozen=True)
class PagedDecodeModes:
    """out_len: most steps of a call (the outputs' width; the call's rows.steps bound the
    loop at run time); slice_layers / topk: as programs.DecodeModes; stop_width: the stop
    tables' width; phases: most table-width phases of the decode loop (phase_widths; 1:
    every step attends over the whole table)."""

    out_len: int
    slice_layers: bool = True
    topk: int = 0
    stop_width: int = 8
    phases: int = DECODE_PHASES


@shared
def make_decode(cfg: QwenConfig, mesh, attn_impl: str = "blockwise", lora_impl: str = "xla"):
    """jit(decode)(lora, params, slot_meta, pool, ints, floats, active, *, modes) ->
    (tokens [B, N] (−1: nothing drawn), log-probs [B, N], both replicated[, top-k ids
    [B, N, k], top-k log-probs [B, N, k] with modes.topk]; pool).

    programs.decode_loop (every row's newest token through the decoder, drawn with
    its own parameters, ended by its own stop set or max_tokens), reading each row's cache
    through its page table [B, M] and writing each step's K/V to page
    table[position // page]. ints, floats: pack_rows of the DecodeRows and the page tables
    [B, M] (stop tables modes.stop_width wide); rows.base is unused. The pool is donated.
    A hybrid model's rows take their recurrent states from the pool's state rows (the
    packed slot column) before the loop, one recurrent step per row and step
    (delta_rule.StepMix; a row at position 0 starts from zeros), and put them back after.
    attn_impl: training's (Sampler.step_cfg.attn_impl); "pallas" reads the pages in place
    (pallas_decode_attend), any other the gathered XLA path (paged_decode_attend).
    lora_impl: training's too; "cpu" runs the grouped LoRA products through jcp.lora_cpu's
    kernels (Routing.kernel), as make_extend's.
    """
    hybrid = cfg.is_hybrid
    in_place = attn_impl == "pallas"

    @functools.partial(jax.jit, static_argnames=("modes",), donate_argnames=("pool",))
    def decode(lora, params, slot_meta, pool, ints, floats, active, *, modes: PagedDecodeModes):
        kernel = lora_impl == "cpu"
        lora_active = lora_lib.take_for_forward(
            lora, slot_meta.page_GK, jnp.maximum(active, 0), kernel
        )
        rows, table, slot = unpack_rows(ints, floats, modes.stop_width)

        def shard(lora_active, params, slot_meta, pool, table, slot, r: DecodeRows, active):
            route = slot_meta.routing(active, None, r.index, kernel=kernel)
            lora_active, route = lora_lib.route_for_forward(lora_active, slot_meta.page_GK, route)
            model = StepModel.of(cfg, params, lora_active, route, modes)
            page = pool.k.shape[2]
            # A hybrid's loop carries its rows' states [Ll, B, …], not the state rows.
            store = pool._replace(rec=take_rows(pool.rec, slot)) if hybrid else pool
            widths = phase_widths(table.shape[1], modes.phases)
            phases = [
                (
                    w * page if w < table.shape[1] else None,
                    _PagedStep(model, table[:, :w], in_place),
                )
                for w in widths
            ]
            write = _PoolWrite(table, hybrid)
            store, outs = decode_loop(model, r, store, modes, SEQ_AXES, phases, write)
            if hybrid:  # padding rows' slots are out of range: dropped
                store = store._replace(rec=put_rows(pool.rec, store.rec, slot))
            return (*outs, store)

        pool_spec = pool_specs(hybrid)
        in_specs = (
            lora_lib.slot_specs_active(cfg, lora_active),
            model_lib.param_specs(cfg),
            SPECS.slot_G,
            pool_spec,
            TABLE_SPEC,
            ROWS_SPEC,
            DecodeRows.specs(LAYOUT),
            SPECS.replicated,
        )
        return jax.shard_map(
            shard, mesh=mesh, in_specs=in_specs, out_specs=decode_out_specs(modes, pool_spec)
        )(lora_active, params, slot_meta, pool, table, slot, rows, active)

    return decode


@dataclasses.dataclass(frozen=True, eq=False)  # holds traced arrays: by identity
class _PagedStep:
    """make_decode's `run` for one phase (decode_loop): every row's newest token through
    the decoder, attending through the first table_BxW entries of its page table — in
    place (pallas_decode_attend) or over gathered pages (paged_decode_attend)."""

    model: StepModel
    table_BxW: jax.Array
    in_place: bool

    def __call__(self, tok_B, pos_B, store: Pool):
        if self.in_place:
            attend = pallas_decode_attend(self.table_BxW, pos_B, store.k, store.v)
            k = v = layer_indices(store.k)
        else:
            attend = paged_decode_attend(self.table_BxW, pos_B, store.k.shape[2])
            k, v = store.k, store.v
        return self.model.hidden(tok_B, pos_B, attend, kv_cache.KV(k, v), store.rec)


@dataclasses.dataclass(frozen=True, eq=False)  # holds traced arrays: by identity
class _PoolWrite:
    """make_decode's `write` (decode_loop): the step's K/V to page table[position // page]
    of each row not done, a hybrid's new recurrent states kept for the live rows."""

    table_BxM: jax.Array
    hybrid: bool

    def __call__(self, store: Pool, new, pos_B, done_B, count_B, live_B):
        # As in programs.make_decode: skipping the rows of finished sequences makes the
        # write depend on the draw, so XLA orders the reads before it (no copy).
        if self.hybrid:
            store = store._replace(rec=kv_cache.keep_recurrent(store.rec, new.linear, live_B))
            new = new.full
        n_pages, page = store.k.shape[1], store.k.shape[2]
        page_B, row_B = token_pages(self.table_BxM, pos_B[:, None], ~done_B[:, None], n_pages, page)
        return write_pages(store, new, page_B, row_B)
