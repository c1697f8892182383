"""PEFT LoRA adapters: key names, the torch layout, and reading and writing folders.

Owns everything about the PEFT format: `base_model.model.…lora_A.weight` names, lora_A
[r, I] / lora_B [O, r] (torch layout), adapter_config.json and adapter_model.safetensors.
It must never accept a file it would read inexactly — a config option that changes what
the tensors mean, a tensor it would not use, a malformed file — and never write a partial
file where a complete one stood (files are written aside and renamed into place).

Shapes: see the legend in jcp/mesh.py. An adapter tree is {module: {"a": [L, I, r],
"b": [L, r, O]}} over its target modules (lm_head without L), r its own rank.
"""

from __future__ import annotations

import json
import math
import os
import tempfile

import numpy as np
from safetensors.numpy import save_file

from jcp import lora as lora_lib
from jcp.errors import InputError
from jcp.config import QwenConfig
from jcp.hf import SafetensorsFile

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


def peft_key(module: str, layer: int | None, which: str) -> str:
    """PEFT's tensor name of lora_A ("a") or lora_B ("b") of a module in a layer."""
    ab = {"a": "lora_A", "b": "lora_B"}[which]
    if module == lora_lib.HEAD:
        return f"base_model.model.lm_head.{ab}.weight"
    sub = "self_attn" if module in lora_lib.ATTN else "mlp"
    return f"base_model.model.model.layers.{layer}.{sub}.{module}.{ab}.weight"


def _layers(module: str, num_layers: int):
    return [None] if module == lora_lib.HEAD else range(num_layers)


def to_peft(tree: dict, rank: int, targets, num_layers: int) -> dict[str, np.ndarray]:
    """An adapter tree (at rank ≥ r) -> PEFT dict: lora_A [r, I], lora_B [O, r] of every
    target module and layer."""
    out = {}
    for m in targets:
        a, b = np.asarray(tree[m]["a"]), np.asarray(tree[m]["b"])
        for li in _layers(m, num_layers):
            al = a if li is None else a[li]
            bl = b if li is None else b[li]
            out[peft_key(m, li, "a")] = np.ascontiguousarray(al[:, :rank].T)
            out[peft_key(m, li, "b")] = np.ascontiguousarray(bl[:rank, :].T)
    return out


# peft's save_pretrained also writes the base unembedding when lm_head is a target
# (save_embedding_layers): loading such a folder restores that weight, so it is accepted
# only when it is this model's own.
BASE_HEAD_KEY = "base_model.model.lm_head.base_layer.weight"


def from_peft(tensors, cfg: QwenConfig, rank: int, targets, where: str,
              is_base_head=None) -> dict:
    """Inverse of to_peft: {PEFT name: array (or loader)} -> adapter tree at rank r.

    Accepts peft's on-disk names with or without the adapter name (".default.weight").
    Refuses (InputError naming `where` and the tensor) a missing, misshapen or non-finite
    tensor, and any tensor it would not use: a layer past the model's depth, a module
    outside `targets`, an unknown name. A saved base unembedding (BASE_HEAD_KEY, torch
    layout [V, D]) is accepted when is_base_head(array) says it equals this model's.
    """
    def plain(name):
        return name.replace(".default.weight", ".weight")

    by_name = {plain(n): n for n in tensors}
    tree, used = {}, set()
    for m in targets:
        i, o = lora_lib.module_dims(cfg, m)
        lead = () if m == lora_lib.HEAD else (cfg.num_layers,)
        tree[m] = {"a": np.zeros(lead + (i, rank), np.float32),
                   "b": np.zeros(lead + (rank, o), np.float32)}
        for li in _layers(m, cfg.num_layers):
            for which, want in (("a", (rank, i)), ("b", (o, rank))):
                key = peft_key(m, li, which)
                if key not in by_name:
                    raise InputError(f"{where}: tensor {key} is missing")
                used.add(key)
                t = tensors[by_name[key]]
                t = np.asarray(t() if callable(t) else t, np.float32)
                if t.shape != want:
                    raise InputError(f"{where}: tensor {key} has shape {t.shape}, expected "
                                     f"{want}")
                if not np.all(np.isfinite(t)):
                    raise InputError(f"{where}: tensor {key} has non-finite values")
                dst = tree[m][which] if li is None else tree[m][which][li]
                dst[...] = t.T
    if BASE_HEAD_KEY in by_name and lora_lib.HEAD in targets and is_base_head is not None:
        t = tensors[by_name[BASE_HEAD_KEY]]
        t = np.asarray(t() if callable(t) else t)
        if t.shape != (cfg.vocab_size, cfg.hidden_size) or not is_base_head(t):
            raise InputError(f"{where}: tensor {BASE_HEAD_KEY} is not this base model's "
                             "unembedding; jcp keeps the base weights frozen")
        used.add(BASE_HEAD_KEY)
    extra = sorted(set(by_name) - used)
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise InputError(f"{where}: tensor {by_name[extra[0]]}{more} is not used by an adapter "
                         f"of this model ({cfg.num_layers} layers, target modules "
                         f"{list(targets)}); refusing to drop it silently")
    return tree


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


