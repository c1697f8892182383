"""Per-device compiled memory of forward + backward against the cp size, and attention work.

For a fixed total of tokens (one long datum in the zigzag layout), compiles the gradient of
the Tinker cross-entropy loss through the shard_map'd decoder (remat on) at mesh
(dp=1, cp=k, tp=1) for each k, and reads XLA's per-device memory analysis: temp, argument
and output bytes. The goal is M(cp=k) / M(cp=1) ≤ 1.2 / k. Each cp > 1 is compiled with
each attention path of --attention: "gather" (K/V all-gathered over cp: every rank holds
all keys and their fp32 gradients per layer) and "ring" (K/V passed around the cp ring:
O(S) per rank). Nothing is run, only compiled, so shapes stand in for data
(jax.ShapeDtypeStruct).

The gradient is taken w.r.t. every norm weight: a real backward through every layer
(activation gradients down to the first layer, per-layer reductions over the tokens like
LoRA's), with outputs as small as an adapter's (the embedding and unembedding are frozen,
as in LoRA training: their [V, D] gradients would be a cp-independent term that LoRA
training never has).

M = arguments + outputs + temporaries per device; the weights (arguments) are replicated
over cp, so the activation share is the temporaries, and the goal is checked on M itself.
--explain N compiles with XLA's dumps and prints the N largest groups of buffers live at
the peak of the heap (the live-range report), each with the op that made it: that is how
the ring's per-step buffers were found (benchmarks/RESULTS.md, "Ring memory").
--model qwen3-8b compiles Qwen3-8B's shape (bf16, 36 layers; the layer scan makes
compile time independent of depth), compile only.

Also prints attention.block_work (attention blocks computed per cp rank) for the zigzag
layout against a contiguous split of the same datum: the goal is max/min ≤ 1.05 for zigzag.

Measured (jax 0.10.2, 8 fake CPU devices, compile only; M(cp)/M(1) at cp = 2, 4, 8; goal
0.60 / 0.30 / 0.15):
  issue config (hidden 256, 2 layers, 8 heads × 64, vocab 2048, ring), total M:
    before the ring fix  32k 0.530 / 0.283 / 0.159   64k 0.528 / 0.279 / 0.156
    after                32k 0.518 / 0.264 / 0.139   64k 0.515 / 0.260 / 0.135
  the same with --kv-heads 8 (K/V as wide as q; issue 37), total M:
    unrolled ring steps  32k 0.563 / 0.325 / 0.220   64k 0.561 / 0.322 / 0.217
    the ring as a loop   32k 0.563 / 0.271 / 0.140   64k 0.561 / 0.263 / 0.136
    (--kv-heads 2 after it: 32k 0.524 / 0.271 / 0.141, 64k 0.521 / 0.267 / 0.136)
  Qwen3-8B shape, 36 layers, 32k, float32: temp 0.507 / 0.259 / 0.135; total 0.694 /
    0.540 / 0.463 (31 GB of weights replicated over cp); bfloat16: temp 0.689 / 0.533 /
    0.456, of which ~26 GB at every cp were XLA:CPU's f32 copies of the stacked weights.
    Those are gone (model.scan_layers): bf16 temp at cp = 1 76,408 -> 49,911 MiB, cp = 2
    ring 26,142 MiB (temp/t1 0.524). What XLA:CPU still holds in f32 is activations: the
    layer scan's saved hidden states [L, S, D] and attention outputs [L, S, K, M, H]
    (18 GB each at cp = 1, bf16 in the program; XLA:CPU has no bf16 dynamic-update-slice,
    so it keeps the stacks in f32). --explain shows them.

    python benchmarks/memory.py [--tokens 32768,65536] [--attention ring,gather]
                                [--kv-heads 8] [--explain 12] [--out /tmp/jcp_memory.json]
    python benchmarks/memory.py --model qwen3-8b --no-balance     # Qwen3-8B shape
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
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
    """(trained, frozen): every norm weight is differentiated, the rest is not."""
    trained = {
        "final_norm": tree["final_norm"],
        "layers": {k: v for k, v in tree["layers"].items() if k in TRAINED_LAYER_LEAVES},
    }
    frozen = {k: v for k, v in tree.items() if k not in ("final_norm", "layers")}
    frozen["layers"] = {k: v for k, v in tree["layers"].items() if k not in TRAINED_LAYER_LEAVES}
    return trained, frozen


def merge_params(trained, frozen):
    out = {**frozen, **{k: v for k, v in trained.items() if k != "layers"}}
    out["layers"] = {**frozen["layers"], **trained["layers"]}
    return out


def compiled_step(cfg, cp, tokens, attn_block, chunk, cp_attention="gather", dump_to=None):
    """The compiled grad(loss) at mesh (1, cp, 1), S per rank, and compile seconds.
    dump_to: a folder for XLA's dumps of the compiled program (see peak_buffers)."""
    mesh = jcp.make_mesh(1, cp, 1)
    s_len = 2 * mesh_lib.zigzag_chunk(tokens, cp)
    specs = model.param_specs(cfg)
    shapes = model.param_shapes(cfg)
    dtype = jnp.dtype(cfg.dtype)

    def abstract(shape, spec, dt):
        return jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(mesh, spec))

    params = jax.tree.map(
        lambda s, sp: abstract(s, sp, dtype), shapes, specs, is_leaf=lambda x: isinstance(x, tuple)
    )
    stream = mesh_lib.SPECS.stream_DPxCPxS
    ints = abstract((1, cp, s_len), stream, jnp.int32)
    floats = abstract((1, cp, s_len), stream, jnp.float32)

    step_cfg = train_step.StepConfig(
        remat=True, attn_block=attn_block, logprob_chunk=chunk, cp_attention=cp_attention
    )

    def inner(params, tok, seg, pos, tgt, w):
        tok, seg, pos, tgt, w = (x[0, 0] for x in (tok, seg, pos, tgt, w))
        stream = train_step.Stream(tok, seg, pos, tgt, losses.TokenInputs(w, w, w))
        opts = train_step.LossOptions("cross_entropy", 8)
        loss, _ = train_step.model_loss(cfg, step_cfg, params, None, None, stream, {}, opts)
        return loss

    f = jax.shard_map(inner, mesh=mesh, in_specs=(specs,) + (stream,) * 5, out_specs=P())

    def loss_fn(trained, frozen, *xs):
        return f(merge_params(trained, frozen), *xs)

    trained, frozen = split_params(params)
    step = jax.jit(jax.value_and_grad(loss_fn))
    t0 = time.time()
    options = None if dump_to is None else {"xla_dump_to": dump_to}
    compiled = step.lower(trained, frozen, ints, ints, ints, ints, floats).compile(options)
    return compiled, s_len, time.time() - t0


