"""The shape every wire format has: an :class:`Edge` turns its request into the core's and the
core's output into its frames, whole body or error body.

One generation handler (:mod:`stream_gateway.http`) serves every edge the same way: parse the body
into :attr:`Edge.request`, :meth:`Edge.open` it into an :class:`Exchange` (admitted, placed in a
session, its prompt built), then either stream (:meth:`Exchange.start_stream` gives the encoder
and the first frame; the core produces the rest) or collect the choices and answer
:meth:`Exchange.body`. A request that fails before its response starts is answered with
:meth:`Edge.error_body`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from pydantic import BaseModel

from stream_gateway._errors import GatewayError
from stream_gateway.completion import ChoiceResult, CompletionService, FrameEncoder, PreparedCompletion

__all__ = ["Call", "Edge", "EdgeBase", "Exchange", "SideRoute", "StreamStart"]

BodyT = TypeVar("BodyT", bound=BaseModel, contravariant=True)


@dataclass(frozen=True, slots=True)
class Call:
    """What the HTTP layer knows of a request besides its body: who asks, and in which session."""

    tenant: str
    session_id: str | None  # from the session URL or the ``x-session-id`` header (already checked)
    agent: str | None  # the User-Agent
    adapter: str | None = None  # the LoRA adapter the caller's key is bound to (docs/adapters.md)
    captured: bool = True  # False: the caller did not consent to capture (docs/data-rights.md)

    def placement(self) -> dict[str, Any]:
        """What the core's ``prepare`` and ``prepare_tokens`` take of the call, as keyword arguments."""
        return {
            "tenant": self.tenant,
            "session_id": self.session_id,
            "agent": self.agent,
            "adapter": self.adapter,
            "captured": self.captured,
        }


@dataclass(frozen=True, slots=True)
class StreamStart:
    """How a streamed response begins: its encoder, the frame sent before any token, and whether
    the last write carries usage."""

    encoder: FrameEncoder
    first: bytes | None
    include_usage: bool


class Exchange(Protocol):
    """One admitted request of one wire format: its prepared choices and how their output is encoded."""

    @property
    def batch(self) -> Sequence[PreparedCompletion]:
        """The prepared completions (one per prompt) whose choices the core runs."""
        ...

    @property
    def stream(self) -> bool:
        """Whether the client asked for a stream."""
        ...

    def start_stream(self) -> StreamStart:
        """The encoder and first frame of a streamed response."""
        ...

    def body(self, results: list[ChoiceResult]) -> dict[str, Any]:
        """The whole (non-streamed) response body from the finished choices."""
        ...


@dataclass(frozen=True, slots=True)
class SideRoute:
    """A route of a wire format that does not generate (Anthropic's ``count_tokens``): its body
    type, and what answers it for a tenant."""

    path: str
    request: type[BaseModel]
    answer: Callable[[Any, str], Awaitable[dict[str, Any]]]


class Edge(Protocol[BodyT]):
    """One wire format at the gateway's edge."""

    path: str  # its generation route, e.g. ``/v1/chat/completions`` (also served under ``/sessions/{id}``)
    name: str  # the route's name
    request: type[BaseModel]  # the body it parses
    # The body's top-level array that a continuation repeats (``messages``, ``input``; None: none):
    # read through the kept histories (completion/_history.py, _kept.py), a next turn reads what it adds.
    history_field: str | None

    @property
    def side_routes(self) -> Sequence[SideRoute]:
        """Other routes of the same format."""
        ...

    def session_id(self, body: BodyT) -> str | None:
        """A session named inside the body, for formats that have one (vLLM's ``session_id``)."""
        ...

    async def open(self, body: BodyT, call: Call) -> Exchange:
        """Admit ``body``: validate it, translate it for the core, and prepare its choices."""
        ...

    def error_body(self, error: GatewayError) -> dict[str, Any]:
        """The error as this format's clients expect it."""
        ...


class EdgeBase:
    """What most edges share: the core they prepare through, no side routes, no session named in
    the body, OpenAI's error shape. An edge overrides what differs."""

    side_routes: Sequence[SideRoute] = ()
    history_field: str | None = None

    def __init__(self, service: CompletionService) -> None:
        self._service = service

    def session_id(self, body: Any) -> str | None:
        return None

    @staticmethod
    def error_body(error: GatewayError) -> dict[str, Any]:
        return error.body()
