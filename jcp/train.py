"""`jcp-train`: the main job. Trains LoRA adapters concurrently on one base model.

With no arguments it runs the embedded default: QwenConfig.tiny() with random weights on
all local devices (with no accelerator, fake CPU devices: as many as --mesh holds, else
8 on mesh dp2 cp2 tp2), two adapters trained in the same passes — "sft" (cross_entropy
on a counting task) and "rl" (on-policy RL: each step it samples --group-size
completions of every prompt from its current weights with Trainer.sample, scores them
with a verifiable reward, and trains on GRPO advantages with --rl-loss and the sampler's
own log-probs) — with a progress bar (the rl adapter's mean reward, the others' loss per
token), metrics.jsonl (the rl rows carry reward:mean), orbax checkpoints every K steps
and --resume; the run ends by writing metrics.png (each adapter's loss and reward per
step) next to metrics.jsonl.

With jcp/cli.py (the pieces it shares with jcp-serve) this is the only place that parses
strings from the command line; bad options and files end in a one-line error, never a
traceback.
"""

from __future__ import annotations

import argparse
import os
import sys

from jcp.cli import (
    COUNT,
    POSITIVE,
    SEED,
    CliError,
    Parser,
    add_cache_flags,
    address,
    build_trainer,
    existing_file,
    existing_folder,
    folder,
    integer,
    parse_mesh,
    setup_compilation_cache,
    setup_devices,
)
from jcp.train_job.data import (
    NAME_MAX,
    PROMPT,
    DataFile,
    blame,
    load_data,
    read_jsonl,
    reward,
    rl_rollouts,
    synthetic_sft,
)
from jcp.train_job.run_files import (
    plot_metrics,
    progress_postfix,
    read_latest,
    save_run,
    trim_metrics,
    write_metrics,
)

# The job's data and files live in jcp.train_job; their names stay importable from here.
__all__ = [
    "NAME_MAX",
    "PROMPT",
    "DataFile",
    "load_data",
    "main",
    "parse_args",
    "plot_metrics",
    "progress_postfix",
    "read_jsonl",
    "read_latest",
    "reward",
    "rl_rollouts",
    "run",
    "save_run",
    "synthetic_sft",
    "write_metrics",
]

SFT, RL = "sft", "rl"
RL_LOSSES = ("importance_sampling", "ppo", "cispo", "dro")
MAX_STEP_TOKENS = 1 << 24  # per adapter per step: ~64 MiB per int32 host array


def parse_args(argv):
    p = Parser(prog="jcp-train", description=__doc__.split("\n\n")[0])
    _model_flags(p.add_argument_group("model"))
    _training_flags(p.add_argument_group("training"))
    _rl_flags(p.add_argument_group("rl adapter"))
    _run_flags(p.add_argument_group("run"))
    _process_flags(p.add_argument_group("multi-process job"))
    add_cache_flags(p, "~/.cache/jcp/xla")
    a = p.parse_args(argv)
    if a.mesh is not None:
        a.mesh = parse_mesh(a.mesh)
    if a.moe and a.hf_model is not None:
        raise CliError(
            "--moe picks the tiny random MoE model; with --hf-model the folder's "
            "config says whether the model is a mixture of experts"
        )
    if None not in (a.process_id, a.num_processes) and a.process_id >= a.num_processes:
        raise CliError(f"--process-id {a.process_id} must be < --num-processes {a.num_processes}")
    _check_with_jcp(a)
    return a


def _model_flags(g) -> None:
    g.add_argument(
        "--mesh", default=None, help="dp,cp,tp (default 2,2,2 on 8 devices, else 1,<devices>,1)"
    )
    g.add_argument(
        "--hf-model",
        type=existing_folder,
        default=None,
        help="Hugging Face Qwen2/Qwen3/Qwen3-MoE/Qwen3.5 folder",
    )
    g.add_argument(
        "--moe",
        action="store_true",
        help="without --hf-model: the tiny random mixture-of-experts model "
        "(QwenConfig.tiny_moe()) instead of the dense one",
    )
    g.add_argument(
        "--expert-lora",
        default="shared_outer",
        choices=("shared_outer", "per_expert"),
        help="how adapters hold the experts of a MoE model (default shared_outer)",
    )
    g.add_argument("--max-tokens-per-device", type=integer(2), default=None)


