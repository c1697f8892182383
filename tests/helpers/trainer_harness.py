"""Shared pieces of the Trainer tests: the tiny config, batches that mix adapters, PEFT
folders written from NumPy, state snapshots, and one cached Trainer per mesh.

Compiling a forward_backward program dominates the run time (seconds per loss and mesh),
so the Trainers are cached per mesh shape for the whole session: tests that reuse a
Trainer with a batch of the same shapes (same S bucket, same number of active adapters)
hit its jit cache. Every test that borrows a cached Trainer frees the slots it allocated
(`borrowed`), so the next test finds it empty.

Legend: N tokens of a datum; r an adapter's own rank; I, O in/out features.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import types

import jax
import numpy as np
from safetensors.numpy import save_file

import jcp

CFG = jcp.QwenConfig.tiny()
MAX_RANK = 8
# Small blocks and chunks so every stream spans several attention blocks and log-prob chunks.
TRAINER_KW = dict(max_adapters=4, max_rank=MAX_RANK, attn_block=16, logprob_chunk=16)
LOSS_NAMES = ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro")
# Non-default settings that put the clip boundaries among the ratios of the data below.
LOSS_CONFIGS = {
    "cross_entropy": None,
    "importance_sampling": None,
    "ppo": {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1},
    "cispo": {"clip_low_threshold": 0.92, "clip_high_threshold": 1.08},
    "dro": {"beta": 0.5},
}

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
ALL = ATTN + MLP + ("lm_head",)

# Three adapters of different ranks, scalings and target sets (two adapt the unembedding).
ADAPTERS = {
    "p": dict(rank=2, alpha=4.0, targets=ALL, seed=11),
    "q": dict(rank=8, alpha=8.0, targets=ATTN + ("lm_head",), seed=12),
    "r": dict(rank=4, alpha=16.0, targets=MLP, seed=13),
}

# Ragged lengths (none a multiple of 2·cp for every cp), two one-token datums.
LENGTHS = (37, 1, 20, 64, 5, 1, 13)
ASSIGN = ("p", "q", "r", "p", "q", "r", "q")
# Two halves of the batch above; each holds all three adapters and needs the same S bucket.
HALVES = ((0, 2, 6), (1, 3, 4, 5))


# ----------------------------------------------------------------------------------------
# Data


def random_data(lengths, seed=0, vocab=CFG.vocab_size, lp_center=None):
    """Datums carrying every loss field. Sampling log-probs sit near the model's (≈ −log V)
    so the importance ratios straddle the clip thresholds."""
    rng = np.random.default_rng(seed)
    center = -np.log(vocab) if lp_center is None else lp_center
    out = []
    for n in lengths:
        out.append(
            jcp.Datum(
                model_input=rng.integers(0, vocab, n),
                loss_fn_inputs={
                    "target_tokens": rng.integers(0, vocab, n),
                    "weights": rng.uniform(0.0, 1.5, n).astype(np.float32),
                    "advantages": rng.normal(size=n).astype(np.float32),
                    "logprobs": (center + 0.1 * rng.normal(size=n)).astype(np.float32),
                },
            )
        )
    return out


# ----------------------------------------------------------------------------------------
# PEFT folders


def peft_key(module: str, layer, which: str) -> str:
    """The PEFT state-dict key (written here, not taken from jcp, to stay independent)."""
    if module == "lm_head":
        return f"base_model.model.lm_head.lora_{which}.weight"
    sub = "self_attn" if module in ATTN else "mlp"
    return f"base_model.model.model.layers.{layer}.{sub}.{module}.lora_{which}.weight"


def module_dims(cfg, module):
    d, f = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {
        "q_proj": (d, q),
        "k_proj": (d, kv),
        "v_proj": (d, kv),
        "o_proj": (q, d),
        "gate_proj": (d, f),
        "up_proj": (d, f),
        "down_proj": (f, d),
        "lm_head": (d, cfg.vocab_size),
    }[module]


def random_peft_weights(cfg, rank, targets, seed, b_std=0.05) -> dict[str, np.ndarray]:
    """PEFT-layout weights: lora_A [r, in] ~ U(±1/√in), lora_B [out, r] ~ N(0, b_std)."""
    rng = np.random.default_rng(seed)
    out = {}
    for m in targets:
        i, o = module_dims(cfg, m)
        for layer in [None] if m == "lm_head" else range(cfg.num_layers):
            a = rng.uniform(-1, 1, (rank, i)) / np.sqrt(i)
            out[peft_key(m, layer, "A")] = a.astype(np.float32)
            out[peft_key(m, layer, "B")] = (b_std * rng.normal(size=(o, rank))).astype(np.float32)
    return out


def write_peft(path, rank, alpha, targets, weights, **extra) -> str:
    """A PEFT LoRA folder as peft's save_pretrained writes it (config + safetensors)."""
    os.makedirs(path, exist_ok=True)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": list(targets),
        "lora_dropout": 0.0,
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "fan_in_fan_out": False,
    }
    config.update(extra)
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    save_file(weights, os.path.join(path, "adapter_model.safetensors"), metadata={"format": "pt"})
    return os.fspath(path)


