"""A vLLM/SGLang-like inference server for benchmarks: one token per frame, paced per stream, at almost no CPU.

Run it in a process of its own (``benchmarks/relay.py`` does)::

    .venv/bin/python benchmarks/paced_upstream.py --port 9000 --model tiny-agent
    .venv/bin/python benchmarks/paced_upstream.py --port 0 --tokens-per-second 50 --first-token-ms 20

It prints ``ready PORT`` on stdout once it listens. In-process use: ``await start(host, port, PacedUpstream(...))``.

A real vLLM server streams one token per frame per engine step (``--stream-interval 1``, the default) at tens of tokens
per second per stream, to hundreds of streams at once; a front in front of it pays per frame. This server does the
same without a model, so that what sits in front of it is what gets measured. Every stream is the same token stream:
a passage tokenized once at start-up with the model's own tokenizer (``--model``: a directory with ``tokenizer.json``
and ``config.json``, or a built-in name such as ``tiny-agent``), cycled to the length asked for, so every id is valid
for that model and the text of the chat endpoint is exactly the ids' decoding.

Endpoints (HTTP/1.1, keep-alive, streamed responses in chunked transfer encoding, one frame per chunk):

* ``POST /v1/completions``: vLLM's token-in protocol as the ``vllm-http`` engine speaks it
  (``stream_gateway/engines/remote.py``): ``prompt`` as ids (or text), ``max_tokens`` (16 when absent, as vLLM),
  ``logprobs: k`` (per token ``token_logprobs``, ``tokens``, ``text_offset`` and ``top_logprobs``: the sampled token
  first and most likely, then ``k - 1`` alternatives; with ``k = 0`` the sampled token alone, as vLLM writes it),
  ``return_token_ids`` (``token_ids`` per chunk, ``prompt_token_ids`` on the first), ``return_tokens_as_token_ids``
  (``"token_id:N"`` for tokens and alternatives), ``stream_options.include_usage``, ``stream_interval`` (vLLM
  0.32's: that many tokens a frame, the first alone, the last what is left). Chunks are vLLM 0.33's
  (``stop_reason``, ``kv_transfer_params`` null); the last token's chunk has ``finish_reason``.
* ``POST /generate``: SGLang's native protocol as the ``sglang-http`` engine speaks it: ``input_ids``,
  ``sampling_params.max_new_tokens`` (128 when absent), ``return_logprob``, ``top_logprobs_num``, ``rid``. Frames hold
  ``text``, ``output_ids`` and ``meta_info`` (``output_token_logprobs`` as ``[logprob, id, null]``,
  ``output_top_logprobs``, ``finish_reason`` as ``{"type": "length", "length": n}`` or
  ``{"type": "stop", "matched": id}``, ``prompt_tokens``, ``completion_tokens``); everything so far by default, as
  SGLang does, or only the new part with ``--incremental-streaming-output``. Then ``data: [DONE]``.
* ``POST /v1/chat/completions``: the same token stream as OpenAI chat chunks (vLLM's: the role chunk goes with the
  first token's, ``finish_reason`` on the last token's chunk, a usage chunk with ``stream_options.include_usage``),
  so a chat proxy (LiteLLM) relays exactly the tokens the ``vllm-http`` front receives as ids. No logprobs here.
* ``GET /health`` (200, empty), ``GET /v1/models`` (with ``max_model_len``), ``GET /get_model_info`` (SGLang's): the
  remote engines health-check these and learn the served model from them.

Every turn produces exactly ``max_tokens`` tokens (finish ``length``), unless ``--stop-after N`` is given: a request
without ``ignore_eos`` then ends after ``N`` tokens, the last being the model's EOS id (finish ``stop``). Only
streamed requests are served (``stream: true``; others get a 400), with one choice (``n`` = 1).

Deliberate choices:

* **Paced per stream, exactly.** A turn's first token is written ``--first-token-ms`` after its request arrived
  (the prefill), token ``i`` at ``first + i / rate``: no drift, and a late tick (a busy loop, a paused transport)
  is caught up at once rather than skipped. Each tick is a ``loop.call_at`` callback on the connection (no task, no
  future per token), so the timer and one ``transport.write`` are all a token costs. Streams keep the phase their
  request arrived with; a vLLM engine steps all its streams together instead, which a client sees only as burstier
  arrivals at a front. ``--tokens-per-second 0`` writes the tokens as fast as the loop allows.
* **Pre-serialised frames.** The JSON of a token's frame is built once per position (completions: ``text_offset``
  depends on the position, up to ``--max-model-len``) or per token of the passage (chat) and per request option
  (model, ``logprobs``, ids or text), cached; a frame is the request's constant head (its id) and that body. Only the
  first and last frames and the usage chunk are formatted per request, and SGLang's cumulative frames (every frame
  repeats all before it: it costs what it costs SGLang, a copy that grows with the turn).
* **No framework.** A raw ``asyncio.Protocol`` (on uvloop from the CLI); request heads are parsed by
  ``fake_upstream.py``'s parser (``Content-Length`` bodies only), bodies with orjson.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, cast

import orjson

sys.path.insert(0, str(Path(__file__).parent))
import fake_upstream
from fake_upstream import _MAX_HEAD, _REASONS, _STREAM_HEAD, _chunk, _HttpError

# The token stream: tokenized once with the model's tokenizer, cycled. ASCII only, so every token is whole
# characters and the chat text is the concatenation of the tokens' texts. It starts with a space and ends with a
# full stop, so the cycle reads on across its seam, and it never repeats one chunk (LiteLLM ends a stream whose
# chunks repeat one content 100 times in a row).
PASSAGE = (
    " The keeper of the lighthouse climbed the stairs at dusk, as he had done every evening for thirty years."
    " He trimmed the wick, wound the clockwork that turned the lens, and wrote the weather in his log: wind"
    " from the west, a falling glass, three ships seen before noon and one after. When the beam swept the water"
    " he watched the grey sea break on the rocks below, counted the seconds between the flashes, and listened"
    " for the bell on the reef. Near midnight a small boat rounded the point with its lantern swinging, and he"
    " raised his own lamp twice to show it the channel. By morning the storm had passed, the gulls were back"
    " on the rail, and the kettle sang on the stove while he slept."
)
DEFAULT_MAX_MODEL_LEN = 32768
_DONE = _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"  # [DONE] and the terminating zero-length chunk
_TAIL_DELAY_S = 0.001  # between a stream's finishing frame and its tail
_TOP_FIRST = -0.05  # logprob of the sampled token (always the most likely); alternative r has -(r + 1)


@dataclass(frozen=True, slots=True)
class TokenCycle:
    """The token stream every turn repeats: ids, the text of each, and the ids a model may also have sampled."""

    ids: tuple[int, ...]
    texts: tuple[str, ...]  # texts[i] is the decoding of ids[i] (ASCII, so token by token)
    eos_id: int
    text_of: dict[int, str]  # every id of the passage, and EOS
    others: tuple[int, ...]  # the passage's distinct ids: the alternatives are drawn from them
    rank: dict[int, int]  # where each id is in ``others``

    @classmethod
    def from_model(cls, model_dir: str | Path, passage: str = PASSAGE) -> TokenCycle:
        """Tokenize ``passage`` with ``model_dir``'s ``tokenizer.json``; vocabulary and EOS from its ``config.json``."""
        from tokenizers import Tokenizer

        directory = Path(model_dir)
        tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
        config = orjson.loads((directory / "config.json").read_bytes())
        eos = config.get("eos_token_id")
        eos_id = int(eos[0] if isinstance(eos, list) else eos)
        vocab_size = int(config.get("vocab_size") or tokenizer.get_vocab_size(with_added_tokens=True))
        ids = tuple(tokenizer.encode(passage, add_special_tokens=False).ids)
        texts = tuple(tokenizer.decode([i], skip_special_tokens=False) for i in ids)
        if "".join(texts) != tokenizer.decode(list(ids), skip_special_tokens=False) or not passage.isascii():
            raise ValueError("the passage does not decode token by token")
        if any(i >= vocab_size or i in tokenizer.get_added_tokens_decoder() for i in ids):
            raise ValueError("the passage encodes to added or out-of-vocabulary ids")
        text_of = dict(zip(ids, texts, strict=True))
        text_of[eos_id] = tokenizer.decode([eos_id], skip_special_tokens=False)
        others = tuple(sorted(set(ids)))
        return cls(ids, texts, eos_id, text_of, others, {t: i for i, t in enumerate(others)})

    def alternatives(self, token: int, k: int) -> list[tuple[int, float]]:
        """The ``k`` most likely tokens at a step that sampled ``token``: itself first, then ``k - 1`` others."""
        others, n = self.others, len(self.others)
        at = self.rank.get(token, -1)  # EOS is not among them
        return [(token, _TOP_FIRST)] + [(others[(at + r) % n], -(r + 1.0)) for r in range(1, min(k, n))]


