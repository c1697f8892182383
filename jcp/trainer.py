"""Trainer: the public API over the base model, the adapter-state table and the steps.

Owns the base weights on the mesh, the validation of every public call, and the order of
work: validate and pack (jcp.calls), dispatch through the compiled steps
(jcp.step_programs), read back (jcp.calls), commit. Every public call validates its whole
input before any device work, so a refused call changes nothing; slot arrays are read and
written only through jcp.adapter_state. Its settings (TrainerOptions, AdamParams) and
what they resolve to for the model and mesh are jcp.trainer_options'; the refusals of
adapter ids and new adapters jcp.adapter_checks'. It is the public facade: most methods
are their reference docstring over a few lines of work. It must never differentiate or
modify the base weights.

Shapes: see the legend in jcp/mesh.py.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jcp import adapter_checks, calls, checkpoint, train_step
from jcp import adapter_state as adapter_state_lib
from jcp import custom_loss as custom_loss_lib
from jcp import lora as lora_lib
from jcp import losses as losses_lib
from jcp import mesh as mesh_lib
from jcp import model as model_lib
from jcp import peft as peft_lib
from jcp import remat as remat_lib
from jcp import sample as sample_lib
from jcp import trainer_options as options_lib
from jcp.adapter_state import AdapterInfo, AdapterState, HostSlot
from jcp.calls import ForwardBackwardOutput, Steps, per_datum_slots
from jcp.config import QwenConfig
from jcp.errors import InputError
from jcp.mesh import host, put, replicate
from jcp.step_programs import StepPrograms
from jcp.trainer_options import AdamParams as AdamParams
from jcp.trainer_options import TrainerOptions

# Runs of each program in Trainer.warmup (see there).
WARMUP_RUNS = 2


class Trainer:
    """Many LoRA adapters on one frozen Qwen base, trained over a (dp, cp, tp) mesh.

    See docs/design.md for the contract. Gradients are raw sums over tokens and datums and
    accumulate across forward_backward calls until optim_step.

    Tuning: keywords named as TrainerOptions' fields (`**tuning`), or one TrainerOptions as
    `options` (each setting documented there): remat, remat_budget_bytes, attn_impl,
    attn_block, logprob_chunk, cp_attention, router_aux_loss_coef, expert_lora_modes,
    adapter_memory; any other keyword is a TypeError. `options` holds what was given;
    step_cfg and remat_decisions what was resolved.

    Mixture-of-experts models: forward / forward_backward metrics add Tinker's expert-load
    figures (e_frac_with_tokens:mean, e_frac_oversubscribed:mean, e_max_violation:mean and
    :max, e_min_violation:mean; defined in moe.load_metrics) over every MoE layer's routing
    of the call's real tokens; router_aux_loss_coef adds a load-balancing loss
    (TrainerOptions.router_aux_loss_coef).
    """

    MAX_IN_FLIGHT = calls.MAX_IN_FLIGHT  # micro-batches of one call ahead of the oldest

    def __init__(
        self,
        cfg: QwenConfig,
        mesh,
        base_params=None,
        max_adapters: int = 4,
        max_rank: int = 16,
        seed: int = 0,
        max_tokens_per_device: int | None = None,
        *,
        options: TrainerOptions | None = None,
        **tuning,
    ):
        if tuple(mesh.axis_names) != mesh_lib.AXES:
            raise ValueError(f"mesh axes must be {mesh_lib.AXES}, got {mesh.axis_names}")
        self.options = opts = TrainerOptions.of(options, tuning)
        self.cfg, self.mesh = cfg, mesh
        self.dp, self.cp, self.tp = (mesh_lib.axis_size(mesh, a) for a in mesh_lib.AXES)
        cfg.check_mesh(self.tp)
        # Every step setting is checked by StepConfig (the one place); what needs the
        # model's config by step_config.
        self.step_cfg = options_lib.step_config(cfg, mesh.devices.flat[0].platform, self.tp, opts)
        self.remat = self.step_cfg.remat
        options_lib.check_capacity(max_adapters, max_rank)
        self.max_adapters, self.max_rank = max_adapters, max_rank
        self._seed = seed
        self.max_tokens_per_device, self.token_cap = options_lib.token_limits(
            cfg, self.cp, self.tp, max_tokens_per_device
        )

        if base_params is None:
            base_params = model_lib.random_params(cfg, seed)
        model_lib.check_shapes(cfg, base_params)
        self.params = model_lib.place(
            base_params, model_lib.param_specs(cfg), mesh, dtype=jnp.dtype(cfg.dtype)
        )

        adapter_memory = opts.adapter_memory
        if adapter_memory == "auto":
            adapter_memory = adapter_state_lib.auto_memory_bytes(mesh)
        self.state = AdapterState(
            cfg, mesh, max_adapters, max_rank, opts.expert_lora_modes, adapter_memory
        )
        self.programs = StepPrograms(
            cfg, mesh, self.step_cfg, max_rank, opts.remat_budget_bytes, opts.turn_spans
        )
        self.remat_decisions: dict = self.programs.decisions
        """Per compiled forward_backward program, keyed as forward_backward_programs:
        {"remat": bool, "bytes": its per-device memory without recomputation (measured,
        cached or estimated; None unless remat="auto"), "budget": remat_budget_bytes used,
        "estimate": remat.estimate's figure, "how": "estimate" / "cached" / "measured"
        (see remat; None unless "auto")}."""

    @property
    def sums_on_host(self) -> bool:
        """Whether forward_backward and forward (dense models, Tinker losses) sum the
        gradient and outputs over each process's devices on the host, between two programs
        (host_sum.HostSummedStep: a multi-process XLA:CPU job with tp = 1, where every
        collective is TCP); settable before the first call."""
        return self.programs.sums_on_host

    @sums_on_host.setter
    def sums_on_host(self, value: bool) -> None:
        self.programs.sums_on_host = value

    @property
    def adapters(self):
        """adapter id -> AdapterInfo (rank, alpha, targets) of every allocated adapter."""
        return self.state.infos

    # ------------------------------------------------------------------ helpers

    def _check_adapter(self, adapter, what: str = "adapter") -> int:
        return adapter_checks.allocated(self.adapters, adapter, what)

    def _check_new_adapter(
        self, rank, alpha, targets, expert_lora: str | None = "shared_outer"
    ) -> AdapterInfo:
        """The AdapterInfo of a new adapter, or InputError (adapter_checks.new_adapter)."""
        modes = self.state.expert_lora_modes
        return adapter_checks.new_adapter(
            self.cfg, self.max_rank, modes, rank, alpha, targets, expert_lora
        )

    # ------------------------------------------------------------------ adapters

    def create_adapter(
        self,
        rank: int = 8,
        alpha: float = 16.0,
        seed: int | None = None,
        targets=None,
        expert_lora: str = "shared_outer",
    ) -> int:
        """Allocate a slot with PEFT's initialisation (A uniform ±1/√in, B = 0) -> its id.

        targets: module names or groups ("attn", "mlp", "experts", "unembed", "all");
        default all the model has (dense: attn + mlp + unembed; MoE: attn + experts +
        unembed). expert_lora, for expert targets: "shared_outer" (Tinker's scheme: gate.A,
        up.A and down.B one factor per layer shared by all experts, the other factors per
        expert), "per_expert" (every factor per expert) or "fused_gate_up" (per expert,
        gate and up sharing one A: PEFT's fused gate_up_proj LoRA, what load_peft gives).
        seed: a non-negative integer (default: from the Trainer's seed and the slot).
        """
        info = self._check_new_adapter(rank, alpha, targets, expert_lora)
        seed = adapter_checks.seed(seed)
        slot = self.state.free_slot()
        seed = self._seed * 1_000_003 + slot if seed is None else seed
        weights = lora_lib.init_adapter(self.cfg, info.rank, info.targets, seed, info.expert_lora)
        self.state.install(slot, info, weights)
        return slot

    def copy_adapter(self, adapter: int) -> int:
        """A device copy of an adapter's weights in the lowest free slot -> its id (fresh
        AdamW moments and no gradient: a read-only snapshot, e.g. sampler weights)."""
        slot = self._check_adapter(adapter)
        dst = self.state.free_slot()
        self.state.copy(slot, dst)
        return dst

    def delete_adapter(self, adapter: int) -> None:
        """Free a slot: zero its weights, accumulator and optimizer state."""
        self.state.reset(self._check_adapter(adapter))

    def offload_adapter(self, adapter: int) -> HostSlot:
        """Move an adapter (weights, accumulated gradient, AdamW moments, step count) to
        host memory and free its slot; restore_adapter puts it back bit for bit."""
        return self.state.offload(self._check_adapter(adapter))

    def restore_adapter(self, saved: HostSlot, adapter: int | None = None) -> int:
        """Put an offloaded adapter back into a free slot (`adapter`, or the lowest free
        one) -> its id. It continues exactly as if it had never left."""
        if not isinstance(saved, HostSlot):
            raise InputError(
                f"restore_adapter needs what offload_adapter returned, got {type(saved).__name__}"
            )
        if adapter is None:
            slot = self.state.free_slot()
        else:
            slot = adapter_checks.slot_id(adapter, self.max_adapters)
        self.state.restore(slot, saved)
        return slot

    def adapter_weights(self, adapter: int) -> dict[str, np.ndarray]:
        """The adapter's weights: PEFT keys, torch layout, its own rank and targets."""
        return self._peft(self._check_adapter(adapter), "weights")

    def gradients(self, adapter: int) -> dict[str, np.ndarray]:
        """The accumulated gradient (raw sum) in the layout of adapter_weights."""
        return self._peft(self._check_adapter(adapter), "grads")

    def _peft(self, slot: int, which: str) -> dict[str, np.ndarray]:
        info = self.adapters[slot]
        return peft_lib.to_peft(
            self.state.read(slot, which), info.rank, info.targets, self.cfg.num_layers, cfg=self.cfg
        )

    def load_peft(self, path) -> int:
        """Import a PEFT LoRA folder into a free slot -> its id (targets are the folder's)."""
        rank, alpha, targets, weights = peft_lib.read_folder(
            path, self.cfg, self.max_rank, self._is_base_head
        )
        info = self._check_new_adapter(rank, alpha, targets, lora_lib.tree_expert_lora(weights))
        slot = self.state.free_slot()
        self.state.install(slot, info, weights)
        return slot

    def _is_base_head(self, head_VxD: np.ndarray) -> bool:
        """Whether a host [V, D] array equals this model's unembedding, bit for bit
        (compared on the devices, each against its own vocab slice)."""
        w = self.params["lm_head"] if "lm_head" in self.params else None
        spec = mesh_lib.SPECS.unembed_DxV if w is not None else mesh_lib.SPECS.embed_VxD
        x = head_VxD.T if w is not None else head_VxD
        x = np.asarray(x, jnp.dtype(self.cfg.dtype))
        other = put(self.mesh, x, spec)
        return bool(host(_array_equal(w if w is not None else self.params["embed"], other)))

    def export_peft(self, adapter: int, path) -> None:
        """Write the adapter as a PEFT folder (adapter_config.json + adapter_model.safetensors).
        A path that cannot be such a folder (an existing file) is refused (InputError)."""
        slot = self._check_adapter(adapter)
        path = peft_lib.check_export_path(path, "export_peft: path")
        peft_lib.write_folder(path, self.cfg, self.adapters[slot], self.state.read(slot, "weights"))

    def export_vllm(self, adapter: int, path) -> None:
        """Write the adapter as a LoRA folder in the per-expert 2-D layout vLLM loads for
        Qwen3-MoE (`…mlp.experts.{e}.{gate,up,down}_proj.lora_{A,B}.weight`; a shared-outer
        factor repeated over experts). For dense models it equals export_peft's folder."""
        slot = self._check_adapter(adapter)
        path = peft_lib.check_export_path(path, "export_vllm: path")
        peft_lib.write_vllm_folder(
            path, self.cfg, self.adapters[slot], self.state.read(slot, "weights")
        )

    # ------------------------------------------------------------------ steps

    def _prepare(self, data, loss_fn, loss_fn_config, adapters):
        """Validate everything and pack (calls.prepare); no device work, nothing changed."""
        return calls.prepare(
            data, loss_fn, loss_fn_config, adapters, self._check_adapter, self.call_limits
        )

    @property
    def call_limits(self) -> calls.CallLimits:
        """What a call's data is checked and packed against (calls.prepare): the
        vocabulary, token cap, mesh's dp / cp, tokens per device and adapters per pass."""
        return calls.CallLimits(
            vocab_size=self.cfg.vocab_size,
            token_cap=self.token_cap,
            dp=self.dp,
            cp=self.cp,
            max_tokens_per_device=self.max_tokens_per_device,
            max_adapters=self.max_adapters,
            hybrid=self.cfg.is_hybrid,
        )

    def _run(self, *args, **kw):
        """_steps(*args, **kw) run to the end -> its output."""
        steps = self._steps(*args, **kw)
        while not steps.step():
            pass
        return steps.output

    def _steps(
        self,
        data,
        loss_fn,
        loss_fn_config,
        adapters,
        backward: bool,
        keep: bool = True,
        turns: bool = False,
    ) -> Steps:
        checked, packed, cfg_arrays = self._prepare(data, loss_fn, loss_fn_config, adapters)
        custom = loss_fn if isinstance(loss_fn, custom_loss_lib.CustomLoss) else None
        loss_cfg = jax.tree.map(lambda v: replicate(self.mesh, v), cfg_arrays)
        call_tokens = sum(int(np.sum(pb.segment >= 0)) for pb in packed)
        # Only the modules the call's adapters target are computed (train_step.used_modules).
        targeted = {
            m for slot in per_datum_slots(packed) if slot >= 0 for m in self.adapters[slot].targets
        }
        if targeted & set(lora_lib.EXPERT):  # the experts' factors go in as one piece
            targeted |= set(lora_lib.EXPERT)
        modules = tuple(m for m in self.state.weights if m in targeted)

        def batch_args(pb) -> tuple:
            """(step_args, static) of one micro-batch, its arrays placed."""
            b = calls.device_batch(self.mesh, pb, call_tokens)
            custom_args = tuple(
                (replicate(self.mesh, idx), tuple(replicate(self.mesh, x) for x in inputs))
                for _, idx, inputs in pb.custom
            )
            args = (
                self.params,
                self.state.meta,
                b,
                {k: loss_cfg[k] for k in pb.loss_fns},
                custom_args,
            )
            return args, train_step.BatchStatics(pb.loss_fns, pb.num_slots, custom, modules)

        def step(pb, accumulate):
            args, static = batch_args(pb)
            if accumulate is None:
                return self.programs.forward(self.state.weights, args, static) + (None,)
            return accumulate(
                lambda acc: _split_first(
                    self.programs.forward_backward(acc, self.state.weights, args, static)
                )
            )

        def first_turn(pb, accumulate):
            """The micro-batch's first turn (StepPrograms.first_turn): its PassTurns, or None."""
            args, static = batch_args(pb)
            # The accumulators pass through unchanged: the first turn only reads its key.
            return accumulate(
                lambda acc: (acc, self.programs.first_turn(acc, self.state.weights, args, static))
            )

        def forward_first(pb):
            """The forward micro-batch's first half (StepPrograms.forward_first), or None."""
            args, static = batch_args(pb)
            return self.programs.forward_first(self.state.weights, args, static)

        def dispatch(accumulate):
            # Micro-batches are dispatched ahead of reading any result back, so the device
            # never waits on a host transfer, but at most MAX_IN_FLIGHT of them: dozens of
            # queued programs made XLA:CPU's collectives miss their rendezvous timeout and
            # abort the process. Each one dispatched is a step (Steps), each turn of one
            # run in turns too.
            results = []
            for i, pb in enumerate(packed):
                if i:
                    yield results
                if i >= self.MAX_IN_FLIGHT:
                    jax.block_until_ready(results[i - self.MAX_IN_FLIGHT])
                # Only a full-length micro-batch (the longest unit; warmup compiles its
                # turns' programs) runs in turns.
                full = pb.tokens.shape[-1] == self.max_tokens_per_device
                if accumulate is None:  # a forward: its layers in two halves
                    half = forward_first(pb) if steps.turns and full else None
                    if half is None:
                        results.append(step(pb, accumulate))
                        continue
                    yield [*results, half[1]]
                    second = self.programs.forward_second(self.state.weights, self.state.meta, half)
                    results.append(second + (None,))
                    continue
                turns = first_turn(pb, accumulate) if steps.turns and full else None
                if turns is None:
                    results.append(step(pb, accumulate))
                    continue
                while turns.left > 1:
                    yield [*results, turns.held]
                    turns.next(self.state.meta)
                yield [*results, turns.held]
                last = functools.partial(turns.last, slot_meta=self.state.meta)
                results.append(accumulate(lambda acc: _split_first(last(acc))))
            return calls.outputs(checked, packed, results)

        def run():
            if not backward:
                return (yield from dispatch(None))
            with self.state.accumulating(per_datum_slots(packed), keep) as accumulate:
                return (yield from dispatch(accumulate))

        steps = Steps(run(), len(packed), turns=turns)
        return steps

    def forward_steps(
        self, data, loss_fn="cross_entropy", loss_fn_config=None, adapters=0, turns=False
    ) -> Steps:
        """`forward`, one micro-batch at a time (Steps): refused (InputError) here, before
        any device work, exactly as forward would refuse. turns: each full-length
        micro-batch of a dense model in two steps, its first half of the layers, then the
        rest and the loss (StepPrograms.forward_first; the same results). Settable between
        steps as `Steps.turns`."""
        return self._steps(data, loss_fn, loss_fn_config, adapters, backward=False, turns=turns)

    def forward_backward_steps(
        self, data, loss_fn="cross_entropy", loss_fn_config=None, adapters=0, turns=False
    ) -> Steps:
        """`forward_backward`, one micro-batch at a time (Steps): refused (InputError)
        here, before any device work, exactly as forward_backward would refuse.

        turns: each full-length micro-batch in 2n steps where it can (StepPrograms.
        first_turn: a dense model's pass without a custom loss, whose program fits twice in
        the memory budget), n = min(turn_spans, num_layers) layer spans (TrainerOptions):
        the forward pass of each span, then the backward pass of each, the last with the
        accumulation, with the same results bit for bit; so a caller's other work between
        steps waits for about 1 / 2n of a micro-batch (jcp-serve: a heavy tenant's split
        pass, while other work waits). The tiny model's 1 × 1,023 tokens on one CPU
        device: 53.7 ms whole, turns of 19.7 and 36.8 ms with one span, 10.0, 11.5, 21.9
        and 16.4 ms with two; a call of 16 such takes 6 % and 11 % longer
        (benchmarks/pass_turns.py). Settable between steps as `Steps.turns`.
        """
        return self._steps(data, loss_fn, loss_fn_config, adapters, backward=True, turns=turns)

    @property
    def forward_backward_programs(self) -> dict:
        """The compiled forward_backward programs so far (jax.stages.Compiled, or
        host_sum.HostSummedProgram where sums_on_host), keyed as remat_decisions: for
        profiling and memory or cost analysis."""
        return dict(self.programs.compiled)

    def pass_shapes(self, data, loss_fn="cross_entropy", adapters=0) -> list[tuple]:
        """(losses, stream length S in rows per device, active-adapter entries, datum slots)
        of each micro-batch forward_backward would pack this call into: what its compiled
        program is specialised on besides the adapters' modules. Validated as that call
        would be (InputError); no device work."""
        return [
            (pb.loss_fns, pb.tokens.shape[-1], len(pb.active), pb.num_slots)
            for pb in self._prepare(data, loss_fn, None, adapters)[1]
        ]

    def warmup_call(self, data, loss_fn="cross_entropy", adapters=0) -> int:
        """Compile the programs forward_backward(data, loss_fn, adapters=adapters) runs ->
        how many forward_backward programs that compiled (or loaded from the persistent
        cache): the call runs WARMUP_RUNS times (as in warmup: XLA:CPU prepares a GEMM
        fusion on its first run), each time every adapter's accumulated gradient put back
        bit for bit, so nothing changes."""
        before = len(self.programs.compiled)
        for _ in range(WARMUP_RUNS):
            self._run(data, loss_fn, None, adapters, backward=True, keep=False)
        return len(self.programs.compiled) - before

    def warmup_rows(self, limit: int | None = None) -> list[int]:
        """The stream lengths (rows per device) a packed micro-batch can have, shortest
        first: mesh.bucket_length's buckets below max_tokens_per_device, and it; only those
        ≤ limit when given."""
        return calls.stream_lengths(self.max_tokens_per_device, limit)

    def warmup(self, loss_fn="cross_entropy", rows: Sequence[int] | None = None) -> int:
        """Compile the programs of training steps before any call needs them -> how many
        forward_backward programs it compiled (or loaded from the persistent cache).

        For each stream length of `rows` (rows per device; None: every one, warmup_rows),
        forward_backward of zero-weight datums that fill it, with loss_fn (a loss name, or a
        tuple of names: the program of calls that mix them), on a scratch adapter that
        targets every module (at max_tokens_per_device, in turns too: the programs of
        forward_backward_steps' turns, and the two of forward_steps'); then its
        optim_step, and the gradient-copy programs of every adapter count. Each program runs
        WARMUP_RUNS times: XLA:CPU prepares a GEMM fusion (YNNPACK) when it first runs it,
        once per device that runs it at the same time, so a program run once still cost the
        first real step 10-20% more. Since a pass's adapter and datum counts follow its
        stream length (batch.static_counts), any later call of those lengths and losses
        whose adapters target every module (Tinker's default) compiles nothing, however its
        datums and adapters are grouped, unless it holds more adapters or datums than its
        length's floors (warmup_call compiles a given call's programs exactly). The scratch
        adapter is deleted; then an adapter of each page count is created, copied,
        offloaded, restored and deleted (_warm_slot_writes). No other adapter is touched
        (needs a free slot)."""
        names = (loss_fn,) if isinstance(loss_fn, str) else tuple(loss_fn)
        for name in names:
            losses_lib.check_loss_fn(name)
        before = len(self.programs.compiled)
        for n in sorted(
            {
                min(self.max_adapters, mesh_lib.pow2_at_least(k))
                for k in range(1, self.max_adapters + 1)
            }
        ):
            with self.state.accumulating(range(n)):  # compiles the copy; changes nothing
                pass
        scratch = self.create_adapter(rank=self.max_rank)
        try:
            for s_len in rows if rows is not None else self.warmup_rows():
                data, losses = calls.filling_data(names, int(s_len), self.call_limits)
                for _ in range(WARMUP_RUNS):
                    self.forward_backward(data, losses, adapters=scratch)
                    if s_len == self.max_tokens_per_device:  # and the turns
                        self._run(data, losses, None, scratch, backward=True, turns=True)
                        self._run(data, losses, None, scratch, backward=False, turns=True)
            for _ in range(WARMUP_RUNS):
                self.optim_step(scratch)
        finally:
            self.delete_adapter(scratch)
        self._warm_slot_writes()
        return len(self.programs.compiled) - before

    def _warm_slot_writes(self) -> None:
        """Create, copy, offload and restore an adapter of every page count (targeting
        every module): the slot writes and reads compile one program per table leaf and
        page count (AdapterState), so later adapters of any rank and targets compile
        nothing there, nor in save_state."""
        step = self.state.page_rank
        for rank in range(step, self.max_rank + 1, step):
            extra = self.create_adapter(rank=rank)
            if self.state.room(rank):
                self.delete_adapter(self.copy_adapter(extra))
            self.delete_adapter(self.restore_adapter(self.offload_adapter(extra)))

    def remat_budget_bytes(self) -> int:
        """The per-device bytes a forward_backward program may take without recomputation
        (remat="auto"; see the class docstring)."""
        return self.programs.budget_bytes()

    # remat="auto" trusts remat.estimate where the budget lies beyond these factors of it
    # (jcp/remat.py).
    REMAT_MARGIN = remat_lib.MARGIN
    REMAT_MARGIN_LOOSE = remat_lib.MARGIN_LOOSE

    def forward(
        self, data, loss_fn="cross_entropy", loss_fn_config=None, adapters=0
    ) -> ForwardBackwardOutput:
        """Per-datum log-probs and losses; no gradient is touched.

        loss_fn: one Tinker loss for all datums, or one per datum (then loss_fn_config, if
        given, maps loss names to their settings); or a jcp.custom_loss.CustomLoss for all
        datums (a JAX function or the SDK's traced graph; see forward_backward).
        adapters: one id, or one per datum.
        """
        return self._run(data, loss_fn, loss_fn_config, adapters, backward=False)

    def forward_backward(
        self, data, loss_fn="cross_entropy", loss_fn_config=None, adapters=0
    ) -> ForwardBackwardOutput:
        """forward, and add the gradient of the summed loss into each adapter's accumulator.

        loss_fn may be a jcp.custom_loss.CustomLoss: each datum's loss is fn(logprobs,
        *its inputs) on the datum's whole log-prob vector ([N], or [N, K] for 2-D
        target_tokens), the call's loss their sum, all in this one pass (exact under any
        mesh); per datum "loss:sum" is its custom loss, and the loss's custom/<name>:sum /
        :mean metrics are summed / averaged over the datums.
        """
        return self._run(data, loss_fn, loss_fn_config, adapters, backward=True)

    def optim_step(self, adapter: int, adam: AdamParams | None = None) -> dict:
        """One AdamW step of one adapter on its accumulated gradient, then zero it.

        Nothing non-finite is ever applied: if the gradient or the update is not finite in
        float32, the adapter's weights, moments and step count are left bit-identical, its
        accumulated gradient is cleared, and InputError says why.
        """
        slot = self._check_adapter(adapter)
        if adam is None:
            adam = AdamParams()
        if not isinstance(adam, AdamParams):
            raise InputError(f"adam must be jcp.AdamParams, got {type(adam).__name__}")
        return self.state.step(slot, adam.checked())

    # ------------------------------------------------------------------ state

    def save_state(self, adapter: int, path) -> None:
        """Save weights, AdamW moments, step count and config of one adapter (orbax).

        A save killed at any instant leaves the previous checkpoint at `path` loadable
        (see jcp/checkpoint.py); saving onto a regular file or into a folder holding
        anything but a jcp checkpoint is refused (InputError) before anything is written.
        """
        checkpoint.save_state(self.state, self.cfg, self._check_adapter(adapter), path)

    def load_state(self, path, adapter: int | None = None, with_optimizer: bool = True) -> int:
        """Load a saved adapter into `adapter` (or a free slot) -> its id.

        Refused (InputError, nothing changed) when the checkpoint was saved for another
        base model or does not fit this Trainer. with_optimizer=False loads the weights
        only (fresh moments, step 0). The slot's accumulated gradient is zeroed.
        """
        slot = self.state.free_slot() if adapter is None else self._check_adapter(adapter)
        checkpoint.load_state(
            self.state, self.cfg, path, slot, self._check_new_adapter, with_optimizer
        )
        return slot

    # ------------------------------------------------------------------ sampling

    @functools.cached_property
    def sampler(self) -> sample_lib.Sampler:
        """The static Sampler behind sample / compute_logprobs (made on first use): its plan
        of a call (Sampler.plan, last_plan) and its compiled programs."""
        return self.make_sampler()

    def make_sampler(self) -> sample_lib.Sampler:
        """A Sampler over this Trainer's base weights and adapter table (read only)."""
        limits = sample_lib.Limits(
            token_cap=self.token_cap,
            max_tokens_per_device=self.max_tokens_per_device,
            max_adapters=self.max_adapters,
        )
        return sample_lib.Sampler(
            self.cfg, self.mesh, self.params, self.state, self.step_cfg, limits, self._check_adapter
        )

    def sample(
        self,
        prompts,
        sampling_params: sample_lib.SamplingParams,
        adapters=None,
        num_samples: int = 1,
        prompt_logprobs: bool = False,
        *,
        cache_mode: str | None = None,
        fields=None,
    ) -> list[sample_lib.SampleResult]:
        """Sample num_samples completions of every prompt -> one SampleResult per prompt.

        prompts: token sequences (lists or arrays); adapters: None (the base model), one
        adapter id, or one entry (id or None) per prompt — one call may mix adapters.
        Each prompt is prefilled once for all its samples. result.sequences[j].tokens /
        .logprobs / .stop_reason; .logprobs are log_softmax(logits / T) of the sampled
        tokens before top-k / top-p truncation (T = 1 for greedy), so at T = 1 they equal
        what `forward` computes for the same tokens. prompt_logprobs: also return
        log p(prompt[t] | prompt[:t]) (NaN at 0). Reads the adapters; changes no state.
        Bad input raises InputError before any device work (see SamplingParams).

        cache_mode: the KV cache's layout over the mesh — "batch" (sequences spread over
        dp and cp, each sequence's cache on one device), "split" (sequences over dp, each
        sequence's cache split over cp along the sequence: per-device memory ∝ tokens / cp,
        for long prompts), or None: "split" iff cp > 1 and the per-device cache of "batch"
        would exceed sample.SPLIT_ABOVE_BYTES (1 GiB) and splitting makes it smaller. The
        results do not depend on it (fp32 rounding).

        fields: the SDK 0.38 extras — a sample.PromptFields for every prompt, or one per
        prompt: topk_prompt_logprobs, topk_sample_logprobs, prompt_logprobs_last_n,
        target_prompt_logprobs, prompt_alt_tokens_k (results in SampleResult /
        SampledSequence). Each is computed vocab-parallel with forward's log_softmax.
        """
        return self.sampler.sample(
            prompts, sampling_params, adapters, num_samples, prompt_logprobs, cache_mode, fields
        )

    def compute_logprobs(
        self, prompts, adapters=None, prompt_logprobs_last_n: int | None = None
    ) -> list[np.ndarray]:
        """Prompt log-probs float32 [len(prompt)] per prompt (NaN at 0), through the chunked
        forward path (no [tokens, vocab] logits). adapters as in `sample`.
        prompt_logprobs_last_n: only the last n positions are returned (earlier ones NaN);
        1 ≤ n ≤ len(prompt) − 1 for every prompt."""
        return self.sampler.compute_logprobs(prompts, adapters, prompt_logprobs_last_n)


@functools.partial(jax.jit, out_shardings=None)
def _array_equal(a, b):
    return jnp.array_equal(a, b)


def _split_first(result):
    """(table, *rest) -> (table, rest): the form AdapterState.accumulate expects."""
    return result[0], tuple(result[1:])
