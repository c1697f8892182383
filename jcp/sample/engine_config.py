"""The continuous-batching engine's settings and the sizes and buckets they imply.

Owns EngineConfig (what a caller chooses, validated before anything is built) and
EngineSizes (the numbers the admission policy, the device arrays and the warm-up derive
from it and the mesh: rows per device, table widths, page counts, every bucket ladder).
Pure host, tested in tests/sample/test_sample_policy.py; it must never touch a device.

Programs: every dynamic dimension of the engine's device programs is bucketed to a few
values (layout.ladder rungs, steps of 4 from the top unless said): decode rows per device
(b_local, b_local / 2, … ≥ 8), table pages (max_len / page, … ≥ 64 / page, and
long_len / page, ÷ 4, … > max_len / page for long sequences), prefill rows per
device (min(64, b_local), ÷ 4, … ≥ 4), prefill chunk (pow2(prefill_tokens) capped at
max_len, ÷ 4, … ≥ 16), active adapters (powers of two from 2, runner.active_entries),
page copies (rows rungs). Run-time values inside one program, not program dimensions:
decode steps per call (max_chunk, ÷ 4, … ≥ chunk: a bound of the loop, outputs max_chunk
wide), the draw kind (draws.sample_tokens), topk_sample_logprobs (MAX_TOPK columns,
computed only when a row asks) and prompt log-probs (extend computes them only when a row
asks). Stop tables have one width, params.STOP_WIDTH ids (longer stop lists widen to a
power of two; jcp-serve refuses them).
"""

from __future__ import annotations

import dataclasses

from jcp.mesh import pow2_at_least
from jcp.sample.layout import ladder
from jcp.sample.params import is_int

# The smallest decode window: live rows per device, cache positions (the module docstring,
# "Programs"). Decode reads every weight once per step whatever the rows, so a
# few more rows cost little while each window compiled costs tens of seconds.
WINDOW_FLOOR = (8, 64)
PREFILL_ROWS = (64, 4)  # prefill rows per device: the most per step, the smallest rung
MIN_CHUNK = 16  # the smallest prefill chunk bucket
# Decode rows per device step down by 2 (b_local, b_local / 2, … ≥ 8): a decode call's
# time grows with its rows on CPU, and ÷ 4 rungs ran up to 4× padding (257 sequences on
# 2 devices decoded 512 rows each: 1.03 s instead of ~0.3 s).
DECODE_ROWS_STEP = 2


