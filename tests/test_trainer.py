"""The multi-LoRA Trainer: the promise across meshes, isolation, accumulation, AdamW,
micro-batching, refusals and slot reuse.

Evidence:
1. forward_backward gives the same per-datum log-probs, elementwise losses, loss sums,
   metrics and per-adapter gradients on meshes (1,8,1) (2,2,2) as on (1,1,1), for all
   five Tinker losses, on one batch that mixes three adapters of ranks 2, 4, 8 (non-zero
   B, different target sets) with ragged and one-token datums — and again with ring
   attention forced (cp_attention="ring") at (2,2,2) (cp = 8: test_attention).
   One mixed-loss pass per mesh carries all five losses (each loss on its own copy of the
   batch and its own copies of the adapters), so each mesh compiles one program;
2. optim_step with weight decay and clipping on one adapter leaves every other slot's
   weights, gradient accumulator and AdamW state bit-identical;
3. two forward_backward calls accumulate to one call on both batches; forward changes no
   state at all;
4. two optim_steps equal a NumPy AdamW (bias correction, decoupled decay, clipping);
5. a batch over the per-device token budget is split into micro-batches (one of which has
   a rank holding only padding) and gives the single-pass result;
6. every refused input raises InputError naming the datum and field and changes nothing;
7. delete_adapter frees its slot, and a new adapter there starts from a clean state.

Compiling dominates: one Trainer per mesh is cached (helpers.trainer_harness.trainer) and tests
reuse batches of the same shapes, so most calls hit the jit cache.
"""

from __future__ import annotations

import contextlib

import jax
import numpy as np
import pytest
from helpers import trainer_harness as H
from helpers.packing import micro_batches

import jcp
from jcp import attention, train_step

REF = (1, 1, 1)
# Every axis, the largest cp and all three together. (1,4,1) and (1,2,2) (~8.5 CPU s each)
# added no axis: cp = 4 and cp with tp alone are test_losses' and test_qwen3_5's meshes.
MESHES = ((1, 8, 1), (2, 2, 2))
RTOL = 1e-5
ATOL = 1e-6  # times the largest magnitude of the compared quantity
# Gradients sum over more terms (all tokens, both passes): twice the room. Measured on
# these meshes: at most half of this tolerance is used.
GRAD_ATOL = 2e-6


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return H.adapter_folders(str(tmp_path_factory.mktemp("adapters")))


@pytest.fixture(scope="module")
def data():
    return H.random_data(H.LENGTHS, seed=0)


def _ids(ids, names):
    return [ids[n] for n in names]


# ----------------------------------------------------------------------------------------
# 1. The promise across meshes

_MESH_RESULTS: dict = {}


@contextlib.contextmanager
def _counting_attention(counts):
    """Count the traced calls of the two cp attention paths (gather and ring)."""
    paths = attention.strategies  # where cp_attend / ring_attend look the paths up
    saved = paths.cp_attention, paths.ring_attention

    def counted(name, f):
        def g(*a, **kw):
            counts[name] += 1
            return f(*a, **kw)

        return g

    paths.cp_attention = counted("gather", saved[0])
    paths.ring_attention = counted("ring", saved[1])
    try:
        yield counts
    finally:
        paths.cp_attention, paths.ring_attention = saved


# One forward_backward per mesh serves all five losses (one compiled program instead of
# five): the batch is H.LENGTHS once per loss, each copy under its own loss and its own
# three adapters (p, q, r loaded again per loss), so every (loss, adapter) gradient lands
# in a slot of its own and every datum's outputs are those of its loss — the same
# quantities one pass per loss gives (test_mixed_losses: a mixed pass = separate passes).
MESH_TRAINER_KW = dict(max_adapters=len(H.LOSS_NAMES) * len(H.ADAPTERS) + 1)


def _mesh_results(mesh_shape, folders, data, cp_attention="auto"):
    """{loss: (output of its datums, {adapter name: gradients})}, "mixed": the whole
    pass's output, and "paths": how often each cp attention path was traced meanwhile."""
    key = (mesh_shape, cp_attention)
    if key not in _MESH_RESULTS:
        tr = H.trainer(
            mesh_shape,
            **MESH_TRAINER_KW,
            **({} if cp_attention == "auto" else {"cp_attention": cp_attention}),
        )
        with _counting_attention({"gather": 0, "ring": 0}) as counts, H.borrowed(tr):
            ids = {loss: H.load_adapters(tr, folders) for loss in H.LOSS_NAMES}
            batch, losses, adapters = [], [], []
            for loss in H.LOSS_NAMES:
                batch += data
                losses += [loss] * len(data)
                adapters += _ids(ids[loss], H.ASSIGN)
            configs = {k: v for k, v in H.LOSS_CONFIGS.items() if v is not None}
            out = tr.forward_backward(batch, losses, configs, adapters=adapters)
            res = {"mixed": out}
            for i, loss in enumerate(H.LOSS_NAMES):
                outputs = out.loss_fn_outputs[i * len(data) : (i + 1) * len(data)]
                metrics = {"loss:sum": sum(o["loss:sum"] for o in outputs)}
                if "clipped_tokens:sum" in outputs[0]:
                    metrics["clipped_tokens:sum"] = sum(o["clipped_tokens:sum"] for o in outputs)
                res[loss] = (
                    jcp.ForwardBackwardOutput(loss_fn_outputs=outputs, metrics=metrics),
                    {n: tr.gradients(a) for n, a in ids[loss].items()},
                )
        res["paths"] = counts
        _MESH_RESULTS[key] = res
    return _MESH_RESULTS[key]


