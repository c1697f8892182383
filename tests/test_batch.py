"""Validation of client datums and loss_fn_config, and packing into [DP, CP, S] streams."""

from __future__ import annotations

import copy
import re

import numpy as np
import pytest

import jcp
from jcp import batch as batch_lib
from jcp import losses
from jcp import mesh as mesh_lib

V = 64
CAP = 40


FIELDS = ("weights", "advantages", "logprobs", "sequence_ratio_mask")


def make_datum(rng, n, fields=FIELDS):
    inputs = {"target_tokens": rng.integers(0, V, n)}
    for f in fields:
        inputs[f] = rng.normal(size=n) if f != "logprobs" else -rng.uniform(0.1, 4, n)
    return jcp.Datum(model_input=rng.integers(0, V, n), loss_fn_inputs=inputs)


def make_data(lengths=(3, 7, 5, 2), seed=0, fields=FIELDS):
    rng = np.random.default_rng(seed)
    return [make_datum(rng, n, fields) for n in lengths]


def snapshot(data):
    return copy.deepcopy([(d.model_input, d.loss_fn_inputs) for d in data])


def same(a, b) -> bool:
    """Exact equality of nested client values: same types, dtypes and contents."""
    if type(a) is not type(b):
        return False
    if isinstance(a, np.ndarray):
        return (
            a.dtype == b.dtype
            and a.shape == b.shape
            and bool(np.all((a == b) | ((a != a) & (b != b))))
        )  # NaN where NaN was
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b or (a != a and b != b)


def assert_same_as(data, snap):
    assert len(data) == len(snap)
    for i, (d, (mi, inputs)) in enumerate(zip(data, snap)):
        assert same(d.model_input, mi), f"datum {i} model_input changed"
        assert same(d.loss_fn_inputs, inputs), f"datum {i} loss_fn_inputs changed"


# ----------------------------------------------------------------------------------------
# Validation: accepted input


def test_validate_returns_private_typed_copies():
    data = make_data()
    # already the internal dtypes: a lazy implementation could hand these back uncopied
    data[0].model_input = data[0].model_input.astype(np.int32)
    data[0].loss_fn_inputs = {
        k: v.astype(np.int32 if k == "target_tokens" else np.float32)
        for k, v in data[0].loss_fn_inputs.items()
    }
    snap = snapshot(data)
    checked = batch_lib.validate(data, "dro", V, CAP)
    assert len(checked) == len(data)
    for d, c in zip(data, checked):
        assert c.n == len(d.model_input)
        assert c.tokens.dtype == c.targets.dtype == np.int32
        np.testing.assert_array_equal(c.tokens, d.model_input)
        np.testing.assert_array_equal(c.targets, d.loss_fn_inputs["target_tokens"])
        assert sorted(c.floats) == ["advantages", "logprobs", "sequence_ratio_mask", "weights"]
        for k, v in c.floats.items():
            assert v.dtype == np.float32
            np.testing.assert_array_equal(v, np.float32(d.loss_fn_inputs[k]))
            assert not np.shares_memory(v, d.loss_fn_inputs[k])
        assert not np.shares_memory(c.tokens, d.model_input)
        assert not np.shares_memory(c.targets, d.loss_fn_inputs["target_tokens"])
        # scribbling on the private copy leaves the caller's arrays alone
        c.tokens[:] = 0
        c.targets[:] = 0
        for v in c.floats.values():
            v[:] = 123.0
    assert_same_as(data, snap)


def test_validate_accepts_lists_and_int32_and_integral_floats():
    d = jcp.Datum(
        model_input=[1.0, 2.0, 63.0],
        loss_fn_inputs={"target_tokens": np.array([0, 5, 9], np.int32), "weights": [1, 0, 2]},
    )
    (c,) = batch_lib.validate([d], "cross_entropy", V, CAP)
    np.testing.assert_array_equal(c.tokens, [1, 2, 63])
    np.testing.assert_array_equal(c.floats["weights"], [1.0, 0.0, 2.0])
    assert d.model_input == [1.0, 2.0, 63.0]


