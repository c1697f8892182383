"""Text in jcp-serve's loop: the served model's Hugging Face tokenizer and chat template,
incremental detokenization, and string stop sequences (host only).

Owns everything that turns tokens into text and back for the OpenAI-compatible routes
(jcp/server/openai_api.py) and for the Tinker `SamplingParams.stop` strings:

- `Text.load(folder)`: `tokenizer.json` through the `tokenizers` library, and the chat
  template of `tokenizer_config.json` (or `chat_template.jinja`) rendered with jinja2 as
  transformers' `apply_chat_template` renders it (a sandboxed environment with trim_blocks,
  lstrip_blocks, loopcontrols, its `tojson`, `raise_exception`, `strftime_now`; the
  special tokens of tokenizer_config.json as variables; `add_generation_prompt`). The
  rendered text is tokenized without adding special tokens, as transformers does.
- `Detokenizer`: a completion's text token by token. A token that ends inside a multi-byte
  character yields nothing until the character is complete (vLLM's offsets: each step
  decodes a short window, never the whole sequence), so the streamed pieces concatenate
  to the text of the whole sequence.
- `SeqText` / `StopWatch`: string stop sequences. The text ends exactly where the first
  stop string starts — also when the stop string spans tokens —, and the sequence ends at
  the token that completes it (that token is kept, as vLLM keeps it in `token_ids`).
  While a stop string could still be completing, the last (longest stop − 1) characters
  are held back from a stream. `StopWatch` is the sampling engine's per-request hook
  (jcp.sample.engine.Engine.submit(watch=…)): called with each sequence's tokens after
  every decode call, it says where a sequence ends, so its rows are freed at that step.

It must never import jax or touch the worker's state; every call here is pure host work.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import logging
import os
import threading
from collections.abc import Callable, Sequence

import numpy as np

log = logging.getLogger("jcp.serve")
# What a decoder writes for bytes that are not (yet) a whole UTF-8 character.
REPLACEMENT = "\ufffd"


class TextError(ValueError):
    """A request the text layer refuses (a template error, a bad message): the client's."""


@dataclasses.dataclass(frozen=True)
class Text:
    """The tokenizer and chat template of one served model.

    tok: a `tokenizers.Tokenizer`; template: the compiled jinja template or None (then
    chat is refused); specials: the special-token variables the template sees (bos_token,
    eos_token, …, as transformers' `special_tokens_map`)."""

    tok: object
    template: object | None
    specials: dict
    folder: str

    @classmethod
    def load(cls, folder: str | None) -> Text | None:
        """The folder's tokenizer (None when it has no tokenizer.json)."""
        if not folder or not os.path.isfile(os.path.join(folder, "tokenizer.json")):
            return None
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
        config = {}
        path = os.path.join(folder, "tokenizer_config.json")
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                config = json.load(f)
        source = _template_source(folder, config)
        specials = {}
        for key, value in config.items():
            if key.endswith("_token") and key != "chat_template":
                content = value.get("content") if isinstance(value, dict) else value
                if isinstance(content, str):
                    specials[key] = content
        return cls(tok, None if source is None else compile_template(source), specials, folder)

    # ---------------------------------------------------------------- tokens <-> text

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of a prompt string (special-token strings become their ids)."""
        return self.tok.encode(text, add_special_tokens=True).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_str(self, token: int) -> str:
        """One token's own text (log-prob listings; a partial character reads as U+FFFD)."""
        return self.tok.decode([int(token)], skip_special_tokens=False)

    # ---------------------------------------------------------------- chat

    def render_chat(
        self, messages: list[dict], add_generation_prompt: bool = True, **kwargs
    ) -> str:
        """The chat template applied to `messages`, as transformers' apply_chat_template(
        tokenize=False) renders it: the special tokens, then `kwargs`, as variables."""
        if self.template is None:
            raise TextError(
                "this model's tokenizer has no chat template "
                "(tokenizer_config.json chat_template); use /v1/completions"
            )
        import jinja2

        chat = [{k: v for k, v in m.items() if v is not None} for m in messages]
        try:
            return self.template.render(
                messages=chat,
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **{**self.specials, **kwargs},
            )
        except jinja2.TemplateError as e:
            raise TextError(f"messages: the chat template refused them ({e})") from None
        except Exception as e:  # noqa: BLE001 — a template fed odd values: the client's
            raise TextError(
                f"the chat template failed on these messages ({type(e).__name__}: {e})"
            ) from None

    def chat_tokens(
        self, messages: list[dict], add_generation_prompt: bool = True, **kwargs
    ) -> list[int]:
        """render_chat, tokenized without adding special tokens (as transformers does)."""
        text = self.render_chat(messages, add_generation_prompt, **kwargs)
        return self.tok.encode(text, add_special_tokens=False).ids


