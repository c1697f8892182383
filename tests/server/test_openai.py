"""jcp-serve's OpenAI-compatible routes through the real `openai` client (sync, async,
streaming), beside the Tinker SDK on the same server, and jcp.server.text on its own.

A tiny random Qwen3 written without torch (cookbook_harness.build_numpy) with a real
byte-level BPE tokenizer and a chat template built here; its unembedding keeps special and
non-ASCII tokens out of greedy text (so texts are plain and stop strings meet them).

Evidence:
1. text.py (host only): incremental detokenization of multi-byte characters concatenates
   to the full decode and never shows a partial character; stop strings end the text
   exactly where they start, also across token boundaries; the chat template renders as
   transformers' apply_chat_template on the same tokenizer_config (text and tokens);
2. one engine for both protocols: greedy /v1/completions and /v1/chat/completions text
   equals the Tinker SDK's `sample` of the same tokens, decoded; echo + logprobs equal
   the SDK's `compute_logprobs`; n > 1 with a seed reproduces and equals the SDK's draws;
   a tenant's sampler weights (named, in-memory) and training checkpoint are served
   under their tinker:// paths and equal the SDK's sampling of them; another tenant's
   paths are "not found" and not listed;
3. stop strings (OpenAI `stop` and Tinker `SamplingParams.stop`) end the text where the
   string starts — one inside a token and one across a token boundary — and the sequence
   at the token that completes it (finish_reason / stop_reason "stop");
4. streamed chunks (sync and async, completions and chat, n > 1) concatenate to the
   non-streamed text, with the usage chunk; a client that disconnects mid-stream has its
   request cancelled in the engine and its rows freed;
5. refusals in OpenAI's error shape naming the field, with nothing queued: unsupported
   fields (tools, response_format, an image part, logit_bias), the context length, and a
   model without a tokenizer (text routes refused clearly);
6. lm-eval's `local-completions` runs a local multiple-choice loglikelihood task against
   the server; its per-choice log-likelihoods equal `compute_logprobs` sums; its
   `local-chat-completions` runs a local generate_until task whose outputs equal the
   SDK's greedy samples of the chat template's tokens, decoded (skipped when lm-eval is
   not installed).
"""

from __future__ import annotations

import asyncio
import json
import os
import time

import numpy as np
import pytest

os.environ.setdefault("TINKER_TELEMETRY", "0")
openai = pytest.importorskip("openai")
tinker = pytest.importorskip("tinker")
httpx = pytest.importorskip("httpx")
from helpers import cookbook_harness as C  # noqa: E402
from helpers.server_harness import client, serving  # noqa: E402
from tinker import types  # noqa: E402

import jcp  # noqa: E402
from jcp.server.text import Detokenizer, SeqText, StopWatch, Text, complete_text  # noqa: E402

