"""Qwen3.5 (hybrid Gated DeltaNet) measurements, ratios within one run.

1. kernel: the gated delta rule, chunked (WY / UT form, delta_rule.chunked) against the
   recurrent form (delta_rule.recurrent), forward and forward + backward, tokens/s, at
   --kernel-tokens tokens (one sequence; Hk key heads, H value heads, dk = dv).
2. model: training tokens/s (forward + backward of one datum of --tokens tokens, LoRA
   r = 8 on the MLP and lm_head, cross_entropy) — jcp (mesh 1,1,1) against torch +
   transformers' Qwen3_5ForCausalLM with its torch fallbacks (torch_chunk_gated_delta_rule,
   SDPA) + peft, same config, same process, alternated for --rounds rounds, best of each;
   torch on --torch-threads threads (2: the machine's cores; more only contend). Default
   2048 tokens: the issue's figure is `--only model --tokens 16384`, where torch's
   fallback (its solve_triangular per chunk, a third of its step) takes minutes per step on
   2 loaded cores (last session: 24 min for its first step, torch's default threads).
3. memory: compiled memory per device of one datum at each of --mem-tokens tokens against
   cp (mesh 1,cp,1 on 8 fake CPU devices; XLA's memory analysis of grad(loss), the
   full-attention layer on the ring), split at the heap's peak into the Gated DeltaNet
   layers' buffers (ops under jax.named_scope("gated_delta_net")) and the rest, each as a
   ratio to cp = 1 (goal 1.2/cp); and every all-gather of the cp = 4 program with its
   bytes at both lengths — the linear layers' (conv halos, piece transitions) stay put.

    python benchmarks/qwen3_5.py [--only kernel|model|memory] [--tokens N] [--torch-threads N]
                                 [--kernel-tokens N] [--mem-tokens N,N] [--mem-cps 1,2,4,8]
                                 [--attention ring|gather|auto] [--rounds N]
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jcp  # noqa: E402
from jcp import delta_rule as dr  # noqa: E402

MiB = float(1 << 20)
# The model of sections 2 and 3: Qwen3.5's layout (3 Gated DeltaNet layers, then gated
# full attention), small widths.
MODEL = dict(
    vocab_size=1024,
    hidden_size=256,
    intermediate_size=512,
    num_layers=4,
    num_heads=8,
    num_kv_heads=2,
    head_dim=32,
    linear_num_key_heads=4,
    linear_num_value_heads=8,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
)


def _best(f, *args, reps=3):
    jax.block_until_ready(f(*args))
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        out.append(time.perf_counter() - t)
    return min(out)


def kernel(s_len: int, hk=2, h=4, d=64, chunk=64) -> dict:
    rng = np.random.default_rng(0)
    q = dr.l2norm(rng.standard_normal((s_len, hk, d)).astype(np.float32))
    k = dr.l2norm(rng.standard_normal((s_len, hk, d)).astype(np.float32))
    v = jnp.asarray(rng.standard_normal((s_len, h, d)).astype(np.float32))
    g = jnp.asarray(-np.abs(rng.standard_normal((s_len, h))).astype(np.float32) * 0.1)
    b = jnp.asarray(np.full((s_len, h), 0.5, np.float32))
    forms = {
        "recurrent": lambda *a: dr.recurrent(*a)[0],
        f"chunked {chunk}": lambda *a: dr.chunked(*a, chunk=chunk)[0],
    }
    print(f"\n1. kernel: {s_len} tokens, {h} value heads ({hk} key heads), dk = dv = {d}")
    res = {}
    for name, f in forms.items():
        fwd = jax.jit(f)
        bwd = jax.jit(
            jax.grad(
                lambda q, k, v, g, b, f=f: jnp.sum(f(q, k, v, g, b) ** 2), argnums=(0, 1, 2, 3, 4)
            )
        )
        res[name] = (_best(fwd, q, k, v, g, b), _best(bwd, q, k, v, g, b))
    rec = res["recurrent"]
    for name, (tf, tb) in res.items():
        print(
            f"  {name:12s} fwd {s_len / tf:12,.0f} tok/s ({rec[0] / tf:5.2f}x recurrent)   "
            f"fwd+bwd {s_len / tb:12,.0f} tok/s ({rec[1] / tb:5.2f}x recurrent)"
        )
    return res


# ------------------------------------------------------------------------------ model


def _torch_side(tokens: int, threads: int):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3_5ForCausalLM
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    m = MODEL
    hc = Qwen3_5TextConfig(
        vocab_size=m["vocab_size"],
        hidden_size=m["hidden_size"],
        intermediate_size=m["intermediate_size"],
        num_hidden_layers=m["num_layers"],
        num_attention_heads=m["num_heads"],
        num_key_value_heads=m["num_kv_heads"],
        head_dim=m["head_dim"],
        linear_num_key_heads=m["linear_num_key_heads"],
        linear_num_value_heads=m["linear_num_value_heads"],
        linear_key_head_dim=m["linear_key_head_dim"],
        linear_value_head_dim=m["linear_value_head_dim"],
        tie_word_embeddings=False,
        max_position_embeddings=tokens + 1,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [2, 1, 1],
        },
    )
    torch.manual_seed(0)
    torch.set_num_threads(threads)
    hm = Qwen3_5ForCausalLM(hc).float()
    pm = get_peft_model(
        hm,
        LoraConfig(
            r=8, lora_alpha=16, target_modules=["gate_proj", "up_proj", "down_proj", "lm_head"]
        ),
    )
    ids = torch.randint(0, m["vocab_size"], (1, tokens + 1))

    def step():
        pm.zero_grad()
        logits = pm(input_ids=ids[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits[0], ids[0, 1:], reduction="sum")
        loss.backward()

    return step


def _jcp_side(tokens: int):
    cfg = jcp.QwenConfig.tiny_qwen3_5(**MODEL, max_position_embeddings=max(4096, tokens))
    tr = jcp.Trainer(cfg, jcp.make_mesh(1, 1, 1), max_adapters=1, max_rank=8)
    # The modules torch's side targets (MLP and lm_head): jcp's default is every module.
    a = tr.create_adapter(rank=8, alpha=16.0, seed=0, targets=["mlp", "unembed"])
    rng = np.random.default_rng(0)
    ids = rng.integers(0, cfg.vocab_size, tokens + 1).astype(np.int32)
    datum = jcp.Datum(ids[:-1], {"target_tokens": ids[1:], "weights": np.ones(tokens, np.float32)})

    def step():
        tr.forward_backward([datum], "cross_entropy", adapters=a)
        jax.block_until_ready(jax.tree.leaves(tr.state.weights))

    return step


def model(tokens: int, rounds: int, threads: int = 2) -> dict:
    print(
        f"\n2. training tokens/s, one datum of {tokens} tokens, forward + backward, LoRA r 8 "
        f"(MLP, lm_head); torch threads {threads}; model {MODEL}"
    )
    sides = {"torch + peft": _torch_side(tokens, threads), "jcp (1,1,1)": _jcp_side(tokens)}
    best = {}
    for name, step in sides.items():  # warm-up (compiles jcp)
        t = time.perf_counter()
        step()
        print(f"  {name}: first step {time.perf_counter() - t:.1f} s")
    for r in range(rounds):
        for name, step in sides.items():
            t = time.perf_counter()
            step()
            dt = time.perf_counter() - t
            best[name] = min(best.get(name, dt), dt)
            print(f"  round {r}: {name:14s} {tokens / dt:10,.0f} tok/s")
    ref = best["torch + peft"]
    for name, dt in best.items():
        print(f"  best {name:14s} {tokens / dt:10,.0f} tok/s  ({ref / dt:.2f}x torch)")
    return best


# ------------------------------------------------------------------------------ memory


_AG = re.compile(r"= (\w+)\[([\d,]*)\][^=]*? all-gather\(")


def all_gathers(compiled) -> list[tuple[str, int]]:
    """(shape, bytes) of every all-gather in a compiled program's HLO."""
    out = []
    for m in _AG.finditer(compiled.as_text()):
        dt, dims = m.group(1), m.group(2)
        n = int(np.prod([int(x) for x in dims.split(",") if x])) if dims else 1
        size = {"f32": 4, "s32": 4, "bf16": 2, "pred": 1, "u32": 4, "s8": 1}.get(dt, 4)
        out.append((f"{dt}[{dims}]", n * size))
    return out


