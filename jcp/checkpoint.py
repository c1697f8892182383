"""Adapter files: PEFT import/export and orbax adapter state.

Owns the on-disk formats of one adapter. It must never write a partial file where a
complete one stood (files are written aside and renamed into place) and never change
trainer state when a file is refused.

Legend: L layers; I, O in/out features; R max rank; r the adapter's own rank.
"""

from __future__ import annotations

import json
import math
import os
import tempfile

import numpy as np
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
        "jcp_base_fingerprint": cfg.fingerprint(),
    }
    _atomic_write(os.path.join(path, PEFT_WEIGHTS),
                  lambda p: save_file({k: np.ascontiguousarray(v, np.float32)
                                       for k, v in weights.items()}, p,
                                      metadata={"format": "pt"}))
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
    for key in ("modules_to_save", "layers_to_transform", "layers_pattern"):
        if pc.get(key):
            raise InputError(f"{cfg_path}: {key} is not supported")
    if pc.get("bias", "none") != "none":
        raise InputError(f"{cfg_path}: bias {pc.get('bias')!r} is not supported")
    if pc.get("use_dora"):
        raise InputError(f"{cfg_path}: DoRA is not supported")
    rank = pc.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise InputError(f"{cfg_path}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise InputError(f"{cfg_path}: rank {rank} exceeds max_rank {max_rank} of this Trainer")
    alpha = float(pc.get("lora_alpha", 8))
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
