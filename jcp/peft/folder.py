"""PEFT adapter folders: adapter_config.json and adapter_model.safetensors written (aside,
then renamed into place) and read back, refusing any file jcp would read inexactly — a
config option that changes what the tensors mean, a tensor it would not use, a malformed
file.
"""

from __future__ import annotations

import json
import math
import os
import re

import numpy as np
from safetensors.numpy import save_file

from jcp import lora as lora_lib
from jcp.config import QwenConfig
from jcp.errors import InputError
from jcp.files import atomic_write
from jcp.hf import SafetensorsFile
from jcp.peft.experts import DOWN, GATE_UP, GATE_UP_PATTERN, VLLM_EXPERT, moe_layer_ids
from jcp.peft.tensors import from_peft, peft_key, to_peft, to_vllm, tree_rank
from jcp.peft_options import TENSOR_MEANING_OPTIONS

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# What PEFT can name in target_modules (the expert modules are parameters, not modules).
PEFT_MODULES = lora_lib.ATTN + lora_lib.MLP + lora_lib.LINEAR + (lora_lib.HEAD,)
# Spellings of target_parameters that select exactly that parameter of every MoE layer.
_PARAM_NAMES = {
    n: full
    for full in (GATE_UP, DOWN)
    for n in (full, full.removeprefix("mlp."), full.rpartition(".")[2])
}


def _config(info, target_modules) -> dict:
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": info.rank,
        "lora_alpha": info.alpha,
        "target_modules": list(target_modules),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "layers_to_transform": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "init_lora_weights": True,
        "base_model_name_or_path": None,
        "inference_mode": True,
    }


def _write(path, cfg: QwenConfig, config: dict, weights: dict) -> None:
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    atomic_write(
        os.path.join(path, WEIGHTS_FILE),
        lambda p: save_file(
            {k: np.ascontiguousarray(v, np.float32) for k, v in weights.items()},
            p,
            metadata={"format": "pt", "jcp_base_fingerprint": cfg.fingerprint()},
        ),
    )
    atomic_write(os.path.join(path, CONFIG_FILE), json.dumps(config, indent=2))


def check_export_path(path, what: str) -> str:
    """path as a str where a folder can be written, or InputError naming `what`: not a
    path, a NUL byte, a component longer than the file-name limit, or an existing
    non-folder at the path or above it. Nothing is created."""
    try:
        path = os.fspath(path)
    except TypeError:
        raise InputError(f"{what} must be a path, got {type(path).__name__}") from None
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    if not path or "\0" in path:
        raise InputError(f"{what} {path!r} is empty or holds a NUL byte")
    for part in path.split(os.sep):
        if len(os.fsencode(part)) > 255:
            raise InputError(f"{what}: the name {part[:20]!r}... is longer than 255 bytes")
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        where = "" if probe == os.path.abspath(path) else f" (at {probe!r})"
        raise InputError(f"{what} {path!r} exists and is not a folder{where}")
    return path


def write_folder(path, cfg: QwenConfig, info, tree: dict) -> None:
    """A PEFT LoRA folder (adapter_config.json + adapter_model.safetensors) of an adapter
    tree; `info` has rank, alpha and targets.

    Expert modules (either parameterisation) are written as peft's target_parameters on
    the fused experts (experts_to_peft); with gate and up both targeted, gate_up is at rank
    2r and alpha 2·alpha through rank_pattern / alpha_pattern (same scale, exact), which
    peft 0.21 honours for target_parameters.
    """
    experts = [m for m in info.targets if m in lora_lib.EXPERT]
    config = _config(info, [m for m in info.targets if m not in lora_lib.EXPERT])
    if experts:
        gate_up = [m for m in ("expert_gate", "expert_up") if m in experts]
        config["target_parameters"] = ([GATE_UP] if gate_up else []) + (
            [DOWN] if "expert_down" in experts else []
        )
        if len(gate_up) == 2 and info.expert_lora != "fused_gate_up":
            config["rank_pattern"] = {GATE_UP_PATTERN: 2 * info.rank}
            config["alpha_pattern"] = {GATE_UP_PATTERN: 2 * info.alpha}
    _write(path, cfg, config, to_peft(tree, info.rank, info.targets, cfg.num_layers, cfg=cfg))


