"""Trainer: the public API over the base model, the adapter-state table and the steps.

Owns the base weights on the mesh, the validation of every public call, and the order of
work (validate, pack, dispatch, read back, commit). Every public call validates its whole
input before any device work, so a refused call changes nothing; slot arrays are read and
written only through jcp.adapter_state. It must never differentiate or modify the base
weights.

Shapes: see the legend in jcp/mesh.py.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jcp import attention as attention_lib
from jcp import batch as batch_lib
from jcp import checkpoint, host_sum, train_step
from jcp import custom_loss as custom_loss_lib
from jcp import lora as lora_lib
from jcp import losses as losses_lib
from jcp import mesh as mesh_lib
from jcp import model as model_lib
from jcp import peft as peft_lib
from jcp import remat as remat_lib
from jcp import sample as sample_lib
from jcp.adapter_state import AdapterInfo, AdapterState, HostSlot
from jcp.config import QwenConfig
from jcp.errors import F32, InputError, float32_number
from jcp.mesh import host, put, replicate
from jcp.model import moe as moe_lib


@dataclasses.dataclass(frozen=True)
class AdamParams:
    """Tinker's optimizer settings. grad_clip_norm 0 = no clipping."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0

    def checked(self) -> np.ndarray:
        """As float32 [6], each value checked after the cast to float32 (the device's
        dtype); InputError naming the first bad field."""
        vals = {
            f.name: float32_number(getattr(self, f.name), f"AdamParams.{f.name}")
            for f in dataclasses.fields(self)
        }
        for name, v in vals.items():
            if v < 0:
                raise InputError(f"AdamParams.{name} must be ≥ 0, got {v}")
        for name in ("beta1", "beta2"):
            if not vals[name] < 1.0:
                raise InputError(
                    f"AdamParams.{name} must be < 1 in float32, got "
                    f"{getattr(self, name)} (rounds to {vals[name]})"
                )
        # eps = 0 turns every zero-gradient entry into 0/0 = NaN — always the zero padding
        # of slots beyond an adapter's rank and targets — and a denormal eps is flushed to
        # 0 on the device.
        if not vals["eps"] >= F32.smallest_normal:
            raise InputError(
                f"AdamParams.eps must be ≥ {F32.smallest_normal:.4g} (the "
                f"smallest normal float32), got {self.eps}"
            )
        return np.asarray(list(vals.values()), np.float32)


@dataclasses.dataclass
class ForwardBackwardOutput:
    """Per-datum outputs in the caller's order, and batch metrics (Tinker's names)."""

    loss_fn_outputs: list[dict]
    metrics: dict


class Steps:
    """A forward / forward_backward run one micro-batch at a time (Trainer.forward_steps,
    forward_backward_steps), so that a caller may do other work between its micro-batches
    (jcp-serve interleaves other tenants' passes: docs/serving.md, "Fairness").

    Validation and packing happen when it is made (InputError then, nothing changed);
    each `step()` dispatches the next micro-batch (at most Trainer.MAX_IN_FLIGHT run
    ahead of the oldest unread one), and the last one also reads every result back ->
    True, and `output` holds the ForwardBackwardOutput. The same micro-batches, programs
    and accumulation order as forward / forward_backward, so the same results bit for
    bit. Between steps, other Trainer calls may run if none of them touches this call's
    adapters (their gradient rows are restored on failure, a copy taken on entry). A
    step that raises (a non-finite loss or gradient: InputError) has rolled the call's
    accumulation back; `close()` before the end does the same.
    """

    def __init__(self, gen, passes: int):
        self._gen, self.passes = gen, passes
        self.done, self.output = False, None
        self._dispatched: list = []

    def step(self, settle: bool = False) -> bool:
        """Dispatch the next micro-batch (read everything back after the last) -> whether
        the call is over. settle: also wait until every dispatched micro-batch has run (a
        caller about to hand the device to other work; no result changes)."""
        try:
            self._dispatched = next(self._gen)
        except StopIteration as end:
            self.done, self.output = True, end.value
            return True
        if settle:
            jax.block_until_ready(self._dispatched)
        return False

    def close(self) -> None:
        """Abandon the call: its accumulation so far is rolled back."""
        self._gen.close()
        self.done = True


