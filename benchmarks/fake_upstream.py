"""A fake OpenAI chat-completions upstream that costs almost no CPU, so a proxy in front of it is what gets measured.

Run it in a process of its own::

    .venv/bin/python benchmarks/fake_upstream.py --port 9000
    .venv/bin/python benchmarks/fake_upstream.py --port 9000 --tokens-per-second 50

It prints ``ready`` on stdout once it listens. In-process use: ``await serve(host, port, tokens_per_second)``.

What it is: a raw ``asyncio.Protocol`` HTTP/1.1 server (on uvloop when it is importable, from the CLI), no framework.
Connections are keep-alive (pipelined requests are answered in order); request bodies must carry ``Content-Length``.

* ``POST /v1/chat/completions`` with ``"stream": true``: ``text/event-stream`` in chunked transfer encoding, a role
  frame, ``max_tokens`` content frames (``delta.content`` cycling through ``WORDS``; ``max_completion_tokens`` is read
  when ``max_tokens`` is absent, 16 when both are), a finish frame (``finish_reason`` ``"length"`` when a limit was
  given, else ``"stop"``), a usage frame when ``stream_options.include_usage`` is true, and ``data: [DONE]``. Every
  frame is serialized once (per model name) and written with one ``transport.write`` (the response head goes with the
  role frame); only the usage frame is formatted per request. ``--tokens-per-second 0`` (the default) writes frames as
  fast as the loop allows, yielding to the loop after each one so that concurrent streams interleave; ``R > 0`` paces
  each stream to ``R`` content frames a second (frame ``i`` is due ``i / R`` seconds after the role frame). Writes
  wait while the transport has paused writing (flow control: ``pause_writing`` / ``resume_writing``).
* ``POST /v1/chat/completions`` without ``stream``: one ``chat.completion`` JSON body, content ``"tok" * max_tokens``.
* ``GET /v1/models``: a model list with the default model. ``GET /health``: ``{"status":"ok"}``.

The paths are also served without the ``/v1`` prefix. The body is parsed with :mod:`json`, only to read ``model``,
``stream``, ``max_tokens`` / ``max_completion_tokens`` and ``stream_options.include_usage``; ``prompt_tokens`` in the
usage is a rough ``len(body) // 4``, not a tokenization.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

DEFAULT_MODEL = "fake-model"
DEFAULT_MAX_TOKENS = 16
TOKEN = "tok"
# Content frames cycle through these words: LiteLLM (1.106) ends a stream whose chunks repeat one
# content 100 times in a row ("The model is repeating the same chunk").
WORDS = (" the", " keeper", " of", " a", " lighthouse", " watched", " grey", " sea", " as", " night", " came", " on")

_MAX_HEAD = 64 * 1024  # bytes of request line + headers before 431
_MAX_BODY = 16 * 1024 * 1024  # bytes of request body before 413
_MAX_MODELS = 256  # distinct model names with frames of their own; past that, the default model's frames are used
_COMPLETION_ID = "chatcmpl-fake-upstream"

_STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\ntransfer-encoding: chunked\r\n"
)
_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    411: "Length Required",
    413: "Content Too Large",
    431: "Request Header Fields Too Large",
    501: "Not Implemented",
}


def _dumps(obj: object) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _chunk(payload: bytes) -> bytes:
    """One chunk of a chunked transfer-encoded body."""
    return b"%x\r\n%s\r\n" % (len(payload), payload)


def _sse(obj: object) -> bytes:
    """One server-sent event ``data:`` frame, as one chunk."""
    return _chunk(b"data: " + _dumps(obj) + b"\n\n")


@dataclass(frozen=True, slots=True)
class _Frames:
    """The pre-serialized frames of a streamed response for one model name (each already one HTTP chunk)."""

    model: str
    created: int
    role: bytes
    content: tuple[bytes, ...]  # one frame per word of WORDS, sent in turn
    finish_length: bytes
    finish_stop: bytes
    done: bytes  # ``data: [DONE]`` and the terminating zero-length chunk
    usage_prefix: bytes  # the usage frame's JSON up to the ``usage`` object

    @classmethod
    def build(cls, model: str, created: int) -> _Frames:
        """Serialize every frame of a stream for ``model``."""

        def chunk(delta: dict[str, str], finish_reason: str | None) -> dict[str, Any]:
            return {
                "id": _COMPLETION_ID,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
            }

        usage_head = {"id": _COMPLETION_ID, "object": "chat.completion.chunk", "created": created, "model": model}
        return cls(
            model=model,
            created=created,
            role=_sse(chunk({"role": "assistant", "content": ""}, None)),
            content=tuple(_sse(chunk({"content": word}, None)) for word in WORDS),
            finish_length=_sse(chunk({}, "length")),
            finish_stop=_sse(chunk({}, "stop")),
            done=_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n",
            usage_prefix=b"data: " + _dumps(usage_head)[:-1] + b',"choices":[],"usage":',
        )

    def usage(self, prompt_tokens: int, completion_tokens: int) -> bytes:
        """The usage frame (``choices: []``), as one chunk."""
        usage = b'{"prompt_tokens":%d,"completion_tokens":%d,"total_tokens":%d}}\n\n' % (
            prompt_tokens,
            completion_tokens,
            prompt_tokens + completion_tokens,
        )
        return _chunk(self.usage_prefix + usage)


@dataclass(frozen=True, slots=True)
class _ChatRequest:
    """What a chat-completions request body asks of the fake: only the fields it reads."""

    model: str
    stream: bool
    max_tokens: int
    limited: bool  # a token limit was given (finish_reason "length" rather than "stop")
    include_usage: bool
    prompt_tokens: int

    @classmethod
    def parse(cls, body: bytes) -> _ChatRequest:
        """Read the body; raises ``ValueError`` when it is not a JSON object with sane fields."""
        data = json.loads(body)
        if not isinstance(data, dict):
            raise ValueError("the body is not a JSON object")
        model = data.get("model") or DEFAULT_MODEL
        limit = data.get("max_tokens")
        if limit is None:
            limit = data.get("max_completion_tokens")
        if not isinstance(model, str):
            raise ValueError("model must be a string")
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
            raise ValueError("max_tokens must be a non-negative integer")
        options = data.get("stream_options")
        include_usage = isinstance(options, dict) and options.get("include_usage") is True
        return cls(
            model=model,
            stream=data.get("stream") is True,
            max_tokens=DEFAULT_MAX_TOKENS if limit is None else limit,
            limited=limit is not None,
            include_usage=include_usage,
            prompt_tokens=max(1, len(body) // 4),
        )


class _Upstream:
    """What every connection shares: the pacing and the pre-serialized frames and bodies."""

    def __init__(self, tokens_per_second: float) -> None:
        if tokens_per_second < 0:
            raise ValueError("tokens_per_second must be >= 0")
        self.interval = 1.0 / tokens_per_second if tokens_per_second > 0 else 0.0
        self.created = int(time.time())
        self.default_frames = _Frames.build(DEFAULT_MODEL, self.created)
        self._frames: dict[str, _Frames] = {DEFAULT_MODEL: self.default_frames}
        models = {
            "object": "list",
            "data": [{"id": DEFAULT_MODEL, "object": "model", "created": self.created, "owned_by": "fake-upstream"}],
        }
        self.models_body = _dumps(models)
        self.health_body = b'{"status":"ok"}'

    def frames(self, model: str) -> _Frames:
        """The frames for ``model``, serialized on its first request."""
        frames = self._frames.get(model)
        if frames is None:
            if len(self._frames) >= _MAX_MODELS:
                return self.default_frames
            frames = self._frames[model] = _Frames.build(model, self.created)
        return frames

    def completion_body(self, request: _ChatRequest) -> bytes:
        """A non-streamed ``chat.completion`` body."""
        return _dumps(
            {
                "id": _COMPLETION_ID,
                "object": "chat.completion",
                "created": self.created,
                "model": request.model,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": TOKEN * request.max_tokens},
                        "logprobs": None,
                        "finish_reason": "length" if request.limited else "stop",
                    }
                ],
                "usage": {
                    "prompt_tokens": request.prompt_tokens,
                    "completion_tokens": request.max_tokens,
                    "total_tokens": request.prompt_tokens + request.max_tokens,
                },
            }
        )


class _Connection(asyncio.Protocol):
    """One client connection: parses requests as bytes arrive and answers them in order.

    Non-streamed answers are written from ``data_received``; a streamed one runs as a task, and the requests that
    arrive meanwhile wait in the buffer until it ends.
    """

    def __init__(self, upstream: _Upstream) -> None:
        self._upstream = upstream
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._stream: asyncio.Task[None] | None = None
        self._writable: asyncio.Future[None] | None = None  # set while writing is paused
        self._closed = False

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's transports are not asyncio.Transport subclasses

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        if self._stream is None:
            self._process()

    def eof_received(self) -> bool:
        return False  # a client that half-closes gets the connection closed

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self._release_writer()
        if self._stream is not None:
            self._stream.cancel()
            self._stream = None

    def pause_writing(self) -> None:
        if self._writable is None:
            self._writable = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        self._release_writer()

    # internals

    def _release_writer(self) -> None:
        if self._writable is not None:
            if not self._writable.done():
                self._writable.set_result(None)
            self._writable = None

    def _process(self) -> None:
        """Answer the complete requests in the buffer, up to the first streamed one."""
        transport = self._transport
        assert transport is not None
        while not self._closed and self._stream is None:
            head_end = self._buffer.find(b"\r\n\r\n")
            if head_end < 0:
                if len(self._buffer) > _MAX_HEAD:
                    self._error(431, "request head too large", close=True)
                return
            try:
                method, path, keep_alive, length = self._parse_head(bytes(self._buffer[:head_end]))
            except _HttpError as exc:
                self._error(exc.status, exc.message, close=True)
                return
            body_start = head_end + 4
            if len(self._buffer) < body_start + length:
                return
            body = bytes(self._buffer[body_start : body_start + length])
            del self._buffer[: body_start + length]
            self._route(method, path, body, keep_alive)

    @staticmethod
    def _parse_head(head: bytes) -> tuple[str, str, bool, int]:
        """Method, path (no query), keep-alive and Content-Length of a request head."""
        lines = head.split(b"\r\n")
        parts = lines[0].split(b" ")
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
            raise _HttpError(400, "malformed request line")
        keep_alive = parts[2] == b"HTTP/1.1"
        length = 0
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if not sep:
                raise _HttpError(400, "malformed header line")
            name = name.strip().lower()
            if name == b"content-length":
                try:
                    length = int(value.strip())
                except ValueError:
                    raise _HttpError(400, "bad content-length") from None
                if length < 0:
                    raise _HttpError(400, "bad content-length")
                if length > _MAX_BODY:
                    raise _HttpError(413, "request body too large")
            elif name == b"transfer-encoding":
                raise _HttpError(501, "chunked request bodies are not supported: send content-length")
            elif name == b"connection":
                tokens = {token.strip() for token in value.lower().split(b",")}
                if b"close" in tokens:
                    keep_alive = False
                elif b"keep-alive" in tokens:
                    keep_alive = True
        path = parts[1].split(b"?", 1)[0].decode("latin-1")
        return parts[0].decode("latin-1"), path, keep_alive, length

    def _route(self, method: str, path: str, body: bytes, keep_alive: bool) -> None:
        if path.startswith("/v1/"):
            path = path[3:]
        if path == "/chat/completions":
            if method != "POST":
                self._error(405, "use POST", close=not keep_alive)
                return
            try:
                request = _ChatRequest.parse(body)
            except ValueError as exc:  # json.JSONDecodeError is a ValueError
                self._error(400, str(exc), close=not keep_alive)
                return
            if request.stream:
                self._stream = asyncio.get_running_loop().create_task(self._send_stream(request, keep_alive))
            else:
                self._respond(200, self._upstream.completion_body(request), close=not keep_alive)
        elif path == "/models" and method == "GET":
            self._respond(200, self._upstream.models_body, close=not keep_alive)
        elif path == "/health" and method == "GET":
            self._respond(200, self._upstream.health_body, close=not keep_alive)
        else:
            self._error(404, f"no route for {method} {path}", close=not keep_alive)

    def _respond(self, status: int, body: bytes, *, close: bool) -> None:
        transport = self._transport
        assert transport is not None
        head = (
            f"HTTP/1.1 {status} {_REASONS[status]}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"{'connection: close' if close else 'connection: keep-alive'}\r\n\r\n"
        )
        transport.write(head.encode("latin-1") + body)
        if close:
            self._closed = True
            transport.close()

    def _error(self, status: int, message: str, *, close: bool) -> None:
        error = {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": None}}
        self._respond(status, _dumps(error), close=close)

    async def _wait_writable(self) -> None:
        waiter = self._writable
        if waiter is not None:
            await waiter

    async def _send_stream(self, request: _ChatRequest, keep_alive: bool) -> None:
        """Write one streamed response, frame by frame, then go on with the buffered requests."""
        transport = self._transport
        assert transport is not None
        frames = self._upstream.frames(request.model)
        interval = self._upstream.interval
        loop = asyncio.get_running_loop()
        try:
            head = _STREAM_HEAD + (b"\r\n" if keep_alive else b"connection: close\r\n\r\n")
            transport.write(head + frames.role)
            start = loop.time()
            content = frames.content
            words = len(content)
            for i in range(request.max_tokens):
                if interval:
                    await asyncio.sleep(max(0.0, start + i * interval - loop.time()))
                else:
                    await asyncio.sleep(0)
                if self._writable is not None:
                    await self._wait_writable()
                if self._closed:
                    return
                transport.write(content[i % words])
            tail = [frames.finish_length if request.limited else frames.finish_stop]
            if request.include_usage:
                tail.append(frames.usage(request.prompt_tokens, request.max_tokens))
            tail.append(frames.done)
            for frame in tail:
                await asyncio.sleep(0)
                if self._writable is not None:
                    await self._wait_writable()
                if self._closed:
                    return
                transport.write(frame)
        except asyncio.CancelledError:
            return
        finally:
            self._stream = None
        if not keep_alive:
            self._closed = True
            transport.close()
        elif self._buffer:
            self._process()


class _HttpError(Exception):
    """A request that gets an error status and a closed connection."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