def test_validate_accepts_datum_exactly_at_the_cap():
    data = make_data(lengths=(CAP, 1))
    assert [c.n for c in batch_lib.validate(data, "ppo", V, CAP)] == [CAP, 1]


def test_datum_from_json_tinker_chunks():
    d = jcp.Datum.from_json(
        {
            "model_input": {"chunks": [{"tokens": [1, 2]}, {"tokens": [3]}]},
            "loss_fn_inputs": {"target_tokens": [2, 3, 4], "weights": [0, 1, 1]},
        }
    )
    (c,) = batch_lib.validate([d], "cross_entropy", V, CAP)
    np.testing.assert_array_equal(c.tokens, [1, 2, 3])


# ----------------------------------------------------------------------------------------
# Validation: every refusal names the datum and the field, and mutates nothing


def _set(field, value):
    def edit(d):
        if field == "model_input":
            d.model_input = value(d) if callable(value) else value
        else:
            d.loss_fn_inputs[field] = value(d) if callable(value) else value

    return edit


def _drop(field):
    def edit(d):
        del d.loss_fn_inputs[field]

    return edit


def _poke(field, j, value):
    def edit(d):
        arr = np.array(d.model_input if field == "model_input" else d.loss_fn_inputs[field])
        arr = arr.astype(np.result_type(arr, np.asarray(value)))
        arr[j] = value
        _set(field, arr)(d)

    return edit


def _resize_all(n):
    """Every vector of the datum cut or repeated to n entries (consistent lengths)."""

    def edit(d):
        d.model_input = np.resize(np.asarray(d.model_input), n)
        for k, v in list(d.loss_fn_inputs.items()):
            d.loss_fn_inputs[k] = np.resize(np.asarray(v), n)

    return edit


