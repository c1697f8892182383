"""jcp.custom_loss: the SDK's traced graphs rebuilt from jcp's own operation tables.

Every loss here is a real torch function, traced and encoded by the tinker SDK's own code
(trace_loss / encode_graph, what create_custom_loss sends); the rebuilt JAX function's
value, metrics and gradient w.r.t. logprobs must equal torch's on the same inputs.
Refusals name the node and build nothing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from helpers.custom_zoo import ZOO, encoded, zoo_inputs
from jcp import InputError
from jcp import custom_loss as cl


def rebuilt(fn, ranks):
    graph, inputs = encoded(fn, ranks)
    return cl.CustomLoss.from_graph(graph, inputs, fn.__name__)


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
