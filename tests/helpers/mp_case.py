"""The workload of the two-process test, shared by the worker and the one-process run."""

import numpy as np

import jcp

CFG = jcp.QwenConfig.tiny()


MESH = (4, 2, 1)


def run(ckpt_dir: str) -> dict:
    """Mesh MESH over every device (tp = 1: over 2 processes, forward_backward sums on the
    host, host_sum.HostSummedStep; test_serve_multiprocess's jobs cover tp = 2); two
    adapters, ppo, an optim_step, a forward, a save_state.

    Returns flat NumPy results: per-datum outputs, gradients, post-step weights, the weights
    read back from the saved checkpoint, and whether the Trainer summed on the host.
    """
    rng = np.random.default_rng(0)
    lens = (37, 1, 20, 64, 5)
    data = [
        jcp.Datum(
            rng.integers(0, CFG.vocab_size, n),
            {
                "target_tokens": rng.integers(0, CFG.vocab_size, n),
                "advantages": rng.normal(size=n),
                "logprobs": -rng.uniform(1, 6, n),
            },
        )
        for n in lens
    ]
    tr = jcp.Trainer(CFG, jcp.make_mesh(*MESH), max_rank=8, attn_block=16, logprob_chunk=16)
    a = tr.create_adapter(rank=4, seed=1)
    b = tr.create_adapter(rank=8, seed=2)
    adapters = [a, b, a, b, a]
    tr.forward_backward(data, "ppo", adapters=adapters)
    tr.optim_step(a, jcp.AdamParams(learning_rate=1e-2))
    tr.optim_step(b, jcp.AdamParams(learning_rate=1e-2))
    out = tr.forward_backward(data, "ppo", adapters=adapters)
    res = {}
    for i, o in enumerate(out.loss_fn_outputs):
        res[f"logprobs_{i}"] = o["logprobs"]
        res[f"loss_{i}"] = o["elementwise_loss"]
        res[f"sum_{i}"] = np.float64(o["loss:sum"])
    res["metric_loss"] = np.float64(out.metrics["loss:sum"])
    fwd = tr.forward(data, "ppo", adapters=[b, a, b, a, b])
    for i, o in enumerate(fwd.loss_fn_outputs):
        res[f"forward_logprobs_{i}"] = o["logprobs"]
        res[f"forward_sum_{i}"] = np.float64(o["loss:sum"])
    for name, g in (("a", tr.gradients(a)), ("b", tr.gradients(b))):
        for k, v in g.items():
            res[f"grad_{name}_{k}"] = v
    tr.save_state(b, ckpt_dir)
    c = tr.load_state(ckpt_dir)
    for k, v in tr.adapter_weights(c).items():
        res[f"reloaded_{k}"] = v
    res["sums_on_host"] = np.bool_(tr.sums_on_host)
    return res