class Trainer:
    """Many LoRA adapters on one frozen Qwen base, trained over a (dp, cp, tp) mesh.

    See docs/design.md for the contract. Gradients are raw sums over tokens and datums and
    accumulate across forward_backward calls until optim_step.

    Tuning (keyword-only): remat — True: recompute each layer in the backward pass
    (keeping only the attention kernel's output and log-sum-exp); False: keep every
    activation the backward needs; "auto" (the default): decided per compiled
    forward_backward program (one per batch shape) by whether the program without
    recomputation fits remat_budget_bytes per device (arguments + outputs + temporaries,
    donated buffers once), compiling only the program it keeps wherever it can: from
    remat.estimate (jcp/remat.py: the config, the stream length and the placed arguments; no compile)
    where that is clearly within or beyond the budget (REMAT_MARGIN), else from a decision
    an earlier process measured, stored beside the persistent compilation cache, else by
    compiling the program without recomputation and reading XLA's memory analysis of it
    (the recomputing one is compiled only if it does not fit). Both give the same numbers;
    recomputation only costs time (about one more forward pass), so it is spent only where
    memory requires it. remat_budget_bytes (None: 90% of the device's
    memory limit on an accelerator; on CPU, half the host's physical memory shared by its
    local devices; with several processes, the smallest of theirs, so that every process
    compiles the same programs); remat_decisions says what was chosen. attn_impl — "auto"
    (the default; attention.resolve_implementation: "pallas" on GPUs for bf16/fp16 models,
    "cpu" on CPU devices where the C++ kernels build and the head dim is one of
    attention.cpu.HEAD_DIMS, else "blockwise"),
    "blockwise" (the reference kernel in plain JAX), "cpu" (fused C++ flash-attention
    kernels for XLA:CPU, compiled on first use with the system C++ compiler into
    ~/.cache/jcp; fp32 inside, bf16 converted; on CPU faster end to end than "blockwise":
    benchmarks/RESULTS.md, issue 22; see jcp/attention/cpu.py), "pallas" (a fused Pallas
    flash-attention kernel for GPUs, Triton; interpreted — slowly, for tests — on CPU; see
    jcp/attention/pallas.py) or "dense" (tests only); step_cfg.attn_impl says which one
    was chosen; attn_block — attention tile rows of "blockwise" and "pallas" ("cpu" has
    its own 64-row tiles) (None: 64 on CPU, where the masked half of diagonal tiles
    dominates, 512 on accelerators); logprob_chunk — tokens per
    log-prob chunk (None: at most 1024, fewer for large vocabularies so that one chunk's
    fp32 logits [chunk, V/tp] stay within 256 MiB); cp_attention — how a rank's queries
    reach the other cp ranks' keys: "gather" all-gathers K/V (one collective; every rank
    holds all CP·S keys and their fp32 gradients per layer), "ring" passes them around
    the cp ring with ppermute (cp − 1 hops each way; memory O(S) per rank), "auto" (the
    default) rings iff cp > 1 and the gathered K/V of one layer with their fp32 gradients,
    CP·S·K·H·2·(itemsize + 4) bytes (K local kv heads under tp), would exceed
    attention.RING_ABOVE_BYTES (64 MiB) — decided per compiled stream length, so short
    batches gather and long ones ring. attn_impl "dense" always gathers.
    expert_lora_modes — the expert parameterisations (lora.EXPERT_LORA) the slots can
    hold, for MoE models: both by default; ("shared_outer",) drops the per-expert
    hidden-side factors from every slot (the bulk of a per-expert adapter: at r = 32 on
    Qwen3-30B-A3B 462 M instead of 1.66 B parameters per slot, each held four times —
    weights, accumulator, two AdamW moments), and per-expert adapters (PEFT imports) are
    then refused.
    adapter_memory — bytes of each device for the adapter tables (None: room for
    max_adapters adapters at max_rank; "auto": AUTO_ADAPTER_MEMORY of the device's free
    memory once the base model is placed, at most that room). They are paged by rank (jcp/adapter_state.py): an
    adapter of rank r holds ⌈r / 8⌉ pages of rank 8 (for max_rank a multiple of 8), each
    with its weights, gradient accumulator and two AdamW moments, so many low-rank adapters
    fit where few max-rank ones would; max_adapters then bounds the count only (its
    per-slot cost is a few bytes of metadata). An adapter that does not fit is refused
    (InputError) before any device work; state.room(rank) says whether one fits.

    Mixture-of-experts models: forward / forward_backward metrics add Tinker's expert-load
    figures (e_frac_with_tokens:mean, e_frac_oversubscribed:mean, e_max_violation:mean and
    :max, e_min_violation:mean; defined in moe.load_metrics) over every MoE layer's routing
    of the call's real tokens. router_aux_loss_coef (≥ 0, default 0; MoE only) adds
    c · Σ over MoE layers of E · Σ_e f_e · P_e (Switch Transformer's load-balancing loss;
    f_e the fraction of the layer's (token, choice) assignments routed to expert e, P_e
    the mean router probability of e, over the call's real tokens on all dp and cp shards;
    see moe.load_balancing_loss) to the differentiated loss, so its gradient reaches the
    adapters' factors upstream of each (frozen) router; it is reported as the metric
    router_aux_loss:sum, and loss:sum stays the Tinker token sum without it. A call split
    into several micro-batches (max_tokens_per_device) gets the token-weighted mean of the
    micro-batches' terms, f and P then taken per micro-batch. Default 0: Tinker's losses
    are pure token sums.
    """

    # Micro-batches of one call dispatched ahead of the oldest's completion: enough to keep
    # the device fed, few enough that XLA:CPU's collective rendezvous never times out.
    MAX_IN_FLIGHT = 4

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
        remat: bool | str = "auto",
        remat_budget_bytes: int | None = None,
        attn_impl: str = "auto",
        attn_block: int | None = None,
        logprob_chunk: int | None = None,
        cp_attention: str = "auto",
        router_aux_loss_coef: float = 0.0,
        expert_lora_modes: tuple[str, ...] = lora_lib.EXPERT_LORA,
        adapter_memory: int | str | None = None,
    ):
        if tuple(mesh.axis_names) != mesh_lib.AXES:
            raise ValueError(f"mesh axes must be {mesh_lib.AXES}, got {mesh.axis_names}")
        if remat_budget_bytes is not None and (
            isinstance(remat_budget_bytes, bool)
            or not isinstance(remat_budget_bytes, int)
            or remat_budget_bytes < 1
        ):
            raise ValueError(
                f"remat_budget_bytes must be a positive integer or None, got {remat_budget_bytes!r}"
            )
        self.cfg, self.mesh = cfg, mesh
        self.dp, self.cp, self.tp = (mesh_lib.axis_size(mesh, a) for a in mesh_lib.AXES)
        cfg.check_mesh(self.tp)
        attn_impl = attention_lib.resolve_implementation(
            attn_impl, mesh.devices.flat[0].platform, cfg.head_dim, cfg.dtype
        )
        if attn_block is None:
            cpu = mesh.devices.flat[0].platform == "cpu"
            attn_block = 64 if cpu else attention_lib.DEFAULT_BLOCK
        if logprob_chunk is None:
            per_chunk = max(16, (1 << 26) // (cfg.vocab_size // self.tp))
            logprob_chunk = 1 << (min(1024, per_chunk).bit_length() - 1)
        # Every step setting is checked by StepConfig (the one place); what needs the
        # model's config is checked here.
        self.step_cfg = train_step.StepConfig(
            remat=remat,
            attn_impl=attn_impl,
            attn_block=attn_block,
            logprob_chunk=logprob_chunk,
            cp_attention=cp_attention,
            router_aux_loss_coef=router_aux_loss_coef,
        )
        self.remat = self.step_cfg.remat
        if self.step_cfg.router_aux_loss_coef and not cfg.is_moe:
            raise ValueError(
                "router_aux_loss_coef needs a mixture-of-experts model; this config has no router"
            )
        for name, v in (("max_adapters", max_adapters), ("max_rank", max_rank)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        self.max_adapters, self.max_rank = max_adapters, max_rank
        self._seed = seed
        if max_tokens_per_device is None:
            per_rank = 2 * mesh_lib.zigzag_chunk(cfg.max_position_embeddings, self.cp)
            self.max_tokens_per_device = per_rank
            self.token_cap = cfg.max_position_embeddings
        else:
            if not isinstance(max_tokens_per_device, int) or max_tokens_per_device < 2:
                raise ValueError(
                    f"max_tokens_per_device must be an integer ≥ 2, got {max_tokens_per_device!r}"
                )
            self.max_tokens_per_device = max_tokens_per_device
            self.token_cap = mesh_lib.datum_token_cap(max_tokens_per_device, self.cp, self.tp)

        if base_params is None:
            base_params = model_lib.random_params(cfg, seed)
        model_lib.check_shapes(cfg, base_params)
        self.params = model_lib.place(
            base_params, model_lib.param_specs(cfg), mesh, dtype=jnp.dtype(cfg.dtype)
        )

        modes = tuple(expert_lora_modes) if isinstance(expert_lora_modes, (list, tuple)) else ()
        if (
            not modes
            or len(set(modes)) < len(modes)
            or any(m not in lora_lib.EXPERT_LORA for m in modes)
        ):
            raise ValueError(
                f"expert_lora_modes must be a non-empty tuple of distinct "
                f"{lora_lib.EXPERT_LORA}, got {expert_lora_modes!r}"
            )
        if adapter_memory == "auto":
            adapter_memory = _default_adapter_memory(mesh)
        elif adapter_memory is not None and (
            isinstance(adapter_memory, bool) or not isinstance(adapter_memory, int)
        ):
            raise ValueError(
                f"adapter_memory must be bytes (an int), 'auto' or None, got {adapter_memory!r}"
            )
        self.state = AdapterState(cfg, mesh, max_adapters, max_rank, modes, adapter_memory)
        self._forward = train_step.make_forward(cfg, mesh, self.step_cfg)
        self._fb_steps = {
            r: train_step.make_forward_backward(
                cfg, mesh, dataclasses.replace(self.step_cfg, remat=r)
            )
            for r in (True, False)
            if remat in (r, "auto")
        }
        self._remat_budget = remat_budget_bytes
        self.sums_on_host = host_sum.sums_on_host(mesh)
        """Whether forward_backward and forward (dense models, Tinker losses) sum the
        gradient and outputs over each process's devices on the host, between two programs
        (host_sum.HostSummedStep: a multi-process XLA:CPU job with tp = 1, where every
        collective is TCP); settable before the first call."""
        self._fb_programs: dict = {}
        self.remat_decisions: dict = {}
        """Per compiled forward_backward program, keyed as forward_backward_programs:
        {"remat": bool, "bytes": its per-device memory without recomputation (measured,
        cached or estimated; None unless remat="auto"), "budget": remat_budget_bytes used,
        "estimate": remat.estimate's figure, "how": "estimate" / "cached" / "measured"
        (see remat; None unless "auto")}."""

    @property
    def adapters(self):
        """adapter id -> AdapterInfo (rank, alpha, targets) of every allocated adapter."""
        return self.state.infos

    # ------------------------------------------------------------------ helpers

    def _check_adapter(self, adapter, what: str = "adapter") -> int:
        if isinstance(adapter, (bool, np.bool_)) or not isinstance(adapter, (int, np.integer)):
            raise InputError(f"{what} must be an adapter id (int), got {adapter!r}")
        if int(adapter) not in self.adapters:
            raise InputError(
                f"{what} {adapter} is not an allocated adapter; allocated: {sorted(self.adapters)}"
            )
        return int(adapter)

    def _check_new_adapter(
        self, rank, alpha, targets, expert_lora: str | None = "shared_outer"
    ) -> AdapterInfo:
        """The AdapterInfo of a new adapter, or InputError. expert_lora applies only when
        an expert module is targeted (None otherwise)."""
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or rank < 1:
            raise InputError(f"rank must be a positive integer, got {rank!r}")
        if rank > self.max_rank:
            raise InputError(f"rank {rank} exceeds max_rank {self.max_rank} of this Trainer")
        alpha = float32_number(alpha, "alpha")
        if alpha <= 0:
            raise InputError(f"alpha must be > 0, got {alpha}")
        try:
            targets = lora_lib.resolve_targets(targets, self.cfg)
        except ValueError as e:
            raise InputError(str(e)) from None
        if not set(targets) & set(lora_lib.EXPERT):
            expert_lora = None
        elif expert_lora not in lora_lib.EXPERT_LORA:
            raise InputError(
                f"expert_lora must be one of {lora_lib.EXPERT_LORA}, got {expert_lora!r}"
            )
        elif expert_lora == "fused_gate_up" and not {"expert_gate", "expert_up"} <= set(targets):
            raise InputError(
                "expert_lora 'fused_gate_up' ties expert_up's A to expert_gate's: "
                f"target both, got {sorted(set(targets) & set(lora_lib.EXPERT))}"
            )
        elif expert_lora not in self.state.expert_lora_modes:
            raise InputError(
                f"a {expert_lora!r} adapter of the experts does not fit this "
                f"Trainer's slots (expert_lora_modes="
                f"{self.state.expert_lora_modes}); build it with "
                f"expert_lora_modes including {expert_lora!r}"
            )
        return AdapterInfo(int(rank), alpha, targets, expert_lora)

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
        if seed is not None and (
            isinstance(seed, (bool, np.bool_))
            or not isinstance(seed, (int, np.integer))
            or seed < 0
        ):
            raise InputError(f"seed must be a non-negative integer, got {seed!r}")
        slot = self.state.free_slot()
        seed = self._seed * 1_000_003 + slot if seed is None else int(seed)
        weights = lora_lib.init_adapter(self.cfg, info.rank, info.targets, seed, info.expert_lora)
        self.state.install(slot, info, weights)
        return slot

    def copy_adapter(self, adapter: int) -> int:
        """A device copy of an adapter's weights in the lowest free slot -> its id (fresh
        AdamW moments and no gradient: a read-only snapshot, e.g. sampler weights)."""
        slot = self._check_adapter(adapter)
        dst = self.state.free_slot()
        self.state.install(dst, self.adapters[slot], self.state.export(slot).weights)
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
        elif (
            isinstance(adapter, (bool, np.bool_))
            or not isinstance(adapter, (int, np.integer))
            or not 0 <= adapter < self.max_adapters
        ):
            raise InputError(
                f"adapter must be a slot id in [0, {self.max_adapters}), got {adapter!r}"
            )
        else:
            slot = int(adapter)
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
        """Validate everything and pack; no device work, nothing changed."""
        if isinstance(data, batch_lib.Datum) or not isinstance(data, Sequence):
            raise InputError("data must be a list of Datum")
        names = batch_lib.per_datum_losses(loss_fn, len(data))
        if isinstance(loss_fn, custom_loss_lib.CustomLoss):
            if loss_fn_config:
                raise InputError(
                    "loss_fn_config: a custom loss takes no settings (close "
                    "over them, or pass them as loss_fn_inputs)"
                )
            loss_cfg = {losses_lib.CUSTOM: {}}
        else:
            loss_cfg = self._loss_configs(sorted(set(names)), loss_fn_config)
        if isinstance(adapters, (int, np.integer)) and not isinstance(adapters, bool):
            per_datum = [self._check_adapter(adapters)] * len(data)
        elif isinstance(adapters, Sequence) and not isinstance(adapters, str):
            if len(adapters) != len(data):
                raise InputError(f"adapters has {len(adapters)} entries for {len(data)} datums")
            per_datum = [
                self._check_adapter(a, f"datum {i}: adapter") for i, a in enumerate(adapters)
            ]
        else:
            raise InputError(
                f"adapters must be an adapter id or one id per datum, got {adapters!r}"
            )
        checked = batch_lib.validate(
            data,
            loss_fn if isinstance(loss_fn, custom_loss_lib.CustomLoss) else names,
            self.cfg.vocab_size,
            self.token_cap,
        )
        # A pass's adapter and datum counts follow its stream length (batch.static_counts),
        # except a hybrid model's datum slots: its Gated DeltaNet layers pay per slot.
        packed = batch_lib.pack(
            checked,
            per_datum,
            self.dp,
            self.cp,
            self.max_tokens_per_device,
            self.max_adapters,
            adapter_rows=batch_lib.ADAPTER_ROWS,
            slot_tokens=None if self.cfg.is_hybrid else batch_lib.SLOT_TOKENS,
        )
        return checked, packed, loss_cfg

    @staticmethod
    def _loss_configs(distinct: list[str], loss_fn_config) -> dict[str, dict[str, np.float32]]:
        """{loss: settings}. With one loss, loss_fn_config holds its settings; with several,
        it maps loss names to settings."""
        if loss_fn_config is not None and not isinstance(loss_fn_config, dict):
            raise InputError(f"loss_fn_config must be a dict, got {type(loss_fn_config).__name__}")
        given = loss_fn_config or {}
        if len(distinct) == 1 and not (given and set(given) <= set(losses_lib.LOSSES)):
            per_loss = {distinct[0]: given}
        else:
            extra = set(given) - set(distinct)
            if extra:
                raise InputError(
                    f"loss_fn_config: with losses {distinct}, its keys must be "
                    f"loss names of the batch; got {sorted(extra)}"
                )
            per_loss = {name: given.get(name) for name in distinct}
        return {
            name: {
                k: np.float32(v) for k, v in losses_lib.resolve_config(name, per_loss[name]).items()
            }
            for name in distinct
        }

    def _device_batch(self, pb: batch_lib.PackedBatch, call_tokens: int) -> train_step.Batch:
        specs = train_step.batch_specs()
        host = train_step.Batch(
            tokens=pb.tokens,
            targets=pb.targets,
            segment=pb.segment,
            position=pb.position,
            loss_id=pb.loss_id,
            **pb.floats,
            spans=pb.spans,
            active=pb.active,
            call_tokens=np.asarray(call_tokens, np.int32),
        )
        return jax.tree.map(lambda x, spec: put(self.mesh, x, spec), host, specs)

    def _run(self, data, loss_fn, loss_fn_config, adapters, backward: bool, keep: bool = True):
        steps = self._steps(data, loss_fn, loss_fn_config, adapters, backward, keep)
        while not steps.step():
            pass
        return steps.output

    def _steps(
        self, data, loss_fn, loss_fn_config, adapters, backward: bool, keep: bool = True
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

        def step(pb, accumulate):
            b = self._device_batch(pb, call_tokens)
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
            kw = dict(loss_fns=pb.loss_fns, num_slots=pb.num_slots, custom=custom, modules=modules)
            if accumulate is None:
                if self.sums_on_host and train_step.folds_outputs(self.cfg, custom):
                    return self._host_step.forward(
                        self.state.weights,
                        *args[:-1],
                        loss_fns=pb.loss_fns,
                        num_slots=pb.num_slots,
                        modules=modules,
                    ) + (None,)
                return self._forward(self.state.weights, *args, **kw) + (None,)
            return accumulate(
                lambda acc: _split_first(
                    self._forward_backward(acc, self.state.weights, *args, **kw)
                )
            )

        def dispatch(accumulate):
            # Micro-batches are dispatched ahead of reading any result back, so the device
            # never waits on a host transfer, but at most MAX_IN_FLIGHT of them: dozens of
            # queued programs made XLA:CPU's collectives miss their rendezvous timeout and
            # abort the process. Each one dispatched is a step (Steps).
            results = []
            for i, pb in enumerate(packed):
                if i:
                    yield results
                if i >= self.MAX_IN_FLIGHT:
                    jax.block_until_ready(results[i - self.MAX_IN_FLIGHT])
                results.append(step(pb, accumulate))
            return self._outputs(checked, packed, results)

        def run():
            if not backward:
                return (yield from dispatch(None))
            with self.state.accumulating(per_datum_slots(packed), keep) as accumulate:
                return (yield from dispatch(accumulate))

        return Steps(run(), len(packed))

    def forward_steps(
        self, data, loss_fn="cross_entropy", loss_fn_config=None, adapters=0
    ) -> Steps:
        """`forward`, one micro-batch at a time (Steps): refused (InputError) here, before
        any device work, exactly as forward would refuse."""
        return self._steps(data, loss_fn, loss_fn_config, adapters, backward=False)

    def forward_backward_steps(
        self, data, loss_fn="cross_entropy", loss_fn_config=None, adapters=0
    ) -> Steps:
        """`forward_backward`, one micro-batch at a time (Steps): refused (InputError)
        here, before any device work, exactly as forward_backward would refuse."""
        return self._steps(data, loss_fn, loss_fn_config, adapters, backward=True)

    @property
    def forward_backward_programs(self) -> dict:
        """The compiled forward_backward programs so far (jax.stages.Compiled, or
        host_sum.HostSummedProgram where sums_on_host), keyed as remat_decisions: for
        profiling and memory or cost analysis."""
        return dict(self._fb_programs)

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
        cache): the call runs, then every adapter's accumulated gradient is put back bit
        for bit, so nothing changes."""
        before = len(self._fb_programs)
        self._run(data, loss_fn, None, adapters, backward=True, keep=False)
        return len(self._fb_programs) - before

    def warmup_rows(self, limit: int | None = None) -> list[int]:
        """The stream lengths (rows per device) a packed micro-batch can have, shortest
        first: mesh.bucket_length's buckets below max_tokens_per_device, and it; only those
        ≤ limit when given."""
        top = (
            self.max_tokens_per_device if limit is None else min(limit, self.max_tokens_per_device)
        )
        out, b = [], mesh_lib.bucket_length(1)
        while b < top:
            out.append(b)
            b = mesh_lib.bucket_length(b + 1)
        return out + [mesh_lib.bucket_length(top, maximum=self.max_tokens_per_device)]

    def warmup(self, loss_fn="cross_entropy", rows: Sequence[int] | None = None) -> int:
        """Compile the programs of training steps before any call needs them -> how many
        forward_backward programs it compiled (or loaded from the persistent cache).

        For each stream length of `rows` (rows per device; None: every one, warmup_rows),
        one forward_backward of zero-weight datums that fill it, with loss_fn (a loss name,
        or a tuple of names: the program of calls that mix them), on a scratch adapter that
        targets every module; then its optim_step, and the gradient-copy programs of every
        adapter count. Since a pass's adapter and datum counts follow its stream length
        (batch.static_counts), any later call of those lengths and losses whose adapters
        target every module (Tinker's default) compiles nothing, however its datums and
        adapters are grouped, unless it holds more adapters or datums than its length's
        floors (warmup_call compiles a given call's programs exactly). The scratch adapter
        is deleted; no other adapter is touched (needs a free slot)."""
        names = (loss_fn,) if isinstance(loss_fn, str) else tuple(loss_fn)
        for name in names:
            losses_lib.check_loss_fn(name)
        before = len(self._fb_programs)
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
            cap_rows = self.token_cap // self.cp
            for s_len in rows if rows is not None else self.warmup_rows():
                total = max(2 * len(names), min(int(s_len), cap_rows))
                data = []
                # Each dp shard's stream gets one datum of every loss, of an even share of
                # its rows (packing deals equal lengths out one per shard, longest first).
                for i, name in enumerate(names):
                    r = 2 * (total // (2 * len(names)) + (i < total // 2 % len(names)))
                    n = r * self.cp  # zigzag rows 2·ceil(n / 2cp) = r
                    inputs = {
                        f: np.ones(n, np.float32)
                        if f == "sequence_ratio_mask"
                        else np.zeros(n, np.float32)
                        for f in losses_lib.LOSSES[name].inputs
                    }
                    data += [
                        batch_lib.Datum(
                            np.zeros(n, np.int32),
                            {"target_tokens": np.zeros(n, np.int32), **inputs},
                        )
                    ] * self.dp
                self.forward_backward(
                    data, [d_loss for d_loss in names for _ in range(self.dp)], adapters=scratch
                )
            self.optim_step(scratch)
        finally:
            self.delete_adapter(scratch)
        return len(self._fb_programs) - before

    @functools.cached_property
    def _host_step(self) -> host_sum.HostSummedStep:
        return host_sum.HostSummedStep(self.cfg, self.mesh, self.step_cfg, tuple(self._fb_steps))

    def remat_budget_bytes(self) -> int:
        """The per-device bytes a forward_backward program may take without recomputation
        (remat="auto"; see the class docstring)."""
        if self._remat_budget is None:
            self._remat_budget = remat_lib.default_budget(self.mesh)
        return self._remat_budget

    def _forward_backward(
        self,
        acc,
        lora,
        params,
        slot_meta,
        batch,
        loss_cfg,
        custom_args=(),
        *,
        loss_fns,
        num_slots,
        custom=None,
        modules=None,
    ):
        """train_step's forward_backward through the program compiled for this batch's
        shapes (with remat="auto", the one _decide_remat picks)."""
        args = (acc, lora, params, slot_meta, batch, loss_cfg, custom_args)
        on_host = self.sums_on_host and train_step.folds_outputs(self.cfg, custom)
        # Everything the compiled program is specialised on: the per-call arguments' tree and
        # every leaf's shape and dtype (2-D targets, custom inputs), and the static arguments.
        per_call = (batch, loss_cfg, custom_args)
        key = (
            jax.tree.structure(per_call),
            tuple((x.shape, x.dtype) for x in jax.tree.leaves(per_call)),
            loss_fns,
            num_slots,
            custom,
            modules,
        )
        if key not in self._fb_programs:

            def compile_(remat):
                if on_host:
                    return self._host_step.compile(
                        remat, *args[:-1], loss_fns=loss_fns, num_slots=num_slots, modules=modules
                    )
                return (
                    self._fb_steps[remat]
                    .lower(
                        *args,
                        loss_fns=loss_fns,
                        num_slots=num_slots,
                        custom=custom,
                        modules=modules,
                    )
                    .compile()
                )

            if self.remat != "auto":
                program = compile_(self.remat)
                decision = {
                    "remat": self.remat,
                    "bytes": None,
                    "budget": None,
                    "estimate": None,
                    "how": None,
                }
            else:
                program, decision = self._decide_remat(key, args, batch.tokens.shape[-1], compile_)
                program = program or compile_(decision["remat"])
            self._fb_programs[key] = program
            self.remat_decisions[key] = decision
        return self._fb_programs[key](*args)

    # remat="auto" trusts remat.estimate where the budget lies beyond these factors of it
    # (jcp/remat.py).
    REMAT_MARGIN = remat_lib.MARGIN
    REMAT_MARGIN_LOOSE = remat_lib.MARGIN_LOOSE

    def _decide_remat(self, key, args, s_len: int, compile_):
        """remat="auto": (the program without recomputation if it was compiled to decide,
        else None; the decision) — remat.decide for this Trainer's model, mesh and budget."""
        store = remat_lib.RematStore.open(
            key, self.cfg, self.mesh, self.step_cfg, self.remat_budget_bytes()
        )
        return remat_lib.decide(
            self.cfg,
            self.tp,
            self.max_rank,
            self.remat_budget_bytes(),
            args,
            s_len,
            compile_,
            store,
        )

    def _outputs(self, checked, packed, results) -> ForwardBackwardOutput:
        """Read back every micro-batch's results; InputError (the caller rolls back) when a
        datum's loss or an adapter's gradient is not finite in float32.

        MoE models add moe.load_metrics of the expert counts summed over micro-batches, and
        with the router auxiliary loss on, router_aux_loss:sum (its micro-batch terms summed;
        the step's loss includes them, loss:sum does not)."""
        outputs: list[dict | None] = [None] * len(checked)
        total, clipped, counts, aux = 0.0, 0, None, None
        custom_metrics: dict[str, list[float]] = {}
        for pb, (loss, out, finite_A) in zip(packed, results):
            lp = batch_lib.unpack(host(out.logprobs), pb)
            el = batch_lib.unpack(host(out.elementwise_loss), pb)
            datum_loss, datum_clipped = host(out.datum_loss), host(out.clipped)
            members = pb.slot_datums
            custom_loss = {}
            if pb.custom:  # per-datum custom losses and metrics, in pb.custom's order
                custom_loss = dict(zip((c[0] for c in pb.custom), host(out.custom_loss)))
                for key, values in out.custom_metrics.items():
                    custom_metrics.setdefault(key, []).extend(map(float, host(values)))
            for slot_i, j in enumerate(members):
                lp_j = lp[j]
                if lp_j.ndim == 2:  # a [DP, CP, S, K] stream: the datum's own K columns
                    lp_j = (
                        lp_j[:, : checked[j].targets.shape[1]]
                        if (checked[j].targets.ndim == 2)
                        else lp_j[:, 0]
                    )
                outputs[j] = {
                    "logprobs": lp_j,
                    "elementwise_loss": el[j],
                    "loss:sum": float(custom_loss.get(j, datum_loss[slot_i])),
                }
                if checked[j].loss_fn in losses_lib.LOSSES and (
                    losses_lib.LOSSES[checked[j].loss_fn].clips
                ):
                    outputs[j]["clipped_tokens:sum"] = int(datum_clipped[slot_i])
                _check_finite(j, checked[j], outputs[j])
            if finite_A is not None and not host(finite_A).all():
                bad = sorted({int(a) for a, ok in zip(pb.active, host(finite_A)) if not ok})
                raise InputError(
                    f"the gradient of adapter(s) {bad} is not finite in float32 "
                    f"for this batch (datums {sorted(members)}); nothing was accumulated"
                )
            total += float(host(loss))
            clipped += int(datum_clipped.sum())
            if out.expert_counts is not None:
                c = host(out.expert_counts).astype(np.int64)
                counts = c if counts is None else counts + c
            if out.router_aux_loss is not None:
                a = float(host(out.router_aux_loss))
                total -= a
                aux = a if aux is None else aux + a
        if not np.isfinite(total):
            raise InputError(
                f"the batch's loss:sum overflows float32 ({total}) although every "
                "datum's loss is finite; split the batch"
            )
        metrics = {"loss:sum": total}
        for key, values in custom_metrics.items():  # combined over datums as named
            metrics[key] = float(np.sum(values) if key.endswith(":sum") else np.mean(values))
        if any(
            d.loss_fn in losses_lib.LOSSES and losses_lib.LOSSES[d.loss_fn].clips for d in checked
        ):
            metrics["clipped_tokens:sum"] = clipped
        if counts is not None:
            metrics.update(moe_lib.load_metrics(counts))
        if aux is not None:
            metrics["router_aux_loss:sum"] = aux
        return ForwardBackwardOutput(loss_fn_outputs=outputs, metrics=metrics)

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


def _check_finite(i: int, datum, out: dict) -> None:
    """losses.check_finite_outputs, and for a custom loss: its value must be finite."""
    if datum.loss_fn != losses_lib.CUSTOM:
        return losses_lib.check_finite_outputs(i, datum, out)
    if not np.isfinite(out["loss:sum"]):
        raise InputError(
            f"datum {i}: its custom loss is {out['loss:sum']} (not finite in "
            "float32); nothing was accumulated"
        )


@functools.partial(jax.jit, out_shardings=None)
def _array_equal(a, b):
    return jnp.array_equal(a, b)


AUTO_ADAPTER_MEMORY = 0.25


def _default_adapter_memory(mesh) -> int:
    limit, used = remat_lib.device_memory(mesh)
    return int(AUTO_ADAPTER_MEMORY * (limit - used))


def _split_first(result):
    """(table, *rest) -> (table, rest): the form AdapterState.accumulate expects."""
    return result[0], tuple(result[1:])


def per_datum_slots(packed) -> list[int]:
    """Every adapter slot a packed call routes tokens to."""
    return sorted({int(a) for pb in packed for a in pb.active})
