"""Tinker SDK 0.39's REST additions: checkpoint search and external-weights uploads.

Owns POST /api/v1/checkpoints/search (a tenant's checkpoints by user_metadata, type and
base model, newest first, in cursor pages) and the upload of an adapter from outside:
POST external_weights_upload_start (a signed URL per file) -> PUT each file -> POST
external_weights_upload_finish -> a `tinker://<run>/external_weights/<name>` path, which
samples (Tinker and OpenAI routes) like named sampler weights. The wire shapes follow the
0.39 reference (tinker/types/checkpoint_search_*.py, external_weights_upload.py); where it
is silent the choice is said where it is made, and follows the 0.38 routes jcp serves.

An upload is what save_weights_external writes for this model: adapter_config.json and
adapter_model.safetensors, a PEFT LoRA of the rank and modules its lora_config names. Each
file is bounded (the config to CONFIG_BYTES, the tensors to what that rank can take) while
it streams in; the finish checks both (check_adapter: every tensor named, shaped and
finite, nothing else) before anything is recorded, through StateStore.saving, so a
refused or failed finish leaves no run, no checkpoint and no file. Files wait in
<state_dir>/uploads/<upload_id>/ (emptied at start) until the finish, which consumes the
upload whatever its outcome; an unfinished one is dropped when its URLs expire. Uploads
are bound to the tenant that started them: the URLs carry a random token, and another
tenant's finish is "not found" and leaves the upload as it was. It must never import jax
or touch the worker (the adapter's layout comes in as a PeftLayout, built by
jcp.server.service). Its routes are a module-level router over the AppContext.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import json
import math
import os
import secrets
import shutil
import struct
import time
import uuid
from collections.abc import Mapping

import numpy as np
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response

from jcp.peft_options import TENSOR_MEANING_OPTIONS
from jcp.server import edge
from jcp.server.context import context, takes
from jcp.server.edge import Refused
from jcp.server.state import NotFound, StateStore

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
FILES = (CONFIG_FILE, WEIGHTS_FILE)
CONFIG_BYTES = 64 << 10
UPLOAD_TTL_S = 15 * 60
MAX_UPLOADS = 8  # open uploads per tenant: bounds the staged bytes
# adapter_config.json options refused as jcp.peft's reader refuses them; per-module ranks
# and DoRA too (an upload is the plain LoRA of one rank that lora_config declares).
REFUSED_OPTIONS = (*TENSOR_MEANING_OPTIONS, "rank_pattern", "alpha_pattern", "use_dora")
# safetensors dtype -> (numpy dtype of its bits, mask of the exponent: all ones = inf/NaN).
DTYPES = {
    "F32": (np.dtype("<u4"), 0x7F800000),
    "F16": (np.dtype("<u2"), 0x7C00),
    "BF16": (np.dtype("<u2"), 0x7F80),
}


@dataclasses.dataclass(frozen=True)
class PeftLayout:
    """The PEFT tensors an adapter of the served model can hold.

    keys: tensor name -> (module, "a" | "b", its rank-free size: in features of lora_A
    [r, I], out features of lora_B [O, r]). groups: LoraConfig flag -> the modules it
    selects (None: not uploadable — a MoE model's experts, which PEFT stores as fused
    target_parameters). fingerprint: the base model's, which jcp writes in the
    safetensors metadata (a file carrying another one was written for another model)."""

    keys: Mapping[str, tuple[str, str, int]]
    groups: Mapping[str, tuple[str, ...] | None]
    fingerprint: str

    def modules(self, flags: dict) -> set[str]:
        """The modules a lora_config's train_* flags select; Refused for the experts."""
        out = set()
        for flag, on in flags.items():
            if on and self.groups[flag] is None:
                raise Refused(
                    422,
                    f"external_weights_upload_start: lora_config.{flag}: uploads of a "
                    "mixture-of-experts model's experts are not supported; set it false",
                )
            out |= set(self.groups[flag] or ()) if on else set()
        if not out:
            raise Refused(
                422,
                "external_weights_upload_start: lora_config: at least one of train_attn, "
                "train_mlp, train_unembed must be true",
            )
        return out

    def header_bytes(self) -> int:
        return (16 << 10) + 512 * len(self.keys)

    def weights_bytes(self, rank: int, modules: set[str]) -> int:
        """The most bytes adapter_model.safetensors of this rank and these modules takes
        (fp32, the widest dtype read)."""
        data = sum(4 * rank * n for m, _, n in self.keys.values() if m in modules)
        return 8 + self.header_bytes() + data


# ---------------------------------------------------------------------- the file check


