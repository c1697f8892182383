"""jcp.custom_loss: the SDK's traced graphs rebuilt from jcp's own operation tables.

Every loss here is a real torch function, traced and encoded by the tinker SDK's own code
(trace_loss / encode_graph, what create_custom_loss sends); the rebuilt JAX function's
value, metrics and gradient w.r.t. logprobs must equal torch's on the same inputs.
Refusals name the node and build nothing.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tinker.lib.public_interfaces.custom_loss import encode_graph, trace_loss

from jcp import InputError
from jcp import custom_loss as cl


def encoded(fn, ranks):
    """(graph JSON, inputs JSON) exactly as ServiceClient.create_custom_loss uploads them."""
    handle = trace_loss(fn, ranks, "session")
    return (encode_graph(handle).model_dump(mode="json"),
            [x.model_dump(mode="json") for x in handle.inputs])


def rebuilt(fn, ranks):
    graph, inputs = encoded(fn, ranks)
    return cl.CustomLoss.from_graph(graph, inputs, fn.__name__)


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


def torch_value_and_grad(fn, lp, args):
    x = torch.tensor(lp, dtype=torch.float64, requires_grad=True)
    loss, metrics = fn(x, *(torch.tensor(np.asarray(a), dtype=torch.float64) for a in args))
    loss.backward()
    return float(loss.detach()), {k: float(v.detach()) for k, v in metrics.items()}, x.grad.numpy()


@pytest.mark.parametrize("name", sorted(ZOO))
def test_rebuilt_graph_matches_torch(name):
    fn, ranks = ZOO[name]
    loss_fn = rebuilt(fn, ranks)
    lp, values = zoo_inputs(name)
    args = [values[k] for k in loss_fn.input_names]
    loss_fn.check(0, lp.shape, {k: np.asarray(values[k]) for k in loss_fn.input_names})

    def scalar(lp_):
        return loss_fn(lp_, *(jnp.asarray(a) for a in args))

    (value, metrics), grad = jax.value_and_grad(scalar, has_aux=True)(jnp.asarray(lp))
    ref_value, ref_metrics, ref_grad = torch_value_and_grad(fn, lp, args)
    assert np.any(ref_grad != 0)
    np.testing.assert_allclose(float(value), ref_value, rtol=2e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(grad), ref_grad, rtol=2e-5, atol=2e-6)
    assert sorted(metrics) == sorted(ref_metrics)
    for k in metrics:
        np.testing.assert_allclose(float(metrics[k]), ref_metrics[k], rtol=2e-5, atol=1e-6)


def test_from_function_matches_graph():
    """A JAX function and the traced torch one are interchangeable CustomLoss objects."""
    def jax_seq_mean_is(logprobs, sampling_logprobs, advantages, mask):
        ratio = jnp.exp(logprobs - sampling_logprobs)
        n = jnp.maximum(mask.sum(), 1.0)
        return -(ratio * advantages * mask).sum() / n, {}

    ranks = ZOO["seq_mean_is"][1]
    a = cl.CustomLoss.from_function(jax_seq_mean_is, ranks)
    b = rebuilt(*ZOO["seq_mean_is"])
    lp, values = zoo_inputs("seq_mean_is")
    args = [values[k] for k in a.input_names]
    assert a.input_names == b.input_names
    np.testing.assert_allclose(float(a(lp, *args)[0]), float(b(lp, *args)[0]), rtol=1e-6)


# ----------------------------------------------------------------------------------------
# Refusals: a clear InputError naming the node, before anything runs


def _graph_with(node, ranks=None):
    graph, inputs = encoded(lambda logprobs: (logprobs.sum(), {}), {"logprobs": 1})
    graph["nodes"].insert(1, node)
    return graph, inputs


def test_unknown_function_is_refused_naming_the_node():
    graph, inputs = encoded(lambda logprobs: (torch.exp(logprobs).sum(), {}), {"logprobs": 1})
    for node in graph["nodes"]:
        if node["target"] == "torch.exp":
            node["target"] = "os.system"
    with pytest.raises(InputError, match=r"node 1 \('exp'.*'os.system' is not an allowed"):
        cl.CustomLoss.from_graph(graph, inputs)


def test_attribute_outside_the_list_is_refused():
    def reads_grad(logprobs):
        return logprobs.sum() + logprobs.shape[0], {}

    graph, inputs = encoded(reads_grad, {"logprobs": 1})
    cl.CustomLoss.from_graph(graph, inputs)  # as traced: allowed
    for node in graph["nodes"]:
        if node["target"] == "getattr":
            node["args"][1] = "__class__"
    with pytest.raises(InputError, match="reads attribute '__class__'"):
        cl.CustomLoss.from_graph(graph, inputs)


@pytest.mark.parametrize("op,target", [("call_module", "lin"), ("get_attr", "weight"),
                                       ("call_method", "backward"),
                                       ("call_method", "item")])
def test_disallowed_ops_and_methods(op, target):
    graph, inputs = _graph_with({"op": op, "name": "bad", "target": target,
                                 "args": [{"ref": "logprobs"}], "kwargs": {}})
    with pytest.raises(InputError, match=r"node 1 \('bad'"):
        cl.CustomLoss.from_graph(graph, inputs)


def test_too_large_and_too_deep_graphs_are_refused(monkeypatch):
    graph, inputs = encoded(lambda logprobs: (logprobs.sum(), {}), {"logprobs": 1})
    chain = [{"op": "call_function", "name": f"n{j}", "target": "operator.neg",
              "args": [{"ref": "logprobs" if j == 0 else f"n{j - 1}"}], "kwargs": {}}
             for j in range(cl.MAX_DEPTH + 1)]
    deep = {"nodes": graph["nodes"][:1] + chain + graph["nodes"][1:]}
    with pytest.raises(InputError, match=f"deeper than {cl.MAX_DEPTH}"):
        cl.CustomLoss.from_graph(deep, inputs)
    wide = [{"op": "call_function", "name": f"w{j}", "target": "operator.neg",
             "args": [{"ref": "logprobs"}], "kwargs": {}} for j in range(cl.MAX_NODES)]
    with pytest.raises(InputError, match=f"at most {cl.MAX_NODES}"):
        cl.CustomLoss.from_graph({"nodes": graph["nodes"][:1] + wide + graph["nodes"][1:]},
                                 inputs)
    many = [{"name": "logprobs", "rank": 1}] + [{"name": f"x{j}", "rank": 1}
                                                for j in range(cl.MAX_INPUTS)]
    with pytest.raises(InputError, match=f"at most {cl.MAX_INPUTS}"):
        cl.CustomLoss.from_graph(graph, many)


def test_malformed_graphs_are_refused():
    graph, inputs = encoded(lambda logprobs: (logprobs.sum(), {}), {"logprobs": 1})
    bad_ref = {"nodes": [dict(graph["nodes"][0]), {"op": "call_function", "name": "a",
                                                   "target": "torch.exp",
                                                   "args": [{"ref": "later"}]}]}
    with pytest.raises(InputError, match="'later', which is not an earlier node"):
        cl.CustomLoss.from_graph(bad_ref, inputs)
    with pytest.raises(InputError, match="not allowed"):
        cl.CustomLoss.from_graph(*_graph_with({"op": "call_function", "name": "c",
                                               "target": "torch.exp",
                                               "args": [{"code": "print(1)"}]}))
    with pytest.raises(InputError, match=r"reads 1 inputs, declared 2"):
        cl.CustomLoss.from_graph(graph, [{"name": "logprobs", "rank": 1},
                                         {"name": "advantages", "rank": 1}])
    with pytest.raises(InputError, match="first input must be logprobs"):
        cl.CustomLoss.from_graph(graph, [{"name": "logprobs", "rank": 0}])


def test_rank_and_shape_mismatches_name_the_datum():
    loss = rebuilt(*ZOO["clipped_kl"])
    lp, values = zoo_inputs("clipped_kl")
    shapes = {k: np.asarray(values[k]) for k in loss.input_names}
    with pytest.raises(InputError, match="datum 3: loss_fn_inputs.target_tokens has rank 2"):
        loss.check(3, lp.shape + (2,), shapes)
    with pytest.raises(InputError, match="datum 3: loss_fn_inputs.advantages has rank 0"):
        loss.check(3, lp.shape, {**shapes, "advantages": np.float32(1.0)})
    with pytest.raises(InputError,
                       match=r"datum 3: custom loss graph: node 11 \('sub_1'.*incompatible"):
        loss.check(3, lp.shape, {**shapes, "ref_logprobs": np.zeros(4, np.float32)})
    vec = rebuilt(lambda logprobs: (logprobs * 2, {}), {"logprobs": 1})
    with pytest.raises(InputError, match="must return a scalar loss"):
        vec.check(0, lp.shape, {})
