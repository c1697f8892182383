"""Sampling parameters, results and the validation of a sampling call (host only).

Owns SamplingParams, SampledSequence / SampleResult, the checks that refuse bad input
before any device work (InputError naming the argument and field), and the per-sequence
seed streams. It must never touch devices.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jcp.errors import InputError, float32_number

# Temperatures below this are treated as this: logits / T stays finite in float32, and the
# draw is then the greedy token except for exact ties.
MIN_TEMPERATURE = 1e-6
BASE = -1  # adapter key of "no adapter" (the base model alone)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample (Tinker's SamplingParams, token stops only).

    max_tokens: most new tokens per sequence (≥ 1). temperature: 0 = greedy; otherwise
    logits / T (values below 1e-6 act as 1e-6). top_k: keep the k most likely tokens (−1 =
    all). top_p: then keep the smallest set of most likely tokens whose probability
    reaches top_p (1 = all). stop: token ids that end a sequence (the stop token is
    included in the result); None = the model's EOS ids (QwenConfig.eos_token_ids, from
    config.json / generation_config.json); [] = never stop early. seed: makes the call
    reproducible (each sequence of each prompt gets its own stream from it); None =
    fresh entropy.

    Returned log-probs are log_softmax(logits / T) of the sampled token, before top-k /
    top-p truncation (T = 1 for greedy), so at T = 1 they are the Trainer's own
    log-probs of those tokens.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    stop: Sequence[int] | None = None
    seed: int | None = None


# The most top-k entries, target ids per position, or prompt draws per position a request
# may ask for; the device programs see these widths bucketed (k_bucket).
MAX_TOPK = 64


def k_bucket(k: int) -> int:
    """The compiled width of a requested k: 0, or 4, 16, 64 (the smallest ≥ k)."""
    if k <= 0:
        return 0
    b = 4
    while b < k:
        b *= 4
    return b


# The width of the engine's stop tables: every stop list of at most STOP_WIDTH token ids
# shares one compiled width (a longer one would compile a wider table; jcp-serve refuses
# longer lists at the edge, jcp.server.edge.MAX_STOPS).
STOP_WIDTH = 16


@dataclasses.dataclass
class TopK:
    """Tokens and log-probs at each position: token_ids int32 [n, k], logprobs float32
    [n, k], most likely first. A position with nothing computed (prompt position 0,
    positions before prompt_logprobs_last_n) has ids −1 and log-probs NaN."""

    token_ids: np.ndarray
    logprobs: np.ndarray


@dataclasses.dataclass
class SampledSequence:
    """One completion: tokens int32 [n] (a stop token that ended it included), logprobs
    float32 [n] (see SamplingParams), stop_reason "stop" | "length"; topk_logprobs (when
    topk_sample_logprobs = k > 0): TopK [n, k] of the distribution each token was drawn
    from (the one `logprobs` are taken from)."""

    tokens: np.ndarray
    logprobs: np.ndarray
    stop_reason: str
    topk_logprobs: TopK | None = None


@dataclasses.dataclass
class SampleResult:
    """The num_samples sequences of one prompt; prompt_logprobs float32 [len(prompt)]
    (NaN at 0, and before the last prompt_logprobs_last_n positions) when asked for, else
    None. With the PromptFields of the request: topk_prompt_logprobs TopK [len(prompt), k]
    (log_softmax(logits) at each position, as forward); target_prompt_logprobs float32
    [len(prompt) − 1, K] (row i: the log-probs of the requested ids at position i + 1;
    0.0 where the id was −1); prompt_alt_tokens TopK [len(prompt) − 1, k] (row i: k
    independent draws at position i + 1, at the request's temperature, and their
    log-probs log_softmax(logits / T), T = 1 when greedy)."""

    sequences: list[SampledSequence]
    prompt_logprobs: np.ndarray | None = None
    topk_prompt_logprobs: TopK | None = None
    target_prompt_logprobs: np.ndarray | None = None
    prompt_alt_tokens: TopK | None = None


@dataclasses.dataclass(frozen=True)
class PromptFields:
    """The SDK 0.38 per-request fields beyond prompt_logprobs (SampleRequest):
    topk_prompt_logprobs, topk_sample_logprobs, prompt_alt_tokens_k (each 0 = none, at
    most MAX_TOPK and the vocabulary); prompt_logprobs_last_n (None = all; 1 ≤ n ≤
    len(prompt) − 1, needs prompt_logprobs; applies to prompt_logprobs and
    topk_prompt_logprobs); target_prompt_logprobs: token ids int [len(prompt) − 1, K]
    (−1 = none, K ≤ MAX_TOPK, at least one id). See SampleResult for the results."""

    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    prompt_logprobs_last_n: int | None = None
    target_prompt_logprobs: np.ndarray | None = None
    prompt_alt_tokens_k: int = 0

    @property
    def prompt_stats(self) -> bool:
        """Whether the prefill must compute more than prompt log-probs."""
        return bool(
            self.topk_prompt_logprobs
            or self.prompt_alt_tokens_k
            or self.target_prompt_logprobs is not None
        )

    @property
    def target_width(self) -> int:
        t = self.target_prompt_logprobs
        return 0 if t is None else int(t.shape[1])


NO_FIELDS = PromptFields()


def check_fields(
    fields, prompt_len: int, vocab_size: int, prompt_logprobs: bool, what: str = ""
) -> PromptFields:
    """PromptFields (or None) for a prompt of prompt_len tokens -> a checked private copy;
    InputError naming the field."""
    if fields is None:
        return NO_FIELDS
    if not isinstance(fields, PromptFields):
        raise InputError(
            f"{what}fields must be jcp.sample.PromptFields, got {type(fields).__name__}"
        )
    cap = min(MAX_TOPK, vocab_size)
    for name in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k"):
        k = getattr(fields, name)
        if not is_int(k) or not 0 <= k <= cap:
            raise InputError(f"{what}{name} must be an integer in [0, {cap}], got {k!r}")
    n = fields.prompt_logprobs_last_n
    if n is not None:
        if not is_int(n) or not 1 <= n <= prompt_len - 1:
            raise InputError(
                f"{what}prompt_logprobs_last_n must be an integer in [1, "
                f"len(prompt) − 1 = {prompt_len - 1}] or None, got {n!r}"
            )
        if not prompt_logprobs:
            raise InputError(
                f"{what}prompt_logprobs_last_n applies to prompt log-probs; set prompt_logprobs"
            )
    t = fields.target_prompt_logprobs
    if t is not None:
        try:
            arr = np.array(t, copy=True)
        except Exception as e:  # noqa: BLE001 — ragged and the like
            raise InputError(
                f"{what}target_prompt_logprobs is not an array of token ids ({e})"
            ) from None
        if arr.ndim != 2 or arr.shape[0] != prompt_len - 1:
            raise InputError(
                f"{what}target_prompt_logprobs must have shape [len(prompt) − 1 "
                f"= {prompt_len - 1}, K], got {list(arr.shape)}"
            )
        if not np.issubdtype(arr.dtype, np.integer):
            raise InputError(
                f"{what}target_prompt_logprobs must hold integer token ids, got {arr.dtype}"
            )
        if not 1 <= arr.shape[1] <= MAX_TOPK:
            raise InputError(
                f"{what}target_prompt_logprobs has K = {arr.shape[1]} ids per "
                f"position; 1 ≤ K ≤ {MAX_TOPK}"
            )
        bad = np.argwhere((arr < -1) | (arr >= vocab_size))
        if bad.size:
            i, j = (int(x) for x in bad[0])
            raise InputError(
                f"{what}target_prompt_logprobs[{i}][{j}] = {arr[i, j]} is "
                f"neither −1 nor a token id in [0, {vocab_size})"
            )
        if not np.any(arr >= 0):
            raise InputError(f"{what}target_prompt_logprobs names no token id (all −1)")
        t = arr.astype(np.int32)
    return PromptFields(
        int(fields.topk_prompt_logprobs),
        int(fields.topk_sample_logprobs),
        None if n is None else int(n),
        t,
        int(fields.prompt_alt_tokens_k),
    )


@dataclasses.dataclass(frozen=True)
class Checked:
    """A validated sampling call."""

    prompts: list[np.ndarray]
    adapters: list[int]  # per prompt; BASE = none
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    stop: tuple[int, ...]
    seed: int
    num_samples: int


def is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def check_prompts(prompts, vocab_size: int, what: str = "prompts") -> list[np.ndarray]:
    """A list of non-empty token vectors inside the vocabulary -> int32 copies."""
    if isinstance(prompts, (str, bytes, np.ndarray)) or not isinstance(prompts, Sequence):
        raise InputError(f"{what} must be a list of token sequences")
    if len(prompts) == 0:
        raise InputError(f"{what} is empty: pass at least one prompt")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, (str, bytes)):
            raise InputError(f"{what}[{i}] must be a sequence of token ids, got a string")
        try:
            arr = np.array(p, copy=True)
        except Exception as e:  # ragged and the like
            raise InputError(f"{what}[{i}] is not a vector of token ids ({e})") from None
        if arr.ndim != 1:
            raise InputError(f"{what}[{i}] must be 1-D, got shape {arr.shape}")
        if arr.size == 0:
            raise InputError(f"{what}[{i}] is empty")
        if not np.issubdtype(arr.dtype, np.integer):
            if (
                arr.dtype.kind != "f"
                or not np.all(np.isfinite(arr))
                or np.any(arr != np.round(arr))
            ):
                raise InputError(f"{what}[{i}] must hold integer token ids, got {arr.dtype}")
        bad = np.flatnonzero((arr < 0) | (arr >= vocab_size))
        if bad.size:
            j = int(bad[0])
            raise InputError(
                f"{what}[{i}][{j}] = {arr[j]} is outside the vocabulary [0, {vocab_size})"
            )
        out.append(arr.astype(np.int32))
    return out


def check_params(sp, vocab_size: int, eos: tuple[int, ...]) -> dict:
    """SamplingParams -> checked values (float32 for the floats); InputError names the field."""
    if not isinstance(sp, SamplingParams):
        raise InputError(f"sampling_params must be jcp.SamplingParams, got {type(sp).__name__}")
    if not is_int(sp.max_tokens) or sp.max_tokens < 1:
        raise InputError(f"SamplingParams.max_tokens must be an integer ≥ 1, got {sp.max_tokens!r}")
    temperature = float32_number(sp.temperature, "SamplingParams.temperature")
    if temperature < 0:
        raise InputError(f"SamplingParams.temperature must be ≥ 0, got {sp.temperature}")
    if not is_int(sp.top_k) or not (sp.top_k == -1 or sp.top_k >= 1):
        raise InputError(
            f"SamplingParams.top_k must be −1 (no limit) or an integer ≥ 1, got {sp.top_k!r}"
        )
    top_p = float32_number(sp.top_p, "SamplingParams.top_p")
    if not 0.0 < top_p <= 1.0:
        raise InputError(f"SamplingParams.top_p must lie in (0, 1], got {sp.top_p}")
    if sp.stop is None:
        stop = tuple(eos)
    else:
        if isinstance(sp.stop, (str, bytes)) or not isinstance(sp.stop, (Sequence, np.ndarray)):
            raise InputError(
                f"SamplingParams.stop must be a list of token ids or None, got {sp.stop!r}"
            )
        for j, t in enumerate(sp.stop):
            if not is_int(t) or not 0 <= t < vocab_size:
                raise InputError(
                    f"SamplingParams.stop[{j}] = {t!r} is not a token id in [0, {vocab_size})"
                )
        stop = tuple(int(t) for t in sp.stop)
    if sp.seed is None:
        seed = int(np.random.SeedSequence().entropy % (1 << 63))
    elif not is_int(sp.seed) or not 0 <= sp.seed < 1 << 63:
        raise InputError(
            f"SamplingParams.seed must be an integer in [0, 2^63) or None, got {sp.seed!r}"
        )
    else:
        seed = int(sp.seed)
    return dict(
        max_tokens=int(sp.max_tokens),
        temperature=temperature,
        top_k=int(min(sp.top_k, vocab_size)) if sp.top_k > 0 else -1,
        top_p=top_p,
        stop=stop,
        seed=seed,
    )


def alt_key(seed: int, prompt: int) -> np.ndarray:
    """The raw threefry key uint32 [2] of one prompt's prompt_alt_tokens draws (a stream
    apart from its sequences' keys)."""
    return np.random.SeedSequence([seed, prompt, 0, 1]).generate_state(2, np.uint32)


