"""The wire formats at the gateway's edge, each the same shape (an :class:`Edge`).

* :mod:`._chat`: OpenAI chat completions (``/v1/chat/completions``), the core's own shape.
* :mod:`._anthropic`: Anthropic's Messages API (``/v1/messages``, ``count_tokens``).
* :mod:`._responses`: OpenAI's Responses API (``/v1/responses``).
* :mod:`._token_in`: vLLM's token-in ``/v1/completions``.

A new wire format is a new module with an :class:`Edge` (its request model, ``open`` into the
core's request, its frame encoder, whole body and error body) added to :func:`edges`; the HTTP
layer serves it, session-scoped twin and OpenAPI schema included, with no other change.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from stream_gateway.protocols._anthropic import MessagesEdge
from stream_gateway.protocols._chat import ChatEdge
from stream_gateway.protocols._edge import Call, Edge, EdgeBase, Exchange, SideRoute, StreamStart
from stream_gateway.protocols._responses import ResponsesEdge
from stream_gateway.protocols._token_in import TokenInEdge

if TYPE_CHECKING:
    from stream_gateway.completion import CompletionService

__all__ = [
    "Call",
    "ChatEdge",
    "Edge",
    "EdgeBase",
    "Exchange",
    "MessagesEdge",
    "ResponsesEdge",
    "SideRoute",
    "StreamStart",
    "TokenInEdge",
    "edges",
]


def edges(service: CompletionService) -> list[Edge]:  # type: ignore[type-arg]
    """Every wire format the gateway serves, over one completion service."""
    return [ChatEdge(service), TokenInEdge(service), MessagesEdge(service), ResponsesEdge(service)]
