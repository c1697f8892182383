"""One prepared accelerator run: everything issue 22 asks of a GPU, in one go, one table.

On one H200 it is meant to finish in about 10 minutes: each part runs in its own
subprocess under a hard time limit (a part that fails or runs out of time shows the rows it
finished and its error in the table, and the others still run; the limits add up to 15
minutes; --parts runs some of them, --logs keeps each part's whole output). Parts:

  kernels  Pallas kernels (jcp/pallas_attention.py, Triton) against the blockwise kernel
           on the device, values and gradients (d q, k, v), bf16 and fp32: one datum of
           8192 tokens, Qwen3-8B's heads (32 query, 8 kv, head dim 128); max |Δ| relative
           to the blockwise result's largest entry, and fwd / fwd+bwd times of each.
  mfu_pallas, mfu_blockwise
           benchmarks/mfu.py (Qwen3-8B shape, one datum of 32768 tokens, LoRA r32 on every
           target) through the Trainer with attn_impl "pallas" (36 layers) and with
           "blockwise" (--blockwise-layers, default 8: the XLA kernel is the slow path and
           MFU is per-layer work, so fewer layers measure the same rate in less time):
           tokens/s, MFU, the remat choice (remat "auto"), and the device's own peak memory
           (memory_stats: weights + adapter state + the step; each part is its own process,
           so the peak is its own).
  memory   per-device compiled memory of bf16 training (benchmarks/memory.py's program:
           Qwen3-8B shape, 36 layers, gradient through every layer, cp = 1) at 32768 and
           65536 tokens, and whether the compiled program holds f32 copies of the stacked
           bf16 weights (unfused f32 arrays of a stacked weight's shape; XLA:CPU computes
           bf16 dots in f32 and made them until model.scan_layers tied each stack to the
           layer index: now it converts one layer's slice at a time).
  decode   the engine's decode tokens/s at batch 1, 64 and 512 (Qwen3-8B shape, bf16, one
           adapter r32, 16-token prompts, 64 new tokens at T = 1, no stop tokens) against
           the HBM roofline. One Engine (jcp/sample/engine.py, its paged cache; attn_impl
           "auto" = "pallas" on a GPU for bf16: attention.paged's kernel reads each row's
           pages in place); per batch a warm-up round (compiles), then a timed round whose
           prompts are prefilled in prefill-only steps first, so the time is the decode's
           alone. Roofline: the bytes every decode step must read from HBM — the weights
           it multiplies (all but the embedding table, whose B rows are gathered; the
           adapter's factors) and each row's live K/V (its cached positions, every layer)
           — summed over the round's steps, at the device's HBM bandwidth (HBM_BYTES_PER_S,
           by device kind; none on CPU).

  multi_lora
           issue 33 on the device (benchmarks/multi_lora.py's shape: a 1024-wide 4-layer
           Qwen3, r16 on attn + mlp): one fused forward_backward of 256 datums in 4,096
           rows over A = 1, 8, 64, 256 adapters (time and compiled memory against A = 1),
           lora_impl "auto" (the tiles in XLA on a GPU). Last, so the others run first.

    python benchmarks/gpu.py                 # on the GPU machine
    python benchmarks/gpu.py --smoke         # CPU check of every part: tiny shapes, in
                                             # one process (tests/test_benchmarks.py)
    python benchmarks/gpu.py --parts kernels,decode --out /tmp/gpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PARTS = ("kernels", "memory", "mfu_pallas", "mfu_blockwise", "decode", "multi_lora")
# Seconds per part. The H200 run of 2026-12-04 (jax 0.11.2) took kernels 96 s (when its
# inputs were still compile-time constants), memory 79 s, mfu_pallas 166 s (a first step of
# 128 s: two compiles, remat "auto"); mfu_blockwise and decode ran past 120 s.
LIMITS_S = {
    "kernels": 75,
    "memory": 120,
    "mfu_pallas": 200,
    "mfu_blockwise": 200,
    "decode": 180,
    "multi_lora": 120,
}
GiB = float(1 << 30)
# HBM bandwidth by device kind (vendor figures), for the decode roofline.
HBM_BYTES_PER_S = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12}


# ----------------------------------------------------------------------------------------
# Parts (each runs in its own process: python gpu.py --part NAME [--smoke])


class Rows(list):
    """A part's rows; each one is also printed ("ROW {json}", flushed) as it is added, so a
    part stopped at its time limit still reports the rows it finished."""

    def append(self, row):
        super().append(row)
        print("ROW " + json.dumps(row, default=str), flush=True)


def progress(msg):
    """A line in the part's log (stderr), flushed: where a part that timed out had got to."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _timed(f, *args, reps=3):
    """Median seconds of f(*args) over reps calls after one warm-up call (compiles)."""
    import jax

    jax.block_until_ready(f(*args))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def part_kernels(smoke: bool) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import PartitionSpec as P

    import jcp
    from jcp import attention
    from jcp.mesh import SPECS

    s_len, q_heads, kv_heads, head_dim, block = (
        (128, 4, 2, 16, 32) if smoke else (8192, 32, 8, 128, 512)
    )
    mesh = jcp.make_mesh(1, 1, 1)
    seg = jnp.zeros(s_len, jnp.int32)
    pos = jnp.arange(s_len, dtype=jnp.int32)
    rng = np.random.default_rng(0)
    rows = Rows()
    for dtype in ("float32", "bfloat16"):
        q, k, v, g = (
            jnp.asarray(rng.standard_normal(shape), dtype)
            for shape in (
                (s_len, q_heads, head_dim),
                (s_len, kv_heads, head_dim),
                (s_len, kv_heads, head_dim),
                (s_len, q_heads, head_dim),
            )
        )

        def attend(impl):
            def f(q, k, v, seg, pos):
                return attention.cp_attention(q, k, v, seg, pos, implementation=impl, block=block)

            return jax.shard_map(
                f,
                mesh=mesh,
                in_specs=(P(),) * 3 + (SPECS.replicated,) * 2,
                out_specs=P(),
                check_vma=False,
            )

        def vjp(f):
            # Every array an argument: arrays a jitted function closes over become constants,
            # which XLA folds at compile time (minutes at 8192 tokens on the H200).
            def grads(q, k, v, g, seg, pos):
                return jax.vjp(lambda q, k, v: f(q, k, v, seg, pos), q, k, v)[1](g)

            return grads

        res = {}
        for impl in ("blockwise", "pallas"):
            fwd, grad = jax.jit(attend(impl)), jax.jit(vjp(attend(impl)))
            out = fwd(q, k, v, seg, pos)
            grads = grad(q, k, v, g, seg, pos)
            res[impl] = dict(
                out=np.asarray(out, np.float32),
                grads=[np.asarray(x, np.float32) for x in grads],
                fwd_s=_timed(fwd, q, k, v, seg, pos),
                fwd_bwd_s=_timed(grad, q, k, v, g, seg, pos),
            )
            progress(
                f"kernels {dtype} {impl}: fwd {res[impl]['fwd_s'] * 1e3:.2f} ms, "
                f"fwd+bwd {res[impl]['fwd_bwd_s'] * 1e3:.2f} ms"
            )
        ref, got = res["blockwise"], res["pallas"]

        def rel(a, b):
            return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))

        rows.append(
            dict(
                dtype=dtype,
                tokens=s_len,
                heads=f"{q_heads}/{kv_heads}x{head_dim}",
                out_rel_err=rel(got["out"], ref["out"]),
                grad_rel_err=max(rel(a, b) for a, b in zip(got["grads"], ref["grads"])),
                finite=bool(
                    np.isfinite(got["out"]).all()
                    and all(np.isfinite(x).all() for x in got["grads"])
                ),
                **{f"{impl}_{k}": res[impl][k] for impl in res for k in ("fwd_s", "fwd_bwd_s")},
            )
        )
    return rows


