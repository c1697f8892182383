"""Multi-LoRA at fixed tokens: what a fused pass costs against the number of adapters in it.

One Trainer (a 1024-wide, 4-layer Qwen3: jcp.QwenConfig.tiny(hidden_size=1024, …), fp32),
--adapters adapters of rank 16 (alpha 32) on --targets (attn + mlp; add unembed for the
unembedding's LoRA, with a wider --vocab to see it; --experts E: every layer MoE, E experts
of width 256, top 2, with --targets attn,experts), all created up front; one batch of
--datums datums of uneven lengths (--tokens in all, the same tokens in every row of the
table), datum j on adapter ⌊j·A / datums⌋ of the first A. For each A: one fused
forward_backward, timed (best of --reps, the A's run interleaved so a slow spell of the
shared machine falls on every A alike; wall and process CPU seconds), and the compiled
program's per-device memory (XLA's memory analysis: temporaries, and arguments + outputs +
temporaries). Goal (issue 33): time(A) / time(1) ≤ 1.15 and memory ≤ 1.1× at every A.

Contiguous, not round-robin: packing orders a stream by adapter but numbers its datum slots
(segment ids) by datum index, so round-robin owners leave the segment ids out of order
along the stream, and attention's block skipping (attention.tiling.blocks_needed: per-block
segment ranges) then computes blocks it could skip — 17.3 against 8.8 CPU s for this
batch over 16 adapters (one thread), whatever the LoRA products cost. --round-robin shows
it.

--parts sample times an engine-free prefill + --decode-steps decode of one prompt per row
(--rows rows) over the same A adapters (Trainer.sample), the rows' adapters interleaved
(row i: adapter i mod A), so decode batches mix adapters in any order.

--parts kernels times the grouped LoRA product alone (lora.delta, forward + backward, S = 4096,
I = O = 1024, R = 16) against the masked dense product it replaced and jax.lax.ragged_dot,
at tile sizes 16 … 256 (in isolation; lora.tile_rows is set by the fused pass).

--parts cpu_ops times lora_impl="cpu"'s kernels alone (jcp/lora_cpu.cc through
jcp.lora_cpu: each factor's forward and backward, Q = 4096 rows, I = O = 1024, R = 16, the
rows in contiguous runs of A adapters, one device, best of 7 wall times) beside XLA's own
dots for one adapter (x · A, u · B and their backward): what a kernel costs against a
plain matrix product of the same shape.

    python benchmarks/multi_lora.py [--adapters 1,4,16,64] [--parts fused,sample,kernels,cpu_ops]
    python benchmarks/multi_lora.py --smoke          # tiny shapes: every part runs
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from common import best_time  # noqa: E402  (benchmarks/ is sys.path[0])

import jcp  # noqa: E402
from jcp import lora as lora_lib  # noqa: E402
from jcp import lora_cpu  # noqa: E402

MiB = float(1 << 20)
TILES = (16, 32, 64, 128, 256)


def config(smoke: bool, vocab: int = 2048, experts: int = 0) -> jcp.QwenConfig:
    if smoke:
        return jcp.QwenConfig.tiny(num_layers=2)
    moe = {}
    if experts:  # every layer MoE, top 2 of `experts` experts of width 256
        moe = dict(
            num_experts=experts,
            num_experts_per_tok=2,
            moe_intermediate_size=256,
            norm_topk_prob=True,
            mlp_only_layers=(),
        )
    return jcp.QwenConfig.tiny(
        **moe,
        hidden_size=1024,
        intermediate_size=2048,
        num_layers=4,
        num_heads=16,
        num_kv_heads=8,
        head_dim=64,
        vocab_size=vocab,
    )


def datums(n: int, tokens: int, vocab: int, seed: int = 0) -> list:
    """n datums of uneven even lengths (½ … 1½ × the mean) summing to `tokens`: packed
    without padding into one stream of `tokens` rows."""
    rng = np.random.default_rng(seed)
    mean = tokens // n
    lengths = 2 * rng.integers(max(1, mean // 4), mean // 2 + mean // 4 + 1, n)
    while lengths.sum() != tokens:  # even steps onto the longest / shortest until exact
        if lengths.sum() > tokens:
            lengths[np.argmax(lengths)] -= 2
        else:
            lengths[np.argmin(lengths)] += 2
    assert lengths.min() >= 2, lengths
    out = []
    for n_tok in lengths:
        seq = rng.integers(0, vocab, int(n_tok) + 1)
        out.append(
            jcp.Datum(
                model_input=seq[:-1],
                loss_fn_inputs={
                    "target_tokens": seq[1:],
                    "weights": np.ones(int(n_tok), np.float32),
                },
            )
        )
    return out


def program_memory(program) -> tuple[float, float]:
    """(temporaries, arguments + outputs + temporaries) MiB of a compiled program."""
    m = program.memory_analysis()
    total = (
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        + m.temp_size_in_bytes
        - m.alias_size_in_bytes
    )
    return m.temp_size_in_bytes / MiB, total / MiB


def fused_passes(args, cfg) -> list[dict]:
    counts = [int(a) for a in args.adapters.split(",")]
    # One micro-batch of exactly --tokens rows (datums(): no padding).
    tr = jcp.Trainer(
        cfg,
        jcp.make_mesh(1, 1, 1),
        max_adapters=max(counts),
        max_rank=16,
        remat=False,
        max_tokens_per_device=args.tokens,
        lora_impl=args.lora_impl,
    )
    ids = [
        tr.create_adapter(rank=16, alpha=32.0, seed=i, targets=args.targets.split(","))
        for i in range(max(counts))
    ]
    data = datums(args.datums, args.tokens, cfg.vocab_size)
    rows, runs, program = [], {}, None
    for a in counts:
        owners = [ids[i % a if args.round_robin else i * a // len(data)] for i in range(len(data))]
        before = set(tr.forward_backward_programs)
        t0 = time.perf_counter()
        tr.forward_backward(data, "cross_entropy", adapters=owners)
        compile_s = time.perf_counter() - t0
        # A's that pack to the same entry count (batch.static_counts) share a program.
        new = [p for k, p in tr.forward_backward_programs.items() if k not in before]
        program = new[-1] if new else program
        temp, total = program_memory(program)
        rows.append({"A": a, "compile_s": compile_s, "temp_mib": temp, "total_mib": total})
        runs[a] = lambda owners=owners: tr.forward_backward(data, "cross_entropy", adapters=owners)
    best = {a: (float("inf"), float("inf")) for a in counts}
    for _ in range(args.reps):
        for a, run in runs.items():
            t, c = time.perf_counter(), time.process_time()
            run()
            best[a] = (
                min(best[a][0], time.perf_counter() - t),
                min(best[a][1], time.process_time() - c),
            )
    for row in rows:
        row["wall_s"], row["cpu_s"] = best[row["A"]]
    return rows


def sampling(args, cfg) -> list[dict]:
    counts = [int(a) for a in args.adapters.split(",")]
    tr = jcp.Trainer(cfg, jcp.make_mesh(1, 1, 1), max_adapters=max(counts), max_rank=16)
    ids = [
        tr.create_adapter(rank=16, alpha=32.0, seed=i, targets=args.targets.split(","))
        for i in range(max(counts))
    ]
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, cfg.vocab_size, 16).tolist() for _ in range(args.rows)]
    sp = jcp.SamplingParams(max_tokens=args.decode_steps, temperature=1.0, seed=0)
    rows, runs = [], {}
    for a in counts:
        owners = [ids[i % a] for i in range(args.rows)]
        runs[a] = lambda owners=owners: tr.sample(prompts, sp, adapters=owners)
        runs[a]()
        rows.append({"A": a})
    best = {a: float("inf") for a in counts}
    for _ in range(args.reps):
        for a, run in runs.items():
            t = time.perf_counter()
            run()
            best[a] = min(best[a], time.perf_counter() - t)
    for row in rows:
        row["wall_s"] = best[row["A"]]
    return rows


def kernels(smoke: bool) -> list[dict]:
    """lora.delta (grouped) against the masked dense product and ragged_dot, fwd + bwd."""
    s_len, width, rank = (256, 64, 4) if smoke else (4096, 1024, 16)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((s_len, width)), jnp.float32)
    ct = jnp.asarray(rng.standard_normal((s_len, width)), jnp.float32)
    meta = lora_lib.SlotMeta(scale_G=jnp.full(256, 2.0), shared_G=jnp.zeros(256))
    out = []
    for a in (1, 8) if smoke else (1, 4, 16, 64):
        fa = jnp.asarray(rng.standard_normal((a, width, rank)) * 0.03, jnp.float32)
        fb = jnp.asarray(rng.standard_normal((a, rank, width)) * 0.03, jnp.float32)
        cuts = np.sort(rng.choice(np.arange(1, s_len), a - 1, replace=False))
        edges = np.concatenate([[0], cuts, [s_len]])
        spans = jnp.asarray(np.stack([edges[:-1], edges[1:]], 1), jnp.int32)
        active = jnp.arange(a)
        route = meta.routing(active, spans, s_len=s_len)
        w_SxA = jnp.where(route.mask_SxA(s_len), route.scale_A[None], 0.0)

        def dense(x, fa, fb):  # the masked product: every row times all A adapters
            u = jnp.einsum("si,air->sar", x, fa) * w_SxA[:, :, None]
            return jnp.einsum("sar,aro->so", u, fb)

        def ragged(x, fa, fb):
            sizes = spans[:, 1] - spans[:, 0]
            u = jax.lax.ragged_dot(x, fa, sizes) * (w_SxA.sum(1))[:, None]
            return jax.lax.ragged_dot(u, fb, sizes)

        fns = {"dense": dense, "ragged_dot": ragged}
        for tile in (8, 32) if smoke else TILES:
            tiles = lora_lib.plan_spans(spans, active >= 0, route.scale_A, s_len, tile)
            r = lora_lib.Routing(active, spans, route.scale_A, route.shared_A, tiles=tiles)
            fns[f"T={tile}"] = lambda x, fa, fb, r=r: lora_lib.delta(x, fa, fb, r)
        fns["grouped (tile_rows)"] = lambda x, fa, fb: lora_lib.delta(x, fa, fb, route)
        row = {"A": a, "tile_rows": lora_lib.tile_rows(s_len, a)}
        ref = None
        for name, fn in fns.items():
            step = jax.jit(
                jax.value_and_grad(
                    lambda x, fa, fb, fn=fn: jnp.vdot(fn(x, fa, fb), ct), argnums=(0, 1, 2)
                )
            )
            res = jax.block_until_ready(step(x, fa, fb))
            if ref is None:
                ref = res
            err = max(
                float(jnp.max(jnp.abs(p - q)) / jnp.max(jnp.abs(q)))  # the gradients
                for p, q in zip(res[1], ref[1])
            )
            assert err < 1e-4, (a, name, err)
            best = float("inf")
            for _ in range(3 if smoke else 5):
                c = time.process_time()
                jax.block_until_ready(step(x, fa, fb))
                best = min(best, time.process_time() - c)
            row[name] = best * 1e3
        out.append(row)
    return out


def cpu_ops(smoke: bool) -> dict:
    """{"kernels": [{"A", op: ms}], "xla": {op: ms}, "shape"}: lora_cpu's four calls per A,
    and XLA's dots of one adapter's factors; wall ms, best of 7 (3 with --smoke)."""
    q, i_w, o_w, r = (256, 64, 64, 8) if smoke else (4096, 1024, 1024, 16)
    reps, rng = (3 if smoke else 7), np.random.default_rng(0)

    def rand(*shape, scale=1.0):
        return jnp.asarray(rng.standard_normal(shape) * scale, jnp.float32)

    def ms(f, *args) -> float:
        f = jax.jit(f)
        return best_time(lambda: jax.block_until_ready(f(*args)), reps) * 1e3

    x, dy, u = rand(q, i_w), rand(q, o_w), rand(q, r)
    a1, b1 = rand(i_w, r, scale=0.03), rand(r, o_w, scale=0.03)
    xla = {
        "a_fwd": ms(lambda x, a: x @ a, x, a1),
        "b_fwd": ms(lambda u, b: u @ b, u, b1),
        "a_bwd": ms(lambda u, a, x: (u @ a.T, x.T @ u), u, a1, x),
        "b_bwd": ms(lambda dy, b, u: (dy @ b.T, u.T @ dy), dy, b1, u),
    }
    rows = []
    for n_a in (1, 4) if smoke else (1, 16, 256):
        ta, tb = rand(n_a, 1, i_w, r, scale=0.03), rand(n_a, 1, r, o_w, scale=0.03)
        page = jnp.arange(n_a, dtype=jnp.int32)[:, None]
        row_k = jnp.asarray(np.arange(q) * n_a // q, jnp.int32)  # contiguous runs
        calls = {  # (the call of table t, pages p, rows' adapters k; its arrays)
            "a_fwd": (lambda x, t, p, k: lora_cpu.forward("a", x, t, 0, p, k), (x, ta)),
            "b_fwd": (lambda u, t, p, k: lora_cpu.forward("b", u, t, 0, p, k), (u, tb)),
            "a_bwd": (lambda x, d, t, p, k: lora_cpu.backward("a", x, d, t, 0, p, k), (x, u, ta)),
            "b_bwd": (lambda u, d, t, p, k: lora_cpu.backward("b", u, d, t, 0, p, k), (u, dy, tb)),
        }
        row = {name: ms(f, *args, page, row_k) for name, (f, args) in calls.items()}
        rows.append({"A": n_a, **row})
    return {"kernels": rows, "xla": xla, "shape": (q, i_w, o_w, r)}


def report_fused(args, cfg, rows) -> None:
    base = rows[0]
    print(
        f"fused forward_backward, {args.datums} datums / {args.tokens} tokens, hidden "
        f"{cfg.hidden_size}, {cfg.num_layers} layers, vocab {cfg.vocab_size}, r16 on "
        f"{args.targets}"
    )
    print(
        f"{'A':>4} {'wall s':>7} {'CPU s':>7} {'t/t1':>6} {'temp MiB':>9} {'temp/t1':>7} "
        f"{'total MiB':>9} {'tot/t1':>6} {'compile s':>9}"
    )
    for r in rows:
        r["time_ratio"] = r["wall_s"] / base["wall_s"]
        r["cpu_ratio"] = r["cpu_s"] / base["cpu_s"]
        r["temp_ratio"] = r["temp_mib"] / base["temp_mib"]
        r["total_ratio"] = r["total_mib"] / base["total_mib"]
        print(
            f"{r['A']:>4} {r['wall_s']:>7.3f} {r['cpu_s']:>7.3f} {r['time_ratio']:>6.2f} "
            f"{r['temp_mib']:>9.1f} {r['temp_ratio']:>7.3f} {r['total_mib']:>9.1f} "
            f"{r['total_ratio']:>6.3f} {r['compile_s']:>9.1f}"
        )


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--adapters", default="1,4,16,64")
    ap.add_argument("--datums", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--round-robin", action="store_true", help="datum j on adapter j mod A")
    ap.add_argument("--parts", default="fused", help="of fused,sample,kernels")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--targets", default="attn,mlp", help="the adapters' targets (+ unembed)")
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument(
        "--experts", type=int, default=0, help="a MoE model of this many experts (targets: experts)"
    )
    ap.add_argument(
        "--lora-impl", default="auto", help="TrainerOptions.lora_impl: auto, xla or cpu"
    )
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    if args.smoke:
        args.adapters, args.datums, args.tokens, args.reps = "1,4", 8, 128, 1
        args.rows, args.decode_steps, args.parts = 8, 4, "fused,sample,kernels,cpu_ops"
    cfg = config(args.smoke, args.vocab, args.experts)
    res = {}
    t0 = time.perf_counter()
    parts = args.parts.split(",")
    if "fused" in parts:
        res["fused"] = fused_passes(args, cfg)
        report_fused(args, cfg, res["fused"])
    if "sample" in parts:
        res["sample"] = rows = sampling(args, cfg)
        print(
            f"sample: {args.rows} prompts of 16 tokens, {args.decode_steps} new tokens, "
            "row i on adapter i mod A"
        )
        for r in rows:
            r["time_ratio"] = r["wall_s"] / rows[0]["wall_s"]
            print(f"{r['A']:>4} {r['wall_s']:>7.3f} s {r['time_ratio']:>6.2f}")
    if "kernels" in parts:
        res["kernels"] = rows = kernels(args.smoke)
        print(
            "lora.delta forward + backward, CPU ms (S = 4096, I = O = 1024, R = 16, or "
            "smoke's 256, 64, 4; uneven random spans)"
        )
        for r in rows:
            print(
                "  ".join(
                    f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items()
                )
            )
    if "cpu_ops" in parts:
        if not lora_cpu.available():
            print("cpu_ops: jcp's CPU kernels are not available here")
        else:
            res["cpu_ops"] = ops = cpu_ops(args.smoke)
            q, i_w, o_w, r = ops["shape"]
            print(f"lora_cpu kernels, wall ms (Q = {q}, I = {i_w}, O = {o_w}, R = {r}, one device)")
            names = ("a_fwd", "b_fwd", "a_bwd", "b_bwd")
            print(f"{'A':>9} " + " ".join(f"{n:>7}" for n in names))
            for row in ops["kernels"]:
                print(f"{row['A']:>9} " + " ".join(f"{row[n]:>7.2f}" for n in names))
            print(f"{'XLA dots':>9} " + " ".join(f"{ops['xla'][n]:>7.2f}" for n in names))
    print(f"({time.perf_counter() - t0:.0f} s)")
    return res


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
