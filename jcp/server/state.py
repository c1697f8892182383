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
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import re
import shutil
import threading
import time
import uuid

_NAME = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
_RUN = re.compile(r"^[A-Za-z0-9._:-]{1,200}$")
KINDS = ("weights", "sampler_weights")
# Folder kind -> the SDK's checkpoint_type.
CHECKPOINT_TYPES = {"weights": "training", "sampler_weights": "sampler",
                    "external_weights": "external"}
# Sampler weights saved without a name: deleted with their model (or their TTL).
EPHEMERAL = "ephemeral-"


class NotFound(LookupError):
    """Unknown, or owned by another key (indistinguishable on purpose)."""


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
            out.append(pyrage.x25519.Recipient.from_str(k) if k.startswith("age1")
                       else pyrage.ssh.Recipient.from_str(k))
        except Exception:  # noqa: BLE001 — pyrage raises its own error types
            raise ValueError(f"age_encryption_recipients[{i}] is not an age X25519 "
                             f"(age1…) or SSH public key: {str(k)[:80]!r}") from None
    return out


def _iso(t: float | None) -> str | None:
    return None if t is None else datetime.datetime.fromtimestamp(
        t, datetime.timezone.utc).isoformat()


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
    owner: str
    last_seen: float                 # time.monotonic() of its last heartbeat or creation
    ended: bool = False              # finished by the client, or its heartbeats stopped


@dataclasses.dataclass
class SamplerRecord:
    sampler_id: str
    owner: str
    base_model: str
    model_path: str | None
    folder: str | None  # PEFT folder; None = the base model


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
                raise ValueError(f"{path}:{i}: expected `key name` (two fields), got "
                                 f"{len(parts)} field(s)")
            if parts[0] in keys:
                raise ValueError(f"{path}:{i}: this key already appears on an earlier line")
            if parts[1] in keys:
                raise ValueError(f"{path}:{i}: tenant name equals a key")
            keys[parts[0]] = parts[1]
    if set(keys) & set(keys.values()):
        raise ValueError(f"{path}: a tenant name equals a key")
    return keys


