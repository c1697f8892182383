"""The Qwen2/Qwen3 decoder as a per-shard function (runs inside the one shard_map).

Owns the base-parameter tree (names, shapes, PartitionSpecs), its random initialisation
and placement, and the forward pass from tokens to final hidden states. The layer is
built from two blocks, attention and MLP, and the differing piece of each use is passed
in: the attention strategy (`attend`, see attention.Attend: training's CP attention, or
prefill / decode over a KV cache) and the MLP block (dense SwiGLU, or an MoE block with
the same signature). It must never compute the unembedding's full logits (losses.py does
that, chunked) and never update base weights: they are frozen and not differentiated.

Shapes: see the legend in jcp/mesh.py. Under tp, the q/k/v projections hold this rank's
Q/tp and K/tp heads (widths Q·H and K·H), gate/up/down F/tp.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from jcp import attention as attention_lib
from jcp import lora as lora_lib
from jcp.config import QwenConfig
from jcp.mesh import SPECS, TP

# Layer modules in the stacked `layers` tree: name -> spec field.
COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW = ("o_proj", "down_proj")


def param_shapes(cfg: QwenConfig) -> dict:
    """The base-parameter tree as shapes. Projections are stored [in, out] (x @ W)."""
    L, d, f, v = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    layers = {
        "input_norm": (L, d), "post_norm": (L, d),
        "q_proj": (L, d, cfg.q_dim), "k_proj": (L, d, cfg.kv_dim), "v_proj": (L, d, cfg.kv_dim),
        "o_proj": (L, cfg.q_dim, d),
        "gate_proj": (L, d, f), "up_proj": (L, d, f), "down_proj": (L, f, d),
    }
    if cfg.attention_bias:
        layers.update(q_bias=(L, cfg.q_dim), k_bias=(L, cfg.kv_dim), v_bias=(L, cfg.kv_dim))
    if cfg.qk_norm:
        layers.update(q_norm=(L, cfg.head_dim), k_norm=(L, cfg.head_dim))
    out = {"embed": (v, d), "final_norm": (d,), "layers": layers}
    if not cfg.tie_word_embeddings:
        out["lm_head"] = (d, v)
    return out


def param_specs(cfg: QwenConfig) -> dict:
    """The PartitionSpec of every base parameter, from the one table in mesh.py."""
    def layer_spec(name):
        if name in COLUMN:
            return SPECS.column_LxDxO
        if name in ROW:
            return SPECS.row_LxIxD
        if name.endswith("_bias"):
            return SPECS.column_bias_LxO
        return SPECS.norm_LxD

    shapes = param_shapes(cfg)
    out = {"embed": SPECS.embed_VxD, "final_norm": SPECS.norm_D,
           "layers": {k: layer_spec(k) for k in shapes["layers"]}}
    if "lm_head" in shapes:
        out["lm_head"] = SPECS.unembed_DxV
    return out


def random_params(cfg: QwenConfig, seed: int = 0) -> dict:
    """Random host weights (NumPy float32) for tests and the demo: N(0, 0.02), norms ~1."""
    rng = np.random.default_rng(seed)

    def make(name, shape):
        if "norm" in name:
            return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        return (0.02 * rng.standard_normal(shape)).astype(np.float32)

    shapes = param_shapes(cfg)
    out = {k: make(k, s) for k, s in shapes.items() if k != "layers"}
    out["layers"] = {k: make(k, s) for k, s in shapes["layers"].items()}
    return out


def place(tree_host, specs, mesh, dtype=None):
    """Host arrays (or callables index -> array) -> global arrays in their sharded layout.

    Each device receives only its own slice (`jax.make_array_from_callback`), so no device
    ever holds a full replicated copy of a sharded weight, and every process supplies only
    the slices of its own devices.
    """
    def one(x, spec):
        sharding = NamedSharding(mesh, spec)
        shape = x.shape
        dt = dtype or x.dtype

        def cb(index):
            return np.asarray(x[index], dtype=dt)

        return jax.make_array_from_callback(shape, sharding, cb)

    return jax.tree.map(one, tree_host, specs)


def check_shapes(cfg: QwenConfig, params) -> None:
    """Raise ValueError naming the first parameter whose shape differs from cfg's."""
    want = param_shapes(cfg)
    have_keys = set(params) - {"layers"}
    want_keys = set(want) - {"layers"}
    if have_keys != want_keys or set(params.get("layers", {})) != set(want["layers"]):
        raise ValueError(
            f"base parameters do not match the config: expected {sorted(want_keys)} and layers "
            f"{sorted(want['layers'])}, got {sorted(have_keys)} and "
            f"{sorted(params.get('layers', {}))}")
    for k, s in want.items():
        if k == "layers":
            for kk, ss in s.items():
                if tuple(params["layers"][kk].shape) != ss:
                    raise ValueError(f"base parameter layers.{kk} has shape "
                                     f"{tuple(params['layers'][kk].shape)}, expected {ss}")
        elif tuple(params[k].shape) != s:
            raise ValueError(f"base parameter {k} has shape {tuple(params[k].shape)}, "
                             f"expected {s}")


