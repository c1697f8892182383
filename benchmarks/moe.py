"""Mixture-of-experts benchmarks: per-device memory with the experts split over tp, and
training tokens/s of LoRA on a tiny Qwen3-MoE against torch + peft.

1. memory — per-device compiled memory of one Trainer forward_backward step (the jitted
   train_step.make_forward_backward, remat on, LoRA slots with expert factors) at mesh
   (1, 1, k) on 8 fake CPU devices, k = tp = 1, 2, 4, 8: the experts are split k ways.
   Nothing runs: every argument is a jax.ShapeDtypeStruct with its real sharding, and XLA's
   memory_analysis() gives argument, output, alias and temp bytes (total = arg + out +
   temp − alias; the accumulator is donated). The expert share is M(model) − M(control),
   where the control is the same model with 8 experts of width 8 (everything else equal),
   split into arguments (expert weights, expert LoRA slots and their accumulators) and
   temp (the experts' activations); the expert argument bytes are also computed from the
   shardings (column "exp arg*"). Goal: expert share(k) / share(1) ≤ 1.2 / k.
   The slot table here holds both parameterisations' expert factors (the Trainer default),
   so the memory is the same for "shared_outer" and "per_expert" adapters;
   Trainer(expert_lora_modes=("shared_outer",)) drops the per-expert hidden-side factors.

2. torch — forward + backward + AdamW (the optimizer step included on both sides) of LoRA
   r 8 (alpha 16) on attention (q, k, v, o) and the experts (gate, up, down) of a tiny
   Qwen3-MoE (vocab 1024, hidden 256, 4 layers, all MoE, 8 heads × 32, 4 kv heads,
   8 experts top-2, moe_intermediate 128, norm_topk_prob, untied), 8 datums × 512
   tokens, token-sum cross_entropy, fp32, one CPU device. jcp: jcp.Trainer on mesh
   (1, 1, 1), targets ("attn", "experts"), expert_lora "shared_outer" (the default) and
   "per_expert", timed through the public forward_backward + optim_step. torch: transformers
   Qwen3MoeForCausalLM (experts_implementation="eager", SDPA attention) + peft LoraConfig
   (target_modules q/k/v/o_proj, target_parameters mlp.experts.gate_up_proj and
   mlp.experts.down_proj, i.e. per-expert factors), torch.set_num_threads(2), AdamW.
   Every measurement runs in its own subprocess; the three systems run round-robin for
   --rounds rounds (the machine is shared) and each keeps its median step per round; the
   ratio is taken per round and its median printed. Goal: jcp ≥ 1.0× torch tokens/s.

    python benchmarks/moe.py                          # both sections
    python benchmarks/moe.py --only memory [--tokens 4096 --experts 64 --moe-width 768
                                            --top-k 4 --hidden 512 --layers 4]
    python benchmarks/moe.py --only torch [--rounds 3 --steps 3 --warmup 1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from throughput import _time_steps  # benchmarks/ is sys.path[0]

MiB = 1 << 20

# Section 2's tiny MoE.
T_VOCAB, T_HIDDEN, T_LAYERS, T_HEADS, T_KV, T_HEAD_DIM = 1024, 256, 4, 8, 4, 32
T_EXPERTS, T_TOP_K, T_WIDTH, T_DENSE = 8, 2, 128, 512
RANK, ALPHA, LR = 8, 16.0, 1e-4
DATUMS, TOKENS = 8, 512


# ----------------------------------------------------------------------------------------
# 1. memory (runs in a subprocess with 8 fake devices)


def largest_arrays(hlo: str, top: int):
    """The `top` largest distinct array shapes in optimized HLO text: [(MiB, shape, count)]
    (count: lines mentioning the shape)."""
    import re

    import numpy as np

    itemsize = {"f32": 4, "s32": 4, "u32": 4, "bf16": 2, "pred": 1}
    found = {}
    for dtype, dims in re.findall(r"\b(f32|bf16|s32|u32|pred)\[([\d,]+)\]", hlo):
        key = f"{dtype}[{dims}]"
        n = int(np.prod([int(d) for d in dims.split(",")])) * itemsize[dtype]
        found.setdefault(key, [n / MiB, 0])[1] += 1
    return sorted(((m, s, c) for s, (m, c) in found.items()), reverse=True)[:top]


def side_memory(args) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jcp
    from jcp import batch as batch_lib
    from jcp import lora as lora_lib
    from jcp import losses, train_step
    from jcp import mesh as mesh_lib
    from jcp import model as model_lib

    def config(experts, width):
        return jcp.QwenConfig(
            vocab_size=args.vocab,
            hidden_size=args.hidden,
            intermediate_size=args.hidden * 2,
            num_layers=args.layers,
            num_heads=args.heads,
            num_kv_heads=args.kv_heads,
            head_dim=args.head_dim,
            max_position_embeddings=max(8192, args.tokens),
            num_experts=experts,
            num_experts_per_tok=args.top_k,
            moe_intermediate_size=width,
            norm_topk_prob=True,
        )

    def abstract(tree_shapes, tree_specs, dtype, mesh):
        return jax.tree.map(
            lambda s, sp: jax.ShapeDtypeStruct(s, dtype, sharding=NamedSharding(mesh, sp)),
            tree_shapes,
            tree_specs,
            is_leaf=lambda x: isinstance(x, tuple),
        )

    def device_bytes(x):
        return int(np.prod(x.sharding.shard_shape(x.shape))) * jnp.dtype(x.dtype).itemsize

    def compile_step(cfg, k):
        """The Trainer's forward_backward at mesh (1, 1, k), as Trainer.__init__ sets it up."""
        mesh = jcp.make_mesh(1, 1, k)
        cfg.check_mesh(k)
        chunk = 1 << (min(1024, max(16, (1 << 26) // (cfg.vocab_size // k))).bit_length() - 1)
        step_cfg = train_step.StepConfig(remat=True, attn_block=64, logprob_chunk=chunk)
        params = abstract(
            model_lib.param_shapes(cfg), model_lib.param_specs(cfg), jnp.dtype(cfg.dtype), mesh
        )
        slots = abstract(
            lora_lib.slot_shapes(cfg, args.slots, RANK), lora_lib.slot_specs(cfg), jnp.float32, mesh
        )
        rep = NamedSharding(mesh, P())
        g = jax.ShapeDtypeStruct((args.slots,), jnp.float32, sharding=rep)
        meta = lora_lib.SlotMeta(g, g)
        rng = np.random.default_rng(0)
        n = args.tokens // args.datums
        data = [
            jcp.Datum(
                rng.integers(0, cfg.vocab_size, n),
                {
                    "target_tokens": rng.integers(0, cfg.vocab_size, n),
                    "weights": np.ones(n, np.float32),
                },
            )
            for _ in range(args.datums)
        ]
        checked = batch_lib.validate(data, "cross_entropy", cfg.vocab_size, 1 << 20)
        (pb,) = batch_lib.pack(
            checked,
            [0] * len(checked),
            1,
            1,
            2 * mesh_lib.zigzag_chunk(cfg.max_position_embeddings, 1),
            args.slots,
        )
        host = train_step.Batch(
            tokens=pb.tokens,
            targets=pb.targets,
            segment=pb.segment,
            position=pb.position,
            loss_id=pb.loss_id,
            **pb.floats,
            spans=pb.spans,
            active=pb.active,
            call_tokens=np.asarray(np.sum(pb.segment >= 0), np.int32),
        )
        batch = jax.tree.map(
            lambda x, sp: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, sp)),
            host,
            train_step.batch_specs(),
        )
        loss_cfg = {
            name: {
                key: jax.ShapeDtypeStruct((), jnp.float32, sharding=rep)
                for key in losses.resolve_config(name, None)
            }
            for name in pb.loss_fns
        }
        fb = train_step.make_forward_backward(cfg, mesh, step_cfg)
        t0 = time.time()
        compiled = fb.lower(
            slots,
            slots,
            params,
            meta,
            batch,
            loss_cfg,
            static=train_step.BatchStatics(pb.loss_fns, pb.num_slots),
        ).compile()
        mem = compiled.memory_analysis()
        # Expert arrays among the arguments: the base experts, and the expert factors of
        # the slot table twice (the weights and the donated accumulator).
        exp_args = sum(device_bytes(params["moe_mlp"][m]) for m in lora_lib.EXPERT) + 2 * sum(
            device_bytes(x) for m in lora_lib.EXPERT for x in slots[m].values()
        )
        if args.explain:
            print(
                f"    {cfg.num_experts} experts, k={k}: largest arrays of the compiled step "
                "(MiB, shape, count)"
            )
            for mib, shape, count in largest_arrays(compiled.as_text(), args.explain):
                print(f"      {mib:9.1f}  {shape}  ×{count}")
        return dict(
            k=k,
            arg=mem.argument_size_in_bytes,
            out=mem.output_size_in_bytes,
            alias=mem.alias_size_in_bytes,
            temp=mem.temp_size_in_bytes,
            total=(
                mem.argument_size_in_bytes
                + mem.output_size_in_bytes
                + mem.temp_size_in_bytes
                - mem.alias_size_in_bytes
            ),
            exp_args=exp_args,
            s_len=int(pb.tokens.shape[-1]),
            compile_s=time.time() - t0,
        )

    full, control = config(args.experts, args.moe_width), config(8, 8)
    print(
        f"  jax {jax.__version__}, {len(jax.devices())} {jax.devices()[0].platform} devices; "
        "attention block 64 (the CPU default), remat on"
    )
    print(
        f"  model: V{full.vocab_size} D{full.hidden_size} L{full.num_layers} (all MoE) "
        f"H{full.num_heads}/{full.num_kv_heads}x{full.head_dim}; {full.num_experts} experts "
        f"top-{full.num_experts_per_tok} width {full.moe_intermediate_size}; fp32; "
        f"{args.datums}x{args.tokens // args.datums} tokens; {args.slots} slots r{RANK}"
    )
    print("  control: the same with 8 experts of width 8")
    hdr = (
        f"  {'k':>2} {'arg':>8} {'temp':>8} {'total':>8} {'tot/k1':>7} | {'exp arg':>8} "
        f"{'exp arg*':>8} {'exp temp':>8} {'expert':>8} {'exp/k1':>7} {'goal':>6} "
        f"{'ok':>3} | {'rest':>7} {'compile':>8}"
    )
    print(hdr + "\n  " + "-" * (len(hdr) - 2) + "\n  (MiB per device)", flush=True)
    rows = []
    base = None
    for k in args.ks:
        f, c = compile_step(full, k), compile_step(control, k)
        share = f["total"] - c["total"]
        e_arg = f["arg"] - c["arg"]
        e_temp = f["temp"] - c["temp"]
        if base is None:
            base = (f["total"], share)
        r_tot, r_exp = f["total"] / base[0], share / base[1]
        ok = r_exp <= 1.2 / k
        rows.append(
            dict(
                k=k,
                full=f,
                control=c,
                expert_share=share,
                expert_arg=e_arg,
                expert_temp=e_temp,
                ratio_total=r_tot,
                ratio_expert=r_exp,
                goal=1.2 / k,
                ok=ok,
            )
        )
        print(
            f"  {k:>2} {f['arg'] / MiB:>8.1f} {f['temp'] / MiB:>8.1f} {f['total'] / MiB:>8.1f} "
            f"{r_tot:>7.3f} | {e_arg / MiB:>8.1f} {f['exp_args'] / MiB:>8.1f} "
            f"{e_temp / MiB:>8.1f} {share / MiB:>8.1f} {r_exp:>7.3f} {1.2 / k:>6.3f} "
            f"{'yes' if ok else 'NO':>3} | {c['total'] / MiB:>7.1f} "
            f"{f['compile_s'] + c['compile_s']:>7.1f}s",
            flush=True,
        )
    print(
        "  arg/temp/total: the whole step; exp arg = arg(model) − arg(control), exp arg* the "
        "same from the\n  shardings alone; exp temp = temp(model) − temp(control); expert = "
        "exp arg + exp temp + out − alias\n  differences; rest = the control's total."
    )
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(dict(config=vars(args), rows=rows), fh, indent=2, default=str)
        print(f"  wrote {args.out}")


# ----------------------------------------------------------------------------------------
# 2. tokens/s against torch + peft (each side in its own subprocess, one CPU device)


def _data():
    import numpy as np

    rng = np.random.default_rng(0)
    return (rng.integers(0, T_VOCAB, (DATUMS, TOKENS)), rng.integers(0, T_VOCAB, (DATUMS, TOKENS)))


def side_torch(args) -> dict:
    import peft
    import torch
    import transformers

    torch.set_num_threads(2)
    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=T_VOCAB,
        hidden_size=T_HIDDEN,
        intermediate_size=T_DENSE,
        num_hidden_layers=T_LAYERS,
        num_attention_heads=T_HEADS,
        num_key_value_heads=T_KV,
        head_dim=T_HEAD_DIM,
        num_experts=T_EXPERTS,
        num_experts_per_tok=T_TOP_K,
        moe_intermediate_size=T_WIDTH,
        norm_topk_prob=True,
        mlp_only_layers=[],
        decoder_sparse_step=1,
        rope_theta=10_000.0,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        experts_implementation="eager",
    )
    model = transformers.Qwen3MoeForCausalLM(cfg).float()
    lora = peft.LoraConfig(
        r=RANK,
        lora_alpha=ALPHA,
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    )
    model = peft.get_peft_model(model, lora)
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=LR, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0)
    tokens, targets = _data()
    ids, tgt = torch.tensor(tokens), torch.tensor(targets)

    def step():
        logits = model(input_ids=ids).logits
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, T_VOCAB), tgt.reshape(-1), reduction="sum"
        )
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    res = _time_steps(step, args.warmup, args.steps, DATUMS * TOKENS)
    res.update(
        threads=torch.get_num_threads(),
        trainable=sum(p.numel() for p in trainable),
        attn=getattr(model.config, "_attn_implementation", "?"),
    )
    return res


