"""The REST routes of jcp-serve over training runs and checkpoints, and the downloads.

Training runs, checkpoints, TTLs, weights info and copies answer from the state store, or
wait for the worker (AppContext.run_now) when they touch folders a load might be reading;
external-weights download URLs carry expiring per-file tokens (AppContext.tokens, kept per
tenant). No jax, no worker.
"""

from __future__ import annotations

import datetime
import os
import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, Response

from jcp.server import edge
from jcp.server.context import AppContext, context, takes
from jcp.server.edge import Refused
from jcp.server.state import NotFound

URL_TTL_S = 15 * 60


router = APIRouter()


@router.get("/api/v1/training_runs")
async def training_runs(request: Request, limit: int = 20, offset: int = 0):
    c = context(request)
    if not (1 <= limit <= 1000 and offset >= 0):
        raise Refused(422, "limit must be in [1, 1000] and offset ≥ 0")
    return c.store.training_runs(c.owner(request), offset, limit)


@router.get("/api/v1/training_runs/{run}")
async def training_run(run: str, request: Request):
    c = context(request)
    return c.store.training_run(run, c.owner(request))


@router.get("/api/v1/training_runs/{run}/checkpoints")
async def checkpoints(run: str, request: Request):
    c = context(request)
    return c.store.checkpoints(run, c.owner(request))


@router.delete("/api/v1/training_runs/{run}/checkpoints/{kind}/{name}")
async def delete_checkpoint(run: str, kind: str, name: str, request: Request):
    c = context(request)
    who = c.owner(request)
    folder = c.store.checkpoint_folder(run, f"{kind}/{name}", who)
    await c.run_now(who, "delete_checkpoint", {"folder": folder})
    return Response(status_code=200)


@router.put("/api/v1/training_runs/{run}/checkpoints/{kind}/{name}/ttl", **takes(edge.SetTtl))
async def set_ttl(run: str, kind: str, name: str, request: Request):
    c = context(request)
    who, body = c.owner(request), await c.body_json(request)
    seconds = edge.parse(edge.SetTtl, body, "set_ttl").ttl_seconds
    c.store.set_ttl(run, f"{kind}/{name}", who, seconds)
    return Response(status_code=200)


def checkpoint(c: AppContext, path, who: str) -> tuple[list[str], str]:
    """tinker://<run>/<kind>/<name> of a checkpoint `who` owns -> ([run, kind, name],
    its folder); NotFound otherwise."""
    parts = path[len("tinker://") :].split("/") if isinstance(path, str) else []
    if len(parts) != 3:
        raise NotFound(f"path {path!r} not found")
    return parts, c.store.checkpoint_folder(parts[0], f"{parts[1]}/{parts[2]}", who)


@router.post("/api/v1/weights_info", **takes(edge.WeightsInfo))
async def weights_info(request: Request):
    c = context(request)
    who, body = c.owner(request), await c.body_json(request)
    path = edge.parse(edge.WeightsInfo, body, "weights_info").tinker_path
    parts, _ = checkpoint(c, path, who)
    run = c.store.training_run(parts[0], who)
    info = c.store.run_info(path, who) if parts[1] == "weights" else {}
    return {
        "base_model": run["base_model"],
        "is_lora": True,
        "lora_rank": run["lora_rank"],
        "optimizer_config": {"type": "adamw"},
        **{k: info.get(k) for k in ("train_unembed", "train_mlp", "train_attn")},
    }


@router.post("/api/v1/copy_weights", **takes(edge.CopyWeights))
async def copy_weights(request: Request):
    c = context(request)
    who, body, req = await c.parsed(request, edge.CopyWeights, "copy_weights")
    parts, folder = checkpoint(c, req.source_path, who)
    if req.session_id is not None:
        c.store.check_session(req.session_id, who)
        if req.model_seq_id is None:
            raise Refused(
                422, "copy_weights: model_seq_id must be a non-negative integer with session_id"
            )
        dest = c.store.model_id(req.session_id, req.model_seq_id)
    else:
        dest = f"copy-{uuid.uuid4().hex[:16]}"
    info = c.store.run_info(f"tinker://{parts[0]}/weights/x", who, must_exist=False)
    c.store.check_room(who, new_run=True, save=True)
    return await c.run_now(
        who,
        "copy_weights",
        {
            "folder": folder,
            "kind": parts[1],
            "dest_run": dest,
            "run_info": {**info, "lora_rank": c.store.training_run(parts[0], who)["lora_rank"]},
            "ttl_seconds": req.ttl_seconds,
        },
    )


# ------------------------------------------------------------------ downloads
# Every file of an external-weights checkpoint gets its own URL token: random,
# expiring after URL_TTL_S, bound to the tenant and the checkpoint that issued it (a
# token whose checkpoint is deleted, expired or no longer the tenant's is refused).


@router.get("/api/v1/training_runs/{run}/checkpoints/{kind}/{name}/external_weights_urls")
async def external_weights_urls(run: str, kind: str, name: str, request: Request):
    c = context(request)
    who = c.owner(request)
    if kind != "external_weights":
        raise NotFound(f"checkpoint {kind}/{name!r} is not external weights")
    folder = c.store.checkpoint_folder(run, f"{kind}/{name}", who)
    expires = time.time() + URL_TTL_S
    base = str(request.base_url).rstrip("/")
    urls = {}
    for f in sorted(os.listdir(folder)):
        tok = c.tokens.new(who, run, f"{kind}/{name}", f, expires)
        urls[f] = f"{base}/api/v1/external_weights/{tok}/{f}"
    return {
        "urls": urls,
        "expires": datetime.datetime.fromtimestamp(expires, datetime.UTC).isoformat(),
    }


@router.get("/api/v1/external_weights/{token}/{file}")
async def download(token: str, file: str, request: Request):
    c = context(request)
    rec = c.tokens.get(token)
    if rec is None or rec[4] < time.time() or rec[3] != file:
        raise NotFound("download URL unknown or expired; request new URLs")
    who, run, ckpt, f, _ = rec
    folder = c.store.checkpoint_folder(run, ckpt, who)
    return FileResponse(os.path.join(folder, f), filename=f)
