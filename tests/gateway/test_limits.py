"""Bounded requests: body size (413 before the body is read), messages, tools, and prompts that
cannot fit refused before they are tokenized."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from stream_gateway import Settings
from stream_gateway.engines import build_engine

from ..support.servers import RunningGateway, run_gateway
from .test_conformance import check

LIMIT = 64 * 1024


@pytest.fixture(scope="module")
def small_gateway(tiny_model_path: Path) -> Iterator[RunningGateway]:
    settings = Settings(
        model=str(tiny_model_path),
        served_model_name="tiny",
        max_request_bytes=LIMIT,
        max_messages=8,
        max_model_len=2048,
    )
    with run_gateway(build_engine(settings), settings) as running:
        yield running


def _url(gateway: RunningGateway) -> str:
    return f"{gateway.base_url}/v1/chat/completions"


def _assert_too_large(response: httpx.Response) -> None:
    assert response.status_code == 413, response.text
    body = response.json()
    check(body, "ErrorResponse")
    assert body["error"]["code"] == "request_too_large"
    assert str(LIMIT) in body["error"]["message"]


def test_a_body_over_the_limit_gets_413(small_gateway: RunningGateway) -> None:
    big = {"model": "tiny", "messages": [{"role": "user", "content": "x" * (LIMIT + 1)}]}
    _assert_too_large(httpx.post(_url(small_gateway), json=big, timeout=30))

    # Without a Content-Length (chunked): refused once the bytes read pass the limit.
    def chunks() -> Iterator[bytes]:
        yield b'{"model": "tiny", "messages": [{"role": "user", "content": "'
        for _ in range(64):
            yield b"y" * 4096
        yield b'"}]}'

    _assert_too_large(httpx.post(_url(small_gateway), content=chunks(), timeout=30))
    # ... and the gateway goes on serving.
    ok = httpx.post(
        _url(small_gateway),
        json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        timeout=30,
    )
    assert ok.status_code == 200, ok.text


def test_prompts_that_cannot_fit_are_refused_before_tokenizing(small_gateway: RunningGateway) -> None:
    engine = small_gateway.engine
    context = engine.max_model_len
    longest = max(len(token) for token in engine.tokenizer.get_vocab())
    # Far more characters than the context's tokens could hold: refused on the count alone.
    huge = {"model": "tiny", "messages": [{"role": "user", "content": "z" * (context * longest + 1)}]}
    # Fewer, but still ~1.5 times what the context holds (~2 tokens per 12 characters): refused from
    # the tokens of a prefix, not after rendering and tokenizing it all.
    long = {"model": "tiny", "messages": [{"role": "user", "content": "hello world " * (context * 3 // 4)}]}
    assert context * 4 < len(long["messages"][0]["content"]) < context * longest < LIMIT - 1024  # type: ignore[index]
    for body, says in ((huge, "characters, more than"), (long, "in their first part")):
        response = httpx.post(_url(small_gateway), json=body, timeout=30)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert (error["code"], error["param"]) == ("context_length_exceeded", "messages")
        assert says in error["message"], error
    # Just over the context, in fewer characters than the early checks look at: the exact count.
    near = {"model": "tiny", "messages": [{"role": "user", "content": "a " * (context + 64)}]}
    response = httpx.post(_url(small_gateway), json=near, timeout=30)
    assert response.status_code == 400, response.text
    assert "first part" not in response.json()["error"]["message"]
    assert "in the messages" in response.json()["error"]["message"]


def test_messages_and_tools_are_bounded(small_gateway: RunningGateway) -> None:
    many = [{"role": "user", "content": "hi"}] * 9
    response = httpx.post(_url(small_gateway), json={"model": "tiny", "messages": many}, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages", response.text
    tool = {"type": "function", "function": {"name": "f"}}
    body = {"model": "tiny", "messages": many[:1], "tools": [tool] * 129}
    response = httpx.post(_url(small_gateway), json=body, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == "tools", response.text