MODEL = "tiny-chat"
KEYS = {"tml-alice": "alice", "tml-bob": "bob"}
# A chat template in the style of Qwen's: system / user / assistant turns, the EOS token
# from tokenizer_config.json after assistant turns, raise_exception on a bad role, a
# generation prompt, and a loop control.
TEMPLATE = (
    "{%- for m in messages %}"
    "{%- if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + m['role']) }}{%- endif %}"
    "{%- if m['content'] == '' %}{% continue %}{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] }}"
    "{%- if m['role'] == 'assistant' %}{{ eos_token }}{% else %}{{ '<|im_end|>' }}{% endif %}"
    "{{ '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _quiet(fast) -> list[int]:
    """Special tokens and tokens that are not printable ASCII: never greedy text."""
    return [
        i
        for i in range(len(fast))
        if i in fast.added_tokens_decoder
        or not fast.decode([i])
        or not all(32 <= ord(c) < 127 for c in fast.decode([i]))
    ]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return C.build_numpy(
        str(tmp_path_factory.mktemp("tiny-chat")), chat_template=TEMPLATE, quiet=_quiet
    )


@pytest.fixture(scope="module")
def text(folder):
    return Text.load(folder)


@pytest.fixture(scope="module")
def env(folder):
    cfg, base = jcp.load_hf(folder)
    tr = jcp.Trainer(cfg, jcp.make_mesh(1, 1, 1), base_params=base, max_adapters=4, max_rank=8)
    with serving(
        tr,
        MODEL,
        KEYS,
        "jcp-serve-openai-",
        tokenizer_id=folder,
        sample_slots=16,
        sample_max_len=128,
    ) as state:
        state["text"] = Text.load(folder)
        state["oai"] = {
            k: openai.OpenAI(base_url=state["srv"].url + "/v1", api_key=k, max_retries=0)
            for k in KEYS
        }
        yield state


def _sampler(env, key="tml-alice"):
    """The SDK's sampling client of the base model (one per tenant)."""
    if key not in env:
        env[key] = client(env, key).create_sampling_client(base_model=MODEL).result()
    return env[key]


GREEDY = dict(temperature=0.0)


# ---------------------------------------------------------------------- text.py alone


def test_detokenizer_streams_whole_characters(text):
    s = "Hi héllo 你好 🙂 — the answer is 42."
    ids = text.encode(s)
    assert len(ids) > len(s.encode()) // 2  # multi-byte characters span several tokens
    d = Detokenizer(text)
    pieces = [d.push(t) for t in ids] + [d.flush()]
    assert "".join(pieces) == text.decode(ids) == s
    assert not any("\ufffd" in p for p in pieces)
    assert pieces.count("") >= 3  # tokens that ended inside a character waited
    # A sequence cut inside a character ends with the replacement character, as decode.
    d = Detokenizer(text)
    cut = text.encode("Hi héllo 你")[:-1]
    got = "".join(d.push(t) for t in cut) + d.flush()
    assert got == text.decode(cut) and got.endswith("\ufffd")


def test_stop_strings_cut_where_they_start(text):
    s = "The answer is 17. Hello, how are you?"
    ids = text.encode(s)
    pieces = [text.decode([t]) for t in ids]
    # A stop string across a token boundary (the end of one token, the start of the next).
    k = next(
        i for i in range(1, len(pieces) - 1) if len(pieces[i]) >= 2 and len(pieces[i + 1]) >= 2
    )
    across = pieces[k][-2:] + pieces[k + 1][:2]
    at = s.find(across)
    assert at == len("".join(pieces[: k + 1])) - 2
    got, keep = complete_text(text, ids, [across])
    assert (got, keep) == (s[:at], k + 2)
    # One inside a token; the earliest of several wins; none found keeps everything.
    got, keep = complete_text(text, ids, ["zzz", "ello"])
    assert got == s[: s.find("ello")] and keep == next(
        i + 1 for i in range(len(ids)) if "ello" in text.decode(ids[: i + 1])
    )
    assert complete_text(text, ids, ["zzz"]) == (s, None)
    # A stream holds back what could still become a stop string, never more.
    seq = SeqText(text, [across])
    for t in ids[: k + 1]:
        assert not seq.push(t)
    assert seq.ready == len(seq.text) - (len(across) - 1)
    assert seq.push(ids[k + 1]) and seq.text == s[:at] and seq.ready == at
    # The engine's hook: sequence 1 ends at the completing token, sequence 0 runs on,
    # and the feed got exactly the kept tokens.
    fed = []
    watch = StopWatch(text, [across], lambda j, t, lp, rows: fed.append((j, t)))
    assert watch(0, ids[:k], [0.0] * k) is None
    assert watch(1, ids, [0.0] * len(ids)) == k + 2
    assert fed == [(0, ids[:k]), (1, ids[: k + 2])]


def test_chat_template_renders_as_transformers(text, folder):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    chats = [
        [{"role": "user", "content": "What is 4 + 5?"}],
        [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Hello, how are you?"},
            {"role": "assistant", "content": "I am fine, thank you. And you?"},
            {"role": "assistant", "content": ""},
            {"role": "user", "content": "Tell me a short story about a cat."},
        ],
    ]
    for msgs in chats:
        for gen in (True, False):
            want = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
            assert text.render_chat(msgs, gen) == want
            ids = hf.apply_chat_template(msgs, tokenize=True, add_generation_prompt=gen)
            ids = ids["input_ids"] if not isinstance(ids, list) else ids
            assert text.chat_tokens(msgs, gen) == list(ids)
    assert "<|im_end|>" in want and text.chat_tokens(chats[0])[0] == hf.convert_tokens_to_ids(
        "<|im_start|>"
    )
    from jcp.server.text import TextError

    with pytest.raises(TextError, match="unknown role tool"):
        text.render_chat([{"role": "tool", "content": "x"}])


# ---------------------------------------------------------------------- one engine


def test_greedy_text_equals_tinker_sample(env):
    text, oai = env["text"], env["oai"]["tml-alice"]
    prompt = "Hello, how are you?"
    ids = text.encode(prompt)
    ref = (
        _sampler(env)
        .sample(types.ModelInput.from_ints(ids), 1, types.SamplingParams(max_tokens=12, **GREEDY))
        .result()
        .sequences[0]
    )
    assert len(text.decode(ref.tokens).strip()) >= 6  # the model writes text
    r = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=12, **GREEDY)
    assert r.choices[0].text == text.decode(ref.tokens)
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 12)
    # Token-id prompts and lists of prompts: one choice per prompt, in order.
    r = oai.completions.create(
        model=MODEL, prompt=[ids, text.encode("What is 4 + 5?")], max_tokens=12, **GREEDY
    )
    assert [c.index for c in r.choices] == [0, 1] and r.choices[0].text == text.decode(ref.tokens)
    # Chat: the template's tokens, sampled by the SDK, decoded.
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "What is 12 + 30?"}]},
    ]
    chat_ids = text.chat_tokens(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is 12 + 30?"},
        ]
    )
    ref = (
        _sampler(env)
        .sample(
            types.ModelInput.from_ints(chat_ids), 1, types.SamplingParams(max_tokens=10, **GREEDY)
        )
        .result()
        .sequences[0]
    )
    r = oai.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, **GREEDY)
    assert r.choices[0].message.content == text.decode(ref.tokens)
    assert r.choices[0].message.role == "assistant" and r.usage.prompt_tokens == len(chat_ids)


