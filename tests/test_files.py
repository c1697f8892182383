"""files.atomic_write: the file is replaced whole or left untouched, no temporary left.
files.private_folder: a cache folder jcp loads code from is this user's alone (host only)."""

import argparse
import os

import pytest

from jcp import files
from jcp.files import atomic_write


def test_atomic_write_replaces_whole_and_leaves_nothing_behind(tmp_path):
    path = tmp_path / "a.json"
    atomic_write(path, "old")
    assert path.read_text() == "old"
    atomic_write(path, b"new bytes")
    assert path.read_bytes() == b"new bytes"
    atomic_write(path, lambda tmp: open(tmp, "w").write("written by a callback"))
    assert path.read_text() == "written by a callback"
    assert os.listdir(tmp_path) == ["a.json"]


def test_atomic_write_failure_keeps_the_old_file(tmp_path):
    path = tmp_path / "a.json"
    atomic_write(path, "old")

    def fail(tmp):
        with open(tmp, "w") as f:
            f.write("half")
        raise RuntimeError("killed mid-write")

    with pytest.raises(RuntimeError, match="killed"):
        atomic_write(path, fail)
    assert path.read_text() == "old"
    assert os.listdir(tmp_path) == ["a.json"]


def test_private_folder_is_made_0700_and_refused_when_shared(tmp_path, monkeypatch):
    """A cache folder is made mode 0700 (parents too) and accepted; one that group or
    others may write, or that another user owns, is refused with the reason — and so is
    jcp-serve's / jcp-train's compilation cache there, before anything is configured."""
    from jcp.cli import CliError, setup_compilation_cache

    path = tmp_path / "a" / "xla"
    assert files.private_folder(path) == ""
    assert (path.stat().st_mode & 0o777) == 0o700
    assert files.private_folder(path) == ""  # an existing private folder is fine

    path.chmod(0o770)
    assert "writable by group or others (mode 770)" in files.private_folder(path)
    args = argparse.Namespace(compilation_cache=str(path), no_compilation_cache=False)
    with pytest.raises(CliError, match="compilation cache .*writable by group or others"):
        setup_compilation_cache(args)
    path.chmod(0o700)

    monkeypatch.setattr(os, "geteuid", lambda: os.stat(path).st_uid + 1)
    assert "is owned by uid" in files.private_folder(path)
    monkeypatch.undo()
    (tmp_path / "file").write_text("")
    assert files.private_folder(tmp_path / "file")  # a file is no cache folder
