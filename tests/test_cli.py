"""jcp-train: resume continues exactly, bad options are one-line errors."""

import json
import os
import subprocess
import sys

import pytest

SMALL = ["--seq-len", "64", "--batch-size", "2", "--no-progress", "--save-every", "2"]


def _env():
    env = dict(os.environ)
    # The job picks its own 8 fake devices; don't inherit the test process's flags.
    env.pop("XLA_FLAGS", None)
    env["JAX_PLATFORMS"] = "cpu"
    return env


def _run(*args, check=True):
    p = subprocess.run([sys.executable, "-m", "jcp.train", *args], capture_output=True,
                       text=True, env=_env(), timeout=600)
    if check:
        assert p.returncode == 0, p.stderr[-3000:]
    return p


def _rows(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("straight"))
    _run("--out", out, "--steps", "5", *SMALL)
    return _rows(out)


def test_resume_continues_exactly(tmp_path, straight):
    out = str(tmp_path / "resumed")
    _run("--out", out, "--steps", "3", *SMALL)
    first = _rows(out)
    assert sorted({r["step"] for r in first}) == [1, 2, 3]
    p = _run("--out", out, "--steps", "5", "--resume", *SMALL)
    assert "done at step 5" in p.stdout
    rows = _rows(out)
    # One row per step and adapter: nothing repeated or lost.
    keys = [(r["step"], r["adapter"]) for r in rows]
    assert len(keys) == len(set(keys))
    assert sorted(keys) == sorted((s, a) for s in range(1, 6) for a in ("sft", "rl"))
    assert rows[:len(first)] == first
    # The resumed run is the uninterrupted run: same losses, gradient norms, Adam steps.
    assert len(straight) == len(rows)
    for a, b in zip(straight, rows):
        assert (a["step"], a["adapter"], a["optim_step"]) == (b["step"], b["adapter"], b["optim_step"])
        assert a["loss:sum"] == pytest.approx(b["loss:sum"], rel=1e-5, abs=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)


def test_default_losses_fall(straight):
    """Both adapters' losses go down even in 5 small steps (the full default runs 40)."""
    for name in ("sft", "rl"):
        r = [x["loss:sum"] / x["tokens:sum"] for x in straight if x["adapter"] == name]
        assert r[-1] < r[0], (name, r)
    assert {x["loss_fn"] for x in straight} == {"cross_entropy", "importance_sampling"}


def test_data_file(tmp_path):
    data = tmp_path / "d.jsonl"
    lines = []
    for i in range(3):
        toks = list(range(10 + i, 30 + i))
        lines.append({"model_input": toks, "adapter": "a" if i % 2 else "b",
                      "loss_fn_inputs": {"target_tokens": toks[1:] + [0],
                                         "weights": [1.0] * len(toks)}})
    data.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    out = str(tmp_path / "o")
    _run("--out", out, "--steps", "2", "--data", str(data), "--mesh", "1,2,1",
         "--batch-size", "1", "--no-progress")
    rows = _rows(out)
    assert sorted({r["adapter"] for r in rows}) == ["a", "b"]
    assert all(r["loss_fn"] == "cross_entropy" for r in rows)


@pytest.mark.parametrize("args, needle", [
    (["--mesh", "3,x"], "--mesh"),
    (["--mesh", "1,1,3"], "tp=3"),
    (["--bogus"], "unrecognized"),
    (["--steps", "0"], "--steps"),
    (["--data", "/nonexistent.jsonl"], "--data"),
    (["--hf-model", "/nonexistent"], "--hf-model"),
])
def test_bad_options_are_one_line(tmp_path, args, needle):
    p = _run("--out", str(tmp_path / "x"), *args, check=False)
    assert p.returncode == 2
    lines = [ln for ln in p.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    assert lines[0].startswith("jcp-train: error:") and needle in lines[0]


def test_bad_data_file_is_one_line(tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"model_input": [1, 2], "adapter": "a", "loss_fn_inputs": '
                    '{"target_tokens": [1, 99999], "weights": [1, 1]}}\n')
    p = _run("--out", str(tmp_path / "x"), "--data", str(data), "--steps", "1",
             "--mesh", "1,1,1", check=False)
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr
    assert "datum 0" in p.stderr and "target_tokens" in p.stderr
