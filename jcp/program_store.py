"""Compiled programs kept on disk and found without tracing, so that a restart loads them.

JAX's persistent compilation cache is keyed by the lowered program: a warm restart still
traces and lowers every program to find its key (jcp-serve's warm-up on the tiny model:
27 s tracing, 22 s lowering of a 107-s warm restart). This store keys a compiled program
by what it is built from instead — the jitted function's builder and its arguments (model
config, mesh, step settings), the call's static arguments and its arguments' tree,
shapes, dtypes and shardings — together with a fingerprint of everything else its code
depends on: jcp's own source, the versions of the libraries that trace and compile it,
the XLA and JAX settings of the environment, the backend and its devices. Any change of
these is a new key, so a program is never loaded for code or settings it was not built
from. The folder is bounded (`use`'s max_bytes, 8 GiB by default, as jcp's JAX cache):
past it, the programs used longest ago are deleted — older fingerprints first, as nothing
loads them — so two jcp versions sharing a folder keep each other's programs.

It is on where jcp-serve and jcp-train keep their compilation cache (`--compilation-cache`,
a folder `jcp-programs` inside it, which files.private_folder has made this user's
alone), off for library use unless `use(folder)` is called, and off in multi-process jobs.
A program whose key would not be stable across processes (an argument whose repr names an
object's address, such as a custom loss) is compiled and kept in memory only. A file that
fails its checksum or does not load is deleted and the program compiled again. Only what
this process compiled is stored: XLA:CPU cannot serialize again an executable that JAX's
persistent cache handed back (the copy fails at its first run), so such a program comes
from JAX's cache on each start.
"""

from __future__ import annotations

import functools
import glob
import hashlib
import importlib.metadata
import os
import pickle
import sys
import threading

import jax
import numpy as np

from jcp import files

MAGIC = b"JCPPROG1"
SUFFIX = ".jcpprog"
# Environment variables read into the fingerprint: anything that may change how a program
# is traced or compiled.
ENV_PREFIXES = ("XLA_", "JAX_", "JCP_", "LIBTPU", "TPU_", "CUDA_", "NVIDIA_TF32")
LIBRARIES = ("jax", "jaxlib", "optax", "numpy", "ml_dtypes")

# The folder's bound by default (jcp's JAX compilation cache has the same, cli.py).
MAX_BYTES = 8 << 30

_FOLDER: list = [None]
_MAX: list = [MAX_BYTES]
_LOADED = [0]  # programs this process loaded from the store
# Per thread: programs JAX's persistent compilation cache handed this thread (its
# monitoring event is recorded in the compiling thread).
_FROM_JAX_CACHE = threading.local()


def _count_cache_hit(event: str, **kwargs) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        _FROM_JAX_CACHE.hits = _cache_hits() + 1


jax.monitoring.register_event_listener(_count_cache_hit)


def _cache_hits() -> int:
    """Programs JAX's persistent cache has handed this thread so far."""
    return getattr(_FROM_JAX_CACHE, "hits", 0)


def use(folder: str | None, max_bytes: int | None = MAX_BYTES) -> str | None:
    """Keep compiled programs in `folder` (made this user's alone, files.private_folder),
    at most max_bytes of them (None: unbounded; past it, the programs used longest ago are
    deleted) -> its absolute path; None turns the store off. Touches no JAX backend
    (jcp-serve calls it before jax.distributed starts). ValueError when the folder cannot
    be made private or max_bytes is negative."""
    if max_bytes is not None and max_bytes < 0:
        raise ValueError(f"program store: max_bytes {max_bytes} is negative")
    if folder is not None:
        folder = os.path.abspath(folder)
        why = files.private_folder(folder)
        if why:
            raise ValueError(f"program store {folder}: {why}")
    _FOLDER[0], _MAX[0] = folder, max_bytes
    return folder


def loaded() -> int:
    """How many programs this process has loaded from the store."""
    return _LOADED[0]


