"""Checkpoint faults: saves SIGKILLed at every step, flipped, truncated and deleted files,
leftovers of killed saves, saves onto files, hostile metadata. A load gives exactly the
old or the new checkpoint or an InputError naming it; a refusal changes nothing."""

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from helpers import ckpt_kill_child as kc

import jcp

HERE = os.path.dirname(__file__)

# (phase at which the second save is killed, what PATH must hold afterwards)
PHASES = [
    ("planned", "old"),
    ("orbax", "old"),
    ("written", "old"),
    ("pointer-staged", "old"),
    ("pointer-moved", "new"),
    ("removing", "new"),
    ("done", "new"),
]
# A killed first save: nothing at PATH (the pointer never named the complete version).
FRESH = [("written", None)]


@pytest.fixture(scope="module")
def tr():
    """Loads happen on mesh (1, 2, 2); the children save on (1, 1, 1). One adapter stays
    installed, so a refused load that touched any table would show."""
    t = jcp.Trainer(kc.CFG, jcp.make_mesh(1, 2, 2), max_rank=8, max_adapters=4)
    kc.put(t, "third")
    return t


def _snapshot(tr):
    return jax.device_get(tr.state.tables()), dict(tr.adapters)


def _assert_same(a, b):
    jax.tree.map(np.testing.assert_array_equal, a[0], b[0])
    assert a[1] == b[1]


def _assert_holds(tr, slot, which):
    """Slot `slot` holds the known state `which` exactly: config, weights, moments, count."""
    info, want = kc.values(tr.state, which)
    assert tr.adapters[slot] == info
    got = tr.state.export(slot)
    for part in ("weights", "mu", "nu"):
        got_part = jax.device_get(getattr(got, part))
        assert got_part.keys() == want[part].keys()
        jax.tree.map(np.testing.assert_array_equal, got_part, want[part])
    assert int(jax.device_get(got.count)) == want["count"]


def _load_expecting(tr, path, which):
    slot = tr.load_state(path)
    try:
        _assert_holds(tr, slot, which)
    finally:
        tr.delete_adapter(slot)


def _refused(tr, path, match):
    """load_state(path) raises InputError matching `match`, naming path, in one short
    line, and changes nothing -> the message."""
    before = _snapshot(tr)
    with pytest.raises(jcp.InputError, match=match) as e:
        tr.load_state(path)
    msg = str(e.value)
    assert str(path) in msg, msg
    assert "\n" not in msg and "tensorstore_spec" not in msg and len(msg) < 700, msg
    _assert_same(before, _snapshot(tr))
    return msg


def _assert_next_save_works(tr, path):
    """A save over whatever a fault left behind succeeds, and leaves only itself."""
    third = kc.put(tr, "third")
    tr.save_state(third, path)
    tr.delete_adapter(third)
    entries = sorted(os.listdir(path))
    assert len(entries) == 2 and entries[0] == "CURRENT" and entries[1].startswith("v-"), entries
    _load_expecting(tr, path, "third")


# ----------------------------------------------------------------------------------------
# saves killed at every step


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """Every killed save, 3 children at a time -> {(phase, mode): (path, returncode, log)}."""
    root = tmp_path_factory.mktemp("killed")
    env = dict(os.environ)
    env["XLA_FLAGS"] = os.environ.get("JCP_TEST_CHILD_XLA_FLAGS", "")
    pending = [(p, "replace") for p, _ in PHASES] + [(p, "fresh") for p, _ in FRESH]
    running, out = {}, {}
    deadline = time.monotonic() + 300
    while pending or running:
        while pending and len(running) < 3:
            phase, mode = case = pending.pop(0)
            path, log = str(root / f"{mode}-{phase}"), str(root / f"{mode}-{phase}.log")
            with open(log, "w") as f:
                proc = subprocess.Popen(
                    [
                        sys.executable,
                        os.path.join(HERE, "helpers", "ckpt_kill_child.py"),
                        path,
                        phase,
                        mode,
                    ],
                    env=env,
                    stdout=f,
                    stderr=subprocess.STDOUT,
                )
            running[case] = (path, log, proc)
        for case, (path, log, proc) in list(running.items()):
            late = proc.poll() is None and time.monotonic() > deadline
            if late:
                proc.kill()
                proc.wait()
            if proc.poll() is not None:
                with open(log) as f:
                    out[case] = (path, "timed out" if late else proc.returncode, f.read())
                del running[case]
        time.sleep(0.05)
    return out