def part_memory(smoke: bool) -> list[dict]:
    import jax
    import jax.numpy as jnp

    import jcp
    from jcp import model

    sys.path.insert(0, HERE)
    import memory  # noqa: E402  (benchmarks/memory.py: its compiled program)

    base = dict(memory.QWEN3_8B)
    if smoke:
        base.update(
            vocab_size=1024,
            hidden_size=128,
            intermediate_size=256,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            head_dim=32,
        )
    rows = Rows()
    for tokens in (1024, 2048) if smoke else (32768, 65536):
        cfg = jcp.QwenConfig(**base, max_position_embeddings=max(tokens, 40960))
        progress(f"memory: compiling the {tokens}-token step")
        compiled, _, secs = memory.compiled_step(
            cfg, 1, tokens, 512, 256 if smoke else memory.logprob_chunk(cfg, 1024)
        )
        m = compiled.memory_analysis()
        shapes = [
            s
            for s in jax.tree.leaves(
                model.param_shapes(cfg)["layers"], is_leaf=lambda x: isinstance(x, tuple)
            )
            if len(s) == 3
        ]
        # A stacked weight [L, I, O] in f32 made by an instruction outside fused computations
        # (a buffer of its own; inside a fusion it is computed slice by slice). Activations
        # are [tokens, …], so at these lengths no activation has a weight's shape.
        stacks = {f"f32[{','.join(map(str, s))}]" for s in shapes}
        f32_copies = sorted({m for m in unfused_shapes(compiled.as_text()) if m in stacks})
        rows.append(
            dict(
                tokens=tokens,
                platform=jax.devices()[0].platform,
                argument_gib=m.argument_size_in_bytes / GiB,
                output_gib=m.output_size_in_bytes / GiB,
                temp_gib=m.temp_size_in_bytes / GiB,
                total_gib=(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes)
                / GiB,
                bf16_weights=jnp.dtype(cfg.dtype).name,
                f32_copies_of_stacked_weights=f32_copies,
                compile_s=secs,
            )
        )
    return rows


