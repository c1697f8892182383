"""A zoo of per-datum custom losses written the way users write them (torch), the SDK's
encoding of them, and inputs for one datum — shared by test_custom_loss (the graph
interpreter against torch) and test_custom_server (server-side vs the SDK's client path).
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from hypothesis import strategies as st
from tinker.lib.public_interfaces.custom_loss import encode_graph, trace_loss


def encoded(fn, ranks):
    """(graph JSON, inputs JSON) exactly as ServiceClient.create_custom_loss uploads them."""
    handle = trace_loss(fn, ranks, "session")
    return (
        encode_graph(handle).model_dump(mode="json"),
        [x.model_dump(mode="json") for x in handle.inputs],
    )


# ----------------------------------------------------------------------------------------
# A zoo of per-datum losses written the way users write them (torch)


def seq_mean_is(logprobs, sampling_logprobs, advantages, mask):
    """Sequence-mean importance sampling (a ratio of sums, not a token sum)."""
    ratio = torch.exp(logprobs - sampling_logprobs)
    n = mask.sum().clamp(min=1.0)
    loss = -(ratio * advantages * mask).sum() / n
    return loss, {
        "custom/ratio:mean": (ratio.detach() * mask).sum() / n,
        "custom/tokens:sum": mask.sum(),
    }


def clipped_kl(logprobs, sampling_logprobs, advantages, ref_logprobs):
    """PPO's clipped ratio with a k3 KL penalty to a reference policy, token mean."""
    ratio = torch.exp(logprobs - sampling_logprobs)
    clipped = torch.clamp(ratio, 0.8, 1.2)
    pg = -torch.min(ratio * advantages, clipped * advantages)
    d = ref_logprobs - logprobs
    kl = torch.exp(d) - d - 1
    return (pg + 0.05 * kl).mean(), {
        "custom/kl:mean": kl.mean().detach(),
        "custom/clipfrac:mean": (ratio != clipped).float().mean(),
    }


def dpo_pair(logprobs, ref_logprobs, chosen_mask, rejected_mask, beta):
    """DPO inside one datum: chosen and rejected completions packed in one sequence."""
    pi = (logprobs * chosen_mask).sum() - (logprobs * rejected_mask).sum()
    ref = (ref_logprobs * chosen_mask).sum() - (ref_logprobs * rejected_mask).sum()
    margin = beta * (pi - ref)
    return -F.logsigmoid(margin), {
        "custom/margin:mean": margin.detach(),
        "custom/acc:mean": (margin > 0).float(),
    }


def topk_distill(logprobs, teacher_logprobs):
    """Cross-entropy to a teacher's top-k distribution (2-D targets), renormalised."""
    p = torch.softmax(teacher_logprobs, dim=-1)
    ce = -(p * logprobs).sum(dim=-1)
    return ce.sum(), {"custom/ce:mean": ce.mean()}