async def start(host: str, port: int, tokens_per_second: float = 0.0) -> asyncio.Server:
    """Start listening on ``host:port`` (``port`` 0: any free one) and return the server, already serving."""
    upstream = _Upstream(tokens_per_second)
    loop = asyncio.get_running_loop()
    return await loop.create_server(lambda: _Connection(upstream), host, port, backlog=4096)


async def serve(
    host: str,
    port: int,
    tokens_per_second: float = 0.0,
    *,
    ready: Callable[[asyncio.Server], object] | None = None,
) -> None:
    """Serve the fake upstream on ``host:port`` until cancelled; ``ready(server)`` is called once it listens."""
    server = await start(host, port, tokens_per_second)
    async with server:
        if ready is not None:
            ready(server)
        await server.serve_forever()


def main(argv: list[str] | None = None) -> None:
    """The command line: ``python benchmarks/fake_upstream.py --port P [--tokens-per-second R]``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument(
        "--tokens-per-second", type=float, default=0.0, help="content frames per second per stream (0: no pacing)"
    )
    args = parser.parse_args(argv)

    def ready(server: asyncio.Server) -> None:
        print("ready", flush=True)

    loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None
    try:
        import uvloop

        loop_factory = uvloop.new_event_loop
    except ImportError:
        pass
    try:
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            runner.run(serve(args.host, args.port, args.tokens_per_second, ready=ready))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
