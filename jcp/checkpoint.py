"""Adapter files: PEFT import/export and orbax adapter state.

Owns the on-disk formats of one adapter. It must never write a partial file where a
complete one stood (files are written aside and renamed into place) and never change
trainer state when a file is refused.

Legend: L layers; I, O in/out features; R max rank; r the adapter's own rank.
"""

from __future__ import annotations

import functools
import json
import math
import os
import shutil
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from safetensors.numpy import save_file

from jcp import lora as lora_lib
from jcp.batch import InputError
from jcp.config import QwenConfig
from jcp.hf import _SafetensorsFile

PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"


def _atomic_write(path: str, write) -> None:
    """write(tmp_path) beside `path`, then rename it into place."""
    d = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=d, prefix=".tmp-", suffix=os.path.basename(path))
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_peft(path, cfg: QwenConfig, info, weights: dict[str, np.ndarray]) -> None:
    """A PEFT LoRA folder: adapter_config.json + adapter_model.safetensors."""
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": info.rank,
        "lora_alpha": info.alpha, "target_modules": list(info.targets), "lora_dropout": 0.0,
        "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
        "modules_to_save": None, "layers_to_transform": None, "rank_pattern": {},
        "alpha_pattern": {}, "init_lora_weights": True, "base_model_name_or_path": None,
        "inference_mode": True,
    }
    _atomic_write(os.path.join(path, PEFT_WEIGHTS),
                  lambda p: save_file({k: np.ascontiguousarray(v, np.float32)
                                       for k, v in weights.items()}, p,
                                      metadata={"format": "pt",
                                                "jcp_base_fingerprint": cfg.fingerprint()}))
    _atomic_write(os.path.join(path, PEFT_CONFIG),
                  lambda p: open(p, "w").write(json.dumps(config, indent=2)))