def check_adapter(folder: str, layout: PeftLayout, rank: int, modules: set[str]) -> None:
    """Refused (422, naming the file and what is wrong) unless `folder` holds the PEFT
    LoRA jcp's reader takes exactly, of rank `rank` over `modules`: its config names them
    and nothing that changes what the tensors mean; its safetensors holds every lora_A
    [r, I] and lora_B [O, r] of them and nothing else, each fp32, fp16 or bf16 and finite,
    laid out without gap or overlap."""
    cfg = _config(os.path.join(folder, CONFIG_FILE))

    def bad(what: str) -> Refused:
        return Refused(422, f"external_weights_upload_finish: {CONFIG_FILE}: {what}")

    if cfg.get("peft_type", "LORA") != "LORA":
        raise bad(f"peft_type {cfg.get('peft_type')!r} is not LORA")
    if cfg.get("r") != rank or isinstance(cfg.get("r"), bool):
        raise bad(f"r {cfg.get('r')!r} is not lora_config.rank {rank}")
    alpha = cfg.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise bad(f"lora_alpha must be a finite number, got {alpha!r}")
    for key in REFUSED_OPTIONS:
        if cfg.get(key):
            raise bad(f"{key} is not supported")
    if cfg.get("bias", "none") != "none":
        raise bad(f"bias {cfg.get('bias')!r} is not supported")
    targets = cfg.get("target_modules")
    if not isinstance(targets, list) or set(targets) != modules or len(targets) != len(modules):
        raise bad(
            f"target_modules {str(targets)[:200]} must be {sorted(modules)}: the modules "
            "lora_config's train_* flags select on this model"
        )
    _check_tensors(os.path.join(folder, WEIGHTS_FILE), layout, rank, modules)


def _config(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise Refused(
            422, f"external_weights_upload_finish: {CONFIG_FILE} is not JSON ({e})"
        ) from None
    if not isinstance(cfg, dict):
        raise Refused(422, f"external_weights_upload_finish: {CONFIG_FILE} must hold an object")
    return cfg


def _check_tensors(path: str, layout: PeftLayout, rank: int, modules: set[str]) -> None:
    def bad(what: str) -> Refused:
        return Refused(422, f"external_weights_upload_finish: {WEIGHTS_FILE}: {what}")

    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if not 2 <= n <= min(layout.header_bytes(), size - 8):
            raise bad("not a safetensors file (its header length is missing or out of range)")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, ValueError, RecursionError):
            header = None
        if not isinstance(header, dict):
            raise bad("not a safetensors file (its header is not a JSON object)")
        meta = header.pop("__metadata__", None) or {}
        got = meta.get("jcp_base_fingerprint") if isinstance(meta, dict) else None
        if got is not None and got != layout.fingerprint:
            raise bad("written by jcp for another base model (jcp_base_fingerprint differs)")
        want = {k for k, (m, _, _) in layout.keys.items() if m in modules}
        missing, extra = sorted(want - set(header)), sorted(set(header) - want)
        if missing or extra:
            name = (missing or extra)[0]
            raise bad(
                f"{'lacks' if missing else 'holds a tensor it may not'} {name[:200]!r} "
                f"({len(missing)} missing, {len(extra)} unexpected)"
            )
        spans = []
        for k, t in header.items():
            module, which, dim = layout.keys[k]
            shape = [rank, dim] if which == "a" else [dim, rank]
            dtype = t.get("dtype") if isinstance(t, dict) else None
            offs = t.get("data_offsets") if isinstance(t, dict) else None
            if dtype not in DTYPES:
                raise bad(f"{k}: dtype {str(dtype)[:20]!r} is not F32, F16 or BF16")
            if t.get("shape") != shape:
                raise bad(f"{k}: shape {str(t.get('shape'))[:40]} is not {shape}")
            bits = DTYPES[dtype][0]
            if (
                not isinstance(offs, list)
                or len(offs) != 2
                or not all(isinstance(o, int) and not isinstance(o, bool) for o in offs)
                or offs[1] - offs[0] != rank * dim * bits.itemsize
            ):
                raise bad(f"{k}: data_offsets {str(offs)[:60]} do not fit its shape and dtype")
            spans.append((offs[0], offs[1], k, dtype))
        spans.sort()
        end = 0
        for b, e, k, _ in spans:
            if b != end:
                raise bad(f"{k}: its data overlaps another tensor's or leaves a gap")
            end = e
        if 8 + n + end != size:
            raise bad(f"{size - 8 - n} bytes of data, but the header lays out {end}")
        base = 8 + n
        for b, e, k, dtype in spans:  # no NaN or inf ever reaches an adapter
            bits, mask = DTYPES[dtype]
            f.seek(base + b)
            x = np.frombuffer(f.read(e - b), bits)
            if np.any((x & mask) == mask):
                raise bad(f"{k}: holds a NaN or an infinity")


