"""The HTTP application: OpenAI routes, health and metrics.

Deliberate choices:

* Request bodies are parsed by hand (``orjson`` + ``model_validate``) instead of FastAPI's
  automatic body validation, so that every malformed body gets OpenAI's error shape and status
  (400, with the offending ``param``) rather than FastAPI's 422.
* Every error, including unknown routes and wrong methods, is rendered as
  ``{"error": {"message", "type", "param", "code"}}``.
* The engine belongs to the app's lifespan: it starts before the first request is accepted and
  stops after the last response ended.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import orjson
from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from sse_starlette import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ._api_types import ChatCompletionRequest
from ._completion import CompletionService, ProducerItem
from ._errors import AuthenticationFailed, GatewayError, InvalidRequest
from ._metrics import GatewayMetrics
from ._settings import Settings
from .engines import Engine

log = logging.getLogger(__name__)


class ORJSONResponse(JSONResponse):
    """JSON responses encoded with orjson."""

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


def create_app(engine: Engine, settings: Settings) -> FastAPI:
    """The gateway's ASGI app serving ``engine``; entering its lifespan starts the engine."""
    metrics = GatewayMetrics()
    service = CompletionService(engine, settings, metrics)
    started = int(time.time())

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async with engine:
            log.info("engine %s ready: model %s", engine.name, engine.model_id)
            yield

    app = FastAPI(title="stream-gateway", lifespan=lifespan, docs_url=None, redoc_url=None)

    def authorize(request: Request) -> None:
        if not settings.api_keys:
            return
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or key.strip() not in settings.api_keys:
            raise AuthenticationFailed("Incorrect API key provided.")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        authorize(request)
        body = await _parse(request, ChatCompletionRequest)
        prepared = await service.prepare(body)
        if body.stream:
            send, receive = anyio.create_memory_object_stream[ProducerItem](max_buffer_size=64)

            async def producer() -> None:
                await service.produce(prepared, send)

            return EventSourceResponse(
                service.stream_frames(prepared, receive),
                data_sender_callable=producer,
                ping=settings.sse_ping_seconds,
                send_timeout=settings.sse_send_timeout_seconds,
            )

        async def wait_disconnect() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        result = await service.complete(prepared, wait_disconnect)
        if result is None:  # the client is gone; nobody reads this
            return Response(status_code=499)
        return ORJSONResponse(result)

    @app.get("/v1/models")
    async def list_models(request: Request) -> Response:
        authorize(request)
        model = {
            "id": engine.model_id,
            "object": "model",
            "created": started,
            "owned_by": "stream-gateway",
            "max_model_len": engine.max_model_len,
        }
        return ORJSONResponse({"object": "list", "data": [model]})

    @app.get("/health")
    async def health() -> Response:
        stats = engine.statistics()
        return ORJSONResponse(
            {
                "status": "ok",
                "engine": engine.name,
                "model": engine.model_id,
                "policy_version": engine.policy_version,
                "active_requests": stats.active_requests,
                "waiting_requests": stats.waiting_requests,
                "total_requests": stats.total_requests,
                "total_generated_tokens": stats.total_generated_tokens,
            }
        )

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.exception_handler(GatewayError)
    async def gateway_error(_: Request, exc: GatewayError) -> Response:
        metrics.requests.labels("unknown", str(exc.status_code)).inc()
        return ORJSONResponse(exc.body(), status_code=exc.status_code)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> Response:
        error_type = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        body = {"error": {"message": str(exc.detail), "type": error_type, "param": None, "code": None}}
        return ORJSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> Response:
        return ORJSONResponse(InvalidRequest(str(exc)).body(), status_code=400)

    @app.exception_handler(Exception)
    async def unexpected_error(_: Request, exc: Exception) -> Response:
        log.exception("unhandled error", exc_info=exc)
        body = GatewayError("The server had an error while processing your request.").body()
        return ORJSONResponse(body, status_code=500)

    return app


async def _parse(request: Request, model: type[ChatCompletionRequest]) -> ChatCompletionRequest:
    """Parse and validate a JSON body, translating every failure into a 400 InvalidRequest."""
    raw = await request.body()
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"We could not parse the JSON body of your request: {exc}") from exc
    if not isinstance(data, dict):
        raise InvalidRequest("The request body must be a JSON object.")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise _validation_error(exc) from exc


def _validation_error(exc: ValidationError) -> InvalidRequest:
    """The first validation error as OpenAI words it; ``param`` is the top-level field."""
    first = exc.errors(include_url=False)[0]
    location = first["loc"]
    param = str(location[0]) if location else None
    path = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in location).lstrip(".")
    if first["type"] == "extra_forbidden" and len(location) == 1:
        return InvalidRequest(f"Unrecognized request argument supplied: {param}", param=param)
    if first["type"] == "missing":
        return InvalidRequest(f"Missing required parameter: '{path}'.", param=param)
    message = first["msg"].removeprefix("Value error, ")
    return InvalidRequest(f"Invalid value for '{path}': {message}", param=param)