def read_peft(path, cfg: QwenConfig, max_rank: int):
    """Read a PEFT LoRA folder -> (rank, alpha, targets, slot weights zero-padded to max_rank).

    Refuses (InputError) what jcp cannot represent exactly: per-module rank or alpha
    patterns, biases, modules_to_save, DoRA, unknown target modules, missing or misshapen
    tensors. use_rslora is honoured by folding √r into alpha.
    """
    path = os.fspath(path)
    cfg_path = os.path.join(path, PEFT_CONFIG)
    w_path = os.path.join(path, PEFT_WEIGHTS)
    if not os.path.isfile(cfg_path) or not os.path.isfile(w_path):
        raise InputError(f"{path} is not a PEFT folder: it needs {PEFT_CONFIG} and {PEFT_WEIGHTS}")
    with open(cfg_path) as f:
        pc = json.load(f)
    if pc.get("peft_type", "LORA") != "LORA":
        raise InputError(f"{cfg_path}: peft_type {pc.get('peft_type')!r} is not LORA")
    for key in ("rank_pattern", "alpha_pattern"):
        if pc.get(key):
            raise InputError(f"{cfg_path}: {key} is not supported (one rank and alpha per adapter)")
    # Each of these changes what the tensors mean (a bias on lora_B, a transposed layout,
    # other layers or parameters); read as plain LoRA they would give silently wrong results.
    for key in ("modules_to_save", "layers_to_transform", "layers_pattern", "lora_bias",
                "fan_in_fan_out", "layer_replication", "target_parameters",
                "trainable_token_indices", "alora_invocation_tokens", "use_qalora"):
        if pc.get(key):
            raise InputError(f"{cfg_path}: {key} is not supported")
    if pc.get("bias", "none") != "none":
        raise InputError(f"{cfg_path}: bias {pc.get('bias')!r} is not supported")
    if pc.get("use_dora"):
        raise InputError(f"{cfg_path}: DoRA is not supported")
    rank = pc.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise InputError(f"{cfg_path}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise InputError(f"{cfg_path}: rank {rank} exceeds max_rank {max_rank} of this Trainer")
    alpha = pc.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise InputError(f"{cfg_path}: lora_alpha must be a finite number, got {alpha!r}")
    alpha = float(alpha)
    if pc.get("use_rslora"):
        alpha = alpha * math.sqrt(rank)  # rsLoRA scales by alpha/√r = (alpha·√r)/r
    targets = pc.get("target_modules")
    if isinstance(targets, str):
        raise InputError(f"{cfg_path}: target_modules as a pattern ({targets!r}) is not "
                         "supported; list the modules")
    unknown = [t for t in targets or [] if t not in lora_lib.ALL_MODULES]
    if unknown or not targets:
        raise InputError(f"{cfg_path}: target_modules {targets!r} must be a non-empty subset "
                         f"of {list(lora_lib.ALL_MODULES)}")
    targets = lora_lib.resolve_targets(targets)

    f = _SafetensorsFile(w_path)
    weights = lora_lib.init_slot(cfg, rank, max_rank, (), 0)  # zeros
    for m in targets:
        i, o = lora_lib.module_dims(cfg, m)
        layers = [None] if m == lora_lib.HEAD else range(cfg.num_layers)
        for li in layers:
            for which, want in (("a", (rank, i)), ("b", (o, rank))):
                key = lora_lib.peft_key(m, li, which)
                name = key if key in f.header else key.replace(".weight", ".default.weight")
                if name not in f.header:
                    raise InputError(f"{w_path}: tensor {key} is missing")
                t = np.asarray(f.tensor(name), np.float32)
                if t.shape != want:
                    raise InputError(f"{w_path}: tensor {key} has shape {t.shape}, expected {want}")
                if not np.all(np.isfinite(t)):
                    raise InputError(f"{w_path}: tensor {key} has non-finite values")
                dst = weights[m][which] if li is None else weights[m][which][li]
                if which == "a":
                    dst[:, :rank] = t.T
                else:
                    dst[:rank, :] = t.T
    return rank, alpha, targets, weights


# ----------------------------------------------------------------------------------------
# orbax adapter state

STATE_FORMAT = 1


def _sans_slot(spec):
    """The PartitionSpec of one slot: the slot table's spec without its leading G axis."""
    return P(*tuple(spec)[1:])


def _state_layout(tr, info) -> dict:
    """{module: {"a"/"b": (shape at the adapter's rank, PartitionSpec)}} of its targets."""
    shapes = lora_lib.slot_shapes(tr.cfg, 1, info.rank)
    specs = lora_lib.slot_specs()
    return {m: {ab: (shapes[m][ab][1:], _sans_slot(specs[m][ab])) for ab in ("a", "b")}
            for m in info.targets}


def _crop(x, rank, which):
    return x[..., :rank] if which == "a" else x[..., :rank, :]


def _slot_state(tr, slot: int, info) -> dict:
    """Device arrays of one slot at its own rank: weights, moments, count (global arrays)."""
    layout = _state_layout(tr, info)
    shardings = {m: {ab: NamedSharding(tr.mesh, spec) for ab, (_, spec) in v.items()}
                 for m, v in layout.items()}

    @functools.partial(jax.jit, static_argnums=(1,),
                       out_shardings=(shardings, shardings, shardings))
    def extract(trees, rank, slot):
        return tuple({m: {ab: _crop(t[m][ab][slot], rank, ab) for ab in ("a", "b")}
                      for m in layout} for t in trees)

    weights, mu, nu = extract((tr.lora, tr.opt.mu, tr.opt.nu), info.rank,
                              tr._replicated(np.asarray(slot, np.int32)))
    count = tr._replicated(np.asarray(np.asarray(tr.opt.count.addressable_data(0))[slot],
                                      np.int32))
    return {"weights": weights, "mu": mu, "nu": nu, "count": count}


def _checkpointer():
    return ocp.Checkpointer(ocp.CompositeCheckpointHandler())


def save_state(tr, slot: int, path) -> None:
    """Save one adapter with orbax: weights at its rank, AdamW moments, step count, its
    config and the base-model fingerprint, as global arrays (loadable under any mesh).

    Written aside and moved into place (orbax finalizes atomically; an existing checkpoint
    at `path` is replaced only after the new one is complete), so an interrupted save never
    damages the previous checkpoint.
    """
    info = tr.adapters[slot]
    path = os.path.abspath(os.fspath(path))
    state = _slot_state(tr, slot, info)
    meta = {"format": STATE_FORMAT, "rank": info.rank, "alpha": info.alpha,
            "targets": list(info.targets), "base_fingerprint": tr.cfg.fingerprint(),
            "max_rank_saved": info.rank}
    staging = path + ".jcp-staging"
    primary = jax.process_index() == 0
    if primary and os.path.exists(staging):
        shutil.rmtree(staging)
    _sync("jcp-save-clean")
    _checkpointer().save(staging, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))
    _sync("jcp-save-written")
    if primary:
        old = path + ".jcp-old"
        if os.path.exists(path):
            os.replace(path, old)
        os.replace(staging, path)
        if os.path.exists(old):
            shutil.rmtree(old)
    _sync("jcp-save-done")


