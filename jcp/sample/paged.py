"""The engine's paged KV cache: a pool of fixed-size pages per device, read through page
tables, and the three device programs over it (extend, decode, copy).

The pool is K and V [L, P, page, K, H] with P = pages over (dp, cp) (the "batch"
layout's sequence axes: every page lives on one device, and a sequence's pages all on the
device that decodes it). A sequence's page table [M] lists, in order, the device-local
pages that hold its positions: position t is row t % page of page table[t // page]
(−1: no page yet). Pages are shared read-only between sequences (the num_samples of a
prompt, prefix-cache hits); the host (engine.py, PagePool) owns the tables, the free list
and the reference counts, so memory per sequence is its real length rounded up to a page.

One attention (`paged_attend`) serves both programs: a row's C new tokens (C = 1 in
decode, a prompt chunk in extend) see every cached position < the chunk's start through
the row's table, and each other causally; the new K/V are written after the layer stack
(`write_pages`), once per step, so the layer scan never copies the pool.

Programs (each jitted, the pool donated and updated in place):
- extend: chunks of prompts through the decoder, writing their K/V into pages — chunked
  prefill (a long prompt split over engine steps) that also starts from cached pages (a
  prefix-cache hit computes only the rest). Optionally the chunk's target log-probs.
- decode: the engine's decode loop (programs.make_decode's loop, the cache read through
  page tables).
- copy: page contents copied between pages of one device (a prompt's partial last page,
  copied for every further sample: copy on write at the fork).

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

from jcp import lora as lora_lib
from jcp import losses as losses_lib
from jcp import model as model_lib
from jcp.config import QwenConfig
from jcp.mesh import SPECS
from jcp.sample import draws
from jcp.sample import kv_cache
from jcp.sample.programs import DecodeRows, decode_loop

POOL_SPEC = SPECS.cache_LxBxTxKxH   # [L, P, page, K, H]: pages over (dp, cp), heads over tp
ROWS_SPEC = SPECS.seqs_B            # [B]
TABLE_SPEC = SPECS.seqs_Bx2         # [B, M] / [B, C]
LAYOUT = kv_cache.LAYOUTS["batch"]   # the engine's sequences: over (dp, cp)
SEQ_AXES = LAYOUT.seq_axes


class Programs(NamedTuple):
    """The three jitted programs (make_extend, make_decode, make_copy)."""

    extend: object
    decode: object
    copy: object


class Pool(NamedTuple):
    """k, v [L, P, page, K, H]: every device's pages."""

    k: jax.Array
    v: jax.Array


def paged_attend(table_BxM, start_B, valid_BxC):
    """Attention of each row's C new tokens over its cached positions and each other.

    table_BxM: device-local page of each table entry (−1 none); start_B: the position of
    the row's first new token (cached positions are 0 … start − 1); valid_BxC: which new
    tokens are real (padding neither sees nor is seen). Query c sees cached positions
    < start and new tokens c' ≤ c. state: this layer's KV(k [P, page, K, H], v); q, k,
    v: [B·C, ·, H] (row-major). Returns (out [B·C, Q, H], KV(k, v) of the new tokens).
    """
    b, m = table_BxM.shape
    c = valid_BxC.shape[1]

    def attend(q_NxQxH, k_NxKxH, v_NxKxH, state: kv_cache.KV):
        q_heads, head_dim = q_NxQxH.shape[1:]
        kv_heads = k_NxKxH.shape[1]
        per_kv = q_heads // kv_heads
        page = state.k.shape[1]
        q = q_NxQxH.reshape(b, c, kv_heads, per_kv, head_dim)
        k_new = k_NxKxH.reshape(b, c, kv_heads, head_dim)
        v_new = v_NxKxH.reshape(b, c, kv_heads, head_dim)
        take = jnp.maximum(table_BxM, 0)
        k_old, v_old = (jnp.take(x, take, axis=0).reshape(b, m * page, kv_heads, head_dim)
                        for x in (state.k, state.v))
        t = jnp.arange(m * page)
        seen_BxT = (t[None] < start_B[:, None]) & jnp.repeat(table_BxM >= 0, page, axis=1)
        causal = jnp.arange(c)[:, None] >= jnp.arange(c)[None, :]
        seen_BxCxC = causal[None] & valid_BxC[:, None, :]
        scale = 1.0 / np.sqrt(head_dim)
        s_old = jnp.einsum("bckmh,btkh->bkmct", q, k_old,
                           preferred_element_type=jnp.float32) * scale
        s_new = jnp.einsum("bckmh,bdkh->bkmcd", q, k_new,
                           preferred_element_type=jnp.float32) * scale
        s = jnp.concatenate([jnp.where(seen_BxT[:, None, None, None], s_old, -jnp.inf),
                             jnp.where(seen_BxCxC[:, None, None], s_new, -jnp.inf)], -1)
        top = jnp.max(s, -1, keepdims=True)
        p = jnp.exp(s - jnp.where(jnp.isfinite(top), top, 0.0))
        total = jnp.sum(p, -1)
        vals = jnp.concatenate([v_old, v_new], 1).astype(jnp.float32)
        out = jnp.einsum("bkmct,btkh->bckmh", p, vals)
        out = out / jnp.where(total == 0, 1.0, total).transpose(0, 3, 1, 2)[..., None]
        return (out.reshape(b * c, q_heads, head_dim).astype(q_NxQxH.dtype),
                kv_cache.KV(k_NxKxH, v_NxKxH))

    return attend


