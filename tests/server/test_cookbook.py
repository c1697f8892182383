"""The Tinker cookbook (tinker-cookbook 0.6.1), unmodified, against jcp-serve on 127.0.0.1.

Offline: a tiny random Qwen3 folder with a local BPE chat tokenizer (cookbook_harness), the
cookbook's `qwen3` renderer, its own training loops — supervised.train (and its resume
after a server restart), rl.train sync (default importance_sampling, with provenance
spans) and async (ppo) — its completers and weights.download (age-encrypted export).

The cookbook is not in the test extra: it requires tml-renderers, which the package index
does not have (it is imported only for Inkling / Kimi models). Install it with
`pip install --no-deps tinker-cookbook==0.6.1 chz blobfile datasets aiohttp termcolor
cloudpickle` to run these tests; without it they are skipped.
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile

import numpy as np
import pytest

os.environ.setdefault("TINKER_TELEMETRY", "0")
pytest.importorskip("tinker")
pytest.importorskip(
    "tinker_cookbook.rl.train",
    reason="tinker-cookbook not installed (pip install --no-deps tinker-cookbook==0.6.1 "
    "chz blobfile datasets aiohttp termcolor cloudpickle)",
)

from helpers import cookbook_harness as C  # noqa: E402

import jcp  # noqa: E402
from jcp.server.service import Server  # noqa: E402


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    path = C.build(str(tmp_path_factory.mktemp("tiny-qwen3")))
    cfg, base = jcp.load_hf(path)
    tr = jcp.Trainer(cfg, jcp.make_mesh(1, 1, 1), base_params=base, max_adapters=4, max_rank=8)
    state = {"tr": tr, "path": path, "dir": str(tmp_path_factory.mktemp("state"))}
    state["srv"] = Server(tr, path, state["dir"], tokenizer_id=path).start()
    old = os.environ.get("TINKER_API_KEY")
    os.environ["TINKER_API_KEY"] = "tml-local"
    yield state
    state["srv"].stop()
    if old is None:
        os.environ.pop("TINKER_API_KEY", None)
    else:
        os.environ["TINKER_API_KEY"] = old


def rows(log_path: str) -> list[dict]:
    with open(os.path.join(log_path, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def sl_config(env, log_path, max_steps):
    from tinker_cookbook.supervised import train
    from tinker_cookbook.supervised.data import FromConversationFileBuilder
    from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

    data = C.conversations(os.path.join(log_path, "..", "convos.jsonl"))
    common = ChatDatasetBuilderCommonConfig(
        model_name_for_tokenizer=env["path"], renderer_name="qwen3", max_length=64, batch_size=2
    )
    return train, train.Config(
        log_path=log_path,
        model_name=env["path"],
        recipe_name="jcp_test",
        renderer_name="qwen3",
        lora_rank=8,
        base_url=env["srv"].url,
        learning_rate=1e-3,
        dataset_builder=FromConversationFileBuilder(file_path=data, common_config=common),
        max_steps=max_steps,
        save_every=1,
        eval_every=0,
    )


def test_supervised_train_and_resume_after_restart(env):
    log = tempfile.mkdtemp(dir=env["dir"])
    train, cfg = sl_config(env, log, 2)
    asyncio.run(train.main(cfg))
    got = rows(log)
    assert [r.get("step") for r in got if "train_mean_nll" in r] == [0, 1]
    assert all(isinstance(r["step"], int) for r in got)
    assert all(r["adam_step:max"] == r["step"] + 1 for r in got if "train_mean_nll" in r)

    # As if the job and the server had been killed after step 0's checkpoint: the
    # cookbook resumes from it (weights and optimizer, through a restarted server on the
    # same --state-dir), drops the rows from step 1 on, and keeps one row per step.
    ckpts = os.path.join(log, "checkpoints.jsonl")
    with open(ckpts) as f:
        first = f.readline()
    assert json.loads(first)["batch"] == 1
    with open(ckpts, "w") as f:
        f.write(first)
    tr = env["tr"]
    env["srv"].stop()
    for a in list(tr.adapters):
        tr.delete_adapter(a)
    env["srv"] = Server(tr, env["path"], env["dir"], tokenizer_id=env["path"]).start()
    train, cfg = sl_config(env, log, 3)
    asyncio.run(train.main(cfg))
    steps = [r.get("step") for r in rows(log) if "train_mean_nll" in r]
    assert steps == [0, 1, 2]
    # The optimizer state came back with the weights: Adam's count continues from the
    # checkpoint's (≥ 1) instead of restarting at 1.
    count = {r["step"]: r["adam_step:max"] for r in rows(log) if "train_mean_nll" in r}
    assert count[1] >= 2 and count[2] == count[1] + 1
    with open(os.path.join(log, "checkpoints.jsonl")) as f:
        env["state_path"] = [json.loads(line) for line in f][-1]["state_path"]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_rl_train(env, mode):
    from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticDatasetBuilder
    from tinker_cookbook.rl import train

    log = tempfile.mkdtemp(dir=env["dir"])
    kw = {}
    if mode == "async":
        kw = dict(
            loss_fn="ppo",
            async_config=train.AsyncConfig(
                max_steps_off_policy=1, groups_per_batch=2, loss_fn="ppo"
            ),
        )
    cfg = train.Config(
        learning_rate=1e-3,
        model_name=env["path"],
        recipe_name="jcp_test",
        renderer_name="qwen3",
        log_path=log,
        lora_rank=8,
        base_url=env["srv"].url,
        max_tokens=6,
        max_steps=1,
        save_every=0,
        eval_every=0,
        dataset_builder=ArithmeticDatasetBuilder(
            batch_size=2,
            group_size=3,
            n_batches=1,
            model_name_for_tokenizer=env["path"],
            renderer_name="qwen3",
        ),
        **kw,
    )
    asyncio.run(train.main(cfg))
    trained = [r for r in rows(log) if "optim/kl_sample_train_v1" in r]
    assert [r["step"] for r in trained] == [0]
    # The sampler's log-probs are the trainer's: on-policy data has ratio 1.
    assert abs(trained[0]["optim/kl_sample_train_v1"]) < 1e-4
    # jcp's optim metrics joined the row without overwriting the cookbook's own keys.
    assert "grad_norm:mean" in trained[0] and trained[0]["step"] == 0


def test_completers(env):
    import tinker
    from tinker_cookbook import renderers
    from tinker_cookbook.completers import TinkerMessageCompleter, TinkerTokenCompleter
    from tinker_cookbook.tokenizer_utils import get_tokenizer

    sc = tinker.ServiceClient(base_url=env["srv"].url)
    try:
        sampler = sc.create_sampling_client(base_model=env["path"])
        renderer = renderers.get_renderer("qwen3", get_tokenizer(env["path"]))
        prompt = renderer.build_generation_prompt([{"role": "user", "content": "Hello"}])
        out = asyncio.run(
            TinkerTokenCompleter(sampler, max_tokens=4)(prompt, renderer.get_stop_sequences())
        )
        assert 1 <= len(out.tokens) <= 4 and len(out.maybe_logprobs) == len(out.tokens)
        msg = asyncio.run(
            TinkerMessageCompleter(sampler, renderer, max_tokens=4)(
                [{"role": "user", "content": "Hello"}]
            )
        )
        assert msg["role"] == "assistant" and isinstance(msg["content"], (str, list))
    finally:
        sc.close("success").result()


def test_weights_download(env, tmp_path):
    """weights.download of a training checkpoint: a temporary model exports it
    age-encrypted, the files come from jcp-serve's URLs, are decrypted, and the export is
    deleted; the adapter equals the checkpoint's weights."""
    from safetensors.numpy import load_file
    from tinker_cookbook import weights

    path = env["state_path"]
    out = weights.download(
        tinker_path=path, output_dir=str(tmp_path / "adapter"), base_url=env["srv"].url
    )
    assert sorted(os.listdir(out)) == ["adapter_config.json", "adapter_model.safetensors"]
    got = load_file(os.path.join(out, "adapter_model.safetensors"))
    tr = env["tr"]
    folder, _ = env["srv"].store.resolve(path, "local", "weights")
    a = tr.load_state(folder)
    try:
        want = tr.adapter_weights(a)
    finally:
        tr.delete_adapter(a)
    assert got.keys() == want.keys() and any(np.abs(v).max() > 0 for v in got.values())
    for k in got:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    runs = os.path.join(env["dir"], "runs")
    assert not any(
        os.path.isdir(os.path.join(runs, r, "external_weights", "download"))
        for r in os.listdir(runs)
    )
