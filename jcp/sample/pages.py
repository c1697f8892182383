"""The host side of the engine's paged KV cache: per device, which pages are free, held,
reserved or cached, and the keys that name a prompt's pages in the prefix cache.

Owns the free lists, reference counts, reservations, the prefix-cache index and its
least-recently-used order (PagePool), and the chained page hash (page_keys). Pure host
(Python lists and NumPy, tested in tests/sample/test_sample_policy.py); it must never create or
read a device array — the pages themselves live in paged.Pool (paged.py).

Prefix cache: every full page of a prefilled prompt is registered under a hash chained
over (adapter slot, its version, the request's salt, the previous page's hash, the page's
tokens); a later prompt with the same adapter, salt and leading pages on the same device
takes those pages (reference counted) and prefills only the rest. The salt partitions the
cache (jcp-serve salts by tenant: whether a prompt hits — and so how fast it is served —
never depends on another tenant's prompts); requests without one share one partition.
Pages no sequence holds stay cached and are evicted least recently used when a page is
needed. A hit gives the same tokens and log-probs as a miss (the K/V of a position depend
on the tokens up to it only).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque

import numpy as np


class PagePool:
    """The host side of the paged cache: per device, a free list, reference counts,
    reservations and the prefix cache (hash -> page, LRU of unreferenced cached pages).

    available(g): pages device g can still promise (free + evictable − reserved).
    """

    def __init__(self, groups: int, pages: int):
        self.pages = pages
        self.free = [deque(range(pages)) for _ in range(groups)]
        # Python lists, not an array: a step takes and releases thousands of pages one by
        # one, and a NumPy scalar update costs several times a list's.
        self.ref = [[0] * pages for _ in range(groups)]
        self.held = [0] * groups  # pages with ref > 0, per device
        self.reserved = [0] * groups
        self.index: list[dict[bytes, int]] = [{} for _ in range(groups)]
        self.key_of: list[dict[int, bytes]] = [{} for _ in range(groups)]
        self.logprobs: list[dict[int, np.ndarray]] = [{} for _ in range(groups)]
        self.lru: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(groups)]
        self.hits = self.lookups = 0  # pages found / pages looked up

    def available(self, g: int) -> int:
        return len(self.free[g]) + len(self.lru[g]) - self.reserved[g]

    def used(self, g: int) -> int:
        """Pages some sequence holds on device g."""
        return self.held[g]

    def alloc(self, g: int) -> int:
        """A fresh page (from the free list, else the least recently used cached page)."""
        if self.free[g]:
            p = self.free[g].popleft()
        else:
            p, _ = self.lru[g].popitem(last=False)
            del self.index[g][self.key_of[g].pop(p)]
            self.logprobs[g].pop(p, None)
        self.ref[g][p] = 1
        self.held[g] += 1
        return p

    def take(self, g: int, p: int) -> None:
        ref = self.ref[g]
        if ref[p] == 0:
            self.lru[g].pop(p)
            self.held[g] += 1
        ref[p] += 1

    def release(self, g: int, p: int) -> None:
        ref = self.ref[g]
        ref[p] -= 1
        if ref[p] == 0:
            self.held[g] -= 1
            if p in self.key_of[g]:
                self.lru[g][p] = None
            else:
                self.free[g].append(p)

    def lookup(self, g: int, keys: list[bytes], need_logprobs: bool) -> list[int]:
        """The pages of the longest cached prefix of `keys` on device g (with prompt
        log-probs stored, if need_logprobs)."""
        out = []
        for k in keys:
            p = self.index[g].get(k)
            if p is None or (need_logprobs and p not in self.logprobs[g]):
                break
            out.append(p)
        return out

    def register(self, g: int, key: bytes, p: int, logprobs: np.ndarray | None) -> None:
        if key in self.index[g] or p in self.key_of[g]:
            if logprobs is not None and self.index[g].get(key) == p:
                self.logprobs[g][p] = logprobs
            return
        self.index[g][key] = p
        self.key_of[g][p] = key
        if logprobs is not None:
            self.logprobs[g][p] = logprobs


def page_keys(
    prompt: np.ndarray, adapter: int, version: int, page: int, salt: bytes = b""
) -> list[bytes]:
    """The chained hash of every full page of prompt[:-1] (the prefilled positions). salt:
    the partition of the prefix cache these pages belong to (jcp-serve: the tenant), so
    that keys of different salts never meet; b"" keeps the unsalted keys."""
    h = np.array([adapter, version], np.int64).tobytes()
    if salt:  # a fixed-length digest: no salt is a prefix of another's key
        h += hashlib.blake2b(salt, digest_size=16, person=b"jcp-prefix-salt").digest()
    out = []
    for i in range((len(prompt) - 1) // page):
        h = hashlib.blake2b(
            h + np.asarray(prompt[i * page : (i + 1) * page], np.int64).tobytes(), digest_size=16
        ).digest()
        out.append(h)
    return out