def _training_flags(g) -> None:
    g.add_argument("--steps", type=COUNT, default=100, help="optimizer steps in all (default 100)")
    g.add_argument(
        "--data",
        type=existing_file,
        default=None,
        help='JSONL of Tinker datums, each with an "adapter" name and optionally a "loss_fn"',
    )
    g.add_argument(
        "--loss-fn", default=None, help="loss for --data lines without one (default cross_entropy)"
    )
    g.add_argument("--lr", type=POSITIVE, default=2e-3, help="Adam learning rate (default 2e-3)")
    g.add_argument("--rank", type=COUNT, default=8, help="LoRA rank (default 8)")
    g.add_argument("--alpha", type=POSITIVE, default=16.0, help="LoRA alpha (default 16)")
    g.add_argument("--batch-size", type=COUNT, default=4, help="datums per adapter per step")
    g.add_argument(
        "--seq-len", type=integer(PROMPT + 2), default=512, help="synthetic datum length"
    )


def _rl_flags(g) -> None:
    g.add_argument(
        "--group-size", type=COUNT, default=4, help="rl: completions sampled per prompt (default 4)"
    )
    g.add_argument(
        "--rl-tokens",
        type=COUNT,
        default=16,
        help="rl: most tokens sampled per completion (default 16)",
    )
    g.add_argument(
        "--rl-loss",
        default="importance_sampling",
        choices=RL_LOSSES,
        help="rl: loss on the sampled rollouts (default importance_sampling)",
    )


def _run_flags(g) -> None:
    g.add_argument(
        "--save-every", type=COUNT, default=25, help="checkpoint every K steps (default 25)"
    )
    g.add_argument(
        "--out", type=folder, default="jcp-out", help="output folder (default ./jcp-out)"
    )
    g.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    g.add_argument("--seed", type=SEED, default=0)
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument(
        "--warmup",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="compile the run's training programs before its first step (every "
        "stream length its steps pack to; default on)",
    )


def _process_flags(g) -> None:
    g.add_argument(
        "--coordinator-address",
        type=address,
        default=None,
        help="jax.distributed coordinator host:port (or JAX_COORDINATOR_ADDRESS)",
    )
    g.add_argument("--num-processes", type=COUNT, default=None, help="(or JAX_NUM_PROCESSES)")
    g.add_argument("--process-id", type=integer(0), default=None, help="(or JAX_PROCESS_ID)")


def _check_with_jcp(a) -> None:
    """The checks that need jcp (and so JAX) come last, so that a mistyped flag fails fast.
    Importing JAX touches no backend; setup_devices still runs before one starts. Sets
    a.adam."""
    import jcp
    from jcp.errors import float32_number
    from jcp.losses import check_loss_fn

    if a.loss_fn is not None:
        try:
            check_loss_fn(a.loss_fn)
        except jcp.InputError as e:
            raise CliError(f"--loss-fn: {e}") from None
    try:
        float32_number(a.alpha, "--alpha")
    except jcp.InputError as e:
        raise CliError(str(e)) from None
    # Host arrays of one step hold every adapter's tokens (a few int32/float32 vectors
    # each): bound them before anything is built.
    step_tokens = a.batch_size * max(a.seq_len, a.group_size * (PROMPT + a.rl_tokens))
    if step_tokens > MAX_STEP_TOKENS:
        raise CliError(
            f"--batch-size {a.batch_size}: a step of {step_tokens} tokens per "
            f"adapter exceeds {MAX_STEP_TOKENS} (lower --batch-size, --seq-len, "
            "--group-size or --rl-tokens)"
        )
    a.adam = jcp.AdamParams(learning_rate=a.lr)
    try:
        a.adam.checked()  # in float32, as the optimizer will see it
    except jcp.InputError as e:
        raise CliError(f"--lr: {e}") from None


# ----------------------------------------------------------------------------------------
# Main


def check_fits(tr, args, src: DataFile | None) -> None:
    """Every datum the run will train on fits the Trainer (token cap, vocabulary, inputs),
    checked before any adapter exists: CliError naming FILE:LINE or the flag."""
    import jcp
    from jcp import batch as batch_lib

    cap = tr.token_cap
    why = (
        f"--max-tokens-per-device {args.max_tokens_per_device}"
        if args.max_tokens_per_device is not None
        else f"--mesh {tr.dp},{tr.cp},{tr.tp}"
    )
    if src is not None:
        for i, (d, loss) in enumerate(zip(src.datums, src.losses)):
            try:
                batch_lib.validate([d], [loss], tr.cfg.vocab_size, cap)
            except jcp.InputError as e:
                raise CliError(
                    f"{src.where(i)}: {str(e).removeprefix('datum 0: ')} (with "
                    f"{why}, a datum holds at most {cap} tokens)"
                ) from None
        return
    if args.seq_len > cap:
        raise CliError(f"--seq-len {args.seq_len}: {why} lets a datum hold at most {cap} tokens")
    if PROMPT + args.rl_tokens > cap:
        raise CliError(
            f"--rl-tokens {args.rl_tokens}: a {PROMPT}-token prompt plus "
            f"completion exceeds the {cap} tokens {why} allows per sequence"
        )


