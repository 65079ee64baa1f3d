"""Bad input gets OpenAI's error body with the right status: never a 500, never a hung stream."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI

from stream_gateway import Settings
from stream_gateway.engines import build_engine

from ..support.servers import RunningGateway, run_gateway

USER = [{"role": "user", "content": "hello"}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


def _post(gateway: RunningGateway, body: Any, **kwargs: Any) -> httpx.Response:
    return httpx.post(gateway.base_url + "/v1/chat/completions", timeout=30, **kwargs, json=body)


def _assert_error(response: httpx.Response, status: int, *, code: str | None = None, param: str | None = None) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if code is not None:
        assert error["code"] == code
    if param is not None:
        assert error["param"] == param


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("body", "status", "code", "param"),
    [
        ({"messages": USER}, 400, None, "model"),
        ({"model": "tiny"}, 400, None, "messages"),
        ({"model": "tiny", "messages": []}, 400, None, "messages"),
        ({"model": "tiny", "messages": "hello"}, 400, None, "messages"),
        ({"model": "tiny", "messages": [{"role": "wizard", "content": "hi"}]}, 400, None, None),
        ({"model": "tiny", "messages": [{"content": "hi"}]}, 400, None, None),
        ({"model": "tiny", "messages": [{"role": "user"}]}, 400, None, None),
        ({"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, None, None),
        ({"model": "nope", "messages": USER}, 404, "model_not_found", "model"),
        ({"model": "tiny", "messages": USER, "max_tokens": 0}, 400, None, "max_tokens"),
        ({"model": "tiny", "messages": USER, "max_tokens": 10**12}, 400, "context_length_exceeded", "max_tokens"),
        ({"model": "tiny", "messages": USER, "max_completion_tokens": -5}, 400, None, "max_completion_tokens"),
        ({"model": "tiny", "messages": USER, "temperature": 3}, 400, None, "temperature"),
        ({"model": "tiny", "messages": USER, "top_p": 0}, 400, None, "top_p"),
        ({"model": "tiny", "messages": USER, "n": 0}, 400, None, "n"),
        ({"model": "tiny", "messages": USER, "n": 1000}, 400, None, "n"),
        ({"model": "tiny", "messages": USER, "top_logprobs": 3}, 400, None, "top_logprobs"),
        ({"model": "tiny", "messages": USER, "logprobs": True, "top_logprobs": 50}, 400, None, "top_logprobs"),
        ({"model": "tiny", "messages": USER, "presence_penalty": 0.5}, 400, "unsupported_parameter", None),
        ({"model": "tiny", "messages": USER, "logit_bias": {"5": 1}}, 400, "unsupported_parameter", None),
        (
            {"model": "tiny", "messages": USER, "response_format": {"type": "xml"}},
            400,
            None,
            "response_format",
        ),
        ({"model": "tiny", "messages": USER, "tool_choice": "auto"}, 400, None, "tool_choice"),
        (
            {
                "model": "tiny",
                "messages": USER,
                "tools": TOOLS,
                "tool_choice": {"type": "function", "function": {"name": "not_offered"}},
            },
            400,
            None,
            "tool_choice",
        ),
        (
            {
                "model": "tiny",
                "messages": USER,
                "tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}],
            },
            400,
            None,
            "tools",
        ),
        ({"model": "tiny", "messages": USER, "tools": [{"type": "retrieval"}]}, 400, None, "tools"),
        ({"model": "tiny", "messages": USER, "frobnicate": True}, 400, None, "frobnicate"),
        ({"model": "tiny", "messages": USER, "stop": ["a"] * 40}, 400, None, "stop"),
        (
            {"model": "tiny", "messages": USER, "tools": [{"type": "function", "function": {"name": "bad name!"}}]},
            400,
            None,
            None,
        ),
    ],
)
def test_bad_requests_get_openai_errors(
    gateway: RunningGateway, body: dict[str, Any], status: int, code: str | None, param: str | None, stream: bool
) -> None:
    _assert_error(_post(gateway, {**body, "stream": stream}), status, code=code, param=param)


def test_stream_options_without_stream(gateway: RunningGateway) -> None:
    body = {"model": "tiny", "messages": USER, "stream_options": {"include_usage": True}}
    _assert_error(_post(gateway, body), 400, param="stream_options")


@pytest.mark.parametrize("raw", [b"{not json", b"", b"[1, 2]", b'"text"', b"\xff\xfe"])
def test_malformed_json(gateway: RunningGateway, raw: bytes) -> None:
    response = httpx.post(
        gateway.base_url + "/v1/chat/completions", content=raw, headers={"content-type": "application/json"}, timeout=30
    )
    _assert_error(response, 400)


def test_unknown_route_and_method(gateway: RunningGateway) -> None:
    _assert_error(httpx.get(gateway.base_url + "/v1/nothing", timeout=10), 404)
    _assert_error(httpx.get(gateway.base_url + "/v1/chat/completions", timeout=10), 405)


def test_openai_client_raises_typed_errors(client: OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as not_found:
        client.chat.completions.create(model="missing", messages=USER)
    assert not_found.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="tiny", messages=USER, max_tokens=10**9, stream=True)
    assert bad.value.code == "context_length_exceeded"


@pytest.fixture(scope="module")
def short_context_gateway(tiny_model_path: Path) -> Iterator[RunningGateway]:
    """The tiny model capped at 64 tokens of context, to overflow it cheaply."""
    settings = Settings(model=str(tiny_model_path), served_model_name="tiny", max_model_len=64, api_keys=("sk-good",))
    with run_gateway(build_engine(settings), settings) as running:
        yield running


def test_prompt_longer_than_the_context(short_context_gateway: RunningGateway) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "word " * 200}]}
    response = _post(short_context_gateway, body, headers={"authorization": "Bearer sk-good"})
    _assert_error(response, 400, code="context_length_exceeded", param="messages")


def test_generation_stops_at_the_context_limit(short_context_gateway: RunningGateway) -> None:
    with OpenAI(base_url=short_context_gateway.base_url + "/v1", api_key="sk-good", max_retries=0) as c:
        reply = c.chat.completions.create(model="tiny", messages=USER, extra_body={"ignore_eos": True})
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage is not None and reply.usage.total_tokens == 64


def test_api_keys_are_enforced_when_configured(short_context_gateway: RunningGateway) -> None:
    response = _post(
        short_context_gateway, {"model": "tiny", "messages": USER}, headers={"authorization": "Bearer sk-bad"}
    )
    _assert_error(response, 401, code="invalid_api_key")
    with (
        OpenAI(base_url=short_context_gateway.base_url + "/v1", api_key="sk-bad", max_retries=0) as c,
        pytest.raises(openai.AuthenticationError),
    ):
        c.models.list()
