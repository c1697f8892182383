"""Hugging Face Qwen2/Qwen3 safetensors checkpoints (their configs: jcp.config).

Owns the mapping from Hugging Face names and layouts to jcp's base-parameter tree. It must
never materialise a full replicated copy of a weight on a device: `load_hf` returns lazy
tensors whose slices are read from memory-mapped files only when a device's shard is built
(`jax.make_array_from_callback` in model.params.place).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping

import ml_dtypes
import numpy as np

from jcp.config import QwenConfig, config_from_hf
from jcp.model import params as params_lib

# ----------------------------------------------------------------------------------------
# Lazy safetensors reading

_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F64": np.float64}


class SafetensorsFile:
    """Header of one .safetensors file; tensors come back as read-only memory maps.

    (safetensors' NumPy API cannot return bfloat16, so the documented format — u64 header
    length, JSON header, raw little-endian data — is read directly.)
    """

    def __init__(self, path: str):
        self.path = path
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if n < 2 or 8 + n > size:
                raise ValueError(
                    f"{path} is not a safetensors file (its header length does "
                    f"not fit the file's {size} bytes)"
                )
            try:
                header = json.loads(f.read(n))
            except (UnicodeDecodeError, json.JSONDecodeError):
                header = None
        if not isinstance(header, dict):
            raise ValueError(f"{path} is not a safetensors file (its header is not a JSON object)")
        header.pop("__metadata__", None)
        self.base = 8 + n
        for name, info in header.items():
            offsets = info.get("data_offsets") if isinstance(info, dict) else None
            if (
                not isinstance(offsets, list)
                or len(offsets) != 2
                or not all(isinstance(o, int) for o in offsets)
                or not 0 <= offsets[0] <= offsets[1]
                or self.base + offsets[1] > size
                or not isinstance(info.get("shape"), list)
            ):
                raise ValueError(
                    f"{path} is truncated or corrupt: tensor {name} lies outside "
                    f"the file's {size} bytes or has a malformed entry"
                )
        self.header = header

    def tensor(self, name: str) -> np.ndarray:
        info = self.header[name]
        if info["dtype"] not in _DTYPES:
            raise ValueError(f"{self.path}: tensor {name} has unsupported dtype {info['dtype']}")
        begin, end = info["data_offsets"]
        dt = np.dtype(_DTYPES[info["dtype"]])
        shape = tuple(info["shape"])
        if end - begin != int(np.prod(shape)) * dt.itemsize:
            raise ValueError(f"{self.path}: tensor {name} has a corrupt size")
        return np.memmap(self.path, dtype=dt, mode="r", offset=self.base + begin, shape=shape)


def _open_checkpoint(path: str) -> dict[str, Callable[[], np.ndarray]]:
    """{tensor name: loader} over a single-file or index-sharded safetensors folder."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        files = {}
        out = {}
        for name, fname in weight_map.items():
            if fname not in files:
                fpath = os.path.join(path, fname)
                if not os.path.isfile(fpath):
                    raise ValueError(f"checkpoint shard {fname} named in the index is missing")
                files[fname] = SafetensorsFile(fpath)
            if name not in files[fname].header:
                raise ValueError(f"tensor {name} is not in {fname} as the index says")
            out[name] = (lambda f, n: lambda: f.tensor(n))(files[fname], name)
        return out
    paths = sorted(p for p in os.listdir(path) if p.endswith(".safetensors"))
    if not paths:
        raise ValueError(f"no .safetensors files in {path}")
    out = {}
    for p in paths:
        f = SafetensorsFile(os.path.join(path, p))
        for name in f.header:
            out[name] = (lambda f, n: lambda: f.tensor(n))(f, name)
    return out


class LazyTensor:
    """A jcp-layout tensor whose slices are read from the checkpoint on demand.

    `read(index)` receives a tuple of slices (one per axis) and returns that block.
    """

    def __init__(self, shape, dtype, read):
        self.shape = tuple(shape)
        self.dtype = np.dtype(dtype)
        self.ndim = len(self.shape)
        self._read = read

    def __getitem__(self, index):
        if not isinstance(index, tuple):
            index = (index,)
        index = index + (slice(None),) * (self.ndim - len(index))
        index = tuple(slice(*s.indices(n)) for s, n in zip(index, self.shape))
        return self._read(index)

    def __array__(self, dtype=None, copy=None):
        out = self[()]
        return out if dtype is None else out.astype(dtype)