# ---------------------------------------------------------------------- uploads


@dataclasses.dataclass
class Upload:
    upload_id: str
    owner: str
    base_model: str
    rank: int
    flags: dict
    modules: set
    bounds: dict  # file -> its most bytes
    tokens: dict  # file -> its URL token
    folder: str
    expires: float


class Uploads:
    """Open uploads by id and by URL token, MAX_UPLOADS per tenant; an expired one is
    dropped (its staged files removed) at the next call. Used on the event loop only."""

    def __init__(self, root: str):
        self.root = root
        shutil.rmtree(root, ignore_errors=True)  # left by a server that was stopped
        self._open: dict[str, Upload] = {}
        self._tokens: dict[str, tuple[str, str]] = {}  # token -> (upload id, file)

    def sweep(self) -> None:
        now = time.time()
        for up in [u for u in self._open.values() if u.expires <= now]:
            self.drop(up)

    def drop(self, up: Upload) -> None:
        self._open.pop(up.upload_id, None)
        for tok in up.tokens.values():
            self._tokens.pop(tok, None)
        shutil.rmtree(up.folder, ignore_errors=True)

    def new(self, **kw) -> Upload:
        self.sweep()
        owner = kw["owner"]
        if sum(u.owner == owner for u in self._open.values()) >= MAX_UPLOADS:
            raise Refused(
                429, f"this tenant has {MAX_UPLOADS} open uploads; finish them or let them expire"
            )
        uid = f"upload-{uuid.uuid4().hex}"
        folder = os.path.join(self.root, uid)
        os.makedirs(folder)
        up = Upload(
            upload_id=uid,
            tokens={f: secrets.token_urlsafe(32) for f in FILES},
            folder=folder,
            expires=time.time() + UPLOAD_TTL_S,
            **kw,
        )
        self._open[uid] = up
        self._tokens.update({tok: (uid, f) for f, tok in up.tokens.items()})
        return up

    def by_token(self, token: str, file: str) -> Upload:
        self.sweep()
        uid, f = self._tokens.get(token, (None, None))
        if uid is None or f != file:
            raise NotFound("upload URL unknown or expired; start a new upload")
        return self._open[uid]

    def take(self, upload_id, owner: str) -> Upload:
        """The open upload `owner` started, no longer open (NotFound otherwise: another
        tenant's is left as it is)."""
        self.sweep()
        up = self._open.get(upload_id) if isinstance(upload_id, str) else None
        if up is None or up.owner != owner:
            raise NotFound(f"upload {str(upload_id)[:80]!r} not found")
        for tok in up.tokens.values():
            self._tokens.pop(tok, None)
        del self._open[upload_id]
        return up


def _iso(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.UTC).isoformat()


def mount(app: FastAPI) -> None:
    """Add the routes to `app` (jcp.server.app.create_app calls this, its AppContext on
    app.state.jcp) with the uploads' staging folder under the state folder."""
    app.state.uploads = Uploads(os.path.join(app.state.jcp.store.state_dir, "uploads"))
    app.include_router(router)


router = APIRouter()


# The route is the 0.38 /api/v1/sessions/search's twin: the reference gives the
# request and response types but not the path.
@router.post("/api/v1/checkpoints/search", **takes(edge.SearchCheckpoints))
async def search_checkpoints(request: Request):
    c = context(request)
    who, body, req = await c.parsed(request, edge.SearchCheckpoints, "search_checkpoints")
    if req.project_ids:  # "naming a project the caller cannot list is an error"
        raise NotFound(f"project {req.project_ids[0][:80]!r} not found (jcp has none)")
    if req.owner.type == "user":
        # Tenants see only their own checkpoints; "accessible" is theirs too.
        raise Refused(422, "search_checkpoints: owner: only 'own' and 'accessible' are served")
    after = None
    if req.cursor is not None:
        try:
            t = datetime.datetime.fromisoformat(req.cursor.last_created_at)
        except ValueError:
            t = None
        if t is None or t.tzinfo is None:
            raise Refused(
                422, "search_checkpoints: cursor.last_created_at: not an aware ISO datetime"
            )
        after = (t.astimezone(datetime.UTC), req.cursor.last_checkpoint_uuid)
    page, last = c.store.search_checkpoints(
        who, req.user_metadata, req.checkpoint_type, req.base_models, req.limit, after
    )
    # last_checkpoint_uuid: jcp's checkpoints have no uuid; the tinker path is as
    # unique, and the cursor is opaque to clients.
    cursor = (
        None
        if last is None
        else {"last_created_at": last[0].isoformat(), "last_checkpoint_uuid": last[1]}
    )
    return {"checkpoints": page, "next_cursor": cursor}


