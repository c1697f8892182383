"""The host arrays of an engine's device calls, built from admission's records: which row
each group or sequence takes on its device, the page tables, and the rows of one extend,
decode or page-copy call, every dimension bucketed (engine_config.py's module docstring,
"Programs").

Pure host (NumPy): it decides nothing (which groups prefill, which sequences decode and for how
many steps is admission.py's) and touches no device (runner.py's EngineDevice puts the
arrays on the mesh and runs the programs over them). Tested with NumPy alone
(tests/sample/test_engine_rows.py).

Shapes: B = rows of a call (groups · rows per device), C = prefill chunk, M = table pages
per row.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from jcp.sample import layout as layout_lib
from jcp.sample import paged as paged_lib
from jcp.sample import programs
from jcp.sample.engine_config import MIN_CHUNK, PREFILL_ROWS, WINDOW_FLOOR, EngineSizes
from jcp.sample.params import STOP_WIDTH

# (adapter of each row [B] (layout.PADDING where none), the rows holding sequences) ->
# (active adapters, each row's index into them): Runner.active_index.
ActiveIndex = Callable[[np.ndarray, list[int]], tuple[np.ndarray, np.ndarray]]


def rows_at(per_device: list[list], width: int) -> dict[int, int]:
    """Row index (by id) of each item when every device's items fill its first rows of a
    [groups · width] batch."""
    return {id(x): g * width + i for g, items in enumerate(per_device) for i, x in enumerate(items)}


def page_table(seqs, at: dict[int, int], b: int, m: int) -> np.ndarray:
    """int32 [B, M]: each sequence's pages in its row (at), −1 elsewhere."""
    table = np.full((b, m), -1, np.int32)
    for seq in seqs:
        table[at[id(seq)], : len(seq.pages)] = seq.pages[:m]
    return table


