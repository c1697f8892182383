"""benchmarks/gpu.py --smoke: every part of the prepared accelerator run (but the Pallas
MFU step: SMOKE_PARTS) works (CPU, tiny shapes, in this process) and lands in its one
table; the numbers it reports are checked for what CPU can show (kernel agreement, the
f32-copy detector, sizes that grow)."""

import os
import re
import sys

import pytest

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
)

import gpu  # noqa: E402
import multi_lora  # noqa: E402
import pass_turns  # noqa: E402

# Every part but mfu_pallas (~11 of the smoke's 30 CPU s: the 1,024-token step with the
# kernels interpreted): its Trainer with attn_impl="pallas" is
# test_pallas_attention.py::test_trainer_pallas_matches_blockwise's, and mfu.py's step and
# row are mfu_blockwise's.
SMOKE_PARTS = tuple(p for p in gpu.PARTS if p != "mfu_pallas")


def test_gpu_script_smoke(capsys):
    res = gpu.main(["--smoke", "--parts", ",".join(SMOKE_PARTS)])
    out = capsys.readouterr().out
    assert set(res) == set(SMOKE_PARTS) and "mfu_pallas" in gpu.PARTS
    assert re.search(r"pallas +not run", out)  # a part left out is named in its table
    for name, rows in res.items():
        assert isinstance(rows, list) and rows, (name, rows)
    kernels = {r["dtype"]: r for r in res["kernels"]}
    assert kernels["float32"]["out_rel_err"] < 1e-5
    assert kernels["float32"]["grad_rel_err"] < 1e-4
    assert kernels["bfloat16"]["out_rel_err"] < 3e-2
    assert all(r["finite"] for r in res["kernels"])
    short, long = res["memory"]
    assert long["tokens"] == 2 * short["tokens"] and long["temp_gib"] > short["temp_gib"]
    one, five = res["multi_lora"]  # the fused pass over 1 and 5 adapters, ratios to A = 1
    assert (one["A"], five["A"]) == (1, 5) and one["time_ratio"] == 1.0
    assert five["time_ratio"] > 0 and five["total_ratio"] > 0 and "Multi-LoRA" in out
    # XLA:CPU computes bf16 dots in f32; model.scan_layers keeps it from converting whole
    # weight stacks (the detector's positive case: test_gpu_f32_copy_detector).
    assert short["f32_copies_of_stacked_weights"] == []
    (row,) = res["mfu_blockwise"]
    assert row["attn_impl"] == "blockwise" and row["tokens_per_s"] > 0 and row["mfu"] > 0
    assert [r["batch"] for r in res["decode"]] == [1, 4]
    assert all(r["tokens"] == r["batch"] * r["new_tokens"] for r in res["decode"])
    # The roofline's bytes per step: the weights, and live K/V that grows with the batch
    # (no bandwidth on CPU, so no roofline figure).
    one, four = res["decode"]
    assert one["weights_gib"] == four["weights_gib"] > 0
    assert four["kv_gib_per_step"] == pytest.approx(4 * one["kv_gib_per_step"], rel=1e-9)
    assert one["kv_gib_per_step"] > 0
    assert one["roofline_tokens_per_s"] is None
    for title in ("Pallas vs blockwise", "MFU", "compiled memory", "Sampling decode"):
        assert title in out
    assert "error" not in out


