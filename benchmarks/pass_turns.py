"""How long each turn of a forward_backward in turns holds the device, and what the turns
cost a call: what another tenant waits for behind a heavy tenant's split pass in jcp-serve
(docs/serving.md, "Fairness across tenants").

jcp-serve's model and settings (the tiny random model unless --layers; one CPU device
(of --cpu-devices in the process), --max-tokens-per-device 1,024, as
benchmarks/noisy_neighbour.py runs it). For each number of layer spans (--spans; 0: the
micro-batch whole, one program), one full-length micro-batch (1 × 1,023 tokens) through
Trainer.forward_backward_steps(turns=True), each turn waited on before the next: every
turn's time, median over --rounds; then a call of --datums full-length datums, whole and
in turns, rounds interleaved: its median time and its ratio to the whole call, measured
in the same run.

    python benchmarks/pass_turns.py [--spans 0,1,2] [--rounds 20] [--datums 16]
        [--layers N] [--cpu-devices 1] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from common import fake_cpu_devices


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--spans", default="0,1,2", help="layer spans to compare (0: whole)")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--datums", type=int, default=16, help="full-length datums of the call")
    p.add_argument("--tokens", type=int, default=1024, help="max_tokens_per_device")
    p.add_argument("--layers", type=int, default=None, help="the tiny model's layers (2)")
    p.add_argument(
        "--cpu-devices",
        type=int,
        default=1,
        help="fake CPU devices of the process, the mesh on one (jcp-serve on --mesh 1,1,1 "
        "made 8 before it made the mesh's share: jcp.cli.cpu_devices)",
    )
    p.add_argument("--json", default=None, help="also write the figures here")
    p.add_argument("--smoke", action="store_true", help="a tiny run (the tests)")
    a = p.parse_args(argv)
    a.spans = [int(x) for x in a.spans.split(",")]
    if a.smoke:
        a.rounds, a.datums, a.tokens = 2, 2, 64
    return a


def main(argv=None) -> dict:
    a = parse_args(argv)
    fake_cpu_devices((a.cpu_devices, 1, 1))  # that many devices; the mesh below uses one
    import jax
    import numpy as np

    import jcp

    overrides = {} if a.layers is None else {"num_layers": a.layers}
    cfg = jcp.QwenConfig.tiny(**overrides)
    tr = jcp.Trainer(
        cfg, jcp.make_mesh(1, 1, 1), max_adapters=4, max_rank=32, max_tokens_per_device=a.tokens
    )
    adapter = tr.create_adapter(rank=32)
    rng = np.random.default_rng(0)

    def datum():  # fills a micro-batch: its tokens and one row of padding
        n = a.tokens - 1
        return jcp.Datum(
            model_input=rng.integers(0, cfg.vocab_size, n, dtype=np.int32),
            loss_fn_inputs={
                "target_tokens": rng.integers(0, cfg.vocab_size, n, dtype=np.int32),
                "weights": np.ones(n, np.float32),
            },
        )

    one, call = [datum()], [datum() for _ in range(a.datums)]

    def run(data, spans: int, timed: bool) -> list[float]:
        """The call through Steps (in turns unless spans is 0) -> each step's seconds,
        waited on."""
        tr.programs.turn_spans = max(spans, 1)
        steps = tr.forward_backward_steps(data, adapters=adapter, turns=spans > 0)
        times = []
        while True:
            t0 = time.perf_counter()
            done = steps.step(settle=timed)
            times.append(time.perf_counter() - t0)
            if done:
                return times

    res = {"layers": cfg.num_layers, "tokens": a.tokens, "turns": {}, "call": {}}
    for spans in a.spans:  # compile and first runs out of the figures
        for _ in range(3):
            run(one, spans, True)
            run(call, spans, False)
    per_turn = {s: [] for s in a.spans}
    per_call = {s: [] for s in a.spans}
    for _ in range(a.rounds):
        for spans in a.spans:
            per_turn[spans].append(run(one, spans, True))
            t0 = time.perf_counter()
            run(call, spans, False)
            jax.effects_barrier()
            per_call[spans].append(time.perf_counter() - t0)
    whole = float(np.median(per_call[a.spans[0]]))
    print(
        f"tiny model, {cfg.num_layers} layers, 1 × {a.tokens - 1} tokens a micro-batch, "
        f"one CPU device of {a.cpu_devices} in the process; medians of {a.rounds} rounds"
    )
    print(
        f"spans | programs | each turn ms | longest ms | call of {a.datums} ms | call / first row's"
    )
    for spans in a.spans:
        turns = np.median(np.array(per_turn[spans]), axis=0) * 1e3
        t_call = float(np.median(per_call[spans]))
        res["turns"][spans] = [round(float(t), 2) for t in turns]
        res["call"][spans] = {"s": t_call, "ratio": t_call / whole}
        print(
            f"{spans} | {len(turns)} | {', '.join(f'{t:.1f}' for t in turns)} | "
            f"{turns.max():.1f} | {t_call * 1e3:.0f} | {t_call / whole:.2f}"
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main(sys.argv[1:])