def sequence_keys(seed: int, prompt: int, num_samples: int) -> np.ndarray:
    """Raw threefry keys uint32 [num_samples, 2] of one prompt's sequences: a pure function
    of (seed, prompt index, sample index), so a draw never depends on the batch around it."""
    return np.stack(
        [
            np.random.SeedSequence([seed, prompt, j]).generate_state(2, np.uint32)
            for j in range(num_samples)
        ]
    )


@dataclasses.dataclass(frozen=True)
class PromptStatsCall:
    """What one prefill call computes beside the log-probs (host side): topk / alt: the
    bucketed widths (params.k_bucket) of topk_prompt_logprobs / prompt_alt_tokens_k over
    its prompts; temperature float32 [P] and keys uint32 [P, 2]: each prompt's draw
    temperature (0: greedy) and params.alt_key; which: the prompt of each prefill datum
    (as Sampler.packed)."""

    topk: int
    alt: int
    temperature: np.ndarray
    keys: np.ndarray
    which: tuple[int, ...]

    @staticmethod
    def of(prompts, fields, temperatures, seeds, prompt_index) -> PromptStatsCall | None:
        """For prompts with their PromptFields, temperatures, seeds and prompt indices (the
        index each prompt's keys derive from); None when nothing beyond log-probs."""
        topk = k_bucket(max(f.topk_prompt_logprobs for f in fields))
        alt = k_bucket(max(f.prompt_alt_tokens_k for f in fields))
        if not (topk or alt):
            return None
        t = np.array([0.0 if x == 0 else max(x, MIN_TEMPERATURE) for x in temperatures], np.float32)
        keys = np.stack([alt_key(sd, i) for sd, i in zip(seeds, prompt_index)])
        return PromptStatsCall(
            topk, alt, t, keys, tuple(i for i, x in enumerate(prompts) if len(x) > 1)
        )

    def streams(self, pb) -> tuple[np.ndarray, np.ndarray]:
        """(temperature [DP, CP, S], keys [DP, CP, S, 2]) of a packed batch's tokens (pb: a
        batch.PackedBatch)."""
        members = np.array(pb.slot_datums or (0,))
        real = pb.segment >= 0
        prompt = np.array(self.which)[members[np.where(real, pb.segment, 0)]]
        return (
            np.where(real, self.temperature[prompt], 0.0).astype(np.float32),
            np.where(real[..., None], self.keys[prompt], 0).astype(np.uint32),
        )