def test_noisy_neighbour_smoke(tmp_path):
    """benchmarks/noisy_neighbour.py --smoke: a jcp-serve child process, two tenants, the
    victim timed alone and beside hostile bodies sent from the neighbour's own process
    (the drivers on a CPU of their own), in two rounds pooled; every one refused, the server
    healthy after them and stopped at the end; --json writes the run."""
    import json

    import noisy_neighbour

    cpus, out = os.sched_getaffinity(0), tmp_path / "run.json"
    res = noisy_neighbour.main(
        ["--smoke", "--neighbour", "refused", "--rounds", "2", "--json", str(out)]
    )
    # the drivers ran on this process's first CPU and every thread of the server on the
    # others, from its start (cpus_apart); this process's CPUs are back
    drivers, server = res["placed"]
    first, rest = ([min(cpus)], sorted(cpus - {min(cpus)})) if len(cpus) > 1 else ([], [])
    assert drivers == (first or sorted(cpus)) and len(server) > 1  # several server threads
    assert all(t == (rest or sorted(cpus)) for t in server), server
    assert os.sched_getaffinity(0) == cpus
    assert json.loads(out.read_text())["placed"] == res["placed"]
    assert len(res["rounds"]) == 2 and len(res["round_ratios"]) == 2
    assert len(res["idle_waits"]) == 1  # the second alone phase waited for an idle server
    for phase in ("alone", "beside"):
        each = [r[phase] for r in res["rounds"]]
        assert all(len(x) >= 5 for x in each)
        assert res[phase] == each[0] + each[1]  # pooled: every round's requests
    # (under load a 2 s smoke phase may end before the neighbour sent a body)
    assert "hostile bodies ACCEPTED" not in res["counts"], res["counts"]
    assert res["healthy"] and res["server_exit"] is not None
    assert not os.path.exists(res["state_dir"])  # its folder removed


def test_wait_idle_waits_out_a_busy_spell():
    """noisy_neighbour.wait_idle returns only after the process has been quiet for
    quiet_s s: not during a busy spell of 1.5 s, and at once-ish for one already idle."""
    import subprocess

    import noisy_neighbour

    busy = "import time\nt = time.time()\nwhile time.time() - t < 1.5: pass\ntime.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", busy])
    try:
        waited = noisy_neighbour.wait_idle(proc.pid, quiet_s=1.0, bound_s=20.0)
        assert 2.0 <= waited < 15.0, waited  # the busy spell, then a quiet second
        again = noisy_neighbour.wait_idle(proc.pid, quiet_s=1.0, bound_s=20.0)
        assert again < 2.0, again  # quiet already
    finally:
        proc.kill()
        proc.wait()


def test_gpu_f32_copy_detector():
    """unfused_shapes finds an f32 weight stack made outside a fusion (a plain lax.scan
    over bf16 stacks on XLA:CPU makes one), not one computed inside a fusion."""
    import jax
    import jax.numpy as jnp

    from jcp.model import decoder

    w = jnp.ones((3, 16, 16), jnp.bfloat16)
    body = lambda h, xs: (jnp.tanh(h @ xs[0]), None)  # noqa: E731
    plain = lambda w, h: jax.lax.scan(body, h, (w,))[0].sum()  # noqa: E731
    ours = lambda w, h: decoder.scan_layers(body, h, w, (), False)[0].sum()  # noqa: E731
    shapes = {
        n: gpu.unfused_shapes(
            jax.jit(f).lower(w, jnp.ones((4, 16), jnp.bfloat16)).compile().as_text()
        )
        for n, f in (("plain", plain), ("ours", ours))
    }
    assert "f32[3,16,16]" in shapes["plain"] and "f32[3,16,16]" not in shapes["ours"]


