"""The server's state store: tenants, sessions, models, sampling sessions, and the folders
behind `tinker://` paths.

Owns who owns what, and where checkpoints live on disk:
    <state_dir>/runs/<model_id>/owner.json           (owner, base model, rank, user_metadata)
    <state_dir>/runs/<model_id>/checkpoints.json     (per checkpoint: time, TTL, user_metadata)
    <state_dir>/runs/<model_id>/external_weights/<name>/  (PEFT, maybe age-encrypted)
    <state_dir>/runs/<model_id>/weights/<name>/          (orbax, Trainer.save_state)
    <state_dir>/runs/<model_id>/sampler_weights/<name>/  (PEFT, Trainer.export_peft)
Because paths map to folders deterministically and ownership is written next to them, a
restarted server with the same --state-dir loads every path saved before. Anything a key
does not own is reported as "not found", exactly like something that does not exist.
Thread-safe (the HTTP loop and the worker both use it). It must never import jax.

A checkpoint exists once `saving` recorded it in checkpoints.json, after its writer
returned and its folder was measured: a save that failed is never listed, loaded or a
run's last checkpoint, and its new folder is removed (a folder found unrecorded at start,
left by a save that was killed, is removed too). Every checkpoint name of every route goes
through `checkpoint_name`. Every table is bounded per tenant (TenantLimits), and runs,
checkpoints and TTLs are indexed in memory (built once at start), so no request reads
another tenant's runs and the TTL sweep pops a heap instead of reading every run.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import datetime
import errno
import heapq
import json
import logging
import os
import re
import shutil
import stat
import threading
import time
import uuid

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


@dataclasses.dataclass(frozen=True)
class TenantLimits:
    """What one tenant may hold. Each is counted per tenant, so no tenant's use evicts,
    blocks or slows another's. Only the storage bound is a flag (--max-storage-gb)."""

    storage_bytes: int = 100 * GiB  # checkpoint files on disk (a hard-linked copy in full)
    runs: int = 10_000  # training runs (at the bound, an empty one is reused)
    checkpoints_per_run: int = 1_000
    checkpoints: int = 50_000  # over all of the tenant's runs
    sessions: int = 1_024  # live sessions (ended ones are forgotten)
    samplers: int = 4_096  # sampling sessions
    ended_sessions: int = 4_096  # ended session ids remembered, to answer 410

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if (
                isinstance(v, bool)
                or not isinstance(v, int)
                or v < (0 if f.name == "storage_bytes" else 1)
            ):
                raise ValueError(
                    f"TenantLimits.{f.name} must be an integer ≥ 1 (storage ≥ 0), got {v!r}"
                )


class NotFound(LookupError):
    """Unknown, or owned by another key (indistinguishable on purpose)."""