def unfused_shapes(hlo_text: str) -> set[str]:
    """Result shapes ("f32[2,3]") of the instructions of an optimized HLO module's
    computations other than fusion bodies (*_computation*: XLA's fused computations)."""
    out, fused = set(), False
    for line in hlo_text.splitlines():
        if line and not line[0].isspace():  # a computation's header (or the module's)
            fused = "_computation" in line.split("(")[0]
            continue
        m = None if fused else re.match(r"\s*(?:ROOT )?%\S+ = (\w+\[[\d,]*\])", line)
        if m:
            out.add(m[1])
    return out


def part_mfu(smoke: bool, impl: str, blockwise_layers: int) -> list[dict]:
    sys.path.insert(0, HERE)
    import mfu  # noqa: E402

    argv = ["--attn-impl", impl, "--steps", "2", "--warmup", "1", "--mesh", "1,1,1"]
    if smoke:
        argv += ["--smoke", "--attn-block", "64"]
    elif impl == "blockwise":
        argv += ["--layers", str(blockwise_layers)]
    res = mfu.main(argv)
    return [
        dict(
            attn_impl=impl,
            **{
                k: res.get(k)
                for k in (
                    "layers",
                    "tokens",
                    "tokens_per_s",
                    "median_step_s",
                    "first_step_s",
                    "mfu",
                    "mfu_6n",
                    "peak_bytes_in_use",
                    "remat",
                )
            },
        )
    ]


def part_multi_lora(smoke: bool) -> list[dict]:
    sys.path.insert(0, HERE)
    import argparse as _argparse

    import multi_lora  # noqa: E402

    args = _argparse.Namespace(
        adapters="1,5" if smoke else "1,8,64,256",
        datums=8 if smoke else 256,
        tokens=128 if smoke else 4096,
        reps=1 if smoke else 3,
        round_robin=False,
        targets="attn,mlp",
        lora_impl="auto",
    )
    cfg = multi_lora.config(smoke)
    rows = Rows()
    for r in multi_lora.fused_passes(args, cfg):
        rows.append(dict(r, tokens=args.tokens))
    for r in rows:
        r["time_ratio"] = r["wall_s"] / rows[0]["wall_s"]
        r["total_ratio"] = r["total_mib"] / rows[0]["total_mib"]
    return list(rows)


def hbm_bytes_per_s(device_kind: str) -> float | None:
    return next((bw for k, bw in HBM_BYTES_PER_S.items() if k in device_kind), None)


def decode_step_bytes(cfg, params: dict, adapter_bytes: int) -> tuple[int, int]:
    """(bytes of weights one decode step reads, bytes of K/V per cached position).

    Weights: every base weight but the embedding table (a step gathers its B rows; with
    tied embeddings the table is the unembedding and is read whole) plus the adapter's
    factors. K/V: K and V of every full-attention layer."""
    import jax
    import numpy as np

    weights = sum(
        x.nbytes
        for k, t in params.items()
        if k != "embed" or cfg.tie_word_embeddings
        for x in jax.tree.leaves(t)
    )
    kv_layers = cfg.linear_layers.count(False) if cfg.is_hybrid else cfg.num_layers
    per_position = 2 * kv_layers * cfg.num_kv_heads * cfg.head_dim * np.dtype(cfg.dtype).itemsize
    return weights + adapter_bytes, per_position