def odd_ops(logprobs, x):
    """Indexing, slicing, shapes, cumsum, logsumexp, where, casts and methods."""
    n = logprobs.shape[0]
    head = logprobs[: n // 2]
    tail = logprobs[1::2]
    c = torch.cumsum(logprobs, 0)
    lse = torch.logsumexp(torch.stack([head.sum(), tail.sum()]), dim=0)
    w = torch.where(x > 0, x, torch.zeros_like(x)).float()
    m = torch.max(logprobs.unsqueeze(0), dim=1).values.squeeze()
    soft = F.softplus(logprobs).mean() + torch.sigmoid(logprobs).amax() - logprobs.amin()
    t = torch.tanh(logprobs).abs().sqrt().pow(2).sum() + torch.expm1(logprobs).sum()
    t = t + torch.log1p(torch.exp(logprobs)).sum() + logprobs.reshape(-1, 1).transpose(0, 1).sum()
    return (
        lse
        + (c * w).sum() / n
        + m
        + soft
        + t
        + math.sqrt(2.0) * logprobs[-1]
        + logprobs.clamp(max=-1.0).sum()
    ), {"custom/n:sum": torch.ones_like(m) * n}


ZOO = {
    "seq_mean_is": (seq_mean_is, dict(logprobs=1, sampling_logprobs=1, advantages=0, mask=1)),
    "clipped_kl": (clipped_kl, dict(logprobs=1, sampling_logprobs=1, advantages=1, ref_logprobs=1)),
    "dpo_pair": (
        dpo_pair,
        dict(logprobs=1, ref_logprobs=1, chosen_mask=1, rejected_mask=1, beta=0),
    ),
    "topk_distill": (topk_distill, dict(logprobs=2, teacher_logprobs=2)),
    "odd_ops": (odd_ops, dict(logprobs=1, x=1)),
}


def zoo_inputs(name, n=11, k=4, seed=0):
    """(logprobs, {input: float32 array}) for one datum of a zoo loss."""
    rng = np.random.default_rng(seed)
    lp = (-2.0 + 0.3 * rng.normal(size=(n, k) if name == "topk_distill" else n)).astype(np.float32)
    mask = (rng.uniform(size=n) < 0.7).astype(np.float32)
    chosen = np.zeros(n, np.float32)
    chosen[2:5] = 1
    rejected = np.zeros(n, np.float32)
    rejected[6:10] = 1
    lp1 = lp if lp.ndim == 1 else lp[:, 0]
    values = {
        "sampling_logprobs": lp1 + 0.1 * rng.normal(size=n).astype(np.float32),
        "ref_logprobs": lp1 + 0.2 * rng.normal(size=n).astype(np.float32),
        "advantages": rng.normal(size=n).astype(np.float32),
        "mask": mask,
        "chosen_mask": chosen,
        "rejected_mask": rejected,
        "beta": np.float32(0.5),
        "x": rng.normal(size=n).astype(np.float32),
        "teacher_logprobs": rng.normal(size=(n, k)).astype(np.float32),
    }
    if name == "seq_mean_is":
        values["advantages"] = np.float32(1.3)
    return lp, values


# ----------------------------------------------------------------------------------------
# Random graphs (hypothesis): the SDK's encoding, with the targets and arguments a hostile
# client would reach for (huge ints and exponents, sequence repetition, shape arithmetic,
# huge expands, disallowed names) mixed with ordinary tensor operations.

FUZZ_FUNCTIONS = [
    "operator.add",
    "operator.sub",
    "operator.mul",
    "operator.pow",
    "operator.floordiv",
    "operator.mod",
    "operator.neg",
    "operator.gt",
    "operator.getitem",
    "operator.and_",
    "operator.invert",
    "torch.exp",
    "torch.sum",
    "torch.tensor",
    "torch.stack",
    "torch.cat",
    "torch.where",
    "torch.clamp",
    "torch.ones_like",
    "torch.numel",
    "math.floor",
    "math.exp",
    "math.pow",
    "getattr",
    "torch.lgamma",
    "os.system",
]
FUZZ_METHODS = [
    "sum",
    "mean",
    "expand",
    "reshape",
    "size",
    "pow",
    "float",
    "unsqueeze",
    "__getitem__",
    "numel",
    "max",
    "item",
]


@st.composite
def custom_graphs(draw, max_nodes: int = 10):
    """(graph JSON, inputs JSON) of a random graph over one input, logprobs of rank 1."""
    names = ["logprobs"]
    nodes = [
        {"op": "placeholder", "name": "logprobs", "target": "logprobs", "args": [], "kwargs": {}}
    ]

    def arg():
        return draw(
            st.one_of(
                st.sampled_from(names).map(lambda n: {"ref": n}),
                st.sampled_from(names).map(lambda n: {"ref": n}),
                st.integers(-4, 4),
                st.integers(-(2**70), 2**70),
                st.sampled_from([3 * 10**7, 2**31, 63, 64, 1 << 20, 10**18]),
                st.floats(allow_nan=False, width=32),
                st.sampled_from([{"float": "inf"}, {"float": "nan"}]),
                st.lists(st.integers(-3, 3), max_size=6),
                st.just([0] * 1024),
                st.sampled_from(["shape", "values", "ndim", "x" * 256]),
                st.lists(st.integers(0, 4), max_size=3).map(lambda xs: {"tuple": xs}),
                st.sampled_from([{"slice": [None, 2, None]}, {"slice": [1, None, 2]}]),
                st.none(),
            )
        )

    tensors = ["logprobs"]  # nodes an ordinary operation made: tensors
    hostile = draw(st.booleans())  # else mostly ordinary nodes, so some graphs evaluate
    for j in range(draw(st.integers(1, max_nodes))):
        if hostile or draw(st.integers(0, 9)) == 0:
            op = draw(st.sampled_from(["call_function", "call_function", "call_method"]))
            target = draw(
                st.sampled_from(FUZZ_FUNCTIONS if op == "call_function" else FUZZ_METHODS)
            )
            args = [{"ref": draw(st.sampled_from(names))}] if draw(st.booleans()) else []
            args += [arg() for _ in range(draw(st.integers(0, 3)))]
            kwargs = {"dim": draw(st.integers(-2, 1))} if draw(st.integers(0, 5)) == 0 else {}
        else:
            op, target, arity = draw(
                st.sampled_from(
                    [
                        ("call_function", "torch.exp", 1),
                        ("call_function", "torch.tanh", 1),
                        ("call_function", "operator.add", 2),
                        ("call_function", "operator.mul", 2),
                        ("call_function", "operator.sub", 2),
                        ("call_method", "sum", 1),
                        ("call_method", "float", 1),
                        ("call_method", "pow", 2),
                    ]
                )
            )
            args = [{"ref": draw(st.sampled_from(tensors))}]
            if arity == 2:
                args.append(
                    draw(
                        st.one_of(
                            st.sampled_from(tensors).map(lambda n: {"ref": n}),
                            st.floats(-2, 2),
                            st.integers(-3, 3),
                        )
                    )
                )
            kwargs = {}
            tensors.append(f"n{j}")
        nodes.append({"op": op, "name": f"n{j}", "target": target, "args": args, "kwargs": kwargs})
        names.append(f"n{j}")
    # The loss sums some node: a scalar when that node is a tensor.
    nodes.append(
        {
            "op": "call_method",
            "name": "loss",
            "target": "sum",
            "args": [{"ref": draw(st.sampled_from(names))}],
            "kwargs": {},
        }
    )
    loss = {"ref": "loss"}
    metrics = {"custom/m:sum": {"ref": draw(st.sampled_from(names))}} if draw(st.booleans()) else {}
    nodes.append(
        {
            "op": "output",
            "name": "output",
            "target": "output",
            "args": [{"tuple": [loss, {"dict": metrics}]}],
            "kwargs": {},
        }
    )
    return {"format": 1, "nodes": nodes}, [{"name": "logprobs", "rank": 1}]
