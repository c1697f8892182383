"""Durable and atomic file writes: a reader sees a file whole or not at all, old or new.

Owns the one way jcp replaces a file (write beside it, fsync, rename, fsync the folder),
the fsync of files and folders that checkpoint.py's versioned saves build on, and the
check that a cache folder whose files jcp loads and runs (compiled kernels, XLA
executables) is this user's alone. It must never import jax or know what a file holds.
"""

from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import Callable


def fsync(path: str) -> None:
    """fsync a file or a folder (its entries) by path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: str) -> None:
    """fsync every file and folder under `path`."""
    for root, _, names in os.walk(path):
        for name in names:
            fsync(os.path.join(root, name))
        fsync(root)


def write_durably(file: str, data: bytes) -> None:
    """Write `data` to `file` (created or truncated) and fsync it."""
    with open(file, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def atomic_write(path, data: bytes | str | Callable[[str], object]) -> None:
    """Replace `path` atomically: the bytes (a str is UTF-8 encoded) or what write(tmp)
    writes to a temporary file beside it are fsynced, renamed onto `path`, and the folder
    fsynced. If anything fails, `path` is untouched and the temporary file removed."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=os.path.basename(path))
    os.close(fd)
    try:
        if callable(data):
            data(tmp)
            fsync(tmp)
        else:
            write_durably(tmp, data.encode() if isinstance(data, str) else data)
        os.replace(tmp, path)
        fsync(folder)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def private(path) -> str:
    """'' when `path` exists, is this user's and no one else may write it; else why not.
    Anyone who may write a folder of files jcp loads (a kernel, an XLA executable) could
    swap one between check and load and run code as this user."""
    st = os.stat(path)
    if st.st_uid != os.geteuid():
        return f"{path} is owned by uid {st.st_uid}, not by this user ({os.geteuid()})"
    if st.st_mode & 0o022:
        return f"{path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return ""


def private_folder(path) -> str:
    """Make folder `path` (and missing parents) mode 0700 -> '' when it is `private`, else
    why not (it cannot be made, another user owns it, others may write it)."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except OSError as e:
        return f"{path}: {e.strerror or e}"
    if not os.path.isdir(path):
        return f"{path} is not a folder"
    return private(path)