def prompt_results(out: dict, n: int, fields: PromptFields, prompt_logprobs: bool) -> dict:
    """SampleResult's prompt fields (as keyword arguments) of one prompt of n tokens from
    its Sampler.prompt_outputs entry, cut to what the request asked for."""
    first = 1 if fields.prompt_logprobs_last_n is None else n - fields.prompt_logprobs_last_n
    kw = {}
    if prompt_logprobs:
        lp = out["lp"].copy()
        lp[:first] = np.nan
        kw["prompt_logprobs"] = lp
    k = fields.topk_prompt_logprobs
    if k:
        ids, lps = np.full((n, k), -1, np.int32), np.full((n, k), np.nan, np.float32)
        if n > 1:
            ids[1:], lps[1:] = out["topk_ids"][:, :k], out["topk_lp"][:, :k]
        ids[:first], lps[:first] = -1, np.nan
        kw["topk_prompt_logprobs"] = TopK(ids, lps)
    t = fields.target_prompt_logprobs
    if t is not None:
        kw["target_prompt_logprobs"] = np.where(
            t >= 0, out["targets"][:, : t.shape[1]], 0.0
        ).astype(np.float32)
    k = fields.prompt_alt_tokens_k
    if k:
        kw["prompt_alt_tokens"] = TopK(
            out["alt_ids"][:, :k].astype(np.int32) if n > 1 else np.zeros((0, k), np.int32),
            out["alt_lp"][:, :k].astype(np.float32) if n > 1 else np.zeros((0, k), np.float32),
        )
    return kw