def _hf_layer_names(module: str, layer: int) -> str:
    attn = {"q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"}
    bias = {"q_bias": "q_proj", "k_bias": "k_proj", "v_bias": "v_proj"}
    if module in bias:
        return f"model.layers.{layer}.self_attn.{bias[module]}.bias"
    if module in attn:
        return f"model.layers.{layer}.self_attn.{module}.weight"
    if module == "input_norm":
        return f"model.layers.{layer}.input_layernorm.weight"
    if module == "post_norm":
        return f"model.layers.{layer}.post_attention_layernorm.weight"
    if module == "router":
        return f"model.layers.{layer}.mlp.gate.weight"
    if module in ("shared_gate", "shared_up", "shared_down"):
        return f"model.layers.{layer}.mlp.shared_expert.{module[7:]}_proj.weight"
    return f"model.layers.{layer}.mlp.{module}.weight"


def hf_params(cfg: QwenConfig, tensors: Mapping[str, Callable[[], np.ndarray]]) -> dict:
    """jcp's base tree of LazyTensors over Hugging Face tensors (name -> loader).

    Projections are transposed from torch's [out, in] to [in, out]; layers are stacked on a
    leading L axis. Every tensor is checked for presence and shape before anything is read.
    """
    shapes = params_lib.param_shapes(cfg)
    r = _Reader(cfg, tensors)
    out = {
        "embed": r.plain("model.embed_tokens.weight", shapes["embed"]),
        "final_norm": r.plain("model.norm.weight", shapes["final_norm"]),
        "layers": {k: r.stacked(k, s) for k, s in shapes["layers"].items()},
    }
    if cfg.is_hybrid:
        out.update(_hybrid_tensors(cfg, shapes, r.stacked, r.fetch))
        # Qwen3.5's RMSNorms hold offsets (x · (1 + w)); jcp's hold the factor 1 + w.
        # (The gated norm of Gated DeltaNet is a plain one.)
        out["final_norm"] = _plus_one(out["final_norm"])
        out["layers"] = {
            k: _plus_one(t) if k.endswith("_norm") else t for k, t in out["layers"].items()
        }
        if "full_attn" in out:
            out["full_attn"] = {
                k: _plus_one(t) if k.endswith("_norm") else t for k, t in out["full_attn"].items()
            }
    if cfg.is_moe:
        out.update(_moe_mlps(cfg, shapes, r))
    if "lm_head" in shapes:
        out["lm_head"] = r.plain("lm_head.weight", shapes["lm_head"], transpose=True)
    r.check_all_used()
    return out


class _Reader:
    """hf_params' reads of one checkpoint's tensors: each one checked for presence and
    shape when asked for (`fetch`), wrapped as a LazyTensor (`plain`, or `stacked` over
    layers), and remembered, so that `check_all_used` can refuse the rest."""

    def __init__(self, cfg: QwenConfig, tensors: Mapping[str, Callable[[], np.ndarray]]):
        self.cfg, self.tensors = cfg, tensors
        self.used: set[str] = set()

    def fetch(self, name, want):
        self.used.add(name)
        if name not in self.tensors:
            raise ValueError(f"checkpoint is missing tensor {name}")
        arr = self.tensors[name]()
        if tuple(arr.shape) != tuple(want):
            raise ValueError(
                f"checkpoint tensor {name} has shape {tuple(arr.shape)}, "
                f"expected {tuple(want)} for this config"
            )
        return arr

    def plain(self, name, shape, transpose=False) -> LazyTensor:
        hf_shape = shape[::-1] if transpose else shape
        arr = self.fetch(name, hf_shape)

        def read(index):
            if transpose:
                return np.asarray(arr[index[::-1]]).T.astype(np.float32)
            return np.asarray(arr[index]).astype(np.float32)

        return LazyTensor(shape, np.float32, read)

    def stacked(self, module, shape, layer_ids=None) -> LazyTensor:
        layer_ids = list(range(self.cfg.num_layers)) if layer_ids is None else layer_ids
        per_layer = shape[1:]
        transpose = len(per_layer) == 2
        arrs = [
            self.fetch(_hf_layer_names(module, i), per_layer[::-1] if transpose else per_layer)
            for i in layer_ids
        ]

        def read(index):
            li, rest = index[0], index[1:]
            blocks = []
            for i in range(*li.indices(len(layer_ids))):
                a = arrs[i]
                blocks.append(np.asarray(a[rest[::-1]]).T if transpose else np.asarray(a[rest]))
            return np.stack(blocks).astype(np.float32)

        return LazyTensor(shape, np.float32, read)

    def check_all_used(self) -> None:
        """A tensor the config does not account for (an o_proj bias, extra layers, …) means
        the checkpoint is not the model jcp would compute: refuse rather than ignore it."""
        ignorable = {"lm_head.weight"} if self.cfg.tie_word_embeddings else set()
        extra = sorted(
            n
            for n in self.tensors
            if n not in self.used and n not in ignorable and not n.endswith("rotary_emb.inv_freq")
        )
        if extra:
            more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
            raise ValueError(
                f"checkpoint has tensor {extra[0]}{more}, which this config does not describe"
            )