def _tuple_parts(text):
    """The top-level comma-separated parts of an HLO tuple type "(a, b[1,2]{1,0}, …)"."""
    parts, depth, cur = [], 0, ""
    for ch in text.strip()[1:-1]:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return parts + [cur.strip()] if cur.strip() else parts


def _peak(dump_dir):
    """The buffers live at the peak of the compiled program's heap (XLA's live-range dump):
    [(name, shape, bytes)], and per instruction of the program its full JAX op_name — for
    one XLA made without metadata (a copy, a fusion of such), its first operand's (so a
    copy counts for what it copies)."""
    files = os.listdir(dump_dir)
    ranges = max(
        (f for f in files if f.endswith("live-range.txt")),
        key=lambda f: os.path.getsize(os.path.join(dump_dir, f)),
    )
    hlo = ranges.replace("-live-range.txt", ".txt")
    shapes, ops, operand = {}, {}, {}
    with open(os.path.join(dump_dir, hlo)) as f:
        for line in f:
            m = re.match(r"\s*(?:ROOT )?%(\S+) = (\(.*?\)|\S+) ([\w-]+)\((.*)", line)
            if m:
                shapes[m[1]] = m[2]
                op = re.search(r'op_name="([^"]*)"', line)
                ops[m[1]] = op[1] if op else f"({m[3]})"
                first = re.search(r"%([\w.\-]+)", m[4])
                if not op and first:
                    operand[m[1]] = first[1]
    for name in ops:  # follow copies of copies to the op that made the data
        seen, cur = 0, name
        while ops[cur].startswith("(") and cur in operand and operand[cur] in ops and seen < 8:
            cur, seen = operand[cur], seen + 1
        if cur != name and not ops[cur].startswith("("):
            ops[name] = ops[cur] + f" ({ops[name][1:-1]})"
    with open(os.path.join(dump_dir, ranges)) as f:
        text = f.read()
    peak = text[text.index("(peak):") : text.index("Stack trace breakdown")]
    out = []
    for name, index, size in re.findall(r"^\s+(\S+?)\{([\d,]*)\}: (\d+) bytes", peak, re.M):
        shape = shapes.get(name, "?")
        if shape.startswith("(") and index:
            parts = _tuple_parts(shape)
            i = int(index.split(",")[0])
            shape = parts[i] if i < len(parts) else shape
        out.append((name, re.sub(r"\{[\d,]*\}$", "", shape), int(size)))
    return out, ops


