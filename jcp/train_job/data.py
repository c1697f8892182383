"""The jcp-train job's data: the synthetic tasks (`synthetic_sft`; `rl_rollouts`, sampled
on-policy and scored by `reward`), and a --data JSONL file of Tinker datums (`read_jsonl`
-> `DataFile`, each datum's file and line kept so that `blame` can name them).

Every bad file ends in a CliError naming FILE:LINE; it never trains or writes anything.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re

from jcp.cli import CliError

PROMPT = 16  # leading tokens of every synthetic datum that carry no weight/advantage
NAME_MAX = 255  # bytes in a file name: adapter names become checkpoint folders


def synthetic_sft(step: int, seed: int, batch_size: int, seq_len: int, vocab: int):
    """The sft task, deterministic in (seed, step), so a resumed run sees the same data:
    counting sequences t_{i+1} = t_i + 3 (mod 64) over tokens [0, 64), cross_entropy on
    every token after the prompt. Returns datums."""
    import numpy as np

    from jcp import Datum

    if vocab < 129:
        raise CliError(f"the synthetic tasks need a vocabulary of at least 129 tokens, got {vocab}")
    rng = np.random.default_rng([seed, step])
    data = []
    for _ in range(batch_size):
        start = rng.integers(0, 64)
        seq = (start + 3 * np.arange(seq_len + 1)) % 64
        w = np.ones(seq_len, np.float32)
        w[:PROMPT] = 0.0
        data.append(Datum(seq[:-1], {"target_tokens": seq[1:], "weights": w}))
    return data


def reward(tokens) -> float:
    """The verifiable reward of a completion: the fraction of its tokens that are even."""
    import numpy as np

    tokens = np.asarray(tokens)
    return float(np.mean(tokens % 2 == 0)) if tokens.size else 0.0


def rl_rollouts(tr, adapter: int, step: int, args):
    """On-policy rollouts of the rl adapter: --batch-size prompts (random tokens of
    [64, 128), deterministic in (seed, step)), --group-size completions each sampled at
    T = 1 from the adapter's current weights (seeded by (seed, step), so a resumed run
    samples the same), scored by `reward`. GRPO advantage: the reward standardised within
    its group, on every completion token (0 on the prompt). Datums carry the sampler's
    log-probs, so the importance ratio starts at exactly 1.
    Returns (datums, rewards).
    """
    import numpy as np

    import jcp

    rng = np.random.default_rng([args.seed, step, 1])
    prompts = [rng.integers(64, 128, PROMPT) for _ in range(args.batch_size)]
    sp = jcp.SamplingParams(
        max_tokens=args.rl_tokens, temperature=1.0, seed=int(rng.integers(0, 2**62))
    )
    results = tr.sample(prompts, sp, adapters=adapter, num_samples=args.group_size)
    data, rewards = [], []
    for prompt, res in zip(prompts, results):
        r = np.array([reward(s.tokens) for s in res.sequences])
        adv = (r - r.mean()) / (r.std() + 1e-6)
        for seq, a in zip(res.sequences, adv):
            full = np.concatenate([prompt, seq.tokens]).astype(np.int32)
            advantages = np.zeros(len(full) - 1, np.float32)
            logprobs = np.zeros(len(full) - 1, np.float32)
            advantages[PROMPT - 1 :] = a
            logprobs[PROMPT - 1 :] = seq.logprobs
            data.append(
                jcp.Datum(
                    full[:-1],
                    {"target_tokens": full[1:], "advantages": advantages, "logprobs": logprobs},
                )
            )
        rewards.extend(r.tolist())
    return data, rewards


@dataclasses.dataclass(frozen=True)
class DataFile:
    """The datums of a --data file, and the line each came from."""

    path: str
    datums: list
    adapters: list[str]  # per datum
    losses: list[str]  # per datum
    lines: list[int]  # per datum, 1-based

    @functools.cached_property
    def by_adapter(self) -> dict[str, list[int]]:
        """{adapter name: its datums}, names sorted."""
        return {
            n: [i for i, m in enumerate(self.adapters) if m == n]
            for n in sorted(set(self.adapters))
        }

    @property
    def adapter_names(self) -> list[str]:
        return list(self.by_adapter)

    def batch(self, step: int, batch_size: int):
        """batch_size datums of every adapter for `step`, each adapter cycling its own lines
        -> (datums, adapter names, loss names, their indices here)."""
        picks = [
            mine[((step - 1) * batch_size + j) % len(mine)]
            for mine in self.by_adapter.values()
            for j in range(batch_size)
        ]
        return (
            [self.datums[i] for i in picks],
            [self.adapters[i] for i in picks],
            [self.losses[i] for i in picks],
            picks,
        )

    def where(self, i: int) -> str:
        return f"{self.path}:{self.lines[i]}"


def text_lines(path: str):
    """(line number, text) of a UTF-8 file; a file that cannot be read is a CliError."""
    try:
        f = open(path, "rb")
    except OSError as e:
        raise CliError(f"{path}: {e.strerror}") from None
    with f:
        for lineno, raw in enumerate(f, 1):
            try:
                yield lineno, raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise CliError(
                    f"{path}:{lineno}: not UTF-8 text ({e.reason} at byte {e.start} of the line)"
                ) from None


def _tokens_ok(model_input) -> bool:
    """A list, or Tinker's ModelInput {"chunks": [{"tokens": [...]}, ...]}."""
    if isinstance(model_input, list):
        return True
    chunks = model_input.get("chunks") if isinstance(model_input, dict) else None
    return isinstance(chunks, list) and all(
        isinstance(ch, dict) and isinstance(ch.get("tokens"), list) for ch in chunks
    )


