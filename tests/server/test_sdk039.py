"""Tinker SDK 0.39's REST additions on jcp-serve, over HTTP (the 0.39 SDK is not
installable here; the 0.38 SDK drives training and sampling): checkpoint search by
user_metadata, type and base model in cursor pages, Checkpoint.base_model in listings, and
the external-weights upload (start -> PUT each file -> finish -> a tinker:// path).

One server on the tiny model for the module; alice trains one step (so her adapter is not
the base model) and saves checkpoints with metadata; bob saves one too.

Evidence:
1. search returns exactly the caller's matching checkpoints, newest first, and paging
   through next_cursor (1 and 2 per page) gives the one-page answer; other tenants',
   other types and other metadata are left out; base_models [] and an unknown model match
   nothing; a malformed cursor or another tenant (owner "user") is refused;
2. an adapter exported by save_weights_external, downloaded and uploaded again, samples
   with the exported adapter's log-probs (compute_logprobs, real SDK), which differ from
   the base model's; it is listed and searchable as an external checkpoint of its base;
3. a wrong file (rank, garbage, a NaN, a missing tensor), an oversized one (declared or
   streamed) and another tenant's finish are refused, and leave the state folder, every
   listing and both tenants' usage as they were.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

os.environ.setdefault("TINKER_TELEMETRY", "0")
tinker = pytest.importorskip("tinker")
httpx = pytest.importorskip("httpx")
from helpers.server_harness import client, serving  # noqa: E402
from safetensors.numpy import load, save  # noqa: E402
from tinker import types  # noqa: E402

import jcp  # noqa: E402

MODEL = "jcp-tiny"
KEYS = {"tml-alice": "alice", "tml-bob": "bob"}
RANK = 4
PROMPT = [5, 17, 99, 3, 250, 41, 7, 300, 12]


@pytest.fixture(scope="module")
def env():
    tr = jcp.Trainer(jcp.QwenConfig.tiny(), jcp.make_mesh(1, 1, 1), max_adapters=4, max_rank=8)
    with serving(tr, MODEL, KEYS, "jcp-serve-sdk039-", sample_slots=4, sample_max_len=64) as st:
        alice = client(st).create_lora_training_client(MODEL, rank=RANK).result()
        toks = list(range(1, 26))
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(toks[:-1]),
            loss_fn_inputs={"target_tokens": toks[1:], "weights": [1.0] * 24},
        )
        alice.forward_backward([datum], "cross_entropy").result()
        alice.optim_step(types.AdamParams(learning_rate=0.05)).result()
        st["saved"] = {
            "t1": alice.save_state("t1", user_metadata={"exp": "blue"}).result().path,
            "s1": alice.save_weights_for_sampler("s1", user_metadata={"exp": "blue"}).result().path,
            "s2": alice.save_weights_for_sampler("s2", user_metadata={"exp": "red"}).result().path,
            "s3": alice.save_weights_for_sampler("s3", user_metadata={"exp": "blue", "k": "v"})
            .result()
            .path,
            "x1": alice.save_weights_external("x1").result().path,
        }
        bob = client(st, "tml-bob").create_lora_training_client(MODEL, rank=RANK).result()
        st["bob_path"] = (
            bob.save_weights_for_sampler("b1", user_metadata={"exp": "blue"}).result().path
        )
        st["alice"] = alice
        yield st


def post(env, route: str, body: dict, key: str = "tml-alice") -> httpx.Response:
    return httpx.post(
        f"{env['srv'].url}/api/v1/{route}", json=body, headers={"X-API-Key": key}, timeout=60
    )


def search(env, key: str = "tml-alice", **body) -> dict:
    r = post(env, "checkpoints/search", body, key)
    assert r.status_code == 200, r.text
    return r.json()


def pages(env, limit: int, **body) -> list[dict]:
    out, cursor = [], None
    for _ in range(100):  # a cursor that never ends fails, not hangs
        page = search(env, limit=limit, cursor=cursor, **body)
        assert len(page["checkpoints"]) <= limit
        out += page["checkpoints"]
        cursor = page["next_cursor"]
        if cursor is None:
            return out
    raise AssertionError(f"no last page after 100 pages of {limit}")


def paths(cks) -> list[str]:
    return [c["tinker_path"] for c in cks]


def newest_first(env, names) -> list[str]:
    """The saved checkpoints `names` in search order, from the run's own listing."""
    run = env["alice"].model_id
    got = httpx.get(
        f"{env['srv'].url}/api/v1/training_runs/{run}/checkpoints",
        headers={"X-API-Key": "tml-alice"},
    ).json()["checkpoints"]
    want = {env["saved"][n] for n in names}
    order = sorted(got, key=lambda c: (c["time"], c["tinker_path"]), reverse=True)
    return [c["tinker_path"] for c in order if c["tinker_path"] in want]