def test_reference_results_are_informative(folders, data):
    """The (1,1,1) results the mesh test compares against exercise what they should."""
    res = _mesh_results(REF, folders, data)
    n_tokens = sum(H.LENGTHS)
    for loss in H.LOSS_NAMES:
        out, grads = res[loss]
        assert [len(o["logprobs"]) for o in out.loss_fn_outputs] == list(H.LENGTHS)
        for name, g in grads.items():
            spec = H.ADAPTERS[name]
            assert len(g) == 2 * sum(
                1 if m == "lm_head" else H.CFG.num_layers for m in spec["targets"]
            )
            for k, v in g.items():
                # Non-zero B makes A's gradient non-zero too.
                assert np.any(v != 0), f"{loss}: {name} {k} has a zero gradient"
                r = spec["rank"]
                assert v.shape[0 if ".lora_A." in k else 1] == r
        if loss in ("ppo", "cispo"):
            assert 0 < out.metrics["clipped_tokens:sum"] < n_tokens, loss
    # The losses really differ from one another, and the per-loss parts make up the pass.
    sums = [res[loss][0].metrics["loss:sum"] for loss in H.LOSS_NAMES]
    assert len(set(np.round(sums, 4))) == len(sums)
    assert res["mixed"].metrics["loss:sum"] == pytest.approx(sum(sums), rel=1e-5)


def _mesh_id(m):
    return "dp{}cp{}tp{}".format(*m)


# The same promise with ring attention forced (K/V passed around cp instead of gathered).
RING_MESHES = ((2, 2, 2),)  # the ring at cp = 8: test_attention


@pytest.mark.parametrize(
    "mesh_shape,cp_attention",
    [pytest.param(m, "auto", id=_mesh_id(m)) for m in MESHES]
    + [pytest.param(m, "ring", id=_mesh_id(m) + "-ring") for m in RING_MESHES],
)
def test_forward_backward_same_on_every_mesh(mesh_shape, cp_attention, folders, data):
    tr = H.trainer(
        mesh_shape,
        **MESH_TRAINER_KW,
        **({} if cp_attention == "auto" else {"cp_attention": "ring"}),
    )
    assert mesh_shape != REF and (tr.dp, tr.cp, tr.tp) == mesh_shape
    assert tr.mesh.devices.size == np.prod(mesh_shape) > 1
    assert tr.step_cfg.cp_attention == cp_attention
    ref = _mesh_results(REF, folders, data)
    got = _mesh_results(mesh_shape, folders, data, cp_attention)
    # At this size "auto" gathers; "ring" really took the ring path (traced, never gathered).
    if cp_attention == "ring":
        assert got["paths"]["ring"] > 0 and got["paths"]["gather"] == 0, got["paths"]
    else:
        assert got["paths"]["ring"] == 0, got["paths"]
    H.assert_outputs_close(got["mixed"], ref["mixed"], RTOL, ATOL, f"all losses {mesh_shape}")
    for loss in H.LOSS_NAMES:
        H.assert_outputs_close(got[loss][0], ref[loss][0], RTOL, ATOL, f"{loss} {mesh_shape}")
        for name in H.ADAPTERS:
            H.assert_grads_close(
                got[loss][1][name],
                ref[loss][1][name],
                RTOL,
                GRAD_ATOL,
                f"{loss} {mesh_shape} adapter {name}",
            )


# ----------------------------------------------------------------------------------------
# 2. Isolation of optim_step


