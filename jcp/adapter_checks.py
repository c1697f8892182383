"""The refusals of the Trainer's adapter calls: an adapter id that names an allocated
adapter (`allocated`), a new adapter's rank, alpha, targets and expert parameterisation
(`new_adapter`), an initialisation seed (`seed`), a slot id (`slot_id`).

Each raises InputError before any work, so a refused call changes nothing; alpha is
checked in float32, the dtype the device uses. Pure host checks: it never reads or writes
adapter state (jcp.adapter_state) — the caller passes in what it checks against.
"""

from __future__ import annotations

import numpy as np

from jcp import lora as lora_lib
from jcp.adapter_state import AdapterInfo
from jcp.config import QwenConfig
from jcp.errors import InputError, float32_number


def _is_int(x) -> bool:
    return not isinstance(x, (bool, np.bool_)) and isinstance(x, (int, np.integer))


def allocated(infos, adapter, what: str = "adapter") -> int:
    """The slot of `adapter` if infos (adapter id -> AdapterInfo) holds it."""
    if not _is_int(adapter):
        raise InputError(f"{what} must be an adapter id (int), got {adapter!r}")
    if int(adapter) not in infos:
        raise InputError(
            f"{what} {adapter} is not an allocated adapter; allocated: {sorted(infos)}"
        )
    return int(adapter)


def new_adapter(
    cfg: QwenConfig, max_rank: int, expert_lora_modes, rank, alpha, targets, expert_lora
) -> AdapterInfo:
    """The AdapterInfo of a new adapter of `cfg`'s model in slots of max_rank that hold
    expert_lora_modes. expert_lora applies only when an expert module is targeted (None
    otherwise)."""
    if not _is_int(rank) or rank < 1:
        raise InputError(f"rank must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise InputError(f"rank {rank} exceeds max_rank {max_rank} of this Trainer")
    alpha = float32_number(alpha, "alpha")
    if alpha <= 0:
        raise InputError(f"alpha must be > 0, got {alpha}")
    try:
        targets = lora_lib.resolve_targets(targets, cfg)
    except ValueError as e:
        raise InputError(str(e)) from None
    if not set(targets) & set(lora_lib.EXPERT):
        expert_lora = None
    elif expert_lora not in lora_lib.EXPERT_LORA:
        raise InputError(f"expert_lora must be one of {lora_lib.EXPERT_LORA}, got {expert_lora!r}")
    elif expert_lora == "fused_gate_up" and not {"expert_gate", "expert_up"} <= set(targets):
        raise InputError(
            "expert_lora 'fused_gate_up' ties expert_up's A to expert_gate's: "
            f"target both, got {sorted(set(targets) & set(lora_lib.EXPERT))}"
        )
    elif expert_lora not in expert_lora_modes:
        raise InputError(
            f"a {expert_lora!r} adapter of the experts does not fit this "
            f"Trainer's slots (expert_lora_modes={expert_lora_modes}); build it with "
            f"expert_lora_modes including {expert_lora!r}"
        )
    return AdapterInfo(int(rank), alpha, targets, expert_lora)


def seed(value) -> int | None:
    """An adapter's initialisation seed: None, or a non-negative integer."""
    if value is not None and (not _is_int(value) or value < 0):
        raise InputError(f"seed must be a non-negative integer, got {value!r}")
    return None if value is None else int(value)


def slot_id(adapter, max_adapters: int) -> int:
    """A slot id in [0, max_adapters), allocated or not."""
    if not _is_int(adapter) or not 0 <= adapter < max_adapters:
        raise InputError(f"adapter must be a slot id in [0, {max_adapters}), got {adapter!r}")
    return int(adapter)