# ---------------------------------------------------------------------- search


def test_listings_carry_the_base_model(env):
    run = env["alice"].model_id
    got = httpx.get(
        f"{env['srv'].url}/api/v1/training_runs/{run}/checkpoints",
        headers={"X-API-Key": "tml-alice"},
    ).json()["checkpoints"]
    assert len(got) == len(env["saved"])
    assert {c["base_model"] for c in got} == {MODEL}
    assert {c["base_model"] for c in search(env)["checkpoints"]} == {MODEL}


def test_search_finds_by_metadata_and_pages_through_the_cursor(env):
    blue = newest_first(env, ["t1", "s1", "s3"])
    assert len(blue) == 3
    whole = search(env, user_metadata={"exp": "blue"}, limit=200)
    assert whole["next_cursor"] is None
    assert paths(whole["checkpoints"]) == blue  # bob's blue one and alice's red one left out
    for limit in (1, 2):
        assert paths(pages(env, limit, user_metadata={"exp": "blue"})) == blue
    first = search(env, user_metadata={"exp": "blue"}, limit=2)
    assert len(first["checkpoints"]) == 2 and first["next_cursor"] is not None
    assert paths(search(env, user_metadata={"exp": "blue", "k": "v"})["checkpoints"]) == [
        env["saved"]["s3"]
    ]
    assert paths(search(env, user_metadata={"exp": "green"})["checkpoints"]) == []
    # Every pair must hold, and the value must be equal (not a prefix, not another key's).
    assert search(env, user_metadata={"exp": "blu"})["checkpoints"] == []
    assert paths(search(env, key="tml-bob", user_metadata={"exp": "blue"})["checkpoints"]) == [
        env["bob_path"]
    ]


def test_search_filters_by_type_and_base_model(env):
    everything = newest_first(env, list(env["saved"]))
    assert paths(pages(env, 2)) == everything
    assert paths(search(env, checkpoint_type="training")["checkpoints"]) == [env["saved"]["t1"]]
    assert paths(search(env, checkpoint_type="external")["checkpoints"]) == [env["saved"]["x1"]]
    sampler = search(env, checkpoint_type="sampler", user_metadata={"exp": "blue"})
    assert paths(sampler["checkpoints"]) == newest_first(env, ["s1", "s3"])
    assert paths(search(env, base_models=[MODEL], limit=200)["checkpoints"]) == everything
    assert search(env, base_models=[])["checkpoints"] == []
    assert search(env, base_models=["Qwen/Qwen3-8B"])["checkpoints"] == []


@pytest.mark.parametrize(
    "body",
    [
        {"cursor": {"last_created_at": "yesterday", "last_checkpoint_uuid": "x"}},
        {"cursor": {"last_created_at": "2025-01-01T00:00:00", "last_checkpoint_uuid": "x"}},
        {"limit": 0},
        {"limit": 201},
        {"owner": {"type": "user", "owner_urns": ["bob"]}},
        {"checkpoint_type": "weights"},
        {"user_metadata": {"exp": 1}},
    ],
)
def test_search_refuses_what_it_cannot_answer(env, body):
    r = post(env, "checkpoints/search", body)
    assert r.status_code == 422, r.text
    assert r.json()["detail"]


# ---------------------------------------------------------------------- uploads