class _Turn(Protocol):
    """One streamed answer: the frames of its tokens and what follows the last one, each one or more HTTP chunks."""

    stride: int  # tokens a frame (vLLM's stream_interval): the first frame holds one, the last what is left

    def frame(self, i: int) -> bytes: ...

    def frames(self, i: int, n: int) -> bytes: ...

    def tail(self) -> bytes: ...


@dataclass(frozen=True, slots=True)
class _Ask:
    """What a request asks for, whatever its protocol."""

    model: str
    tokens: int
    finish: str  # "length" or "stop" (the last token is then EOS)
    prompt: list[int] | None  # ids, when the prompt was given as ids
    prompt_tokens: int
    include_usage: bool
    rid: str


class PacedUpstream:
    """What every connection shares: the token stream, the pacing and the caches of serialised frames."""

    def __init__(
        self,
        cycle: TokenCycle,
        *,
        tokens_per_second: float = 50.0,
        first_token_s: float = 0.02,
        served_model_name: str = "tiny-agent",
        max_model_len: int = DEFAULT_MAX_MODEL_LEN,
        stop_after: int = 0,
        incremental: bool = False,
        prefill_tokens_per_second: float = 0.0,
    ) -> None:
        if tokens_per_second < 0 or first_token_s < 0 or stop_after < 0 or prefill_tokens_per_second < 0:
            raise ValueError("rates, delays and --stop-after must be >= 0")
        # Prefill time that grows with the prompt (agent-sized contexts): first_token_s + prompt / rate.
        self.prefill_interval = 1.0 / prefill_tokens_per_second if prefill_tokens_per_second else 0.0
        self.cycle = cycle
        self.interval = 1.0 / tokens_per_second if tokens_per_second else 0.0
        self.first_token_s = first_token_s
        self.model = served_model_name
        self.max_model_len = max_model_len
        self.stop_after = stop_after
        self.incremental = incremental
        self.created = int(time.time())
        self.connections = 0  # connections accepted so far
        self._ids = itertools.count()
        self._offsets: dict[bool, list[int]] = {}
        self._completion_bodies: dict[tuple[str, int | None, bool, bool], list[bytes]] = {}
        self._chat_bodies: dict[str, tuple[bytes, ...]] = {}
        card = {"id": self.model, "object": "model", "created": self.created, "owned_by": "vllm", "root": self.model,
                "parent": None, "max_model_len": max_model_len, "permission": []}  # fmt: skip
        self.models_body = orjson.dumps({"object": "list", "data": [card]})
        self.model_info_body = orjson.dumps({"model_path": self.model, "tokenizer_path": self.model,
                                             "is_generation": True, "weight_version": "default"})  # fmt: skip

    def token(self, i: int, ask: _Ask) -> int:
        """The id of output token ``i``."""
        if ask.finish == "stop" and i == ask.tokens - 1:
            return self.cycle.eos_id
        return self.cycle.ids[i % len(self.cycle.ids)]

    def ask(self, data: dict[str, Any], *, prompt_key: str, limit: int | None, default_limit: int) -> _Ask:
        """The protocol-neutral part of a request body; ``ValueError`` for what this server does not serve."""
        if data.get("stream") is not True:
            raise ValueError("only streamed requests are served (stream: true)")
        if data.get("n", 1) != 1:
            raise ValueError("only n = 1 is served")
        model = data.get("model") or self.model
        tokens = default_limit if limit is None else limit
        if not isinstance(model, str) or isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
            raise ValueError("model must be a string and the token limit a positive integer")
        prompt = data.get(prompt_key)
        ids = prompt if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt) else None
        prompt_tokens = len(ids) if ids is not None else max(1, len(orjson.dumps(prompt)) // 4)
        if prompt_tokens + tokens > self.max_model_len:
            raise ValueError(f"prompt + max tokens exceed max_model_len {self.max_model_len}")
        finish = "length"
        if self.stop_after and self.stop_after < tokens and not data.get("ignore_eos", False):
            tokens, finish = self.stop_after, "stop"
        options = data.get("stream_options")
        include_usage = isinstance(options, dict) and options.get("include_usage") is True
        rid = str(data.get("request_id") or data.get("rid") or next(self._ids))
        return _Ask(model, tokens, finish, ids, prompt_tokens, include_usage, rid)

    def text_offset(self, i: int, as_ids: bool) -> int:
        """vLLM's ``text_offset`` of output token ``i``: the length of the token strings before it."""
        sums = self._offsets.get(as_ids)
        if sums is None:
            cycle = self.cycle
            lengths = (len(f"token_id:{t}") if as_ids else len(x) for t, x in zip(cycle.ids, cycle.texts, strict=True))
            sums = self._offsets[as_ids] = [0, *itertools.accumulate(lengths)]
        laps, rest = divmod(i, len(self.cycle.ids))
        return laps * sums[-1] + sums[rest]

    def completion_bodies(self, model: str, k: int | None, token_ids: bool, as_ids: bool) -> list[bytes]:
        """The cached bodies (``,"choices":[...]}``) of the completion frames at each position, grown on demand."""
        key = (model, k, token_ids, as_ids)
        bodies = self._completion_bodies.get(key)
        if bodies is None:
            if len(self._completion_bodies) >= 64:  # a benchmark sends a few shapes; bound the cache anyway
                self._completion_bodies.clear()
            bodies = self._completion_bodies[key] = []
        return bodies

    def chat_bodies(self, model: str) -> tuple[bytes, ...]:
        """The bodies of the chat frames of each token of the passage."""
        bodies = self._chat_bodies.get(model)
        if bodies is None:
            bodies = self._chat_bodies[model] = tuple(_chat_body(text, None) for text in self.cycle.texts)
        return bodies


def _head(kind: str, rid: str, created: int, model: str) -> bytes:
    """The constant start of every frame of one response."""
    return b'data: {"id":%b,"object":"%b","created":%d,"model":%b' % (
        orjson.dumps(rid), kind.encode(), created, orjson.dumps(model))  # fmt: skip


def _usage(head: bytes, ask: _Ask) -> bytes:
    usage = {"prompt_tokens": ask.prompt_tokens, "completion_tokens": ask.tokens,
             "total_tokens": ask.prompt_tokens + ask.tokens}  # fmt: skip
    return _chunk(head + b',"choices":[],"usage":' + orjson.dumps(usage) + b"}\n\n")


def _chat_body(text: str, finish: str | None) -> bytes:
    choice = {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": finish}
    return b',"choices":[' + orjson.dumps(choice) + b"]}\n\n"


class _CompletionTurn:
    """vLLM's ``/v1/completions`` stream of one request."""

    def __init__(self, upstream: PacedUpstream, ask: _Ask, data: dict[str, Any]) -> None:
        logprobs = data.get("logprobs")
        if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int) or logprobs < 0):
            raise ValueError("logprobs must be a non-negative integer")
        self._upstream, self._ask = upstream, ask
        self._k: int | None = logprobs
        self._token_ids = data.get("return_token_ids") is True
        self._as_ids = data.get("return_tokens_as_token_ids") is True
        self._head = _head("text_completion", f"cmpl-{ask.rid}", upstream.created, ask.model)
        self._bodies = upstream.completion_bodies(ask.model, self._k, self._token_ids, self._as_ids)
        stride = data.get("stream_interval", 1)
        if isinstance(stride, bool) or not isinstance(stride, int) or stride < 1:
            raise ValueError("stream_interval must be a positive integer")
        self.stride = stride

    def _body(self, i: int, tokens: list[int], finish: str | None, prompt: list[int] | None) -> bytes:
        """The body of the frame of ``tokens``, the first of them output token ``i``."""
        cycle, upstream = self._upstream.cycle, self._upstream
        texts = [cycle.text_of[token] for token in tokens]
        as_ids = self._as_ids
        logprobs = None
        if self._k is not None:
            k = max(self._k, 1)
            logprobs = {"text_offset": [upstream.text_offset(i + j, as_ids) for j in range(len(tokens))],
                        "token_logprobs": [_TOP_FIRST] * len(tokens),
                        "tokens": [f"token_id:{t}" for t in tokens] if as_ids else texts,
                        "top_logprobs": [{(f"token_id:{t}" if as_ids else cycle.text_of[t]): lp
                                          for t, lp in cycle.alternatives(token, k)} for token in tokens]}  # fmt: skip
        choice = {"index": 0, "text": "".join(texts), "logprobs": logprobs, "finish_reason": finish,
                  "stop_reason": None, "prompt_token_ids": prompt if self._token_ids else None,
                  "token_ids": tokens if self._token_ids else None}  # fmt: skip
        return b',"choices":[' + orjson.dumps(choice) + b'],"kv_transfer_params":null}\n\n'

    def frames(self, i: int, n: int) -> bytes:
        """One frame of output tokens ``i`` to ``i + n - 1`` (never the first: that one goes alone)."""
        ask, upstream = self._ask, self._upstream
        last = i + n == ask.tokens
        body = self._body(i, [upstream.token(j, ask) for j in range(i, i + n)], ask.finish if last else None, None)
        return b"%x\r\n%b%b\r\n" % (len(self._head) + len(body), self._head, body)

    def frame(self, i: int) -> bytes:
        ask = self._ask
        last = i == ask.tokens - 1
        if i == 0 or last:  # the prompt's ids, the finish reason: per request
            token = self._upstream.token(i, ask)
            body = self._body(i, [token], ask.finish if last else None, ask.prompt if i == 0 else None)
        else:
            bodies = self._bodies
            while len(bodies) <= i:
                j = len(bodies)
                bodies.append(self._body(j, [self._upstream.token(j, ask)], None, None))
            body = bodies[i]
        return b"%x\r\n%b%b\r\n" % (len(self._head) + len(body), self._head, body)

    def tail(self) -> bytes:
        return (_usage(self._head, self._ask) if self._ask.include_usage else b"") + _DONE