def _template_source(folder: str, config: dict) -> str | None:
    """The default chat template: chat_template.jinja, else tokenizer_config.json's
    chat_template (a string, or a list of {name, template} whose "default" is taken)."""
    path = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    t = config.get("chat_template")
    if isinstance(t, list):
        t = next(
            (x.get("template") for x in t if isinstance(x, dict) and x.get("name") == "default"),
            None,
        )
    return t if isinstance(t, str) else None


def compile_template(source: str):
    """A chat template compiled as transformers compiles it (its sandbox, filters and
    globals; `{% generation %}` blocks render their body)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        # transformers' AssistantTracker, without the tracking: the block renders as is.
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(
                lineno
            )

        def _render(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(fmt):
        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


# ---------------------------------------------------------------------- detokenization


class Detokenizer:
    """A sequence's text, token by token (`push` -> the new text, "" while a character is
    incomplete; `flush` -> what is left at the end, incomplete bytes as U+FFFD). The pieces
    concatenate to `text.decode(all tokens)` for byte-level BPE (Qwen's tokenizers).

    vLLM's incremental offsets: `prefix` starts the window the new text is measured in,
    `read` is where the text emitted so far ends; each push decodes ids[prefix:] and
    ids[prefix:read] only."""

    def __init__(self, text: Text):
        self.text = text
        self.ids: list[int] = []
        self.prefix = self.read = 0

    def push(self, token: int) -> str:
        self.ids.append(int(token))
        return self._step(final=False)

    def flush(self) -> str:
        return self._step(final=True)

    def _step(self, final: bool) -> str:
        if self.read == len(self.ids):
            return ""
        before = self.text.decode(self.ids[self.prefix : self.read])
        now = self.text.decode(self.ids[self.prefix :])
        if len(now) > len(before) and (final or not now.endswith(REPLACEMENT)):
            self.prefix, self.read = self.read, len(self.ids)
            return now[len(before) :]
        if final:
            self.prefix = self.read = len(self.ids)
        return ""


class SeqText:
    """One sequence's text under string stop sequences.

    push(token) -> whether the sequence has ended at this token (a stop string completed:
    `text` then ends exactly where it starts). `text` is the text so far (cut at a stop);
    `ready` how much of it a stream may send now (all but the last len(longest stop) − 1
    characters until the sequence ends); `tokens` the tokens pushed (the one that completed
    a stop string is the last)."""

    def __init__(self, text: Text, stops: Sequence[str] = ()):
        self.detok = Detokenizer(text)
        self.stops = tuple(stops)
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""
        self.tokens: list[int] = []
        self.stopped = False
        self.ended = False

    def push(self, token: int) -> bool:
        if self.ended:
            return True
        self.tokens.append(int(token))
        return self._add(self.detok.push(token))

    def finish(self) -> None:
        """The sequence ended (max_tokens, a stop token): flush the detokenizer."""
        if not self.ended:
            self._add(self.detok.flush())
            self.ended = True

    def _add(self, piece: str) -> bool:
        if not piece:
            return False
        start = max(0, len(self.text) - self.hold)
        self.text += piece
        if self.stops:
            found = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
            if found:
                self.text = self.text[: min(found)]
                self.stopped = self.ended = True
                return True
        return False

    @property
    def ready(self) -> int:
        return len(self.text) if self.ended else max(0, len(self.text) - self.hold)


def complete_text(
    text: Text, tokens: Sequence[int], stops: Sequence[str] = ()
) -> tuple[str, int | None]:
    """The text of a finished sequence's tokens -> (text cut at the first stop string,
    how many tokens to keep if a stop string ended it, else None)."""
    seq = SeqText(text, stops)
    for i, t in enumerate(tokens):
        if seq.push(t):
            return seq.text, i + 1
    seq.finish()
    return seq.text, None


class StopWatch:
    """The sampling engine's hook for one request (Engine.submit(watch=…)).

    Called by the worker after each decode call as watch(j, tokens, logprobs, topk) for
    every running sequence j of the request (its tokens and log-probs so far, the engine's
    own lists: read, never kept; topk: the per-call [n, k] top-k parts) -> how many
    tokens the sequence keeps when a stop string ended it (the engine then ends it, stop
    reason "stop"), else None. `on_tokens(j, tokens, logprobs, topk_rows)`, if given, is
    called with the tokens each call adds (cut at a stop), in order: a stream's feed. It is
    called on the worker thread; it must not block."""

    def __init__(
        self, text: Text | None, stops: Sequence[str] = (), on_tokens: Callable | None = None
    ):
        self.text, self.stops, self.on_tokens = text, tuple(stops), on_tokens
        self._seqs: dict[int, SeqText] = {}
        self._sent: dict[int, int] = {}
        self._lock = threading.Lock()

    def __call__(self, j: int, tokens: list, logprobs: list, topk=()) -> int | None:
        try:
            return self._watch(j, tokens, logprobs, topk)
        except Exception:  # noqa: BLE001 — a hook must never fail the engine's step
            log.exception("a sample's text watch failed; its sequence runs on unwatched")
            return None

    def __reduce__(self):
        # A multi-process job (jcp/server/replica.py) replays submit on every process: the
        # followers get the stop strings (and load the same tokenizer folder), never the
        # stream's feed, so every process ends each sequence at the same token.
        return (follower_watch, (self.text.folder if self.stops else None, self.stops))

    def _watch(self, j: int, tokens: list, logprobs: list, topk) -> int | None:
        with self._lock:
            sent = self._sent.get(j, 0)
            keep = None
            if self.stops:
                seq = self._seqs.get(j)
                if seq is None:
                    seq = self._seqs[j] = SeqText(self.text, self.stops)
                for i in range(len(seq.tokens), len(tokens)):
                    if seq.push(tokens[i]):
                        keep = i + 1
                        break
            end = len(tokens) if keep is None else keep
            if self.on_tokens is not None and end > sent:
                rows = None
                if topk:
                    ids = np.concatenate([p[0] for p in topk])[sent:end]
                    lps = np.concatenate([p[1] for p in topk])[sent:end]
                    rows = (ids, lps)
                self.on_tokens(j, list(tokens[sent:end]), list(logprobs[sent:end]), rows)
            self._sent[j] = end
            return keep

    def cut(self, tokens: Sequence[int]) -> int | None:
        """How many of a finished sequence's tokens a stop string keeps (None: all)."""
        if not self.stops:
            return None
        return complete_text(self.text, tokens, self.stops)[1]


@functools.lru_cache(maxsize=4)
def _load_cached(folder: str) -> Text | None:
    return Text.load(folder)


def follower_watch(folder: str | None, stops: tuple[str, ...]) -> StopWatch:
    """A StopWatch rebuilt on a follower process (StopWatch.__reduce__)."""
    return StopWatch(_load_cached(folder) if folder else None, stops)