def test_echo_logprobs_equal_compute_logprobs(env):
    text, oai = env["text"], env["oai"]["tml-alice"]
    ids = text.encode("Once upon a time there was a small cat")
    want = _sampler(env).compute_logprobs(types.ModelInput.from_ints(ids)).result()
    for max_tokens in (0, 1):
        r = oai.completions.create(
            model=MODEL, prompt=ids, max_tokens=max_tokens, echo=True, logprobs=2, **GREEDY
        )
        lp = r.choices[0].logprobs
        assert r.choices[0].text.startswith(text.decode(ids, skip_special_tokens=False))
        assert len(lp.tokens) == len(ids) + max_tokens
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        np.testing.assert_allclose(lp.token_logprobs[1 : len(ids)], want[1:], rtol=1e-5, atol=1e-5)
        for lpv, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:]):
            assert len(top) <= 2 and max(top.values()) >= lpv - 1e-5
        assert r.usage.completion_tokens == max_tokens
    # Chat log-probs: the sampled tokens' own, with their top alternatives.
    r = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=6,
        logprobs=True,
        top_logprobs=3,
        **GREEDY,
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 6 and all(len(c.top_logprobs) == 3 for c in content)
    assert all(c.logprob == c.top_logprobs[0].logprob for c in content)  # greedy: the top
    assert "".join(c.token for c in content) == r.choices[0].message.content


def test_n_with_a_seed_reproduces(env):
    text, oai = env["text"], env["oai"]["tml-bob"]
    kw = dict(
        model=MODEL, prompt="Tell me a short story", max_tokens=10, n=3, seed=11, temperature=1.0
    )
    a = oai.completions.create(**kw)
    b = oai.completions.create(**kw)
    texts = [c.text for c in a.choices]
    assert len(set(texts)) > 1  # the three draws differ...
    assert texts == [c.text for c in b.choices]  # ...and the seed reproduces them
    ref = (
        _sampler(env, "tml-bob")
        .sample(
            types.ModelInput.from_ints(text.encode(kw["prompt"])),
            3,
            types.SamplingParams(max_tokens=10, seed=11),
        )
        .result()
    )
    assert [text.decode(s.tokens) for s in ref.sequences] == texts
    assert oai.completions.create(**{**kw, "seed": 12}).choices[0].text != texts[0]