class _OneTokenFrames:
    """A turn that writes every token in a frame of its own."""

    stride = 1

    def frames(self, i: int, n: int) -> bytes:
        raise NotImplementedError("one token a frame")


class _ChatTurn(_OneTokenFrames):
    """The same token stream as OpenAI chat chunks."""

    def __init__(self, upstream: PacedUpstream, ask: _Ask) -> None:
        self._upstream, self._ask = upstream, ask
        self._head = _head("chat.completion.chunk", f"chatcmpl-{ask.rid}", upstream.created, ask.model)
        self._bodies = upstream.chat_bodies(ask.model)

    def frame(self, i: int) -> bytes:
        ask = self._ask
        if i == ask.tokens - 1:
            token = self._upstream.token(i, ask)
            text = "" if token == self._upstream.cycle.eos_id else self._upstream.cycle.texts[i % len(self._bodies)]
            body = _chat_body(text, ask.finish)
        else:
            body = self._bodies[i % len(self._bodies)]
        frame = b"%x\r\n%b%b\r\n" % (len(self._head) + len(body), self._head, body)
        if i == 0:  # vLLM sends the role chunk when the first output arrives, just before the first token's
            role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            frame = _chunk(self._head + b',"choices":[' + orjson.dumps(role) + b"]}\n\n") + frame
        return frame

    def tail(self) -> bytes:
        return (_usage(self._head, self._ask) if self._ask.include_usage else b"") + _DONE


