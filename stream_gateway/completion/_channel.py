"""The per-token path from a choice's producer to the socket: an update channel and a lean SSE response.

A response's producers (one task per choice) put :class:`ChoiceUpdate` objects into an
:class:`UpdateChannel`; the response's writer takes *everything* waiting at once, merges what
belongs to one choice (:func:`coalesce`) and writes it as one frame per choice, all in one write.
When the client keeps up, the writer is waiting before the next engine step arrives, so every
token is its own chunk; when the client falls behind (the socket's send buffer is full and the
write waits) or the event loop is saturated, the tokens that gathered meanwhile go out together as
one chunk: never dropped, never reordered, ``token_ids`` and logprobs exactly those of the tokens
in the chunk. It is vLLM's ``--stream-interval`` made adaptive: the interval is however long the
last write took.

Deliberate divergences, in the manner of sse-starlette's own docstring:

1. :class:`UpdateChannel` is not an anyio memory object stream. ``put`` never blocks and never
   checkpoints: the pending list is bounded by the turn's ``max_tokens`` (the producer keeps every
   token for the record anyway), and a client that stops reading is cut off by the send timeout.
   An anyio stream costs a checkpoint per send, a task lookup and a generic-alias instantiation
   per blocking receive (anyio 4.16), a fifth of the gateway's CPU per token when measured.
   The wake-up is a bare asyncio future: the gateway runs on asyncio (uvicorn) only.
2. :class:`TokenStreamResponse` keeps sse-starlette's ``EventSourceResponse`` (3.7.0, read) for
   headers, HEAD, the disconnect listener, the shutdown watcher and the task group, and replaces
   two of its methods: ``_stream_response`` writes body frames with the server's own ``send``
   (the ASGI callable uvicorn gave the app, kept by :class:`RawSendApp` in the scope) instead of
   through five middleware wrappers, and without a cancel scope per frame; ``_ping`` becomes a
   watchdog that ticks once a second, sends the keep-alive comment when nothing was written for
   ``ping`` seconds, and raises ``SendTimeoutError`` when one write has waited ``send_timeout``
   seconds (sse-starlette wraps every send in ``move_on_after`` for that). The response start
   still goes through the middlewares, so they know the response has started.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

import anyio
from sse_starlette import EventSourceResponse
from sse_starlette.sse import SendTimeoutError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from stream_gateway.protocols._chat import ChoiceUpdate
from stream_gateway._errors import GatewayError
from stream_gateway.tool_parsers import ToolCallDelta

log = logging.getLogger(__name__)

RAW_SEND = "stream_gateway.raw_send"
"""The scope key under which :class:`RawSendApp` keeps the server's ``send``."""

_WATCHDOG_TICK_S = 1.0

ChannelItem = ChoiceUpdate | GatewayError


class UpdateChannel:
    """Carries one response's updates from its producers to its writer; the writer takes all that waits."""

    __slots__ = ("_closed", "_items", "_waiter")

    def __init__(self) -> None:
        self._items: list[ChannelItem] = []
        self._waiter: asyncio.Future[None] | None = None
        self._closed = False

    def put(self, item: ChannelItem) -> None:
        """Add an update (or the error that ends the response); never blocks."""
        self._items.append(item)
        self._wake()

    def close(self) -> None:
        """No more updates: the writer ends once it has taken what is left."""
        self._closed = True
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    async def take(self) -> list[ChannelItem] | None:
        """Everything put since the last take, waiting for at least one item; ``None`` once closed and empty."""
        while not self._items:
            if self._closed:
                return None
            self._waiter = waiter = asyncio.get_running_loop().create_future()
            await waiter
        items, self._items = self._items, []
        return items


def coalesce(items: Sequence[ChannelItem]) -> list[ChannelItem]:
    """Merge the updates of each choice into one, in order; an error stays last.

    Merged: text and ids and logprobs concatenated, the finish reason and version spans of the
    last, and tool-call deltas folded so that each call appears at most once (its id and name with
    the first argument fragment): a client that parses each entry on its own sees no phantom call.
    """
    if len(items) == 1:
        item = items[0]
        if isinstance(item, GatewayError) or len(item.tool_calls) < 2:
            return [item]
    merged: dict[int, ChoiceUpdate] = {}
    error: GatewayError | None = None
    for item in items:
        if isinstance(item, GatewayError):
            error = item
            break
        into = merged.get(item.index)
        if into is None:
            merged[item.index] = ChoiceUpdate(
                item.index,
                item.text,
                list(item.token_ids),
                list(item.logprobs),
                list(item.top_logprobs) if item.top_logprobs is not None else None,
                item.finish_reason,
                item.tool_calls,
                item.version_spans,
                item.stop_sequence,
            )
            continue
        into.text += item.text
        into.token_ids.extend(item.token_ids)
        into.logprobs.extend(item.logprobs)
        if into.top_logprobs is not None and item.top_logprobs is not None:
            into.top_logprobs.extend(item.top_logprobs)
        into.finish_reason = item.finish_reason
        into.tool_calls += item.tool_calls
        if item.version_spans is not None:
            into.version_spans = item.version_spans
        into.stop_sequence = item.stop_sequence or into.stop_sequence
    out: list[ChannelItem] = []
    for update in merged.values():
        if len(update.tool_calls) > 1:
            update.tool_calls = fold_tool_calls(update.tool_calls)
        out.append(update)
    if error is not None:
        out.append(error)
    return out


def fold_tool_calls(deltas: Sequence[ToolCallDelta]) -> tuple[ToolCallDelta, ...]:
    """One entry per call: a call's fragments joined, its id and name kept from its first entry."""
    folded: dict[int, ToolCallDelta] = {}
    for delta in deltas:
        seen = folded.get(delta.index)
        if seen is None:
            folded[delta.index] = delta
        else:
            folded[delta.index] = ToolCallDelta(
                delta.index, seen.id or delta.id, seen.name or delta.name, seen.arguments + delta.arguments
            )
    return tuple(folded.values())


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

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._raw_send: Send | None = None
        self._writes = 0  # frames written so far: the watchdog's clock
        self._sending = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._raw_send = scope.get(RAW_SEND)
        await super().__call__(scope, receive, send)

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
