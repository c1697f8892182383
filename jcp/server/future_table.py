"""The futures of requests: request id -> eventual result, and download-URL tokens.

Owns `FutureTable` (each tenant's futures, bounded, completed from the worker thread and
awaited on the event loop; the completion log of each sampling session that
retrieve_futures reads) and `UrlTokens` (the expiring per-file tokens of external-weights
downloads). No HTTP here, and never jax or the worker.
"""

from __future__ import annotations

import asyncio
import secrets
import threading
import time
import uuid
from collections import OrderedDict

from jcp.server.edge import Limits, Refused
from jcp.server.state import NotFound

# Bounds of each tenant's download tokens and of each sampling session's completion log.
MAX_URL_TOKENS = 4096
KEEP_COMPLETIONS = 20_000


class Entry:
    """One request's future: its tenant, completion event and result."""

    __slots__ = ("owner", "event", "result", "extra", "group")

    def __init__(self, owner: str, extra: dict, group: str | None = None):
        self.owner, self.extra, self.group = owner, extra, group
        self.event = asyncio.Event()
        self.result = None


class FutureTable:
    """request id -> its eventual result; completed from any thread.

    Bounded per tenant (`per_tenant` entries): a tenant's new request evicts that tenant's
    oldest completed result, never a pending one and never another tenant's; with all of
    its entries pending it is refused (429, which the SDK retries after a pause)."""

    def __init__(self, per_tenant: int = Limits.futures):
        self.per_tenant = per_tenant
        self._entries: dict[str, Entry] = {}
        self._pending: dict[str, set[str]] = {}  # owner -> pending ids
        self._done: dict[str, OrderedDict[str, None]] = {}  # owner -> completed ids, oldest first
        self._lock = threading.Lock()
        self.loop: asyncio.AbstractEventLoop | None = None
        # (owner, group) -> completions [(cursor, request id, "finished" | "failed")], for
        # retrieve_futures; a group is a sampling session.
        self._logs: dict[tuple, list] = {}
        self._cursor = 0

    def new(self, owner: str, group: str | None = None, **extra) -> str:
        rid = f"req-{uuid.uuid4().hex}"
        with self._lock:
            pending = self._pending.setdefault(owner, set())
            done = self._done.setdefault(owner, OrderedDict())
            if len(pending) + len(done) >= self.per_tenant:
                if not done:
                    raise Refused(
                        429,
                        f"{len(pending)} requests of this tenant are pending "
                        f"(--max-futures {self.per_tenant}); retry when some "
                        "complete",
                    )
                del self._entries[done.popitem(last=False)[0]]
            self._entries[rid] = Entry(owner, extra, group)
            pending.add(rid)
        return rid

    def get(self, rid: str, owner: str) -> Entry:
        with self._lock:
            e = self._entries.get(rid)
        if e is None or e.owner != owner:
            raise NotFound(f"request {rid!r} not found")
        return e

    def count(self, owner: str) -> int:
        with self._lock:
            return len(self._pending.get(owner, ())) + len(self._done.get(owner, ()))

    def complete(self, rid: str, result: tuple) -> None:
        with self._lock:
            e = self._entries.get(rid)
            if e is None or rid not in self._pending[e.owner]:
                return
            self._pending[e.owner].discard(rid)
            self._done[e.owner][rid] = None

        def done():
            e.result = result
            e.event.set()
            if e.group is not None:
                self._cursor += 1
                log = self._logs.setdefault((e.owner, e.group), [])
                log.append(
                    (
                        self._cursor,
                        rid,
                        "failed" if result[0] == "error" else "finished",
                        len(result[1]) if result[0] == "proto" else None,
                    )
                )
                del log[:-KEEP_COMPLETIONS]

        if self.loop is not None:
            self.loop.call_soon_threadsafe(done)

    def forget(self, rid: str, owner: str) -> None:
        """Drop a completed request's entry (an OpenAI route read its result); a pending one
        stays."""
        with self._lock:
            if self._done.get(owner, {}).pop(rid, 0) is None:
                del self._entries[rid]

    def fail_pending(self, message: str) -> None:
        """Complete every pending request with `message` (category "server")."""
        with self._lock:
            pending = [rid for ids in self._pending.values() for rid in ids]
        for rid in pending:
            self.complete(rid, ("error", message, "server"))

    def forget_groups(self, owner: str, groups: list[str]) -> None:
        """Drop the completion logs of sampling sessions the store forgot (any thread)."""

        def forget():
            for g in groups:
                self._logs.pop((owner, g), None)

        if self.loop is not None:
            self.loop.call_soon_threadsafe(forget)
        else:
            forget()

    def completions(self, owner: str, group: str, after: int) -> tuple[list[dict], int]:
        """Completions of a group after cursor `after` -> (FutureCompletion dicts, cursor).
        Runs on the event loop (like `done`), so no lock is needed."""
        log = self._logs.get((owner, group), [])
        new = [c for c in log if c[0] > after]
        out = [
            {
                "state": st,
                "request_id": rid,
                **({"response_payload_uncompressed_size": n} if st == "finished" else {}),
            }
            for _, rid, st, n in new
        ]
        return out, (new[-1][0] if new else after)


class UrlTokens:
    """Download-URL tokens -> (tenant, run, checkpoint id, file, expiry), at most
    `per_tenant` per tenant: a tenant's new token drops that tenant's expired tokens, then
    its oldest — never another tenant's. Used on the event loop only."""

    def __init__(self, per_tenant: int = MAX_URL_TOKENS):
        self.per_tenant = per_tenant
        self._tenant: dict[str, str] = {}  # token -> tenant
        self._mine: dict[str, OrderedDict[str, tuple]] = {}  # tenant -> tokens, oldest first

    def new(self, owner: str, run: str, ckpt: str, file: str, expires: float) -> str:
        tok = secrets.token_urlsafe(32)
        mine = self._mine.setdefault(owner, OrderedDict())
        mine[tok] = (owner, run, ckpt, file, expires)
        self._tenant[tok] = owner
        now = time.time()
        while mine and (len(mine) > self.per_tenant or next(iter(mine.values()))[4] < now):
            del self._tenant[mine.popitem(last=False)[0]]
        return tok

    def get(self, token: str) -> tuple | None:
        owner = self._tenant.get(token)
        return None if owner is None else self._mine[owner].get(token)
