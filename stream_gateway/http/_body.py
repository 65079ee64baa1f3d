"""Reading request bodies and ids: OpenAI's error for every malformed input, and the size bound.

Request bodies are parsed by hand (``orjson`` + ``model_validate``) instead of FastAPI's automatic
body validation, so that every malformed body gets OpenAI's error shape and status (400, with the
offending ``param``) rather than FastAPI's 422. A body over ``--max-request-bytes`` is refused
with 413 before a byte is read when its Content-Length says so (:class:`LengthLimit`), or as soon
as a chunked one passes the bound (:func:`parse_body`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import orjson
from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from stream_gateway._errors import GatewayError, InvalidRequest, RequestTooLarge

__all__ = ["LengthLimit", "check_session_id", "decode_body", "parse_body", "read_body", "validation_error"]

BodyT = TypeVar("BodyT", bound=BaseModel)


class LengthLimit:
    """413 before a byte of the body is read when its Content-Length is over the limit. (Starlette's
    RequestBodyLimitMiddleware, which FastAPI 0.165 offers, answers that case in plain text whatever
    the app's error handlers say.) Chunked bodies are counted as they are read (:func:`parse_body`)."""

    def __init__(self, app: ASGIApp, limit: int, render: Callable[[str, GatewayError], Response]) -> None:
        self.app, self.limit, self.render = app, limit, render

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            for name, value in scope["headers"]:
                if name == b"content-length":
                    if value.isdigit() and int(value) > self.limit:
                        refused = self.render(scope.get("path", ""), RequestTooLarge(self.limit))
                        await refused(scope, receive, send)
                        return
                    break
        await self.app(scope, receive, send)


async def parse_body(request: Request, model: type[BodyT], limit: int | None) -> BodyT:
    """Parse and validate a JSON body, translating every failure into a 400 InvalidRequest."""
    return decode_body(await read_body(request, limit), model)


async def read_body(request: Request, limit: int | None) -> bytes:
    """The body's bytes (over ``limit``: 413 as soon as a chunked one passes it)."""
    if limit is None:
        raw = await request.body()
    else:  # a chunked body has no Content-Length for LengthLimit to check: count it as it comes
        parts, size = [], 0
        async for part in request.stream():
            size += len(part)
            if size > limit:
                raise RequestTooLarge(limit)
            parts.append(part)
        raw = b"".join(parts)
    return raw


def decode_body(raw: bytes, model: type[BodyT]) -> BodyT:
    """``raw`` parsed and validated as ``model``; every failure a 400 InvalidRequest."""
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"We could not parse the JSON body of your request: {exc}") from exc
    if not isinstance(data, dict):
        raise InvalidRequest("The request body must be a JSON object.")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc) from exc


def validation_error(exc: ValidationError) -> InvalidRequest:
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


def check_session_id(session_id: str) -> None:
    """Refuse a session id that is not 1-128 printable ASCII characters."""
    if not (0 < len(session_id) <= 128 and session_id.isascii() and session_id.isprintable()):
        raise InvalidRequest("A session id must be 1-128 printable ASCII characters.", param="session_id")