@pytest.mark.parametrize("phase, survivor", PHASES, ids=[p for p, _ in PHASES])
def test_killed_save_leaves_old_or_new(tr, killed, phase, survivor):
    path, rc, log = killed[(phase, "replace")]
    assert rc == -signal.SIGKILL, log[-3000:]  # it really died at `phase`
    if phase == "removing":  # the old version was half removed when the kill came
        assert "v-1" in os.listdir(path)
    _load_expecting(tr, path, survivor)
    _assert_next_save_works(tr, path)


@pytest.mark.parametrize("phase, survivor", FRESH, ids=[p for p, _ in FRESH])
def test_killed_first_save(tr, killed, phase, survivor):
    path, rc, log = killed[(phase, "fresh")]
    assert rc == -signal.SIGKILL, log[-3000:]
    if survivor is None:
        assert os.listdir(path) == ["v-1"]  # complete, but never pointed at
        _refused(tr, path, "is not a jcp adapter checkpoint .it has no CURRENT file")
    else:
        _load_expecting(tr, path, survivor)
    _assert_next_save_works(tr, path)


# ----------------------------------------------------------------------------------------
# damaged files


@pytest.fixture(scope="module")
def saved(tr, tmp_path_factory):
    """The known state "old" (every target, so orbax stores some array bytes outside its
    checksummed index) saved under mesh (1, 2, 2) -> its path."""
    path = str(tmp_path_factory.mktemp("saved") / "ck")
    slot = kc.put(tr, "old")
    tr.save_state(slot, path)
    tr.delete_adapter(slot)
    _load_expecting(tr, path, "old")
    return path


def _files(path):
    return sorted(
        os.path.relpath(os.path.join(root, f), path)
        for root, _, files in os.walk(path)
        for f in files
    )