class LimitReached(ValueError):
    """A tenant's bound (TenantLimits) is reached: HTTP `status` on a direct route (429
    where it frees by itself: sessions expire), a failed request of category "user" (a
    ValueError) through a future. Nothing was changed."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class AuthError(PermissionError):
    pass


class SessionEnded(LookupError):
    """A request for a session that has finished or expired (HTTP 410, as Tinker)."""


def age_recipients(keys) -> list:
    """age recipients ("age1…" X25519 keys or SSH public keys) -> pyrage recipients;
    ValueError naming the bad one."""
    import pyrage

    if not isinstance(keys, list) or not keys or len(keys) > 64:
        raise ValueError("age_encryption_recipients must be a list of 1-64 age recipients")
    out = []
    for i, k in enumerate(keys):
        try:
            if not isinstance(k, str):
                raise ValueError
            out.append(
                pyrage.x25519.Recipient.from_str(k)
                if k.startswith("age1")
                else pyrage.ssh.Recipient.from_str(k)
            )
        except Exception:  # noqa: BLE001 — pyrage raises its own error types
            raise ValueError(
                f"age_encryption_recipients[{i}] is not an age X25519 "
                f"(age1…) or SSH public key: {str(k)[:80]!r}"
            ) from None
    return out


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


def _iso(t: float | None) -> str | None:
    return None if t is None else datetime.datetime.fromtimestamp(t, datetime.UTC).isoformat()


def atomic_json(path: str, obj) -> None:
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


@dataclasses.dataclass
class ModelRecord:
    """A training model. slot: its adapter slot while resident, None while its state is
    in host memory (the engine's slot cache)."""

    model_id: str
    owner: str
    base_model: str
    rank: int
    slot: int | None = None
    session_id: str | None = None


@dataclasses.dataclass
class SessionRecord:
    """A live session (an ended one is forgotten; only its id is remembered, for 410)."""

    owner: str
    last_seen: float  # time.monotonic() of its last heartbeat or creation


@dataclasses.dataclass
class SamplerRecord:
    sampler_id: str
    owner: str
    base_model: str
    model_path: str | None
    folder: str | None  # PEFT folder; None = the base model, or an in-memory snapshot
    session_id: str | None = None  # forgotten when this session ends


@dataclasses.dataclass
class RunRecord:
    """A run in the memory index: its owner, and checkpoints.json (checkpoint id
    "<kind>/<name>" -> time, expires_at, user_metadata, size_bytes) as on disk."""

    owner: str
    created: float
    base_model: str = ""
    checkpoints: dict = dataclasses.field(default_factory=dict)


def read_api_keys(path: str) -> dict[str, str]:
    """`key name` per line (# comments, blank lines skipped) -> {key: tenant name}.

    The tenant name is what the state folder records as a run's owner, so a line without
    one is refused (the key itself would be written to disk), as is a repeated key."""
    keys = {}
    with open(path) as f:
        for i, line in enumerate(f, 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.split()
            if len(parts) != 2:
                # Never echo the line: it holds a key.
                raise ValueError(
                    f"{path}:{i}: expected `key name` (two fields), got {len(parts)} field(s)"
                )
            if parts[0] in keys:
                raise ValueError(f"{path}:{i}: this key already appears on an earlier line")
            if parts[1] in keys:
                raise ValueError(f"{path}:{i}: tenant name equals a key")
            keys[parts[0]] = parts[1]
    if set(keys) & set(keys.values()):
        raise ValueError(f"{path}: a tenant name equals a key")
    return keys


class StateStore:
    def __init__(
        self, state_dir: str, api_keys: dict[str, str] | None, limits: TenantLimits = TenantLimits()
    ):
        self.state_dir = os.path.abspath(state_dir)
        os.makedirs(os.path.join(self.state_dir, "runs"), exist_ok=True)
        self.api_keys = api_keys
        self.limits = limits
        self._lock = threading.Lock()
        self.sessions: dict[str, SessionRecord] = {}  # live ones only
        self.models: dict[str, ModelRecord] = {}
        self.samplers: dict[str, SamplerRecord] = {}
        # Per tenant: live sessions, ended session ids (oldest first), sampling sessions,
        # runs, recorded checkpoints and their bytes.
        self._live: collections.Counter = collections.Counter()
        self._ended: dict[str, collections.OrderedDict] = {}
        self._nsamplers: collections.Counter = collections.Counter()
        self._runs: dict[str, RunRecord] = {}
        self._owned: dict[str, set[str]] = {}
        self._nckpts: collections.Counter = collections.Counter()
        self._bytes: collections.Counter = collections.Counter()
        # (expires_at, run, checkpoint id), a heap; an entry whose checkpoint is gone or
        # whose TTL changed since is skipped when popped.
        self._ttl: list[tuple[float, str, str]] = []
        # Called with (owner, sampler ids) once sampling sessions are forgotten (the app
        # drops their completion logs); never under the lock.
        self.on_forget_samplers = lambda owner, sids: None
        self._load()

    # ------------------------------------------------------------------ tenants

    def owner_of_key(self, key: str | None) -> str:
        if self.api_keys is None:
            return "local"
        if not key or key not in self.api_keys:
            raise AuthError("invalid or missing X-API-Key")
        return self.api_keys[key]

    # ------------------------------------------------------------------ sessions

    def new_session(self, owner: str) -> str:
        sid = f"s{uuid.uuid4().hex[:16]}"
        with self._lock:
            if self._live[owner] >= self.limits.sessions:
                raise LimitReached(
                    429,
                    f"this tenant has {self._live[owner]} live sessions "
                    f"(at most {self.limits.sessions}); finish some, or "
                    "wait for idle ones to expire",
                )
            self.sessions[sid] = SessionRecord(owner, time.monotonic())
            self._live[owner] += 1
        return sid

    def check_session(self, sid: str, owner: str) -> None:
        """A live session of `owner` (NotFound otherwise, SessionEnded for one that ended);
        counts as a sign of life."""
        with self._lock:
            rec = self.sessions.get(sid) if isinstance(sid, str) else None
            if rec is None or rec.owner != owner:
                if isinstance(sid, str) and sid in self._ended.get(owner, ()):
                    raise SessionEnded(
                        f"session {sid!r} has ended (finished, or no heartbeat "
                        "for too long); create a new one"
                    )
                raise NotFound(f"session {str(sid)[:80]!r} not found")
            rec.last_seen = time.monotonic()

    def end_session(self, sid: str) -> list[str]:
        """End a session -> the ids of its models (still loaded; the engine unloads them
        once their queued work is done). Its record and its sampling sessions are
        forgotten; its id is remembered (the last `limits.ended_sessions` of its tenant) so
        that its heartbeats get 410, which stops the SDK's heartbeat loop."""
        with self._lock:
            rec = self.sessions.pop(sid, None)
            gone = []
            if rec is not None:
                self._live[rec.owner] -= 1
                ended = self._ended.setdefault(rec.owner, collections.OrderedDict())
                ended[sid] = None
                while len(ended) > self.limits.ended_sessions:
                    ended.popitem(last=False)
                gone = self._forget_samplers(
                    [s for s, r in self.samplers.items() if r.session_id == sid]
                )
            models = [m for m, r in self.models.items() if r.session_id == sid]
        if gone:
            self.on_forget_samplers(rec.owner, gone)
        return models

    def expired_sessions(self, timeout_s: float) -> list[str]:
        """Live sessions without a sign of life for `timeout_s` seconds."""
        now = time.monotonic()
        with self._lock:
            return [sid for sid, r in self.sessions.items() if now - r.last_seen > timeout_s]

    # ------------------------------------------------------------------ models

    @staticmethod
    def model_id(session_id: str, model_seq_id: int) -> str:
        # The SDK derives the same id from (session_id, model_seq_id) for
        # create_training_client_from_state, so this format is part of the protocol.
        return f"{session_id}:train:{model_seq_id}"

    def add_model(self, rec: ModelRecord, run_info: dict | None = None) -> None:
        """Register a created model and write its run's owner.json (owner, base model and
        `run_info`: lora_rank, train_* flags, user_metadata), which outlives the server.
        LimitReached (nothing written) when the tenant holds `limits.runs` runs and none
        is empty."""
        meta = {
            "owner": rec.owner,
            "base_model": rec.base_model,
            "lora_rank": rec.rank,
            "created": time.time(),
            **(run_info or {}),
        }
        with self._lock:
            self._new_run(rec.model_id, meta)
            self.models[rec.model_id] = rec

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

    def model(self, model_id: str, owner: str) -> ModelRecord:
        """A loaded model of `owner`; a request for it counts as its session's sign of life."""
        with self._lock:
            rec = self.models.get(model_id) if isinstance(model_id, str) else None
            if rec is not None and rec.owner == owner:
                sess = self.sessions.get(rec.session_id)
                if sess is not None:
                    sess.last_seen = time.monotonic()
        if rec is None or rec.owner != owner:
            raise NotFound(f"model {str(model_id)[:200]!r} not found")
        return rec

    def drop_model(self, model_id: str) -> list[str]:
        """Forget a loaded model, its in-memory sampler snapshots' sampling sessions and
        its unnamed (ephemeral) sampler folders (of older servers) -> the deleted folders.
        Named checkpoints and sampling sessions on them stay."""
        folder = os.path.join(self._run_dir(model_id), "sampler_weights")
        prefix = f"tinker://{model_id}/"
        gone = []
        with contextlib.suppress(OSError):
            gone = [os.path.join(folder, n) for n in os.listdir(folder) if n.startswith(EPHEMERAL)]
        with self._lock:
            rec = self.models.pop(model_id, None)
            sids = self._forget_samplers(
                [
                    s
                    for s, r in self.samplers.items()
                    if r.folder in gone
                    or (r.folder is None and (r.model_path or "").startswith(prefix))
                ]
            )
        for f in gone:
            shutil.rmtree(f, ignore_errors=True)
        if sids and rec is not None:
            self.on_forget_samplers(rec.owner, sids)
        return gone

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
        if rec is None or _expired(rec) or not os.path.isdir(folder):
            raise NotFound(f"path {path[:300]!r} not found")
        return folder, run.base_model

    # ------------------------------------------------------------------ runs and checkpoints
    # Per run, checkpoints.json maps checkpoint ids ("<kind>/<name>") to their time,
    # expiry (None = never), user metadata and bytes; a checkpoint is listed and loadable
    # only once recorded there, and the memory index (RunRecord) mirrors it.

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
                meta["owner"], _number(meta.get("created")), str(meta.get("base_model", ""))
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
            if not _expired(c) and os.path.isdir(os.path.join(run_dir, cid))
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
                if not _expired(c)
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

    def usage(self, owner: str) -> dict:
        """What `owner` holds, against TenantLimits' names."""
        with self._lock:
            return {
                "storage_bytes": self._bytes[owner],
                "runs": len(self._owned.get(owner, ())),
                "checkpoints": self._nckpts[owner],
                "sessions": self._live[owner],
                "samplers": self._nsamplers[owner],
            }

    # ------------------------------------------------------------------ samplers

    def add_sampler(
        self,
        owner: str,
        base_model: str,
        model_path: str | None,
        folder: str | None,
        session_id: str | None = None,
    ) -> str:
        """A new sampling session; forgotten when `session_id` ends (or, for an in-memory
        snapshot, when its model is unloaded; for a folder, when it is deleted)."""
        sid = f"sampler-{uuid.uuid4().hex[:16]}"
        with self._lock:
            if self._nsamplers[owner] >= self.limits.samplers:
                raise LimitReached(
                    429,
                    f"this tenant has {self._nsamplers[owner]} sampling "
                    f"sessions (at most {self.limits.samplers}); end "
                    "sessions it no longer needs",
                )
            self.samplers[sid] = SamplerRecord(
                sid, owner, base_model, model_path, folder, session_id
            )
            self._nsamplers[owner] += 1
        return sid

    def _forget_samplers(self, sids: list[str]) -> list[str]:
        for s in sids:
            self._nsamplers[self.samplers.pop(s).owner] -= 1
        return sids

    def sampler(self, sid: str, owner: str) -> SamplerRecord:
        with self._lock:
            rec = self.samplers.get(sid) if isinstance(sid, str) else None
        if rec is None or rec.owner != owner:
            raise NotFound(f"sampling session {str(sid)[:80]!r} not found")
        return rec


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
    return datetime.datetime.fromtimestamp(_number(t), datetime.UTC)


def _has(meta, want: dict) -> bool:
    """Whether user_metadata `meta` holds every key of `want` with an equal value."""
    return all(isinstance(meta, dict) and k in meta and meta[k] == v for k, v in want.items())


def _expired(rec: dict) -> bool:
    exp = rec.get("expires_at")
    return exp is not None and exp <= time.time()


def _number(v) -> float:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else 0.0


def _read_index(run_dir: str) -> dict:
    try:
        with open(os.path.join(run_dir, "checkpoints.json")) as f:
            idx = json.load(f)
    except (OSError, ValueError):
        return {}
    return idx if isinstance(idx, dict) else {}
