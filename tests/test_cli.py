"""jcp-train: resume continues exactly, every user error is one line on stderr (exit 2)."""

import json
import os
import shutil
import subprocess
import sys

import pytest

SMALL = ["--seq-len", "64", "--batch-size", "2", "--no-progress", "--save-every", "2"]


def _env():
    env = dict(os.environ)
    # The job picks its own 8 fake devices; don't inherit the test process's device count.
    env["XLA_FLAGS"] = os.environ.get("JCP_TEST_CHILD_XLA_FLAGS", "")
    env["JAX_PLATFORMS"] = "cpu"
    return env


def _run(*args, check=True):
    p = subprocess.run(
        [sys.executable, "-m", "jcp.train", *args],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=600,
    )
    if check:
        assert p.returncode == 0, p.stderr[-3000:]
    return p


def _rows(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
    """(output folder, stdout) of an uninterrupted 5-step default run (checkpoints at 4
    and 5)."""
    out = str(tmp_path_factory.mktemp("straight"))
    return out, _run("--out", out, "--steps", "5", *SMALL).stdout


@pytest.fixture(scope="module")
def straight_out(straight_run):
    return straight_run[0]


@pytest.fixture(scope="module")
def straight(straight_out):
    return _rows(straight_out)


def test_resume_continues_exactly(tmp_path, straight_out, straight):
    """A run killed while checkpointing step 5 (a copy of the straight run with step 5's
    metrics rows written, sft's step-5 checkpoint written, rl's not, latest.json still at
    step 4) resumes at step 5 as if never stopped: the rows after the checkpoint are
    dropped and redone, the half-written step overwritten. (One jcp-train process: a run
    of 3 steps resumed to 5 took one more for the same check, a step each side of a save.)"""
    out = tmp_path / "resumed"
    shutil.copytree(straight_out, out)
    shutil.rmtree(_state(out).parent / "rl")
    latest = json.loads(_latest(out).read_text())
    assert latest["step"] == 5
    _latest(out).write_text(json.dumps({**latest, "step": 4, "dir": "step_000004"}))
    first = [r for r in straight if r["step"] <= 4]
    p = _run("--out", str(out), "--steps", "5", "--resume", *SMALL)
    assert "done at step 5" in p.stdout
    rows = _rows(out)
    # One row per step and adapter: nothing repeated or lost.
    keys = [(r["step"], r["adapter"]) for r in rows]
    assert len(keys) == len(set(keys))
    assert sorted(keys) == sorted((s, a) for s in range(1, 6) for a in ("sft", "rl"))
    assert rows[: len(first)] == first
    # The resumed run is the uninterrupted run: same losses, gradient norms, Adam steps.
    assert len(straight) == len(rows)
    for a, b in zip(straight, rows):
        assert (a["step"], a["adapter"], a["optim_step"]) == (
            b["step"],
            b["adapter"],
            b["optim_step"],
        )
        assert a["loss:sum"] == pytest.approx(b["loss:sum"], rel=1e-5, abs=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    assert json.loads(_latest(out).read_text())["step"] == 5
    assert sorted(os.listdir(_state(out).parent)) == ["rl", "sft"]


def test_default_run_learns_on_policy(straight):
    """sft's loss goes down even in 5 small steps; rl trains on its own rollouts: each row
    carries the mean reward, and the trained log-probs of the sampled tokens equal the
    sampler's (importance ratio 1). (The full default run's reward rises 0.48 → 0.88.)"""
    r = [x["loss:sum"] / x["tokens:sum"] for x in straight if x["adapter"] == "sft"]
    assert r[-1] < r[0], r
    rl = [x for x in straight if x["adapter"] == "rl"]
    assert all(0.0 <= x["reward:mean"] <= 1.0 for x in rl)
    assert len({x["reward:mean"] for x in rl}) > 1  # fresh rollouts every step
    assert all(x["sampler_logprob_diff:max"] < 1e-4 for x in rl)
    assert {x["loss_fn"] for x in straight} == {"cross_entropy", "importance_sampling"}


def test_run_ends_with_a_plot_named_last(straight_run, straight):
    """The last line printed names metrics.png next to metrics.jsonl; it is a PNG of the
    rows' loss per token and the rl adapter's reward, step by step."""
    from jcp.train import plot_metrics

    out, stdout = straight_run
    png = os.path.join(out, "metrics.png")
    assert stdout.strip().splitlines()[-1].endswith(png)
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    series = plot_metrics(os.path.join(out, "metrics.jsonl"), str(out) + "/again.png")
    for name in ("sft", "rl"):
        mine = [r for r in straight if r["adapter"] == name]
        assert series[name]["step"] == [r["step"] for r in mine]
        assert series[name]["loss"] == [r["loss:sum"] / r["tokens:sum"] for r in mine]
    assert series["rl"]["reward"] == [r["reward:mean"] for r in straight if r["adapter"] == "rl"]
    assert series["sft"]["reward"] == []


def test_progress_bar_shows_rl_reward_not_loss(straight):
    from jcp.train import progress_postfix

    last = [r for r in straight if r["step"] == 5]
    shown = progress_postfix(last)
    rl = next(r for r in last if r["adapter"] == "rl")
    sft = next(r for r in last if r["adapter"] == "sft")
    assert rl["loss:sum"] / rl["tokens:sum"] != rl["reward:mean"]
    assert shown["rl"] == f"reward {rl['reward:mean']:.3f}"
    assert shown["sft"] == f"loss {sft['loss:sum'] / sft['tokens:sum']:.4f}"


def test_data_file(tmp_path):
    data = tmp_path / "d.jsonl"
    lines = []
    for i in range(3):
        toks = list(range(10 + i, 30 + i))
        lines.append(
            {
                "model_input": toks,
                "adapter": "a" if i % 2 else "b",
                "loss_fn_inputs": {"target_tokens": toks[1:] + [0], "weights": [1.0] * len(toks)},
            }
        )
    data.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    out = str(tmp_path / "o")
    from jcp.train import main

    # In this process: the default run above is the real program's; this one's own part is
    # reading the file (a fresh process would add ~2 CPU s of imports).
    argv = ["--out", out, "--steps", "2", "--data", str(data), "--batch-size", "1"]
    assert main([*argv, "--mesh", "1,2,1", "--no-progress"]) == 0
    rows = _rows(out)
    assert sorted({r["adapter"] for r in rows}) == ["a", "b"]
    assert all(r["loss_fn"] == "cross_entropy" for r in rows)


def test_moe_run_trains_experts(tmp_path):
    """--moe: the tiny MoE model, adapters on attention + experts (shared-outer), both sft and
    the on-policy rl adapter (which samples the MoE model) train."""
    out = str(tmp_path / "moe")
    # Mesh (1,1,1): what this run adds is jcp-train's MoE model and expert adapters; the
    # MoE model's sharded training and sampling are test_moe_lora's (meshes (2,1,4),
    # (1,2,2); log-probs at (1,1,4)). At jcp-train's default (2,2,2) the run took 22 CPU s,
    # here 17.
    _run("--out", out, "--steps", "3", "--moe", "--mesh", "1,1,1", *SMALL)
    rows = _rows(out)
    assert sorted({(r["step"], r["adapter"]) for r in rows}) == sorted(
        (s, a) for s in (1, 2, 3) for a in ("sft", "rl")
    )
    sft = [x["loss:sum"] / x["tokens:sum"] for x in rows if x["adapter"] == "sft"]
    assert sft[-1] < sft[0], sft
    assert all(x["sampler_logprob_diff:max"] < 1e-4 for x in rows if x["adapter"] == "rl")
    with open(os.path.join(out, "checkpoints", "latest.json")) as f:
        latest = json.load(f)
    ckpt = os.path.join(out, "checkpoints", latest["dir"], "sft")
    assert os.path.isdir(ckpt)


# One case in a fresh `python -m jcp.train` (the exit status and stderr of the real program);
# the others call main() in this process (each fresh process costs ~2 CPU s of imports).


def _exit_and_stderr(argv, in_process, capfd):
    """jcp-train's exit code and stderr for argv: main() in this process (no ~2 CPU s of
    imports), or a fresh `python -m jcp.train`."""
    if in_process:
        from jcp.train import main

        code = main(argv)
        return code, capfd.readouterr().err
    p = _run(*argv, check=False)
    return p.returncode, p.stderr


@pytest.mark.parametrize(
    "args, needle, in_process",
    [
        (["--moe", "--hf-model", "/tmp"], "--moe", True),
        (["--mesh", "3,x"], "--mesh", True),
        (["--mesh", "1,1,3"], "tp=3", True),
        (["--bogus"], "unrecognized", False),
        (["--steps", "0"], "--steps", True),
        (["--data", "/nonexistent.jsonl"], "--data", True),
        (["--hf-model", "/nonexistent"], "--hf-model", True),
    ],
)
def test_bad_options_are_one_line(tmp_path, capfd, args, needle, in_process):
    argv = ["--out", str(tmp_path / "x"), *args]
    code, err = _exit_and_stderr(argv, in_process, capfd)
    assert code == 2
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("jcp-train: error:") and needle in lines[0]


# ----------------------------------------------------------------------------------------
# User errors: each case -> (argv, what the one line must name). Cases with in_process=False
# run in a fresh process: orbax/tensorstore failures may print from background threads.

FAST = ["--steps", "1", "--seq-len", "32", "--batch-size", "1", "--no-progress", "--mesh", "1,1,1"]


def _datum(adapter="a", **fields):
    d = {
        "model_input": [1, 2, 3, 4],
        "adapter": adapter,
        "loss_fn_inputs": {"target_tokens": [2, 3, 4, 5], "weights": [1.0] * 4},
    }
    d.update(fields)
    return json.dumps(d).encode()


def _data_case(*lines, bad_line):
    """A --data file of `lines` (bytes); the error must name its line `bad_line`."""

    def make(tmp, resumable):
        path = tmp / "d.jsonl"
        path.write_bytes(b"\n".join(lines) + b"\n")
        return ["--data", str(path)], f"{path}:{bad_line}"

    return make


def _resume_case(corrupt, needle):
    """A copy of the 5-step run, corrupted by corrupt(out); `needle(out)` names the file."""

    def make(tmp, resumable):
        out = tmp / "run"
        shutil.copytree(resumable, out)
        corrupt(out)
        return ["--out", str(out), "--resume", "--steps", "6"], needle(out)

    make.needs_run = True
    return make


def _flag(*argv):
    return lambda tmp, resumable: (list(argv), argv[0])


def _latest(out):
    return out / "checkpoints" / "latest.json"


def _state(out):
    return out / "checkpoints" / "step_000005" / "sft"


def _delete_state(out):
    """Remove the orbax "state" item (the arrays), wherever the layout puts it."""
    found = [p for p in _state(out).rglob("state") if p.is_dir()]
    assert found
    for p in found:
        shutil.rmtree(p)


def _truncate_data(out):
    """Cut every array data file (orbax's d/ folders) to 10 bytes."""
    files = [p for p in _state(out).rglob("*") if p.is_file() and p.parent.name == "d"]
    assert files
    for p in files:
        p.write_bytes(p.read_bytes()[:10])


def _garbage_metrics_row(out):
    with open(out / "metrics.jsonl", "a") as f:
        f.write("garbage\n")


def _last_metrics_line(out):
    with open(out / "metrics.jsonl") as f:
        return f"{out / 'metrics.jsonl'}:{len(f.readlines())}"


def _out_is_a_file(tmp, resumable):
    (tmp / "f").write_text("")
    return ["--out", str(tmp / "f")], "--out"


def _loss_fn_unknown(tmp, resumable):
    argv, _ = _data_case(_datum(), bad_line=1)(tmp, resumable)
    return ["--loss-fn", "nope", *argv], "--loss-fn"


OVERFLOW = _datum(
    "b",
    loss_fn="importance_sampling",
    loss_fn_inputs={"target_tokens": [2, 3, 4, 5], "advantages": [1.0] * 4, "logprobs": [-1e4] * 4},
)

USER_ERRORS = [
    ("out-is-a-file", _out_is_a_file, True),
    ("alpha-negative", _flag("--alpha", "-1"), True),
    ("alpha-zero", _flag("--alpha", "0"), True),
    ("alpha-inf", _flag("--alpha", "inf"), True),
    ("alpha-nan", _flag("--alpha", "nan"), True),
    ("lr-inf", _flag("--lr", "inf"), True),
    ("lr-nan", _flag("--lr", "nan"), True),
    # A fresh process: a NumPy overflow warning would be a second line on stderr.
    ("lr-overflows-float32", _flag("--lr", "1e39"), False),
    ("seed-negative", _flag("--seed", "-1"), True),
    ("alpha-overflows-float32", _flag("--alpha", "1e39"), True),
    ("max-tokens-per-device-tiny", _flag("--max-tokens-per-device", "3"), True),
    ("max-tokens-per-device-zero", _flag("--max-tokens-per-device", "0"), True),
    ("num-processes-zero", _flag("--num-processes", "0"), True),
    ("process-id-beyond-the-job", _flag("--num-processes", "2", "--process-id", "2"), True),
    ("coordinator-without-port", _flag("--coordinator-address", "host"), True),
    ("rl-tokens-beyond-the-cap", _flag("--rl-tokens", "100000"), True),
    ("batch-size-huge", _flag("--batch-size", "1000000000"), True),
    ("data-adapter-with-nul", _data_case(_datum(), _datum("a\u0000b"), bad_line=2), True),
    ("data-adapter-name-too-long", _data_case(_datum("n" * 300), bad_line=1), True),
    (
        "data-nested-deep",
        _data_case(
            _datum(), b'{"model_input": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", bad_line=2
        ),
        True,
    ),
    ("loss-fn-unknown", _loss_fn_unknown, True),
    ("data-loss-fn-not-a-string", _data_case(_datum(), _datum(loss_fn=["ppo"]), bad_line=2), True),
    ("data-inputs-a-list", _data_case(_datum(loss_fn_inputs=[1, 2]), bad_line=1), True),
    ("data-inputs-a-string", _data_case(_datum(loss_fn_inputs="abc"), bad_line=1), True),
    (
        "data-bad-chunks",
        _data_case(_datum(), b"", _datum(model_input={"chunks": 5}), bad_line=3),
        True,
    ),
    (
        "data-not-utf8",
        _data_case(_datum(), b'{"model_input": [1], "adapter": "\xff"}', bad_line=2),
        True,
    ),
    # Refused by the Trainer at step 1: batch datum 1 is line 4 of the file.
    (
        "data-token-outside-vocab",
        _data_case(
            _datum(),
            b"",
            _datum(),
            _datum("b", loss_fn_inputs={"target_tokens": [2, 3, 4, 99999], "weights": [1.0] * 4}),
            bad_line=4,
        ),
        True,
    ),
    ("data-ratio-overflows", _data_case(_datum(), b"", _datum(), OVERFLOW, bad_line=4), True),
    ("resume-latest-not-json", _resume_case(lambda o: _latest(o).write_text("{"), _latest), True),
    (
        "resume-latest-missing-keys",
        _resume_case(lambda o: _latest(o).write_text('{"step": 5}'), _latest),
        True,
    ),
    (
        "resume-latest-wrong-types",
        _resume_case(
            lambda o: _latest(o).write_text('{"step": "5", "dir": 5, "adapters": "rl"}'), _latest
        ),
        True,
    ),
    ("resume-state-deleted", _resume_case(_delete_state, _state), False),
    ("resume-data-truncated", _resume_case(_truncate_data, _state), False),
    ("resume-metrics-garbage", _resume_case(_garbage_metrics_row, _last_metrics_line), True),
]


@pytest.mark.parametrize("make, in_process", [pytest.param(m, p, id=n) for n, m, p in USER_ERRORS])
def test_user_error_is_one_line(tmp_path, request, capfd, make, in_process):
    """Exit 2, one line on stderr naming the flag or FILE:LINE, no traceback."""
    needs_run = getattr(make, "needs_run", False)
    resumable = request.getfixturevalue("straight_out") if needs_run else None
    argv, needle = make(tmp_path, resumable)
    if "--out" not in argv:
        argv = ["--out", str(tmp_path / "out"), *argv]
    argv = [*FAST, *argv]
    code, err = _exit_and_stderr(argv, in_process, capfd)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err[-3000:]
    assert lines[0].startswith("jcp-train: error: ") and str(needle) in lines[0], lines[0]
    if not needs_run:  # refused before any work: no checkpoint was begun
        out = argv[argv.index("--out") + 1]
        assert not os.path.exists(os.path.join(out, "checkpoints")), os.listdir(out)


def test_shared_parser_and_mesh_flag_raise_cli_errors():
    """jcp.cli (shared by jcp-train and jcp-serve): usage errors and bad --mesh values are
    CliError naming the problem, not SystemExit."""
    from jcp.cli import CliError, Parser, parse_mesh

    p = Parser(prog="x")
    p.add_argument("--n", type=int)
    assert p.parse_args(["--n", "3"]).n == 3
    with pytest.raises(CliError, match="--n"):
        p.parse_args(["--n", "three"])
    assert parse_mesh("1,2,4") == (1, 2, 4)
    for bad, pattern in (("1,x,2", "integers"), ("1,2", "three"), ("1,0,2", "positive")):
        with pytest.raises(CliError, match=pattern):
            parse_mesh(bad)


def test_serve_without_the_server_extra_names_it(monkeypatch, capsys):
    """`pip install jcp` installs the library only: jcp-serve then says which extra it needs
    (one line, exit 2) instead of an ImportError's traceback."""
    import importlib.util

    from jcp import serve

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "fastapi" else real(name, *a)
    )
    assert serve.main([]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["jcp-serve: error: jcp-serve needs fastapi: pip install 'jcp[serve]'"]


# ----------------------------------------------------------------------------------------
# jcp-serve: every flag's bad values end in one line and exit 2 before any device work
# (the flags' types in jcp.cli: finite sizes, port range, a folder where one is needed).


def _listening():
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


SERVE_ERRORS = [
    (["--state-dir", "{file}"], "--state-dir"),
    (["--state-dir", "{file}/sub"], "--state-dir"),
    (["--max-offload-gb", "inf"], "--max-offload-gb"),
    (["--max-offload-gb", "nan"], "--max-offload-gb"),
    (["--max-offload-gb", "-1"], "--max-offload-gb"),
    (["--max-offload-gb", "1e300"], "--max-offload-gb"),  # its bytes overflow
    (["--max-storage-gb", "inf"], "--max-storage-gb"),
    (["--max-storage-gb", "-1"], "--max-storage-gb"),
    (["--max-storage-gb", "inf"], "--max-storage-gb"),
    (["--port", "99999"], "--port"),
    (["--port", "-1"], "--port"),
    (["--port", "{busy}"], "--port"),
    (["--host", "192.0.2.1", "--port", "0"], "--host"),  # TEST-NET: no address of ours
    (["--session-timeout", "inf"], "--session-timeout"),
    (["--follower-timeout", "inf"], "--follower-timeout"),
    (["--max-tokens-per-device", "0"], "--max-tokens-per-device"),
    (["--turn-spans", "0"], "--turn-spans"),
    (["--max-datums", "0"], "--max-datums"),
    (["--adapter-memory", "0"], "--adapter-memory"),
    (["--adapter-memory", "1.5GiB"], "--adapter-memory"),
    (["--adapter-memory", "4GB"], "--adapter-memory"),
    (["--sample-chunk", "-2"], "--sample-chunk"),
    (["--compute-nice", "-1"], "--compute-nice"),  # lowering it needs privileges
    (["--compute-nice", "20"], "--compute-nice"),
    (["--seed", "-1"], "--seed"),
    (["--hf-model", "{file}"], "--hf-model"),
    (["--api-keys", "{folder}"], "--api-keys"),
    (["--coordinator-address", "host"], "--coordinator-address"),
    (["--coordinator-address", "host:99999"], "--coordinator-address"),
    (["--num-processes", "2", "--process-id", "2"], "--process-id"),
]


@pytest.mark.parametrize("args, needle", SERVE_ERRORS, ids=[" ".join(a) for a, _ in SERVE_ERRORS])
def test_serve_refuses_bad_flags_in_one_line(tmp_path, capfd, monkeypatch, args, needle):
    from jcp import serve

    def no_devices(*a, **k):
        raise AssertionError("reached device setup")

    monkeypatch.setattr(serve, "setup_devices", no_devices)
    (tmp_path / "f").write_text("")
    with _listening() as busy:
        argv = [
            a.format(file=tmp_path / "f", folder=tmp_path, busy=busy.getsockname()[1]) for a in args
        ]
        code = serve.main(argv)
    err = capfd.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err[-3000:]
    assert lines[0].startswith("jcp-serve: error: ") and needle in lines[0], lines[0]
    assert not (tmp_path / "f" / "sub").exists()


def test_flag_types_take_what_they_should():
    """The converters accept the edges of their ranges (a refusal test alone would pass
    with converters that refuse everything)."""
    from jcp.cli import GIGABYTES, PORT, POSITIVE, address, folder, memory_bytes
    from jcp.serve import parse_args

    assert (PORT("0"), PORT("65535"), GIGABYTES("0"), GIGABYTES("1.5")) == (0, 65535, 0.0, 1.5)
    assert [memory_bytes(t) for t in ("auto", "1", "512MiB", "2 GiB", "3kib")] == [
        "auto",
        1,
        512 << 20,
        2 << 30,
        3 << 10,
    ]
    assert POSITIVE("1e-9") == 1e-9 and address("10.0.0.1:1234") == "10.0.0.1:1234"
    assert folder("/tmp/not/yet/made") == "/tmp/not/yet/made"
    args = parse_args(
        [
            "--port",
            "0",
            "--max-offload-gb",
            "0",
            "--session-timeout",
            "0",
            "--num-processes",
            "2",
            "--process-id",
            "1",
        ]
    )
    assert (args.port, args.max_offload_gb, args.session_timeout, args.process_id) == (
        0,
        0.0,
        0.0,
        1,
    )


def test_every_backend_warms_up_the_whole_sampling_set():
    """jcp-serve warms up the whole sampling set (serve.SAMPLING_WARMUP) on every backend:
    with draw kinds, top-k log-probs, prompt log-probs and decode lengths run-time values
    it is a few dozen programs, whose memory maps fit vm.max_map_count on XLA:CPU too."""
    from jcp.serve import SAMPLING_WARMUP, sampling_warmup

    for backend in ("cpu", "gpu", "tpu"):
        assert sampling_warmup(backend) is SAMPLING_WARMUP
    assert set(SAMPLING_WARMUP["active"]) == {1, 2} and SAMPLING_WARMUP["compute_logprobs"]
