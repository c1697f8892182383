"""The Trainer's settings: TrainerOptions (its tuning settings in one frozen, validated
value, each field documented), AdamParams (an optim_step's, Tinker's optimizer settings),
and what the Trainer's settings resolve to for a model and mesh.

`Trainer(cfg, mesh, …, remat=…, attn_impl=…)` and `Trainer(cfg, mesh, …,
options=TrainerOptions(remat=…, attn_impl=…))` build the same Trainer (`TrainerOptions.of`
maps the keywords onto the fields). What needs neither the model nor the mesh is checked
in the dataclass (ValueError); the rest, and every default that depends on them, is
resolved here for the Trainer: `step_config` (the step settings, checked by
train_step.StepConfig), `token_limits`, `check_capacity`. It never touches a device.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jcp import attention as attention_lib
from jcp import cpu_kernels, lora_cpu
from jcp import lora as lora_lib
from jcp import mesh as mesh_lib
from jcp.config import QwenConfig
from jcp.errors import F32, InputError, float32_number
from jcp.train_step import StepConfig


@dataclasses.dataclass(frozen=True)
class TrainerOptions:
    """The Trainer's tuning settings. None means: resolved for the model and mesh."""

    remat: bool | str = "auto"
    """True: recompute each layer in the backward pass (keeping only the attention
    kernel's output and log-sum-exp); False: keep every activation the backward needs;
    "auto": decided per compiled forward_backward program (one per batch shape) by whether
    the program without recomputation fits remat_budget_bytes per device (arguments +
    outputs + temporaries, donated buffers once), compiling only the program it keeps
    wherever it can: from remat.estimate (jcp/remat.py: the config, the stream length and
    the placed arguments; no compile) where that is clearly within or beyond the budget
    (Trainer.REMAT_MARGIN), else from a decision an earlier process measured, stored
    beside the persistent compilation cache, else by compiling the program without
    recomputation and reading XLA's memory analysis of it (the recomputing one is compiled
    only if it does not fit). Both give the same numbers; recomputation only costs time
    (about one more forward pass), so it is spent only where memory requires it.
    Trainer.remat_decisions says what was chosen."""

    remat_budget_bytes: int | None = None
    """Per-device bytes of a program without recomputation (remat="auto"). None: 90% of
    the device's memory limit on an accelerator; on CPU, half the host's physical memory
    shared by its local devices; with several processes, the smallest of theirs, so that
    every process compiles the same programs."""

    attn_impl: str = "auto"
    """"auto" (attention.resolve_implementation: "pallas" on GPUs for bf16/fp16 models,
    "cpu" on CPU devices where the C++ kernels build and the head dim is one of
    attention.cpu.HEAD_DIMS, else "blockwise"), "blockwise" (the reference kernel in plain
    JAX), "cpu" (fused C++ flash-attention kernels for XLA:CPU, compiled on first use with
    the system C++ compiler into ~/.cache/jcp; fp32 inside, bf16 converted; on CPU faster
    end to end than "blockwise": benchmarks/RESULTS.md; see jcp/attention/cpu.py),
    "pallas" (a fused Pallas flash-attention kernel for GPUs, Triton; interpreted —
    slowly, for tests — on CPU; see jcp/attention/pallas.py) or "dense" (tests only).
    Trainer.step_cfg.attn_impl says which one was chosen."""

    lora_impl: str = "auto"
    """How a pass over more than lora.DENSE_MAX_ADAPTERS adapters multiplies each row by its
    own adapter's factors (the grouped products over the slot tables' pages, jcp/lora_grouped.py):
    "xla" (tiles of one adapter's rows in plain JAX: right on every backend), "cpu"
    (jcp/lora_cpu.cc's C++ kernels for XLA:CPU, built on first use with jcp's other CPU
    kernels: each row meets its own adapter's pages in place, no tiles; pages of rank 4,
    8, 16 or 32 in fp32 tables; others take "xla") or "auto" ("cpu" on CPU devices where the
    kernels build, else "xla"). Both give the same values to fp32 rounding
    (tests/test_lora_cpu.py); "cpu" is faster, the more so the more adapters
    (benchmarks/multi_lora.py; on AVX2 and AVX-512 machines alike).
    Trainer.step_cfg.lora_impl says which one was chosen."""

    attn_block: int | None = None
    """Attention tile rows of "blockwise" and "pallas" ("cpu" has its own 64-row tiles).
    None: 64 on CPU, where the masked half of diagonal tiles dominates, 512 on
    accelerators."""

    logprob_chunk: int | None = None
    """Tokens per log-prob chunk. None: at most 1024, fewer for large vocabularies so that
    one chunk's fp32 logits [chunk, V/tp] stay within 256 MiB."""

    cp_attention: str = "auto"
    """How a rank's queries reach the other cp ranks' keys: "gather" all-gathers K/V (one
    collective; every rank holds all CP·S keys and their fp32 gradients per layer), "ring"
    passes them around the cp ring with ppermute (cp − 1 hops each way; memory O(S) per
    rank), "auto" rings iff cp > 1 and the gathered K/V of one layer with their fp32
    gradients, CP·S·K·H·2·(itemsize + 4) bytes (K local kv heads under tp), would exceed
    attention.RING_ABOVE_BYTES (64 MiB) — decided per compiled stream length, so short
    batches gather and long ones ring. attn_impl "dense" always gathers."""

    router_aux_loss_coef: float = 0.0
    """MoE models only (≥ 0): adds c · Σ over MoE layers of E · Σ_e f_e · P_e (Switch
    Transformer's load-balancing loss; f_e the fraction of the layer's (token, choice)
    assignments routed to expert e, P_e the mean router probability of e, over the call's
    real tokens on all dp and cp shards; see moe.load_balancing_loss) to the
    differentiated loss, so its gradient reaches the adapters' factors upstream of each
    (frozen) router; it is reported as the metric router_aux_loss:sum, and loss:sum stays
    the Tinker token sum without it. A call split into several micro-batches
    (max_tokens_per_device) gets the token-weighted mean of the micro-batches' terms, f
    and P then taken per micro-batch. 0: Tinker's losses are pure token sums."""

    expert_lora_modes: tuple[str, ...] = lora_lib.EXPERT_LORA
    """The expert parameterisations (lora.EXPERT_LORA) the slots can hold, for MoE models:
    all by default; ("shared_outer",) drops the per-expert hidden-side factors from every
    slot (the bulk of a per-expert adapter: at r = 32 on Qwen3-30B-A3B 462 M instead of
    1.66 B parameters per slot, each held four times — weights, accumulator, two AdamW
    moments), and per-expert adapters (PEFT imports) are then refused."""

    turn_spans: int = 2
    """The layer spans of a forward_backward micro-batch run in turns
    (forward_backward_steps(turns=True); jcp-serve runs a split pass so while other work
    waits): the forward pass of each span, then of the head and the loss, then the
    backward pass of each of those, last to first, 2 × (min(turn_spans, num_layers) + 1)
    programs (two for a hybrid model: its layers and head run as one) with the same
    results bit for bit. More spans: shorter turns (what another tenant's request waits
    for) and a costlier pass (benchmarks/pass_turns.py)."""

    adapter_memory: int | str | None = None
    """Bytes of each device for the adapter tables. None: room for max_adapters adapters
    at max_rank; "auto": adapter_state.AUTO_ADAPTER_MEMORY of the device's free memory once the
    base model is placed, at most that room. They are paged by rank
    (jcp/adapter_state.py): an adapter of rank r holds ⌈r / 8⌉ pages of rank 8 (for
    max_rank a multiple of 8), each with its weights, gradient accumulator and two AdamW
    moments, so many low-rank adapters fit where few max-rank ones would; max_adapters
    then bounds the count only (its per-slot cost is a few bytes of metadata). An adapter
    that does not fit is refused (InputError) before any device work; state.room(rank)
    says whether one fits."""

    def __post_init__(self):
        b = self.remat_budget_bytes
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b < 1):
            raise ValueError(f"remat_budget_bytes must be a positive integer or None, got {b!r}")
        n = self.turn_spans
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"turn_spans must be a positive integer, got {n!r}")
        modes = self.expert_lora_modes
        modes = tuple(modes) if isinstance(modes, (list, tuple)) else ()
        if (
            not modes
            or len(set(modes)) < len(modes)
            or any(m not in lora_lib.EXPERT_LORA for m in modes)
        ):
            raise ValueError(
                f"expert_lora_modes must be a non-empty tuple of distinct "
                f"{lora_lib.EXPERT_LORA}, got {self.expert_lora_modes!r}"
            )
        object.__setattr__(self, "expert_lora_modes", modes)
        m = self.adapter_memory
        if m != "auto" and m is not None and (isinstance(m, bool) or not isinstance(m, int)):
            raise ValueError(f"adapter_memory must be bytes (an int), 'auto' or None, got {m!r}")

    @classmethod
    def of(cls, options: TrainerOptions | None, tuning: dict) -> TrainerOptions:
        """The Trainer's TrainerOptions: `options`, or its tuning keywords (not both).
        TypeError for a keyword that names no setting, as for any unknown argument."""
        names = {f.name for f in dataclasses.fields(cls)}
        for name in tuning:
            if name not in names:
                raise TypeError(f"Trainer() got an unexpected keyword argument {name!r}")
        from_keywords = cls(**tuning)
        if options is None:
            return from_keywords
        if not isinstance(options, cls):
            raise ValueError(f"options must be a jcp.trainer.TrainerOptions, got {options!r}")
        if from_keywords != cls():
            raise ValueError("give the tuning settings as options or as keywords, not both")
        return options


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