def side_jcp(args) -> dict:
    import jax
    import numpy as np

    import jcp

    cfg = jcp.QwenConfig(
        vocab_size=T_VOCAB,
        hidden_size=T_HIDDEN,
        intermediate_size=T_DENSE,
        num_layers=T_LAYERS,
        num_heads=T_HEADS,
        num_kv_heads=T_KV,
        head_dim=T_HEAD_DIM,
        rope_theta=10_000.0,
        tie_word_embeddings=False,
        max_position_embeddings=4096,
        num_experts=T_EXPERTS,
        num_experts_per_tok=T_TOP_K,
        moe_intermediate_size=T_WIDTH,
        norm_topk_prob=True,
    )
    tr = jcp.Trainer(cfg, jcp.make_mesh(1, 1, 1), max_adapters=1, max_rank=RANK)
    a = tr.create_adapter(
        rank=RANK, alpha=ALPHA, targets=["attn", "experts"], expert_lora=args.expert_lora
    )
    tokens, targets = _data()
    data = [
        jcp.Datum(
            model_input=tokens[i],
            loss_fn_inputs={"target_tokens": targets[i], "weights": np.ones(TOKENS, np.float32)},
        )
        for i in range(DATUMS)
    ]
    adam = jcp.AdamParams(learning_rate=LR, beta1=0.9, beta2=0.95, eps=1e-12)

    def step():
        tr.forward_backward(data, "cross_entropy", adapters=a)
        tr.optim_step(a, adam)

    res = _time_steps(step, args.warmup, args.steps, DATUMS * TOKENS)
    res.update(
        devices=len(jax.devices()),
        expert_lora=args.expert_lora,
        trainable=sum(
            int(np.prod(x.shape))
            for ab in tr.state.read(a, "weights").values()
            for x in ab.values()
        ),
    )
    return res