N_BAD = 7  # length of the offending datum
TARGETS = r"loss_fn_inputs\.target_tokens"
INT_IDS = r"model_input must hold integer token ids"
BAD_INPUTS = {
    # lengths and ranks
    "short target_tokens": (
        "ppo",
        _set("target_tokens", lambda d: d.loss_fn_inputs["target_tokens"][:-1]),
        TARGETS + r" has length 6, model_input has length 7",
    ),
    "long weights": (
        "cross_entropy",
        _set("weights", np.ones(N_BAD + 1)),
        r"loss_fn_inputs\.weights has length 8, model_input has length 7",
    ),
    "short advantages": (
        "ppo",
        _set("advantages", np.ones(3)),
        r"loss_fn_inputs\.advantages has length 3",
    ),
    "short logprobs": ("dro", _set("logprobs", [-1.0]), r"loss_fn_inputs\.logprobs has length 1"),
    "scalar weights": (
        "cross_entropy",
        _set("weights", 1.0),
        r"loss_fn_inputs\.weights must be 1-D",
    ),
    "2-D advantages": (
        "cispo",
        _set("advantages", np.ones((N_BAD, 1))),
        r"loss_fn_inputs\.advantages must be 1-D",
    ),
    "2-D model_input": (
        "ppo",
        _set("model_input", np.ones((N_BAD, 1), int)),
        r"model_input must be 1-D",
    ),
    "ragged model_input": (
        "ppo",
        _set("model_input", [[1, 2], [3]]),
        r"model_input is not a vector of token ids",
    ),
    # missing keys for the chosen loss
    "missing weights": (
        "cross_entropy",
        _drop("weights"),
        r"loss_fn_inputs\.weights is missing \(needed by cross_entropy\)",
    ),
    "missing advantages": (
        "ppo",
        _drop("advantages"),
        r"loss_fn_inputs\.advantages is missing \(needed by ppo\)",
    ),
    "missing logprobs": (
        "importance_sampling",
        _drop("logprobs"),
        r"loss_fn_inputs\.logprobs is missing \(needed by importance_sampling\)",
    ),
    "missing logprobs dro": ("dro", _drop("logprobs"), r"loss_fn_inputs\.logprobs is missing"),
    "missing target_tokens": ("cispo", _drop("target_tokens"), TARGETS + " is missing"),
    "missing sequence_ratio_mask": (
        "gspo",
        _drop("sequence_ratio_mask"),
        r"loss_fn_inputs\.sequence_ratio_mask is missing \(needed "
        r"by gspo\)",
    ),
    "missing advantages gspo": (
        "gspo",
        _drop("advantages"),
        r"loss_fn_inputs\.advantages is missing \(needed by gspo\)",
    ),
    "short sequence_ratio_mask": (
        "gspo",
        _set("sequence_ratio_mask", np.ones(N_BAD - 2)),
        r"loss_fn_inputs\.sequence_ratio_mask has length 5, "
        r"model_input has length 7",
    ),
    "2-D sequence_ratio_mask": (
        "gspo",
        _set("sequence_ratio_mask", np.ones((N_BAD, 1))),
        r"loss_fn_inputs\.sequence_ratio_mask must be 1-D",
    ),
    "NaN sequence_ratio_mask": (
        "gspo",
        _poke("sequence_ratio_mask", 3, np.nan),
        r"loss_fn_inputs\.sequence_ratio_mask\[3\] = nan is not finite",
    ),
    "sequence_ratio_mask over float32": (
        "gspo",
        _poke("sequence_ratio_mask", 4, 1e39),
        r"loss_fn_inputs\.sequence_ratio_mask\[4\] = 1e\+39 "
        r"overflows float32",
    ),
    "string sequence_ratio_mask": (
        "gspo",
        _set("sequence_ratio_mask", ["x"] * N_BAD),
        r"loss_fn_inputs\.sequence_ratio_mask is not a vector of "
        r"numbers",
    ),
    # token ids
    "token = vocab": (
        "ppo",
        _poke("model_input", 3, V),
        r"model_input\[3\] = 64 is outside the vocabulary \[0, 64\)",
    ),
    "negative token": ("ppo", _poke("model_input", 0, -1), r"model_input\[0\] = -1 is outside"),
    "target = vocab": (
        "cross_entropy",
        _poke("target_tokens", 6, V + 5),
        TARGETS + r"\[6\] = 69 is outside the vocabulary",
    ),
    "negative target": ("dro", _poke("target_tokens", 2, -3), TARGETS + r"\[2\] = -3"),
    "fractional token": ("ppo", _poke("model_input", 1, 2.5), INT_IDS),
    "NaN token": ("ppo", _poke("model_input", 1, np.nan), INT_IDS),
    "string tokens": ("ppo", _set("model_input", ["a"] * N_BAD), INT_IDS),
    "bool tokens": ("ppo", _set("model_input", [True] * N_BAD), INT_IDS),
    "fractional target": (
        "ppo",
        _poke("target_tokens", 4, 0.5),
        TARGETS + " must hold integer token ids",
    ),
    # non-finite floats
    "NaN weight": (
        "cross_entropy",
        _poke("weights", 1, np.nan),
        r"loss_fn_inputs\.weights\[1\] = nan is not finite",
    ),
    "Inf advantage": (
        "ppo",
        _poke("advantages", 5, np.inf),
        r"loss_fn_inputs\.advantages\[5\] = inf is not finite",
    ),
    "-Inf logprob": (
        "cispo",
        _poke("logprobs", 0, -np.inf),
        r"loss_fn_inputs\.logprobs\[0\] = -inf is not finite",
    ),
    "NaN in an unused field": (
        "ppo",
        _poke("weights", 2, np.nan),
        r"loss_fn_inputs\.weights\[2\] = nan is not finite",
    ),
    "non-numeric weights": (
        "cross_entropy",
        _set("weights", ["x"] * N_BAD),
        r"loss_fn_inputs\.weights is not a vector of numbers",
    ),
    # empty, over the cap
    "empty datum": ("ppo", _resize_all(0), r"model_input is empty"),
    "over the cap": (
        "ppo",
        _resize_all(CAP + 1),
        rf"model_input has {CAP + 1} tokens, over the cap of {CAP} tokens",
    ),
    # unknown keys, wrong containers
    "unknown field": (
        "ppo",
        _set("mask", np.ones(N_BAD)),
        r"loss_fn_inputs\.mask is not a known field",
    ),
    "inputs not a dict": (
        "ppo",
        lambda d: setattr(d, "loss_fn_inputs", [1, 2]),
        r"loss_fn_inputs must be a dict",
    ),
}