def _damaged_copy(saved, dest, rel, how):
    """A copy of `saved` at dest with file `rel` deleted, truncated to half, or with 16
    bytes flipped (all bits) at byte offset `how` (an int)."""
    shutil.copytree(saved, dest)
    f = os.path.join(dest, rel)
    data = bytearray(open(f, "rb").read())
    if how == "delete":
        os.remove(f)
        return
    if how == "truncate":
        data = data[: len(data) // 2]
    else:
        data[how : how + 16] = bytes(b ^ 0xFF for b in data[how : how + 16])
    with open(f, "wb") as out:
        out.write(bytes(data))


def _offsets(path, rel, stride=None):
    """Where to flip: 9 places across a data file (array bytes sit inside them), or every
    `stride` bytes of it; start, middle and end of any other file."""
    n = max(os.path.getsize(os.path.join(path, rel)) - 16, 0)
    if "/d/" not in rel:
        return sorted({0, n // 2, n})
    if stride:
        return sorted(set(range(0, n, stride)) | {n})
    return sorted({k * n // 8 for k in range(9)})


def _reseal(path):
    """Re-record every file of the current version as it is now (the documented format:
    v-n/jcp-files.json lists each file's size and sha256, CURRENT holds its sha256), as
    if the damage had happened before the save hashed the files."""
    with open(os.path.join(path, "CURRENT")) as f:
        pointer = json.load(f)
    vpath = os.path.join(path, f"v-{pointer['version']}")
    files = {}
    for rel in _files(vpath):
        if rel != "jcp-files.json":
            data = open(os.path.join(vpath, rel), "rb").read()
            files[rel] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    text = json.dumps(files).encode()
    with open(os.path.join(vpath, "jcp-files.json"), "wb") as f:
        f.write(text)
    pointer["files_sha256"] = hashlib.sha256(text).hexdigest()
    with open(os.path.join(path, "CURRENT"), "w") as f:
        json.dump(pointer, f)


def test_flipped_bytes_refused_naming_the_file(tr, saved, tmp_path):
    """Every file of the checkpoint, flipped at several places: refused, naming that file
    (CURRENT names the list of files it vouches for), before orbax reads anything."""
    files = _files(saved)
    kinds = {
        "CURRENT",
        "v-1/jcp-files.json",
        "v-1/meta/metadata",
        "v-1/_CHECKPOINT_METADATA",
        "v-1/state/_METADATA",
        "v-1/state/manifest.ocdbt",
        "v-1/state/array_metadatas/process_0",
        "v-1/commit_success.txt",
    }
    assert kinds <= set(files), files
    assert any("/d/" in f for f in files), files
    for i, rel in enumerate(files):
        for at in _offsets(saved, rel):
            dest = str(tmp_path / f"{i}-{at}")
            _damaged_copy(saved, dest, rel, at)
            named = "(CURRENT|v-1/jcp-files.json)" if rel == "CURRENT" else re.escape(rel)
            _refused(tr, dest, re.escape(dest + os.sep) + named)
            shutil.rmtree(dest)


def test_values_checked_behind_the_files(tr, saved, tmp_path):
    """Array bytes flipped and the file hashes re-recorded (corruption before the save
    hashed its files): orbax reads some of these back without complaint, so only the
    arrays' own sha256 stands between them and the trainer. Every load is refused or gives
    exactly the saved values."""
    # Where orbax keeps array bytes outside its checksummed index (state/d/ is all index).
    # Which file holds the arrays that orbax does not check, and where in it, varies from
    # save to save; the largest arrays (lm_head's B and its moments) are 8 KiB each, and
    # any 8 KiB of a file holds one multiple of 8192: a flip every 8 KiB lands in each of
    # them wherever it sits.
    data_files = [f for f in _files(saved) if "/ocdbt.process_" in f and "/d/" in f]
    assert data_files
    by_value = 0
    for i, rel in enumerate(data_files):
        for at in _offsets(saved, rel, stride=8192):
            dest = str(tmp_path / f"{i}-{at}")
            _damaged_copy(saved, dest, rel, at)
            _reseal(dest)
            before = _snapshot(tr)
            try:
                slot = tr.load_state(dest)
            except jcp.InputError as e:
                msg = str(e)
                assert dest in msg and "\n" not in msg and "tensorstore_spec" not in msg, msg
                _assert_same(before, _snapshot(tr))
                by_value += bool(re.search("array .* does not match the sha256 recorded", msg))
            else:
                try:
                    _assert_holds(tr, slot, "old")
                finally:
                    tr.delete_adapter(slot)
            shutil.rmtree(dest)
    assert by_value > 0


@pytest.mark.parametrize("how", ["truncate", "delete"])
def test_truncated_or_deleted_file(tr, saved, tmp_path, how):
    files = [f for f in _files(saved) if f.startswith("v-1/") and f != "v-1/jcp-files.json"]
    match = (
        "is missing; the checkpoint is incomplete"
        if how == "delete"
        else "does not match the size and sha256 recorded"
    )
    for i, rel in enumerate(files):
        dest = str(tmp_path / str(i))
        _damaged_copy(saved, dest, rel, how)
        _refused(tr, dest, re.escape(os.path.join(dest, rel)) + " " + match)


def test_missing_or_extra_parts(tr, saved, tmp_path):
    dest = str(tmp_path / "noversion")
    shutil.copytree(saved, dest)
    shutil.rmtree(os.path.join(dest, "v-1"))
    _refused(tr, dest, "CURRENT names v-1, which does not exist")
    dest = str(tmp_path / "nolist")
    _damaged_copy(saved, dest, "v-1/jcp-files.json", "delete")
    _refused(tr, dest, "jcp-files.json: cannot read the list of files")
    dest = str(tmp_path / "extra")
    shutil.copytree(saved, dest)
    os.makedirs(os.path.join(dest, "v-1", "state", "ocdbt.process_1"))
    with open(os.path.join(dest, "v-1", "state", "ocdbt.process_1", "manifest.ocdbt"), "w"):
        pass
    _refused(tr, dest, "ocdbt.process_1/manifest.ocdbt was not written by the save")


# ----------------------------------------------------------------------------------------
# hostile metadata (rewritten, and by default resealed so the checks behind the hashes run)


def _rewrite_meta(path, edit, reseal=True):
    with open(os.path.join(path, "CURRENT")) as f:
        pointer = json.load(f)
    mfile = os.path.join(path, f"v-{pointer['version']}", "meta", "metadata")
    with open(mfile) as f:
        meta = json.load(f)
    edit(meta)
    with open(mfile, "w") as f:
        json.dump(meta, f)
    if reseal:
        _reseal(path)


def _to_rank(r):
    """Edit: metadata says rank r, and (consistently) lists every array at rank r."""

    def edit(meta):
        meta["rank"] = r
        for name, rec in meta["arrays"].items():
            if name != "count":
                axis = -1 if name.endswith("/a") else -2
                rec["shape"][axis] = r

    return edit


HOSTILE = {
    "missing_key_unsealed": (
        lambda m: m.pop("base_fingerprint"),
        False,
        "meta/metadata does not match the size and sha256 recorded",
    ),
    "missing_key": (
        lambda m: m.pop("base_fingerprint"),
        True,
        r"metadata keys \['alpha', 'arrays', 'format', 'rank', 'targets'\]",
    ),
    "extra_key": (lambda m: m.update(max_rank_saved=6), True, "metadata keys"),
    "fingerprint_type": (
        lambda m: m.update(base_fingerprint=123),
        True,
        "base_fingerprint = 123 has the wrong type",
    ),
    "rank_type": (lambda m: m.update(rank="6"), True, "rank = '6' has the wrong type"),
    "rank_bool": (lambda m: m.update(rank=True), True, "rank = True has the wrong type"),
    "targets_type": (lambda m: m.update(targets=[1]), True, "targets .1. must be names"),
    "arrays_type": (lambda m: m.update(arrays=[]), True, "arrays = .. has the wrong type"),
    "format": (lambda m: m.update(format=3), True, "metadata format 3, expected 2"),
    "rank_vs_listed": (
        lambda m: m.update(rank=6),
        True,
        "metadata of array .*its rank and targets need shape",
    ),
    "rank_vs_stored": (
        _to_rank(6),
        True,
        r"array .* is stored as float32\[.*4.*\]; the metadata's rank 6 needs",
    ),
    "array_missing": (
        lambda m: m["arrays"].pop("mu/q_proj/a"),
        True,
        r"missing \['mu/q_proj/a'\], unexpected \[\]",
    ),
    "array_hash": (
        lambda m: m["arrays"]["nu/v_proj/b"].update(sha256="0" * 64),
        True,
        "array nu/v_proj/b does not match the sha256 recorded",
    ),
    "wrong_base": (lambda m: m.update(base_fingerprint="0" * 16), True, "different base model"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_metadata_refused(tr, saved, tmp_path, name):
    edit, reseal, match = HOSTILE[name]
    dest = str(tmp_path / "ck")
    shutil.copytree(saved, dest)
    _rewrite_meta(dest, edit, reseal)
    _refused(tr, dest, match)


def _write(path, rel, text):
    with open(os.path.join(path, rel), "w") as f:
        f.write(text)


def test_unparsable_metadata_pointer_and_list(tr, saved, tmp_path):
    dest = str(tmp_path / "meta")
    shutil.copytree(saved, dest)
    _write(dest, "v-1/meta/metadata", '{"format": 2, "rank": ')
    _refused(tr, dest, "meta/metadata does not match the size and sha256 recorded")
    _reseal(dest)  # as if the save itself had written it so
    _refused(tr, dest, "v-1: cannot read the metadata")
    for i, (text, match) in enumerate(
        [
            ("v-1", "CURRENT is corrupt"),
            ("[1]", "CURRENT is corrupt .no format."),
            ('{"format": 2}', "CURRENT is corrupt .expected keys"),
            ('{"format": 2, "version": "1", "files_sha256": "00"}', "CURRENT is corrupt .version"),
            (
                '{"format": 1, "version": 1, "meta_sha256": "00"}',
                "checkpoint format 1; this jcp reads format 2",
            ),
        ]
    ):
        dest = str(tmp_path / f"pointer{i}")
        shutil.copytree(saved, dest)
        _write(dest, "CURRENT", text)
        _refused(tr, dest, match)
    # A hand-made CURRENT vouching for a list that is not one.
    dest = str(tmp_path / "list")
    shutil.copytree(saved, dest)
    _write(dest, "v-1/jcp-files.json", '["meta/metadata"]')
    digest = hashlib.sha256(b'["meta/metadata"]').hexdigest()
    _write(dest, "CURRENT", json.dumps({"format": 2, "version": 1, "files_sha256": digest}))
    _refused(tr, dest, "jcp-files.json is not a list of files")


def test_non_finite_values_refused(tr, tmp_path):
    """A checkpoint whose hashes match but whose values are not finite (saved from a state
    that was given NaN directly) is refused."""
    info, v = kc.values(tr.state, "old")
    v["mu"]["down_proj"]["b"][0, 0, 0] = np.nan
    slot = tr.state.free_slot()
    tr.state.install(slot, info, v["weights"], v["mu"], v["nu"], v["count"])
    path = str(tmp_path / "nan")
    tr.save_state(slot, path)
    tr.delete_adapter(slot)
    _refused(tr, path, "array mu/down_proj/b holds invalid values")


def test_format_1_refused(tr, tmp_path):
    """A checkpoint of the previous format (a bare orbax folder, no checksums)."""
    path = str(tmp_path / "old")
    ocp.Checkpointer(ocp.CompositeCheckpointHandler()).save(
        path,
        args=ocp.args.Composite(
            state=ocp.args.StandardSave({"count": np.int32(0)}),
            meta=ocp.args.JsonSave({"format": 1, "rank": 4}),
        ),
    )
    _refused(tr, path, "is a jcp adapter checkpoint of format 1 .no checksums.")
    before = sorted(_files(path))
    slot = kc.put(tr, "old")
    try:
        with pytest.raises(jcp.InputError, match="'_CHECKPOINT_METADATA', which is not part"):
            tr.save_state(slot, path)
    finally:
        tr.delete_adapter(slot)
    assert sorted(_files(path)) == before


# ----------------------------------------------------------------------------------------
# where a save may go


def test_save_onto_file_refused_untouched(tr, tmp_path):
    path = tmp_path / "notes.bin"
    path.write_bytes(b"the user's file")
    slot = kc.put(tr, "old")
    try:
        with pytest.raises(jcp.InputError, match="it is a file, not a folder"):
            tr.save_state(slot, str(path))
        assert path.read_bytes() == b"the user's file"
        assert os.listdir(tmp_path) == ["notes.bin"]
        # A folder holding anything else is refused too, and left as it was.
        (tmp_path / "mine").mkdir()
        (tmp_path / "mine" / "notes.txt").write_text("keep")
        with pytest.raises(jcp.InputError, match="'notes.txt', which is not part of a jcp"):
            tr.save_state(slot, str(tmp_path / "mine"))
        assert os.listdir(tmp_path / "mine") == ["notes.txt"]
        assert sorted(os.listdir(tmp_path)) == ["mine", "notes.bin"]
    finally:
        tr.delete_adapter(slot)


def test_leftovers_never_block_a_save(tr, tmp_path):
    path = str(tmp_path / "ck")
    # What the format-1 save left beside PATH when killed: not ours any more, untouched.
    os.makedirs(path + ".jcp-old/state")
    os.makedirs(path + ".jcp-staging")
    with open(path + ".jcp-old/state/x", "w") as f:
        f.write("old")
    old = kc.put(tr, "old")
    tr.save_state(old, path)
    tr.delete_adapter(old)
    # What a killed format-2 save leaves inside PATH.
    os.makedirs(os.path.join(path, "v-7.orbax-checkpoint-tmp", "state"))
    os.makedirs(os.path.join(path, "v-9", "meta"))
    with open(os.path.join(path, "CURRENT.tmp"), "w") as f:
        f.write("half a pointer")
    _load_expecting(tr, path, "old")  # leftovers do not disturb a load either
    new = kc.put(tr, "new")
    tr.save_state(new, path)
    tr.delete_adapter(new)
    assert sorted(os.listdir(path)) == ["CURRENT", "v-10"]
    _load_expecting(tr, path, "new")
    assert sorted(os.listdir(tmp_path)) == ["ck", "ck.jcp-old", "ck.jcp-staging"]
    assert open(path + ".jcp-old/state/x").read() == "old"
