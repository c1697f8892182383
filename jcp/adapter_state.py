"""The adapter-state table: every slot's weights, gradient accumulator, AdamW moments and
step count, its scale, and the host-side description of each allocated slot.

This module is the only one that reads or writes slot arrays (through the programs of
jcp.adapter_tables, which nothing else calls). Its surface is small —
install, read, export, reset, accumulate, step — and is what the Trainer, checkpointing,
the sampler and the server use. It must never touch base weights, never change a slot
other than the one named (every write is `.at[slot].set`), and never leave a non-finite
value in any slot: a step whose result is not finite changes nothing.

Paged by rank: a table is {module: {"a": [P, L, I, r], "b": [P, L, r, O]}} (lm_head
without L) of P pages of rank r = page_rank(max_rank); an adapter of rank ρ holds ⌈ρ / r⌉
pages, listed in SlotMeta.page_GK (G slots × K = max_rank / r entries; an unused entry is
P, which reads zeros and is never written). So a slot costs what its rank costs, and the
number of pages — the device memory the table takes — is set apart from the number of
slots (`memory_bytes`). The compiled steps read the pages of their active slots only
(lora.take_active / add_active); one adapter's tree holds only its target modules at its
own rank ρ. Shapes: see the legend in jcp/mesh.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import heapq
import math
import types

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jcp import lora as lora_lib
from jcp import optim
from jcp.adapter_tables import (
    SlotHeader,
    clear_slot,
    copy_pages,
    put_rows,
    rank_padding,
    read_count,
    read_pages,
    sans_slot,
    take_rows,
    write_header,
    write_pages,
)
from jcp.config import QwenConfig
from jcp.errors import InputError
from jcp.mesh import device_memory, host, pow2_at_least, replicate
from jcp.program_cache import shared
from jcp.program_store import StoredPrograms

# The rank of one page of a slot table: the finest rank step a slot's memory follows.
PAGE_RANK = 8
# The four tables a slot holds in every page: weights, gradient accumulator, AdamW moments.
TABLES = 4


# adapter_memory="auto": this share of a device's free memory once the base model is placed.
AUTO_ADAPTER_MEMORY = 0.25


def auto_memory_bytes(mesh) -> int:
    """AUTO_ADAPTER_MEMORY of a device's free memory (mesh.device_memory)."""
    limit, used = device_memory(mesh)
    return int(AUTO_ADAPTER_MEMORY * (limit - used))


@shared(kept=256)
def _page_copier(sharding):
    """jit(copy_pages) for one table leaf's sharding, the leaf donated."""
    return jax.jit(copy_pages, donate_argnums=(0,), out_shardings=sharding)


@shared(kept=256)
def _leaf_reader(which: str, sharding):
    """jit(read_pages) for one table leaf's factor kind and sharding, the slot's factor
    replicated (readable on every process without a collective)."""
    return jax.jit(
        functools.partial(read_pages, which), out_shardings=NamedSharding(sharding.mesh, P())
    )


@shared(kept=256)
def _leaf_writer(which: str, page_rank: int, sharding):
    """jit(write_pages) for one table leaf's factor kind and sharding, the leaf donated."""
    return jax.jit(
        functools.partial(write_pages, which, page_rank),
        donate_argnums=(0,),
        out_shardings=sharding,
    )


def page_rank(max_rank: int) -> int:
    """A page's rank for slots of rank ≤ max_rank: the largest divisor of max_rank ≤ PAGE_RANK
    that is a power of two (max_rank / page_rank pages hold a max-rank slot)."""
    return math.gcd(max_rank, PAGE_RANK)


@dataclasses.dataclass(frozen=True)
class AdapterInfo:
    """Host-side description of one allocated slot."""

    rank: int
    alpha: float
    targets: tuple[str, ...]
    # lora.EXPERT_LORA parameterisation when an expert module is targeted, else None.
    expert_lora: str | None = None

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @property
    def shared_outer(self) -> bool:
        return self.expert_lora == "shared_outer"

    @property
    def tied_gate_up(self) -> bool:
        return self.expert_lora == "fused_gate_up"


