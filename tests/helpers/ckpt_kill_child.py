"""Known adapter states for the checkpoint fault tests, and one save killed at a phase.

As a script (run by tests/test_checkpoint_faults.py, not by pytest):
    ckpt_kill_child.py PATH PHASE MODE
MODE "replace": save state "old" to PATH, then save "new" there, SIGKILLed at PHASE;
MODE "fresh": only the killed save of "new". PHASE is a jcp.checkpoint.on_phase phase, or
"orbax" (inside orbax, while the JSON item is written) or "removing" (after the pointer
moved, with one file of the old version deleted). Exits 0 only if PHASE never came.
One fake CPU device, mesh (1, 1, 1).
"""

import os
import signal
import sys

if __name__ == "__main__":
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1 " + os.environ.get(
        "JCP_TEST_CHILD_XLA_FLAGS", ""
    )
    os.environ["JAX_PLATFORMS"] = "cpu"

import numpy as np  # noqa: E402

import jcp  # noqa: E402
from jcp import lora as lora_lib  # noqa: E402
from jcp.adapter_state import AdapterInfo  # noqa: E402

CFG = jcp.QwenConfig.tiny()
# Different ranks, targets, moments and step counts, so a mix-up cannot go unseen.
SPECS = {
    "old": dict(rank=4, alpha=8.0, targets="all", seed=1, count=3),
    "new": dict(rank=6, alpha=3.0, targets=["attn"], seed=2, count=11),
    "third": dict(rank=2, alpha=1.0, targets=["mlp"], seed=3, count=5),
}


def values(state, which: str) -> tuple[AdapterInfo, dict]:
    """(info, {"weights"|"mu"|"nu": {module: {"a", "b"}}, "count": int}) of a known state,
    NumPy float32 at the adapter's own rank; the same on every mesh."""
    s = SPECS[which]
    info = AdapterInfo(s["rank"], s["alpha"], lora_lib.resolve_targets(s["targets"]))
    rng = np.random.default_rng(s["seed"])
    layout = state.layout(info)

    def tree(scale, positive=False):
        out = {
            m: {
                ab: (rng.standard_normal(x.shape) * scale).astype(np.float32) for ab, x in v.items()
            }
            for m, v in layout.items()
        }
        return (
            {m: {ab: np.abs(x) for ab, x in v.items()} for m, v in out.items()} if positive else out
        )

    return info, {
        "weights": tree(0.1),
        "mu": tree(1e-3),
        "nu": tree(1e-6, positive=True),
        "count": s["count"],
    }


def put(tr, which: str) -> int:
    """Install the known state `which` in a free slot of Trainer `tr` -> its id."""
    info, v = values(tr.state, which)
    slot = tr.state.free_slot()
    tr.state.install(slot, info, v["weights"], v["mu"], v["nu"], v["count"])
    return slot


def main(path: str, phase: str, mode: str) -> None:
    import shutil

    import orbax.checkpoint as ocp

    from jcp import checkpoint

    tr = jcp.Trainer(CFG, jcp.make_mesh(1, 1, 1), max_rank=8)
    if mode == "replace":
        tr.save_state(put(tr, "old"), path)
    new = put(tr, "new")

    def kill(*_, **__):
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    reached = []
    if phase == "orbax":
        ocp.JsonCheckpointHandler.save = kill
        ocp.JsonCheckpointHandler.async_save = kill
    elif phase == "removing":
        real = shutil.rmtree

        def rmtree(p, *a, **k):
            if "pointer-moved" in reached:
                for root, _, files in sorted(os.walk(p)):
                    if files:
                        os.remove(os.path.join(root, sorted(files)[0]))
                        kill()
            return real(p, *a, **k)

        shutil.rmtree = rmtree
    checkpoint.on_phase = lambda p: kill() if p == phase else reached.append(p)
    tr.save_state(new, path)
    print("survived: phase", phase, "never came; reached", reached)


if __name__ == "__main__":
    main(*sys.argv[1:4])