def test_optim_step_touches_only_its_slot(folders, data):
    tr = H.trainer(REF)
    with H.borrowed(tr):
        ids = H.load_adapters(tr, folders)
        p, q = ids["p"], ids["q"]
        tr.forward_backward(data, "cross_entropy", adapters=_ids(ids, H.ASSIGN))
        tr.optim_step(q, jcp.AdamParams(learning_rate=1e-2, weight_decay=0.1))  # q: state ≠ 0
        tr.forward_backward(data, "cross_entropy", adapters=_ids(ids, H.ASSIGN))
        before = H.snapshot(tr)
        assert before["opt"].count[q] == 1 and before["opt"].count[p] == 0
        assert H.max_abs(before["grads"][q]) > 0 and H.max_abs(before["grads"][p]) > 0
        for m in H.ADAPTERS["q"]["targets"]:
            ab = before["opt"].mu[m]
            assert np.any(ab["a"][q] != 0) and np.any(ab["b"][q] != 0), m

        norm = float(
            np.sqrt(sum(np.sum(g.astype(np.float64) ** 2) for g in before["grads"][p].values()))
        )
        m = tr.optim_step(
            p, jcp.AdamParams(learning_rate=1e-2, weight_decay=0.5, grad_clip_norm=0.5 * norm)
        )
        after = H.snapshot(tr)
        assert m["step"] == 1 and m["grad_norm"] == pytest.approx(norm, rel=1e-5)

        # The stepped adapter did change: every tensor, its accumulator zeroed, count + 1.
        for k, w in before["weights"][p].items():
            assert np.any(after["weights"][p][k] != w), k
        assert all(np.all(g == 0) for g in after["grads"][p].values())
        assert after["opt"].count[p] == 1

        # Every other slot (allocated or free) is bit-identical: weights, accumulators, moments.
        others = [g for g in range(tr.max_adapters) if g != p]
        assert len(others) == tr.max_adapters - 1 and q in others
        for part in ("lora", "acc"):
            for (path, x), (_, y) in zip(
                *(jax.tree.leaves_with_path(s[part]) for s in (before, after))
            ):
                np.testing.assert_array_equal(x[others], y[others], err_msg=f"{part} {path}")
        for part in ("mu", "nu"):
            for (path, x), (_, y) in zip(
                *(jax.tree.leaves_with_path(getattr(s["opt"], part)) for s in (before, after))
            ):
                np.testing.assert_array_equal(x[others], y[others], err_msg=f"{part} {path}")
        np.testing.assert_array_equal(before["opt"].count[others], after["opt"].count[others])
        for a in (q, ids["r"]):
            for part in ("weights", "grads"):
                for k in before[part][a]:
                    np.testing.assert_array_equal(before[part][a][k], after[part][a][k])


# ----------------------------------------------------------------------------------------
# 3. Accumulation; forward leaves state alone


def test_two_calls_accumulate_to_one_and_forward_changes_nothing(folders, data):
    tr = H.trainer(REF)
    loss, cfg = "dro", H.LOSS_CONFIGS["dro"]
    halves = [[data[i] for i in h] for h in H.HALVES]
    with H.borrowed(tr):
        ids = H.load_adapters(tr, folders)
        outs, after = [], []
        for half, h in zip(halves, H.HALVES):
            outs.append(
                tr.forward_backward(half, loss, cfg, adapters=_ids(ids, [H.ASSIGN[i] for i in h]))
            )
            after.append({n: tr.gradients(a) for n, a in ids.items()})
        after_first, acc = after

        # forward: no state changes at all (its outputs are checked below).
        before = H.snapshot(tr)
        fwd = tr.forward(data, loss, cfg, adapters=_ids(ids, H.ASSIGN))
        H.assert_same_state(before, H.snapshot(tr))

    with H.borrowed(tr):
        ids = H.load_adapters(tr, folders)
        one = tr.forward_backward(data, loss, cfg, adapters=_ids(ids, H.ASSIGN))
        single = {n: tr.gradients(a) for n, a in ids.items()}

    for n in ids:
        # The second call contributed, so the comparison below is not vacuous.
        assert any(not np.allclose(acc[n][k], after_first[n][k], rtol=1e-3) for k in acc[n]), n
        H.assert_grads_close(acc[n], single[n], RTOL, GRAD_ATOL, f"accumulated vs single, {n}")
    # Per-datum outputs of the halves are those of the whole batch.
    for half_out, h in zip(outs, H.HALVES):
        for j, i in enumerate(h):
            for key in ("logprobs", "elementwise_loss"):
                np.testing.assert_allclose(
                    half_out.loss_fn_outputs[j][key],
                    one.loss_fn_outputs[i][key],
                    rtol=RTOL,
                    atol=1e-5,
                )
    assert sum(o.metrics["loss:sum"] for o in outs) == pytest.approx(
        one.metrics["loss:sum"], rel=1e-5
    )
    H.assert_outputs_close(fwd, one, RTOL, ATOL, "forward vs forward_backward")


# ----------------------------------------------------------------------------------------
# 4. AdamW against NumPy


def _adamw_reference(params, grads, mu, nu, t, hp: jcp.AdamParams):
    """One AdamW step in float64: clip by global norm, bias-corrected moments, decoupled decay."""
    g = {k: v.astype(np.float64) for k, v in grads.items()}
    norm = np.sqrt(sum(np.sum(v * v) for v in g.values()))
    if hp.grad_clip_norm > 0 and norm > hp.grad_clip_norm:
        g = {k: v * (hp.grad_clip_norm / norm) for k, v in g.items()}
    mu = {k: hp.beta1 * mu[k] + (1 - hp.beta1) * g[k] for k in g}
    nu = {k: hp.beta2 * nu[k] + (1 - hp.beta2) * g[k] ** 2 for k in g}
    out = {}
    for k, p in params.items():
        m_hat = mu[k] / (1 - hp.beta1**t)
        v_hat = nu[k] / (1 - hp.beta2**t)
        p = p.astype(np.float64)
        out[k] = p - hp.learning_rate * (m_hat / (np.sqrt(v_hat) + hp.eps) + hp.weight_decay * p)
    return out, mu, nu, norm


