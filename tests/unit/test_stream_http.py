"""The remote engines' streaming HTTP client against a real socket server that misbehaves on purpose.

The server is ``asyncio.start_server``; each test's handler writes exactly the bytes it wants (chunked,
by length, to the close, stalled, broken), so the client's framing, keep-alive, retry, timeouts and
slots are checked against the wire, not against a mock of it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import httpx
import pytest

from stream_gateway._errors import ConnectFailed, ConnectionLost, PoolTimeout, ReadTimeout
from stream_gateway.engines.remote._stream_http import KEEPALIVE_S, StreamClient, control_transport

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, bytes], Awaitable[bool]]
"""Answers one request (its head and body read); ``False`` ends the connection."""


class Server:
    """A socket server that reads requests (head and ``content-length`` body) and lets ``handler`` answer."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.requests: list[bytes] = []
        self.closed_by_client = asyncio.Event()
        self.server: asyncio.Server | None = None
        self.tasks: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        for task in self.tasks:  # handlers still answering (stalled on purpose) end here
            task.cancel()
        await asyncio.gather(*self.tasks)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        task = asyncio.current_task()
        assert task is not None
        self.tasks.add(task)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    (
                        int(line.split(b":")[1])
                        for line in head.split(b"\r\n")
                        if line.lower().startswith(b"content-length")
                    ),
                    0,  # a GET
                )
                body = await reader.readexactly(length)
                self.requests.append(head + body)
                if not await self.handler(reader, writer, body):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            self.closed_by_client.set()
        except asyncio.CancelledError:
            pass  # the test is over: end quietly (asyncio's server callback reads the task's exception)
        finally:
            writer.close()


def chunked(*parts: bytes) -> bytes:
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    return head + b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


def client(**overrides: float) -> StreamClient:
    settings = {"connect_timeout": 2.0, "read_timeout": 5.0, "pool_timeout": 2.0, "max_connections": 8, "max_idle": 8}
    settings.update(overrides)
    return StreamClient(
        connect_timeout=settings["connect_timeout"],
        read_timeout=settings["read_timeout"],
        pool_timeout=settings["pool_timeout"],
        max_connections=int(settings["max_connections"]),
        max_idle=int(settings["max_idle"]),
        headers={"authorization": "Bearer k"},
    )


async def body_of(http: StreamClient, url: str) -> tuple[int, bytes, int]:
    """Status, whole body and how many reads it took."""
    response = await http.post(url + "/v1/completions", b'{"prompt": [1]}')
    parts = []
    while (data := await response.read()) is not None:
        parts.append(data)
    await response.aclose()
    return response.status_code, b"".join(parts), len(parts)


def test_chunked_answers_reuse_one_connection_and_the_request_is_complete() -> None:
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, body: bytes) -> bool:
        writer.write(chunked(b"data: 1\n\n", b"data: 2\n\n"))
        await writer.drain()
        return True

    async def run() -> None:
        server = Server(answer)
        async with server as url:
            http = client()
            for _ in range(3):
                assert (await body_of(http, url))[:2] == (200, b"data: 1\n\ndata: 2\n\n")
            assert server.connections == 1
            head = server.requests[0]
            assert head.startswith(b"POST /v1/completions HTTP/1.1\r\n")
            assert b"authorization: Bearer k\r\n" in head and head.endswith(b'\r\n\r\n{"prompt": [1]}')
            await http.aclose()

    asyncio.run(run())


def test_bodies_by_length_and_to_the_close_are_read_whole() -> None:
    async def by_length(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, body: bytes) -> bool:
        writer.write(b'HTTP/1.1 400 Bad Request\r\ncontent-length: 9\r\n\r\n{"e": 1}\n')
        return True

    async def to_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, body: bytes) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\ndata: a\n\n")
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(b"data: b\n\n")
        await writer.drain()
        return False

    async def run() -> None:
        async with Server(by_length) as url:
            http = client()
            response = await http.post(url + "/x", b"{}")
            assert response.status_code == 400 and await response.aread() == b'{"e": 1}\n'
            await http.aclose()
        async with Server(to_close) as url:
            http = client()
            status, body, reads = await body_of(http, url)
            assert (status, body, reads) == (200, b"data: a\n\ndata: b\n\n", 2)
            await http.aclose()

    asyncio.run(run())


def test_a_connection_the_server_closed_while_idle_is_replaced() -> None:
    """Each answer by length, then the server closes: the next request finds the pooled one dead."""

    async def once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, body: bytes) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()
        return False

    async def run() -> None:
        server = Server(once)
        async with server as url:
            http = client()
            for _ in range(3):
                assert (await body_of(http, url))[:2] == (200, b"ok")
            assert server.connections == 3 and len(server.requests) == 3
            await http.aclose()

    asyncio.run(run())


