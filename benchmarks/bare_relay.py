"""The floor of a relay written in CPython: the front's per-token work in protocol callbacks, and nothing else.

Run it in a process of its own (``benchmarks/relay.py --bare`` does)::

    .venv/bin/python benchmarks/bare_relay.py --port 9100 --upstream http://127.0.0.1:9000 --model tiny-agent

It answers ``GET /health`` and streamed ``POST /v1/chat/completions`` in front of a vLLM-like server's
``/v1/completions`` (``benchmarks/paced_upstream.py``), asking it what the ``vllm-http`` engine asks (token ids in,
``return_token_ids``, ``return_tokens_as_token_ids``, logprobs, usage). What it is for: the question "how much of the
front's CPU per token is its design, and how much is CPython's floor?" (``docs/performance.md``, "The bound, and
why"). Per request it renders the chat template and tokenizes (transformers), per upstream frame it does what the
front must do per token and no more:

* one ``data_received`` callback on uvloop, the body dechunked by httptools (llhttp, as the front's client);
* ``orjson.loads`` of the frame, the token ids and logprobs appended to the turn's record;
* the ids detokenized incrementally (tokenizers' ``DecodeStream``, as the front);
* the chat chunk built as a dict and ``orjson.dumps``-ed, and one ``transport.write`` to the client, in chunked
  transfer encoding.

What it leaves out, and the front does not: tasks and async generators between the socket and the writer (here
nothing wakes a task: the upstream's callback writes to the client's transport; ``--tasks`` puts the request's task
back in, woken once per read as the front's reader is, to price that wake-up alone), ASGI (uvicorn's ``send``,
middlewares), routing and validation of the request (pydantic), capture (events, NATS, session records), tool,
reasoning and stop-string parsers, sampling-parameter checks, failover, backpressure (a client that stops reading
has its frames buffered), error frames. What it keeps besides, so that it runs clean under a load generator:
every request's task belongs to the server's task group, a malformed request gets a 400, a request that fails
closes its client's connection, and a client that leaves aborts its upstream request (the upstream connection is
closed, as a front closes it). It is not a product and must not become one: it is the measured floor
under the product's design on this machine, the figure a compiled or callback-driven relay would be judged against.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path
from typing import Any, cast
from urllib.parse import urlsplit

import httptools
import orjson
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

_STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\ncache-control: no-store\r\n"
    b"x-accel-buffering: no\r\ntransfer-encoding: chunked\r\n\r\n"
)
_DONE = b"data: [DONE]\n\n"


def _chunk(frame: bytes) -> bytes:
    """One SSE frame as one HTTP chunk."""
    return b"%x\r\n%s\r\n" % (len(frame), frame)


class _Relay:
    """The shared state: the tokenizers, the upstream's address and its idle keep-alive connections."""

    def __init__(self, model_dir: Path, upstream: str, served: str, *, tasks: bool = False) -> None:
        from transformers import AutoTokenizer

        self.tasks = tasks
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.backend: Tokenizer = self.tokenizer.backend_tokenizer
        parts = urlsplit(upstream)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.served = served
        self.idle: list[_Upstream] = []
        self.counter = 0
        self.group: asyncio.TaskGroup | None = None  # the server's: it owns every request's task

    def prompt_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(self.backend.encode(text, add_special_tokens=False).ids)

    async def upstream(self) -> _Upstream:
        while self.idle:
            connection = self.idle.pop()
            if not connection.closed:
                return connection
        loop = asyncio.get_running_loop()
        _, protocol = await loop.create_connection(lambda: _Upstream(self), self.host, self.port)
        return protocol


