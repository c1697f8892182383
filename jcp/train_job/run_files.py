"""The jcp-train job's files under --out: checkpoints of every adapter with
checkpoints/latest.json (`save_run`, `read_latest`), metrics.jsonl (`write_metrics`,
`trim_metrics` on resume), the progress bar's figures and the metrics.png plot.
"""

from __future__ import annotations

import json
import os
import re
import shutil

from jcp.cli import CliError
from jcp.files import atomic_write
from jcp.train_job.data import text_lines


def read_latest(out: str, adapter_names: list[str]):
    """checkpoints/latest.json as a dict, None when there is none; CliError when it is bad
    or holds other adapters than `adapter_names`."""
    path = os.path.join(out, "checkpoints", "latest.json")
    try:
        with open(path, encoding="utf-8") as f:
            latest = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:  # ValueError: not JSON, not UTF-8
        raise CliError(f"--resume: {path}: cannot be read ({e})") from None
    ok = (
        isinstance(latest, dict)
        and type(latest.get("step")) is int
        and latest["step"] >= 0
        and isinstance(latest.get("dir"), str)
        and re.fullmatch(r"step_\d+", latest["dir"]) is not None
        and isinstance(latest.get("adapters"), list)
        and all(isinstance(n, str) for n in latest["adapters"])
    )
    if not ok:
        raise CliError(
            f'--resume: {path}: expected {{"step": int, "dir": "step_N", '
            f'"adapters": [names]}}, got {json.dumps(latest)[:80]}'
        )
    if sorted(latest["adapters"]) != sorted(adapter_names):
        raise CliError(
            f"--resume: the checkpoint in {out} holds adapters "
            f"{sorted(latest['adapters'])}, this run trains {adapter_names}"
        )
    return latest


def save_run(tr, adapters: dict, out: str, step: int, keep: int = 2) -> None:
    """Checkpoint every adapter at `step`, then point latest.json at it (atomic)."""
    import jax

    root = os.path.join(out, "checkpoints")
    d = os.path.join(root, f"step_{step:06d}")
    for name, aid in adapters.items():
        tr.save_state(aid, os.path.join(d, name))
    if jax.process_index() == 0:
        atomic_write(
            os.path.join(root, "latest.json"),
            json.dumps({"step": step, "dir": os.path.basename(d), "adapters": sorted(adapters)}),
        )
        steps = sorted(p for p in os.listdir(root) if p.startswith("step_"))
        for old in steps[:-keep]:
            shutil.rmtree(os.path.join(root, old), ignore_errors=True)


def trim_metrics(path: str, last_step: int) -> None:
    """Drop metrics rows after the checkpoint we resume from (they will be redone)."""
    if not os.path.exists(path):
        return
    rows = []
    for lineno, line in text_lines(path):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise CliError(f"--resume: {path}:{lineno}: not JSON ({e.msg})") from None
        step = row.get("step") if isinstance(row, dict) else None
        if type(step) is not int:
            raise CliError(f"--resume: {path}:{lineno}: not a metrics row (no integer step)")
        if step <= last_step:
            rows.append(line)
    atomic_write(path, "".join(rows))


def write_metrics(path: str, rows: list[dict]) -> None:
    with open(path, "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def progress_postfix(rows: list[dict]) -> dict[str, str]:
    """What the progress bar shows per adapter: the mean reward of an adapter whose rows
    carry one (rl: its on-policy loss is ~0 and tells nothing), else loss per token."""
    return {
        r["adapter"]: (
            f"reward {r['reward:mean']:.3f}"
            if "reward:mean" in r
            else f"loss {r['loss:sum'] / max(r['tokens:sum'], 1):.4f}"
        )
        for r in rows
    }


def plot_metrics(metrics_path: str, png_path: str) -> dict[str, dict[str, list]]:
    """Write a PNG of each adapter's loss per token and (where rows carry one) mean reward
    against the step, from every row of metrics.jsonl (a resumed run plots its whole
    history). Returns the plotted series {adapter: {"step", "loss", "reward_step",
    "reward"}}."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display, no GUI toolkit
    import matplotlib.pyplot as plt

    series: dict[str, dict[str, list]] = {}
    for _, line in text_lines(metrics_path):
        if not line.strip():
            continue
        r = json.loads(line)
        s = series.setdefault(
            r["adapter"], {"step": [], "loss": [], "reward_step": [], "reward": []}
        )
        s["step"].append(r["step"])
        s["loss"].append(r["loss:sum"] / max(r["tokens:sum"], 1))
        if "reward:mean" in r:
            s["reward_step"].append(r["step"])
            s["reward"].append(r["reward:mean"])
    rewarded = any(s["reward"] for s in series.values())
    fig, axes = plt.subplots(
        1, 2 if rewarded else 1, figsize=(10 if rewarded else 5.5, 3.8), squeeze=False
    )
    for name, s in series.items():
        axes[0, 0].plot(s["step"], s["loss"], marker=".", label=name)
        if s["reward"]:
            axes[0, 1].plot(s["reward_step"], s["reward"], marker=".", label=name)
    axes[0, 0].set(title="loss per token", xlabel="step")
    if rewarded:
        axes[0, 1].set(title="mean reward", xlabel="step")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return series