def test_the_control_client_sends_a_get_once_more_where_the_server_closed_its_connection_unanswered() -> None:
    """The engines' httpx client (health checks): a server that reads a kept-alive connection's second
    request and closes it unanswered (as uvicorn does when its 5-s keep-alive timer fires while the
    request is on its way) costs a ``GET`` one more connection, not a failed check; a ``POST`` (a
    weight load, an adapter) is never sent twice, and a server that never answers still fails."""
    answered: dict[int, int] = {}

    async def first_only(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, body: bytes) -> bool:
        key = id(writer)
        answered[key] = answered.get(key, 0) + 1
        if answered[key] > 1:  # this connection's second request: closed, no answer
            return False
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()
        return True

    async def never(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, body: bytes) -> bool:
        return False

    async def run() -> None:
        assert KEEPALIVE_S < 5.0  # under uvicorn's keep-alive
        server = Server(first_only)
        async with server as url, httpx.AsyncClient(transport=control_transport(8)) as http:
            for _ in range(3):
                assert (await http.get(f"{url}/health")).text == "ok"
            # each GET after the first: sent on the kept connection, closed unanswered, sent on a new one
            assert (server.connections, len(server.requests)) == (3, 5)
            with pytest.raises(httpx.RemoteProtocolError):
                await http.post(f"{url}/pause", content=b"{}")
            assert (server.connections, len(server.requests)) == (3, 6)  # once only
        silent = Server(never)
        async with silent as url, httpx.AsyncClient(transport=control_transport(8)) as http:
            with pytest.raises(httpx.RemoteProtocolError):
                await http.get(f"{url}/health")
            assert (silent.connections, len(silent.requests)) == (2, 2)  # the check once more, then it fails

    asyncio.run(run())


def test_a_silent_server_times_out_once_per_response_not_per_read() -> None:
    async def stall(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, body: bytes) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for _ in range(4):  # 0.8 s of frames every 0.2 s: slower than nothing, never silent for 0.5 s
            writer.write(b"5\r\nhello\r\n")
            await writer.drain()
            await asyncio.sleep(0.2)
        await asyncio.sleep(10)
        return False

    async def run() -> None:
        async with Server(stall) as url:
            http = client(read_timeout=0.5)
            response = await http.post(url + "/x", b"{}")
            started, got = time.monotonic(), b""
            with pytest.raises(ReadTimeout):
                while (data := await response.read()) is not None:
                    got += data
            assert got == b"hello" * 4
            assert 0.7 < time.monotonic() - started < 2.5  # the last frame at ~0.6 s, then 0.5-1 s of silence
            await response.aclose()
            await http.aclose()

    asyncio.run(run())


def test_closing_a_response_midway_disconnects_from_the_server() -> None:
    async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, body: bytes) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        while True:
            writer.write(b"9\r\ndata: x\n\n\r\n")
            await writer.drain()
            await asyncio.sleep(0.01)

    async def run() -> None:
        server = Server(endless)
        async with server as url:
            http = client()
            response = await http.post(url + "/x", b"{}")
            assert (await response.read() or b"").startswith(b"data: x")
            await response.aclose()
            await asyncio.wait_for(server.closed_by_client.wait(), 5)
            await http.aclose()

    asyncio.run(run())


def test_refused_broken_and_full() -> None:
    async def broken(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, body: bytes) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\nnot hex\r\n")
        await writer.drain()
        await asyncio.sleep(1)
        return False

    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, body: bytes) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(2)
        return False

    async def run() -> None:
        async with Server(broken) as url:
            port = int(url.rsplit(":", 1)[1])
        with pytest.raises(ConnectFailed, match="could not connect"):
            await client().post(f"http://127.0.0.1:{port}/x", b"{}")  # nothing listens there now
        async with Server(broken) as url:
            http = client()
            response = await http.post(url + "/x", b"{}")
            with pytest.raises(ConnectionLost, match="broke HTTP"):
                await response.read()
            await response.aclose()
            await http.aclose()
        async with Server(slow) as url:
            http = client(max_connections=1, pool_timeout=0.3)
            first = await http.post(url + "/x", b"{}")
            with pytest.raises(PoolTimeout):
                await http.post(url + "/x", b"{}")
            await first.aclose()  # its slot comes free
            second = await http.post(url + "/x", b"{}")
            await second.aclose()
            await http.aclose()

    asyncio.run(run())


def test_a_reader_that_falls_behind_holds_the_server_back() -> None:
    """32 MiB sent as fast as loopback goes, read only after 0.5 s: the server waits for the reader."""
    size, piece = 32 * 1024 * 1024, b"x" * 65536
    drained_at: list[float] = []

    async def flood(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, body: bytes) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % size)
        for _ in range(size // len(piece)):
            writer.write(piece)
            await writer.drain()
        drained_at.append(time.monotonic())
        return True

    async def run() -> None:
        async with Server(flood) as url:
            http = client()
            response = await http.post(url + "/x", b"{}")
            await asyncio.sleep(0.5)
            reading_from, total = time.monotonic(), 0
            assert not drained_at  # the server is still waiting: it could not hand over 32 MiB
            while (data := await response.read()) is not None:
                total += len(data)
            assert total == size and drained_at and drained_at[0] > reading_from
            await http.aclose()

    asyncio.run(run())


def test_session_hints_name_the_session_and_the_turn_in_plain_ascii() -> None:
    from stream_gateway.engines.remote._stream_http import session_hints

    assert session_hints("agent-7", "chatcmpl-1") == b"X-Session-ID: agent-7\r\nX-Request-ID: chatcmpl-1\r\n"
    assert session_hints(None, "r") == b"X-Request-ID: r\r\n"
    # Any other session id goes hashed: stable (it still groups the session), never a header injection.
    odd = session_hints("a b\r\nX-Evil: 1", "r")
    assert odd == session_hints("a b\r\nX-Evil: 1", "r") and b"Evil" not in odd
    assert odd.startswith(b"X-Session-ID: sha256:") and odd.count(b"\r\n") == 2
    assert session_hints("é", "r") != session_hints("e", "r")