def exported_files(env) -> dict[str, bytes]:
    """The files of alice's save_weights_external checkpoint, through its download URLs."""
    if "files" not in env:
        _, _, run, kind, name = env["saved"]["x1"].split("/")
        urls = httpx.get(
            f"{env['srv'].url}/api/v1/training_runs/{run}/checkpoints/{kind}/{name}"
            "/external_weights_urls",
            headers={"X-API-Key": "tml-alice"},
        ).json()["urls"]
        env["files"] = {f: httpx.get(u).content for f, u in urls.items()}
    assert set(env["files"]) == {"adapter_config.json", "adapter_model.safetensors"}
    return env["files"]


def start(env, key: str = "tml-alice", rank: int = RANK) -> dict:
    r = post(
        env,
        "external_weights_upload_start",
        {"base_model": MODEL, "lora_config": {"rank": rank}},
        key,
    )
    assert r.status_code == 200, r.text
    up = r.json()
    assert set(up) == {"upload_id", "urls", "expires"}
    return up


def upload(env, files: dict, key: str = "tml-alice") -> tuple[dict, httpx.Response]:
    """start, PUT each file (no API key: the URL is signed), finish -> (start, finish)."""
    up = start(env, key)
    for name, data in files.items():
        r = httpx.put(up["urls"][name], content=data)
        assert r.status_code == 200, r.text
    return up, post(env, "external_weights_upload_finish", {"upload_id": up["upload_id"]}, key)


def logprobs(env, **where) -> np.ndarray:
    sc = client(env).create_sampling_client(**where).result()
    lp = sc.compute_logprobs(types.ModelInput.from_ints(PROMPT)).result()
    return np.array(lp[1:], np.float64)


def test_an_upload_round_trips_to_the_exported_adapters_logprobs(env):
    up, fin = upload(env, exported_files(env))
    assert fin.status_code == 200, fin.text
    path = fin.json()["tinker_path"]
    assert path.startswith("tinker://") and "/external_weights/" in path
    mine = logprobs(env, model_path=path)
    exported = logprobs(env, model_path=env["saved"]["s1"])  # same weights, saved for sampler
    base = logprobs(env, base_model=MODEL)
    assert np.abs(exported - base).max() > 1e-3  # the adapter is not the base model
    np.testing.assert_allclose(mine, exported, rtol=1e-6, atol=1e-7)
    found = search(env, checkpoint_type="external", base_models=[MODEL])["checkpoints"]
    assert path in paths(found)
    run = path.split("/")[2]
    info = httpx.get(
        f"{env['srv'].url}/api/v1/training_runs/{run}", headers={"X-API-Key": "tml-alice"}
    ).json()
    assert (info["base_model"], info["lora_rank"]) == (MODEL, RANK)
    # Another tenant cannot sample it.
    r = post(
        env,
        "create_sampling_session",
        {"session_id": "x", "model_path": path},
        "tml-bob",
    )
    assert r.status_code == 404
    assert not os.listdir(os.path.join(env["dir"], "uploads"))


def snapshot(env) -> tuple:
    """Everything a refused upload could leave: files, listings, usage."""
    tree = sorted(
        os.path.relpath(os.path.join(d, f), env["dir"])
        for d, _, fs in os.walk(env["dir"])
        for f in fs
    )
    store = env["srv"].store
    runs = {
        k: httpx.get(f"{env['srv'].url}/api/v1/training_runs", headers={"X-API-Key": k}).json()
        for k in KEYS
    }
    return tree, runs, store.usage("alice"), store.usage("bob")


def safetensors_with(files: dict, change) -> dict:
    tensors = load(files["adapter_model.safetensors"])
    change(tensors)
    return {**files, "adapter_model.safetensors": save(tensors)}


def config_with(files: dict, **change) -> dict:
    cfg = {**json.loads(files["adapter_config.json"]), **change}
    return {**files, "adapter_config.json": json.dumps(cfg).encode()}


def _nan(t):
    k = sorted(t)[0]
    t[k] = t[k].copy()
    t[k].flat[3] = np.nan