# ----------------------------------------------------------------------------------------
# Per-shard forward


def rms_norm(x, w, eps):
    """RMSNorm in fp32 math, cast back to x's dtype, then scaled (as Hugging Face Qwen)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return w.astype(x.dtype) * xf.astype(x.dtype)


def rope(x, position_S, theta):
    """Rotary embedding, rotate-half form, angles from each token's position in its datum.

    x: [S, heads, H] (q with Q heads or k with K heads).
    """
    head_dim = x.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    ang = position_S.astype(jnp.float32)[:, None] * inv_freq[None, :]
    ang = jnp.concatenate([ang, ang], axis=-1)[:, None, :]
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    xf = x.astype(jnp.float32)
    half = head_dim // 2
    rot = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos + rot * sin).astype(x.dtype)


def embed(embed_VxD, tokens_S):
    """Vocab-parallel lookup: each tp rank holds V/tp rows; psum over "tp" combines them."""
    v_local = embed_VxD.shape[0]
    local = tokens_S - jax.lax.axis_index(TP) * v_local
    inside = (local >= 0) & (local < v_local)
    rows = jnp.take(embed_VxD, jnp.where(inside, local, 0), axis=0)
    return jax.lax.psum(jnp.where(inside[:, None], rows, 0), TP)


def _linear(x_SxI, w_IxO, lora_ab, route, bias_O=None):
    """x @ W (+ bias) (+ each token's own LoRA update) in x's dtype: [S, O]."""
    y = jnp.einsum("si,io->so", x_SxI, w_IxO.astype(x_SxI.dtype))
    if bias_O is not None:
        y = y + bias_O.astype(x_SxI.dtype)
    if lora_ab is not None:
        y = y + lora_lib.delta(x_SxI, lora_ab["a"], lora_ab["b"], route)
    return y


def _lora(lora_layer, module):
    """One module's {"a", "b"} of this layer's active adapters, or None without LoRA."""
    return None if lora_layer is None else lora_layer[module]


def attention_block(cfg: QwenConfig, h_SxD, layer, lora_layer, route: lora_lib.Routing | None,
                    position_S, attend: attention_lib.Attend, attn_state):
    """Pre-norm self-attention of one layer: (its output [S, D], psum'd over tp; new state).

    norm → q/k/v projections (+ bias, + LoRA) → qk-norm (Qwen3) → RoPE at position_S →
    attend(q [S, Q, H], k, v [S, K, H], attn_state) → o_proj (+ LoRA) → psum over tp.
    The caller adds the residual. layer / lora_layer: this layer's slice of the stacked
    weights and of the active adapters ({module: {"a": [A, I, R], "b": [A, R, O]}} or None).
    """
    s_len = h_SxD.shape[0]
    x_SxD = rms_norm(h_SxD, layer["input_norm"], cfg.rms_norm_eps)
    q = _linear(x_SxD, layer["q_proj"], _lora(lora_layer, "q_proj"), route, layer.get("q_bias"))
    k = _linear(x_SxD, layer["k_proj"], _lora(lora_layer, "k_proj"), route, layer.get("k_bias"))
    v = _linear(x_SxD, layer["v_proj"], _lora(lora_layer, "v_proj"), route, layer.get("v_bias"))
    q_SxQxH = q.reshape(s_len, -1, cfg.head_dim)
    k_SxKxH = k.reshape(s_len, -1, cfg.head_dim)
    v_SxKxH = v.reshape(s_len, -1, cfg.head_dim)
    if cfg.qk_norm:
        q_SxQxH = rms_norm(q_SxQxH, layer["q_norm"], cfg.rms_norm_eps)
        k_SxKxH = rms_norm(k_SxKxH, layer["k_norm"], cfg.rms_norm_eps)
    q_SxQxH = rope(q_SxQxH, position_S, cfg.rope_theta)
    k_SxKxH = rope(k_SxKxH, position_S, cfg.rope_theta)
    o_SxQxH, attn_state = attend(q_SxQxH, k_SxKxH, v_SxKxH, attn_state)
    o_SxD = _linear(o_SxQxH.reshape(s_len, -1), layer["o_proj"], _lora(lora_layer, "o_proj"),
                    route)
    return jax.lax.psum(o_SxD, TP), attn_state


def dense_mlp(cfg: QwenConfig, h_SxD, layer, lora_layer, route: lora_lib.Routing | None):
    """Pre-norm SwiGLU MLP of one layer: down(silu(gate(x)) · up(x)), psum'd over tp: [S, D].

    The MLP strategy of decoder_layer; an MoE block with this signature can replace it.
    The caller adds the residual.
    """
    x_SxD = rms_norm(h_SxD, layer["post_norm"], cfg.rms_norm_eps)
    g_SxF = _linear(x_SxD, layer["gate_proj"], _lora(lora_layer, "gate_proj"), route)
    u_SxF = _linear(x_SxD, layer["up_proj"], _lora(lora_layer, "up_proj"), route)
    y_SxD = _linear(jax.nn.silu(g_SxF) * u_SxF, layer["down_proj"],
                    _lora(lora_layer, "down_proj"), route)
    return jax.lax.psum(y_SxD, TP)


def decoder_layer(cfg: QwenConfig, h_SxD, layer, lora_layer, route: lora_lib.Routing | None,
                  position_S, attend: attention_lib.Attend, attn_state, mlp=dense_mlp):
    """One pre-norm decoder layer on this shard: (h + attention, then + mlp; new state)."""
    a_SxD, attn_state = attention_block(cfg, h_SxD, layer, lora_layer, route, position_S,
                                        attend, attn_state)
    h_SxD = h_SxD + a_SxD
    return h_SxD + mlp(cfg, h_SxD, layer, lora_layer, route), attn_state


def hidden_states(cfg: QwenConfig, params, tokens_S, position_S, attend: attention_lib.Attend,
                  lora=None, route: lora_lib.Routing | None = None, *, attn_state=None,
                  mlp=dense_mlp, remat: bool = True):
    """(final-norm hidden states [S, D] of this shard's tokens, new attention state).

    params: this shard's base weights (see param_shapes); lora: active adapters
    {module: {"a": [L, A, I, R], "b": [L, A, R, O]}} or None; route: their token spans.
    attend: the attention strategy (attention.cp_attend(segment_S, position_S, …) for
    training); attn_state: per-layer attention state stacked on a leading [L] axis (None,
    an empty pytree, for training), scanned with the weights and returned likewise.
    mlp: the MLP block (dense_mlp). Layers run under lax.scan (compile time independent of
    depth), each rematerialised in the backward pass when `remat` (all but the attention
    kernel's output and lse).
    """
    dtype = jnp.dtype(cfg.dtype)
    h = embed(params["embed"], tokens_S).astype(dtype)
    layer_lora = None if lora is None else {m: lora[m] for m in lora_lib.LAYER_MODULES}

    def body(h, xs):
        layer, lora_layer, state = xs
        return decoder_layer(cfg, h, layer, lora_layer, route, position_S, attend, state, mlp)

    if remat:
        # Recompute each layer in the backward pass except the attention kernel's output and
        # log-sum-exp: O(S·Q·H) per layer saved buys not running attention twice.
        policy = jax.checkpoint_policies.save_only_these_names(*attention_lib.SAVED_NAMES)
        body = jax.checkpoint(body, prevent_cse=False, policy=policy)
    h, attn_state = jax.lax.scan(body, h, (params["layers"], layer_lora, attn_state))
    return rms_norm(h, params["final_norm"], cfg.rms_norm_eps), attn_state


def unembed_factors(params, h_SxD, lora=None, route: lora_lib.Routing | None = None):
    """(lefts, rights) with logits = Σ lefts[i] @ rights[i], rights split over vocab.

    Base: h [S, D] @ W [D, V/tp] (W = lm_head, or embed^T when tied); LoRA on lm_head adds
    [S, A·R] @ [A·R, V/tp]: each token's (h @ lora_a[a])·scale[a] in its own adapter a's
    R columns, zero elsewhere, times the stacked lora_b. losses.target_logprobs consumes
    these.
    """
    w_DxV = params["lm_head"] if "lm_head" in params else params["embed"].T
    lefts, rights = [h_SxD], [w_DxV]
    if lora is not None and lora_lib.HEAD in lora:
        head = lora[lora_lib.HEAD]
        lefts.append(lora_lib.low_rank_input(h_SxD, head["a"], route).astype(h_SxD.dtype))
        rights.append(head["b"].reshape(-1, head["b"].shape[-1]))
    return tuple(lefts), tuple(rights)
