"""Seconds per step of the Tinker cookbook's own loops against jcp-serve, split into where
the time goes.

The tiny local Qwen3 of tests/helpers/cookbook_harness.py (vocab 512, hidden 64, 2 layers, a BPE
chat tokenizer), LoRA rank 8, on --mesh (default 1,1,1: one CPU device). The server runs
in this process (jcp.server.service.Server on 127.0.0.1); the cookbook (tinker-cookbook 0.6.1,
unmodified) drives it through the Tinker SDK:

- supervised.train: FromConversationFileBuilder, batch 4 chats of ~45 tokens, qwen3
  renderer, save_every 0 (the final save is counted apart).
- rl.train (sync, importance_sampling): the arithmetic env, batch 2 groups × 4 samples,
  max_tokens 8.

Each loop runs twice over the same batches: a cold run (a fresh server process would pay
this: every new packed-batch shape compiles its forward_backward, ~20 s each on CPU, and
the shapes follow the data's lengths) and a warm run, timed end to end, that reuses the
compiled programs (the steady state of a long run, once its shape buckets are seen).
The worker's seconds per request kind (Engine.busy_s) split
the time: sampling (asample), training (forward_backward, forward, optim_step), weights
(save_* / load_*, the per-step sampler snapshot included) and the rest — HTTP, the SDK,
the cookbook's own work and idle gaps — as "client + server overhead".

    python benchmarks/cookbook.py [--steps 3] [--mesh 1,1,1]

Needs tinker-cookbook (pip install --no-deps tinker-cookbook==0.6.1 chz blobfile datasets
aiohttp termcolor cloudpickle).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
os.environ.setdefault("TINKER_TELEMETRY", "0")
os.environ.setdefault("TINKER_API_KEY", "tml-local")

TRAIN = ("forward_backward", "forward", "optim_step")
SAMPLE = ("sample",)


def split(busy: dict, wall: float, steps: int) -> str:
    s = sum(busy.get(k, 0.0) for k in SAMPLE)
    t = sum(busy.get(k, 0.0) for k in TRAIN)
    w = sum(v for k, v in busy.items() if k not in SAMPLE + TRAIN)
    rest = wall - s - t - w
    per = lambda x: f"{x / steps:7.3f}"  # noqa: E731
    return (
        f"{per(wall)} s/step = sampling {per(s)} + training {per(t)} + weights "
        f"{per(w)} + client/server overhead {per(rest)}"
    )


def run(srv, make_config, steps: int) -> list[tuple[float, dict]]:
    """[(wall, worker seconds by kind, sampling programs compiled)] of a cold and a warm
    run of `steps` steps."""
    out = []
    for _ in range(2):
        main, cfg = make_config(tempfile.mkdtemp(), steps)
        before, programs = dict(srv.worker.busy_s), srv.worker.sampling.programs()
        t0 = time.perf_counter()
        asyncio.run(main(cfg))
        wall = time.perf_counter() - t0
        out.append(
            (
                wall,
                {k: v - before.get(k, 0.0) for k, v in srv.worker.busy_s.items()},
                srv.worker.sampling.programs() - programs,
            )
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--mesh", default="1,1,1")
    args = ap.parse_args()
    logging.disable(logging.WARNING)

    from helpers import cookbook_harness as C

    import jcp
    from jcp.server.service import Server

    path = C.build(os.path.join(tempfile.gettempdir(), "jcp-cookbook-tiny-qwen3"))
    cfg, base = jcp.load_hf(path)
    tr = jcp.Trainer(
        cfg,
        jcp.make_mesh(*map(int, args.mesh.split(","))),
        base_params=base,
        max_adapters=8,
        max_rank=8,
    )
    srv = Server(tr, path, tempfile.mkdtemp(), tokenizer_id=path).start()
    data = C.conversations(os.path.join(tempfile.mkdtemp(), "chats.jsonl"), n=64)

    def sl(log, n):
        from tinker_cookbook.supervised import train
        from tinker_cookbook.supervised.data import FromConversationFileBuilder
        from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

        common = ChatDatasetBuilderCommonConfig(
            model_name_for_tokenizer=path, renderer_name="qwen3", max_length=64, batch_size=4
        )
        return train.main, train.Config(
            log_path=log,
            model_name=path,
            recipe_name="bench",
            renderer_name="qwen3",
            lora_rank=8,
            base_url=srv.url,
            learning_rate=1e-3,
            max_steps=n,
            save_every=0,
            eval_every=0,
            dataset_builder=FromConversationFileBuilder(file_path=data, common_config=common),
        )

    def rl(log, n):
        from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticDatasetBuilder
        from tinker_cookbook.rl import train

        return train.main, train.Config(
            learning_rate=1e-3,
            model_name=path,
            recipe_name="bench",
            renderer_name="qwen3",
            log_path=log,
            lora_rank=8,
            base_url=srv.url,
            max_tokens=8,
            max_steps=n,
            save_every=0,
            eval_every=0,
            dataset_builder=ArithmeticDatasetBuilder(
                batch_size=2,
                group_size=4,
                n_batches=n,
                model_name_for_tokenizer=path,
                renderer_name="qwen3",
            ),
        )

    try:
        print(
            f"tiny Qwen3 (V 512, D 64, 2 layers), LoRA rank 8, mesh {args.mesh}, "
            f"{args.steps} steps per run (the final checkpoint included)"
        )
        for name, make in (("supervised.train", sl), ("rl.train (sync)", rl)):
            for label, (wall, busy, n) in zip(("cold", "warm"), run(srv, make, args.steps)):
                print(f"{name:17s} {label} {split(busy, wall, args.steps)}")
                print(f"{'':22s} sampling-engine programs compiled in this run: {n}")
                print(
                    f"{'':22s} worker seconds by kind: "
                    + ", ".join(f"{k} {v:.3f}" for k, v in sorted(busy.items()))
                )
    finally:
        srv.stop()


if __name__ == "__main__":
    main()
