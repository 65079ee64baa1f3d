"""The lean SSE response that carries a stream's frames to the socket.

Deliberate divergences from sse-starlette, in the manner of its own docstring:

* :class:`TokenStreamResponse` keeps sse-starlette's ``EventSourceResponse`` (3.7.0, read) for
   headers, HEAD, the disconnect listener, the shutdown watcher and the task group, and replaces
   two of its methods: ``_stream_response`` writes body frames with the server's own ``send``
   (the ASGI callable uvicorn gave the app, kept by :class:`RawSendApp` in the scope) instead of
   through five middleware wrappers, and without a cancel scope per frame; ``_ping`` becomes a
   watchdog that ticks once a second, sends the keep-alive comment when nothing was written for
   ``ping`` seconds, and raises ``SendTimeoutError`` when one write has waited ``send_timeout``
   seconds (sse-starlette wraps every send in ``move_on_after`` for that). The response start
   still goes through the middlewares, so they know the response has started.
* A stream of one choice pushes its frames (:class:`~stream_gateway.completion.FrameWriter`):
  ``_stream_response`` runs the push coroutine, and each frame is written at once with a
  :class:`_Writer`, from the task or from the upstream connection's callbacks. A write steps the
  server's ``send`` coroutine by hand: uvicorn's (0.55, ``httptools_impl.RequestResponseCycle.send``,
  read) writes to the transport and returns without suspending unless the client is behind (its
  transport paused writing); then the rest of that send runs in a task of its own, later frames wait
  in order behind it, and the producer is paused until it is out.
* Shutdown (SIGINT/SIGTERM): sse-starlette ends every stream the moment the server starts to stop,
  which cut them mid-answer (the client saw the role chunk, then a broken connection). Here a
  stream in flight may run to its end for ``shutdown_grace`` seconds; then ``on_shutdown`` is
  called (:meth:`~stream_gateway.completion.CompletionService.stop_streams`: each stream ends at
  its next step with an error frame and ``[DONE]``, its turn recorded as aborted) and the response
  waits a little longer for that last write before sse-starlette's own ending.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Generator
from typing import Any, ClassVar, cast

import anyio
from sse_starlette import EventSourceResponse
from sse_starlette.sse import SendTimeoutError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from stream_gateway.completion import FrameWriter

__all__ = ["RawSendApp", "TokenStreamResponse"]

log = logging.getLogger(__name__)

RAW_SEND = "stream_gateway.raw_send"
"""The scope key under which :class:`RawSendApp` keeps the server's ``send``."""

_WATCHDOG_TICK_S = 1.0
_STOPPING_TICK_S = 0.05  # the watchdog's tick once the server is stopping
_LAST_WRITE_S = 5.0  # after the grace, how long a stream has to write its error frame
_GONE, _TIMED_OUT, _SHUTDOWN = "the client left", "the client read nothing for too long", "shutdown"


