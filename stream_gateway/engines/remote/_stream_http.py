"""A lean HTTP/1.1 client for the remote engines' one hot call: a streamed POST to an inference server.

In front of vLLM or SGLang every sampled token arrives as its own frame (``--stream-interval 1``),
so what the gateway pays per body read is paid per token. httpx (0.28, with httpcore 1.0 and anyio
4.16, read) pays per read an anyio stream receive, a ``fail_after`` cancel scope, h11's event
machinery and two async generators: a sixth of the front's CPU in a profile at 64 streams
(``docs/performance.md``, "The relay path"). This client parses with httptools (llhttp, the parser
uvicorn already runs here), receives in asyncio's protocol callbacks, and hands its reader, in one
wake-up, every body byte that arrived since the reader last asked.

What it does, and how it differs from httpx (which the engines keep for everything else: health
checks, model info, adapters):

* Keep-alive connections per origin (scheme, host, port); at most ``max_connections`` requests in
  flight at once (a request waits up to ``pool_timeout`` for a slot) and ``max_idle`` idle
  connections kept. A server closes idle connections on its own schedule (uvicorn, and so vLLM
  and SGLang, after 5 s): a closed one is dropped when it closes, and a request whose reused
  connection turns out closed before any byte of an answer is sent once more on a new one.
* ``connect_timeout`` for the connection (TLS included for ``https``); ``read_timeout`` as one
  timer per response that checks for progress, not a timer per read: a response whose server
  sends nothing for that long fails.
* Backpressure: once ``_HIGH_WATER`` bytes of body wait unread (a client that reads slower than
  the server writes), the connection stops reading until the reader takes them, so the kernel's
  buffers and TCP hold the rest back at the server, as a pull-based client would.
* Closing a response before its end closes the connection, so the server sees the disconnect and
  aborts the request (vLLM and SGLang both do). Closing it with ``finish=True`` says the request
  is over although the body is not: vLLM writes ``data: [DONE]`` as its own chunk after the
  finishing frame, and a reader that stops at the finish would otherwise throw every connection
  away. The rest of the answer is then read and dropped in the connection's callbacks (no task),
  and the connection joins the idle ones at the answer's end, or is closed if the end does not
  come within ``_DRAIN_S``.
* Not supported: proxies (``HTTP_PROXY`` and friends are not read), HTTP/2, redirects, content
  encodings (it asks for ``identity``), trailers.

The engines' httpx client for the rest (:func:`control_transport`) keeps the same two rules for
idle connections: it lets one go after ``KEEPALIVE_S``, under the servers' 5 s, and a ``GET`` (a
health check) whose connection the server closed without answering is sent once more. Without
them a check right at the 5 s (health checks pause while a server reloads weights, and a busy
server's timer fires late) met a connection closing under it, ``RemoteProtocolError: Server
disconnected without sending a response``, and took a healthy server out of the pool (CI, the
weight-reload test against a real vLLM).
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache, partial
from typing import Protocol, cast
from urllib.parse import urlsplit

import httptools
import httpx

from stream_gateway._errors import ConnectFailed, ConnectionLost, HttpFailure, PoolTimeout, ReadTimeout

__all__ = [
    "KEEPALIVE_S",
    "BodyListener",
    "ConnectFailed",
    "HttpFailure",
    "StreamClient",
    "StreamResponse",
    "control_transport",
]


_HIGH_WATER = 256 * 1024  # unread body bytes at which a connection stops reading
_DRAIN_S = 5.0  # how long a finished request's answer may take to end before its connection is closed
KEEPALIVE_S = 4.0
"""How long the engines' httpx client keeps an idle connection: under uvicorn's (vLLM's, SGLang's) 5 s."""


class _RetryStaleGets(httpx.AsyncHTTPTransport):
    """httpx's transport (0.29 with httpcore 1.0.9, read), sending a ``GET`` or ``HEAD`` once more
    when the server closed its connection without answering: the connection was an idle one the
    server was closing (httpcore checks an idle connection for the server's close before it takes
    it, which a close in flight passes). Only those: a ``POST`` the server may have read is never
    sent twice."""

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        try:
            return await super().handle_async_request(request)
        except httpx.RemoteProtocolError:
            if request.method not in ("GET", "HEAD"):
                raise
            return await super().handle_async_request(request)  # the failed connection is gone: a new one


def control_transport(max_connections: int) -> httpx.AsyncHTTPTransport:
    """The transport for an engine's httpx client (health checks, model info, adapters, weights).

    A client given it reads no proxy from the environment (``HTTP_PROXY``), as :class:`StreamClient`
    reads none; ``SSL_CERT_FILE`` and ``SSL_CERT_DIR`` are still read."""
    idle = min(64, max_connections)
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=idle, keepalive_expiry=KEEPALIVE_S)
    return _RetryStaleGets(limits=limits)


class BodyListener(Protocol):
    """What takes a response's body in the connection's callbacks (:meth:`StreamResponse.listen`)."""

    def body(self, data: bytes) -> None:
        """Body bytes, as they arrive."""

    def end(self) -> None:
        """The body ended."""

    def failed(self, error: HttpFailure) -> None:
        """The connection failed (lost, broken, or silent for the read timeout)."""


@dataclass(frozen=True, slots=True)
class _Origin:
    tls: bool
    host: str
    port: int

    @property
    def where(self) -> str:
        return f"{self.host}:{self.port}"


SESSION_HEADER = "X-Session-ID"  # vLLM >= 0.32 reads it (entrypoints/generate/base/serving.py) into its KV events
REQUEST_HEADER = "X-Request-ID"
_HINT = re.compile(r"[!-~]{1,200}")  # visible ASCII: no space, no control character, bounded


def session_hints(session: str | None, request_id: str) -> bytes:
    """The header lines that tell an inference server, and any router before it, which session and
    which turn a request belongs to: ``X-Session-ID`` (vLLM attaches it to the KV-cache events it
    publishes; a session-affine router, e.g. vLLM production-stack's router in its session mode keyed by
    this header, keeps the session on one server) and ``X-Request-ID``.

    A value that is not plain visible ASCII (a session id may be any string) goes as
    ``sha256:<hex>`` of itself: stable, so the hint still groups the session's requests.
    """
    lines = b""
    if session:
        lines += f"{SESSION_HEADER}: {_hint(session)}\r\n".encode("ascii")
    if request_id:
        lines += f"{REQUEST_HEADER}: {_hint(request_id)}\r\n".encode("ascii")
    return lines


def _hint(value: str) -> str:
    if _HINT.fullmatch(value):
        return value
    return "sha256:" + hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()[:32]


@lru_cache(maxsize=1024)
def _target(url: str) -> tuple[_Origin, str]:
    """``url`` as its origin and request target (path and query)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConnectFailed(f"not an http(s) URL: {url!r}")
    tls = parts.scheme == "https"
    target = parts.path or "/"
    if parts.query:
        target += "?" + parts.query
    return _Origin(tls, parts.hostname, parts.port or (443 if tls else 80)), target