def test_optim_step_matches_numpy_adamw(folders, data):
    tr = H.trainer(REF)
    with H.borrowed(tr):
        ids = H.load_adapters(tr, folders)
        p = ids["p"]
        w = tr.adapter_weights(p)
        mu = {k: np.zeros(v.shape) for k, v in w.items()}
        nu = {k: np.zeros(v.shape) for k, v in w.items()}
        for t in (1, 2):
            tr.forward_backward(data, "cross_entropy", adapters=_ids(ids, H.ASSIGN))
            g = tr.gradients(p)
            norm = float(np.sqrt(sum(np.sum(v.astype(np.float64) ** 2) for v in g.values())))
            # Step 1 clips (to 40% of the norm); step 2 does not.
            hp = jcp.AdamParams(
                learning_rate=1e-2,
                beta1=0.9,
                beta2=0.95,
                eps=1e-8,
                weight_decay=0.1,
                grad_clip_norm=0.4 * norm if t == 1 else 0.0,
            )
            want, mu, nu, ref_norm = _adamw_reference(w, g, mu, nu, t, hp)
            assert (ref_norm > hp.grad_clip_norm > 0) == (t == 1)
            m = tr.optim_step(p, hp)
            assert m["step"] == t
            assert m["grad_norm"] == pytest.approx(ref_norm, rel=1e-5)
            assert m["learning_rate"] == pytest.approx(hp.learning_rate)
            got = tr.adapter_weights(p)
            for k in want:
                assert np.any(got[k] != w[k]), k
                np.testing.assert_allclose(
                    got[k], want[k], rtol=1e-5, atol=1e-7, err_msg=f"step {t}: {k}"
                )
            assert all(np.all(v == 0) for v in tr.gradients(p).values())
            w = got


# ----------------------------------------------------------------------------------------
# 5. Micro-batches


def test_micro_batches_match_single_pass(folders):
    # At (2,2,1) with 32 rows per device the cap is 64 tokens; three 64-token datums need two
    # micro-batches and the one-token datums land where cp rank 1 holds only padding.
    lengths = (64, 64, 64, 1, 1)
    assign = ("p", "q", "p", "q", "p")
    data = H.random_data(lengths, seed=3)
    small = H.trainer((2, 2, 1), max_tokens_per_device=32)
    big = H.trainer(REF)
    assert small.token_cap == 64 and big.token_cap >= sum(lengths)

    results, runs, packs = [], [], []
    for tr in (small, big):
        with H.borrowed(tr):
            ids = H.load_adapters(tr, folders, names=("p", "q"))
            adapters = _ids(ids, assign)
            packs.append(micro_batches(tr, data, "ppo", adapters))
            # forward_backward one micro-batch at a time: each step() runs the next one.
            steps = tr.forward_backward_steps(data, "ppo", H.LOSS_CONFIGS["ppo"], adapters)
            ran = 1
            while not steps.step():
                ran += 1
            runs.append(ran)
            results.append((steps.output, {n: tr.gradients(a) for n, a in ids.items()}))

    assert runs[0] >= 2 and runs[1] == 1
    assert runs == [len(p) for p in packs]
    # Some (dp, cp) device of some micro-batch holds no real token.
    assert any(
        np.all(pb.segment[d, c] < 0)
        for pb in packs[0]
        for d in range(pb.segment.shape[0])
        for c in range(pb.segment.shape[1])
    )
    (out_s, g_s), (out_b, g_b) = results
    H.assert_outputs_close(out_s, out_b, RTOL, ATOL, "micro-batched vs single pass")
    assert 0 < out_b.metrics["clipped_tokens:sum"]
    for n in g_b:
        H.assert_grads_close(g_s[n], g_b[n], RTOL, GRAD_ATOL, f"micro-batched vs single, {n}")


def _with_calls_between(tr, steps, ids, other) -> int:
    """Run `steps` to its end, every other step settled, with adapter r's forward_backward,
    optim_step and forward and a create and delete between its steps (jcp-serve's fair
    worker) -> how many steps it took; r moved (the calls between really ran)."""
    r0 = tr.adapter_weights(ids["r"])
    k = 0
    while not steps.step(settle=k % 2 == 0):
        tr.forward_backward(other, "cross_entropy", adapters=ids["r"])
        tr.optim_step(ids["r"], jcp.AdamParams(learning_rate=1e-2))
        tr.forward(other, "cross_entropy", adapters=ids["r"])
        tr.delete_adapter(tr.create_adapter(rank=2))
        k += 1
    r1 = tr.adapter_weights(ids["r"])
    assert any(not np.array_equal(r1[m], r0[m]) for m in r0)
    return k + 1