def resolve_lora_impl(lora_impl: str, platform: str) -> str:
    """TrainerOptions.lora_impl for devices of `platform`: "auto" is "cpu" on CPU devices
    where the kernels build (lora_cpu.available), else "xla"; "cpu" elsewhere
    is refused (ValueError), as is a build that failed (lora_cpu's Unavailable names why)."""
    if lora_impl == "auto":
        return "cpu" if platform == "cpu" and lora_cpu.available() else "xla"
    if lora_impl == "cpu":
        if platform != "cpu":
            raise ValueError(f"lora_impl 'cpu' runs on CPU devices, not {platform!r}; use 'xla'")
        why = cpu_kernels.load()
        if why:
            raise cpu_kernels.Unavailable(why)
    return lora_impl


def step_config(cfg: QwenConfig, platform: str, tp: int, opts: TrainerOptions) -> StepConfig:
    """The StepConfig of the Trainer's step settings, the defaults resolved for this model
    and mesh: attn_impl by attention.resolve_implementation; lora_impl by
    resolve_lora_impl; attn_block 64 on CPU (where
    the masked half of diagonal tiles dominates), else attention.DEFAULT_BLOCK;
    logprob_chunk at most 1024 tokens, fewer for large vocabularies so that one chunk's
    fp32 logits [chunk, V/tp] stay within 256 MiB."""
    names = ("remat", "attn_impl", "lora_impl", "attn_block", "logprob_chunk", "cp_attention")
    settings = {f: getattr(opts, f) for f in names + ("router_aux_loss_coef",)}
    settings["attn_impl"] = attention_lib.resolve_implementation(
        settings["attn_impl"], platform, cfg.head_dim, cfg.dtype
    )
    settings["lora_impl"] = resolve_lora_impl(settings["lora_impl"], platform)
    if settings["attn_block"] is None:
        settings["attn_block"] = 64 if platform == "cpu" else attention_lib.DEFAULT_BLOCK
    if settings["logprob_chunk"] is None:
        per_chunk = max(16, (1 << 26) // (cfg.vocab_size // tp))
        settings["logprob_chunk"] = 1 << (min(1024, per_chunk).bit_length() - 1)
    step_cfg = StepConfig(**settings)
    if step_cfg.router_aux_loss_coef and not cfg.is_moe:
        raise ValueError(
            "router_aux_loss_coef needs a mixture-of-experts model; this config has no router"
        )
    return step_cfg


def token_limits(cfg: QwenConfig, cp: int, tp: int, max_tokens_per_device) -> tuple[int, int]:
    """(rows per device, the datum token cap): None gives the rows of the model's whole
    context, zigzagged over cp."""
    if max_tokens_per_device is None:
        per_rank = 2 * mesh_lib.zigzag_chunk(cfg.max_position_embeddings, cp)
        return per_rank, cfg.max_position_embeddings
    if not isinstance(max_tokens_per_device, int) or max_tokens_per_device < 2:
        raise ValueError(
            f"max_tokens_per_device must be an integer ≥ 2, got {max_tokens_per_device!r}"
        )
    return max_tokens_per_device, mesh_lib.datum_token_cap(max_tokens_per_device, cp, tp)


def check_capacity(max_adapters, max_rank) -> None:
    """ValueError unless max_adapters and max_rank are positive integers."""
    for name, v in (("max_adapters", max_adapters), ("max_rank", max_rank)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
