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

`StateStore` is here with tenants, sessions, models and sampling sessions; its runs and
checkpoints are jcp.server.run_index (folders, the index, bounds, `saving`) and
jcp.server.run_listing (the REST reads, TTLs, deletion); its exceptions
jcp.server.store_errors. Every name callers use is importable from here.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import shutil
import threading
import time
import uuid

from jcp.server.run_index import (
    CHECKPOINT_TYPES,
    EPHEMERAL,
    GiB,
    RunIndex,
    RunRecord,
    checkpoint_name,
    folder_bytes,
    written_bytes,
)
from jcp.server.run_listing import RunListing
from jcp.server.store_errors import AuthError, LimitReached, NotFound, SessionEnded

# Importable from here, where the store is: the record types, errors and checkpoint names.
__all__ = [
    "CHECKPOINT_TYPES",
    "AuthError",
    "LimitReached",
    "ModelRecord",
    "NotFound",
    "RunRecord",
    "SamplerRecord",
    "SessionEnded",
    "SessionRecord",
    "StateStore",
    "TenantLimits",
    "age_recipients",
    "checkpoint_name",
    "folder_bytes",
    "read_api_keys",
    "written_bytes",
]


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


class StateStore(RunIndex, RunListing):
    """Tenants, sessions, models and sampling sessions (here), runs and checkpoints
    (RunIndex, RunListing); one lock over all of it (module docstring)."""

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