def restore_or_create(tr, args, adapter_names: list[str], latest: dict | None) -> tuple[dict, int]:
    """-> ({adapter name: id}, the step they are at): the checkpoint `latest` points at,
    else fresh adapters (and a fresh metrics.jsonl)."""
    import jax

    import jcp

    try:
        os.makedirs(args.out, exist_ok=True)
    except OSError as e:
        raise CliError(f"--out {args.out}: {e.strerror}") from None
    metrics_path = os.path.join(args.out, "metrics.jsonl")
    adapters = {}
    if latest:
        d = os.path.join(args.out, "checkpoints", latest["dir"])
        for name in adapter_names:
            try:
                adapters[name] = tr.load_state(os.path.join(d, name))
            except (jcp.InputError, OSError) as e:
                raise CliError(f"--resume: {e}") from None
        if jax.process_index() == 0:
            trim_metrics(metrics_path, latest["step"])
        return adapters, latest["step"]
    if args.resume:
        print(f"jcp-train: no checkpoint in {args.out}; starting from step 0", file=sys.stderr)
    for i, name in enumerate(adapter_names):
        adapters[name] = tr.create_adapter(
            rank=args.rank, alpha=args.alpha, seed=args.seed * 100 + i, expert_lora=args.expert_lora
        )
    if jax.process_index() == 0 and os.path.exists(metrics_path):
        os.remove(metrics_path)
    return adapters, 0


def train_loop(tr, args, src: DataFile | None, adapters: dict, start: int) -> dict:
    """Steps start+1 .. --steps: one forward_backward over every adapter's batch, one
    optim_step per adapter, a metrics row per adapter, a checkpoint every --save-every."""
    import jax
    from tqdm import tqdm

    import jcp

    primary = jax.process_index() == 0
    metrics_path = os.path.join(args.out, "metrics.jsonl")
    last = {}
    with tqdm(
        range(start + 1, args.steps + 1),
        initial=start,
        total=args.steps,
        disable=args.no_progress or not primary,
        desc="jcp-train",
        unit="step",
    ) as bar:
        for step in bar:
            data, names, losses, picks, rewards = _step_data(tr, args, src, adapters, step)
            try:
                out = tr.forward_backward(data, losses, None, [adapters[n] for n in names])
            except jcp.InputError as e:
                raise blame(e, step, src, picks) from None
            rows = []
            for name, aid in adapters.items():
                mine = [i for i, n in enumerate(names) if n == name]
                try:
                    opt = tr.optim_step(aid, args.adam)
                except jcp.InputError as e:
                    raise blame(e, step, src, picks) from None
                rows.append(_metrics_row(step, name, mine, losses, out, opt))
                if name == RL and rewards is not None:
                    rows[-1].update(_rl_metrics(out, data, mine, rewards))
                last[name] = rows[-1]
            if primary:
                write_metrics(metrics_path, rows)
                bar.set_postfix(progress_postfix(rows))
            if step % args.save_every == 0 or step == args.steps:
                save_run(tr, adapters, args.out, step)
    return last


def _step_data(tr, args, src: DataFile | None, adapters: dict, step: int) -> tuple:
    """One step's datums -> (data, adapter name per datum, loss per datum, the --data
    lines picked (None: synthetic), the rl rollouts' rewards (None: --data))."""
    if src:
        data, names, losses, picks = src.batch(step, args.batch_size)
        return data, names, losses, picks, None
    data = synthetic_sft(step, args.seed, args.batch_size, args.seq_len, tr.cfg.vocab_size)
    rl_data, rewards = rl_rollouts(tr, adapters[RL], step, args)
    names = [SFT] * len(data) + [RL] * len(rl_data)
    losses = ["cross_entropy"] * len(data) + [args.rl_loss] * len(rl_data)
    return data + rl_data, names, losses, None, rewards


def _metrics_row(step: int, name: str, mine: list[int], losses, out, opt) -> dict:
    """One adapter's metrics row of a step (`mine`: its datums' indices)."""
    return {
        "step": step,
        "adapter": name,
        "loss_fn": ",".join(sorted({losses[i] for i in mine})),
        "loss:sum": float(sum(out.loss_fn_outputs[i]["loss:sum"] for i in mine)),
        "datums:sum": len(mine),
        "tokens:sum": int(sum(len(out.loss_fn_outputs[i]["logprobs"]) for i in mine)),
        "grad_norm": opt["grad_norm"],
        "learning_rate": opt["learning_rate"],
        "optim_step": opt["step"],
    }


