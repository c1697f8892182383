"""Where one CPU training step's time goes: jcp (jax.profiler trace) against torch + peft
(torch.profiler), on throughput.py's workload, grouped into the same few categories.

jcp: the step (forward_backward + optim_step) is traced with jax.profiler (a Perfetto
trace); every XLA:CPU thunk's *exclusive* time (its duration minus the thunks nested in
it: while / cond bodies) is put into a category from the op_name metadata of its HLO
instruction in the compiled program (XLA fusions keep the op_name of their root):

  attention     the blockwise kernel (its block loops and conds, scores, p·v, dq/dk/dv)
  linear        the layers' projections x @ W (base + LoRA: "si,io->so", "si,ir->sr", …)
  logprobs      the chunked vocab log-probs (logits chunk, softmax, their backward)
  elementwise   everything else (norms, RoPE, silu, adds, copies, slices, transposes)

torch: torch.profiler's self CPU time per aten op over one step, in the same categories
(scaled_dot_product / flash attention ops, mm / addmm / bmm / linear, log_softmax /
cross_entropy, everything else). Both sides run in this process one after the other,
torch with its default threads; the machine's other load affects both (timings are
noisy on a shared machine: compare shares, not milliseconds).

    python benchmarks/profile_cpu.py [--datums 8 --tokens 512] [--remat auto|1|0]
    python benchmarks/profile_cpu.py --kernel 4096 [--tiles 128,256] [--breakdown]

Shares at 8 × 512 (remat auto): 48 % elementwise, 35 % linear, 13 % attention with the
rolled layer loop; unrolled on CPU (train_step.unroll_layers) and without the untargeted
lm_head factor, 32 % elementwise, 42 % linear, 22 % attention, 4 % logprobs (load ≈ 17:
the thunks' times are stretched by the load, so compare shares only).

--kernel N times the attention kernel alone: blockwise fwd + bwd (jax.grad of a weighted
sum, jitted) of one causal datum of N tokens at the model's heads (8 q / 4 kv, head dim
32, fp32) per tile size, and the C++ kernel (attn_impl "cpu", its own tiles),
against torch SDPA (is_causal, enable_gqa) fwd + bwd, alternated
for 3 rounds; best process CPU seconds and wall. Measured on the shared 2-core machine
(load ≈ 12): 4096 tokens, 256-row tiles: 0.773 CPU s before the key-major backward,
0.511 after, torch 0.442; 8192 tokens: jcp 2.04, torch 1.55 (load ≈ 20). The kernel is
compiled with the training programs' XLA options (train_step.compiler_options).

--breakdown adds, per tile size, where the kernel's thunk time goes (one traced fwd + bwd;
exclusive time of every XLA:CPU thunk, put into a class from the compiled HLO):

  gemm          fusions around a dot (XLA:CPU's YNN GEMMs: scores, p·v, dq / dk / dv)
  softmax       the exp passes and the row reductions (max, sum) over a score tile
  tile ew       other elementwise passes over a whole score tile (mask, dS)
  overhead      the rest: block slices and updates, accumulation adds, copies, conds,
                loop control — what a tile costs besides its products and passes

Exclusive times are the thunks' spans on the thread that ran them: with more than one
thread a parallel op's span includes its wait for the other thread, so compare classes on
one core (`taskset -c 0`), or as shares.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import math
import os
import re
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import throughput as T  # noqa: E402  (the workload)

CATEGORIES = ("attention", "linear", "logprobs", "elementwise")


def jcp_category(op_name: str) -> str:
    if re.search(r"krh|kth|krt|kmst|kmsh|/cond|knr|nkr|ksmh|skmh", op_name):
        return "attention"
    # Inside the attention kernel's loops (block loops nested in the layer scan).
    if re.search(r"closed_call/while/body/closed_call/while", op_name):
        return "attention"
    if re.search(r"sv,dv|sd,dv|sd,sv|log|reduce_max|take_along_axis|scatter", op_name):
        return "logprobs"
    if re.search(r"si,io->so|si,ir->sr|sr,ro->so|so,ro->sr|si,so->io|dot_general|ai,", op_name):
        return "linear"
    return "elementwise"


def torch_category(name: str) -> str:
    n = name.lower()
    if "attention" in n or "sdpa" in n or "flash" in n or "scaled_dot" in n:
        return "attention"
    if re.search(r"aten::(mm|addmm|bmm|matmul|linear)\b", n):
        return "linear"
    if "log_softmax" in n or "cross_entropy" in n or "nll_loss" in n:
        return "logprobs"
    return "elementwise"


def exclusive_times(events):
    """{name: exclusive µs} of complete ('X') events, nesting taken per thread."""
    out = collections.Counter()
    by_thread = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and "dur" in e:
            by_thread[(e.get("pid"), e.get("tid"))].append(e)
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack = []  # [end, name, child time]
        for e in evs:
            while stack and stack[-1][0] <= e["ts"]:
                end, name, child, dur = stack.pop()
                out[name] += dur - child
                if stack:
                    stack[-1][2] += dur
            stack.append([e["ts"] + e["dur"], e["name"], 0.0, e["dur"]])
        while stack:
            end, name, child, dur = stack.pop()
            out[name] += dur - child
            if stack:
                stack[-1][2] += dur
    return out


def profile_jcp(args) -> dict:
    import jax
    import numpy as np

    import jcp

    cfg = jcp.QwenConfig(
        vocab_size=T.VOCAB,
        hidden_size=T.HIDDEN,
        intermediate_size=T.MLP,
        num_layers=T.LAYERS,
        num_heads=T.HEADS,
        num_kv_heads=T.KV_HEADS,
        head_dim=T.HEAD_DIM,
        rope_theta=10_000.0,
        tie_word_embeddings=False,
        max_position_embeddings=max(4096, args.tokens),
    )
    remat = {"auto": "auto", "1": True, "0": False}[args.remat]
    tr = jcp.Trainer(cfg, jcp.make_mesh(1, 1, 1), max_adapters=1, max_rank=T.RANK, remat=remat)
    a = tr.create_adapter(rank=T.RANK, alpha=T.ALPHA, targets=["attn", "mlp"])
    tokens, targets = T._data(args.datums, args.tokens)
    data = [
        jcp.Datum(
            model_input=tokens[i],
            loss_fn_inputs={
                "target_tokens": targets[i],
                "weights": np.ones(args.tokens, np.float32),
            },
        )
        for i in range(args.datums)
    ]
    adam = jcp.AdamParams(learning_rate=T.LR, beta1=0.9, beta2=0.95, eps=1e-12)

    def step():
        tr.forward_backward(data, "cross_entropy", adapters=a)
        tr.optim_step(a, adam)

    step()
    step()
    t = time.perf_counter()
    step()
    wall = time.perf_counter() - t
    # The HLO of every compiled program the step ran: instruction name -> op_name.
    ops = {}
    for text in [p.as_text() for p in tr.forward_backward_programs.values()]:
        for line in text.splitlines():
            m = re.match(r"\s*(?:ROOT )?%(\S+) = ", line)
            if m:
                op = re.search(r'op_name="([^"]*)"', line)
                ops[m[1]] = op[1] if op else ""
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            t = time.perf_counter()
            step()
            traced_wall = time.perf_counter() - t
        path = glob.glob(os.path.join(d, "**", "perfetto_trace.json.gz"), recursive=True)[0]
        with gzip.open(path) as f:
            trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    excl = exclusive_times(events)
    cats = collections.Counter()
    for name, us in excl.items():
        if name in ops:  # XLA thunks of the forward_backward program
            cats[jcp_category(ops[name])] += us / 1e6
    return dict(
        wall_s=wall,
        traced_wall_s=traced_wall,
        categories=dict(cats),
        remat=[v["remat"] for v in tr.remat_decisions.values()],
        flops=_flops(tr),
    )


def _flops(tr):
    out = 0.0
    for p in tr.forward_backward_programs.values():
        ca = p.cost_analysis()
        ca = ca[0] if isinstance(ca, list) else ca
        out += float(ca.get("flops", 0.0))
    return out


def profile_torch(args) -> dict:
    import peft
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(
        vocab_size=T.VOCAB,
        hidden_size=T.HIDDEN,
        intermediate_size=T.MLP,
        num_hidden_layers=T.LAYERS,
        num_attention_heads=T.HEADS,
        num_key_value_heads=T.KV_HEADS,
        head_dim=T.HEAD_DIM,
        tie_word_embeddings=False,
        max_position_embeddings=max(4096, args.tokens),
        rope_theta=10_000.0,
    )
    model = peft.get_peft_model(
        transformers.Qwen3ForCausalLM(cfg).float(),
        peft.LoraConfig(
            r=T.RANK,
            lora_alpha=T.ALPHA,
            lora_dropout=0.0,
            bias="none",
            target_modules=[
                "q_proj",
                "k_proj",
                "v_proj",
                "o_proj",
                "gate_proj",
                "up_proj",
                "down_proj",
            ],
            task_type="CAUSAL_LM",
        ),
    )
    model.train()
    opt = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=T.LR, betas=(0.9, 0.95), eps=1e-12
    )
    tokens, targets = T._data(args.datums, args.tokens)
    ids, tgt = torch.tensor(tokens), torch.tensor(targets)

    def step():
        logits = model(input_ids=ids).logits
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, T.VOCAB), tgt.reshape(-1), reduction="sum"
        )
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    t = time.perf_counter()
    step()
    wall = time.perf_counter() - t
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
    cats = collections.Counter()
    for e in prof.key_averages():
        cats[torch_category(e.key)] += e.self_cpu_time_total / 1e6
    return dict(
        wall_s=wall,
        categories=dict(cats),
        threads=torch.get_num_threads(),
        attn=getattr(model.config, "_attn_implementation", "?"),
    )


def profile_kernel(args) -> dict:
    """Blockwise and the C++ kernel ("cpu") fwd + bwd vs torch SDPA on one causal datum:
    {name: (best wall, best CPU s)}."""
    import resource

    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch

    import jcp
    from jcp.attention import blockwise, cpu
    from jcp.train_step import compiler_options

    n, kv, per_kv, hd = args.kernel, T.KV_HEADS, T.HEADS // T.KV_HEADS, T.HEAD_DIM
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((n, kv, per_kv, hd), np.float32))
    k, v = (jnp.asarray(rng.standard_normal((n, kv, hd), np.float32)) for _ in range(2))
    w = jnp.asarray(rng.standard_normal(q.shape, np.float32))
    seg, pos = jnp.zeros(n, jnp.int32), jnp.arange(n, dtype=jnp.int32)
    tq = torch.randn(1, kv * per_kv, n, hd, requires_grad=True)
    tk, tv = (torch.randn(1, kv, n, hd, requires_grad=True) for _ in range(2))

    def torch_step():
        out = torch.nn.functional.scaled_dot_product_attention(
            tq, tk, tv, is_causal=True, enable_gqa=True
        )
        out.sum().backward()

    steps, grads = {"torch sdpa": torch_step}, {}
    options = compiler_options(jcp.make_mesh(1, 1, 1))  # as the training programs compile
    for b in (int(x) for x in args.tiles.split(",")):
        g = jax.jit(
            jax.grad(
                lambda q, k, v, b=b: (blockwise.flash(q, k, v, seg, pos, seg, pos, b, b) * w).sum(),
                argnums=(0, 1, 2),
            ),
            compiler_options=options,
        )
        grads[b] = g
        steps[f"jcp blockwise, tile {b}"] = lambda g=g: jax.block_until_ready(g(q, k, v))
    if cpu.available():
        qf = q.reshape(n, kv * per_kv, hd)
        g = jax.jit(
            jax.grad(
                lambda q, k, v: (
                    cpu.flash_attention(q, k, v, seg, pos, seg, pos) * w.reshape(q.shape)
                ).sum(),
                argnums=(0, 1, 2),
            ),
            compiler_options=options,
        )
        steps["jcp cpu kernel"] = lambda: jax.block_until_ready(g(qf, k, v))
    else:
        print("jcp cpu kernel unavailable: the C++ kernels did not build")

    def cpu_s():
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    best = {}
    for f in steps.values():
        f()
    for _ in range(3):
        for name, f in steps.items():
            c, t = cpu_s(), time.perf_counter()
            f()
            wall, cpu = time.perf_counter() - t, cpu_s() - c
            old = best.get(name, (wall, cpu))
            best[name] = (min(old[0], wall), min(old[1], cpu))
    print(
        f"attention fwd + bwd, {n} causal tokens, {T.HEADS}/{kv} heads x {hd}, fp32 "
        f"(best of 3: wall s, CPU s)"
    )
    for name, (wall, cpu) in best.items():
        print(f"  {name:<24} wall {wall:7.3f}  CPU {cpu:7.3f}")
    if args.breakdown:
        print(
            f"thunk s of one traced call ({len(os.sched_getaffinity(0))} cores usable; see "
            f"--breakdown in the docstring)"
        )
        print(f"  {'tile':<6}" + "".join(f"{c:>10}" for c in BREAKDOWN) + f"{'sum':>10}")
        for b, g in grads.items():
            parts = kernel_breakdown(g, kv * per_kv * b * b, q, k, v)
            best[f"breakdown {b}"] = parts
            print(
                f"  {b:<6}"
                + "".join(f"{parts.get(c, 0.0):>10.3f}" for c in BREAKDOWN)
                + f"{sum(parts.values()):>10.3f}"
            )
    return best


def hlo_classes(hlo_text: str, tile_elems: int) -> dict[str, str]:
    """{instruction name: breakdown class} of a compiled HLO module's text (see --breakdown).

    A fusion is classed by the computation it calls: a dot makes it "gemm"; an exp or a
    reduce "softmax"; an output of ≥ tile_elems elements (a score tile, K · Bq·M · Bk)
    "tile ew"; anything else is "overhead", as are non-fusion thunks (copies, conds,
    whiles, dynamic slices)."""
    ops, calls, shape = collections.defaultdict(set), {}, {}
    comp = None
    for line in hlo_text.splitlines():
        head = re.match(r"(?:ENTRY )?%(\S+) \(", line)
        if head:
            comp = head[1]
            continue
        m = re.match(r"\s*(?:ROOT )?%(\S+) = (\S+?)(?:\{[^}]*\})? ([\w-]+)\(", line)
        if m and comp is not None:
            ops[comp].add(m[3])
            called = re.search(r"calls=%([\w.-]+)", line)
            if m[3] == "fusion" and called:
                calls[m[1]] = called[1]
            dims = re.match(r"\w+\[([\d,]*)\]", m[2])
            shape[m[1]] = math.prod(int(d) for d in dims[1].split(",") if d) if dims else 0
    out = {}
    for name in shape:
        body = ops.get(calls.get(name, ""), set())
        if "dot" in body:
            out[name] = "gemm"
        elif body & {"exponential", "reduce"}:
            out[name] = "softmax"
        elif name in calls and shape[name] >= tile_elems:
            out[name] = "tile ew"
        else:
            out[name] = "overhead"
    return out


BREAKDOWN = ("gemm", "softmax", "tile ew", "overhead")


def kernel_breakdown(grad_fn, tile_elems, *args) -> dict[str, float]:
    """{class: thunk seconds} of one traced call of the jitted grad_fn(*args); tile_elems:
    the elements of one score tile."""
    import jax

    classes = hlo_classes(grad_fn.lower(*args).compile().as_text(), tile_elems)
    jax.block_until_ready(grad_fn(*args))
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            jax.block_until_ready(grad_fn(*args))
        path = glob.glob(os.path.join(d, "**", "perfetto_trace.json.gz"), recursive=True)[0]
        with gzip.open(path) as f:
            trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    out = collections.Counter()
    for name, us in exclusive_times(events).items():
        if name in classes:
            out[classes[name]] += us / 1e6
    return dict(out)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--datums", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--remat", default="auto", choices=("auto", "1", "0"))
    ap.add_argument(
        "--kernel",
        type=int,
        default=0,
        metavar="N",
        help="time only the attention kernel at N tokens against torch SDPA",
    )
    ap.add_argument("--tiles", default="128,256", help="--kernel: tile sizes to time")
    ap.add_argument(
        "--breakdown",
        action="store_true",
        help="--kernel: also split one traced call's thunk time into GEMMs, "
        "softmax passes, other tile passes and per-tile overhead",
    )
    args = ap.parse_args(argv)
    if args.kernel:
        return profile_kernel(args)
    print(
        f"CPU: {T.cpu_model()}, {os.cpu_count()} cores; load average "
        f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}"
    )
    print(
        f"workload: throughput.py's model, {args.datums} x {args.tokens} tokens, one step "
        f"(forward + backward + AdamW)"
    )
    j = profile_jcp(args)
    t = profile_torch(args)
    print(f"\n{'category':<12} {'jcp s':>8} {'share':>6} {'torch s':>8} {'share':>6}")
    jt, tt = sum(j["categories"].values()), sum(t["categories"].values())
    for c in CATEGORIES:
        a, b = j["categories"].get(c, 0.0), t["categories"].get(c, 0.0)
        print(f"{c:<12} {a:>8.3f} {a / jt:>6.0%} {b:>8.3f} {b / tt:>6.0%}")
    print(f"{'sum':<12} {jt:>8.3f} {'':>6} {tt:>8.3f}   (thread-seconds: summed over threads)")
    print(
        f"wall of one untraced step: jcp {j['wall_s']:.3f} s (remat {j['remat']}), torch "
        f"{t['wall_s']:.3f} s ({t['threads']} threads, {t['attn']}); jcp program "
        f"{j['flops'] / 1e9:.1f} GFLOP (XLA cost analysis)"
    )
    return dict(jcp=j, torch=t)


if __name__ == "__main__":
    main()