def _full_micro_batches(tr, data, adapters) -> int:
    """How many of the call's micro-batches are full length (the ones run in halves)."""
    shapes = tr.pass_shapes(data, "ppo", adapters=adapters)
    return sum(s_len == tr.max_tokens_per_device for _, s_len, _, _ in shapes)


@pytest.mark.parametrize("mesh", [REF, (1, 2, 2)])
def test_forward_in_halves_with_other_calls_between_equals_one_forward(folders, mesh):
    """forward_steps(turns=True) — each full-length micro-batch in two steps: the first
    half of the layers, then the rest and the loss (at cp = tp = 2: the hidden states
    between them sharded over dp and cp) — with another adapter's forward_backward,
    optim_step and forward, and a create and delete, run between the steps (jcp-serve's
    fair worker), gives the one forward's outputs bit for bit."""
    tr = H.trainer(mesh, max_tokens_per_device=32 // mesh[1])  # 32 tokens a micro-batch
    data = H.random_data((32, 32, 32, 1, 1), seed=5)
    other = H.random_data((20, 7), seed=6)
    assign = ("p", "q", "p", "q", "p")
    cfg = H.LOSS_CONFIGS["ppo"]
    with H.borrowed(tr):
        ids = H.load_adapters(tr, folders)
        whole = tr.forward(data, "ppo", cfg, adapters=_ids(ids, assign))
        steps = tr.forward_steps(data, "ppo", cfg, adapters=_ids(ids, assign), turns=True)
        n = _with_calls_between(tr, steps, ids, other)
        halved = steps.output
        full = _full_micro_batches(tr, data, _ids(ids, assign))
        assert full >= 2 and n == steps.passes + full  # each full-length one: two steps
    assert halved.metrics == whole.metrics
    for a, b in zip(halved.loss_fn_outputs, whole.loss_fn_outputs):
        assert a.keys() == b.keys()
        for key in a:
            np.testing.assert_array_equal(a[key], b[key])


@pytest.mark.parametrize(("spans", "mesh"), [(None, REF), (1, (1, 2, 2)), (2, (1, 2, 2))])
def test_steps_with_other_calls_between_equal_one_call(folders, spans, mesh):
    """forward_backward_steps — one micro-batch per step (in turns, each full-length one in
    2(n + 1): the forward pass of each of its n layer spans and of the head and the loss,
    then the backward pass of each, last to first; at
    cp = tp = 2, so that the residuals between turns include the ring's and tp's, and the
    hidden states between spans are sharded over dp and cp), another adapter's
    forward_backward, optim_step and forward, and a create and delete, run between them
    (jcp-serve's fair worker) — gives the one call's outputs and gradients bit for bit;
    close() before the end (in turns, after a micro-batch's first) rolls its accumulation
    back."""
    tr = H.trainer(mesh, max_tokens_per_device=32 // mesh[1])  # 32 tokens a micro-batch
    data = H.random_data((32, 32, 32, 1, 1), seed=5)
    other = H.random_data((20, 7), seed=6)
    assign = ("p", "q", "p", "q", "p")
    cfg = H.LOSS_CONFIGS["ppo"]
    turns = spans is not None
    n_spans = len(train_step.layer_bounds(tr.cfg, spans or 1)) - 1
    assert n_spans == (spans or 1)  # the model has as many layers as the spans asked for
    parts = train_step.turn_parts(tr.cfg, spans or 1)

    def run(between: bool):
        with H.borrowed(tr):
            ids = H.load_adapters(tr, folders)
            if between:
                steps = tr.forward_backward_steps(
                    data, "ppo", cfg, adapters=_ids(ids, assign), turns=turns
                )
                assert steps.passes >= 3
                n = _with_calls_between(tr, steps, ids, other)
                out = steps.output
                # In turns, each full-length micro-batch took 2(n + 1) steps.
                full = _full_micro_batches(tr, data, _ids(ids, assign))
                extra = full * (2 * parts - 1) if turns else 0
                assert parts == n_spans + 1
                assert full >= 2 and n == steps.passes + extra
            else:
                out = tr.forward_backward(data, "ppo", cfg, adapters=_ids(ids, assign))
            grads = {n: tr.gradients(ids[n]) for n in ("p", "q")}
            # An abandoned call leaves the accumulators as they were.
            steps = tr.forward_backward_steps(
                data, "ppo", cfg, adapters=_ids(ids, assign), turns=turns
            )
            steps.step()  # in turns, the first micro-batch's first span's forward only
            steps.close()
            for n in ("p", "q"):
                for k, g in tr.gradients(ids[n]).items():
                    np.testing.assert_array_equal(g, grads[n][k])
            return out, grads

    before = tr.programs.turn_spans
    tr.programs.turn_spans = spans or before
    try:
        (out_a, g_a), (out_b, g_b) = run(True), run(False)
    finally:
        tr.programs.turn_spans = before
    assert out_a.metrics == out_b.metrics
    for a, b in zip(out_a.loss_fn_outputs, out_b.loss_fn_outputs):
        assert a.keys() == b.keys()
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])
    for n in g_b:
        assert any(np.any(g != 0) for g in g_b[n].values())
        for k in g_b[n]:
            np.testing.assert_array_equal(g_a[n][k], g_b[n][k])