def part_decode(smoke: bool) -> list[dict]:
    import jax
    import numpy as np

    import jcp
    from jcp.sample.engine import Engine

    sys.path.insert(0, HERE)
    import mfu  # noqa: E402

    cfg = mfu.config(1, 8, 1024) if smoke else mfu.config(36, 1, 1024)
    mesh = jcp.make_mesh(1, 1, 1)
    progress("decode: placing the weights")
    tr = jcp.Trainer(cfg, mesh, mfu.device_random_params(cfg), max_adapters=1, max_rank=32)
    a = tr.create_adapter(rank=32, alpha=64.0, targets=list(mfu.TARGETS))
    prompt, new = 16, (8 if smoke else 64)
    batches = (1, 4) if smoke else (1, 64, 512)
    sampler = tr.make_sampler()
    eng = Engine(sampler, slots=max(batches), max_len=prompt + new)
    # max_adapters = 1: the slot tables are this adapter's (fp32 factors).
    adapter = sum(x.nbytes for x in jax.tree.leaves(tr.state.weights))
    weights, per_position = decode_step_bytes(cfg, tr.params, adapter)
    bandwidth = hbm_bytes_per_s(jax.devices()[0].device_kind)
    rng = np.random.default_rng(0)
    sp = jcp.SamplingParams(max_tokens=new, temperature=1.0, stop=[], seed=0)
    rows = Rows()
    for batch in batches:
        prompts = [rng.integers(0, cfg.vocab_size, prompt).tolist() for _ in range(batch)]
        progress(f"decode: batch {batch}, warm-up round (compiles)")
        t = time.perf_counter()
        eng.sample(prompts, sp, adapters=a)
        first = time.perf_counter() - t
        progress(f"decode: batch {batch}, warm-up {first:.1f} s; timed round")
        rids = [eng.submit(p, sp, a) for p in prompts]
        hosts = getattr(eng, "admission", eng)  # the engine's host-side bookkeeping
        for _ in range(64):  # prefill-only steps until every row is admitted and prefilled
            if eng.live == batch and not hosts.prefilling:
                break
            eng.step(decode=False)
        t = time.perf_counter()
        eng.run()
        secs = time.perf_counter() - t
        made = sum(len(s.tokens) for r in rids for s in eng.result(r).sequences)
        # Step i (0 ≤ i < new) attends over prompt − 1 + i cached positions of each row.
        read = new * weights + batch * per_position * (new * (prompt - 1) + new * (new - 1) // 2)
        roofline = None if bandwidth is None else made / (read / bandwidth)
        rows.append(
            dict(
                batch=batch,
                new_tokens=new,
                tokens=made,
                seconds=secs,
                tokens_per_s=made / secs,
                first_call_s=first,
                attn_impl=sampler.step_cfg.attn_impl,
                weights_gib=weights / GiB,
                kv_gib_per_step=(read / new - weights) / GiB,
                roofline_tokens_per_s=roofline,
                of_roofline=None if roofline is None else made / secs / roofline,
            )
        )
    return rows


# ----------------------------------------------------------------------------------------
# Driver


def subprocess_json(cmd, timeout, log=None):
    """Run cmd; its last 'RESULT {json}' line, or {"error": why, "rows": [the rows it
    printed ("ROW {json}") before it failed or ran out of time]}. With log, the command's
    whole stdout and stderr are written there (a timed-out part's too)."""
    try:
        p = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=_env(),
            cwd=os.path.dirname(HERE),
        )
        out, err, why = p.stdout, p.stderr, None
    except subprocess.TimeoutExpired as e:
        out, err, why = _text(e.stdout), _text(e.stderr), f"timed out after {timeout} s"
    _write_log(log, out, err)
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    if why is None and p.returncode == 0 and lines:
        return json.loads(lines[-1][len("RESULT ") :])
    if why is None:
        tail = (err or out).strip().splitlines()[-1:] or ["?"]
        why = f"exit {p.returncode}: {tail[0][:200]}"
    return {
        "error": why,
        "rows": [json.loads(ln[len("ROW ") :]) for ln in out.splitlines() if ln.startswith("ROW ")],
    }


def _text(x) -> str:
    return (x.decode(errors="replace") if isinstance(x, bytes) else x) or ""


def _write_log(path, out, err):
    if path:
        with open(path, "w") as f:
            f.write(f"--- stdout\n{out}\n--- stderr\n{err}\n")