@pytest.mark.parametrize("label", sorted(BAD_INPUTS))
def test_validation_names_datum_and_field(label):
    loss_fn, edit, pattern = BAD_INPUTS[label]
    data = make_data(lengths=(3, 9, N_BAD, 5), seed=1)
    batch_lib.validate(data, loss_fn, V, CAP)  # the unedited batch is valid
    edit(data[2])
    snap = snapshot(data)
    with pytest.raises(jcp.InputError) as err:
        batch_lib.validate(data, loss_fn, V, CAP)
    msg = str(err.value)
    assert msg.startswith("datum 2: "), msg
    assert re.search(pattern, msg), msg
    assert isinstance(err.value, ValueError)
    assert_same_as(data, snap)


def test_validation_reports_the_first_bad_datum():
    data = make_data(lengths=(3, 4, 5, 6))
    data[1].loss_fn_inputs["weights"] = data[1].loss_fn_inputs["weights"][:2]
    data[3].loss_fn_inputs["weights"] = data[3].loss_fn_inputs["weights"][:2]
    with pytest.raises(jcp.InputError, match=r"^datum 1: loss_fn_inputs\.weights has length 2"):
        batch_lib.validate(data, "cross_entropy", V, CAP)


def test_validation_refuses_non_datum_entries():
    data = make_data()
    data[2] = {"model_input": [1], "loss_fn_inputs": {}}
    with pytest.raises(jcp.InputError, match=r"^datum 2: expected jcp\.Datum, got dict"):
        batch_lib.validate(data, "ppo", V, CAP)


@pytest.mark.parametrize(
    "data,pattern",
    [
        ([], "data is empty"),
        (None, "data must be a list of Datum"),
        ("abc", "datum 0: expected jcp.Datum, got str"),
    ],
)
def test_validation_refuses_bad_containers(data, pattern):
    with pytest.raises(jcp.InputError, match=pattern):
        batch_lib.validate(data, "ppo", V, CAP)


def test_validation_refuses_a_lone_datum():
    with pytest.raises(jcp.InputError, match="data must be a list of Datum"):
        batch_lib.validate(make_data()[0], "ppo", V, CAP)


@pytest.mark.parametrize("loss_fn", ["grpo", "PPO", "", "cross-entropy"])
def test_unknown_loss_names(loss_fn):
    data = make_data()
    snap = snapshot(data)
    with pytest.raises(jcp.InputError, match=re.escape(f"unknown loss_fn {loss_fn!r}")):
        batch_lib.validate(data, loss_fn, V, CAP)
    with pytest.raises(jcp.InputError, match="unknown loss_fn"):
        losses.resolve_config(loss_fn, None)
    assert_same_as(data, snap)


# ----------------------------------------------------------------------------------------
# loss_fn_config