@router.post("/api/v1/external_weights_upload_start", **takes(edge.UploadStart))
async def upload_start(request: Request):
    c = context(request)
    who, body, req = await c.parsed(request, edge.UploadStart, "external_weights_upload_start")
    if req.base_model != c.served.name:
        raise NotFound(
            f"base model {req.base_model[:200]!r} not found; this server serves {c.served.name!r}"
        )
    if req.destination_project_id is not None:
        raise NotFound(f"project {req.destination_project_id[:80]!r} not found (jcp has none)")
    layout, rank = c.served.peft, req.lora_config.rank
    if layout is None:
        raise Refused(422, "external_weights_upload_start: this server takes no uploads")
    if not 1 <= rank <= c.served.max_rank:
        raise Refused(
            422,
            f"external_weights_upload_start: lora_config.rank {rank} must be in "
            f"[1, {c.served.max_rank}] (--max-rank)",
        )
    flags = {k: getattr(req.lora_config, k) for k in ("train_attn", "train_mlp", "train_unembed")}
    modules = layout.modules(flags)
    c.store.check_room(who, new_run=True, save=True)
    up = request.app.state.uploads.new(
        owner=who,
        base_model=req.base_model,
        rank=rank,
        flags=flags,
        modules=modules,
        bounds={
            CONFIG_FILE: CONFIG_BYTES,
            WEIGHTS_FILE: layout.weights_bytes(rank, modules),
        },
    )
    base = str(request.base_url).rstrip("/")
    return {
        "upload_id": up.upload_id,
        "urls": {
            f: f"{base}/api/v1/external_weights_upload/{tok}/{f}" for f, tok in up.tokens.items()
        },
        "expires": _iso(up.expires),
    }


# A signed URL: the token is the credential (as a storage bucket's signed PUT URL, which
# clients call without their API key).
@router.put(
    "/api/v1/external_weights_upload/{token}/{file}",
    **takes(None, "application/octet-stream"),
)
async def upload_file(token: str, file: str, request: Request):
    up = request.app.state.uploads.by_token(token, file)
    limit = up.bounds[file]
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise Refused(413, f"{file}: {length} bytes exceed this upload's bound of {limit}")
    tmp = os.path.join(up.folder, f".{file}.{uuid.uuid4().hex[:8]}")
    try:
        size = 0
        with open(tmp, "wb") as f:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise Refused(413, f"{file}: more than this upload's bound of {limit} bytes")
                f.write(chunk)
        os.replace(tmp, os.path.join(up.folder, file))
    except FileNotFoundError:  # the upload finished or expired meanwhile
        raise NotFound("upload URL unknown or expired; start a new upload") from None
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return Response(status_code=200)


@router.post("/api/v1/external_weights_upload_finish", **takes(edge.UploadFinish))
async def upload_finish(request: Request):
    c = context(request)
    who, body, req = await c.parsed(request, edge.UploadFinish, "external_weights_upload_finish")
    up = request.app.state.uploads.take(req.upload_id, who)
    try:
        for f in FILES:
            if not os.path.isfile(os.path.join(up.folder, f)):
                raise Refused(422, f"external_weights_upload_finish: {f} was not uploaded")
        path = await asyncio.to_thread(install, c.store, up, c.served.peft)
    finally:
        shutil.rmtree(up.folder, ignore_errors=True)
    return {"tinker_path": path}


def install(store: StateStore, up: Upload, layout: PeftLayout) -> str:
    """Check an upload's files and record them as checkpoint external_weights/final of a
    new run named by the upload (Refused, nothing recorded or left, if they fail)."""
    check_adapter(up.folder, layout, up.rank, up.modules)
    # The checkpoint's name: the reference is silent; "final", as a run's last save.
    with store.saving(
        up.owner,
        up.upload_id,
        "external_weights",
        "final",
        new_run={
            "base_model": up.base_model,
            "lora_rank": up.rank,
            **up.flags,
            "user_metadata": None,
        },
    ) as (path, folder):
        os.makedirs(folder)
        for f in FILES:
            os.replace(os.path.join(up.folder, f), os.path.join(folder, f))
    return path