@pytest.mark.parametrize(
    ("model", "spans", "turns_each"),
    [("dense", 3, 8), ("dense_layers_only", 3, 8), ("hybrid", 2, 2)],
)
def test_turns_equal_one_pass(model, spans, turns_each):
    """A model of three layers in three spans (turn_spans=3): each span's forward pass, then
    the head's and the loss's, then each one's backward pass, last to first (a middle
    span's takes the hidden states in and gives their cotangent back: at cp = tp = 2,
    sharded over dp and cp), eight programs per full-length micro-batch — the whole
    pass's outputs and gradients bit for bit, on an adapter whose factors are all
    non-zero (after one optim_step), the head's among them. A hybrid model (Qwen3.5:
    Gated DeltaNet layers, on one device) runs its layers and head as one part, whatever
    turn_spans says: its forward pass, then its backward pass. An adapter of the layers
    alone (no head factors) runs the same turns."""
    dense = model.startswith("dense")
    cfg = jcp.QwenConfig.tiny(num_layers=3) if dense else jcp.QwenConfig.tiny_qwen3_5()
    # The hybrid model on one device: what it checks is that its pass runs as one part
    # (on (1, 2, 2) it compiled 42 programs, 47 s of the suite).
    mesh = (1, 2, 2) if dense else (1, 1, 1)
    tr = jcp.Trainer(
        cfg,
        jcp.make_mesh(*mesh),
        max_adapters=3,
        max_rank=4,
        attn_block=8,
        logprob_chunk=16,
        max_tokens_per_device=16 * 2 // mesh[1],
        turn_spans=spans,
    )
    targets = ("attn", "mlp") if model == "dense_layers_only" else None
    a = tr.create_adapter(rank=4, seed=1, targets=targets)
    assert any("lm_head" in k for k in tr.adapter_weights(a)) == (targets is None)
    data = H.random_data((32, 32, 5), seed=8)
    tr.forward_backward(data, "ppo", H.LOSS_CONFIGS["ppo"], adapters=a)
    tr.optim_step(a)
    assert all(np.any(w != 0) for w in tr.adapter_weights(a).values())
    b = tr.copy_adapter(a)
    steps = tr.forward_backward_steps(data, "ppo", H.LOSS_CONFIGS["ppo"], adapters=a, turns=True)
    n = 1
    while not steps.step():
        n += 1
    full = _full_micro_batches(tr, data, a)
    assert full >= 2 and n == steps.passes + full * (turns_each - 1)
    whole = tr.forward_backward(data, "ppo", H.LOSS_CONFIGS["ppo"], adapters=b)
    assert steps.output.metrics == whole.metrics
    for x, y in zip(steps.output.loss_fn_outputs, whole.loss_fn_outputs):
        for k in y:
            np.testing.assert_array_equal(x[k], y[k])
    ga, gb = tr.gradients(a), tr.gradients(b)
    assert ga.keys() == gb.keys() and all(np.any(g != 0) for g in gb.values())
    for k in gb:
        np.testing.assert_array_equal(ga[k], gb[k])


# ----------------------------------------------------------------------------------------
# 6. Refused input changes nothing


def _bad(data, i, **changes):
    """A copy of data with datum i changed: model_input=…, or a loss_fn_inputs field
    (None drops it). The caller's datums are not touched."""
    out = list(data)
    d = data[i]
    mi = changes.pop("model_input", d.model_input)
    inputs = dict(d.loss_fn_inputs)
    for k, v in changes.items():
        if v is None:
            inputs.pop(k)
        else:
            inputs[k] = v
    out[i] = jcp.Datum(model_input=mi, loss_fn_inputs=inputs)
    return out