def write_pages(pool: Pool, new: kv_cache.KV, page_N, row_N) -> Pool:
    """pool with new [L, N, K, H] token n written to row row_N[n] of page page_N[n]
    (pages ≥ P are dropped: padding, finished rows)."""
    return Pool(*(x.at[:, page_N, row_N].set(n.astype(x.dtype), mode="drop")
                  for x, n in zip(pool, new)))


@dataclasses.dataclass(frozen=True)
class ExtendModes:
    """with_logprobs: also return each new token's target log-prob; slice_layers: as
    programs.DecodeModes."""

    with_logprobs: bool
    slice_layers: bool = True


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ExtendRows:
    """tokens, targets int32 [B, C] (targets: the next prompt token, for log-probs);
    valid bool [B, C]; start int32 [B]: position of tokens[:, 0]; index int32 [B]: the
    row's adapter as an index into active; table int32 [B, M]."""

    tokens: jax.Array
    targets: jax.Array
    valid: jax.Array
    start: jax.Array
    index: jax.Array
    table: jax.Array

    @staticmethod
    def specs() -> ExtendRows:
        return ExtendRows(TABLE_SPEC, TABLE_SPEC, TABLE_SPEC, ROWS_SPEC, ROWS_SPEC, TABLE_SPEC)


def token_pages(table_BxM, position_BxC, valid_BxC, n_pages: int, page: int):
    """(page, row) int32 [B·C] where each new token's K/V goes (page n_pages: nowhere)."""
    at = jnp.take_along_axis(table_BxM, jnp.clip(position_BxC // page, 0,
                                                 table_BxM.shape[1] - 1), axis=1)
    ok = valid_BxC & (at >= 0)
    return (jnp.where(ok, at, n_pages).reshape(-1), (position_BxC % page).reshape(-1))


def make_extend(cfg: QwenConfig, mesh, logprob_chunk: int):
    """jit(extend)(lora, params, slot_meta, pool, rows: ExtendRows, active, *, modes) ->
    (pool, log-probs [B, C] replicated or None). pool is donated."""

    @functools.partial(jax.jit, static_argnames=("modes",), donate_argnames=("pool",))
    def extend(lora, params, slot_meta, pool, rows: ExtendRows, active, *, modes: ExtendModes):
        lora_active = lora_lib.take_active(lora, jnp.maximum(active, 0))

        def shard(lora_active, params, slot_meta, pool, r: ExtendRows, active):
            b, c = r.tokens.shape
            position = r.start[:, None] + jnp.arange(c)[None, :]
            route = slot_meta.routing(active, None, jnp.repeat(r.index, c))
            attend = paged_attend(r.table, r.start, r.valid)
            layers = (model_lib.layer_slices(cfg, params, lora_active)
                      if modes.slice_layers else None)
            h, new, _ = model_lib.hidden_states(
                cfg, params, r.tokens.reshape(-1), position.reshape(-1), attend, lora_active,
                route, attn_state=kv_cache.KV(pool.k, pool.v), remat=False, layers=layers)
            page_N, row_N = token_pages(r.table, position, r.valid, pool.k.shape[1],
                                        pool.k.shape[2])
            pool = write_pages(pool, new, page_N, row_N)
            lp = None
            if modes.with_logprobs:
                lefts, rights = model_lib.unembed_factors(params, h, lora_active, route)
                lp = losses_lib.target_logprobs(lefts, rights, r.targets.reshape(-1),
                                                logprob_chunk).reshape(b, c)
                lp = draws.gather_batch(jnp.where(r.valid, lp, 0.0), SEQ_AXES)
            return pool, lp

        pool_spec = Pool(POOL_SPEC, POOL_SPEC)
        in_specs = (lora_lib.slot_specs_active(cfg, lora_active), model_lib.param_specs(cfg),
                    SPECS.slot_G, pool_spec, ExtendRows.specs(), SPECS.replicated)
        out_specs = (pool_spec, P() if modes.with_logprobs else None)
        return jax.shard_map(shard, mesh=mesh, in_specs=in_specs, out_specs=out_specs)(
            lora_active, params, slot_meta, pool, rows, active)

    return extend


def make_copy(mesh):
    """jit(copy)(pool, src, dst) -> pool with page dst[i] ← page src[i] on each device
    (src, dst int32 [G·N] device-local pages over (dp, cp); dst ≥ P: nothing)."""

    @functools.partial(jax.jit, donate_argnames=("pool",))
    def copy(pool, src, dst):
        def shard(pool, src, dst):
            return Pool(*(x.at[:, dst].set(jnp.take(x, jnp.maximum(src, 0), axis=1),
                                           mode="drop") for x in pool))

        spec = Pool(POOL_SPEC, POOL_SPEC)
        return jax.shard_map(shard, mesh=mesh, in_specs=(spec, ROWS_SPEC, ROWS_SPEC),
                             out_specs=spec)(pool, src, dst)

    return copy


