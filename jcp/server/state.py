"""The server's state store: tenants, sessions, models, sampling sessions, and the folders
behind `tinker://` paths.

Owns who owns what, and where checkpoints live on disk:
    <state_dir>/runs/<model_id>/owner.json
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
# Sampler weights saved without a name: deleted with their model (or their TTL).
EPHEMERAL = "ephemeral-"


class NotFound(LookupError):
    """Unknown, or owned by another key (indistinguishable on purpose)."""


class AuthError(PermissionError):
    pass


class SessionEnded(LookupError):
    """A request for a session that has finished or expired (HTTP 410, as Tinker)."""


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
    """`key [name]` per line (# comments, blank lines skipped) -> {key: tenant name}."""
    keys = {}
    with open(path) as f:
        for i, line in enumerate(f, 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.split()
            if len(parts) > 2:
                raise ValueError(f"{path}:{i}: expected `key [name]`, got {line!r}")
            keys[parts[0]] = parts[1] if len(parts) == 2 else parts[0]
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

    def run_info(self, path: str, owner: str) -> dict:
        """The run_info (train_* flags, user_metadata) of the run that saved `path`."""
        folder, _ = self.resolve(path, owner, "weights")
        meta = self._read_meta(os.path.dirname(os.path.dirname(folder))) or {}
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
        if meta.get("owner") != owner or not os.path.isdir(folder):
            raise NotFound(f"path {path!r} not found")
        return folder, meta.get("base_model", "")

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
