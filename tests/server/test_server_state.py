"""jcp-serve's state store on the host alone (no model, no server, no jax): every table
bounded per tenant, checkpoint names that leave their run refused, a failed save never
recorded, the storage quota, and listings and the TTL sweep that read only what they must.
The route-level cases (`..` over HTTP, a save that fails on a full disk) are in
test_server_lifecycle.py, on its server.
"""

from __future__ import annotations

import asyncio
import builtins
import errno
import os
import time

import pytest

from jcp.server.app import FutureTable, UrlTokens
from jcp.server.state import (
    CHECKPOINT_TYPES,
    LimitReached,
    ModelRecord,
    NotFound,
    SessionEnded,
    StateStore,
    TenantLimits,
)


def store(tmp_path, **limits) -> StateStore:
    return StateStore(str(tmp_path), {"ka": "alice", "kb": "bob"}, TenantLimits(**limits))


def model(st: StateStore, owner: str) -> str:
    """A loaded model of `owner` in a session of its own -> its id (= its run)."""
    sid = st.new_session(owner)
    mid = st.model_id(sid, 0)
    st.add_model(ModelRecord(mid, owner, "m", 4, 0, sid))
    return mid


def save(st, owner, run, name, nbytes=100, kind="weights", **kw) -> str:
    """A checkpoint of `nbytes` bytes, written as a writer would -> its tinker path."""
    with st.saving(owner, run, kind, name, **kw) as (path, folder):
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "f"), "wb") as f:
            f.write(b"x" * nbytes)
    return path


def listed(st, run, owner="alice") -> list[str]:
    return [c["checkpoint_id"] for c in st.checkpoints(run, owner)["checkpoints"]]


class Disk:
    """Counts the files opened and folders listed under a state folder while active."""

    def __init__(self, monkeypatch, root):
        self.opened, self.listed = [], []
        real_open, real_listdir = builtins.open, os.listdir

        def counting_open(file, *a, **k):
            if str(file).startswith(str(root)):
                self.opened.append(str(file))
            return real_open(file, *a, **k)

        def counting_listdir(path="."):
            if str(path).startswith(str(root)):
                self.listed.append(str(path))
            return real_listdir(path)

        monkeypatch.setattr(builtins, "open", counting_open)
        monkeypatch.setattr(os, "listdir", counting_listdir)


def test_dot_names_are_refused_on_every_store_entry(tmp_path):
    """`.`, `..` and empty never name a checkpoint: `..` resolved to the run itself (a
    DELETE of weights/.. removed the whole run; external_weights/.. listed owner.json)."""
    st = store(tmp_path)
    mid = model(st, "alice")
    save(st, "alice", mid, "ok")
    run_dir = os.path.join(st.state_dir, "runs", mid)
    for name in ("..", ".", ""):
        for kind in CHECKPOINT_TYPES:
            path = f"tinker://{mid}/{kind}/{name}"
            for call in (
                lambda: st.resolve(path, "alice", kind),
                lambda: st.checkpoint_folder(mid, f"{kind}/{name}", "alice"),
                lambda: st.set_ttl(mid, f"{kind}/{name}", "alice", 60),
                lambda: st.run_info(path, "alice"),
            ):
                with pytest.raises(NotFound):
                    call()
            with pytest.raises(ValueError, match="not '.' or '..'"):
                st.new_path(mid, kind, name)
            with pytest.raises(ValueError, match="not '.' or '..'"):
                with st.saving("alice", mid, kind, name):
                    raise AssertionError("the block must not run")
    assert os.path.isfile(os.path.join(run_dir, "owner.json")) and listed(st, mid) == ["weights/ok"]


def test_failed_save_is_never_recorded(tmp_path):
    """A save whose writer fails (disk full) is not listed, leaves no folder and is not
    the run's last checkpoint; a failed overwrite keeps the old record; a folder a killed
    save left is removed at the next start."""
    st = store(tmp_path)
    mid = model(st, "alice")
    save(st, "alice", mid, "good")
    for name in ("full", "good"):
        with pytest.raises(OSError, match="No space"):
            with st.saving("alice", mid, "weights", name) as (_, folder):
                os.makedirs(folder, exist_ok=True)
                with open(os.path.join(folder, "part"), "wb") as f:
                    f.write(b"half")
                raise OSError(errno.ENOSPC, "No space left on device")
    assert listed(st, mid) == ["weights/good"]
    assert st.training_run(mid, "alice")["last_checkpoint"]["checkpoint_id"] == "weights/good"
    assert not os.path.exists(os.path.join(st.state_dir, "runs", mid, "weights", "full"))
    with pytest.raises(NotFound):
        st.resolve(f"tinker://{mid}/weights/full", "alice", "weights")
    with pytest.raises(OSError, match="wrote no file"):
        with st.saving("alice", mid, "sampler_weights", "empty"):
            pass
    with pytest.raises(OSError, match="link or special file") as e:  # could lead out of the run
        with st.saving("alice", mid, "external_weights", "linked") as (path, folder):
            os.makedirs(folder)
            os.symlink(
                os.path.join(st.state_dir, "runs", mid, "owner.json"),
                os.path.join(folder, "owner.json"),
            )
    assert path in str(e.value) and st.state_dir not in str(e.value)
    assert listed(st, mid) == ["weights/good"] and not os.path.lexists(folder)

    killed = os.path.join(st.state_dir, "runs", mid, "weights", "killed")
    os.makedirs(killed)
    again = store(tmp_path)
    assert not os.path.exists(killed) and listed(again, mid) == ["weights/good"]
    assert again.usage("alice")["storage_bytes"] == 100