def peak_buffers(dump_dir, top):
    """The buffers live at the peak of the compiled program's heap, grouped by (what made
    them, shape), largest total first: [(MiB, count, shape, op)].

    op is the tail of the JAX op_name that made the buffer ("…/ppermute", "…/checkpoint/
    while"; a copy XLA added is named by what it copies); a group of many equal buffers
    from one op (one per ring step, say) is what grows with the number of steps rather
    than with the tokens on a rank."""
    live, ops = _peak(dump_dir)
    groups = {}
    for name, shape, size in live:
        op = ops.get(name, "")
        key = (shape, "/".join(op.split("/")[-3:]) if op else name)
        n, b = groups.get(key, (0, 0))
        groups[key] = (n + 1, b + size)
    rows = sorted(((b / MiB, n, shape, op) for (shape, op), (n, b) in groups.items()), reverse=True)
    return rows[:top]


def peak_split(dump_dir, scope):
    """(bytes, total bytes) live at the heap's peak, of which made by ops inside
    jax.named_scope(scope) (their op_name holds it)."""
    live, ops = _peak(dump_dir)
    inside = sum(size for name, _, size in live if f"/{scope}/" in ops.get(name, "") + "/")
    return inside, sum(size for _, _, size in live)


def block_balance(tokens, cp, block):
    """(zigzag, contiguous) blocks per cp rank for one datum of `tokens` tokens."""
    idx = jcp.zigzag_indices(tokens, cp)
    seg_z = np.where(idx >= 0, 0, -1).astype(np.int32)
    pos_z = np.where(idx >= 0, idx, 0).astype(np.int32)
    s_len = idx.shape[1]
    flat = np.arange(cp * s_len, dtype=np.int32)
    seg_c = np.where(flat < tokens, 0, -1).reshape(cp, s_len).astype(np.int32)
    pos_c = np.where(flat < tokens, flat, 0).reshape(cp, s_len).astype(np.int32)
    return (attention.block_work(seg_z, pos_z, block), attention.block_work(seg_c, pos_c, block))


def ratio(work):
    return float(work.max() / max(work.min(), 1))


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
    dtype="bfloat16",
)


def model_config(args, tokens):
    if args.model == "qwen3-8b":
        c = dict(QWEN3_8B)
        if args.layers is not None:
            c["num_layers"] = args.layers
        if args.dtype is not None:
            c["dtype"] = args.dtype
    else:
        c = dict(
            vocab_size=args.vocab,
            hidden_size=args.hidden,
            intermediate_size=args.intermediate,
            num_layers=args.layers or 2,
            num_heads=args.heads,
            num_kv_heads=args.kv_heads,
            head_dim=args.head_dim,
            dtype=args.dtype or "float32",
        )
    return jcp.QwenConfig(**c, max_position_embeddings=max(tokens, 32768))


