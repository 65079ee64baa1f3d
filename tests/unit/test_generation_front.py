"""The generation routes' front door: which requests it takes from FastAPI's router, and which it
leaves to it. (Its answers are the gateway suites': every generation request goes through it.)"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from fastapi import FastAPI

from stream_gateway.http import GenerationFront

_EDGES: Any = [SimpleNamespace(path="/v1/chat/completions"), SimpleNamespace(path="/v1/messages")]


def _front() -> GenerationFront:
    async def inner(scope: Any, receive: Any, send: Any) -> None:
        raise AssertionError("not for the router")

    return GenerationFront(inner, FastAPI(), _EDGES)


@pytest.mark.parametrize(
    ("path", "edge", "session_id"),
    [
        ("/v1/chat/completions", "/v1/chat/completions", None),
        ("/v1/messages", "/v1/messages", None),
        ("/sessions/run-1/v1/chat/completions", "/v1/chat/completions", "run-1"),
        ("/sessions/a%2Fb/v1/messages", "/v1/messages", "a%2Fb"),
    ],
)
def test_the_routes_it_takes(path: str, edge: str, session_id: str | None) -> None:
    found = _front()._route(path)
    assert found is not None
    assert (found[0].path, found[1]) == (edge, session_id)


@pytest.mark.parametrize(
    "path",
    [
        "/v1/chat/completions/",
        "/v1/models",
        "/sessions/run-1",
        "/sessions//v1/chat/completions",
        "/sessions/a/b/v1/chat/completions",
        "/sessions/run-1/v1/responses",
        "/x/v1/chat/completions",
    ],
)
def test_the_paths_it_leaves_to_the_router(path: str) -> None:
    assert _front()._route(path) is None


@pytest.mark.anyio
@pytest.mark.parametrize(
    "scope",
    [
        {"type": "http", "method": "GET", "path": "/v1/chat/completions", "root_path": ""},
        {"type": "http", "method": "POST", "path": "/v1/models", "root_path": ""},
        {"type": "websocket", "path": "/v1/chat/completions", "root_path": ""},
        {"type": "lifespan"},
    ],
)
async def test_everything_else_goes_on_to_the_app(scope: dict[str, Any]) -> None:
    seen: list[dict[str, Any]] = []

    async def inner(scope: Any, receive: Any, send: Any) -> None:
        seen.append(scope)

    async def nothing() -> Any:
        raise AssertionError

    front = GenerationFront(inner, FastAPI(), _EDGES)
    await front(scope, nothing, nothing)
    assert seen == [scope]