def test_tenant_weights_by_path_and_isolation(env):
    text, alice, bob = env["text"], env["oai"]["tml-alice"], env["oai"]["tml-bob"]
    tc = (
        client(env, "tml-alice")
        .create_lora_training_client(base_model=MODEL, rank=4, seed=3)
        .result()
    )
    toks = text.encode("The answer is 17. Hello, how are you?")
    d = types.Datum(
        model_input=types.ModelInput.from_ints(toks[:-1]),
        loss_fn_inputs={"target_tokens": toks[1:], "weights": [1.0] * (len(toks) - 1)},
    )
    for _ in range(2):
        tc.forward_backward([d], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    named = tc.save_weights_for_sampler("oai-named").result().path
    ckpt = tc.save_state("oai-ckpt").result().path
    snap = tc.save_weights_and_get_sampling_client().result()
    snap_path = [
        r.model_path
        for r in env["srv"].store.samplers.values()
        if r.owner == "alice" and r.folder is None and r.model_path
    ][-1]
    prompt = text.encode("What is 4 + 5?")
    sp = types.SamplingParams(max_tokens=10, **GREEDY)
    base = _sampler(env).sample(types.ModelInput.from_ints(prompt), 1, sp).result()
    want = snap.sample(types.ModelInput.from_ints(prompt), 1, sp).result().sequences[0].tokens
    assert list(want) != list(base.sequences[0].tokens)  # the adapter changes the text
    listed = {m.id for m in alice.models.list().data}
    assert {MODEL, named, ckpt, snap_path} <= listed
    for path in (named, ckpt, snap_path):
        r = alice.completions.create(model=path, prompt=prompt, max_tokens=10, **GREEDY)
        assert r.choices[0].text == text.decode(want), path
        assert r.model == path
    # bob: none of alice's paths is listed or served, with OpenAI's "not found".
    assert {m.id for m in bob.models.list().data} == {MODEL}
    for path in (named, ckpt, snap_path, "tinker://nope/weights/x", "gpt-4"):
        with pytest.raises(openai.NotFoundError) as e:
            bob.completions.create(model=path, prompt=prompt, max_tokens=2)
        assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"


# ---------------------------------------------------------------------- stop strings


def test_stop_strings_end_the_text_where_they_start(env):
    text, oai = env["text"], env["oai"]["tml-alice"]
    prompt = text.encode("Once upon a time")
    full = (
        _sampler(env)
        .sample(
            types.ModelInput.from_ints(prompt), 1, types.SamplingParams(max_tokens=24, **GREEDY)
        )
        .result()
        .sequences[0]
        .tokens
    )
    pieces = [text.decode([t]) for t in full]
    whole = "".join(pieces)
    k = next(
        i
        for i in range(2, len(pieces) - 1)
        if len(pieces[i]) >= 2
        and len(pieces[i + 1]) >= 1
        and whole.find(pieces[i][-2:] + pieces[i + 1][:1]) == len("".join(pieces[: i + 1])) - 2
    )
    across = pieces[k][-2:] + pieces[k + 1][:1]  # ends inside token k + 1
    inside = next(p for p in pieces[1:] if len(p.strip()) >= 2).strip()[:2]
    for stop in (across, inside):
        at = whole.find(stop)
        keep = next(i + 1 for i in range(len(full)) if stop in text.decode(full[: i + 1]))
        r = oai.completions.create(
            model=MODEL, prompt=prompt, max_tokens=24, stop=[stop, "@@"], **GREEDY
        )
        c = r.choices[0]
        assert (c.text, c.finish_reason) == (whole[:at], "stop"), stop
        assert r.usage.completion_tokens == keep
        streamed = "".join(
            ch.choices[0].text
            for ch in oai.completions.create(
                model=MODEL, prompt=prompt, max_tokens=24, stop=stop, stream=True, **GREEDY
            )
            if ch.choices
        )
        assert streamed == whole[:at]
        # Tinker's SamplingParams.stop strings: the tokens through the completing one.
        seq = (
            _sampler(env)
            .sample(
                types.ModelInput.from_ints(prompt),
                1,
                types.SamplingParams(max_tokens=24, stop=[stop], **GREEDY),
            )
            .result()
            .sequences[0]
        )
        assert list(seq.tokens) == list(full[:keep]) and seq.stop_reason == "stop"


# ---------------------------------------------------------------------- streaming


def _joined(chunks, chat=False):
    out, reasons, usage = {}, {}, None
    for ch in chunks:
        if ch.usage is not None:
            usage = ch.usage
        for c in ch.choices:
            piece = (c.delta.content or "") if chat else c.text
            out[c.index] = out.get(c.index, "") + piece
            if c.finish_reason is not None:
                reasons[c.index] = c.finish_reason
    return out, reasons, usage


def test_streaming_concatenates_to_the_whole(env):
    oai = env["oai"]["tml-alice"]
    kw = dict(
        model=MODEL,
        prompt="Hello, how are you?",
        max_tokens=20,
        n=2,
        seed=5,
        temperature=0.8,
        logprobs=1,
    )
    whole = oai.completions.create(**kw)
    got, reasons, usage = _joined(
        oai.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    assert got == {c.index: c.text for c in whole.choices}
    assert reasons == {c.index: c.finish_reason for c in whole.choices}
    assert usage.completion_tokens == whole.usage.completion_tokens == 40

    async def chat():
        aoai = openai.AsyncOpenAI(base_url=env["srv"].url + "/v1", api_key="tml-bob", max_retries=0)
        ckw = dict(
            model=MODEL,
            messages=[{"role": "user", "content": "What is 4 + 5?"}],
            max_completion_tokens=16,
            seed=2,
            temperature=0.7,
            n=2,
        )
        whole, stream = await asyncio.gather(
            aoai.chat.completions.create(**ckw), aoai.chat.completions.create(**ckw, stream=True)
        )
        chunks = [ch async for ch in stream]
        await aoai.close()
        return whole, chunks

    whole, chunks = asyncio.run(chat())
    got, reasons, _ = _joined(chunks, chat=True)
    assert got == {c.index: c.message.content for c in whole.choices}
    assert chunks[0].choices[0].delta.role == "assistant"


def test_disconnect_mid_stream_frees_its_rows(env):
    sampling = env["srv"].worker.sampling
    cancelled = []
    real = sampling.cancel
    sampling.cancel = lambda rid: (cancelled.append(rid), real(rid))[1]
    try:
        body = {
            "model": MODEL,
            "prompt": "Hello",
            "max_tokens": 400,
            "n": 3,
            "stream": True,
            "temperature": 0,
        }
        with httpx.stream(
            "POST",
            env["srv"].url + "/v1/completions",
            json=body,
            timeout=60,
            headers={"Authorization": "Bearer tml-bob"},
        ) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            first = next(
                x
                for x in lines
                if x.startswith("data: {") and json.loads(x[6:])["choices"][0]["text"]
            )
            assert first and sampling.live == 3  # decoding, its three rows held
        deadline = time.monotonic() + 30
        while not (cancelled and sampling.idle):
            assert time.monotonic() < deadline, "the stream's request was not cancelled"
            time.sleep(0.01)
        assert sampling.live == 0
        # A client that gives up waiting for a whole (non-streamed) answer: the same.
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                env["srv"].url + "/v1/completions",
                json={**body, "stream": False, "n": 1, "max_tokens": 1000},
                headers={"Authorization": "Bearer tml-bob"},
                timeout=0.5,
            )
        deadline = time.monotonic() + 30
        while not (len(cancelled) == 2 and sampling.idle):
            assert time.monotonic() < deadline, "the abandoned request was not cancelled"
            time.sleep(0.01)
    finally:
        sampling.cancel = real


# ---------------------------------------------------------------------- refusals


def _settled(srv, quiet=0.3, limit=30.0):
    """(passes, engine steps, pending) once the engine is idle and its step count has held
    for `quiet` s: a step an earlier test's cancelled request was in can still end (and
    count) after the engine went idle."""
    deadline = time.monotonic() + limit
    while True:
        steps = srv.worker.sampling.steps
        time.sleep(quiet)
        if srv.worker.sampling.idle and srv.worker.sampling.steps == steps:
            return srv.scheduler.counters.passes, steps, srv.scheduler.pending()
        assert time.monotonic() < deadline, "the engine did not settle"


def test_unsupported_fields_are_refused_naming_them(env):
    oai, srv = env["oai"]["tml-alice"], env["srv"]
    before = _settled(srv)
    msgs = [{"role": "user", "content": "hi"}]
    cases = [
        ("tools", dict(messages=msgs, tools=[{"type": "function", "function": {"name": "f"}}])),
        ("response_format", dict(messages=msgs, response_format={"type": "json_object"})),
        (
            "messages[0].content[1].type",
            dict(
                messages=[
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "what is this"},
                            {"type": "image_url", "image_url": {"url": "data:,"}},
                        ],
                    }
                ]
            ),
        ),
        ("logit_bias", dict(messages=msgs, logit_bias={"5": 10})),
        ("messages[0]", dict(messages=[{"role": "tool", "content": "x", "tool_call_id": "1"}])),
    ]
    for param, kw in cases:
        with pytest.raises(openai.BadRequestError) as e:
            oai.chat.completions.create(model=MODEL, max_tokens=2, **kw)
        assert e.value.status_code == 400
        assert e.value.body["param"] == param and param.split("[")[0] in e.value.body["message"]
        assert e.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=MODEL, prompt="x" * 10, max_tokens=10**6)
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=srv.url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert (
        srv.scheduler.counters.passes,
        srv.worker.sampling.steps,
        srv.scheduler.pending(),
    ) == before