def _rl_metrics(out, data, mine: list[int], rewards) -> dict:
    """The rl adapter's mean reward, and how far the trained log-probs of the sampled
    tokens are from the sampler's: on-policy they are equal (up to fp32 rounding) before
    this step's update."""
    import numpy as np

    diff = max(
        float(
            np.max(
                np.abs(
                    out.loss_fn_outputs[i]["logprobs"][PROMPT - 1 :]
                    - data[i].loss_fn_inputs["logprobs"][PROMPT - 1 :]
                )
            )
        )
        for i in mine
    )
    return {"reward:mean": float(np.mean(rewards)), "sampler_logprob_diff:max": diff}


def run(args) -> dict:
    """The job; returns the last metrics row of each adapter."""
    src = load_data(args)
    adapter_names = src.adapter_names if src else [SFT, RL]
    latest = read_latest(args.out, adapter_names) if args.resume else None
    # The warm-up trains a scratch adapter: one slot more.
    tr = build_trainer(
        args, max_adapters=max(len(adapter_names), 1) + int(args.warmup), max_rank=args.rank
    )
    check_fits(tr, args, src)
    adapters, start = restore_or_create(tr, args, adapter_names, latest)
    if start >= args.steps:
        print(f"jcp-train: already at step {start} of {args.steps}", file=sys.stderr)
        return {}
    if args.warmup:
        warmup(tr, args, src, adapters, start)
    return train_loop(tr, args, src, adapters, start)


# Steps of a --data run whose stream lengths the warm-up reads (its batches cycle).
WARMUP_STEPS = 256


def warmup(tr, args, src: DataFile | None, adapters: dict, start: int) -> None:
    """Compile what the run's steps will run before the first: each distinct shape of
    forward_backward among the next WARMUP_STEPS steps of a --data run (its batches cycle;
    Trainer.pass_shapes, Trainer.warmup_call), or of the synthetic step (its rl rollouts
    sampled once here, from the adapters as they are: the first step's sampling programs
    compile too), then optim_step and the gradient copies (Trainer.warmup on its scratch
    slot). Nothing the run trains changes."""
    import time

    import jax

    import jcp

    t0 = time.monotonic()
    if src:
        steps = range(start + 1, min(args.steps, start + WARMUP_STEPS) + 1)
        batches = [src.batch(step, args.batch_size)[:3] for step in steps]
    else:
        data = synthetic_sft(start + 1, args.seed, args.batch_size, args.seq_len, tr.cfg.vocab_size)
        rl_data, _ = rl_rollouts(tr, adapters[RL], start + 1, args)
        batches = [
            (
                data + rl_data,
                [SFT] * len(data) + [RL] * len(rl_data),
                ["cross_entropy"] * len(data) + [args.rl_loss] * len(rl_data),
            )
        ]
    seen, n = set(), 0
    for data, names, losses in batches:
        ids = [adapters[name] for name in names]
        try:
            shapes = tuple(tr.pass_shapes(data, losses, ids))
            if shapes not in seen:
                seen.add(shapes)
                n += tr.warmup_call(data, losses, ids)
        except jcp.InputError:
            continue  # that step will say why
    n += tr.warmup(rows=[])
    if jax.process_index() == 0:
        print(
            f"jcp-train: warm-up compiled {n} training programs in {time.monotonic() - t0:.1f} s",
            flush=True,
        )


def main(argv=None) -> int:
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
        setup_compilation_cache(args)
        setup_devices(args)
        last = run(args)
    except CliError as e:
        # One line, whatever the message it wraps (orbax's can span several).
        print("jcp-train: error: " + " ".join(str(e).split()), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("jcp-train: interrupted", file=sys.stderr)
        return 130
    if last:
        import jax

        if jax.process_index() == 0:
            summary = ", ".join(
                f"{n} loss/token {r['loss:sum'] / max(r['tokens:sum'], 1):.4f}"
                + (f" reward {r['reward:mean']:.3f}" if "reward:mean" in r else "")
                for n, r in last.items()
            )
            metrics_path = os.path.join(args.out, "metrics.jsonl")
            print(
                f"jcp-train: done at step {max(r['step'] for r in last.values())} "
                f"({summary}); metrics in {metrics_path}"
            )
            png = os.path.join(args.out, "metrics.png")
            plot_metrics(metrics_path, png)
            print(f"jcp-train: plot of each adapter's loss and reward per step in {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