@functools.cache
def adapter_folders(root: str) -> dict[str, str]:
    """The three ADAPTERS as PEFT folders with non-zero B (so A gets a gradient)."""
    out = {}
    for name, spec in ADAPTERS.items():
        w = random_peft_weights(CFG, spec["rank"], spec["targets"], spec["seed"])
        out[name] = write_peft(
            os.path.join(root, name), spec["rank"], spec["alpha"], spec["targets"], w
        )
    return out


def load_adapters(tr, folders, names=("p", "q", "r")) -> dict[str, int]:
    return {n: tr.load_peft(folders[n]) for n in names}


# ----------------------------------------------------------------------------------------
# Trainers and state


@functools.cache
def trainer(mesh_shape, **kw) -> jcp.Trainer:
    """One Trainer per (mesh, settings) for the session, on CFG's seed-0 random base."""
    tr = jcp.Trainer(CFG, jcp.make_mesh(*mesh_shape), **{**TRAINER_KW, **kw})
    assert (tr.dp, tr.cp, tr.tp) == tuple(mesh_shape)
    return tr


@contextlib.contextmanager
def borrowed(tr):
    """Use a cached Trainer; afterwards free every slot allocated meanwhile."""
    before = set(tr.adapters)
    try:
        yield tr
    finally:
        for a in sorted(set(tr.adapters) - before):
            tr.delete_adapter(a)


def by_slot(table: dict, pages_GK: np.ndarray) -> dict:
    """A paged table ({module: {key: [P, …, r]}}) as one row per slot [G, …, K·r], page k
    of a slot its rank columns [k·r, (k+1)·r), a page index ≥ P zeros (NumPy, written
    apart from jcp.lora.gather_pages)."""

    def one(which, x):
        padded = np.concatenate([x, np.zeros_like(x[:1])])
        g = padded[np.minimum(pages_GK, len(x))]  # [G, K, …, r]
        ax = x.ndim - 1 if which.startswith("a") else x.ndim - 2
        g = np.moveaxis(g, 1, ax)
        return g.reshape(g.shape[:ax] + (-1,) + g.shape[ax + 2 :])

    return {m: {k: one(k, x) for k, x in ab.items()} for m, ab in table.items()}


def snapshot(tr) -> dict:
    """Everything a refused call must leave alone, as host copies: the raw tables, and
    the weights, accumulators and moments one row per slot (by_slot)."""
    tables = jax.tree.map(np.array, jax.device_get(tr.state.tables()))
    slot = {k: by_slot(tables[k], tables["pages"]) for k in ("weights", "grads", "mu", "nu")}
    return {
        "adapters": dict(tr.adapters),
        "weights": {a: tr.adapter_weights(a) for a in tr.adapters},
        "grads": {a: tr.gradients(a) for a in tr.adapters},
        "tables": tables,
        "opt": types.SimpleNamespace(mu=slot["mu"], nu=slot["nu"], count=tables["count"]),
        "scale": tables["scale"],
        "lora": slot["weights"],
        "acc": slot["grads"],
    }


