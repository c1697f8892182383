"""Model FLOP utilisation of one LoRA training step (forward + backward) at long context.

Workload: a Qwen3-8B-shaped model (hidden 4096, 36 layers, 32 query heads, 8 kv heads,
head dim 128, MLP 12288, vocab 151936, untied, qk_norm), bf16 random weights made on the
device (no files), one LoRA adapter of rank 32 (alpha 64) on every target (q, k, v, o,
gate, up, down and lm_head), one datum of --tokens tokens (default 32768), token-sum
cross_entropy, through the public jcp.Trainer (its defaults: remat "auto"). A step is one
Trainer.forward_backward; tokens/s = tokens / median step time after --warmup untimed
steps (the first one compiles, and is reported apart). The AdamW step (adapter-only,
negligible) is not timed.

FLOPs counted (model FLOPs, as PaLM appendix B and MaxText's calculate_tflops count them:
matmuls only, 2 FLOPs per multiply-add, rematerialisation and FlashAttention's
recomputation of the scores in the backward pass NOT counted). T tokens of one datum, L
layers, Q query heads, H head dim, r the LoRA rank:

    N       = base matmul parameters touched per token: per layer q, k, v, o and gate,
              up, down projections, plus lm_head (the embedding is a gather: 0 FLOPs).
    N_lora  = r · Σ over adapted modules (in + out features): the LoRA factors' sizes.
    attn    = 2 · L · Q · H · T²: forward scores (q·kᵀ) and p·v, 4·Q·H per
              (query, key) pair per layer, over the T²/2 causal pairs of the datum.

    LoRA step (frozen base):  F = 4·N·T + 6·N_lora·T + 3·attn
      forward 2·N·T; the backward computes the base layers' input gradients (2·N·T) but
      no weight gradients (frozen); the LoRA factors are trained (2× forward backward,
      6·N_lora·T in all); attention has no weights, its backward is 2× its forward.
    Conventional (all weights trained): F_6N = 6·N·T + 3·attn — printed for comparison
      with full-fine-tuning MFU figures; it overstates the work of a LoRA step.

    MFU = F / step time / (peak · devices), peak = 989e12 FLOP/s (H200 SXM dense bf16;
    --peak-tflops to change).

The attention kernel: --attn-impl auto picks "pallas" (the fused Triton kernels of
jcp/attention/pallas.py) on GPU and "blockwise" elsewhere ("pallas" on CPU runs the
kernels in Pallas interpret mode: a correctness check, not a speed); both the all-gather
and the ring path use it. Run on one H200 (2026-12-04, jax 0.11.2, through
benchmarks/gpu.py): "pallas", 36 layers, 32768 tokens: 4,105 tokens/s, 7.98 s per step, MFU
24.8 % (30.9 % counted as 6N), peak 41.7 GiB, remat "auto" chose recomputation (the program
without it needs ~291 GiB); the first step took 128 s (two compiles).

    python benchmarks/mfu.py                       # GPU: Qwen3-8B shape, 32768 tokens
    python benchmarks/mfu.py --attn-impl blockwise # the same with the XLA kernel
    python benchmarks/mfu.py --smoke               # CPU check: 1 layer, 1024 tokens,
                                                   # every width divided by 8
    python benchmarks/mfu.py --smoke --attn-impl pallas   # the same, kernels interpreted
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jcp
from jcp import attention
from jcp import mesh as mesh_lib
from jcp import model as model_lib

QWEN3_8B = dict(
    vocab_size=151936,
    hidden_size=4096,
    intermediate_size=12288,
    num_layers=36,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    qk_norm=True,
    attention_bias=False,
    max_position_embeddings=40960,
    dtype="bfloat16",
)
TARGETS = ("attn", "mlp", "unembed")
H200_PEAK_BF16 = 989e12


def config(layers: int, shrink: int, tokens: int) -> jcp.QwenConfig:
    """Qwen3-8B's shape with `layers` layers and every width but the head dim divided by
    `shrink` (1: the real shape)."""
    c = dict(
        QWEN3_8B,
        num_layers=layers,
        max_position_embeddings=max(QWEN3_8B["max_position_embeddings"], tokens),
    )
    for k in ("vocab_size", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads"):
        if c[k] % shrink:
            raise SystemExit(f"--shrink {shrink} does not divide {k} = {c[k]}")
        c[k] //= shrink
    return jcp.QwenConfig(**c)


class DeviceRandom:
    """A base weight for model.place: made on the default device (N(0, 0.02) in the model's
    dtype; norms 1) the first time place slices it, and read back to the host once (place
    takes host slices). Generating 8B parameters with NumPy would take minutes."""

    def __init__(self, name: str, shape: tuple[int, ...], dtype, seed: int):
        self.name, self.shape, self.dtype, self.seed = name, shape, jnp.dtype(dtype), seed
        self._host = None

    def __getitem__(self, index):
        if self._host is None:
            if "norm" in self.name:
                x = jnp.ones(self.shape, self.dtype)
            else:
                x = _normal(jax.random.key(self.seed), self.shape, self.dtype)
            self._host = np.asarray(jax.device_get(x))
            del x
        return self._host[index]


@functools.cache
def _normal_fn(shape, dtype):
    return jax.jit(lambda k: (0.02 * jax.random.normal(k, shape, jnp.float32)).astype(dtype))


def _normal(key, shape, dtype):
    return _normal_fn(shape, dtype)(key)


def device_random_params(cfg: jcp.QwenConfig, seed: int = 0) -> dict:
    """The base-parameter tree of cfg as DeviceRandom leaves."""
    out, i = {}, 0
    for k, s in model_lib.param_shapes(cfg).items():
        if isinstance(s, dict):
            out[k] = {}
            for kk, ss in s.items():
                out[k][kk] = DeviceRandom(kk, ss, cfg.dtype, seed + i)
                i += 1
        else:
            out[k] = DeviceRandom(k, s, cfg.dtype, seed + i)
            i += 1
    return out


# ----------------------------------------------------------------------------------------
# FLOPs


@dataclasses.dataclass(frozen=True)
class Flops:
    """FLOPs of one step (see the module docstring): the parts and the two totals."""

    base_params: int  # N
    lora_params: int  # N_lora
    forward: float  # 2·N·T
    backward_input_grads: float  # 2·N·T
    lora: float  # 6·N_lora·T
    attention: float  # 3·attn
    lora_step: float  # F
    conventional_6n: float  # F_6N


def step_flops(cfg: jcp.QwenConfig, rank: int, tokens: int) -> Flops:
    d, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    qd, kvd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    # (in, out) of every adapted matmul of one layer, and of the head.
    layer = [(d, qd), (d, kvd), (d, kvd), (qd, d), (d, f), (d, f), (f, d)]
    n = cfg.num_layers * sum(i * o for i, o in layer) + d * v
    n_lora = rank * (cfg.num_layers * sum(i + o for i, o in layer) + d + v)
    attn = 2.0 * cfg.num_layers * cfg.num_heads * cfg.head_dim * tokens**2
    fwd, bwd, lora = 2.0 * n * tokens, 2.0 * n * tokens, 6.0 * n_lora * tokens
    return Flops(
        n,
        n_lora,
        fwd,
        bwd,
        lora,
        3 * attn,
        fwd + bwd + lora + 3 * attn,
        6.0 * n * tokens + 3 * attn,
    )


# ----------------------------------------------------------------------------------------
# The run


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=32768, help="tokens of the one datum")
    ap.add_argument("--layers", type=int, default=QWEN3_8B["num_layers"])
    ap.add_argument(
        "--shrink",
        type=int,
        default=1,
        help="divide vocab, hidden, MLP and head counts by this (head dim kept)",
    )
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument(
        "--attn-impl",
        default="auto",
        choices=("auto",) + attention.IMPLEMENTATIONS,
        help="auto: pallas on GPU, blockwise elsewhere",
    )
    ap.add_argument(
        "--attn-block", type=int, default=None, help="Trainer attn_block (default: the Trainer's)"
    )
    ap.add_argument("--mesh", default=None, help="dp,cp,tp (default 1,<all devices>,1)")
    ap.add_argument("--cp-attention", default="auto", choices=("auto", "gather", "ring"))
    ap.add_argument("--steps", type=int, default=5, help="timed steps")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps (≥ 1, compiles)")
    ap.add_argument(
        "--peak-tflops",
        type=float,
        default=H200_PEAK_BF16 / 1e12,
        help="peak dense bf16 TFLOP/s of one device",
    )
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="small shapes for a CPU check: --layers 1 --tokens 1024 --shrink 8 "
        "--steps 1 --warmup 1",
    )
    ap.add_argument("--out", default=None, help="also write the results as JSON here")
    args = ap.parse_args(argv)
    if args.smoke:
        args.layers, args.tokens, args.shrink, args.steps, args.warmup = 1, 1024, 8, 1, 1
    args.warmup = max(1, args.warmup)

    devices = jax.devices()
    platform = devices[0].platform
    impl = args.attn_impl
    if impl == "auto":
        impl = "pallas" if platform == "gpu" else "blockwise"
    dp, cp, tp = (
        (1, len(devices), 1) if args.mesh is None else tuple(int(x) for x in args.mesh.split(","))
    )
    mesh = jcp.make_mesh(dp, cp, tp)
    cfg = config(args.layers, args.shrink, args.tokens)
    flops = step_flops(cfg, args.rank, args.tokens)
    n_dev = dp * cp * tp
    peak = args.peak_tflops * 1e12 * n_dev

    print(
        f"jax {jax.__version__}; {n_dev} of {len(devices)} {devices[0].device_kind} "
        f"({platform}); mesh dp={dp} cp={cp} tp={tp}"
    )
    print(
        f"model: {cfg.num_layers} layers, hidden {cfg.hidden_size}, MLP "
        f"{cfg.intermediate_size}, heads {cfg.num_heads}/{cfg.num_kv_heads}x{cfg.head_dim}, "
        f"vocab {cfg.vocab_size}, {cfg.dtype}; N = {flops.base_params / 1e9:.3f} B base matmul "
        f"params; LoRA r{args.rank} on {', '.join(TARGETS)} ({flops.lora_params / 1e6:.1f} M)"
    )
    s_len = 2 * mesh_lib.zigzag_chunk(args.tokens, cp)
    path = attention.choose_cp_attention(
        args.cp_attention,
        cp,
        s_len,
        cfg.num_kv_heads // tp,
        cfg.head_dim,
        jnp.dtype(cfg.dtype).itemsize,
    )
    print(f"attention: {impl}, cp path {path}; one datum of {args.tokens} tokens")

    t0 = time.perf_counter()
    kw = {} if args.attn_block is None else {"attn_block": args.attn_block}
    tr = jcp.Trainer(
        cfg,
        mesh,
        device_random_params(cfg),
        max_adapters=1,
        max_rank=args.rank,
        max_tokens_per_device=s_len * tp,
        attn_impl=impl,
        cp_attention=args.cp_attention,
        **kw,
    )
    adapter = tr.create_adapter(rank=args.rank, alpha=2.0 * args.rank, targets=list(TARGETS))
    setup_s = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    datum = jcp.Datum(
        model_input=rng.integers(0, cfg.vocab_size, args.tokens),
        loss_fn_inputs={
            "target_tokens": rng.integers(0, cfg.vocab_size, args.tokens),
            "weights": np.ones(args.tokens, np.float32),
        },
    )

    def step():
        t = time.perf_counter()
        # Returns host copies of the per-token outputs of the same program: synchronous.
        out = tr.forward_backward([datum], "cross_entropy", adapters=adapter)
        return time.perf_counter() - t, out

    first_s, out = step()
    loss = float(out.metrics["loss:sum"])
    for _ in range(args.warmup - 1):
        step()
    times = [step()[0] for _ in range(args.steps)]
    med = statistics.median(times)

    # The device's own count of its peak (accelerators; None on CPU): weights, adapter
    # state and the step's activations, whatever XLA allocated.
    stats = devices[0].memory_stats() if platform != "cpu" else None
    peak_bytes = stats.get("peak_bytes_in_use") if stats else None
    res = dict(
        platform=platform,
        devices=n_dev,
        mesh=[dp, cp, tp],
        attn_impl=impl,
        peak_bytes_in_use=peak_bytes,
        remat=[d["remat"] for d in tr.remat_decisions.values()],
        tokens=args.tokens,
        layers=cfg.num_layers,
        shrink=args.shrink,
        rank=args.rank,
        setup_s=setup_s,
        first_step_s=first_s,
        step_s=times,
        median_step_s=med,
        tokens_per_s=args.tokens / med,
        loss_sum=loss,
        flops=dataclasses.asdict(flops),
        mfu=flops.lora_step / med / peak,
        mfu_6n=flops.conventional_6n / med / peak,
        peak_flops=peak,
    )
    print(
        f"setup {setup_s:.1f} s (weights made on device, placed); first step (compiles) "
        f"{first_s:.1f} s; loss:sum {loss:.4g}"
    )
    print(
        f"steps: {args.steps} timed after {args.warmup} warm-up: median {med * 1e3:.1f} ms "
        f"[{min(times) * 1e3:.1f}–{max(times) * 1e3:.1f}]"
    )
    print(f"tokens/s: {res['tokens_per_s']:.0f} ({res['tokens_per_s'] / n_dev:.0f} per device)")
    print(
        f"FLOPs/step: LoRA step {flops.lora_step:.4g} = fwd {flops.forward:.4g} + bwd input "
        f"grads {flops.backward_input_grads:.4g} + LoRA {flops.lora:.4g} + attention "
        f"{flops.attention:.4g}; conventional 6N+attn {flops.conventional_6n:.4g}"
    )
    print(
        f"MFU (LoRA step FLOPs): {100 * res['mfu']:.2f}%   "
        f"[conventional 6N+attention: {100 * res['mfu_6n']:.2f}%]   peak "
        f"{args.peak_tflops:.0f} TFLOP/s x {n_dev}"
    )
    if peak_bytes is not None:
        print(f"device memory: peak {peak_bytes / 2**30:.2f} GiB in use (memory_stats)")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(res, fh, indent=2)
    return res


if __name__ == "__main__":
    main()
    sys.exit(0)
