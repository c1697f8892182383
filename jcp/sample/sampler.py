"""The static sampler: one call, one decode batch, from prompts to results.

Owns the order of work of Trainer.sample / compute_logprobs: validate (params.py), lay
out (layout.py), prefill every prompt once for all its samples straight into the cache,
decode the whole batch in one device loop (programs.py), and cut the results. It is built
from explicit parts (config, mesh, base weights, the adapter state, limits and an
adapter check) and must never change any state — sampling only reads.

Cache layouts (kv_cache.LAYOUTS), chosen per call by size (layout.choose_cache_mode) or by
the caller's cache_mode: "batch" spreads the decode batch over (dp, cp), each sequence's
cache on one device; "split" keeps each sequence's cache split over cp along the sequence
(per-device cache memory ∝ tokens / cp for long prompts). The continuous-batching engine
(engine.py) uses "batch"; a long single prompt runs here, split.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from jcp import batch as batch_lib
from jcp import delta_rule
from jcp import mesh as mesh_lib
from jcp import train_step
from jcp.adapter_state import AdapterState, host, replicate
from jcp.config import QwenConfig
from jcp.errors import InputError
from jcp.mesh import SPECS
from jcp.sample import kv_cache
from jcp.sample import layout as layout_lib
from jcp.sample import paged as paged_lib
from jcp.sample import programs
from jcp.sample.params import (BASE, MIN_TEMPERATURE, Checked, PromptFields, SampledSequence,
                               SampleResult, TopK, alt_key, check_fields, check_params,
                               check_prompts,
                               is_int, k_bucket, sequence_keys)


@dataclasses.dataclass(frozen=True)
class Limits:
    """What a sampling call may hold: token_cap (tokens per sequence, prompt + new),
    max_tokens_per_device (prefill stream rows per device), max_adapters (slot count)."""

    token_cap: int
    max_tokens_per_device: int
    max_adapters: int


@dataclasses.dataclass(frozen=True)
class PromptStatsCall:
    """What one prefill call computes beside the log-probs (host side): topk / alt: the
    bucketed widths (params.k_bucket) of topk_prompt_logprobs / prompt_alt_tokens_k over
    its prompts; temperature float32 [P] and keys uint32 [P, 2]: each prompt's draw
    temperature (0: greedy) and params.alt_key; which: the prompt of each prefill datum
    (as Sampler.packed)."""

    topk: int
    alt: int
    temperature: np.ndarray
    keys: np.ndarray
    which: tuple[int, ...]

    @staticmethod
    def of(prompts, fields, temperatures, seeds, prompt_index) -> PromptStatsCall | None:
        """For prompts with their PromptFields, temperatures, seeds and prompt indices (the
        index each prompt's keys derive from); None when nothing beyond log-probs."""
        topk = k_bucket(max(f.topk_prompt_logprobs for f in fields))
        alt = k_bucket(max(f.prompt_alt_tokens_k for f in fields))
        if not (topk or alt):
            return None
        t = np.array([0.0 if x == 0 else max(x, MIN_TEMPERATURE) for x in temperatures],
                     np.float32)
        keys = np.stack([alt_key(sd, i) for sd, i in zip(seeds, prompt_index)])
        return PromptStatsCall(topk, alt, t, keys,
                               tuple(i for i, x in enumerate(prompts) if len(x) > 1))

    def streams(self, pb: batch_lib.PackedBatch) -> tuple[np.ndarray, np.ndarray]:
        """(temperature [DP, CP, S], keys [DP, CP, S, 2]) of a packed batch's tokens."""
        members = np.array(sorted(p.index for p in pb.placements) or [0])
        real = pb.segment >= 0
        prompt = np.array(self.which)[members[np.where(real, pb.segment, 0)]]
        return (np.where(real, self.temperature[prompt], 0.0).astype(np.float32),
                np.where(real[..., None], self.keys[prompt], 0).astype(np.uint32))


def prompt_results(out: dict, n: int, fields: PromptFields, prompt_logprobs: bool) -> dict:
    """SampleResult's prompt fields (as keyword arguments) of one prompt of n tokens from
    its Sampler.prompt_outputs entry, cut to what the request asked for."""
    first = 1 if fields.prompt_logprobs_last_n is None else n - fields.prompt_logprobs_last_n
    kw = {}
    if prompt_logprobs:
        lp = out["lp"].copy()
        lp[:first] = np.nan
        kw["prompt_logprobs"] = lp
    k = fields.topk_prompt_logprobs
    if k:
        ids, lps = np.full((n, k), -1, np.int32), np.full((n, k), np.nan, np.float32)
        if n > 1:
            ids[1:], lps[1:] = out["topk_ids"][:, :k], out["topk_lp"][:, :k]
        ids[:first], lps[:first] = -1, np.nan
        kw["topk_prompt_logprobs"] = TopK(ids, lps)
    t = fields.target_prompt_logprobs
    if t is not None:
        kw["target_prompt_logprobs"] = np.where(t >= 0, out["targets"][:, :t.shape[1]],
                                                0.0).astype(np.float32)
    k = fields.prompt_alt_tokens_k
    if k:
        kw["prompt_alt_tokens"] = TopK(
            out["alt_ids"][:, :k].astype(np.int32) if n > 1 else np.zeros((0, k), np.int32),
            out["alt_lp"][:, :k].astype(np.float32) if n > 1 else np.zeros((0, k), np.float32))
    return kw


class Sampler:
    """Sampling over base weights and an adapter table (read only).

    cfg, mesh: the model and mesh; params: the base weights placed on the mesh; state:
    the AdapterState whose slots `adapters` name (read at each call, so new weights are
    seen); step_cfg: training's step settings (prefill runs training's attention);
    limits: Limits; check_adapter(adapter, what) -> slot: the owner's adapter-id check
    (InputError for an id that is not allocated). Programs compiled: one prefill per
    (stream length, active adapters, cache layout and shape) bucket, one decode per
    (layout, batch, cache length, out length) bucket and draw kind. `last_plan` is the
    Plan of the latest sample call.
    """

    def __init__(self, cfg: QwenConfig, mesh, params: dict, state: AdapterState,
                 step_cfg: train_step.StepConfig, limits: Limits,
                 check_adapter: Callable[[object, str], int]):
        self.cfg, self.mesh, self.params, self.state = cfg, mesh, params, state
        self.limits, self.check_adapter, self.step_cfg = limits, check_adapter, step_cfg
        self.dp, self.cp, self.tp = (mesh_lib.axis_size(mesh, a) for a in mesh_lib.AXES)
        self.prefill = programs.make_prefill(cfg, mesh, step_cfg)
        self.decode = programs.make_decode(cfg, mesh)
        self.last_plan: layout_lib.Plan | None = None
        # Slicing the layers out of the stacks before the decode loop holds a second copy
        # of the layer weights for the call (measured: 26.7 vs 14.1 MiB of temporaries at
        # hidden 512, 18 MiB of layer weights) for 1.93× faster steps on CPU (XLA:CPU
        # slices the stacks anew each step). Worth it only while that copy is small.
        layer_bytes = sum(x.addressable_data(0).nbytes for k, t in params.items()
                          if isinstance(t, dict) for x in jax.tree.leaves(t))
        # A hybrid model's layers run as scans by kind (model.layer_slices is per layer).
        self.slice_layers = (layer_bytes <= programs.SLICE_LAYERS_MAX_BYTES
                             and not cfg.is_hybrid)
        # Cache rows hold the full-attention layers only; a hybrid model's Gated DeltaNet
        # layers keep one recurrent state per sequence instead (kv_cache.Cache.rec).
        self.kv_layers = (cfg.linear_layers.count(False) if cfg.is_hybrid
                          else cfg.num_layers)
        self.row_bytes = layout_lib.kv_row_bytes(self.kv_layers, cfg.num_kv_heads // self.tp,
                                                 cfg.head_dim, jnp.dtype(cfg.dtype).itemsize)
        # A hybrid model's recurrent state per sequence on one device (fp32 conv window and
        # delta-rule state of every Gated DeltaNet layer; 0 for other models).
        self.state_bytes = 0
        if cfg.is_hybrid:
            ll = cfg.num_layers - self.kv_layers
            conv = (cfg.linear_conv_kernel_dim - 1) * (2 * cfg.linear_key_dim
                                                        + cfg.linear_value_dim)
            ssm = (cfg.linear_num_value_heads * cfg.linear_key_head_dim
                   * cfg.linear_value_head_dim)
            self.state_bytes = 4 * ll * (conv + ssm) // self.tp

    @functools.cached_property
    def paged(self) -> paged_lib.Programs:
        """The engine's paged-cache programs (paged.py), made once per Sampler so that every
        Engine over it shares their compiled variants."""
        return paged_lib.Programs(
            paged_lib.make_extend(self.cfg, self.mesh, self.step_cfg.logprob_chunk),
            paged_lib.make_decode(self.cfg, self.mesh), paged_lib.make_copy(self.mesh))

    # ------------------------------------------------------------------ validation

    def check_adapters(self, adapters, n: int) -> list[int]:
        """None / one id / one entry per prompt -> a slot (or BASE) per prompt."""
        if adapters is None:
            return [BASE] * n
        if is_int(adapters):
            return [self.check_adapter(adapters, "adapter")] * n
        if isinstance(adapters, (str, bytes)) or not isinstance(adapters, Sequence):
            raise InputError(f"adapters must be None, an adapter id, or one entry (id or None) "
                             f"per prompt, got {adapters!r}")
        if len(adapters) != n:
            raise InputError(f"adapters has {len(adapters)} entries for {n} prompts")
        return [BASE if a is None else self.check_adapter(a, f"adapters[{i}]")
                for i, a in enumerate(adapters)]

    def check(self, prompts, sampling_params, adapters, num_samples) -> Checked:
        """Every refusal of a sampling call (InputError naming the argument), no device work."""
        prompts = check_prompts(prompts, self.cfg.vocab_size)
        per_prompt = self.check_adapters(adapters, len(prompts))
        p = check_params(sampling_params, self.cfg.vocab_size, self.cfg.eos_token_ids)
        if not is_int(num_samples) or num_samples < 1:
            raise InputError(f"num_samples must be an integer ≥ 1, got {num_samples!r}")
        cap = self.limits.token_cap
        for i, x in enumerate(prompts):
            if len(x) + p["max_tokens"] > cap:
                raise InputError(f"prompts[{i}]: {len(x)} prompt tokens + max_tokens "
                                 f"{p['max_tokens']} exceed the token cap of {cap} tokens per "
                                 "sequence (raise max_tokens_per_device or cp)")
        return Checked(prompts, per_prompt, num_samples=int(num_samples), **p)

    def plan(self, prompt_lengths: Sequence[int], max_tokens: int, num_samples: int = 1,
             cache_mode: str | None = None) -> layout_lib.Plan:
        """The cache layout a call with these prompt lengths would use (host only)."""
        return layout_lib.plan(prompt_lengths, max_tokens, num_samples, self.dp, self.cp,
                               self.row_bytes, cache_mode)

    # ------------------------------------------------------------------ device helpers

    def put(self, x, spec):
        """A host array (the same on every process) as a global array of spec."""
        return jax.make_array_from_callback(x.shape, NamedSharding(self.mesh, spec),
                                            lambda idx: x[idx])

    def zeros(self, shape, spec, dtype=None):
        """A zero array (in the model's dtype by default), each device making only its own
        slice."""
        sharding = NamedSharding(self.mesh, spec)
        local = sharding.shard_shape(shape)
        dtype = jnp.dtype(self.cfg.dtype) if dtype is None else dtype
        return jax.make_array_from_callback(shape, sharding,
                                            lambda idx: np.zeros(local, dtype))

    def packed(self, prompts, adapters, min_stream: int = 1, fields=None
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
                t[:, 1:1 + extra.shape[1]] = extra
            return t

        data = [batch_lib.CheckedDatum(prompts[i][:-1], targets(i), {}) for i in which]
        cap = self.limits.max_tokens_per_device
        packed = batch_lib.pack(data, [adapters[i] for i in which], self.dp, self.cp,
                                cap, self.limits.max_adapters + 1)
        return which, [batch_lib.pad_streams(
            pb, min(mesh_lib.pow2_at_least(pb.tokens.shape[-1], min_stream), cap)) for pb in packed]

    def run_prefill(self, pb, source=None, old=None, *, layout=None, with_logprobs,
                    stats: PromptStatsCall | None = None, row_of=None, prompt_of=None):
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
                    layout_lib.recurrent_source(row_of, pb.placements, prompt_of, piece,
                                                pieces, source.shape[0], self.cp),
                    kv_cache.LAYOUTS[layout].seqs_B)
        if source is not None:
            source = self.put(source, kv_cache.LAYOUTS[layout].position_BxT)
        topk, alt = (stats.topk, stats.alt) if stats is not None else (0, 0)
        temperature = keys = None
        if alt:
            temperature, keys = stats.streams(pb)
            temperature, keys = self.put(temperature, s), self.put(keys, s)
        args = programs.PrefillArgs(
            self.put(pb.tokens, s), self.put(pb.segment, s), self.put(pb.position, s),
            self.put(pb.targets, s), self.put(pb.spans, SPECS.spans_DPxCPxAx2),
            replicate(self.mesh, pb.active), temperature, keys)
        modes = programs.PrefillModes(layout, bool(with_logprobs), topk if with_logprobs else 0,
                                      alt if with_logprobs else 0, pieces)
        return self.prefill(self.state.weights, self.params, self.state.meta, args, source,
                            old, rec_source, modes=modes)

    def empty_cache(self, b: int, t: int, layout: kv_cache.Layout) -> kv_cache.KV:
        """A zero cache of b sequences × t rows in `layout` (with a hybrid model's zero
        recurrent states)."""
        cfg = self.cfg
        shape = (self.kv_layers, b, t, cfg.num_kv_heads, cfg.head_dim)
        kv = kv_cache.KV(*(self.zeros(shape, layout.kv_LxBxTxKxH) for _ in range(2)))
        if not cfg.is_hybrid:
            return kv
        ll = cfg.num_layers - self.kv_layers
        conv = (ll, b, cfg.linear_conv_kernel_dim - 1,
                2 * cfg.linear_key_dim + cfg.linear_value_dim)
        ssm = (ll, b, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
               cfg.linear_value_head_dim)
        specs = layout.rec_specs
        return kv._replace(rec=delta_rule.Recurrent(
            *(self.zeros(x, spec, np.float32) for x, spec in ((conv, specs.conv),
                                                              (ssm, specs.ssm)))))

    # ------------------------------------------------------------------ log-probs

    def compute_logprobs(self, prompts, adapters=None,
                         prompt_logprobs_last_n: int | None = None) -> list[np.ndarray]:
        """log p(prompt[t] | prompt[:t]) float32 [len(prompt)] per prompt, NaN at 0 (and
        before the last prompt_logprobs_last_n positions, when given)."""
        prompts = check_prompts(prompts, self.cfg.vocab_size)
        per_prompt = self.check_adapters(adapters, len(prompts))
        for i, x in enumerate(prompts):
            if len(x) > self.limits.token_cap:
                raise InputError(f"prompts[{i}] has {len(x)} tokens, over the cap of "
                                 f"{self.limits.token_cap} tokens per sequence")
        self.check_fields(prompts, PromptFields(prompt_logprobs_last_n=prompt_logprobs_last_n),
                          True)
        out = self.prompt_logprobs(prompts, per_prompt, None)
        if prompt_logprobs_last_n is not None:
            for lp in out:
                lp[:len(lp) - prompt_logprobs_last_n] = np.nan
        return out

    def prompt_outputs(self, prompts, adapters, packed_results, min_stream: int = 1,
                       fields=None, stats: PromptStatsCall | None = None) -> list[dict]:
        """Per prompt {"lp": float32 [len] (NaN at 0)} and, as the prefill computed them,
        "targets" [len − 1, K], "topk_ids" / "topk_lp" [len − 1, k], "alt_ids" / "alt_lp"
        [len − 1, k] (row i: position i + 1); from prefill results made with the same
        prompts, adapters, min_stream and fields (run here when packed_results is None)."""
        which, packed = self.packed(prompts, adapters, min_stream, fields)
        if packed_results is None:
            packed_results = [self.run_prefill(pb, with_logprobs=True, stats=stats)[1]
                              for pb in packed]
        out = [{"lp": np.full(len(x), np.nan, np.float32)} for x in prompts]
        for pb, res in zip(packed, packed_results):
            res = host(res) if not isinstance(res, dict) else {k: host(v)
                                                              for k, v in res.items()}
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

    def prompt_logprobs(self, prompts, adapters, packed_results,
                        min_stream: int = 1) -> list[np.ndarray]:
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

    # ------------------------------------------------------------------ sample

    def check_fields(self, prompts, fields, prompt_logprobs) -> list[PromptFields]:
        """None / one PromptFields for every prompt / one per prompt -> checked, per prompt."""
        if fields is None or isinstance(fields, PromptFields):
            per = [fields] * len(prompts)
        elif isinstance(fields, Sequence) and len(fields) == len(prompts):
            per = list(fields)
        else:
            raise InputError(f"fields must be None, a PromptFields, or one per prompt "
                             f"({len(prompts)}), got {fields!r}")
        return [check_fields(f, len(x), self.cfg.vocab_size, bool(prompt_logprobs),
                             f"prompts[{i}]: ") for i, (f, x) in enumerate(zip(per, prompts))]

    def sample(self, prompts, sampling_params, adapters=None, num_samples=1,
               prompt_logprobs=False, cache_mode=None, fields=None) -> list[SampleResult]:
        c = self.check(prompts, sampling_params, adapters, num_samples)
        if not isinstance(prompt_logprobs, (bool, np.bool_)):
            raise InputError(f"prompt_logprobs must be a bool, got {prompt_logprobs!r}")
        fields = self.check_fields(c.prompts, fields, prompt_logprobs)
        want_lp = bool(prompt_logprobs) or any(f.prompt_stats for f in fields)
        n_prompts = len(c.prompts)
        stats = PromptStatsCall.of(c.prompts, fields, [c.temperature] * n_prompts,
                                   [c.seed] * n_prompts, range(n_prompts))
        plan = self.plan([len(x) for x in c.prompts], c.max_tokens, c.num_samples, cache_mode)
        lay = kv_cache.LAYOUTS[plan.mode]
        call = layout_lib.call_layout([len(x) for x in c.prompts], c.adapters, c.num_samples,
                                      plan, self.dp, self.cp)
        b_total, t_total = call.shape

        # Prefill every prompt once, for all its num_samples sequences, straight into the
        # cache.
        which, packed = self.packed(c.prompts, c.adapters, 1, fields)
        kv, lps = None, []
        for pb in packed:
            source = layout_lib.prefill_source(call, pb.placements, which,
                                               pb.tokens.shape[-1], self.cp)
            kv, lp = self.run_prefill(pb, source, kv, layout=plan.mode,
                                      with_logprobs=want_lp, stats=stats,
                                      row_of=call.row_of, prompt_of=which)
            lps.append(lp)
        if kv is None:  # every prompt is one token: nothing to prefill
            kv = self.empty_cache(b_total, t_total, lay)
        cache = kv_cache.Cache(kv.k, kv.v, self.put(call.row_position, lay.position_BxT),
                               kv.rec)

        # Per-row start state and parameters.
        token = np.zeros(b_total, np.int32)
        position = np.zeros(b_total, np.int32)
        done = np.ones(b_total, bool)
        keys = np.zeros((b_total, 2), np.uint32)
        for i, x in enumerate(c.prompts):
            k = sequence_keys(c.seed, i, c.num_samples)
            rows = call.row_of[i]
            token[rows], position[rows], done[rows], keys[rows] = x[-1], len(x) - 1, False, k
        a_len = batch_lib.active_bucket(len(set(c.adapters)), self.limits.max_adapters + 1)
        active, index = layout_lib.active_index(call.adapter, a_len, BASE)
        greedy = c.temperature == 0.0
        full = lambda v, dt: np.full(b_total, v, dt)  # noqa: E731
        rows = programs.DecodeRows(
            token=token, position=position, base=call.base, done=done,
            count=np.zeros(b_total, np.int32), index=index,
            max_tokens=full(c.max_tokens, np.int32), temperature=full(c.temperature, np.float32),
            top_k=full(c.top_k, np.int32), top_p=full(c.top_p, np.float32), keys=keys,
            stop=layout_lib.stop_table([c.stop] * b_total))
        rows = jax.tree.map(self.put, rows, programs.DecodeRows.specs(lay))
        topk = max(f.topk_sample_logprobs for f in fields)
        modes = programs.DecodeModes(
            layout=plan.mode, out_len=plan.out_len, greedy=greedy,
            filtered=not greedy and (c.top_k > 0 or c.top_p < 1.0),
            slice_layers=self.slice_layers, topk=k_bucket(topk))
        self.last_plan = plan
        out_tok, out_lp, *out_tk, _ = self.decode(
            self.state.weights, self.params, self.state.meta, cache, rows,
            replicate(self.mesh, active), modes=modes)
        outs = (self.prompt_outputs(c.prompts, c.adapters, lps, 1, fields) if want_lp
                else None)
        out_tok, out_lp = host(out_tok), host(out_lp)
        out_tk = [host(x) for x in out_tk]

        stops = set(c.stop)
        results = []
        for i in range(len(c.prompts)):
            sequences = []
            for j in range(c.num_samples):
                r = call.row_of[i, j]
                n = int(np.sum(out_tok[r] >= 0))
                toks = out_tok[r, :n].astype(np.int32)
                reason = "stop" if n and int(toks[-1]) in stops else "length"
                k = fields[i].topk_sample_logprobs
                tk = (TopK(out_tk[0][r, :n, :k].astype(np.int32),
                           out_tk[1][r, :n, :k].astype(np.float32)) if k else None)
                sequences.append(SampledSequence(toks, out_lp[r, :n].astype(np.float32),
                                                 reason, tk))
            extra = ({} if outs is None else
                     prompt_results(outs[i], len(c.prompts[i]), fields[i], prompt_logprobs))
            results.append(SampleResult(sequences, **extra))
        return results
