"""The engine's warm-up: every program an engine can run for a set of buckets, compiled up
front and run on padding (each decode loop's body a few steps per branch; extends only
when cheap, _extends), so that a first request runs as fast as later ones.

Owns the enumeration of that bounded set (engine_config.py's module docstring,
"Programs") over an EngineDevice's sizes. Every call writes nothing that a request reads (padding rows:
every page and state-row write is dropped); it must never run on an engine holding
requests (Engine.warmup checks) nor decide anything about requests.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import jax
import numpy as np

from jcp import batch as batch_lib
from jcp import mesh as mesh_lib
from jcp.adapter_state import host
from jcp.sample import layout as layout_lib
from jcp.sample import paged, programs
from jcp.sample.engine_config import DECODE_ROWS_STEP, MIN_CHUNK, PREFILL_ROWS, WINDOW_FLOOR, rungs
from jcp.sample.params import BASE, MAX_TOPK, STOP_WIDTH, PromptStatsCall, k_bucket
from jcp.sample.runner import EngineDevice, active_entries

# Draw kinds a request may take (greedy; drawn; drawn with top-k / top-p): one decode
# program serves them all (draws.sample_tokens picks at run time), so `draws` only checks
# the names its callers pass.
KINDS = ("greedy", "drawn", "filtered")


def warmup(
    device: EngineDevice,
    active: Sequence[int] = (1,),
    draws: Sequence[str] = KINDS,
    prompt_logprobs: Sequence[bool] = (False,),
    compute_logprobs: bool = False,
    stop_width: Sequence[int] = (STOP_WIDTH,),
    topk: Sequence[int] = (0,),
    prompt_stats: Sequence[tuple[int, int, int]] = (),
) -> int:
    """Compile, up front, the programs an engine (its EngineDevice) can run for these
    buckets -> how many it ran (device.program_keys then holds them). The bounded set:
    every prefill (extend) rows × chunk × table-pages rung × active-adapter bucket, every
    decode rows × table-pages rung × active bucket × stop-table width, every page-copy
    rung, and the cache-less prefill's stream buckets (min_stream … max(max_len,
    prefill_tokens), doubling) × active bucket for compute_logprobs (if compute_logprobs)
    and for each prompt_stats entry (topk_prompt_logprobs, target_prompt_logprobs width,
    prompt_alt_tokens_k) of the SDK prompt fields (each bucketed by params.k_bucket; a
    request's fields take the widest of those admitted with it). active: distinct adapters
    (the base model counts as one) per step, bucketed by runner.active_entries (1 and 2
    share one bucket). What is decided at run time inside one program needs no entry:
    prompt log-probs on or off (prompt_logprobs), the draw kind (draws: "greedy", "drawn",
    "filtered"), topk_sample_logprobs (topk) and the decode steps of a call; those
    arguments are only checked. Runs each program on padding (a decode loop's body
    WARM_STEPS steps per phase and draw branch; an extend only up to WARM_RUN_FLOPS), so
    later requests of those shapes compile nothing and the first runs as fast as later
    ones (a costly extend's first call within ~1.2× of its later ones, 1.5× for the
    largest)."""
    for d in draws:
        if d not in KINDS:
            raise ValueError(f"draws: {d!r} is not one of {sorted(KINDS)}")
    cap = device.runner.limits.max_adapters + 1
    a_lens = sorted({active_entries(a, cap) for a in active})
    before = set(device.program_keys)
    _extends(device, a_lens)
    variants = ([(0, 0, 0)] if compute_logprobs else []) + [
        tuple(k_bucket(int(k)) for k in v) for v in prompt_stats
    ]
    _cacheless(device, a_lens, variants)
    _decodes(device, a_lens, stop_width)
    z = device.sizes
    for n in rungs(z.b_local, WINDOW_FLOOR[0]):
        zero = np.zeros(z.groups * n, np.int32)
        device.copy(
            zero,
            np.full(z.groups * n, z.n_pages, np.int32),
            zero,
            np.full(z.groups * n, z.b_local, np.int32),
        )
    return len(device.program_keys - before)


def _padding(b: int, a: int) -> tuple[np.ndarray, np.ndarray]:
    """(active, index) of b padding rows with a active-adapter entries."""
    return layout_lib.active_index(np.full(b, layout_lib.PADDING), a, BASE)


# An extend program is run on padding at warm-up only up to this many flops (XLA's cost
# analysis of the compiled program); a costlier one is compiled (or loaded) only.
WARM_RUN_FLOPS = 2e9


def _extends(device: EngineDevice, a_lens: list[int]) -> None:
    """Every extend (chunked prefill) program: rows × chunk × table pages × active,
    compiled, and run without prompt log-probs if it costs at most WARM_RUN_FLOPS. A first
    run pays XLA:CPU's preparation of its fusions (_decode_runs), a fixed cost that is
    most of a small program's first call but a small part of a large one's: padding costs
    what real rows cost (its attention reads the whole table), and on the default engine
    of the tiny model the 7 extends over 2 GFLOP took 31 s of the 44 s that running every
    extend took, and a first call of one of them took 1.01-1.20× its third (the largest,
    256 rows × 256 tokens over 256 pages, 22 GFLOP: 22 s against 15 s). Their run-time branch
    (prompt log-probs) is left to the first request that wants them: running it on
    padding rows for every extend program took 30 s of the default engine's 65-s warm-up
    on a warm compilation cache."""
    z, slice_layers = device.sizes, device.runner.slice_layers
    for e_b in rungs(z.prefill_rows, PREFILL_ROWS[1]):
        b = z.groups * e_b
        for c in rungs(z.chunk_top, MIN_CHUNK):
            zero = np.zeros((b, c), np.int32)
            for m in z.table_rungs():
                for a in a_lens:
                    act, index = _padding(b, a)
                    rows = paged.ExtendRows(
                        zero,
                        zero,
                        np.zeros((b, c), bool),
                        np.zeros(b, np.int32),
                        index,
                        np.full((b, m), -1, np.int32),
                        np.full(b, z.b_local, np.int32),
                        np.zeros(b, bool),
                    )
                    modes = paged.ExtendModes(slice_layers)
                    if flops(device.extend_program(rows, modes, act)) <= WARM_RUN_FLOPS:
                        device.extend(rows, modes, act)


def flops(program) -> float:
    """XLA's cost analysis of a compiled program: its flops (0 when the backend gives
    none, so that the program counts as cheap)."""
    try:
        cost = program.cost_analysis()
    except Exception:  # noqa: BLE001 — no analysis: treat as cheap (run it)
        return 0.0
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    return float((cost or {}).get("flops", 0.0))


def _cacheless(device: EngineDevice, a_lens: list[int], variants: list[tuple]) -> None:
    """The cache-less prefills: compute_logprobs (no stats) and the SDK prompt fields, per
    stream bucket min_stream … max(max_len, prefill_tokens) (doubling)."""
    r, z = device.runner, device.sizes
    cap, x = r.limits.max_tokens_per_device, z.min_stream
    while variants:
        for a, (k, width, alt) in itertools.product(a_lens, dict.fromkeys(variants)):
            pb = padding_batch(r.dp, r.cp, min(x, cap), a, width)
            call = (
                PromptStatsCall(k, alt, np.zeros(1, np.float32), np.zeros((1, 2), np.uint32), (0,))
                if k or alt
                else None
            )
            device.note_prefill(pb, (k, alt))
            jax.tree.map(host, r.run_prefill(pb, with_logprobs=True, stats=call)[1])
        if x >= cap or x >= mesh_lib.pow2_at_least(max(z.max_len, z.prefill_tokens)):
            break
        x *= 2


def _decodes(device: EngineDevice, a_lens: list[int], stop_width: Sequence[int]) -> None:
    """Every decode program: rows × table pages × active × stop width, each run so that
    every part of its loop body runs once (_decode_runs)."""
    z, slice_layers = device.sizes, device.runner.slice_layers
    for w_b in rungs(z.b_local, WINDOW_FLOOR[0], DECODE_ROWS_STEP):
        b = z.groups * w_b
        for m, a, ns in itertools.product(z.table_rungs(), a_lens, stop_width):
            act, index = _padding(b, a)
            modes = paged.PagedDecodeModes(z.max_chunk, slice_layers, MAX_TOPK, ns)
            for rows in _decode_runs(b, index, ns, paged.phase_starts(m, z.page)):
                device.decode(
                    np.full((b, m), -1, np.int32), rows, modes, act, np.full(b, z.b_local, np.int32)
                )


# Decode steps of each warm-up call (_decode_runs).
WARM_STEPS = 4


def _decode_runs(b: int, index: np.ndarray, ns: int, starts: list[int]):
    """The DecodeRows of a decode program's warm-up calls: b live rows of WARM_STEPS steps
    (max_tokens; their page tables -1, so every write is dropped), per phase start (each
    phase is its own copy of the loop body), once all greedy and once mixed (drawn,
    truncated by top-k, with top-k log-probs): together every branch of the body runs,
    several times on every device. XLA:CPU prepares a GEMM fusion (YNNPACK) when it
    first runs it, ~5-25 ms, and again for each device that runs it at the same time (a
    pool per fusion). A warm-up whose rows were all done never ran the body: the first
    sampling round took 1.9× a steady one in process (1.4× with the body run one step)."""
    zero, steps = np.zeros(b, np.int32), np.full(b, WARM_STEPS, np.int32)
    mixed = np.arange(b) % 2 == 1
    for start in starts:
        for drawn in (False, True):
            yield programs.DecodeRows(
                zero,
                np.full(b, start, np.int32),
                zero,
                np.zeros(b, bool),
                zero,
                index,
                steps,
                np.where(drawn & mixed, 1.0, 0.0).astype(np.float32),
                np.where(drawn & mixed, 4, -1).astype(np.int32),
                np.ones(b, np.float32),
                drawn & mixed,
                steps,
                np.zeros((b, 2), np.uint32),
                layout_lib.stop_table([()] * b, ns),
            )


def padding_batch(
    dp: int, cp: int, length: int, active: int, target_width: int = 0
) -> batch_lib.PackedBatch:
    """A packed prefill batch of `length` rows per stream that holds only padding, with
    `active` adapter entries and, if target_width, [.., 1 + target_width] targets."""
    z = np.zeros((dp, cp, length), np.int32)
    targets = np.zeros(z.shape + (1 + target_width,), np.int32) if target_width else z
    return batch_lib.PackedBatch(
        tokens=z,
        targets=targets,
        segment=np.full((dp, cp, length), -1, np.int32),
        position=z,
        loss_id=z,
        floats={},
        spans=np.zeros((dp, cp, active, 2), np.int32),
        active=np.full(active, BASE, np.int32),
        num_slots=8,
        placements=(),
    )
