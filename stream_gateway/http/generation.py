"""The generation routes: one handler serves every wire format's :class:`~stream_gateway.protocols.Edge`.

Each edge's route (``/v1/chat/completions``, ``/v1/completions``, ``/v1/messages``,
``/v1/responses``) and its session-scoped twin (``/sessions/{session_id}`` + the route) run under
the tenant's limits: its slot is held until the response has ended. The handler parses the body
into the edge's request, opens it into an exchange, then sends what the core produces: a stream
(:meth:`~stream_gateway.completion.CompletionService.stream` decides how it is produced, the edge's
encoder writes the frames) or the edge's body of the collected choices.

The routes are FastAPI's (for the OpenAPI document, and for every request the front door does not
take), but :class:`GenerationFront` answers their requests before FastAPI's middlewares and router:
those cost a request about 0.2 ms before the handler ran (``docs/performance.md``), for nothing
these routes use (no dependencies, no path parameters but the session's, errors rendered by the
same handlers).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from pydantic import BaseModel
from starlette._utils import get_route_path
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from stream_gateway.http._auth import CAPTURE_HEADER, WARNING_HEADER, captured
from stream_gateway.http._body import check_session_id, parse_body, read_body
from stream_gateway.http._render import HeldResponse, ORJSONResponse
from stream_gateway.http._sse import TokenStreamResponse
from stream_gateway.http._state import GatewayState, gateway_state
from stream_gateway.protocols import Call, Edge, SideRoute

__all__ = ["GenerationFront", "generation_bodies", "generation_router"]

log = logging.getLogger(__name__)

SESSION_PREFIX = "/sessions/{session_id}"


def generation_router(edges: Sequence[Edge[Any]]) -> APIRouter:
    """``POST`` routes for every edge and its side routes, each with its session-scoped twin."""
    router = APIRouter()
    for edge in edges:
        route, session_route = _endpoints(edge)
        router.add_api_route(edge.path, route, methods=["POST"], name=edge.name)
        router.add_api_route(SESSION_PREFIX + edge.path, session_route, methods=["POST"], name=f"session_{edge.name}")
        for side in edge.side_routes:
            side_route, side_session_route = _side_endpoints(side)
            name = f"{edge.name}_{side.path.rsplit('/', 1)[-1]}"
            router.add_api_route(side.path, side_route, methods=["POST"], name=name)
            router.add_api_route(
                SESSION_PREFIX + side.path, side_session_route, methods=["POST"], name=f"session_{name}"
            )
    return router


Endpoint = Callable[..., Awaitable[Response]]


def _endpoints(edge: Edge[Any]) -> tuple[Endpoint, Endpoint]:
    # FastAPI reads an endpoint's signature for its parameters: only the request and the path's.
    async def route(request: Request) -> Response:
        return await _limited(request, edge, None)

    async def session_route(request: Request, session_id: str) -> Response:
        return await _limited(request, edge, session_id)

    return route, session_route


def _side_endpoints(side: SideRoute) -> tuple[Endpoint, Endpoint]:
    async def route(request: Request) -> Response:
        return await _side(request, side)

    async def session_route(request: Request, session_id: str) -> Response:
        return await _side(request, side)

    return route, session_route


class GenerationFront:
    """The generation routes' ``POST`` requests (each edge's path and its session-scoped twin)
    served here, before ``app`` (FastAPI's middleware stack and router), which takes every other.

    What FastAPI would do for them is done here: ``scope["app"]``, the edge's handler, and an error
    rendered by the app's exception handlers (looked up by the exception's classes, as Starlette
    does), a failure before the response started included."""

    def __init__(self, app: ASGIApp, gateway: FastAPI, edges: Sequence[Edge[Any]]) -> None:
        self.app = app
        self._gateway = gateway
        self._edges = {edge.path: edge for edge in edges}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            found = self._route(get_route_path(scope))
            if found is not None:
                await self._serve(scope, receive, send, *found)
                return
        await self.app(scope, receive, send)

    def _route(self, path: str) -> tuple[Edge[Any], str | None] | None:
        edge = self._edges.get(path)
        if edge is not None:
            return edge, None
        if path.startswith("/sessions/"):  # SESSION_PREFIX: the id is one path segment, as FastAPI matches it
            session_id, slash, rest = path[len("/sessions/") :].partition("/")
            edge = self._edges.get("/" + rest)
            if session_id and slash and edge is not None:
                return edge, session_id
        return None

    async def _serve(self, scope: Scope, receive: Receive, send: Send, edge: Edge[Any], session_id: str | None) -> None:
        scope["app"] = self._gateway
        request = Request(scope, receive)
        try:
            response = await _limited(request, edge, session_id)
        except Exception as exc:
            response = await self._error(request, exc)
        started = False

        async def sending(message: Message) -> None:
            nonlocal started
            started = True
            await send(message)

        try:
            await response(scope, receive, sending)
        except Exception as exc:
            if started:
                raise  # uvicorn logs it and closes the connection
            await (await self._error(request, exc))(scope, receive, send)

    async def _error(self, request: Request, exc: Exception) -> Response:
        handlers = self._gateway.exception_handlers
        for kind in type(exc).__mro__:
            handler = handlers.get(kind)
            if handler is not None:
                answer = handler(request, exc)
                response: Response = await answer if isinstance(answer, Awaitable) else answer
                return response
        raise exc


def generation_bodies(edges: Sequence[Edge[Any]]) -> dict[str, type[BaseModel]]:
    """The request body each generation route parses, by path (for the OpenAPI document)."""
    bodies: dict[str, type[BaseModel]] = {}
    for edge in edges:
        bodies[edge.path] = bodies[SESSION_PREFIX + edge.path] = edge.request
        for side in edge.side_routes:
            bodies[side.path] = bodies[SESSION_PREFIX + side.path] = side.request
    return bodies


async def _limited(request: Request, edge: Edge[Any], session_id: str | None) -> Response:
    """The edge's response, under the tenant's limits: its slot is held until the response ends."""
    state = gateway_state(request)
    entry = state.auth.entry(request)
    capture, why_not = captured(request, entry)
    release = state.limiter.admit(entry.tenant, entry.limits)
    try:
        call = Call(entry.tenant, session_id, request.headers.get("user-agent"), entry.adapter, capture)
        response = await _generate(request, state, edge, call)
        if why_not is not None:
            state.metrics.uncaptured.labels(why_not).inc()
    except BaseException:
        release()
        raise
    return HeldResponse(response, release)


async def _generate(request: Request, state: GatewayState, edge: Edge[Any], call: Call) -> Response:
    limit = state.settings.max_request_bytes
    if edge.history_field is not None and state.histories is not None:
        body: Any = state.histories.parse(await read_body(request, limit), edge.request, edge.history_field)
    else:
        body = await parse_body(request, edge.request, limit)
    session_id = call.session_id or request.headers.get("x-session-id") or edge.session_id(body) or None
    if session_id is not None:
        check_session_id(session_id)
    exchange = await edge.open(body, replace(call, session_id=session_id))
    batch = exchange.batch
    headers = {"x-session-id": batch[0].session.session_id, CAPTURE_HEADER: "on" if call.captured else "off"}
    if batch[0].warnings:
        headers[WARNING_HEADER] = "; ".join(batch[0].warnings)
    service = state.service
    if exchange.stream:
        start = exchange.start_stream()
        output = service.stream(batch, start.encoder, start.first, start.include_usage)
        settings = state.settings
        return TokenStreamResponse(
            output.writes,
            push=output.push,
            headers=headers,
            data_sender_callable=output.producer,
            ping=settings.sse_ping_seconds,
            send_timeout=settings.sse_send_timeout_seconds,
            shutdown_grace=settings.shutdown_grace_seconds,
            on_shutdown=service.stop_streams,
        )
    results = await service.collect(batch, _disconnect_waiter(request))
    if results is None:  # the client is gone; nobody reads this
        return Response(status_code=499)
    return ORJSONResponse(exchange.body(results), headers=headers)


async def _side(request: Request, side: SideRoute) -> Response:
    state = gateway_state(request)
    tenant = state.auth.tenant(request)
    body = await parse_body(request, side.request, state.settings.max_request_bytes)
    return ORJSONResponse(await side.answer(body, tenant))


def _disconnect_waiter(request: Request) -> Callable[[], Awaitable[None]]:
    """A function that returns once the client of ``request`` has disconnected."""

    async def wait_disconnect() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    return wait_disconnect