class _Connection(asyncio.Protocol):
    """One connection: the transport, httptools' parser of the current answer, and what it has parsed.

    The parser's callbacks (``on_*``) run inside ``data_received``: they store the body and wake the
    reader, which runs in the request's task, or, while a :class:`BodyListener` listens, hand the
    body to it at once (no task runs per read).
    """

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.on_idle_close: Callable[[_Connection], None] | None = None  # the pool forgets it
        self._parser: httptools.HttpResponseParser | None = None
        self._chunks: list[bytes] = []
        self._buffered = 0  # bytes in _chunks
        self._paused = False
        self._waiter: asyncio.Future[None] | None = None
        self._error: HttpFailure | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._progress = 0  # parsed callbacks so far: the read timeout's clock
        self._seen = 0
        self._framed = False  # content-length or chunked: the end is in the body, not the close
        self._keep_alive = False
        self.status = 0
        self.answered = False  # any byte of the answer arrived
        self.headers_done = False
        self.complete = False
        self._on_drained: Callable[[_Connection], None] | None = None  # set while the rest of an answer is dropped
        self.listener: BodyListener | None = None  # takes the body in these callbacks instead of a reader

    # -- asyncio.Protocol ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast("asyncio.Transport", transport)  # uvloop's transports subclass none of asyncio's

    def data_received(self, data: bytes) -> None:
        parser = self._parser
        if parser is None:  # bytes on an idle connection: nothing can be trusted on it any more
            self._lose("the server sent bytes outside an answer")
            return
        self.answered = True
        try:
            parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._lose(f"the server broke HTTP: {exc}")

    def eof_received(self) -> bool:
        return False  # close the transport: a half-closed connection is of no use here

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._on_drained is not None:
            self._finish_drain()
            return
        if self._parser is None:
            if self.on_idle_close is not None:
                self.on_idle_close(self)
            return
        if self.complete:
            return
        if self.headers_done and not self._framed:
            self.on_message_complete()  # an answer that ends at the close
        elif self._error is None:
            detail = f": {exc}" if exc is not None else ""
            self._fail(ConnectionLost(f"the server closed the connection before the answer's end{detail}"))

    # -- httptools callbacks ---------------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"content-length" or (name == b"transfer-encoding" and b"chunked" in value.lower()):
            self._framed = True

    def on_headers_complete(self) -> None:
        assert self._parser is not None
        self.status = self._parser.get_status_code()
        self._keep_alive = self._parser.should_keep_alive()  # asked here: llhttp resets it at the message's end
        self.headers_done = True
        self._progress += 1
        self._wake()

    def on_body(self, body: bytes) -> None:
        self._progress += 1
        listener = self.listener
        if listener is not None:
            listener.body(body)
            return
        self._chunks.append(body)
        self._buffered += len(body)
        if self._buffered > _HIGH_WATER and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self.complete = True
        self._progress += 1
        self._stop_timer()
        self._wake()
        if self.listener is not None:
            self.listener.end()
        if self._on_drained is not None:  # not from inside the parser's feed: the pool may reset it
            asyncio.get_running_loop().call_soon(self._finish_drain)

    # -- the request's side ------------------------------------------------------------------------

    def send(self, data: bytes, read_timeout: float) -> None:
        """Write a request and get ready for its answer."""
        assert self.transport is not None
        self._parser = httptools.HttpResponseParser(self)
        self._chunks.clear()
        self._buffered = 0
        self._error = None
        self._framed = self._keep_alive = self.answered = self.headers_done = self.complete = False
        self.status = 0
        self._progress = self._seen = 0
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(read_timeout, self._check_progress, read_timeout)
        self.transport.write(data)

    async def head(self) -> None:
        """Wait for the answer's status line and headers."""
        while not self.headers_done:
            if self._error is not None:
                raise self._error
            await self._wait()

    async def read(self) -> bytes | None:
        """The body bytes that arrived since the last read (waiting for some); ``None`` at the end."""
        chunks = self._chunks
        while not chunks:
            if self.complete:
                return None
            if self._error is not None:
                raise self._error
            await self._wait()
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self._buffered = 0
        if self._paused:
            self._paused = False
            if self.transport is not None and not self.closed:
                self.transport.resume_reading()
        return data

    def listen(self, listener: BodyListener) -> None:
        """Hand the body to ``listener`` from now on: what waits unread first, then each part as it arrives."""
        self.listener = listener
        if self._chunks:
            data = self._chunks[0] if len(self._chunks) == 1 else b"".join(self._chunks)
            self._chunks.clear()
            self._buffered = 0
            listener.body(data)
        if self.listener is not listener:  # it has heard enough
            return
        if self.complete:
            listener.end()
        elif self._error is not None:
            listener.failed(self._error)
        elif self._paused:
            self.resume()

    def pause(self) -> None:
        """Stop reading (the taker of the body is behind); TCP holds the server back."""
        if not self._paused and self.transport is not None and not self.closed:
            self._paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        """Read again after :meth:`pause`."""
        if self._paused:
            self._paused = False
            if self.transport is not None and not self.closed:
                self.transport.resume_reading()

    def reusable(self) -> bool:
        """Whether the answer ended cleanly on a connection the server keeps open."""
        return self.complete and self._keep_alive and not self.closed and self._parser is not None

    def idle(self) -> None:
        """The answer is over and the connection goes back to the pool (reading, to notice a close)."""
        self._parser = None
        self.listener = None
        self._stop_timer()
        self._chunks.clear()
        self._buffered = 0
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()

    def drain(self, done: Callable[[_Connection], None], timeout: float) -> None:
        """Read the rest of the answer and drop it; ``done(self)`` at its end, at a close, or after
        ``timeout`` seconds (then closed)."""
        self._on_drained = done
        self._stop_timer()
        self._timer = asyncio.get_running_loop().call_later(timeout, self._drain_expired)
        self._chunks.clear()
        self._buffered = 0
        if self._paused and self.transport is not None and not self.closed:
            self._paused = False
            self.transport.resume_reading()
        if self.complete or self.closed:
            self._finish_drain()

    def _drain_expired(self) -> None:
        self._timer = None
        self.close()
        self._finish_drain()

    def _finish_drain(self) -> None:
        done, self._on_drained = self._on_drained, None
        if done is not None:
            self._stop_timer()
            done(self)

    def close(self) -> None:
        self._stop_timer()
        self._parser = None
        self.listener = None
        self.on_idle_close = None
        if self.transport is not None and not self.closed:
            self.transport.close()
        self.closed = True

    async def _wait(self) -> None:
        self._waiter = waiter = asyncio.get_running_loop().create_future()
        try:
            await waiter
        finally:
            self._waiter = None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, error: HttpFailure) -> None:
        if self._error is None:
            self._error = error
        self._stop_timer()
        self._wake()
        if self.listener is not None:
            self.listener.failed(error)

    def _lose(self, why: str) -> None:
        self._fail(ConnectionLost(why))
        self.close()

    def _check_progress(self, read_timeout: float) -> None:
        self._timer = None
        if self.complete or self._parser is None:
            return
        if self._progress == self._seen:
            self._fail(ReadTimeout(f"the server sent nothing for {read_timeout:g} s"))
            self.close()
            return
        self._seen = self._progress
        self._timer = asyncio.get_running_loop().call_later(read_timeout, self._check_progress, read_timeout)

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class StreamResponse:
    """An answer whose body is read as it arrives; :meth:`aclose` it (or read it to the end) always."""

    def __init__(self, client: StreamClient, connection: _Connection, origin: _Origin) -> None:
        self._client = client
        self._connection: _Connection | None = connection
        self._origin = origin
        self.status_code = connection.status
        self.where = origin.where
        """``host:port`` of the server, for messages."""
        self.content = b""
        """The whole body, once :meth:`aread` has read it."""

    async def read(self) -> bytes | None:
        """The body bytes that arrived since the last read; ``None`` at the end."""
        if self._connection is None:
            return None
        data = await self._connection.read()
        if data is None:
            await self.aclose()
        return data

    def listen(self, listener: BodyListener) -> None:
        """Hand the body to ``listener`` in the connection's callbacks, as it arrives, until
        :meth:`aclose` (instead of :meth:`read`); what arrived unread is handed over first."""
        if self._connection is None:
            listener.end()
            return
        self._connection.listen(listener)

    def pause(self) -> None:
        """Stop reading the body for now (the listener's taker is behind)."""
        if self._connection is not None:
            self._connection.pause()

    def resume(self) -> None:
        """Read the body again after :meth:`pause`."""
        if self._connection is not None:
            self._connection.resume()

    async def aread(self) -> bytes:
        """The rest of the body, whole (an error answer's, say)."""
        parts = [self.content]
        while (data := await self.read()) is not None:
            parts.append(data)
        self.content = b"".join(parts)
        return self.content

    async def aclose(self, *, finish: bool = False) -> None:
        """Release the connection: back to the pool after a clean end, closed otherwise.

        ``finish``: the request is over though the body has not ended yet (a trailing ``[DONE]``):
        the connection drops the rest and goes back to the pool at the answer's end.
        """
        connection, self._connection = self._connection, None
        if connection is None:
            return
        connection.listener = None
        if finish and not connection.complete and not connection.closed:
            self._client.drain(self._origin, connection)
        else:
            self._client.release(self._origin, connection)


