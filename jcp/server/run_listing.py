"""The REST reads of jcp-serve's state store: runs and checkpoints as the SDK sees them.

Owns the answers of the training-run and checkpoint routes (`training_run(s)`,
`checkpoints`, `search_checkpoints`, `checkpoint_folder`), TTL changes, deletion and the
TTL sweep (`expired_folders`). `RunListing` is one part of jcp.server.state.StateStore,
over the index of jcp.server.run_index. Never jax.
"""

from __future__ import annotations

import contextlib
import datetime
import heapq
import os
import shutil
import time

from jcp.server.run_index import CHECKPOINT_TYPES, atomic_json, expired, number
from jcp.server.store_errors import NotFound


def _iso(t: float | None) -> str | None:
    return None if t is None else datetime.datetime.fromtimestamp(t, datetime.UTC).isoformat()


class RunListing:
    """The StateStore's listings, TTLs and deletions (module docstring)."""

    def _owned_run(self, run: str, owner: str) -> dict:
        """The owner.json of a run `owner` owns (NotFound otherwise)."""
        run_dir = self._run_dir(run)
        with self._lock:
            rec = self._runs.get(run)
        meta = None if rec is None or rec.owner != owner else self._read_meta(run_dir)
        if meta is None:
            raise NotFound(f"training run {run!r} not found")
        return meta

    def _checkpoints(self, run: str) -> list[dict]:
        """Every live checkpoint of a run as the SDK's Checkpoint, oldest first."""
        run_dir = self._run_dir(run)
        with self._lock:
            rec = self._runs.get(run)
            items = list(rec.checkpoints.items()) if rec is not None else []
        out = [
            _checkpoint(run, cid, c, rec.base_model)
            for cid, c in items
            if not expired(c) and os.path.isdir(os.path.join(run_dir, cid))
        ]
        return sorted(out, key=lambda c: c["time"] or "")

    def search_checkpoints(
        self,
        owner: str,
        user_metadata: dict,
        checkpoint_type: str | None,
        base_models: list[str] | None,
        limit: int,
        after: tuple[datetime.datetime, str] | None,
    ) -> tuple[list[dict], tuple[datetime.datetime, str] | None]:
        """One page of `owner`'s live checkpoints that match, newest first -> (the SDK's
        Checkpoints, the (time, tinker path) of the page's last one, or None once nothing
        follows it). Order and cursor are (creation time to the microsecond, as listings
        write it, then tinker path), both descending; `after` resumes below that key.
        Reads the memory index of that tenant's runs only, and the disk for the page."""
        want = None if base_models is None else set(base_models)
        with self._lock:
            found = [
                (_when(c.get("time")), f"tinker://{run}/{cid}", run, cid, c, rec.base_model)
                for run in self._owned.get(owner, ())
                for rec in (self._runs[run],)
                if want is None or rec.base_model in want
                for cid, c in rec.checkpoints.items()
                if not expired(c)
                and (
                    checkpoint_type is None
                    or CHECKPOINT_TYPES[cid.split("/")[0]] == checkpoint_type
                )
                and _has(c.get("user_metadata"), user_metadata)
            ]
        found.sort(key=lambda f: f[:2], reverse=True)
        if after is not None:
            found = [f for f in found if f[:2] < after]
        page, last = [], None
        for f in found:
            if len(page) == limit:
                return page, last
            if os.path.isdir(os.path.join(self.state_dir, "runs", f[2], f[3])):
                page.append(_checkpoint(*f[2:]))
                last = f[:2]
        return page, None

    def training_run(self, run: str, owner: str) -> dict:
        """The SDK's TrainingRun of a run `owner` owns."""
        meta = self._owned_run(run, owner)
        ckpts = self._checkpoints(run)
        last = {
            t: next((c for c in reversed(ckpts) if c["checkpoint_type"] == t), None)
            for t in ("training", "sampler")
        }
        seen = max(
            [meta.get("created", 0.0)]
            + [os.path.getmtime(os.path.join(self._run_dir(run), "owner.json"))]
        )
        return {
            "training_run_id": run,
            "base_model": meta.get("base_model", ""),
            "model_owner": owner,
            "is_lora": True,
            "corrupted": False,
            "lora_rank": meta.get("lora_rank"),
            "last_request_time": _iso(seen),
            "last_checkpoint": last["training"],
            "last_sampler_checkpoint": last["sampler"],
            "user_metadata": meta.get("user_metadata"),
        }

    def training_runs(self, owner: str, offset: int, limit: int) -> dict:
        """A page of `owner`'s runs, newest first (reads only that tenant's runs)."""
        with self._lock:
            runs = sorted(
                ((self._runs[r].created, r) for r in self._owned.get(owner, ())), reverse=True
            )
        page = []
        for _, r in runs[offset : offset + limit]:
            with contextlib.suppress(NotFound):  # forgotten meanwhile (an empty run reused)
                page.append(self.training_run(r, owner))
        return {
            "training_runs": page,
            "cursor": {"offset": offset, "limit": limit, "total_count": len(runs)},
        }

    def checkpoints(self, run: str, owner: str) -> dict:
        self._owned_run(run, owner)
        return {"checkpoints": self._checkpoints(run)}

    def checkpoint_folder(self, run: str, ckpt: str, owner: str) -> str:
        """The folder of checkpoint `ckpt` ("<kind>/<name>") of a run `owner` owns."""
        kind, _, name = ckpt.partition("/")
        if kind not in CHECKPOINT_TYPES:
            raise NotFound(f"checkpoint {ckpt[:200]!r} not found")
        return self.resolve(f"tinker://{run}/{kind}/{name}", owner, kind)[0]

    def set_ttl(self, run: str, ckpt: str, owner: str, ttl_seconds) -> None:
        self.checkpoint_folder(run, ckpt, owner)
        with self._lock:
            rec = self._runs[run]
            if ckpt not in rec.checkpoints:  # deleted meanwhile
                raise NotFound(f"checkpoint {ckpt!r} not found")
            entry = dict(rec.checkpoints[ckpt])
            entry["expires_at"] = None if ttl_seconds is None else time.time() + ttl_seconds
            self._record(run, ckpt, entry)

    def delete_folder(self, folder: str) -> None:
        """Delete a checkpoint folder (the worker calls this, so no load reads it meanwhile)
        and its record; its bytes leave the tenant's storage."""
        kind_dir = os.path.dirname(folder)
        run = os.path.basename(os.path.dirname(kind_dir))
        cid = f"{os.path.basename(kind_dir)}/{os.path.basename(folder)}"
        shutil.rmtree(folder, ignore_errors=True)
        with self._lock:
            rec = self._runs.get(run)
            if rec is not None and cid in rec.checkpoints:
                new = {k: v for k, v in rec.checkpoints.items() if k != cid}
                atomic_json(os.path.join(self._run_dir(run), "checkpoints.json"), new)
                self._count(rec.owner, rec.checkpoints[cid], -1)
                rec.checkpoints = new
            sids = self._forget_samplers(
                [s for s, r in self.samplers.items() if r.folder == folder]
            )
        if sids and rec is not None:
            self.on_forget_samplers(rec.owner, sids)

    def expired_folders(self) -> list[str]:
        """Folders of checkpoints whose TTL has passed (the worker deletes them): pops the
        TTL heap, so it reads only what expired."""
        out, now = [], time.time()
        with self._lock:
            while self._ttl and self._ttl[0][0] <= now:
                exp, run, cid = heapq.heappop(self._ttl)
                rec = self._runs.get(run)
                c = rec.checkpoints.get(cid) if rec is not None else None
                if (
                    c is not None
                    and c.get("expires_at") is not None
                    and float(c["expires_at"]) == exp
                ):
                    out.append(os.path.join(self.state_dir, "runs", run, cid))
        return out


def _checkpoint(run: str, cid: str, c: dict, base_model: str) -> dict:
    """A recorded checkpoint as the SDK's Checkpoint (0.39 adds base_model)."""
    return {
        "checkpoint_id": cid,
        "checkpoint_type": CHECKPOINT_TYPES[cid.split("/")[0]],
        "time": _iso(c.get("time")),
        "tinker_path": f"tinker://{run}/{cid}",
        "size_bytes": c.get("size_bytes", 0),
        "public": False,
        "user_metadata": c.get("user_metadata"),
        "expires_at": _iso(c.get("expires_at")),
        "base_model": base_model or None,
    }


def _when(t) -> datetime.datetime:
    """A record's time as listings write it (UTC, to the microsecond): the search order,
    so a cursor read back from its ISO form compares exactly."""
    return datetime.datetime.fromtimestamp(number(t), datetime.UTC)


def _has(meta, want: dict) -> bool:
    """Whether user_metadata `meta` holds every key of `want` with an equal value."""
    return all(isinstance(meta, dict) and k in meta and meta[k] == v for k, v in want.items())
