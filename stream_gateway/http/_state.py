"""What the routers serve with: the process's services, typed, on ``app.state.gateway``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from stream_gateway._metrics import GatewayMetrics
from stream_gateway._settings import Settings
from stream_gateway.capture import EventRecorder
from stream_gateway.completion import CompletionService, Histories
from stream_gateway.control import PolicyApplier, RateLimiter
from stream_gateway.engines import Engine
from stream_gateway.http._auth import Authorizer
from stream_gateway.protocols import Edge
from stream_gateway.sessions import SessionDirectory

__all__ = ["GatewayState", "gateway_state"]


@dataclass(frozen=True, slots=True)
class GatewayState:
    """The services one gateway process serves its routes with (built by ``create_app``)."""

    settings: Settings
    engine: Engine
    metrics: GatewayMetrics
    recorder: EventRecorder
    sessions: SessionDirectory
    service: CompletionService
    edges: Sequence[Edge[Any]]
    auth: Authorizer
    limiter: RateLimiter
    applier: PolicyApplier
    replica: str  # this process's name in policy events and /health
    started: int  # unix time: ``created`` of /v1/models
    histories: Histories | None = None  # chat bodies read in proportion to what they add (completion/_history.py)


def gateway_state(request: Request) -> GatewayState:
    """The services of the app serving ``request``."""
    state: GatewayState = request.app.state.gateway
    return state