def test_a_model_without_tokenizer_refuses_text_routes(tmp_path):
    from fastapi.testclient import TestClient

    from jcp.server.app import FutureTable, ServedModel, create_app
    from jcp.server.scheduler import Scheduler
    from jcp.server.state import StateStore

    sched, store = Scheduler(), StateStore(str(tmp_path), None)
    app = create_app(store, sched, FutureTable(), ServedModel("jcp-tiny", 4096, 32, None))
    with TestClient(app) as tc:
        assert [m["id"] for m in tc.get("/v1/models").json()["data"]] == ["jcp-tiny"]
        for route, body in (
            ("completions", {"prompt": [1, 2, 3]}),
            ("chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ):
            r = tc.post(f"/v1/{route}", json={"model": "jcp-tiny", **body})
            assert r.status_code == 400
            err = r.json()["error"]
            assert err["code"] == "no_tokenizer" and "tokenizer" in err["message"]
        # Tinker string stops need the tokenizer too: the sample's future fails naming stop.
        sid = store.add_sampler("local", "jcp-tiny", None, None)
        rid = tc.post(
            "/api/v1/asample",
            json={
                "sampling_session_id": sid,
                "prompt": {"chunks": [{"tokens": [1, 2, 3]}]},
                "sampling_params": {"max_tokens": 2, "stop": ["\n\n"]},
            },
        ).json()["request_id"]
        got = tc.post("/api/v1/retrieve_future", json={"request_id": rid}).json()
        assert got["category"] == "user" and "stop: string stops need" in got["error"]
    assert sched.pending() == 0


def test_bodies_are_typed_in_the_schema_and_wrong_types_refused_in_openais_shape(env):
    """/openapi.json describes both routes' bodies (what schemathesis fuzzes); a wrong type
    is refused with OpenAI's error naming the field (param), with nothing queued."""
    srv = env["srv"]
    spec = httpx.get(srv.url + "/openapi.json").json()
    for path, want in (
        ("/v1/completions", {"prompt", "max_tokens", "logprobs", "echo", "stop", "stream"}),
        ("/v1/chat/completions", {"messages", "max_completion_tokens", "top_logprobs", "seed"}),
    ):
        body = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        assert want | {"model"} <= set(body["schema"]["properties"]), path
        assert {"model", next(iter(want & {"prompt", "messages"}))} <= set(
            body["schema"]["required"]
        )
    before = (srv.scheduler.counters.passes, srv.worker.sampling.steps, srv.scheduler.pending())
    cases = [
        ("completions", {"model": MODEL, "prompt": "hi", "temperature": "0.5"}, "temperature"),
        ("completions", {"model": MODEL, "prompt": "hi", "echo": "yes"}, "echo"),
        ("completions", {"model": MODEL, "prompt": [1, "a"]}, "prompt"),
        ("completions", {"prompt": "hi"}, "model"),
        ("chat/completions", {"model": MODEL, "messages": "hi"}, "messages"),
        (
            "chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": 5}]},
            "messages[0].content",
        ),
        (
            "chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logprobs": 2},
            "logprobs",
        ),
    ]
    for route, body, param in cases:
        r = httpx.post(
            f"{srv.url}/v1/{route}", json=body, headers={"Authorization": "Bearer tml-alice"}
        )
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert (err["param"], err["type"]) == (param, "invalid_request_error"), (body, err)
        assert err["message"].startswith(param + ":"), err
    after = (srv.scheduler.counters.passes, srv.worker.sampling.steps, srv.scheduler.pending())
    assert after == before


