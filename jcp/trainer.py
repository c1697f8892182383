"""Trainer: adapters, gradient accumulators and optimizer states over the jitted steps.

Owns the host-side bookkeeping of adapter slots (rank, alpha, targets) and the global
arrays of slots, accumulators and AdamW state. Every public call validates its whole input
before any device work, so a refused call changes nothing. It must never differentiate
or modify the base weights.

Legend: G slots; L layers; I, O in/out features; R max rank.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jcp import attention as attention_lib
from jcp import batch as batch_lib
from jcp import lora as lora_lib
from jcp import losses as losses_lib
from jcp import mesh as mesh_lib
from jcp import model as model_lib
from jcp import train_step
from jcp.batch import InputError
from jcp.config import QwenConfig


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
        """As float32 [6]; InputError naming the first bad field."""
        vals = [self.learning_rate, self.beta1, self.beta2, self.eps, self.weight_decay,
                self.grad_clip_norm]
        for f, v in zip(dataclasses.fields(self), vals):
            v = batch_lib.finite_number(v, f"AdamParams.{f.name}")
            if v < 0:
                raise InputError(f"AdamParams.{f.name} must be ≥ 0, got {v}")
        for name in ("beta1", "beta2"):
            if not float(getattr(self, name)) < 1.0:
                raise InputError(f"AdamParams.{name} must be < 1, got {getattr(self, name)}")
        # eps = 0 turns every zero-gradient entry into 0/0 = NaN — always the zero padding
        # of slots beyond an adapter's rank and targets — and poisons the whole adapter.
        if not np.float32(self.eps) > 0:
            raise InputError(f"AdamParams.eps must be > 0 (in float32), got {self.eps}")
        return np.asarray(vals, np.float32)


@dataclasses.dataclass(frozen=True)
class AdapterInfo:
    """Host-side description of one allocated slot."""

    rank: int
    alpha: float
    targets: tuple[str, ...]

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


@dataclasses.dataclass
class ForwardBackwardOutput:
    """Per-datum outputs in the caller's order, and batch metrics (Tinker's names)."""

    loss_fn_outputs: list[dict]
    metrics: dict


def _host(x) -> np.ndarray:
    """A replicated global array as NumPy, readable on every process."""
    return np.asarray(x.addressable_data(0))


class Trainer:
    """Many LoRA adapters on one frozen Qwen base, trained over a (dp, cp, tp) mesh.

    See DESIGN.md for the contract. Gradients are raw sums over tokens and datums and
    accumulate across forward_backward calls until optim_step.

    Tuning (keyword-only): remat — recompute each layer in the backward pass (keeping only
    the attention output); attn_impl — "blockwise" (the reference kernel) or "dense"
    (tests only); attn_block — attention tile rows (None: 64 on CPU, where the masked half
    of diagonal tiles dominates, 512 on accelerators); logprob_chunk — tokens per
    log-prob chunk (None: at most 1024, fewer for large vocabularies so that one chunk's
    fp32 logits [chunk, V/tp] stay within 256 MiB).
    """

    def __init__(self, cfg: QwenConfig, mesh, base_params=None, max_adapters: int = 4,
                 max_rank: int = 16, seed: int = 0, max_tokens_per_device: int | None = None,
                 *, remat: bool = True, attn_impl: str = "blockwise",
                 attn_block: int | None = None, logprob_chunk: int | None = None):
        if tuple(mesh.axis_names) != mesh_lib.AXES:
            raise ValueError(f"mesh axes must be {mesh_lib.AXES}, got {mesh.axis_names}")
        if attn_impl not in attention_lib.IMPLEMENTATIONS:
            raise ValueError(f"attn_impl must be one of {attention_lib.IMPLEMENTATIONS}, got "
                             f"{attn_impl!r}")
        self.cfg, self.mesh = cfg, mesh
        self.dp, self.cp, self.tp = (mesh_lib.axis_size(mesh, a) for a in mesh_lib.AXES)
        cfg.check_mesh(self.tp)
        if attn_block is None:
            cpu = mesh.devices.flat[0].platform == "cpu"
            attn_block = 64 if cpu else attention_lib.DEFAULT_BLOCK
        if logprob_chunk is None:
            per_chunk = max(16, (1 << 26) // (cfg.vocab_size // self.tp))
            logprob_chunk = 1 << (min(1024, per_chunk).bit_length() - 1)
        for name, v in (("attn_block", attn_block), ("logprob_chunk", logprob_chunk),
                        ("max_adapters", max_adapters), ("max_rank", max_rank)):
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
                raise ValueError("max_tokens_per_device must be an integer ≥ 2, got "
                                 f"{max_tokens_per_device!r}")
            self.max_tokens_per_device = max_tokens_per_device
            self.token_cap = mesh_lib.datum_token_cap(max_tokens_per_device, self.cp, self.tp)
        self.step_cfg = train_step.StepConfig(remat=remat, attn_impl=attn_impl,
                                              attn_block=attn_block, logprob_chunk=logprob_chunk)

        if base_params is None:
            base_params = model_lib.random_params(cfg, seed)
        model_lib.check_shapes(cfg, base_params)
        self.params = model_lib.place(base_params, model_lib.param_specs(cfg), mesh,
                                      dtype=jnp.dtype(cfg.dtype))

        shapes = lora_lib.slot_shapes(cfg, max_adapters, max_rank)
        self._slot_shardings = jax.tree.map(lambda s: NamedSharding(mesh, s),
                                            lora_lib.slot_specs())
        zeros = jax.jit(lambda: jax.tree.map(lambda s: jnp.zeros(s, jnp.float32), shapes,
                                             is_leaf=lambda x: isinstance(x, tuple)),
                        out_shardings=self._slot_shardings)
        self._zeros = zeros
        self.lora = zeros()
        self.acc = zeros()
        self.opt = train_step.OptState(mu=zeros(), nu=zeros(),
                                       count=self._replicated(np.zeros(max_adapters, np.int32)))
        self.scale = self._replicated(np.zeros(max_adapters, np.float32))
        self.adapters: dict[int, AdapterInfo] = {}

        self._forward = train_step.make_forward(cfg, mesh, self.step_cfg)
        self._forward_backward = train_step.make_forward_backward(cfg, mesh, self.step_cfg)
        self._optim_step = train_step.make_optim_step(mesh)
        self._write_slot = jax.jit(
            lambda tree, slot, values: jax.tree.map(lambda x, v: x.at[slot].set(v), tree, values),
            donate_argnums=(0,), out_shardings=self._slot_shardings)
        rep = NamedSharding(mesh, P())
        self._read_slot = jax.jit(lambda tree, slot: jax.tree.map(lambda x: x[slot], tree),
                                  out_shardings=rep)

    # ------------------------------------------------------------------ helpers

    def _replicated(self, x: np.ndarray):
        sharding = NamedSharding(self.mesh, P())
        return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])

    def _check_adapter(self, adapter, what: str = "adapter") -> int:
        if isinstance(adapter, (bool, np.bool_)) or not isinstance(adapter, (int, np.integer)):
            raise InputError(f"{what} must be an adapter id (int), got {adapter!r}")
        if int(adapter) not in self.adapters:
            raise InputError(f"{what} {adapter} is not an allocated adapter; allocated: "
                             f"{sorted(self.adapters)}")
        return int(adapter)

    def _check_new_adapter(self, rank, alpha, targets) -> tuple[int, float, tuple[str, ...]]:
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or rank < 1:
            raise InputError(f"rank must be a positive integer, got {rank!r}")
        if rank > self.max_rank:
            raise InputError(f"rank {rank} exceeds max_rank {self.max_rank} of this Trainer")
        try:
            alpha = float(alpha)
        except (TypeError, ValueError):
            raise InputError(f"alpha must be a number, got {alpha!r}") from None
        if not math.isfinite(alpha) or alpha <= 0:
            raise InputError(f"alpha must be finite and > 0, got {alpha}")
        try:
            targets = lora_lib.resolve_targets(targets)
        except ValueError as e:
            raise InputError(str(e)) from None
        return int(rank), alpha, targets

    def _free_slot(self) -> int:
        for g in range(self.max_adapters):
            if g not in self.adapters:
                return g
        raise InputError(f"all {self.max_adapters} adapter slots are in use; delete_adapter "
                         "one or raise max_adapters")

    def _install(self, slot: int, info: AdapterInfo, weights: dict) -> None:
        """Write a slot's weights; reset its accumulator and optimizer state."""
        zeros = jax.tree.map(lambda x: np.zeros_like(x), weights)
        self.lora = self._write_slot(self.lora, slot, weights)
        self.acc = self._write_slot(self.acc, slot, zeros)
        self.opt = train_step.OptState(
            mu=self._write_slot(self.opt.mu, slot, zeros),
            nu=self._write_slot(self.opt.nu, slot, zeros),
            count=self._replicated(self._count_host(slot, 0)))
        scale = _host(self.scale).copy()
        scale[slot] = info.scale
        self.scale = self._replicated(scale)
        self.adapters[slot] = info

    def _count_host(self, slot: int, value: int) -> np.ndarray:
        count = _host(self.opt.count).copy()
        count[slot] = value
        return count

    def _slot_host(self, tree, slot: int) -> dict:
        return jax.tree.map(_host, self._read_slot(tree, slot))

    # ------------------------------------------------------------------ adapters

    def create_adapter(self, rank: int = 8, alpha: float = 16.0, seed: int | None = None,
                       targets=None) -> int:
        """Allocate a slot with PEFT's initialisation (A uniform ±1/√in, B = 0) -> its id.

        targets: module names or groups ("attn", "mlp", "unembed", "all"); default all.
        """
        rank, alpha, targets = self._check_new_adapter(rank, alpha, targets)
        slot = self._free_slot()
        seed = self._seed * 1_000_003 + slot if seed is None else seed
        weights = lora_lib.init_slot(self.cfg, rank, self.max_rank, targets, seed)
        self._install(slot, AdapterInfo(rank, alpha, targets), weights)
        return slot

    def delete_adapter(self, adapter: int) -> None:
        """Free a slot: zero its weights, accumulator and optimizer state."""
        slot = self._check_adapter(adapter)
        info = self.adapters[slot]
        zeros = lora_lib.init_slot(self.cfg, 1, self.max_rank, (), 0)
        self._install(slot, info, zeros)
        del self.adapters[slot]
        scale = _host(self.scale).copy()
        scale[slot] = 0.0
        self.scale = self._replicated(scale)

    def adapter_weights(self, adapter: int) -> dict[str, np.ndarray]:
        """The adapter's weights: PEFT keys, torch layout, its own rank and targets."""
        slot = self._check_adapter(adapter)
        info = self.adapters[slot]
        return lora_lib.to_peft(self._slot_host(self.lora, slot), info.rank, info.targets,
                                self.cfg.num_layers)

    def gradients(self, adapter: int) -> dict[str, np.ndarray]:
        """The accumulated gradient (raw sum) in the layout of adapter_weights."""
        slot = self._check_adapter(adapter)
        info = self.adapters[slot]
        return lora_lib.to_peft(self._slot_host(self.acc, slot), info.rank, info.targets,
                                self.cfg.num_layers)

    def load_peft(self, path) -> int:
        """Import a PEFT LoRA folder into a free slot -> its id (targets are the folder's)."""
        from jcp import checkpoint

        rank, alpha, targets, weights = checkpoint.read_peft(path, self.cfg, self.max_rank)
        rank, alpha, targets = self._check_new_adapter(rank, alpha, targets)
        slot = self._free_slot()
        self._install(slot, AdapterInfo(rank, alpha, targets), weights)
        return slot

    def export_peft(self, adapter: int, path) -> None:
        """Write the adapter as a PEFT folder (adapter_config.json + adapter_model.safetensors)."""
        from jcp import checkpoint

        slot = self._check_adapter(adapter)
        checkpoint.write_peft(path, self.cfg, self.adapters[slot], self.adapter_weights(slot))

    # ------------------------------------------------------------------ steps

    def _prepare(self, data, loss_fn, loss_fn_config, adapters):
        """Validate everything and pack; no device work, nothing changed."""
        if isinstance(data, batch_lib.Datum) or not isinstance(data, Sequence):
            raise InputError("data must be a list of Datum")
        names = batch_lib.per_datum_losses(loss_fn, len(data))
        loss_cfg = self._loss_configs(sorted(set(names)), loss_fn_config)
        if isinstance(adapters, (int, np.integer)) and not isinstance(adapters, bool):
            per_datum = [self._check_adapter(adapters)] * len(data)
        elif isinstance(adapters, Sequence) and not isinstance(adapters, str):
            if len(adapters) != len(data):
                raise InputError(f"adapters has {len(adapters)} entries for {len(data)} datums")
            per_datum = [self._check_adapter(a, f"datum {i}: adapter")
                         for i, a in enumerate(adapters)]
        else:
            raise InputError(f"adapters must be an adapter id or one id per datum, got "
                             f"{adapters!r}")
        checked = batch_lib.validate(data, names, self.cfg.vocab_size, self.token_cap)
        packed = batch_lib.pack(checked, per_datum, self.dp, self.cp,
                                self.max_tokens_per_device, self.max_adapters)
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
                raise InputError(f"loss_fn_config: with losses {distinct}, its keys must be "
                                 f"loss names of the batch; got {sorted(extra)}")
            per_loss = {name: given.get(name) for name in distinct}
        return {name: {k: np.float32(v) for k, v in
                       losses_lib.resolve_config(name, per_loss[name]).items()}
                for name in distinct}

    def _device_batch(self, pb: batch_lib.PackedBatch) -> train_step.Batch:
        def put(x, spec):
            return jax.make_array_from_callback(x.shape, NamedSharding(self.mesh, spec),
                                                lambda idx: x[idx])
        specs = train_step.batch_specs()
        host = train_step.Batch(tokens=pb.tokens, targets=pb.targets, segment=pb.segment,
                                position=pb.position, loss_id=pb.loss_id,
                                weights=pb.floats["weights"],
                                advantages=pb.floats["advantages"],
                                logprobs=pb.floats["logprobs"], spans=pb.spans,
                                active=pb.active)
        return jax.tree.map(put, host, specs)

    def _run(self, data, loss_fn, loss_fn_config, adapters, backward: bool):
        checked, packed, cfg_arrays = self._prepare(data, loss_fn, loss_fn_config, adapters)
        loss_cfg = jax.tree.map(lambda v: self._replicated(np.asarray(v)), cfg_arrays)
        outputs: list[dict | None] = [None] * len(checked)
        total, clipped = 0.0, 0
        for pb in packed:
            b = self._device_batch(pb)
            kw = dict(loss_fns=pb.loss_fns, num_slots=pb.num_slots)
            if backward:
                self.acc, loss, out = self._forward_backward(
                    self.acc, self.lora, self.params, self.scale, b,
                    {k: loss_cfg[k] for k in pb.loss_fns}, **kw)
            else:
                loss, out = self._forward(self.lora, self.params, self.scale, b,
                                          {k: loss_cfg[k] for k in pb.loss_fns}, **kw)
            lp = batch_lib.unpack(_host(out.logprobs), pb)
            el = batch_lib.unpack(_host(out.elementwise_loss), pb)
            datum_loss = _host(out.datum_loss)
            members = sorted(p.index for p in pb.placements)
            for slot_i, j in enumerate(members):
                outputs[j] = {"logprobs": lp[j], "elementwise_loss": el[j],
                              "loss:sum": float(datum_loss[slot_i])}
            total += float(_host(loss))
            clipped += int(_host(out.clipped))
        metrics = {"loss:sum": total}
        if set(cfg_arrays) & set(losses_lib.CLIPPING_LOSSES):
            metrics["clipped_tokens:sum"] = clipped
        return ForwardBackwardOutput(loss_fn_outputs=outputs, metrics=metrics)

    def forward(self, data, loss_fn="cross_entropy", loss_fn_config=None,
                adapters=0) -> ForwardBackwardOutput:
        """Per-datum log-probs and losses; no gradient is touched.

        loss_fn: one Tinker loss for all datums, or one per datum (then loss_fn_config, if
        given, maps loss names to their settings). adapters: one id, or one per datum.
        """
        return self._run(data, loss_fn, loss_fn_config, adapters, backward=False)

    def forward_backward(self, data, loss_fn="cross_entropy", loss_fn_config=None,
                         adapters=0) -> ForwardBackwardOutput:
        """forward, and add the gradient of the summed loss into each adapter's accumulator."""
        return self._run(data, loss_fn, loss_fn_config, adapters, backward=True)

    def optim_step(self, adapter: int, adam: AdamParams | None = None) -> dict:
        """One AdamW step of one adapter on its accumulated gradient, then zero it."""
        slot = self._check_adapter(adapter)
        if adam is None:
            adam = AdamParams()
        if not isinstance(adam, AdamParams):
            raise InputError(f"adam must be jcp.AdamParams, got {type(adam).__name__}")
        hp = self._replicated(adam.checked())
        self.lora, self.acc, self.opt, metrics = self._optim_step(
            self.lora, self.acc, self.opt, self._replicated(np.asarray(slot, np.int32)), hp)
        m = {k: _host(v).item() for k, v in metrics.items()}
        return {"grad_norm": float(m["grad_norm"]), "learning_rate": float(m["learning_rate"]),
                "step": int(m["step"])}

    # ------------------------------------------------------------------ state

    def save_state(self, adapter: int, path) -> None:
        """Save weights, AdamW moments, step count and config of one adapter (orbax)."""
        from jcp import checkpoint

        checkpoint.save_state(self, self._check_adapter(adapter), path)

    def load_state(self, path, adapter: int | None = None, with_optimizer: bool = True) -> int:
        """Load a saved adapter into `adapter` (or a free slot) -> its id."""
        from jcp import checkpoint

        return checkpoint.load_state(self, path, adapter, with_optimizer)