def folder() -> str | None:
    """The store's folder, or None when it is off — also in a multi-process job, where
    each process would load programs for its own devices."""
    where = _FOLDER[0]
    if where is None or jax.process_count() > 1:
        return None
    return where


def _bound(where: str, keep: str) -> None:
    """Delete the folder's programs used longest ago (a load touches its file's mtime)
    until they fit in _MAX — never `keep`, the one just written. Other processes may
    share the folder: a file gone meanwhile is skipped."""
    limit = _MAX[0]
    if limit is None:
        return
    held = []
    with os.scandir(where) as entries:
        for e in entries:
            try:
                if e.name.endswith(SUFFIX) and e.is_file(follow_symlinks=False):
                    st = e.stat(follow_symlinks=False)
                    held.append((st.st_mtime_ns, st.st_size, e.path))
            except OSError:
                continue
    total = sum(size for _, size, _ in held)
    for _, size, path in sorted(held):
        if total <= limit:
            break
        if path != keep:
            _remove(path)
            total -= size


@functools.cache
def fingerprint() -> str:
    """sha256 of what every program's compiled code depends on besides its arguments."""
    h = hashlib.sha256()
    root = os.path.dirname(os.path.abspath(__file__))
    for path in sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True)):
        h.update(os.path.relpath(path, root).encode() + b"\0")
        with open(path, "rb") as f:
            h.update(f.read() + b"\0")
    versions = []
    for name in LIBRARIES:
        try:
            versions.append((name, importlib.metadata.version(name)))
        except importlib.metadata.PackageNotFoundError:
            versions.append((name, None))
    env = sorted((k, v) for k, v in os.environ.items() if k.startswith(ENV_PREFIXES))
    backend = jax.devices()[0].client
    settings = (
        jax.config.jax_enable_x64,
        jax.config.jax_default_matmul_precision,
        jax.config.jax_numpy_rank_promotion,
    )
    h.update(
        repr(
            (versions, env, backend.platform, backend.platform_version, settings, sys.version)
        ).encode()
    )
    return h.hexdigest()


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def _signature(x) -> tuple:
    """What a compiled program is specialised on for one argument leaf, as hashable values
    (cheap: every call computes it; the store's key is its text, made on a miss only)."""
    if isinstance(x, jax.Array):
        return (x.shape, x.dtype, x.weak_type, _sharding(x.sharding))
    return (np.shape(x), type(x), getattr(x, "dtype", None))


def _sharding(sharding):
    """A NamedSharding in one spelling of its placement: PartitionSpec() and
    PartitionSpec(None, None) place an array alike (a compiled program takes either) but
    compare unequal: on a restarted jcp-serve, the engine's weights after a training step
    came in the short one and missed the programs its warm-up had prepared with the long
    one, so the first sampling round traced and loaded them again (1.0-1.5 s). Each entry
    as a tuple of mesh axes (None for none), axes of size 1 dropped (they split nothing: a
    tp = 1 engine's weights came back from a training step split over 'tp'), trailing
    Nones dropped."""
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return sharding
    sizes = dict(sharding.mesh.shape)
    spec = []
    for entry in sharding.spec:
        if isinstance(entry, str):
            entry = (entry,)
        if isinstance(entry, (tuple, list)):  # an axis of size 1 splits nothing
            entry = tuple(a for a in entry if sizes.get(a) != 1) or None
        spec.append(entry)
    while spec and spec[-1] is None:
        spec.pop()
    return ("NamedSharding", sharding.mesh, tuple(spec), sharding.memory_kind)


