"""benchmarks/gpu.py --smoke: every part of the prepared accelerator run works (CPU, tiny
shapes, in this process) and lands in its one table; the numbers it reports are checked
for what CPU can show (kernel agreement, the f32-copy detector, sizes that grow)."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))

import gpu  # noqa: E402


def test_gpu_script_smoke(capsys):
    res = gpu.main(["--smoke"])
    out = capsys.readouterr().out
    assert set(res) == set(gpu.PARTS)
    for name, rows in res.items():
        assert isinstance(rows, list) and rows, (name, rows)
    kernels = {r["dtype"]: r for r in res["kernels"]}
    assert kernels["float32"]["out_rel_err"] < 1e-5
    assert kernels["float32"]["grad_rel_err"] < 1e-4
    assert kernels["bfloat16"]["out_rel_err"] < 3e-2
    assert all(r["finite"] for r in res["kernels"])
    short, long = res["memory"]
    assert long["tokens"] == 2 * short["tokens"] and long["temp_gib"] > short["temp_gib"]
    # XLA:CPU computes bf16 dots in f32, so the CPU program holds f32 weight copies: the
    # detector the GPU run reports with must find them here.
    assert short["f32_copies_of_stacked_weights"]
    for impl in ("pallas", "blockwise"):
        (row,) = res[f"mfu_{impl}"]
        assert row["attn_impl"] == impl and row["tokens_per_s"] > 0 and row["mfu"] > 0
    assert [r["batch"] for r in res["decode"]] == [1, 4]
    assert all(r["tokens"] == r["batch"] * r["new_tokens"] for r in res["decode"])
    for title in ("Pallas vs blockwise", "MFU", "compiled memory", "Sampling decode"):
        assert title in out
    assert "error" not in out