@dataclasses.dataclass(frozen=True)
class SlotState:
    """One adapter on the device at its own rank (global arrays, any mesh): weights and
    AdamW moments as {module: {"a": [L, I, r], "b": [L, r, O]}} over its targets (the
    keys of lora.adapter_shapes); count its optimizer step count (replicated int32
    scalar). values: the same as host NumPy {"weights", "mu", "nu": {module: {key: array}},
    "count": int32 scalar}, on every process (for checksums, without a collective)."""

    weights: dict
    mu: dict
    nu: dict
    count: jax.Array
    values: dict


@dataclasses.dataclass(frozen=True)
class HostSlot:
    """One adapter moved off the device (AdapterState.offload): everything a slot holds —
    weights, accumulated gradient, AdamW moments as host NumPy {module: {"a": [L, I, r],
    "b": [L, r, O]}} at its own rank over its targets, and the step count — so that
    `restore` puts it back bit for bit."""

    info: AdapterInfo
    weights: dict
    grads: dict
    mu: dict
    nu: dict
    count: int

    @property
    def nbytes(self) -> int:
        return sum(
            x.nbytes
            for t in (self.weights, self.grads, self.mu, self.nu)
            for ab in t.values()
            for x in ab.values()
        )


@shared
def _make_zeros(cfg: QwenConfig, mesh, num_pages: int, page_rank: int, expert_lora_modes: tuple):
    """jit() -> one table of zeros: num_pages pages of page_rank (lora.slot_shapes),
    sharded by lora.slot_specs."""
    shapes = lora_lib.slot_shapes(cfg, num_pages, page_rank, expert_lora_modes)
    specs = lora_lib.slot_specs(cfg, expert_lora_modes)
    return jax.jit(
        lambda: jax.tree.map(
            lambda s: jnp.zeros(s, jnp.float32), shapes, is_leaf=lambda x: isinstance(x, tuple)
        ),
        out_shardings=jax.tree.map(lambda s: NamedSharding(mesh, s), specs),
    )