class _Turn:
    """One streamed chat request relayed: the record and the client's transport."""

    __slots__ = ("client", "created", "decoder", "ids", "logprobs", "name", "prompt_tokens", "relay")

    def __init__(self, relay: _Relay, client: asyncio.Transport, name: str, created: int, prompt_tokens: int) -> None:
        self.relay = relay
        self.client = client
        self.name = name
        self.created = created
        self.prompt_tokens = prompt_tokens
        self.decoder = DecodeStream(skip_special_tokens=False)
        self.ids: list[int] = []
        self.logprobs: list[float] = []

    def frame(self, delta: dict[str, Any], finish: str | None) -> bytes:
        chunk = {
            "id": self.name,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.relay.served,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        }
        return b"data: " + orjson.dumps(chunk) + b"\n\n"

    def upstream_frame(self, event: dict[str, Any]) -> None:
        """One upstream frame: record its tokens, detokenize them, write the chat chunk."""
        choices = event.get("choices")
        if not choices:
            usage = event.get("usage")
            if usage is not None:
                done = {
                    "id": self.name,
                    "object": "chat.completion.chunk",
                    "created": self.created,
                    "model": self.relay.served,
                    "choices": [],
                    "usage": {
                        "prompt_tokens": self.prompt_tokens,
                        "completion_tokens": len(self.ids),
                        "total_tokens": self.prompt_tokens + len(self.ids),
                    },
                }
                self.client.write(_chunk(b"data: " + orjson.dumps(done) + b"\n\n"))
            return
        choice = choices[0]
        ids = choice.get("token_ids") or ()
        if not ids and choice.get("finish_reason") is None:
            return
        self.ids.extend(ids)
        logprobs = choice.get("logprobs")
        if logprobs is not None:
            self.logprobs.extend(logprobs["token_logprobs"])
        decoder, backend = self.decoder, self.relay.backend
        text = "".join(piece for i in ids if (piece := decoder.step(backend, i)) is not None)
        finish = choice.get("finish_reason")
        if text or finish is not None:
            self.client.write(_chunk(self.frame({"content": text}, finish)))

    def end(self) -> None:
        self.client.write(_chunk(_DONE) + b"0\r\n\r\n")