def _moe_mlps(cfg: QwenConfig, shapes: dict, r: _Reader) -> dict:
    """{"dense_mlp" (where some layers are dense), "moe_mlp"}: the router, experts and
    shared expert of the MoE layers, the dense MLPs of the others."""
    kinds = cfg.moe_layers
    dense_ids = [i for i, k in enumerate(kinds) if not k]
    moe_ids = [i for i, k in enumerate(kinds) if k]
    out = {}
    if dense_ids:
        out["dense_mlp"] = {k: r.stacked(k, s, dense_ids) for k, s in shapes["dense_mlp"].items()}
    out["moe_mlp"] = {"router": r.stacked("router", shapes["moe_mlp"]["router"], moe_ids)}
    out["moe_mlp"].update(_expert_tensors(cfg, moe_ids, r.tensors, r.fetch))
    out["moe_mlp"].update(
        {
            k: r.stacked(k, shapes["moe_mlp"][k], moe_ids)
            for k in shapes["moe_mlp"]
            if k.startswith("shared_")
        }
    )
    return out


def _plus_one(t: LazyTensor) -> LazyTensor:
    return LazyTensor(t.shape, np.float32, lambda index: np.asarray(t[index]) + np.float32(1))


def _stack(per_layer: list) -> LazyTensor:
    """[L, …] LazyTensor over per-layer LazyTensors."""

    def read(index):
        li, rest = index[0], index[1:]
        return np.stack(
            [np.asarray(per_layer[i][rest]) for i in range(*li.indices(len(per_layer)))]
        ).astype(np.float32)

    return LazyTensor((len(per_layer),) + per_layer[0].shape, np.float32, read)


def _rows_t(arr, r0: int, r1: int, squeeze_mid: bool = False) -> LazyTensor:
    """Rows r0:r1 of a torch [out, in] (or conv [out, 1, Kc]) tensor, transposed: [in, r1−r0]."""
    inner = arr.shape[-1]

    def read(index):
        ii, oi = index
        o0, o1, step = oi.indices(r1 - r0)
        rows = slice(r0 + o0, r0 + o1, step)
        block = arr[rows, 0, ii] if squeeze_mid else arr[rows, ii]
        return np.asarray(block).T.astype(np.float32)

    return LazyTensor((inner, r1 - r0), np.float32, read)


def _hybrid_tensors(cfg: QwenConfig, shapes, stacked, fetch) -> dict:
    """full_attn [Lf, …] (self_attn.*) and linear_attn [Ll, …] (linear_attn.*) of a
    Qwen3.5 checkpoint; in_proj_qkv and conv1d are cut into their q, k, v parts."""
    out = {}
    kinds = cfg.linear_layers
    full_ids = [i for i, k in enumerate(kinds) if not k]
    lin_ids = [i for i, k in enumerate(kinds) if k]
    if full_ids:
        out["full_attn"] = {k: stacked(k, s, full_ids) for k, s in shapes["full_attn"].items()}
    d, kd, vd = cfg.hidden_size, cfg.linear_key_dim, cfg.linear_value_dim
    hv, kc = cfg.linear_num_value_heads, cfg.linear_conv_kernel_dim
    parts = {"q": (0, kd), "k": (kd, 2 * kd), "v": (2 * kd, 2 * kd + vd)}
    per = {k: [] for k in shapes["linear_attn"]}
    for i in lin_ids:
        pre = f"model.layers.{i}.linear_attn"
        qkv = fetch(f"{pre}.in_proj_qkv.weight", (2 * kd + vd, d))
        conv = fetch(f"{pre}.conv1d.weight", (2 * kd + vd, 1, kc))
        for p, (r0, r1) in parts.items():
            per[f"in_proj_{p}"].append(_rows_t(qkv, r0, r1))
            per[f"conv_{p}"].append(_rows_t(conv, r0, r1, squeeze_mid=True))
        for m, rows in (("in_proj_z", vd), ("in_proj_b", hv), ("in_proj_a", hv)):
            per[m].append(_rows_t(fetch(f"{pre}.{m}.weight", (rows, d)), 0, rows))
        per["out_proj"].append(_rows_t(fetch(f"{pre}.out_proj.weight", (d, vd)), 0, d))
        for m, name, n in (
            ("dt_bias", "dt_bias", hv),
            ("a_log", "A_log", hv),
            ("gated_norm", "norm.weight", cfg.linear_value_head_dim),
        ):
            arr = fetch(f"{pre}.{name}", (n,))
            per[m].append(
                LazyTensor((n,), np.float32, lambda index, a=arr: np.asarray(a[index], np.float32))
            )
    out["linear_attn"] = {k: _stack(v) for k, v in per.items()}
    return out


