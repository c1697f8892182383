"""The device side of sampling, shared by the static Sampler and the Engine: the model's
weights, the adapter state and the compiled programs, and every call into them.

Owns Runner (the programs — prefill, decode, and the engine's paged extend / decode /
copy — and how host arrays become device arrays for them) and EngineDevice (one engine's
paged KV cache on the devices, its extend / decode / copy calls over the host arrays that
engine_rows.py builds from admission's records, and the signature of every program it
ran). The Sampler and every Engine over it hold the same Runner, so they share compiled
programs. It decides nothing: which requests run, where, and for how many steps is
admission.py's; it must never change adapter state.

Shapes: B = rows of a call (groups · rows per device), M = table pages per row, DP / CP /
S = a packed prefill batch's streams and their rows.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from jcp import batch as batch_lib
from jcp import delta_rule, train_step
from jcp import mesh as mesh_lib
from jcp.adapter_state import AdapterState, host, replicate
from jcp.config import QwenConfig
from jcp.mesh import SPECS
from jcp.program_store import StoredPrograms
from jcp.sample import engine_rows, kv_cache, programs
from jcp.sample import layout as layout_lib
from jcp.sample import paged as paged_lib
from jcp.sample.engine_config import EngineSizes
from jcp.sample.params import BASE, MAX_TOPK, PromptStatsCall, k_bucket

# Every sampling program takes at least ACTIVE_FLOOR active-adapter entries: up to
# lora.DENSE_MAX_ADAPTERS the LoRA products are one GEMM masked per row, an entry more
# costs R columns of it, and one program then serves steps of one adapter and of two (a
# warm-up compiles one adapter bucket for both).
ACTIVE_FLOOR = 2


def active_entries(n: int, cap: int) -> int:
    """Active-adapter entries of a sampling call with n distinct adapters (the base model
    counts as one): the power of two ≥ max(n, ACTIVE_FLOOR), at most cap (the limit's
    max_adapters + 1) unless n itself is more."""
    return max(n, min(mesh_lib.pow2_at_least(max(n, ACTIVE_FLOOR)), cap))


def floor_active(pb: batch_lib.PackedBatch, cap: int) -> batch_lib.PackedBatch:
    """pb with active_entries(…) active entries (extra ones as pack pads: the first
    adapter again, with empty spans)."""
    a = len(pb.active)
    more = active_entries(a, cap) - a
    if more <= 0:
        return pb
    spans = np.concatenate([pb.spans, np.zeros(pb.spans.shape[:2] + (more, 2), np.int32)], 2)
    active = np.concatenate([pb.active, np.full(more, pb.active[0], np.int32)])
    return dataclasses.replace(pb, spans=spans, active=active)


class Runner:
    """The programs over one model's weights and adapter table (read only).

    cfg, mesh: the model and mesh; params: the base weights placed on the mesh; state: the
    AdapterState (read at each call, so new weights are seen); step_cfg: training's step
    settings (prefill runs training's attention); limits: the Sampler's Limits
    (max_tokens_per_device, max_adapters). slice_layers, kv_layers, row_bytes and
    state_bytes describe the model's cache (below).
    """

    def __init__(
        self,
        cfg: QwenConfig,
        mesh,
        params: dict,
        state: AdapterState,
        step_cfg: train_step.StepConfig,
        limits,
    ):
        self.cfg, self.mesh, self.params, self.state = cfg, mesh, params, state
        self.limits, self.step_cfg = limits, step_cfg
        self.dp, self.cp, self.tp = (mesh_lib.axis_size(mesh, a) for a in mesh_lib.AXES)
        # Behind program_store.StoredPrograms: kept in the store when it is on.
        self.prefill = StoredPrograms(
            programs.make_prefill(cfg, mesh, step_cfg), "prefill", (cfg, step_cfg), mesh
        )
        self.decode = programs.make_decode(cfg, mesh, step_cfg.lora_impl)
        # Slicing the layers out of the stacks before the decode loop holds a second copy
        # of the layer weights for the call (measured: 26.7 vs 14.1 MiB of temporaries at
        # hidden 512, 18 MiB of layer weights) for 1.93× faster steps on CPU (XLA:CPU
        # slices the stacks anew each step). Worth it only while that copy is small.
        layer_bytes = sum(
            x.addressable_data(0).nbytes
            for k, t in params.items()
            if isinstance(t, dict)
            for x in jax.tree.leaves(t)
        )
        # A hybrid model's layers run as scans by kind (model.layer_slices is per layer).
        self.slice_layers = layer_bytes <= programs.SLICE_LAYERS_MAX_BYTES and not cfg.is_hybrid
        # Cache rows hold the full-attention layers only; a hybrid model's Gated DeltaNet
        # layers keep one recurrent state per sequence instead (kv_cache.Cache.rec).
        self.kv_layers = cfg.linear_layers.count(False) if cfg.is_hybrid else cfg.num_layers
        self.row_bytes = layout_lib.kv_row_bytes(
            self.kv_layers, cfg.num_kv_heads // self.tp, cfg.head_dim, jnp.dtype(cfg.dtype).itemsize
        )
        # A hybrid model's recurrent state per sequence on one device (fp32 conv window and
        # delta-rule state of every Gated DeltaNet layer; 0 for other models).
        self.state_bytes = 0
        if cfg.is_hybrid:
            ll = cfg.num_layers - self.kv_layers
            conv = (cfg.linear_conv_kernel_dim - 1) * (
                2 * cfg.linear_key_dim + cfg.linear_value_dim
            )
            ssm = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim
            self.state_bytes = 4 * ll * (conv + ssm) // self.tp

    @functools.cached_property
    def paged(self) -> paged_lib.Programs:
        """The engine's paged-cache programs (paged.py), made once per Runner so that every
        Engine over it shares their compiled variants; each kept in the program store when
        it is on (program_store.StoredPrograms: a restart loads them without tracing)."""
        cfg, mesh, chunk, impl, lora = (
            self.cfg,
            self.mesh,
            self.step_cfg.logprob_chunk,
            self.step_cfg.attn_impl,
            self.step_cfg.lora_impl,
        )
        extend = paged_lib.make_extend(cfg, mesh, chunk, lora)
        decode = paged_lib.make_decode(cfg, mesh, impl, lora)
        return paged_lib.Programs(
            StoredPrograms(extend, "extend", (cfg, chunk, lora), mesh),
            StoredPrograms(decode, "decode", (cfg, impl, lora), mesh),
            StoredPrograms(paged_lib.make_copy(mesh), "copy", (), mesh),
        )

    def put(self, x, spec):
        """A host array (the same on every process) as a global array of spec (mesh.put)."""
        return mesh_lib.put(self.mesh, x, spec)

    def zeros(self, shape, spec, dtype=None):
        """A zero array (in the model's dtype by default), each device making only its own
        slice."""
        sharding = NamedSharding(self.mesh, spec)
        local = sharding.shard_shape(shape)
        dtype = jnp.dtype(self.cfg.dtype) if dtype is None else dtype
        return jax.make_array_from_callback(shape, sharding, lambda idx: np.zeros(local, dtype))

    def empty_cache(self, b: int, t: int, layout: kv_cache.Layout) -> kv_cache.KV:
        """A zero cache of b sequences × t rows in `layout` (with a hybrid model's zero
        recurrent states)."""
        cfg = self.cfg
        shape = (self.kv_layers, b, t, cfg.num_kv_heads, cfg.head_dim)
        kv = kv_cache.KV(*(self.zeros(shape, layout.kv_LxBxTxKxH) for _ in range(2)))
        if not cfg.is_hybrid:
            return kv
        ll = cfg.num_layers - self.kv_layers
        conv = (
            ll,
            b,
            cfg.linear_conv_kernel_dim - 1,
            2 * cfg.linear_key_dim + cfg.linear_value_dim,
        )
        ssm = (
            ll,
            b,
            cfg.linear_num_value_heads,
            cfg.linear_key_head_dim,
            cfg.linear_value_head_dim,
        )
        specs = layout.rec_specs
        return kv._replace(
            rec=delta_rule.Recurrent(
                *(
                    self.zeros(x, spec, np.float32)
                    for x, spec in ((conv, specs.conv), (ssm, specs.ssm))
                )
            )
        )

    def packed(
        self, prompts, adapters, min_stream: int = 1, fields=None
    ) -> tuple[list[int], list[batch_lib.PackedBatch]]:
        """(prompt index of each prefill datum, packed micro-batches) of prompt[:-1] →
        prompt[1:] for every prompt longer than one token. Streams are padded on to a power
        of two ≥ min_stream (at most a device's rows): sampling's prefill also varies with
        the cache shape, so coarser stream buckets keep the number of programs down.
        fields: PromptFields per prompt (or None); when any asks target_prompt_logprobs,
        targets are [N, 1 + K] (column 0 the next prompt token, then the requested ids,
        −1 padded to K = k_bucket of the widest)."""
        which = [i for i, x in enumerate(prompts) if len(x) > 1]
        if not which:
            return which, []
        width = k_bucket(max((f.target_width for f in fields or ()), default=0))

        def targets(i):
            if not width:
                return prompts[i][1:]
            t = np.full((len(prompts[i]) - 1, 1 + width), -1, np.int32)
            t[:, 0] = prompts[i][1:]
            extra = fields[i].target_prompt_logprobs
            if extra is not None:
                t[:, 1 : 1 + extra.shape[1]] = extra
            return t

        data = [batch_lib.CheckedDatum(prompts[i][:-1], targets(i), {}) for i in which]
        cap = self.limits.max_tokens_per_device
        packed = batch_lib.pack(
            data, [adapters[i] for i in which], self.dp, self.cp, cap, self.limits.max_adapters + 1
        )
        return which, [
            floor_active(
                batch_lib.pad_streams(
                    pb, min(mesh_lib.pow2_at_least(pb.tokens.shape[-1], min_stream), cap)
                ),
                self.limits.max_adapters + 1,
            )
            for pb in packed
        ]

    def run_prefill(
        self,
        pb,
        source=None,
        old=None,
        *,
        layout=None,
        with_logprobs,
        stats: PromptStatsCall | None = None,
        row_of=None,
        prompt_of=None,
    ):
        """One packed micro-batch through the prefill program (see programs.make_prefill);
        stats: the top-k / prompt draws to compute with the log-probs. A hybrid model
        filling a cache also needs row_of (the decode rows of each prompt) and prompt_of
        (the prompt of each prefill datum) to place the recurrent states."""
        s = SPECS.stream_DPxCPxS
        rec_source, pieces = None, 0
        if self.cfg.is_hybrid:
            piece, pieces = layout_lib.stream_pieces(pb.segment, pb.position)
            if source is not None:
                rec_source = self.put(
                    layout_lib.recurrent_source(
                        row_of, pb.placements, prompt_of, piece, pieces, source.shape[0], self.cp
                    ),
                    kv_cache.LAYOUTS[layout].seqs_B,
                )
        if source is not None:
            source = self.put(source, kv_cache.LAYOUTS[layout].position_BxT)
        topk, alt = (stats.topk, stats.alt) if stats is not None else (0, 0)
        temperature = keys = None
        if alt:
            temperature, keys = stats.streams(pb)
            temperature, keys = self.put(temperature, s), self.put(keys, s)
        args = programs.PrefillArgs(
            self.put(pb.tokens, s),
            self.put(pb.segment, s),
            self.put(pb.position, s),
            self.put(pb.targets, s),
            self.put(pb.spans, SPECS.spans_DPxCPxAx2),
            replicate(self.mesh, pb.active),
            temperature,
            keys,
        )
        modes = programs.PrefillModes(
            layout,
            bool(with_logprobs),
            topk if with_logprobs else 0,
            alt if with_logprobs else 0,
            pieces,
        )
        return self.prefill(
            self.state.weights,
            self.params,
            self.state.meta,
            args,
            source,
            old,
            rec_source,
            modes=modes,
        )

    def prompt_outputs(
        self,
        prompts,
        adapters,
        packed_results,
        min_stream: int = 1,
        fields=None,
        stats: PromptStatsCall | None = None,
    ) -> list[dict]:
        """Per prompt {"lp": float32 [len] (NaN at 0)} and, as the prefill computed them,
        "targets" [len − 1, K], "topk_ids" / "topk_lp" [len − 1, k], "alt_ids" / "alt_lp"
        [len − 1, k] (row i: position i + 1); from prefill results made with the same
        prompts, adapters, min_stream and fields (run here when packed_results is None)."""
        which, packed = self.packed(prompts, adapters, min_stream, fields)
        if packed_results is None:
            packed_results = [
                self.run_prefill(pb, with_logprobs=True, stats=stats)[1] for pb in packed
            ]
        out = [{"lp": np.full(len(x), np.nan, np.float32)} for x in prompts]
        for pb, res in zip(packed, packed_results):
            res = host(res) if not isinstance(res, dict) else {k: host(v) for k, v in res.items()}
            res = res if isinstance(res, dict) else {"lp": res}
            for key, stream in res.items():
                for j, vec in batch_lib.unpack(stream, pb).items():
                    o = out[which[j]]
                    if key == "lp" and vec.ndim == 2:
                        o["lp"][1:], o["targets"] = vec[:, 0], vec[:, 1:]
                    elif key == "lp":
                        o["lp"][1:] = vec
                    else:
                        o[key] = vec
        return out

    def prompt_logprobs(
        self, prompts, adapters, packed_results, min_stream: int = 1
    ) -> list[np.ndarray]:
        """Prompt log-probs from prefill results (run here when packed_results is None);
        min_stream as the `packed` call that made them."""
        which, packed = self.packed(prompts, adapters, min_stream)
        if packed_results is None:
            packed_results = [self.run_prefill(pb, with_logprobs=True)[1] for pb in packed]
        out = [np.full(len(x), np.nan, np.float32) for x in prompts]
        for pb, lp in zip(packed, packed_results):
            for j, vec in batch_lib.unpack(host(lp), pb).items():
                out[which[j]][1:] = vec
        return out

    def active_index(self, adapter_B: np.ndarray, rows_live) -> tuple[np.ndarray, np.ndarray]:
        """(active adapters, each row's index into them) of a call whose rows rows_live
        hold sequences of adapter_B (padding elsewhere); active_entries of them."""
        n_active = len({int(adapter_B[x]) for x in rows_live})
        a_len = active_entries(n_active, self.limits.max_adapters + 1)
        return layout_lib.active_index(adapter_B, a_len, BASE)


class EngineDevice:
    """One engine's side of the devices: its paged KV cache (paged.Pool, made on first
    use, donated to every program and held under the one sharding it was made with), its
    calls over the host arrays of admission's records (admission.Group / Seq, laid out by
    engine_rows.py), and program_keys, the static signature of every program it ran."""

    def __init__(self, runner: Runner, sizes: EngineSizes):
        self.runner, self.sizes = runner, sizes
        self.cache: paged_lib.Pool | None = None
        self.program_keys: set[tuple] = set()

    def lose(self) -> None:
        """Forget the pages (a program they were donated to failed)."""
        self.cache = None

    def _ensure_cache(self) -> None:
        if self.cache is None:
            r, z = self.runner, self.sizes
            c = r.cfg
            shape = (r.kv_layers, z.groups * z.n_pages, z.page, c.num_kv_heads, c.head_dim)
            rec = None
            if z.hybrid:  # one state row per decode slot (Runner.empty_cache's shapes)
                rec = r.empty_cache(z.slots, 1, paged_lib.LAYOUT).rec
            self.cache = paged_lib.Pool(
                *(r.zeros(shape, paged_lib.POOL_SPEC) for _ in range(2)), rec
            )

    def _keep(self, pool) -> None:
        """Hold a program's output pages under the one sharding the engine made them with
        (a relabel, no copy): XLA may report an equivalent sharding with another spec, and a
        different input sharding would compile the next program anew."""
        self.cache = jax.tree.map(
            lambda x, spec: jax.device_put(x, NamedSharding(self.runner.mesh, spec)),
            pool,
            paged_lib.pool_specs(self.sizes.hybrid),
        )

    def note_prefill(self, pb: batch_lib.PackedBatch, stats: tuple[int, int]) -> None:
        """Record a cache-less prefill of pb (stats: its (top-k, alt) widths)."""
        self.program_keys.add(
            ("prefill", None, pb.tokens.shape, pb.targets.shape, pb.spans.shape, True, stats)
        )

    # ------------------------------------------------------------------ program calls

    def prompt_outputs(
        self, prompts, adapters, fields, stats: PromptStatsCall | None
    ) -> list[dict]:
        """Runner.prompt_outputs of newly admitted prompts (the SDK prompt fields): one
        cache-less prefill, its streams at least min_stream."""
        r, min_stream = self.runner, self.sizes.min_stream
        for pb in r.packed(prompts, adapters, min_stream, fields)[1]:
            self.note_prefill(pb, (stats.topk, stats.alt) if stats else (0, 0))
        return r.prompt_outputs(prompts, adapters, None, min_stream, fields, stats)

    def prompt_logprobs(self, prompts, adapters) -> list[np.ndarray]:
        """Runner.prompt_logprobs of compute_logprobs requests (one cache-less prefill)."""
        r, min_stream = self.runner, self.sizes.min_stream
        for pb in r.packed(prompts, adapters, min_stream)[1]:
            self.note_prefill(pb, (0, 0))
        return r.prompt_logprobs(prompts, adapters, None, min_stream)

    def extend(
        self, rows: paged_lib.ExtendRows, modes: paged_lib.ExtendModes, active: np.ndarray
    ) -> np.ndarray | None:
        """One extend call over the engine's pages (kept, donated) -> host log-probs (None
        when no row wants them)."""
        want_lp = bool(np.any(rows.want_lp))
        pool, lp = self.runner.paged.extend(*self._extend_args(rows, modes, active), modes=modes)
        self._keep(pool)
        del pool
        return host(lp) if want_lp else None

    def extend_program(
        self, rows: paged_lib.ExtendRows, modes: paged_lib.ExtendModes, active: np.ndarray
    ):
        """The compiled program an extend call of these rows would run, compiled (or
        loaded from the program store) but not run."""
        return self.runner.paged.extend.program(
            *self._extend_args(rows, modes, active), modes=modes
        )

    def _extend_args(
        self, rows: paged_lib.ExtendRows, modes: paged_lib.ExtendModes, active: np.ndarray
    ) -> tuple:
        r = self.runner
        self.program_keys.add(
            ("extend",) + rows.tokens.shape + (rows.table.shape[1], len(active), modes)
        )
        self._ensure_cache()
        return (
            r.state.weights,
            r.params,
            r.state.meta,
            self.cache,
            jax.tree.map(r.put, rows, paged_lib.ExtendRows.specs()),
            replicate(r.mesh, active),
        )

    def decode(
        self,
        table: np.ndarray,
        rows: programs.DecodeRows,
        modes: paged_lib.PagedDecodeModes,
        active: np.ndarray,
        slot: np.ndarray | None = None,
    ) -> list[np.ndarray]:
        """One decode call over the engine's pages (kept, donated) -> its host outputs
        (tokens, log-probs[, top-k ids, top-k log-probs: when a live row wants them]). slot:
        each row's state row."""
        r = self.runner
        self.program_keys.add(("decode", len(rows.token), table.shape[1], len(active), modes))
        want_topk = bool(np.any(rows.want_topk & ~rows.done))
        ints, floats = paged_lib.pack_rows(rows, table, slot)
        self._ensure_cache()
        *out, pool = r.paged.decode(
            r.state.weights,
            r.params,
            r.state.meta,
            self.cache,
            r.put(ints, paged_lib.TABLE_SPEC),
            r.put(floats, paged_lib.TABLE_SPEC),
            replicate(r.mesh, active),
            modes=modes,
        )
        self._keep(pool)
        del pool
        return [host(x) for x in out[: 4 if want_topk else 2]]

    def copy(
        self, src: np.ndarray, dst: np.ndarray, rec_src: np.ndarray, rec_dst: np.ndarray
    ) -> None:
        """One page-copy call: pages src → dst and state rows rec_src → rec_dst (int32
        [groups · n] each, a device's entries in its n; dst n_pages / b_local: none)."""
        r = self.runner
        self.program_keys.add(("copy", len(src) // self.sizes.groups))
        self._ensure_cache()
        out = r.paged.copy(
            self.cache, *(r.put(x, paged_lib.ROWS_SPEC) for x in (src, dst, rec_src, rec_dst))
        )
        self._keep(out)

    # ------------------------------------------------------------------ a step's calls

    def run_copies(self, copies: list) -> None:
        """Run the page and state-row copies of this step's forks ((device, src, dst,
        "page" | "row"), admission.Admission.fork) in one program call."""
        if copies:
            self.copy(*engine_rows.copy_rows(copies, self.sizes))

    def extend_batch(
        self, work: list
    ) -> tuple[paged_lib.ExtendRows, paged_lib.ExtendModes, np.ndarray, dict[int, int]]:
        """(rows, modes, active adapters, row of each group by id) of one extend call over
        work (engine_rows.extend_rows)."""
        rows, active, at = engine_rows.extend_rows(work, self.sizes, self.runner.active_index)
        return rows, paged_lib.ExtendModes(self.runner.slice_layers), active, at

    def decode_batch(self, live: list, n_steps: int) -> tuple:
        """(table, rows, modes, active adapters, state rows, row of each sequence by id) of
        one decode call of n_steps over the live sequences (engine_rows.decode_rows). One
        program serves every n_steps ≤ max_chunk, draw kind and topk_sample_logprobs: they
        are run-time values (rows.steps, the rows' parameters, rows.want_topk) under static
        bounds (max_chunk outputs, params.MAX_TOPK top-k columns)."""
        table, rows, active, slot, at = engine_rows.decode_rows(
            live, n_steps, self.sizes, self.runner.active_index
        )
        modes = paged_lib.PagedDecodeModes(
            self.sizes.max_chunk, self.runner.slice_layers, MAX_TOPK, rows.stop.shape[1]
        )
        return table, rows, modes, active, slot, at