def write_vllm_folder(path, cfg: QwenConfig, info, tree: dict) -> None:
    """A LoRA folder in the per-expert 2-D layout vLLM loads for Qwen3-MoE (to_vllm):
    target_modules name the experts' gate_proj, up_proj, down_proj (plus the attention and
    lm_head targets), one rank and alpha, no target_parameters. peft on transformers 5
    reads it too (it fuses the experts as write_folder does). jcp does not read it back."""
    modules = [m for m in info.targets if m not in lora_lib.EXPERT]
    if set(info.targets) & set(lora_lib.EXPERT):
        modules += [VLLM_EXPERT[m] for m in lora_lib.EXPERT]
    _write(path, cfg, _config(info, modules), to_vllm(tree, info.rank, info.targets, cfg))


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
    """Read a PEFT LoRA folder -> (rank, alpha, targets, adapter tree at that rank);
    is_base_head as in from_peft.

    Refuses (InputError) what jcp cannot represent exactly: per-module rank or alpha
    patterns, biases, modules_to_save, DoRA, unknown target modules, missing, misshapen or
    unused tensors, malformed files. use_rslora is honoured by folding √r into alpha.
    On a MoE model the experts come from target_parameters (GATE_UP and / or DOWN, any
    other is refused) and are read per expert (from_peft); dense MLP modules in
    target_modules are refused unless every factor pair of theirs in the file changes
    nothing (a zero lora_B or lora_A), and then left out: peft 0.22 writes them so when it
    saves an adapter it read in vLLM's per-expert layout (target_modules gate_proj,
    up_proj, down_proj also wrap the dense MLP of a model's dense layers, at their
    initial, zero lora_B);
    rank_pattern / alpha_pattern may set the fused gate_up's rank and alpha only, at the
    adapter's scale (_gate_up_rank). The rank is r unless gate and up need more.
    """
    cfg_path, w_path = _folder_files(path)
    pc = _read_config(cfg_path)
    _refuse_options(pc, cfg_path, cfg.is_moe)
    rank, alpha, file_alpha = _rank_and_alpha(pc, cfg_path, max_rank)
    targets, gate_up_rank, dense_mlp = _targets(pc, cfg, cfg_path, rank, file_alpha)
    tree = _read_tensors(w_path, cfg, rank, targets, is_base_head, gate_up_rank, dense_mlp)
    full, alpha = _whole_rank(tree, rank, alpha, max_rank, cfg_path)
    return full, alpha, targets, tree


def _folder_files(path) -> tuple[str, str]:
    """(config path, weights path) of a PEFT folder; InputError unless both exist."""
    path = os.fspath(path)
    cfg_path = os.path.join(path, CONFIG_FILE)
    w_path = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(cfg_path) or not os.path.isfile(w_path):
        raise InputError(f"{path} is not a PEFT folder: it needs {CONFIG_FILE} and {WEIGHTS_FILE}")
    return cfg_path, w_path


def _refuse_options(pc: dict, cfg_path: str, moe: bool) -> None:
    """InputError for every adapter_config option that changes what the tensors mean."""
    if pc.get("peft_type", "LORA") != "LORA":
        raise InputError(f"{cfg_path}: peft_type {pc.get('peft_type')!r} is not LORA")
    for key in ("rank_pattern", "alpha_pattern"):
        if pc.get(key) and not moe:
            raise InputError(f"{cfg_path}: {key} is not supported (one rank and alpha per adapter)")
    for key in TENSOR_MEANING_OPTIONS:
        if pc.get(key) and not (moe and key == "target_parameters"):
            raise InputError(f"{cfg_path}: {key} is not supported")
    if pc.get("bias", "none") != "none":
        raise InputError(f"{cfg_path}: bias {pc.get('bias')!r} is not supported")
    if pc.get("use_dora"):
        raise InputError(f"{cfg_path}: DoRA is not supported")


