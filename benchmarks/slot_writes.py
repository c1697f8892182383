"""What a tenant's new adapter costs the worker: create_adapter of a sequence of (rank,
target set) kinds on one Trainer — seconds and XLA compiles of each first call, then of a
copy (a sampler snapshot), an offload + restore and a checkpoint (save_state, then
load_state) of each — and
optim_step's first call (it compiles) and its median step.

Every create, copy, restore, save and load is timed on its first call of its kind, as a tenant's
first request meets it; the compiles are counted from JAX's own events. In one process, tiny
model, --mesh of fake CPU devices.

    python benchmarks/slot_writes.py [--mesh 1,2,2] [--max-rank 16] [--steps 50]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

from common import fake_cpu_devices, mesh_arg

KINDS = ((8, "all"), (4, "all"), (2, "all"), (8, "attn"), (16, "mlp"), (3, "attn,mlp"))


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mesh", type=mesh_arg, default=(1, 2, 2), help="dp,cp,tp")
    p.add_argument("--max-rank", type=int, default=16)
    p.add_argument("--steps", type=int, default=50, help="optim_steps timed after the first")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    a = parse_args(sys.argv[1:] if argv is None else argv)
    fake_cpu_devices(a.mesh)
    import jax
    import numpy as np

    import jcp

    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, secs, **kw: (
            compiles.append(name) if name == "/jax/core/compile/backend_compile_duration" else None
        )
    )

    def timed(fn):
        n, t = len(compiles), time.perf_counter()
        out = fn()
        return out, time.perf_counter() - t, len(compiles) - n

    cfg = jcp.QwenConfig.tiny()
    tr = jcp.Trainer(cfg, jcp.make_mesh(*a.mesh), max_adapters=4, max_rank=a.max_rank)
    rows = []
    print(f"mesh {a.mesh}, max_rank {a.max_rank}, page rank {tr.state.page_rank}")
    print(
        f"{'rank':>4} {'targets':>9} {'create s':>9} {'comp':>4} {'copy s':>7} {'comp':>4} "
        f"{'offload+restore s':>17} {'comp':>4} {'save s':>7} {'comp':>4} {'load s':>7} "
        f"{'comp':>4}"
    )
    folder = tempfile.TemporaryDirectory(prefix="jcp-slot-writes-")
    for i, (rank, targets) in enumerate(KINDS):
        slot, t_create, c_create = timed(
            lambda: tr.create_adapter(rank=rank, targets=targets.split(","))
        )
        copy, t_copy, c_copy = timed(lambda: tr.copy_adapter(slot))
        tr.delete_adapter(copy)
        slot, t_back, c_back = timed(lambda: tr.restore_adapter(tr.offload_adapter(slot)))
        path = os.path.join(folder.name, str(i))
        _, t_save, c_save = timed(lambda: tr.save_state(slot, path))
        tr.delete_adapter(slot)
        slot, t_load, c_load = timed(lambda: tr.load_state(path))
        tr.delete_adapter(slot)
        rows.append(
            dict(
                rank=rank,
                targets=targets,
                create_s=t_create,
                create_compiles=c_create,
                copy_s=t_copy,
                copy_compiles=c_copy,
                back_s=t_back,
                back_compiles=c_back,
                save_s=t_save,
                save_compiles=c_save,
                load_s=t_load,
                load_compiles=c_load,
            )
        )
        print(
            f"{rank:>4} {targets:>9} {t_create:9.3f} {c_create:4d} {t_copy:7.3f} "
            f"{c_copy:4d} {t_back:17.3f} {c_back:4d} {t_save:7.3f} {c_save:4d} "
            f"{t_load:7.3f} {c_load:4d}"
        )
    folder.cleanup()

    a_slot = tr.create_adapter(rank=a.max_rank)
    rng = np.random.default_rng(0)
    data = [
        jcp.Datum(
            rng.integers(0, cfg.vocab_size, 32),
            {"target_tokens": rng.integers(0, cfg.vocab_size, 32), "weights": np.ones(32)},
        )
        for _ in range(2)
    ]
    tr.forward_backward(data, "cross_entropy", adapters=a_slot)
    _, t_first, c_first = timed(lambda: tr.optim_step(a_slot))
    steps = []
    for _ in range(a.steps):
        tr.forward_backward(data, "cross_entropy", adapters=a_slot)
        t = time.perf_counter()
        tr.optim_step(a_slot)
        steps.append(time.perf_counter() - t)
    step = float(np.median(steps))
    print(
        f"optim_step: first call {t_first:.3f} s ({c_first} compiles), then a step "
        f"{1e3 * step:.1f} ms (median of {a.steps})"
    )
    return {"kinds": rows, "optim_first_s": t_first, "optim_step_s": step}


if __name__ == "__main__":
    main()