_INT_FIELDS = ("token", "position", "base", "done", "count", "index", "max_tokens", "top_k")


def pack_rows(rows: DecodeRows, table_BxM: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Host DecodeRows and page table as two arrays, so a decode call moves 2 host arrays
    to the devices instead of 13 (each transfer costs ~ms of host time on CPU): int32
    [B, 8 + 2 + NS + M] (the int fields, done as 0/1, keys' bits, stop table, page table)
    and float32 [B, 2] (temperature, top_p). unpack_rows inverts it inside the program."""
    ints = np.concatenate(
        [np.stack([np.asarray(getattr(rows, f)).astype(np.int32) for f in _INT_FIELDS], 1),
         np.ascontiguousarray(rows.keys, np.uint32).view(np.int32), rows.stop, table_BxM],
        axis=1).astype(np.int32)
    floats = np.stack([rows.temperature, rows.top_p], 1).astype(np.float32)
    return ints, floats


def unpack_rows(ints, floats, stop_width: int) -> tuple[DecodeRows, jax.Array]:
    """(DecodeRows, table [B, M]) from pack_rows' arrays (traced)."""
    f = {name: ints[:, i] for i, name in enumerate(_INT_FIELDS)}
    f["done"] = f["done"] != 0
    n = len(_INT_FIELDS)
    keys = jax.lax.bitcast_convert_type(ints[:, n:n + 2], jnp.uint32)
    stop = ints[:, n + 2:n + 2 + stop_width]
    return (DecodeRows(keys=keys, stop=stop, temperature=floats[:, 0], top_p=floats[:, 1], **f),
            ints[:, n + 2 + stop_width:])


@dataclasses.dataclass(frozen=True)
class PagedDecodeModes:
    """out_len: most steps of the call; greedy / filtered / slice_layers / topk: as
    programs.DecodeModes."""

    out_len: int
    greedy: bool
    filtered: bool
    slice_layers: bool = True
    topk: int = 0
    stop_width: int = 8


def make_decode(cfg: QwenConfig, mesh):
    """jit(decode)(lora, params, slot_meta, pool, ints, floats, active, *, modes) -> (tokens [B, N] (−1: nothing drawn), log-probs [B, N], both replicated[, top-k
    ids [B, N, k], top-k log-probs [B, N, k] with modes.topk]; pool).

    programs.decode_loop (every row's newest token through the decoder, drawn with
    its own parameters, ended by its own stop set or max_tokens), reading each row's cache
    through its page table [B, M] and writing each step's K/V to page
    table[position // page]. ints, floats: pack_rows of the DecodeRows and the page tables
    [B, M] (stop tables modes.stop_width wide); rows.base is unused. The pool is donated.
    """

    @functools.partial(jax.jit, static_argnames=("modes",), donate_argnames=("pool",))
    def decode(lora, params, slot_meta, pool, ints, floats, active, *, modes: PagedDecodeModes):
        lora_active = lora_lib.take_active(lora, jnp.maximum(active, 0))
        rows, table = unpack_rows(ints, floats, modes.stop_width)

        def shard(lora_active, params, slot_meta, pool, table, r: DecodeRows, active):
            route = slot_meta.routing(active, None, r.index)
            b = r.token.shape[0]
            n_pages, page = pool.k.shape[1], pool.k.shape[2]

            def run(tok_B, pos_B, pool, lora_active, layers):
                attend = paged_attend(table, pos_B, jnp.ones((b, 1), bool))
                h_BxD, new, _ = model_lib.hidden_states(
                    cfg, params, tok_B, pos_B, attend, lora_active, route,
                    attn_state=kv_cache.KV(pool.k, pool.v), remat=False, layers=layers)
                return h_BxD, new

            def write(pool, new, pos_B, done_B, count_B, live_B):
                # As in programs.make_decode: skipping the rows of finished sequences makes
                # the write depend on the draw, so XLA orders the reads before it (no copy).
                page_B, row_B = token_pages(table, pos_B[:, None], ~done_B[:, None],
                                            n_pages, page)
                return write_pages(pool, new, page_B, row_B)

            pool, outs = decode_loop(cfg, params, lora_active, route, r, pool, modes,
                                     SEQ_AXES, run, write)
            return (*outs, pool)

        pool_spec = Pool(POOL_SPEC, POOL_SPEC)
        in_specs = (lora_lib.slot_specs_active(cfg, lora_active), model_lib.param_specs(cfg),
                    SPECS.slot_G, pool_spec, TABLE_SPEC, DecodeRows.specs(LAYOUT),
                    SPECS.replicated)
        return jax.shard_map(shard, mesh=mesh, in_specs=in_specs,
                             out_specs=(P(), P()) + (P(), P()) * bool(modes.topk)
                             + (pool_spec,))(
            lora_active, params, slot_meta, pool, table, rows, active)

    return decode