# ---------------------------------------------------------------------- lm-eval


def test_lm_eval_local_completions_loglikelihood(env, folder, tmp_path):
    pytest.importorskip("lm_eval")
    from lm_eval import evaluator
    from lm_eval.tasks import TaskManager

    text = env["text"]
    rows = [
        {"q": "What is 4 + 5?", "choices": ["9", "12"], "gold": 0},
        {"q": "The answer is", "choices": ["17.", "a cat"], "gold": 0},
    ]
    with open(tmp_path / "mc.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    (tmp_path / "mc.yaml").write_text(
        "task: jcp_mc\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {tmp_path / 'mc.jsonl'}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{q}}'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: gold\nmetric_list:\n  - metric: acc\n"
    )
    out = evaluator.simple_evaluate(
        model="local-completions",
        tasks=["jcp_mc"],
        # This folder's task only: indexing lm-eval's own tasks took ~6 CPU s a call.
        task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False),
        model_args=dict(
            model=MODEL,
            base_url=f"{env['srv'].url}/v1/completions",
            tokenizer_backend="huggingface",
            tokenizer=folder,
            num_concurrent=1,
            max_retries=1,
            header={"Authorization": "Bearer tml-alice"},
        ),
        log_samples=True,
        limit=None,
    )
    samples = out["samples"]["jcp_mc"]
    assert len(samples) == 2
    sampler = _sampler(env)
    for s in samples:
        ctx = text.encode(s["doc"]["q"])
        for (ll, _), choice in zip(s["filtered_resps"], s["doc"]["choices"]):
            whole = text.encode(s["doc"]["q"] + " " + choice)
            assert whole[: len(ctx)] == ctx
            lp = sampler.compute_logprobs(types.ModelInput.from_ints(whole)).result()
            assert ll == pytest.approx(sum(lp[len(ctx) :]), abs=1e-4)