def logprob_chunk(cfg, chunk):
    """The Trainer's default rule (fp32 logits of one chunk ≤ 256 MiB) under --chunk."""
    per_chunk = max(16, (1 << 26) // cfg.vocab_size)
    return min(chunk, 1 << (per_chunk.bit_length() - 1))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--tokens",
        default="32768,65536",
        help="total tokens of the one datum; a comma list runs each",
    )
    ap.add_argument("--cps", default="1,2,4,8")
    ap.add_argument(
        "--attention",
        default="ring",
        help="cp attention paths to compile at each cp > 1 (gather, ring)",
    )
    ap.add_argument(
        "--model",
        default="small",
        choices=("small", "qwen3-8b"),
        help="small: the widths below; qwen3-8b: Qwen3-8B's shape in bf16",
    )
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument(
        "--layers", type=int, default=None, help="layers (default 2 small, 36 qwen3-8b)"
    )
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument(
        "--kv-heads",
        type=int,
        default=2,
        help="kv heads (small model); 8 = as many as q heads: K/V as wide as q",
    )
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--intermediate", type=int, default=768)
    ap.add_argument("--attn-block", type=int, default=attention.DEFAULT_BLOCK)
    ap.add_argument(
        "--chunk",
        type=int,
        default=losses.DEFAULT_CHUNK,
        help="log-prob token chunk (capped as the Trainer caps it)",
    )
    ap.add_argument(
        "--dtype",
        default=None,
        choices=("float32", "bfloat16"),
        help="default float32 (small), bfloat16 (qwen3-8b); on CPU, XLA holds the "
        "layer scan's stacked bf16 activations (saved hidden states, "
        "attention outputs) in f32, twice their bf16 size, so the qwen3-8b "
        "scaling is best read in float32 on CPU",
    )
    ap.add_argument("--out", default="/tmp/jcp_memory.json")
    ap.add_argument(
        "--explain",
        type=int,
        default=0,
        metavar="N",
        help="also print the N largest groups of buffers live at the peak of "
        "each compiled program (XLA's live-range dump)",
    )
    ap.add_argument("--no-balance", action="store_true", help="skip the block-work table")
    args = ap.parse_args(argv)

    cps = [int(c) for c in args.cps.split(",")]
    token_list = [int(t) for t in args.tokens.split(",")]
    print(f"jax {jax.__version__}, {len(jax.devices())} {jax.devices()[0].platform} devices")
    print(f"config: {model_config(args, token_list[0])}")
    print(
        f"attn_block {args.attn_block}, remat on, grad w.r.t. the norms; M = arguments "
        f"+ outputs + temporaries per device; weights are replicated over cp, so the "
        f"activation share is temp (temp/t1)\n"
    )

    rows = []
    hdr = (
        f"{'tokens':>6} {'cp':>3} {'path':>6} {'S/rank':>7} {'arg MiB':>9} {'out MiB':>8} "
        f"{'temp MiB':>9} {'total MiB':>10} {'M/M1':>6} {'goal':>6} {'temp/t1':>8} {'ok':>3} "
        f"{'compile':>8}"
    )
    print(hdr)
    print("-" * len(hdr))
    explained = {}
    paths = args.attention.split(",")
    for tokens in token_list:
        cfg = model_config(args, tokens)
        chunk = logprob_chunk(cfg, args.chunk)
        base_total = base_temp = None
        for cp, path in [(c, p) for c in cps for p in (["gather"] if c == 1 else paths)]:
            with tempfile.TemporaryDirectory() as dump:
                compiled, s_len, secs = compiled_step(
                    cfg, cp, tokens, args.attn_block, chunk, path, dump if args.explain else None
                )
                if args.explain:
                    explained[f"{tokens} tokens, cp={cp} {path}"] = peak_buffers(dump, args.explain)
            mem = compiled.memory_analysis()
            total = mem.temp_size_in_bytes + mem.argument_size_in_bytes + mem.output_size_in_bytes
            if base_total is None:
                base_total, base_temp = total, mem.temp_size_in_bytes
            r = total / base_total
            goal = 1.2 / cp
            row = dict(
                tokens=tokens,
                cp=cp,
                path=path,
                s_per_rank=s_len,
                temp_bytes=mem.temp_size_in_bytes,
                argument_bytes=mem.argument_size_in_bytes,
                output_bytes=mem.output_size_in_bytes,
                alias_bytes=mem.alias_size_in_bytes,
                total_bytes=total,
                ratio_to_cp1=r,
                goal=goal,
                meets_goal=bool(r <= goal),
                temp_ratio_to_cp1=mem.temp_size_in_bytes / base_temp,
                compile_s=secs,
            )
            rows.append(row)
            print(
                f"{tokens:>6} {cp:>3} {path:>6} {s_len:>7} "
                f"{mem.argument_size_in_bytes / MiB:>9.1f} {mem.output_size_in_bytes / MiB:>8.1f} "
                f"{mem.temp_size_in_bytes / MiB:>9.1f} {total / MiB:>10.1f} {r:>6.3f} "
                f"{goal:>6.3f} {row['temp_ratio_to_cp1']:>8.3f} "
                f"{'yes' if row['meets_goal'] else 'NO':>3} {secs:>7.1f}s",
                flush=True,
            )

    for what, groups in explained.items():
        print(
            f"\n{what}: buffers live at the heap's peak, largest groups (MiB, count, shape, "
            f"made by)"
        )
        for mib, n, shape, op in groups:
            print(f"  {mib:8.2f}  {n:>3} × {shape:<28} {op}")

    work = []
    if not args.no_balance:
        tokens = token_list[0]
        print(
            f"\nattention blocks per cp rank (block {args.attn_block}, one datum of "
            f"{tokens} tokens)"
        )
        hdr2 = f"{'cp':>3} {'layout':>10} {'min':>6} {'max':>6} {'max/min':>8}  per rank"
        print(hdr2)
        print("-" * len(hdr2))
        for cp in cps:
            z, c = block_balance(tokens, cp, args.attn_block)
            work.append(
                dict(
                    cp=cp,
                    zigzag=z.tolist(),
                    contiguous=c.tolist(),
                    zigzag_max_over_min=ratio(z),
                    contiguous_max_over_min=ratio(c),
                    zigzag_meets_goal=ratio(z) <= 1.05,
                )
            )
            for name, w in (("zigzag", z), ("contiguous", c)):
                print(
                    f"{cp:>3} {name:>10} {w.min():>6} {w.max():>6} {ratio(w):>8.2f}  {w.tolist()}"
                )

    out = dict(
        config=dict(vars(args)),
        model=str(model_config(args, token_list[0])),
        memory=rows,
        block_work=work,
        peak_buffers={k: v for k, v in explained.items()},
    )
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
    print(f"\nwrote {args.out}")
    return out


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