WRONG = {
    "rank": (lambda f: config_with(f, r=2), "r 2 is not lora_config.rank 4"),
    "targets": (lambda f: config_with(f, target_modules=["q_proj"]), "target_modules"),
    "dora": (lambda f: config_with(f, use_dora=True), "use_dora"),
    "garbage": (
        lambda f: {**f, "adapter_model.safetensors": b"\x10" + b"\0" * 7 + b"not json"},
        "not a safetensors file",
    ),
    "nan": (lambda f: safetensors_with(f, _nan), "NaN"),
    "missing": (lambda f: safetensors_with(f, lambda t: t.pop(sorted(t)[-1])), "lacks"),
    "transposed": (
        lambda f: safetensors_with(f, lambda t: t.update({k: t[k].T.copy() for k in list(t)})),
        "shape",
    ),
    "config_missing": (
        lambda f: {"adapter_model.safetensors": f["adapter_model.safetensors"]},
        "adapter_config.json was not uploaded",
    ),
}


@pytest.mark.parametrize("case", list(WRONG))
def test_a_wrong_file_is_refused_and_leaves_nothing(env, case):
    make, why = WRONG[case]
    files = make(exported_files(env))
    before = snapshot(env)
    up, fin = upload(env, files)
    assert fin.status_code == 422, fin.text
    assert why in fin.json()["detail"]
    assert snapshot(env) == before
    # The refused upload is gone: finishing it again is "not found".
    again = post(env, "external_weights_upload_finish", {"upload_id": up["upload_id"]})
    assert again.status_code == 404


def test_an_oversized_file_is_refused_and_leaves_nothing(env):
    files = exported_files(env)
    before = snapshot(env)
    up = start(env)
    url = up["urls"]["adapter_model.safetensors"]
    r = httpx.put(up["urls"]["adapter_config.json"], content=b"{" + b" " * (64 << 10) + b"}")
    assert r.status_code == 413, r.text
    big = files["adapter_model.safetensors"] + b"\0" * (1 << 20)
    assert httpx.put(url, content=big).status_code == 413  # declared by content-length

    def chunks():  # streamed: no length declared
        for i in range(0, len(big), 1 << 16):
            yield big[i : i + (1 << 16)]

    assert httpx.put(url, content=chunks()).status_code == 413
    assert os.listdir(os.path.join(env["dir"], "uploads", up["upload_id"])) == []
    fin = post(env, "external_weights_upload_finish", {"upload_id": up["upload_id"]})
    assert fin.status_code == 422 and "was not uploaded" in fin.json()["detail"]
    assert snapshot(env) == before
    # The bound is the rank's own: the real file fits it.
    up, fin = upload(env, files)
    assert fin.status_code == 200, fin.text


def test_another_tenants_finish_is_not_found_and_leaves_the_upload(env):
    files = exported_files(env)
    up = start(env)
    for name, data in files.items():
        assert httpx.put(up["urls"][name], content=data).status_code == 200
    before = snapshot(env)
    theirs = post(env, "external_weights_upload_finish", {"upload_id": up["upload_id"]}, "tml-bob")
    assert theirs.status_code == 404, theirs.text
    assert snapshot(env) == before
    mine = post(env, "external_weights_upload_finish", {"upload_id": up["upload_id"]})
    assert mine.status_code == 200, mine.text
    assert snapshot(env) != before


def test_upload_start_refuses_what_it_cannot_take(env):
    for body, status in [
        ({"base_model": "Qwen/Qwen3-8B", "lora_config": {"rank": 4}}, 404),
        ({"base_model": MODEL, "lora_config": {"rank": 9}}, 422),
        ({"base_model": MODEL, "lora_config": {"rank": 0}}, 422),
        ({"base_model": MODEL, "lora_config": {"rank": 4, "train_attn": "yes"}}, 422),
        (
            {
                "base_model": MODEL,
                "lora_config": {
                    "rank": 4,
                    "train_attn": False,
                    "train_mlp": False,
                    "train_unembed": False,
                },
            },
            422,
        ),
    ]:
        r = post(env, "external_weights_upload_start", body)
        assert r.status_code == status, (body, r.text)
    assert httpx.put(f"{env['srv'].url}/api/v1/external_weights_upload/nope/x").status_code == 404
