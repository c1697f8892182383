"""The engine's admission policy: which device, decode rows and pages each request takes,
when pages are taken and given back, and how many decode steps a device call runs.

Owns Admission, which places, forks, grows and releases the host records of requests
(requests.py: Request, its samples Seq, their per-device Group; re-exported here) over
the PagePool (pages.py), refuses at submit what could never fit (check_fits) and picks
the decode length (decode_len). Pure host, tested on plain records in
tests/sample/test_sample_policy.py; it must never create or read a device array, nor run a
program — engine.py drives it, runner.py turns its records into device arrays.

Memory (paged.py): each device holds `pages` pages of `page_size` positions. A sequence's
positions 0, 1, … live in the pages its table lists, so it holds ⌈real length / page⌉
pages, not max_len rows. The num_samples of one prompt on one device share the prompt's
full pages read-only; its partial last page is copied once per further sample when
prefill ends (copy on write at the fork). Admission reserves a request's worst case
(prompt pages + ⌈(prompt + max_tokens) / page⌉ per sample, less shared pages) so a running
sequence never runs out of pages, but pages are taken only as the sequence grows, and a
sequence that stops early gives back its pages and reservation. A request that does not
fit waits; one that could never fit is refused at submit.

Tenants (`admit_fair`, Request.tenant): waiting requests are admitted round robin over
tenants — the tenant admitted least recently first —, first come, first served within
a tenant (a tenant's head that does not fit holds back that tenant's later requests, no
one else's). While `active` > 1 tenants use the engine, a tenant that holds rows already
is admitted more only within 1/active of the rows and of the pages (reservations
counted, shared prompt pages once per sample), so one tenant's burst cannot fill the
batch while another's request waits. A tenant's first request is admitted whatever its
size (when it fits), so no request starves: one request larger than a share holds the
rows and pages it takes until it ends (nothing is preempted). One tenant alone is served
exactly first come, first served.

Light steps (`step_tenants`): a step need not serve every row. While several tenants hold
rows and the light ones — each holding fewer than an equal split of the live rows (1/n)
— would run in a rows bucket at most 1/LIGHT_STEP_RATIO of the whole batch's, the steps
alternate between the light tenants' rows alone and the others' rows alone, the light
first: a tenant whose one short request sits beside another's 64 long ones gets its
prefill and decode chunk in a step the size of its own rows, not of hers, and she loses
only those small steps. While a step leaves out a light tenant (one holding no rows too,
between its requests), it decodes chunk / LIGHT_STEP_RATIO steps (`decode_len`), so that
the light tenant's next request waits for that, not a whole chunk. A step that serves some
tenants prefills and decodes only their groups and rows (`prefill_work`, `decode_len`,
`serving`); a row's draws depend on its own key and token count only, and the chunk
length changes none either, so this changes no result.

Decode chunks (`decode_len`): a step's device loop runs `chunk` decode steps while other
work waits — a prompt still prefilling, or step(hurry=True) from a caller whose queue
holds requests (jcp-serve) —, so a newcomer's first token waits for at most one such
chunk; when a request waits for rows or pages, the largest rung no live row's max_tokens
ends before (it may join as soon as rows free); when nothing waits, the least rung by which
every live row's max_tokens has ended, so a batch with nothing else to do decodes to its
end in one call — unless rows of different ages share it and the rows left once the
shortest end fit a smaller rows bucket: then the step ends there too (the device loop has
a fixed shape and computes ended rows until its last row ends; measured in
docs/engine.md). Rungs: max_chunk (default 4 · chunk), max_chunk / 4, … ≥ chunk; the loop
stops early once every row has ended (stop tokens). Bound: a request arriving during a
long chunk waits for at most max_chunk decode steps of the running batch, then its own
prefill. The chunk length changes no result (draws depend on a sequence's key and token
count only).
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Collection

import numpy as np

from jcp.errors import InputError
from jcp.sample.engine_config import EngineSizes
from jcp.sample.layout import ladder
from jcp.sample.pages import PagePool, page_keys
from jcp.sample.params import sequence_keys
from jcp.sample.requests import Group, Request, Seq

# A step serves the light tenants' rows alone when their rows bucket is at most
# 1/LIGHT_STEP_RATIO of the whole batch's (the module docstring, "Light steps"): such a
# step costs the others about that fraction of one of theirs.
LIGHT_STEP_RATIO = 4


class Admission:
    """Which device, decode rows and pages each request's samples take, and when pages
    are taken and given back (the module docstring; pages.py's, "Prefix cache").

    pool: the PagePool; free_rows: per device, a heap of free recurrent-state rows (a
    hybrid model); rows_used: per device, sequences holding a decode row; prefilling:
    groups whose prompt is not all cached (FIFO); decoding: sequences that decode.
    """

    def __init__(self, sizes: EngineSizes):
        self.sizes = sizes
        self.pool = PagePool(sizes.groups, sizes.n_pages)
        self.free_rows = self.all_rows()
        self.rows_used = [0] * sizes.groups
        self.prefilling: list[Group] = []
        self.decoding: list[Seq] = []
        self._turns = itertools.count()
        self._admitted: dict[str, int] = {}  # tenant -> its last admission (round robin)
        self._light_next = True  # a split batch's next step serves its light tenants
        # How many tenants use the engine, as the last admit_fair was told (its `active`):
        # this step's, since a step admits first (prefill_work's "Light steps" bound).
        self.users = 1

    def all_rows(self) -> list[list[int]]:
        """Every device's state rows, all free (heaps)."""
        return [list(range(self.sizes.b_local)) for _ in range(self.sizes.groups)]

    def reset(self) -> None:
        """An empty pool and free rows (the device pages were lost; every request holding
        pages has been ended)."""
        self.pool = PagePool(self.sizes.groups, self.sizes.n_pages)
        self.free_rows = self.all_rows()

    def page_keys(self, req: Request) -> list[bytes]:
        """req's prompt page keys ([] without the prefix cache)."""
        if not self.sizes.prefix_cache:
            return []
        return page_keys(req.prompt, req.adapter, req.version, self.sizes.page, req.salt)

    # ------------------------------------------------------------------ admission

    def admit(self, req: Request) -> bool:
        """Place req's samples, take their rows, cached pages and reservations, and start
        their prefill (or fork at once when the prompt is all cached) -> False, changing
        nothing, when it must wait."""
        keys = self.page_keys(req)
        plan = self.place(req, keys)
        if plan is None:
            return False
        req.keys = sequence_keys(req.params["seed"], 0, req.num_samples)
        req.plp = np.full(len(req.prompt), np.nan, np.float32) if req.extend_logprobs else None
        j = 0
        for g, k, hits in plan:
            group = Group([])
            for _ in range(k):
                seq = Seq(req, j, g)
                j += 1
                group.seqs.append(seq)
                req.seqs.append(seq)
            self.start_group(req, group, g, hits, keys)
            req.groups.append(group)
        return True

    def admit_fair(self, waiting: deque, active: int = 1) -> list[Request]:
        """Admit from `waiting` round robin over tenants within their shares (the module
        docstring, "Tenants"; active: how many tenants use the engine) -> the requests
        admitted, in order, removed from `waiting`."""
        self.users = active
        out, blocked = [], set()
        while True:
            heads: dict[str, Request] = {}
            for req in waiting:
                if req.tenant not in blocked and req.tenant not in heads:
                    heads[req.tenant] = req
            if not heads:
                return out
            t = min(heads, key=lambda t: (self._admitted.get(t, -1), heads[t].rid))
            req = heads[t]
            if not (self.within_share(req, active) and self.admit(req)):
                blocked.add(t)
                continue
            waiting.remove(req)
            self._admitted[t] = next(self._turns)
            out.append(req)

    def held(self, tenant: str) -> tuple[int, int]:
        """(decode rows, pages held or reserved) of the tenant's admitted sequences."""
        seqs = self.decoding + [x for gr in self.prefilling for x in gr.seqs]
        mine = [x for x in seqs if x.req.tenant == tenant and not x.done]
        return len(mine), sum(len(x.pages) + x.reserve for x in mine)

    def within_share(self, req: Request, active: int) -> bool:
        """Whether req may be admitted within its tenant's share: 1/active of the rows and
        pages, or any size while its tenant holds nothing (so nothing starves)."""
        if active <= 1:
            return True
        s = self.sizes
        rows, pages = self.held(req.tenant)
        if rows == 0:
            return True
        rows += req.num_samples
        pages += req.num_samples * s.pages_per_seq(req.n, req.params["max_tokens"])
        return rows <= s.slots // active and pages <= s.groups * s.n_pages // active

    # ------------------------------------------------------------------ light steps

    def rows_by_tenant(self) -> dict[str, list[int]]:
        """tenant -> its rows (decoding or prefilling sequences) on each device."""
        out: dict[str, list[int]] = {}
        seqs = self.decoding + [x for gr in self.prefilling for x in gr.seqs]
        for x in seqs:
            if not x.done:
                out.setdefault(x.req.tenant, [0] * self.sizes.groups)[x.g] += 1
        return out

    def split(self) -> frozenset | None:
        """The light tenants when the batch splits (the module docstring, "Light steps"),
        else None."""
        per = self.rows_by_tenant()
        if len(per) < 2:
            return None
        total = sum(map(sum, per.values()))
        light = frozenset(t for t, rows in per.items() if sum(rows) * len(per) < total)
        if not light:
            return None

        def bucket(tenants) -> int:
            return self.sizes.rows_bucket(
                max(sum(per[t][g] for t in tenants) for g in range(self.sizes.groups))
            )

        if bucket(light) * LIGHT_STEP_RATIO > bucket(per):
            return None
        return light

    def step_tenants(self, commit: bool = True) -> frozenset | None:
        """Whose rows this step serves (the module docstring, "Light steps"): None, every
        tenant's; else the light tenants' or the others', alternating, the light first.
        commit=False: only say what the next step would serve."""
        light = self.split()
        if light is None:
            serve, light_next = None, True
        else:
            heavy = frozenset(self.rows_by_tenant()) - light
            serve, light_next = (light, False) if self._light_next else (heavy, True)
        if commit:
            self._light_next = light_next
        return serve

    def serving(self, tenants: Collection[str] | None) -> list[Seq]:
        """The decoding sequences a step serving `tenants` (None: all) decodes."""
        if tenants is None:
            return list(self.decoding)
        return [x for x in self.decoding if x.req.tenant in tenants]

    def check_fits(self, n: int, max_tokens: int, num_samples: int) -> None:
        """Refuse (InputError) num_samples sequences of n prefilled positions + max_tokens
        that the engine could never hold: too many positions, samples or pages."""
        sizes, prompt = self.sizes, f"prompt of {n + 1} tokens + max_tokens {max_tokens}"
        if n + max_tokens > sizes.long_len:
            raise InputError(
                f"{prompt} exceed the engine's {sizes.long_len} positions per sequence"
            )
        if num_samples > sizes.slots:
            raise InputError(f"num_samples {num_samples} exceeds the engine's {sizes.slots} slots")
        if sizes.pages_per_seq(n, max_tokens) > sizes.n_pages:
            raise InputError(
                f"{prompt} need more than the engine's {sizes.n_pages} pages per device"
            )
        most = self.most_samples(n, max_tokens)
        if num_samples > most:
            raise InputError(
                f"num_samples {num_samples} of a {prompt} need more pages than the engine "
                f"holds (at most {most} such samples at once)"
            )

    def most_samples(self, n: int, max_tokens: int) -> int:
        """The most samples of one request (n prefilled positions, max_tokens new ones) the
        engine could ever hold at once: on every device, as many rows as its whole page
        pool gives them beside one copy of the prompt's full pages. A request of more
        could never be placed (it would wait at the head of the queue for ever)."""
        full = n // self.sizes.page
        own = self.sizes.pages_per_seq(n, max_tokens) - full
        per_device = (
            self.sizes.b_local
            if own == 0
            else min(self.sizes.b_local, max(self.sizes.n_pages - full, 0) // own)
        )
        return self.sizes.groups * per_device

    def need(self, req: Request, g: int, k: int, hits: list[int]) -> int:
        """Pages device g must promise for k samples of req sharing a prefill that takes
        `hits` cached pages."""
        full = req.n // self.sizes.page
        own = self.sizes.pages_per_seq(req.n, req.params["max_tokens"]) - full
        cached_idle = sum(1 for p in hits if self.pool.ref[g][p] == 0)
        return (full - len(hits)) + cached_idle + k * own

    def place(self, req: Request, keys) -> list[tuple[int, int, list[int]]] | None:
        """[(device, samples, cached pages)] for req, or None if it must wait: all samples
        on one device when one fits them (the device with the longest cached prefix
        first), else spread over devices."""
        groups, b_local = self.sizes.groups, self.sizes.b_local
        hits = {
            g: self.pool.lookup(g, keys, req.extend_logprobs) if keys else [] for g in range(groups)
        }
        order = sorted(range(groups), key=lambda g: (-len(hits[g]), -self.pool.available(g), g))

        def rows(g):
            return b_local - self.rows_used[g]

        def fits(g, k):
            return rows(g) >= k and self.need(req, g, k, hits[g]) <= self.pool.available(g)

        for g in order:
            if fits(g, req.num_samples):
                return [(g, req.num_samples, hits[g])]
        plan, left = [], req.num_samples
        for g in order:
            k = min(left, rows(g))
            while k and not fits(g, k):
                k -= 1
            if k:
                plan.append((g, k, hits[g]))
                left -= k
            if not left:
                return plan
        return None

    def start_group(self, req: Request, group: Group, g: int, hits: list[int], keys) -> None:
        """Give group (k samples of req on device g) its rows, cached pages and
        reservations; queue its prefill, or fork it when the prompt is all cached."""
        page = self.sizes.page
        full = req.n // page
        own = self.sizes.pages_per_seq(req.n, req.params["max_tokens"]) - full
        lead = group.seqs[0]
        self.pool.lookups += len(keys)
        self.pool.hits += len(hits)
        for p in hits:
            self.pool.take(g, p)
        lead.pages = list(hits)
        lead.reserve = (full - len(hits)) + own
        for seq in group.seqs[1:]:
            seq.reserve = own
        self.pool.reserved[g] += sum(s.reserve for s in group.seqs)
        self.rows_used[g] += len(group.seqs)
        if self.sizes.hybrid:
            for seq in group.seqs:
                seq.row = heapq.heappop(self.free_rows[g])  # the lowest free row
        group.filled = len(hits) * page
        if req.plp is not None:
            for i, p in enumerate(hits):
                req.plp[i * page + 1 : (i + 1) * page + 1] = self.pool.logprobs[g][p]
        if group.filled >= req.n:
            self.fork(group, [])
        else:
            self.prefilling.append(group)

    # ------------------------------------------------------------------ prefill

    def prefill_work(self, tenants: Collection[str] | None = None) -> list[tuple[Group, int]]:
        """[(group, positions)] of this step's prefill: one chunk of every prefilling
        prompt (of `tenants`' only, when given: "Light steps"), FIFO, within
        prefill_tokens in all and prefill_rows per device — prefill_tokens /
        LIGHT_STEP_RATIO while the step leaves out a light tenant of the `users` using the
        engine (as decode_len's chunk), so that its next request waits for a quarter of
        the others' prefill, not all of it."""
        budget, s = self.sizes.prefill_tokens, self.sizes
        if self.leaves_light(tenants, self.users):
            budget = max(1, budget // LIGHT_STEP_RATIO)
        taken = [0] * s.groups
        work = []
        for group in self.prefilling:
            lead = group.seqs[0]
            if budget <= 0:
                break
            if tenants is not None and lead.req.tenant not in tenants:
                continue
            if taken[lead.g] >= s.prefill_rows:
                continue
            c = min(lead.req.n - group.filled, budget, s.chunk_top)
            budget -= c
            taken[lead.g] += 1
            work.append((group, c))
        return work

    def end_prefill(self, group: Group, copies: list) -> None:
        """group's prompt is all cached: register its full pages in the prefix cache and
        fork its samples (copies as fork)."""
        if self.sizes.prefix_cache:
            lead, page = group.seqs[0], self.sizes.page
            req = lead.req
            for i, key in enumerate(self.page_keys(req)):
                lp = None if req.plp is None else req.plp[i * page + 1 : (i + 1) * page + 1].copy()
                self.pool.register(lead.g, key, lead.pages[i], lp)
        self.fork(group, copies)
        self.prefilling.remove(group)

    def grow(self, seq: Seq, positions: int) -> None:
        """Give seq pages for its first `positions` positions (from its reservation)."""
        while len(seq.pages) * self.sizes.page < positions:
            seq.pages.append(self.pool.alloc(seq.g))
            seq.reserve -= 1
            self.pool.reserved[seq.g] -= 1

    def fork(self, group: Group, copies: list) -> None:
        """Prefill over: every further sample takes the prompt's full pages (shared) and a
        copy of its partial last page (appended to copies as (device, src, dst, "page")) —
        and, for a hybrid model, a copy of the prompt's final recurrent state into its own
        state row ((device, src, dst, "row"))."""
        req, lead = group.seqs[0].req, group.seqs[0]
        full = req.n // self.sizes.page
        for seq in group.seqs[1:]:
            for p in lead.pages[:full]:
                self.pool.take(seq.g, p)
            seq.pages = list(lead.pages[:full])
            if req.n % self.sizes.page:
                self.grow(seq, req.n)
                copies.append((seq.g, lead.pages[full], seq.pages[full], "page"))
            if self.sizes.hybrid:
                copies.append((seq.g, lead.row, seq.row, "row"))
        for seq in group.seqs:
            seq.decoding = True
            self.decoding.append(seq)

    # ------------------------------------------------------------------ ending

    def release(self, seq: Seq) -> None:
        """Give back a sequence's pages, reservation, decode row and state row."""
        for p in seq.pages:
            self.pool.release(seq.g, p)
        seq.pages = []
        self.pool.reserved[seq.g] -= seq.reserve
        seq.reserve = 0
        if not seq.done:
            seq.done = True
            self.rows_used[seq.g] -= 1
            if seq.row is not None:
                heapq.heappush(self.free_rows[seq.g], seq.row)
                seq.row = None

    def remove(self, req: Request) -> None:
        """Release every sequence of req and forget its groups and sequences."""
        for seq in req.seqs:
            self.release(seq)
        self.prefilling = [gr for gr in self.prefilling if gr.seqs[0].req is not req]
        self.decoding = [x for x in self.decoding if x.req is not req]

    # ------------------------------------------------------------------ decode length

    def light_beside(self, tenants: Collection[str] | None, active: Collection[str]) -> bool:
        """Whether a step serving `tenants` (None: every tenant holding rows) leaves out a
        light tenant of `active` (the tenants using the engine): one holding fewer than an
        equal split of the live rows — none, between its requests ("Light steps")."""
        return self.leaves_light(tenants, len(set(active) | set(self.rows_by_tenant())))

    def leaves_light(self, tenants: Collection[str] | None, users: int) -> bool:
        """light_beside for `users` tenants using the engine, by count: those holding no
        rows are light and left out by every step (a step serves tenants holding rows)."""
        per = self.rows_by_tenant()
        users = max(users, len(per))
        served = set(per) if tenants is None else set(tenants) & set(per)
        total = sum(map(sum, per.values()))
        if users < 2 or not total:
            return False
        if users > len(per):  # a tenant holding no rows, between its requests
            return True
        return any(sum(rows) * users < total for t, rows in per.items() if t not in served)

    def decode_len(
        self,
        hurry: bool = False,
        waiting: bool = False,
        tenants: Collection[str] | None = None,
        active: Collection[str] = (),
    ) -> int:
        """Decode steps of this step's device call (the module docstring, "Decode chunks"):
        `chunk` while other work waits (hurry, or a prompt still prefilling); else, if a request
        waits for rows or pages (waiting), the largest rung that no live row's max_tokens
        ends before (a row may end there and free its row); else, if the rows left once the
        shortest have ended fit a smaller rows bucket, that same rung (the batch shrinks
        there: a fixed-shape device loop computes ended rows until its last row ends, so
        rows that joined later would otherwise keep the early ones' rows running); else the
        least rung by which every live row's max_tokens has ended. Rungs: max_chunk,
        max_chunk / 4, … ≥ chunk (layout.ladder); the device loop stops early once every
        row has ended. tenants: a step serving only theirs ("Light steps"; None: all).
        active: the tenants using the engine; while the step leaves out a light one
        (light_beside), at most chunk / LIGHT_STEP_RATIO steps, so that its next request
        waits for a quarter of a chunk of the others' rows."""
        s = self.sizes
        if active and self.light_beside(tenants, active):
            return max(1, s.chunk // LIGHT_STEP_RATIO)
        decoding = self.serving(tenants)
        prefilling = [
            gr for gr in self.prefilling if tenants is None or gr.seqs[0].req.tenant in tenants
        ]
        if hurry or prefilling or not decoding:
            return s.chunk
        left = [seq.req.params["max_tokens"] - len(seq.tokens) for seq in decoding]
        before_shortest = max([r for r in s.decode_rungs() if r <= min(left)] or [s.chunk])
        if waiting:
            return before_shortest
        if min(left) < max(left):
            every, rest = [0] * s.groups, [0] * s.groups
            for seq, n in zip(decoding, left):
                every[seq.g] += 1
                rest[seq.g] += n > min(left)
            if s.rows_bucket(max(rest)) < s.rows_bucket(max(every)):
                return before_shortest
        return ladder(min(max(left), s.max_chunk), s.max_chunk, s.chunk)