def test_resolve_config_defaults_and_overrides():
    assert losses.resolve_config("ppo", None) == {
        "clip_low_threshold": 0.8,
        "clip_high_threshold": 1.2,
    }
    assert losses.resolve_config("cispo", {}) == {
        "clip_low_threshold": 0.0,
        "clip_high_threshold": 4.0,
    }
    assert losses.resolve_config("dro", None) == {"beta": 0.05}
    assert losses.resolve_config("gspo", None) == {
        "clip_low_threshold": 0.8,
        "clip_high_threshold": 1.2,
    }
    assert losses.resolve_config("cross_entropy", None) == {}
    assert losses.resolve_config("importance_sampling", None) == {}
    user = {"clip_high_threshold": 2}
    got = losses.resolve_config("ppo", user)
    assert got == {"clip_low_threshold": 0.8, "clip_high_threshold": 2.0}
    assert isinstance(got["clip_high_threshold"], float)
    assert user == {"clip_high_threshold": 2}  # the caller's dict is not touched
    assert losses.resolve_config("dro", {"beta": "0.5"}) == {"beta": 0.5}
    # defaults are not shared state
    got["clip_low_threshold"] = 0.0
    assert losses.resolve_config("ppo", None)["clip_low_threshold"] == 0.8


@pytest.mark.parametrize(
    "loss_fn,config,pattern",
    [
        ("ppo", {"clip_ratio": 0.2}, r"loss_fn_config\.clip_ratio is not a setting of ppo"),
        ("cross_entropy", {"beta": 0.1}, r"loss_fn_config\.beta is not a setting of cross_entropy"),
        (
            "importance_sampling",
            {"clip_low_threshold": 0.5},
            r"loss_fn_config\.clip_low_threshold is not a setting of importance_sampling",
        ),
        (
            "dro",
            {"clip_high_threshold": 2.0},
            r"loss_fn_config\.clip_high_threshold is not a setting",
        ),
        ("dro", {"beta": "big"}, r"loss_fn_config\.beta must be a number, got 'big'"),
        (
            "ppo",
            {"clip_low_threshold": None},
            r"loss_fn_config\.clip_low_threshold must be a number",
        ),
        (
            "ppo",
            {"clip_high_threshold": [1.2]},
            r"loss_fn_config\.clip_high_threshold must be a number",
        ),
        (
            "cispo",
            {"clip_high_threshold": float("nan")},
            r"loss_fn_config\.clip_high_threshold must be finite",
        ),
        ("dro", {"beta": float("inf")}, r"loss_fn_config\.beta must be finite"),
        (
            "ppo",
            {"clip_low_threshold": 1.5},
            r"clip_low_threshold 1\.5 exceeds clip_high_threshold 1\.2",
        ),
        (
            "cispo",
            {"clip_low_threshold": 3.0, "clip_high_threshold": 2.0},
            r"clip_low_threshold 3\.0 exceeds clip_high_threshold 2\.0",
        ),
        ("dro", {"beta": -0.1}, r"loss_fn_config\.beta must be ≥ 0"),
        ("gspo", {"beta": 0.1}, r"loss_fn_config\.beta is not a setting of gspo"),
        (
            "gspo",
            {"clip_low_threshold": 2.0},
            r"clip_low_threshold 2\.0 exceeds clip_high_threshold 1\.2",
        ),
    ],
)
def test_bad_loss_fn_config(loss_fn, config, pattern):
    before = copy.deepcopy(config)
    with pytest.raises(jcp.InputError, match=pattern):
        losses.resolve_config(loss_fn, config)
    assert repr(config) == repr(before)


# ----------------------------------------------------------------------------------------
# Packing


def checked(lengths, seed=0):
    return batch_lib.validate(make_data(lengths, seed), "dro", V, 10**6)