def _env():
    env = dict(os.environ)
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # peaks are the program's own
    env.setdefault("JAX_PLATFORMS", "cuda")
    env["PYTHONUNBUFFERED"] = "1"  # a part stopped at its limit leaves its lines in the log
    return env


def run_part(name: str, args) -> list[dict]:
    if name == "kernels":
        rows = part_kernels(args.smoke)
    elif name == "memory":
        rows = part_memory(args.smoke)
    elif name.startswith("mfu_"):
        rows = part_mfu(args.smoke, name[len("mfu_") :], args.blockwise_layers)
    elif name == "multi_lora":
        rows = part_multi_lora(args.smoke)
    else:
        rows = part_decode(args.smoke)
    return json.loads(json.dumps(rows, default=str))


def _fmt(x, spec):
    return "—" if x is None else format(x, spec)


def _rows(results: dict, name: str) -> tuple[list[dict], list[str]]:
    """A part's rows (those it finished, where it failed or ran out of time) and the lines
    saying what is missing: the error, or that the part was not run."""
    r = results.get(name)
    if r is None:
        return [], ["  not run"]
    if isinstance(r, dict):
        return r.get("rows", []), [f"  error: {r['error']}"]
    return r, []


def table(results: dict, device: str) -> str:
    out = [f"jcp GPU run on {device}", ""]
    rows, missing = _rows(results, "kernels")
    out.append("Pallas vs blockwise attention (one datum, causal; rel = max |Δ| / max |ref|)")
    out.append(
        f"  {'dtype':<9} {'tokens':>6} {'heads':>10} {'out rel':>9} {'grad rel':>9} "
        f"{'pallas fwd':>11} {'block fwd':>10} {'pallas f+b':>11} {'block f+b':>10}"
    )
    for x in rows:
        out.append(
            f"  {x['dtype']:<9} {x['tokens']:>6} {x['heads']:>10} "
            f"{x['out_rel_err']:>9.2e} {x['grad_rel_err']:>9.2e} "
            f"{x['pallas_fwd_s'] * 1e3:>9.2f}ms {x['blockwise_fwd_s'] * 1e3:>8.2f}ms "
            f"{x['pallas_fwd_bwd_s'] * 1e3:>9.2f}ms "
            f"{x['blockwise_fwd_bwd_s'] * 1e3:>8.2f}ms" + ("" if x["finite"] else "  NOT FINITE")
        )
    out += missing + [""]
    out.append("MFU: Qwen3-8B shape, LoRA r32, one datum (benchmarks/mfu.py)")
    out.append(
        f"  {'attention':<10} {'layers':>6} {'tokens':>6} {'tok/s':>8} {'step s':>8} "
        f"{'MFU':>7} {'MFU 6N':>7} {'peak GiB':>9} {'remat':>6} {'first s':>8}"
    )
    for impl in ("pallas", "blockwise"):
        rows, missing = _rows(results, f"mfu_{impl}")
        for x in rows:
            peak = None if x["peak_bytes_in_use"] is None else x["peak_bytes_in_use"] / GiB
            out.append(
                f"  {x['attn_impl']:<10} {x['layers']:>6} {x['tokens']:>6} "
                f"{x['tokens_per_s']:>8.0f} {x['median_step_s']:>8.2f} "
                f"{100 * x['mfu']:>6.1f}% {100 * x['mfu_6n']:>6.1f}% "
                f"{_fmt(peak, '9.2f'):>9} {str(x['remat']):>6} "
                f"{_fmt(x.get('first_step_s'), '8.1f'):>8}"
            )
        out += [f"  {impl:<10}{m[1:]}" for m in missing]
    out.append("")
    rows, missing = _rows(results, "memory")
    out.append("Per-device compiled memory, bf16 training (memory.py's program, cp = 1)")
    out.append(
        f"  {'tokens':>6} {'arg GiB':>8} {'out GiB':>8} {'temp GiB':>9} "
        f"{'total GiB':>10}  f32 copies of stacked bf16 weights"
    )
    for x in rows:
        copies = ", ".join(x["f32_copies_of_stacked_weights"]) or "none"
        out.append(
            f"  {x['tokens']:>6} {x['argument_gib']:>8.2f} {x['output_gib']:>8.2f} "
            f"{x['temp_gib']:>9.2f} {x['total_gib']:>10.2f}  {copies}"
        )
    out += missing + [""]
    rows, missing = _rows(results, "decode")
    out.append(
        "Sampling decode, the engine (Qwen3-8B shape, bf16, 16-token prompts, T = 1; "
        "roofline: weights + live K/V read per step at HBM bandwidth)"
    )
    out.append(
        f"  {'batch':>5} {'new':>4} {'attn':>9} {'tokens':>7} {'decode s':>9} "
        f"{'tok/s':>9} {'roofline':>9} {'of roof':>8} {'W GiB':>6} {'KV GiB/st':>9} "
        f"{'warm-up s':>9}"
    )
    for x in rows:
        of = x.get("of_roofline")
        out.append(
            f"  {x['batch']:>5} {x['new_tokens']:>4} {x.get('attn_impl', '—'):>9} "
            f"{x['tokens']:>7} {x['seconds']:>9.2f} {x['tokens_per_s']:>9.0f} "
            f"{_fmt(x.get('roofline_tokens_per_s'), '9.0f'):>9} "
            f"{'—' if of is None else format(100 * of, '.1f') + '%':>8} "
            f"{_fmt(x.get('weights_gib'), '6.2f'):>6} {_fmt(x.get('kv_gib_per_step'), '9.3f'):>9} "
            f"{x['first_call_s']:>9.1f}"
        )
    out += missing + [""]
    rows, missing = _rows(results, "multi_lora")
    out.append(
        "Multi-LoRA: one fused forward_backward at fixed tokens over A adapters "
        "(benchmarks/multi_lora.py's shape; goal t/t1 <= 1.15, memory <= 1.1)"
    )
    out.append(
        f"  {'A':>4} {'tokens':>6} {'wall s':>8} {'t/t1':>6} {'total MiB':>10} {'mem/m1':>7}"
    )
    for x in rows:
        out.append(
            f"  {x['A']:>4} {x['tokens']:>6} {x['wall_s']:>8.3f} {x['time_ratio']:>6.2f} "
            f"{x['total_mib']:>10.1f} {x['total_ratio']:>7.3f}"
        )
    out += missing
    return "\n".join(out)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--smoke", action="store_true", help="CPU, tiny shapes: checks that every part runs"
    )
    ap.add_argument("--parts", default=",".join(PARTS))
    ap.add_argument("--blockwise-layers", type=int, default=8)
    ap.add_argument("--out", default=None, help="also write the results as JSON here")
    ap.add_argument(
        "--logs",
        default=None,
        help="write each part's whole output to DIR/PART.log (not with --smoke)",
    )
    ap.add_argument("--part", choices=PARTS, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.part:
        print("RESULT " + json.dumps(run_part(args.part, args)))
        return {}

    t0 = time.perf_counter()
    if args.smoke:  # in this process (no device to isolate; saves a JAX start per part)
        import jax

        d = jax.devices()
        device = f"{len(d)} x {d[0].device_kind} ({d[0].platform}), jax {jax.__version__}"
    else:
        info = subprocess_json(
            [
                sys.executable,
                "-c",
                (
                    "import jax, json; d = jax.devices(); "
                    "print('RESULT ' + json.dumps(f'{len(d)} x {d[0].device_kind} ({d[0].platform}),"
                    " jax {jax.__version__}'))"
                ),
            ],
            timeout=120,
        )
        device = info if isinstance(info, str) else f"? ({info.get('error')})"
    print(f"device: {device}", flush=True)
    results = {}
    limits = LIMITS_S
    for name in args.parts.split(","):
        if name not in PARTS:
            raise SystemExit(f"unknown part {name!r}; parts: {', '.join(PARTS)}")
        t = time.perf_counter()
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--part",
            name,
            "--blockwise-layers",
            str(args.blockwise_layers),
        ] + (["--smoke"] if args.smoke else [])
        if args.smoke:
            try:
                results[name] = run_part(name, args)
            except Exception as e:  # noqa: BLE001  (the table reports it; others still run)
                results[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
        else:
            log = os.path.join(args.logs, f"{name}.log") if args.logs else None
            results[name] = subprocess_json(cmd, limits[name], log)
        print(
            f"  part {name}: {time.perf_counter() - t:.0f} s"
            + (f" — {results[name]['error']}" if isinstance(results[name], dict) else ""),
            flush=True,
        )
    print()
    print(table(results, device))
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=device, results=results), f, indent=2, default=str)
    return results


if __name__ == "__main__":
    res = main()
    sys.exit(0 if all(not isinstance(r, dict) for r in res.values()) else 1)