def memory(token_list: list[int], cps=(1, 2, 4, 8), attention: str = "ring") -> dict:
    """Compiled memory per device against cp at each length; the linear layers' share is
    what ops inside jax.named_scope("gated_delta_net") (decoder.linear_attention_block)
    made of the buffers live at the heap's peak (memory.peak_split), the rest everything
    else there (the layer scan's saved hidden states, the full-attention and MLP blocks, the
    loss). Returns {tokens: {cp: (temp bytes, linear bytes at peak, rest bytes at peak)}}."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import tempfile  # noqa: E402

    import memory as memory_bench  # noqa: E402  (compiled_step: grad of one datum; peak_split)

    print(
        f"\n3. compiled memory per device, one datum, grad(loss), remat on, full-attention "
        f"layer cp path {attention!r}; temp = XLA's temporaries; at the heap's peak: "
        "linear = bytes made by the Gated DeltaNet layers' ops, rest = the others; "
        "ratios to cp = 1, goal 1.2/cp"
    )
    res, gathers = {}, {}
    for tokens in token_list:
        cfg = jcp.QwenConfig.tiny_qwen3_5(**MODEL, max_position_embeddings=max(4096, tokens))
        res[tokens] = {}
        for cp in cps:
            with tempfile.TemporaryDirectory() as dump:
                compiled, s_len, secs = memory_bench.compiled_step(
                    cfg, cp, tokens, 64, 1024, attention if cp > 1 else "gather", dump
                )
                linear, peak = memory_bench.peak_split(dump, "gated_delta_net")
            temp = compiled.memory_analysis().temp_size_in_bytes
            res[tokens][cp] = (temp, linear, peak - linear)
            t1, l1, r1 = res[tokens][cps[0]]
            print(
                f"  {tokens:6d} tokens cp={cp}: {s_len:6d} rows/rank  temp "
                f"{temp / MiB:7.1f} MiB ({temp / t1:.3f})  peak: linear "
                f"{linear / MiB:6.1f} MiB ({linear / l1:.3f})  rest "
                f"{(peak - linear) / MiB:6.1f} MiB ({(peak - linear) / r1:.3f})  goal "
                f"{1.2 / cp:.3f}  (compile {secs:.0f} s)",
                flush=True,
            )
            if cp == 4:
                gathers[tokens] = all_gathers(compiled)
    if len(gathers) >= 2:
        (ta, a), (tb, b) = sorted(gathers.items())[-1], sorted(gathers.items())[0]
        print(
            f"  cp=4 all-gathers at {ta} tokens (each once per scanned layer body); 'same' = "
            f"also at {tb} tokens"
        )
        for shape, size in sorted(set(a)):
            tag = "same" if (shape, size) in set(b) else "grows with tokens"
            print(f"    {shape:28s} {size:>12,d} B   {tag}")
    h, dk, dv = (
        MODEL["linear_num_value_heads"],
        MODEL["linear_key_head_dim"],
        MODEL["linear_value_head_dim"],
    )
    p = 2 * 8 + 1  # pieces per rank: two zigzag chunks of each of 8 datum slots, + padding
    print(
        f"  linear layer, cp=4: transitions cp·P·H·dk·(dk+dv)·4 = "
        f"{4 * p * h * dk * (dk + dv) * 4:,d} B (P = {p} piece slots), independent of tokens"
    )
    return res


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--only", choices=("kernel", "model", "memory"))
    p.add_argument(
        "--tokens", type=int, default=2048, help="model section's datum (the issue's figure: 16384)"
    )
    p.add_argument("--torch-threads", type=int, default=2)
    p.add_argument("--kernel-tokens", type=int, default=16384)
    p.add_argument(
        "--mem-tokens", default="8192,16384", help="lengths of the memory section (comma list)"
    )
    p.add_argument("--mem-cps", default="1,2,4,8")
    p.add_argument(
        "--attention",
        default="ring",
        choices=("ring", "gather", "auto"),
        help="the full-attention layer's cp path in the memory section",
    )
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args(argv)
    print(f"jax {jax.__version__}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}")
    if args.only in (None, "kernel"):
        kernel(args.kernel_tokens)
    if args.only in (None, "model"):
        model(args.tokens, args.rounds, args.torch_threads)
    if args.only in (None, "memory"):
        memory(
            [int(t) for t in args.mem_tokens.split(",")],
            tuple(int(c) for c in args.mem_cps.split(",")),
            args.attention,
        )


if __name__ == "__main__":
    main()