class AdapterState:
    """Slot arrays of up to `max_adapters` adapters of rank ≤ `max_rank` over one mesh, in
    pages (module docstring): `memory_bytes` of each device for the tables (None: room for
    every slot at max_rank).

    Public reads: `infos` (slot -> AdapterInfo), `weights` and `meta` (the tables the
    compiled steps consume), `read`, `export`, `tables`, `room`. Writes: `install`,
    `reset`, `accumulate`, `step`. Slot ids are the adapter ids the Trainer hands out.
    """

    def __init__(
        self,
        cfg: QwenConfig,
        mesh,
        max_adapters: int,
        max_rank: int,
        expert_lora_modes=lora_lib.EXPERT_LORA,
        memory_bytes: int | None = None,
    ):
        self.cfg, self.mesh = cfg, mesh
        self.max_adapters, self.max_rank = max_adapters, max_rank
        self.expert_lora_modes = tuple(expert_lora_modes)
        specs = lora_lib.slot_specs(cfg, self.expert_lora_modes)
        self._specs = specs
        self._shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
        rep = NamedSharding(mesh, P())
        self.page_rank = page_rank(max_rank)
        self.pages_per_slot = max_rank // self.page_rank
        self.page_bytes = page_bytes(cfg, mesh, self.page_rank, self.expert_lora_modes)
        self.num_pages = max_adapters * self.pages_per_slot
        if memory_bytes is not None:
            if memory_bytes < self.page_bytes * self.pages_per_slot:
                raise ValueError(
                    f"adapter memory {memory_bytes} bytes holds no adapter of rank "
                    f"{max_rank}: one takes {self.page_bytes * self.pages_per_slot} bytes "
                    "of each device"
                )
            self.num_pages = min(self.num_pages, memory_bytes // self.page_bytes)
        self._free_pages = list(range(self.num_pages))  # a heap: lowest pages first
        self._page_GK = np.full((max_adapters, self.pages_per_slot), self.num_pages, np.int32)
        zeros = _make_zeros(cfg, mesh, self.num_pages, self.page_rank, self.expert_lora_modes)
        self._weights, self._grads, self._mu, self._nu = zeros(), zeros(), zeros(), zeros()
        self._count = self._replicated(np.zeros(max_adapters, np.int32))
        self._meta = lora_lib.SlotMeta(
            *(self._replicated(np.zeros(max_adapters, np.float32)) for _ in range(3)),
            page_GK=self._replicated(self._page_GK),
        )
        self._infos: dict[int, AdapterInfo] = {}
        # Bumped by every write of a slot's weights (install, reset, step): a reader that
        # must not mix weights (the sampling engine) compares it before and after.
        self._versions = np.zeros(max_adapters, np.int64)

        tables = (self._shardings,) * 4 + (rep, rep)
        self._clear = jax.jit(clear_slot, donate_argnums=(0,), out_shardings=tables)
        self._write_header = jax.jit(write_header, donate_argnums=(0, 1), out_shardings=(rep, rep))
        self._take_rows = jax.jit(take_rows)
        self._put_rows = jax.jit(put_rows, donate_argnums=(0,), out_shardings=self._shardings)
        self._read_count = jax.jit(read_count, out_shardings=rep)
        # optim.make_optim_step's program, kept in the program store when it is on.
        self.optim_programs = StoredPrograms(optim.make_optim_step(mesh), "optim_step", (), mesh)

    def _replicated(self, x: np.ndarray):
        return replicate(self.mesh, x)

    # ------------------------------------------------------------------ reads

    @property
    def infos(self) -> types.MappingProxyType:
        """slot -> AdapterInfo of every allocated slot (read-only view)."""
        return types.MappingProxyType(self._infos)

    @property
    def weights(self) -> dict:
        """The weight table {module: {"a": [G, L, I, R], "b": [G, L, R, O]}} (read only)."""
        return self._weights

    @property
    def meta(self) -> lora_lib.SlotMeta:
        """Per-slot scale (alpha / rank, 0 for free slots) and expert mode, float32 [G];
        each slot's pages, int32 [G, K]."""
        return self._meta

    def pages_for(self, rank: int) -> int:
        """The pages an adapter of `rank` holds."""
        return -(-rank // self.page_rank)

    @property
    def free_pages(self) -> int:
        return len(self._free_pages)

    def room(self, rank: int) -> bool:
        """Whether an adapter of `rank` fits now: a free slot and its pages."""
        return len(self._infos) < self.max_adapters and self.pages_for(rank) <= self.free_pages

    def tables(self) -> dict:
        """Every table as global arrays, for snapshots and tests: weights, grads, mu, nu
        (pages), count [G], scale [G], shared [G], tied [G], pages [G, K]."""
        return {
            "weights": self._weights,
            "grads": self._grads,
            "mu": self._mu,
            "nu": self._nu,
            "count": self._count,
            "scale": self._meta.scale_G,
            "shared": self._meta.shared_G,
            "tied": self._meta.tied_G,
            "pages": self._meta.page_GK,
        }

    def version(self, slot: int) -> int:
        """A counter of the writes of `slot`'s weights (install, reset, optimizer step)."""
        return int(self._versions[slot])

    def free_slot(self) -> int:
        """The lowest free slot; InputError when all are in use."""
        for g in range(self.max_adapters):
            if g not in self._infos:
                return g
        raise InputError(
            f"all {self.max_adapters} adapter slots are in use; delete_adapter "
            "one or raise max_adapters"
        )

    def read(self, slot: int, which: str = "weights") -> dict:
        """One slot's weights, accumulated gradient or AdamW moment ("weights", "grads",
        "mu", "nu") as host NumPy at its own rank over its targets: {module: {"a": [L, I, r],
        "b": [L, r, O]}} (lora.adapter_shapes)."""
        info = self._infos[slot]
        table = {"weights": self._weights, "grads": self._grads, "mu": self._mu, "nu": self._nu}[
            which
        ]
        pages = self._pages_of(slot)
        return {
            m: {
                k: lora_lib.at_rank(k, host(self._read_leaf(m, k, table[m][k], pages)), info.rank)
                for k in lora_lib.expert_keys(m, info.expert_lora)
            }
            for m in info.targets
        }

    def _read_leaf(self, m: str, which: str, x_P, pages_K):
        """read_pages of one leaf, replicated: one program per leaf kind, whatever the
        adapter's rank and targets (so a tenant's new kind compiles nothing here)."""
        return _leaf_reader(which, self._shardings[m][which])(x_P, pages_K)

    def export(self, slot: int) -> SlotState:
        """One slot at its own rank as device arrays (for checkpoints), sharded like the
        table without its slot axis: `read` of each table (cut to its rank on the host),
        placed shard by shard — no program of its own, so no rank or target set compiles
        one."""
        info = self._infos[slot]
        layout = self.layout(info)
        values = {which: self.read(slot, which) for which in ("weights", "mu", "nu")}
        count = self._read_count(self._count, slot)  # offload's program, replicated
        values["count"] = host(count)

        def placed(tree):
            return {
                m: {
                    k: jax.make_array_from_callback(
                        x.shape, layout[m][k].sharding, lambda index, x=x: x[index]
                    )
                    for k, x in ab.items()
                }
                for m, ab in tree.items()
            }

        return SlotState(
            placed(values["weights"]), placed(values["mu"]), placed(values["nu"]), count, values
        )

    def layout(self, info: AdapterInfo) -> dict:
        """{module: {"a"/"b": ShapeDtypeStruct at the adapter's rank, sharded}} of its
        targets: what `export` returns and `install` accepts, for restoring files."""
        shapes = lora_lib.adapter_shapes(self.cfg, info.rank, info.targets, info.expert_lora)
        return {
            m: {
                k: jax.ShapeDtypeStruct(
                    s, jnp.float32, sharding=NamedSharding(self.mesh, sans_slot(self._specs[m][k]))
                )
                for k, s in ks.items()
            }
            for m, ks in shapes.items()
        }

    # ------------------------------------------------------------------ writes

    def install(
        self,
        slot: int,
        info: AdapterInfo,
        weights: dict,
        mu: dict | None = None,
        nu: dict | None = None,
        count: int = 0,
        grads: dict | None = None,
    ) -> None:
        """Put an adapter in `slot`: weights (and optionally AdamW moments, step count and
        accumulated gradient) at its own rank over its targets (NumPy or device arrays);
        the accumulator is zero unless given, untargeted modules and rank padding are zero."""
        self._check_tree(weights, info, "weights")
        for name, tree in (("mu", mu), ("nu", nu), ("grads", grads)):
            if tree is not None:
                self._check_tree(tree, info, name)
        trees = {"weights": weights, "grads": grads, "mu": mu, "nu": nu}
        self._place(slot, info, count, lambda pages: self._write_factors(pages, trees))

    def copy(self, src: int, dst: int) -> None:
        """Put a copy of slot src's weights in slot dst (fresh moments, no gradient, step
        count 0), page by page on the device: one program per table leaf shape and page
        count, whatever the adapter's rank and targets."""
        info = self._infos[src]
        src_K = self._page_GK[src][: self.pages_for(info.rank)].copy()
        self._place(dst, info, 0, lambda pages: self._copy_weights(info, src_K, pages))

    def _place(self, slot: int, info: AdapterInfo, count: int, write) -> None:
        """Give `slot` the pages an adapter of info.rank needs (InputError, before any
        device work, when they are not free), write(pages) its factors there, then its
        header. The pages are free, so zero (clear_slot): only the factors written differ
        from zero. If write fails, the pages are zeroed and freed again."""
        need = self.pages_for(info.rank)
        held = self.pages_for(self._infos[slot].rank) if slot in self._infos else 0
        if need > self.free_pages + held:
            raise InputError(
                f"adapter memory is full: an adapter of rank {info.rank} needs {need} "
                f"pages of rank {self.page_rank}, {self.free_pages} of {self.num_pages} are "
                "free; delete or offload an adapter, or give the tables more memory"
            )
        if slot in self._infos:  # replaced: its pages are zeroed and freed first
            self.reset(slot)
        row = self._page_GK[slot].copy()
        row[:need] = [heapq.heappop(self._free_pages) for _ in range(need)]
        try:
            write(row[:need])
        except BaseException:  # its pages zeroed and freed again: the tables stay whole
            self._clear_pages(slot, row)
            for page in row[:need]:
                heapq.heappush(self._free_pages, int(page))
            raise
        self._count, self._meta = self._write_header(
            self._count,
            self._meta,
            SlotHeader(
                slot=np.int32(slot),
                count=np.int32(count),
                scale=np.float32(info.scale),
                shared=np.float32(info.shared_outer),
                tied=np.float32(info.tied_gate_up),
                row_K=row,
            ),
        )
        self._page_GK[slot] = row
        self._infos[slot] = info
        self._versions[slot] += 1

    def _copy_weights(self, info: AdapterInfo, src_K: np.ndarray, dst_K: np.ndarray) -> None:
        src, dst = self._replicated(src_K), self._replicated(dst_K)
        for m in info.targets:
            for which in lora_lib.expert_keys(m, info.expert_lora):
                x = self._weights[m][which]
                leaf = _page_copier(self._shardings[m][which])(x, src, dst)
                self._weights = {**self._weights, m: {**self._weights[m], which: leaf}}

    def _write_factors(self, pages: np.ndarray, trees: dict) -> None:
        """write_pages of every factor given (trees: table name -> {module: {key: array}}
        or None) into the pages `pages`; each table keeps every leaf written so far."""
        pages_K = self._replicated(pages)
        for name, tree in trees.items():
            attr = "_" + name
            for m, ab in (tree or {}).items():
                for which, v in ab.items():
                    table = getattr(self, attr)
                    leaf = self._write_leaf(m, which, table[m][which], pages_K, v)
                    setattr(self, attr, {**table, m: {**table[m], which: leaf}})

    def _write_leaf(self, m: str, which: str, x_P, pages_K, v):
        """write_pages of one leaf: a host array comes zero-padded to whole pages, so its
        program does not depend on the adapter's rank (a device array is padded in the
        program, one per shape: every caller in jcp passes host arrays)."""
        if not isinstance(v, jax.Array):
            v = np.asarray(v)
            pad = rank_padding(which, v.shape, pages_K.shape[0], self.page_rank)
            v = np.pad(v.astype(x_P.dtype, copy=False), pad)
        return _leaf_writer(which, self.page_rank, self._shardings[m][which])(x_P, pages_K, v)

    def _pages_of(self, slot: int) -> jax.Array:
        return self._replicated(self._page_GK[slot])

    def offload(self, slot: int) -> HostSlot:
        """Move one adapter to host memory and free its slot. Rank padding and untargeted
        modules of a slot are always zero (install pads with zeros; their gradients and
        AdamW updates are zero), so the adapter's own-rank arrays are all of its state and
        `restore` of the result continues bit for bit."""
        info = self._infos[slot]
        out = HostSlot(
            info,
            *(self.read(slot, w) for w in ("weights", "grads", "mu", "nu")),
            count=int(host(self._read_count(self._count, slot))),
        )
        self.reset(slot)
        return out

    def restore(self, slot: int, saved: HostSlot) -> None:
        """Put an offloaded adapter back into the free `slot`, bit for bit."""
        if slot in self._infos:
            raise InputError(f"slot {slot} is in use; restore needs a free slot")
        self.install(slot, saved.info, saved.weights, saved.mu, saved.nu, saved.count, saved.grads)

    def _check_tree(self, tree: dict, info: AdapterInfo, what: str) -> None:
        want = {m: {ab: s.shape for ab, s in v.items()} for m, v in self.layout(info).items()}
        have = {m: {ab: tuple(np.shape(x)) for ab, x in v.items()} for m, v in tree.items()}
        if have != want:
            raise InputError(f"adapter {what}: expected shapes {want}, got {have}")

    def reset(self, slot: int) -> None:
        """Free a slot: its pages, accumulator, moments, count and scale all zero, its
        pages back in the free list."""
        row = self._page_GK[slot].copy()  # not a view: the row is rewritten below, in flight
        self._clear_pages(slot, row)
        for page in row[row < self.num_pages]:
            heapq.heappush(self._free_pages, int(page))
        self._page_GK[slot] = self.num_pages
        del self._infos[slot]
        self._versions[slot] += 1

    def _clear_pages(self, slot: int, row: np.ndarray) -> None:
        """clear_slot: the pages `row` of every table zero, slot's header that of a free
        slot."""
        empty = np.full_like(row, self.num_pages)
        zero = np.float32(0.0)
        tables = (self._weights, self._grads, self._mu, self._nu, self._count, self._meta)
        (self._weights, self._grads, self._mu, self._nu, self._count, self._meta) = self._clear(
            tables, row, SlotHeader(np.int32(slot), np.int32(0), zero, zero, zero, empty)
        )

    def rows_bucket(self, slots) -> np.ndarray:
        """The distinct `slots`, sorted, then the first repeated up to a power of two (at
        most max_adapters) entries: the rows accumulating copies, so that its programs are
        one per bucket (1, 2, 4, …), not one per number of adapters in a call."""
        rows = sorted(set(int(s) for s in slots))
        n = max(len(rows), min(pow2_at_least(len(rows)), self.max_adapters))
        return np.asarray(rows + rows[:1] * (n - len(rows)), np.int32)

    @contextlib.contextmanager
    def accumulating(self, slots, keep: bool = True):
        """Add gradients into the accumulators of `slots`, all or nothing.

        Yields accumulate(fn): fn(grads table) -> (new grads table, result), run with the
        table donated; returns result. If the with-block raises, or in any case when not
        `keep` (a run for its programs only: Trainer.warmup), the accumulators of `slots`
        are restored bit for bit (from a copy of those rows taken on entry).
        """
        rows = self._replicated(self._page_GK[self.rows_bucket(slots)].reshape(-1))
        saved = self._take_rows(self._grads, rows)

        def accumulate(fn):
            self._grads, result = fn(self._grads)
            return result

        try:
            yield accumulate
        except BaseException:
            self._grads = self._put_rows(self._grads, rows, saved)
            raise
        if not keep:
            self._grads = self._put_rows(self._grads, rows, saved)

    def step(self, slot: int, hp_6: np.ndarray) -> dict:
        """One AdamW step of `slot` on its accumulated gradient, which is then zeroed.

        hp_6: float32 (learning_rate, beta1, beta2, eps, weight_decay, grad_clip_norm).
        If the gradient or the resulting weights or moments are not finite, weights,
        moments and count stay bit-identical, the accumulator is cleared, and InputError
        names the adapter and the cause.
        """
        (self._weights, self._grads, opt, metrics) = self.optim_programs(
            self._weights,
            self._grads,
            optim.OptState(mu=self._mu, nu=self._nu, count=self._count),
            self._replicated(np.asarray(slot, np.int32)),
            # One missing page more (reads zeros, never written): a gather of one page is a
            # slice of the table, which XLA then copies whole before writing the table in
            # place (measured: one table's bytes of temporaries at max_rank = page rank).
            self._replicated(np.append(self._page_GK[slot], self.num_pages).astype(np.int32)),
            self._replicated(hp_6),
        )
        self._mu, self._nu, self._count = opt.mu, opt.nu, opt.count
        self._versions[slot] += 1
        m = {k: host(v).item() for k, v in metrics.items()}
        if not m["grad_finite"]:
            raise InputError(
                f"adapter {slot}: the accumulated gradient is not finite; nothing "
                "was applied and the accumulated gradient was cleared"
            )
        if not m["applied"]:
            raise InputError(
                f"adapter {slot}: the AdamW update is not finite in float32 "
                f"(learning_rate {float(hp_6[0]):g}, grad_norm {m['grad_norm']:g});"
                " nothing was applied and the accumulated gradient was cleared"
            )
        return {
            "grad_norm": float(m["grad_norm"]),
            "learning_rate": float(m["learning_rate"]),
            "step": int(m["step"]),
        }


def page_bytes(cfg: QwenConfig, mesh, rank: int, modes=lora_lib.EXPERT_LORA) -> int:
    """Bytes of one page of rank `rank` of every table (TABLES of them, float32) on one
    device of `mesh`."""
    shapes = lora_lib.slot_shapes(cfg, 1, rank, modes)
    specs = lora_lib.slot_specs(cfg, modes)
    return TABLES * sum(
        4 * math.prod(NamedSharding(mesh, specs[m][k]).shard_shape(shape))
        for m, ks in shapes.items()
        for k, shape in ks.items()
    )