class RawSendApp:
    """Outermost ASGI layer: keeps the server's ``send`` in the scope for :class:`TokenStreamResponse`."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope[RAW_SEND] = send
        await self.app(scope, receive, send)


class TokenStreamResponse(EventSourceResponse):
    """An SSE response whose body iterator yields ready frames, or whose ``push`` writes them (see
    the module docstring)."""

    def __init__(
        self,
        content: AsyncIterator[bytes] | None,
        *args: Any,
        push: Callable[[FrameWriter], Awaitable[None]] | None = None,
        shutdown_grace: float = 0.0,
        on_shutdown: Callable[[str], None] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(content if content is not None else _nothing(), *args, **kwargs)
        self._push = push
        self._grace = shutdown_grace
        self._on_shutdown = on_shutdown
        self._raw_send: Send | None = None
        self._writes = 0  # frames written so far: the watchdog's clock
        self._sending = False
        # A pushed response's own (see _serve_pushed):
        self._writer: _Writer | None = None
        self._task: asyncio.Task[Any] | None = None
        self._ended: str | None = None  # why it was ended from outside
        self._seen = 0
        self._idle_s = self._stuck_s = 0.0
        self._told_to_stop = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._raw_send = scope.get(RAW_SEND)
        if self._push is None or scope["type"] != "http" or scope["method"].upper() == "HEAD":
            await super().__call__(scope, receive, send)
            return
        await self._serve_pushed(receive, send)
        if self.background is not None:
            await self.background()

    async def _serve_pushed(self, receive: Receive, send: Send) -> None:
        """A pushed response, in the request's own task: one small task waits for the client's
        disconnect, and the loop's one :class:`_Watchdog` pings, drops a client stuck past the send
        timeout, and ends the stream at shutdown (sse-starlette starts four tasks a stream for that:
        a tenth of a short turn's CPU). Each of them ends the response by cancelling this task."""
        task = asyncio.current_task()
        assert task is not None
        self._task = task
        listener = asyncio.get_running_loop().create_task(self._watch_client(receive))
        watchdog = _Watchdog.of_loop()
        watchdog.add(self)
        try:
            await self._stream_response(send)
        except asyncio.CancelledError:
            why = self._ended
            if why is None or task.uncancel() > 0:  # cancelled from outside too
                raise
            if why == _TIMED_OUT:
                raise SendTimeoutError() from None
        finally:
            self.active = False
            listener.cancel()
            watchdog.discard(self)

    async def _watch_client(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        if self.active:  # the client left before the end (the end's own write also wakes this)
            self._stop(_GONE)

    def _stop(self, why: str) -> None:
        """End a pushed response from outside its task (once)."""
        if self._ended is None and self._task is not None:
            self._ended = why
            self._task.cancel()

    def _watch(self, elapsed: float, stopping_s: float | None) -> None:
        """The watchdog's look at a pushed response, ``elapsed`` seconds after its last one;
        ``stopping_s``: seconds since the server began to stop (``None``: it has not)."""
        if self._writes != self._seen:
            self._seen, self._idle_s, self._stuck_s = self._writes, 0.0, 0.0
        else:
            self._idle_s += elapsed
            timeout = self.send_timeout or 0.0
            if self._sending:
                self._stuck_s += elapsed
                if timeout and self._stuck_s >= timeout:
                    log.warning("dropping a client that read nothing for %.0f s", self._stuck_s)
                    self._stop(_TIMED_OUT)
                    return
            elif self.ping_interval and self._idle_s >= self.ping_interval and self._writer is not None:
                self._idle_s = 0.0
                self._writer.write(b": ping\n\n")
        if stopping_s is None or stopping_s < self._grace:
            return
        if self._on_shutdown is None:
            self._stop(_SHUTDOWN)
        elif not self._told_to_stop:
            self._told_to_stop = True
            self._on_shutdown(f"streams still running {self._grace:g} s after the stop signal were ended")
        elif stopping_s >= self._grace + _LAST_WRITE_S:
            self._stop(_SHUTDOWN)

    async def _listen_for_exit_signal_with_grace(self) -> None:
        """Returns (and sse-starlette cancels the stream) once the server stops and the stream has
        ended, by itself within the grace or with an error frame after it."""
        await self._listen_for_exit_signal()
        # Polled as sse-starlette's own grace loop polls it: ``active`` is a flag its tasks clear.
        with anyio.move_on_after(self._grace):
            while self.active:  # noqa: ASYNC110
                await anyio.sleep(0.05)
        if not self.active or self._on_shutdown is None:
            return
        self._on_shutdown(f"streams still running {self._grace:g} s after the stop signal were ended")
        with anyio.move_on_after(_LAST_WRITE_S):
            while self.active:  # noqa: ASYNC110
                await anyio.sleep(0.05)

    async def _stream_response(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        raw = self._raw_send or send
        if self._push is not None:
            self._writer = writer = _Writer(raw, self)
            try:
                await self._push(writer)
                await writer.drained()
            finally:
                writer.close()
            await self._end(raw)
            return
        body = self.body_iterator
        try:
            async for chunk in body:
                self._sending = True
                await raw({"type": "http.response.body", "body": chunk, "more_body": True})
                self._sending = False
                self._writes += 1
        except BaseException:
            aclose = getattr(body, "aclose", None)
            if aclose is not None:
                with anyio.move_on_after(self._cleanup_timeout, shield=True):
                    await aclose()
            raise
        await self._end(raw)

    async def _end(self, raw: Send) -> None:
        """The last write. ``active`` turns false only once it is out: the watchdog ends (and
        sse-starlette then cancels the response) when it sees it false, and the last write waits
        for a client that is behind like any other."""
        async with self._send_lock:
            await raw({"type": "http.response.body", "body": b"", "more_body": False})
            self.active = False

    async def _ping(self, send: Send) -> None:
        raw = self._raw_send or send
        timeout = self.send_timeout or 0.0
        tick = min(_WATCHDOG_TICK_S, self.ping_interval, timeout or _WATCHDOG_TICK_S)
        idle_s = stuck_s = 0.0
        seen = self._writes
        while self.active:
            await anyio.sleep(tick)
            if self._writes != seen:
                seen, idle_s, stuck_s = self._writes, 0.0, 0.0
                continue
            idle_s += tick
            if self._sending:
                stuck_s += tick
                if timeout and stuck_s >= timeout:
                    log.warning("dropping a client that read nothing for %.0f s", stuck_s)
                    raise SendTimeoutError()
            elif idle_s >= self.ping_interval:
                idle_s = 0.0
                async with self._send_lock:
                    if self.active:
                        message: Message = {"type": "http.response.body", "body": b": ping\n\n", "more_body": True}
                        await raw(message)


async def _nothing() -> AsyncIterator[bytes]:
    return
    yield b""  # an async generator that yields nothing: a pushed response's body iterator


class _Writer:
    """A pushed response's frames, each written at once (:class:`~stream_gateway.completion.FrameWriter`).

    A write starts the server's ``send`` and steps it by hand: it returns having written, unless the
    client is behind. Then the send is finished in a task (:class:`_Rest`), the producer is paused,
    and later writes wait in order until that task has sent them too."""

    __slots__ = ("_error", "_held", "_pause", "_response", "_resume", "_send", "_task", "behind")

    def __init__(self, send: Send, response: TokenStreamResponse) -> None:
        self._send = send
        self._response = response
        self.behind = False
        self._held: list[bytes] = []
        self._task: asyncio.Task[None] | None = None
        self._error: BaseException | None = None
        self._pause: Callable[[], None] | None = None
        self._resume: Callable[[], None] | None = None

    def when_behind(self, pause: Callable[[], None], resume: Callable[[], None]) -> None:
        self._pause, self._resume = pause, resume
        if self.behind:
            pause()

    def write(self, frame: bytes) -> None:
        if self.behind:
            self._held.append(frame)
            return
        if self._error is not None:
            raise self._error
        response = self._response
        response._writes += 1
        sending = cast(
            "Coroutine[Any, Any, None]", self._send({"type": "http.response.body", "body": frame, "more_body": True})
        )
        try:
            waits_on = sending.send(None)  # send's coroutine, stepped by hand
        except StopIteration:
            return  # written
        self.behind = response._sending = True
        if self._pause is not None:
            self._pause()
        self._task = asyncio.get_running_loop().create_task(self._catch_up(_Rest(sending, waits_on)))

    async def _catch_up(self, rest: _Rest) -> None:
        response = self._response
        try:
            await rest
            while self._held:
                frames = self._held[0] if len(self._held) == 1 else b"".join(self._held)
                self._held.clear()
                response._writes += 1
                await self._send({"type": "http.response.body", "body": frames, "more_body": True})
        except Exception as exc:
            self._error = exc
            return
        finally:
            self.behind = response._sending = False
        if self._resume is not None:
            self._resume()

    async def drained(self) -> None:
        task = self._task
        if task is not None and not task.done():
            await asyncio.shield(task)  # cancelling the caller leaves it to close()
        if self._error is not None:
            raise self._error

    def close(self) -> None:
        """The response is over: a send still waiting is cancelled."""
        self._pause = self._resume = None
        if self._task is not None and not self._task.done():
            self._task.cancel()


class _Rest:
    """The rest of a coroutine stepped once by hand, awaited in a task: what it waits on is handed
    to the task as if the coroutine had been awaited from the start, and what the task sends or
    throws goes on to it."""

    __slots__ = ("_coroutine", "_waits_on")

    def __init__(self, coroutine: Coroutine[Any, Any, Any], waits_on: Any) -> None:
        self._coroutine = coroutine
        self._waits_on = waits_on

    def __await__(self) -> Generator[Any, Any, None]:
        coroutine, waits_on = self._coroutine, self._waits_on
        while True:
            try:
                value = yield waits_on
            except GeneratorExit:
                coroutine.close()
                raise
            except BaseException as exc:  # cancelled: into the coroutine, which may handle it
                try:
                    waits_on = coroutine.throw(exc)
                except StopIteration:
                    return
                continue
            try:
                waits_on = coroutine.send(value)
            except StopIteration:
                return


class _Watchdog:
    """One task per event loop that looks after every pushed response once a tick
    (:meth:`TokenStreamResponse._watch`): keep-alive pings, the send timeout, the shutdown's grace.
    It runs while there are pushed responses and waits for the server's stop signal as
    sse-starlette's streams wait for it (its shared watcher, 3.7.0)."""

    _by_loop: ClassVar[weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Watchdog]] = weakref.WeakKeyDictionary()

    def __init__(self) -> None:
        self._responses: set[TokenStreamResponse] = set()
        self._tick = _WATCHDOG_TICK_S
        self._task: asyncio.Task[None] | None = None

    @classmethod
    def of_loop(cls) -> _Watchdog:
        loop = asyncio.get_running_loop()
        watchdog = cls._by_loop.get(loop)
        if watchdog is None:
            cls._by_loop[loop] = watchdog = cls()
        return watchdog

    def add(self, response: TokenStreamResponse) -> None:
        self._responses.add(response)
        timeout = response.send_timeout or _WATCHDOG_TICK_S
        self._tick = min(self._tick, response.ping_interval or _WATCHDOG_TICK_S, timeout)
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    def discard(self, response: TokenStreamResponse) -> None:
        self._responses.discard(response)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        stop_signal = loop.create_task(EventSourceResponse._listen_for_exit_signal())
        stopping_since: float | None = None
        last = loop.time()
        try:
            while self._responses:
                await asyncio.sleep(self._tick if stopping_since is None else _STOPPING_TICK_S)
                now = loop.time()
                if stopping_since is None and stop_signal.done():
                    stopping_since = now
                stopping_s = None if stopping_since is None else now - stopping_since
                for response in list(self._responses):
                    try:
                        response._watch(now - last, stopping_s)
                    except Exception:  # a broken write: that response ends, the others are still watched
                        log.exception("the watchdog ends a stream it could not look after")
                        response._stop(_GONE)
                last = now
        finally:
            stop_signal.cancel()
            self._task = None
