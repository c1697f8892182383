"""A zoo of per-datum custom losses written the way users write them (torch), the SDK's
encoding of them, and inputs for one datum — shared by test_custom_loss (the graph
interpreter against torch) and test_custom_server (server-side vs the SDK's client path).
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from tinker.lib.public_interfaces.custom_loss import encode_graph, trace_loss


def encoded(fn, ranks):
    """(graph JSON, inputs JSON) exactly as ServiceClient.create_custom_loss uploads them."""
    handle = trace_loss(fn, ranks, "session")
    return (encode_graph(handle).model_dump(mode="json"),
            [x.model_dump(mode="json") for x in handle.inputs])



# ----------------------------------------------------------------------------------------
# A zoo of per-datum losses written the way users write them (torch)


def seq_mean_is(logprobs, sampling_logprobs, advantages, mask):
    """Sequence-mean importance sampling (a ratio of sums, not a token sum)."""
    ratio = torch.exp(logprobs - sampling_logprobs)
    n = mask.sum().clamp(min=1.0)
    loss = -(ratio * advantages * mask).sum() / n
    return loss, {"custom/ratio:mean": (ratio.detach() * mask).sum() / n,
                  "custom/tokens:sum": mask.sum()}


def clipped_kl(logprobs, sampling_logprobs, advantages, ref_logprobs):
    """PPO's clipped ratio with a k3 KL penalty to a reference policy, token mean."""
    ratio = torch.exp(logprobs - sampling_logprobs)
    clipped = torch.clamp(ratio, 0.8, 1.2)
    pg = -torch.min(ratio * advantages, clipped * advantages)
    d = ref_logprobs - logprobs
    kl = torch.exp(d) - d - 1
    return (pg + 0.05 * kl).mean(), {"custom/kl:mean": kl.mean().detach(),
                                     "custom/clipfrac:mean": (ratio != clipped).float().mean()}


def dpo_pair(logprobs, ref_logprobs, chosen_mask, rejected_mask, beta):
    """DPO inside one datum: chosen and rejected completions packed in one sequence."""
    pi = (logprobs * chosen_mask).sum() - (logprobs * rejected_mask).sum()
    ref = (ref_logprobs * chosen_mask).sum() - (ref_logprobs * rejected_mask).sum()
    margin = beta * (pi - ref)
    return -F.logsigmoid(margin), {"custom/margin:mean": margin.detach(),
                                   "custom/acc:mean": (margin > 0).float()}


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
    return (lse + (c * w).sum() / n + m + soft + t + math.sqrt(2.0) * logprobs[-1]
            + logprobs.clamp(max=-1.0).sum()), {"custom/n:sum": torch.ones_like(m) * n}


ZOO = {
    "seq_mean_is": (seq_mean_is, dict(logprobs=1, sampling_logprobs=1, advantages=0, mask=1)),
    "clipped_kl": (clipped_kl, dict(logprobs=1, sampling_logprobs=1, advantages=1,
                                    ref_logprobs=1)),
    "dpo_pair": (dpo_pair, dict(logprobs=1, ref_logprobs=1, chosen_mask=1, rejected_mask=1,
                                beta=0)),
    "topk_distill": (topk_distill, dict(logprobs=2, teacher_logprobs=2)),
    "odd_ops": (odd_ops, dict(logprobs=1, x=1)),
}


def zoo_inputs(name, n=11, k=4, seed=0):
    """(logprobs, {input: float32 array}) for one datum of a zoo loss."""
    rng = np.random.default_rng(seed)
    lp = (-2.0 + 0.3 * rng.normal(size=(n, k) if name == "topk_distill" else n)).astype(
        np.float32)
    mask = (rng.uniform(size=n) < 0.7).astype(np.float32)
    chosen = np.zeros(n, np.float32)
    chosen[2:5] = 1
    rejected = np.zeros(n, np.float32)
    rejected[6:10] = 1
    lp1 = lp if lp.ndim == 1 else lp[:, 0]
    values = {"sampling_logprobs": lp1 + 0.1 * rng.normal(size=n).astype(np.float32),
              "ref_logprobs": lp1 + 0.2 * rng.normal(size=n).astype(np.float32),
              "advantages": rng.normal(size=n).astype(np.float32), "mask": mask,
              "chosen_mask": chosen, "rejected_mask": rejected,
              "beta": np.float32(0.5), "x": rng.normal(size=n).astype(np.float32),
              "teacher_logprobs": rng.normal(size=(n, k)).astype(np.float32)}
    if name == "seq_mean_is":
        values["advantages"] = np.float32(1.3)
    return lp, values