def _sync(name: str) -> None:
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def read_state_meta(path) -> dict:
    path = os.path.abspath(os.fspath(path))
    if not os.path.isdir(path):
        raise InputError(f"no adapter checkpoint at {path}")
    try:
        meta = _checkpointer().restore(path, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
    except Exception as e:  # orbax raises several types for a foreign folder
        raise InputError(f"{path} is not a jcp adapter checkpoint ({e})") from None
    meta = meta["meta"]
    if not isinstance(meta, dict) or meta.get("format") != STATE_FORMAT:
        raise InputError(f"{path} is not a jcp adapter checkpoint of format {STATE_FORMAT}")
    return meta


def load_state(tr, path, adapter=None, with_optimizer: bool = True) -> int:
    """Load a checkpoint of save_state into `adapter` (allocated) or a free slot -> its id.

    Refused (InputError, nothing changed) when the base-model config differs or the rank
    exceeds this trainer's max_rank. with_optimizer=False loads the weights only (fresh
    moments, step 0). The slot's gradient accumulator is zeroed.
    """
    from jcp.trainer import AdapterInfo

    path = os.path.abspath(os.fspath(path))
    meta = read_state_meta(path)
    if meta["base_fingerprint"] != tr.cfg.fingerprint():
        raise InputError(f"{path} was saved for a different base model (fingerprint "
                         f"{meta['base_fingerprint']}, this trainer's {tr.cfg.fingerprint()})")
    rank, alpha, targets = tr._check_new_adapter(meta["rank"], meta["alpha"], meta["targets"])
    slot = tr._free_slot() if adapter is None else tr._check_adapter(adapter)
    info = AdapterInfo(rank, alpha, targets)

    layout = _state_layout(tr, info)
    abstract_tree = {m: {ab: jax.ShapeDtypeStruct(shape, jnp.float32,
                                                  sharding=NamedSharding(tr.mesh, spec))
                         for ab, (shape, spec) in v.items()} for m, v in layout.items()}
    abstract = {"weights": abstract_tree, "mu": abstract_tree, "nu": abstract_tree,
                "count": jax.ShapeDtypeStruct((), jnp.int32,
                                              sharding=NamedSharding(tr.mesh, P()))}
    state = _checkpointer().restore(path, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract)))["state"]

    zeros = jax.tree.map(jnp.zeros_like, state["weights"])
    mu, nu = (state["mu"], state["nu"]) if with_optimizer else (zeros, zeros)
    count = int(np.asarray(state["count"].addressable_data(0))) if with_optimizer else 0
    slot_arr = tr._replicated(np.asarray(slot, np.int32))
    tr.lora = _put_slot(tr.lora, slot_arr, state["weights"])
    tr.acc = _put_slot(tr.acc, slot_arr, zeros)
    tr.opt = type(tr.opt)(mu=_put_slot(tr.opt.mu, slot_arr, mu),
                          nu=_put_slot(tr.opt.nu, slot_arr, nu),
                          count=tr._replicated(tr._count_host(slot, count)))
    scale = np.asarray(tr.scale.addressable_data(0)).copy()
    scale[slot] = info.scale
    tr.scale = tr._replicated(scale)
    tr.adapters[slot] = info
    return slot


@functools.partial(jax.jit, donate_argnums=(0,))
def _put_slot(tree_G, slot, small):
    """Write one slot from arrays at the adapter's rank: zero-pad to max rank; modules
    absent from `small` (not targeted) become zero."""
    out = {}
    for m, ab in tree_G.items():
        out[m] = {}
        for which, x in ab.items():
            full = jnp.zeros(x.shape[1:], x.dtype)
            if m in small:
                v = small[m][which]
                full = jax.lax.dynamic_update_slice(full, v.astype(x.dtype), (0,) * v.ndim)
            out[m][which] = x.at[slot].set(full)
    return out