def test_refused_input_changes_nothing(folders, data, tmp_path):
    tr = H.trainer(REF)
    V = H.CFG.vocab_size
    with H.borrowed(tr):
        ids = H.load_adapters(tr, folders)
        adapters = _ids(ids, H.ASSIGN)
        # Non-trivial state everywhere: accumulated gradients, AdamW moments, step counts.
        tr.forward_backward(data, "cross_entropy", adapters=adapters)
        tr.optim_step(ids["q"], jcp.AdamParams(learning_rate=1e-2))
        tr.forward_backward(data, "cross_entropy", adapters=adapters)
        before = H.snapshot(tr)
        assert H.max_abs(before["grads"][ids["p"]]) > 0 and before["opt"].count[ids["q"]] == 1

        w2 = np.asarray(data[2].loss_fn_inputs["weights"])
        adv3 = np.array(data[3].loss_fn_inputs["advantages"])
        adv3[5] = np.nan
        tok0 = np.array(data[0].model_input)
        tok0[7] = V
        tgt4 = np.array(data[4].loss_fn_inputs["target_tokens"])
        tgt4[1] = -1
        big_rank = H.write_peft(
            str(tmp_path / "r9"),
            H.MAX_RANK + 1,
            8.0,
            ("q_proj",),
            H.random_peft_weights(H.CFG, H.MAX_RANK + 1, ("q_proj",), 0),
        )
        free = next(g for g in range(tr.max_adapters) if g not in tr.adapters)

        cases = [
            (
                lambda: tr.forward_backward(
                    _bad(data, 2, weights=w2[:-1]), "cross_entropy", adapters=adapters
                ),
                r"datum 2\b.*weights",
            ),
            (
                lambda: tr.forward_backward(
                    _bad(data, 1, advantages=None), "ppo", adapters=adapters
                ),
                r"datum 1\b.*advantages",
            ),
            (
                lambda: tr.forward_backward(
                    _bad(data, 0, model_input=tok0), "cross_entropy", adapters=adapters
                ),
                r"datum 0\b.*model_input",
            ),
            (
                lambda: tr.forward_backward(
                    _bad(data, 4, target_tokens=tgt4), "cross_entropy", adapters=adapters
                ),
                r"datum 4\b.*target_tokens",
            ),
            (
                lambda: tr.forward_backward(
                    _bad(data, 3, advantages=adv3), "dro", adapters=adapters
                ),
                r"datum 3\b.*advantages",
            ),
            (
                lambda: tr.forward(_bad(data, 3, advantages=adv3), "dro", adapters=adapters),
                r"datum 3\b.*advantages",
            ),
            (
                lambda: tr.forward_backward(
                    _bad(
                        data,
                        5,
                        model_input=np.zeros(tr.token_cap + 1, np.int64),
                        target_tokens=np.zeros(tr.token_cap + 1),
                        weights=np.ones(tr.token_cap + 1),
                    ),
                    "cross_entropy",
                    adapters=adapters,
                ),
                r"datum 5\b.*cap",
            ),
            (lambda: tr.forward_backward(data, "kl", adapters=adapters), "loss_fn"),
            (lambda: tr.forward_backward(data, "ppo", {"beta": 0.1}, adapters=adapters), "beta"),
            (
                lambda: tr.forward_backward(
                    data, "cispo", {"clip_low_threshold": float("nan")}, adapters=adapters
                ),
                "clip_low_threshold",
            ),
            (lambda: tr.forward_backward(data, "cross_entropy", adapters=free), str(free)),
            (
                lambda: tr.forward_backward(
                    data, "cross_entropy", adapters=adapters[:2] + [free] + adapters[3:]
                ),
                rf"datum 2\b.*{free}",
            ),
            (
                lambda: tr.forward_backward(data, "cross_entropy", adapters=adapters[:-1]),
                "adapters",
            ),
            (lambda: tr.create_adapter(rank=H.MAX_RANK + 1), "max_rank"),
            (lambda: tr.create_adapter(rank=0), "rank"),
            (lambda: tr.create_adapter(rank=2, targets=["qproj"]), "qproj"),
            (lambda: tr.load_peft(big_rank), "max_rank"),
            (lambda: tr.load_peft(str(tmp_path / "missing")), "PEFT"),
            (
                lambda: tr.optim_step(ids["p"], jcp.AdamParams(learning_rate=float("nan"))),
                "learning_rate",
            ),
            (
                lambda: tr.optim_step(ids["p"], jcp.AdamParams(weight_decay=float("inf"))),
                "weight_decay",
            ),
            (
                lambda: tr.optim_step(ids["p"], jcp.AdamParams(grad_clip_norm=-1.0)),
                "grad_clip_norm",
            ),
            # eps = 0 would make 0/0 = NaN of every zero-padded entry of the slot.
            (lambda: tr.optim_step(ids["p"], jcp.AdamParams(eps=0.0)), "eps"),
            (lambda: tr.optim_step(free, jcp.AdamParams()), str(free)),
            (lambda: tr.gradients(free), str(free)),
            (lambda: tr.delete_adapter(free), str(free)),
        ]
        for call, pattern in cases:
            with pytest.raises(jcp.InputError, match=pattern):
                call()
            H.assert_same_state(before, H.snapshot(tr))

        # No free slot.
        filler = tr.create_adapter(rank=1)
        assert len(tr.adapters) == tr.max_adapters
        full = H.snapshot(tr)
        with pytest.raises(jcp.InputError, match="slots"):
            tr.create_adapter(rank=2)
        with pytest.raises(jcp.InputError, match="slots"):
            tr.load_peft(folders["p"])
        H.assert_same_state(full, H.snapshot(tr))
        tr.delete_adapter(filler)
        H.assert_same_state(before, H.snapshot(tr))


