"""The static sampler: one call, one decode batch, from prompts to results.

Owns the order of work of Trainer.sample / compute_logprobs: validate (params.py), lay
out (layout.py), prefill every prompt once for all its samples straight into the cache,
decode the whole batch in one device loop (programs.py), and cut the results. It is built
from explicit parts (config, mesh, base weights, the adapter state, limits and an
adapter check) and must never change any state — sampling only reads. The device side
(weights, programs, host → device arrays, program calls) is its Runner (runner.py), which
every Engine over this Sampler shares.

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
import numpy as np

from jcp import train_step
from jcp.adapter_state import AdapterState, host, replicate
from jcp.config import QwenConfig
from jcp.errors import InputError
from jcp.sample import kv_cache, programs
from jcp.sample import layout as layout_lib
from jcp.sample import paged as paged_lib
from jcp.sample import runner as runner_lib
from jcp.sample.params import (
    BASE,
    Checked,
    PromptFields,
    PromptStatsCall,
    SampledSequence,
    SampleResult,
    TopK,
    check_fields,
    check_params,
    check_prompts,
    is_int,
    k_bucket,
    prompt_results,
    sequence_keys,
)
from jcp.sample.runner import Runner


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

    def __init__(
        self,
        cfg: QwenConfig,
        mesh,
        params: dict,
        state: AdapterState,
        step_cfg: train_step.StepConfig,
        limits: Limits,
        check_adapter: Callable[[object, str], int],
    ):
        self.cfg, self.mesh, self.params, self.state = cfg, mesh, params, state
        self.limits, self.check_adapter, self.step_cfg = limits, check_adapter, step_cfg
        # The device side, shared with every Engine over this Sampler (runner.py).
        self.runner = Runner(cfg, mesh, params, state, step_cfg, limits)
        self.dp, self.cp, self.tp = self.runner.dp, self.runner.cp, self.runner.tp
        self.last_plan: layout_lib.Plan | None = None

    @property
    def prefill(self):
        """The runner's prefill program (settable: a test may wrap it)."""
        return self.runner.prefill

    @prefill.setter
    def prefill(self, fn) -> None:
        self.runner.prefill = fn

    @property
    def paged(self) -> paged_lib.Programs:
        """The engine's paged-cache programs (Runner.paged)."""
        return self.runner.paged

    @property
    def slice_layers(self) -> bool:
        """Whether decode slices the layers out of the stacks first (Runner)."""
        return self.runner.slice_layers

    @property
    def row_bytes(self) -> int:
        """Bytes of one cache position on one device (K and V of every cached layer)."""
        return self.runner.row_bytes

    @property
    def state_bytes(self) -> int:
        """Bytes of one sequence's recurrent state on one device (0 unless hybrid)."""
        return self.runner.state_bytes

    # ------------------------------------------------------------------ validation

    def check_adapters(self, adapters, n: int) -> list[int]:
        """None / one id / one entry per prompt -> a slot (or BASE) per prompt."""
        if adapters is None:
            return [BASE] * n
        if is_int(adapters):
            return [self.check_adapter(adapters, "adapter")] * n
        if isinstance(adapters, (str, bytes)) or not isinstance(adapters, Sequence):
            raise InputError(
                f"adapters must be None, an adapter id, or one entry (id or None) "
                f"per prompt, got {adapters!r}"
            )
        if len(adapters) != n:
            raise InputError(f"adapters has {len(adapters)} entries for {n} prompts")
        return [
            BASE if a is None else self.check_adapter(a, f"adapters[{i}]")
            for i, a in enumerate(adapters)
        ]

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
                raise InputError(
                    f"prompts[{i}]: {len(x)} prompt tokens + max_tokens "
                    f"{p['max_tokens']} exceed the token cap of {cap} tokens per "
                    "sequence (raise max_tokens_per_device or cp)"
                )
        return Checked(prompts, per_prompt, num_samples=int(num_samples), **p)

    def plan(
        self,
        prompt_lengths: Sequence[int],
        max_tokens: int,
        num_samples: int = 1,
        cache_mode: str | None = None,
    ) -> layout_lib.Plan:
        """The cache layout a call with these prompt lengths would use (host only)."""
        return layout_lib.plan(
            prompt_lengths, max_tokens, num_samples, self.dp, self.cp, self.row_bytes, cache_mode
        )

    # ------------------------------------------------------------------ device helpers

    # ------------------------------------------------------------------ log-probs

    def compute_logprobs(
        self, prompts, adapters=None, prompt_logprobs_last_n: int | None = None
    ) -> list[np.ndarray]:
        """log p(prompt[t] | prompt[:t]) float32 [len(prompt)] per prompt, NaN at 0 (and
        before the last prompt_logprobs_last_n positions, when given)."""
        prompts = check_prompts(prompts, self.cfg.vocab_size)
        per_prompt = self.check_adapters(adapters, len(prompts))
        for i, x in enumerate(prompts):
            if len(x) > self.limits.token_cap:
                raise InputError(
                    f"prompts[{i}] has {len(x)} tokens, over the cap of "
                    f"{self.limits.token_cap} tokens per sequence"
                )
        self.check_fields(
            prompts, PromptFields(prompt_logprobs_last_n=prompt_logprobs_last_n), True
        )
        out = self.runner.prompt_logprobs(prompts, per_prompt, None)
        if prompt_logprobs_last_n is not None:
            for lp in out:
                lp[: len(lp) - prompt_logprobs_last_n] = np.nan
        return out

    # ------------------------------------------------------------------ sample

    def check_fields(self, prompts, fields, prompt_logprobs) -> list[PromptFields]:
        """None / one PromptFields for every prompt / one per prompt -> checked, per prompt."""
        if fields is None or isinstance(fields, PromptFields):
            per = [fields] * len(prompts)
        elif isinstance(fields, Sequence) and len(fields) == len(prompts):
            per = list(fields)
        else:
            raise InputError(
                f"fields must be None, a PromptFields, or one per prompt "
                f"({len(prompts)}), got {fields!r}"
            )
        return [
            check_fields(f, len(x), self.cfg.vocab_size, bool(prompt_logprobs), f"prompts[{i}]: ")
            for i, (f, x) in enumerate(zip(per, prompts))
        ]

    def sample(
        self,
        prompts,
        sampling_params,
        adapters=None,
        num_samples=1,
        prompt_logprobs=False,
        cache_mode=None,
        fields=None,
    ) -> list[SampleResult]:
        c = self.check(prompts, sampling_params, adapters, num_samples)
        if not isinstance(prompt_logprobs, (bool, np.bool_)):
            raise InputError(f"prompt_logprobs must be a bool, got {prompt_logprobs!r}")
        fields = self.check_fields(c.prompts, fields, prompt_logprobs)
        want_lp = bool(prompt_logprobs) or any(f.prompt_stats for f in fields)
        plan = self.plan([len(x) for x in c.prompts], c.max_tokens, c.num_samples, cache_mode)
        call = layout_lib.call_layout(
            [len(x) for x in c.prompts], c.adapters, c.num_samples, plan, self.dp, self.cp
        )
        r = self.runner
        cache, lps = self._prefill(c, fields, plan, call, want_lp)
        rows, active, topk = self._decode_rows(c, fields, plan, call)
        modes = programs.DecodeModes(
            layout=plan.mode,
            out_len=plan.out_len,
            slice_layers=r.slice_layers,
            topk=k_bucket(topk),
        )
        self.last_plan = plan
        out_tok, out_lp, *out_tk, _ = r.decode(
            self.state.weights,
            self.params,
            self.state.meta,
            cache,
            rows,
            replicate(self.mesh, active),
            modes=modes,
        )
        outs = r.prompt_outputs(c.prompts, c.adapters, lps, 1, fields) if want_lp else None
        drawn = (host(out_tok), host(out_lp), [host(x) for x in out_tk])
        return [
            SampleResult(
                _sequences(c, call.row_of[i], drawn, fields[i].topk_sample_logprobs),
                **(
                    {}
                    if outs is None
                    else prompt_results(outs[i], len(c.prompts[i]), fields[i], prompt_logprobs)
                ),
            )
            for i in range(len(c.prompts))
        ]

    def _prefill(self, c: Checked, fields, plan, call, want_lp: bool):
        """(the cache every prompt was prefilled into — once, for all its num_samples
        sequences —, the prefill calls' log-prob outputs, one per packed batch)."""
        r = self.runner
        lay = kv_cache.LAYOUTS[plan.mode]
        n_prompts = len(c.prompts)
        stats = PromptStatsCall.of(
            c.prompts, fields, [c.temperature] * n_prompts, [c.seed] * n_prompts, range(n_prompts)
        )
        which, packed = r.packed(c.prompts, c.adapters, 1, fields)
        kv, lps = None, []
        for pb in packed:
            source = layout_lib.prefill_source(
                call, pb.placements, which, pb.tokens.shape[-1], self.cp
            )
            kv, lp = r.run_prefill(
                pb,
                source,
                kv,
                layout=plan.mode,
                with_logprobs=want_lp,
                stats=stats,
                row_of=call.row_of,
                prompt_of=which,
            )
            lps.append(lp)
        if kv is None:  # every prompt is one token: nothing to prefill
            kv = r.empty_cache(*call.shape, lay)
        return kv_cache.Cache(kv.k, kv.v, r.put(call.row_position, lay.position_BxT), kv.rec), lps

    def _decode_rows(self, c: Checked, fields, plan, call):
        """(every row's start state and parameters as device DecodeRows, the call's active
        adapters [A], the widest top-k a prompt asked of its sampled tokens)."""
        b_total = call.shape[0]
        token = np.zeros(b_total, np.int32)
        position = np.zeros(b_total, np.int32)
        done = np.ones(b_total, bool)
        keys = np.zeros((b_total, 2), np.uint32)
        for i, x in enumerate(c.prompts):
            k = sequence_keys(c.seed, i, c.num_samples)
            rows = call.row_of[i]
            token[rows], position[rows], done[rows], keys[rows] = x[-1], len(x) - 1, False, k
        a_len = runner_lib.active_entries(len(set(c.adapters)), self.limits.max_adapters + 1)
        active, index = layout_lib.active_index(call.adapter, a_len, BASE)
        full = lambda v, dt: np.full(b_total, v, dt)  # noqa: E731
        topk = max(f.topk_sample_logprobs for f in fields)
        rows = programs.DecodeRows(
            token=token,
            position=position,
            base=call.base,
            done=done,
            count=np.zeros(b_total, np.int32),
            index=index,
            max_tokens=full(c.max_tokens, np.int32),
            temperature=full(c.temperature, np.float32),
            top_k=full(c.top_k, np.int32),
            top_p=full(c.top_p, np.float32),
            want_topk=full(topk > 0, bool),
            steps=full(plan.out_len, np.int32),
            keys=keys,
            stop=layout_lib.stop_table([c.stop] * b_total),
        )
        lay = kv_cache.LAYOUTS[plan.mode]
        return jax.tree.map(self.runner.put, rows, programs.DecodeRows.specs(lay)), active, topk


def _sequences(c: Checked, rows_J, drawn, k: int) -> list[SampledSequence]:
    """One prompt's sampled sequences from its rows rows_J [num_samples] of the decode
    outputs (drawn: tokens [B, N] (−1: nothing), log-probs [B, N], the top-k pair [B, N,
    k] or []); k: the prompt's topk_sample_logprobs."""
    out_tok, out_lp, out_tk = drawn
    stops = set(c.stop)
    sequences = []
    for r in rows_J:
        n = int(np.sum(out_tok[r] >= 0))
        toks = out_tok[r, :n].astype(np.int32)
        reason = "stop" if n and int(toks[-1]) in stops else "length"
        tk = (
            TopK(out_tk[0][r, :n, :k].astype(np.int32), out_tk[1][r, :n, :k].astype(np.float32))
            if k
            else None
        )
        sequences.append(SampledSequence(toks, out_lp[r, :n].astype(np.float32), reason, tk))
    return sequences