def write_folder(path, cfg: QwenConfig, info, tree: dict) -> None:
    """A PEFT LoRA folder (adapter_config.json + adapter_model.safetensors) of an adapter
    tree; `info` has rank, alpha and targets."""
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
    weights = to_peft(tree, info.rank, info.targets, cfg.num_layers)
    _atomic_write(os.path.join(path, WEIGHTS_FILE),
                  lambda p: save_file({k: np.ascontiguousarray(v, np.float32)
                                       for k, v in weights.items()}, p,
                                      metadata={"format": "pt",
                                                "jcp_base_fingerprint": cfg.fingerprint()}))
    _atomic_write(os.path.join(path, CONFIG_FILE),
                  lambda p: open(p, "w").write(json.dumps(config, indent=2)))


def _read_config(cfg_path: str) -> dict:
    try:
        with open(cfg_path, encoding="utf-8") as f:
            pc = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(f"{cfg_path} is not valid JSON ({e})") from None
    if not isinstance(pc, dict):
        raise InputError(f"{cfg_path} must hold a JSON object, got {type(pc).__name__}")
    return pc


def read_folder(path, cfg: QwenConfig, max_rank: int, is_base_head=None):
    """Read a PEFT LoRA folder -> (rank, alpha, targets, adapter tree at rank r);
    is_base_head as in from_peft.

    Refuses (InputError) what jcp cannot represent exactly: per-module rank or alpha
    patterns, biases, modules_to_save, DoRA, unknown target modules, missing, misshapen or
    unused tensors, malformed files. use_rslora is honoured by folding √r into alpha.
    """
    path = os.fspath(path)
    cfg_path = os.path.join(path, CONFIG_FILE)
    w_path = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(cfg_path) or not os.path.isfile(w_path):
        raise InputError(f"{path} is not a PEFT folder: it needs {CONFIG_FILE} and {WEIGHTS_FILE}")
    pc = _read_config(cfg_path)
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
    if (not isinstance(targets, list) or not targets
            or not all(isinstance(t, str) and t in lora_lib.ALL_MODULES for t in targets)):
        raise InputError(f"{cfg_path}: target_modules {targets!r} must be a non-empty list, a "
                         f"subset of {list(lora_lib.ALL_MODULES)}")
    targets = lora_lib.resolve_targets(targets)
    try:
        f = SafetensorsFile(w_path)
    except ValueError as e:
        raise InputError(str(e)) from None
    tensors = {n: (lambda n: lambda: f.tensor(n))(n) for n in f.header}
    try:
        tree = from_peft(tensors, cfg, rank, targets, w_path, is_base_head)
    except ValueError as e:
        if isinstance(e, InputError):
            raise
        raise InputError(str(e)) from None
    return rank, alpha, targets, tree
