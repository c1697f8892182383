"""Mesh construction, the zigzag layout and its inverse, the per-datum token cap, buckets."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import jcp
from jcp import mesh as mesh_lib


def zigzag_by_hand(n, cp):
    """Independent statement of DESIGN's layout: pad to 2cp·C, chunk, rank r takes chunks
    r and 2cp−1−r."""
    c = -(-n // (2 * cp))
    padded = [i if i < n else -1 for i in range(2 * cp * c)]
    chunks = [padded[k * c : (k + 1) * c] for k in range(2 * cp)]
    return [chunks[r] + chunks[2 * cp - 1 - r] for r in range(cp)]


# ----------------------------------------------------------------------------------------
# make_mesh


@pytest.mark.parametrize("shape", [(1, 1, 1), (2, 2, 2), (1, 8, 1), (3, 1, 2), (1, 2, 4)])
def test_make_mesh_axes_and_devices(shape):
    dp, cp, tp = shape
    mesh = jcp.make_mesh(dp=dp, cp=cp, tp=tp)
    assert mesh.axis_names == ("dp", "cp", "tp") == mesh_lib.AXES
    assert dict(mesh.shape) == {"dp": dp, "cp": cp, "tp": tp}
    assert mesh.devices.size == dp * cp * tp
    assert len(set(mesh.devices.flat)) == dp * cp * tp  # no device twice


def test_make_mesh_uses_given_devices():
    devices = jax.devices()[4:]
    mesh = jcp.make_mesh(dp=2, cp=1, tp=2, devices=devices)
    assert set(mesh.devices.flat) == set(devices)


@pytest.mark.parametrize("shape", [(3, 3, 1), (1, 16, 1), (2, 2, 4), (9, 1, 1)])
def test_make_mesh_refuses_more_devices_than_exist(shape):
    dp, cp, tp = shape
    with pytest.raises(ValueError, match=f"dp={dp} cp={cp} tp={tp} needs {dp * cp * tp} devices"):
        jcp.make_mesh(dp=dp, cp=cp, tp=tp)


def test_make_mesh_refuses_too_few_given_devices():
    with pytest.raises(ValueError, match="needs 4 devices, only 2"):
        jcp.make_mesh(dp=1, cp=4, tp=1, devices=jax.devices()[:2])


@pytest.mark.parametrize(
    "kwargs,axis", [({"dp": 0}, "dp"), ({"cp": -2}, "cp"), ({"tp": 1.5}, "tp"), ({"cp": "2"}, "cp")]
)
def test_make_mesh_refuses_bad_axis_sizes(kwargs, axis):
    with pytest.raises(ValueError, match=f"mesh axis {axis} must be a positive integer"):
        jcp.make_mesh(**kwargs)


# ----------------------------------------------------------------------------------------
# zigzag_indices / unzigzag


def test_zigzag_worked_examples():
    np.testing.assert_array_equal(jcp.zigzag_indices(8, 2), [[0, 1, 6, 7], [2, 3, 4, 5]])
    np.testing.assert_array_equal(jcp.zigzag_indices(5, 2), [[0, 1, -1, -1], [2, 3, 4, -1]])
    np.testing.assert_array_equal(jcp.zigzag_indices(1, 2), [[0, -1], [-1, -1]])
    np.testing.assert_array_equal(jcp.zigzag_indices(3, 1), [[0, 1, 2, -1]])
    np.testing.assert_array_equal(
        jcp.zigzag_indices(16, 4), [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]
    )
    np.testing.assert_array_equal(jcp.zigzag_indices(3, 4), [[0, -1], [1, -1], [2, -1], [-1, -1]])


NS = list(range(1, 40)) + [63, 64, 65, 127, 1000, 1023]
CPS = [1, 2, 3, 4, 8]


@pytest.mark.parametrize("cp", CPS)
def test_zigzag_layout_properties(cp):
    for n in NS:
        idx = jcp.zigzag_indices(n, cp)
        c = -(-n // (2 * cp))
        assert idx.shape == (cp, 2 * c) and idx.dtype == np.int32
        np.testing.assert_array_equal(idx, zigzag_by_hand(n, cp))
        # every position exactly once, padding only as -1
        held = np.sort(idx[idx >= 0])
        np.testing.assert_array_equal(held, np.arange(n))
        assert (idx >= -1).all()
        assert (idx == -1).sum() == 2 * cp * c - n
        if n % (2 * cp) == 0:
            # balanced causal work: every rank attends to the same number of (q, k) pairs
            work = (idx + 1).sum(axis=1)
            assert (work == work[0]).all()


@pytest.mark.parametrize("cp", CPS)
def test_unzigzag_inverts_zigzag(cp):
    rng = np.random.default_rng(cp)
    for n in NS:
        x = rng.normal(size=(n, 3)).astype(np.float32)
        idx = jcp.zigzag_indices(n, cp)
        local = np.where((idx >= 0)[..., None], x[np.maximum(idx, 0)], np.nan)  # [cp, 2C, 3]
        np.testing.assert_array_equal(jcp.unzigzag(local, n), x)
        # also for plain vectors
        v = np.arange(n) * 10 + 7
        local_v = np.where(idx >= 0, v[np.maximum(idx, 0)], -999)
        back = jcp.unzigzag(local_v, n)
        np.testing.assert_array_equal(back, v)
        assert back.dtype == local_v.dtype


def test_unzigzag_worked_example():
    local = np.array([["a0", "a1", "p", "p"], ["a2", "a3", "a4", "p"]])
    np.testing.assert_array_equal(jcp.unzigzag(local, 5), ["a0", "a1", "a2", "a3", "a4"])


@pytest.mark.parametrize("n,cp", [(0, 2), (5, 0), (-1, 1)])
def test_zigzag_refuses_bad_sizes(n, cp):
    with pytest.raises(ValueError):
        jcp.zigzag_indices(n, cp)


# ----------------------------------------------------------------------------------------
# token cap and buckets


@pytest.mark.parametrize(
    "m,cp,tp,pad,cap",
    [
        (100, 1, 1, 1, 100),
        (101, 1, 1, 1, 100),  # made even
        (101, 4, 1, 1, 400),
        (100, 2, 3, 1, 196),  # floor(100/3)·3 = 99 -> 98 (even) -> ·2
        (100, 2, 2, 8, 192),  # p = 16: 96 -> ·2
        (7, 8, 1, 1, 48),  # 6 per rank ·8
        (15, 1, 2, 4, 8),  # p = 8: 8
        (1, 2, 1, 1, 0),  # a device of 1 token cannot hold a zigzag pair
    ],
)
def test_datum_token_cap(m, cp, tp, pad, cap):
    assert mesh_lib.datum_token_cap(m, cp, tp, pad) == cap


@pytest.mark.parametrize("cp", [1, 2, 4, 8])
def test_datum_at_the_cap_fits_one_device_stream(cp):
    for m in (16, 17, 100, 1000, 4097):
        for tp in (1, 2):
            cap = mesh_lib.datum_token_cap(m, cp, tp)
            assert cap % (2 * cp) == 0
            rows = jcp.zigzag_indices(cap, cp).shape[1]
            assert rows <= m  # the datum's rows on each rank fit in M ...
            assert rows > m - 2 * tp  # ... and little of M is left unusable


def test_bucket_length_monotone_and_covering():
    prev = 0
    seen = set()
    for n in range(1, 5000):
        b = mesh_lib.bucket_length(n)
        assert b >= n and b >= 16 and b >= prev
        if n > 16:
            assert b < 1.5 * n + 1  # at most a third of a bucket is padding
        # buckets are powers of two or 1.5 × powers of two
        assert b & (b - 1) == 0 or (b % 3 == 0 and (b // 3) & (b // 3 - 1) == 0), b
        prev = b
        seen.add(b)
    assert len(seen) < 25  # few distinct programs
    assert sorted(seen)[:6] == [16, 24, 32, 48, 64, 96]


def test_bucket_length_minimum_and_maximum():
    assert mesh_lib.bucket_length(1) == 16
    assert mesh_lib.bucket_length(3, minimum=8) == 8
    assert mesh_lib.bucket_length(9, minimum=8) == 12
    assert mesh_lib.bucket_length(13, minimum=8) == 16
    assert mesh_lib.bucket_length(100, maximum=110) == 110  # 128 clipped
    assert mesh_lib.bucket_length(100, maximum=1000) == 128
    assert mesh_lib.bucket_length(100, maximum=100) == 100
    for n in range(1, 300):
        b = mesh_lib.bucket_length(n, maximum=200)
        if n <= 200:
            assert n <= b == min(mesh_lib.bucket_length(n), 200)
        else:  # a maximum below n does not apply
            assert b == mesh_lib.bucket_length(n)


@pytest.mark.parametrize(
    "n, minimum, want",
    [(0, 1, 1), (1, 1, 1), (3, 1, 4), (4, 1, 4), (5, 1, 8), (5, 16, 16), (17, 16, 32)],
)
def test_pow2_at_least(n, minimum, want):
    assert mesh_lib.pow2_at_least(n, minimum) == want


# ----------------------------------------------------------------------------------------
# Host arrays <-> global arrays


def test_put_gives_each_device_its_slice_and_host_gather_read_back():
    mesh = jcp.make_mesh(2, 2, 2)
    x = np.arange(4 * 6, dtype=np.float32).reshape(4, 6)
    spec = jax.sharding.PartitionSpec(mesh_lib.DP, mesh_lib.TP)
    g = mesh_lib.put(mesh, x, spec, dtype=np.int32)
    assert g.shape == (4, 6) and g.dtype == np.int32
    for shard in g.addressable_shards:  # each device holds exactly its own block
        assert shard.data.shape == (2, 3)
        np.testing.assert_array_equal(np.asarray(shard.data), x[shard.index].astype(np.int32))
    np.testing.assert_array_equal(mesh_lib.gather(g), x.astype(np.int32))

    r = mesh_lib.replicate(mesh, x)
    assert all(s.data.shape == (4, 6) for s in r.addressable_shards)
    np.testing.assert_array_equal(mesh_lib.host(r), x)
    assert len({s.device for s in r.addressable_shards}) == 8


@pytest.mark.parametrize("tp", [2, 1])
def test_psum_flat_sums_as_psum_does_in_one_all_reduce_per_group(tp):
    """psum_flat = jax.lax.psum leaf for leaf (values, shapes, dtypes, varying axes), and
    the compiled program's all-reduces carry one operand per (dtype, varying axes) group,
    where psum's carry one per leaf (XLA:CPU runs each operand of a combined all-reduce on
    its own: over gloo, one ring of TCP hops each); with tp = 1, varying over tp or not
    makes no group of its own (its all-reduces over one device are not counted)."""
    import re

    from jax.sharding import PartitionSpec as P

    mesh = jcp.make_mesh(dp=2, cp=4 // tp, tp=tp)
    rng = np.random.default_rng(0)
    tree = {
        "a1": rng.normal(size=(8, 3)).astype(np.float32),
        "a2": rng.normal(size=(8, 2, 5)).astype(np.float32),
        "b": rng.normal(size=(8 // tp, 7)).astype(np.float32),
        "c": np.arange(8 * 6, dtype=np.int32).reshape(8, 6),
    }
    every, batch = P(("dp", "cp", "tp")), P(("dp", "cp"))
    spec = {"a1": every, "a2": every, "b": batch, "c": every}
    out = {"a1": P("tp"), "a2": P("tp"), "b": P(), "c": P("tp")}

    def run(fn):
        f = jax.jit(
            jax.shard_map(lambda t: fn(t, ("dp", "cp")), mesh=mesh, in_specs=(spec,), out_specs=out)
        )
        hlo = f.lower(tree).compile().as_text()
        operands = [
            m[0].count("%")
            for m in re.findall(
                r" all-reduce(?:-start)?\(([^)]*)\).*replica_groups=(\{[{}\d,]*\})", hlo
            )
            if re.search(r"\d,\d", m[1])
        ]  # groups of more than one device
        return f(tree), operands

    want, plain = run(jax.lax.psum)
    got, flat = run(mesh_lib.psum_flat)
    for k in tree:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape
        assert got[k].sharding.spec == want[k].sharding.spec, k
        np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), rtol=1e-6, err_msg=k)
    assert min(np.abs(np.asarray(want[k])).max() for k in tree) > 0
    # Groups: a1 + a2 (float32, varying over tp too), b (float32), c (int32); with tp = 1,
    # a1 + a2 + b.
    assert sum(plain) == 4 and sum(flat) == (3 if tp > 1 else 2), (plain, flat)