def rungs(full: int, floor: int, step: int = 4) -> list[int]:
    """Every value layout.ladder(n, full, floor, step) takes, largest first."""
    out = [full]
    while out[-1] > floor:
        out.append(max(floor, -(-out[-1] // step)))
    return out


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """What an Engine is sized for (engine.py's module docstring explains each policy).
    Engine(sampler, slots=…, …) builds one from its keywords; None fields take defaults
    that depend on the sampler (EngineSizes.of)."""

    slots: int = 64
    """Most sequences decoding at once: a multiple of dp·cp, slots / (dp·cp) per device."""
    max_len: int = 256
    """Positions per sequence that the cache and the usual table widths are sized for."""
    chunk: int = 8
    """Decode steps per device call while other work waits; requests join and leave
    between calls."""
    prefill_tokens: int | None = None
    """Most prompt tokens prefilled per step over all prompts (None: the sampler's
    max_tokens_per_device · dp)."""
    max_chunk: int | None = None
    """Most decode steps per device call when nothing waits (None: 4 · chunk; at least
    chunk)."""
    page_size: int = 16
    """Positions per page of the paged cache."""
    pages: int | None = None
    """Pages per device (None: what slots × max_len positions would take)."""
    prefix_cache: bool = True
    """Reuse cached prompt pages (always off for a hybrid model)."""
    long_len: int | None = None
    """Most positions of one sequence, prompt − 1 + max_tokens (None: max_len; at least
    max_len); the table rungs above max_len's serve the longer ones."""

    def __post_init__(self):
        for name in (
            "slots",
            "max_len",
            "chunk",
            "page_size",
            "max_chunk",
            "long_len",
            "prefill_tokens",
            "pages",
        ):
            v = getattr(self, name)
            if v is None and name in ("max_chunk", "long_len", "prefill_tokens", "pages"):
                continue
            if not is_int(v) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")


@dataclasses.dataclass(frozen=True)
class EngineSizes:
    """An EngineConfig resolved for one mesh and model: every count the engine's host
    policy and device arrays use. groups: devices along the sequence axes (dp·cp);
    b_local: decode rows per device; page: positions per page; max_pages / long_pages:
    table entries of a max_len / long_len sequence; n_pages: pages per device; seq_cap:
    the most positions of a sequence the engine takes; prefill_rows: prompts prefilled per
    device and step; chunk_top: the largest prefill chunk bucket; min_stream: the least
    stream of a cache-less prefill (compute_logprobs, the SDK prompt fields); hybrid: a
    Gated DeltaNet model (a recurrent-state row per sequence, no prefix cache)."""

    groups: int
    slots: int
    b_local: int
    max_len: int
    long_len: int
    page: int
    max_pages: int
    long_pages: int
    n_pages: int
    seq_cap: int
    chunk: int
    max_chunk: int
    prefill_tokens: int
    prefill_rows: int
    chunk_top: int
    min_stream: int
    hybrid: bool
    prefix_cache: bool

    @staticmethod
    def of(
        config: EngineConfig, groups: int, default_prefill_tokens: int, hybrid: bool
    ) -> EngineSizes:
        """config on `groups` devices along the sequence axes; default_prefill_tokens
        stands in for prefill_tokens None. ValueError when slots do not divide."""
        c = config
        if c.slots % groups:
            raise ValueError(f"slots ({c.slots}) must be a multiple of dp·cp = {groups}")
        b_local = c.slots // groups
        max_pages = -(-c.max_len // c.page_size)
        n_pages = c.pages if c.pages is not None else b_local * max_pages
        long_len = c.max_len if c.long_len is None else max(c.max_len, c.long_len)
        prefill_tokens = (
            c.prefill_tokens if c.prefill_tokens is not None else default_prefill_tokens
        )
        max_chunk = 4 * c.chunk if c.max_chunk is None else c.max_chunk
        return EngineSizes(
            groups=groups,
            slots=c.slots,
            b_local=b_local,
            max_len=c.max_len,
            long_len=long_len,
            page=c.page_size,
            max_pages=max_pages,
            long_pages=-(-long_len // c.page_size),
            n_pages=n_pages,
            seq_cap=min(long_len, n_pages * c.page_size),
            chunk=c.chunk,
            max_chunk=max(c.chunk, max_chunk),
            prefill_tokens=prefill_tokens,
            prefill_rows=min(PREFILL_ROWS[0], b_local),
            chunk_top=max(MIN_CHUNK, min(pow2_at_least(prefill_tokens), pow2_at_least(c.max_len))),
            min_stream=max(16, pow2_at_least(c.max_len) // 4),
            hybrid=bool(hybrid),
            prefix_cache=bool(c.prefix_cache) and not hybrid,
        )

    def pages_per_seq(self, n: int, max_tokens: int) -> int:
        """Pages of a sequence of n prefilled positions and max_tokens new ones."""
        return -(-(n + max_tokens) // self.page)

    def table_width(self, n: int) -> int:
        """Table pages of a call whose longest sequence holds n pages: the rungs of max_len
        (max_len / page, ÷ 4, … ≥ 64 / page), above them those of long_len."""
        if n <= self.max_pages:
            return ladder(n, self.max_pages, max(1, WINDOW_FLOOR[1] // self.page))
        return ladder(n, self.long_pages, self.max_pages)

    def table_rungs(self) -> list[int]:
        """Every value table_width takes."""
        return (
            rungs(self.max_pages, max(1, WINDOW_FLOOR[1] // self.page))
            + rungs(self.long_pages, self.max_pages)[:-1]
        )

    def rows_bucket(self, n: int) -> int:
        """Decode rows per device of a call whose fullest device holds n live rows."""
        return ladder(n, self.b_local, WINDOW_FLOOR[0], DECODE_ROWS_STEP)

    def decode_rungs(self) -> list[int]:
        """Decode steps a device call may take: max_chunk, max_chunk / 4, … ≥ chunk."""
        return rungs(self.max_chunk, self.chunk)
