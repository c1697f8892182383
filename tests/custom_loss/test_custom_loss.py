"""jcp.custom_loss: the SDK's traced graphs rebuilt from jcp's own operation tables.

Every loss here is a real torch function, traced and encoded by the tinker SDK's own code
(trace_loss / encode_graph, what create_custom_loss sends); the rebuilt JAX function's
value, metrics and gradient w.r.t. logprobs must equal torch's on the same inputs.
Refusals name the node and build nothing.
"""

from __future__ import annotations

import os
import time
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers.custom_zoo import ZOO, custom_graphs, encoded, zoo_inputs
from hypothesis import HealthCheck, given, settings

import jcp
from jcp import InputError, batch, datum
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


@pytest.mark.parametrize(
    "op,target",
    [
        ("call_module", "lin"),
        ("get_attr", "weight"),
        ("call_method", "backward"),
        ("call_method", "item"),
    ],
)
def test_disallowed_ops_and_methods(op, target):
    graph, inputs = _graph_with(
        {"op": op, "name": "bad", "target": target, "args": [{"ref": "logprobs"}], "kwargs": {}}
    )
    with pytest.raises(InputError, match=r"node 1 \('bad'"):
        cl.CustomLoss.from_graph(graph, inputs)


def test_too_large_and_too_deep_graphs_are_refused(monkeypatch):
    graph, inputs = encoded(lambda logprobs: (logprobs.sum(), {}), {"logprobs": 1})
    chain = [
        {
            "op": "call_function",
            "name": f"n{j}",
            "target": "operator.neg",
            "args": [{"ref": "logprobs" if j == 0 else f"n{j - 1}"}],
            "kwargs": {},
        }
        for j in range(cl.MAX_DEPTH + 1)
    ]
    deep = {"nodes": graph["nodes"][:1] + chain + graph["nodes"][1:]}
    with pytest.raises(InputError, match=f"deeper than {cl.MAX_DEPTH}"):
        cl.CustomLoss.from_graph(deep, inputs)
    wide = [
        {
            "op": "call_function",
            "name": f"w{j}",
            "target": "operator.neg",
            "args": [{"ref": "logprobs"}],
            "kwargs": {},
        }
        for j in range(cl.MAX_NODES)
    ]
    with pytest.raises(InputError, match=f"at most {cl.MAX_NODES}"):
        cl.CustomLoss.from_graph({"nodes": graph["nodes"][:1] + wide + graph["nodes"][1:]}, inputs)
    many = [{"name": "logprobs", "rank": 1}] + [
        {"name": f"x{j}", "rank": 1} for j in range(cl.MAX_INPUTS)
    ]
    with pytest.raises(InputError, match=f"at most {cl.MAX_INPUTS}"):
        cl.CustomLoss.from_graph(graph, many)


def test_malformed_graphs_are_refused():
    graph, inputs = encoded(lambda logprobs: (logprobs.sum(), {}), {"logprobs": 1})
    bad_ref = {
        "nodes": [
            dict(graph["nodes"][0]),
            {"op": "call_function", "name": "a", "target": "torch.exp", "args": [{"ref": "later"}]},
        ]
    }
    with pytest.raises(InputError, match="'later', which is not an earlier node"):
        cl.CustomLoss.from_graph(bad_ref, inputs)
    with pytest.raises(InputError, match="not allowed"):
        cl.CustomLoss.from_graph(
            *_graph_with(
                {
                    "op": "call_function",
                    "name": "c",
                    "target": "torch.exp",
                    "args": [{"code": "print(1)"}],
                }
            )
        )
    with pytest.raises(InputError, match=r"reads 1 inputs, declared 2"):
        cl.CustomLoss.from_graph(
            graph, [{"name": "logprobs", "rank": 1}, {"name": "advantages", "rank": 1}]
        )
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
    with pytest.raises(
        InputError, match=r"datum 3: custom loss graph: node 11 \('sub_1'.*incompatible"
    ):
        loss.check(3, lp.shape, {**shapes, "ref_logprobs": np.zeros(4, np.float32)})
    vec = rebuilt(lambda logprobs: (logprobs * 2, {}), {"logprobs": 1})
    with pytest.raises(InputError, match="must return a scalar loss"):
        vec.check(0, lp.shape, {})


# ----------------------------------------------------------------------------------------
# Bounds: a graph is a client's program, run on the worker while it holds the GIL