class _GenerateTurn(_OneTokenFrames):
    """SGLang's ``/generate`` stream: cumulative frames (its default) or only the new part."""

    def __init__(self, upstream: PacedUpstream, ask: _Ask, data: dict[str, Any]) -> None:
        self._upstream, self._ask = upstream, ask
        self._logprobs = data.get("return_logprob") is True
        self._k = int(data.get("top_logprobs_num") or 0) if self._logprobs else 0
        self._rid = orjson.dumps(ask.rid)
        self._text = bytearray()  # JSON-escaped text so far, without quotes
        self._ids = bytearray()
        self._entries = bytearray()
        self._tops = bytearray()

    def frame(self, i: int) -> bytes:
        upstream, ask, cycle = self._upstream, self._ask, self._upstream.cycle
        token = upstream.token(i, ask)
        text = b"" if token == cycle.eos_id else orjson.dumps(cycle.texts[i % len(cycle.ids)])[1:-1]
        sep = b"," if i and not upstream.incremental else b""
        if upstream.incremental:
            self._text, self._ids, self._entries, self._tops = bytearray(), bytearray(), bytearray(), bytearray()
        self._text += text
        self._ids += sep + b"%d" % token
        if self._logprobs:
            self._entries += sep + b"[%r,%d,null]" % (_TOP_FIRST, token)
            if self._k:
                top = upstream.cycle.alternatives(token, self._k)
                self._tops += sep + b"[" + b",".join(b"[%r,%d,null]" % (lp, t) for t, lp in top) + b"]"
        last = i == ask.tokens - 1
        finish = b"null"
        if last:
            finish = b'{"type":"length","length":%d}' % ask.tokens
            if ask.finish == "stop":
                finish = b'{"type":"stop","matched":%d}' % token
        body = (
            b'data: {"text":"%b","output_ids":[%b],"meta_info":{"id":%b,"finish_reason":%b,"prompt_tokens":%d,'
            b'"completion_tokens":%d,"cached_tokens":0,"weight_version":"default","output_token_logprobs":[%b],'
            b'"output_top_logprobs":[%b]}}\n\n'
        ) % (bytes(self._text), bytes(self._ids), self._rid, finish, ask.prompt_tokens, i + 1, bytes(self._entries),
             bytes(self._tops))  # fmt: skip
        return _chunk(body)

    def tail(self) -> bytes:
        return _DONE


