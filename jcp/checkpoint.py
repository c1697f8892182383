"""Adapter checkpoints: one adapter's state (weights, AdamW moments, step count, config)
saved and restored with orbax as global arrays, so any mesh loads what any mesh saved.

Owns the on-disk format of a checkpoint. It must never write a partial checkpoint where a
complete one stood, never let a checkpoint load that differs from what was saved, never
change trainer state when a checkpoint is refused, and never touch slot arrays itself
(jcp/adapter_state.py exports and installs them).

Layout (format 2). A checkpoint PATH is a directory:

    PATH/CURRENT                 {"format": 2, "version": n, "files_sha256": hex}
    PATH/v-<n>/                  one complete orbax checkpoint: items "state" (the arrays)
                                 and "meta" (rank, alpha, targets, base fingerprint, and
                                 per array its shape, dtype and sha256)
    PATH/v-<n>/jcp-files.json    {relative path: {"size", "sha256"}} of every other file
                                 in v-<n>; CURRENT holds this file's sha256

A save writes v-<n+1> beside the current version, records and fsyncs its files, then
replaces CURRENT with os.replace, then removes every other entry. Whenever a save is killed, CURRENT names a complete
version (the old one until the replace, the new one after it), and the next save clears
the leftovers. Only process 0 creates, renames and removes; the other processes write
their shards of the arrays through orbax.

Integrity, two layers. Files: after orbax has written every process's shards, process 0
hashes every file of the version into jcp-files.json, whose hash CURRENT records; a load
checks every file before orbax reads any (a damaged file is named, and orbax never parses
garbage). Values: each array's sha256 over the C-order little-endian bytes of its global
value (gathered to the host one array at a time, so independent of mesh and process
count) is recorded in the metadata; a load hashes every restored array and checks it is
finite. Between the two it checks the metadata's keys and types and the stored shapes.
Nothing is installed before every check has passed.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from orbax.checkpoint._src.metadata import array_metadata_store  # no public name in 0.12

from jcp.adapter_state import AdapterState
from jcp.config import QwenConfig
from jcp.errors import InputError
from jcp.files import fsync, fsync_tree, write_durably
from jcp.mesh import gather

# Format 1 was a bare orbax folder at PATH without checksums; it is refused
# with a message saying so rather than loaded unverified.
STATE_FORMAT = 2

POINTER = "CURRENT"
_POINTER_TMP = POINTER + ".tmp"
FILES = "jcp-files.json"
# Everything a save may leave in PATH: the pointer, its temporary, versions and orbax's
# temporary folders of versions ("v-3.orbax-checkpoint-tmp").
_OURS = re.compile(r"(CURRENT|CURRENT\.tmp|v-(\d+)(\.orbax-checkpoint-tmp.*)?)")
_META_KEYS = {
    "format": int,
    "rank": int,
    "alpha": (int, float),
    "targets": list,
    "base_fingerprint": str,
    "arrays": dict,
}
_HEX64 = re.compile(r"[0-9a-f]{64}")


def _checkpointer():
    """The arrays under "state" (a PyTree of jax.Arrays), the metadata under "meta" (JSON).

    Each replicated shard is written whole by its first replica: orbax's default,
    replica-parallel writing, slices every shard among its replicas with a program per
    shape (36 compiles for a new rank's adapter at mesh (1,2,2)), for adapters far too
    small to gain from it."""
    handler = ocp.type_handlers.ArrayHandler(
        array_metadata_store=array_metadata_store.Store(),  # as orbax's default handler
        use_replica_parallel=False,
    )
    arrays = ocp.type_handlers.create_type_handler_registry((jax.Array, handler))
    return ocp.Checkpointer(
        ocp.CompositeCheckpointHandler(
            state=ocp.PyTreeCheckpointHandler(type_handler_registry=arrays),
            meta=ocp.JsonCheckpointHandler(),
        )
    )


# A fault-injection hook: called with each phase of save_state as it completes ("planned",
# "written", "pointer-staged", "pointer-moved", "done"). None in use; the crash tests
# (tests/helpers/ckpt_kill_child.py) set it to SIGKILL the process at a phase.
on_phase = None


def _reached(phase: str) -> None:
    if on_phase is not None:
        on_phase(phase)


# ----------------------------------------------------------------------------------------
# save


def save_state(state: AdapterState, cfg: QwenConfig, slot: int, path) -> None:
    """Save one adapter: weights at its rank, AdamW moments, step count, its config, the
    base-model fingerprint and a sha256 of every array, as global arrays (loadable under
    any mesh).

    InputError, before anything is written, when `path` is a file or a folder holding
    anything but a jcp checkpoint. A checkpoint already at `path` is replaced atomically:
    killed at any point, `path` still loads the old or the new checkpoint, complete.
    """
    info = state.infos[slot]
    path = os.path.abspath(os.fspath(path))
    current = _check_save_target(path)
    version = 1 + max([current or 0] + [int(m.group(2)) for m in _our_entries(path) if m.group(2)])
    exported = state.export(slot)
    tree = {
        "weights": exported.weights,
        "mu": exported.mu,
        "nu": exported.nu,
        "count": exported.count,
    }
    meta = {
        "format": STATE_FORMAT,
        "rank": info.rank,
        "alpha": info.alpha,
        "targets": list(info.targets),
        "base_fingerprint": cfg.fingerprint(),
        "arrays": {name: _describe(x) for name, x in _flat(exported.values).items()},
    }
    if info.expert_lora is not None:  # only adapters of experts say how they hold them
        meta["expert_lora"] = info.expert_lora
    primary = jax.process_index() == 0
    _sync("jcp-save-plan")  # every process has read the folder before it changes
    if primary:
        os.makedirs(path, exist_ok=True)
        # Leftovers of killed saves. An unreadable CURRENT keeps every version.
        _remove_all_but(
            path,
            POINTER,
            *([f"v-{current}"] if current else [m.group(0) for m in _our_entries(path)]),
        )
    _sync("jcp-save-clean")
    _reached("planned")
    _checkpointer().save(
        os.path.join(path, f"v-{version}"),
        args=ocp.args.Composite(state=ocp.args.PyTreeSave(tree), meta=ocp.args.JsonSave(meta)),
    )
    _sync("jcp-save-written")
    _reached("written")
    if primary:
        vpath = os.path.join(path, f"v-{version}")
        files = json.dumps(_file_digests(vpath), indent=1, sort_keys=True).encode()
        write_durably(os.path.join(vpath, FILES), files)
        fsync_tree(vpath)  # all of the new version is durable before CURRENT names it
        fsync(path)
        pointer = {
            "format": STATE_FORMAT,
            "version": version,
            "files_sha256": hashlib.sha256(files).hexdigest(),
        }
        tmp = os.path.join(path, _POINTER_TMP)
        write_durably(tmp, (json.dumps(pointer) + "\n").encode())
        _reached("pointer-staged")
        os.replace(tmp, os.path.join(path, POINTER))
        fsync(path)
        _reached("pointer-moved")
        _remove_all_but(path, POINTER, f"v-{version}")
    _sync("jcp-save-done")
    _reached("done")


def _check_save_target(path: str) -> int | None:
    """InputError unless `path` is absent, an empty folder or a jcp checkpoint folder ->
    the version CURRENT names (None when there is none or it is unreadable)."""
    if os.path.lexists(path) and not os.path.isdir(path):
        raise InputError(
            f"refusing to save an adapter checkpoint to {path}: it is a file, not a folder"
        )
    if not os.path.isdir(path):
        return None
    for name in sorted(os.listdir(path)):
        if not _OURS.fullmatch(name):
            raise InputError(
                f"refusing to save an adapter checkpoint to {path}: it holds "
                f"{name!r}, which is not part of a jcp adapter checkpoint "
                f"(format {STATE_FORMAT}); remove it or choose another path"
            )
    try:
        return _read_pointer(path)[0]
    except InputError:
        return None


def _our_entries(path: str) -> list[re.Match]:
    if not os.path.isdir(path):
        return []
    return [m for m in map(_OURS.fullmatch, os.listdir(path)) if m]


def _remove_all_but(path: str, *keep: str) -> None:
    for name in os.listdir(path):
        if name not in keep:
            full = os.path.join(path, name)
            if os.path.isdir(full) and not os.path.islink(full):
                shutil.rmtree(full)
            else:
                os.remove(full)


def _sync(name: str) -> None:
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


# ----------------------------------------------------------------------------------------
# integrity


def _flat(tree: dict) -> dict:
    """{"weights": {"q_proj": {"a": x}}, "count": c} -> {"weights/q_proj/a": x, "count": c}."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {"/".join(str(k.key) for k in keys): x for keys, x in leaves}


def _digest(x: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(x, x.dtype.newbyteorder("<")).tobytes()).hexdigest()


def _describe(x: np.ndarray) -> dict:
    return {"shape": list(x.shape), "dtype": x.dtype.name, "sha256": _digest(x)}


def _file_digests(vpath: str) -> dict:
    """{path relative to vpath: {"size", "sha256"}} of every file in a version but FILES."""
    out = {}
    for root, _, names in os.walk(vpath):
        for name in names:
            rel = os.path.relpath(os.path.join(root, name), vpath)
            if rel != FILES:
                out[rel] = _file_digest(os.path.join(root, name))
    return out


def _file_digest(file: str) -> dict:
    h, size = hashlib.sha256(), 0
    with open(file, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
            size += len(chunk)
    return {"size": size, "sha256": h.hexdigest()}


def _check_files(path: str, vpath: str, files_sha256: str) -> None:
    """Every file of the version is the one written at save, byte for byte; InputError
    naming the first that is not (missing, extra, resized or changed)."""
    where = os.path.join(vpath, FILES)
    try:
        with open(where, "rb") as f:
            data = f.read()
    except OSError as e:
        raise InputError(f"{where}: cannot read the list of files ({e})") from None
    if hashlib.sha256(data).hexdigest() != files_sha256:
        raise InputError(
            f"{where} does not match the sha256 recorded in "
            f"{os.path.join(path, POINTER)}; the checkpoint is corrupt"
        )
    try:
        want = json.loads(data)
        good = isinstance(want, dict) and all(
            isinstance(v, dict) and set(v) == {"size", "sha256"} for v in want.values()
        )
    except ValueError:  # UnicodeDecodeError included
        good = False
    if not good:  # only a hand-made CURRENT can point at such a list
        raise InputError(f"{where} is not a list of files with their sizes and sha256")
    have = {}
    for root, _, names in os.walk(vpath):
        for name in names:
            rel = os.path.relpath(os.path.join(root, name), vpath)
            have[rel] = os.path.getsize(os.path.join(root, name))
    del have[FILES]
    for rel in sorted(set(want) | set(have)):
        file = os.path.join(vpath, rel)
        if rel not in have:
            raise InputError(f"{file} is missing; the checkpoint is incomplete")
        if rel not in want:
            raise InputError(f"{file} was not written by the save; the checkpoint was altered")
        if have[rel] != want[rel]["size"] or _file_digest(file) != want[rel]:
            raise InputError(
                f"{file} does not match the size and sha256 recorded when it "
                "was saved; the checkpoint is corrupt"
            )


# ----------------------------------------------------------------------------------------
# load


def _read_pointer(path: str) -> tuple[int, str]:
    """PATH/CURRENT -> (version, files_sha256); InputError if missing or malformed."""
    where = os.path.join(path, POINTER)
    try:
        with open(where, "rb") as f:
            pointer = json.loads(f.read().decode())
    except FileNotFoundError:
        raise InputError(_no_pointer(path)) from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise InputError(f"{where} is corrupt ({e})") from None
    if not isinstance(pointer, dict) or "format" not in pointer:
        raise InputError(f"{where} is corrupt (no format)")
    if pointer["format"] != STATE_FORMAT or isinstance(pointer["format"], bool):
        raise InputError(
            f"{where}: checkpoint format {pointer['format']!r}; this jcp reads "
            f"format {STATE_FORMAT}"
        )
    if set(pointer) != {"format", "version", "files_sha256"}:
        raise InputError(f"{where} is corrupt (expected keys format, version, files_sha256)")
    version, files = pointer["version"], pointer["files_sha256"]
    if (
        isinstance(version, bool)
        or not isinstance(version, int)
        or version < 1
        or not isinstance(files, str)
        or not _HEX64.fullmatch(files)
    ):
        raise InputError(f"{where} is corrupt (version {version!r}, files_sha256 {files!r})")
    return version, files


def _no_pointer(path: str) -> str:
    try:
        with open(os.path.join(path, "meta", "metadata")) as f:
            old = json.load(f).get("format") == 1
    except (OSError, ValueError, AttributeError):
        old = False
    if old:
        return (
            f"{path} is a jcp adapter checkpoint of format 1 (no checksums); this jcp "
            f"reads format {STATE_FORMAT}: load it with the jcp that wrote it and save "
            "it again"
        )
    return f"{path} is not a jcp adapter checkpoint (it has no {POINTER} file)"


def _read_meta(path: str) -> tuple[str, dict]:
    """-> (the current version's folder, its verified metadata)."""
    if not os.path.isdir(path):
        raise InputError(f"no adapter checkpoint at {path}")
    version, files_sha256 = _read_pointer(path)
    vpath = os.path.join(path, f"v-{version}")
    if not os.path.isdir(vpath):
        raise InputError(f"{path}: {POINTER} names v-{version}, which does not exist")
    _check_files(path, vpath, files_sha256)
    try:
        meta = _checkpointer().restore(vpath, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))[
            "meta"
        ]
    except Exception as e:  # orbax and json raise many types for damaged files
        raise InputError(f"{vpath}: cannot read the metadata ({_brief(e)})") from None
    # Intact metadata can still be wrong if it was written wrong: check keys and types.
    if not isinstance(meta, dict):
        raise InputError(f"{vpath}: the metadata is {type(meta).__name__}, not an object")
    if set(meta) - {"expert_lora"} != set(_META_KEYS):
        raise InputError(f"{vpath}: metadata keys {sorted(meta)}, expected {sorted(_META_KEYS)}")
    for key, types in _META_KEYS.items():
        if isinstance(meta[key], bool) or not isinstance(meta[key], types):
            raise InputError(f"{vpath}: metadata {key} = {meta[key]!r} has the wrong type")
    if not isinstance(meta.get("expert_lora", ""), str):
        raise InputError(
            f"{vpath}: metadata expert_lora = {meta['expert_lora']!r} has the wrong type"
        )
    if meta["format"] != STATE_FORMAT:
        raise InputError(f"{vpath}: metadata format {meta['format']}, expected {STATE_FORMAT}")
    if not all(isinstance(t, str) for t in meta["targets"]):
        raise InputError(f"{vpath}: metadata targets {meta['targets']!r} must be names")
    return vpath, meta


def _check_listed(vpath: str, listed: dict, want: dict) -> None:
    """The metadata lists exactly the arrays the adapter needs, at their shapes and dtypes."""
    if set(listed) != set(want):
        raise InputError(
            f"{vpath}: metadata lists arrays that rank and targets do not "
            f"need: missing {sorted(set(want) - set(listed))}, unexpected "
            f"{sorted(set(listed) - set(want))}"
        )
    for name, s in want.items():
        rec = listed[name]
        good = (
            isinstance(rec, dict)
            and set(rec) == {"shape", "dtype", "sha256"}
            and isinstance(rec["sha256"], str)
            and _HEX64.fullmatch(rec["sha256"])
        )
        if not good or rec["shape"] != list(s.shape) or rec["dtype"] != np.dtype(s.dtype).name:
            raise InputError(
                f"{vpath}: metadata of array {name} is {rec!r}; its rank and "
                f"targets need shape {list(s.shape)}, {np.dtype(s.dtype).name}"
            )


def _check_stored(vpath: str, want: dict, rank: int) -> None:
    """The arrays orbax stored have the shapes and dtypes the metadata promises."""
    try:
        stored = _flat(_checkpointer().metadata(vpath).item_metadata["state"].tree)
        stored = {k: (tuple(m.shape), np.dtype(m.dtype)) for k, m in stored.items()}
    except Exception as e:  # orbax raises many types for damaged files
        raise InputError(f"{vpath}: cannot read the array metadata ({_brief(e)})") from None
    for name, s in want.items():
        if name not in stored:
            raise InputError(f"{vpath}: array {name} is missing")
        if stored[name] != (tuple(s.shape), np.dtype(s.dtype)):
            raise InputError(
                f"{vpath}: array {name} is stored as {stored[name][1]}"
                f"{list(stored[name][0])}; the metadata's rank {rank} needs "
                f"{np.dtype(s.dtype)}{list(s.shape)}"
            )


def _brief(e: BaseException) -> str:
    """An orbax/TensorStore error in one line, naming the file it failed on if it says."""
    text = str(e) or type(e).__name__
    files = [f for f in re.findall(r'local file "([^"]+)"', text) if not f.endswith("/")]
    text = text.split(" [tensorstore_spec")[0].splitlines()[0]
    if len(text) > 240:  # keep the status and the innermost cause
        text = f"{text[:60]} … {text[-160:]}"
    return f"{files[-1]}: {text}" if files else text


def load_state(
    state: AdapterState,
    cfg: QwenConfig,
    path,
    slot: int,
    check_new_adapter,
    with_optimizer: bool = True,
) -> None:
    """Load a checkpoint of save_state into `slot`.

    Refused (InputError naming the checkpoint, and the file or array where it can; nothing
    changed) when the checkpoint is missing, damaged or corrupt (any hash, shape, key or
    type mismatch, a non-finite value), saved for a different base-model config, or the
    adapter does not fit (check_new_adapter(rank, alpha, targets, expert_lora) ->
    AdapterInfo raises). with_optimizer=False loads the weights only (fresh moments, step 0).
    The slot's gradient accumulator is zeroed.
    """
    path = os.path.abspath(os.fspath(path))
    vpath, meta = _read_meta(path)
    if meta["base_fingerprint"] != cfg.fingerprint():
        raise InputError(
            f"{path} was saved for a different base model (fingerprint "
            f"{meta['base_fingerprint']}, this trainer's {cfg.fingerprint()})"
        )
    info = check_new_adapter(
        meta["rank"], meta["alpha"], meta["targets"], meta.get("expert_lora", "shared_outer")
    )
    layout = state.layout(info)
    abstract = {
        "weights": layout,
        "mu": layout,
        "nu": layout,
        "count": jax.ShapeDtypeStruct((), np.int32, sharding=NamedSharding(state.mesh, P())),
    }
    want = _flat(abstract)
    _check_listed(vpath, meta["arrays"], want)
    _check_stored(vpath, want, info.rank)
    try:
        restored = _checkpointer().restore(
            vpath,
            args=ocp.args.Composite(
                state=ocp.args.PyTreeRestore(
                    abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract)
                )
            ),
        )["state"]
    except Exception as e:  # orbax and TensorStore raise many types for damaged files
        raise InputError(f"{vpath}: cannot read the arrays ({_brief(e)})") from None
    # The whole values on every process (gather is a collective): checked, then installed
    # as host arrays, which AdapterState pads to whole pages on the host — device arrays
    # of the checkpoint's rank were padded in a program per rank and leaf.
    values = jax.tree.map(gather, restored)
    for name, value in _flat(values).items():
        if _digest(value) != meta["arrays"][name]["sha256"]:
            raise InputError(
                f"{vpath}: array {name} does not match the sha256 recorded when "
                "it was saved; the checkpoint is corrupt"
            )
        if not np.all(np.isfinite(value)) or (name == "count" and value < 0):
            raise InputError(
                f"{vpath}: array {name} holds invalid values (non-finite or a negative step count)"
            )
    if with_optimizer:
        count = int(values["count"])
        state.install(slot, info, values["weights"], values["mu"], values["nu"], count)
    else:
        state.install(slot, info, values["weights"])