def assert_same_state(a: dict, b: dict) -> None:
    """Bit-identical snapshots (NaN-free by construction, so array_equal is exact)."""
    assert a["adapters"] == b["adapters"]
    for part in ("weights", "grads"):
        assert a[part].keys() == b[part].keys()
        for ad in a[part]:
            assert a[part][ad].keys() == b[part][ad].keys()
            for k in a[part][ad]:
                np.testing.assert_array_equal(
                    a[part][ad][k], b[part][ad][k], err_msg=f"{part} of adapter {ad}: {k}"
                )
    la, lb = jax.tree.leaves_with_path(a["tables"]), jax.tree.leaves_with_path(b["tables"])
    assert [p for p, _ in la] == [p for p, _ in lb]
    for (path, x), (_, y) in zip(la, lb):
        np.testing.assert_array_equal(x, y, err_msg=f"tables{jax.tree_util.keystr(path)}")


# ----------------------------------------------------------------------------------------
# Comparisons


def max_abs(d: dict) -> float:
    return max(float(np.max(np.abs(v))) for v in d.values())


def assert_grads_close(got: dict, want: dict, rtol: float, atol_frac: float, what: str):
    """Per PEFT key: |got − want| ≤ atol_frac·max|want| (over the adapter) + rtol·|want|."""
    assert got.keys() == want.keys(), f"{what}: keys differ"
    scale = max_abs(want)
    assert scale > 0, f"{what}: the reference gradient is zero"
    for k in want:
        np.testing.assert_allclose(
            got[k], want[k], rtol=rtol, atol=atol_frac * scale, err_msg=f"{what}: {k}"
        )


def assert_outputs_close(got, want, rtol: float, atol: float, what: str):
    """Per-datum logprobs, elementwise_loss, loss:sum and metrics of two outputs."""
    assert len(got.loss_fn_outputs) == len(want.loss_fn_outputs)
    lp_scale = max(float(np.max(np.abs(o["logprobs"]))) for o in want.loss_fn_outputs)
    el_scale = max(float(np.max(np.abs(o["elementwise_loss"]))) for o in want.loss_fn_outputs)
    for i, (g, w) in enumerate(zip(got.loss_fn_outputs, want.loss_fn_outputs)):
        assert g["logprobs"].shape == w["logprobs"].shape, f"{what}: datum {i} length"
        np.testing.assert_allclose(
            g["logprobs"],
            w["logprobs"],
            rtol=rtol,
            atol=atol * lp_scale,
            err_msg=f"{what}: datum {i} logprobs",
        )
        np.testing.assert_allclose(
            g["elementwise_loss"],
            w["elementwise_loss"],
            rtol=rtol,
            atol=atol * el_scale,
            err_msg=f"{what}: datum {i} elementwise_loss",
        )
        np.testing.assert_allclose(
            g["loss:sum"],
            w["loss:sum"],
            rtol=rtol,
            atol=atol * el_scale * len(w["logprobs"]),
            err_msg=f"{what}: datum {i} loss:sum",
        )
    assert got.metrics.keys() == want.metrics.keys()
    n_tokens = sum(len(o["logprobs"]) for o in want.loss_fn_outputs)
    np.testing.assert_allclose(
        got.metrics["loss:sum"],
        want.metrics["loss:sum"],
        rtol=rtol,
        atol=atol * el_scale * n_tokens,
        err_msg=f"{what}: loss:sum",
    )
    if "clipped_tokens:sum" in want.metrics:
        assert got.metrics["clipped_tokens:sum"] == want.metrics["clipped_tokens:sum"], what


def traces_and_compiles(fn):
    """(fn(), the JAX trace and XLA compile events it caused, in order)."""
    events = []
    record = lambda name, secs, **kw: events.append(name)  # noqa: E731
    jax.monitoring.register_event_duration_secs_listener(record)
    try:
        out = fn()
    finally:
        jax.monitoring.unregister_event_duration_listener(record)
    return out, [e for e in events if "trace" in e or "backend_compile" in e]