def test_storage_quota_is_per_tenant_and_freed_by_delete(tmp_path):
    st = store(tmp_path, storage_bytes=1000)
    a, b = model(st, "alice"), model(st, "bob")
    first = save(st, "alice", a, "one", 600)
    with pytest.raises(LimitReached, match="max-storage-gb") as e:
        save(st, "alice", a, "two", 600)
    assert e.value.status == 422
    assert listed(st, a) == ["weights/one"]
    assert not os.path.exists(os.path.join(st.state_dir, "runs", a, "weights", "two"))
    save(st, "bob", b, "two", 600)  # bob's room is his own
    # A copy into a new run that would exceed the quota leaves no run behind either.
    runs = set(os.listdir(os.path.join(st.state_dir, "runs")))
    with pytest.raises(LimitReached):
        save(st, "alice", "copy-x", "one", 600, new_run={"base_model": "m"})
    assert set(os.listdir(os.path.join(st.state_dir, "runs"))) == runs
    st.delete_folder(st.resolve(first, "alice", "weights")[0])
    save(st, "alice", a, "two", 600)
    assert st.usage("alice")["storage_bytes"] == st.usage("bob")["storage_bytes"] == 600
    # At the quota, nothing new is written at all.
    full = store(tmp_path / "full", storage_bytes=600)
    m = model(full, "alice")
    save(full, "alice", m, "x", 600)
    with pytest.raises(LimitReached):
        with full.saving("alice", m, "weights", "y"):
            raise AssertionError("the block must not run")
    with pytest.raises(LimitReached):
        full.check_room("alice", save=True)


def test_runs_are_bounded_per_tenant_and_empty_ones_reused(tmp_path):
    st = store(tmp_path, runs=3)
    copies = [save(st, "alice", f"copy-{i}", "c", new_run={"base_model": "m"}) for i in range(3)]
    with pytest.raises(LimitReached, match="training runs") as e:
        model(st, "alice")
    assert e.value.status == 422
    with pytest.raises(LimitReached, match="training runs"):
        st.check_room("alice", new_run=True)
    model(st, "bob")  # another tenant's runs are not alice's
    st.delete_folder(st.resolve(copies[0], "alice", "weights")[0])
    mid = model(st, "alice")  # the emptied run is forgotten to make room
    runs = [r["training_run_id"] for r in st.training_runs("alice", 0, 10)["training_runs"]]
    assert sorted(runs) == sorted(["copy-1", "copy-2", mid])
    with pytest.raises(LimitReached):  # a run with a loaded model is never taken
        save(st, "alice", "copy-9", "c", new_run={"base_model": "m"})


def test_checkpoints_are_bounded_per_run_and_tenant(tmp_path):
    st = store(tmp_path, checkpoints_per_run=2, checkpoints=3)
    a, b = model(st, "alice"), model(st, "alice")
    save(st, "alice", a, "x")
    save(st, "alice", a, "y")
    save(st, "alice", a, "y")  # an overwrite adds none
    with pytest.raises(LimitReached, match="per run"):
        save(st, "alice", a, "z")
    save(st, "alice", b, "x")
    with pytest.raises(LimitReached, match="per tenant"):
        save(st, "alice", b, "y")
    save(st, "bob", model(st, "bob"), "x")


def test_listing_and_ttl_sweep_read_only_what_they_must(tmp_path, monkeypatch):
    """bob's listing reads bob's runs only (it read every tenant's owner.json), and the
    5-s TTL sweep reads no file at all (it read every run's checkpoints.json)."""
    st = store(tmp_path)
    for i in range(30):
        save(st, "alice", f"copy-{i}", "c", new_run={"base_model": "m"}, ttl_seconds=3600)
    mine = save(st, "bob", "copy-bob", "c", new_run={"base_model": "m"}, ttl_seconds=0.2)
    disk = Disk(monkeypatch, st.state_dir)
    page = st.training_runs("bob", 0, 10)
    assert [r["training_run_id"] for r in page["training_runs"]] == ["copy-bob"]
    assert page["training_runs"][0]["last_checkpoint"]["tinker_path"] == mine
    assert all("copy-bob" in f for f in disk.opened + disk.listed), disk.opened + disk.listed
    disk.opened.clear()
    disk.listed.clear()
    assert st.expired_folders() == []
    time.sleep(0.25)
    assert st.expired_folders() == [os.path.join(st.state_dir, "runs", "copy-bob", "weights", "c")]
    assert disk.opened == disk.listed == []
    # A TTL set again leaves its old heap entry stale: skipped, never a deletion.
    st.set_ttl("copy-0", "weights/c", "alice", 0.2)
    st.set_ttl("copy-0", "weights/c", "alice", None)
    time.sleep(0.25)
    assert st.expired_folders() == [] and listed(st, "copy-0") == ["weights/c"]


