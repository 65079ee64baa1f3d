"""The update channel: from the producers of a response with several choices to its writer.

A one-choice stream (every agent's request) does not use it: it is produced in the response's own
task (:meth:`~stream_gateway.completion.CompletionService.stream`). With several choices (``n >
1``, or several prompts), and for a whole response, the producers (one task per choice) put
:class:`ChoiceUpdate` objects into an :class:`UpdateChannel`; the response's writer takes
*everything* waiting at once, merges what belongs to one choice (:func:`coalesce`) and writes it as
one frame per choice, all in one write. When the client keeps up, the writer is waiting before the
next engine step arrives, so every token is its own chunk; when the client falls behind (the
socket's send buffer is full and the write waits) or the event loop is saturated, the tokens that
gathered meanwhile go out together as one chunk: never dropped, never reordered, ``token_ids`` and
logprobs exactly those of the tokens in the chunk. It is vLLM's ``--stream-interval`` made
adaptive: the interval is however long the last write took.

Deliberate choice: :class:`UpdateChannel` is not an anyio memory object stream. ``put`` never blocks and never
   checkpoints: the pending list is bounded by the turn's ``max_tokens`` (the producer keeps every
   token for the record anyway), and a client that stops reading is cut off by the send timeout.
   An anyio stream costs a checkpoint per send, a task lookup and a generic-alias instantiation
   per blocking receive (anyio 4.16), a fifth of the gateway's CPU per token when measured.
   The wake-up is a bare asyncio future: the gateway runs on asyncio (uvicorn) only.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from stream_gateway._errors import GatewayError
from stream_gateway.completion._updates import ChoiceUpdate
from stream_gateway.tool_parsers import ToolCallDelta

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

    Merged: thinking, text, ids and logprobs concatenated; the finish reason, version spans,
    thinking span and routes of the last; and tool-call deltas folded so that each call appears at
    most once (its id and name with the first argument fragment): a client that parses each entry
    on its own sees no phantom call.
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
                item.reasoning,
                item.reasoning_tokens,
                item.answer_start,
                item.routes,
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
        into.reasoning += item.reasoning
        into.reasoning_tokens, into.answer_start = item.reasoning_tokens, item.answer_start
        if item.routes is not None:
            into.routes = item.routes
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
