"""One-pass server-side custom loss vs the Tinker SDK's two-pass client-side path.

The tiny model (jcp.QwenConfig.tiny()), LoRA rank 8, on --mesh (default 1,1,1); jcp-serve
in this process (127.0.0.1, a free port) driven by the Tinker SDK 0.38. The loss is a
sequence-mean importance-sampling loss with a KL penalty, traced by the SDK
(create_custom_loss). One training step = forward_backward_custom of 8 × 512 tokens.

- server-side: the handle the server made (loss_id set): one forward/backward pass on the
  server, the loss evaluated there (jcp.custom_loss).
- client-side: the same handle with loss_id None, which the SDK runs as a forward pass,
  the loss and its gradient in torch on the client, then a cross_entropy pass with
  weights = −dC/dlogprobs.

The two sides alternate single steps, --rounds × --steps of each (after warm-up); the
median and best step time (tokens/s) of each side are printed, with the ratio of the best
steps and the median of the paired steps' ratios. The machine may be shared: compare the
ratios, not absolute times.

    python benchmarks/custom_loss.py [--mesh 1,1,1] [--steps 3] [--rounds 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time

from common import fake_cpu_devices, mesh_arg  # benchmarks/ is sys.path[0]

DATUMS, TOKENS, RANK, SEED = 8, 512, 8, 0


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--mesh", type=mesh_arg, default="1,1,1", help="dp,cp,tp (fake CPU devices as needed)"
    )
    p.add_argument("--steps", type=int, default=3, help="timed steps per round")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    return args


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    fake_cpu_devices(args.mesh)
    import numpy as np
    import tinker
    import torch
    from tinker import types

    import jcp
    from jcp.server.service import Server

    def seq_mean_is_kl(logprobs, sampling_logprobs, advantages):
        ratio = torch.exp(logprobs - sampling_logprobs)
        d = sampling_logprobs - logprobs
        kl = torch.exp(d) - d - 1
        return (
            -(ratio * advantages).mean() + 0.05 * kl.mean(),
            {"custom/ratio:mean": ratio.detach().mean()},
        )

    cfg = jcp.QwenConfig.tiny()
    tr = jcp.Trainer(
        cfg,
        jcp.make_mesh(*args.mesh),
        max_adapters=8,
        max_rank=RANK,
        max_tokens_per_device=DATUMS * TOKENS,
    )
    rng = np.random.default_rng(0)

    def floats(x):
        return types.TensorData(
            data=np.asarray(x, np.float32).tolist(), dtype="float32", shape=[len(x)]
        )

    data = []
    for _ in range(DATUMS):
        t = rng.integers(0, cfg.vocab_size, TOKENS + 1)
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(t[:-1].tolist()),
                loss_fn_inputs={
                    "target_tokens": t[1:].tolist(),
                    "sampling_logprobs": floats(
                        -np.log(cfg.vocab_size) + 0.1 * rng.normal(size=TOKENS)
                    ),
                    "advantages": floats(rng.normal(size=TOKENS)),
                },
            )
        )

    srv = Server(tr, "jcp-tiny", tempfile.mkdtemp(prefix="jcp-custom-bench-")).start()
    sc = tinker.ServiceClient(base_url=srv.url, api_key="tml-bench")
    try:
        print(
            f"jcp-serve at {srv.url}; mesh dp,cp,tp = {args.mesh}; tiny model "
            f"(hidden {cfg.hidden_size}, {cfg.num_layers} layers, vocab {cfg.vocab_size}); "
            f"LoRA rank {RANK}; {DATUMS} × {TOKENS} tokens per step",
            flush=True,
        )
        handle = sc.create_custom_loss(
            seq_mean_is_kl, {"logprobs": 1, "sampling_logprobs": 1, "advantages": 1}
        ).result()
        assert handle.loss_id is not None
        sides = {
            "server-side (1 pass)": (
                handle,
                sc.create_lora_training_client(
                    base_model="jcp-tiny", rank=RANK, seed=SEED
                ).result(),
            ),
            "client-side (SDK, 2 passes)": (
                dataclasses.replace(handle, loss_id=None),
                sc.create_lora_training_client(
                    base_model="jcp-tiny", rank=RANK, seed=SEED
                ).result(),
            ),
        }

        def step(name):
            loss, tc = sides[name]
            t0 = time.perf_counter()
            tc.forward_backward_custom(data, loss).result()
            return time.perf_counter() - t0

        for name in sides:
            for _ in range(args.warmup):
                step(name)
        # Single steps alternate (order flipped each time), so a slow spell of a shared
        # machine hits both sides alike; min is the least disturbed step of each side.
        times = {name: [] for name in sides}
        names = list(sides)
        for i in range(args.rounds * args.steps):
            for name in names if i % 2 == 0 else names[::-1]:
                times[name].append(step(name))
        for name, ts in times.items():
            print(
                f"   {name:28s} median {statistics.median(ts) * 1e3:8.1f} ms/step "
                f"({DATUMS * TOKENS / statistics.median(ts):8.0f} tokens/s), best "
                f"{min(ts) * 1e3:8.1f} ms ({DATUMS * TOKENS / min(ts):8.0f} tokens/s)",
                flush=True,
            )
        one, two = times.values()
        paired = [b / a for a, b in zip(one, two)]
        print(
            f"   client-side / server-side step time: best-of {min(two) / min(one):.3f}×, "
            f"median of {len(paired)} paired steps {statistics.median(paired):.3f}×",
            flush=True,
        )
    finally:
        if sc._session_holder is not None:
            sc._session_holder.close()
        srv.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