class _Upstream(asyncio.Protocol):
    """One keep-alive connection to the upstream; its answer's frames go straight to the turn's client."""

    def __init__(self, relay: _Relay) -> None:
        self.relay = relay
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.turn: _Turn | None = None
        self.buffer = b""
        self.closed = False
        self.pending: list[bytes] = []  # --tasks: the reads the task has not taken yet
        self.waiter: asyncio.Future[None] | None = None
        self.complete = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast("asyncio.Transport", transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)
        if self.turn is not None:
            self.turn.client.close()
            self.turn = None

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def send(self, turn: _Turn, body: bytes) -> None:
        assert self.transport is not None
        self.turn, self.buffer, self.complete = turn, b"", False
        self.pending.clear()
        relay = self.relay
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {relay.host}:{relay.port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        self.transport.write(head.encode() + body)

    # httptools callbacks

    def on_body(self, body: bytes) -> None:
        turn = self.turn
        if turn is None:
            return
        if self.relay.tasks:  # the request's task does the work: store and wake it
            self.pending.append(body)
            if self.waiter is not None and not self.waiter.done():
                self.waiter.set_result(None)
            return
        self.take(turn, body)

    def take(self, turn: _Turn, body: bytes) -> None:
        """The body bytes of one read (or several, joined): their whole frames relayed. A client
        that has gone aborts the upstream request by closing its connection, as a front does."""
        if turn.client.is_closing():
            self.turn = None
            assert self.transport is not None
            self.transport.close()
            return
        loads = orjson.loads
        if not self.buffer and body.startswith(b"data: {") and body.find(b"\n\n") == len(body) - 2:
            turn.upstream_frame(loads(body[6:]))  # one frame a read: the common case
            return
        buffer = self.buffer + body
        blocks = buffer.split(b"\n\n")
        self.buffer = blocks.pop()
        for block in blocks:
            if block.startswith(b"data: {"):
                turn.upstream_frame(loads(block[6:]))

    def on_message_complete(self) -> None:
        if self.relay.tasks:
            self.complete = True
            if self.waiter is not None and not self.waiter.done():
                self.waiter.set_result(None)
            return
        turn, self.turn = self.turn, None
        if turn is not None and not turn.client.is_closing():
            turn.end()
        self.relay.idle.append(self)

    async def relay_in_task(self, turn: _Turn) -> None:
        """``--tasks``: the request's task waits for each read and relays it (a task wake-up per read)."""
        loop = asyncio.get_running_loop()
        try:
            while self.turn is turn:  # take() lets go of a turn whose client has gone
                while not self.pending and not self.complete and not self.closed:
                    self.waiter = loop.create_future()
                    await self.waiter
                if self.pending:
                    body = self.pending[0] if len(self.pending) == 1 else b"".join(self.pending)
                    self.pending.clear()
                    self.take(turn, body)
                if self.complete or self.closed:
                    break
        except asyncio.CancelledError:  # the client left while the task waited: abort upstream
            assert self.transport is not None
            self.transport.close()
            raise
        finally:
            self.turn = None
        if turn.client.is_closing():
            return
        turn.end()
        if not self.closed:
            self.relay.idle.append(self)


class _Client(asyncio.Protocol):
    """One client connection: requests parsed by httptools, one at a time."""

    def __init__(self, relay: _Relay) -> None:
        self.relay = relay
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.body: list[bytes] = []
        self.task: asyncio.Task[None] | None = None  # the request in flight (in the server's task group)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast("asyncio.Transport", transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.task is not None:
            self.task.cancel()  # a request still waiting for its upstream connection, or relaying (--tasks)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            assert self.transport is not None
            self.transport.close()

    def on_url(self, url: bytes) -> None:
        self.url = url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        assert self.transport is not None
        body, self.body = b"".join(self.body), []
        if self.url == b"/health":
            self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
            return
        if self.url != b"/v1/chat/completions":
            self.transport.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
            return
        try:
            request = orjson.loads(body)
        except orjson.JSONDecodeError:
            request = None
        if not isinstance(request, dict) or not isinstance(request.get("messages"), list):
            # refused here: a request's task must not fail the server's task group
            self.transport.write(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
            self.transport.close()
            return
        assert self.relay.group is not None
        self.task = self.relay.group.create_task(self.start(request))

    async def start(self, request: dict[str, Any]) -> None:
        """One request relayed. One that fails (an upstream out of reach, messages the template
        refuses) closes its client's connection and says why on stderr; the server goes on."""
        try:
            await self._relay(request)
        except Exception as exc:  # a measuring stick: the load generator counts the error
            sys.stderr.write(f"bare_relay: a request failed: {exc!r}\n")
            if self.transport is not None:
                self.transport.close()

    async def _relay(self, request: dict[str, Any]) -> None:
        relay, client = self.relay, self.transport
        assert client is not None
        relay.counter += 1
        prompt = relay.prompt_ids(request["messages"])
        turn = _Turn(relay, client, f"chatcmpl-bare-{os.getpid()}-{relay.counter}", 1_700_000_000, len(prompt))
        body = {
            "model": relay.served,
            "prompt": prompt,
            "max_tokens": request.get("max_tokens", 16),
            "temperature": request.get("temperature", 1.0),
            "logprobs": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            "skip_special_tokens": False,
            "ignore_eos": bool(request.get("ignore_eos")),
            "request_id": turn.name,
        }
        client.write(_STREAM_HEAD + _chunk(turn.frame({"role": "assistant", "content": ""}, None)))
        upstream = await relay.upstream()
        upstream.send(turn, orjson.dumps(body))
        if relay.tasks:
            await upstream.relay_in_task(turn)


async def _serve(relay: _Relay, port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Client(relay), "127.0.0.1", port, backlog=4096)
    sys.stdout.write(f"ready {server.sockets[0].getsockname()[1]}\n")
    sys.stdout.flush()
    async with asyncio.TaskGroup() as group:  # every request's task; cancelled with the server
        relay.group = group
        await server.serve_forever()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--upstream", required=True, help="the vLLM-like server's base URL")
    parser.add_argument("--model", default="tiny-agent", help="a model directory or a built-in name (its tokenizer)")
    parser.add_argument("--served-model-name", default="tiny-agent")
    parser.add_argument(
        "--tasks",
        action="store_true",
        help="relay in each request's task, woken per read, instead of in the connection's callback",
    )
    args = parser.parse_args(argv)
    model_dir = Path(args.model)
    if not model_dir.is_dir():
        from stream_gateway.models import resolve_model

        model_dir = Path(resolve_model(args.model))
    import uvloop

    relay = _Relay(model_dir, args.upstream, args.served_model_name, tasks=args.tasks)
    uvloop.run(_serve(relay, args.port))


if __name__ == "__main__":
    main()