def _hostile(*nodes):
    graph, inputs = encoded(lambda logprobs: (logprobs.sum(), {}), {"logprobs": 1})
    return {"nodes": graph["nodes"][:1] + list(nodes) + graph["nodes"][1:]}, inputs


def _node(name, target, *args, op="call_function"):
    return {"op": op, "name": name, "target": target, "args": list(args), "kwargs": {}}


def _ref(name):
    return {"ref": name}


_N = [
    _node("shape", "getattr", _ref("logprobs"), "shape"),
    _node("n", "operator.getitem", _ref("shape"), 0),
]  # n = logprobs.shape[0]
BEYOND = r"may reach 2\*\*\d+, beyond int64"
CREATION_REFUSALS = {
    "pow": ([_node("p", "operator.pow", 3, 3 * 10**7)], r"node 1 \('p'.*3 \*\* 30000000 " + BEYOND),
    "pow_computed_exponent": (
        _N + [_node("p", "operator.pow", 3, _ref("n"))],
        r"node 3 \('p'.*power with a computed exponent",
    ),
    "list_repetition": (
        _N + [_node("r", "operator.mul", [0] * 1024, _ref("n"))],
        r"node 3 \('r'.*operator.mul on a sequence",
    ),
    "shape_repetition": (
        [_N[0], _node("r", "operator.mul", _ref("shape"), 10**6)],
        r"node 2 \('r'.*operator.mul on a sequence",
    ),
    "string_arithmetic": (
        [_node("s", "operator.mul", "x" * 256, 1 << 40)],
        r"node 1 \('s'.*on a sequence or string",
    ),
    "product_beyond_int64": (
        _N
        + [
            _node("a", "operator.mul", _ref("n"), _ref("n")),
            _node("b", "operator.mul", _ref("a"), _ref("n")),
        ],
        r"node 4 \('b'.*" + BEYOND,
    ),
    "literal_beyond_int64": (
        [_node("a", "operator.add", 1 << 70, 1)],
        r"node 1 \('a'.*integer argument outside int64",
    ),
    "too_many_literals": (
        [
            _node(f"t{j}", "torch.tensor", [0.0] * cl.MAX_LITERAL)
            for j in range(cl.MAX_LITERALS // cl.MAX_LITERAL + 1)
        ],
        f"over {cl.MAX_LITERALS} literal entries",
    ),
}


@pytest.mark.parametrize("case", sorted(CREATION_REFUSALS))
def test_unbounded_python_values_are_refused_at_creation(case):
    """pow(3, 3·10⁷) or [0]*1024*n ran for seconds (and 8 GiB) on the worker holding the
    GIL, freezing every tenant and /healthz: the cost model refuses them at creation, naming
    the node, before anything runs."""
    nodes, match = CREATION_REFUSALS[case]
    start = time.monotonic()
    with pytest.raises(InputError, match=match):
        cl.CustomLoss.from_graph(*_hostile(*nodes))
    assert time.monotonic() - start < 1.0


RUN_REFUSALS = {
    "float_to_huge_int": (
        [_node("a", "math.floor", 1e300), _node("b", "operator.pow", _ref("a"), 2)],
        r"node 1 \('a'.*integer result outside int64",
    ),
    "huge_expand": (
        [_node("e", "expand", _ref("logprobs"), 1 << 20, 1 << 20, 5, op="call_method")],
        r"node 1 \('e'.*over \d+ elements",
    ),
    "concatenation_doubling": (
        [_N[0]]
        + [
            _node(f"c{j}", "operator.add", *[_ref("shape" if j == 0 else f"c{j - 1}")] * 2)
            for j in range(8)
        ],
        r"node 8 \('c6'.*" + f"concatenation over {cl.MAX_SEQUENCE} entries",
    ),
    "complex": ([_node("c", "operator.pow", -8.0, 0.5)], r"node 1 \('c'.*complex"),
}


@pytest.mark.parametrize("case", sorted(RUN_REFUSALS))
def test_values_out_of_bounds_are_refused_at_their_node(case):
    """What the cost model cannot see before shapes are known is held when it runs: ints
    within int64, built tuples and arrays bounded; refused naming the datum and node."""
    nodes, match = RUN_REFUSALS[case]
    loss = cl.CustomLoss.from_graph(*_hostile(*nodes))
    start = time.monotonic()
    with pytest.raises(InputError, match="datum 0: custom loss graph: " + match):
        loss.check(0, (5,), {}, deadline=start + cl.CHECK_BUDGET_S)
    assert time.monotonic() - start < 1.0


def _datums(loss, name, count=1):
    lp, values = zoo_inputs(name)
    n = lp.shape[0]
    inputs = {"target_tokens": np.arange(n) % 7, **{k: values[k] for k in loss.input_names}}
    return [
        jcp.Datum(model_input=np.arange(n) % 7, loss_fn_inputs=dict(inputs)) for _ in range(count)
    ]


def test_evaluation_has_a_time_budget_per_request(monkeypatch):
    """A graph still evaluating its shapes at the request's deadline is refused at the node
    it reached (batch.validate — jcp.datum's — gives every check of a request CHECK_BUDGET_S together)."""
    loss = rebuilt(*ZOO["clipped_kl"])
    lp, values = zoo_inputs("clipped_kl")
    shapes = {k: np.asarray(values[k]) for k in loss.input_names}
    with pytest.raises(
        InputError,
        match=r"datum 2: custom loss graph: node \d+ .*ran past "
        r"its time budget",
    ):
        loss.check(2, lp.shape, shapes, deadline=time.monotonic() - 1)
    monkeypatch.setattr(datum, "CHECK_BUDGET_S", -1.0)
    with pytest.raises(InputError, match="datum 0: .*ran past its time budget"):
        batch.validate(_datums(loss, "clipped_kl"), loss, vocab_size=16, token_cap=64)
    monkeypatch.setattr(datum, "CHECK_BUDGET_S", 60.0)
    assert len(batch.validate(_datums(loss, "clipped_kl"), loss, 16, 64)) == 1


def test_a_request_traces_a_bounded_number_of_operations(monkeypatch):
    """The loss is traced once per datum into the step: nodes × datums is bounded."""
    loss = rebuilt(*ZOO["seq_mean_is"])
    assert loss.ops == len(encoded(*ZOO["seq_mean_is"])[0]["nodes"]) - 5  # 4 inputs, output
    monkeypatch.setattr(datum, "MAX_TRACED_OPS", 2 * loss.ops)
    assert len(batch.validate(_datums(loss, "seq_mean_is", 2), loss, 16, 64)) == 2
    with pytest.raises(
        InputError, match=f"has {loss.ops} operations, traced once per datum: 3 datums"
    ):
        batch.validate(_datums(loss, "seq_mean_is", 3), loss, 16, 64)


def test_inputs_the_loss_does_not_read_are_ignored():
    """As the SDK's client-side path: a datum may carry loss_fn_inputs the loss does not
    read (RL data often does); the ones it reads are still checked."""
    loss = rebuilt(*ZOO["seq_mean_is"])
    data = _datums(loss, "seq_mean_is")
    n = len(data[0].model_input)
    data[0].loss_fn_inputs.update(old=np.zeros((n, 3), np.float32), weights=np.ones(n, np.float32))
    (checked,) = batch.validate(data, loss, 16, 64)
    assert sorted(checked.extra) == sorted(loss.input_names)
    data[0].loss_fn_inputs["mask"] = np.ones((n, 2), np.float32)
    with pytest.raises(InputError, match="datum 0: loss_fn_inputs.mask has rank 2"):
        batch.validate(data, loss, 16, 64)


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(jcp.__file__)))


def test_random_graphs_are_refused_or_evaluate_within_budget():
    """Hypothesis: random graphs (hostile arguments mixed in, tests/helpers/custom_zoo.py)
    are refused with a one-line InputError or evaluate within budget: never another
    exception, never a hang. Seeded and bounded."""
    outcomes = Counter()

    @settings(
        max_examples=150,
        derandomize=True,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(custom_graphs())
    def one(graph_inputs):
        start = time.monotonic()
        try:
            loss = cl.CustomLoss.from_graph(*graph_inputs)
            loss.check(0, (7,), {}, deadline=start + cl.CHECK_BUDGET_S)
            outcomes["evaluated"] += 1
        except InputError as e:
            assert str(e) and "\n" not in str(e) and ROOT not in str(e)
            outcomes["refused at creation" if "datum 0" not in str(e) else "refused"] += 1
        assert time.monotonic() - start < cl.CHECK_BUDGET_S

    one()
    assert min(outcomes["evaluated"], outcomes["refused"], outcomes["refused at creation"]) >= 5, (
        outcomes
    )