def _parse_datum(obj, default_loss: str):
    """One JSON line -> (Datum, adapter name, loss name); InputError names the field."""
    import jcp
    from jcp.losses import check_loss_fn

    if not isinstance(obj, dict) or "model_input" not in obj:
        raise jcp.InputError("expected an object with model_input and loss_fn_inputs")
    if not _tokens_ok(obj["model_input"]):
        raise jcp.InputError(
            'model_input must be a list of token ids or {"chunks": [{"tokens": [...]}, ...]}'
        )
    if not isinstance(obj.get("loss_fn_inputs", {}), dict):
        raise jcp.InputError(
            "loss_fn_inputs must be an object of named vectors, got "
            f"{json.dumps(obj['loss_fn_inputs'])[:40]}"
        )
    loss = obj.get("loss_fn", default_loss)
    if not isinstance(loss, str):
        raise jcp.InputError(f"loss_fn must be a loss name, got {json.dumps(loss)[:40]}")
    check_loss_fn(loss)
    adapter = obj.get("adapter", "default")
    # The name becomes a folder under checkpoints/.
    if (
        not isinstance(adapter, str)
        or adapter in ("", ".", "..")
        or "/" in adapter
        or os.sep in adapter
        or "\0" in adapter
        or len(adapter.encode("utf-8", "surrogatepass")) > NAME_MAX
    ):
        raise jcp.InputError(
            f"adapter must be a name usable as a folder name (no / or NUL, "
            f"at most {NAME_MAX} bytes), got {json.dumps(adapter)[:40]}"
        )
    return jcp.Datum.from_json(obj), adapter, loss


def read_jsonl(path: str, default_loss: str) -> DataFile:
    """Tinker datums from JSONL; errors name the file and line."""
    import jcp

    datums, adapters, losses, lines = [], [], [], []
    for lineno, line in text_lines(path):
        if not line.strip():
            continue
        try:
            datum, adapter, loss = _parse_datum(json.loads(line), default_loss)
        except json.JSONDecodeError as e:
            raise CliError(f"{path}:{lineno}: not JSON ({e.msg})") from None
        except RecursionError:
            raise CliError(f"{path}:{lineno}: JSON nested too deeply") from None
        except jcp.InputError as e:
            raise CliError(f"{path}:{lineno}: {e}") from None
        datums.append(datum)
        adapters.append(adapter)
        losses.append(loss)
        lines.append(lineno)
    if not datums:
        raise CliError(f"{path}: no datums")
    return DataFile(path, datums, adapters, losses, lines)


def load_data(args) -> DataFile | None:
    """The --data file, or None for the synthetic tasks."""
    if args.data:
        return read_jsonl(args.data, args.loss_fn or "cross_entropy")
    if args.loss_fn:
        raise CliError("--loss-fn applies to --data; the default run has its own losses")
    return None


def blame(err, step: int, src: DataFile | None, picks: list[int] | None) -> CliError:
    """A Trainer refusal during training as a CliError; "datum i" of the step's batch
    becomes the file and line it came from."""
    msg = str(err)
    m = re.search(r"\bdatum (\d+)\b:? ?", msg)
    if src is None or m is None or int(m[1]) >= len(picks):
        return CliError(f"step {step}: {msg}")
    if m.start() == 0:
        msg = msg[m.end() :]
    return CliError(f"{src.where(picks[int(m[1])])}: {msg} (at step {step})")
