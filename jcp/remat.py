"""remat="auto": whether a forward_backward program recomputes activations in its backward.

Owns the decision and what it reads: an estimate of a program's per-device bytes without
recomputation that compiles nothing (`estimate`), XLA's memory analysis of a compiled one
(`program_bytes`), measured decisions kept beside JAX's persistent compilation cache
(`RematStore`), and the budget from a device's memory (`default_budget`). The Trainer
calls `decide` once per compiled program shape; nothing here runs a step.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os

import jax
import numpy as np

from jcp import files
from jcp.config import QwenConfig
from jcp.mesh import device_memory

# A forward_backward program's per-device bytes without recomputation lie within MARGIN× of
# estimate's (0.76–1.23× on small dense Qwen3 shapes, 1.8× on the tiny MoE;
# tests/test_trainer_config.py checks the tiny model): where the budget is beyond that band
# on either side, the estimate decides. Mixture-of-experts and hybrid layers are estimated
# more loosely.
MARGIN = 2.0
MARGIN_LOOSE = 4.0


def decide(cfg: QwenConfig, tp: int, max_rank: int, budget: int, args, s_len: int, compile_, store):
    """(the program without recomputation if it was compiled here, else None; the decision
    {"remat", "bytes", "budget", "estimate", "how"}). how: "estimate" (no program compiled
    to decide: estimate() is clearly within or beyond the budget), "cached" (an earlier
    process's measured decision, from `store`: a RematStore or None) or "measured" (the
    program without recomputation compiled by compile_(False), kept iff XLA's memory
    analysis of it fits)."""
    est = estimate(cfg, s_len, tp, max_rank, args)
    decision = {"budget": budget, "estimate": est}
    margin = MARGIN_LOOSE if cfg.is_moe or cfg.is_hybrid else MARGIN
    if est * margin <= budget or est / margin > budget:
        return None, {**decision, "remat": est / margin > budget, "bytes": est, "how": "estimate"}
    cached = store.read() if store else None
    if cached is not None:
        return None, {**decision, **cached, "how": "cached"}
    program = compile_(False)
    need = program_bytes(program)
    decision.update(remat=need > budget, bytes=need, how="measured")
    if store:
        store.write({"remat": decision["remat"], "bytes": need})
    return (None if decision["remat"] else program), decision


def program_bytes(compiled) -> int:
    """Per-device bytes of a compiled program by XLA's memory analysis: arguments, outputs
    and temporaries, donated (aliased) buffers counted once."""
    m = compiled.memory_analysis()
    return int(
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        + m.temp_size_in_bytes
        - m.alias_size_in_bytes
    )


def placed_bytes(args) -> int:
    """Per-device bytes of the arrays in `args` as placed (host arrays: their size)."""
    placed = 0
    for x in jax.tree.leaves(args):
        if isinstance(x, jax.Array):
            placed += int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize
        else:
            placed += np.asarray(x).nbytes
    return placed


def estimate(cfg: QwenConfig, s_len: int, tp: int, max_rank: int, args) -> int:
    """An estimate of a forward_backward program's per-device bytes without recomputation,
    compiling nothing: its arguments as placed (weights, slot tables, the batch), plus what
    the backward keeps of each layer for each of the S rows, counted in fp32 (a bf16 model
    keeps much of it in fp32: norms, attention outputs, LoRA products) — 16 × the hidden
    size D (the residual stream, norms and their inputs), 3 × the attention's q, k, v and
    output widths ((Hq + 2·Hkv)·head_dim / tp), 3 × the MLP width (intermediate / tp; a MoE
    layer's routed experts' k · moe_intermediate and the shared expert) and the 7 modules'
    LoRA products (rank R) — plus the log-prob chunk's fp32 logits and their gradient. The
    coefficients are fitted to XLA's memory analysis of small Qwen3 shapes (fp32 and bf16,
    tp 1 and 2), which it matches within MARGIN (tests/test_trainer_config.py checks it)."""
    placed = placed_bytes(args)
    heads = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim // tp
    mlp = (
        cfg.num_experts_per_tok * cfg.moe_intermediate_size + cfg.shared_expert_intermediate_size
        if cfg.is_moe
        else cfg.intermediate_size
    ) // tp
    per_row_layer = 4 * (16 * cfg.hidden_size + 3 * heads + 3 * mlp + 7 * max_rank)
    logits = 3 * 4 * min(s_len, 1024) * cfg.vocab_size // tp
    return placed + cfg.num_layers * s_len * per_row_layer + logits


class RematStore:
    """remat="auto"'s measured decisions on disk, beside JAX's persistent compilation cache
    (jax_compilation_cache_dir; none without one): one JSON file per program, named by a
    hash of everything the program's memory depends on — the program key (batch shapes,
    losses, slot counts, modules), the model config, the mesh and its devices, the step
    settings, the budget, the JAX version and jcp's own source. A custom loss's programs
    are not stored (its key holds the loss object)."""

    def __init__(self, path: str):
        self.path = path

    @classmethod
    def open(cls, key, cfg: QwenConfig, mesh, step_cfg, budget: int) -> RematStore | None:
        folder = jax.config.jax_compilation_cache_dir
        if not folder or key[4] is not None:
            return None
        dev = mesh.devices.flat[0]
        text = repr(
            (
                key,
                cfg,
                *(mesh.shape[a] for a in mesh.axis_names),
                dev.platform,
                dev.device_kind,
                jax.process_count(),
                step_cfg,
                budget,
                jax.__version__,
                source_hash(),
            )
        )
        name = hashlib.sha256(text.encode()).hexdigest()[:32]
        return cls(os.path.join(folder, "jcp-remat", name + ".json"))

    def read(self) -> dict | None:
        try:
            with open(self.path, encoding="utf-8") as f:
                got = json.load(f)
        except (OSError, ValueError):
            return None
        ok = (
            isinstance(got, dict)
            and isinstance(got.get("remat"), bool)
            and type(got.get("bytes")) is int
        )
        return {"remat": got["remat"], "bytes": got["bytes"]} if ok else None

    def write(self, decision: dict) -> None:
        try:
            os.makedirs(os.path.dirname(self.path), mode=0o700, exist_ok=True)
            files.atomic_write(self.path, json.dumps(decision))
        except OSError:
            pass  # an unwritable cache costs a compile next time, nothing else


@functools.cache
def source_hash() -> str:
    """A hash of jcp's Python source: a decision measured under other code is not reused."""
    root = os.path.dirname(os.path.abspath(__file__))
    h = hashlib.sha256()
    for folder, _, names in sorted(os.walk(root)):
        for n in sorted(names):
            if n.endswith(".py"):
                with open(os.path.join(folder, n), "rb") as f:
                    h.update(n.encode() + b"\0" + f.read())
    return h.hexdigest()


def default_budget(mesh) -> int:
    """90% of a device's memory limit (mesh.device_memory)."""
    return int(0.9 * device_memory(mesh)[0])


# adapter_memory="auto": this share of a device's free memory once the base model is placed.