_parse_head = fake_upstream._Connection._parse_head  # method, path, keep-alive, Content-Length; raises _HttpError


def _response(status: int, body: bytes, *, close: bool, json: bool = True) -> bytes:
    kind = "application/json" if json else "text/plain"
    head = (f"HTTP/1.1 {status} {_REASONS[status]}\r\ncontent-type: {kind}\r\ncontent-length: {len(body)}\r\n"
            f"{'connection: close' if close else 'connection: keep-alive'}\r\n\r\n")  # fmt: skip
    return head.encode("latin-1") + body


class _Connection(asyncio.Protocol):
    """One client connection: requests answered in order, a streamed one token by token from timer callbacks."""

    def __init__(self, upstream: PacedUpstream) -> None:
        self._upstream = upstream
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._turn: _Turn | None = None
        self._keep_alive = True
        self._sent = 0  # tokens of the current turn written
        self._tokens = 0  # tokens of the current turn
        self._first_at = 0.0  # loop time the first token is due
        self._timer: asyncio.Handle | None = None  # a TimerHandle, or a Handle when unpaced
        self._paused = False
        self._closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._upstream.connections += 1
        self._transport = cast(asyncio.Transport, transport)  # uvloop's transports are not asyncio.Transport subclasses

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        if self._turn is None:
            self._process()

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        if self._turn is not None and self._timer is None:
            self._tick()  # the tick that found the transport paused

    def _process(self) -> None:
        """Answer the complete requests in the buffer, up to the first streamed one."""
        while not self._closed and self._turn is None:
            head_end = self._buffer.find(b"\r\n\r\n")
            if head_end < 0:
                if len(self._buffer) > _MAX_HEAD:
                    self._error(431, "request head too large", close=True)
                return
            try:
                method, path, keep_alive, length = _parse_head(bytes(self._buffer[:head_end]))
            except _HttpError as exc:
                self._error(exc.status, exc.message, close=True)
                return
            start = head_end + 4
            if len(self._buffer) < start + length:
                return
            body = bytes(self._buffer[start : start + length])
            del self._buffer[: start + length]
            self._keep_alive = keep_alive
            self._route(method, path, body)

    def _route(self, method: str, path: str, body: bytes) -> None:
        upstream, close = self._upstream, not self._keep_alive
        if method == "GET" and path in ("/health", "/v1/models", "/get_model_info"):
            answer = {"/health": b"", "/v1/models": upstream.models_body, "/get_model_info": upstream.model_info_body}
            self._write(_response(200, answer[path], close=close, json=path != "/health"), close=close)
            return
        if path not in ("/v1/completions", "/v1/chat/completions", "/generate"):
            self._error(404, f"no route for {method} {path}", close=close)
            return
        if method != "POST":
            self._error(405, "use POST", close=close)
            return
        try:
            data = orjson.loads(body)
            if not isinstance(data, dict):
                raise ValueError("the body is not a JSON object")
            turn, ask = self._turn_of(path, data)
        except ValueError as exc:  # orjson.JSONDecodeError is a ValueError
            self._error(400, str(exc), close=close)
            return
        self._start(turn, ask.tokens, upstream.first_token_s + ask.prompt_tokens * upstream.prefill_interval)

    def _turn_of(self, path: str, data: dict[str, Any]) -> tuple[_Turn, _Ask]:
        upstream = self._upstream
        if path == "/generate":
            sampling = data.get("sampling_params") or {}
            if not isinstance(sampling, dict):
                raise ValueError("sampling_params must be an object")
            data = {**data, "ignore_eos": sampling.get("ignore_eos", False)}
            ask = upstream.ask(data, prompt_key="input_ids" if "input_ids" in data else "text",
                               limit=sampling.get("max_new_tokens"), default_limit=128)  # fmt: skip
            return _GenerateTurn(upstream, ask, data), ask
        if path == "/v1/completions":
            ask = upstream.ask(data, prompt_key="prompt", limit=data.get("max_tokens"), default_limit=16)
            return _CompletionTurn(upstream, ask, data), ask
        limit = data.get("max_tokens")
        limit = data.get("max_completion_tokens") if limit is None else limit
        ask = upstream.ask(data, prompt_key="messages", limit=limit, default_limit=16)
        return _ChatTurn(upstream, ask), ask

    def _start(self, turn: _Turn, tokens: int, prefill_s: float) -> None:
        self._turn, self._tokens, self._sent = turn, tokens, 0
        head = _STREAM_HEAD + (b"\r\n" if self._keep_alive else b"connection: close\r\n\r\n")
        self._write(head, close=False)
        self._first_at = self._loop.time() + prefill_s
        self._timer = self._loop.call_at(self._first_at, self._tick)

    def _tick(self) -> None:
        """Write the next token's frame (and, after the last, the tail); schedule the next tick."""
        self._timer = None
        turn, transport = self._turn, self._transport
        if self._closed or turn is None or transport is None:
            return
        if self._paused:
            return  # resume_writing ticks again
        i, stride = self._sent, turn.stride
        n = 1 if i == 0 or stride == 1 else min(stride, self._tokens - i)  # vLLM: the first frame at once
        frame = turn.frame(i) if n == 1 else turn.frames(i, n)
        self._sent = i + n
        if self._sent < self._tokens:
            transport.write(frame)
            interval = self._upstream.interval
            if interval:  # the next frame when its last token is due
                last = self._sent + min(stride, self._tokens - self._sent) - 1
                self._timer = self._loop.call_at(self._first_at + last * interval, self._tick)
            else:
                self._timer = self._loop.call_soon(self._tick)
            return
        # The tail (usage, ``[DONE]``) in a write of its own, a moment later, as vLLM sends it: a
        # client that stops reading at the finish must still keep the connection (issue 38).
        transport.write(frame)
        self._timer = self._loop.call_later(_TAIL_DELAY_S, self._end)

    def _end(self) -> None:
        self._timer = None
        turn = self._turn
        if self._closed or turn is None:
            return
        self._turn = None
        self._write(turn.tail(), close=not self._keep_alive)
        if self._buffer:
            self._process()

    def _write(self, data: bytes, *, close: bool) -> None:
        transport = self._transport
        if transport is None or self._closed:
            return
        transport.write(data)
        if close:
            self._closed = True
            transport.close()

    def _error(self, status: int, message: str, *, close: bool) -> None:
        error = {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": status}}
        self._write(_response(status, orjson.dumps(error), close=close), close=close)


async def start(host: str, port: int, upstream: PacedUpstream) -> asyncio.Server:
    """Listen on ``host:port`` (``port`` 0: any free one) and return the server, already serving."""
    loop = asyncio.get_running_loop()
    return await loop.create_server(lambda: _Connection(upstream), host, port, backlog=4096)


async def serve(host: str, port: int, upstream: PacedUpstream, *, ready: Callable[[int], object]) -> None:
    """Serve until cancelled; ``ready(port)`` is called once it listens."""
    server = await start(host, port, upstream)
    async with server:
        ready(server.sockets[0].getsockname()[1])
        await server.serve_forever()


def _model_dir(spec: str) -> Path:
    path = Path(spec).expanduser()
    if path.is_dir():
        return path
    from stream_gateway.models import resolve_model  # a built-in name: built on first use

    return Path(resolve_model(spec))


def main(argv: list[str] | None = None) -> None:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True, help="0: any free port (printed)")
    parser.add_argument("--model", default="tiny-agent", help="a model directory or a built-in name: the tokenizer")
    parser.add_argument("--served-model-name", default="tiny-agent")
    parser.add_argument("--tokens-per-second", type=float, default=50.0, help="per stream; 0: as fast as possible")
    parser.add_argument("--first-token-ms", type=float, default=20.0, help="request to first token (the prefill)")
    parser.add_argument("--prefill-tokens-per-second", type=float, default=0.0,
                        help="add prompt tokens / this to the first-token delay (0: a fixed delay)")  # fmt: skip
    parser.add_argument("--max-model-len", type=int, default=DEFAULT_MAX_MODEL_LEN)
    parser.add_argument("--stop-after", type=int, default=0, help="end turns without ignore_eos with EOS after N")
    parser.add_argument("--incremental-streaming-output", action="store_true", help="SGLang: frames hold new tokens")
    args = parser.parse_args(argv)
    upstream = PacedUpstream(
        TokenCycle.from_model(_model_dir(args.model)),
        tokens_per_second=args.tokens_per_second,
        first_token_s=args.first_token_ms / 1000,
        served_model_name=args.served_model_name,
        max_model_len=args.max_model_len,
        stop_after=args.stop_after,
        incremental=args.incremental_streaming_output,
        prefill_tokens_per_second=args.prefill_tokens_per_second,
    )
    loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None
    try:
        import uvloop

        loop_factory = uvloop.new_event_loop
    except ImportError:
        pass
    try:
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            runner.run(serve(args.host, args.port, upstream, ready=lambda port: print(f"ready {port}", flush=True)))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
