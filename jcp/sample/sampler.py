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
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from jcp import batch as batch_lib
from jcp import mesh as mesh_lib
from jcp import train_step
from jcp.adapter_state import AdapterState, host, replicate
from jcp.config import QwenConfig
from jcp.errors import InputError
from jcp.mesh import SPECS
from jcp.sample import kv_cache
from jcp.sample import layout as layout_lib
from jcp.sample import programs
from jcp.sample.params import (BASE, Checked, SampledSequence, SampleResult, check_params,
                               check_prompts, is_int, sequence_keys)


@dataclasses.dataclass(frozen=True)
class Limits:
    """What a sampling call may hold: token_cap (tokens per sequence, prompt + new),
    max_tokens_per_device (prefill stream rows per device), max_adapters (slot count)."""

    token_cap: int
    max_tokens_per_device: int
    max_adapters: int


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
        self.limits, self.check_adapter = limits, check_adapter
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
        self.slice_layers = layer_bytes <= programs.SLICE_LAYERS_MAX_BYTES
        self.row_bytes = layout_lib.kv_row_bytes(cfg.num_layers, cfg.num_kv_heads // self.tp,
                                                 cfg.head_dim, jnp.dtype(cfg.dtype).itemsize)

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

    def zeros(self, shape, spec):
        """A zero array in the model's dtype, each device making only its own slice."""
        sharding = NamedSharding(self.mesh, spec)
        local = sharding.shard_shape(shape)
        return jax.make_array_from_callback(
            shape, sharding, lambda idx: np.zeros(local, jnp.dtype(self.cfg.dtype)))

    def packed(self, prompts, adapters, min_stream: int = 1
               ) -> tuple[list[int], list[batch_lib.PackedBatch]]:
        """(prompt index of each prefill datum, packed micro-batches) of prompt[:-1] →
        prompt[1:] for every prompt longer than one token. Streams are padded on to a power
        of two ≥ min_stream (at most a device's rows): sampling's prefill also varies with
        the cache shape, so coarser stream buckets keep the number of programs down."""
        which = [i for i, x in enumerate(prompts) if len(x) > 1]
        if not which:
            return which, []
        data = [batch_lib.CheckedDatum(prompts[i][:-1], prompts[i][1:], {}) for i in which]
        cap = self.limits.max_tokens_per_device
        packed = batch_lib.pack(data, [adapters[i] for i in which], self.dp, self.cp,
                                cap, self.limits.max_adapters + 1)
        return which, [batch_lib.pad_streams(
            pb, min(mesh_lib.pow2_at_least(pb.tokens.shape[-1], min_stream), cap)) for pb in packed]

    def run_prefill(self, pb, source=None, old=None, *, layout=None, with_logprobs):
        """One packed micro-batch through the prefill program (see programs.make_prefill)."""
        s = SPECS.stream_DPxCPxS
        if source is not None:
            source = self.put(source, kv_cache.LAYOUTS[layout].position_BxT)
        args = programs.PrefillArgs(
            self.put(pb.tokens, s), self.put(pb.segment, s), self.put(pb.position, s),
            self.put(pb.targets, s), self.put(pb.spans, SPECS.spans_DPxCPxAx2),
            replicate(self.mesh, pb.active))
        return self.prefill(self.state.weights, self.params, self.state.meta, args, source,
                            old, modes=programs.PrefillModes(layout, bool(with_logprobs)))

    # ------------------------------------------------------------------ log-probs

    def compute_logprobs(self, prompts, adapters=None) -> list[np.ndarray]:
        """log p(prompt[t] | prompt[:t]) float32 [len(prompt)] per prompt, NaN at 0."""
        prompts = check_prompts(prompts, self.cfg.vocab_size)
        per_prompt = self.check_adapters(adapters, len(prompts))
        for i, x in enumerate(prompts):
            if len(x) > self.limits.token_cap:
                raise InputError(f"prompts[{i}] has {len(x)} tokens, over the cap of "
                                 f"{self.limits.token_cap} tokens per sequence")
        return self.prompt_logprobs(prompts, per_prompt, None)

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

    def sample(self, prompts, sampling_params, adapters=None, num_samples=1,
               prompt_logprobs=False, cache_mode=None) -> list[SampleResult]:
        c = self.check(prompts, sampling_params, adapters, num_samples)
        if not isinstance(prompt_logprobs, (bool, np.bool_)):
            raise InputError(f"prompt_logprobs must be a bool, got {prompt_logprobs!r}")
        plan = self.plan([len(x) for x in c.prompts], c.max_tokens, c.num_samples, cache_mode)
        lay = kv_cache.LAYOUTS[plan.mode]
        call = layout_lib.call_layout([len(x) for x in c.prompts], c.adapters, c.num_samples,
                                      plan, self.dp, self.cp)
        b_total, t_total = call.shape

        # Prefill every prompt once, for all its num_samples sequences, straight into the
        # cache.
        which, packed = self.packed(c.prompts, c.adapters)
        kv, lps = None, []
        for pb in packed:
            source = layout_lib.prefill_source(call, pb.placements, which,
                                               pb.tokens.shape[-1], self.cp)
            kv, lp = self.run_prefill(pb, source, kv, layout=plan.mode,
                                      with_logprobs=bool(prompt_logprobs))
            lps.append(lp)
        if kv is None:  # every prompt is one token: nothing to prefill
            shape = (self.cfg.num_layers, b_total, t_total, self.cfg.num_kv_heads,
                     self.cfg.head_dim)
            kv = kv_cache.KV(*(self.zeros(shape, lay.kv_LxBxTxKxH) for _ in range(2)))
        cache = kv_cache.Cache(kv.k, kv.v, self.put(call.row_position, lay.position_BxT))

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
        modes = programs.DecodeModes(
            layout=plan.mode, out_len=plan.out_len, greedy=greedy,
            filtered=not greedy and (c.top_k > 0 or c.top_p < 1.0),
            slice_layers=self.slice_layers)
        self.last_plan = plan
        out_tok, out_lp, _ = self.decode(self.state.weights, self.params, self.state.meta,
                                         cache, rows, replicate(self.mesh, active), modes=modes)
        plp = (self.prompt_logprobs(c.prompts, c.adapters, lps) if prompt_logprobs
               else None)
        out_tok, out_lp = host(out_tok), host(out_lp)

        stops = set(c.stop)
        results = []
        for i in range(len(c.prompts)):
            sequences = []
            for j in range(c.num_samples):
                r = call.row_of[i, j]
                n = int(np.sum(out_tok[r] >= 0))
                toks = out_tok[r, :n].astype(np.int32)
                reason = "stop" if n and int(toks[-1]) in stops else "length"
                sequences.append(SampledSequence(toks, out_lp[r, :n].astype(np.float32),
                                                 reason))
            results.append(SampleResult(sequences, None if plp is None else plp[i]))
        return results
