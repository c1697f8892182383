"""Per-device compiled memory of forward + backward against the cp size, and attention work.

For a fixed total of tokens (one long datum in the zigzag layout), compiles the gradient of
the Tinker cross-entropy loss through the shard_map'd decoder (remat on) at mesh
(dp=1, cp=k, tp=1) for each k, and reads XLA's per-device memory analysis: temp, argument
and output bytes. The goal is M(cp=k) / M(cp=1) ≤ 1.2 / k. Each cp > 1 is compiled with
each attention path of --attention: "gather" (K/V all-gathered over cp: every rank holds
all keys and their fp32 gradients per layer) and "ring" (K/V passed around the cp ring:
O(S) per rank). Nothing is run, only compiled, so shapes stand in for data
(jax.ShapeDtypeStruct).

The gradient is taken w.r.t. the embedding table and every norm weight: a real backward
through every layer (activation gradients to the embedding, per-layer reductions over the
tokens like LoRA's), with outputs as small as an adapter's.

Also prints attention.block_work (attention blocks computed per cp rank) for the zigzag
layout against a contiguous split of the same datum: the goal is max/min ≤ 1.05 for zigzag.

    python benchmarks/memory.py [--tokens 16384] [--attention gather,ring]
                                [--out /tmp/jcp_memory.json]
    python benchmarks/memory.py --tokens 65536 --cps 1,8 --attention ring   # the 64k row
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jcp  # noqa: E402
from jcp import attention, losses, model, train_step  # noqa: E402
from jcp import mesh as mesh_lib  # noqa: E402

MiB = 1 << 20
TRAINED_LAYER_LEAVES = ("input_norm", "post_norm", "q_norm", "k_norm")


def split_params(tree):
    """(trained, frozen): the embedding and norms are differentiated, the rest is not."""
    trained = {"embed": tree["embed"], "final_norm": tree["final_norm"],
               "layers": {k: v for k, v in tree["layers"].items() if k in TRAINED_LAYER_LEAVES}}
    frozen = {k: v for k, v in tree.items() if k not in ("embed", "final_norm", "layers")}
    frozen["layers"] = {k: v for k, v in tree["layers"].items()
                        if k not in TRAINED_LAYER_LEAVES}
    return trained, frozen


def merge_params(trained, frozen):
    out = {**frozen, **{k: v for k, v in trained.items() if k != "layers"}}
    out["layers"] = {**frozen["layers"], **trained["layers"]}
    return out


def compiled_step(cfg, cp, tokens, attn_block, chunk, cp_attention="gather"):
    """The compiled grad(loss) at mesh (1, cp, 1), S per rank, and compile seconds."""
    mesh = jcp.make_mesh(1, cp, 1)
    s_len = 2 * mesh_lib.zigzag_chunk(tokens, cp)
    specs = model.param_specs(cfg)
    shapes = model.param_shapes(cfg)
    dtype = jnp.dtype(cfg.dtype)

    def abstract(shape, spec, dt):
        return jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(mesh, spec))

    params = jax.tree.map(lambda s, sp: abstract(s, sp, dtype), shapes, specs,
                          is_leaf=lambda x: isinstance(x, tuple))
    stream = mesh_lib.SPECS.stream_DPxCPxS
    ints = abstract((1, cp, s_len), stream, jnp.int32)
    floats = abstract((1, cp, s_len), stream, jnp.float32)

    step_cfg = train_step.StepConfig(remat=True, attn_block=attn_block, logprob_chunk=chunk,
                                     cp_attention=cp_attention)

    def inner(params, tok, seg, pos, tgt, w):
        tok, seg, pos, tgt, w = (x[0, 0] for x in (tok, seg, pos, tgt, w))
        loss, _ = train_step.model_loss(cfg, step_cfg, params, None, None, tok, seg, pos, tgt,
                                        losses.TokenInputs(w, w, w), "cross_entropy", {}, 8,
                                        base_unembed_grad=True)
        return loss

    f = jax.shard_map(inner, mesh=mesh, in_specs=(specs,) + (stream,) * 5, out_specs=P())

    def loss_fn(trained, frozen, *xs):
        return f(merge_params(trained, frozen), *xs)

    trained, frozen = split_params(params)
    step = jax.jit(jax.value_and_grad(loss_fn))
    t0 = time.time()
    compiled = step.lower(trained, frozen, ints, ints, ints, ints, floats).compile()
    return compiled, s_len, time.time() - t0


def largest_arrays(compiled, top):
    """The `top` largest distinct array shapes in the optimized HLO: [(MiB, shape)]."""
    itemsize = {"f32": 4, "s32": 4, "u32": 4, "bf16": 2, "pred": 1}
    found = {}
    for dtype, dims in re.findall(r"\b(f32|bf16|s32|u32|pred)\[([\d,]+)\]", compiled.as_text()):
        n = int(np.prod([int(d) for d in dims.split(",")])) * itemsize[dtype]
        found[f"{dtype}[{dims}]"] = n / MiB
    return sorted(((m, s) for s, m in found.items()), reverse=True)[:top]


def block_balance(tokens, cp, block):
    """(zigzag, contiguous) blocks per cp rank for one datum of `tokens` tokens."""
    idx = jcp.zigzag_indices(tokens, cp)
    seg_z = np.where(idx >= 0, 0, -1).astype(np.int32)
    pos_z = np.where(idx >= 0, idx, 0).astype(np.int32)
    s_len = idx.shape[1]
    flat = np.arange(cp * s_len, dtype=np.int32)
    seg_c = np.where(flat < tokens, 0, -1).reshape(cp, s_len).astype(np.int32)
    pos_c = np.where(flat < tokens, flat, 0).reshape(cp, s_len).astype(np.int32)
    return (attention.block_work(seg_z, pos_z, block),
            attention.block_work(seg_c, pos_c, block))


def ratio(work):
    return float(work.max() / max(work.min(), 1))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=16384, help="total tokens (one datum)")
    ap.add_argument("--cps", default="1,2,4,8")
    ap.add_argument("--attention", default="gather,ring",
                    help="cp attention paths to compile at each cp > 1")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--intermediate", type=int, default=768)
    ap.add_argument("--attn-block", type=int, default=attention.DEFAULT_BLOCK)
    ap.add_argument("--chunk", type=int, default=losses.DEFAULT_CHUNK,
                    help="log-prob token chunk")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--out", default="/tmp/jcp_memory.json")
    ap.add_argument("--explain", type=int, default=0, metavar="N",
                    help="also print the N largest array shapes of each compiled program")
    args = ap.parse_args(argv)

    cps = [int(c) for c in args.cps.split(",")]
    cfg = jcp.QwenConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_layers=args.layers, num_heads=args.heads, num_kv_heads=args.kv_heads,
        head_dim=args.head_dim, max_position_embeddings=max(args.tokens, 32768),
        dtype=args.dtype)
    print(f"jax {jax.__version__}, {len(jax.devices())} {jax.devices()[0].platform} devices")
    print(f"config: {cfg}")
    print(f"tokens {args.tokens} (one datum), attn_block {args.attn_block}, "
          f"chunk {args.chunk}, remat on, grad w.r.t. embed + norms\n")

    rows = []
    hdr = (f"{'cp':>3} {'path':>6} {'S/rank':>7} {'arg MiB':>8} {'out MiB':>8} {'temp MiB':>9} "
           f"{'total MiB':>10} {'M/M1':>6} {'goal':>6} {'temp/t1':>8} {'ok':>3} {'compile':>8}")
    print(hdr)
    print("-" * len(hdr))
    base_total = base_temp = None
    explained = {}
    paths = args.attention.split(",")
    runs = [(cp, p) for cp in cps for p in (["gather"] if cp == 1 else paths)]
    for cp, path in runs:
        compiled, s_len, secs = compiled_step(cfg, cp, args.tokens, args.attn_block, args.chunk,
                                              path)
        mem = compiled.memory_analysis()
        if args.explain:
            explained[f"{cp} {path}"] = largest_arrays(compiled, args.explain)
        total = mem.temp_size_in_bytes + mem.argument_size_in_bytes + mem.output_size_in_bytes
        if base_total is None:
            base_total, base_temp = total, mem.temp_size_in_bytes
        r = total / base_total
        goal = 1.2 / cp
        row = dict(cp=cp, path=path, s_per_rank=s_len, temp_bytes=mem.temp_size_in_bytes,
                   argument_bytes=mem.argument_size_in_bytes,
                   output_bytes=mem.output_size_in_bytes, alias_bytes=mem.alias_size_in_bytes,
                   total_bytes=total, ratio_to_cp1=r, goal=goal, meets_goal=bool(r <= goal),
                   temp_ratio_to_cp1=mem.temp_size_in_bytes / base_temp, compile_s=secs)
        rows.append(row)
        print(f"{cp:>3} {path:>6} {s_len:>7} {mem.argument_size_in_bytes / MiB:>8.1f} "
              f"{mem.output_size_in_bytes / MiB:>8.1f} {mem.temp_size_in_bytes / MiB:>9.1f} "
              f"{total / MiB:>10.1f} {r:>6.3f} {goal:>6.3f} {row['temp_ratio_to_cp1']:>8.3f} "
              f"{'yes' if row['meets_goal'] else 'NO':>3} {secs:>7.1f}s", flush=True)

    for cp, arrays in explained.items():
        print(f"\ncp={cp}: largest arrays in the compiled program (MiB, shape)")
        for mib, shape in arrays:
            print(f"  {mib:8.2f}  {shape}")

    print(f"\nattention blocks per cp rank (block {args.attn_block}, one datum of "
          f"{args.tokens} tokens)")
    hdr2 = f"{'cp':>3} {'layout':>10} {'min':>6} {'max':>6} {'max/min':>8}  per rank"
    print(hdr2)
    print("-" * len(hdr2))
    work = []
    for cp in cps:
        z, c = block_balance(args.tokens, cp, args.attn_block)
        work.append(dict(cp=cp, zigzag=z.tolist(), contiguous=c.tolist(),
                         zigzag_max_over_min=ratio(z), contiguous_max_over_min=ratio(c),
                         zigzag_meets_goal=ratio(z) <= 1.05))
        for name, w in (("zigzag", z), ("contiguous", c)):
            print(f"{cp:>3} {name:>10} {w.min():>6} {w.max():>6} {ratio(w):>8.2f}  {w.tolist()}")

    out = dict(config=dict(vars(args)), model=str(cfg), memory=rows, block_work=work,
               largest_arrays={str(k): v for k, v in explained.items()})
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
    print(f"\nwrote {args.out}")
    return out


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
