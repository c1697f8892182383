"""files.atomic_write: the file is replaced whole or left untouched, no temporary left."""

import os

import pytest

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