def measure(side: str, args, **kw) -> dict:
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--side",
        side,
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
    ]
    for k, v in kw.items():
        cmd += [f"--{k.replace('_', '-')}", str(v)]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = " ".join(
        f
        for f in env.get("XLA_FLAGS", "").split()
        if not f.startswith("--xla_force_host_platform_device_count")
    )
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise SystemExit(f"{side} {kw} failed (exit {proc.returncode})")
    return json.loads(lines[-1][len("RESULT ") :])


def section_torch(args) -> None:
    systems = {
        "torch": ("torch", {}),
        "jcp shared_outer": ("jcp", dict(expert_lora="shared_outer")),
        "jcp per_expert": ("jcp", dict(expert_lora="per_expert")),
    }
    print(
        f"  model: Qwen3-MoE V{T_VOCAB} D{T_HIDDEN} L{T_LAYERS} (all MoE) "
        f"H{T_HEADS}/{T_KV}x{T_HEAD_DIM}, {T_EXPERTS} experts top-{T_TOP_K} width {T_WIDTH}, "
        f"untied; LoRA r{RANK} a{ALPHA:g} on q,k,v,o + experts; {DATUMS}x{TOKENS} tokens; "
        f"fp32; step = forward + backward + AdamW (both sides)"
    )
    print(
        f"  {args.warmup} warm-up + {args.steps} timed steps (median) per round, {args.rounds} "
        f"rounds round-robin; cpus {os.cpu_count()}, load "
        f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}",
        flush=True,
    )
    runs = {name: [] for name in systems}
    for r in range(args.rounds):
        for name, (side, kw) in systems.items():
            res = measure(side, args, **kw)
            runs[name].append(res)
            print(
                f"    round {r + 1} {name:<17} {res['tokens_per_s']:>6.0f} tok/s  step "
                f"{res['median_step_s'] * 1e3:>6.0f} ms [{min(res['step_s']) * 1e3:.0f}–"
                f"{max(res['step_s']) * 1e3:.0f}]  first {res['first_step_s']:.1f} s  "
                f"trainable {res['trainable']}",
                flush=True,
            )
    t = runs["torch"]
    print(
        f"\n  {'system':<22} {'tok/s (median of rounds)':>25} {'× torch (median of per-round ratios)':>38}"
    )
    for name, rs in runs.items():
        tps = statistics.median(r["tokens_per_s"] for r in rs)
        line = f"  {name:<22} {tps:>25.0f}"
        if name != "torch":
            ratios = [r["tokens_per_s"] / tr["tokens_per_s"] for r, tr in zip(rs, t)]
            med = statistics.median(ratios)
            line += (
                f" {med:>38.2f}  (rounds {'/'.join(f'{x:.2f}' for x in ratios)}; goal ≥ 1.0: "
                f"{'met' if med >= 1.0 else 'NOT met'})"
            )
        print(line)
    print(
        f"  torch threads {t[0]['threads']}, attention {t[0]['attn']}; jcp lm_head not "
        "targeted (torch neither)"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", choices=("memory", "torch"), default=None)
    p.add_argument("--steps", type=int, default=3, help="timed steps per measurement")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps (≥ 1, compiles)")
    p.add_argument("--rounds", type=int, default=3, help="round-robin rounds of section 2")
    m = p.add_argument_group("section 1 (memory) sizes")
    m.add_argument("--ks", default="1,2,4,8", help="tp sizes (experts split k ways)")
    m.add_argument("--tokens", type=int, default=4096, help="tokens of the step")
    m.add_argument("--datums", type=int, default=4)
    m.add_argument("--vocab", type=int, default=4096)
    m.add_argument("--hidden", type=int, default=512)
    m.add_argument("--layers", type=int, default=4)
    m.add_argument("--heads", type=int, default=16)
    m.add_argument("--kv-heads", type=int, default=8, help="divisible by the largest k")
    m.add_argument("--head-dim", type=int, default=32)
    m.add_argument("--experts", type=int, default=64)
    m.add_argument("--top-k", type=int, default=4)
    m.add_argument("--moe-width", type=int, default=768, help="moe_intermediate_size")
    m.add_argument("--slots", type=int, default=4, help="max_adapters of the slot table")
    m.add_argument(
        "--explain",
        type=int,
        default=0,
        metavar="N",
        help="print the N largest array shapes of each compiled step",
    )
    m.add_argument("--out", default="", help="also write section 1's rows as JSON here")
    p.add_argument("--side", choices=("memory", "torch", "jcp"), help=argparse.SUPPRESS)
    p.add_argument("--expert-lora", default="shared_outer", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.warmup = max(1, args.warmup)
    args.ks = [int(k) for k in str(args.ks).split(",")] if isinstance(args.ks, str) else args.ks

    if args.side == "memory":
        side_memory(args)
        return
    if args.side in ("torch", "jcp"):
        res = side_torch(args) if args.side == "torch" else side_jcp(args)
        print("RESULT " + json.dumps(res))
        return

    if args.only in (None, "memory"):
        print(
            "[1] per-device memory of one forward_backward step, experts split k ways "
            "(mesh 1,1,k on 8 fake CPU devices)",
            flush=True,
        )
        env = dict(os.environ, JAX_PLATFORMS="cpu")
        env["XLA_FLAGS"] = " ".join(
            [
                f
                for f in env.get("XLA_FLAGS", "").split()
                if not f.startswith("--xla_force_host_platform_device_count")
            ]
            + ["--xla_force_host_platform_device_count=8"]
        )
        cmd = [sys.executable, os.path.abspath(__file__), "--side", "memory"] + [
            a for a in sys.argv[1:] if a not in ("--only", "memory")
        ]
        if subprocess.run(cmd, env=env).returncode:
            raise SystemExit("memory section failed")
    if args.only in (None, "torch"):
        print("\n[2] tokens/s, jcp vs torch + peft, tiny Qwen3-MoE, one CPU device", flush=True)
        section_torch(args)


if __name__ == "__main__":
    main()
