"""Rendering answers: JSON with orjson, every error in the shape its route's clients expect.

Every error, including unknown routes, wrong methods and unexpected exceptions, is rendered as an
error body: OpenAI's ``{"error": {"message", "type", "param", "code"}}`` by default, or the shape
of the wire format whose routes it happened on (Anthropic's on the Messages routes); the formats
register their shapes by path (:class:`ErrorShapes`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from stream_gateway._errors import GatewayError, HTTPError, InvalidRequest
from stream_gateway._metrics import GatewayMetrics

__all__ = ["ErrorShapes", "HTTPError", "HeldResponse", "ORJSONResponse", "install_error_handlers"]

log = logging.getLogger(__name__)

ErrorBody = Callable[[GatewayError], dict[str, Any]]


class ORJSONResponse(JSONResponse):
    """JSON responses encoded with orjson."""

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


class HeldResponse(Response):
    """``inner``, then ``release`` once it has been sent (or failed, or the client left)."""

    def __init__(self, inner: Response, release: Callable[[], None]) -> None:
        self.inner, self.release = inner, release
        self.status_code = inner.status_code
        self.raw_headers = inner.raw_headers
        self.background = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.inner(scope, receive, send)
        finally:
            self.release()


class ErrorShapes:
    """Which error body each route's clients expect, by the route's path (session twins included)."""

    def __init__(self) -> None:
        self._by_suffix: list[tuple[str, ErrorBody]] = []

    def register(self, path: str, body: ErrorBody) -> None:
        """Errors on ``path`` (and ``/sessions/{id}`` + ``path``) take ``body``'s shape."""
        self._by_suffix.append((path, body))

    def body(self, path: str, error: GatewayError) -> dict[str, Any]:
        """The body of ``error`` on ``path``: a registered shape, or OpenAI's."""
        for suffix, body in self._by_suffix:
            if path.endswith(suffix):
                return body(error)
        return error.body()

    def response(self, path: str, error: GatewayError, headers: dict[str, str] | None = None) -> Response:
        """The error response for ``error`` on ``path``."""
        return ORJSONResponse(self.body(path, error), status_code=error.status_code, headers=headers)


def install_error_handlers(app: FastAPI, shapes: ErrorShapes, metrics: GatewayMetrics) -> None:
    """Render every error of ``app`` as an error body of its route's shape."""

    async def gateway_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, GatewayError)
        metrics.requests.labels("unknown", str(exc.status_code)).inc()
        return shapes.response(request.url.path, exc, exc.headers)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        error = HTTPError(exc.status_code, str(exc.detail))
        body = shapes.body(request.url.path, error)
        return ORJSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    async def validation_error(request: Request, exc: Exception) -> Response:
        return shapes.response(request.url.path, InvalidRequest(str(exc)))

    async def unexpected_error(_: Request, exc: Exception) -> Response:
        log.exception("unhandled error", exc_info=exc)
        body = GatewayError("The server had an error while processing your request.").body()
        return ORJSONResponse(body, status_code=500)

    app.add_exception_handler(GatewayError, gateway_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(Exception, unexpected_error)