class StreamClient:
    """Streamed POSTs over a pool of keep-alive connections (see the module docstring)."""

    def __init__(
        self,
        *,
        connect_timeout: float,
        read_timeout: float,
        pool_timeout: float,
        max_connections: int,
        max_idle: int,
        headers: dict[str, str] | None = None,
    ) -> None:
        self._connect_timeout = connect_timeout
        self._read_timeout = read_timeout
        self._pool_timeout = pool_timeout
        self._slots = asyncio.Semaphore(max_connections)
        self._max_idle = max_idle
        self._idle: dict[_Origin, list[_Connection]] = {}
        self._idle_count = 0
        self._busy: set[_Connection] = set()
        self._extra = b"".join(f"{k}: {v}\r\n".encode("latin-1") for k, v in (headers or {}).items())
        self._ssl: ssl.SSLContext | None = None
        self._closed = False

    async def post(
        self, url: str, body: bytes, content_type: str = "application/json", headers: bytes = b""
    ) -> StreamResponse:
        """Send ``body`` to ``url``; the answer once its headers are in (its body streams after).

        ``headers``: this request's own header lines, ``name: value\r\n`` each (:func:`header_lines`).
        """
        if self._closed:
            raise ConnectFailed("the client is closed")
        origin, target = _target(url)
        request = (
            (
                f"POST {target} HTTP/1.1\r\nhost: {origin.where}\r\ncontent-type: {content_type}\r\n"
                f"accept-encoding: identity\r\ncontent-length: {len(body)}\r\n"
            ).encode("latin-1")
            + self._extra
            + headers
            + b"\r\n"
            + body
        )
        if self._slots.locked():
            try:
                async with asyncio.timeout(self._pool_timeout):
                    await self._slots.acquire()
            except TimeoutError:
                raise PoolTimeout(f"no connection to {origin.where} came free in {self._pool_timeout:g} s") from None
        else:
            await self._slots.acquire()  # returns at once
        connection: _Connection | None = None
        try:
            while True:
                connection = self._take_idle(origin)
                reused = connection is not None
                if connection is None:
                    connection = await self._connect(origin)
                self._busy.add(connection)
                connection.send(request, self._read_timeout)
                try:
                    await connection.head()
                except ConnectionLost:
                    if reused and not connection.answered:  # closed by the server while idle: once more
                        self._busy.discard(connection)
                        connection.close()
                        continue
                    raise
                return StreamResponse(self, connection, origin)
        except BaseException:
            if connection is not None:
                self._busy.discard(connection)
                connection.close()
            self._slots.release()
            raise

    def release(self, origin: _Origin, connection: _Connection) -> None:
        """A response is done with ``connection`` (:meth:`StreamResponse.aclose`)."""
        self._slots.release()
        self._keep_or_close(origin, connection)

    def drain(self, origin: _Origin, connection: _Connection) -> None:
        """A finished request's response lets go of ``connection`` before its answer ended: its slot
        is free now, the connection is kept once the answer ends (see the module docstring)."""
        self._slots.release()
        connection.drain(partial(self._keep_or_close, origin), _DRAIN_S)

    def _keep_or_close(self, origin: _Origin, connection: _Connection) -> None:
        self._busy.discard(connection)
        if connection.reusable() and not self._closed and self._idle_count < self._max_idle:
            connection.idle()
            connection.on_idle_close = partial(self._forget_idle, origin)
            self._idle.setdefault(origin, []).append(connection)
            self._idle_count += 1
        else:
            connection.close()

    async def aclose(self) -> None:
        """Close every connection, idle or busy."""
        self._closed = True
        for connections in self._idle.values():
            for connection in connections:
                connection.close()
        self._idle.clear()
        self._idle_count = 0
        for connection in list(self._busy):
            connection.close()

    def _take_idle(self, origin: _Origin) -> _Connection | None:
        idle = self._idle.get(origin)
        while idle:
            connection = idle.pop()  # the most recently used: the least likely to have timed out
            self._idle_count -= 1
            connection.on_idle_close = None
            if not connection.closed:
                return connection
        return None

    def _forget_idle(self, origin: _Origin, connection: _Connection) -> None:
        """An idle connection closed (the server's keep-alive timeout): out of the pool."""
        idle = self._idle.get(origin)
        if idle is not None and connection in idle:
            idle.remove(connection)
            self._idle_count -= 1

    async def _connect(self, origin: _Origin) -> _Connection:
        loop = asyncio.get_running_loop()
        context = None
        if origin.tls:
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            context = self._ssl
        try:
            async with asyncio.timeout(self._connect_timeout):
                _, connection = await loop.create_connection(
                    _Connection, origin.host, origin.port, ssl=context, server_hostname=origin.host if context else None
                )
        except TimeoutError:
            raise ConnectFailed(f"could not connect to {origin.where} in {self._connect_timeout:g} s") from None
        except (OSError, ssl.SSLError) as exc:
            raise ConnectFailed(f"could not connect to {origin.where}: {exc}") from exc
        return connection