class StoredPrograms:
    """The compiled programs of one jitted function, one per call signature.

    `programs(*args, **static)` runs the program for these arguments: held in memory, else
    loaded from the store, else compiled (`jitted.lower(*args, **static).compile()`) and
    stored. name and parts (the builder's arguments) identify the jitted function; mesh
    gives the devices a loaded program runs on. The arguments are checked against the
    program by JAX on every call, as a jitted call's are."""

    def __init__(self, jitted, name: str, parts: tuple, mesh):
        self.jitted, self.name, self.parts, self.mesh = jitted, name, parts, mesh
        self._held: dict = {}
        # Counters for tests and logs: programs loaded from the store and compiled.
        self.loaded = 0
        self.compiled_count = 0

    def __len__(self) -> int:
        return len(self._held)

    def clear(self) -> None:
        """Forget the programs held in memory (the store keeps its files): the next call
        of each signature loads or compiles it again."""
        self._held.clear()

    def __call__(self, *args, **static):
        return self.program(*args, **static)(*args)

    def program(self, *args, **static):
        """The compiled program for these arguments (see the class). Keyword arguments are
        the jitted function's static ones; arrays go by position (TypeError otherwise)."""
        for name, value in static.items():
            if isinstance(value, (jax.Array, np.ndarray)):
                raise TypeError(f"{self.name}: array argument {name!r} passed by keyword")
        leaves, tree = jax.tree.flatten(args)
        key = (tuple(sorted(static.items())), tree, tuple(map(_signature, leaves)))
        held = self._held.get(key)
        if held is None:
            held = self._held[key] = self._load_or_compile(key, args, static)
        return held

    def _path(self, key) -> str | None:
        where = folder()
        if where is None:
            return None
        static, tree, signature = key
        leaves = [tuple(map(str, sig)) for sig in signature]
        text = repr((self.name, self.parts, self.mesh.device_ids.tolist(), static, tree, leaves))
        if " at 0x" in text:  # an object's address: not the same key in another process
            return None
        digest = hashlib.sha256(text.encode()).hexdigest()
        return os.path.join(where, f"{fingerprint()[:16]}-{self.name}-{digest[:32]}{SUFFIX}")

    def _load_or_compile(self, key, args, static):
        path = self._path(key)
        if path is not None and os.path.exists(path):
            program = self._load(path)
            if program is not None:
                self.loaded += 1
                _LOADED[0] += 1
                return program
        hits = _cache_hits()
        program = self.jitted.lower(*args, **static).compile()
        self.compiled_count += 1
        # XLA:CPU cannot serialize again an executable it deserialized: the copy of one
        # that JAX's persistent cache handed back loads, then fails at its first run
        # ("Function … not found"). Such a program is held in memory only (a restart
        # finds it in JAX's cache again).
        if path is not None and _cache_hits() == hits:
            self._save(path, program)
        return program

    def _load(self, path: str):
        from jax.experimental import serialize_executable

        try:
            why = files.private(path)
            if why:
                raise ValueError(why)
            with open(path, "rb") as f:
                data = f.read()
            body = data[len(MAGIC) + 64 :]
            if (
                not data.startswith(MAGIC)
                or data[len(MAGIC) : len(MAGIC) + 64].decode() != hashlib.sha256(body).hexdigest()
            ):
                raise ValueError("checksum")
            payload, in_tree, out_tree = pickle.loads(body)
            program = serialize_executable.deserialize_and_load(
                payload, in_tree, out_tree, execution_devices=list(self.mesh.devices.flat)
            )
        except Exception:  # noqa: BLE001 — a bad file is compiled again, never fatal
            _remove(path)
            return None
        try:  # used now: the last the bound deletes
            os.utime(path)
        except OSError:
            pass
        return program

    def _save(self, path: str, program) -> None:
        from jax.experimental import serialize_executable

        try:
            payload, in_tree, out_tree = serialize_executable.serialize(program)
            body = pickle.dumps((payload, in_tree, out_tree))
        except Exception:  # noqa: BLE001 — a program that cannot be serialized stays in memory
            return
        try:  # atomic: a reader sees the old file, none, or the whole new one
            files.atomic_write(path, MAGIC + hashlib.sha256(body).hexdigest().encode() + body)
            _bound(os.path.dirname(path), path)
        except OSError:
            pass
