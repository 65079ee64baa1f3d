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
* Shutdown (SIGINT/SIGTERM): sse-starlette ends every stream the moment the server starts to stop,
  which cut them mid-answer (the client saw the role chunk, then a broken connection). Here a
  stream in flight may run to its end for ``shutdown_grace`` seconds; then ``on_shutdown`` is
  called (:meth:`~stream_gateway.completion.CompletionService.stop_streams`: each stream ends at
  its next step with an error frame and ``[DONE]``, its turn recorded as aborted) and the response
  waits a little longer for that last write before sse-starlette's own ending.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import anyio
from sse_starlette import EventSourceResponse
from sse_starlette.sse import SendTimeoutError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["RawSendApp", "TokenStreamResponse"]

log = logging.getLogger(__name__)

RAW_SEND = "stream_gateway.raw_send"
"""The scope key under which :class:`RawSendApp` keeps the server's ``send``."""

_WATCHDOG_TICK_S = 1.0
_LAST_WRITE_S = 5.0  # after the grace, how long a stream has to write its error frame


class RawSendApp:
    """Outermost ASGI layer: keeps the server's ``send`` in the scope for :class:`TokenStreamResponse`."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope[RAW_SEND] = send
        await self.app(scope, receive, send)


class TokenStreamResponse(EventSourceResponse):
    """An SSE response whose body iterator yields ready frames (see the module docstring)."""

    def __init__(
        self,
        *args: Any,
        shutdown_grace: float = 0.0,
        on_shutdown: Callable[[str], None] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self._grace = shutdown_grace
        self._on_shutdown = on_shutdown
        self._raw_send: Send | None = None
        self._writes = 0  # frames written so far: the watchdog's clock
        self._sending = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._raw_send = scope.get(RAW_SEND)
        await super().__call__(scope, receive, send)

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
        async with self._send_lock:
            self.active = False
            await raw({"type": "http.response.body", "body": b"", "more_body": False})

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