def copy_rows(
    copies: list, z: EngineSizes
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(src, dst, rec_src, rec_dst) of one page-copy call (EngineDevice.copy) over this
    step's forks, [(device, src, dst, "page" | "row")] (admission.Admission.fork): each
    device's copies in its first entries of a rows rung, dst n_pages / b_local (none)
    elsewhere."""
    per = {
        kind: [[c for c in copies if c[0] == g and c[3] == kind] for g in range(z.groups)]
        for kind in ("page", "row")
    }
    n = layout_lib.ladder(max(len(x) for k in per.values() for x in k), z.b_local, WINDOW_FLOOR[0])
    out = {}
    for kind, none in (("page", z.n_pages), ("row", z.b_local)):
        src = np.zeros(z.groups * n, np.int32)
        dst = np.full(z.groups * n, none, np.int32)
        for g, items in enumerate(per[kind]):
            for i, (_, a, b, _) in enumerate(items):
                src[g * n + i], dst[g * n + i] = a, b
        out[kind] = (src, dst)
    return (*out["page"], *out["row"])


def extend_rows(
    work: list, z: EngineSizes, active_index: ActiveIndex
) -> tuple[paged_lib.ExtendRows, np.ndarray, dict[int, int]]:
    """(rows, active adapters, row of each group by id) of one extend call over work,
    [(group, positions)] (admission.Admission.prefill_work; pages grown): each device's
    groups in its first rows, every dimension bucketed."""
    per = [[] for _ in range(z.groups)]
    for group, _ in work:
        per[group.seqs[0].g].append(group)
    e_b = layout_lib.ladder(max(len(x) for x in per), z.prefill_rows, PREFILL_ROWS[1])
    c_len = layout_lib.ladder(max(c for _, c in work), z.chunk_top, MIN_CHUNK)
    m = z.table_width(max(len(g.seqs[0].pages) for g, _ in work))
    b = z.groups * e_b
    at = rows_at(per, e_b)
    tokens = np.zeros((b, c_len), np.int32)
    targets = np.zeros((b, c_len), np.int32)
    valid = np.zeros((b, c_len), bool)
    start = np.zeros(b, np.int32)
    slot = np.full(b, z.b_local, np.int32)
    want_lp = np.zeros(b, bool)
    adapter = np.full(b, layout_lib.PADDING, np.int64)
    for group, c in work:
        req, i, f = group.seqs[0].req, at[id(group)], group.filled
        tokens[i, :c] = req.prompt[f : f + c]
        targets[i, :c] = req.prompt[f + 1 : f + c + 1]
        valid[i, :c] = True
        start[i] = f
        want_lp[i] = req.plp is not None
        adapter[i] = req.adapter
        if z.hybrid:
            slot[i] = group.seqs[0].row
    at_seq = {id(g.seqs[0]): at[id(g)] for g, _ in work}
    table = page_table([g.seqs[0] for g, _ in work], at_seq, b, m)
    active, index = active_index(adapter, [at[id(g)] for g, _ in work])
    rows = paged_lib.ExtendRows(tokens, targets, valid, start, index, table, slot, want_lp)
    return rows, active, at


def decode_rows(
    live: list, n_steps: int, z: EngineSizes, active_index: ActiveIndex
) -> tuple[np.ndarray, programs.DecodeRows, np.ndarray, np.ndarray, dict[int, int]]:
    """(table, rows, active adapters, state rows, row of each sequence by id) of one
    decode call of n_steps over the live sequences (admission.Seq; pages grown):
    each device's sequences in its first rows, their tables M pages wide, each
    bucketed (engine_config.py's module docstring, "Programs"). One program serves every
    n_steps ≤ max_chunk, draw kind and topk_sample_logprobs: they are run-time values
    (rows.steps, the rows' parameters, rows.want_topk) under static bounds (max_chunk
    outputs, params.MAX_TOPK top-k columns)."""
    per = [[] for _ in range(z.groups)]
    for seq in live:
        per[seq.g].append(seq)
    w_b = z.rows_bucket(max(len(x) for x in per))
    m = z.table_width(max(len(x.pages) for x in live))
    b = z.groups * w_b
    at = rows_at(per, w_b)
    token = np.zeros(b, np.int32)
    position = np.zeros(b, np.int32)
    done = np.ones(b, bool)
    count = np.zeros(b, np.int32)
    max_tokens = np.ones(b, np.int32)
    temperature = np.zeros(b, np.float32)
    top_k = np.full(b, -1, np.int32)
    top_p = np.ones(b, np.float32)
    want_topk = np.zeros(b, bool)
    keys = np.zeros((b, 2), np.uint32)
    slot = np.full(b, z.b_local, np.int32)
    adapter = np.full(b, layout_lib.PADDING, np.int64)
    stops = [()] * b
    for seq in live:
        req, i, p = seq.req, at[id(seq)], seq.req.params
        if z.hybrid:
            slot[i] = seq.row
        c = len(seq.tokens)
        token[i] = seq.tokens[-1] if c else req.prompt[-1]
        position[i], count[i], done[i] = req.n + c, c, False
        max_tokens[i], temperature[i] = p["max_tokens"], p["temperature"]
        top_k[i], top_p[i] = p["top_k"], p["top_p"]
        want_topk[i] = req.fields.topk_sample_logprobs > 0
        keys[i] = req.keys[seq.j]
        adapter[i], stops[i] = req.adapter, p["stop"]
    rows_live = [at[id(x)] for x in live]
    active, index = active_index(adapter, rows_live)
    rows = programs.DecodeRows(
        token,
        position,
        np.zeros(b, np.int32),
        done,
        count,
        index,
        max_tokens,
        temperature,
        top_k,
        top_p,
        want_topk,
        np.full(b, n_steps, np.int32),
        keys,
        layout_lib.stop_table(stops, STOP_WIDTH),
    )
    return page_table(live, at, b, m), rows, active, slot, at