def test_lm_eval_local_chat_completions_generate_until(env, tmp_path):
    """lm-eval's `local-chat-completions` (its chat template applied by the server) runs a
    local generate_until task; each output is the greedy text of the same server through
    the Tinker SDK: the chat template's tokens sampled, decoded."""
    pytest.importorskip("lm_eval")
    from lm_eval import evaluator
    from lm_eval.tasks import TaskManager

    text = env["text"]
    rows = [{"q": "What is 4 + 5?", "a": "9"}, {"q": "Name a small animal.", "a": "a cat"}]
    with open(tmp_path / "gen.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    # "\n\n" never ends these texts (the model draws printable ASCII only), so each runs to
    # max_gen_toks: the SDK reference needs no stop of its own.
    (tmp_path / "gen.yaml").write_text(
        "task: jcp_gen\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {tmp_path / 'gen.jsonl'}\n"
        "test_split: test\noutput_type: generate_until\ndoc_to_text: '{{q}}'\n"
        "doc_to_target: '{{a}}'\n"
        'generation_kwargs:\n  until: ["\\n\\n"]\n  max_gen_toks: 12\n'
        "metric_list:\n  - metric: exact_match\n"
    )
    out = evaluator.simple_evaluate(
        model="local-chat-completions",
        tasks=["jcp_gen"],
        task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False),
        model_args=dict(
            model=MODEL,
            base_url=f"{env['srv'].url}/v1/chat/completions",
            num_concurrent=1,
            max_retries=1,
            header={"Authorization": "Bearer tml-alice"},
        ),
        apply_chat_template=True,
        log_samples=True,
        limit=None,
    )
    samples = out["samples"]["jcp_gen"]
    assert len(samples) == len(rows)
    sampler = _sampler(env)
    got = {}
    for s in samples:
        ids = text.chat_tokens([{"role": "user", "content": s["doc"]["q"]}])
        ref = (
            sampler.sample(
                types.ModelInput.from_ints(ids), 1, types.SamplingParams(max_tokens=12, **GREEDY)
            )
            .result()
            .sequences[0]
        )
        want = text.decode(ref.tokens)
        assert len(ref.tokens) == 12 and want.strip()
        got[s["doc"]["q"]] = want
        assert s["resps"][0][0] == want, (s["doc"], s["resps"], want)
    assert len(set(got.values())) == len(rows)  # two prompts, two different answers