class StateStore:
    def __init__(self, state_dir: str, api_keys: dict[str, str] | None):
        self.state_dir = os.path.abspath(state_dir)
        os.makedirs(os.path.join(self.state_dir, "runs"), exist_ok=True)
        self.api_keys = api_keys
        self._lock = threading.Lock()
        self.sessions: dict[str, SessionRecord] = {}
        self.models: dict[str, ModelRecord] = {}
        self.samplers: dict[str, SamplerRecord] = {}

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
            self.sessions[sid] = SessionRecord(owner, time.monotonic())
        return sid

    def check_session(self, sid: str, owner: str) -> None:
        """A live session of `owner` (NotFound otherwise); counts as a sign of life."""
        with self._lock:
            rec = self.sessions.get(sid)
            if rec is None or rec.owner != owner:
                raise NotFound(f"session {sid!r} not found")
            if rec.ended:
                raise SessionEnded(f"session {sid!r} has ended (finished, or no heartbeat "
                                   "for too long); create a new one")
            rec.last_seen = time.monotonic()

    def end_session(self, sid: str) -> list[str]:
        """Mark a session ended -> the ids of its models (still loaded; the engine unloads
        them once their queued work is done)."""
        with self._lock:
            rec = self.sessions.get(sid)
            if rec is not None:
                rec.ended = True
            return [m for m, r in self.models.items() if r.session_id == sid]

    def expired_sessions(self, timeout_s: float) -> list[str]:
        """Live sessions without a sign of life for `timeout_s` seconds."""
        now = time.monotonic()
        with self._lock:
            return [sid for sid, r in self.sessions.items()
                    if not r.ended and now - r.last_seen > timeout_s]

    # ------------------------------------------------------------------ models

    @staticmethod
    def model_id(session_id: str, model_seq_id: int) -> str:
        # The SDK derives the same id from (session_id, model_seq_id) for
        # create_training_client_from_state, so this format is part of the protocol.
        return f"{session_id}:train:{model_seq_id}"

    def add_run(self, run: str, owner: str, base_model: str, run_info: dict) -> None:
        """A run without a loaded model (copy_weights' destination)."""
        run_dir = self._run_dir(run)
        os.makedirs(run_dir, exist_ok=True)
        atomic_json(os.path.join(run_dir, "owner.json"),
                    {"owner": owner, "base_model": base_model, "created": time.time(),
                     **run_info})

    def add_model(self, rec: ModelRecord, run_info: dict | None = None) -> None:
        """Register a created model and write its run's owner.json (owner, base model and
        `run_info`: lora_rank, train_* flags, user_metadata), which outlives the server."""
        run = self._run_dir(rec.model_id)
        os.makedirs(run, exist_ok=True)
        meta = {"owner": rec.owner, "base_model": rec.base_model, "lora_rank": rec.rank,
                "created": time.time(), **(run_info or {})}
        atomic_json(os.path.join(run, "owner.json"), meta)
        with self._lock:
            self.models[rec.model_id] = rec

    def model(self, model_id: str, owner: str) -> ModelRecord:
        """A loaded model of `owner`; a request for it counts as its session's sign of life."""
        with self._lock:
            rec = self.models.get(model_id)
            if rec is not None and rec.owner == owner:
                sess = self.sessions.get(rec.session_id)
                if sess is not None and not sess.ended:
                    sess.last_seen = time.monotonic()
        if rec is None or rec.owner != owner:
            raise NotFound(f"model {model_id!r} not found")
        return rec

    def drop_model(self, model_id: str) -> list[str]:
        """Forget a loaded model and delete its unnamed (ephemeral) sampler weights and
        their sampling sessions -> the deleted folders. Named checkpoints stay."""
        folder = os.path.join(self._run_dir(model_id), "sampler_weights")
        gone = []
        with contextlib.suppress(OSError):
            gone = [os.path.join(folder, n) for n in os.listdir(folder)
                    if n.startswith(EPHEMERAL)]
        with self._lock:
            self.models.pop(model_id, None)
            for sid in [s for s, r in self.samplers.items() if r.folder in gone]:
                del self.samplers[sid]
        for f in gone:
            shutil.rmtree(f, ignore_errors=True)
        return gone

    def run_info(self, path: str, owner: str, must_exist: bool = True) -> dict:
        """The run_info (train_* flags, user_metadata) of the run that saved `path`."""
        if must_exist:
            folder, _ = self.resolve(path, owner, "weights")
            run_dir = os.path.dirname(os.path.dirname(folder))
        else:
            run_dir = self._run_dir(path[len("tinker://"):].split("/")[0])
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
        if not _RUN.match(run) or run in (".", ".."):
            raise NotFound(f"run {run!r} not found")
        return os.path.join(self.state_dir, "runs", run)

    def new_path(self, model_id: str, kind: str, name: str | None) -> tuple[str, str]:
        """-> (tinker path, folder) for a new checkpoint of the model."""
        if name is None:
            name = f"{EPHEMERAL}{uuid.uuid4().hex[:12]}"
        elif name.startswith(EPHEMERAL):
            raise ValueError(f"checkpoint name {name!r}: names starting with {EPHEMERAL!r} are "
                             "reserved for unnamed sampler weights")
        if not _NAME.match(name) or name in (".", ".."):
            raise ValueError(f"checkpoint name {name!r} must be 1-128 of [A-Za-z0-9._-]")
        folder = os.path.join(self._run_dir(model_id), kind, name)
        return f"tinker://{model_id}/{kind}/{name}", folder

    def resolve(self, path: str, owner: str, kind: str) -> tuple[str, str]:
        """tinker://<run>/<kind>/<name> -> (folder, base model), if `owner` owns the run."""
        if not isinstance(path, str) or not path.startswith("tinker://"):
            raise NotFound(f"path {path!r} not found (expected tinker://<run>/{kind}/<name>)")
        parts = path[len("tinker://"):].split("/")
        if len(parts) != 3 or parts[1] != kind or not _NAME.match(parts[2]):
            raise NotFound(f"path {path!r} not found (expected tinker://<run>/{kind}/<name>)")
        run_dir = self._run_dir(parts[0])
        try:
            with open(os.path.join(run_dir, "owner.json")) as f:
                meta = json.load(f)
        except (OSError, ValueError):
            raise NotFound(f"path {path!r} not found") from None
        folder = os.path.join(run_dir, kind, parts[2])
        if meta.get("owner") != owner or not os.path.isdir(folder) or self._expired(
                parts[0], f"{kind}/{parts[2]}"):
            raise NotFound(f"path {path!r} not found")
        return folder, meta.get("base_model", "")

    # ------------------------------------------------------------------ runs and checkpoints
    # Per run, checkpoints.json maps checkpoint ids ("<kind>/<name>") to their time,
    # expiry (None = never) and user metadata; the folders themselves are the truth.

    def _index(self, run: str) -> dict:
        try:
            with open(os.path.join(self._run_dir(run), "checkpoints.json")) as f:
                idx = json.load(f)
        except (OSError, ValueError):
            return {}
        return idx if isinstance(idx, dict) else {}

    def _expired(self, run: str, ckpt: str) -> bool:
        exp = (self._index(run).get(ckpt) or {}).get("expires_at")
        return exp is not None and exp <= time.time()

    def note_checkpoint(self, tinker_path: str, ttl_seconds=None, user_metadata=None) -> None:
        """Record a checkpoint just written (its TTL and user metadata)."""
        run, kind, name = tinker_path[len("tinker://"):].split("/")
        with self._lock:
            idx = self._index(run)
            idx[f"{kind}/{name}"] = {
                "time": time.time(), "user_metadata": user_metadata,
                "expires_at": None if ttl_seconds is None else time.time() + ttl_seconds}
            atomic_json(os.path.join(self._run_dir(run), "checkpoints.json"), idx)

    def _owned_run(self, run: str, owner: str) -> dict:
        meta = self._read_meta(self._run_dir(run))
        if meta is None or meta.get("owner") != owner:
            raise NotFound(f"training run {run!r} not found")
        return meta

    def _checkpoints(self, run: str) -> list[dict]:
        """Every live checkpoint of a run as the SDK's Checkpoint, oldest first."""
        run_dir, idx, out = self._run_dir(run), self._index(run), []
        for kind, ctype in CHECKPOINT_TYPES.items():
            with contextlib.suppress(OSError):
                for name in os.listdir(os.path.join(run_dir, kind)):
                    folder = os.path.join(run_dir, kind, name)
                    cid = f"{kind}/{name}"
                    rec = idx.get(cid) or {}
                    if not _NAME.match(name) or not os.path.isdir(folder) or self._expired(
                            run, cid):
                        continue
                    size = sum(os.path.getsize(os.path.join(d, f))
                               for d, _, fs in os.walk(folder) for f in fs)
                    out.append({"checkpoint_id": cid, "checkpoint_type": ctype,
                                "time": _iso(rec.get("time") or os.path.getmtime(folder)),
                                "tinker_path": f"tinker://{run}/{cid}", "size_bytes": size,
                                "public": False, "user_metadata": rec.get("user_metadata"),
                                "expires_at": _iso(rec.get("expires_at"))})
        return sorted(out, key=lambda c: c["time"])

    def training_run(self, run: str, owner: str) -> dict:
        """The SDK's TrainingRun of a run `owner` owns."""
        meta = self._owned_run(run, owner)
        ckpts = self._checkpoints(run)
        last = {t: next((c for c in reversed(ckpts) if c["checkpoint_type"] == t), None)
                for t in ("training", "sampler")}
        seen = max([meta.get("created", 0.0)] + [os.path.getmtime(os.path.join(
            self._run_dir(run), "owner.json"))])
        return {"training_run_id": run, "base_model": meta.get("base_model", ""),
                "model_owner": owner, "is_lora": True, "corrupted": False,
                "lora_rank": meta.get("lora_rank"), "last_request_time": _iso(seen),
                "last_checkpoint": last["training"], "last_sampler_checkpoint": last["sampler"],
                "user_metadata": meta.get("user_metadata")}

    def training_runs(self, owner: str, offset: int, limit: int) -> dict:
        runs = []
        with contextlib.suppress(OSError):
            for run in os.listdir(os.path.join(self.state_dir, "runs")):
                meta = self._read_meta(os.path.join(self.state_dir, "runs", run))
                if meta is not None and meta.get("owner") == owner:
                    runs.append((meta.get("created", 0.0), run))
        runs.sort(reverse=True)  # newest first
        page = [self.training_run(r, owner) for _, r in runs[offset:offset + limit]]
        return {"training_runs": page,
                "cursor": {"offset": offset, "limit": limit, "total_count": len(runs)}}

    def checkpoints(self, run: str, owner: str) -> dict:
        self._owned_run(run, owner)
        return {"checkpoints": self._checkpoints(run)}

    def checkpoint_folder(self, run: str, ckpt: str, owner: str) -> str:
        """The folder of checkpoint `ckpt` ("<kind>/<name>") of a run `owner` owns."""
        kind, _, name = ckpt.partition("/")
        if kind not in CHECKPOINT_TYPES:
            raise NotFound(f"checkpoint {ckpt!r} not found")
        return self.resolve(f"tinker://{run}/{kind}/{name}", owner, kind)[0]

    def set_ttl(self, run: str, ckpt: str, owner: str, ttl_seconds) -> None:
        self.checkpoint_folder(run, ckpt, owner)
        with self._lock:
            idx = self._index(run)
            rec = idx.setdefault(ckpt, {"time": time.time(), "user_metadata": None})
            rec["expires_at"] = None if ttl_seconds is None else time.time() + ttl_seconds
            atomic_json(os.path.join(self._run_dir(run), "checkpoints.json"), idx)

    def delete_folder(self, folder: str) -> None:
        """Delete a checkpoint folder (the worker calls this, so no load reads it meanwhile)
        and its index entry."""
        kind_dir = os.path.dirname(folder)
        run = os.path.basename(os.path.dirname(kind_dir))
        cid = f"{os.path.basename(kind_dir)}/{os.path.basename(folder)}"
        shutil.rmtree(folder, ignore_errors=True)
        with self._lock:
            idx = self._index(run)
            if idx.pop(cid, None) is not None:
                atomic_json(os.path.join(self._run_dir(run), "checkpoints.json"), idx)
            for sid in [s for s, r in self.samplers.items() if r.folder == folder]:
                del self.samplers[sid]

    def expired_folders(self) -> list[str]:
        """Folders of checkpoints whose TTL has passed (the worker deletes them)."""
        out, now = [], time.time()
        with contextlib.suppress(OSError):
            for run in os.listdir(os.path.join(self.state_dir, "runs")):
                for cid, rec in self._index(run).items():
                    exp = (rec or {}).get("expires_at")
                    if exp is not None and exp <= now:
                        out.append(os.path.join(self.state_dir, "runs", run, cid))
        return out

    # ------------------------------------------------------------------ samplers

    def add_sampler(self, owner: str, base_model: str, model_path: str | None,
                    folder: str | None) -> str:
        sid = f"sampler-{uuid.uuid4().hex[:16]}"
        with self._lock:
            self.samplers[sid] = SamplerRecord(sid, owner, base_model, model_path, folder)
        return sid

    def sampler(self, sid: str, owner: str) -> SamplerRecord:
        with self._lock:
            rec = self.samplers.get(sid)
        if rec is None or rec.owner != owner:
            raise NotFound(f"sampling session {sid!r} not found")
        return rec