def test_collective_counter_classifies_and_counts_loops():
    """serve_multiprocess.collectives on a compiled shard_map over a (2, 2, 2, 1) mesh of the
    8 devices, read as 2 processes × 4 (devices 0-3, 4-7): a psum over the innermost axis
    stays within a process, one over the outermost crosses, one over the size-1 axis moves
    nothing, and a psum inside a 3-trip loop counts 3 times."""
    import jax
    import jax.numpy as jnp
    import serve_multiprocess as bench
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((2, 2, 2, 1), ("a", "b", "c", "d"))

    def body(x):
        x = jax.lax.psum(x, "c")
        x = jax.lax.psum(x * 2.0, "a")
        x = jax.lax.psum(x * 3.0, "d")
        return jax.lax.fori_loop(0, 3, lambda i, y: y * 0.5 + jax.lax.psum(y, "b"), x)

    f = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=P(("a", "b", "c")), out_specs=P(("a", "b", "c")))
    )
    x = jax.device_put(jnp.ones((8, 16), jnp.float32), NamedSharding(mesh, P(("a", "b", "c"))))
    hlo = f.lower(x).compile().as_text()
    ops = bench.collectives(hlo, lambda i: i // 4)
    got = bench.summarize(ops)
    assert {op for op, _, _ in ops} == {"all-reduce"}
    assert got["cross"] == {"count": 1, "bytes": 16 * 4}
    assert got["local"] == {"count": 1 + 3, "bytes": 4 * 16 * 4}
    assert got["trivial"]["count"] <= 1  # XLA may drop the size-1 psum
    # All 8 devices as one process: nothing crosses.
    assert bench.summarize(bench.collectives(hlo, lambda i: 0))["cross"]["count"] == 0


def test_gpu_part_stopped_at_its_limit_keeps_its_rows(tmp_path):
    """A part that runs out of time reports the rows it printed before, its log keeps its
    whole output, and the table shows those rows, the error, and parts not run."""
    import sys

    code = (
        "import sys, time; sys.path.insert(0, 'benchmarks'); import gpu; rows = gpu.Rows(); "
        "rows.append(dict(batch=1, new_tokens=4, tokens=4, seconds=0.5, tokens_per_s=8.0, "
        "first_call_s=2.0)); gpu.progress('decode: batch 64'); time.sleep(60)"
    )
    log = tmp_path / "decode.log"
    # 3 s: the child imports only the standard library (gpu.py) before its row and sleep.
    res = gpu.subprocess_json([sys.executable, "-c", code], 3, str(log))
    assert res["error"] == "timed out after 3 s"
    assert [r["batch"] for r in res["rows"]] == [1]
    assert "decode: batch 64" in log.read_text()
    out = gpu.table({"decode": res, "kernels": {"error": "exit 1: boom"}}, "test")
    decode = out[out.index("Sampling decode") :]
    assert "error: timed out after 3 s" in decode
    assert any(line.split()[:4] == ["1", "4", "—", "4"] for line in decode.splitlines())
    assert "error: exit 1: boom" in out and "not run" in out[out.index("Per-device") :]
    done = gpu.subprocess_json([sys.executable, "-c", "print('RESULT [1]')"], 30)
    assert done == [1]


def test_multi_lora_smoke(capsys):
    """benchmarks/multi_lora.py --smoke: the fused pass, sampling, the grouped products and
    lora_cpu's kernels alone at A = 1 and more, tiny shapes (the grouped products assert
    agreement with the masked dense product)."""
    res = multi_lora.main(["--smoke"])
    out = capsys.readouterr().out
    assert [r["A"] for r in res["fused"]] == [1, 4] == [r["A"] for r in res["sample"]]
    assert all(r["cpu_s"] > 0 and r["temp_mib"] > 0 for r in res["fused"])
    assert [r["A"] for r in res["kernels"]] == [1, 8]
    assert all(r["grouped (tile_rows)"] > 0 for r in res["kernels"])
    for title in ("fused forward_backward", "sample:", "lora.delta"):
        assert title in out
    # The LoRA kernels alone, beside XLA's dots, wherever the kernels build.
    assert ("cpu_ops" in res) == multi_lora.lora_cpu.available()
    if "cpu_ops" in res:
        assert [r["A"] for r in res["cpu_ops"]["kernels"]] == [1, 4]
        assert all(v > 0 for r in res["cpu_ops"]["kernels"] for v in r.values())
        assert all(v > 0 for v in res["cpu_ops"]["xla"].values()) and "XLA dots" in out


def test_pass_turns_smoke(capsys):
    """benchmarks/pass_turns.py --smoke: a micro-batch whole, in four turns (one layer span,
    then the head and the loss) and in six (two spans and the head), each turn timed, and
    the call's cost each way."""
    res = pass_turns.main(["--smoke", "--spans", "0,1,2"])
    assert {s: len(t) for s, t in res["turns"].items()} == {0: 1, 1: 4, 2: 6}
    assert all(t > 0 for turns in res["turns"].values() for t in turns)
    assert res["call"][0]["ratio"] == 1.0 and res["call"][2]["s"] > 0
    assert "spans | programs" in capsys.readouterr().out
