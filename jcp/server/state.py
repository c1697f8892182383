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

import dataclasses
import json
import os
import re
import threading
import uuid

_NAME = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
_RUN = re.compile(r"^[A-Za-z0-9._:-]{1,200}$")
KINDS = ("weights", "sampler_weights")


class NotFound(LookupError):
    """Unknown, or owned by another key (indistinguishable on purpose)."""


class AuthError(PermissionError):
    pass


@dataclasses.dataclass
class ModelRecord:
    model_id: str
    owner: str
    base_model: str
    rank: int
    slot: int | None = None


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
        self.sessions: dict[str, str] = {}           # session id -> owner
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
            self.sessions[sid] = owner
        return sid

    def check_session(self, sid: str, owner: str) -> None:
        with self._lock:
            if self.sessions.get(sid) != owner:
                raise NotFound(f"session {sid!r} not found")

    # ------------------------------------------------------------------ models

    @staticmethod
    def model_id(session_id: str, model_seq_id: int) -> str:
        # The SDK derives the same id from (session_id, model_seq_id) for
        # create_training_client_from_state, so this format is part of the protocol.
        return f"{session_id}:train:{model_seq_id}"

    def add_model(self, rec: ModelRecord) -> None:
        with self._lock:
            self.models[rec.model_id] = rec
        run = self._run_dir(rec.model_id)
        os.makedirs(run, exist_ok=True)
        with open(os.path.join(run, "owner.json"), "w") as f:
            json.dump({"owner": rec.owner, "base_model": rec.base_model}, f)

    def model(self, model_id: str, owner: str) -> ModelRecord:
        with self._lock:
            rec = self.models.get(model_id)
        if rec is None or rec.owner != owner:
            raise NotFound(f"model {model_id!r} not found")
        return rec

    def drop_model(self, model_id: str) -> None:
        with self._lock:
            self.models.pop(model_id, None)

    # ------------------------------------------------------------------ paths

    def _run_dir(self, run: str) -> str:
        if not _RUN.match(run) or run in (".", ".."):
            raise NotFound(f"run {run!r} not found")
        return os.path.join(self.state_dir, "runs", run)

    def new_path(self, model_id: str, kind: str, name: str | None) -> tuple[str, str]:
        """-> (tinker path, folder) for a new checkpoint of the model."""
        if name is None:
            name = f"ephemeral-{uuid.uuid4().hex[:12]}"
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
