"""The continuous-batching engine on a hybrid model (tiny Qwen3.5: Gated DeltaNet + gated
full attention, jcp.QwenConfig.tiny_qwen3_5()), LoRA rank 8, --mesh (default 1,2,2 on fake
CPU devices), against the static sampler. Ratios within one run, after a warm-up that
compiles the programs; the machine is shared, so treat them as rough.

1. Equal batch: R prompts × S samples × T tokens (drawn, stop=[]) through
   Trainer.sample (one static call) and Engine.sample (same sequences): tokens/s of the
   engine ÷ static.
2. Memory per sequence: the recurrent-state row (Engine.state_bytes) and the K/V bytes
   per position of the full-attention layers (Engine.kv_bytes).

    python benchmarks/engine_hybrid.py [--mesh 1,2,2] [--r 16] [--s 4] [--t 16]
"""

from __future__ import annotations

import argparse
import sys

from common import (  # benchmarks/ is sys.path[0]
    best_time,
    fake_cpu_devices,
    mesh_arg,
    sampling_workload,
)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mesh", type=mesh_arg, default="1,2,2")
    p.add_argument("--r", type=int, default=16, help="requests (prompts)")
    p.add_argument("--s", type=int, default=4, help="samples per request")
    p.add_argument("--t", type=int, default=16, help="new tokens per sequence")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    fake_cpu_devices(args.mesh)
    import jcp

    cfg = jcp.QwenConfig.tiny_qwen3_5()
    tr = jcp.Trainer(cfg, jcp.make_mesh(*args.mesh), max_adapters=2, max_rank=8)
    ad = tr.create_adapter(rank=8, seed=0)
    n_seq = args.r * args.s
    prompts, sp, eng = sampling_workload(tr, args.mesh, args.r, args.t, args.s)

    t_static = best_time(lambda: tr.sample(prompts, sp, adapters=ad, num_samples=args.s))
    t_engine = best_time(lambda: eng.sample(prompts, sp, adapters=ad, num_samples=args.s))
    print(
        f"1. equal batch {args.r}×{args.s}×{args.t}: static {n_seq * args.t / t_static:.0f} "
        f"tok/s, engine {n_seq * args.t / t_engine:.0f} tok/s -> engine/static "
        f"{t_static / t_engine:.2f}×",
        flush=True,
    )
    print(
        f"2. per sequence on one device: recurrent-state row {eng.state_bytes()} B; K/V "
        f"{eng.kv_bytes(1) // eng.page} B per position ({cfg.linear_layers.count(False)} "
        f"of {cfg.num_layers} layers full attention)",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