def _expert_tensors(cfg: QwenConfig, moe_ids, tensors, fetch) -> dict:
    """expert_gate / expert_up [Lm, E, D, F] and expert_down [Lm, E, F, D] as LazyTensors.

    Each MoE layer is read from transformers 5's fused tensors (`mlp.experts.gate_up_proj`
    [E, 2F, D], gate rows first; `mlp.experts.down_proj` [E, D, F]) when present, else from
    the per-expert names of published checkpoints (`mlp.experts.{e}.gate_proj.weight`
    [F, D], …). A device's block reads only its own experts' rows.
    """
    e, d, f = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    # sources[part][layer][expert] -> (torch-layout [out, in] array, row offset)
    sources = {"expert_gate": [], "expert_up": [], "expert_down": []}
    for i in moe_ids:
        prefix = f"model.layers.{i}.mlp.experts"
        if f"{prefix}.gate_up_proj" in tensors:
            gate_up = fetch(f"{prefix}.gate_up_proj", (e, 2 * f, d))
            down = fetch(f"{prefix}.down_proj", (e, d, f))
            sources["expert_gate"].append([(gate_up[x], 0) for x in range(e)])
            sources["expert_up"].append([(gate_up[x], f) for x in range(e)])
            sources["expert_down"].append([(down[x], 0) for x in range(e)])
            continue
        for part, (name, hf_shape) in {
            "expert_gate": ("gate_proj", (f, d)),
            "expert_up": ("up_proj", (f, d)),
            "expert_down": ("down_proj", (d, f)),
        }.items():
            sources[part].append(
                [(fetch(f"{prefix}.{x}.{name}.weight", hf_shape), 0) for x in range(e)]
            )

    def lazy(part, shape):
        def read(index):
            li, ei, ii, oi = index
            out = [
                [
                    np.asarray(src[oi.start + off : oi.stop + off : oi.step, ii]).T
                    for src, off in sources[part][l][ei]
                ]
                for l in range(*li.indices(len(moe_ids)))
            ]
            return np.asarray(out, np.float32).reshape(
                (len(out), len(range(*ei.indices(e))))
                + (len(range(*ii.indices(shape[2]))), len(range(*oi.indices(shape[3]))))
            )

        return LazyTensor(shape, np.float32, read)

    lm = len(moe_ids)
    return {
        "expert_gate": lazy("expert_gate", (lm, e, d, f)),
        "expert_up": lazy("expert_up", (lm, e, d, f)),
        "expert_down": lazy("expert_down", (lm, e, f, d)),
    }


def load_hf(path, dtype: str = "float32") -> tuple[QwenConfig, dict]:
    """(config, base parameters) from a Hugging Face folder: config.json + *.safetensors.

    The parameters are LazyTensors in jcp's layout: pass them to `Trainer(base_params=…)`
    (or `model.place`), which reads each device's slice straight from the memory-mapped
    files. Raises ValueError for an unknown architecture, a missing tensor or a shape
    mismatch.
    """
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise ValueError(f"{path} is not a Hugging Face model folder")
    cfg = config_from_hf(path, dtype=dtype)
    return cfg, hf_params(cfg, text_model_tensors(_open_checkpoint(path)))


TEXT_PREFIX = "model.language_model."


def text_model_tensors(tensors: dict) -> dict:
    """The causal LM's tensors of a checkpoint: unchanged for a causal LM; for an image-text
    one (Qwen3_5ForConditionalGeneration, config.MULTIMODAL) its language model's, renamed
    model.language_model.X -> model.X, with lm_head — the vision tower (model.visual.*) and
    any multi-token-prediction head (mtp.*) are left unread."""
    if not any(n.startswith(TEXT_PREFIX) for n in tensors):
        return tensors
    return {
        ("model." + n[len(TEXT_PREFIX) :] if n.startswith(TEXT_PREFIX) else n): t
        for n, t in tensors.items()
        if n.startswith(TEXT_PREFIX) or n.startswith("lm_head.")
    }