# ----------------------------------------------------------------------------------------
# 7. Slot reuse


def test_delete_frees_slot_and_new_adapter_starts_clean(folders, data):
    tr = H.trainer(REF)
    with H.borrowed(tr):
        ids = H.load_adapters(tr, folders)
        tr.forward_backward(data, "cross_entropy", adapters=_ids(ids, H.ASSIGN))
        tr.optim_step(ids["q"], jcp.AdamParams(learning_rate=1e-2))
        tr.forward_backward(data, "cross_entropy", adapters=_ids(ids, H.ASSIGN))
        q = ids["q"]
        before = H.snapshot(tr)
        assert H.max_abs(before["grads"][q]) > 0 and before["opt"].count[q] == 1

        tr.delete_adapter(q)
        assert q not in tr.adapters
        for call in (lambda: tr.adapter_weights(q), lambda: tr.gradients(q)):
            with pytest.raises(jcp.InputError):
                call()
        gone = H.snapshot(tr)
        for part in ("lora", "acc"):
            assert all(np.all(x[q] == 0) for x in jax.tree.leaves(gone[part]))
        assert all(np.all(x[q] == 0) for x in jax.tree.leaves((gone["opt"].mu, gone["opt"].nu)))
        assert gone["opt"].count[q] == 0 and gone["scale"][q] == 0

        new = tr.create_adapter(rank=3, alpha=6.0, seed=5, targets=["attn", "mlp"])
        assert new == q
        w = tr.adapter_weights(new)
        assert not any("lm_head" in k for k in w) and len(w) == 2 * 7 * H.CFG.num_layers
        for k, v in w.items():
            if ".lora_A." in k:
                bound = 1.0 / np.sqrt(v.shape[1])
                assert v.shape[0] == 3 and np.all(np.abs(v) <= bound) and np.any(v != 0), k
            else:
                assert v.shape[1] == 3 and np.all(v == 0), k
        assert all(np.all(g == 0) for g in tr.gradients(new).values())
        fresh = H.snapshot(tr)
        assert fresh["opt"].count[new] == 0 and fresh["scale"][new] == pytest.approx(2.0)
        # The other adapters did not notice.
        for a in (ids["p"], ids["r"]):
            for part in ("weights", "grads"):
                for k in before[part][a]:
                    np.testing.assert_array_equal(before[part][a][k], fresh[part][a][k])
        # A different rank than the deleted one fits the same slot; the old one is gone.
        assert tr.adapters[new].rank == 3


def test_offload_and_restore_are_bit_exact(folders, data):
    """An adapter moved to host memory and back (the server's slot cache) holds exactly what
    it held: weights, accumulated gradient, AdamW moments, step count — the whole slot
    table is bit-identical, although the slot was reused meanwhile."""
    tr = H.trainer(REF)
    with H.borrowed(tr):
        ids = H.load_adapters(tr, folders)
        tr.forward_backward(data, "cross_entropy", adapters=_ids(ids, H.ASSIGN))
        tr.optim_step(ids["q"], jcp.AdamParams(learning_rate=1e-2, weight_decay=0.1))
        tr.forward_backward(data, "cross_entropy", adapters=_ids(ids, H.ASSIGN))
        q = ids["q"]
        before = H.snapshot(tr)
        assert H.max_abs(before["grads"][q]) > 0 and before["opt"].count[q] == 1
        assert np.max(np.abs(before["opt"].mu["q_proj"]["a"][q])) > 0

        saved = tr.offload_adapter(q)
        assert q not in tr.adapters and saved.count == 1 and saved.nbytes > 0
        gone = H.snapshot(tr)
        assert all(np.all(x[q] == 0) for x in jax.tree.leaves(gone["acc"]))
        # Someone else uses the slot meanwhile, and leaves it.
        filler = tr.create_adapter(rank=8, alpha=8.0, seed=1)
        assert filler == q
        tr.forward_backward(data, "cross_entropy", adapters=filler)
        tr.optim_step(filler, jcp.AdamParams(learning_rate=1e-2))
        tr.delete_adapter(filler)

        assert tr.restore_adapter(saved, q) == q
        H.assert_same_state(before, H.snapshot(tr))

        # Into another slot, it is the same adapter there (weights, gradient, count).
        moved = tr.offload_adapter(q)
        spare = next(g for g in range(tr.max_adapters) if g not in tr.adapters and g != q)
        other = tr.restore_adapter(moved, spare)
        assert other != q
        for part, read in (("weights", tr.adapter_weights), ("grads", tr.gradients)):
            for k, v in before[part][q].items():
                np.testing.assert_array_equal(read(other)[k], v, err_msg=k)
        assert H.snapshot(tr)["opt"].count[other] == 1
        with pytest.raises(jcp.InputError, match="in use"):
            tr.restore_adapter(moved, ids["p"])