def rows_of(n, cp):
    return 2 * (-(-n // (2 * cp)))


def shard_contents(pb):
    """{shard: placements sorted by offset}."""
    out = {}
    for p in pb.placements:
        out.setdefault(p.shard, []).append(p)
    return {s: sorted(ps, key=lambda p: p.offset) for s, ps in out.items()}


LENGTHS = (30, 2, 7, 19, 11, 5, 3, 23, 1, 13, 40, 9)
ADAPTERS = (2, 0, 1, 2, 0, 3, 1, 1, 2, 0, 3, 2)


@pytest.mark.parametrize("dp,cp", [(1, 1), (2, 1), (3, 2), (2, 4), (4, 2), (1, 8)])
def test_pack_layout(dp, cp):
    datums = checked(LENGTHS)
    before = copy.deepcopy(datums)
    (pb,) = batch_lib.pack(datums, ADAPTERS, dp, cp, max_rows=4096, max_adapters=8)
    s_len = pb.tokens.shape[-1]
    assert (
        pb.tokens.shape
        == pb.targets.shape
        == pb.segment.shape
        == pb.position.shape
        == (dp, cp, s_len)
    )
    assert all(v.shape == (dp, cp, s_len) for v in pb.floats.values())

    # every datum exactly once, with its zigzag row count
    assert sorted(p.index for p in pb.placements) == list(range(len(LENGTHS)))
    for p in pb.placements:
        assert p.n == LENGTHS[p.index] and p.rows == rows_of(p.n, cp)

    # balanced over dp: greedy longest-first keeps shards within one datum of each other
    loads = [sum(p.rows for p in pb.placements if p.shard == s) for s in range(dp)]
    assert max(loads) - min(loads) <= max(rows_of(n, cp) for n in LENGTHS)
    if dp > 1:
        assert min(loads) > 0
    assert s_len == mesh_lib.bucket_length(max(loads), maximum=4096)

    # within a shard: contiguous, sorted by adapter (then caller's order)
    slots = set()
    for s, ps in shard_contents(pb).items():
        off = 0
        for p in ps:
            assert p.offset == off
            off += p.rows
        keys = [(ADAPTERS[p.index], p.index) for p in ps]
        assert keys == sorted(keys)
        # beyond the last datum: padding only
        assert (pb.segment[s, :, off:] == -1).all() and (pb.tokens[s, :, off:] == 0).all()

    # active adapters and their spans
    distinct = sorted(set(ADAPTERS))
    k = len(pb.active)
    assert k == batch_lib.active_bucket(len(distinct), 8)
    assert list(pb.active[: len(distinct)]) == distinct
    assert pb.spans.shape == (dp, cp, k, 2)
    for s in range(dp):
        ps = shard_contents(pb).get(s, [])
        for a_i in range(k):
            a = int(pb.active[a_i])
            mine = [p for p in ps if ADAPTERS[p.index] == a]
            start, end = pb.spans[s, 0, a_i]
            if a_i >= len(distinct) or not mine:
                assert start == end  # an empty span
            else:
                assert (start, end) == (mine[0].offset, mine[-1].offset + mine[-1].rows)
            assert (pb.spans[s, :, a_i] == pb.spans[s, 0, a_i]).all()  # same on every cp rank

    # stream contents, reassembled per datum
    for name, want in [
        ("tokens", lambda c: c.tokens),
        ("targets", lambda c: c.targets),
        ("position", lambda c: np.arange(c.n)),
    ]:
        got = batch_lib.unpack(getattr(pb, name), pb)
        for i, c in enumerate(datums):
            np.testing.assert_array_equal(got[i], want(c), err_msg=f"{name} datum {i}")
    for f in batch_lib.FLOAT_FIELDS:
        got = batch_lib.unpack(pb.floats[f], pb)
        for i, c in enumerate(datums):
            np.testing.assert_array_equal(got[i], c.floats[f])
    # segments: one distinct slot per datum, -1 exactly on rows that hold no token
    for p in pb.placements:
        idx = jcp.zigzag_indices(p.n, cp)
        seg = pb.segment[p.shard, :, p.offset : p.offset + p.rows]
        np.testing.assert_array_equal(seg < 0, idx < 0)
        slot = np.unique(seg[seg >= 0])
        assert slot.size == 1 and 0 <= slot[0] < pb.num_slots
        slots.add(int(slot[0]))
        np.testing.assert_array_equal(
            pb.position[p.shard, :, p.offset : p.offset + p.rows], np.maximum(idx, 0)
        )
    assert len(slots) == len(LENGTHS)
    assert pb.num_slots == mesh_lib.bucket_length(len(LENGTHS), minimum=8)
    pad = pb.segment < 0
    assert (pb.tokens[pad] == 0).all() and (pb.targets[pad] == 0).all()
    assert all((v[pad] == 0).all() for v in pb.floats.values())

    # the validated datums are untouched
    for a, b in zip(datums, before):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_array_equal(a.targets, b.targets)
        for f in a.floats:
            np.testing.assert_array_equal(a.floats[f], b.floats[f])


def test_pack_one_tiny_datum_leaves_shards_empty():
    (pb,) = batch_lib.pack(checked([1]), [0], dp=2, cp=2, max_rows=64, max_adapters=4)
    (p,) = pb.placements
    empty = (pb.segment < 0).all(axis=-1)
    assert empty.sum() == 3 and not empty[p.shard, 0]
    assert (pb.spans[1 - p.shard] == 0).all()


def test_pack_splits_into_micro_batches_over_max_rows():
    lengths = [32] * 6 + [3]  # cp = 2: 16 rows each, then 4 rows
    datums = checked(lengths)
    batches = batch_lib.pack(datums, [0] * len(lengths), dp=2, cp=2, max_rows=32, max_adapters=4)
    assert len(batches) == 2  # 6·16 + 4 rows over 2 shards × 32 rows needs two passes
    seen = []
    for pb in batches:
        assert pb.tokens.shape[-1] <= 32
        for s in range(2):
            load = sum(p.rows for p in pb.placements if p.shard == s)
            assert load <= 32
        seen += [p.index for p in pb.placements]
        # slots are per micro-batch
        got = batch_lib.unpack(pb.tokens, pb)
        for i, v in got.items():
            np.testing.assert_array_equal(v, datums[i].tokens)
    assert sorted(seen) == list(range(len(lengths)))


def test_pack_one_batch_when_it_fits():
    batches = batch_lib.pack(checked([32] * 4), [0] * 4, dp=2, cp=2, max_rows=32, max_adapters=4)
    assert len(batches) == 1 and batches[0].tokens.shape == (2, 2, 32)


def test_active_bucket():
    assert [batch_lib.active_bucket(k, 8) for k in range(1, 9)] == [1, 2, 4, 4, 8, 8, 8, 8]
    assert batch_lib.active_bucket(3, 3) == 3
    assert batch_lib.active_bucket(5, 6) == 6


def test_unpack_inverts_the_layout_of_any_stream():
    datums = checked([5, 12, 1, 8])
    (pb,) = batch_lib.pack(datums, [1, 0, 1, 0], dp=2, cp=4, max_rows=256, max_adapters=2)
    # a per-token value that encodes (datum slot, position) survives the round trip
    stream = np.where(pb.segment >= 0, pb.segment * 1000 + pb.position, -1)
    got = batch_lib.unpack(stream, pb)
    for p in pb.placements:
        slot = pb.segment[p.shard, 0, p.offset]
        np.testing.assert_array_equal(got[p.index], slot * 1000 + np.arange(p.n))


def test_pad_streams_pads_every_stream_loss_id_included():
    data = [
        jcp.Datum(
            model_input=[1, 2, 3, 4, 5],
            loss_fn_inputs={"target_tokens": [2, 3, 4, 5, 6], "weights": [1.0] * 5},
        )
    ]
    checked = batch_lib.validate(data, "cross_entropy", 64, 10**6)
    (pb,) = batch_lib.pack(checked, [0], 1, 2, 64, 1)
    s_len = pb.tokens.shape[-1]
    out = batch_lib.pad_streams(pb, s_len + 3)
    assert out is not pb and batch_lib.pad_streams(pb, s_len) is pb
    for name in ("tokens", "targets", "segment", "position", "loss_id"):
        old, new = getattr(pb, name), getattr(out, name)
        assert new.shape == old.shape[:-1] + (s_len + 3,), name
        np.testing.assert_array_equal(new[..., :s_len], old)
        assert (new[..., s_len:] == (-1 if name == "segment" else 0)).all(), name
    for k, v in pb.floats.items():
        np.testing.assert_array_equal(out.floats[k][..., :s_len], v)
        assert (out.floats[k][..., s_len:] == 0).all()
    with pytest.raises(ValueError, match="cannot pad"):
        batch_lib.pad_streams(pb, s_len - 1)


def test_floors_make_the_counts_follow_the_stream_length():
    """With the Trainer's floors (adapter_rows, slot_tokens), a micro-batch's active-entry
    and datum-slot counts depend on its stream length only: 8 datums of one adapter and 2 ×
    4 datums of two pack to the same shapes (without floors they differ); more adapters or
    datums than the length's floors take the next bucket."""
    cap = 4096
    data = batch_lib.validate(
        [
            jcp.Datum(
                np.zeros(256, np.int32),
                {"target_tokens": np.zeros(256, np.int32), "weights": np.ones(256, np.float32)},
            )
        ]
        * 8,
        "cross_entropy",
        512,
        cap,
    )
    floors = dict(adapter_rows=batch_lib.ADAPTER_ROWS, slot_tokens=batch_lib.SLOT_TOKENS)

    def shapes(adapters, **kw):
        (pb,) = batch_lib.pack(data, adapters, 2, 2, cap, 8, **kw)
        return pb.tokens.shape, len(pb.active), pb.num_slots

    one, two = [0] * 8, [0] * 4 + [1] * 4
    assert shapes(one) != shapes(two)  # without floors: 1 vs 2 active entries
    assert shapes(one, **floors) == shapes(two, **floors) == ((2, 2, 512), 2, 16)
    assert batch_lib.static_counts(1024, 2, 2, 1, 1, 8, **floors) == (4, 32)
    assert batch_lib.static_counts(1024, 2, 2, 5, 40, 8, **floors) == (8, 48)
    # A length between powers of two: 3 adapters in 768 rows meet the warm-up's program
    # (jcp-serve's first fused pass of 3 tenants compiled one more before the floor was a
    # power of two at least S / adapter_rows).
    assert [batch_lib.static_counts(768, 2, 2, k, 1, 8, **floors)[0] for k in (1, 3, 4)] == [4] * 3


def test_datum_slots_ascend_along_every_stream():
    """Segment ids are numbered in stream order (a stream is sorted by adapter, not by the
    caller's index), so they ascend along every [S] stream — what attention's block
    skipping by segment range needs — and slot_datums names each slot's datum."""
    lengths = [9, 14, 5, 20, 7, 11, 3, 16]
    adapters = [3, 1, 2, 1, 0, 3, 2, 0]  # not in the callers' order
    (pb,) = batch_lib.pack(checked(lengths), adapters, dp=2, cp=2, max_rows=256, max_adapters=4)
    for stream in pb.segment.reshape(-1, pb.segment.shape[-1]):
        real = stream[stream >= 0]
        assert real.size and (np.diff(real) >= 0).all(), stream
    assert sorted(pb.slot_datums) == list(range(len(lengths)))
    for b, j in enumerate(pb.slot_datums):
        p = pb.placements[b]
        assert p.index == j and (pb.segment[p.shard, :, p.offset : p.offset + p.rows] == b).any()
    # The streams run by adapter: datum order differs from the callers'.
    assert list(pb.slot_datums) != sorted(pb.slot_datums)