def _rank_and_alpha(pc: dict, cfg_path: str, max_rank: int) -> tuple[int, float, float]:
    """(r, alpha with rsLoRA's √r folded in, lora_alpha as the file has it)."""
    rank = pc.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise InputError(f"{cfg_path}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise InputError(f"{cfg_path}: rank {rank} exceeds max_rank {max_rank} of this Trainer")
    alpha = pc.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise InputError(f"{cfg_path}: lora_alpha must be a finite number, got {alpha!r}")
    file_alpha = alpha
    alpha = float(alpha)
    if pc.get("use_rslora"):
        alpha = alpha * math.sqrt(rank)  # rsLoRA scales by alpha/√r = (alpha·√r)/r
    return rank, alpha, file_alpha


def _targets(pc: dict, cfg: QwenConfig, cfg_path: str, rank: int, file_alpha):
    """(jcp target modules, the fused gate_up's rank or None, the dense MLP modules a MoE
    folder names, whose factors must change nothing: _inert_dense_mlp) of target_modules
    and, on a MoE model, target_parameters."""
    moe = cfg.is_moe
    targets = pc.get("target_modules")
    if isinstance(targets, str):
        raise InputError(
            f"{cfg_path}: target_modules as a pattern ({targets!r}) is not "
            "supported; list the modules"
        )
    params = _target_parameters(pc.get("target_parameters"), cfg_path) if moe else []
    if params and targets is None:
        targets = []
    if (
        not isinstance(targets, list)
        or not (targets or params)
        or not all(isinstance(t, str) and t in PEFT_MODULES for t in targets)
    ):
        raise InputError(
            f"{cfg_path}: target_modules {targets!r} must be a non-empty list, a "
            f"subset of {list(PEFT_MODULES)}"
        )
    if not moe:
        try:
            return lora_lib.resolve_targets(targets, cfg), None, []
        except ValueError as e:
            raise InputError(f"{cfg_path}: {e}") from None
    dense_mlp = sorted(set(targets) & set(lora_lib.MLP))
    targets = [t for t in targets if t not in dense_mlp]
    if dense_mlp and not (targets or params):
        raise InputError(_dense_mlp_refusal(cfg_path, f"target_modules {dense_mlp}"))
    gate_up_rank = _gate_up_rank(pc, cfg, cfg_path, rank, file_alpha, targets, params)
    experts = (("expert_gate", "expert_up") if GATE_UP in params else ()) + (
        ("expert_down",) if DOWN in params else ()
    )
    return lora_lib.resolve_targets(list(targets) + list(experts), cfg), gate_up_rank, dense_mlp


def _dense_mlp_refusal(where: str, what) -> str:
    return (
        f"{where}: {what} adapts a dense MLP, which jcp does not adapt on a "
        "mixture-of-experts model; its experts are read from target_parameters "
        f"{[GATE_UP, DOWN]} (per-expert 2-D adapters, as vLLM and transformers 4 name "
        "them, are not read)"
    )


def _inert_dense_mlp(tensors: dict, cfg: QwenConfig, dense_mlp, w_path: str) -> dict:
    """tensors without the factors of the dense MLP modules `dense_mlp` (a MoE folder's:
    _targets), each layer's pair checked to change nothing (lora_B or lora_A all zeros);
    InputError naming the first that does."""
    out = dict(tensors)
    for m in dense_mlp:
        for i in range(cfg.num_layers):
            keys = [peft_key(m, i, which) for which in ("a", "b")]
            if not any(k in out for k in keys):
                continue
            missing = [k for k in keys if k not in out]
            if missing:
                raise InputError(f"{w_path}: {missing[0]} is missing")
            a, b = (out.pop(k)() for k in keys)
            if np.any(a != 0) and np.any(b != 0):
                raise InputError(_dense_mlp_refusal(w_path, f"tensor {keys[1]}, not zero,"))
    return out


def _read_tensors(
    w_path: str, cfg: QwenConfig, rank: int, targets, is_base_head, gate_up_rank, dense_mlp=()
) -> dict:
    """The adapter tree of the safetensors file (from_peft), the factors of a MoE folder's
    dense MLP modules left out once checked to change nothing (_inert_dense_mlp);
    InputError naming the file."""
    try:
        f = SafetensorsFile(w_path)
    except ValueError as e:
        raise InputError(str(e)) from None
    tensors = {n: (lambda n: lambda: f.tensor(n))(n) for n in f.header}
    try:
        tensors = _inert_dense_mlp(tensors, cfg, dense_mlp, w_path)
        return from_peft(tensors, cfg, rank, targets, w_path, is_base_head, gate_up_rank)
    except ValueError as e:
        if isinstance(e, InputError):
            raise
        raise InputError(str(e)) from None


def _whole_rank(tree: dict, rank: int, alpha: float, max_rank: int, cfg_path: str):
    """(the tree's rank, alpha at it): r, unless a fused gate_up that is not jcp's
    block-diagonal form makes gate and up each keep its whole rank — every other module
    then zero-padded to it, alpha keeping alpha / rank."""
    full = tree_rank(tree)
    if full == rank:
        return full, alpha
    if full > max_rank:
        raise InputError(
            f"{cfg_path}: the experts' gate and up take rank {full} each "
            f"(the fused gate_up's, not jcp's block-diagonal form), which "
            f"exceeds max_rank {max_rank} of this Trainer"
        )
    return full, alpha * full / rank


def _target_parameters(names, cfg_path: str) -> list[str]:
    """A MoE folder's target_parameters -> the fused expert parameters it names (GATE_UP,
    DOWN); InputError for anything else."""
    if names is None or names == []:
        return []
    if not isinstance(names, list) or not all(
        isinstance(n, str) and n in _PARAM_NAMES for n in names
    ):
        raise InputError(
            f"{cfg_path}: target_parameters {names!r} is not supported; jcp "
            f"reads the experts of every MoE layer, {[GATE_UP, DOWN]}"
        )
    return sorted({_PARAM_NAMES[n] for n in names})


def _gate_up_rank(
    pc: dict, cfg: QwenConfig, cfg_path: str, rank: int, alpha, modules, params
) -> int | None:
    """The fused gate_up's rank under rank_pattern / alpha_pattern (None: not targeted).

    Patterns resolve as peft resolves them (the first key whose regex matches the whole
    name or a dotted suffix of it; module names as in the base model, "model.layers.1.
    self_attn.q_proj", parameters as "model.layers.1.mlp.experts.gate_up_proj"). Every
    target but gate_up must keep the adapter's r and alpha; gate_up may take any rank k
    whose scale equals the adapter's (alpha_k / k, or / √k under rsLoRA), the same in
    every layer — jcp's own export is k = 2r, alpha 2·alpha.
    """
    patterns = {}
    for key in ("rank_pattern", "alpha_pattern"):
        p = pc.get(key) or {}
        if not isinstance(p, dict):
            raise InputError(f"{cfg_path}: {key} must be an object, got {p!r}")
        patterns[key] = p

    def resolve(name):
        out = []
        for key, default in (("rank_pattern", rank), ("alpha_pattern", alpha)):
            for p, value in patterns[key].items():
                try:
                    hit = re.match(rf"(.*\.)?({p})$", name)
                except re.error as e:
                    raise InputError(
                        f"{cfg_path}: {key} key {p!r} is not a regular expression ({e})"
                    ) from None
                if hit:
                    out.append(value)
                    break
            else:
                out.append(default)
        return tuple(out)

    ids = moe_layer_ids(cfg)
    names = (
        [
            peft_key(m, i, "a").removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            for m in modules
            if m in lora_lib.ATTN + lora_lib.LINEAR
            for i in lora_lib.module_layer_ids(cfg, m)
        ]
        + (["lm_head"] if lora_lib.HEAD in modules else [])
        + [f"model.layers.{i}.{DOWN}" for i in ids if DOWN in params]
    )
    for name in names:
        if resolve(name) != (rank, alpha):
            raise InputError(
                f"{cfg_path}: rank_pattern / alpha_pattern give {name} rank and "
                f"alpha {resolve(name)}, not the adapter's ({rank}, {alpha}); jcp "
                f"holds one rank and alpha per adapter (a pattern may set only "
                f"{GATE_UP}, at the adapter's scale)"
            )
    if GATE_UP not in params:
        return None
    got = {resolve(f"model.layers.{i}.{GATE_UP}") for i in ids}
    if len(got) > 1:
        raise InputError(
            f"{cfg_path}: rank_pattern / alpha_pattern give {GATE_UP} different "
            f"ranks or alphas in different layers {sorted(got)}"
        )
    ((k, a),) = got
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise InputError(
            f"{cfg_path}: rank_pattern gives {GATE_UP} rank {k!r}, not a positive integer"
        )
    if isinstance(a, bool) or not isinstance(a, (int, float)) or not math.isfinite(a):
        raise InputError(
            f"{cfg_path}: alpha_pattern gives {GATE_UP} alpha {a!r}, not a finite number"
        )
    norm = math.sqrt if pc.get("use_rslora") else float
    if not math.isclose(a / norm(k), alpha / norm(rank), rel_tol=1e-9):
        raise InputError(
            f"{cfg_path}: {GATE_UP} at rank {k}, alpha {a} has another scale "
            f"than the adapter's (rank {rank}, alpha {alpha}); jcp holds one "
            "scale per adapter"
        )
    return k
