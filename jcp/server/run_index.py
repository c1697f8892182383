"""The run index of jcp-serve's state store: runs and checkpoints on disk, and their bounds.

Owns the folders behind `tinker://` paths (`folder`, `new_path`, `resolve`; every
checkpoint name through `checkpoint_name`), the in-memory index of runs and checkpoints
(RunRecord, built once at start by `_load`), the per-tenant bounds on runs, checkpoints
and storage, and `saving` (a checkpoint recorded only once written). Per run,
checkpoints.json maps checkpoint ids ("<kind>/<name>") to their time, expiry (None =
never), user metadata and bytes; a checkpoint is listed and loadable only once recorded
there, and the memory index mirrors it. `RunIndex` is one part of
jcp.server.state.StateStore (which owns the lock and the tables it reads). Never jax.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import heapq
import json
import logging
import os
import re
import shutil
import stat
import time
import uuid

from jcp.server.store_errors import LimitReached, NotFound

_NAME = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
_RUN = re.compile(r"^[A-Za-z0-9._:-]{1,200}$")
KINDS = ("weights", "sampler_weights")
# Folder kind -> the SDK's checkpoint_type.
CHECKPOINT_TYPES = {
    "weights": "training",
    "sampler_weights": "sampler",
    "external_weights": "external",
}
# Sampler weights saved without a name: deleted with their model (or their TTL).
EPHEMERAL = "ephemeral-"
GiB = 1 << 30
log = logging.getLogger("jcp.serve")


def checkpoint_name(name) -> str:
    """`name` if it can name a checkpoint: 1-128 of [A-Za-z0-9._-], and neither "." nor
    ".." (the kind's folder and the run's own folder); ValueError otherwise. The one check
    of a name on every route (save, load, list, TTL, delete, copy, weights info,
    downloads): StateStore.folder calls it."""
    if not isinstance(name, str) or not _NAME.match(name) or name in (".", ".."):
        raise ValueError(
            f"checkpoint name {str(name)[:140]!r} must be 1-128 of [A-Za-z0-9._-], not '.' or '..'"
        )
    return name


def folder_bytes(folder: str) -> int:
    """Bytes of the files under `folder` (0 if there is none); a link counts as itself."""
    total = 0
    for d, _, fs in os.walk(folder):
        for f in fs:
            with contextlib.suppress(OSError):  # gone meanwhile
                total += os.lstat(os.path.join(d, f)).st_size
    return total


def written_bytes(folder: str, what: str) -> int:
    """Bytes of a checkpoint folder just written; OSError naming `what` (its tinker path)
    unless it holds at least one file, and only regular files and folders: a link could
    lead out of the run, and a download would follow it."""
    total, files = 0, 0
    try:
        if os.path.islink(folder):
            raise ValueError
        for d, dirs, fs in os.walk(folder):
            for f in dirs + fs:
                st = os.lstat(os.path.join(d, f))
                if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
                    raise ValueError
                if stat.S_ISREG(st.st_mode):
                    total, files = total + st.st_size, files + 1
    except (OSError, ValueError):
        raise OSError(
            errno.EIO,
            f"{what}: the written checkpoint holds a link or special "
            "file, or a file vanished while it was measured",
        ) from None
    if not files:
        raise OSError(errno.EIO, f"{what}: the save wrote no file")
    return total


def atomic_json(path: str, obj) -> None:
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


@dataclasses.dataclass
class RunRecord:
    """A run in the memory index: its owner, and checkpoints.json (checkpoint id
    "<kind>/<name>" -> time, expires_at, user_metadata, size_bytes) as on disk."""

    owner: str
    created: float
    base_model: str = ""
    checkpoints: dict = dataclasses.field(default_factory=dict)


class RunIndex:
    """The StateStore's runs and checkpoints (module docstring)."""

    def _new_run(self, run: str, meta: dict) -> bool:
        """Write a run's owner.json and index the run (under the lock) -> whether the run
        is new. A run of another owner is refused (NotFound)."""
        run_dir = self._run_dir(run)
        old = self._runs.get(run)
        if old is not None and old.owner != meta["owner"]:
            raise NotFound(f"training run {run!r} not found")
        if old is None:
            self._room_for_run(meta["owner"])
        os.makedirs(run_dir, exist_ok=True)
        atomic_json(os.path.join(run_dir, "owner.json"), meta)
        if old is None:
            self._add_run(
                run, RunRecord(meta["owner"], meta["created"], str(meta.get("base_model", "")))
            )
        return old is None

    def run_info(self, path: str, owner: str, must_exist: bool = True) -> dict:
        """The run_info (train_* flags, user_metadata) of the run that saved `path`."""
        if must_exist:
            folder, _ = self.resolve(path, owner, "weights")
            run_dir = os.path.dirname(os.path.dirname(folder))
        else:
            run_dir = self._run_dir(path[len("tinker://") :].split("/")[0])
            self._owned_run(os.path.basename(run_dir), owner)
        meta = self._read_meta(run_dir) or {}
        return {k: v for k, v in meta.items() if k.startswith("train_") or k == "user_metadata"}

    def _read_meta(self, run_dir: str) -> dict | None:
        try:
            with open(os.path.join(run_dir, "owner.json")) as f:
                meta = json.load(f)
        except (OSError, ValueError):
            return None
        return meta if isinstance(meta, dict) else None

    # ------------------------------------------------------------------ paths

    def _run_dir(self, run: str) -> str:
        if not isinstance(run, str) or not _RUN.match(run) or run in (".", ".."):
            raise NotFound(f"run {str(run)[:200]!r} not found")
        return os.path.join(self.state_dir, "runs", run)

    def folder(self, run: str, kind: str, name: str) -> str:
        """The folder of checkpoint <kind>/<name> of `run` (NotFound for a bad run or
        kind, ValueError for a name `checkpoint_name` refuses); never outside the run's
        <kind> folder."""
        if kind not in CHECKPOINT_TYPES:
            raise NotFound(f"checkpoint kind {str(kind)[:40]!r} not found")
        kind_dir = os.path.join(self._run_dir(run), kind)
        folder = os.path.join(kind_dir, checkpoint_name(name))
        if os.path.dirname(os.path.normpath(folder)) != kind_dir:  # the name check's promise
            raise ValueError(f"checkpoint name {name!r} leaves its run")
        return folder

    def new_path(self, model_id: str, kind: str, name: str | None) -> tuple[str, str]:
        """-> (tinker path, folder) for a new checkpoint of the model."""
        if name is None:
            name = f"{EPHEMERAL}{uuid.uuid4().hex[:12]}"
        elif checkpoint_name(name).startswith(EPHEMERAL):
            raise ValueError(
                f"checkpoint name {name!r}: names starting with {EPHEMERAL!r} are "
                "reserved for unnamed sampler weights"
            )
        folder = self.folder(model_id, kind, name)
        return f"tinker://{model_id}/{kind}/{name}", folder

    def resolve(self, path: str, owner: str, kind: str) -> tuple[str, str]:
        """tinker://<run>/<kind>/<name> of a recorded, live checkpoint `owner` owns ->
        (folder, base model); NotFound otherwise."""
        if not isinstance(path, str) or not path.startswith("tinker://"):
            raise NotFound(
                f"path {str(path)[:300]!r} not found (expected tinker://<run>/{kind}/<name>)"
            )
        parts = path[len("tinker://") :].split("/")
        if len(parts) != 3 or parts[1] != kind:
            raise NotFound(f"path {path[:300]!r} not found (expected tinker://<run>/{kind}/<name>)")
        try:
            folder = self.folder(*parts)
        except ValueError:
            raise NotFound(f"path {path[:300]!r} not found") from None
        with self._lock:
            run = self._runs.get(parts[0])
            rec = (
                None
                if run is None or run.owner != owner
                else run.checkpoints.get(f"{kind}/{parts[2]}")
            )
        if rec is None or expired(rec) or not os.path.isdir(folder):
            raise NotFound(f"path {path[:300]!r} not found")
        return folder, run.base_model

    # ------------------------------------------------------------------ runs and checkpoints

    def _load(self) -> None:
        """Index every run of the state folder (once, at start). A checkpoint folder that
        is not recorded is what a save that failed or was killed left: it is removed."""
        root = os.path.join(self.state_dir, "runs")
        for run in sorted(os.listdir(root)):
            run_dir = os.path.join(root, run)
            meta = self._read_meta(run_dir) if _RUN.match(run) and run not in (".", "..") else None
            if meta is None or not isinstance(meta.get("owner"), str):
                continue
            idx = _read_index(run_dir)
            rec = RunRecord(
                meta["owner"], number(meta.get("created")), str(meta.get("base_model", ""))
            )
            for kind in CHECKPOINT_TYPES:
                with contextlib.suppress(OSError):
                    for name in os.listdir(os.path.join(run_dir, kind)):
                        cid, folder = f"{kind}/{name}", os.path.join(run_dir, kind, name)
                        entry = idx.get(cid)
                        if (
                            isinstance(entry, dict)
                            and _NAME.match(name)
                            and name not in (".", "..")
                            and os.path.isdir(folder)
                        ):
                            if not isinstance(entry.get("size_bytes"), int):
                                entry["size_bytes"] = folder_bytes(folder)
                            rec.checkpoints[cid] = entry
                            continue
                        log.warning(
                            "state: removing %s (never recorded: a save that failed or was killed)",
                            folder,
                        )
                        if os.path.isdir(folder) and not os.path.islink(folder):
                            shutil.rmtree(folder, ignore_errors=True)
                        else:
                            with contextlib.suppress(OSError):
                                os.remove(folder)
            if rec.checkpoints != idx:
                atomic_json(os.path.join(run_dir, "checkpoints.json"), rec.checkpoints)
            self._add_run(run, rec)

    def _add_run(self, run: str, rec: RunRecord) -> None:
        self._runs[run] = rec
        self._owned.setdefault(rec.owner, set()).add(run)
        for cid, c in rec.checkpoints.items():
            self._count(rec.owner, c, +1)
            self._push_ttl(run, cid, c.get("expires_at"))

    def _count(self, owner: str, c: dict, sign: int) -> None:
        self._nckpts[owner] += sign
        self._bytes[owner] += sign * c.get("size_bytes", 0)

    def _push_ttl(self, run: str, cid: str, expires_at) -> None:
        if expires_at is None:
            return
        heapq.heappush(self._ttl, (float(expires_at), run, cid))
        # TTLs set again leave stale entries: rebuild once they outnumber the live ones.
        if len(self._ttl) > 2 * sum(self._nckpts.values()) + 1024:
            self._ttl = [
                (float(c["expires_at"]), r, k)
                for r, rec in self._runs.items()
                for k, c in rec.checkpoints.items()
                if c.get("expires_at") is not None
            ]
            heapq.heapify(self._ttl)

    def _room_for_run(self, owner: str, take: bool = True) -> None:
        """Make room for one more run of `owner` (under the lock): at `limits.runs`, its
        oldest run with no checkpoint and no loaded model is forgotten (with `take`);
        LimitReached when there is none."""
        runs = self._owned.get(owner, ())
        if len(runs) < self.limits.runs:
            return
        empty = [
            (self._runs[r].created, r)
            for r in runs
            if not self._runs[r].checkpoints and r not in self.models
        ]
        if not empty:
            raise LimitReached(
                422,
                f"training runs: this tenant holds {len(runs)}, the "
                f"server's limit per tenant; delete the checkpoints of "
                "runs it no longer needs (an empty run is then reused)",
            )
        if take:
            self._forget_run(min(empty)[1])

    def _forget_run(self, run: str) -> None:
        """Drop a run from the index and the disk (under the lock)."""
        rec = self._runs.pop(run)
        self._owned[rec.owner].discard(run)
        for c in rec.checkpoints.values():
            self._count(rec.owner, c, -1)
        shutil.rmtree(self._run_dir(run), ignore_errors=True)

    def check_room(self, owner: str, new_run: bool = False, save: bool = False) -> None:
        """LimitReached unless `owner` can have one more run (`new_run`) and one more
        checkpoint (`save`, storage below --max-storage-gb): the routes' check before they
        queue work. Changes nothing."""
        with self._lock:
            if new_run:
                self._room_for_run(owner, take=False)
            if save:
                self._room_for_checkpoint(owner, None, None)

    def _room_for_checkpoint(self, owner: str, run: RunRecord | None, old: dict | None) -> None:
        """LimitReached unless `owner` may write one more checkpoint into `run` (`old`:
        the record it replaces, whose writer keeps both versions while it writes)."""
        lim, used = self.limits, self._bytes[owner]
        need = 0 if old is None else old.get("size_bytes", 0)
        if used + need > lim.storage_bytes or (old is None and used >= lim.storage_bytes):
            raise LimitReached(
                422,
                f"storage: this tenant's checkpoints take {used} bytes "
                f"(--max-storage-gb {lim.storage_bytes / GiB:g}); "
                "delete some first",
            )
        if old is None and self._nckpts[owner] >= lim.checkpoints:
            raise LimitReached(
                422,
                f"checkpoints: this tenant holds {self._nckpts[owner]}, "
                "the server's limit per tenant; delete some first",
            )
        if old is None and run is not None and len(run.checkpoints) >= lim.checkpoints_per_run:
            raise LimitReached(
                422,
                f"checkpoints: this run holds {len(run.checkpoints)}, the "
                "server's limit per run; delete some first",
            )

    @contextlib.contextmanager
    def saving(
        self,
        owner: str,
        run: str,
        kind: str,
        name: str | None,
        ttl_seconds=None,
        user_metadata=None,
        new_run: dict | None = None,
    ):
        """Write checkpoint <kind>/<name> of `run`: -> (tinker path, folder) for the block
        to write into. `new_run`: the owner.json fields of the run, created here if it
        does not exist (copy_weights' destination).

        Refused before anything is written (LimitReached) when the tenant is at a bound:
        storage (an overwrite needs room for its old version, which its writer keeps while
        it writes), checkpoints, runs. The checkpoint is recorded — listed, loadable, the
        run's last checkpoint — only once the block returned and the folder holds files,
        regular ones only (`written_bytes`). If the block raises, that check fails, or the
        new checkpoint takes the
        tenant over --max-storage-gb, a new folder (and a run made here) is removed;
        a failed save onto an existing name leaves what its writer left, the previous
        version (orbax and PEFT writers replace atomically)."""
        path, folder = self.new_path(run, kind, name)
        cid = f"{kind}/{os.path.basename(folder)}"
        with self._lock:
            made = new_run is not None and self._new_run(
                run, {"owner": owner, "created": time.time(), **new_run}
            )
            rec = self._runs.get(run)
            if rec is None or rec.owner != owner:
                raise NotFound(f"training run {run!r} not found")
            old = rec.checkpoints.get(cid)
            try:
                self._room_for_checkpoint(owner, rec, old)
            except LimitReached:
                if made:
                    self._forget_run(run)
                raise
        try:
            yield path, folder
            size = written_bytes(folder, path)
            with self._lock:
                used = self._bytes[owner] - (old or {}).get("size_bytes", 0)
                if old is None and used + size > self.limits.storage_bytes:
                    raise LimitReached(
                        422,
                        f"storage: checkpoint {cid!r} ({size} bytes) "
                        f"would take this tenant's checkpoints to "
                        f"{used + size} bytes (--max-storage-gb "
                        f"{self.limits.storage_bytes / GiB:g}); delete "
                        "some first",
                    )
                now = time.time()
                entry = {
                    "time": now,
                    "user_metadata": user_metadata,
                    "size_bytes": size,
                    "expires_at": None if ttl_seconds is None else now + ttl_seconds,
                }
                self._record(run, cid, entry)
        except BaseException:
            if old is None:
                shutil.rmtree(folder, ignore_errors=True)
            if made:
                with self._lock:
                    if run in self._runs:
                        self._forget_run(run)
            raise

    def _record(self, run: str, cid: str, entry: dict) -> None:
        """Put (or replace) a checkpoint's record, on disk then in memory (under the lock)."""
        rec = self._runs[run]
        new = {**rec.checkpoints, cid: entry}
        atomic_json(os.path.join(self._run_dir(run), "checkpoints.json"), new)
        old = rec.checkpoints.get(cid)
        if old is not None:
            self._count(rec.owner, old, -1)
        rec.checkpoints = new
        self._count(rec.owner, entry, +1)
        self._push_ttl(run, cid, entry.get("expires_at"))


def expired(rec: dict) -> bool:
    exp = rec.get("expires_at")
    return exp is not None and exp <= time.time()


def number(v) -> float:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else 0.0


def _read_index(run_dir: str) -> dict:
    try:
        with open(os.path.join(run_dir, "checkpoints.json")) as f:
            idx = json.load(f)
    except (OSError, ValueError):
        return {}
    return idx if isinstance(idx, dict) else {}