def test_ended_sessions_and_their_samplers_are_forgotten(tmp_path):
    """3,000 create/finish loops kept 6,000 records: now an ended session keeps only its
    id (its heartbeat still gets 410), and its sampling sessions go with it."""
    st = store(tmp_path, ended_sessions=8)
    forgotten = []
    st.on_forget_samplers = lambda owner, sids: forgotten.extend(sids)
    live = st.new_session("bob")
    kept = st.add_sampler("bob", "m", None, None, live)
    for _ in range(50):
        sid = st.new_session("alice")
        samp = st.add_sampler("alice", "m", None, None, sid)
        mid = model(st, "alice")
        snap = st.add_sampler("alice", "m", f"tinker://{mid}/sampler_weights/ephemeral-1", None)
        st.end_session(sid)
        st.end_session(mid.split(":train:")[0])
        st.drop_model(mid)
        with pytest.raises(SessionEnded):
            st.check_session(sid, "alice")
        with pytest.raises(NotFound):
            st.sampler(samp, "alice")
        with pytest.raises(NotFound):
            st.sampler(snap, "alice")
    assert set(st.sessions) == {live} and set(st.samplers) == {kept} and not st.models
    assert len(forgotten) == 100
    assert st.usage("alice")["sessions"] == st.usage("alice")["samplers"] == 0
    with pytest.raises(NotFound):  # beyond the remembered ids: unknown, never another's
        st.check_session(sid, "bob")


def test_sessions_and_samplers_are_bounded_per_tenant(tmp_path):
    st = store(tmp_path, sessions=2, samplers=2)
    sids = [st.new_session("alice") for _ in range(2)]
    with pytest.raises(LimitReached, match="live sessions") as e:
        st.new_session("alice")
    assert e.value.status == 429
    bob = st.new_session("bob")
    for _ in range(2):
        st.add_sampler("alice", "m", None, None, sids[0])
    with pytest.raises(LimitReached, match="sampling sessions"):
        st.add_sampler("alice", "m", None, None, sids[1])
    st.add_sampler("bob", "m", None, None, bob)
    st.end_session(sids[0])
    st.new_session("alice")
    st.add_sampler("alice", "m", None, None, sids[1])


def test_download_tokens_are_bounded_per_tenant():
    """alice's URLs evict only her own oldest tokens (a global table let her 20,000
    creates evict bob's)."""
    tokens = UrlTokens(per_tenant=4)
    far = time.time() + 600
    bobs = tokens.new("bob", "r", "external_weights/x", "f", far)
    alices = [tokens.new("alice", "r", "external_weights/x", f"f{i}", far) for i in range(10)]
    assert tokens.get(bobs) == ("bob", "r", "external_weights/x", "f", far)
    assert [tokens.get(t) is not None for t in alices] == [False] * 6 + [True] * 4
    expired = tokens.new("carol", "r", "external_weights/x", "g", time.time() - 1)
    tokens.new("carol", "r", "external_weights/x", "h", far)  # drops her expired ones
    assert tokens.get(expired) is None and tokens.get(bobs) is not None


def test_forgotten_sampling_sessions_drop_their_completion_logs(tmp_path):
    """The app's completion log of a sampling session (up to KEEP_COMPLETIONS entries)
    goes when the store forgets the session."""
    from jcp.server.app import ServedModel, create_app
    from jcp.server.scheduler import Scheduler

    st, futures = store(tmp_path), FutureTable(per_tenant=8)
    create_app(st, Scheduler(), futures, ServedModel("m", 64, 4, None))

    async def run():
        futures.loop = asyncio.get_running_loop()
        sid = st.new_session("alice")
        groups = [st.add_sampler("alice", "m", None, None, sid) for _ in range(2)]
        for g in groups:
            futures.complete(futures.new("alice", g), ("json", {}))
        await asyncio.sleep(0)
        before = [len(futures.completions("alice", g, 0)[0]) for g in groups]
        st.end_session(sid)
        await asyncio.sleep(0)
        return before, [len(futures.completions("alice", g, 0)[0]) for g in groups]

    assert asyncio.run(run()) == ([1, 1], [0, 0])
